//! Two shepherd replicas (separate BMDB handles and sessions; provisioner + 4 initializer
//! workers each) over one simulated fleet of 200 machines, with injected connection
//! failures: every machine is taken over exactly once, asserted from the work history; and
//! the simulated fleet agreeing with the provisioner's reconciliation.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::*;
use shepherd_loops::initializer::{Initializer, InitializerConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{Provisioner, ProvisionerConfig};
use shepherd_loops::reconcile::{reconcile, Limits};
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_provider::{Availability, Provider as _};
use shepherd_sim::{SimFleet, SimKnobs};
use tokio_util::sync::CancellationToken;

const MACHINES: usize = 200;

async fn replica(db: Bmdb, fleet: Arc<SimFleet>, name: &str, cancel: CancellationToken) {
    let provisioner = Provisioner::new(
        fleet.clone(),
        ProvisionerConfig {
            limits: Limits::new(0, 50),
            reconcile_rate: RateSpec::new(Duration::from_millis(100), 1),
            creation_rate: RateSpec::new(Duration::from_millis(1), 50),
            creation_parallelism: 1,
        },
    );
    let mut config = InitializerConfig::new(vec![0x7f], "bmaas.example:443");
    config.backoff = Backoff::exponential(Duration::from_secs(1), Duration::from_secs(2), 1.2);
    let init = Initializer::new(fleet.clone(), fleet.clone(), config).unwrap();
    let runner = RunnerConfig::new(
        4,
        RateSpec::new(Duration::from_millis(5), 8),
        SessionConfig::new(name, Processor::ShepherdInitializer),
    );
    tokio::join!(
        shepherd_loops::periodic::run(
            &provisioner,
            db.clone(),
            SessionConfig::new(name, Processor::ShepherdProvisioner),
            shepherd_tasks::Tasks::default().task("provisioner"),
            cancel.clone()
        ),
        run(db, Arc::new(init), runner, cancel),
    );
}

async fn two_replicas_take_each_machine_over_once(db: Bmdb, url: String) {
    let second = Bmdb::open(&url).await.unwrap();
    let knobs = SimKnobs {
        connect_failure: 0.1,
        takeover_time: Duration::from_millis(20),
        ..Default::default()
    };
    let fleet = Arc::new(SimFleet::new(MACHINES, knobs).unwrap());
    let cancel = CancellationToken::new();
    let a = tokio::spawn(replica(
        db.clone(),
        fleet.clone(),
        "replica-a",
        cancel.clone(),
    ));
    let b = tokio::spawn(replica(
        second.clone(),
        fleet.clone(),
        "replica-b",
        cancel.clone(),
    ));

    let within = Duration::from_secs(120);
    testing::eventually(
        "both replicas to take every machine over",
        within,
        async || {
            let counts = db.status_counts().await.unwrap();
            testing::when(counts.agent_started == MACHINES as i64, counts)
        },
    )
    .await;
    cancel.cancel();
    a.await.unwrap();
    b.await.unwrap();

    let history = db
        .read(|tx| Box::pin(async move { tx.history_after(0, 1_000_000).await }))
        .await
        .unwrap();
    let mut finished: HashMap<uuid::Uuid, usize> = HashMap::new();
    let mut sessions = std::collections::HashSet::new();
    let mut open: HashMap<uuid::Uuid, bool> = HashMap::new();
    for h in history
        .iter()
        .filter(|h| h.process == Process::ShepherdAgentStart)
    {
        match h.event {
            WorkEvent::Started => {
                let was_open = open.insert(h.machine_id, true).unwrap_or(false);
                assert!(!was_open, "overlapping work on {}", h.machine_id);
                sessions.insert(h.session_id);
            }
            end => {
                open.insert(h.machine_id, false);
                if end == WorkEvent::Finished {
                    *finished.entry(h.machine_id).or_default() += 1;
                }
            }
        }
    }
    assert_eq!(finished.len(), MACHINES);
    assert!(
        finished.values().all(|&n| n == 1),
        "a machine was taken over twice"
    );
    assert!(
        sessions.len() >= 8,
        "want work from 8 workers' sessions, saw {}",
        sessions.len()
    );
    let c = fleet.counters();
    assert_eq!(c.agents_started, MACHINES as u64);
    assert!(
        c.connect_failures > 0,
        "failure injection did nothing: {c:?}"
    );
    second.close().await;
}

fn unpaced() -> ProvisionerConfig {
    ProvisionerConfig {
        limits: Limits::new(0, MACHINES),
        reconcile_rate: RateSpec::new(Duration::from_millis(1), 1),
        creation_rate: RateSpec::new(Duration::from_millis(1), 1000),
        creation_parallelism: 1,
    }
}

/// Replicas of `shepherd run --provider sim` are processes with a simulator each: the second
/// sees the machines the first brought in as in use, not as a disagreement with the BMDB.
async fn separate_simulators_share_one_fleet_through_the_bmdb(db: Bmdb, url: String) {
    let second = Bmdb::open(&url).await.unwrap();
    let (a, b) = (
        Arc::new(SimFleet::new(MACHINES, SimKnobs::default()).unwrap()),
        Arc::new(SimFleet::new(MACHINES, SimKnobs::default()).unwrap()),
    );
    a.share_through(db.clone());
    b.share_through(second.clone());
    let sa = testing::session(&db, Processor::ShepherdProvisioner).await;
    let sb = testing::session(&second, Processor::ShepherdProvisioner).await;
    let first = Provisioner::new(a, unpaced()).iterate(&sa).await.unwrap();
    assert_eq!(first.created, MACHINES);
    let later = Provisioner::new(b, unpaced())
        .iterate(&sb)
        .await
        .expect("the second replica sees the first one's machines");
    assert_eq!((later.managed, later.created), (MACHINES, 0), "{later:?}");
    sa.close().await.unwrap();
    sb.close().await.unwrap();
    second.close().await;
}

/// A machine the simulator created while the BMDB could not record it is an orphan, adopted
/// by the next pass, as a real provider's.
async fn an_orphan_of_the_simulator_is_adopted(db: Bmdb) {
    let fleet = Arc::new(SimFleet::new(3, SimKnobs::default()).unwrap());
    let lost = testing::session(&db, Processor::ShepherdProvisioner).await;
    lost.close().await.unwrap();
    let unused = fleet.list_machines().await.unwrap().remove(1);
    let err = fleet.create_machine(&lost, &unused).await.unwrap_err();
    assert!(err.is_bmdb_failure(), "{err}");

    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    let report = Provisioner::new(fleet.clone(), unpaced())
        .iterate(&s)
        .await
        .expect("no disagreement over the orphan");
    assert_eq!((report.created, report.managed), (3, 0), "{report:?}");
    let recorded = testing::provided_by(&db, ProviderKind::Sim).await;
    assert_eq!(recorded.len(), 3);
    s.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite() {
    let t = shepherd_bmdb::testing::sqlite().await;
    two_replicas_take_each_machine_over_once(t.db.clone(), t.url.clone()).await;
    t.cleanup().await;
    let t = shepherd_bmdb::testing::sqlite().await;
    separate_simulators_share_one_fleet_through_the_bmdb(t.db.clone(), t.url.clone()).await;
    t.cleanup().await;
    let t = shepherd_bmdb::testing::sqlite().await;
    an_orphan_of_the_simulator_is_adopted(t.db.clone()).await;
    t.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres() {
    let Some(t) = shepherd_bmdb::testing::postgres().await else {
        return;
    };
    two_replicas_take_each_machine_over_once(t.db.clone(), t.url.clone()).await;
    t.cleanup().await;
    let Some(t) = shepherd_bmdb::testing::postgres().await else {
        return;
    };
    separate_simulators_share_one_fleet_through_the_bmdb(t.db.clone(), t.url.clone()).await;
    t.cleanup().await;
    let Some(t) = shepherd_bmdb::testing::postgres().await else {
        return;
    };
    an_orphan_of_the_simulator_is_adopted(t.db.clone()).await;
    t.cleanup().await;
}

#[tokio::test]
async fn a_deployed_fleet_is_all_ours_and_agrees_with_a_bmdb_that_records_it() {
    let knobs = SimKnobs {
        deployed: true,
        ..Default::default()
    };
    let fleet = SimFleet::new(100, knobs).unwrap();
    let list = fleet.list_machines().await.unwrap();
    assert!(list
        .iter()
        .all(|m| m.availability == Availability::PossiblyUsed));
    // After a restart over a BMDB that records every machine: nothing to create, no
    // discrepancy.
    let recorded = list.iter().filter_map(|m| m.id.clone()).collect();
    let plan = reconcile(&list, &recorded, Default::default()).unwrap();
    assert_eq!((plan.managed, plan.create.len()), (100, 0));
    // A fresh fleet over the same BMDB, not sharing it, disagrees with it: that is what
    // the flag and `share_through` are for.
    let fresh = SimFleet::new(100, SimKnobs::default()).unwrap();
    let fresh = fresh.list_machines().await.unwrap();
    assert!(reconcile(&fresh, &recorded, Default::default()).is_err());
}
