//! The recoverer's safety settings through the real `shepherd run` binary over a simulated
//! fleet whose agents never heartbeat (as when the BMaaS server is down for all of them):
//! - with the default brake, nothing is rebooted, and the web UI and metrics say why;
//! - with the brake out of the way, each machine is rebooted `--recovery-give-up-after` times
//!   in a row, backing off in between, then left alone; the web UI and metrics show it.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{announced_all, sample, sim_run, ChildGuard};
use shepherd_bmdb::{testing, Bmdb, Process, WorkEvent};

const MACHINES: usize = 20;

/// `shepherd run` over `MACHINES` silent simulated agents, due for recovery one second after
/// their takeover; returns the child and its web UI and metrics addresses.
fn run_silent_fleet(
    url: &str,
    log: &std::path::Path,
    extra: &[&str],
) -> (ChildGuard, String, String) {
    let mut cmd: Command = sim_run(url, MACHINES, "5ms", log);
    cmd.args(["--sim-silent-agent-rate", "1"])
        .args(["--recovery-no-heartbeat-after", "1s"])
        .args(["--recovery-brake-interval", "200ms"])
        .args(["--recoverer-db-rate", "10ms,8"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .args(extra)
        .stdout(Stdio::piped());
    let mut child = ChildGuard(Some(cmd.spawn().unwrap()));
    let mut lines = announced_all(
        child.child(),
        &["shepherd run: web UI at ", "shepherd run: metrics at "],
    );
    let metrics = lines.pop().unwrap();
    (child, lines.pop().unwrap(), metrics)
}

async fn get(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// Polls `url` until `ok` holds for its body, for at most `secs`; shows `log` if it never does.
async fn until(url: &str, secs: u64, log: &std::path::Path, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        let body = get(url).await;
        if ok(&body) {
            return body;
        }
        assert!(
            Instant::now() < deadline,
            "{url} never got there:\n{body}\n{}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn finished_recoveries(db: &Bmdb) -> usize {
    let mut n = 0;
    let ids = db
        .read(|tx| Box::pin(async move { tx.machine_ids(None, 1000).await }))
        .await
        .unwrap();
    for id in ids {
        let history = db
            .read(move |tx| Box::pin(async move { tx.machine_history(id).await }))
            .await
            .unwrap();
        n += history
            .iter()
            .filter(|h| h.process == Process::ShepherdRecovery && h.event == WorkEvent::Finished)
            .count();
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_fleet_is_braked_or_rebooted_a_bounded_number_of_times() {
    let t = testing::sqlite().await;
    let dir = tempfile::tempdir().unwrap();

    // The default brake: every machine is due at once, so nothing is rebooted.
    let log = dir.path().join("braked.log");
    let (child, ui, metrics) = run_silent_fleet(&t.url, &log, &[]);
    let page = until(&ui, 30, &log, |p| {
        p.contains("Recovery brake engaged: 20 machines (100%)")
    })
    .await;
    assert!(page.contains(r#"data-engaged="true""#), "{page}");
    let text = get(&metrics).await;
    assert_eq!(
        sample(&text, "shepherd_recovery_brake_engaged"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, "shepherd_recovery_silent_machines"),
        Some(20.0),
        "{text}"
    );
    // Several more counts and claim rounds, with every machine due by now: still nothing
    // rebooted.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let text = get(&metrics).await;
    assert_eq!(
        sample(&text, "shepherd_recovery_due_machines"),
        Some(20.0),
        "{text}"
    );
    for kind in ["first", "repeated", "last"] {
        let series = format!("shepherd_recoverer_reboots_total{{in_a_row=\"{kind}\"}}");
        assert_eq!(sample(&text, &series), Some(0.0), "{series}: {text}");
    }
    let out = child.terminate();
    assert!(out.status.success());
    assert_eq!(
        finished_recoveries(&t.db).await,
        0,
        "the brake let a reboot through"
    );
    let log = std::fs::read_to_string(&log).unwrap();
    // The brake is logged when it engages, which may be before the last machines of the
    // fleet were taken over (the page and the gauges above show all 20).
    let engaged = log
        .lines()
        .find(|l| l.contains("recovery brake engaged: "))
        .unwrap_or_else(|| panic!("no brake in the log: {log}"));
    assert!(engaged.contains("machines (100%)"), "{engaged}");

    // A fresh fleet (a simulated fleet lives as long as its process) with no brake (more
    // than 100 % cannot be silent), giving up after two reboots in a row.
    t.cleanup().await;
    let t = testing::sqlite().await;
    let log = dir.path().join("unbraked.log");
    let (child, ui, metrics) = run_silent_fleet(
        &t.url,
        &log,
        &[
            "--recovery-brake-share",
            "1",
            "--recovery-give-up-after",
            "2",
            "--recovery-repeat-backoff",
            "1s",
        ],
    );
    let text = until(&metrics, 60, &log, |m| {
        sample(m, "shepherd_recoverer_reboots_total{in_a_row=\"last\"}") == Some(MACHINES as f64)
    })
    .await;
    assert_eq!(
        sample(
            &text,
            "shepherd_recoverer_reboots_total{in_a_row=\"first\"}"
        ),
        Some(MACHINES as f64),
        "{text}"
    );
    // Left alone: the recoverer keeps running and reboots nothing more.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let text = get(&metrics).await;
    assert_eq!(
        sample(&text, "shepherd_recoverer_reboots_total{in_a_row=\"last\"}"),
        Some(MACHINES as f64)
    );
    assert_eq!(
        sample(
            &text,
            "shepherd_recoverer_reboots_total{in_a_row=\"repeated\"}"
        ),
        Some(0.0)
    );
    let page = get(&ui).await;
    assert!(
        page.contains(r#"id="brake" data-engaged="false""#),
        "{page}"
    );
    let id =
        t.db.read(|tx| Box::pin(async move { tx.machine_ids(None, 1).await }))
            .await
            .unwrap()[0];
    let page = get(&ui.replace("/machines", &format!("/machines/{id}"))).await;
    assert!(page.contains(r#"data-field="in_a_row">2<"#), "{page}");
    assert!(
        page.contains("left alone after 2 reboots in a row"),
        "{page}"
    );
    let out = child.terminate();
    assert!(out.status.success());
    assert_eq!(finished_recoveries(&t.db).await, 2 * MACHINES);
    let log = std::fs::read_to_string(&log).unwrap();
    assert_eq!(
        log.matches("leaving it alone until an operator runs `shepherd machines retry")
            .count(),
        MACHINES,
        "{log}"
    );
    t.cleanup().await;
}
