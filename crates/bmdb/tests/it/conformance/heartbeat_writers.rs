//! Servers' heartbeat troubles (`sql/heartbeat_writers.rs`) and the silence they excuse.

use super::*;

/// Both recovery thresholds: ten minutes.
const T: Duration = Duration::from_secs(600);

const MIN: Duration = Duration::from_secs(60);

fn recovery() -> Retrieval {
    Retrieval::AgentRecovery {
        provider: ProviderKind::Sim,
        thresholds: RecoveryThresholds {
            no_heartbeat_after_start: T,
            heartbeat_older_than: T,
        },
    }
}

async fn due(db: &Bmdb) -> BTreeSet<Uuid> {
    db.read(|tx| {
        Box::pin(async move {
            tx.eligible_machines(Process::ShepherdRecovery, &recovery(), 100)
                .await
        })
    })
    .await
    .unwrap()
    .into_iter()
    .collect()
}

async fn report(db: &Bmdb, writer_id: Uuid, state: WriterState) {
    db.report_heartbeat_writer(WriterReport {
        writer_id,
        component: "bmsrv".into(),
        backlog: 3,
        refused: 7,
        state,
    })
    .await
    .unwrap();
}

async fn age(db: &Bmdb, by: Duration) {
    db.transact(move |tx| Box::pin(async move { tx.age_heartbeat_writers(by).await }))
        .await
        .unwrap();
}

/// A machine whose last heartbeat came less than the threshold before a server's trouble
/// began is not due while the trouble goes on, nor for the threshold after it ended, nor while
/// a server that stopped reporting may have lost its heartbeats; silence that began long
/// before any trouble is still due, and so is everything once the troubles are past.
async fn a_servers_trouble_excuses_only_silence_it_may_have_caused(db: Bmdb) {
    let ids = testing::provision(&db, 4, ProviderKind::Sim).await;
    let (beat_15, beat_60, never_15, never_60) = (ids[0], ids[1], ids[2], ids[3]);
    db.transact(move |tx| {
        Box::pin(async move {
            let now = tx.now().await?;
            let ago = |min: i64| now - chrono::Duration::minutes(min);
            for (id, started, beat) in [
                (beat_15, 120, Some(15)),
                (beat_60, 120, Some(60)),
                (never_15, 15, None),
                (never_60, 60, None),
            ] {
                tx.set_agent_started_at(id, Some(ago(started)), &key(1))
                    .await?;
                if let Some(min) = beat {
                    tx.set_heartbeat_at(id, ago(min)).await?;
                }
            }
            Ok(())
        })
    })
    .await
    .unwrap();
    let all: BTreeSet<Uuid> = ids.iter().copied().collect();
    let long_silent: BTreeSet<Uuid> = [beat_60, never_60].into_iter().collect();
    assert_eq!(
        due(&db).await,
        all,
        "no server reports: silence is believed"
    );

    let writer = Uuid::new_v4();
    report(&db, writer, WriterState::Clean).await;
    assert_eq!(due(&db).await, all, "a clean server excuses nothing");

    // In trouble since 12 minutes ago: 15 minutes of silence may be 3 of the machine's and 12
    // of the server's; 60 minutes cannot.
    report(&db, writer, WriterState::Trouble { since: 12 * MIN }).await;
    assert_eq!(due(&db).await, long_silent);
    let (now, overview) = db
        .read(|tx| Box::pin(async move { Ok((tx.now().await?, tx.heartbeat_writers().await?)) }))
        .await
        .unwrap();
    assert_eq!(overview.len(), 1);
    let w = &overview[0];
    assert!(w.in_trouble(now) && !w.is_stale(now), "{w:?}");
    assert_eq!(
        w.in_doubt.end - w.in_doubt.start,
        chrono::Duration::minutes(12)
    );
    assert_eq!((overview[0].backlog, overview[0].refused), (3, 7));

    // Ended 5 minutes ago: agents had less than the threshold to be heard again.
    let ended = WriterState::Ended {
        since: 12 * MIN,
        last: 5 * MIN,
        refused: 7,
        cause: "database".into(),
    };
    report(&db, writer, ended).await;
    assert_eq!(due(&db).await, long_silent);
    let troubles = db
        .read(|tx| Box::pin(async move { tx.recent_heartbeat_troubles(5).await }))
        .await
        .unwrap();
    assert_eq!(troubles.len(), 1);
    assert_eq!(
        (troubles[0].refused, troubles[0].cause.as_str()),
        (7, "database")
    );
    // From the clean point the earlier report wrote (12 minutes before it) to 5 minutes ago.
    let window = &troubles[0].window;
    let (length, seven) = (window.end - window.start, chrono::Duration::minutes(7));
    assert!(
        length >= seven && length < seven + chrono::Duration::seconds(10),
        "{window:?}"
    );

    // Six minutes on, the window ended 11 minutes ago, but the server has not reported for six:
    // it may have lost what it received since, so it excuses from its last report.
    age(&db, 6 * MIN).await;
    assert_eq!(due(&db).await, long_silent);
    // Five more: its last report is older than the threshold and the staleness allowance.
    age(&db, 5 * MIN).await;
    assert_eq!(
        due(&db).await,
        all,
        "troubles past the threshold excuse nothing"
    );

    // A server that stopped gracefully is forgotten at once.
    let other = Uuid::new_v4();
    report(&db, other, WriterState::Trouble { since: 12 * MIN }).await;
    assert_eq!(due(&db).await, long_silent);
    db.forget_heartbeat_writer(other).await.unwrap();
    assert_eq!(due(&db).await, all);
}

shepherd_bmdb::conformance_tests!(a_servers_trouble_excuses_only_silence_it_may_have_caused,);
