//! What the web UI's overview reads, on both backends: fleet count snapshots (one per minute
//! and series, whichever process writes first), work endings per minute, top failure causes.

use shepherd_bmdb::*;
use uuid::Uuid;

async fn overview_reads(db: Bmdb) {
    let id = db
        .transact(|tx| Box::pin(async move { tx.create_machine().await }))
        .await
        .unwrap();
    let counts = |machines| FleetCounts {
        machines,
        ..Default::default()
    };
    // Two replicas refresh in the same minute: the first one's point stands.
    for n in [7, 9] {
        let c = counts(n);
        db.transact(move |tx| {
            let c = c.clone();
            Box::pin(async move { tx.record_fleet_snapshot(&c).await })
        })
        .await
        .unwrap();
    }
    let (snapshots, endings, causes) = db
        .transact(move |tx| {
            Box::pin(async move {
                let now = tx.now().await?;
                let ago = |m: i64| now - chrono::Duration::minutes(m);
                let p = Process::ShepherdAgentStart;
                tx.insert_fleet_snapshot_raw(ago(30), "machines", 3).await?;
                tx.insert_fleet_snapshot_raw(ago(60 * 24 * 9), "machines", 1)
                    .await?;
                for (m, event, cause) in [
                    (5, WorkEvent::Finished, None),
                    (5, WorkEvent::Finished, None),
                    (5, WorkEvent::Failed, Some("refused")),
                    (6, WorkEvent::Failed, Some("refused")),
                    (7, WorkEvent::Failed, Some("timed out")),
                    (7, WorkEvent::Started, None),
                    (120, WorkEvent::Finished, None),
                    (60 * 30, WorkEvent::Failed, Some("long ago")),
                ] {
                    tx.insert_history_raw(id, p, event, ago(m), cause).await?;
                }
                Ok((
                    tx.fleet_snapshots(chrono::Duration::days(1)).await?,
                    tx.work_endings_per_minute(chrono::Duration::hours(1))
                        .await?,
                    tx.top_failure_causes(chrono::Duration::days(1), 10).await?,
                ))
            })
        })
        .await
        .unwrap();
    let machines: Vec<i64> = snapshots
        .iter()
        .filter(|s| s.1 == "machines")
        .map(|s| s.2)
        .collect();
    assert_eq!(
        machines,
        [3, 7],
        "older than a day left out; first writer wins"
    );
    assert!(snapshots
        .iter()
        .all(|s| s.0.timestamp() % 60 == 0 || s.2 == 3));
    let per: Vec<(WorkEvent, i64)> = endings.iter().map(|e| (e.2, e.3)).collect();
    assert_eq!(
        per,
        [
            (WorkEvent::Failed, 1),
            (WorkEvent::Failed, 1),
            (WorkEvent::Failed, 1),
            (WorkEvent::Finished, 2)
        ],
        "{endings:?}"
    );
    assert!(endings.windows(2).all(|w| w[0].0 <= w[1].0));
    assert_eq!(
        causes,
        [("refused".to_string(), 2), ("timed out".to_string(), 1)]
    );
    // Per machine and cause, most recent first: what the page of one cause shape filters.
    let failures = db
        .read(|tx| Box::pin(async move { tx.recent_failures(chrono::Duration::days(1), 10).await }))
        .await
        .unwrap();
    let per: Vec<(Uuid, &str, i64)> = failures
        .iter()
        .map(|f| (f.machine_id, f.cause.as_str(), f.failures))
        .collect();
    assert_eq!(
        per,
        [(id, "refused", 2), (id, "timed out", 1)],
        "{failures:?}"
    );
    assert!(failures[0].last > failures[1].last);
    // The next refresh forgets snapshots older than eight days.
    let c = counts(9);
    db.transact(move |tx| {
        let c = c.clone();
        Box::pin(async move { tx.record_fleet_snapshot(&c).await })
    })
    .await
    .unwrap();
    let all = db
        .read(|tx| Box::pin(async move { tx.fleet_snapshots(chrono::Duration::days(30)).await }))
        .await
        .unwrap();
    assert!(all.iter().all(|s| s.2 != 1), "{all:?}");
}

shepherd_bmdb::conformance_tests!(overview_reads);
