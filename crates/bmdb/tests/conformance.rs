//! One conformance suite for the BMDB, run against SQLite and Postgres (SPEC §2–§5).

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shepherd_bmdb::*;
use uuid::Uuid;

const START: Retrieval = Retrieval::AgentStart {
    provider: Provider::Sim,
};

fn key(byte: u8) -> Vec<u8> {
    vec![byte; AGENT_KEY_LEN]
}

async fn session(db: &Bmdb, name: &str) -> Session {
    db.start_session(SessionConfig::new(name, Processor::ShepherdInitializer))
        .await
        .expect("start session")
}

/// Long enough after a [`doomed_session`]'s keep-alive stopped for it to have expired.
const PAST_EXPIRY: Duration = Duration::from_millis(2200);

/// A session with a one-second interval, which expires two seconds after its keep-alive
/// stops.
async fn doomed_session(db: &Bmdb) -> Session {
    testing::session_every(db, Processor::ShepherdInitializer, Duration::from_secs(1)).await
}

fn claimed(c: Claim) -> Work {
    match c {
        Claim::Work(w) => w,
        other => panic!("expected work, got {other:?}"),
    }
}

/// The fleet counts at the default thresholds.
async fn fleet_counts(db: &Bmdb) -> FleetCounts {
    db.read(|tx| {
        Box::pin(async move {
            tx.fleet_counts(RecoveryThresholds::default().stale_after())
                .await
        })
    })
    .await
    .unwrap()
}

async fn history(db: &Bmdb, id: Uuid) -> Vec<HistoryEntry> {
    db.read(|tx| Box::pin(async move { tx.machine_history(id).await }))
        .await
        .unwrap()
}

/// Starts the agent of every machine in `ids` except those in `keep`, making them ineligible
/// for agent start.
async fn start_all_but(db: &Bmdb, ids: &[Uuid], keep: &BTreeSet<Uuid>) {
    let started: Vec<Uuid> = ids
        .iter()
        .copied()
        .filter(|id| !keep.contains(id))
        .collect();
    db.transact(move |tx| {
        let started = started.clone();
        Box::pin(async move {
            for id in started {
                tx.set_agent_started(id, &key(4)).await?;
            }
            Ok(())
        })
    })
    .await
    .unwrap();
}

/// Claims one machine for agent start and finishes it with its agent started.
async fn claim_and_start(s: &Session) -> Uuid {
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    let id = w.machine_id();
    w.finish(TagWrites::none().agent_started(key(4)))
        .await
        .unwrap();
    id
}

async fn count_start(db: &Bmdb) -> i64 {
    db.read(|tx| {
        Box::pin(async move { tx.count_eligible(Process::ShepherdAgentStart, &START).await })
    })
    .await
    .unwrap()
}

// -------------------------------------------------------------------------------------------

async fn migrations_are_idempotent(db: Bmdb) {
    assert_eq!(db.schema_version().await.unwrap(), SCHEMA_VERSION);
    assert_eq!(
        db.migrate().await.unwrap(),
        (SCHEMA_VERSION, SCHEMA_VERSION)
    );
    db.check_schema().await.unwrap();
}

async fn tags_round_trip(db: Bmdb) {
    let id = testing::provision(&db, 1, Provider::Static).await[0];
    let t0 = Utc::now() - chrono::Duration::minutes(3);
    db.transact(move |tx| {
        Box::pin(async move {
            let mut p = Provided::new(Provider::Static, id.simple().to_string());
            p.ip_address = Some("192.0.2.1".into());
            p.location = Some("rack-1".into());
            p.status = Some(ProviderStatus::Running);
            p.reservation_id = Some("res-1".into());
            p.facts.insert("cpus", "64");
            p.facts
                .insert("resource_class", "baremetal \"large\" ünïcode");
            tx.set_provided(id, &p).await?;
            tx.set_agent_started_at(id, Some(t0), &key(7)).await?;
            tx.set_heartbeat(id).await?;
            tx.set_hardware_report(id, b"hw").await?;
            tx.set_os_installation_request(
                id,
                &OsInstallationRequest {
                    generation: 3,
                    request_raw: b"req".to_vec(),
                },
            )
            .await?;
            tx.set_os_installation_report(
                id,
                &OsInstallationReport {
                    generation: 3,
                    result: InstallationResult::Error,
                    report_raw: b"rep".to_vec(),
                },
            )
            .await?;
            let pinned = tx.pin_ssh_host_key(id, "ssh-ed25519 AAAA first").await?;
            assert_eq!(pinned.key, "ssh-ed25519 AAAA first");
            // Pinning the same key again is no change; another key is refused, naming both.
            let same = tx.pin_ssh_host_key(id, "ssh-ed25519 AAAA first").await?;
            assert_eq!(same.key, "ssh-ed25519 AAAA first");
            let other = tx.pin_ssh_host_key(id, "ssh-ed25519 BBBB second").await;
            assert!(
                matches!(&other, Err(Error::HostKeyPinned { pinned, presented })
                    if pinned == "ssh-ed25519 AAAA first" && presented == "ssh-ed25519 BBBB second"),
                "{other:?}"
            );
            assert_eq!(tx.ssh_host_key(id).await?.unwrap().key, "ssh-ed25519 AAAA first");
            Ok(())
        })
    })
    .await
    .unwrap();

    db.read(move |tx| {
        Box::pin(async move {
            let p = tx.provided(id).await?.unwrap();
            assert_eq!(p.ip_address.as_deref(), Some("192.0.2.1"));
            assert_eq!(p.status, Some(ProviderStatus::Running));
            assert_eq!(p.facts.get("cpus"), Some("64"));
            assert_eq!(
                p.facts.get("resource_class"),
                Some("baremetal \"large\" ünïcode")
            );
            assert_eq!(
                tx.machine_by_provider_id(Provider::Static, &p.provider_id)
                    .await?,
                Some(id)
            );
            let started = tx.agent_started(id).await?.unwrap();
            assert_eq!(started.public_key, key(7));
            assert_eq!(started.started_at.timestamp_micros(), t0.timestamp_micros());
            assert!(tx.agent_key_matches(id, &key(7)).await?);
            assert!(!tx.agent_key_matches(id, &key(8)).await?);
            let hb = tx.heartbeat(id).await?.unwrap();
            assert!(
                (Utc::now() - hb).num_seconds().abs() < 60,
                "heartbeat time {hb}"
            );
            assert_eq!(tx.hardware_report(id).await?.unwrap(), b"hw");
            assert_eq!(tx.os_installation_request(id).await?.unwrap().generation, 3);
            assert_eq!(
                tx.os_installation_report(id).await?.unwrap().result,
                InstallationResult::Error
            );
            assert_eq!(tx.provided_by(Provider::Static).await?.len(), 1);
            assert!(tx.provided_by(Provider::Sim).await?.is_empty());
            Ok(())
        })
    })
    .await
    .unwrap();

    // Bad values are refused with a clear error and write nothing.
    let err = db
        .transact(move |tx| Box::pin(async move { tx.set_agent_started(id, &[1, 2, 3]).await }))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("32 bytes"), "{err}");
    let err = db
        .transact(move |tx| {
            Box::pin(async move {
                tx.set_provided(id, &Provided::new(Provider::Static, "x".repeat(129)))
                    .await
            })
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("provider id"), "{err}");
    // Unique (provider, provider_id): a second machine cannot claim the same provider id.
    let other = testing::provision(&db, 1, Provider::Sim).await[0];
    let dup = db
        .transact(move |tx| {
            Box::pin(async move {
                tx.set_provided(
                    other,
                    &Provided::new(Provider::Static, id.simple().to_string()),
                )
                .await
            })
        })
        .await;
    assert!(dup.is_err(), "duplicate provider id accepted");

    // Each delete says whether there was a row; the second heartbeat delete finds none.
    let deleted = db
        .transact(move |tx| {
            Box::pin(async move {
                let started = tx.delete_agent_started(id).await?;
                let beats = [
                    tx.delete_heartbeat(id).await?,
                    tx.delete_heartbeat(id).await?,
                ];
                Ok((started, beats))
            })
        })
        .await
        .unwrap();
    assert_eq!(deleted, (true, [true, false]));
}

async fn session_expiry_releases_work(db: Bmdb) {
    let ids = testing::provision(&db, 1, Provider::Sim).await;
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
    let ids = testing::provision(&db, 2, Provider::Sim).await;
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

/// Every claim of each of `ids` has exactly one ending after its Started, and no work is held.
async fn every_claim_ended_once(db: &Bmdb, ids: &[Uuid]) {
    for id in ids {
        let events: Vec<WorkEvent> = history(db, *id).await.iter().map(|e| e.event).collect();
        let alternates = events.chunks(2).all(|pair| {
            pair.len() == 2 && pair[0] == WorkEvent::Started && pair[1] != WorkEvent::Started
        });
        assert!(alternates, "one ending per claim for {id}: {events:?}");
    }
    let work = fleet_counts(db).await.work;
    assert!(work.iter().all(|(_, n)| *n == 0), "no work left: {work:?}");
}

/// A session closed while its own works are being ended: the close and each ending race for
/// the work row, and whichever removes it writes the one ending in the machine's history —
/// never both a Finished and the close's Canceled. Nothing is left held.
async fn closing_a_session_while_its_work_ends_records_each_ending_once(db: Bmdb) {
    let ids = testing::provision(&db, 8 * CLOSE_ROUNDS_MAX, Provider::Sim).await;
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
    let ids = testing::provision(&db, 8, Provider::Sim).await;
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

async fn work_endings(db: Bmdb) {
    let ids = testing::provision(&db, 1, Provider::Sim).await;
    let id = ids[0];
    let s = session(&db, "endings").await;

    // Cancel: lock released, no backoff, Canceled history; cancel again is a no-op.
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    // While held, the machine is not eligible for this process.
    assert!(matches!(
        s.work(Process::ShepherdAgentStart, START).await.unwrap(),
        Claim::NothingToDo
    ));
    let held = db
        .read(move |tx| Box::pin(async move { tx.machine_work(id).await }))
        .await
        .unwrap();
    assert_eq!(
        held,
        vec![ActiveWork {
            machine_id: id,
            process: Process::ShepherdAgentStart,
            session_id: s.id()
        }]
    );
    w.cancel("test").await.unwrap();
    w.cancel("test").await.unwrap();
    assert!(matches!(
        w.finish(TagWrites::none()).await,
        Err(Error::WorkAlreadyDone("canceled"))
    ));
    assert_eq!(count_start(&db).await, 1);

    // Finish twice is an error, cancel after finish a no-op, and the commit runs in the same
    // transaction (an error in it rolls the whole ending back).
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    let bad = w.finish(TagWrites::none().agent_started([0; 3])).await;
    assert!(matches!(bad, Err(Error::InvalidArgument { .. })), "{bad:?}");
    let still_held = db
        .read(move |tx| Box::pin(async move { tx.machine_work(id).await }))
        .await
        .unwrap();
    assert_eq!(
        still_held.len(),
        1,
        "a failed commit must not release the lock"
    );
    w.finish(TagWrites::none().agent_started(key(2)))
        .await
        .unwrap();
    assert!(matches!(
        w.finish(TagWrites::none()).await,
        Err(Error::WorkAlreadyDone("finished"))
    ));
    assert!(matches!(
        w.fail(None, "late").await,
        Err(Error::WorkAlreadyDone("finished"))
    ));
    w.cancel("test").await.unwrap();
    let events: Vec<_> = history(&db, id)
        .await
        .into_iter()
        .map(|e| e.event)
        .collect();
    use WorkEvent::*;
    assert_eq!(events, vec![Started, Canceled, Started, Finished]);

    // Dropping unended work cancels it in the background.
    db.transact(move |tx| Box::pin(async move { tx.delete_agent_started(id).await.map(|_| ()) }))
        .await
        .unwrap();
    let w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    drop(w);
    for _ in 0..100 {
        if count_start(&db).await == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(count_start(&db).await, 1);
    assert_eq!(history(&db, id).await.last().unwrap().event, Canceled);
}

async fn backoff_is_persisted_and_grows(db: Bmdb) {
    let id = testing::provision(&db, 1, Provider::Sim).await[0];
    let s = session(&db, "backoff").await;
    let b = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(60), 2.0);
    let backoff_row = |db: Bmdb| async move {
        let rows = db
            .read(move |tx| Box::pin(async move { tx.machine_backoffs(id).await }))
            .await
            .unwrap();
        let now = db
            .read(|tx| Box::pin(async move { tx.now().await }))
            .await
            .unwrap();
        rows.into_iter().next().map(|r| {
            (
                r.last_interval_seconds,
                (r.until - now).num_milliseconds(),
                r.cause,
            )
        })
    };

    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    assert_eq!(w.previous_backoff_seconds(), None);
    w.fail(Some(&b), "first failure").await.unwrap();
    let (last, remaining_ms, cause) = backoff_row(db.clone()).await.unwrap();
    assert_eq!((last, cause.as_str()), (1, "first failure"));
    assert!((0..=1000).contains(&remaining_ms), "{remaining_ms}");
    assert_eq!(count_start(&db).await, 0);
    assert!(matches!(
        s.work(Process::ShepherdAgentStart, START).await.unwrap(),
        Claim::NothingToDo
    ));
    // Another process is not held back by this process's backoff.
    let unit = db
        .read(|tx| Box::pin(async move { tx.count_eligible(Process::UnitTest1, &START).await }))
        .await
        .unwrap();
    assert_eq!(unit, 1);

    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    assert_eq!(w.previous_backoff_seconds(), Some(1));
    w.fail(Some(&b), "second failure").await.unwrap();
    let (last, remaining_ms, _) = backoff_row(db.clone()).await.unwrap();
    assert_eq!(last, 2);
    assert!((1000..=2000).contains(&remaining_ms), "{remaining_ms}");

    tokio::time::sleep(Duration::from_millis(2100)).await;
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    assert_eq!(w.previous_backoff_seconds(), Some(2));
    w.finish(TagWrites::none()).await.unwrap();
    assert_eq!(
        backoff_row(db.clone()).await,
        None,
        "finish clears the backoff"
    );

    // After a finish the next failure starts again at the initial interval.
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    assert_eq!(w.previous_backoff_seconds(), None);
    w.fail(None, "no descriptor").await.unwrap();
    assert_eq!(backoff_row(db.clone()).await.unwrap().0, 1);
    let failed = history(&db, id)
        .await
        .into_iter()
        .filter(|e| e.event == WorkEvent::Failed)
        .count();
    assert_eq!(failed, 3);
}

/// 16 workers in 4 sessions over 1,000 machines: every machine is processed exactly once and
/// no two work intervals on one machine overlap, as the audit history shows.
async fn claims_are_exclusive_under_parallelism(db: Bmdb) {
    const MACHINES: usize = 1000;
    testing::provision(&db, MACHINES, Provider::Sim).await;
    let conflicts = Arc::new(AtomicU64::new(0));
    let claims = Arc::new(AtomicU64::new(0));
    let mut workers = vec![];
    for s in 0..4 {
        let session = session(&db, &format!("replica-{s}")).await;
        for _ in 0..4 {
            let (session, conflicts, claims) = (session.clone(), conflicts.clone(), claims.clone());
            workers.push(tokio::spawn(async move {
                let mut idle = 0;
                while idle < 3 {
                    match session
                        .work(Process::ShepherdAgentStart, START)
                        .await
                        .unwrap()
                    {
                        Claim::Work(mut w) => {
                            idle = 0;
                            claims.fetch_add(1, Ordering::Relaxed);
                            tokio::task::yield_now().await;
                            w.finish(TagWrites::none().agent_started(key(9)))
                                .await
                                .unwrap();
                        }
                        Claim::Conflict => {
                            conflicts.fetch_add(1, Ordering::Relaxed);
                        }
                        Claim::NothingToDo => {
                            idle += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            }));
        }
    }
    for w in workers {
        w.await.unwrap();
    }
    let claims = claims.load(Ordering::Relaxed);
    let conflicts = conflicts.load(Ordering::Relaxed);
    assert_eq!(claims, MACHINES as u64, "each machine claimed exactly once");
    assert!(
        (conflicts as f64) < 0.01 * (claims + conflicts) as f64,
        "conflict rate too high: {conflicts} conflicts in {} attempts",
        claims + conflicts
    );
    let status = db.status_counts().await.unwrap();
    assert_eq!(status.agent_started, MACHINES as i64);
    assert!(status.work.is_empty());
    // The workers' concurrent claims were served together, not one statement each.
    let (batches, requests) = db.metrics().claim_batches(Processor::ShepherdInitializer);
    assert!(
        requests >= claims + conflicts,
        "every request was in a batch"
    );
    assert!(
        batches < requests,
        "{requests} claims in {batches} batches: none shared"
    );

    // Audit: per (machine, process) events alternate Started / ending, never two Started in a row.
    let entries = testing::all_history(&db).await;
    let mut open: HashMap<(Uuid, Process), Uuid> = HashMap::new();
    let mut started: HashMap<Uuid, u32> = HashMap::new();
    for e in &entries {
        let k = (e.machine_id, e.process);
        match e.event {
            WorkEvent::Started => {
                assert!(
                    open.insert(k, e.session_id.unwrap()).is_none(),
                    "overlapping work on {k:?}"
                );
                *started.entry(e.machine_id).or_default() += 1;
            }
            _ => {
                let holder = open
                    .remove(&k)
                    .unwrap_or_else(|| panic!("{:?} without Started on {k:?}", e.event));
                assert_eq!(Some(holder), e.session_id, "ended by another session");
            }
        }
    }
    assert!(open.is_empty());
    assert_eq!(started.len(), MACHINES);
    assert!(started.values().all(|n| *n == 1));
}

/// A fleet where almost every machine is ineligible (agents started): claims still find the
/// few eligible ones wherever they are, then report nothing to do.
async fn sparse_eligible_machines_are_found(db: Bmdb) {
    let ids = testing::provision(&db, 1500, Provider::Sim).await;
    let keep: BTreeSet<Uuid> = [ids[3], ids[700], ids[1499]].into_iter().collect();
    start_all_but(&db, &ids, &keep).await;
    let s = session(&db, "sparse").await;
    let mut found = BTreeSet::new();
    for _ in 0..3 {
        found.insert(claim_and_start(&s).await);
    }
    assert_eq!(found, keep);
    for _ in 0..5 {
        assert!(matches!(
            s.work(Process::ShepherdAgentStart, START).await.unwrap(),
            Claim::NothingToDo
        ));
    }
}

// -------------------------------------------------------------------------------------------
// Eligibility against a plain-Rust model of SPEC §5

#[derive(Debug, Clone)]
struct Fleet {
    id: Uuid,
    provider: Provider,
    started_min_ago: Option<i64>,
    heartbeat_min_ago: Option<i64>,
    request_gen: Option<i64>,
    report: Option<(i64, InstallationResult)>,
    work: Option<Process>,
    backoff: Option<(Process, bool)>,
}

fn model_eligible(m: &Fleet, process: Process, retrieval: &Retrieval) -> bool {
    if m.provider != retrieval.provider() {
        return false;
    }
    if m.work.is_some_and(|w| process.exclusion_set().contains(&w)) {
        return false;
    }
    if m.backoff.is_some_and(|(p, active)| p == process && active) {
        return false;
    }
    let report_gen_matches = |req: i64, need_success: bool| {
        m.report
            .is_some_and(|(g, r)| g == req && (!need_success || r == InstallationResult::Success))
    };
    match retrieval {
        Retrieval::AgentStart { .. } => {
            m.started_min_ago.is_none()
                && !m.request_gen.is_some_and(|g| report_gen_matches(g, false))
        }
        Retrieval::AgentRecovery { thresholds, .. } => {
            let Some(started) = m.started_min_ago else {
                return false;
            };
            if m.request_gen.is_some_and(|g| report_gen_matches(g, true)) {
                return false;
            }
            let start_limit = thresholds.no_heartbeat_after_start.as_secs() as i64 / 60;
            let hb_limit = thresholds.heartbeat_older_than.as_secs() as i64 / 60;
            match m.heartbeat_min_ago {
                None => started > start_limit,
                Some(hb) => hb > hb_limit,
            }
        }
    }
}

async fn eligibility_matches_model(db: Bmdb) {
    let seed: u64 = rand::random();
    eprintln!("eligibility fleet seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let holder = session(&db, "holder").await;
    let procs = [
        Process::ShepherdAgentStart,
        Process::ShepherdRecovery,
        Process::ShepherdAccess,
        Process::UnitTest1,
    ];
    let mut fleet = vec![];
    for _ in 0..400 {
        let pick = |rng: &mut StdRng, p: f64| rng.random_bool(p);
        let started = pick(&mut rng, 0.6).then(|| [1, 20, 45, 120][rng.random_range(0..4)]);
        fleet.push(Fleet {
            id: Uuid::nil(),
            provider: if pick(&mut rng, 0.8) {
                Provider::Sim
            } else {
                Provider::Static
            },
            started_min_ago: started,
            heartbeat_min_ago: (started.is_some() && pick(&mut rng, 0.6))
                .then(|| [1, 5, 15, 60][rng.random_range(0..4)]),
            request_gen: pick(&mut rng, 0.3).then(|| rng.random_range(1..3)),
            report: pick(&mut rng, 0.3).then(|| {
                let r = if pick(&mut rng, 0.5) {
                    InstallationResult::Success
                } else {
                    InstallationResult::Error
                };
                (rng.random_range(1..3), r)
            }),
            work: pick(&mut rng, 0.2).then(|| procs[rng.random_range(0..procs.len())]),
            backoff: pick(&mut rng, 0.25).then(|| {
                let p = if pick(&mut rng, 0.5) {
                    Process::ShepherdAgentStart
                } else {
                    Process::ShepherdRecovery
                };
                (p, pick(&mut rng, 0.5))
            }),
        });
    }
    let sid = holder.id();
    let fleet = db
        .transact(move |tx| {
            let mut fleet = fleet.clone();
            Box::pin(async move {
                let now = tx.now().await?;
                let ago = |min: i64| now - chrono::Duration::minutes(min);
                for m in fleet.iter_mut() {
                    m.id = tx.create_machine().await?;
                    tx.set_provided(m.id, &Provided::new(m.provider, m.id.to_string()))
                        .await?;
                    if let Some(min) = m.started_min_ago {
                        tx.set_agent_started_at(m.id, Some(ago(min)), &key(3))
                            .await?;
                    }
                    if let Some(min) = m.heartbeat_min_ago {
                        tx.set_heartbeat_at(m.id, ago(min)).await?;
                    }
                    if let Some(g) = m.request_gen {
                        tx.set_os_installation_request(
                            m.id,
                            &OsInstallationRequest {
                                generation: g,
                                request_raw: vec![],
                            },
                        )
                        .await?;
                    }
                    if let Some((g, result)) = m.report {
                        tx.set_os_installation_report(
                            m.id,
                            &OsInstallationReport {
                                generation: g,
                                result,
                                report_raw: vec![],
                            },
                        )
                        .await?;
                    }
                    if let Some(p) = m.work {
                        tx.insert_work_raw(m.id, sid, p).await?;
                    }
                    if let Some((p, active)) = m.backoff {
                        let until = if active {
                            now + chrono::Duration::hours(1)
                        } else {
                            ago(1)
                        };
                        tx.set_backoff(m.id, p, until, 60, "test").await?;
                    }
                }
                Ok(fleet)
            })
        })
        .await
        .unwrap();

    let thresholds = RecoveryThresholds::default();
    let short = RecoveryThresholds {
        no_heartbeat_after_start: Duration::from_secs(600),
        heartbeat_older_than: Duration::from_secs(180),
    };
    let cases = [
        (
            Process::ShepherdAgentStart,
            Retrieval::AgentStart {
                provider: Provider::Sim,
            },
        ),
        (
            Process::ShepherdAgentStart,
            Retrieval::AgentStart {
                provider: Provider::Static,
            },
        ),
        (
            Process::UnitTest1,
            Retrieval::AgentStart {
                provider: Provider::Sim,
            },
        ),
        (
            Process::ShepherdRecovery,
            Retrieval::AgentRecovery {
                provider: Provider::Sim,
                thresholds,
            },
        ),
        (
            Process::ShepherdRecovery,
            Retrieval::AgentRecovery {
                provider: Provider::Static,
                thresholds,
            },
        ),
        (
            Process::ShepherdRecovery,
            Retrieval::AgentRecovery {
                provider: Provider::Sim,
                thresholds: short,
            },
        ),
    ];
    for (process, retrieval) in cases {
        let want: BTreeSet<Uuid> = fleet
            .iter()
            .filter(|m| model_eligible(m, process, &retrieval))
            .map(|m| m.id)
            .collect();
        let (got, count) = db
            .read(move |tx| {
                Box::pin(async move {
                    Ok((
                        tx.eligible_machines(process, &retrieval, 10_000).await?,
                        tx.count_eligible(process, &retrieval).await?,
                    ))
                })
            })
            .await
            .unwrap();
        let got: BTreeSet<Uuid> = got.into_iter().collect();
        assert_eq!(
            count as usize,
            got.len(),
            "count query disagrees for {process} {retrieval:?}"
        );
        if got != want {
            let extra: Vec<_> = fleet
                .iter()
                .filter(|m| got.contains(&m.id) && !want.contains(&m.id))
                .collect();
            let missing: Vec<_> = fleet
                .iter()
                .filter(|m| !got.contains(&m.id) && want.contains(&m.id))
                .collect();
            panic!(
                "{process} {retrieval:?} (seed {seed}):\nextra {extra:#?}\nmissing {missing:#?}"
            );
        }
        assert!(
            !want.is_empty() || process == Process::ShepherdRecovery,
            "degenerate fleet for {process}"
        );
    }
}

/// The heartbeat hot path: authorization by key, the write, the pending request, and an
/// expired session refusing to write.
async fn agent_heartbeats(db: Bmdb) {
    let s = session(&db, "bmsrv").await;
    let (key, other) = (vec![7u8; 32], vec![8u8; 32]);
    let m = testing::machine_with_agent(&db, &key).await;
    let beat = |db: Bmdb| async move {
        db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()
    };
    assert_eq!(
        s.agent_heartbeat(m, &other, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Unauthorized
    );
    assert_eq!(
        s.agent_heartbeat(Uuid::new_v4(), &key, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Unauthorized
    );
    assert!(
        beat(db.clone()).await.is_none(),
        "written without authorization"
    );
    assert_eq!(
        s.agent_heartbeat(m, &key, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Recorded {
            pending_request: None
        }
    );
    let first = beat(db.clone()).await.unwrap();

    let request = |generation| OsInstallationRequest {
        generation,
        request_raw: vec![generation as u8; 3],
    };
    db.transact(move |tx| {
        Box::pin(async move { tx.set_os_installation_request(m, &request(1)).await })
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        s.agent_heartbeat(m, &key, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Recorded {
            pending_request: Some(vec![1; 3])
        }
    );
    assert!(
        beat(db.clone()).await.unwrap() > first,
        "heartbeat time moves"
    );
    let report = |generation| OsInstallationReport {
        generation,
        result: InstallationResult::Success,
        report_raw: vec![],
    };
    // Reports travel with a heartbeat, through the same entry point and the same key check.
    let with_report = AgentReport {
        hardware: Some(vec![9; 4]),
        installation: Some(report(1)),
    };
    let stored = |db: Bmdb| async move {
        db.read(move |tx| {
            Box::pin(async move {
                Ok((
                    tx.hardware_report(m).await?,
                    tx.os_installation_report(m).await?,
                ))
            })
        })
        .await
        .unwrap()
    };
    assert_eq!(
        s.agent_heartbeat(m, &other, &with_report).await.unwrap(),
        AgentHeartbeat::Unauthorized
    );
    assert_eq!(
        stored(db.clone()).await,
        (None, None),
        "stored without authorization"
    );
    assert_eq!(
        s.agent_heartbeat(m, &key, &with_report).await.unwrap(),
        AgentHeartbeat::Recorded {
            pending_request: None
        },
        "the report fulfils the request it answers"
    );
    assert_eq!(
        stored(db.clone()).await,
        (Some(vec![9; 4]), Some(report(1)))
    );

    // A session whose row is gone may not write.
    let dead = session(&db, "bmsrv-dead").await;
    let id = dead.id();
    dead.stop_keepalive();
    db.transact(move |tx| Box::pin(async move { tx.delete_session_raw(id).await }))
        .await
        .unwrap();
    let before = beat(db.clone()).await;
    assert!(matches!(
        dead.agent_heartbeat(m, &key, &AgentReport::default()).await,
        Err(Error::SessionExpired)
    ));
    assert_eq!(beat(db.clone()).await, before);
}

async fn summaries_and_fleet_counts(db: Bmdb) {
    let (seeded, session) = testing::seed_every_state(&db).await;
    let now = Utc::now();
    let all = db
        .read(|tx| Box::pin(async move { tx.machine_summaries(None, None, 1000).await }))
        .await
        .unwrap();
    assert_eq!(all.len(), seeded.len());
    for m in &seeded {
        let s = all.iter().find(|s| s.machine_id == m.id).expect("listed");
        assert_eq!(
            s.lifecycle(now, RecoveryThresholds::default().stale_after()),
            m.state,
            "{m:?}: {s:?}"
        );
        assert_eq!(
            s.provided.as_ref().map(|p| p.provider_id.clone()),
            m.provider_id
        );
    }
    let in_work = seeded
        .iter()
        .find(|m| m.state == Lifecycle::InWork)
        .unwrap();
    let one = db
        .read({
            let id = in_work.id;
            move |tx| Box::pin(async move { tx.machine_summary(id).await })
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(one.work, vec![Process::ShepherdAgentStart]);
    let sid = session.id();
    let held = db
        .read(move |tx| Box::pin(async move { tx.session_work(sid).await }))
        .await
        .unwrap();
    assert_eq!(held, vec![(in_work.id, Process::ShepherdAgentStart)]);
    assert!(db
        .read(|tx| Box::pin(async move { tx.machine_summary(Uuid::new_v4()).await }))
        .await
        .unwrap()
        .is_none());

    // Paging in id order with a provider filter visits every Static machine exactly once.
    let mut after = None;
    let mut paged = vec![];
    loop {
        let page = db
            .read(move |tx| {
                Box::pin(
                    async move { tx.machine_summaries(after, Some(Provider::Static), 3).await },
                )
            })
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.machine_id);
        paged.extend(page.into_iter().map(|s| s.machine_id));
    }
    let mut want: Vec<Uuid> = seeded
        .iter()
        .filter(|m| m.provider_id.as_deref().is_some_and(|p| p != "box-0"))
        .map(|m| m.id)
        .collect();
    want.sort();
    assert_eq!(paged, want);

    let c = fleet_counts(&db).await;
    assert_eq!(c.machines, 9);
    assert_eq!(c.provided, vec![(Provider::Sim, 1), (Provider::Static, 7)]);
    assert_eq!(c.agent_started, 5);
    assert_eq!((c.heartbeating, c.stale), (3, 1));
    assert_eq!((c.pending_install, c.installed), (1, 1));
    assert_eq!(c.work, vec![(Process::ShepherdAgentStart, 1)]);
    assert_eq!(c.backoffs, vec![(Process::ShepherdAgentStart, 1)]);
    assert_eq!(c.missing, 0);

    // A provided machine the provider stopped listing counts as missing.
    let listed = seeded
        .iter()
        .find(|m| m.provider_id.is_some())
        .expect("a provided machine")
        .id;
    db.transact(move |tx| {
        Box::pin(async move {
            let mut p = tx.provided(listed).await?.expect("provided");
            p.status = Some(ProviderStatus::Missing);
            tx.set_provided(listed, &p).await
        })
    })
    .await
    .unwrap();
    assert_eq!(fleet_counts(&db).await.missing, 1);

    // As upstream counts: an Error report of the current generation is installed (no longer
    // pending), and counted among the failed ones too.
    db.transact(|tx| {
        Box::pin(async move {
            let id = tx.create_machine().await?;
            tx.set_os_installation_request(
                id,
                &OsInstallationRequest {
                    generation: 2,
                    request_raw: vec![],
                },
            )
            .await?;
            tx.set_os_installation_report(
                id,
                &OsInstallationReport {
                    generation: 2,
                    result: InstallationResult::Error,
                    report_raw: vec![],
                },
            )
            .await
        })
    })
    .await
    .unwrap();
    let c = fleet_counts(&db).await;
    assert_eq!(
        (c.pending_install, c.installed, c.install_failed),
        (1, 2, 1)
    );
    session.close().await.unwrap();
}

/// A transaction dropped at any point (a shutdown, a timeout) leaves no transaction open on
/// its connection and nothing half-written: every later transaction works, and each
/// transaction's two machines were written together or not at all.
async fn cancelled_transactions_leave_nothing_open(db: Bmdb) {
    let session = db
        .start_session(SessionConfig::new("cancel-test", Processor::Unknown))
        .await
        .unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    for i in 0..300 {
        // From "before BEGIN is sent" to "after COMMIT": cancellation lands everywhere.
        let within = Duration::from_micros(rng.random_range(0..3_000));
        fn two_machines(tx: &mut Tx) -> TxFuture<'_, ()> {
            Box::pin(async move {
                tx.create_machine().await?;
                tx.create_machine().await?;
                Ok(())
            })
        }
        if i % 2 == 0 {
            let _ = tokio::time::timeout(within, db.transact(two_machines)).await;
        } else {
            let _ = tokio::time::timeout(within, session.transact(two_machines)).await;
        }
    }
    for _ in 0..20 {
        db.transact(|tx| Box::pin(async move { tx.create_machine().await }))
            .await
            .expect("a transaction after cancellations");
        session
            .transact(|tx| Box::pin(async move { tx.create_machine().await }))
            .await
            .expect("a session transaction after cancellations");
    }
    let machines = db
        .read(|tx| Box::pin(async move { tx.machine_ids(None, 100_000).await }))
        .await
        .unwrap()
        .len();
    assert_eq!(
        machines % 2,
        0,
        "a transaction was half-written: {machines} machines"
    );
    session.close().await.unwrap();
}

/// Concurrent bare heartbeats are group-committed: far fewer transactions than heartbeats,
/// yet each caller gets its own answer — authorized or not, with its own pending request —
/// and only authorized heartbeats are written.
async fn heartbeats_are_group_committed(db: Bmdb) {
    const MACHINES: usize = 300;
    let s = session(&db, "bmsrv").await;
    let machines: Vec<Uuid> = db
        .transact(|tx| {
            Box::pin(async move {
                let mut ids = Vec::new();
                for i in 0..MACHINES {
                    let id = tx.create_machine().await?;
                    tx.set_agent_started(id, &[(i % 200) as u8; 32]).await?;
                    if i % 3 == 0 {
                        let request = OsInstallationRequest {
                            generation: i as i64,
                            request_raw: vec![i as u8; 2],
                        };
                        tx.set_os_installation_request(id, &request).await?;
                    }
                    ids.push(id);
                }
                Ok(ids)
            })
        })
        .await
        .unwrap();
    let (batches_before, _) = db.metrics().heartbeat_batches(s.processor());
    // Every fifth agent presents the wrong key; the first ten heartbeat twice at once (the
    // same machine twice in one batch is written once and answered twice).
    let key_of = |i: usize| {
        if i % 5 == 4 {
            [255u8; 32]
        } else {
            [(i % 200) as u8; 32]
        }
    };
    let expected = |i: usize| {
        if i % 5 == 4 {
            AgentHeartbeat::Unauthorized
        } else {
            AgentHeartbeat::Recorded {
                pending_request: i.is_multiple_of(3).then(|| vec![i as u8; 2]),
            }
        }
    };
    let mut calls = Vec::new();
    for (i, &machine) in machines[..10].iter().chain(&machines).enumerate() {
        let i = if i < 10 { i } else { i - 10 };
        let (s, key) = (s.clone(), key_of(i));
        let call = tokio::spawn(async move {
            s.agent_heartbeat(machine, &key, &AgentReport::default())
                .await
                .unwrap()
        });
        calls.push((i, call));
    }
    for (i, call) in calls {
        assert_eq!(call.await.unwrap(), expected(i), "heartbeat {i}");
    }
    let written = db
        .read(move |tx| {
            let machines = machines.clone();
            Box::pin(async move {
                let mut written = Vec::new();
                for m in machines {
                    written.push(tx.heartbeat(m).await?.is_some());
                }
                Ok(written)
            })
        })
        .await
        .unwrap();
    for (i, written) in written.into_iter().enumerate() {
        assert_eq!(written, i % 5 != 4, "heartbeat {i} written");
    }
    let (batches, beats) = db.metrics().heartbeat_batches(s.processor());
    let batches = batches - batches_before;
    assert_eq!(beats, MACHINES as u64 + 10);
    assert!(
        batches * 4 <= MACHINES as u64,
        "{MACHINES} concurrent heartbeats took {batches} transactions"
    );
}

/// A worker that goes away while its claim is being made (its loop was cancelled) leaves no
/// machine locked: the work claimed for it is released with Canceled history.
async fn a_claim_nobody_waits_for_is_released(db: Bmdb) {
    let id = testing::provision(&db, 1, Provider::Sim).await[0];
    let s = session(&db, "goes-away").await;
    let mut claim = Box::pin(s.work(Process::ShepherdAgentStart, START));
    assert!(
        futures::poll!(claim.as_mut()).is_pending(),
        "the claim was asked for"
    );
    drop(claim);
    let events = testing::eventually("the claim released", Duration::from_secs(10), async || {
        let events = testing::history_as(&db, |e| (e.machine_id, e.event)).await;
        let work = db.status_counts().await.unwrap().work;
        testing::when(events.len() == 2 && work.is_empty(), events)
    })
    .await;
    assert_eq!(
        events,
        [(id, WorkEvent::Started), (id, WorkEvent::Canceled)],
        "claimed, then released"
    );
    // Released, the machine is claimed again at once.
    assert_eq!(
        claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap()).machine_id(),
        id
    );
    s.close().await.unwrap();
}

/// Endings of concurrent workers are committed together, with every kind of tag a finish
/// writes; one whose tags are refused fails alone: the others' endings and tags commit, its
/// own writes are undone (its work is still held) and it is told its own error, not the
/// batch's. Two refusals: a host key pinned already (found by the database) and a malformed
/// agent key (found before anything is written).
async fn a_failed_ending_fails_only_its_own_work(db: Bmdb) {
    const WORKS: usize = 8;
    testing::provision(&db, WORKS, Provider::Sim).await;
    let s = session(&db, "enders").await;
    let mut works = Vec::new();
    for _ in 0..WORKS {
        works.push(claimed(
            s.work(Process::ShepherdAgentStart, START).await.unwrap(),
        ));
    }
    let id = |w: &Work| w.machine_id();
    let mut first = works.remove(0);
    let (first_id, pinned, silenced) = (first.machine_id(), id(&works[3]), id(&works[2]));
    db.transact(move |tx| {
        Box::pin(async move {
            tx.pin_ssh_host_key(pinned, "ssh-ed25519 another").await?;
            tx.set_heartbeat(silenced).await
        })
    })
    .await
    .unwrap();
    let processor = s.processor();
    let before = db.metrics().ending_batches(processor);
    // Another transaction holds the first machine's agent tag (and, on SQLite, the writer) a
    // while, so the first finish waits in its batch and the others gather behind it.
    let holding = tokio::spawn({
        let db = db.clone();
        async move {
            db.transact(move |tx| {
                Box::pin(async move {
                    tx.set_agent_started(first_id, &key(1)).await?;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    Ok(())
                })
            })
            .await
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let first_finish =
        tokio::spawn(async move { first.finish(TagWrites::none().agent_started(key(1))).await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = || TagWrites::none().agent_started(key(2));
    let tags = [
        started().pin_ssh_host_key("ssh-ed25519 zero"),
        started().recovery(3).hold_back(
            Process::ShepherdRecovery,
            Duration::from_secs(3600),
            60,
            "held",
        ),
        TagWrites::none()
            .forget_heartbeat()
            .pin_ssh_host_key("ssh-ed25519 two"),
        started().pin_ssh_host_key("ssh-ed25519 three"),
        TagWrites::none().agent_started(vec![0; 3]),
        started().pin_ssh_host_key("ssh-ed25519 five"),
        started(),
    ];
    let endings = works.iter_mut().zip(tags).map(|(w, t)| w.finish(t));
    let outcomes = futures::future::join_all(endings).await;
    holding.await.unwrap().unwrap();
    first_finish.await.unwrap().unwrap();
    let (batches, endings) = db.metrics().ending_batches(processor);
    assert_eq!(
        (batches - before.0, endings - before.1),
        (2, WORKS as u64),
        "the first finish alone, the other seven together"
    );
    let refused = [id(&works[3]), id(&works[4])];
    for (i, outcome) in outcomes.iter().enumerate() {
        match (i, outcome) {
            (3, Err(Error::HostKeyPinned { pinned, presented })) => {
                assert_eq!(
                    (&**pinned, &**presented),
                    ("ssh-ed25519 another", "ssh-ed25519 three")
                )
            }
            (4, Err(Error::InvalidArgument { .. })) => {}
            (0..=2 | 5..=6, Ok(())) => {}
            other => panic!("each its own outcome, not the batch's: {other:?}"),
        }
    }
    let status = db.status_counts().await.unwrap();
    assert_eq!(status.agent_started, 5, "the first, and 0, 1, 5 and 6");
    assert_eq!(
        status.work,
        vec![(Process::ShepherdAgentStart, 2)],
        "the refused endings' work is still held"
    );
    let (zero, one) = (id(&works[0]), id(&works[1]));
    let tagged = db
        .read(move |tx| {
            Box::pin(async move {
                Ok((
                    tx.ssh_host_key(zero).await?.map(|k| k.key),
                    tx.ssh_host_key(pinned).await?.map(|k| k.key),
                    tx.recovery(one).await?.map(|r| r.in_a_row),
                    tx.machine_backoffs(one).await?,
                    tx.heartbeat(silenced).await?,
                ))
            })
        })
        .await
        .unwrap();
    let (zero_key, pinned_key, in_a_row, backoffs, heartbeat) = tagged;
    assert_eq!(zero_key.as_deref(), Some("ssh-ed25519 zero"));
    assert_eq!(pinned_key.as_deref(), Some("ssh-ed25519 another"), "kept");
    assert_eq!(in_a_row, Some(3));
    let held: Vec<_> = backoffs
        .iter()
        .map(|b| (b.process, &*b.cause, b.last_interval_seconds))
        .collect();
    assert_eq!(held, [(Process::ShepherdRecovery, "held", 60)]);
    let wait = backoffs[0].until - Utc::now();
    assert!(wait > chrono::TimeDelta::minutes(59) && wait <= chrono::TimeDelta::hours(1));
    assert_eq!(heartbeat, None, "forgotten");
    let finished = testing::history_as(&db, |e| (e.machine_id, e.event)).await;
    for r in refused {
        assert!(!finished.contains(&(r, WorkEvent::Finished)));
    }
    assert_eq!(
        finished
            .iter()
            .filter(|(_, e)| *e == WorkEvent::Finished)
            .count(),
        WORKS - 2
    );
    // The refused ones can still be ended as the loop's policy says.
    for mut w in works.drain(3..5) {
        w.fail(None, "tagging refused").await.unwrap();
    }
    assert!(db.status_counts().await.unwrap().work.is_empty());
    s.close().await.unwrap();
}

/// A session whose row is gone (expired, and collected by another replica) claims nothing,
/// whether its claim is served alone or together with a live session's: the claim statement
/// checks each request's session itself (Postgres has one statement for a lone request and
/// one for a batch).
async fn a_session_whose_row_is_gone_claims_nothing(db: Bmdb) {
    testing::provision(&db, 2, Provider::Sim).await;
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

/// A failure cause is stored whatever its text: a NUL (which Postgres' text refuses) is
/// replaced, so that one odd error message cannot fail the batch of endings it shares.
async fn a_failure_cause_with_a_nul_is_stored(db: Bmdb) {
    testing::provision(&db, 1, Provider::Sim).await;
    let s = session(&db, "nul").await;
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    let id = w.machine_id();
    w.fail(None, "stderr: a\0b").await.unwrap();
    let failed = history(&db, id).await.pop().unwrap();
    assert_eq!(failed.event, WorkEvent::Failed);
    assert_eq!(failed.cause.as_deref(), Some("stderr: a\u{fffd}b"));
    s.close().await.unwrap();
}

/// Provider skips: a skip is read back until it ends, a second skip of the same id replaces
/// the first, and skips of another provider are apart.
async fn provider_skips_are_shared_until_they_end(db: Bmdb) {
    let skip = |id: &'static str, provider: Provider, secs: i64| {
        db.transact(move |tx| {
            Box::pin(async move {
                let until = tx.now().await? + chrono::Duration::seconds(secs);
                tx.skip_provider_id(provider, id, until, "refused: 400\0")
                    .await
            })
        })
    };
    let skipped = |provider: Provider| {
        db.read(move |tx| Box::pin(async move { tx.skipped_provider_ids(provider).await }))
    };
    skip("node-b", Provider::Ironic, 600).await.unwrap();
    skip("node-a", Provider::Ironic, -1).await.unwrap();
    skip("node-c", Provider::Static, 600).await.unwrap();
    let now = skipped(Provider::Ironic).await.unwrap();
    assert_eq!(now.len(), 1, "the ended skip is not read: {now:?}");
    assert_eq!(now[0].provider_id, "node-b");
    assert_eq!(now[0].cause, "refused: 400\u{fffd}");
    assert!(now[0].until > now[0].at);
    // Skipped again for longer, with another cause: one row, the new one.
    skip("node-b", Provider::Ironic, 1200).await.unwrap();
    let again = skipped(Provider::Ironic).await.unwrap();
    assert_eq!(again.len(), 1);
    assert!(again[0].until > now[0].until);
    assert_eq!(skipped(Provider::Static).await.unwrap().len(), 1);
}

shepherd_bmdb::conformance_tests!(
    provider_skips_are_shared_until_they_end,
    a_failure_cause_with_a_nul_is_stored,
    a_session_whose_row_is_gone_claims_nothing,
    a_claim_nobody_waits_for_is_released,
    a_failed_ending_fails_only_its_own_work,
    cancelled_transactions_leave_nothing_open,
    summaries_and_fleet_counts,
    agent_heartbeats,
    heartbeats_are_group_committed,
    migrations_are_idempotent,
    tags_round_trip,
    session_expiry_releases_work,
    closing_a_session_releases_its_work,
    closing_a_session_while_its_work_ends_records_each_ending_once,
    closing_a_session_while_it_claims_leaves_no_claim_without_an_ending,
    work_endings,
    backoff_is_persisted_and_grows,
    claims_are_exclusive_under_parallelism,
    sparse_eligible_machines_are_found,
    eligibility_matches_model,
);

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
        let machine = testing::provision(&t.db, 1, Provider::Sim).await[0];
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

    let mut tx = f.raw.begin().await.unwrap();
    sqlx::query(
        "WITH del AS (DELETE FROM work WHERE machine_id = $1 RETURNING machine_id, process, session_id)
         INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
         SELECT machine_id, process, 'Canceled', now(), session_id, 'ended elsewhere' FROM del",
    )
    .bind(id)
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(
        collect_while_held(&db, tx).await,
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
    sqlx::query(
        "WITH w AS (INSERT INTO work (machine_id, session_id, process)
                    VALUES ($1, $2, 'ShepherdAgentStart') RETURNING *)
         INSERT INTO work_history (machine_id, process, event, at, session_id)
         SELECT machine_id, process, 'Started', now(), session_id FROM w",
    )
    .bind(id)
    .bind(session)
    .execute(&mut *tx)
    .await
    .unwrap();
    assert_eq!(
        collect_while_held(&db, tx).await,
        (0, 1),
        "the collection skips the session the claim holds; the next one releases it"
    );
    assert_started_then_canceled(&db, id, "session expired").await;
    let work = fleet_counts(&db).await.work;
    assert!(work.iter().all(|(_, n)| *n == 0), "no work left: {work:?}");
    f.end().await;
}

/// Two handles on one SQLite file behave like two processes: they contend for the file's write
/// lock (BEGIN IMMEDIATE plus the busy timeout) and still never claim a machine twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_share_one_sqlite_file() {
    let t = shepherd_bmdb::testing::sqlite().await;
    let other = Bmdb::open(&t.url).await.expect("second handle");
    testing::provision(&t.db, 300, Provider::Sim).await;
    let mut workers = vec![];
    for db in [t.db.clone(), other.clone()] {
        for w in 0..4 {
            let s = session(&db, &format!("proc-worker-{w}")).await;
            workers.push(tokio::spawn(async move {
                let mut done = 0u32;
                loop {
                    match s.work(Process::ShepherdAgentStart, START).await.unwrap() {
                        Claim::Work(mut work) => {
                            work.finish(TagWrites::none().agent_started(key(5)))
                                .await
                                .unwrap();
                            done += 1;
                        }
                        Claim::Conflict => {}
                        Claim::NothingToDo => return done,
                    }
                }
            }));
        }
    }
    let mut total = 0;
    for w in workers {
        total += w.await.unwrap();
    }
    assert_eq!(total, 300);
    let counts = other.status_counts().await.unwrap();
    assert_eq!((counts.agent_started, counts.history_entries), (300, 600));
    other.close().await;
    t.cleanup().await;
}

fn searches(db: &Bmdb, search: ClaimSearch, claimed: bool) -> u64 {
    db.metrics().claim_searches(
        Processor::ShepherdInitializer,
        Process::ShepherdAgentStart,
        search,
        claimed,
    )
}

/// On Postgres a full search keeps its other candidates as hints for the next claims of the
/// same handle: a sparse fleet drains with one full search per many claims, each machine
/// claimed once; hints made stale by another replica are re-checked and never claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_claims_reuse_leftover_candidates() {
    let Some(t) = shepherd_bmdb::testing::postgres().await else {
        return;
    };
    let db = t.db.clone();
    let ids = testing::provision(&db, 3000, Provider::Sim).await;
    // 40 eligible machines spread over 3,000: the 64-id window search mostly misses.
    let eligible: BTreeSet<Uuid> = ids.iter().copied().step_by(75).collect();
    assert_eq!(eligible.len(), 40);
    start_all_but(&db, &ids, &eligible).await;

    let s = session(&db, "hinted").await;
    let mut found = BTreeSet::new();
    for _ in 0..20 {
        assert!(found.insert(claim_and_start(&s).await), "claimed twice");
    }
    let full = searches(&db, ClaimSearch::Everywhere, true);
    let hinted = searches(&db, ClaimSearch::Hinted, true);
    let window = searches(&db, ClaimSearch::Window, true);
    assert_eq!(full + hinted + window, 20);
    // Claims before the first full search may hit in the random window (about half do at
    // this density); every claim after it is served by its hints, so there is exactly one.
    // Without hints most later claims would search everywhere again.
    assert!(
        full == 1 && hinted >= 1,
        "later claims are served by hints: {hinted} hinted, {window} window, {full} full searches"
    );

    // Another replica (its own handle, so it has no hints) processes the other 20. Our hints
    // now name machines that are no longer eligible: they must be dropped, not claimed.
    let other = Bmdb::open(&t.url).await.unwrap();
    let o = session(&other, "other-replica").await;
    for _ in 0..20 {
        assert!(found.insert(claim_and_start(&o).await), "claimed twice");
    }
    assert_eq!(found, eligible);
    let stale_before = searches(&db, ClaimSearch::Hinted, false);
    assert!(matches!(
        s.work(Process::ShepherdAgentStart, START).await.unwrap(),
        Claim::NothingToDo
    ));
    assert_eq!(
        searches(&db, ClaimSearch::Hinted, false),
        stale_before + 1,
        "the stale hints were checked"
    );
    // The full search found nothing, so no hints remain: the next claim searches afresh.
    let hinted_total = searches(&db, ClaimSearch::Hinted, false);
    assert!(matches!(
        s.work(Process::ShepherdAgentStart, START).await.unwrap(),
        Claim::NothingToDo
    ));
    assert_eq!(searches(&db, ClaimSearch::Hinted, false), hinted_total);
    for id in &eligible {
        let started = history(&db, *id)
            .await
            .iter()
            .filter(|e| e.event == WorkEvent::Started)
            .count();
        assert_eq!(started, 1, "machine {id} claimed once");
    }
    s.close().await.unwrap();
    o.close().await.unwrap();
    other.close().await;
    t.cleanup().await;
}
