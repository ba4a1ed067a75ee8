//! The recovery brake: when much of a provider's fleet looks broken at once, the likelier
//! cause is us (the BMaaS server is down, the agents cannot reach it, the network is cut), and
//! power-cycling the whole fleet would make things worse. Like Kubernetes' node-lifecycle
//! controller, which stops evictions in a zone that is mostly unhealthy, the brake stops the
//! recoverer while more than a set share of the provider's machines are silent, and releases
//! it by itself when the share falls. Silent means no heartbeat within *half* the recovery
//! threshold (machines just rebooted count until their agent is back), so when a whole fleet
//! goes quiet the brake engages well before any machine falls due. Only machines whose agent
//! was started are counted: machines still being brought in (a bring-up, an expansion) have
//! no agent to be silent.
//!
//! It is evaluated from two count queries, never per claim: on an interval, and as soon as the
//! recoverer has used up the few reboots each count allows (`min_silent`). So however fast
//! machines go silent between two counts, at most that many are rebooted before the brake
//! looks again.

use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Bmdb, Process, ProviderKind, RecoveryThresholds, Retrieval};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use shepherd_provider::settings::InvalidSetting;

use shepherd_tasks::{Outcome, TaskHandle};

/// When the brake engages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BrakeConfig {
    /// Engage when more than this share of the provider's machines are silent.
    pub max_silent_share: f64,
    /// ... and at least this many are (a small fleet with a few broken machines still
    /// recovers). Also the most reboots between two counts.
    pub min_silent: i64,
    /// How often the share is counted.
    pub interval: Duration,
}

impl Default for BrakeConfig {
    fn default() -> Self {
        BrakeConfig {
            max_silent_share: 0.5,
            min_silent: 5,
            interval: Duration::from_secs(30),
        }
    }
}

impl BrakeConfig {
    /// Checks the settings; the message names the setting.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if !(self.max_silent_share > 0.0 && self.max_silent_share <= 1.0) {
            return Err(InvalidSetting::new(
                "recovery-brake-share",
                format!(
                    "must be more than 0 and at most 1, not {}",
                    self.max_silent_share
                ),
            ));
        }
        if self.min_silent < 0 {
            return Err(InvalidSetting::new(
                "recovery-brake-min-silent",
                "must not be negative",
            ));
        }
        if self.interval.is_zero() {
            return Err(InvalidSetting::new(
                "recovery-brake-interval",
                "must be more than zero",
            ));
        }
        Ok(())
    }
}

/// The brake's gauges, which are also its status for the web UI. Cheap to clone; clones
/// share values.
#[derive(Debug, Clone, Default)]
pub struct BrakeMetrics {
    engaged: Gauge,
    due: Gauge,
    silent: Gauge,
    share: Gauge<f64, std::sync::atomic::AtomicU64>,
    counted: Arc<AtomicBool>,
    allowed_share: Gauge<f64, std::sync::atomic::AtomicU64>,
}

/// The brake as last evaluated, for display.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BrakeStatus {
    /// Whether the recoverer is stopped.
    pub engaged: bool,
    /// Whether the machines were counted yet (the brake holds until they are).
    pub counted: bool,
    /// Machines due for recovery at the last count.
    pub due: i64,
    /// Machines without a recent heartbeat at the last count.
    pub silent: i64,
    /// Their share of the provider's machines whose agent was started.
    pub share: f64,
    /// The share above which the brake engages.
    pub allowed_share: f64,
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
            self.due.clone(),
        );
        registry.register(
            "shepherd_recovery_silent_machines",
            "Machines of the provider without a recent heartbeat at the brake's last count",
            self.silent.clone(),
        );
        registry.register(
            "shepherd_recovery_silent_share",
            "Share of the provider's machines with a started agent that have no recent heartbeat, at the brake's last count",
            self.share.clone(),
        );
    }

    /// The brake's state as last evaluated.
    pub fn status(&self) -> BrakeStatus {
        BrakeStatus {
            engaged: self.engaged.get() != 0,
            counted: self.counted.load(Ordering::Relaxed),
            due: self.due.get(),
            silent: self.silent.get(),
            share: self.share.get(),
            allowed_share: self.allowed_share.get(),
        }
    }
}

/// What one count found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BrakeReading {
    /// Machines due for recovery.
    pub due: i64,
    /// Machines without a heartbeat within half the recovery threshold (an agent started that
    /// never heartbeated, just rebooted, or gone quiet).
    pub silent: i64,
    /// Machines of the provider whose agent was started (or that were rebooted since).
    pub machines: i64,
}

/// The brake of one provider's recoverer. Engaged until its first count.
#[derive(Debug)]
pub struct Brake {
    config: BrakeConfig,
    provider: ProviderKind,
    thresholds: RecoveryThresholds,
    engaged: AtomicBool,
    /// Reboots left before the next count.
    reboots_left: AtomicI64,
    /// Wakes the counting loop when the reboots are used up.
    recount: Notify,
    metrics: BrakeMetrics,
}

impl Brake {
    /// A brake over `provider`'s machines, counting into `metrics`.
    pub fn new(
        config: BrakeConfig,
        provider: ProviderKind,
        thresholds: RecoveryThresholds,
        metrics: BrakeMetrics,
    ) -> Arc<Brake> {
        metrics.engaged.set(1);
        metrics.allowed_share.set(config.max_silent_share);
        Arc::new(Brake {
            config,
            provider,
            thresholds,
            engaged: AtomicBool::new(true),
            reboots_left: AtomicI64::new(0),
            recount: Notify::new(),
            metrics,
        })
    }

    /// Whether the recoverer must not reboot anything now.
    pub fn engaged(&self) -> bool {
        self.engaged.load(Ordering::Relaxed)
    }

    /// Whether the recoverer may reboot one more machine before the next count.
    pub fn admits(&self) -> bool {
        !self.engaged() && self.reboots_left.load(Ordering::Relaxed) > 0
    }

    /// Tells the brake a machine was rebooted; the last reboot a count allowed asks for the
    /// next count at once.
    pub fn rebooted(&self) {
        if self.reboots_left.fetch_sub(1, Ordering::Relaxed) <= 1 {
            self.recount.notify_one();
        }
    }

    /// Whether `reading` calls for the brake.
    pub fn should_engage(&self, r: BrakeReading) -> bool {
        r.silent >= self.config.min_silent
            && r.silent as f64 > self.config.max_silent_share * r.machines.max(1) as f64
    }

    /// Counts the machines due for recovery and the provider's machines, and engages or
    /// releases the brake, logging each change once.
    pub async fn evaluate(&self, db: &Bmdb) -> Result<BrakeReading, shepherd_bmdb::Error> {
        let (provider, thresholds) = (self.provider, self.thresholds);
        let fresh_within = thresholds.heartbeat_older_than / 2;
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
                    let (machines, heartbeating) =
                        tx.count_heartbeating(provider, fresh_within).await?;
                    Ok(BrakeReading {
                        due,
                        silent: machines - heartbeating,
                        machines,
                    })
                })
            })
            .await?;
        let engage = self.should_engage(reading);
        let share = reading.silent as f64 / reading.machines.max(1) as f64;
        self.metrics.due.set(reading.due);
        self.metrics.silent.set(reading.silent);
        self.metrics.share.set(share);
        self.metrics.engaged.set(i64::from(engage));
        self.metrics.counted.store(true, Ordering::Relaxed);
        self.reboots_left.store(
            if engage {
                0
            } else {
                self.config.min_silent.max(1)
            },
            Ordering::Relaxed,
        );
        let was = self.engaged.swap(engage, Ordering::Relaxed);
        // The counts go on both messages, as fields of the event's span.
        let _counts = tracing::info_span!(
            "recovery_brake",
            provider = %self.provider,
            due = reading.due,
            silent = reading.silent,
            machines = reading.machines,
        )
        .entered();
        if engage && !was {
            tracing::warn!(
                "recovery brake engaged: {} of {} machines ({:.0}%) have no recent heartbeat, more than the {:.0}% allowed; suspecting the BMaaS server or the network, no machine is rebooted until the share falls ({} due for recovery wait)",
                reading.silent,
                reading.machines,
                share * 100.0,
                self.config.max_silent_share * 100.0,
                reading.due
            );
        } else if !engage && was {
            tracing::info!(
                "recovery brake released: {} of {} machines have no recent heartbeat, {} are due for recovery",
                reading.silent,
                reading.machines,
                reading.due
            );
        }
        Ok(reading)
    }

    /// Evaluates the brake every interval, and whenever the reboots a count allowed are used
    /// up, until `cancel`, reporting each count to `task` (`driver::repeat`: a panic is
    /// reported and the next count comes as usual). A failed or panicked count keeps the brake
    /// engaged if it was, and allows no more reboots until a count succeeds.
    pub async fn run(self: Arc<Self>, db: Bmdb, task: TaskHandle, cancel: CancellationToken) {
        let count = || async {
            let mut count = NoRebootsUnlessCounted {
                reboots_left: &self.reboots_left,
                counted: false,
            };
            let ended = self.count_once(&db).await;
            count.counted = ended.0 == Outcome::Succeeded;
            ended
        };
        let pause = || async {
            tokio::select! {
                _ = tokio::time::sleep(self.config.interval) => {}
                _ = self.recount.notified() => {}
            }
        };
        shepherd_tasks::driver::repeat(&task, &cancel, count, pause).await;
    }

    /// One count, and how it ended for the task's status.
    async fn count_once(&self, db: &Bmdb) -> (Outcome, String) {
        match self.evaluate(db).await {
            Ok(r) => {
                let state = if self.engaged() {
                    "engaged"
                } else {
                    "released"
                };
                let summary = format!(
                    "{state}: {} of {} machines silent, {} due",
                    r.silent, r.machines, r.due
                );
                (Outcome::Succeeded, summary)
            }
            Err(e) => {
                tracing::warn!(error = %e, "counting machines for the recovery brake failed; no reboots until a count succeeds");
                (Outcome::of_bmdb_error(&e), format!("counting failed: {e}"))
            }
        }
    }
}

/// Allows no more reboots when dropped unless the count succeeded: a count that failed, or
/// panicked (its future dropped while unwinding), leaves no allowance of an earlier one.
struct NoRebootsUnlessCounted<'a> {
    reboots_left: &'a AtomicI64,
    counted: bool,
}

impl Drop for NoRebootsUnlessCounted<'_> {
    fn drop(&mut self) {
        if !self.counted {
            self.reboots_left.store(0, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A count that panics (its future dropped while unwinding) leaves no reboots allowed; a
    /// count that succeeded leaves what it allowed.
    #[test]
    fn a_count_that_did_not_finish_allows_no_reboots() {
        let left = AtomicI64::new(5);
        let panicked = std::panic::catch_unwind(|| {
            let _count = NoRebootsUnlessCounted {
                reboots_left: &left,
                counted: false,
            };
            panic!("injected: the count panicked");
        });
        assert!(panicked.is_err());
        assert_eq!(left.load(Ordering::Relaxed), 0);
        left.store(5, Ordering::Relaxed);
        let mut count = NoRebootsUnlessCounted {
            reboots_left: &left,
            counted: false,
        };
        count.counted = true;
        drop(count);
        assert_eq!(left.load(Ordering::Relaxed), 5);
    }

    #[test]
    fn engages_over_the_share_and_the_minimum() {
        let b = Brake::new(
            BrakeConfig::default(),
            ProviderKind::Sim,
            RecoveryThresholds::default(),
            BrakeMetrics::default(),
        );
        assert!(b.engaged(), "engaged until the first count");
        let r = |silent, machines| BrakeReading {
            due: silent,
            silent,
            machines,
        };
        assert!(!b.should_engage(r(4, 4)), "a small fleet still recovers");
        assert!(!b.should_engage(r(50, 100)), "half is not more than half");
        assert!(b.should_engage(r(51, 100)));
        assert!(b.should_engage(r(100_000, 100_000)));
        assert!(!b.should_engage(r(0, 0)));
        for share in [0.0, 1.5, f64::NAN] {
            let bad = BrakeConfig {
                max_silent_share: share,
                ..Default::default()
            };
            assert!(bad.validate().is_err(), "{share}");
        }
        assert!(BrakeConfig::default().validate().is_ok());
    }
}
