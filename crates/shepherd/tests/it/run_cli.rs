//! `shepherd run` as an operator runs it: settings from flags, environment and config file,
//! start-up errors naming the setting, the sim and static providers (the latter over a real
//! sshd), and graceful shutdown on SIGTERM.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{announced, free_port, refused, shepherd, signal, sim_replica, Pace};
use shepherd_bmdb::{Bmdb, StatusCounts};

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bad_settings_fail_at_start_up_naming_the_setting() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("s.db").display());
    let base = ["run", "--provider", "sim", "--migrate", "--database", &db];
    type Case<'a> = (Vec<&'a str>, Vec<(&'a str, &'a str)>, &'a str);
    let cases: Vec<Case> = vec![
        (
            vec!["--provisioner-reconcile-rate", "5x"],
            vec![],
            "--provisioner-reconcile-rate",
        ),
        (
            vec!["--initializer-db-rate", "1s"],
            vec![("SHEPHERD_AGENT_ENDPOINT", "x:1")],
            "--initializer-db-rate",
        ),
        (
            vec!["--ssh-exec-timeout", "soon"],
            vec![],
            "--ssh-exec-timeout",
        ),
        (vec![], vec![], "agent-endpoint: is required"),
        (
            vec!["--agent-endpoint", "x:1", "--metrics-listen", "0.0.0.0:0"],
            vec![],
            "metrics-listen: 0.0.0.0:0 is not loopback",
        ),
        (
            vec!["--agent-endpoint", "x:1", "--agent-target-path", "agent"],
            vec![],
            "target path",
        ),
        (
            vec!["--agent-endpoint", "x:1", "--sim-bad-agent-rate", "2"],
            vec![],
            "sim bad agent rate",
        ),
        (
            vec!["--agent-endpoint", "x:1"],
            vec![("SHEPHERD_SSH_CONNECT_TIMEOUT", "0s")],
            "ssh-connect-timeout",
        ),
        (
            vec!["--agent-endpoint", "x:1", "--history-retention", "0s"],
            vec![],
            "history-retention: must be more than zero",
        ),
        (
            vec![
                "--agent-endpoint",
                "x:1",
                "--history-retention",
                "ninety days",
            ],
            vec![],
            "--history-retention",
        ),
    ];
    for (args, env, want) in cases {
        let o = shepherd()
            .args(base)
            .args(&args)
            .envs(env.clone())
            .output()
            .unwrap();
        assert!(!o.status.success(), "{args:?} {env:?} succeeded");
        assert!(
            stderr(&o).contains(want),
            "{args:?} {env:?}: want {want:?} in {}",
            stderr(&o)
        );
    }

    // Static provider: inventory and SSH credentials are required; a key file others can
    // read is refused.
    let key = dir.path().join("id");
    std::fs::write(&key, "x").unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let agent = dir.path().join("agent");
    std::fs::write(&agent, "#!/bin/sh\n").unwrap();
    let static_base = [
        "run",
        "--migrate",
        "--database",
        &db,
        "--agent-endpoint",
        "x:1",
    ];
    let agent_flag = ["--agent-executable", agent.to_str().unwrap()];
    let inventory = ["--static-inventory", "file:///nonexistent.json"];
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec![], "agent-executable: is required"),
        (agent_flag.to_vec(), "static-inventory: is required"),
        (
            [&agent_flag[..], &inventory[..]].concat(),
            "ssh-key: is required unless ssh-password is set",
        ),
        (
            [
                &agent_flag[..],
                &inventory[..],
                &["--ssh-key", key.to_str().unwrap()],
            ]
            .concat(),
            "chmod 400",
        ),
    ];
    for (args, want) in cases {
        let o = shepherd().args(static_base).args(&args).output().unwrap();
        assert!(!o.status.success(), "{args:?} succeeded");
        assert!(
            stderr(&o).contains(want),
            "{args:?}: want {want:?} in {}",
            stderr(&o)
        );
    }
}

#[test]
fn config_file_is_below_flags_and_environment() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("s.db").display());
    let config = dir.path().join("shepherd.toml");
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        shepherd()
            .args([
                "run",
                "--provider",
                "sim",
                "--migrate",
                "--database",
                &db,
                "--config",
            ])
            .arg(&config)
            .args(extra)
            .envs(env.iter().copied())
            .output()
            .unwrap()
    };
    // A bad value in the file is reported like a bad flag.
    std::fs::write(
        &config,
        "agent-endpoint = \"x:1\"\nprovisioner-creation-rate = \"often\"\n",
    )
    .unwrap();
    let o = run(&[], &[]);
    refused(&o, "--provisioner-creation-rate");
    // A flag or an environment variable overrides the file, so the bad value is never read;
    // the next error (a bad sim rate from the file) shows the file's other keys still apply.
    std::fs::write(
        &config,
        "agent-endpoint = \"x:1\"\nprovisioner-creation-rate = \"often\"\nsim-silent-agent-rate = 3.5\n",
    )
    .unwrap();
    for o in [
        run(&["--provisioner-creation-rate", "1s,1"], &[]),
        run(&[], &[("SHEPHERD_PROVISIONER_CREATION_RATE", "1s,1")]),
    ] {
        refused(&o, "sim silent agent rate: 3.5");
    }
    // Unknown keys and wrong types are refused.
    for (file, want) in [
        (
            "agent-endpont = \"x:1\"\n",
            "unknown setting \"agent-endpont\"",
        ),
        (
            "agent-endpoint = [1]\n",
            "must be a string, number or boolean",
        ),
    ] {
        std::fs::write(&config, file).unwrap();
        refused(&run(&[], &[]), want);
    }
    // SHEPHERD_CONFIG names the file too.
    std::fs::write(
        &config,
        "agent-endpoint = \"x:1\"\nsim-machines = \"many\"\n",
    )
    .unwrap();
    let o = shepherd()
        .args(["run", "--provider", "sim", "--database", &db])
        .env("SHEPHERD_CONFIG", &config)
        .output()
        .unwrap();
    refused(&o, "--sim-machines");
}

/// The database's counts; `None` while `shepherd run` has not created and migrated it yet.
async fn counts(url: &str) -> Option<StatusCounts> {
    let db = Bmdb::open(url).await.ok()?;
    let c = db.status_counts().await.unwrap();
    db.close().await;
    Some(c)
}

/// Waits until `done(counts)`, then SIGTERMs the child and checks it exits cleanly with no
/// sessions or work left behind.
async fn run_until_then_terminate(
    mut child: Child,
    url: &str,
    done: impl Fn(&StatusCounts) -> bool,
) -> StatusCounts {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            panic!("shepherd run exited early with {status}: {}", stderr(&out));
        }
        let c = counts(url).await;
        if c.as_ref().is_some_and(&done) {
            break;
        }
        assert!(Instant::now() < deadline, "no progress: {c:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal(&child, "TERM");
    let started = Instant::now();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "exit {}: {}",
        out.status,
        stderr(&out)
    );
    assert!(started.elapsed() < Duration::from_secs(15), "slow shutdown");
    let c = counts(url).await.unwrap();
    assert_eq!(
        c.sessions_live + c.sessions_expired,
        0,
        "sessions left: {c:?}"
    );
    assert!(c.work.iter().all(|(_, n)| *n == 0), "work left: {c:?}");
    c
}

/// `shepherd tasks --at base`: its output, after checking it exited 0 (no task failed or
/// stale).
fn tasks_at(base: &str) -> String {
    let o = shepherd().args(["tasks", "--at", base]).output().unwrap();
    let out = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(o.status.success(), "shepherd tasks: {}\n{out}", stderr(&o));
    out
}

/// A converged `shepherd run` shows every loop as a task, none failed or stale, through
/// `shepherd tasks` (its `/tasks.json`); then it shuts down cleanly.
async fn sim_run_converges_and_shuts_down(url: &str) {
    let mut child = shepherd()
        .args([
            "run",
            "--provider",
            "sim",
            "--sim-machines",
            "30",
            "--migrate",
            "--database",
            url,
        ])
        .args([
            "--agent-endpoint",
            "bmaas.test:443",
            "--provisioner-max-machines",
            "0",
        ])
        .args([
            "--provisioner-reconcile-rate",
            "100ms,1",
            "--provisioner-creation-rate",
            "1ms,30",
        ])
        .args([
            "--initializer-parallelism",
            "4",
            "--initializer-db-rate",
            "1ms,8",
        ])
        .args(["--sim-takeover-time", "20ms"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = announced(&mut child, "shepherd run: metrics at ");
    let base = metrics.strip_suffix("/metrics").unwrap().to_string();
    let c = run_until_then_terminate(child, url, |c| {
        let converged = c.agent_started == 30 && c.heartbeating == 30;
        if converged {
            let tasks = tasks_at(&base);
            for task in [
                "provisioner",
                "updater",
                "initializer",
                "recoverer",
                "recovery-brake",
                "fleet-statistics",
            ] {
                let line = tasks.lines().find(|l| l.starts_with(&format!("{task} ")));
                assert!(line.is_some(), "{task} missing in\n{tasks}");
            }
        }
        converged
    })
    .await;
    assert_eq!(c.provided, 30);
}

shepherd_bmdb::url_conformance_tests!(sim_run_converges_and_shuts_down);

#[tokio::test]
async fn static_run_takes_a_real_sshd_over() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("s.db").display());
    // The operator's key is generated by shepherd itself on first start; here we create it
    // first so the machine can trust it.
    let entry = serde_json::json!({"ID": "rack1-box1", "Location": "rack1"});
    let common::SshdMachine {
        sshd,
        key_path,
        inventory,
    } = common::sshd_machine(dir.path(), entry);
    let agent = shepherd_loops::testing::test_agent_path();
    let target = sshd.dir().join("agent");
    let config = dir.path().join("shepherd.toml");
    std::fs::write(
        &config,
        format!(
            "provider = \"static\"\nstatic-inventory = \"file://{}\"\nagent-executable = \"{}\"\n\
             agent-target-path = \"{}\"\nagent-endpoint = \"bmaas.test:443\"\nssh-key = \"{}\"\n\
             ssh-user = \"{}\"\nssh-connect-timeout = \"10s\"\nprovisioner-reconcile-rate = \"100ms,1\"\n\
             provisioner-creation-rate = \"1ms,1\"\ninitializer-db-rate = \"10ms,1\"\nmigrate = true\n",
            inventory.display(),
            agent.display(),
            target.display(),
            key_path.display(),
            std::env::var("USER").unwrap_or_else(|_| "root".into()),
        ),
    )
    .unwrap();
    let child = shepherd()
        .args(["run", "--database", &url, "--config"])
        .arg(&config)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let c = run_until_then_terminate(child, &url, |c| c.agent_started == 1).await;
    assert_eq!(c.provided, 1);
    assert!(Path::new(&target).exists());
    assert_eq!(
        std::fs::read(&target).unwrap(),
        std::fs::read(&agent).unwrap()
    );
}

#[test]
fn demo_converges_and_prints_a_summary() {
    let out = demo(&[
        "--machines=60",
        "--takeover-time=10ms",
        "--silent-agent-rate=0.1",
        "--connect-failure-rate=0.1",
        "--timeout=90s",
    ]);
    let value = |name: &str| summary_value(&out, name);
    assert_eq!(value("machines provided"), "60");
    assert_eq!(value("agents heartbeating"), "60");
    // Heartbeats and reports came from the real agent code through the real server.
    assert_eq!(value("hardware reports stored"), "60");
    assert!(value("time to converge").ends_with(" s"), "{out}");
    // Failures were injected, retried and recovered from.
    let finished: u64 = value("takeovers finished").parse().unwrap();
    assert!(finished >= 60, "{out}");
}

/// Runs `shepherd demo` with `args` and its operator view on a free port; its summary, once it
/// succeeded.
fn demo(args: &[&str]) -> String {
    let o = shepherd()
        .arg("demo")
        .args(args)
        .args(["--http-listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    out
}

/// The value of the demo summary's row `name`.
fn summary_value(out: &str, name: &str) -> String {
    out.lines()
        .find(|l| l.starts_with(name))
        .unwrap_or_else(|| panic!("no {name:?} row in {out}"))[name.len()..]
        .trim()
        .to_string()
}

/// A demo with only its default faults (connect failures, garbage answers, silent agents)
/// fails no heartbeat: an agent that heartbeats before the takeover's ending recorded its key
/// is told to wait, not refused; and only the machines of silent agents are rebooted.
#[test]
fn a_default_demo_fails_no_heartbeat_and_reboots_only_silent_machines() {
    let out = demo(&["--machines=400", "--takeover-time=10ms", "--timeout=120s"]);
    let value = |name: &str| summary_value(&out, name);
    assert_eq!(value("agents heartbeating"), "400");
    assert_eq!(value("agent heartbeats failed"), "0", "{out}");
    assert_eq!(value("  of healthy machines"), "0", "{out}");
}

/// A server that holds some heartbeats longer than the recovery threshold before writing them,
/// as a slow BMDB would, gets no healthy machine rebooted: it reports its trouble and the
/// recoverer does not take that silence for the machines'. The silent agents of the same run
/// are still rebooted: the BMDB's history holds one recovery for each, and no more.
#[test]
fn slow_heartbeat_writes_get_no_healthy_machine_rebooted() {
    let out = demo(&[
        "--machines=200",
        "--takeover-time=10ms",
        "--connect-failure-rate=0",
        "--bad-agent-rate=0",
        "--silent-agent-rate=0.05",
        "--slow-heartbeat-share=0.05",
        "--slow-heartbeat-delay=15s",
        "--slow-heartbeat-for=30s",
        "--timeout=150s",
    ]);
    let number = |name: &str| -> u64 { summary_value(&out, name).parse().unwrap() };
    assert!(
        number("heartbeats recorded late (over 5 s)") > 0,
        "the fault was injected: {out}"
    );
    let silent = number("  injected silent agents");
    assert!(silent > 0, "{out}");
    assert_eq!(number("  of healthy machines"), 0, "{out}");
    // "recoveries (reboots)" counts the Finished recoveries of the BMDB's history.
    assert_eq!(number("recoveries (reboots)"), silent, "{out}");
}

/// What the README promises: run the demo, open the web UI it prints, see the machines, scrape
/// the metrics; `--stay` keeps it all up until the operator stops it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_serves_its_web_ui_and_metrics() {
    use std::io::{BufRead, BufReader};
    let mut child = shepherd()
        .args(["demo", "--stay", "--machines", "20"])
        .args(["--takeover-time", "10ms"])
        .args(["--http-listen", "127.0.0.1:0", "--timeout", "90s"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr_pipe = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr_pipe).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut ui, mut converged) = (None, false);
    let deadline = Instant::now() + Duration::from_secs(120);
    while !converged {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = rx.recv_timeout(left).expect("demo never said it converged");
        if let Some(rest) = line.trim().strip_prefix("web UI: ") {
            ui = Some(rest.split(' ').next().unwrap().to_string());
        }
        converged = line.starts_with("converged in");
    }
    let ui = ui.expect("demo printed no web UI address");
    // Every machine heartbeats, and every row and badge says so: a machine the recoverer
    // rebooted (the demo's silent agents) is held back from another reboot for a while, which
    // does not show once its agent heartbeats again. One the recoverer is still writing its
    // reboot down for shows in work for a moment.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let page = common::get_text(&ui).await;
        assert_eq!(page.matches("<tr data-machine=").count(), 20, "{page}");
        if page.matches("data-state=\"heartbeating\"").count() == 40 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a machine does not show heartbeating: {page}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let metrics_url = ui.replace("/machines", "/metrics");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let metrics = reqwest::get(&metrics_url).await.unwrap();
        let metrics = metrics.text().await.unwrap();
        if metrics.contains("shepherd_fleet_machines_heartbeating 20")
            && metrics.contains("shepherd_recovery_brake_engaged 0")
        {
            assert!(metrics.contains("bmdb_work_finished_total{"), "{metrics}");
            assert!(
                metrics.contains("shepherd_recoverer_reboots_total{in_a_row=\"last\"} 0"),
                "{metrics}"
            );
            // The server's write backlog and refusals (none in a healthy demo).
            for series in [
                "shepherd_server_heartbeats_in_flight ",
                "shepherd_server_heartbeats_refused_total{cause=\"shed\"} 0",
                "shepherd_server_heartbeat_trouble ",
            ] {
                assert!(metrics.contains(series), "{series}: {metrics}");
            }
            break;
        }
        assert!(Instant::now() < deadline, "{metrics}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // A healthy fleet: the page says the recovery brake is released, and at what share it
    // would engage.
    let page = common::get_text(&ui).await;
    assert!(
        page.contains(r#"id="brake" data-engaged="false""#) && page.contains("engages above 50%"),
        "{page}"
    );
    // Pages over plain HTTP carry the security headers, without HSTS.
    let answer = reqwest::get(&ui).await.unwrap();
    assert_eq!(answer.headers()["x-content-type-options"], "nosniff");
    let csp = answer.headers()["content-security-policy"]
        .to_str()
        .unwrap();
    assert!(
        csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'none'"),
        "{csp}"
    );
    assert!(answer.headers().get("strict-transport-security").is_none());
    // The overview names the server reporting its heartbeats, clean.
    let overview = common::get_text(&ui.replace("/machines", "/overview")).await;
    assert!(
        overview.contains(r#"id="heartbeat-writers""#)
            && overview.contains(r#"data-trouble="false""#),
        "{overview}"
    );
    assert!(
        child.try_wait().unwrap().is_none(),
        "--stay keeps the demo up"
    );
    signal(&child, "INT");
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("agents heartbeating"));
}

#[test]
fn config_print_shows_merged_settings_with_sources_and_no_secrets() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("shepherd.toml");
    std::fs::write(
        &config,
        "ssh-user = \"deploy\"\ninitializer-parallelism = 4\nssh-password = \"hunter2\"\nsession-interval = \"9s\"\n\
         ironic-url = \"http://ironic.example:6385\"\nironic-user = \"shepherd\"\nironic-password = \"ir0nic-pw\"\n\
         ironic-extra = \"pool=shepherd\"\n",
    )
    .unwrap();
    let out = shepherd()
        .args(["config", "print", "run", "--config"])
        .arg(&config)
        .args(["--session-interval", "7s"])
        .env(
            "SHEPHERD_DATABASE",
            "postgres://shepherd:s3cret@db.example/bmdb",
        )
        .env("SHEPHERD_SSH_USER", "ops")
        .env("SHEPHERD_EQUINIX_API_TOKEN", "eqx-t0ken")
        .env("SHEPHERD_IRONIC_DEPLOYMENT", "site-b")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    for line in [
        "ironic-url = \"http://ironic.example:6385\"  # config file",
        "ironic-password = \"<redacted>\"  # config file",
        "ironic-deployment = \"site-b\"  # environment SHEPHERD_IRONIC_DEPLOYMENT",
        "ironic-extra = \"pool=shepherd\"  # config file",
        "ironic-deploy-wait = \"5m\"  # default",
        "initializer-parallelism = 4  # config file",
        "ssh-user = \"ops\"  # environment SHEPHERD_SSH_USER",
        "session-interval = \"7s\"  # flag",
        "ssh-password = \"<redacted>\"  # config file",
        "database = \"postgres://shepherd:<redacted>@db.example/bmdb\"  # environment SHEPHERD_DATABASE",
        "recoverer-db-rate = \"250ms,8\"  # default",
        "# agent-executable is not set",
        "equinix-api-token = \"<redacted>\"  # environment SHEPHERD_EQUINIX_API_TOKEN",
    ] {
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    assert!(
        !text.contains("hunter2") && !text.contains("s3cret") && !text.contains("ir0nic-pw"),
        "{text}"
    );
    // The output is TOML a config file can start from.
    let table: toml::Table = text.parse().expect("valid TOML");
    assert_eq!(table["initializer-parallelism"].as_integer(), Some(4));

    // Bad values and unknown keys name the setting.
    for (command, file, want) in [
        (
            "run",
            "initializer-parallelism = \"many\"\n",
            "--initializer-parallelism",
        ),
        (
            "server",
            "initialiser-parallelism = 2\n",
            "unknown setting \"initialiser-parallelism\"",
        ),
    ] {
        std::fs::write(&config, file).unwrap();
        let print = ["config", "print", command, "--config"];
        refused(&shepherd().args(print).arg(&config).output().unwrap(), want);
    }
}

#[test]
fn json_logs_carry_the_work_span() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("s.db").display());
    let pace = Pace {
        reconcile_rate: "100ms,1",
        creation_rate: "1ms,3",
        claim_rate: "10ms,4",
        ..Pace::default()
    };
    let child = sim_replica(&db, 3, "50ms", pace)
        .args([
            "--migrate",
            "--sim-connect-failure-rate",
            "1",
            "--log-format",
            "json",
        ])
        .env("SHEPHERD_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_secs(4));
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().unwrap();
    let logs = stderr(&out);
    let failures: Vec<serde_json::Value> = logs
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .filter(|v: &serde_json::Value| v["fields"]["message"] == "processing failed")
        .collect();
    assert_eq!(failures.len(), 3, "one failure per machine:\n{logs}");
    for f in failures {
        let span = &f["span"];
        assert_eq!(span["name"], "work");
        assert_eq!(span["process"], "ShepherdAgentStart");
        assert!(
            span["machine"]
                .as_str()
                .unwrap()
                .parse::<uuid::Uuid>()
                .is_ok(),
            "{f}"
        );
        assert!(!span["provider_id"].as_str().unwrap().is_empty(), "{f}");
        assert_eq!(f["level"], "WARN");
    }
}

/// The example configurations under `deploy/` are accepted as they are (every key known, every
/// value valid), and the example inventory is one the static provider reads.
#[tokio::test]
async fn deploy_examples_are_valid() {
    let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy");
    for site in ["single-site-sqlite", "replicas-postgres"] {
        for command in ["run", "server"] {
            let file = deploy.join(site).join(format!("{command}.toml"));
            let out = shepherd()
                .args(["config", "print", command, "--config"])
                .arg(&file)
                .output()
                .unwrap();
            assert!(out.status.success(), "{}: {}", file.display(), stderr(&out));
            let text = String::from_utf8(out.stdout).unwrap();
            assert!(text.contains("# config file"), "{text}");
        }
    }
    for unit in ["shepherd-run", "shepherd-server"] {
        let text = std::fs::read_to_string(deploy.join(format!("systemd/{unit}.service"))).unwrap();
        let command = unit.trim_start_matches("shepherd-");
        assert!(
            text.contains(&format!(
                "ExecStart=/usr/bin/shepherd {command} --config /etc/shepherd/{command}.toml"
            )),
            "{text}"
        );
    }
    // The example's BMC password file and variable exist only on a real host, so only the
    // text is checked here (`run` also checks what the entries name at start-up).
    let inventory = std::fs::read(deploy.join("single-site-sqlite/inventory.json")).unwrap();
    let entries = shepherd_provider::static_inventory::parse_inventory(&inventory).unwrap();
    assert_eq!(entries.len(), 3);
}

/// `shepherd run --provider equinix` against the fake Equinix Metal API: it ensures the project
/// SSH key from its own key, turns reservations into devices up to the maximum, records them,
/// and reports its API calls in /metrics; the token never reaches the logs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equinix_run_provisions_from_reservations() {
    use std::io::BufReader;
    let fake = shepherd_equinix::fake::FakeEquinix::start("tok-123456", "proj", 5).await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let agent = dir.path().join("agent");
    std::fs::write(&agent, b"#!/bin/sh\n").unwrap();
    let mut child = shepherd()
        .args([
            "run",
            "--provider",
            "equinix",
            "--migrate",
            "--database",
            &url,
        ])
        .arg(format!("--equinix-api-url={}", fake.url()))
        .args(["--equinix-project-id", "proj"])
        .env("SHEPHERD_EQUINIX_API_TOKEN", "tok-123456")
        .arg(format!("--ssh-key={}", dir.path().join("id").display()))
        .arg(format!("--agent-executable={}", agent.display()))
        .args(
            Pace {
                max_machines: 3,
                reconcile_rate: "100ms,1",
                creation_rate: "1ms,10",
                ..Pace::default()
            }
            .args(),
        )
        .env("SHEPHERD_LOG", "debug")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Debug logs are plentiful: drain them as they come, or the child blocks on a full pipe.
    let stderr_pipe = child.stderr.take().unwrap();
    let logs = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut BufReader::new(stderr_pipe), &mut text);
        text
    });
    let metrics_url = announced(&mut child, "shepherd run: metrics at ");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if counts(&url).await.is_some_and(|c| c.provided == 3) {
            break;
        }
        assert!(child.try_wait().unwrap().is_none(), "shepherd run exited");
        assert!(Instant::now() < deadline, "no devices recorded");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let ours = fake
        .devices()
        .iter()
        .filter(|d| d.hostname.starts_with("shepherd-"))
        .count();
    assert_eq!(ours, 3, "the maximum holds");
    let keys = fake.ssh_keys();
    assert_eq!(keys.len(), 1);
    let key = shepherd_ssh::load_or_generate_key(&dir.path().join("id")).unwrap();
    assert_eq!(
        keys[0].key.trim(),
        shepherd_ssh::public_key_openssh(&key).trim(),
        "the project key is the public half of our SSH key"
    );
    let metrics = reqwest::get(&metrics_url).await.unwrap();
    let metrics = metrics.text().await.unwrap();
    assert!(
        metrics
            .contains("shepherd_equinix_api_calls_total{call=\"create_device\",result=\"ok\"} 3"),
        "{metrics}"
    );
    signal(&child, "TERM");
    let status = child.wait().unwrap();
    let logs = logs.join().unwrap();
    assert!(status.success(), "{logs}");
    assert!(logs.contains("Equinix"), "debug logs were captured");
    assert!(!logs.contains("tok-123456"), "the token was logged");
}

/// A broken Ironic setting, and an Ironic that cannot be reached, stop `run --provider
/// ironic` at start-up with one line naming the setting, before the database is touched.
#[test]
fn ironic_settings_are_checked_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let url = format!("http://127.0.0.1:{}", free_port());
    let run = |extra: &[&str]| {
        shepherd()
            .args([
                "run",
                "--provider",
                "ironic",
                "--migrate",
                "--database",
                &db,
            ])
            .arg(format!("--ssh-key={}", dir.path().join("id").display()))
            .args(["--agent-endpoint", "bmaas.test:443"])
            .arg(format!(
                "--agent-executable={}",
                shepherd_loops::testing::test_agent_path().display()
            ))
            .args(extra)
            .output()
            .unwrap()
    };
    for (extra, want) in [
        (vec![], "ironic-url: is required"),
        (
            vec!["--ironic-url", &url, "--ironic-user", "shepherd"],
            "ironic-password: is required",
        ),
        (
            vec!["--ironic-url", &url, "--ironic-image", "http://img/x.qcow2"],
            "ironic-image-checksum: is required",
        ),
        (
            vec!["--ironic-url", &url, "--ironic-deployment", "has space"],
            "ironic-deployment: must be",
        ),
        (vec!["--ironic-url", &url], "cannot connect"),
    ] {
        refused(&run(&extra), want);
    }
    // An Ironic that does not answer: retried, then one line, with its cause once.
    let out = run(&["--ironic-url", &url]);
    let err = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{err}");
    assert_eq!(lines[0].matches("cannot connect").count(), 1, "{err}");
    assert!(
        !dir.path().join("bmdb.sqlite").exists(),
        "the database was opened before the settings were checked"
    );
}

/// Machines that come bare stop `run` at start-up with one line when nothing can boot them:
/// the bare settings missing, a file that is no live image, and a BMC that answers without a
/// virtual CD (the scripted one has none); a BMC that cannot be reached is only a warning,
/// since it may answer once its machine is recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bare_settings_and_bmcs_are_checked_at_start_up() {
    use shepherd_provider::testing::bmc::{Script, ScriptedBmc};
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let bmc = ScriptedBmc::start(Script::allowing(&["On", "ForceOff"])).await;
    let entry = bmc.entry(dir.path());
    let bare = serde_json::json!({"ImageURL": "https://images.test/os.img",
        "ImageSHA256": "ab".repeat(32), "Disk": "/dev/vda"});
    let inventory = dir.path().join("inventory.json");
    std::fs::write(
        &inventory,
        serde_json::json!([{"ID": "new-1", "Addr": "192.0.2.1:22", "Bare": bare,
            "BMC": {"URL": entry.url, "Username": "admin", "System": entry.system,
                    "PasswordFile": entry.password_file}},
            {"ID": "new-2", "Addr": "192.0.2.2:22", "Bare": bare,
            "BMC": {"URL": format!("http://127.0.0.1:{}", free_port()), "Username": "admin",
                    "System": entry.system, "PasswordFile": entry.password_file}}])
        .to_string(),
    )
    .unwrap();
    let image = shepherd_media::testing::image_with_slots(dir.path());
    let not_an_image = dir.path().join("not.iso");
    std::fs::write(&not_an_image, vec![0u8; 8192]).unwrap();
    let certs = dir.path().join("media");
    shepherd_server::dev_certs(&certs, &["127.0.0.1".to_string()]).unwrap();
    let media_url = format!("https://127.0.0.1:{}", free_port());
    let media = [
        "--bare-media-url",
        &media_url,
        "--bare-media-listen",
        "127.0.0.1:0",
    ];
    let cert = [
        "--bare-media-cert".to_string(),
        certs.join("server.pem").display().to_string(),
        "--bare-media-key".to_string(),
        certs.join("server.key").display().to_string(),
    ];
    let run = |extra: Vec<String>| {
        let mut run = shepherd();
        run.args([
            "run",
            "--provider",
            "static",
            "--migrate",
            "--database",
            &db,
        ])
        .arg(format!("--static-inventory=file://{}", inventory.display()))
        .arg(format!("--ssh-key={}", dir.path().join("id").display()))
        .args(["--agent-endpoint", "bmaas.test:443"])
        .arg(format!(
            "--agent-executable={}",
            shepherd_loops::testing::test_agent_path().display()
        ))
        .args(extra);
        // The scripted BMC answers from this runtime while the process runs; one that does
        // not stop at start-up is killed.
        let mut run = tokio::process::Command::from(run);
        async move {
            let out = run.kill_on_drop(true).output();
            let out = tokio::time::timeout(Duration::from_secs(60), out).await;
            out.expect("start-up did not stop within a minute").unwrap()
        }
    };
    let with = |image: &Path, rest: &[&[String]]| {
        let mut args = vec!["--bare-live-image".to_string(), image.display().to_string()];
        args.extend(media.iter().map(|s| s.to_string()));
        args.extend(rest.concat());
        args
    };
    let cases = [
        (vec![], "bare-live-image: is required"),
        (
            with(&image, &[]),
            "bare-media-cert and bare-media-key: is required",
        ),
        (with(&not_an_image, &[&cert]), "slots named"),
    ];
    for (extra, want) in cases {
        refused(&run(extra).await, want);
    }
    let out = run(with(&image, &[&cert])).await;
    refused(
        &out,
        "1 bare entry names a BMC that cannot boot it, e.g. new-1: ",
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("could not be asked about virtual media") && err.contains("new-2"),
        "no warning about the unreachable BMC: {err}"
    );
    assert!(
        bmc.requests().iter().all(|r| r.what == "GET"),
        "the start-up probe changed the BMC: {:?}",
        bmc.requests()
    );
}
