//! The recoverer over a simulated fleet, on both backends.
//! - The brake: when every agent is silent (they never heartbeat, or the BMaaS server stops and
//!   heartbeats end), the recoverer reboots nothing and says why; with the brake out of the way
//!   the same fleet is rebooted; when heartbeats resume the brake releases by itself.
//! - Repeated reboots of a machine whose agent never comes back back off, and stop at the cap
//!   until an operator retries; a heartbeat in between starts the count again.
//! - A reboot's wait holds no worker: one worker reboots a whole fleet whose machines take an
//!   hour to come back, and the initializer leaves them alone for that hour.

use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::*;
use shepherd_loops::brake::{Brake, BrakeConfig, BrakeMetrics};
use shepherd_loops::initializer::{Initializer, InitializerConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{Provisioner, ProvisionerConfig};
use shepherd_loops::reconcile::Limits;
use shepherd_loops::recoverer::{Recoverer, RepeatPolicy};
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_sim::{SimFleet, SimKnobs};
use shepherd_tasks::Tasks;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const MACHINES: usize = 20;
const THRESHOLD: Duration = Duration::from_millis(300);

fn thresholds() -> RecoveryThresholds {
    RecoveryThresholds {
        no_heartbeat_after_start: THRESHOLD,
        heartbeat_older_than: THRESHOLD,
    }
}

fn runner(name: &str, processor: Processor) -> RunnerConfig {
    RunnerConfig::new(
        2,
        RateSpec::new(Duration::from_millis(5), 8),
        SessionConfig::new(name, processor),
    )
}

/// Runs `brake`'s counts in the background until `cancel`.
fn spawn_brake(
    brake: &Arc<Brake>,
    db: &Bmdb,
    cancel: &CancellationToken,
) -> tokio::task::JoinHandle<()> {
    let task = shepherd_tasks::Tasks::default().task("recovery-brake");
    tokio::spawn(brake.clone().run(db.clone(), task, cancel.clone()))
}

/// The initializer over the simulated fleet, run until `cancel`.
async fn initializing(db: Bmdb, fleet: &Arc<SimFleet>, cancel: CancellationToken) {
    let config = InitializerConfig::new(vec![0x7f], "bmaas.example:443");
    let init = Initializer::new(fleet.clone(), fleet.clone(), config).unwrap();
    let workers = runner("initializer", Processor::ShepherdInitializer);
    run(db, Arc::new(init), workers, cancel).await
}

/// Brings the fleet in and takes every machine over (no recoverer yet).
async fn take_over(db: &Bmdb, fleet: &Arc<SimFleet>) {
    let cancel = CancellationToken::new();
    let provisioner = Provisioner::new(
        fleet.clone(),
        ProvisionerConfig {
            limits: Limits::new(0, MACHINES),
            reconcile_rate: RateSpec::new(Duration::from_millis(50), 1),
            creation_rate: RateSpec::new(Duration::from_millis(1), 50),
            creation_parallelism: 1,
        },
    );
    let work = tokio::spawn({
        let (db, cancel, fleet) = (db.clone(), cancel.clone(), fleet.clone());
        async move {
            tokio::join!(
                shepherd_loops::periodic::run(
                    &provisioner,
                    db.clone(),
                    SessionConfig::new("provisioner", Processor::ShepherdProvisioner),
                    Tasks::default().task("provisioner"),
                    cancel.clone()
                ),
                initializing(db, &fleet, cancel),
            );
        }
    });
    testing::eventually(
        "every machine taken over",
        Duration::from_secs(60),
        async || {
            let c = db.status_counts().await.unwrap();
            if c.agent_started == MACHINES as i64 {
                Ok(())
            } else {
                Err(c)
            }
        },
    )
    .await;
    cancel.cancel();
    work.await.unwrap();
}

/// A brake over the simulated fleet, with these tests' thresholds and fresh metrics.
fn sim_brake(config: BrakeConfig) -> Arc<Brake> {
    Brake::new(
        config,
        ProviderKind::Sim,
        thresholds(),
        BrakeMetrics::default(),
    )
}

/// Runs the recoverer with `brake` for `period`; returns the brake.
async fn recover_for(
    db: &Bmdb,
    fleet: &Arc<SimFleet>,
    config: BrakeConfig,
    period: Duration,
) -> Arc<Brake> {
    let brake = sim_brake(config);
    let cancel = CancellationToken::new();
    let braking = spawn_brake(&brake, db, &cancel);
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

/// A fleet whose agents never heartbeat, with machines back `reboot_time` after a reboot.
fn silent_fleet(reboot_time: Duration) -> Arc<SimFleet> {
    Arc::new(
        SimFleet::new(
            MACHINES,
            SimKnobs {
                silent_agent: 1.0,
                takeover_time: Duration::from_millis(5),
                reboot_time,
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

/// A fleet whose agents heartbeat every 50 ms while `run_agents` runs (their server is up).
fn heartbeating_fleet() -> Arc<SimFleet> {
    Arc::new(
        SimFleet::new(
            MACHINES,
            SimKnobs {
                takeover_time: Duration::from_millis(5),
                heartbeat_interval: Duration::from_millis(50),
                ..Default::default()
            },
        )
        .unwrap(),
    )
}

fn brake(share: f64) -> BrakeConfig {
    BrakeConfig {
        max_silent_share: share,
        min_silent: 5,
        interval: Duration::from_millis(100),
    }
}

async fn agents_that_never_heartbeat_are_not_all_rebooted(db: Bmdb) {
    let fleet = silent_fleet(Duration::from_millis(5));
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
    let fleet = heartbeating_fleet();
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
    let b = sim_brake(brake(0.5));
    testing::eventually(
        "the brake to release once heartbeats resume",
        Duration::from_secs(30),
        async || {
            let reading = b.evaluate(&db).await.unwrap();
            if b.engaged() {
                Err(format!("{reading:?}"))
            } else {
                Ok(())
            }
        },
    )
    .await;
    server.cancel();
    agents.await.unwrap();
}

async fn a_server_stopping_under_a_running_recoverer_costs_a_few_reboots_at_most(db: Bmdb) {
    let fleet = heartbeating_fleet();
    let server = CancellationToken::new();
    let agents = tokio::spawn(fleet.clone().run_agents(db.clone(), server.clone()));
    take_over(&db, &fleet).await;
    // The recoverer and its brake run throughout; the fleet is healthy, so the brake releases.
    // Its interval is longer than the test: only the counts the recoverer asks for happen.
    let config = BrakeConfig {
        interval: Duration::from_secs(60),
        ..brake(0.5)
    };
    let b = sim_brake(config);
    let cancel = CancellationToken::new();
    let braking = spawn_brake(&b, &db, &cancel);
    let recovering = tokio::spawn(run(
        db.clone(),
        Arc::new(Recoverer::new(fleet.clone(), thresholds()).with_brake(b.clone())),
        runner("recoverer", Processor::ShepherdRecoverer),
        cancel.clone(),
    ));
    testing::eventually(
        "a healthy fleet's brake to release",
        Duration::from_secs(10),
        async || {
            if b.engaged() {
                Err("engaged")
            } else {
                Ok(())
            }
        },
    )
    .await;
    // The server stops: every agent goes silent at once, and the whole fleet falls due between
    // two counts. Only the few reboots one count allows get through before the next count
    // sees the silence.
    server.cancel();
    agents.await.unwrap();
    tokio::time::sleep(THRESHOLD * 2 + Duration::from_secs(1)).await;
    cancel.cancel();
    recovering.await.unwrap();
    braking.await.unwrap();
    let reboots = fleet.counters().reboots;
    let parallelism = runner("", Processor::Unknown).parallelism as u64;
    assert!(
        reboots < config.min_silent as u64 + parallelism,
        "{reboots} reboots got through before the brake engaged"
    );
    assert!(
        b.engaged(),
        "the whole fleet went silent: the brake must hold"
    );
}

/// A recoverer that is never braked (more than 100 % cannot be due).
fn unbraked(fleet: &Arc<SimFleet>, repeat: RepeatPolicy) -> (Recoverer<SimFleet>, Arc<Brake>) {
    let brake = sim_brake(brake(1.0));
    let recoverer = Recoverer::new(fleet.clone(), thresholds())
        .with_repeat_policy(repeat)
        .with_brake(brake.clone());
    (recoverer, brake)
}

/// Every machine's recovery tag and active backoffs.
async fn recoveries(db: &Bmdb) -> Vec<(Uuid, Option<Recovery>, Vec<BackoffEntry>)> {
    db.read(|tx| {
        Box::pin(async move {
            let mut out = vec![];
            for id in tx.machine_ids(None, 10_000).await? {
                let now = tx.now().await?;
                let backoffs = tx.machine_backoffs(id).await?;
                out.push((
                    id,
                    tx.recovery(id).await?,
                    backoffs.into_iter().filter(|b| b.until > now).collect(),
                ));
            }
            Ok(out)
        })
    })
    .await
    .unwrap()
}

/// Runs the initializer and `recoverer` (with its brake counted) together until `done` holds
/// for every machine's recovery tag and active backoffs, or 60 s pass.
async fn initialize_and_recover(
    db: &Bmdb,
    fleet: &Arc<SimFleet>,
    (recoverer, brake): (Recoverer<SimFleet>, Arc<Brake>),
    done: impl Fn(&Option<Recovery>, &[BackoffEntry]) -> bool,
) {
    let cancel = CancellationToken::new();
    let loops = tokio::spawn({
        let (db, cancel, fleet) = (db.clone(), cancel.clone(), fleet.clone());
        async move {
            tokio::join!(
                brake.run(
                    db.clone(),
                    shepherd_tasks::Tasks::default().task("recovery-brake"),
                    cancel.clone()
                ),
                initializing(db.clone(), &fleet, cancel.clone()),
                run(
                    db,
                    Arc::new(recoverer),
                    runner("recoverer", Processor::ShepherdRecoverer),
                    cancel
                ),
            );
        }
    });
    testing::eventually(
        "every machine to get there",
        Duration::from_secs(60),
        async || {
            let all = recoveries(db).await;
            if all.iter().all(|(_, r, b)| done(r, b)) {
                Ok(())
            } else {
                Err(all[..3].to_vec())
            }
        },
    )
    .await;
    cancel.cancel();
    loops.await.unwrap();
}

fn left_alone(b: &[BackoffEntry]) -> bool {
    b.iter().any(|b| {
        b.process == Process::ShepherdRecovery
            && b.cause.starts_with("left alone after")
            && b.until > chrono::Utc::now() + chrono::TimeDelta::days(365)
    })
}

async fn repeated_reboots_back_off_and_stop_at_the_cap(db: Bmdb) {
    let fleet = silent_fleet(Duration::ZERO);
    take_over(&db, &fleet).await;
    let repeat = RepeatPolicy {
        backoff: Backoff::exponential(Duration::from_millis(300), Duration::from_secs(1), 2.0),
        give_up_after: 3,
    };
    // No agent ever heartbeats: every machine is rebooted three times in a row, then left
    // alone.
    initialize_and_recover(&db, &fleet, unbraked(&fleet, repeat), |r, b| {
        r.is_some_and(|r| r.in_a_row == 3) && left_alone(b)
    })
    .await;
    // Left alone means left alone: the recoverer runs on and reboots nothing more.
    let before = fleet.counters().reboots;
    assert_eq!(
        before,
        3 * MACHINES as u64,
        "every machine exactly three times"
    );
    let (recoverer, _) = unbraked(&fleet, repeat);
    let cancel = CancellationToken::new();
    let recovering = tokio::spawn(run(
        db.clone(),
        Arc::new(recoverer),
        runner("recoverer", Processor::ShepherdRecoverer),
        cancel.clone(),
    ));
    tokio::time::sleep(THRESHOLD * 4).await;
    cancel.cancel();
    recovering.await.unwrap();
    assert_eq!(
        fleet.counters().reboots,
        before,
        "a machine left alone was rebooted"
    );
    // The work history says the same: three finished recoveries per machine, never two
    // recoverers on one machine at once.
    for (id, _, _) in recoveries(&db).await {
        let history = db
            .read(move |tx| Box::pin(async move { tx.machine_history(id).await }))
            .await
            .unwrap();
        let finished = history
            .iter()
            .filter(|h| h.process == Process::ShepherdRecovery && h.event == WorkEvent::Finished)
            .count();
        assert_eq!(finished, 3, "{id}: {history:#?}");
    }

    // The operator retries one machine whose agent, meanwhile, did heartbeat once: the count
    // starts again at one and no recovery backoff is set. Another is retried with its agent
    // still silent: it gets one more reboot and is left alone again.
    let all = recoveries(&db).await;
    let (healed, silent) = (all[0].0, all[1].0);
    db.transact(move |tx| {
        Box::pin(async move {
            let long_ago = tx.now().await? - chrono::TimeDelta::seconds(60);
            tx.set_heartbeat_at(healed, long_ago).await?;
            tx.clear_backoffs(healed, None).await?;
            tx.clear_backoffs(silent, Some(Process::ShepherdRecovery))
                .await?;
            Ok(())
        })
    })
    .await
    .unwrap();
    initialize_and_recover(&db, &fleet, unbraked(&fleet, repeat), |r, b| {
        r.is_some_and(|r| r.in_a_row != 3) || (r.is_some_and(|r| r.in_a_row == 3) && left_alone(b))
    })
    .await;
    let all = recoveries(&db).await;
    let find = |id: Uuid| all.iter().find(|(m, _, _)| *m == id).unwrap();
    // The healed machine's agent is silent again after its reboot (the fleet is silent), so
    // it may be rebooted a second time before the other machine's turn ends this phase: its
    // count is 1, or 2 — not 4, which would mean the count went on from before the heartbeat.
    let (_, r, b) = find(healed);
    let in_a_row = r.unwrap().in_a_row;
    assert!(
        (1..=2).contains(&in_a_row),
        "a heartbeat between reboots starts the count again: {in_a_row} in a row"
    );
    if in_a_row == 1 {
        assert!(
            !b.iter().any(|b| b.process == Process::ShepherdRecovery),
            "the first reboot in a row sets no recovery backoff: {b:?}"
        );
    }
    assert!(!left_alone(b), "the healed machine was left alone: {b:?}");
    let (_, r, b) = find(silent);
    assert_eq!(r.unwrap().in_a_row, 4);
    assert!(left_alone(b), "{b:?}");
}

async fn a_reboot_wait_holds_no_worker(db: Bmdb) {
    // Machines take an hour to come back. A recoverer (one worker) that slept through that
    // hour holding the machine's lock would reboot one machine an hour.
    let hour = Duration::from_secs(3600);
    let fleet = silent_fleet(hour);
    take_over(&db, &fleet).await;
    let (recoverer, brake) = unbraked(&fleet, RepeatPolicy::default());
    initialize_and_recover(&db, &fleet, (recoverer, brake), |r, b| {
        r.is_some() && b.iter().any(|b| b.process == Process::ShepherdAgentStart)
    })
    .await;
    assert_eq!(fleet.counters().reboots, MACHINES as u64);
    let counts = db.status_counts().await.unwrap();
    assert_eq!(
        counts.agent_started, 0,
        "the initializer took over a machine that was given an hour to come back"
    );
    for (id, _, backoffs) in recoveries(&db).await {
        let wait = backoffs
            .iter()
            .find(|b| b.process == Process::ShepherdAgentStart)
            .unwrap();
        let left = wait.until - chrono::Utc::now();
        assert!(
            left > chrono::TimeDelta::minutes(59) && left <= chrono::TimeDelta::minutes(61),
            "{id}: {wait:?}"
        );
        assert_eq!(wait.last_interval_seconds, 0, "a wait is not a failure");
    }
}

/// Machines being brought in (provided, no agent started yet) are no evidence of a failing
/// server or network: a bring-up of many machines next to a few running ones does not engage
/// the brake, while the running ones going silent, or rebooted and not back yet, do.
async fn machines_still_being_brought_in_do_not_engage_the_brake(db: Bmdb) {
    let b = sim_brake(brake(0.5));
    let new = testing::provision(&db, 40, ProviderKind::Sim).await;
    let running = testing::provision(&db, 10, ProviderKind::Sim).await;
    let ids = running.clone();
    db.transact(move |tx| {
        let ids = ids.clone();
        Box::pin(async move {
            for (n, id) in ids.into_iter().enumerate() {
                tx.set_agent_started(id, &[n as u8 + 1; 32]).await?;
                tx.set_heartbeat(id).await?;
            }
            Ok(())
        })
    })
    .await
    .unwrap();
    let reading = b.evaluate(&db).await.unwrap();
    assert_eq!((reading.silent, reading.machines), (0, 10), "{reading:?}");
    assert!(
        !b.engaged(),
        "40 machines being brought in engaged the brake"
    );

    // Six of the ten running machines: three gone quiet, three rebooted whose agents are not
    // back. More than half of the machines with agents are silent: the brake holds.
    let (quiet, rebooted) = (running[..3].to_vec(), running[3..6].to_vec());
    db.transact(move |tx| {
        let (quiet, rebooted) = (quiet.clone(), rebooted.clone());
        Box::pin(async move {
            let long_ago = tx.now().await? - chrono::Duration::hours(2);
            for id in quiet {
                tx.set_heartbeat_at(id, long_ago).await?;
            }
            for id in rebooted {
                tx.delete_agent_started(id).await?;
                tx.delete_heartbeat(id).await?;
                tx.set_recovery(id, 1).await?;
            }
            Ok(())
        })
    })
    .await
    .unwrap();
    let reading = b.evaluate(&db).await.unwrap();
    assert_eq!((reading.silent, reading.machines), (6, 10), "{reading:?}");
    assert!(b.engaged(), "{reading:?}");
    assert_eq!(new.len(), 40);
}

shepherd_bmdb::conformance_tests!(
    machines_still_being_brought_in_do_not_engage_the_brake,
    agents_that_never_heartbeat_are_not_all_rebooted,
    a_stopped_server_does_not_get_the_fleet_power_cycled,
    a_server_stopping_under_a_running_recoverer_costs_a_few_reboots_at_most,
    repeated_reboots_back_off_and_stop_at_the_cap,
    a_reboot_wait_holds_no_worker
);
