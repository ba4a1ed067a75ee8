//! Sessions (`sql/sessions.rs`): expiry, closing, and the collection of expired sessions racing
//! endings and claims.

use super::*;

async fn session_expiry_releases_work(db: Bmdb) {
    let ids = testing::provision(&db, 1, ProviderKind::Sim).await;
    let a = doomed_session(&db).await;
    let mut work = claimed(a.work(Process::ShepherdAgentStart, START).await.unwrap());
    assert_eq!(work.machine_id(), ids[0]);

    // A live session keeps itself alive well past its interval.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert!(!a.is_expired());
    a.transact(|_| Box::pin(async { Ok(()) })).await.unwrap();

    // The process "crashes": no more pokes.
    a.stop_keepalive();
    tokio::time::sleep(PAST_EXPIRY).await;
    assert!(matches!(
        a.transact(|_| Box::pin(async { Ok(()) })).await,
        Err(Error::SessionExpired)
    ));
    assert!(matches!(
        work.finish(TagWrites::none()).await,
        Err(Error::SessionExpired)
    ));
    assert!(matches!(
        a.work(Process::ShepherdAgentStart, START).await,
        Err(Error::SessionExpired)
    ));
    // Counted once, however often it is found expired.
    let expired = || {
        db.metrics()
            .sessions_expired(Processor::ShepherdInitializer)
    };
    assert_eq!(expired(), 1);

    // Until garbage collection its lock still holds; after it, another session can claim.
    let b = session(&db, "successor").await;
    assert!(matches!(
        b.work(Process::ShepherdAgentStart, START).await.unwrap(),
        Claim::NothingToDo
    ));
    assert!(db.collect_garbage().await.unwrap() >= 1);
    let sessions = db
        .read(|tx| Box::pin(async move { tx.sessions().await }))
        .await
        .unwrap();
    assert_eq!(
        sessions.iter().map(|s| s.session_id).collect::<Vec<_>>(),
        vec![b.id()]
    );
    let mut w2 = claimed(b.work(Process::ShepherdAgentStart, START).await.unwrap());
    assert_eq!(w2.machine_id(), ids[0]);
    w2.finish(TagWrites::none().agent_started(key(1)))
        .await
        .unwrap();

    let h: Vec<_> = history(&db, ids[0])
        .await
        .into_iter()
        .map(|e| (e.event, e.session_id, e.cause))
        .collect();
    assert_eq!(
        h,
        vec![
            (WorkEvent::Started, Some(a.id()), None),
            (
                WorkEvent::Canceled,
                Some(a.id()),
                Some("session expired".into())
            ),
            (WorkEvent::Started, Some(b.id()), None),
            (WorkEvent::Finished, Some(b.id()), None),
        ]
    );
    // Canceling the dead session's work later is a harmless no-op.
    work.cancel("test").await.unwrap();
    assert_eq!(history(&db, ids[0]).await.len(), 4);
    b.close().await.unwrap();
    assert_eq!(expired(), 1, "a session closed by its owner did not expire");
}
async fn closing_a_session_releases_its_work(db: Bmdb) {
    let ids = testing::provision(&db, 2, ProviderKind::Sim).await;
    let a = session(&db, "a").await;
    let w1 = claimed(a.work(Process::ShepherdAgentStart, START).await.unwrap());
    let w2 = claimed(a.work(Process::ShepherdAgentStart, START).await.unwrap());
    assert_eq!(
        BTreeSet::from([w1.machine_id(), w2.machine_id()]),
        ids.iter().copied().collect()
    );
    assert_eq!(count_start(&db).await, 0);
    a.close().await.unwrap();
    assert!(a.is_expired());
    assert_eq!(count_start(&db).await, 2);
    for id in &ids {
        let last = history(&db, *id).await.pop().unwrap();
        assert_eq!(
            (last.event, last.cause.as_deref()),
            (WorkEvent::Canceled, Some("session closed"))
        );
    }
    std::mem::forget((w1, w2));
}
/// Rounds of a session closed while `racers` it started run: each round starts a session,
/// the racers (tasks) against it, closes it after a pause, and waits for the racers; until
/// both sides of the race were hit (see [`CLOSE_ROUNDS_MIN`]), or the test fails for not
/// having exercised it.
async fn close_during_rounds(
    db: &Bmdb,
    seed: u64,
    racers: impl AsyncFn(&Session) -> Vec<tokio::task::JoinHandle<()>>,
    sides_hit: impl Fn() -> (bool, bool),
) {
    let mut rng = StdRng::seed_from_u64(seed);
    for round in 0..CLOSE_ROUNDS_MAX {
        let s = session(db, "closing").await;
        let running = racers(&s).await;
        // Random at first; then, if one side of the race has not been hit yet, timed for it:
        // the close at once (for the close to win), or late (for the racers to).
        let delay = match (round >= CLOSE_ROUNDS_MIN, sides_hit()) {
            (true, (true, false)) => 0,
            (true, (false, true)) => 5000,
            _ => rng.random_range(0..3000),
        };
        tokio::time::sleep(Duration::from_micros(delay)).await;
        s.close().await.unwrap();
        for r in running {
            r.await.unwrap();
        }
        if round + 1 >= CLOSE_ROUNDS_MIN && sides_hit() == (true, true) {
            return;
        }
    }
    panic!("{CLOSE_ROUNDS_MAX} rounds and the race still went one way only: it was not exercised");
}
/// Rounds of [`close_during_rounds`]: at least the first, at most the second (until both
/// sides of the race were hit: `sides_hit` says whether the racers won at least once, and
/// whether the close did).
const CLOSE_ROUNDS_MIN: usize = 25;
const CLOSE_ROUNDS_MAX: usize = 100;
/// A session closed while its own works are being ended: the close and each ending race for
/// the work row, and whichever removes it writes the one ending in the machine's history —
/// never both a Finished and the close's Canceled. Nothing is left held.
async fn closing_a_session_while_its_work_ends_records_each_ending_once(db: Bmdb) {
    let ids = testing::provision(&db, 8 * CLOSE_ROUNDS_MAX, ProviderKind::Sim).await;
    // Finishes that won the race, and finishes the close beat: both must happen, or the
    // check below proves nothing about the race.
    let (finished, beaten) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let racers = async |s: &Session| {
        let mut enders = Vec::new();
        for _ in 0..8 {
            let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
            let (finished, beaten) = (finished.clone(), beaten.clone());
            enders.push(tokio::spawn(async move {
                // Either the finish or the close removes the work; a finish that lost the race
                // says so (work lost, or session gone) and leaves nothing to cancel.
                match w.finish(TagWrites::none().agent_started(key(4))).await {
                    Ok(()) => finished.fetch_add(1, Ordering::SeqCst),
                    Err(_) => beaten.fetch_add(1, Ordering::SeqCst),
                };
                std::mem::forget(w);
            }));
        }
        enders
    };
    let both = || {
        let seen = |n: &AtomicUsize| n.load(Ordering::SeqCst) > 0;
        (seen(&finished), seen(&beaten))
    };
    close_during_rounds(&db, 7, racers, both).await;
    every_claim_ended_once(&db, &ids).await;
}
/// A session closed while it is still claiming: each claim either commits before the close
/// (and the close cancels its work, with history) or finds the session gone. No claim is left
/// with a Started and no ending, and nothing is left held.
async fn closing_a_session_while_it_claims_leaves_no_claim_without_an_ending(db: Bmdb) {
    let ids = testing::provision(&db, 8, ProviderKind::Sim).await;
    // Claims that committed before the close, and claims that found the session gone.
    let (before, after) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let both = || {
        let seen = |n: &AtomicUsize| n.load(Ordering::SeqCst) > 0;
        (seen(&before), seen(&after))
    };
    let racers = async |s: &Session| {
        let claim = |s: Session| {
            let (before, after) = (before.clone(), after.clone());
            async move {
                match s.work(Process::ShepherdAgentStart, START).await {
                    Ok(Claim::Work(w)) => {
                        before.fetch_add(1, Ordering::SeqCst);
                        // The close releases it, or has released it already.
                        std::mem::forget(w);
                    }
                    Err(_) => {
                        after.fetch_add(1, Ordering::SeqCst);
                    }
                    Ok(_) => {}
                }
            }
        };
        (0..8).map(|_| tokio::spawn(claim(s.clone()))).collect()
    };
    close_during_rounds(&db, 9, racers, both).await;
    every_claim_ended_once(&db, &ids).await;
}
/// A session whose row is gone (expired, and collected by another replica) claims nothing,
/// whether its claim is served alone or together with a live session's: the claim statement
/// checks each request's session itself (Postgres has one statement for a lone request and
/// one for a batch).
async fn a_session_whose_row_is_gone_claims_nothing(db: Bmdb) {
    testing::provision(&db, 2, ProviderKind::Sim).await;
    let remove = |s: &Session| {
        let id = s.id();
        s.stop_keepalive();
        let db = db.clone();
        async move {
            db.transact(move |tx| Box::pin(async move { tx.delete_session_raw(id).await }))
                .await
                .unwrap()
        }
    };
    let alone = session(&db, "gone-alone").await;
    remove(&alone).await;
    assert!(matches!(
        alone.work(Process::ShepherdAgentStart, START).await,
        Err(Error::SessionExpired)
    ));
    assert!(alone.is_expired());
    assert!(
        testing::all_history(&db).await.is_empty(),
        "nothing claimed"
    );

    let live = session(&db, "live").await;
    let gone = session(&db, "gone-together").await;
    remove(&gone).await;
    let (live_claim, gone_claim) = tokio::join!(
        live.work(Process::ShepherdAgentStart, START),
        gone.work(Process::ShepherdAgentStart, START)
    );
    assert!(matches!(gone_claim, Err(Error::SessionExpired)));
    let mut work = claimed(live_claim.unwrap());
    let started = testing::history_as(&db, |e| (e.machine_id, e.session_id)).await;
    assert_eq!(
        started,
        [(work.machine_id(), Some(live.id()))],
        "only the live one claimed"
    );
    work.cancel("test").await.unwrap();
    live.close().await.unwrap();
}
/// A Postgres test database with one machine, a [`doomed_session`] whose keep-alive is
/// stopped (it expires [`PAST_EXPIRY`] from now), and a connection of the test's own for the
/// transaction that races the garbage collection.
struct DoomedOnPostgres {
    t: testing::TestDb,
    machine: Uuid,
    session: Session,
    raw: sqlx::PgConnection,
}
impl DoomedOnPostgres {
    async fn start() -> Option<DoomedOnPostgres> {
        use sqlx::Connection;
        let t = testing::postgres().await?;
        let machine = testing::provision(&t.db, 1, ProviderKind::Sim).await[0];
        let session = doomed_session(&t.db).await;
        session.stop_keepalive();
        let raw = sqlx::PgConnection::connect(&t.url).await.unwrap();
        Some(DoomedOnPostgres {
            t,
            machine,
            session,
            raw,
        })
    }

    async fn end(self) {
        use sqlx::Connection;
        self.raw.close().await.unwrap();
        self.t.cleanup().await;
    }
}
/// Collects garbage while `tx` (another transaction, holding a row the collection needs) is
/// open, then commits `tx`. Returns what that collection released, and what the next one
/// released: a collection waits (within its lock timeout) for a work row `tx` holds, and
/// skips a session whose row `tx` holds, leaving it to the next collection.
/// Runs `sql` with `binds` in `tx`, then [`collect_while_held`].
async fn collect_after(
    db: &Bmdb,
    mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
    sql: &str,
    binds: &[Uuid],
) -> (u64, u64) {
    let query = binds.iter().fold(sqlx::query(sql), |q, b| q.bind(*b));
    query.execute(&mut *tx).await.unwrap();
    collect_while_held(db, tx).await
}

async fn collect_while_held(db: &Bmdb, tx: sqlx::Transaction<'_, sqlx::Postgres>) -> (u64, u64) {
    let collecting = tokio::spawn({
        let db = db.clone();
        async move { db.collect_garbage().await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waited = !collecting.is_finished();
    tx.commit().await.unwrap();
    let first = collecting.await.unwrap().unwrap();
    assert_eq!(
        waited,
        first == 1,
        "a collection that released it waited for it"
    );
    (first, db.collect_garbage().await.unwrap())
}
/// The machine's history is one claim, ended Canceled with `cause`.
async fn assert_started_then_canceled(db: &Bmdb, id: Uuid, cause: &str) {
    let events: Vec<_> = history(db, id)
        .await
        .into_iter()
        .map(|e| (e.event, e.cause))
        .collect();
    assert_eq!(
        events,
        [
            (WorkEvent::Started, None),
            (WorkEvent::Canceled, Some(cause.to_string())),
        ]
    );
}
/// Garbage collection of an expired session races an ending of its work (Postgres: SQLite's
/// single writer serializes them). Another transaction has deleted the work row and written
/// its own Canceled, as an ending does, and commits while the collection waits for that row:
/// the collection must not add a second Canceled for a lock it did not release.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn collecting_a_session_leaves_work_another_transaction_ended() {
    use sqlx::Connection;
    let Some(mut f) = DoomedOnPostgres::start().await else {
        return;
    };
    let (db, id) = (f.t.db.clone(), f.machine);
    let w = claimed(
        f.session
            .work(Process::ShepherdAgentStart, START)
            .await
            .unwrap(),
    );
    tokio::time::sleep(PAST_EXPIRY).await;

    let tx = f.raw.begin().await.unwrap();
    let ended_elsewhere =
        "WITH del AS (DELETE FROM work WHERE machine_id = $1 RETURNING machine_id, process, session_id)
         INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
         SELECT machine_id, process, 'Canceled', now(), session_id, 'ended elsewhere' FROM del";
    assert_eq!(
        collect_after(&db, tx, ended_elsewhere, &[id]).await,
        (1, 0),
        "the collection waits for the work row, then releases the session"
    );
    assert_started_then_canceled(&db, id, "ended elsewhere").await;
    std::mem::forget(w);
    f.end().await;
}
/// Garbage collection of an expired session races a claim of that session that checked it
/// alive just before its deadline (Postgres; SQLite's single writer serializes them). The
/// claim holds the session row `FOR KEY SHARE`, as claims do, and commits its work while the
/// collection runs: the collection skips the session it cannot lock, and the next one must
/// release that work with a Canceled, not leave a Started without an ending.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn collecting_a_session_cancels_a_claim_that_committed_meanwhile() {
    use sqlx::Connection;
    let Some(mut f) = DoomedOnPostgres::start().await else {
        return;
    };
    let (db, id, session) = (f.t.db.clone(), f.machine, f.session.id());
    let mut tx = f.raw.begin().await.unwrap();
    let alive: Option<i32> = sqlx::query_scalar(
        "SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now() FOR KEY SHARE",
    )
    .bind(session)
    .fetch_optional(&mut *tx)
    .await
    .unwrap();
    assert_eq!(alive, Some(1));
    tokio::time::sleep(PAST_EXPIRY).await;
    let claim = "WITH w AS (INSERT INTO work (machine_id, session_id, process)
                    VALUES ($1, $2, 'ShepherdAgentStart') RETURNING *)
         INSERT INTO work_history (machine_id, process, event, at, session_id)
         SELECT machine_id, process, 'Started', now(), session_id FROM w";
    assert_eq!(
        collect_after(&db, tx, claim, &[id, session]).await,
        (0, 1),
        "the collection skips the session the claim holds; the next one releases it"
    );
    assert_started_then_canceled(&db, id, "session expired").await;
    let work = fleet_counts(&db).await.work;
    assert!(work.iter().all(|(_, n)| *n == 0), "no work left: {work:?}");
    f.end().await;
}

shepherd_bmdb::conformance_tests!(
    session_expiry_releases_work,
    closing_a_session_releases_its_work,
    closing_a_session_while_its_work_ends_records_each_ending_once,
    closing_a_session_while_it_claims_leaves_no_claim_without_an_ending,
    a_session_whose_row_is_gone_claims_nothing,
);
