//! Where machines come from and how they are power-cycled (SPEC §6).

use async_trait::async_trait;
use shepherd_bmdb::{Provided, Provider as ProviderKind, ProviderStatus, Session};
use uuid::Uuid;

/// Whether a machine the provider lists is ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Availability {
    /// Deployed and ours.
    KnownUsed,
    /// Free capacity (e.g. a hardware reservation); may lack an id and an address.
    KnownUnused,
    /// A stateless provider (a static list) cannot tell; the BMDB decides.
    PossiblyUsed,
}

/// A machine as the provider sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderMachine {
    /// The provider's id; `None` while the machine has none yet (unused capacity).
    pub id: Option<String>,
    /// Address reachable over SSH, if known.
    pub addr: Option<String>,
    /// Whether it is ours.
    pub availability: Availability,
    /// The provider says the machine is broken; reconciliation ignores it.
    pub failed: bool,
    /// Where it is, if the provider says.
    pub location: Option<String>,
    /// The provider's view of its state.
    pub status: Option<ProviderStatus>,
    /// The reservation it was (or is to be) created from, for providers that have them.
    pub reservation: Option<String>,
}

impl ProviderMachine {
    /// A usable machine with an id and an address.
    pub fn new(id: impl Into<String>, addr: Option<String>, availability: Availability) -> Self {
        ProviderMachine {
            id: Some(id.into()),
            addr,
            availability,
            failed: false,
            location: None,
            status: None,
            reservation: None,
        }
    }

    /// The id if it is a valid provider id (non-empty, bounded as the BMDB requires).
    pub fn valid_id(&self) -> Option<&str> {
        self.id
            .as_deref()
            .filter(|id| !id.is_empty() && id.len() <= shepherd_bmdb::MAX_PROVIDER_ID_LEN)
    }
}

/// Errors from a provider.
#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// The provider does not know this machine.
    #[error("machine {0:?} not found at the provider")]
    NotFound(String),
    /// The provider cannot do this.
    #[error("not supported by this provider: {0}")]
    NotSupported(&'static str),
    /// Anything else (API errors, timeouts, bad data).
    #[error(transparent)]
    Other(#[from] anyhow::Error),
}

/// A source of machines. Providers are not called concurrently.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Which provider this is, as recorded in `machine_provided`.
    fn kind(&self) -> ProviderKind;

    /// Every machine the provider knows about.
    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError>;

    /// One machine by provider id; [`ProviderError::NotFound`] if it does not exist.
    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError>;

    /// Turns unused capacity into a machine of ours: creates it at the provider and records it
    /// in the BMDB (see [`record_new_machine`]) in one session transaction.
    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Uuid, ProviderError>;
}

/// A provider that can also power-cycle machines (used by the Recoverer).
#[async_trait]
pub trait Recoverer: Provider {
    /// Reboots the machine and waits as long as the provider needs for that to take effect.
    async fn reboot(&self, machine: &ProviderMachine) -> Result<(), ProviderError>;

    /// Reinstalls the machine's OS, where the provider can.
    async fn reinstall(&self, _machine: &ProviderMachine) -> Result<(), ProviderError> {
        Err(ProviderError::NotSupported("reinstall"))
    }
}

/// Writes the `machines` row and `machine_provided` tag for a machine a provider just created,
/// in one session transaction, and returns the new machine id. If the provider id is already
/// recorded (a previous insert committed but its caller never heard), returns that machine
/// instead of failing, so a retried creation adopts rather than duplicates.
pub async fn record_new_machine(
    session: &Session,
    kind: ProviderKind,
    machine: &ProviderMachine,
) -> anyhow::Result<Uuid> {
    let id = machine
        .valid_id()
        .ok_or_else(|| anyhow::anyhow!("provider returned a machine without a valid id"))?
        .to_string();
    let provided = Provided {
        provider: kind,
        provider_id: id,
        reservation_id: machine.reservation.clone(),
        ip_address: machine.addr.clone(),
        location: machine.location.clone(),
        status: machine.status,
    };
    let machine_id = session
        .transact(move |tx| {
            let provided = provided.clone();
            Box::pin(async move {
                if let Some(existing) = tx
                    .machine_by_provider_id(provided.provider, &provided.provider_id)
                    .await?
                {
                    return Ok(existing);
                }
                let id = tx.create_machine().await?;
                tx.set_provided(id, &provided).await?;
                Ok(id)
            })
        })
        .await?;
    Ok(machine_id)
}
