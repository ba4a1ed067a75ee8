//! Assembling and running one replica's control loops over one provider: what `shepherd run`,
//! `shepherd demo` and the benchmarks start.

use std::sync::Arc;
use std::time::Duration;

use crate::brake::{Brake, BrakeConfig, BrakeMetrics};
use crate::initializer::{Initializer, InitializerConfig};
use crate::limiter::RateSpec;
use crate::provider::{Provider, Recoverer as RecovererProvider};
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

/// Runs the provisioner, the updater, the initializer and, if `recoverer` is given, the recoverer until
/// `cancel`; returns once every loop canceled its work and closed its sessions.
pub async fn run_loops<P, R>(
    db: Bmdb,
    provider: Arc<P>,
    transport: Arc<dyn Transport>,
    recoverer: Option<Arc<R>>,
    settings: FleetSettings,
    cancel: CancellationToken,
) -> Result<(), InvalidSetting>
where
    P: Provider + 'static,
    R: RecovererProvider + 'static,
{
    let interval = settings.session_interval;
    let initializer = Initializer::new(provider.clone(), transport, settings.initializer)?;
    let updater = Updater::new(provider.clone(), settings.updater_rate);
    let updating = updater.run(
        db.clone(),
        session("shepherd-updater", Processor::ShepherdUpdater, interval),
        settings.tasks.task("updater"),
        cancel.clone(),
    );
    let provisioner = Provisioner::new(provider, settings.provisioner);
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
    let initializing = runner::run(
        db.clone(),
        Arc::new(initializer),
        RunnerConfig {
            parallelism: settings.initializer_loop.parallelism,
            db_rate: settings.initializer_loop.db_rate,
            session: session(
                "shepherd-initializer",
                Processor::ShepherdInitializer,
                interval,
            ),
        },
        cancel.clone(),
    );
    let recovering = async {
        if let Some(r) = recoverer {
            let brake = Brake::new(
                settings.recovery_brake,
                r.kind(),
                settings.recovery,
                settings.recovery_brake_metrics.clone(),
            );
            let braking = tokio::spawn(brake.clone().run(db.clone(), cancel.clone()));
            let task = Recoverer::new(r, settings.recovery)
                .with_backoff(settings.recoverer_backoff)
                .with_repeat_policy(settings.recovery_repeat)
                .with_metrics(settings.recoverer_metrics.clone())
                .with_brake(brake);
            runner::run(
                db.clone(),
                Arc::new(task),
                RunnerConfig {
                    parallelism: settings.recoverer_loop.parallelism,
                    db_rate: settings.recoverer_loop.db_rate,
                    session: session("shepherd-recoverer", Processor::ShepherdRecoverer, interval),
                },
                cancel.clone(),
            )
            .await;
            let _ = braking.await;
        }
    };
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
    tokio::join!(provisioning, initializing, recovering, updating, pruning);
    Ok(())
}
