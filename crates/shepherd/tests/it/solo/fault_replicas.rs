//! Fault suite: processes of `shepherd run` dying or stopping mid-work.
//! - kill -9 of one of two replicas on Postgres: its locks are freed within the session
//!   interval plus a margin, the survivor finishes every machine, and the history shows no
//!   machine taken over by two sessions at once, none twice, none lost.
//! - SIGTERM mid-work on both backends: no work rows and no sessions are left, and the work
//!   in flight is recorded as Canceled.

use crate::common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::ssh_fleet::{open_when_migrated, SshFleet};
use common::{history, signal, sim_run, ChildGuard};
use shepherd_bmdb::{testing, Bmdb, Process, StatusCounts, WorkEvent};
use uuid::Uuid;

const SESSION_INTERVAL: Duration = Duration::from_secs(2);

async fn counts(db: &Bmdb) -> StatusCounts {
    db.status_counts().await.unwrap()
}

/// Sessions of the process with this pid.
async fn sessions_of(db: &Bmdb, pid: u32) -> HashSet<Uuid> {
    history::sessions_of(db, pid).await.unwrap()
}

/// Machines locked by any of `sessions`.
async fn work_of(db: &Bmdb, sessions: &HashSet<Uuid>) -> usize {
    let mut n = 0;
    for s in sessions.clone() {
        n += db
            .read(move |tx| Box::pin(async move { tx.session_work(s).await }))
            .await
            .unwrap()
            .len();
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_of_one_replica_loses_and_duplicates_nothing() {
    const MACHINES: usize = 30;
    let Some(url) = testing::fresh_postgres_database().await else {
        return;
    };
    let fleet = SshFleet::start(MACHINES, 700, &["a", "b"]);
    let mut a = ChildGuard(Some(fleet.replica(&url, "a")));
    let db = open_when_migrated(&url).await;
    let mut b = ChildGuard(Some(fleet.replica(&url, "b")));
    let (a_pid, b_pid) = (a.child().id(), b.child().id());
    // Both replicas work; a holds machines when it dies.
    let mut a_sessions = HashSet::new();
    testing::eventually(
        "replica a to hold work",
        Duration::from_secs(30),
        async || {
            a_sessions.extend(sessions_of(&db, a_pid).await);
            if work_of(&db, &a_sessions).await >= 1 && !sessions_of(&db, b_pid).await.is_empty() {
                Ok(())
            } else {
                Err(fleet.log("a"))
            }
        },
    )
    .await;
    a_sessions.extend(sessions_of(&db, a_pid).await);
    signal(a.child(), "KILL");
    let killed = Instant::now();
    let _ = a.0.take().unwrap().wait();

    // Its sessions expire after at most one interval; the survivor's keep-alive collects
    // them (every half interval). Margin for a busy CI machine.
    let within = SESSION_INTERVAL * 2 + Duration::from_secs(8);
    let freed = "the killed replica's locks to be freed";
    testing::eventually(freed, within, async || {
        let held = work_of(&db, &a_sessions).await;
        testing::when(held == 0, held)
    })
    .await;
    let freed_after = killed.elapsed();

    let every_machine = "the survivor to finish every machine";
    testing::eventually(every_machine, Duration::from_secs(90), async || {
        let c = counts(&db).await;
        if c.agent_started == MACHINES as i64 {
            Ok(())
        } else {
            Err((c, fleet.log("b")))
        }
    })
    .await;
    let out = b.terminate();
    assert!(out.status.success(), "survivor exit: {}", out.status);

    let c = counts(&db).await;
    assert_eq!(
        (c.machines, c.provided),
        (MACHINES as i64, MACHINES as i64),
        "{c:?}"
    );
    let history = history::all(&db).await;
    let finished = history::exclusive_finishes(&history, Process::ShepherdAgentStart);
    assert_eq!(finished.len(), MACHINES, "machines never taken over");
    assert!(
        finished.values().all(|&n| n == 1),
        "a machine was taken over twice"
    );
    let lost_locks = history
        .iter()
        .filter(|h| h.event == WorkEvent::Canceled)
        .filter(|h| h.session_id.is_some_and(|s| a_sessions.contains(&s)))
        .count();
    assert!(
        lost_locks >= 1,
        "the killed replica's work was never recorded as lost"
    );
    eprintln!("locks freed {freed_after:?} after kill -9; {lost_locks} lost locks recorded");
    db.close().await;
}

/// SIGTERM while takeovers are in flight: the work is canceled and recorded, sessions closed.
async fn sigterm_mid_work_leaves_nothing(url: &str) {
    let dir = tempfile::tempdir().unwrap();
    let mut run = ChildGuard(Some(
        sim_run(url, 40, "3s", &dir.path().join("run.log"))
            .spawn()
            .unwrap(),
    ));
    let db = open_when_migrated(url).await;
    testing::eventually("takeovers in flight", Duration::from_secs(30), async || {
        let held = counts(&db).await.work.iter().map(|(_, n)| *n).sum::<i64>();
        testing::when(held >= 2, held)
    })
    .await;
    signal(run.child(), "TERM");
    let stopping = Instant::now();
    let status = run.0.take().unwrap().wait().unwrap();
    assert!(status.success(), "exit {status}");
    assert!(
        stopping.elapsed() < Duration::from_secs(15),
        "slow shutdown"
    );
    let c = counts(&db).await;
    assert_eq!(
        c.sessions_live + c.sessions_expired,
        0,
        "sessions left: {c:?}"
    );
    assert!(c.work.iter().all(|(_, n)| *n == 0), "work left: {c:?}");
    let history = history::all(&db).await;
    history::exclusive_finishes(&history, Process::ShepherdAgentStart);
    let canceled: Vec<_> = history
        .iter()
        .filter(|h| h.event == WorkEvent::Canceled)
        .collect();
    assert!(
        canceled.len() >= 2,
        "work in flight was not recorded as Canceled: {canceled:?}"
    );
    // Each says why: the loop that shut down.
    for h in &canceled {
        let cause = h.cause.as_deref().unwrap_or_default();
        assert!(
            cause.contains("shutting down") && cause.contains("shepherd-initializer"),
            "a Canceled entry without its cause: {h:?}"
        );
    }
    db.close().await;
}

shepherd_bmdb::url_conformance_tests!(sigterm_mid_work_leaves_nothing);
