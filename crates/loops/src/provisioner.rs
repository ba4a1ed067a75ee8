//! The Provisioner (design.md §7): reconciles the provider's view with the BMDB and brings unused
//! capacity in, within limits and rate limits.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{LeaseLost, Processor, Session};

use crate::limiter::{Limiter, RateSpec};
use crate::periodic::{Pass, PassError};
use crate::reconcile::{reconcile, Limits, ReconcileError};
use shepherd_provider::metrics::register_at_zero;
use shepherd_provider::{
    listed_and_recorded, Availability, HandBack, ListError, Provider, ProviderError,
    ProviderMachine,
};

/// Why a provisioner pass failed or stopped early.
#[derive(Debug, thiserror::Error)]
pub enum ProvisionerError {
    /// The provider or the BMDB could not be read.
    #[error(transparent)]
    List(#[from] ListError),
    /// The provisioner's own records (decommissioned ids, skipped ids, candidates recorded
    /// since the listing) could not be read or written.
    #[error("reading or writing the decommissioned, skipped and recorded provider ids: {0}")]
    Bmdb(shepherd_bmdb::Error),
    /// The provider and the BMDB disagree: nothing is created until they agree.
    #[error(transparent)]
    Reconcile(#[from] ReconcileError),
    /// The BMDB could not record a machine the provider had just created: the pass stops
    /// rather than create machines nothing can record.
    #[error("stopped the pass after {created} machine(s): the BMDB cannot record what the provider creates: {error}")]
    BmdbFailed {
        /// Machines created and recorded before the failure.
        created: usize,
        /// The failure.
        error: ProviderError,
    },
    /// The provider's API became unavailable during the pass: the rest of the pass would fail
    /// alike, so it stops, and the next pass tries again.
    #[error("stopped the pass after {created} machine(s): the provider is unavailable: {error}")]
    ProviderUnavailable {
        /// Machines created before the failure.
        created: usize,
        /// The failure.
        error: ProviderError,
    },
    /// The session's lease ended during the pass: nothing more is created or handed back.
    #[error("stopped the pass: {0}")]
    LeaseLost(LeaseLost),
}

/// Provisioner settings (design.md §17 defaults).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProvisionerConfig {
    /// Managed-machine limit and per-iteration chunk.
    pub limits: Limits,
    /// How often to reconcile (`1m,1`).
    pub reconcile_rate: RateSpec,
    /// How fast to create machines at the provider (`5s,1`).
    pub creation_rate: RateSpec,
    /// Most creations in flight at once (1). More fills a slow provider's pipeline (Ironic
    /// places allocations and starts deploys in the background), at a price: when the BMDB
    /// fails mid-pass, up to this many machines may have been created that it cannot record
    /// (each adopted by a later pass).
    pub creation_parallelism: usize,
}

impl PassError for ProvisionerError {
    fn bmdb_unavailable(&self) -> bool {
        match self {
            ProvisionerError::List(e) => e.is_bmdb_unavailable(),
            ProvisionerError::Bmdb(e) => e.is_transient(),
            ProvisionerError::BmdbFailed { .. } | ProvisionerError::LeaseLost(_) => true,
            ProvisionerError::Reconcile(_) | ProvisionerError::ProviderUnavailable { .. } => false,
        }
    }
}

impl Default for ProvisionerConfig {
    fn default() -> Self {
        ProvisionerConfig {
            limits: Limits::default(),
            reconcile_rate: RateSpec::new(Duration::from_secs(60), 1),
            creation_rate: RateSpec::new(Duration::from_secs(5), 1),
            creation_parallelism: 1,
        }
    }
}

/// What one reconciliation did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct IterationReport {
    /// Machines both the provider and the BMDB know.
    pub managed: usize,
    /// Machines brought in this iteration.
    pub created: usize,
    /// Machines another replica (or an earlier, unanswered attempt) had already recorded.
    pub adopted: usize,
    /// Creations that failed (logged and skipped).
    pub failed: usize,
    /// Unused machines another client of the provider took first (skipped).
    pub taken: usize,
    /// Unused machines not claimable now (busy at the provider, a failed claim cleaned up, an
    /// answer lost): a later pass tries again or adopts what was made.
    pub deferred: usize,
    /// Listed machines an operator decommissioned, not managed.
    pub decommissioned: usize,
    /// Decommissioned machines handed back to the provider in this pass.
    pub handed_back: usize,
    /// Machines the BMDB records that the provider no longer lists (within
    /// `--provisioner-max-missing`): the pass went on without them.
    pub missing: usize,
    /// Unused machines left alone because the provider refused them recently (a skip in
    /// the BMDB, this replica's or another's).
    pub skipped: usize,
    /// Machines the provider refused to create in this pass; each is now skipped.
    pub refused: usize,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CreationLabels {
    /// What became of one creation: one of [`CREATION_OUTCOMES`].
    outcome: &'static str,
}

/// The outcomes of a creation, as `shepherd_provisioner_creations_total{outcome}` counts them.
const CREATION_OUTCOMES: [&str; 8] = [
    "created",
    "adopted",
    "taken",
    "deferred",
    "refused",
    "unrecorded",
    "fenced",
    "failed",
];

/// The provisioner's counters. Cheap to clone; clones share values.
#[derive(Debug, Clone, Default)]
pub struct ProvisionerMetrics {
    creations: Family<CreationLabels, Counter>,
}

impl ProvisionerMetrics {
    /// Adds `shepherd_provisioner_creations_total{outcome}` to `registry`, every series at 0.
    pub fn register(&self, registry: &mut Registry) {
        register_at_zero(
            registry,
            "shepherd_provisioner_creations",
            "Creations the provisioner started, by outcome: created and recorded; adopted (an orphan recorded); taken by another client first; deferred (not claimable now, tried again later); refused (skipped for a while); unrecorded (made at the provider, not recorded in the BMDB: a later pass adopts it); fenced (the lease ended mid-creation); failed",
            &self.creations,
            CREATION_OUTCOMES.map(|outcome| CreationLabels { outcome }),
        );
    }

    /// Creations so far that ended with `outcome` (one of those the metric's help names).
    pub fn creations(&self, outcome: &'static str) -> u64 {
        self.creations
            .get_or_create(&CreationLabels { outcome })
            .get()
    }

    fn count(&self, result: &Result<shepherd_provider::Recorded, ProviderError>) {
        let outcome = match result {
            Ok(r) if r.adopted => "adopted",
            Ok(_) => "created",
            Err(ProviderError::Taken(_)) => "taken",
            Err(ProviderError::NotYet(_)) => "deferred",
            Err(ProviderError::Refused { .. }) => "refused",
            Err(ProviderError::Record(_)) => "unrecorded",
            Err(ProviderError::LeaseLost(_)) => "fenced",
            Err(_) => "failed",
        };
        self.creations
            .get_or_create(&CreationLabels { outcome })
            .inc();
    }
}

/// The provisioner for one provider.
pub struct Provisioner<P: Provider> {
    provider: Arc<P>,
    config: ProvisionerConfig,
    creation: Limiter,
    metrics: ProvisionerMetrics,
}

impl<P: Provider> Provisioner<P> {
    /// A provisioner; nothing runs until [`Provisioner::run`] or [`Provisioner::iterate`].
    pub fn new(provider: Arc<P>, config: ProvisionerConfig) -> Self {
        Provisioner {
            provider,
            creation: Limiter::new(config.creation_rate),
            config,
            metrics: ProvisionerMetrics::default(),
        }
    }

    /// The provisioner, counting its creations into `metrics`.
    pub fn with_metrics(self, metrics: ProvisionerMetrics) -> Self {
        Provisioner { metrics, ..self }
    }

    /// One reconciliation (design.md §7 steps 1–5). A discrepancy between the provider and the
    /// BMDB is an error and nothing is created.
    pub async fn iterate(&self, session: &Session) -> Result<IterationReport, ProvisionerError> {
        let (listed, recorded) = listed_and_recorded(&*self.provider, session).await?;
        let in_bmdb: BTreeSet<String> = recorded.into_iter().map(|(_, p)| p.provider_id).collect();
        // A decommissioned machine is neither ours nor a candidate: the operator took it out
        // and only a recommission brings it back.
        let kind = self.provider.kind();
        let (barred, skips) = session
            .read(move |tx| {
                Box::pin(async move {
                    let barred = tx.decommissioned_ids(kind).await?;
                    Ok((barred, tx.skipped_provider_ids(kind).await?))
                })
            })
            .await
            .map_err(ProvisionerError::Bmdb)?;
        let barred: BTreeMap<String, bool> = barred.into_iter().collect();
        let skipped: BTreeSet<String> = skips.into_iter().map(|s| s.provider_id).collect();
        // Unused capacity whose reservation names a barred id is barred too: an Ironic node
        // handed back is listed as unused under its own id.
        let key =
            |m: &ProviderMachine| m.valid_id().or(m.reservation.as_deref()).map(str::to_owned);
        let (decommissioned, listed): (Vec<_>, Vec<_>) = listed
            .into_iter()
            .partition(|m| key(m).is_some_and(|id| barred.contains_key(&id)));
        // A machine the provider refused lately is no candidate until its skip ends; one the
        // BMDB records is ours whatever a skip says.
        let (skipped, listed): (Vec<_>, Vec<_>) = listed.into_iter().partition(|m| {
            m.availability != Availability::KnownUsed
                && key(m).is_some_and(|id| skipped.contains(&id) && !in_bmdb.contains(&id))
        });
        let plan = reconcile(&listed, &in_bmdb, self.config.limits)?;
        let mut report = IterationReport {
            managed: plan.managed,
            decommissioned: decommissioned.len(),
            missing: plan.missing.len(),
            skipped: skipped.len(),
            ..Default::default()
        };
        if !plan.missing.is_empty() {
            tracing::warn!(
                missing = plan.missing.len(),
                examples = %crate::bounded::first_few(&plan.missing),
                "machines the BMDB records are gone from the provider; provisioning the others goes on (the updater marks them Missing; `shepherd machines decommission ID` retires them)"
            );
        }
        self.hand_back(session, &decommissioned, &barred, &mut report)
            .await?;
        self.create(session, &plan.create, &in_bmdb, &mut report)
            .await?;
        Ok(report)
    }

    /// Hands the machines an operator decommissioned back to the provider (torn down where
    /// `barred` says so), each only while the session's lease holds.
    async fn hand_back(
        &self,
        session: &Session,
        decommissioned: &[ProviderMachine],
        barred: &BTreeMap<String, bool>,
        report: &mut IterationReport,
    ) -> Result<(), ProvisionerError> {
        for machine in decommissioned
            .iter()
            .filter(|m| m.availability != Availability::KnownUnused)
        {
            let Some(id) = machine.valid_id() else {
                continue;
            };
            let undeploy = barred.get(id).copied().unwrap_or(false);
            match self
                .provider
                .hand_back(&session.lease(), machine, undeploy)
                .await
            {
                Ok(HandBack::Kept) => {}
                Ok(HandBack::Released) => {
                    tracing::info!(
                        provider_id = id,
                        undeploy,
                        "handed a decommissioned machine back to the provider"
                    );
                    report.handed_back += 1;
                }
                Ok(HandBack::InProgress) => {
                    tracing::debug!(
                        provider_id = id,
                        undeploy,
                        "a decommissioned machine is still being handed back"
                    );
                }
                // Nothing more is handed back by a replica whose session ended.
                Err(ProviderError::LeaseLost(lost)) => {
                    return Err(ProvisionerError::LeaseLost(lost));
                }
                Err(e) => {
                    tracing::warn!(provider_id = id, undeploy, error = %e, "handing a decommissioned machine back failed; trying again next pass");
                    report.failed += 1;
                }
            }
        }
        Ok(())
    }

    /// Creates `machines` at the provider, paced, up to `creation_parallelism` at a time, each
    /// started only while the session's lease holds; starts no more after a failure that the
    /// next machine would meet too (the provider or the BMDB unavailable, the lease gone), but
    /// lets those in flight finish: a creation cut off halfway is an orphan to adopt later.
    async fn create(
        &self,
        session: &Session,
        machines: &[ProviderMachine],
        in_bmdb: &BTreeSet<String>,
        report: &mut IterationReport,
    ) -> Result<(), ProvisionerError> {
        let parallelism = self.config.creation_parallelism.max(1);
        let mut pending = machines.iter();
        let mut in_flight = futures::stream::FuturesUnordered::new();
        let mut stopped = None;
        loop {
            while stopped.is_none() && in_flight.len() < parallelism {
                let Some(machine) = pending.next() else {
                    break;
                };
                self.creation.wait().await;
                // A creation started under a lease that ended would be another replica's.
                if let Err(lost) = session.lease().left() {
                    stopped = Some(ProvisionerError::LeaseLost(lost));
                    break;
                }
                match self.recorded_since_listed(session, machine, in_bmdb).await {
                    Ok(false) => {}
                    Ok(true) => {
                        let taken = ProviderError::Taken(
                            "another replica recorded it since the listing".into(),
                        );
                        self.created(session, machine, Err(taken), report).await?;
                        continue;
                    }
                    Err(e) => {
                        stopped = Some(ProvisionerError::Bmdb(e));
                        break;
                    }
                }
                in_flight.push(async move {
                    let result = self.provider.create_machine(session, machine).await;
                    (machine, result)
                });
            }
            let Some((machine, result)) = futures::StreamExt::next(&mut in_flight).await else {
                break;
            };
            if let Err(stop) = self.created(session, machine, result, report).await {
                stopped.get_or_insert(stop);
            }
        }
        stopped.map_or(Ok(()), Err)
    }

    /// Whether the BMDB has recorded `machine` (by the id it will have once created) since
    /// the pass read `in_bmdb`: another replica created it meanwhile. A pass works through a
    /// listing that grows stale while it creates; this one indexed read per candidate spares
    /// the provider a creation that would only conflict. An id recorded before (an Ironic
    /// node undeployed and available again, to be claimed anew) is no reason to pass over.
    async fn recorded_since_listed(
        &self,
        session: &Session,
        machine: &ProviderMachine,
        in_bmdb: &BTreeSet<String>,
    ) -> Result<bool, shepherd_bmdb::Error> {
        let Some(id) = self.provider.id_once_created(machine).map(str::to_owned) else {
            return Ok(false);
        };
        if in_bmdb.contains(&id) {
            return Ok(false);
        }
        let kind = self.provider.kind();
        let recorded = session
            .read(move |tx| {
                let id = id.clone();
                Box::pin(async move { tx.machine_by_provider_id(kind, &id).await })
            })
            .await?;
        Ok(recorded.is_some())
    }

    /// Counts one creation's `result` in `report` (a refusal recorded as a skip in the BMDB);
    /// an error if no further creation should start.
    async fn created(
        &self,
        session: &Session,
        machine: &ProviderMachine,
        result: Result<shepherd_provider::Recorded, ProviderError>,
        report: &mut IterationReport,
    ) -> Result<(), ProvisionerError> {
        self.metrics.count(&result);
        match result {
            Ok(r) if r.adopted => {
                tracing::debug!(machine = %r.machine, provider_id = ?machine.id, "adopted a machine already recorded");
                report.adopted += 1;
            }
            Ok(r) => {
                tracing::info!(machine = %r.machine, provider_id = ?machine.id, "brought a new machine in");
                report.created += 1;
            }
            Err(ProviderError::LeaseLost(lost)) => {
                report.failed += 1;
                return Err(ProvisionerError::LeaseLost(lost));
            }
            Err(ProviderError::Taken(what)) => {
                tracing::debug!(%what, "another client took an unused machine first; skipping it");
                report.taken += 1;
            }
            Err(ProviderError::NotYet(why)) => {
                tracing::debug!(%why, "an unused machine cannot be claimed now; a later pass tries again");
                report.deferred += 1;
            }
            Err(ProviderError::Refused {
                provider_id,
                skip_for,
                error,
            }) => {
                tracing::warn!(provider_id, ?skip_for, %error, "the provider refused to create a machine; every replica skips it for a while");
                report.refused += 1;
                self.skip(session, &provider_id, skip_for, &error.to_string())
                    .await?;
            }
            Err(e) if e.is_unavailable() => {
                report.failed += 1;
                return Err(ProvisionerError::ProviderUnavailable {
                    created: report.created,
                    error: e,
                });
            }
            Err(e) if e.is_bmdb_failure() => {
                // Every further creation would be one more machine the BMDB cannot record:
                // stop here. The one just created is adopted by a later pass.
                report.failed += 1;
                return Err(ProvisionerError::BmdbFailed {
                    created: report.created,
                    error: e,
                });
            }
            Err(e) => {
                tracing::warn!(provider_id = ?machine.id, addr = ?machine.addr, error = %e, "creating a machine failed; skipping it");
                report.failed += 1;
            }
        }
        Ok(())
    }

    /// Records in the BMDB that `provider_id` is skipped for `skip_for` because of `cause`.
    async fn skip(
        &self,
        session: &Session,
        provider_id: &str,
        skip_for: Duration,
        cause: &str,
    ) -> Result<(), ProvisionerError> {
        let kind = self.provider.kind();
        let until = chrono::Utc::now()
            + chrono::TimeDelta::from_std(skip_for)
                .unwrap_or_else(|_| chrono::TimeDelta::weeks(52));
        session
            .transact(|tx| {
                let (id, cause) = (provider_id.to_string(), cause.to_string());
                Box::pin(async move { tx.skip_provider_id(kind, &id, until, &cause).await })
            })
            .await
            .map_err(ProvisionerError::Bmdb)
    }
}

impl std::fmt::Display for IterationReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} managed; {} created, {} adopted, {} failed, {} taken by others, {} deferred, {} refused, {} skipped; {} decommissioned, {} handed back; {} missing",
            self.managed,
            self.created,
            self.adopted,
            self.failed,
            self.taken,
            self.deferred,
            self.refused,
            self.skipped,
            self.decommissioned,
            self.handed_back,
            self.missing
        )
    }
}

#[async_trait]
impl<P: Provider> Pass for Provisioner<P> {
    const PROCESSOR: Processor = Processor::ShepherdProvisioner;
    type Report = IterationReport;
    type Error = ProvisionerError;

    fn rate(&self) -> RateSpec {
        self.config.reconcile_rate
    }

    async fn pass(&self, session: &Session) -> Result<IterationReport, ProvisionerError> {
        let r = self.iterate(session).await?;
        if r.adopted > 0 {
            tracing::info!(
                adopted = r.adopted,
                "adopted machines another replica had just recorded"
            );
        }
        tracing::debug!(report = %r, "reconciled");
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unavailable_bmdb_is_told_apart_from_a_failed_pass() {
        let expired = ProvisionerError::List(ListError::Bmdb(shepherd_bmdb::Error::SessionExpired));
        assert!(expired.bmdb_unavailable());
        let stopped = ProvisionerError::BmdbFailed {
            created: 3,
            error: ProviderError::NotSupported("x"),
        };
        assert!(stopped.bmdb_unavailable());
        let unknown = shepherd_bmdb::Error::UnknownName {
            kind: "Provider",
            name: "x".into(),
            known: String::new(),
        };
        assert!(!ProvisionerError::Bmdb(unknown).bmdb_unavailable());
        let disagree = ProvisionerError::Reconcile(ReconcileError::Discrepancy(vec![]));
        assert!(!disagree.bmdb_unavailable());
        let provider = ProvisionerError::List(ListError::Provider(ProviderError::Incomplete("x")));
        assert!(!provider.bmdb_unavailable());
    }
}
