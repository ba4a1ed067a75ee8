//! The debug web UI of `shepherd server` in a real browser (Debian's Chromium, headless, driven
//! over WebDriver by chromedriver): a BMDB seeded with machines in every state is listed,
//! filtered, paged and opened, and the rendered DOM must show what the database holds.
//! Screenshots land in `target/web-ui/` for people to look at.

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{announced, free_port, shepherd};
use fantoccini::{Client, ClientBuilder, Locator};
use shepherd_bmdb::*;
use shepherd_proto::agent::{BlockDevice, Cpu, NetworkInterface, Node};
use shepherd_proto::bmaas::AgentHardwareReport;
use shepherd_proto::Message;
use uuid::Uuid;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// Kills the child and its process group on drop, so neither a failed assertion nor a passing
/// test leaves processes behind: chromedriver killed alone leaves the Chromium it started
/// running, orphaned. The child must lead its own group ([`CommandExt::process_group`]).
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        // The group may have ended already, which is no error: say nothing of it.
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn screenshot_dir() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target"));
    let dir = target.join("web-ui");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `shepherd server` on free ports over `url`; returns it and its web UI base URL.
fn start_server(url: &str, dir: &Path) -> (Guard, String) {
    start_server_with(url, dir, &[])
}

/// [`start_server`] with more flags.
fn start_server_with(url: &str, dir: &Path, flags: &[&str]) -> (Guard, String) {
    let mut server = shepherd();
    server
        .args(["server", "--database", url, "--listen", "127.0.0.1:0"])
        .args(flags)
        .args(["--http-listen", "127.0.0.1:0"])
        // A reload in the middle of reading a page would detach the elements being read.
        .args(["--web-refresh", "0s"])
        .arg("--dev-certs")
        .arg(dir.join("certs"));
    let (guard, announced) = spawn_announcing(&mut server, "shepherd server: web UI at ");
    let base = announced.split("/machines").next().unwrap().to_string();
    (guard, base)
}

/// Starts `cmd` and waits for the line it prints starting with `prefix`; the rest of it.
fn spawn_announcing(cmd: &mut Command, prefix: &'static str) -> (Guard, String) {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::null()).spawn();
    let mut guard = Guard(child.unwrap());
    let line = announced(&mut guard.0, prefix);
    (guard, line)
}

/// chromedriver on a free port, and a WebDriver session of headless Chromium.
async fn browser(profile: &Path) -> (Guard, Client) {
    for bin in [CHROMIUM, CHROMEDRIVER] {
        assert!(
            Path::new(bin).exists(),
            "{bin} is missing: run scripts/test-deps.sh (installs chromium and chromium-driver)"
        );
    }
    let port = free_port();
    let driver = Guard(
        Command::new(CHROMEDRIVER)
            .process_group(0)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut caps = serde_json::Map::new();
    caps.insert(
        "goog:chromeOptions".into(),
        serde_json::json!({
            "binary": CHROMIUM,
            "args": [
                "--headless=new", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--no-first-run", "--window-size=1400,1000",
                format!("--user-data-dir={}", profile.display()),
            ],
        }),
    );
    // The signed-in UI is served over HTTPS with the test's own development CA.
    caps.insert("acceptInsecureCerts".into(), true.into());
    let deadline = Instant::now() + Duration::from_secs(30);
    let client = loop {
        // chromedriver speaks plain HTTP on loopback.
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        match ClientBuilder::new(connector)
            .capabilities(caps.clone())
            .connect(&format!("http://127.0.0.1:{port}"))
            .await
        {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("no WebDriver session: {e}"),
        }
    };
    (driver, client)
}

/// Rows of the machines table: machine id → state slug.
async fn rows(c: &Client) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    for row in c
        .find_all(Locator::Css("#machines tbody tr"))
        .await
        .unwrap()
    {
        let id = row.attr("data-machine").await.unwrap().unwrap();
        let state = row.attr("data-state").await.unwrap().unwrap();
        // The badge the operator sees says the same as the attribute.
        let badge = row.find(Locator::Css(".state")).await.unwrap();
        let label = badge.text().await.unwrap();
        assert_eq!(
            label.parse::<Lifecycle>().unwrap().slug(),
            state,
            "badge of {id}"
        );
        out.insert(id, state);
    }
    out
}

/// Clicks a link or button and waits until the browser has loaded the page it leads to.
/// The seeded machine in `state`.
fn in_state(seeded: &[testing::SeededMachine], state: Lifecycle) -> &testing::SeededMachine {
    seeded.iter().find(|m| m.state == state).unwrap()
}

/// Picks the option of value `value` in the form's select `css`.
async fn choose(c: &Client, css: &str, value: &str) {
    let select = c.find(Locator::Css(css)).await.unwrap();
    select.select_by_value(value).await.unwrap();
}

async fn click_and_wait(c: &Client, element: fantoccini::elements::Element) {
    let before = c.current_url().await.unwrap();
    element.click().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let url = c.current_url().await.unwrap();
        let ready = c
            .execute("return document.readyState", vec![])
            .await
            .unwrap();
        if url != before && ready == "complete" {
            return;
        }
        assert!(Instant::now() < deadline, "no navigation from {before}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn text(c: &Client, css: &str) -> String {
    c.find(Locator::Css(css))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// A scratch directory, and a BMDB with one machine per lifecycle state (returned, with the
/// session that keeps the in-work one in work) and one more taken over (its id last).
async fn seeded_site() -> (
    tempfile::TempDir,
    testing::TestDb,
    Vec<testing::SeededMachine>,
    Session,
    Uuid,
) {
    let dir = tempfile::tempdir().unwrap();
    let t = testing::sqlite().await;
    let (seeded, holder) = testing::seed_every_state(&t.db).await;
    let box9 = taken_over_machine(&t.db).await;
    (dir, t, seeded, holder, box9)
}

/// A machine taken over through the real work protocol (history: Started, Finished) with a
/// hardware report, next to the seeded ones.
async fn taken_over_machine(db: &Bmdb) -> Uuid {
    let id = db
        .transact(|tx| {
            Box::pin(async move {
                let id = tx.create_machine().await?;
                let mut p = Provided::new(ProviderKind::Static, "box-9");
                p.ip_address = Some("10.0.0.9".into());
                p.location = Some("rack-2".into());
                tx.set_provided(id, &p).await?;
                Ok(id)
            })
        })
        .await
        .unwrap();
    let session = testing::session(db, Processor::ShepherdInitializer).await;
    let retrieval = Retrieval::AgentStart {
        provider: ProviderKind::Static,
    };
    let Claim::Work(mut work) = session
        .work(Process::ShepherdAgentStart, retrieval)
        .await
        .unwrap()
    else {
        panic!("box-9 is the only eligible machine");
    };
    assert_eq!(work.machine_id(), id);
    let report = AgentHardwareReport {
        report: Some(Node {
            manufacturer: "Supermicro".into(),
            product: "SYS-1029U".into(),
            serial_number: "S123".into(),
            memory_installed_bytes: 64 << 30,
            cpu: vec![Cpu {
                cores: 16,
                hardware_threads: 32,
                model: "AMD EPYC 7302P".into(),
                ..Default::default()
            }],
            block_device: vec![BlockDevice {
                device_model: "SAMSUNG MZ7L3480".into(),
                capacity_bytes: 480 << 30,
                ..Default::default()
            }],
            network_interface: vec![NetworkInterface {
                mac: vec![0x02, 0, 0, 0, 0, 9],
                link_up: true,
                ..Default::default()
            }],
            ..Default::default()
        }),
        warning: vec![],
    }
    .encode_to_vec();
    work.finish(TagWrites::none().agent_started([9; 32]))
        .await
        .unwrap();
    db.transact(move |tx| {
        let report = report.clone();
        Box::pin(async move {
            tx.set_heartbeat(id).await?;
            tx.set_hardware_report(id, &report).await?;
            // Then its provider stopped listing it.
            let mut p = tx.provided(id).await?.expect("provided");
            p.status = Some(ProviderStatus::Missing);
            tx.set_provided(id, &p).await
        })
    })
    .await
    .unwrap();
    session.close().await.unwrap();
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn web_ui_shows_what_the_bmdb_holds() {
    let (dir, t, seeded, holder, box9) = seeded_site().await;
    let mut want: BTreeMap<String, String> = seeded
        .iter()
        .map(|m| (m.id.to_string(), m.state.slug().to_string()))
        .collect();
    want.insert(box9.to_string(), "heartbeating".into());

    let (_server, base) = start_server(&t.url, dir.path());
    let (_driver, c) = browser(&dir.path().join("profile")).await;
    let shots = screenshot_dir();

    // The list: every machine with its state, and the fleet counts.
    c.goto(&format!("{base}/")).await.unwrap();
    assert!(
        c.current_url().await.unwrap().path() == "/machines",
        "/ redirects"
    );
    assert_eq!(rows(&c).await, want);
    assert_eq!(
        text(&c, "[data-count=machines]").await,
        want.len().to_string()
    );
    assert_eq!(text(&c, "[data-count=heartbeating]").await, "4");
    assert_eq!(text(&c, "[data-count=missing]").await, "1");
    let missing = text(&c, "#missing").await;
    assert!(
        missing.contains("shepherd machines decommission ID")
            && missing.contains("--provisioner-max-missing"),
        "the missing machines' notice names the remedies: {missing}"
    );
    std::fs::write(shots.join("machines.png"), c.screenshot().await.unwrap()).unwrap();

    // Filter by state through the form.
    choose(&c, "#state", "stale").await;
    click_and_wait(&c, c.find(Locator::Css("#filter")).await.unwrap()).await;
    let stale: Vec<String> = rows(&c).await.into_values().collect();
    assert_eq!(stale, vec!["stale".to_string()]);
    assert!(c
        .current_url()
        .await
        .unwrap()
        .query()
        .unwrap()
        .contains("state=stale"));

    // Filter by provider (the state filter is kept in the form; reset it to "any").
    choose(&c, "#state", "").await;
    choose(&c, "#provider", "Sim").await;
    click_and_wait(&c, c.find(Locator::Css("#filter")).await.unwrap()).await;
    let sim = rows(&c).await;
    let box0 = seeded
        .iter()
        .find(|m| m.provider_id.as_deref() == Some("box-0"))
        .unwrap();
    assert_eq!(
        sim.keys().cloned().collect::<Vec<_>>(),
        vec![box0.id.to_string()]
    );

    // Paging: pages of 4 cover every machine once, in id order.
    c.goto(&format!("{base}/machines?limit=4")).await.unwrap();
    let mut paged = BTreeMap::new();
    let mut pages = 0;
    loop {
        let page = rows(&c).await;
        assert!(page.len() <= 4);
        for (k, v) in page {
            assert!(paged.insert(k, v).is_none(), "a machine on two pages");
        }
        pages += 1;
        match c.find(Locator::Css("#next")).await {
            Ok(next) => click_and_wait(&c, next).await,
            Err(_) => break,
        }
    }
    assert_eq!(paged, want);
    assert_eq!(pages, want.len().div_ceil(4));

    // Machine detail, reached by clicking its link in the list.
    c.goto(&format!("{base}/machines")).await.unwrap();
    click_and_wait(
        &c,
        c.find(Locator::Css(&format!("a[href='/machines/{box9}']")))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(text(&c, "h1").await, format!("Machine {box9}"));
    assert_eq!(text(&c, "#state").await, "heartbeating");
    assert_eq!(text(&c, "[data-field=provider_id]").await, "box-9");
    assert_eq!(text(&c, "[data-field=address]").await, "10.0.0.9");
    assert_eq!(text(&c, "[data-field=location]").await, "rack-2");
    assert_eq!(text(&c, "[data-field=agent_key]").await, "09".repeat(32));
    let cpu = text(&c, "[data-field=cpu]").await;
    assert!(
        cpu.contains("AMD EPYC 7302P") && cpu.contains("16 cores"),
        "{cpu}"
    );
    let memory = text(&c, "[data-field=memory]").await;
    assert!(memory.starts_with("64.0 GiB installed"), "{memory}");
    let history = text(&c, "#history").await;
    let events: Vec<&str> = history
        .lines()
        .filter_map(|l| {
            ["Started", "Finished", "Failed", "Canceled"]
                .into_iter()
                .find(|e| l.contains(e))
        })
        .collect();
    assert_eq!(events, vec!["Started", "Finished"], "{history}");
    std::fs::write(shots.join("machine.png"), c.screenshot().await.unwrap()).unwrap();

    // A machine in backoff shows the cause; one in work links to the session holding it.
    let in_backoff = in_state(&seeded, Lifecycle::InBackoff);
    c.goto(&format!("{base}/machines/{}", in_backoff.id))
        .await
        .unwrap();
    let backoffs = text(&c, "#backoffs").await;
    assert!(
        backoffs.contains("ShepherdAgentStart") && backoffs.contains("ssh: connection refused"),
        "{backoffs}"
    );
    let installed = in_state(&seeded, Lifecycle::Installed);
    c.goto(&format!("{base}/machines/{}", installed.id))
        .await
        .unwrap();
    assert!(text(&c, "[data-field=report]")
        .await
        .contains("generation 3: Success"));
    let in_work = in_state(&seeded, Lifecycle::InWork);
    c.goto(&format!("{base}/machines/{}", in_work.id))
        .await
        .unwrap();
    click_and_wait(
        &c,
        c.find(Locator::Css(&format!(
            "#work a[href='/sessions/{}']",
            holder.id()
        )))
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(text(&c, "h1").await, format!("Session {}", holder.id()));
    assert_eq!(
        text(&c, "[data-field=component]").await,
        "shepherd-initializer"
    );
    assert!(text(&c, "#work").await.contains(&in_work.id.to_string()));
    std::fs::write(shots.join("session.png"), c.screenshot().await.unwrap()).unwrap();

    // Unknown and malformed ids get a page that says so.
    c.goto(&format!("{base}/machines/{}", Uuid::new_v4()))
        .await
        .unwrap();
    assert!(text(&c, ".error").await.contains("does not exist"));
    c.goto(&format!("{base}/machines?state=asleep"))
        .await
        .unwrap();
    assert!(text(&c, ".error")
        .await
        .contains("unknown state \"asleep\""));

    c.close().await.unwrap();
    holder.close().await.unwrap();
    t.cleanup().await;
}

/// The body of a plain GET of `url`.
async fn text_of(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// What the server's page and gauges call stale follows the recoverer's threshold: with
/// `--recovery-heartbeat-older-than 30m`, a machine silent for 11 minutes is heartbeating.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_follows_the_recoverers_threshold() {
    let dir = tempfile::tempdir().unwrap();
    let t = testing::sqlite().await;
    let (seeded, _holder) = testing::seed_every_state(&t.db).await;
    let silent = seeded
        .iter()
        .find(|m| m.state == Lifecycle::Stale)
        .unwrap()
        .id;
    let (_server, base) = start_server_with(
        &t.url,
        dir.path(),
        &[
            "--recovery-heartbeat-older-than",
            "30m",
            "--stats-interval",
            "1s",
        ],
    );
    let page = text_of(&format!("{base}/machines/{silent}")).await;
    assert!(page.contains("s-heartbeating"), "{page}");
    let list = text_of(&format!("{base}/machines?state=stale")).await;
    assert!(!list.contains(&silent.to_string()), "{list}");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let metrics = text_of(&format!("{base}/metrics")).await;
        let gauge = |name: &str| {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
        };
        if let (Some(stale), Some(heartbeating)) = (
            gauge("shepherd_fleet_machines_stale "),
            gauge("shepherd_fleet_machines_heartbeating "),
        ) {
            if heartbeating > 0.0 {
                assert_eq!(stale, 0.0, "{metrics}");
                break;
            }
        }
        assert!(Instant::now() < deadline, "no fleet gauges: {metrics}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    t.cleanup().await;
}

/// Writes a chart's worth of history: an hour of minute snapshots in which the seeded fleet
/// of ten machines was brought in, ending where it stands now, and in the last hour 12
/// takeovers and 5 failures with three causes.
async fn overview_history(db: &Bmdb, machine: Uuid) {
    db.transact(move |tx| {
        Box::pin(async move {
            let now = tx.now().await?;
            for m in 0..60i64 {
                let at = now - chrono::Duration::minutes(60 - m);
                let ramp = |to: i64, from_minute: i64| ((m - from_minute).max(0) * to / 20).min(to);
                for (series, n) in [
                    ("machines", ramp(10, 0)),
                    ("provided", ramp(9, 2)),
                    ("agent started", ramp(6, 8)),
                    ("heartbeating", ramp(5, 12) - i64::from(m > 45)),
                    ("stale", i64::from(m > 45)),
                    ("installing", i64::from(m > 40)),
                    ("installed", i64::from(m > 50)),
                    ("in work", i64::from(m % 7 < 3)),
                    (
                        "in backoff",
                        i64::from(m > 30) + i64::from((33..38).contains(&m)),
                    ),
                ] {
                    tx.insert_fleet_snapshot_raw(at, series, n).await?;
                }
            }
            let recent = |minutes: i64| now - chrono::Duration::minutes(minutes);
            let p = Process::ShepherdAgentStart;
            for i in 0..12 {
                tx.insert_history_raw(machine, p, WorkEvent::Finished, recent(50 - 4 * i), None)
                    .await?;
            }
            for (i, cause) in [
                "ssh: connection refused",
                "ssh: connection refused",
                "ssh: connection refused",
                "agent: takeover response does not decode",
            ]
            .into_iter()
            .enumerate()
            {
                tx.insert_history_raw(
                    machine,
                    p,
                    WorkEvent::Failed,
                    recent(40 - i as i64),
                    Some(cause),
                )
                .await?;
            }
            let r = Process::ShepherdRecovery;
            tx.insert_history_raw(
                machine,
                r,
                WorkEvent::Failed,
                recent(3),
                Some("bmc: timed out"),
            )
            .await?;
            Ok(())
        })
    })
    .await
    .unwrap();
}

/// The overview in Chromium: the state chart draws every series, the bars add up to the
/// history's takeovers and failures, the causes are ranked, hardware is summed per location.
/// Its screenshot is `docs/overview.png`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overview_shows_the_fleet_at_a_glance() {
    let (dir, t, _seeded, holder, box9) = seeded_site().await;
    overview_history(&t.db, box9).await;
    let (_server, base) = start_server_with(&t.url, dir.path(), &["--stats-interval", "1s"]);
    let (_driver, c) = browser(&dir.path().join("profile")).await;

    // The hardware totals come from the statistics' first refresh.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        c.goto(&format!("{base}/overview")).await.unwrap();
        if c.find(Locator::Css("#hardware-totals tr[data-location]"))
            .await
            .is_ok()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no hardware totals on the overview"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let series: Vec<String> = {
        let mut out = vec![];
        for line in c
            .find_all(Locator::Css("#state-chart polyline"))
            .await
            .unwrap()
        {
            out.push(line.attr("data-series").await.unwrap().unwrap());
        }
        out.sort();
        out
    };
    for want in [
        "agent started",
        "heartbeating",
        "in backoff",
        "in work",
        "machines",
        "provided",
    ] {
        assert!(
            series.iter().any(|s| s == want),
            "{want} missing from {series:?}"
        );
    }
    let points = c
        .find(Locator::Css(
            "#state-chart polyline[data-series='agent started']",
        ))
        .await
        .unwrap()
        .attr("points")
        .await
        .unwrap()
        .unwrap();
    assert!(points.split(' ').count() >= 60, "{points}");
    // Twelve written into the history, and box-9's real takeover.
    assert_eq!(text(&c, "[data-total=takeovers]").await, "13");
    assert_eq!(text(&c, "[data-total=failures]").await, "5");
    let causes = text(&c, "#causes tbody").await;
    let lines: Vec<&str> = causes.lines().collect();
    assert_eq!(lines[0], "3 ssh: connection refused machines", "{causes}");
    assert_eq!(lines.len(), 3, "{causes}");
    let rack2 = text(&c, "#hardware-totals tr[data-location='rack-2']").await;
    assert!(
        rack2.starts_with("Static rack-2 1 16 32 64.0 GiB"),
        "{rack2}"
    );
    // Each shape links to the machines that hit it.
    let first = c.find(Locator::Css("#causes tbody tr:first-child a")).await;
    click_and_wait(&c, first.unwrap()).await;
    let hit = text(&c, &format!("#failures tr[data-machine='{box9}']")).await;
    assert!(hit.contains("ssh: connection refused"), "{hit}");
    assert_eq!(
        c.find_all(Locator::Css("#failures tbody tr"))
            .await
            .unwrap()
            .len(),
        1
    );
    // The page is linked from every page's navigation.
    c.goto(&format!("{base}/machines")).await.unwrap();
    let link = c
        .find(Locator::Css("nav a[href='/overview']"))
        .await
        .unwrap();
    click_and_wait(&c, link).await;
    c.set_window_size(1280, 1500).await.unwrap();
    let shot = c.screenshot().await.unwrap();
    std::fs::write(screenshot_dir().join("overview.png"), &shot).unwrap();
    c.close().await.unwrap();
    holder.close().await.unwrap();
    t.cleanup().await;
}

/// `shepherd server` with web sign-in through `issuer` on API port `port`; returns it and the
/// URL of its `/metrics`.
fn start_signed_in_server(
    url: &str,
    dir: &Path,
    issuer: &str,
    port: u16,
    extra: &[&str],
) -> (Guard, String) {
    let secret = dir.join("web-client-secret");
    std::fs::write(&secret, "shepherd-web-secret\n").unwrap();
    let mut child = shepherd();
    child
        .args(["server", "--database", url, "--listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0", "--web-refresh", "5s"])
        .arg("--dev-certs")
        .arg(dir.join("certs"))
        .args(["--dev-cert-names", "127.0.0.1"])
        .args(["--api-listen", &format!("127.0.0.1:{port}")])
        .args(["--oidc-issuer", issuer, "--oidc-audience", "shepherd"])
        .args(["--oidc-role-claim", "groups"])
        .args([
            "--oidc-role",
            "shepherd-operators=operator,shepherd-viewers=viewer",
        ])
        .args(["--web-client-id", "shepherd-web", "--web-scopes", "groups"])
        .arg("--web-client-secret-file")
        .arg(&secret)
        .args(["--web-url", &format!("https://127.0.0.1:{port}")])
        .arg("--metrics-require-token")
        .args(extra);
    spawn_announcing(&mut child, "shepherd server: metrics at ")
}

/// An identity provider and a `shepherd server` over `t` whose web UI signs people in
/// through it; the UI's base URL and the URL of `/metrics`.
fn signed_in_site(
    t: &testing::TestDb,
    dir: &Path,
) -> (common::oidc::OidcProvider, Guard, String, String) {
    signed_in_site_with(t, dir, &[])
}

/// [`signed_in_site`], the server given `extra` flags.
fn signed_in_site_with(
    t: &testing::TestDb,
    dir: &Path,
    extra: &[&str],
) -> (common::oidc::OidcProvider, Guard, String, String) {
    let port = free_port();
    let base = format!("https://127.0.0.1:{port}");
    let idp = common::oidc::OidcProvider::start_with(Some(&format!("{base}/signin/callback")));
    let (server, metrics) = start_signed_in_server(&t.url, dir, &idp.issuer, port, extra);
    (idp, server, base, metrics)
}

/// A sign-in lasts `--web-role-refresh`; then the next page passes through the provider again
/// and comes back with the role the provider gives now. A person moved out of the operators'
/// group loses the buttons within the refresh; before, they kept the role for the whole
/// sign-in (8 h by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sign_in_takes_the_role_the_provider_gives_now() {
    let (dir, t, _seeded, _holder, machine) = seeded_site().await;
    let refresh = ["--web-role-refresh", "3s"];
    let (idp, _server, base, _metrics) = signed_in_site_with(&t, dir.path(), &refresh);
    let page = format!("{base}/machines/{machine}");
    let (_driver, c) = browser(&dir.path().join("profile")).await;
    sign_in(&c, &page, &idp.issuer, "operator-olga").await;
    let buttons = c.find(Locator::Css("#actions-forms")).await;
    assert!(buttons.is_ok(), "an operator sees no buttons");

    idp.set_groups("operator-olga", &["shepherd-viewers"]);
    tokio::time::sleep(Duration::from_secs(4)).await;
    sign_in(&c, &page, &idp.issuer, "operator-olga").await;
    c.find(Locator::Css("#state")).await.unwrap();
    let buttons = c.find(Locator::Css("#actions-forms")).await;
    assert!(buttons.is_err(), "a viewer now, still shown buttons");
    let filter = AuditFilter {
        kind: Some(AuditKind::SignIn),
        ..AuditFilter::default()
    };
    let (signed_in, _) = t.db.audit_events(&filter, None, 10).await.unwrap();
    let roles: Vec<_> = signed_in
        .iter()
        .rev()
        .map(|e| e.reason.split(' ').next())
        .collect();
    assert_eq!(roles, [Some("Operator"), Some("Viewer")], "{signed_in:#?}");
}

/// Signs in as `name` through the provider's login and consent forms, starting from `page`
/// of the UI; returns once the browser is back on `page`.
async fn sign_in(c: &Client, page: &str, issuer: &str, name: &str) {
    sign_in_until(c, page, issuer, name, &|url| url == page).await
}

/// Opens `start` and goes through the provider's login (as `name`) and consent forms until
/// the browser is at a URL that is `done`.
async fn sign_in_until(
    c: &Client,
    start: &str,
    issuer: &str,
    name: &str,
    done: &dyn Fn(&str) -> bool,
) {
    c.goto(start).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut logged_in = false;
    loop {
        let url = c.current_url().await.unwrap().to_string();
        if done(&url) {
            return;
        }
        assert!(Instant::now() < deadline, "sign-in stuck at {url}");
        if url.starts_with(&format!("{issuer}/interaction/")) {
            let ready = c.execute("return document.readyState", vec![]);
            if ready.await.unwrap() != "complete" {
                continue;
            }
            if let Ok(login) = c.find(Locator::Css("input[name=login]")).await {
                assert!(!logged_in, "asked to sign in twice");
                login.send_keys(name).await.unwrap();
                let password = c.find(Locator::Css("input[name=password]")).await;
                password.unwrap().send_keys("any").await.unwrap();
                logged_in = true;
            }
            let submit = c.find(Locator::Css("button[type=submit]")).await.unwrap();
            click_and_wait(c, submit).await;
            continue;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The CSRF token of the forms on `page`, as read with `cookie`.
async fn csrf_on(http: &reqwest::Client, page: &str, cookie: &str) -> String {
    let html = http
        .get(page)
        .header("cookie", cookie)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let at = html
        .find("name=\"csrf\" value=\"")
        .expect("a form with a CSRF token");
    let rest = &html[at + "name=\"csrf\" value=\"".len()..];
    rest[..rest.find('"').unwrap()].to_string()
}

/// The operators' actions recorded for machine `id`: (action, by).
async fn recorded_actions(db: &Bmdb, id: Uuid) -> Vec<(String, String)> {
    let actions = db
        .read(move |tx| Box::pin(async move { tx.machine_actions(id).await }))
        .await
        .unwrap();
    actions
        .into_iter()
        .map(|a| (a.action.slug().to_string(), a.by))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_in_operators_act_from_the_machine_page_and_viewers_cannot() {
    let (dir, t, _seeded, _holder, machine) = seeded_site().await;
    let (idp, _server, base, metrics) = signed_in_site(&t, dir.path());
    let ca = std::fs::read(dir.path().join("certs/ca.pem")).unwrap();
    let http = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let page = format!("{base}/machines/{machine}");

    // Without a sign-in, every page sends the browser to sign in.
    let answer = http.get(&page).send().await.unwrap();
    assert_eq!(answer.status(), 303);
    let location = answer.headers()["location"].to_str().unwrap();
    assert!(location.starts_with("/signin?next="), "{location}");

    // An operator signs in through the provider's form and puts the machine into maintenance.
    let (_driver, c) = browser(&dir.path().join("profile")).await;
    sign_in(&c, &page, &idp.issuer, "operator-alice").await;
    let who = format!("oidc:operator-alice@{}", idp.issuer);
    let form = "form[data-action=maintenance-on]";
    let reason = c
        .find(Locator::Css(&format!("{form} input[name=reason]")))
        .await;
    reason.unwrap().send_keys("firmware update").await.unwrap();
    let button = c
        .find(Locator::Css(&format!("{form} button")))
        .await
        .unwrap();
    button.click().await.unwrap();
    let maintenance = c.wait().for_element(Locator::Css("#maintenance")).await;
    let maintenance = maintenance.unwrap().text().await.unwrap();
    assert!(maintenance.contains(&who), "{maintenance}");
    assert!(maintenance.contains("firmware update"), "{maintenance}");
    let history = text(&c, "#actions tr[data-action=maintenance-on]").await;
    assert!(history.contains(&who), "{history}");
    std::fs::write(
        screenshot_dir().join("signed-in-machine.png"),
        c.screenshot().await.unwrap(),
    )
    .unwrap();
    assert_eq!(
        recorded_actions(&t.db, machine).await,
        vec![("maintenance-on".to_string(), who.clone())]
    );

    // The cookie is HttpOnly, Secure and SameSite=Strict.
    let cookie = c.get_named_cookie("__Host-shepherd-session").await.unwrap();
    assert_eq!(cookie.http_only(), Some(true));
    assert_eq!(cookie.secure(), Some(true));
    assert_eq!(format!("{:?}", cookie.same_site()), "Some(Strict)");
    let session = format!("__Host-shepherd-session={}", cookie.value());

    // Forged forms change nothing: without the session's CSRF token, from another site, or
    // without a session.
    let csrf = csrf_on(&http, &page, &session).await;
    let act = format!("{page}/actions");
    let forged = [
        (Some(session.as_str()), "not-the-token", None),
        (
            Some(session.as_str()),
            csrf.as_str(),
            Some("https://evil.example"),
        ),
        (None, csrf.as_str(), None),
    ];
    for (cookie, token, origin) in forged {
        let mut request = http.post(&act).form(&[
            ("csrf", token),
            ("action", "maintenance-off"),
            ("reason", "forged"),
        ]);
        if let Some(cookie) = cookie {
            request = request.header("cookie", cookie);
        }
        if let Some(origin) = origin {
            request = request.header("origin", origin);
        }
        let status = request.send().await.unwrap().status();
        assert!(
            status == 403 || status == 401,
            "forged form (session: {}, csrf: {token}, origin: {origin:?}): {status}",
            cookie.is_some()
        );
    }
    // A form without its CSRF field gets the same styled refusal, not the parser's 422.
    let bare = http
        .post(&act)
        .header("cookie", session.as_str())
        .form(&[("action", "maintenance-off"), ("reason", "forged")])
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status(), 403);
    let kind = bare.headers()["content-type"].to_str().unwrap().to_string();
    assert!(kind.starts_with("text/html"), "{kind}");
    assert_eq!(
        recorded_actions(&t.db, machine).await.len(),
        1,
        "a forged form acted"
    );

    // `/metrics` asks for a token.
    let metrics_url = metrics;
    let status = reqwest::get(&metrics_url).await.unwrap().status();
    assert_eq!(status, 401);
    let (hour, by) = (Duration::from_secs(3600), Actor::named("test"));
    let made = t.db.create_api_token("prometheus", Role::Viewer, hour, &by);
    let (_, token) = made.await.unwrap().unwrap();
    let answer = reqwest::Client::new()
        .get(&metrics_url)
        .bearer_auth(token.reveal())
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    let scraped = answer.text().await.unwrap();
    let signins = |outcome: &str| {
        let labels = format!("shepherd_web_signins_total{{outcome=\"{outcome}\"}}");
        common::sample(&scraped, &labels).unwrap_or(0.0)
    };
    assert_eq!(signins("signed_in"), 1.0, "{scraped}");
    assert!(
        signins("refused") >= 1.0,
        "the form without a session: {scraped}"
    );

    // Signing out ends the session: its cookie no longer opens a page.
    c.goto(&format!("{base}/account")).await.unwrap();
    let sign_out = c.find(Locator::Css("#sign-out")).await.unwrap();
    click_and_wait(&c, sign_out).await;
    c.find(Locator::Css("#signed-out")).await.unwrap();
    let answer = http
        .get(&page)
        .header("cookie", &session)
        .send()
        .await
        .unwrap();
    assert_eq!(
        answer.status(),
        303,
        "a signed-out session still opens pages"
    );

    // A viewer (a fresh browser profile, so the provider asks again) sees no buttons, and
    // a form with their own valid token is refused for their role.
    drop(c);
    let (_driver2, c) = browser(&dir.path().join("profile-viewer")).await;
    sign_in(&c, &page, &idp.issuer, "viewer-vic").await;
    c.find(Locator::Css("#state")).await.unwrap();
    assert!(
        c.find(Locator::Css("#actions-forms")).await.is_err(),
        "a viewer sees buttons"
    );
    let cookie = c.get_named_cookie("__Host-shepherd-session").await.unwrap();
    let viewer = format!("__Host-shepherd-session={}", cookie.value());
    let csrf = csrf_on(&http, &format!("{base}/account"), &viewer).await;
    let form = [
        ("csrf", csrf.as_str()),
        ("action", "maintenance-off"),
        ("reason", "mine"),
    ];
    let answer = http
        .post(&act)
        .header("cookie", &viewer)
        .form(&form)
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 403);
    assert_eq!(
        recorded_actions(&t.db, machine).await.len(),
        1,
        "a viewer acted"
    );

    // The audit trail has the real sign-ins and the sign-out, and the viewer's refused form
    // (written in a batch, so within a moment).
    let trail = common::wait_for("the audit trail", 20, async || {
        let filter = AuditFilter::default();
        let (events, _) = t.db.audit_events(&filter, None, 1000).await.unwrap();
        let has = |kind, reason: &str| {
            events
                .iter()
                .any(|e| e.kind == kind && e.reason.contains(reason))
        };
        let viewers_form = "needs";
        let all = has(AuditKind::SignIn, "Operator")
            && has(AuditKind::SignIn, "Viewer")
            && has(AuditKind::SignOut, "session.")
            && has(AuditKind::Refused, viewers_form);
        all.then_some(events)
    })
    .await;
    let refused = trail
        .iter()
        .find(|e| e.kind == AuditKind::Refused && e.reason.contains("needs"))
        .unwrap();
    assert_eq!(refused.route.as_deref(), Some("/machines/{id}/actions"));
    assert_eq!(refused.peer.as_deref(), Some("127.0.0.1"), "{refused:?}");
    assert!(refused.principal.as_deref().unwrap().starts_with("oidc:"));

    // Sign-ins are tokens named `session.…`, which nobody else may take.
    let x = Actor::named("x");
    let taken =
        t.db.create_api_token("session.mine", Role::Admin, Duration::from_secs(60), &x);
    assert!(taken.await.is_err(), "a token took a sign-in's name");

    // With the provider down, a new sign-in fails at once, saying why.
    drop(idp);
    let started = common::wait_for("a refused sign-in", 20, async || {
        let answer = http.get(format!("{base}/signin")).send().await.unwrap();
        (answer.status() == 503).then_some(answer)
    });
    let page = started.await.text().await.unwrap();
    assert!(page.contains("cannot be reached"), "{page}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shepherd_login_caches_a_token_the_cli_then_uses() {
    let (dir, t, _seeded, _holder, machine) = seeded_site().await;
    let (idp, _server, base, _metrics) = signed_in_site(&t, dir.path());
    let token_file = dir.path().join("config/shepherd/token");

    // `shepherd login` prints where to sign in; a browser does, and comes back to it.
    let mut login = shepherd()
        .args([
            "login",
            "--issuer",
            &idp.issuer,
            "--client-id",
            "shepherd-cli",
        ])
        .args(["--resource", "urn:shepherd:api", "--token-file"])
        .arg(&token_file)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Its stderr is read to the end by a thread: the rest of what it says, for the asserts.
    let (url_tx, url_rx) = std::sync::mpsc::channel();
    let stderr = std::io::BufReader::new(login.stderr.take().unwrap());
    let said = std::thread::spawn(move || {
        let mut all = String::new();
        for line in std::io::BufRead::lines(stderr).map_while(Result::ok) {
            if line.starts_with("http") {
                let _ = url_tx.send(line.clone());
            }
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let url = url_rx
        .recv_timeout(Duration::from_secs(20))
        .expect("shepherd login prints a URL");
    let (_driver, c) = browser(&dir.path().join("profile")).await;
    let back = |url: &str| url.starts_with("http://127.0.0.1:") && url.contains("/callback?");
    sign_in_until(&c, &url, &idp.issuer, "operator-carol", &back).await;
    let status = common::wait_for("shepherd login to finish", 20, async || {
        login.try_wait().unwrap()
    })
    .await;
    let said = said.join().unwrap();
    assert!(status.success(), "shepherd login: {status}: {said}");
    assert!(said.contains("signed in"), "{said}");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&token_file).unwrap().permissions(),
    );
    assert_eq!(mode & 0o777, 0o600, "the cached token's file mode");

    // The CLI uses the cached token: the action is recorded under the signed-in person.
    let ca = dir.path().join("certs/ca.pem");
    let machines = |token_file: &Path| {
        let mut cmd = shepherd();
        cmd.args(["machines", "--api", &base, "--api-ca"])
            .arg(&ca)
            .arg("--token-file")
            .arg(token_file);
        cmd
    };
    let id = machine.to_string();
    common::succeeds(machines(&token_file).args([
        "maintenance",
        "on",
        &id,
        "--reason",
        "from my laptop",
    ]));
    let who = format!("oidc:operator-carol@{}", idp.issuer);
    assert_eq!(
        recorded_actions(&t.db, machine).await,
        vec![("maintenance-on".to_string(), who)]
    );

    // Without a cached token, the CLI says what to do.
    let missing = machines(&dir.path().join("nothing"))
        .args(["list"])
        .output()
        .unwrap();
    common::refused(&missing, "shepherd login");
}
