//! The real agent binary against the real server over TLS: takeover (as the Initializer runs
//! it), heartbeats from the detached background agent, the hardware report, and OS
//! installation from a local HTTP server, good and corrupted.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use shepherd_bmdb::{testing, Bmdb, InstallationResult};
use shepherd_loops::initializer::{verify_response, verify_takeover};
use shepherd_loops::testing::agent_path;
use shepherd_proto::agent::TakeoverInit;
use shepherd_proto::bmaas::*;
use shepherd_proto::Message;
use shepherd_server::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use uuid::Uuid;

/// Serves `body` for every GET on a loopback port; returns the URL base.
async fn http_server(files: Vec<(&'static str, Vec<u8>)>) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let files = Arc::new(files);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let files = files.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let req = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = req.split_whitespace().nth(1).unwrap_or("/").to_string();
                let (status, body) = match files.iter().find(|(p, _)| *p == path) {
                    Some((_, b)) => ("200 OK", b.clone()),
                    None => ("404 Not Found", Vec::new()),
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = s.write_all(head.as_bytes()).await;
                let _ = s.write_all(&body).await;
            });
        }
    });
    format!("http://{addr}")
}

/// Kills the background agent when the test ends, whatever happens.
struct AgentProcess(Option<u32>);

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if let Some(pid) = self.0 {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
    }
}

/// The pid of the process running `exe` (the detached background agent).
fn pid_of(exe: &Path) -> Option<u32> {
    let out = Command::new("pgrep")
        .arg("-f")
        .arg(exe.display().to_string())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

/// Waits up to 30 s for `f` to return `Some`.
async fn wait_for<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let within = Duration::from_secs(30);
    testing::eventually(what, within, async || f().await.ok_or("not yet")).await
}

async fn agent_takes_over_heartbeats_and_installs(db: Bmdb) {
    // The server, with development certificates the agent trusts through TakeoverInit. It
    // closes a connection that made no authorized request for half a second: the event that
    // shows the agent tried before its key was on record.
    let dir = tempfile::tempdir().unwrap();
    let limits = ServerLimits {
        unauthenticated_timeout: Duration::from_millis(500),
        ..ServerLimits::default()
    };
    let server = LoopbackServer::start(&db, &dir.path().join("certs"), 2, limits)
        .await
        .unwrap();
    // The agent is copied where the Initializer would upload it, and run as it would run it.
    let (exe, machine, init) = agent_for_a_new_machine(&db, &server, dir.path()).await;
    let marker = dir.path().join("rebooted");
    // The machine's one disk, `vdb` of 8 MiB: a sysfs and a /dev of the test's own, as the
    // agent reads them.
    let (sys, dev) = (dir.path().join("sys"), dir.path().join("dev"));
    let vdb = sys.join("devices/pci0000:00/0000:00:06.0/virtio3/block/vdb");
    std::fs::create_dir_all(&vdb).unwrap();
    std::fs::create_dir_all(sys.join("block")).unwrap();
    std::fs::create_dir_all(&dev).unwrap();
    std::fs::write(vdb.join("size"), "16384\n").unwrap();
    std::fs::write(vdb.join("serial"), "DISK-1\n").unwrap();
    std::os::unix::fs::symlink(&vdb, sys.join("block/vdb")).unwrap();
    let disk = dev.join("vdb");
    std::fs::File::create(&disk)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    let mut agent = Command::new(&exe);
    agent
        .env("SHEPHERD_AGENT_SYSFS", &sys)
        .env("SHEPHERD_AGENT_DEV", &dev)
        // As a live environment's config drive sets it for the agent's SSH session.
        .env(shepherd_proto::LIVE_PROOF_VAR, "proof-of-this-boot");
    agent.env("SHEPHERD_AGENT_HEARTBEAT_INTERVAL", "200ms").env(
        "SHEPHERD_AGENT_REBOOT_COMMAND",
        format!("touch {}", marker.display()),
    );
    let out = take_over(agent, &init);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let started = verify_takeover(&init, &out.stdout).unwrap();
    assert_eq!(started.live_proof.as_deref(), Some("proof-of-this-boot"));
    let key = started.key;
    let _background = AgentProcess(pid_of(&exe));
    let state_mode = std::fs::metadata(dir.path().join("agent.state")).unwrap();
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&state_mode.permissions()) & 0o777,
        0o600
    );

    // Nothing heartbeats until the Initializer records the key (the agent's connection is
    // closed for making no authorized request), then heartbeats arrive.
    wait_for("the agent's unauthorized connection closed", async || {
        let closed = server
            .connection_metrics()
            .closes(CloseReason::Unauthenticated);
        (closed >= 1).then_some(())
    })
    .await;
    let m = machine;
    assert!(db
        .read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
        .await
        .unwrap()
        .is_none());
    let k = key.clone();
    db.transact(move |tx| {
        let k = k.clone();
        Box::pin(async move { tx.set_agent_started(m, &k).await })
    })
    .await
    .unwrap();
    let report = wait_for("the hardware report", async || {
        db.read(move |tx| Box::pin(async move { tx.hardware_report(m).await }))
            .await
            .unwrap()
    })
    .await;
    let report = AgentHardwareReport::decode(report.as_slice()).unwrap();
    assert!(report.report.unwrap().memory_installed_bytes > 0);
    let first = wait_for("a heartbeat", async || {
        db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()
    })
    .await;
    wait_for("a later heartbeat", async || {
        let h = db
            .read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()?;
        (h > first).then_some(())
    })
    .await;

    // Installation: generation 1 is a corrupted image (checksum mismatch); generation 2, the
    // good image, is refused, since the disk holds what generation 1 wrote; generation 3 allows
    // the wipe and installs it.
    let image: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    let sha: String = Sha256::digest(&image)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let mut corrupted = image.clone();
    corrupted[1234] ^= 0xff;
    let base = http_server(vec![("/good.img", image.clone()), ("/bad.img", corrupted)]).await;
    for (generation, path, wipe_allowed, want) in [
        (1, "/bad.img", false, InstallationResult::Error),
        (2, "/good.img", false, InstallationResult::Error),
        (3, "/good.img", true, InstallationResult::Success),
    ] {
        let raw = OsInstallationRequest {
            generation,
            r#type: Some(os_installation_request::Type::Image(
                ImageInstallationRequest {
                    url: format!("{base}{path}"),
                    sha256: sha.clone(),
                    root_device_hints: r#"{"serial": "disk-1"}"#.into(),
                    wipe_allowed,
                    ..Default::default()
                },
            )),
        }
        .encode_to_vec();
        testing::request_installation(&db, m, generation, raw).await;
        let stored = wait_for("the installation report", async || {
            let r = testing::installation_report(&db, m).await?;
            (r.generation == generation).then_some(r)
        })
        .await;
        assert_eq!(stored.result, want, "generation {generation}");
        let decoded = OsInstallationReport::decode(stored.report_raw.as_slice()).unwrap();
        if want == InstallationResult::Error {
            match decoded.result {
                Some(os_installation_report::Result::Error(e)) if generation == 1 => {
                    assert!(e.error.contains("checksum mismatch"), "{}", e.error)
                }
                Some(os_installation_report::Result::Error(e)) => {
                    assert!(e.error.contains("holds data"), "{}", e.error)
                }
                other => panic!("{other:?}"),
            }
            assert!(!marker.exists(), "rebooted after a failed installation");
        }
    }
    let written = std::fs::read(&disk).unwrap();
    assert_eq!(&written[..image.len()], image.as_slice());
    assert!(
        written[image.len()..].iter().all(|b| *b == 0),
        "nothing past the image"
    );
    wait_for("the reboot action", async || marker.exists().then_some(())).await;
    server.close().await.unwrap();
}

/// Puts the agent binary `from` at `to` (the agent keeps its state next to itself) as a hard
/// link. A copy would race with the other tests' spawns: a child forked while the copy's
/// write handle is open holds it until it execs, and running the copy then fails with
/// "Text file busy" (ETXTBSY). A link never opens the file for writing. Falls back to a
/// copy only where the two paths are on different filesystems.
fn place_agent(from: &Path, to: &Path) {
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to).unwrap();
    }
}

/// Runs the agent as the Initializer does: `init` on its stdin, its answer on its stdout.
fn take_over(mut agent: Command, init: &TakeoverInit) -> std::process::Output {
    let mut child = agent
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    std::io::Write::write_all(&mut stdin, &init.encode_to_vec()).unwrap();
    drop(stdin);
    child.wait_with_output().unwrap()
}

shepherd_bmdb::conformance_tests!(agent_takes_over_heartbeats_and_installs);

#[test]
fn takeover_without_endpoint_is_an_error_response() {
    let dir = tempfile::tempdir().unwrap();
    let exe = dir.path().join("agent");
    place_agent(&agent_path(), &exe);
    let init = TakeoverInit {
        machine_id: Uuid::new_v4().to_string(),
        ..Default::default()
    };
    let out = take_over(Command::new(&exe), &init);
    let err = verify_response(&init, &out.stdout).unwrap_err().to_string();
    assert!(err.contains("no BMaaS endpoint"), "{err}");
    assert!(!dir.path().join("agent.state").exists());
}

/// A copy of the agent in `dir`, where the Initializer would upload it, a new machine, and
/// the `TakeoverInit` the Initializer would send it for `server`.
async fn agent_for_a_new_machine(
    db: &Bmdb,
    server: &LoopbackServer,
    dir: &Path,
) -> (PathBuf, Uuid, TakeoverInit) {
    let exe = dir.join("agent");
    place_agent(&agent_path(), &exe);
    let machine = db
        .transact(|tx| Box::pin(async move { tx.create_machine().await }))
        .await
        .unwrap();
    let init = TakeoverInit {
        machine_id: machine.to_string(),
        bmaas_endpoint: server.endpoint(),
        ca_certificate: server.ca_der().to_vec(),
        issued_at_unix_millis: chrono::Utc::now().timestamp_millis(),
        claim_generation: 0,
    };
    (exe, machine, init)
}

/// Where Debian's `faketime` package (installed by `scripts/test-deps.sh`) puts its library.
const LIBFAKETIME: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1";

/// A CA and a server certificate for `localhost` as an operator's PKI issues them: valid from
/// today, the server's for 90 days (not the development certificates' 1975–4096, which hide
/// clock problems), written where [`LoopbackServer::start`] finds them.
fn operator_certs(dir: &Path) {
    let today = chrono::Utc::now().date_naive();
    let date = |d: chrono::NaiveDate| {
        use chrono::Datelike;
        rcgen::date_time_ymd(d.year(), d.month() as u8, d.day() as u8)
    };
    let ca_key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    ca_params.not_before = date(today);
    ca_params.not_after = date(today + chrono::Days::new(3650));
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params.not_before = date(today);
    params.not_after = date(today + chrono::Days::new(90));
    let issuer = rcgen::Issuer::from_params(&ca_params, &ca_key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let key_path = dir.join("server.key");
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
}

/// Agents whose clock is wrong (a dead RTC battery: the year 2000; two days behind; a year
/// ahead) heartbeat all the same, against a server certificate valid from today for 90 days:
/// they check its dates against the Initializer's time in their `TakeoverInit`, counted on
/// with their monotonic clock (`agent/src/clock.rs`). One with the right clock is the control.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_with_wrong_clocks_heartbeat() {
    assert!(
        Path::new(LIBFAKETIME).exists(),
        "{LIBFAKETIME} is missing: run scripts/test-deps.sh (installs faketime)"
    );
    let t = testing::sqlite().await;
    let db = t.db.clone();
    let dir = tempfile::tempdir().unwrap();
    operator_certs(&dir.path().join("certs"));
    let mut server =
        LoopbackServer::start(&db, &dir.path().join("certs"), 2, ServerLimits::default())
            .await
            .unwrap();
    let clocks = [
        None,
        Some("@2000-01-01 00:00:00"),
        Some("-2d"),
        Some("+365d"),
    ];
    let mut machines = Vec::new();
    let mut agents = Vec::new();
    for (i, clock) in clocks.iter().enumerate() {
        let home = dir.path().join(format!("agent-{i}"));
        std::fs::create_dir(&home).unwrap();
        let (exe, machine, init) = agent_for_a_new_machine(&db, &server, &home).await;
        let mut agent = Command::new(&exe);
        agent.env("SHEPHERD_AGENT_HEARTBEAT_INTERVAL", "200ms");
        if let Some(clock) = clock {
            agent
                .env("LD_PRELOAD", LIBFAKETIME)
                .env("FAKETIME", clock)
                .env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        let out = take_over(agent, &init);
        let key = verify_response(&init, &out.stdout).unwrap();
        agents.push(AgentProcess(pid_of(&exe)));
        db.transact(move |tx| {
            let key = key.clone();
            Box::pin(async move { tx.set_agent_started(machine, &key).await })
        })
        .await
        .unwrap();
        machines.push((machine, *clock));
    }
    let heartbeating = async || {
        let mut n = 0;
        for (m, _) in machines.clone() {
            let beat = db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }));
            n += usize::from(beat.await.unwrap().is_some());
        }
        n
    };
    let all = testing::eventually(
        "every agent to heartbeat",
        Duration::from_secs(30),
        async || {
            let n = heartbeating().await;
            testing::when(n == machines.len(), n)
        },
    )
    .await;
    println!(
        "wrong_clock_agents_heartbeating = {}",
        all as f64 / machines.len() as f64
    );
    drop(agents);
    server.stop().await.unwrap();
    t.cleanup().await;
}

/// The fencing token of a takeover (`TakeoverInit.claim_generation`): the real agent and the
/// test agent both refuse a takeover whose generation is lower than one they already took
/// for the machine (from a replica whose lease ended), take a higher one, and never refuse
/// one that carries none (an Initializer that sends no token). Another machine's generations
/// are not compared.
#[test]
fn takeovers_with_a_stale_fencing_token_are_refused() {
    for (name, binary) in [
        ("agent", agent_path()),
        ("test agent", shepherd_loops::testing::test_agent_path()),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("agent");
        place_agent(&binary, &exe);
        let _background = AgentProcess(None);
        let takeover = |machine: &str, generation: u64| {
            let init = TakeoverInit {
                machine_id: machine.into(),
                bmaas_endpoint: "localhost:1".into(),
                claim_generation: generation,
                ..Default::default()
            };
            let out = take_over(Command::new(&exe), &init);
            let answer = verify_response(&init, &out.stdout).map(|_| ());
            if let Some(pid) = pid_of(&exe) {
                drop(AgentProcess(Some(pid)));
            }
            answer.map_err(|e| e.to_string())
        };
        let m = Uuid::new_v4().to_string();
        takeover(&m, 5).unwrap_or_else(|e| panic!("{name}: {e}"));
        let stale = takeover(&m, 3).expect_err(name);
        assert!(stale.contains("stale takeover"), "{name}: {stale}");
        takeover(&m, 0).unwrap_or_else(|e| panic!("{name}, no token: {e}"));
        let still = takeover(&m, 4).expect_err(name);
        assert!(
            still.contains("stale takeover"),
            "{name}, after no token: {still}"
        );
        takeover(&m, 7).unwrap_or_else(|e| panic!("{name}: {e}"));
        takeover(&Uuid::new_v4().to_string(), 1)
            .unwrap_or_else(|e| panic!("{name}, another machine: {e}"));
    }
}
