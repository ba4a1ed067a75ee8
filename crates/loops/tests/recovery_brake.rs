//! The recovery brake over a simulated fleet, on both backends: when every agent is silent
//! (they never heartbeat, or the BMaaS server stops and heartbeats end), the recoverer reboots
//! nothing and says why; with the brake out of the way the same fleet is rebooted; when
//! heartbeats resume the brake releases by itself.

use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::*;
use shepherd_loops::brake::{Brake, BrakeConfig, BrakeMetrics};
use shepherd_loops::initializer::{Initializer, InitializerConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{Provisioner, ProvisionerConfig};
use shepherd_loops::reconcile::Limits;
use shepherd_loops::recoverer::Recoverer;
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_loops::sim::{SimFleet, SimKnobs};
use tokio_util::sync::CancellationToken;

const MACHINES: usize = 20;
const THRESHOLD: Duration = Duration::from_millis(300);

fn thresholds() -> RecoveryThresholds {
    RecoveryThresholds {
        no_heartbeat_after_start: THRESHOLD,
        heartbeat_older_than: THRESHOLD,
    }
}

fn runner(name: &str, processor: Processor) -> RunnerConfig {
    RunnerConfig {
        parallelism: 2,
        db_rate: RateSpec::new(Duration::from_millis(5), 8),
        session: SessionConfig::new(name, processor),
    }
}

/// Brings the fleet in and takes every machine over (no recoverer yet).
async fn take_over(db: &Bmdb, fleet: &Arc<SimFleet>) {
    let cancel = CancellationToken::new();
    let provisioner = Provisioner::new(
        fleet.clone(),
        ProvisionerConfig {
            limits: Limits {
                max_machines: 0,
                chunk_size: MACHINES,
            },
            reconcile_rate: RateSpec::new(Duration::from_millis(50), 1),
            creation_rate: RateSpec::new(Duration::from_millis(1), 50),
        },
    );
    let init = Initializer::new(
        fleet.clone(),
        fleet.clone(),
        InitializerConfig::new(vec![0x7f], "bmaas.example:443"),
    )
    .unwrap();
    let work = tokio::spawn({
        let (db, cancel) = (db.clone(), cancel.clone());
        async move {
            tokio::join!(
                provisioner.run(
                    db.clone(),
                    SessionConfig::new("provisioner", Processor::ShepherdProvisioner),
                    cancel.clone()
                ),
                run(
                    db,
                    Arc::new(init),
                    runner("initializer", Processor::ShepherdInitializer),
                    cancel
                ),
            );
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let c = db
            .read(|tx| Box::pin(async move { tx.status_counts().await }))
            .await
            .unwrap();
        if c.agent_started == MACHINES as i64 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "stuck at {c:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cancel.cancel();
    work.await.unwrap();
}

/// Runs the recoverer with `brake` for `period`; returns the brake.
async fn recover_for(
    db: &Bmdb,
    fleet: &Arc<SimFleet>,
    config: BrakeConfig,
    period: Duration,
) -> Arc<Brake> {
    let brake = Brake::new(config, Provider::Sim, thresholds(), BrakeMetrics::default());
    let cancel = CancellationToken::new();
    let braking = tokio::spawn(brake.clone().run(db.clone(), cancel.clone()));
    let recoverer = Recoverer::new(fleet.clone(), thresholds())
        .with_backoff(Backoff::exponential(
            Duration::from_secs(60),
            Duration::from_secs(60),
            1.0,
        ))
        .with_brake(brake.clone());
    let recovering = tokio::spawn(run(
        db.clone(),
        Arc::new(recoverer),
        runner("recoverer", Processor::ShepherdRecoverer),
        cancel.clone(),
    ));
    tokio::time::sleep(period).await;
    cancel.cancel();
    recovering.await.unwrap();
    braking.await.unwrap();
    brake
}

fn brake(share: f64) -> BrakeConfig {
    BrakeConfig {
        max_stale_share: share,
        min_stale: 5,
        interval: Duration::from_millis(100),
    }
}

async fn agents_that_never_heartbeat_are_not_all_rebooted(db: Bmdb) {
    let fleet = Arc::new(
        SimFleet::new(
            MACHINES,
            SimKnobs {
                silent_agent: 1.0,
                takeover_time: Duration::from_millis(5),
                reboot_time: Duration::from_millis(5),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    take_over(&db, &fleet).await;
    tokio::time::sleep(THRESHOLD * 2).await;

    let b = recover_for(&db, &fleet, brake(0.5), Duration::from_secs(2)).await;
    assert!(b.engaged(), "every machine is due: the brake must hold");
    assert_eq!(fleet.counters().reboots, 0, "the brake let reboots through");

    // The same fleet with a brake that never engages (more than 100 % cannot be due): the
    // recoverer does reboot, so the brake above is what held it.
    let b = recover_for(&db, &fleet, brake(1.0), Duration::from_secs(2)).await;
    assert!(!b.engaged());
    assert!(fleet.counters().reboots > 0, "the recoverer never rebooted");
}

async fn a_stopped_server_does_not_get_the_fleet_power_cycled(db: Bmdb) {
    let fleet = Arc::new(
        SimFleet::new(
            MACHINES,
            SimKnobs {
                takeover_time: Duration::from_millis(5),
                heartbeat_interval: Duration::from_millis(50),
                ..Default::default()
            },
        )
        .unwrap(),
    );
    // Agents heartbeat (as through the server)...
    let server = CancellationToken::new();
    let agents = tokio::spawn(fleet.clone().run_agents(db.clone(), server.clone()));
    take_over(&db, &fleet).await;
    tokio::time::sleep(THRESHOLD).await;
    let b = recover_for(&db, &fleet, brake(0.5), Duration::from_millis(500)).await;
    assert!(!b.engaged(), "a healthy fleet does not brake");

    // ...until the server stops: every heartbeat ends at once.
    server.cancel();
    agents.await.unwrap();
    tokio::time::sleep(THRESHOLD * 2).await;
    let b = recover_for(&db, &fleet, brake(0.5), Duration::from_secs(2)).await;
    assert!(
        b.engaged(),
        "the whole fleet went silent: the brake must hold"
    );
    assert_eq!(fleet.counters().reboots, 0, "the fleet was power-cycled");

    // The server comes back: heartbeats resume and the brake releases by itself.
    let server = CancellationToken::new();
    let agents = tokio::spawn(fleet.clone().run_agents(db.clone(), server.clone()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = Brake::new(
        brake(0.5),
        Provider::Sim,
        thresholds(),
        BrakeMetrics::default(),
    );
    let reading = b.evaluate(&db).await.unwrap();
    assert!(
        !b.engaged(),
        "heartbeats resumed but the brake holds: {reading:?}"
    );
    server.cancel();
    agents.await.unwrap();
}

shepherd_bmdb::conformance_tests!(
    agents_that_never_heartbeat_are_not_all_rebooted,
    a_stopped_server_does_not_get_the_fleet_power_cycled
);
