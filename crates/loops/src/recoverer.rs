//! The Recoverer (SPEC §9): reboots machines whose agent never heartbeated or went silent,
//! then clears the agent tags so the Initializer takes them over again.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use async_trait::async_trait;
use shepherd_bmdb::{Backoff, Process, Processor, RecoveryThresholds, Retrieval, Session};
use uuid::Uuid;

use crate::brake::Brake;
use crate::provider::Recoverer as RecovererProvider;
use crate::runner::{Commit, MachineTask};

/// The recoverer for one provider.
pub struct Recoverer<P: RecovererProvider> {
    provider: Arc<P>,
    thresholds: RecoveryThresholds,
    backoff: Backoff,
    brake: Option<Arc<Brake>>,
}

impl<P: RecovererProvider> Recoverer<P> {
    /// A recoverer with upstream's backoff (1 min to 1 h, ×1.2).
    pub fn new(provider: Arc<P>, thresholds: RecoveryThresholds) -> Self {
        Recoverer {
            provider,
            thresholds,
            backoff: Backoff::exponential(Duration::from_secs(60), Duration::from_secs(3600), 1.2),
            brake: None,
        }
    }

    /// The same recoverer, stopped while `brake` is engaged.
    pub fn with_brake(self, brake: Arc<Brake>) -> Self {
        Recoverer {
            brake: Some(brake),
            ..self
        }
    }

    /// The same recoverer with another backoff.
    pub fn with_backoff(self, backoff: Backoff) -> Self {
        Recoverer { backoff, ..self }
    }
}

#[async_trait]
impl<P: RecovererProvider + 'static> MachineTask for Recoverer<P> {
    fn process(&self) -> Process {
        Process::ShepherdRecovery
    }

    fn processor(&self) -> Processor {
        Processor::ShepherdRecoverer
    }

    fn retrieval(&self) -> Retrieval {
        Retrieval::AgentRecovery {
            provider: self.provider.kind(),
            thresholds: self.thresholds,
        }
    }

    fn backoff(&self) -> Backoff {
        self.backoff
    }

    async fn active(&self) -> bool {
        !self.brake.as_ref().is_some_and(|b| b.engaged()) && self.provider.can_reboot().await
    }

    async fn process_machine(&self, session: &Session, machine: Uuid) -> anyhow::Result<Commit> {
        let provided = session
            .transact(move |tx| Box::pin(async move { tx.provided(machine).await }))
            .await?
            .context("machine has no provided tag")?;
        tracing::Span::current().record("provider_id", provided.provider_id.as_str());
        let at_provider = self
            .provider
            .get_machine(&provided.provider_id)
            .await
            .with_context(|| format!("looking up {} at the provider", provided.provider_id))?;
        self.provider
            .reboot(&at_provider)
            .await
            .context("rebooting")?;
        tracing::info!(%machine, provider_id = %provided.provider_id, "rebooted a machine whose agent went silent");
        Ok(Box::new(move |tx| {
            Box::pin(async move {
                tx.delete_agent_started(machine).await?;
                tx.delete_heartbeat(machine).await?;
                Ok(())
            })
        }))
    }
}
