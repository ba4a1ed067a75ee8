//! Assembling and running one replica's control loops over one provider: what `shepherd run`,
//! `shepherd demo` and the benchmarks start.

use std::sync::Arc;
use std::time::Duration;

use crate::brake::{Brake, BrakeConfig, BrakeMetrics};
use crate::initializer::{Initializer, InitializerConfig};
use crate::limiter::RateSpec;
use crate::provider::Recoverer as RecovererProvider;
use crate::provisioner::{Provisioner, ProvisionerConfig};
use crate::recoverer::{Recoverer, RecovererMetrics, RepeatPolicy};
use crate::retention::{HistoryPruner, RETENTION_RATE};
use crate::runner::{self, RunnerConfig};
use crate::settings::InvalidSetting;
use crate::tasks::Tasks;
use crate::transport::Transport;
use crate::updater::Updater;
use shepherd_bmdb::{
    Backoff, Bmdb, HistoryRetention, Processor, RecoveryThresholds, SessionConfig,
};
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
    /// Pace of provider-fact refreshes (the updater).
    pub updater_rate: RateSpec,
    /// Session keep-alive interval.
    pub session_interval: Duration,
    /// How long history is kept; `None` keeps it forever.
    pub history_retention: Option<HistoryRetention>,
    /// Where the periodic loops report their passes (shared with the web UI and `/metrics`).
    pub tasks: Tasks,
}

fn session(name: &str, processor: Processor, interval: Duration) -> SessionConfig {
    SessionConfig::new(name, processor).with_interval(interval)
}

impl LoopSettings {
    /// The runner's settings of a loop whose sessions are named `name`.
    fn runner(&self, name: &str, processor: Processor, interval: Duration) -> RunnerConfig {
        RunnerConfig {
            parallelism: self.parallelism,
            db_rate: self.db_rate,
            session: session(name, processor, interval),
        }
    }
}

/// Runs the provisioner, the updater, the initializer and the recoverer with its brake over
/// `provider` (which also reboots machines), taking machines over through `transport`, and
/// history retention if it is set, until `cancel`; returns once every loop canceled its work
/// and closed its sessions.
pub async fn run_loops<P: RecovererProvider + 'static>(
    db: Bmdb,
    provider: Arc<P>,
    transport: Arc<dyn Transport>,
    settings: FleetSettings,
    cancel: CancellationToken,
) -> Result<(), InvalidSetting> {
    let interval = settings.session_interval;
    let initializer = Initializer::new(provider.clone(), transport, settings.initializer)?;
    let updater = Updater::new(provider.clone(), settings.updater_rate);
    let updating = updater.run(
        db.clone(),
        session("shepherd-updater", Processor::ShepherdUpdater, interval),
        settings.tasks.task("updater"),
        cancel.clone(),
    );
    let provisioner = Provisioner::new(provider.clone(), settings.provisioner);
    let provisioning = provisioner.run(
        db.clone(),
        session(
            "shepherd-provisioner",
            Processor::ShepherdProvisioner,
            interval,
        ),
        settings.tasks.task("provisioner"),
        cancel.clone(),
    );
    let initializer_runner = settings.initializer_loop.runner(
        "shepherd-initializer",
        Processor::ShepherdInitializer,
        interval,
    );
    let initializing = runner::run(
        db.clone(),
        Arc::new(initializer),
        initializer_runner,
        cancel.clone(),
    );
    let brake = Brake::new(
        settings.recovery_brake,
        provider.kind(),
        settings.recovery,
        settings.recovery_brake_metrics.clone(),
    );
    let braking = brake.clone().run(db.clone(), cancel.clone());
    let recoverer = Recoverer::new(provider.clone(), settings.recovery)
        .with_backoff(settings.recoverer_backoff)
        .with_repeat_policy(settings.recovery_repeat)
        .with_metrics(settings.recoverer_metrics.clone())
        .with_brake(brake);
    let recoverer_runner = settings.recoverer_loop.runner(
        "shepherd-recoverer",
        Processor::ShepherdRecoverer,
        interval,
    );
    let recovering = runner::run(
        db.clone(),
        Arc::new(recoverer),
        recoverer_runner,
        cancel.clone(),
    );
    let pruning = async {
        if let Some(retention) = settings.history_retention {
            HistoryPruner::new(retention)
                .run(
                    RETENTION_RATE,
                    db.clone(),
                    session("shepherd-retention", Processor::ShepherdRetention, interval),
                    settings.tasks.task("retention"),
                    cancel.clone(),
                )
                .await;
        }
    };
    tokio::join!(
        provisioning,
        initializing,
        recovering,
        braking,
        updating,
        pruning
    );
    Ok(())
}
