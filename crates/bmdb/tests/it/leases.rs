//! Leases that fence (`lease.rs`): a session's lease ends locally before the database counts
//! the session dead, a healthy session never comes near its deadline, fenced work is
//! canceled with its cause and counted, and no replica's stuck transaction stalls another's
//! keep-alives or its collector.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use shepherd_bmdb::testing::{self, eventually, held, session_every, Blackhole};
use shepherd_bmdb::*;
use tokio::time::Instant;

const START: Retrieval = Retrieval::AgentStart {
    provider: ProviderKind::Sim,
};

/// The database's own opinion of the session: is its row there with a deadline still ahead?
async fn alive_in_database(db: &Bmdb, session: &Session) -> bool {
    let id = session.id();
    db.read(move |tx| {
        Box::pin(async move {
            let now = tx.now().await?;
            Ok(tx.session(id).await?.is_some_and(|s| s.deadline > now))
        })
    })
    .await
    .unwrap()
}

/// The earliest local instant the database's deadline for `session` can fall at: its read
/// starts at some instant `r`, the database's clock is read at `r` or later, so the deadline,
/// `left` after that reading, falls at `r + left` or later. Measured this way, a slow read
/// (a busy CI machine) cannot make the lease look late.
async fn database_deadline_no_earlier_than(db: &Bmdb, session: &Session) -> Instant {
    let id = session.id();
    let read_at = Instant::now();
    let left = db
        .read(move |tx| {
            Box::pin(async move {
                let now = tx.now().await?;
                Ok(tx.session(id).await?.map(|s| s.deadline - now))
            })
        })
        .await
        .unwrap()
        .expect("the session's row is there");
    read_at + left.to_std().unwrap_or_default()
}

/// With its keep-alive stopped (a pause, a partition), a session's lease is seen lost while
/// the database still counts the session alive: no other replica can have its machines yet.
/// The lease's end is compared with the database's deadline, both as local instants, rather
/// than by reading the database right after the lease ended: that read alone could take
/// longer than the margin between the two on a busy machine.
async fn a_lease_ends_before_the_database_lets_go(db: Bmdb) {
    let _turn = crate::alone().await;
    let interval = Duration::from_secs(2);
    let s = session_every(&db, Processor::ShepherdInitializer, interval).await;
    let lease = s.lease();
    s.stop_keepalive();
    let left = lease.left().expect("a new session's lease holds");
    assert!(left <= interval, "{left:?}");
    let lease_ends = Instant::now() + left;
    let database_lets_go = database_deadline_no_earlier_than(&db, &s).await;
    assert!(
        lease_ends < database_lets_go,
        "the lease must end before the database's deadline: {:?} after it",
        lease_ends - database_lets_go
    );
    tokio::time::timeout(interval + Duration::from_secs(1), lease.lost())
        .await
        .expect("the lease ends within its interval once keep-alives stop");
    assert!(Instant::now() >= lease_ends, "the lease ended early");
    assert_eq!(lease.left(), Err(LeaseLost));
    assert!(s.is_expired());
}

/// A healthy session renews early: over several intervals its lease never ends and never
/// gets near its deadline.
async fn a_healthy_lease_never_nears_its_deadline(db: Bmdb) {
    let _turn = crate::alone().await;
    let s = session_every(&db, Processor::ShepherdInitializer, Duration::from_secs(1)).await;
    let lease = s.lease();
    let watched = Instant::now();
    let mut least = Duration::MAX;
    while watched.elapsed() < Duration::from_secs(4) {
        least = least.min(lease.left().expect("a healthy lease holds"));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Renewed every third of the interval, so about two thirds stay left after each renewal,
    // and a third or more when the next is due. A busy machine delays a renewal's transaction
    // (a CI run under load saw 380 ms left with a floor of 400), so the floor is a tenth of
    // the interval: a session that renewed only near its deadline would come down to about
    // nothing, and still fails here.
    assert!(least > Duration::from_millis(100), "least left: {least:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(200), lease.lost())
            .await
            .is_err(),
        "the lease holds"
    );
    s.close().await.unwrap();
    tokio::time::timeout(Duration::from_secs(1), lease.lost())
        .await
        .expect("a closed session's lease is lost at once");
}

/// Fenced work is canceled with the cause "lease lost", counted per process, and charges the
/// machine no backoff.
async fn fenced_work_is_canceled_with_its_cause(db: Bmdb) {
    let _turn = crate::alone().await;
    let m = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let s = testing::session(&db, Processor::ShepherdInitializer).await;
    let mut w = held(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    w.fenced().await.unwrap();
    let entries = testing::history_as(&db, |e| (e.event, e.cause.clone())).await;
    assert_eq!(
        entries,
        [
            (WorkEvent::Started, None),
            (WorkEvent::Canceled, Some("lease lost".to_string()))
        ]
    );
    assert_eq!(db.metrics().works_fenced(Process::ShepherdAgentStart), 1);
    let backoffs = db
        .read(move |tx| Box::pin(async move { tx.machine_backoffs(m).await }))
        .await
        .unwrap();
    assert!(backoffs.is_empty(), "{backoffs:?}");
    // A second ending is refused; fencing again counts nothing.
    w.fenced().await.unwrap();
    assert_eq!(db.metrics().works_fenced(Process::ShepherdAgentStart), 1);
    s.close().await.unwrap();
}

/// The re-check before a BMC reset: true while the session holds the work, false once the
/// work ended or the session is gone.
async fn the_lock_is_read_again_before_a_reset(db: Bmdb) {
    let _turn = crate::alone().await;
    testing::provision(&db, 1, ProviderKind::Sim).await;
    let s = testing::session(&db, Processor::ShepherdRecoverer).await;
    let mut w = held(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    let m = w.machine_id();
    assert!(s.still_holds(m, Process::ShepherdAgentStart).await.unwrap());
    assert!(!s.still_holds(m, Process::ShepherdRecovery).await.unwrap());
    w.cancel("test").await.unwrap();
    assert!(!s.still_holds(m, Process::ShepherdAgentStart).await.unwrap());
    s.close().await.unwrap();
}

shepherd_bmdb::conformance_tests!(
    a_lease_ends_before_the_database_lets_go,
    a_healthy_lease_never_nears_its_deadline,
    fenced_work_is_canceled_with_its_cause,
    the_lock_is_read_again_before_a_reset,
);

/// An expired session whose row another transaction holds (a replica cut off in the middle of
/// its keep-alive) is skipped by the collector, not waited for; it is collected once that
/// transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_collector_skips_a_session_another_transaction_holds() {
    let _turn = crate::alone().await;
    let Some(t) = testing::postgres().await else {
        return;
    };
    let db = t.db.clone();
    let s = session_every(&db, Processor::ShepherdInitializer, Duration::from_secs(1)).await;
    s.stop_keepalive();
    let id = s.id();
    eventually(
        "the session to expire",
        Duration::from_secs(5),
        async || testing::when(!alive_in_database(&db, &s).await, ()),
    )
    .await;
    let mut stuck = sqlx::PgConnection::connect(&t.url).await.unwrap();
    use sqlx::{Connection, Executor};
    stuck.execute("BEGIN").await.unwrap();
    sqlx::query("UPDATE sessions SET deadline = deadline WHERE session_id = $1")
        .bind(id)
        .execute(&mut stuck)
        .await
        .unwrap();
    let collected = tokio::time::timeout(Duration::from_secs(5), db.collect_garbage())
        .await
        .expect("the collector must not wait for a row another transaction holds")
        .unwrap();
    assert_eq!(collected, 0);
    stuck.execute("ROLLBACK").await.unwrap();
    assert_eq!(db.collect_garbage().await.unwrap(), 1);
    t.cleanup().await;
}

/// A replica cut off from Postgres in the middle of its keep-alive (between the UPDATE and
/// the COMMIT, its session row locked) stalls no one: the other replica's sessions keep their
/// leases, the server ends the cut-off transaction, and the other replica claims the cut-off
/// one's machine within three session intervals of its lease's end.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_cut_off_inside_a_transaction_stalls_no_one() {
    let _turn = crate::alone().await;
    let Some(t) = testing::postgres().await else {
        return;
    };
    const INTERVAL: Duration = Duration::from_secs(2);
    let upstream = t.url.split('@').nth(1).unwrap().split('/').next().unwrap();
    let proxy = Blackhole::start(upstream).await;
    let cut_off = Bmdb::open(&proxy.url_through(&t.url, upstream))
        .await
        .unwrap();
    let other = t.db.clone();
    let m = testing::provision(&other, 1, ProviderKind::Sim).await[0];

    let a = session_every(&cut_off, Processor::ShepherdInitializer, INTERVAL).await;
    let _work = held(a.work(Process::ShepherdAgentStart, START).await.unwrap());
    // Replica B runs several sessions meanwhile, each keeping itself alive and collecting.
    let mut b = Vec::new();
    for _ in 0..4 {
        b.push(session_every(&other, Processor::ShepherdInitializer, INTERVAL).await);
    }

    // A's keep-alive, cut off after its UPDATE: the row stays locked by a transaction whose
    // client says nothing more.
    let (id, hold) = (a.id(), proxy_cut_after_update(&proxy));
    let stuck = tokio::spawn(async move {
        cut_off
            .transact(move |tx| {
                let hold = hold.clone();
                Box::pin(async move {
                    tx.poke_session_for_test(id).await?;
                    hold();
                    std::future::pending::<()>().await;
                    Ok(())
                })
            })
            .await
    });
    let lease = a.lease();
    tokio::time::timeout(2 * INTERVAL, lease.lost())
        .await
        .expect("the cut-off replica's lease ends");
    let lease_ended = Instant::now();

    let claimer = &b[0];
    let claimed = eventually(
        "the other replica to claim the cut-off replica's machine",
        6 * INTERVAL,
        async || match claimer.work(Process::ShepherdAgentStart, START).await {
            Ok(Claim::Work(w)) => Ok(w),
            other => Err(format!("{other:?}")),
        },
    )
    .await;
    let after = lease_ended.elapsed();
    println!(
        "stalled_replica_claims_after_lease_s = {:.2}",
        after.as_secs_f64()
    );
    println!("session_interval_s = {}", INTERVAL.as_secs());
    assert_eq!(claimed.machine_id(), m);
    assert!(
        after <= 3 * INTERVAL,
        "claimed {after:?} after the lease ended; at most three intervals"
    );
    assert_eq!(
        other
            .metrics()
            .sessions_expired(Processor::ShepherdInitializer),
        0,
        "none of the other replica's sessions may expire"
    );
    for s in &b {
        assert!(s.lease().left().is_ok());
    }
    stuck.abort();
    proxy.heal();
    t.cleanup().await;
}

/// A closure that cuts `proxy` when called: the partition comes right after the statement
/// the transaction just sent was answered.
fn proxy_cut_after_update(proxy: &Blackhole) -> std::sync::Arc<dyn Fn() + Send + Sync> {
    let proxy = proxy.clone();
    std::sync::Arc::new(move || proxy.cut())
}

/// Log lines written while the returned guard lives, on this thread: the test runs on a
/// current-thread runtime, so every task of it logs here.
fn capture_logs() -> (Arc<Mutex<Vec<u8>>>, tracing::subscriber::DefaultGuard) {
    let logs: Arc<Mutex<Vec<u8>>> = Arc::default();
    let sink = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .with_writer(move || LogSink(sink.clone()))
        .finish();
    (logs, tracing::subscriber::set_default(subscriber))
}

struct LogSink(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for LogSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Another process that stops while it holds the SQLite file's write lock (paused mid-
/// transaction) keeps every other process from writing. The others' leases end on time
/// rather than waiting on the lock, their keep-alives say why, and writes resume once the
/// lock is free.
#[tokio::test(flavor = "current_thread")]
async fn a_stopped_sqlite_writer_is_named_and_the_others_leases_end_on_time() {
    let _turn = crate::alone().await;
    use sqlx::{Connection, Executor};
    let (logs, _guard) = capture_logs();
    let t = testing::sqlite().await;
    let s = session_every(
        &t.db,
        Processor::ShepherdInitializer,
        Duration::from_secs(1),
    )
    .await;
    let mut stopped = sqlx::SqliteConnection::connect(&t.url).await.unwrap();
    stopped.execute("BEGIN IMMEDIATE").await.unwrap();
    tokio::time::timeout(Duration::from_secs(3), s.lease().lost())
        .await
        .expect("the lease ends within its interval, not after the busy timeout");
    let named = "the keep-alive to name the held write lock";
    eventually(named, Duration::from_secs(5), async || {
        let text = String::from_utf8_lossy(&logs.lock().unwrap()).to_string();
        testing::when(
            text.contains("SQLite write lock was not free in time"),
            text,
        )
    })
    .await;
    stopped.execute("ROLLBACK").await.unwrap();
    let write = "a write once the lock is free";
    eventually(write, Duration::from_secs(15), async || {
        let created =
            t.db.transact(|tx| Box::pin(async move { tx.create_machine().await }))
                .await;
        created.map_err(|e| e.to_string())
    })
    .await;
    t.cleanup().await;
}
