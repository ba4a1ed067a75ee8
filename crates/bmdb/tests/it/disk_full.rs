//! A full disk under the SQLite BMDB (a small tmpfs, filled mid-run and then freed): every
//! write fails as the database's unavailability, naming the cause, and the first write after
//! space returns commits; nothing is left half-written. Mounting needs root, as CI runs.

use std::time::{Duration, Instant};

use shepherd_bmdb::testing::{self, held, SmallDisk};
use shepherd_bmdb::*;

const START: Retrieval = Retrieval::AgentStart {
    provider: ProviderKind::Sim,
};

/// One write of the kind the loops make: claim a machine and finish it.
async fn claim_and_finish(s: &Session) -> Result<(), Error> {
    match s.work(Process::ShepherdAgentStart, START).await? {
        Claim::Work(mut w) => w.finish(TagWrites::none().agent_started(vec![7; 32])).await,
        _ => Ok(()),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_is_unavailability_and_writes_resume_when_space_returns() {
    let disk = SmallDisk::mount("2m");
    let url = format!("sqlite:{}", disk.path().join("bmdb.sqlite").display());
    let db = Bmdb::open_with(&url, &OpenOptions::migrating(true))
        .await
        .unwrap();
    testing::provision(&db, 200, ProviderKind::Sim).await;
    let s =
        testing::session_every(&db, Processor::ShepherdInitializer, Duration::from_secs(60)).await;
    claim_and_finish(&s).await.unwrap();

    let filler = disk.fill();
    let mut failures = Vec::new();
    for _ in 0..20 {
        if let Err(e) = claim_and_finish(&s).await {
            failures.push(e);
        }
        let m = db
            .transact(|tx| Box::pin(async move { tx.create_machine().await }))
            .await;
        if let Err(e) = m {
            failures.push(e);
        }
    }
    assert!(!failures.is_empty(), "the disk never filled up");
    for e in &failures {
        assert!(e.is_transient(), "a full disk is unavailability: {e}");
        assert!(
            e.to_string().contains("disk is full"),
            "names the cause: {e}"
        );
    }

    std::fs::remove_file(&filler).unwrap();
    let freed = Instant::now();
    let first = testing::eventually(
        "a write to commit once space is back",
        Duration::from_secs(10),
        async || {
            let w = db
                .transact(|tx| Box::pin(async move { tx.create_machine().await }))
                .await;
            w.map(|_| freed.elapsed()).map_err(|e| e.to_string())
        },
    )
    .await;
    println!(
        "disk_full_first_commit_after_space_s = {:.2}",
        first.as_secs_f64()
    );
    // The session and its claims work again, and the database is whole.
    let mut w = held(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    w.finish(TagWrites::none()).await.unwrap();
    let problems = shepherd_bmdb::testing::integrity_problems(&db).await;
    assert!(problems.is_empty(), "{problems:?}");
    s.close().await.unwrap();
    db.close().await;
}
