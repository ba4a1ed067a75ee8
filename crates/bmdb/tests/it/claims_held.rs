//! Work locks through real claims, as upstream's TestWork has them: two processes hold one
//! machine at once, a third claim of a held process finds nothing, and a released lock can be
//! claimed again. On Postgres, candidates all locked by another transaction make a Conflict.

use shepherd_bmdb::testing::{self, held, history_as, session};
use shepherd_bmdb::*;

const ANY: Retrieval = Retrieval::AgentStart {
    provider: ProviderKind::Sim,
};

async fn two_processes_hold_one_machine(db: Bmdb) {
    let m = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let (s1, s2) = (
        session(&db, Processor::ShepherdInitializer).await,
        session(&db, Processor::ShepherdRecoverer).await,
    );
    let mut a = held(s1.work(Process::UnitTest1, ANY).await.unwrap());
    let mut b = held(s2.work(Process::UnitTest2, ANY).await.unwrap());
    assert_eq!(
        (a.machine_id(), b.machine_id()),
        (m, m),
        "both hold the one machine"
    );
    for s in [&s1, &s2] {
        for p in [Process::UnitTest1, Process::UnitTest2] {
            assert!(
                matches!(s.work(p, ANY).await.unwrap(), Claim::NothingToDo),
                "{p} is held"
            );
        }
    }
    a.cancel("test").await.unwrap();
    let mut again = held(s2.work(Process::UnitTest1, ANY).await.unwrap());
    assert_eq!(again.machine_id(), m);
    again.finish(TagWrites::none()).await.unwrap();
    b.finish(TagWrites::none()).await.unwrap();
    let events = history_as(&db, |e| (e.process, e.event)).await;
    use Process::*;
    use WorkEvent::*;
    assert_eq!(
        events,
        [
            (UnitTest1, Started),
            (UnitTest2, Started),
            (UnitTest1, Canceled),
            (UnitTest1, Started),
            (UnitTest1, Finished),
            (UnitTest2, Finished),
        ]
    );
    s1.close().await.unwrap();
    s2.close().await.unwrap();
}

shepherd_bmdb::conformance_tests!(two_processes_hold_one_machine);

/// Every candidate row locked by another transaction (a claimer of another replica in the
/// middle of its statement): the claim says Conflict, so the runner tries again, rather than
/// NothingToDo; once the lock is gone the claim succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn candidates_locked_elsewhere_are_a_conflict_on_postgres() {
    let Some(t) = testing::postgres().await else {
        return;
    };
    testing::provision(&t.db, 300, ProviderKind::Sim).await;
    let pool = sqlx::PgPool::connect(&t.url).await.unwrap();
    let mut other = pool.begin().await.unwrap();
    sqlx::query("SELECT machine_id FROM machines FOR UPDATE")
        .execute(&mut *other)
        .await
        .unwrap();
    let s = session(&t.db, Processor::ShepherdInitializer).await;
    let claim = s.work(Process::UnitTest1, ANY).await.unwrap();
    assert!(matches!(claim, Claim::Conflict), "{claim:?}");
    other.rollback().await.unwrap();
    held(s.work(Process::UnitTest1, ANY).await.unwrap())
        .cancel("test")
        .await
        .unwrap();
    s.close().await.unwrap();
    pool.close().await;
    t.cleanup().await;
}
