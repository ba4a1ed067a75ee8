//! Fault suite: leases that fence side effects. Two `shepherd run` replicas on one BMDB take
//! over machines (real sshds whose uploads are slow); replica `a` is cut off from
//! Postgres by a silent partition, or paused with SIGSTOP, in the middle of an upload. Every
//! command the machines run is logged with the key that ran it (`ForceCommand`). The same
//! holds for reboots: two replicas' recoverers power-cycle silent machines through Redfish
//! BMCs that are slow to answer, and `a` is paused while it reads a BMC. Asserted:
//! - no machine has side effects of `a` after side effects of `b` (none overlap);
//! - no side effect of `a` started after the last deadline its sessions had in the BMDB;
//! - `a` writes nothing to the BMDB once it is back.
//!
//! The figures are printed as `fence_*` lines for `scripts/fault-figures.sh`.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::ssh_fleet::{open_when_migrated, SideEffect, SshFleet};
use common::{history, shepherd, signal, ChildGuard, Pace};
use shepherd_bmdb::testing::{self, Blackhole};
use shepherd_bmdb::{BackendKind, Bmdb, HistoryEntry, Process, Provided, ProviderKind};
use shepherd_provider::testing::bmc::{Answer, Script, ScriptedBmc};
use uuid::Uuid;

const MACHINES: usize = 3;
/// Each upload waits this long on the machine: a slow link, during which the fault comes.
const UPLOAD_DELAY_MS: u64 = 3000;
/// Each read of replica `a`'s BMCs waits this long before a power-cycle can follow: long
/// enough that `a` cannot power-cycle every machine between the test seeing it read and the
/// fault, even on a loaded CI machine (3 s was not always).
const BMC_READ_DELAY_MS: u64 = 10_000;

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

impl Fault {
    /// The fault of `kind` for a replica of the BMDB at `url`, and the URL that replica uses.
    async fn prepare(kind: Kind, url: &str) -> (Fault, String) {
        match kind {
            Kind::Partition => {
                let upstream = url.split('@').nth(1).unwrap().split('/').next().unwrap();
                let proxy = Blackhole::start(upstream).await;
                let through = proxy.url_through(url, upstream);
                (Fault::Partition(proxy), through)
            }
            Kind::Pause => (Fault::Pause, url.to_string()),
        }
    }

    /// Cuts the replica `child` off, or pauses it.
    async fn inject(&self, child: &std::process::Child, db: &Bmdb) {
        match self {
            Fault::Partition(proxy) => proxy.cut(),
            Fault::Pause => pause_outside_a_write(child, db).await,
        }
    }

    /// Ends the fault.
    fn lift(&self, child: &std::process::Child) {
        match self {
            Fault::Partition(proxy) => proxy.heal(),
            Fault::Pause => signal(child, "CONT"),
        }
    }
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

/// Lets `a` run for a while after its fault ends, then stops both replicas; fails if `a` wrote
/// to the BMDB once back under the sessions `fenced` (every session of `a` if `None`: there is
/// nothing left to do). Returns the whole history.
async fn back_for_a_while(
    db: &Bmdb,
    mut a: ChildGuard,
    b: ChildGuard,
    deadlines: &Deadlines,
    fenced: Option<&HashSet<Uuid>>,
) -> Vec<HistoryEntry> {
    let back = Utc::now();
    // Time for `a` to act, if it still would.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let a_after = history::sessions_of(db, a.child().id()).await.unwrap();
    for replica in [a.terminate(), b.terminate()] {
        assert!(replica.status.success(), "exit: {}", replica.status);
    }
    let every_session: HashSet<Uuid> = deadlines.sessions().union(&a_after).copied().collect();
    let fenced = fenced.unwrap_or(&every_session);
    let history = history::all(db).await;
    let written_after: Vec<_> = history
        .iter()
        .filter(|h| h.session_id.is_some_and(|s| fenced.contains(&s)) && h.at > back)
        .collect();
    assert!(
        written_after.is_empty(),
        "a wrote to the BMDB once back: {written_after:?}"
    );
    history
}

/// Prints the figures of one run (`what`: the side effect and the fault) and returns them:
/// machines with overlapping side effects, and `a`'s side effects after `lease_end`.
fn figures<'e>(
    effects: &'e [SideEffect],
    lease_end: f64,
    what: &str,
) -> (usize, Vec<&'e SideEffect>) {
    let overlapped = overlapping(effects);
    let late: Vec<_> = effects
        .iter()
        .filter(|e| e.replica == "a" && e.at > lease_end)
        .collect();
    println!("fence_overlapping_side_effects_{what} = {overlapped}");
    println!("fence_side_effects_after_lease_{what} = {}", late.len());
    (overlapped, late)
}

/// Pauses `child` (SIGSTOP) at a moment it holds no SQLite write lock. A writer stopped with
/// the lock stops every process of a SQLite site, which `crates/bmdb/tests/leases.rs` tests;
/// here the other replica must be able to go on.
async fn pause_outside_a_write(child: &std::process::Child, db: &Bmdb) {
    for _ in 0..20 {
        signal(child, "STOP");
        if db.backend() != BackendKind::Sqlite {
            return;
        }
        let probe = db.transact(|tx| Box::pin(async move { tx.now().await }));
        let probed = tokio::time::timeout(Duration::from_secs(1), probe).await;
        if probed.is_ok_and(|written| written.is_ok()) {
            return;
        }
        signal(child, "CONT");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("the replica held the SQLite write lock at every try");
}

/// Which fault to inject.
#[derive(Clone, Copy)]
enum Kind {
    Partition,
    Pause,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Partition => "partition",
            Kind::Pause => "pause",
        }
    }
}

async fn fault_during_takeovers(url: &str, kind: Kind) {
    let url = url.to_string();
    let fleet = SshFleet::logging(MACHINES, 500, &["a", "b"], UPLOAD_DELAY_MS);
    let (fault, a_url) = Fault::prepare(kind, &url).await;
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
    fault.inject(a.child(), &db).await;
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
    fault.lift(a.child());
    let history = back_for_a_while(&db, a, b, &deadlines, None).await;
    watcher.abort();

    let effects = fleet.side_effects();
    let what = format!("takeover_{}", kind.name());
    let (overlapped, late) = figures(&effects, lease_end, &what);
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
    let finished = history::exclusive_finishes(&history, Process::ShepherdAgentStart);
    assert_eq!(finished.len(), MACHINES, "{finished:?}");
    db.close().await;
}

/// Silent partitions between replica `a` and Postgres (SQLite has no network to cut): during
/// takeovers, then during reboots, each on a database of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_replica_acts_on_nothing_after_its_lease() {
    let Some(url) = testing::fresh_postgres_database().await else {
        return;
    };
    fault_during_takeovers(&url, Kind::Partition).await;
    let url = testing::fresh_postgres_database().await.unwrap();
    fault_during_reboots(&url, Kind::Partition).await;
}

/// Replica `a` paused (SIGSTOP) for longer than its lease, on either engine.
async fn a_paused_replica_starts_nothing_after_its_lease(url: &str) {
    fault_during_takeovers(url, Kind::Pause).await;
}

/// Machines `box-0`… whose agents went silent, in the BMDB at `url`, migrated here.
async fn silent_static_machines(url: &str, n: usize) -> Bmdb {
    let migrating = shepherd_bmdb::OpenOptions::migrating(true);
    let db = Bmdb::open_with(url, &migrating).await.unwrap();
    let machines = db
        .transact(move |tx| {
            Box::pin(async move {
                let mut ids = Vec::with_capacity(n);
                for i in 0..n {
                    let id = tx.create_machine().await?;
                    let provided = Provided::new(ProviderKind::Static, format!("box-{i}"));
                    tx.set_provided(id, &provided).await?;
                    ids.push(id);
                }
                Ok(ids)
            })
        })
        .await
        .unwrap();
    testing::agents_silent_for_hours(&db, &machines).await;
    db
}

/// A recovering replica: `shepherd run` over the static inventory whose BMCs are `bmcs` (one
/// per machine), logging into `dir`; its recoverer reboots silent machines at once.
fn recovering_replica(
    url: &str,
    dir: &std::path::Path,
    name: &str,
    bmcs: &[ScriptedBmc],
) -> ChildGuard {
    let password = dir.join("bmc-password");
    std::fs::write(&password, "x\n").unwrap();
    let entries: Vec<_> = bmcs
        .iter()
        .enumerate()
        .map(|(i, bmc)| {
            serde_json::json!({
                "ID": format!("box-{i}"),
                // Nothing listens there: the initializer fails fast once a machine is rebooted.
                "Addr": "127.0.0.1:1",
                "BMC": {"URL": bmc.url, "System": "/redfish/v1/Systems/1",
                        "Username": "admin", "PasswordFile": password},
            })
        })
        .collect();
    let inventory = dir.join(format!("inventory-{name}.json"));
    std::fs::write(&inventory, serde_json::Value::from(entries).to_string()).unwrap();
    let child = shepherd()
        .args(["run", "--provider", "static", "--database", url])
        .arg(format!("--static-inventory=file://{}", inventory.display()))
        .arg(format!(
            "--agent-executable={}",
            shepherd_loops::testing::test_agent_path().display()
        ))
        .arg(format!(
            "--ssh-key={}",
            dir.join(format!("id_{name}")).display()
        ))
        .args(Pace::default().args())
        // Longer than any pause: only the lease may stop a reset that was under way.
        .args(["--bmc-timeout", "60s", "--bmc-reboot-wait", "1s"])
        .args([
            "--recovery-brake-share",
            "1",
            // Claims a few times a second: often enough, while seldom holding SQLite's write
            // lock, so that the pause rarely has to wait for a moment without it.
            "--recoverer-db-rate",
            "200ms,2",
        ])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
        .spawn()
        .unwrap();
    ChildGuard(Some(child))
}

/// The resets the BMCs of replica `name` received, as side effects.
fn resets(name: &str, bmcs: &[ScriptedBmc]) -> Vec<SideEffect> {
    let mut effects = Vec::new();
    for (machine, bmc) in bmcs.iter().enumerate() {
        for request in bmc.requests().into_iter().filter(|r| r.what != "GET") {
            effects.push(SideEffect {
                at: request.at,
                machine,
                replica: name.to_string(),
                command: request.what,
            });
        }
    }
    effects
}

/// Replica `a`'s recoverer is cut off or paused while it reads the machines' BMCs, each taking
/// 3 s to answer, until `b` has power-cycled every machine; then it runs on.
async fn fault_during_reboots(url: &str, kind: Kind) {
    let (fault, a_url) = Fault::prepare(kind, url).await;
    let dir = tempfile::tempdir().unwrap();
    let db = silent_static_machines(url, MACHINES).await;
    let (mut a_bmcs, mut b_bmcs) = (Vec::new(), Vec::new());
    for _ in 0..MACHINES {
        let slow = Answer::SlowReads(Duration::from_millis(BMC_READ_DELAY_MS));
        let script = Script::allowing(&["ForceRestart"]);
        a_bmcs.push(
            ScriptedBmc::start(Script {
                answer: slow,
                ..script.clone()
            })
            .await,
        );
        b_bmcs.push(ScriptedBmc::start(script).await);
    }
    let mut a = recovering_replica(&a_url, dir.path(), "a", &a_bmcs);
    let deadlines = Deadlines::default();
    let watcher = deadlines.watch(&db, a.child().id());
    let log = |name: &str| {
        let log = std::fs::read_to_string(dir.path().join(format!("{name}.log")));
        log.unwrap_or_default()
    };
    let read = "replica a to read a BMC";
    testing::eventually(read, Duration::from_secs(60), async || {
        let reading = a_bmcs.iter().any(|b| !b.requests().is_empty());
        testing::when(reading, log("a"))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    fault.inject(a.child(), &db).await;
    let a_sessions = deadlines.sessions();
    // A machine a power-cycled before the fault, under its lease, is not silent any more.
    let done_by_a: HashSet<usize> = resets("a", &a_bmcs).iter().map(|r| r.machine).collect();
    assert!(
        done_by_a.len() < MACHINES,
        "a reset every machine before the fault"
    );
    let b = recovering_replica(url, dir.path(), "b", &b_bmcs);
    let everything = "replica b to power-cycle every machine a left";
    testing::eventually(everything, Duration::from_secs(60), async || {
        let cycled: HashSet<usize> = resets("b", &b_bmcs).iter().map(|r| r.machine).collect();
        testing::when(cycled.len() + done_by_a.len() >= MACHINES, log("b"))
    })
    .await;
    let lease_end = seconds(deadlines.last_of(&a_sessions));
    fault.lift(a.child());
    // Once back, `a` may take new work under a new session, never under those it held.
    back_for_a_while(&db, a, b, &deadlines, Some(&a_sessions)).await;
    watcher.abort();

    let mut effects = resets("a", &a_bmcs);
    effects.extend(resets("b", &b_bmcs));
    effects.sort_by(|x, y| x.at.total_cmp(&y.at));
    let what = format!("reboot_{}", kind.name());
    let (overlapped, late) = figures(&effects, lease_end, &what);
    let a_log = log("a");
    assert_eq!(overlapped, 0, "overlapping resets: {effects:#?}\n{a_log}");
    assert!(
        late.is_empty(),
        "resets of a after its lease ended at {lease_end}: {late:?}\n{a_log}"
    );
    db.close().await;
}

/// Replica `a`'s recoverer paused (SIGSTOP) for longer than its lease, on either engine.
async fn a_paused_recoverer_resets_nothing_after_its_lease(url: &str) {
    fault_during_reboots(url, Kind::Pause).await;
}

shepherd_bmdb::url_conformance_tests!(
    a_paused_replica_starts_nothing_after_its_lease,
    a_paused_recoverer_resets_nothing_after_its_lease
);
