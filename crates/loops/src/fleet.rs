//! Assembling and running one replica's control loops over one provider: what `shepherd run`,
//! `shepherd demo` and the benchmarks start.

use std::sync::Arc;
use std::time::Duration;

use crate::bare_metal::{BareMetalLoop, BareMetrics, BareSettings};
use crate::brake::{Brake, BrakeConfig, BrakeMetrics};
use crate::initializer::{Initializer, InitializerConfig};
use crate::limiter::RateSpec;
use crate::periodic::{self, Pass};
use crate::provisioner::{Provisioner, ProvisionerConfig, ProvisionerMetrics};
use crate::recoverer::{Recoverer, RecovererMetrics, RepeatPolicy};
use crate::retention::{HistoryPruner, Retention};
use crate::runner::{self, MachineTask, RunnerConfig};
use crate::updater::Updater;
use shepherd_bmdb::{Backoff, Bmdb, Processor, RecoveryThresholds, SessionConfig};
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::transport::Transport;
use shepherd_provider::Rebooter;
use shepherd_tasks::{TaskKind, Tasks};
use tokio_util::sync::CancellationToken;

/// Settings of one runner-driven loop.
#[derive(Debug, Clone, Copy)]
pub struct LoopSettings {
    /// Workers.
    pub parallelism: usize,
    /// Claim pace.
    pub db_rate: RateSpec,
}

/// Everything the loops need besides the provider and transport.
#[derive(Debug, Clone)]
pub struct FleetSettings {
    /// Provisioner limits and rates.
    pub provisioner: ProvisionerConfig,
    /// Initializer settings.
    pub initializer: InitializerConfig,
    /// Initializer runner settings.
    pub initializer_loop: LoopSettings,
    /// Recoverer runner settings.
    pub recoverer_loop: LoopSettings,
    /// The bare-metal loop, for a provider whose machines may come bare (a static inventory
    /// with `Bare` entries); `None`: no such loop.
    pub bare: Option<BareMetalSettings>,
    /// When a silent agent gets its machine rebooted.
    pub recovery: RecoveryThresholds,
    /// Recoverer backoff (upstream: 1 min → 1 h, ×1.2).
    pub recoverer_backoff: Backoff,
    /// When the recoverer stops because too much of the fleet is stale at once.
    pub recovery_brake: BrakeConfig,
    /// Where the brake's gauges go (registered by the caller).
    pub recovery_brake_metrics: BrakeMetrics,
    /// What the recoverer does with machines that earlier reboots did not bring back.
    pub recovery_repeat: RepeatPolicy,
    /// Where the recoverer's counters go (registered by the caller).
    pub recoverer_metrics: RecovererMetrics,
    /// Where the provisioner's counters go (registered by the caller).
    pub provisioner_metrics: ProvisionerMetrics,
    /// Pace of provider-fact refreshes (the updater).
    pub updater_rate: RateSpec,
    /// Session keep-alive interval.
    pub session_interval: Duration,
    /// How long history, ended sign-ins and audit events are kept.
    pub retention: Retention,
    /// Where every loop reports its work (shared with the web UI, the API and `/metrics`).
    pub tasks: Tasks,
}

/// The bare-metal loop's settings, runner and counters.
#[derive(Debug, Clone)]
pub struct BareMetalSettings {
    /// What the loop needs to know.
    pub settings: BareSettings,
    /// Its runner.
    pub runner: LoopSettings,
    /// Where its counters go (registered by the caller).
    pub metrics: BareMetrics,
}

/// A session of `processor`'s loop, named by its label.
fn session(processor: Processor, interval: Duration) -> SessionConfig {
    SessionConfig::new(processor.label(), processor).with_interval(interval)
}

/// What every loop of one replica shares.
struct Loops<'a> {
    db: &'a Bmdb,
    interval: Duration,
    tasks: &'a Tasks,
    cancel: &'a CancellationToken,
}

impl Loops<'_> {
    /// Runs `pass` until cancellation, in sessions of its processor, reporting to task `name`.
    async fn periodic<P: Pass>(&self, pass: P, name: &'static str) {
        let session = session(P::PROCESSOR, self.interval);
        let task = self.tasks.task(name);
        periodic::run(&pass, self.db.clone(), session, task, self.cancel.clone()).await
    }

    /// Runs `task` over machines as `settings` say until cancellation, in sessions of
    /// `processor`, reporting each machine's ending to task `name`.
    async fn machines<T: MachineTask>(
        &self,
        settings: &LoopSettings,
        task: T,
        processor: Processor,
        name: &'static str,
    ) {
        let config = RunnerConfig {
            parallelism: settings.parallelism,
            db_rate: settings.db_rate,
            session: session(processor, self.interval),
            status: self.tasks.task_of(name, TaskKind::Machines),
        };
        runner::run(self.db.clone(), Arc::new(task), config, self.cancel.clone()).await
    }
}

/// Runs the provisioner, the updater, the initializer and the recoverer with its brake over
/// `provider` (which also reboots machines), taking machines over through `transport`, and
/// history retention and the bare-metal loop if they are set, until `cancel`; returns once
/// every loop canceled its work and closed its sessions.
pub async fn run_loops<P: Rebooter + 'static>(
    db: Bmdb,
    provider: Arc<P>,
    transport: Arc<dyn Transport>,
    settings: FleetSettings,
    cancel: CancellationToken,
) -> Result<(), InvalidSetting> {
    let initializer = Initializer::new(provider.clone(), transport, settings.initializer)?;
    let loops = Loops {
        db: &db,
        interval: settings.session_interval,
        tasks: &settings.tasks,
        cancel: &cancel,
    };
    let updater = Updater::new(provider.clone(), settings.updater_rate);
    let updating = loops.periodic(updater, "updater");
    let provisioner = Provisioner::new(provider.clone(), settings.provisioner)
        .with_metrics(settings.provisioner_metrics.clone());
    let provisioning = loops.periodic(provisioner, "provisioner");
    let init = Processor::ShepherdInitializer;
    let initializing = loops.machines(&settings.initializer_loop, initializer, init, "initializer");
    let brake = Brake::new(
        settings.recovery_brake,
        provider.kind(),
        settings.recovery,
        settings.recovery_brake_metrics.clone(),
    );
    let brake_task = settings.tasks.task("recovery-brake");
    let braking = brake.clone().run(db.clone(), brake_task, cancel.clone());
    let recoverer = Recoverer::new(provider.clone(), settings.recovery)
        .with_backoff(settings.recoverer_backoff)
        .with_repeat_policy(settings.recovery_repeat)
        .with_metrics(settings.recoverer_metrics.clone())
        .with_brake(brake);
    let recover = Processor::ShepherdRecoverer;
    let recovering = loops.machines(&settings.recoverer_loop, recoverer, recover, "recoverer");
    let pruner = HistoryPruner::new(settings.retention);
    let pruning = loops.periodic(pruner, "retention");
    let bare = match &settings.bare {
        Some(b) => Some((
            BareMetalLoop::new(provider.clone(), b.settings.clone())?
                .with_metrics(b.metrics.clone()),
            b.runner,
        )),
        None => None,
    };
    let bare_metal = async {
        if let Some((bare, runner)) = bare {
            let processor = Processor::ShepherdBareMetal;
            loops.machines(&runner, bare, processor, "bare-metal").await;
        }
    };
    tokio::join!(
        provisioning,
        initializing,
        recovering,
        braking,
        updating,
        pruning,
        bare_metal
    );
    Ok(())
}
