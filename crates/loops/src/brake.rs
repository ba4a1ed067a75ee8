//! The recovery brake: when much of a provider's fleet looks broken at once, the likelier
//! cause is us (the BMaaS server is down, the agents cannot reach it, the network is cut), and
//! power-cycling the whole fleet would make things worse. Like Kubernetes' node-lifecycle
//! controller, which stops evictions in a zone that is mostly unhealthy, the brake stops the
//! recoverer while more than a set share of the provider's machines are stale, and releases
//! it by itself when the share falls. It is evaluated from two count queries on an interval,
//! never per claim.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Bmdb, Process, Provider, RecoveryThresholds, Retrieval, STALE_AFTER};
use tokio_util::sync::CancellationToken;

/// When the brake engages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BrakeConfig {
    /// Engage when more than this share of the provider's machines are due for recovery.
    pub max_stale_share: f64,
    /// ... and at least this many are (a small fleet with a few broken machines still recovers).
    pub min_stale: i64,
    /// How often the share is counted.
    pub interval: Duration,
}

impl Default for BrakeConfig {
    fn default() -> Self {
        BrakeConfig {
            max_stale_share: 0.5,
            min_stale: 5,
            interval: Duration::from_secs(30),
        }
    }
}

impl BrakeConfig {
    /// Checks the settings; the message names the setting.
    pub fn validate(&self) -> anyhow::Result<()> {
        if !(self.max_stale_share > 0.0 && self.max_stale_share <= 1.0) {
            anyhow::bail!(
                "recovery-brake-share: must be more than 0 and at most 1, not {}",
                self.max_stale_share
            );
        }
        if self.min_stale < 0 {
            anyhow::bail!("recovery-brake-min-stale: must not be negative");
        }
        if self.interval.is_zero() {
            anyhow::bail!("recovery-brake-interval: must be more than zero");
        }
        Ok(())
    }
}

/// The brake's gauges. Cheap to clone; clones share values.
#[derive(Debug, Clone, Default)]
pub struct BrakeMetrics {
    engaged: Gauge,
    stale: Gauge,
    share: Gauge<f64, std::sync::atomic::AtomicU64>,
}

impl BrakeMetrics {
    /// Adds the gauges to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "shepherd_recovery_brake_engaged",
            "1 while the recoverer is stopped because too many machines are stale at once",
            self.engaged.clone(),
        );
        registry.register(
            "shepherd_recovery_due_machines",
            "Machines due for recovery at the brake's last count",
            self.stale.clone(),
        );
        registry.register(
            "shepherd_recovery_due_share",
            "Share of the provider's machines due for recovery at the brake's last count",
            self.share.clone(),
        );
    }
}

/// What one count found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BrakeReading {
    /// Machines due for recovery.
    pub due: i64,
    /// Machines of the provider.
    pub machines: i64,
}

/// The brake of one provider's recoverer. Engaged until its first count.
#[derive(Debug)]
pub struct Brake {
    config: BrakeConfig,
    provider: Provider,
    thresholds: RecoveryThresholds,
    engaged: AtomicBool,
    metrics: BrakeMetrics,
}

impl Brake {
    /// A brake over `provider`'s machines, counting into `metrics`.
    pub fn new(
        config: BrakeConfig,
        provider: Provider,
        thresholds: RecoveryThresholds,
        metrics: BrakeMetrics,
    ) -> Arc<Brake> {
        metrics.engaged.set(1);
        Arc::new(Brake {
            config,
            provider,
            thresholds,
            engaged: AtomicBool::new(true),
            metrics,
        })
    }

    /// Whether the recoverer must not reboot anything now.
    pub fn engaged(&self) -> bool {
        self.engaged.load(Ordering::Relaxed)
    }

    /// Whether `reading` calls for the brake.
    pub fn should_engage(&self, r: BrakeReading) -> bool {
        r.due >= self.config.min_stale
            && r.due as f64 > self.config.max_stale_share * r.machines.max(1) as f64
    }

    /// Counts the machines due for recovery and the provider's machines, and engages or
    /// releases the brake, logging each change once.
    pub async fn evaluate(&self, db: &Bmdb) -> Result<BrakeReading, shepherd_bmdb::Error> {
        let (provider, thresholds) = (self.provider, self.thresholds);
        let reading = db
            .read(move |tx| {
                Box::pin(async move {
                    let due = tx
                        .count_eligible(
                            Process::ShepherdRecovery,
                            &Retrieval::AgentRecovery {
                                provider,
                                thresholds,
                            },
                        )
                        .await?;
                    let counts = tx.fleet_counts(STALE_AFTER).await?;
                    let machines = counts
                        .provided
                        .iter()
                        .find(|(p, _)| *p == provider)
                        .map_or(0, |(_, n)| *n);
                    Ok(BrakeReading { due, machines })
                })
            })
            .await?;
        let engage = self.should_engage(reading);
        let share = reading.due as f64 / reading.machines.max(1) as f64;
        self.metrics.stale.set(reading.due);
        self.metrics.share.set(share);
        self.metrics.engaged.set(i64::from(engage));
        let was = self.engaged.swap(engage, Ordering::Relaxed);
        if engage && !was {
            tracing::warn!(
                provider = %self.provider,
                due = reading.due,
                machines = reading.machines,
                "recovery brake engaged: {} of {} machines ({:.0}%) are due for recovery, more than the {:.0}% allowed; suspecting the BMaaS server or the network, no machine is rebooted until the share falls",
                reading.due,
                reading.machines,
                share * 100.0,
                self.config.max_stale_share * 100.0
            );
        } else if !engage && was {
            tracing::info!(
                provider = %self.provider,
                due = reading.due,
                machines = reading.machines,
                "recovery brake released: {} of {} machines are due for recovery",
                reading.due,
                reading.machines
            );
        }
        Ok(reading)
    }

    /// Evaluates the brake every interval until `cancel`. A failed count keeps the last state
    /// (engaged before the first count succeeds).
    pub async fn run(self: Arc<Self>, db: Bmdb, cancel: CancellationToken) {
        loop {
            if let Err(e) = self.evaluate(&db).await {
                tracing::warn!(error = %e, "counting machines for the recovery brake failed; keeping its state");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.config.interval) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engages_over_the_share_and_the_minimum() {
        let b = Brake::new(
            BrakeConfig::default(),
            Provider::Sim,
            RecoveryThresholds::default(),
            BrakeMetrics::default(),
        );
        assert!(b.engaged(), "engaged until the first count");
        let r = |due, machines| BrakeReading { due, machines };
        assert!(!b.should_engage(r(4, 4)), "a small fleet still recovers");
        assert!(!b.should_engage(r(50, 100)), "half is not more than half");
        assert!(b.should_engage(r(51, 100)));
        assert!(b.should_engage(r(100_000, 100_000)));
        assert!(!b.should_engage(r(0, 0)));
        for share in [0.0, 1.5, f64::NAN] {
            let bad = BrakeConfig {
                max_stale_share: share,
                ..Default::default()
            };
            assert!(bad.validate().is_err(), "{share}");
        }
        assert!(BrakeConfig::default().validate().is_ok());
    }
}
