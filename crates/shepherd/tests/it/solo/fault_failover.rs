//! A database failover on a real Patroni cluster (`common::patroni`: three PostgreSQL nodes,
//! etcd, HAProxy routing to the primary): two `shepherd run --provider sim` replicas and a
//! `shepherd server` share the cluster through HAProxy while the primary fails.
//!
//! Three ways the primary goes away: its postmaster killed (SIGKILL), the whole node killed
//! (Patroni too, so the leader key must expire), and a planned `patronictl switchover`. What
//! must hold in each: no two sessions ever hold the same work; no work ends Failed
//! (the simulated fleet injects no failure, and a failover is the database's unavailability:
//! work is released, not failed); every machine is provided and taken over once by the end;
//! each replica commits again within 5 s of HAProxy reaching the new primary; no replica sees
//! the provider and the BMDB disagree; and everything exits cleanly.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::patroni::PatroniCluster;
use common::{history, sim_replica, ChildGuard, Pace};
use shepherd_bmdb::{testing, Bmdb, HistoryEntry, Process, WorkEvent};
use uuid::Uuid;

/// Machines of the tests' fleet (the figures run uses 3,000).
const MACHINES: usize = 600;

/// The replicas' session interval: a session lost in the failover is replaced within it.
const SESSION_INTERVAL: Duration = Duration::from_secs(2);
/// How long a simulated takeover takes.
const TAKEOVER: Duration = Duration::from_secs(1);
/// The BMDB's longest wait between two attempts of a transaction (`transaction.rs`).
const TRANSACTION_RETRY_CAP: Duration = Duration::from_millis(500);
/// What this 2-core machine adds: process scheduling, the history read that observes it.
const MARGIN: Duration = Duration::from_millis(1500);

/// How soon after HAProxy reaches the new primary each replica must commit again: a worker
/// may have to replace its session, then take a machine over, and retry the transaction that
/// records it once; beyond that is only the margin. (5 s with these settings.)
fn commit_again_within() -> Duration {
    SESSION_INTERVAL + TAKEOVER + TRANSACTION_RETRY_CAP + MARGIN
}

/// A sim replica on `url`: 16 initializer workers, [`TAKEOVER`]s, sessions every
/// [`SESSION_INTERVAL`].
fn replica(url: &str, server: &str, dir: &std::path::Path, name: &str, machines: usize) -> Child {
    let interval = format!("{}ms", SESSION_INTERVAL.as_millis());
    let pace = Pace {
        workers: 16,
        claim_rate: "10ms,16",
        reconcile_rate: "1s,1",
        creation_rate: "10ms,10",
        chunk_size: 50,
        session_interval: &interval,
        endpoint: server,
        ..Pace::default()
    };
    let takeover = format!("{}ms", TAKEOVER.as_millis());
    sim_replica(url, machines, &takeover, pace)
        .args(["--sim-heartbeat-interval", "5s"])
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join(format!("{name}.log"))).unwrap())
        .spawn()
        .unwrap()
}

/// A replica's counter `name` from its `/metrics`, summed over the series that carry every
/// label of `labels` (`key="value"`).
async fn counter(metrics: &str, name: &str, labels: &[&str]) -> u64 {
    let text = reqwest::get(metrics).await.unwrap().text().await.unwrap();
    let series = format!("{name}{{");
    text.lines()
        .filter(|l| l.starts_with(&series))
        .filter(|l| labels.iter().all(|label| l.contains(label)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// Takeovers a replica was told were committed (finished).
async fn finished_takeovers(metrics: &str) -> u64 {
    let labels = [r#"process="ShepherdAgentStart""#, r#"result="finished""#];
    counter(metrics, "bmdb_work_finished_total", &labels).await
}

/// The initializer's endings (takeovers among them) whose COMMIT a replica saw fail with the
/// connection: the database may have written them.
async fn initializer_endings_in_doubt(metrics: &str) -> u64 {
    let labels = [r#"processor="shepherd-initializer""#];
    counter(metrics, "bmdb_endings_in_doubt_total", &labels).await
}

/// Sessions of the process with this pid; none while the database cannot be read.
async fn sessions_of(db: &Bmdb, pid: u32) -> HashSet<Uuid> {
    history::sessions_of(db, pid).await.unwrap_or_default()
}

/// Whether a history cause names the database rather than the machine.
fn database_cause(cause: &str) -> bool {
    let cause = cause.to_lowercase();
    [
        "read-only",
        "database",
        "postmaster",
        "connection",
        "session expired",
        "shutdown",
        "starting up",
    ]
    .iter()
    .any(|w| cause.contains(w))
}

/// How the primary goes away.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    /// SIGKILL of its postmaster; its Patroni lives and hands the leader key over.
    PostmasterKilled,
    /// SIGKILL of Patroni and the postmaster: the leader key must expire.
    NodeKilled,
    /// `patronictl switchover`: planned.
    Switchover,
}

/// One cluster at a time: each runs three PostgreSQL nodes, and the replicas load them.
static ONE_CLUSTER_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_primary_postmaster_killed_under_load_costs_no_work_and_no_machine() {
    failover_under_load(Fault::PostmasterKilled).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_primary_node_killed_costs_no_work_and_no_machine() {
    failover_under_load(Fault::NodeKilled).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_planned_switchover_costs_no_work_and_no_machine() {
    failover_under_load(Fault::Switchover).await;
}

/// The figures of `bench/results/failover.md` (`scripts/failover-figures.sh`): the first
/// scenario with 3,000 machines. Not a test of its own (the three above assert the same), so
/// CI does not run it twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by scripts/failover-figures.sh"]
async fn failover_figures() {
    let f = failover_with(Fault::PostmasterKilled, 3000).await;
    let md = format!(
        "# Failover figures\n\n\
         A Patroni cluster of three PostgreSQL 15 nodes (synchronous mode, ttl 10 s, \
         primary_start_timeout 0), one etcd and HAProxy checking Patroni's REST API every 0.5 s, \
         all on this 2-core machine with two `shepherd run --provider sim` replicas (3,000 \
         machines, 16 workers each, 1 s takeovers, 2 s sessions) and a `shepherd server`. Once \
         both replicas are at work, the primary's postmaster is killed with SIGKILL. A side probe \
         inserts a row through HAProxy every 100 ms; the rows it was told were committed are \
         counted again at the end; the creations are the most one replica made that the BMDB \
         could not record. Method: `scripts/failover-figures.sh` \
         (`crates/shepherd/tests/it/solo/fault_failover.rs`, `failover_figures`).\n\n\
         failover_writes_unavailable_s = {:.1}\n\
         failover_resume_after_route_s = {:.2}\n\
         failover_lost_acknowledged = {}\n\
         failover_db_caused_failures = {}\n\
         failover_creations_while_unrecordable = {}\n\
         failover_all_machines_done = {}\n",
        f.writes_unavailable.as_secs_f64(),
        f.slowest_resume.as_secs_f64(),
        f.lost_acknowledged,
        f.db_caused_failures,
        f.creations_while_unrecordable,
        u8::from(f.all_machines_done),
    );
    print!("{md}");
    let out =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/results/failover.md");
    std::fs::write(out, md).unwrap();
}

/// What one failover cost.
struct Figures {
    writes_unavailable: Duration,
    slowest_resume: Duration,
    lost_acknowledged: usize,
    db_caused_failures: usize,
    /// The most of one replica.
    creations_while_unrecordable: usize,
    all_machines_done: bool,
}

/// Inserts a row through `url` every 100 ms until `stop`; returns the ids it was told were
/// committed and the longest time between two acknowledged inserts.
async fn probe(url: String, stop: tokio_util::sync::CancellationToken) -> (Vec<i64>, Duration) {
    use sqlx::Connection;
    let mut acknowledged = Vec::new();
    let mut longest_gap = Duration::ZERO;
    let mut last_ok = Instant::now();
    let mut conn: Option<sqlx::PgConnection> = None;
    let mut id = 0i64;
    while !stop.is_cancelled() {
        id += 1;
        if conn.is_none() {
            conn = tokio::time::timeout(Duration::from_secs(1), sqlx::PgConnection::connect(&url))
                .await
                .ok()
                .and_then(Result::ok);
        }
        let written = match conn.as_mut() {
            Some(c) => tokio::time::timeout(
                Duration::from_secs(1),
                sqlx::query("INSERT INTO failover_probe (id) VALUES ($1)")
                    .bind(id)
                    .execute(&mut *c),
            )
            .await
            .is_ok_and(|r| r.is_ok()),
            None => false,
        };
        if written {
            acknowledged.push(id);
            longest_gap = longest_gap.max(last_ok.elapsed());
            last_ok = Instant::now();
        } else {
            conn = None;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (acknowledged, longest_gap)
}

async fn failover_under_load(fault: Fault) {
    let f = failover_with(fault, MACHINES).await;
    assert!(f.all_machines_done);
    assert_eq!(
        f.lost_acknowledged, 0,
        "{fault:?}: acknowledged writes lost"
    );
    assert!(
        f.creations_while_unrecordable <= 1,
        "{fault:?}: a replica created {} machines while the BMDB could not record them",
        f.creations_while_unrecordable
    );
}

async fn failover_with(fault: Fault, machines: usize) -> Figures {
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    let mut cluster = tokio::task::block_in_place(PatroniCluster::start);
    let url = cluster.url();
    let dir = tempfile::tempdir().unwrap();
    let server_log = dir.path().join("server.log");
    let (server, endpoint) =
        common::start_server(common::server(&url, dir.path()), Some(&server_log));
    let db = Bmdb::open(&url).await.unwrap();
    sqlx::query("CREATE TABLE failover_probe (id bigint PRIMARY KEY)")
        .execute(&mut connect(&url).await)
        .await
        .unwrap();
    let stop_probe = tokio_util::sync::CancellationToken::new();
    let probing = tokio::spawn(probe(url.clone(), stop_probe.clone()));
    let mut a = ChildGuard(Some(replica(&url, &endpoint, dir.path(), "a", machines)));
    let mut b = ChildGuard(Some(replica(&url, &endpoint, dir.path(), "b", machines)));
    let pids = [("a", a.child().id()), ("b", b.child().id())];
    let metrics = [
        common::announced(a.child(), "shepherd run: metrics at "),
        common::announced(b.child(), "shepherd run: metrics at "),
    ];
    let log = |name: &str| std::fs::read_to_string(dir.path().join(format!("{name}.log")));
    let mut sessions: HashMap<&str, HashSet<Uuid>> = HashMap::new();
    let note_sessions = async |sessions: &mut HashMap<&str, HashSet<Uuid>>| {
        for (name, pid) in pids {
            sessions
                .entry(name)
                .or_default()
                .extend(sessions_of(&db, pid).await);
        }
    };

    // Under load: both replicas taking machines over.
    let at_work = "both replicas at work";
    shepherd_bmdb::testing::eventually(at_work, Duration::from_secs(120), async || {
        note_sessions(&mut sessions).await;
        let c = db.status_counts().await;
        let busy = c
            .as_ref()
            .is_ok_and(|c| c.agent_started >= (machines / 6) as i64);
        if busy && sessions.values().all(|s| !s.is_empty()) {
            return Ok(());
        }
        for (name, child) in [("a", &mut a), ("b", &mut b)] {
            if let Ok(Some(status)) = child.child().try_wait() {
                panic!(
                    "replica {name} exited ({status}): {}",
                    log(name).unwrap_or_default()
                );
            }
        }
        let tail = |name| {
            let text = log(name).unwrap_or_default();
            let last: Vec<&str> = text.lines().rev().take(5).collect();
            last.join("\n")
        };
        Err(format!(
            "{c:?} sessions {sessions:?}\na: {}\nb: {}",
            tail("a"),
            tail("b")
        ))
    })
    .await;

    // The primary goes away; Patroni promotes the synchronous standby and HAProxy follows
    // its REST check.
    let old = tokio::task::block_in_place(|| match fault {
        Fault::PostmasterKilled => cluster.kill_primary_postmaster(),
        Fault::NodeKilled => cluster.kill_primary_node(),
        Fault::Switchover => cluster.switchover(),
    });
    let killed = Instant::now();
    let routed =
        tokio::task::block_in_place(|| cluster.wait_for_new_primary(old, Duration::from_secs(90)));
    let routed_at = chrono::Utc::now() - (Instant::now() - routed);
    eprintln!(
        "{fault:?}: HAProxy reached the new primary {:?} after the fault",
        routed - killed
    );

    // Each replica commits again soon after: a history entry written by one of its sessions
    // after HAProxy reached the new primary.
    let mut resumed: HashMap<&str, Duration> = HashMap::new();
    common::wait_for("both replicas to commit again", 60, async || {
        note_sessions(&mut sessions).await;
        let recent: Vec<HistoryEntry> = history::all(&db)
            .await
            .into_iter()
            .filter(|h| h.at >= routed_at)
            .collect();
        for (name, ids) in &sessions {
            if resumed.contains_key(name) {
                continue;
            }
            if let Some(first) = recent
                .iter()
                .filter(|h| h.session_id.is_some_and(|s| ids.contains(&s)))
                .map(|h| h.at)
                .min()
            {
                resumed.insert(name, (first - routed_at).to_std().unwrap_or_default());
            }
        }
        (resumed.len() == pids.len()).then_some(())
    })
    .await;
    for (name, after) in &resumed {
        eprintln!("replica {name} committed again {after:?} after the route");
        assert!(
            *after <= commit_again_within(),
            "replica {name} took {after:?} to commit again (limit {:?})",
            commit_again_within()
        );
    }

    // Everything is brought in and taken over by the end.
    common::wait_for("every machine taken over", 240, async || {
        let c = db.status_counts().await.ok()?;
        (c.provided == machines as i64 && c.agent_started == machines as i64).then_some(())
    })
    .await;
    // Every takeover a replica was told was committed is in the history. A replica counts a
    // finish once its answer reached the worker's ending, a moment after the commit made it
    // visible here, so the count is read until it matches (or for a few seconds). Only
    // endings whose COMMIT was cut off by the fault may be in the history unacknowledged.
    let all = history::all(&db).await;
    let finished = history::exclusive_finishes(&all, Process::ShepherdAgentStart);
    let in_history = finished.values().sum::<usize>() as u64;
    let (mut acknowledged_endings, mut in_doubt) = (0, 0);
    for _ in 0..20 {
        (acknowledged_endings, in_doubt) = (0, 0);
        for m in &metrics {
            acknowledged_endings += finished_takeovers(m).await;
            in_doubt += initializer_endings_in_doubt(m).await;
        }
        if acknowledged_endings == in_history {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    eprintln!("{fault:?}: {in_history} takeovers in the history, {acknowledged_endings} acknowledged, {in_doubt} endings in doubt");
    // Machines each replica created at the provider that the BMDB did not record then, read
    // while the replicas still serve their metrics.
    let (mut unrecorded, mut created) = (Vec::new(), 0);
    for m in &metrics {
        let creations = async |outcome: &str| {
            let label = format!("outcome=\"{outcome}\"");
            counter(m, "shepherd_provisioner_creations_total", &[&label]).await
        };
        unrecorded.push(creations("unrecorded").await);
        created += creations("created").await;
    }
    // The counter is live (the one the provisioner keeps): machines were created, each once.
    assert!(
        (1..=machines).contains(&(created as usize)),
        "{created} creations counted for {machines} machines"
    );
    for (name, child) in [("a", a), ("b", b)] {
        let out = child.terminate();
        assert!(
            out.status.success(),
            "replica {name}: {}\n{}",
            out.status,
            log(name).unwrap_or_default()
        );
    }
    let out = server.terminate();
    assert!(out.status.success(), "server: {}", out.status);

    assert_eq!(finished.len(), machines, "machines never taken over");
    assert!(
        acknowledged_endings <= in_history && in_history - acknowledged_endings <= in_doubt,
        "{fault:?}: {acknowledged_endings} takeovers the replicas were told were committed, \
         against {in_history} in the history with {in_doubt} endings in doubt"
    );
    assert!(
        finished.values().all(|&n| n == 1),
        "a machine was taken over twice"
    );
    // The simulated fleet injects no failure: any work that failed, failed for the database.
    let failed: Vec<&HistoryEntry> = all
        .iter()
        .filter(|h| h.event == WorkEvent::Failed)
        .collect();
    let by_database = failed
        .iter()
        .filter(|h| h.cause.as_deref().is_some_and(database_cause))
        .count();
    assert!(
        failed.is_empty(),
        "{fault:?}: {} work ended Failed ({by_database} naming the database), e.g. {:?}",
        failed.len(),
        &failed[..failed.len().min(3)]
    );
    for name in ["a", "b"] {
        let text = log(name).unwrap_or_default();
        assert!(
            !text.contains("disagree"),
            "replica {name} saw the provider and the BMDB disagree"
        );
    }
    let creations_while_unrecordable = unrecorded.into_iter().max().unwrap_or(0) as usize;

    // Every write the probe was told was committed is there.
    stop_probe.cancel();
    let (acknowledged, writes_unavailable) = probing.await.unwrap();
    let present: Vec<i64> = sqlx::query_scalar("SELECT id FROM failover_probe")
        .fetch_all(&mut connect(&url).await)
        .await
        .unwrap();
    let present: HashSet<i64> = present.into_iter().collect();
    let lost_acknowledged = acknowledged
        .iter()
        .filter(|id| !present.contains(id))
        .count();
    db.close().await;
    Figures {
        writes_unavailable,
        slowest_resume: resumed.values().copied().max().unwrap_or_default(),
        lost_acknowledged,
        db_caused_failures: by_database,
        creations_while_unrecordable,
        all_machines_done: finished.len() == machines,
    }
}

/// The Equinix provider against its fake API, two replicas' provisioners through HAProxy, and
/// the whole primary node killed mid-provisioning (an outage longer than the session interval,
/// so the provisioners' sessions expire and recording fails at once rather than waiting): each replica creates at most one device
/// the BMDB cannot record (its pass stops there), and every such orphan is adopted afterwards:
/// one device per reservation, each recorded once.
///
/// The kill comes while each replica waits for a device the fake API answers slowly, so each
/// has one creation in flight: the path that must stop is taken, not left to timing.
/// The devices created while the BMDB could not record them are counted from the fake API's
/// devices, between two points the test knows exactly: just after the kill, and the first
/// session a replica starts on the new primary (no replica creates anything before its own
/// session starts). Observing the new primary from outside instead would lag it, and count
/// devices created, and recorded, after the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_mid_provisioning_costs_at_most_one_unrecorded_device_per_replica() {
    use shepherd_equinix::fake::{Failure, FakeEquinix};
    use shepherd_equinix::{Client, EquinixConfig, EquinixProvider, RetryPolicy};
    use shepherd_loops::limiter::RateSpec;
    use shepherd_loops::provisioner::{Provisioner, ProvisionerConfig, ProvisionerError};
    use shepherd_loops::reconcile::Limits;

    const RESERVATIONS: usize = 300;
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    let mut cluster = tokio::task::block_in_place(PatroniCluster::start);
    let url = cluster.url();
    Bmdb::open_with(&url, &shepherd_bmdb::OpenOptions::migrating(true))
        .await
        .unwrap()
        .close()
        .await;
    let fake = FakeEquinix::start("token", "proj", RESERVATIONS).await;
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIA0000000000000000000000000000000000000000000 shepherd";
    // Set once the primary is dead; then, by the first replica whose session started after
    // that, how many devices the fake held at that moment.
    let killed = std::sync::atomic::AtomicBool::new(false);
    let writable_again = std::sync::OnceLock::<usize>::new();
    let (killed, writable_again, fake_ref) = (&killed, &writable_again, &fake);
    let replica = |name: &'static str| {
        let (url, api) = (url.clone(), fake.url());
        async move {
            let client = Client::new(
                &api,
                "token",
                "proj",
                RetryPolicy::default(),
                Default::default(),
            )
            .unwrap();
            let mut config = EquinixConfig::new("shepherd-", key);
            config.reservation_cache = Duration::ZERO;
            let provider = Arc::new(EquinixProvider::connect(client, config).await.unwrap());
            let provisioner = Provisioner::new(
                provider,
                ProvisionerConfig {
                    limits: Limits::new(0, 20),
                    reconcile_rate: RateSpec::new(Duration::from_millis(200), 1),
                    creation_rate: RateSpec::new(Duration::from_millis(100), 1),
                    creation_parallelism: 1,
                },
            );
            let db = Bmdb::open(&url).await.unwrap();
            let config = shepherd_bmdb::SessionConfig::new(
                name,
                shepherd_bmdb::Processor::ShepherdProvisioner,
            )
            .with_interval(Duration::from_secs(2));
            let (mut unrecorded, started) = (0usize, Instant::now());
            let mut session = None;
            while started.elapsed() < Duration::from_secs(120) {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let s = match session.take() {
                    Some(s) => s,
                    None => {
                        let after_kill = killed.load(std::sync::atomic::Ordering::SeqCst);
                        match db.start_session(config.clone()).await {
                            Ok(s) => {
                                if after_kill {
                                    // Recorded before this replica can create anything more.
                                    let _ = writable_again.set(fake_ref.devices().len());
                                }
                                s
                            }
                            Err(_) => continue,
                        }
                    }
                };
                match provisioner.iterate(&s).await {
                    Ok(r) if r.managed == RESERVATIONS => break,
                    Ok(_) => session = Some(s),
                    Err(e) => {
                        if matches!(e, ProvisionerError::BmdbFailed { .. }) {
                            unrecorded += 1;
                        }
                        // The session may be gone with the old primary: start another.
                        let _ = s.close().await;
                    }
                }
            }
            db.close().await;
            unrecorded
        }
    };
    let db = Bmdb::open(&url).await.unwrap();
    let fail_over = async {
        common::wait_for("provisioning under way", 60, async || {
            let c = db.status_counts().await.ok()?;
            (c.provided >= (RESERVATIONS / 5) as i64).then_some(())
        })
        .await;
        // One creation of each replica in flight when the primary dies: its device is created
        // while the BMDB is down, so it cannot be recorded and must be adopted later.
        for _ in 0..2 {
            fake.fail_next(
                "POST /projects/devices",
                Failure::Slow(Duration::from_secs(3)),
            );
        }
        common::wait_for("both replicas creating a device", 30, async || {
            (fake.pending_failures() == 0).then_some(())
        })
        .await;
        // The kill blocks this task, so the provisioners (run in this same task) wait for it.
        cluster.kill_primary_node();
        let before = fake.devices().len();
        killed.store(true, std::sync::atomic::Ordering::SeqCst);
        let since_kill = Instant::now();
        // Waited for without blocking: the provisioners run in this same task.
        let after = loop {
            if let Some(&after) = writable_again.get() {
                break after;
            }
            assert!(
                since_kill.elapsed() < Duration::from_secs(60),
                "no session started on a new primary:\n{}",
                cluster.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Devices created from the kill until a session could start again: none of them
        // could be recorded when it was created.
        let created = after - before;
        eprintln!("{created} devices created while the BMDB was down");
        created
    };
    let (a, b, while_down) = tokio::join!(replica("equinix-a"), replica("equinix-b"), fail_over);
    assert!(
        while_down <= 2,
        "{while_down} devices created while the BMDB could not record them (two replicas)"
    );
    assert!(
        a <= 1 && b <= 1,
        "devices created while the BMDB could not record them: {a} and {b}"
    );
    assert!(
        a + b >= 1,
        "the kill caught no creation in flight: the test did not test the failure"
    );
    let devices = fake.devices();
    let recorded = testing::provided_by(&db, shepherd_bmdb::ProviderKind::Equinix).await;
    assert_eq!(devices.len(), RESERVATIONS, "one device per reservation");
    let ids: HashSet<String> = recorded
        .iter()
        .map(|(_, p)| p.provider_id.clone())
        .collect();
    assert_eq!(ids.len(), recorded.len(), "a device recorded twice");
    assert!(
        devices.iter().all(|d| ids.contains(&d.id)),
        "an orphan device was never adopted"
    );
    db.close().await;
}

/// A connection of its own to the cluster (through HAProxy, so to the current primary).
async fn connect(url: &str) -> sqlx::PgConnection {
    <sqlx::PgConnection as sqlx::Connection>::connect(url)
        .await
        .expect("connect to the cluster")
}
