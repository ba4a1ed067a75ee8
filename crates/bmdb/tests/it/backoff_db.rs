//! Backoff through the database, on both backends, as upstream's backoff arithmetic has it:
//! a previous interval below the initial one grows from itself (2 s with initial 60 s gives 4,
//! 8, 16, 32, 64, 120), and the maximum is reached and kept.

use std::time::Duration;

use shepherd_bmdb::*;

const START: Retrieval = Retrieval::AgentStart {
    provider: ProviderKind::Sim,
};

/// Fails one claim of the machine with `backoff`, after making its current backoff (with
/// `last` as its interval) already expired, and returns the interval the failure stored.
async fn fail_once(db: &Bmdb, s: &Session, id: uuid::Uuid, last: Option<i64>, b: &Backoff) -> i64 {
    db.transact(move |tx| {
        Box::pin(async move {
            if let Some(last) = last {
                let expired = tx.now().await? - chrono::Duration::seconds(1);
                tx.set_backoff(id, Process::ShepherdAgentStart, expired, last, "earlier")
                    .await?;
            }
            Ok(())
        })
    })
    .await
    .unwrap();
    let Claim::Work(mut w) = s.work(Process::ShepherdAgentStart, START).await.unwrap() else {
        panic!("the machine is eligible once its backoff expired");
    };
    assert_eq!(w.previous_backoff_seconds(), last);
    w.fail(Some(b), "again").await.unwrap();
    let rows = db
        .read(move |tx| Box::pin(async move { tx.machine_backoffs(id).await }))
        .await
        .unwrap();
    rows[0].last_interval_seconds
}

async fn backoff_grows_from_a_smaller_previous_and_keeps_its_cap(db: Bmdb) {
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let s = testing::session(&db, Processor::ShepherdInitializer).await;
    let b = Backoff::exponential(Duration::from_secs(60), Duration::from_secs(120), 2.0);
    let mut last = Some(2);
    let mut seen = vec![];
    for _ in 0..7 {
        let next = fail_once(&db, &s, id, last, &b).await;
        seen.push(next);
        last = Some(next);
    }
    assert_eq!(seen, [4, 8, 16, 32, 64, 120, 120]);
    s.close().await.unwrap();
}

shepherd_bmdb::conformance_tests!(backoff_grows_from_a_smaller_previous_and_keeps_its_cap);
