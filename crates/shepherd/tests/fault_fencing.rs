//! Fault suite: leases that fence side effects. Two `shepherd run` replicas on one BMDB take
//! over machines (real sshds whose uploads are slow); replica `a` is cut off from
//! Postgres by a silent partition, or paused with SIGSTOP, in the middle of an upload. Every
//! command the machines run is logged with the key that ran it (`ForceCommand`). Asserted:
//! - no machine has side effects of `a` after side effects of `b` (none overlap);
//! - no side effect of `a` started after the last deadline its sessions had in the BMDB;
//! - `a` writes nothing to the BMDB once it is back.
//!
//! The figures are printed as `fence_*` lines for `scripts/fault-figures.sh`.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::ssh_fleet::{open_when_migrated, SideEffect, SshFleet};
use common::{history, signal, ChildGuard, Pace};
use shepherd_bmdb::testing::{self, Blackhole};
use shepherd_bmdb::{Bmdb, Process};
use uuid::Uuid;

const MACHINES: usize = 3;
/// Each upload waits this long on the machine: a slow link, during which the fault comes.
const UPLOAD_DELAY_MS: u64 = 3000;

/// The deadlines the BMDB gave the sessions of one process, polled in the background.
#[derive(Clone, Default)]
struct Deadlines(Arc<Mutex<HashMap<Uuid, DateTime<Utc>>>>);

impl Deadlines {
    /// Polls the sessions of `pid` every 100 ms until the returned task is aborted.
    fn watch(&self, db: &Bmdb, pid: u32) -> tokio::task::JoinHandle<()> {
        let (db, seen, pid) = (db.clone(), self.0.clone(), format!("pid={pid} "));
        tokio::spawn(async move {
            loop {
                let read = db.read(|tx| Box::pin(async move { tx.sessions().await }));
                if let Ok(sessions) = read.await {
                    let mut seen = seen.lock().unwrap();
                    for s in sessions.iter().filter(|s| s.runtime_info.contains(&pid)) {
                        let d = seen.entry(s.session_id).or_insert(s.deadline);
                        *d = (*d).max(s.deadline);
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    }

    /// The sessions seen so far.
    fn sessions(&self) -> HashSet<Uuid> {
        self.0.lock().unwrap().keys().copied().collect()
    }

    /// The latest deadline of `sessions`.
    fn last_of(&self, sessions: &HashSet<Uuid>) -> DateTime<Utc> {
        let seen = self.0.lock().unwrap();
        let deadlines = sessions.iter().filter_map(|s| seen.get(s));
        *deadlines.max().expect("the process had sessions")
    }
}

/// A fault on replica `a`: its partition, or its pause.
enum Fault {
    Partition(Blackhole),
    Pause,
}

fn seconds(t: DateTime<Utc>) -> f64 {
    t.timestamp_micros() as f64 / 1e6
}

/// Machines where a side effect of `a` came after one of `b`.
fn overlapping(effects: &[SideEffect]) -> usize {
    let mut b_seen = HashSet::new();
    let mut overlapped = HashSet::new();
    for e in effects {
        match e.replica.as_str() {
            "b" => {
                b_seen.insert(e.machine);
            }
            _ if b_seen.contains(&e.machine) => {
                overlapped.insert(e.machine);
            }
            _ => {}
        }
    }
    overlapped.len()
}

/// Which fault to inject.
#[derive(Clone, Copy)]
enum Kind {
    Partition,
    Pause,
}

async fn fault_during_takeovers(url: &str, kind: Kind) {
    let url = url.to_string();
    let fleet = SshFleet::logging(MACHINES, 500, &["a", "b"], UPLOAD_DELAY_MS);
    let (fault, a_url) = match kind {
        Kind::Partition => {
            let upstream = url.split('@').nth(1).unwrap().split('/').next().unwrap();
            let proxy = Blackhole::start(upstream).await;
            let through = proxy.url_through(&url, upstream);
            (Fault::Partition(proxy), through)
        }
        Kind::Pause => (Fault::Pause, url.clone()),
    };
    let mut a = ChildGuard(Some(fleet.replica(&a_url, "a")));
    let db = open_when_migrated(&url).await;
    let deadlines = Deadlines::default();
    let watcher = deadlines.watch(&db, a.child().id());

    // The fault comes while `a` uploads to a machine it holds.
    let upload = "replica a to start an upload";
    let first = testing::eventually(upload, Duration::from_secs(60), async || {
        let effects = fleet.side_effects();
        let started = effects.into_iter().find(|e| e.replica == "a");
        started.ok_or_else(|| fleet.log("a"))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    match &fault {
        Fault::Partition(proxy) => proxy.cut(),
        Fault::Pause => signal(a.child(), "STOP"),
    }
    let a_sessions = deadlines.sessions();
    let pace = Pace {
        workers: 1,
        ..Pace::default()
    };
    let b = ChildGuard(Some(fleet.replica_with(&url, "b", pace)));

    let everything = "replica b to take over every machine";
    testing::eventually(everything, Duration::from_secs(90), async || {
        let c = db.status_counts().await.unwrap();
        testing::when(c.agent_started == MACHINES as i64, (c, fleet.log("b")))
    })
    .await;
    let lease_end = seconds(deadlines.last_of(&a_sessions));
    match &fault {
        Fault::Partition(proxy) => proxy.heal(),
        Fault::Pause => signal(a.child(), "CONT"),
    }
    let back = Utc::now();
    // Time for `a` to act, if it still would.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let a_pid = a.child().id();
    let a_after = history::sessions_of(&db, a_pid).await.unwrap();
    for replica in [a.terminate(), b.terminate()] {
        assert!(replica.status.success(), "exit: {}", replica.status);
    }
    watcher.abort();

    let effects = fleet.side_effects();
    let overlapped = overlapping(&effects);
    let late: Vec<_> = effects
        .iter()
        .filter(|e| e.replica == "a" && e.at > lease_end)
        .collect();
    let all_a: HashSet<Uuid> = deadlines.sessions().union(&a_after).copied().collect();
    let history = history::all(&db).await;
    let written_after: Vec<_> = history
        .iter()
        .filter(|h| h.session_id.is_some_and(|s| all_a.contains(&s)) && h.at > back)
        .collect();
    let kind = match kind {
        Kind::Partition => "partition",
        Kind::Pause => "pause",
    };
    println!("fence_overlapping_side_effects_{kind} = {overlapped}");
    println!("fence_side_effects_after_lease_{kind} = {}", late.len());
    let summary = format!("first upload of a: {first:?}\nside effects: {effects:#?}");
    assert!(
        effects
            .iter()
            .any(|e| e.replica == "b" && e.machine == first.machine),
        "the machine a was uploading to was never taken over by b; {summary}"
    );
    assert_eq!(overlapped, 0, "overlapping side effects; {summary}");
    assert!(
        late.is_empty(),
        "side effects of a after its lease ended at {lease_end}: {late:?}; {summary}"
    );
    assert!(
        written_after.is_empty(),
        "a wrote to the BMDB once back: {written_after:?}"
    );
    let finished = history::exclusive_finishes(&history, Process::ShepherdAgentStart);
    assert_eq!(finished.len(), MACHINES, "{finished:?}");
    db.close().await;
}

/// A silent partition between replica `a` and Postgres (SQLite has no network to cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica_starts_nothing_after_its_lease() {
    if let Some(url) = testing::fresh_postgres_database().await {
        fault_during_takeovers(&url, Kind::Partition).await;
    }
}

/// Replica `a` paused (SIGSTOP) for longer than its lease, on either engine.
async fn a_paused_replica_starts_nothing_after_its_lease(url: &str) {
    fault_during_takeovers(url, Kind::Pause).await;
}

shepherd_bmdb::url_conformance_tests!(a_paused_replica_starts_nothing_after_its_lease);
