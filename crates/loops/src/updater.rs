//! The updater (design.md §14, for every provider): at a configured rate, one provider listing is
//! compared with the `machine_provided` tags of that provider, and address, location, status and
//! reservation are brought up to date; a machine the provider no longer lists becomes
//! `Missing` (unless most of the fleet vanished at once, which looks like partial data and is
//! refused). Idempotent, so several replicas may run it.

use std::collections::HashMap;
use std::sync::Arc;

use async_trait::async_trait;
use shepherd_bmdb::{Processor, Provided, ProviderStatus, Session};
use uuid::Uuid;

use crate::limiter::RateSpec;
use crate::periodic::{Pass, PassError};
use shepherd_provider::{listed_and_recorded, ListError, Provider, ProviderMachine};

/// Tags written per transaction.
const BATCH: usize = 500;

/// Provider ids a log line names at most; the rest are counted.
const LOGGED_EXAMPLES: usize = 5;

/// Why an update pass failed.
#[derive(Debug, thiserror::Error)]
pub enum UpdaterError {
    /// The provider or the BMDB could not be read.
    #[error(transparent)]
    List(#[from] ListError),
    /// Writing the refreshed tags failed.
    #[error("writing the refreshed facts: {0}")]
    Bmdb(shepherd_bmdb::Error),
    /// Most of the provider's machines vanished from its listing at once: more likely partial
    /// data than a mass deletion, so nothing is marked Missing.
    #[error("the provider no longer lists {vanishing} of {total} machines; refusing to mark them Missing (partial provider data?)")]
    MostVanished {
        /// Machines the listing lost.
        vanishing: usize,
        /// Machines the BMDB records for the provider.
        total: usize,
    },
}

impl PassError for UpdaterError {
    fn bmdb_unavailable(&self) -> bool {
        match self {
            UpdaterError::List(e) => e.is_bmdb_unavailable(),
            UpdaterError::Bmdb(e) => e.is_transient(),
            UpdaterError::MostVanished { .. } => false,
        }
    }
}

/// What one update pass did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct UpdateReport {
    /// Tags rewritten with the provider's newer facts.
    pub updated: usize,
    /// Machines newly marked `Missing`.
    pub missing: usize,
    /// Tags already up to date.
    pub unchanged: usize,
}

/// The tag `current` should become given what the provider lists (`None`: not listed).
pub fn refreshed(current: &Provided, listed: Option<&ProviderMachine>) -> Provided {
    let mut next = current.clone();
    match listed {
        None => next.status = Some(ProviderStatus::Missing),
        Some(m) => {
            next.ip_address = m.addr.clone().filter(|a| !a.is_empty());
            if m.location.is_some() {
                next.location = m.location.clone();
            }
            next.status = m.status.or(if m.failed {
                Some(ProviderStatus::ProvisioningFailedPermanent)
            } else {
                current.status.filter(|s| *s != ProviderStatus::Missing)
            });
            if m.reservation.is_some() {
                next.reservation_id = m.reservation.clone();
            }
            if !m.facts.is_empty() {
                next.facts = m.facts.clone();
            }
        }
    }
    next
}

/// The updater for one provider.
pub struct Updater<P: Provider + ?Sized> {
    provider: Arc<P>,
    rate: RateSpec,
}

impl<P: Provider + ?Sized> Updater<P> {
    /// An updater passing at `rate` (e.g. `5m,1`).
    pub fn new(provider: Arc<P>, rate: RateSpec) -> Self {
        Updater { provider, rate }
    }

    /// One pass.
    pub async fn iterate(&self, session: &Session) -> Result<UpdateReport, UpdaterError> {
        let (listed, recorded) = listed_and_recorded(&*self.provider, session).await?;
        let by_id: HashMap<&str, &ProviderMachine> = listed
            .iter()
            .filter_map(|m| m.valid_id().map(|id| (id, m)))
            .collect();
        let mut report = UpdateReport::default();
        let mut changes: Vec<(Uuid, Provided, bool)> = Vec::new();
        for (id, current) in recorded {
            let next = refreshed(&current, by_id.get(current.provider_id.as_str()).copied());
            if next == current {
                report.unchanged += 1;
            } else {
                let newly_missing = next.status == Some(ProviderStatus::Missing)
                    && current.status != Some(ProviderStatus::Missing);
                changes.push((id, next, newly_missing));
            }
        }
        // A listing that lost most of our machines at once is more likely partial data from
        // the provider than a mass deletion: refuse rather than mark the fleet Missing.
        let vanishing = changes.iter().filter(|(_, _, m)| *m).count();
        let total = report.unchanged + changes.len();
        if vanishing > 1 && vanishing * 2 > total {
            return Err(UpdaterError::MostVanished { vanishing, total });
        }
        let mut missing_examples = Vec::new();
        for batch in changes.chunks(BATCH) {
            let batch = batch.to_vec();
            let writes = batch.clone();
            session
                .transact(move |tx| {
                    let batch = writes.clone();
                    Box::pin(async move {
                        for (id, tag, _) in &batch {
                            tx.set_provided(*id, tag).await?;
                        }
                        Ok(())
                    })
                })
                .await
                .map_err(UpdaterError::Bmdb)?;
            for (_, tag, newly_missing) in batch {
                if newly_missing {
                    if missing_examples.len() < LOGGED_EXAMPLES {
                        missing_examples.push(tag.provider_id);
                    }
                    report.missing += 1;
                } else {
                    report.updated += 1;
                }
            }
        }
        if report.missing > 0 {
            tracing::warn!(
                count = report.missing,
                examples = ?missing_examples,
                "the provider no longer lists these machines; marked Missing"
            );
        }
        Ok(report)
    }
}

impl std::fmt::Display for UpdateReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} updated, {} newly missing, {} unchanged",
            self.updated, self.missing, self.unchanged
        )
    }
}

#[async_trait]
impl<P: Provider + ?Sized> Pass for Updater<P> {
    const PROCESSOR: Processor = Processor::ShepherdUpdater;
    type Report = UpdateReport;
    type Error = UpdaterError;

    fn rate(&self) -> RateSpec {
        self.rate
    }

    async fn pass(&self, session: &Session) -> Result<UpdateReport, UpdaterError> {
        let r = self.iterate(session).await?;
        tracing::debug!(report = %r, "provider facts updated");
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shepherd_bmdb::ProviderKind;
    use shepherd_provider::Availability;

    fn tag() -> Provided {
        let mut p = Provided::new(ProviderKind::Equinix, "d1");
        p.ip_address = Some("1.1.1.1".into());
        p.location = Some("da".into());
        p.status = Some(ProviderStatus::Running);
        p
    }

    #[test]
    fn unlisted_machines_become_missing_and_listed_ones_follow_the_provider() {
        assert_eq!(
            refreshed(&tag(), None).status,
            Some(ProviderStatus::Missing)
        );
        let mut m = ProviderMachine::new("d1", Some("2.2.2.2".into()), Availability::KnownUsed);
        m.status = Some(ProviderStatus::Stopped);
        m.reservation = Some("r1".into());
        let next = refreshed(&tag(), Some(&m));
        assert_eq!(next.ip_address.as_deref(), Some("2.2.2.2"));
        assert_eq!(next.location.as_deref(), Some("da"), "kept when not listed");
        assert_eq!(next.status, Some(ProviderStatus::Stopped));
        assert_eq!(next.reservation_id.as_deref(), Some("r1"));
        // A machine that comes back is no longer Missing.
        let mut missing = tag();
        missing.status = Some(ProviderStatus::Missing);
        let back = ProviderMachine::new("d1", Some("1.1.1.1".into()), Availability::KnownUsed);
        assert_eq!(refreshed(&missing, Some(&back)).status, None);
        let mut failed = back.clone();
        failed.failed = true;
        assert_eq!(
            refreshed(&tag(), Some(&failed)).status,
            Some(ProviderStatus::ProvisioningFailedPermanent)
        );
        assert_eq!(refreshed(&tag(), Some(&back)), {
            let mut t = tag();
            t.status = Some(ProviderStatus::Running);
            t
        });
    }

    #[test]
    fn hardware_facts_follow_the_provider_when_it_states_them() {
        let mut stated = tag();
        stated.facts.insert("cpus", "4");
        let mut m = ProviderMachine::new("d1", Some("1.1.1.1".into()), Availability::KnownUsed);
        assert_eq!(
            refreshed(&stated, Some(&m)).facts,
            stated.facts,
            "kept when the listing states none"
        );
        m.facts.insert("cpus", "8");
        m.facts.insert("memory_mb", "16384");
        assert_eq!(refreshed(&stated, Some(&m)).facts, m.facts);
        assert_eq!(
            refreshed(&stated, None).facts,
            stated.facts,
            "kept when gone"
        );
    }
}
