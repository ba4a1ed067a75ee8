//! Work endings (`sql/endings.rs`): finished, failed, canceled; backoff; one failed ending
//! among a batch.

use super::*;

async fn work_endings(db: Bmdb) {
    let ids = testing::provision(&db, 1, ProviderKind::Sim).await;
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
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
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
/// Endings of concurrent workers are committed together, with every kind of tag a finish
/// writes; one whose tags are refused fails alone: the others' endings and tags commit, its
/// own writes are undone (its work is still held) and it is told its own error, not the
/// batch's. Two refusals: a host key pinned already (found by the database) and a malformed
/// agent key (found before anything is written).
async fn a_failed_ending_fails_only_its_own_work(db: Bmdb) {
    const WORKS: usize = 8;
    testing::provision(&db, WORKS, ProviderKind::Sim).await;
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
/// A failure cause is stored whatever its text: a NUL (which Postgres' text refuses) is
/// replaced, so that one odd error message cannot fail the batch of endings it shares.
async fn a_failure_cause_with_a_nul_is_stored(db: Bmdb) {
    testing::provision(&db, 1, ProviderKind::Sim).await;
    let s = session(&db, "nul").await;
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    let id = w.machine_id();
    w.fail(None, "stderr: a\0b").await.unwrap();
    let failed = history(&db, id).await.pop().unwrap();
    assert_eq!(failed.event, WorkEvent::Failed);
    assert_eq!(failed.cause.as_deref(), Some("stderr: a\u{fffd}b"));
    s.close().await.unwrap();
}

shepherd_bmdb::conformance_tests!(
    work_endings,
    backoff_is_persisted_and_grows,
    a_failed_ending_fails_only_its_own_work,
    a_failure_cause_with_a_nul_is_stored,
);
