//! End to end through the CLI: `shepherd server` and `shepherd run` (static provider) as
//! processes, a real sshd, and the real agent binary: the initializer starts the agent over
//! SSH, its heartbeats and hardware report arrive through TLS, and both processes shut down
//! cleanly on SIGTERM. The server's heartbeat group commit is one of its tasks.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{shepherd, ChildGuard, TestAgent};
use shepherd_bmdb::{testing, Bmdb};
use shepherd_proto::bmaas::{AgentHardwareReport, HeartbeatRequest};
use shepherd_proto::Message;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_started_over_ssh_heartbeats_to_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());

    // The server, on a free port, with development certificates.
    let (server, addr) = common::start_server(common::server(&url, dir.path()), None);
    let port = addr.rsplit_once(':').unwrap().1;

    // A machine (the sshd) in a static inventory, and the loops pointing agents at the server.
    let common::SshdMachine {
        sshd,
        key_path,
        inventory,
    } = common::sshd_machine(dir.path(), serde_json::json!({"ID": "box-1"}));
    let agent = shepherd_loops::testing::agent_path();
    let target = sshd.dir().join("agent");
    let run = shepherd()
        .args(["run", "--provider", "static", "--database", &url])
        .arg(format!("--static-inventory=file://{}", inventory.display()))
        .arg(format!("--agent-executable={}", agent.display()))
        .arg(format!("--agent-target-path={}", target.display()))
        .arg(format!("--agent-endpoint=localhost:{port}"))
        .arg(format!(
            "--agent-ca={}",
            dir.path().join("certs/ca.pem").display()
        ))
        .arg(format!("--ssh-key={}", key_path.display()))
        .args([
            "--ssh-user",
            &std::env::var("USER").unwrap_or_else(|_| "root".into()),
        ])
        .args([
            "--ssh-connect-timeout",
            "10s",
            "--provisioner-reconcile-rate",
            "100ms,1",
        ])
        .args([
            "--provisioner-creation-rate",
            "1ms,1",
            "--initializer-db-rate",
            "50ms,1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let run = ChildGuard(Some(run));

    let db = Bmdb::open(&url).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let (machine, report) = loop {
        let found = db
            .read(|tx| {
                Box::pin(async move {
                    for id in tx.machine_ids(None, 10).await? {
                        if tx.heartbeat(id).await?.is_some() {
                            if let Some(r) = tx.hardware_report(id).await? {
                                return Ok(Some((id, r)));
                            }
                        }
                    }
                    Ok(None)
                })
            })
            .await
            .unwrap();
        if let Some(f) = found {
            break f;
        }
        assert!(Instant::now() < deadline, "no heartbeat from the agent");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let report = AgentHardwareReport::decode(report.as_slice()).unwrap();
    assert!(report.report.unwrap().memory_installed_bytes > 0);
    let started = db
        .read(move |tx| Box::pin(async move { tx.agent_started(machine).await }))
        .await
        .unwrap();
    assert_eq!(started.unwrap().public_key.len(), 32);

    let run_out = run.terminate();
    assert!(
        run_out.status.success(),
        "{}",
        String::from_utf8_lossy(&run_out.stderr)
    );
    let server_out = server.terminate();
    assert!(
        server_out.status.success(),
        "{}",
        String::from_utf8_lossy(&server_out.stderr)
    );
    // The background agent outlives the SSH session, as on a real machine; stop it here.
    let _ = Command::new("pkill")
        .arg("-f")
        .arg(target.display().to_string())
        .status();
    db.close().await;
}

#[test]
fn server_needs_certificates() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("s.db").display());
    let out = shepherd()
        .args(["server", "--migrate", "--database", &url])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr)
        .contains("tls-cert and tls-key (or dev-certs) are required"));
}

/// The server's heartbeat group commit is a task: agents' bare heartbeats land in batches,
/// each reported, and `/tasks.json` on the server's web listener shows the task with what
/// its last batch wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeat_batches_are_a_task_of_the_server() {
    const AGENTS: usize = 6;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let (server, lines) = common::started_server(
        &url,
        dir.path(),
        &[],
        &[
            "shepherd server: listening on ",
            "shepherd server: web UI at http://",
        ],
    );
    let addr = lines[0].trim().to_string();
    let web = lines[1].split('/').next().unwrap().to_string();
    let ca = std::fs::read(dir.path().join("certs/ca.pem")).unwrap();
    let db = Bmdb::open(&url).await.unwrap();
    let mut beats = Vec::new();
    for _ in 0..AGENTS {
        let agent = TestAgent::new();
        let machine = agent.machine(&db).await;
        let mut client = agent.client(&addr, &ca, Duration::from_secs(10));
        beats.push(async move {
            for _ in 0..3 {
                client
                    .heartbeat(HeartbeatRequest {
                        machine_id: machine.to_string(),
                        ..Default::default()
                    })
                    .await
                    .expect("a bare heartbeat is accepted");
            }
        });
    }
    futures::future::join_all(beats).await;

    let tasks: serde_json::Value = reqwest::get(format!("http://{web}/tasks.json"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let task = tasks["tasks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "heartbeat-batches")
        .unwrap_or_else(|| panic!("no heartbeat-batches task: {tasks}"))
        .clone();
    assert_eq!(task["kind"], "batches", "{task}");
    assert_eq!(task["state"], "ok", "{task}");
    assert_eq!(task["last_outcome"], "succeeded", "{task}");
    let written = task["by_outcome"]["succeeded"].as_u64().unwrap();
    // Each agent waits for its answer before its next heartbeat, so there are at least three
    // batches, and at most one per heartbeat.
    assert!(
        (3..=3 * AGENTS as u64).contains(&written),
        "{written} batches for {} heartbeats: {task}",
        3 * AGENTS
    );
    assert!(
        task["last_summary"]
            .as_str()
            .unwrap()
            .ends_with("heartbeats written in one transaction"),
        "{task}"
    );
    // The schema watch and the heartbeat reporter are tasks too: the checks are shown, each
    // naming both versions, and so are the reports (one a second: the first shows once that
    // has passed).
    let tasks_json = format!("http://{web}/tasks.json");
    let named = |tasks: &serde_json::Value, name: &str| {
        let all = tasks["tasks"].as_array().unwrap();
        all.iter().find(|t| t["name"] == name).cloned()
    };
    let watch = testing::eventually(
        "a heartbeat report shown",
        Duration::from_secs(10),
        async || {
            let tasks: serde_json::Value = reqwest::get(&tasks_json)
                .await
                .unwrap()
                .json()
                .await
                .unwrap();
            let reports = named(&tasks, "heartbeat-reports");
            let written = reports
                .as_ref()
                .and_then(|r| r["by_outcome"]["succeeded"].as_u64());
            let watch = named(&tasks, "schema-watch");
            testing::when(written > Some(0) && watch.is_some(), (reports, watch))
        },
    )
    .await
    .1
    .unwrap();
    assert_eq!(watch["last_outcome"], "succeeded", "{watch}");
    let versions = format!("schema {v}, binary {v}", v = shepherd_bmdb::SCHEMA_VERSION);
    assert_eq!(watch["last_summary"], versions.as_str(), "{watch}");
    let out = server.terminate();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    db.close().await;
}
