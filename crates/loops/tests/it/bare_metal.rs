//! The bare-metal loop against scripted BMCs (design.md §21): each fault that sushy-tools cannot
//! make, asserted from the BMDB's history and the BMC's log of what it was asked. A BMC
//! without virtual media fails its machine once; a BMC that cannot fetch the image, answers
//! 5xx or hangs backs its machine off with its answer; a live environment that never answers
//! is powered off, ejected and booted again, then given up on; a failed installation and an
//! installed OS that never heartbeats fail the machine with their cause; an eject that fails is
//! tried again; and a replica killed at each BMC step leaves the next replica nothing to do
//! twice. The machine's side (its initializer's takeover, its agent's report and heartbeat) is
//! played by the test from what the BMC did.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use shepherd_bmdb::testing::{self, TestDb};
use shepherd_bmdb::*;
use shepherd_loops::bare_metal::{BareMetalLoop, BareSettings};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_proto::bmaas as proto;
use shepherd_proto::{Message, LIVE_PROOF_VAR};
use shepherd_provider::static_provider::StaticProvider;
use shepherd_provider::{Availability, Provider as _, ProviderMachine};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// What the scripted BMC does besides working.
#[derive(Debug, Clone, Default)]
struct Knobs {
    /// It offers no virtual media at all.
    no_virtual_media: bool,
    /// Requests of these actions get this status and body (`insert`, `eject`, `boot`,
    /// `power`, `read`).
    fail: Vec<(&'static str, u16, &'static str)>,
    /// The `n`th request of this action (`insert`, `eject`, `boot`, `power`) is carried out
    /// and never answered.
    hang_at: Option<(&'static str, usize)>,
    /// Its CD says nothing of `Inserted` (the property is optional in Redfish's schema).
    omits_inserted: bool,
    /// Its CD holds this image at the start, left by someone else.
    stale_image: Option<&'static str>,
    /// It answers an insert with success, and its CD never shows the image (it could not
    /// fetch it).
    insert_not_shown: bool,
    /// The boot mode its system shows at the start (`BootSourceOverrideMode`); none, if
    /// `None`.
    shows_mode: Option<&'static str>,
    /// The inventory entry's `BootMode`.
    entry_boot_mode: Option<&'static str>,
    /// The `Retry-After` its scripted failures carry, in seconds.
    retry_after: Option<u64>,
}

/// The scripted BMC's system: power, virtual CD, boot override, what it booted from, and a
/// log of every action carried out.
#[derive(Debug, Default)]
struct Bmc {
    power_on: bool,
    image: Option<String>,
    /// The boot override: its target, and whether it lasts (`Continuous`) or is used up by
    /// the next boot (`Once`).
    boot: Option<String>,
    boot_lasts: bool,
    /// The boot mode it shows.
    mode: Option<String>,
    booted_from: Option<&'static str>,
    log: Vec<String>,
    knobs: Knobs,
}

type Shared = Arc<Mutex<Bmc>>;

const SYSTEM: &str = "/redfish/v1/Systems/1";
const CD: &str = "/redfish/v1/Systems/1/VirtualMedia/Cd";

impl Bmc {
    /// The failure scripted for `action`, if any.
    fn failure(&self, action: &str) -> Option<(StatusCode, String)> {
        let (_, status, body) = self.knobs.fail.iter().find(|f| f.0 == action)?;
        Some((StatusCode::from_u16(*status).unwrap(), body.to_string()))
    }

    /// Powers on: the system boots from its CD when it holds an image and the boot override
    /// says so, from its disk when the override says so, else from the network (the firmware's
    /// own order, as a server's that PXE-boots first). A one-time override is used up.
    fn boot(&mut self) {
        self.power_on = true;
        self.booted_from = Some(match self.boot.as_deref() {
            Some("Cd") if self.image.is_some() => "Cd",
            Some("Hdd") => "Hdd",
            _ => "Pxe",
        });
        if !self.boot_lasts {
            self.boot = None;
        }
    }
}

/// Carries out `action` unless it is scripted to fail; then hangs if it is scripted to.
async fn act(bmc: &Shared, action: &'static str, apply: impl FnOnce(&mut Bmc)) -> Response {
    let hang = {
        let mut b = bmc.lock().unwrap();
        if let Some(failure) = b.failure(action) {
            return match b.knobs.retry_after {
                Some(wait) => {
                    (failure.0, [("Retry-After", wait.to_string())], failure.1).into_response()
                }
                None => failure.into_response(),
            };
        }
        apply(&mut b);
        let done = b.log.iter().filter(|l| l.starts_with(action)).count();
        b.knobs.hang_at == Some((action, done))
    };
    if hang {
        std::future::pending::<()>().await;
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn system(State(bmc): State<Shared>) -> (StatusCode, Json<Value>) {
    let b = bmc.lock().unwrap();
    if let Some((status, body)) = b.failure("read") {
        return (status, Json(json!({ "error": body })));
    }
    let mut system = json!({
        "PowerState": if b.power_on { "On" } else { "Off" },
        "Actions": {"#ComputerSystem.Reset": {
            "target": format!("{SYSTEM}/Actions/ComputerSystem.Reset"),
            "ResetType@Redfish.AllowableValues": ["On", "ForceOff", "ForceRestart"],
        }},
    });
    if !b.knobs.no_virtual_media {
        system["VirtualMedia"] = json!({ "@odata.id": format!("{SYSTEM}/VirtualMedia") });
    }
    if let Some(mode) = &b.mode {
        system["Boot"] = json!({ "BootSourceOverrideMode": mode });
    }
    (StatusCode::OK, Json(system))
}

async fn media_collection() -> Json<Value> {
    Json(json!({ "Members": [{ "@odata.id": CD }] }))
}

async fn cd(State(bmc): State<Shared>) -> Json<Value> {
    let b = bmc.lock().unwrap();
    let mut cd = json!({
        "MediaTypes": ["CD", "DVD"],
        "Image": b.image.clone().unwrap_or_default(),
        "Inserted": b.image.is_some(),
        "Actions": {
            "#VirtualMedia.InsertMedia": { "target": format!("{CD}/Actions/VirtualMedia.InsertMedia") },
            "#VirtualMedia.EjectMedia": { "target": format!("{CD}/Actions/VirtualMedia.EjectMedia") },
        },
    });
    if b.knobs.omits_inserted {
        cd.as_object_mut().unwrap().remove("Inserted");
    }
    Json(cd)
}

async fn insert(State(bmc): State<Shared>, Json(body): Json<Value>) -> Response {
    let url = body["Image"].as_str().unwrap_or_default().to_string();
    act(&bmc, "insert", |b| {
        b.log.push("insert".into());
        if !b.knobs.insert_not_shown {
            b.image = Some(url);
        }
    })
    .await
}

async fn eject(State(bmc): State<Shared>) -> Response {
    act(&bmc, "eject", |b| {
        b.log.push("eject".into());
        b.image = None;
    })
    .await
}

async fn patch(State(bmc): State<Shared>, Json(body): Json<Value>) -> Response {
    let target = body["Boot"]["BootSourceOverrideTarget"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let lasts = body["Boot"]["BootSourceOverrideEnabled"] == "Continuous";
    let mode = body["Boot"]["BootSourceOverrideMode"]
        .as_str()
        .map(String::from);
    act(&bmc, "boot", |b| {
        match &mode {
            Some(mode) => b.log.push(format!("boot {target} in {mode}")),
            None => b.log.push(format!("boot {target}")),
        }
        b.boot = Some(target);
        b.boot_lasts = lasts;
        b.mode = mode.or(b.mode.take());
    })
    .await
}

async fn reset(State(bmc): State<Shared>, Json(body): Json<Value>) -> Response {
    let reset = body["ResetType"].as_str().unwrap_or_default().to_string();
    act(&bmc, "power", |b| {
        b.log.push(format!("power {reset}"));
        match reset.as_str() {
            "ForceOff" => {
                b.power_on = false;
                b.booted_from = None;
            }
            _ => b.boot(),
        }
    })
    .await
}

/// Starts a scripted BMC with `knobs` on a free loopback port; its URL and state.
async fn start_bmc(knobs: Knobs) -> (String, Shared) {
    let bmc: Shared = Arc::new(Mutex::new(Bmc {
        image: knobs.stale_image.map(String::from),
        mode: knobs.shows_mode.map(String::from),
        knobs,
        ..Bmc::default()
    }));
    let app = Router::new()
        .route(SYSTEM, get(system).patch(patch))
        .route(
            &format!("{SYSTEM}/Actions/ComputerSystem.Reset"),
            post(reset),
        )
        .route(&format!("{SYSTEM}/VirtualMedia"), get(media_collection))
        .route(CD, get(cd))
        .route(
            &format!("{CD}/Actions/VirtualMedia.InsertMedia"),
            post(insert),
        )
        .route(
            &format!("{CD}/Actions/VirtualMedia.EjectMedia"),
            post(eject),
        )
        .with_state(bmc.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, bmc)
}

/// How the machine behind the BMC behaves.
#[derive(Debug, Clone, Copy)]
struct Machine {
    /// Its live environment is taken over once it booted from the CD.
    live_answers: bool,
    /// What answers once it booted "from the CD" is its installed OS (the CD boot fell
    /// through): its agent shows no live proof.
    falls_through: bool,
    /// Its agent's report: `None` a success, else this error.
    install_error: Option<&'static str>,
    /// Its first installations fail for the image's server (the first after writing part of
    /// the disk), then it installs.
    image_server_fails: i64,
    /// Its installed OS heartbeats once it booted from its disk.
    installed_heartbeats: bool,
}

const WORKING: Machine = Machine {
    live_answers: true,
    falls_through: false,
    install_error: None,
    image_server_fails: 0,
    installed_heartbeats: true,
};

/// A machine whose live environment never answers.
const LIVE_SILENT: Machine = Machine {
    live_answers: false,
    falls_through: false,
    ..WORKING
};

/// A machine whose installed OS never heartbeats.
const INSTALLED_SILENT: Machine = Machine {
    installed_heartbeats: false,
    ..WORKING
};

/// One bare machine of a static inventory whose BMC is scripted: the BMDB, the provider, the
/// machine's id, its BMC, and the installation requests it carried out.
struct Site {
    t: TestDb,
    provider: Arc<StaticProvider>,
    machine: Uuid,
    bmc: Shared,
    installed: Arc<Mutex<Vec<proto::ImageInstallationRequest>>>,
    _dir: tempfile::TempDir,
}

/// The loop's settings for these tests: short waits, two live boots.
fn settings(live_boot: Duration) -> BareSettings {
    let mut s = BareSettings::new(
        "https://media.test:8443".parse().unwrap(),
        vec!["ssh-ed25519 AAAA shepherd".into()],
    );
    s.timeouts = BareTimeouts {
        live_boot,
        install: Duration::from_secs(30),
        disk_boot: Duration::from_secs(3),
    };
    s.live_boot_attempts = 2;
    s.backoff = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(1), 1.0);
    s.boot_wait = Duration::ZERO;
    s
}

/// The root device hints a real agent's report names the machine's disk by: its serial and
/// WWN.
const CHOSEN_DISK: &str = r#"{"serial":"s== S3YJNX0K","wwn":"s== 0x5002538e40a1b2c3"}"#;

/// A site with one machine whose BMC behaves as `knobs` say, recorded bare.
async fn site(knobs: Knobs) -> Site {
    let t = testing::sqlite().await;
    let dir = tempfile::tempdir().unwrap();
    let boot_mode = knobs.entry_boot_mode;
    let (url, bmc) = start_bmc(knobs).await;
    let password = dir.path().join("bmc-password");
    std::fs::write(&password, "x\n").unwrap();
    let inventory = dir.path().join("inventory.json");
    let mut entry = json!([{"ID": "r1-u01", "Addr": "127.0.0.1:9",
        "BMC": {"URL": url, "System": SYSTEM, "Username": "admin", "PasswordFile": password},
        "Bare": {"ImageURL": "https://images.test/os.img", "ImageSHA256": "a".repeat(64),
            "Disk": {"serial": "S3YJNX0K", "size": ">= 100"}, "Format": "zstd"}}]);
    if let Some(mode) = boot_mode {
        entry[0]["Bare"]["BootMode"] = mode.into();
    }
    std::fs::write(&inventory, entry.to_string()).unwrap();
    let url = format!("file://{}", inventory.display());
    let provider = StaticProvider::new(&url, ProviderKind::Static)
        .unwrap()
        .with_bmc_timing(Duration::from_secs(2), Duration::ZERO);
    provider.load_at_start().await.unwrap();
    let provider = Arc::new(provider);
    let session =
        t.db.start_session(SessionConfig::new(
            "provisioner",
            Processor::ShepherdProvisioner,
        ))
        .await
        .unwrap();
    let unused = ProviderMachine::new("r1-u01", None, Availability::PossiblyUsed);
    let machine = provider
        .create_machine(&session, &unused)
        .await
        .unwrap()
        .machine;
    session.close().await.unwrap();
    Site {
        t,
        provider,
        machine,
        bmc,
        installed: Arc::default(),
        _dir: dir,
    }
}

impl Site {
    /// Whether each installation asked so far allowed a wipe.
    fn wipes_allowed(&self) -> Vec<bool> {
        let installed = self.installed.lock().unwrap();
        installed.iter().map(|r| r.wipe_allowed).collect()
    }

    /// Runs a replica of the bare-metal loop with `settings` until the token is cancelled.
    fn replica(&self, settings: BareSettings) -> (CancellationToken, tokio::task::JoinHandle<()>) {
        let task = BareMetalLoop::new(self.provider.clone(), settings).unwrap();
        let session = SessionConfig::new("bare", Processor::ShepherdBareMetal)
            .with_interval(Duration::from_secs(1));
        let config = RunnerConfig::new(1, RateSpec::new(Duration::from_millis(20), 4), session);
        let cancel = CancellationToken::new();
        let running = tokio::spawn(run(
            self.t.db.clone(),
            Arc::new(task),
            config,
            cancel.clone(),
        ));
        (cancel, running)
    }

    /// Plays the machine: takes its live environment over, reports the installation and
    /// heartbeats from its installed OS, as `m` says, from what its BMC booted.
    fn play(&self, m: Machine) -> CancellationToken {
        let stop = CancellationToken::new();
        let (db, bmc, machine, until) = (
            self.t.db.clone(),
            self.bmc.clone(),
            self.machine,
            stop.clone(),
        );
        let installed = self.installed.clone();
        tokio::spawn(async move {
            while !until.is_cancelled() {
                let booted = {
                    let b = bmc.lock().unwrap();
                    b.power_on.then_some(b.booted_from).flatten()
                };
                let acted = db.transact(move |tx| {
                    Box::pin(async move { act_as_machine(tx, machine, booted, m).await })
                });
                if let Ok(Some(request)) = acted.await {
                    installed.lock().unwrap().push(request);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        stop
    }

    /// What the BMDB says of the machine: its tag, its bare-metal steps, its work history.
    async fn seen(&self) -> (Option<BareMetal>, Vec<BareHistoryEntry>, Vec<HistoryEntry>) {
        let m = self.machine;
        let seen = self.t.db.read(move |tx| {
            Box::pin(async move {
                let steps = tx.bare_history(m, 100).await?;
                Ok((tx.bare_metal(m).await?, steps, tx.machine_history(m).await?))
            })
        });
        seen.await.unwrap()
    }

    async fn phase(&self) -> Option<BarePhase> {
        self.seen().await.0.map(|b| b.phase)
    }

    async fn steps(&self) -> Vec<BareHistoryEntry> {
        self.seen().await.1
    }

    /// The causes of the bare-metal loop's failed steps.
    async fn failures(&self) -> Vec<String> {
        let history = self.seen().await.2;
        let failed = |h: &HistoryEntry| {
            h.process == Process::ShepherdBareMetal && h.event == WorkEvent::Failed
        };
        history
            .into_iter()
            .filter(failed)
            .filter_map(|h| h.cause)
            .collect()
    }

    /// Waits until the machine is in `phase`.
    async fn reaches(&self, phase: BarePhase) {
        testing::eventually("the machine's phase", Duration::from_secs(30), async || {
            let now = self.phase().await;
            let log = self.bmc.lock().unwrap().log.clone();
            testing::when(now == Some(phase), (now, log))
        })
        .await;
    }

    /// Runs the machine, behaving as `m` says, with one replica whose live boots may take
    /// `live_boot`, until it is in `phase`; its steps.
    async fn run_until(
        &self,
        m: Machine,
        live_boot: Duration,
        phase: BarePhase,
    ) -> Vec<BareHistoryEntry> {
        let _machine = self.play(m);
        let (stop, _) = self.replica(settings(live_boot));
        self.reaches(phase).await;
        stop.cancel();
        self.steps().await
    }

    /// Lets the BMC work again, waits until the machine is done and stops the replica; the
    /// machine went its whole way, each phase once.
    async fn heal_and_finish(&self, replica: CancellationToken) {
        self.bmc.lock().unwrap().knobs.fail.clear();
        self.reaches(Done).await;
        replica.cancel();
        assert_eq!(phases(&self.steps().await), the_way());
    }

    /// The cause of the first failed step, once there is one.
    async fn first_failure(&self) -> String {
        testing::eventually("a failed step", Duration::from_secs(30), async || {
            let failures = self.failures().await;
            testing::when(!failures.is_empty(), failures)
        })
        .await
        .remove(0)
    }

    fn log(&self) -> Vec<String> {
        self.bmc.lock().unwrap().log.clone()
    }
}

/// One look of the machine at itself: what a real machine's initializer and agent would have
/// written by now; the installation request it reported on, if it did.
async fn act_as_machine(
    tx: &mut Tx,
    machine: Uuid,
    booted: Option<&'static str>,
    m: Machine,
) -> Result<Option<proto::ImageInstallationRequest>, Error> {
    let Some(bare) = tx.bare_metal(machine).await? else {
        return Ok(None);
    };
    let started = tx.agent_started(machine).await?.is_some();
    match (bare.phase, booted) {
        (BarePhase::LiveBoot, Some("Cd")) if m.live_answers && !started => {
            // The live environment's agent shows the proof its config drive gave it; an
            // installed OS has none.
            let proof = (!m.falls_through).then(|| live_proof_on(&bare)).flatten();
            tx.set_agent_started_with_proof(machine, &[7; AGENT_KEY_LEN], proof.as_deref())
                .await?;
        }
        (BarePhase::Installing, Some("Cd")) => {
            let Some(request) = tx.os_installation_request(machine).await? else {
                return Ok(None);
            };
            let reported = tx.os_installation_report(machine).await?;
            if reported.is_some_and(|r| r.generation == request.generation) {
                return Ok(None);
            }
            let decoded = proto::OsInstallationRequest::decode(request.request_raw.as_slice());
            let image = match decoded.map(|r| r.r#type) {
                Ok(Some(proto::os_installation_request::Type::Image(image))) => image,
                other => panic!("not an image installation: {other:?}"),
            };
            let unavailable = request.generation <= m.image_server_fails;
            let (result, raw) = match m.install_error {
                None if unavailable => (
                    InstallationResult::Error,
                    proto::os_installation_report::Result::Error(
                        proto::os_installation_report::Error {
                            error: "fetching http://images.test/os.img: connection refused".into(),
                            unavailable: true,
                            disk_written: request.generation == 1,
                            unavailable_in_a_row: request.generation as u32,
                        },
                    ),
                ),
                None => (
                    InstallationResult::Success,
                    proto::os_installation_report::Result::Success(
                        proto::os_installation_report::Success {
                            written_onto: "/dev/vda (480.0 GiB, serial S3YJNX0K)".into(),
                            wiped: if image.wipe_allowed {
                                "a GPT partition table on /dev/vda".into()
                            } else {
                                String::new()
                            },
                            config_drive: match image.config_drive.is_empty() {
                                true => String::new(),
                                false => "a config drive as partition 2 of its GPT".into(),
                            },
                        },
                    ),
                ),
                Some(e) => (
                    InstallationResult::Error,
                    proto::os_installation_report::Result::Error(
                        proto::os_installation_report::Error {
                            error: e.into(),
                            ..Default::default()
                        },
                    ),
                ),
            };
            let report_raw = proto::OsInstallationReport {
                generation: request.generation,
                result: Some(raw),
                // The agent chose its disk (by the entry's hints) and names it by identity.
                chosen_disk: CHOSEN_DISK.into(),
            }
            .encode_to_vec();
            let report = OsInstallationReport {
                generation: request.generation,
                result,
                report_raw,
            };
            tx.set_os_installation_report(machine, &report).await?;
            return Ok(Some(image));
        }
        (BarePhase::DiskBoot, Some("Hdd")) if m.installed_heartbeats => {
            tx.set_agent_started(machine, &[8; AGENT_KEY_LEN]).await?;
            tx.set_heartbeat(machine).await?;
        }
        _ => {}
    }
    Ok(None)
}

/// The live proof the config drive of `bare`'s grant gives the agent, as the live image's
/// setup reads it (`meta_data.json`'s `meta`).
fn live_proof_on(bare: &BareMetal) -> Option<String> {
    let files: serde_json::Value = serde_json::from_str(bare.config.as_deref()?).ok()?;
    let meta: serde_json::Value = serde_json::from_str(files["meta_data.json"].as_str()?).ok()?;
    meta["meta"][LIVE_PROOF_VAR].as_str().map(str::to_string)
}

/// A working machine whose BMC answers `action` with `status` and `body`, with a replica
/// running until that failed once: the site, the machine's and the replica's stop tokens, and
/// the cause recorded.
async fn failing(
    action: &'static str,
    status: u16,
    body: &'static str,
) -> (Site, CancellationToken, CancellationToken, String) {
    failing_with(Knobs {
        fail: vec![(action, status, body)],
        ..Knobs::default()
    })
    .await
}

/// A site whose BMC behaves as `knobs` say, its machine played and one replica running, once
/// a step failed: the site, the machine, the replica, and the first cause.
async fn failing_with(knobs: Knobs) -> (Site, CancellationToken, CancellationToken, String) {
    let s = site(knobs).await;
    let machine = s.play(WORKING);
    let (replica, _) = s.replica(settings(Duration::from_secs(30)));
    let cause = s.first_failure().await;
    (s, machine, replica, cause)
}

fn phases(steps: &[BareHistoryEntry]) -> Vec<BarePhase> {
    steps.iter().map(|s| s.phase).collect()
}

use BarePhase::*;

/// Every phase but Failed, each once, in the order they are declared: a machine's whole way.
fn the_way() -> Vec<BarePhase> {
    BarePhase::ALL
        .iter()
        .copied()
        .filter(|p| *p != Failed)
        .collect()
}

/// Every BMC action of a machine's way, each once, in order.
const ITS_ACTIONS: [&str; 7] = [
    "insert",
    "boot Cd",
    "power On",
    "power ForceOff",
    "eject",
    "boot Hdd",
    "power On",
];

#[tokio::test]
async fn a_bare_machine_goes_its_way_and_each_bmc_step_is_taken_once() {
    let s = site(Knobs::default()).await;
    let steps = s.run_until(WORKING, Duration::from_secs(30), Done).await;
    assert_eq!(phases(&steps), the_way());
    assert_eq!(s.log(), ITS_ACTIONS);
    let mut b = s.bmc.lock().unwrap();
    assert!(
        b.image.is_none() && b.power_on && b.booted_from == Some("Hdd"),
        "{b:?}"
    );
    // The disk stays the boot device: a later power cycle (the recoverer's, a power failure)
    // boots the installed OS again, not the firmware's first choice.
    b.boot();
    assert_eq!(b.booted_from, Some("Hdd"), "{b:?}");
    drop(b);
    // The history names the disk the agent chose.
    let ejecting = &steps.iter().find(|s| s.phase == Ejecting).unwrap().detail;
    let chosen = "onto /dev/vda (480.0 GiB, serial S3YJNX0K)";
    assert!(ejecting.contains(chosen), "{ejecting}");
    let drive = "then added a config drive as partition 2 of its GPT";
    assert!(ejecting.contains(drive), "{ejecting}");
    // The entry's disk goes to the agent as the hints it wrote, and its format by name.
    let installed = s.installed.lock().unwrap();
    let [request] = installed.as_slice() else {
        panic!("{installed:?}")
    };
    let hints: serde_json::Value = serde_json::from_str(&request.root_device_hints).unwrap();
    assert_eq!(
        (
            request.target_device.as_str(),
            hints,
            request.format.as_str()
        ),
        ("", json!({"serial": "S3YJNX0K", "size": ">= 100"}), "zstd")
    );
    // The installed OS's config drive: the machine's id and Shepherd's key, and the vendor
    // data that lets the key in as root (Shepherd logs in as root); nothing else (the entry
    // names no network and no user data).
    let [meta, vendor] = request.config_drive.as_slice() else {
        panic!("{:?}", request.config_drive)
    };
    assert_eq!(meta.path, "openstack/latest/meta_data.json");
    assert_eq!(vendor.path, "openstack/latest/vendor_data.json");
    let vendor: serde_json::Value = serde_json::from_slice(&vendor.content).unwrap();
    assert_eq!(
        vendor["cloud-init"],
        shepherd_provider::bare::ROOT_LOGIN_VENDOR_DATA
    );
    let meta: serde_json::Value = serde_json::from_slice(&meta.content).unwrap();
    assert_eq!(meta["uuid"], s.machine.to_string());
    assert_eq!(
        meta["public_keys"]["shepherd-0"],
        "ssh-ed25519 AAAA shepherd"
    );
}

/// Each boot asks for the entry's boot mode where that changes what the system shows, and
/// only there (a write of the mode rebuilds some BMCs' firmware setup); without one, the
/// system's mode stays. The history says the mode of each boot.
#[tokio::test]
async fn the_entrys_boot_mode_is_written_only_where_the_system_shows_another() {
    let cases = [
        (
            Some("UEFI"),
            Some("Legacy"),
            ["boot Cd in Legacy", "boot Hdd"],
            [
                "in Legacy mode, changed from UEFI",
                "in Legacy mode, as the system is",
            ],
        ),
        (
            Some("UEFI"),
            None,
            ["boot Cd", "boot Hdd"],
            ["in the system's UEFI mode", "in the system's UEFI mode"],
        ),
        (
            None,
            Some("UEFI"),
            ["boot Cd in UEFI", "boot Hdd"],
            [
                "in UEFI mode (the BMC showed no mode)",
                "in UEFI mode, as the system is",
            ],
        ),
        (
            None,
            None,
            ["boot Cd", "boot Hdd"],
            [
                "in the firmware's own mode (the BMC shows none)",
                "in the firmware's own mode (the BMC shows none)",
            ],
        ),
    ];
    for (shows_mode, entry_boot_mode, sent, said) in cases {
        let knobs = Knobs {
            shows_mode,
            entry_boot_mode,
            ..Knobs::default()
        };
        let s = site(knobs).await;
        let steps = s.run_until(WORKING, Duration::from_secs(30), Done).await;
        let boots: Vec<String> = s
            .log()
            .into_iter()
            .filter(|l| l.starts_with("boot"))
            .collect();
        assert_eq!(boots, sent, "{shows_mode:?} {entry_boot_mode:?}");
        for (phase, words) in [LiveBoot, DiskBoot].into_iter().zip(said) {
            let step = steps.iter().find(|s| s.phase == phase).unwrap();
            assert!(step.detail.contains(words), "{words}: {}", step.detail);
        }
    }
}

/// A machine that is installed and heartbeats is left alone by the loop however long it runs;
/// an operator's reimage sends it its whole way again, its installation now allowed to wipe
/// the disk, with the operator recorded as who allowed it.
#[tokio::test]
async fn an_installed_machine_goes_live_again_only_when_an_operator_reimages_it() {
    let s = site(Knobs::default()).await;
    let _machine = s.play(WORKING);
    let (replica, _) = s.replica(settings(Duration::from_secs(30)));
    s.reaches(Done).await;
    // The runner claims every 20 ms: dozens of passes over a machine that is done.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(s.log(), ITS_ACTIONS);
    assert_eq!(s.phase().await, Some(Done));
    let operator = testing::session(&s.t.db, Processor::ShepherdOperator).await;
    let alice = Operator::new("alice", "new disk").unwrap();
    let reimaged = operator.reimage(s.machine, &alice, true).await.unwrap();
    assert!(matches!(reimaged, ActionOutcome::Done(())), "{reimaged:?}");
    testing::eventually("its way again", Duration::from_secs(30), async || {
        let steps = phases(&s.steps().await);
        testing::when(steps == [the_way(), the_way()].concat(), steps)
    })
    .await;
    replica.cancel();
    // Running its installed OS, it is powered off before the CD goes in.
    let again = [&ITS_ACTIONS[..], &["power ForceOff"], &ITS_ACTIONS].concat();
    assert_eq!(s.log(), again);
    let wipes = s.wipes_allowed();
    assert_eq!(wipes, [false, true]);
    let (tag, steps, _) = s.seen().await;
    assert_eq!(
        tag.unwrap().wipe_by.as_deref(),
        Some("alice (reimage: new disk)")
    );
    let again = &steps[the_way().len()..];
    assert!(
        again[0].detail.contains("reimaged by alice: new disk"),
        "{again:?}"
    );
    // The wipe is in the history with who allowed it.
    let installing = again.iter().find(|s| s.phase == Installing).unwrap();
    assert!(
        installing
            .detail
            .contains("overwriting a disk that holds data is allowed by alice (reimage: new disk)"),
        "{installing:?}"
    );
    // And so is what the agent's wipe cleared.
    let ejecting = again.iter().find(|s| s.phase == Ejecting).unwrap();
    let cleared = "the agent cleared a GPT partition table on /dev/vda, then wrote the image onto";
    assert!(ejecting.detail.contains(cleared), "{ejecting:?}");
}

#[tokio::test]
async fn a_bmc_without_virtual_media_fails_its_machine_once_with_what_it_lacks() {
    let (s, cause) = failed_at_once(Knobs {
        no_virtual_media: true,
        ..Knobs::default()
    })
    .await;
    assert!(cause.contains("has no virtual CD"), "{cause}");
    assert!(
        s.log().is_empty(),
        "nothing was done but reads: {:?}",
        s.log()
    );
}

/// A site whose BMC behaves as `knobs` say: its machine fails as it is inserted, once, for
/// good (said once, not retried, and an operator's reimage named); the site and the cause.
async fn failed_at_once(knobs: Knobs) -> (Site, String) {
    let s = site(knobs).await;
    let (stop, _) = s.replica(settings(Duration::from_secs(30)));
    s.reaches(Failed).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.cancel();
    let steps = s.steps().await;
    assert_eq!(phases(&steps), [Bare, Inserting, Failed]);
    let cause = steps[2].detail.clone();
    assert!(cause.contains("reimage"), "{cause}");
    let failures = s.failures().await;
    assert!(failures.is_empty(), "said once, not retried: {failures:?}");
    (s, cause)
}

/// A CD that says nothing of `Inserted` (optional in Redfish's schema) but names an image
/// holds that image: someone else's is ejected before the live image goes in.
#[tokio::test]
async fn a_cd_that_omits_inserted_is_read_by_its_image_and_a_stale_one_ejected_first() {
    let s = site(Knobs {
        omits_inserted: true,
        stale_image: Some("https://elsewhere.example/old.iso"),
        ..Knobs::default()
    })
    .await;
    let steps = s.run_until(WORKING, Duration::from_secs(30), Done).await;
    assert_eq!(phases(&steps), the_way());
    let mut actions = vec!["eject"];
    actions.extend(ITS_ACTIONS);
    assert_eq!(
        s.log(),
        actions,
        "the stale image ejected first, then the way"
    );
    let inserting = &steps
        .iter()
        .find(|s| s.phase == StartingLive)
        .unwrap()
        .detail;
    assert!(
        inserting.contains("ejected what its virtual CD held"),
        "{inserting}"
    );
}

/// A BMC that accepts an insert and never shows the image (it could not fetch it, distrusting
/// the media server's certificate, say) is found out within the step, with a cause that says
/// so, not as a live environment that never answered, a live-boot timeout later.
#[tokio::test]
async fn an_insert_the_bmc_accepts_and_never_shows_is_a_clear_cause_at_once() {
    let (s, _machine, stop, cause) = failing_with(Knobs {
        insert_not_shown: true,
        ..Knobs::default()
    })
    .await;
    stop.cancel();
    for part in [
        "insert the live image",
        "accepted the insert",
        "does not show the image",
    ] {
        assert!(cause.contains(part), "{part:?} in {cause}");
    }
    assert_eq!(s.phase().await, Some(Inserting), "it is tried again");
    assert!(
        !s.log().iter().any(|a| a.starts_with("power On")),
        "{:?}",
        s.log()
    );
}

/// A Redfish error answer, as BMCs give it: its code, message and extended info.
const REFUSED_INSERT: &str = r#"{"error": {"code": "Base.1.8.GeneralError", "message": "A general error has occurred. See ExtendedInfo for more information.", "@Message.ExtendedInfo": [{"MessageId": "Base.1.8.PropertyUnknown", "Message": "The property Inserted is not in the list of valid properties for the resource.", "Severity": "Warning"}]}}"#;

/// A request the BMC refuses as such (400, 404, 405, 501...) will be refused again: the machine
/// fails at once, quoting what the BMC said, instead of backing off for ever.
#[tokio::test]
async fn a_request_the_bmc_refuses_as_such_fails_its_machine_quoting_the_bmc() {
    for status in [400, 405] {
        let (_, cause) = failed_at_once(Knobs {
            fail: vec![("insert", status, REFUSED_INSERT)],
            ..Knobs::default()
        })
        .await;
        assert!(
            cause.contains(&status.to_string())
                && cause.contains("The property Inserted is not in the list of valid properties"),
            "{cause}"
        );
        assert!(
            !cause.contains("\"Severity\""),
            "the BMC's message, not its JSON: {cause}"
        );
    }
}

#[tokio::test]
async fn a_bmc_that_cannot_fetch_the_image_backs_its_machine_off_with_its_answer() {
    let refusal = "Cannot download virtual media: got error 404 from the server";
    let (s, _machine, stop, cause) = failing("insert", 500, refusal).await;
    assert!(
        cause.contains("insert the live image")
            && cause.contains("500")
            && cause.contains("Cannot download virtual media"),
        "{cause}"
    );
    assert_eq!(s.phase().await, Some(Inserting), "it stays where it was");
    // Once the BMC can fetch it, the machine goes on from where it was.
    s.heal_and_finish(stop).await;
    assert_eq!(s.log(), ITS_ACTIONS);
}

/// The way of a machine booted live twice, without an installation, then given up on.
const TWO_LIVE_BOOTS_THEN_FAILED: [BarePhase; 9] = [
    Bare,
    Inserting,
    StartingLive,
    LiveBoot,
    Bare,
    Inserting,
    StartingLive,
    LiveBoot,
    Failed,
];

/// Its BMC's actions: each live boot, then powered off and ejected.
fn off_and_ejected_after_each_live_boot() -> Vec<&'static str> {
    let each = ["insert", "boot Cd", "power On", "power ForceOff", "eject"];
    [each, each].concat()
}

/// The image's server fails the first two installations (the first after the agent began
/// writing the disk): the machine is never failed; its live environment is asked again after
/// each backoff, the second and third time allowed to overwrite what Shepherd itself began
/// writing during this live boot, and it is installed.
#[tokio::test]
async fn an_image_server_outage_is_waited_out_and_the_disk_shepherd_began_is_written_again() {
    let outage = Machine {
        image_server_fails: 2,
        ..WORKING
    };
    let s = site(Knobs::default()).await;
    let steps = s.run_until(outage, Duration::from_secs(60), Done).await;
    let the_way = the_way();
    let installing = &the_way[..5];
    let rest = &the_way[5..];
    let expected = [
        installing,
        &[LiveBoot, Installing],
        &[LiveBoot, Installing],
        rest,
    ]
    .concat();
    assert_eq!(phases(&steps), expected);
    let again: Vec<&BareHistoryEntry> = steps
        .iter()
        .skip(4)
        .filter(|s| s.phase == LiveBoot)
        .collect();
    assert!(
        again[0]
            .detail
            .contains("the image's server failed the installation")
            && again[0]
                .detail
                .contains("installation 1 began writing the disk"),
        "{}",
        again[0].detail
    );
    assert!(
        !again[1].detail.contains("began writing"),
        "{}",
        again[1].detail
    );
    let wipes = s.wipes_allowed();
    assert_eq!(
        wipes,
        [false, true, true],
        "the disk Shepherd began may be written again"
    );
    let asked: Vec<&BareHistoryEntry> = steps.iter().filter(|s| s.phase == Installing).collect();
    assert!(
        asked[2].detail.contains("allowed by Shepherd itself"),
        "{}",
        asked[2].detail
    );
    // The first request names the disk as the entry does; once the agent chose it, the
    // retries name that very disk by its serial and WWN.
    let hints: Vec<String> = s
        .installed
        .lock()
        .unwrap()
        .iter()
        .map(|r| r.root_device_hints.clone())
        .collect();
    let entry = r#"{"serial":"S3YJNX0K","size":">= 100"}"#;
    assert_eq!(hints, [entry, CHOSEN_DISK, CHOSEN_DISK]);
    let retry = &asked[1].detail;
    let pinned = format!("onto the disk its agent chose before, the hints {CHOSEN_DISK} (the entry names the hints {entry})");
    assert!(retry.contains(&pinned), "{retry}");
}

/// The CD boot falls through to the disk's installed OS, which lets Shepherd in: its agent is
/// taken over but shows no proof of the live boot, so nothing is asked of it; the machine is
/// powered off and ejected, booted again, and failed with that cause after its last attempt.
#[tokio::test]
async fn an_installed_os_that_answers_instead_of_the_live_environment_gets_no_installation() {
    let fell_through = Machine {
        falls_through: true,
        ..WORKING
    };
    let s = site(Knobs::default()).await;
    let steps = s
        .run_until(fell_through, Duration::from_secs(30), Failed)
        .await;
    assert_eq!(phases(&steps), TWO_LIVE_BOOTS_THEN_FAILED);
    for (step, want) in [
        (&steps[4], "the CD boot fell through to the installed OS"),
        (&steps[4], "(live boot 1 of 2)"),
        (&steps[8], "2 times"),
        (&steps[8], "nothing was written"),
    ] {
        assert!(step.detail.contains(want), "{want}: {}", step.detail);
    }
    assert!(
        s.installed.lock().unwrap().is_empty(),
        "no installation was asked"
    );
    let no_request = s.t.db.read({
        let m = s.machine;
        move |tx| Box::pin(async move { tx.os_installation_request(m).await })
    });
    assert_eq!(no_request.await.unwrap(), None);
    assert_eq!(s.log(), off_and_ejected_after_each_live_boot());
}

#[tokio::test]
async fn a_live_environment_that_never_answers_is_booted_again_then_given_up_on() {
    let s = site(Knobs::default()).await;
    let steps = s
        .run_until(LIVE_SILENT, Duration::from_secs(2), Failed)
        .await;
    assert_eq!(phases(&steps), TWO_LIVE_BOOTS_THEN_FAILED);
    assert!(
        steps[4]
            .detail
            .contains("did not answer SSH within 2s (live boot 1 of 2)"),
        "{}",
        steps[4].detail
    );
    assert!(
        steps[8]
            .detail
            .contains("did not answer SSH within 2s, 2 times"),
        "{}",
        steps[8].detail
    );
    assert_eq!(s.log(), off_and_ejected_after_each_live_boot());
    let b = s.bmc.lock().unwrap();
    assert!(
        !b.power_on && b.image.is_none(),
        "left off and empty: {b:?}"
    );
}

#[tokio::test]
async fn a_failed_installation_fails_the_machine_with_the_agents_cause() {
    let s = site(Knobs::default()).await;
    let error = "/dev/vda holds an MBR partition table; it is overwritten only if the installation allows a wipe";
    let refusing = Machine {
        install_error: Some(error),
        image_server_fails: 0,
        ..WORKING
    };
    let steps = s.run_until(refusing, Duration::from_secs(30), Failed).await;
    assert_eq!(
        phases(&steps),
        [Bare, Inserting, StartingLive, LiveBoot, Installing, Failed]
    );
    assert!(
        steps[5]
            .detail
            .contains(&format!("the installation failed: {error}")),
        "{}",
        steps[5].detail
    );
    assert_eq!(
        s.log(),
        ["insert", "boot Cd", "power On", "power ForceOff", "eject"]
    );
}

#[tokio::test]
async fn an_eject_that_fails_is_tried_again_and_done_once() {
    let (s, _machine, stop, cause) = failing("eject", 503, "Service Unavailable").await;
    assert!(
        cause.contains("eject the live image") && cause.contains("503"),
        "{cause}"
    );
    assert_eq!(s.phase().await, Some(Ejecting));
    s.heal_and_finish(stop).await;
    assert_eq!(s.log().iter().filter(|a| *a == "eject").count(), 1);
}

#[tokio::test]
async fn an_installed_os_that_never_heartbeats_fails_its_machine_with_a_clear_cause() {
    let steps = site(Knobs::default())
        .await
        .run_until(INSTALLED_SILENT, Duration::from_secs(30), Failed)
        .await;
    let failed = steps.last().unwrap();
    assert!(
        failed
            .detail
            .contains("its installed OS did not heartbeat within 3s"),
        "{}",
        failed.detail
    );
    assert_eq!(phases(&steps)[..8], the_way()[..8]);
}

#[tokio::test]
async fn a_bmc_that_fails_or_hangs_backs_its_machine_off_with_its_answer() {
    let knobs = Knobs {
        fail: vec![("read", 500, "Internal Server Error")],
        ..Knobs::default()
    };
    let s = site(knobs).await;
    let (stop, _) = s.replica(settings(Duration::from_secs(30)));
    let cause = s.first_failure().await;
    assert!(
        cause.contains("500") && cause.contains("Internal Server Error"),
        "{cause}"
    );
    stop.cancel();
    assert_eq!(
        s.phase().await,
        Some(Inserting),
        "not failed: it is tried again"
    );

    let s = site(Knobs {
        hang_at: Some(("power", 1)),
        ..Knobs::default()
    })
    .await;
    let (stop, _) = s.replica(settings(Duration::from_secs(30)));
    testing::eventually(
        "a step that timed out",
        Duration::from_secs(30),
        async || {
            let failures = s.failures().await;
            testing::when(!failures.is_empty(), failures)
        },
    )
    .await;
    stop.cancel();
    let cause = s.failures().await.remove(0);
    assert!(
        cause.contains("power on") && cause.contains("timed out"),
        "{cause}"
    );
}

/// A BMC that answers 503 with `Retry-After` is left alone that long, not the loop's own
/// backoff (one second here), and the machine is not failed.
#[tokio::test]
async fn a_bmc_that_asks_to_be_left_alone_is_left_alone_as_long_as_it_asked() {
    let knobs = Knobs {
        fail: vec![("insert", 503, "busy updating its firmware")],
        retry_after: Some(120),
        ..Knobs::default()
    };
    let s = site(knobs).await;
    let (stop, _) = s.replica(settings(Duration::from_secs(30)));
    let cause = s.first_failure().await;
    stop.cancel();
    assert!(
        cause.contains("503") && cause.contains("busy updating"),
        "{cause}"
    );
    let m = s.machine;
    let backoffs =
        s.t.db
            .read(move |tx| Box::pin(async move { tx.machine_backoffs(m).await }));
    let backoffs = backoffs.await.unwrap();
    let waits: Vec<(Process, i64)> = backoffs
        .iter()
        .map(|b| (b.process, b.last_interval_seconds))
        .collect();
    assert_eq!(waits, [(Process::ShepherdBareMetal, 120)], "{backoffs:?}");
    assert_eq!(s.phase().await, Some(Inserting), "not failed");
}

/// A replica is stopped at each BMC step, right after the BMC carried it out and before it
/// could answer (its work canceled where it stood, as a replica killed there leaves it once
/// its session expires: the phase entered, the step's outcome unrecorded); another replica
/// takes the machine over: every step is still taken once (a one-time boot override may be set
/// twice: setting it again changes nothing). (A replica killed with SIGKILL
/// while its machines boot is in the end-to-end test, `solo::bare_metal_e2e`.)
#[tokio::test]
async fn a_replica_stopped_at_each_bmc_step_leaves_nothing_done_twice() {
    let steps = [
        ("insert", 1),
        ("boot", 1),
        ("power", 1),
        ("power", 2),
        ("eject", 1),
        ("boot", 2),
        ("power", 3),
    ];
    for (step, nth) in steps {
        let s = site(Knobs {
            hang_at: Some((step, nth)),
            ..Knobs::default()
        })
        .await;
        let _machine = s.play(WORKING);
        let settings = settings(Duration::from_secs(30));
        let (a, _) = s.replica(settings.clone());
        testing::eventually(
            "replica a at its step",
            Duration::from_secs(30),
            async || {
                let log = s.log();
                let n = log.iter().filter(|l| l.starts_with(step)).count();
                testing::when(n >= nth, log)
            },
        )
        .await;
        a.cancel();
        s.bmc.lock().unwrap().knobs.hang_at = None;
        let (stop, _) = s.replica(settings);
        s.reaches(Done).await;
        stop.cancel();
        assert_eq!(
            phases(&s.steps().await),
            the_way(),
            "stopped at {step} {nth}"
        );
        // A boot override set again is the same setting; every other step is taken once.
        let mut log = s.log();
        log.dedup();
        assert_eq!(log, ITS_ACTIONS, "stopped at {step} {nth}: {:?}", s.log());
    }
}
