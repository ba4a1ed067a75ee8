//! The Recoverer (design.md §9): reboots machines whose agent never heartbeated or went silent,
//! then clears the agent tags so the Initializer takes them over again.
//!
//! The recoverer never sleeps while a machine reboots: the wait is written into the BMDB as a
//! backoff of the initializer, so one worker can reboot machines back to back. Each reboot is
//! recorded in the `machine_recovery` tag with how many came in a row without the agent
//! heartbeating in between; from the second such reboot on, the next recovery backs off, and
//! after an operator-set number the machine is left alone until an operator retries it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{
    Backoff, Bmdb, Holding, LeaseLost, Process, RecoveryThresholds, Retrieval, Session, TagWrites,
};
use uuid::Uuid;

use crate::brake::Brake;
use crate::runner::{MachineTask, OnError};
use shepherd_provider::metrics::register_at_zero;
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::{look_up, LookupFailed, ProviderError, Rebooter};

/// Why a recovery failed; [`Recoverer`]'s error policy decides per kind.
#[derive(Debug, thiserror::Error)]
pub enum RecoveryError {
    /// Reading the machine's tags failed, before anything was done to it.
    #[error("reading the machine: {0}")]
    Read(shepherd_bmdb::Error),
    /// Finishing failed after the reboot: the machine may well have been rebooted.
    #[error("recording the reboot: {0}")]
    Finish(shepherd_bmdb::Error),
    /// The machine has no `machine_provided` tag.
    #[error("machine has no provided tag")]
    NotProvided,
    /// The provider could not be asked about the machine.
    #[error(transparent)]
    Lookup(#[from] LookupFailed),
    /// The reboot failed (the BMC or the provider's API said no, or did not answer).
    #[error("rebooting: {0:#}")]
    Reboot(ProviderError),
    /// The work's lease ended, or the work was found no longer held, before the reboot; or
    /// the lease ended while it was under way.
    #[error("rebooting: {0}")]
    LeaseLost(LeaseLost),
    /// Read right before the reboot, the machine was no longer due: its agent heartbeated
    /// since the claim, or a server's trouble now excuses its silence.
    #[error("no longer due for recovery: its agent heartbeated or its silence is excused")]
    NoLongerDue,
}

impl RecoveryError {
    /// A failed reboot: the provider's refusal to start its reset after the lease ended is the
    /// lease lost (fenced, no backoff), like the recoverer's own check; any other error is
    /// a failed reboot.
    fn of_reboot(error: ProviderError) -> Self {
        match error {
            ProviderError::LeaseLost(lost) => RecoveryError::LeaseLost(lost),
            other => RecoveryError::Reboot(other),
        }
    }
}

impl From<shepherd_bmdb::Error> for RecoveryError {
    /// A failed finish (the runner converts it): the reboot happened before.
    fn from(e: shepherd_bmdb::Error) -> Self {
        RecoveryError::Finish(e)
    }
}

/// How long "left alone" lasts: until an operator acts.
const LEFT_ALONE_FOR: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// What the recoverer does with a machine that earlier reboots did not bring back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RepeatPolicy {
    /// The wait before the second reboot in a row (on top of the recovery thresholds),
    /// growing by its exponent for each further one.
    pub backoff: Backoff,
    /// Reboots in a row after which the machine is left alone until an operator runs
    /// `shepherd machines retry`; 0 never gives up.
    pub give_up_after: u32,
}

impl RepeatPolicy {
    /// `first` before the second reboot in a row, doubling up to 24 h (or `first` if longer),
    /// ±10 %; left alone after `give_up_after` reboots in a row.
    pub fn doubling_from(first: Duration, give_up_after: u32) -> Self {
        RepeatPolicy {
            backoff: Backoff::exponential(first, first.max(Duration::from_secs(24 * 3600)), 2.0)
                .with_jitter(0.1),
            give_up_after,
        }
    }
}

impl Default for RepeatPolicy {
    /// 1 h before the second reboot in a row, doubling up to 24 h, ±10 %; left alone after 6.
    fn default() -> Self {
        RepeatPolicy::doubling_from(Duration::from_secs(3600), 6)
    }
}

/// When the recovery after a reboot may happen, as decided by [`RepeatPolicy::after`].
#[derive(Debug, Clone, PartialEq)]
pub enum NextRecovery {
    /// As soon as the machine is due again (the reboot followed a heartbeat).
    WhenDue,
    /// Not before `delay` has passed; `interval` is the persisted backoff interval.
    After { delay: Duration, interval: i64 },
    /// Not until an operator acts.
    LeftAlone,
}

impl RepeatPolicy {
    /// The decision after the `in_a_row`th reboot in a row.
    pub fn after(&self, in_a_row: i64) -> NextRecovery {
        if self.give_up_after > 0 && in_a_row >= i64::from(self.give_up_after) {
            return NextRecovery::LeftAlone;
        }
        if in_a_row < 2 {
            return NextRecovery::WhenDue;
        }
        let mut interval = None;
        for _ in 1..in_a_row.min(64) {
            interval = Some(self.backoff.next_interval_seconds(interval));
        }
        let interval = interval.unwrap_or_default();
        NextRecovery::After {
            delay: self.backoff.delay_with_jitter(interval),
            interval,
        }
    }

    /// Checks the settings; the message names the setting.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if self.backoff.initial.is_zero() {
            return Err(InvalidSetting::new(
                "recovery-repeat-backoff",
                "must be more than zero",
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RebootLabels {
    /// `first` after a heartbeat, `repeated` when earlier reboots did not bring the agent back,
    /// `last` when the machine is left alone after it.
    in_a_row: &'static str,
}

/// The recoverer's counters. Cheap to clone; clones share values.
#[derive(Debug, Clone, Default)]
pub struct RecovererMetrics {
    reboots: Family<RebootLabels, Counter>,
}

impl RecovererMetrics {
    /// Adds `shepherd_recoverer_reboots_total{in_a_row}` to `registry`, every series at 0.
    pub fn register(&self, registry: &mut Registry) {
        register_at_zero(
            registry,
            "shepherd_recoverer_reboots",
            "Reboots by the recoverer: first (after a heartbeat), repeated (earlier reboots did not bring the agent back) or last (the machine is left alone until an operator retries it)",
            &self.reboots,
            ["first", "repeated", "last"].map(|in_a_row| RebootLabels { in_a_row }),
        );
    }
}

/// Upstream's backoff after a failed reboot: 1 min, growing ×1.2 up to 1 h.
pub fn failed_reboot_backoff() -> Backoff {
    Backoff::exponential(Duration::from_secs(60), Duration::from_secs(3600), 1.2)
}

/// The recoverer for one provider.
pub struct Recoverer<P: Rebooter> {
    provider: Arc<P>,
    thresholds: RecoveryThresholds,
    backoff: Backoff,
    repeat: RepeatPolicy,
    brake: Option<Arc<Brake>>,
    metrics: RecovererMetrics,
}

impl<P: Rebooter> Recoverer<P> {
    /// A recoverer with upstream's backoff after a failed reboot ([`failed_reboot_backoff`])
    /// and the default [`RepeatPolicy`].
    pub fn new(provider: Arc<P>, thresholds: RecoveryThresholds) -> Self {
        Recoverer {
            provider,
            thresholds,
            backoff: failed_reboot_backoff(),
            repeat: RepeatPolicy::default(),
            brake: None,
            metrics: RecovererMetrics::default(),
        }
    }

    /// The same recoverer, stopped while `brake` is engaged.
    pub fn with_brake(self, brake: Arc<Brake>) -> Self {
        Recoverer {
            brake: Some(brake),
            ..self
        }
    }

    /// The same recoverer with another backoff after a failed reboot.
    pub fn with_backoff(self, backoff: Backoff) -> Self {
        Recoverer { backoff, ..self }
    }

    /// The same recoverer with another policy for repeated reboots.
    pub fn with_repeat_policy(self, repeat: RepeatPolicy) -> Self {
        Recoverer { repeat, ..self }
    }

    /// The same recoverer, counting into `metrics`.
    pub fn with_metrics(self, metrics: RecovererMetrics) -> Self {
        Recoverer { metrics, ..self }
    }
}

#[async_trait]
impl<P: Rebooter + 'static> MachineTask for Recoverer<P> {
    type Error = RecoveryError;

    /// Not while the brake holds, not when the provider cannot reboot, and not within a
    /// silence threshold of a BMDB outage: heartbeats that arrived while the database could not
    /// record them are missing from it, and a live agent shows up again within that time.
    async fn active(&self, db: &Bmdb) -> bool {
        let after_outage = db
            .since_last_outage()
            .is_some_and(|since| since < self.thresholds.heartbeat_older_than);
        !after_outage
            && self.brake.as_ref().is_none_or(|b| b.admits())
            && self.provider.can_reboot().await
    }

    fn retrieval(&self) -> Retrieval {
        let (provider, thresholds) = (self.provider.kind(), self.thresholds);
        Retrieval::AgentRecovery {
            provider,
            thresholds,
        }
    }

    /// A BMDB outage before the reboot is not the machine's fault: the work is released as it
    /// is; nor is a provider whose API is unavailable for the lookup: released, and the worker
    /// waits. Once the machine may have been rebooted (a reboot request that failed may have
    /// arrived), every failure backs off, so that a BMDB or a provider that comes back does
    /// not reboot it again at once.
    fn error_policy(&self, error: &RecoveryError) -> OnError {
        match error {
            RecoveryError::LeaseLost(_) => OnError::Fenced,
            RecoveryError::Read(e) if e.is_transient() => OnError::Cancel,
            RecoveryError::NoLongerDue => OnError::Cancel,
            RecoveryError::Lookup(l) if l.error.is_unavailable() => OnError::Wait,
            _ => OnError::Backoff(self.backoff),
        }
    }

    async fn process_machine(
        &self,
        session: &Session,
        machine: Uuid,
    ) -> Result<TagWrites, RecoveryError> {
        let (provided, heartbeat, previous) = session
            .read(move |tx| {
                Box::pin(async move {
                    Ok((
                        tx.provided(machine).await?,
                        tx.heartbeat(machine).await?,
                        tx.recovery(machine).await?,
                    ))
                })
            })
            .await
            .map_err(RecoveryError::Read)?;
        let provided = provided.ok_or(RecoveryError::NotProvided)?;
        tracing::Span::current().record("provider_id", provided.provider_id.as_str());
        let at_provider = look_up(&*self.provider, &provided.provider_id).await?;
        // The lock and the silence are read again right before the reset (the lookup may have
        // taken long enough for a heartbeat to land, or a server's trouble to be reported), and
        // the reset is raced against the lease: a BMC cannot refuse a replica whose lease ended.
        let lease = session.lease();
        let lost = RecoveryError::LeaseLost(LeaseLost);
        match session
            .still_holds_due(machine, self.retrieval())
            .await
            .map_err(RecoveryError::Read)?
        {
            Holding::Due => {}
            Holding::NoLongerDue => return Err(RecoveryError::NoLongerDue),
            Holding::Lost => return Err(lost),
        }
        lease
            .fenced("reboot", self.provider.reboot(&lease, &at_provider))
            .await
            .map_err(RecoveryError::LeaseLost)?
            .map_err(RecoveryError::of_reboot)?;
        if let Some(b) = &self.brake {
            b.rebooted();
        }
        // The machine's agent heartbeated since the last reboot (a reboot deletes the
        // heartbeat tag) unless the tag is missing: then the last reboot did not help.
        let in_a_row = match (heartbeat, previous) {
            (None, Some(p)) => p.in_a_row.saturating_add(1),
            _ => 1,
        };
        let next = self.repeat.after(in_a_row);
        let kind = match next {
            NextRecovery::LeftAlone => "last",
            _ if in_a_row > 1 => "repeated",
            _ => "first",
        };
        self.metrics
            .reboots
            .get_or_create(&RebootLabels { in_a_row: kind })
            .inc();
        let provider_id = provided.provider_id;
        match &next {
            NextRecovery::WhenDue => {
                tracing::info!(%machine, %provider_id, "rebooted a machine whose agent went silent")
            }
            NextRecovery::After { delay, .. } => tracing::info!(
                %machine,
                %provider_id,
                in_a_row,
                "rebooted a machine whose agent went silent, {in_a_row} times in a row; the next recovery waits {}",
                humantime::format_duration(Duration::from_secs(delay.as_secs()))
            ),
            NextRecovery::LeftAlone => tracing::warn!(
                %machine,
                %provider_id,
                in_a_row,
                "rebooted a machine whose agent went silent, {in_a_row} times in a row; leaving it alone until an operator runs `shepherd machines retry {machine}`"
            ),
        }
        let mut tags = TagWrites::none()
            .forget_agent_started()
            .forget_heartbeat()
            .recovery(in_a_row);
        let reboot_wait = self.provider.reboot_wait();
        if !reboot_wait.is_zero() {
            let cause = format!(
                "rebooted by the recoverer; given {} to come back",
                humantime::format_duration(reboot_wait)
            );
            tags = tags.hold_back(Process::ShepherdAgentStart, reboot_wait, 0, &cause);
        }
        Ok(match next {
            NextRecovery::WhenDue => tags,
            NextRecovery::After { delay, interval } => {
                let cause = format!(
                    "rebooted {in_a_row} times in a row without its agent heartbeating; waiting before the next recovery"
                );
                tags.hold_back(Process::ShepherdRecovery, delay, interval, &cause)
            }
            NextRecovery::LeftAlone => {
                let cause = format!(
                    "left alone after {in_a_row} reboots in a row without its agent heartbeating; `shepherd machines retry {machine}` tries again"
                );
                tags.hold_back(Process::ShepherdRecovery, LEFT_ALONE_FOR, 0, &cause)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A static provider over an inventory nobody reads.
    fn inventory() -> Arc<shepherd_provider::static_provider::StaticProvider> {
        let url = "file:///nonexistent/inventory.json";
        Arc::new(
            shepherd_provider::static_provider::StaticProvider::new(
                url,
                shepherd_bmdb::ProviderKind::Static,
            )
            .unwrap(),
        )
    }

    /// Upstream's recoverer backoff: one minute, growing by 1.2 per failed reboot, capped at
    /// an hour; a recoverer built without settings uses it.
    #[test]
    fn the_default_backoff_is_upstreams() {
        let b = failed_reboot_backoff();
        let mut seq = vec![];
        let mut prev = None;
        for _ in 0..24 {
            let next = b.next_interval_seconds(prev);
            seq.push(next);
            prev = Some(next);
        }
        assert_eq!(&seq[..5], [60, 72, 87, 105, 126]);
        assert!(seq.windows(2).all(|w| w[1] >= w[0]));
        assert_eq!(*seq.last().unwrap(), 3600, "{seq:?}");
        let r = Recoverer::new(inventory(), RecoveryThresholds::default());
        assert_eq!(r.backoff, b);
    }

    #[test]
    fn only_an_outage_before_the_reboot_releases_the_machine_without_backoff() {
        let r = Recoverer::new(inventory(), RecoveryThresholds::default());
        let outage = || shepherd_bmdb::Error::Unavailable {
            target: "db".into(),
            cause: "connection refused".into(),
        };
        assert_eq!(
            r.error_policy(&RecoveryError::Read(outage())),
            OnError::Cancel
        );
        // After a reboot the machine may be down already: never reboot it again at once.
        assert_eq!(
            r.error_policy(&RecoveryError::Finish(outage())),
            OnError::Backoff(r.backoff)
        );
        assert_eq!(
            r.error_policy(&RecoveryError::Reboot(ProviderError::NotSupported(
                "reboot"
            ))),
            OnError::Backoff(r.backoff)
        );
        // A provider that did not start its reset because the lease had ended: fenced, as
        // when the recoverer's own check stops the reboot; not a failed reboot.
        let refused = RecoveryError::of_reboot(ProviderError::LeaseLost(LeaseLost));
        assert_eq!(r.error_policy(&refused), OnError::Fenced);
    }

    #[test]
    fn repeated_reboots_back_off_then_give_up() {
        let p = RepeatPolicy {
            backoff: Backoff::exponential(
                Duration::from_secs(3600),
                Duration::from_secs(4 * 3600),
                2.0,
            ),
            give_up_after: 5,
        };
        assert_eq!(p.after(1), NextRecovery::WhenDue);
        let intervals: Vec<_> = (2..5)
            .map(|n| match p.after(n) {
                NextRecovery::After { interval, delay } => {
                    assert_eq!(delay.as_secs() as i64, interval, "no jitter configured");
                    interval
                }
                other => panic!("{n}: {other:?}"),
            })
            .collect();
        assert_eq!(intervals, [3600, 7200, 14400]);
        assert_eq!(p.after(5), NextRecovery::LeftAlone);
        assert_eq!(p.after(500), NextRecovery::LeftAlone);
        let never = RepeatPolicy {
            give_up_after: 0,
            ..p
        };
        assert!(matches!(
            never.after(10_000),
            NextRecovery::After {
                interval: 14400,
                ..
            }
        ));
    }
}
