//! Fault suite: the SQLite BMDB's disk fills up mid-run and is freed again. `shepherd demo`
//! (every loop, the server and real agent code over one SQLite file) runs with its temporary
//! directory on a small tmpfs and no injected failures; the disk is filled while machines are
//! being taken over. Asserted: the cause is printed, the fleet converges once space is back
//! with the first commit within seconds of it, no machine got a Failed entry or a backoff for
//! it, and the database is whole. Mounting needs root, as CI runs.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::Duration;

use chrono::Utc;
use common::{shepherd, ChildGuard};
use shepherd_bmdb::testing::SmallDisk;
use shepherd_bmdb::{Bmdb, Process, WorkEvent};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_penalises_no_machine_and_the_fleet_converges_once_freed() {
    let disk = SmallDisk::mount("64m");
    let mut demo = ChildGuard(Some(
        shepherd()
            .args(["demo", "--machines", "300", "--takeover-time", "300ms"])
            .args([
                "--http-listen",
                "127.0.0.1:0",
                "--keep",
                "--timeout",
                "120s",
            ])
            .args(["--silent-agent-rate", "0", "--connect-failure-rate", "0"])
            .args(["--bad-agent-rate", "0"])
            .env("TMPDIR", disk.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    // Standard error, line by line, as the demo writes it.
    let (lines, errors) = mpsc::channel();
    let stderr = demo.child().stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if lines.send(line).is_err() {
                return;
            }
        }
    });
    let mut seen = Vec::new();
    let mut wait_for_line = |want: &str, within: Duration| {
        let deadline = std::time::Instant::now() + within;
        while let Ok(line) = errors.recv_timeout(deadline - std::time::Instant::now()) {
            seen.push(line.clone());
            if line.contains(want) {
                return line;
            }
        }
        panic!("no line with {want:?} within {within:?}: {seen:#?}");
    };
    wait_for_line("web UI", Duration::from_secs(60));
    // Takeovers under way (300 ms each), then the disk fills.
    std::thread::sleep(Duration::from_secs(2));
    let filler = disk.fill();
    let told = wait_for_line("disk is full", Duration::from_secs(30));
    std::thread::sleep(Duration::from_secs(3));
    std::fs::remove_file(&filler).unwrap();
    let freed = Utc::now();

    let out = demo.0.take().unwrap().wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{seen:#?}");
    assert!(told.contains(&disk.path().display().to_string()), "{told}");
    let kept = stdout
        .lines()
        .find_map(|l| l.strip_prefix("BMDB kept at "))
        .expect("the demo keeps its BMDB");
    let db = Bmdb::open(&format!("sqlite:{kept}")).await.unwrap();
    let history = shepherd_bmdb::testing::all_history(&db).await;
    // Penalised: a Failed entry, or a reboot (no agent here is silent but for the outage).
    let failed: Vec<_> = history
        .iter()
        .filter(|h| {
            h.event == WorkEvent::Failed
                || (h.process == Process::ShepherdRecovery && h.event == WorkEvent::Finished)
        })
        .collect();
    let first_after = history
        .iter()
        .map(|h| h.at)
        .filter(|at| *at >= freed)
        .min()
        .expect("commits after space returned");
    let first_commit_s = (first_after - freed).num_milliseconds() as f64 / 1000.0;
    let backoffs = db
        .read(|tx| {
            Box::pin(async move {
                let ids = tx.machine_ids(None, 1000).await?;
                let mut held = Vec::new();
                for id in ids {
                    held.extend(tx.machine_backoffs(id).await?);
                }
                Ok(held)
            })
        })
        .await
        .unwrap();
    let problems = shepherd_bmdb::testing::integrity_problems(&db).await;
    println!("disk_full_first_commit_after_space_s = {first_commit_s:.2}");
    let mut penalised: Vec<_> = failed.iter().map(|h| h.machine_id).collect();
    penalised.extend(backoffs.iter().map(|b| b.machine_id));
    penalised.sort();
    penalised.dedup();
    println!("disk_full_penalised_machines = {}", penalised.len());
    assert!(
        failed.is_empty(),
        "machines failed or rebooted for a full disk: {failed:#?}"
    );
    assert!(
        backoffs.is_empty(),
        "machines backed off for a full disk: {backoffs:#?}"
    );
    assert!(problems.is_empty(), "{problems:?}");
    assert!(
        first_commit_s <= 5.0,
        "the first commit came {first_commit_s} s after space returned"
    );
    db.close().await;
    std::fs::remove_dir_all(std::path::Path::new(kept).parent().unwrap()).ok();
}
