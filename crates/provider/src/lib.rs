//! What Shepherd's loops reach the world through, below the loops so that a provider's author
//! depends on this crate and not on the runner: where machines come from and how they are
//! power-cycled (design.md §6) — the [`Provider`] trait and its typed errors, here at the root —
//! with the static, Redfish-backed provider; what every provider's client shares (the
//! retried, counted JSON client, the retry policy, call metrics, the penalty box); and the
//! [`transport::Transport`] that starts an agent on a machine.

pub mod bare;
pub mod bmc_tls;
pub mod causes;
pub mod http_body;
pub mod metrics;
pub mod penalty;
pub mod redfish;
pub mod retry;
pub mod retry_after;
pub mod settings;
pub mod static_inventory;
pub mod static_provider;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
pub mod virtual_media;

use std::time::Duration;

use async_trait::async_trait;
use shepherd_bmdb::{
    Lease, LeaseLost, Process, Provided, ProviderFacts, ProviderKind, ProviderStatus, Session,
};
use uuid::Uuid;

use crate::redfish::BmcError;
use crate::static_inventory::InventoryError;

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
    /// Why the provider says it is broken, in the provider's words (Ironic's `last_error`),
    /// when it says.
    pub cause: Option<String>,
    /// Where it is, if the provider says.
    pub location: Option<String>,
    /// The provider's view of its state.
    pub status: Option<ProviderStatus>,
    /// The reservation it was (or is to be) created from, for providers that have them.
    pub reservation: Option<String>,
    /// What the provider says about its hardware.
    pub facts: ProviderFacts,
}

impl ProviderMachine {
    /// A usable machine with an id and an address.
    pub fn new(id: impl Into<String>, addr: Option<String>, availability: Availability) -> Self {
        ProviderMachine {
            id: Some(id.into()),
            addr,
            availability,
            failed: false,
            cause: None,
            location: None,
            status: None,
            reservation: None,
            facts: ProviderFacts::default(),
        }
    }

    /// The id if it is a valid provider id (non-empty, bounded as the BMDB requires).
    pub fn valid_id(&self) -> Option<&str> {
        self.id
            .as_deref()
            .filter(|id| !id.is_empty() && id.len() <= shepherd_bmdb::MAX_PROVIDER_ID_LEN)
    }

    /// The valid id of a machine acted on (rebooted, looked up), or why there is none.
    pub fn required_id(&self) -> Result<&str, ProviderError> {
        self.valid_id()
            .ok_or(ProviderError::Incomplete("an id of the machine"))
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
    /// Another client of the provider, or another replica of this deployment, holds or is
    /// claiming the machine (Ironic answers a second reservation with 409): this attempt
    /// changed nothing, and the machine is no candidate now.
    #[error("taken by another client first: {0}")]
    Taken(String),
    /// The machine cannot be claimed now, for a reason that passes, and nothing is charged:
    /// the provider is busy with it (an Ironic conductor holds the node), a claim of ours
    /// failed and was cleaned up, or this attempt's answer was lost, so whether it made
    /// anything is not known yet. A later pass tries again, or adopts what was made.
    #[error("not claimable now: {0}")]
    NotYet(String),
    /// The provider's API failed or refused; the provider's own typed error.
    #[error(transparent)]
    Api(ApiFailure),
    /// The provider refused to make a machine of this id as it stands (Ironic answering a
    /// node's deploy with 400: a driver that does not validate, say): asking again soon would
    /// be refused alike, so the provisioner records a skip of `skip_for` in the BMDB, which
    /// every replica and a restarted one honour.
    #[error("{error}")]
    Refused {
        /// The provider id refused.
        provider_id: String,
        /// How long to leave it alone.
        skip_for: std::time::Duration,
        /// The provider's own typed error.
        error: ApiFailure,
    },
    /// The provider's API could not be reached or answered that it cannot serve now
    /// (connection refused, a timeout, 5xx, 429), after the client's retries; the provider's
    /// own typed error. No machine is at fault: loops stop and wait instead of charging it.
    #[error(transparent)]
    Unavailable(ApiFailure),
    /// The provider's answer lacks what Shepherd needs of it (an id, a reservation).
    #[error("the provider's answer lacks {0}")]
    Incomplete(&'static str),
    /// The static inventory could not be read.
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    /// The machine's BMC could not be used or did not power-cycle it.
    #[error(transparent)]
    Bmc(Box<BmcError>),
    /// The creating session's lease ended mid-creation: no further step was taken at the
    /// provider (another replica may own the work now); what was done is an orphan a later
    /// pass adopts.
    #[error(transparent)]
    LeaseLost(#[from] LeaseLost),
    /// The machine exists at the provider, but the BMDB did not record it.
    #[error(transparent)]
    Record(#[from] RecordError),
}

/// A provider's own typed error (Ironic's `ApiError`, Equinix's, the simulator's), carried
/// behind the trait as `std::io::Error` carries an OS or custom error: the loops decide by the
/// [`ProviderError`] variant it sits in, never by the provider's type, and code that knows the
/// provider gets its type back with [`ApiFailure::downcast_ref`]. It displays as, and has the
/// source of, the error it carries.
#[derive(Debug)]
pub struct ApiFailure(Box<dyn std::error::Error + Send + Sync>);

impl ApiFailure {
    /// Carries `error`, the provider's own.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        ApiFailure(Box::new(error))
    }

    /// The provider's error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref::<E>()
    }
}

impl std::fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for ApiFailure {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

/// A failure described by a sentence alone: test providers and injected faults.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Described(pub String);

impl From<&str> for ApiFailure {
    fn from(sentence: &str) -> Self {
        ApiFailure::new(Described(sentence.to_string()))
    }
}

impl From<BmcError> for ProviderError {
    fn from(e: BmcError) -> Self {
        ProviderError::Bmc(Box::new(e))
    }
}

impl ProviderError {
    /// Whether the failure is the BMDB's (unreachable, failing over, this process's session
    /// lost) rather than the provider's or one machine's: the provisioner then stops its pass,
    /// since every further machine it created would be one more the BMDB cannot record.
    pub fn is_bmdb_failure(&self) -> bool {
        matches!(self, ProviderError::Record(RecordError::Bmdb { error, .. }) if error.is_transient())
    }

    /// Whether the provider's API is unavailable (see [`ProviderError::Unavailable`]): the
    /// failure says nothing about the machine, and the next machine would fail alike.
    pub fn is_unavailable(&self) -> bool {
        matches!(self, ProviderError::Unavailable(_))
    }
}

/// Why a machine its provider created was not recorded in the BMDB. Until a later pass
/// adopts it (every provider lists the machines that are its own), the machine is an orphan.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The provider gave the machine no id the BMDB can hold.
    #[error("the provider returned a machine without a valid id")]
    NoValidId,
    /// An operator decommissioned this provider id; it is not brought back.
    #[error("provider id {0:?} was decommissioned by an operator")]
    Decommissioned(String),
    /// Another writer recorded the id first, and its machine is gone again.
    #[error("provider id {0:?} conflicted with a machine that is gone again")]
    Vanished(String),
    /// The BMDB failed.
    #[error("recording provider id {provider_id:?} in the BMDB failed (a later pass adopts it): {error}")]
    Bmdb {
        /// The machine's provider id.
        provider_id: String,
        /// What the BMDB said.
        error: shepherd_bmdb::Error,
    },
}

/// A machine could not be looked up at its provider.
#[derive(Debug, thiserror::Error)]
#[error("looking up {provider_id} at the provider: {error:#}")]
pub struct LookupFailed {
    /// The machine's provider id.
    pub provider_id: String,
    /// What the provider said.
    pub error: ProviderError,
}

/// Looks `provider_id` up at `provider`, naming it in the error.
pub async fn look_up<P: Provider + ?Sized>(
    provider: &P,
    provider_id: &str,
) -> Result<ProviderMachine, LookupFailed> {
    provider
        .get_machine(provider_id)
        .await
        .map_err(|error| LookupFailed {
            provider_id: provider_id.to_string(),
            error,
        })
}

/// A source of machines. Calls may overlap: the provisioner creates up to
/// `creation_parallelism` machines at once (each a different one), while the machine loops
/// look machines up and reboot them.
#[async_trait]
pub trait Provider: Send + Sync {
    /// Which provider this is, as recorded in `machine_provided`.
    fn kind(&self) -> ProviderKind;

    /// Every machine the provider knows about.
    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError>;

    /// One machine by provider id; [`ProviderError::NotFound`] if it does not exist.
    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError>;

    /// The provider id `unused` will have once it is created, where the provider knows it
    /// beforehand (an Ironic node keeps its own id); `None` (the default) where creating makes
    /// a new id. The provisioner skips, without asking the provider, a candidate whose id the
    /// BMDB has recorded since the listing (another replica created it meanwhile).
    fn id_once_created<'m>(&self, _unused: &'m ProviderMachine) -> Option<&'m str> {
        None
    }

    /// Turns unused capacity into a machine of ours: creates it at the provider and records it
    /// in the BMDB (see [`record_new_machine`]) in one session transaction.
    async fn create_machine(
        &self,
        session: &Session,
        unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError>;

    /// Hands a machine an operator decommissioned back to the provider, tearing it down first
    /// when `undeploy`. The provisioner calls it, on every pass, for each listed machine of
    /// ours whose provider id is decommissioned; it must be idempotent, and a machine handed
    /// back must stop being listed as ours. Each request at the provider starts only while
    /// `lease` holds ([`Lease::may_start`]): a replica whose session ended tears nothing down.
    /// Providers without such a notion keep the machine as it is (the default).
    async fn hand_back(
        &self,
        _lease: &Lease,
        _machine: &ProviderMachine,
        _undeploy: bool,
    ) -> Result<HandBack, ProviderError> {
        Ok(HandBack::Kept)
    }
}

/// What [`Provider::hand_back`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandBack {
    /// Nothing: the provider keeps the machine as it is.
    Kept,
    /// The machine was released (and torn down, if asked).
    Released,
    /// A step was requested; the next pass finishes it (Ironic: a node still tearing down).
    InProgress,
}

/// A provider that can also power-cycle machines (used by the Recoverer).
#[async_trait]
pub trait Rebooter: Provider {
    /// Reboots the machine, its power action started only while `lease` holds
    /// ([`Lease::may_start`], step `reset`; the recoverer also races the whole call against
    /// the lease). Returns once the provider has done so; it does not wait for the machine to
    /// come back (see [`Rebooter::reboot_wait`]).
    async fn reboot(&self, lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError>;

    /// How long a rebooted machine is given to go down and come back before the initializer
    /// tries to take it over again. The recoverer records this as a wait in the BMDB rather
    /// than sleeping, so no worker or lock is held meanwhile.
    fn reboot_wait(&self) -> Duration {
        Duration::ZERO
    }

    /// Whether any machine can be rebooted now; while not, the recoverer claims nothing (a
    /// static inventory that names no BMC, for example).
    async fn can_reboot(&self) -> bool {
        true
    }

    /// For a machine that came bare (design.md §21): what goes onto it and a client of the BMC
    /// that boots it. Providers without bare machines refuse ([`ProviderError::NotSupported`],
    /// the default).
    async fn bare_plan(&self, _machine: &ProviderMachine) -> Result<BarePlan, ProviderError> {
        Err(ProviderError::NotSupported("bare machines"))
    }
}

/// What [`Rebooter::bare_plan`] gives the bare-metal loop for one machine.
#[derive(Debug)]
pub struct BarePlan {
    /// A client of its BMC.
    pub bmc: redfish::Bmc,
    /// What its inventory entry says of the image, the disk and the network.
    pub entry: bare::BareEntry,
}

/// A machine written into the BMDB by [`record_new_machine`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorded {
    /// The BMDB machine id.
    pub machine: Uuid,
    /// The provider id was already recorded (by another replica, or by an earlier attempt
    /// whose caller never heard): nothing was written and that machine was adopted.
    pub adopted: bool,
}

/// Why the two views of a provider could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ListError {
    /// The BMDB could not be read.
    #[error("reading the machines the BMDB records: {0}")]
    Bmdb(shepherd_bmdb::Error),
    /// The provider could not list its machines.
    #[error("listing the provider's machines: {0}")]
    Provider(ProviderError),
}

impl ListError {
    /// Whether the BMDB, not the provider, failed, and only for now.
    pub fn is_bmdb_unavailable(&self) -> bool {
        matches!(self, ListError::Bmdb(e) if e.is_transient())
    }
}

/// Both views of one provider: what the BMDB records as provided by it, then what it lists
/// now. The provisioner and the updater each start from these.
///
/// The BMDB is read first, and the provider listed after: every machine recorded by then was
/// created at the provider before, so the listing shows it, while a machine another replica
/// creates in between is only listed (ours, unknown to the BMDB: adopted). Read at the same
/// time, a machine another replica recorded between the listing and the read looked missing
/// at the provider, and the pass refused to act on the disagreement.
pub async fn listed_and_recorded<P: Provider + ?Sized>(
    provider: &P,
    session: &Session,
) -> Result<(Vec<ProviderMachine>, Vec<(Uuid, Provided)>), ListError> {
    let kind = provider.kind();
    let recorded = session
        .read(move |tx| Box::pin(async move { tx.provided_by(kind).await }))
        .await
        .map_err(ListError::Bmdb)?;
    let listed = provider
        .list_machines()
        .await
        .map_err(ListError::Provider)?;
    Ok((listed, recorded))
}

/// Writes the `machines` row and `machine_provided` tag for a machine a provider just created,
/// in one session transaction. If the provider id is already recorded, adopts that machine
/// instead of failing, so a retried creation or two replicas racing over one inventory never
/// duplicate a machine — unless the machine carries a reservation and the recorded one another:
/// then the provider id came back under a new claim, and the old machine is removed (its locks
/// ended as Canceled with the cause, its history kept) before the new one is recorded. The race (both saw no row, both inserted) ends in the loser's unique
/// violation, which is answered by reading the winner's row.
pub async fn record_new_machine(
    session: &Session,
    kind: ProviderKind,
    machine: &ProviderMachine,
) -> Result<Recorded, RecordError> {
    record_machine(session, kind, machine, &Recording::default()).await
}

/// How [`record_machine`] records a new machine besides its provided tag.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recording {
    /// The initializer waits this long before its first takeover attempt (the provider is
    /// deploying the machine); zero: no wait.
    pub deploy_wait: Duration,
    /// The machine comes bare (design.md §21): it is recorded at the start of its bare-metal way,
    /// with this in its history.
    pub bare: Option<String>,
}

/// What the recording transaction found.
enum Insert {
    Recorded(Recorded),
    Decommissioned,
}

/// [`record_new_machine`] for a machine its provider is still deploying: in the same
/// transaction, the initializer is told to wait `deploy_wait` before its first takeover attempt
/// (a backoff that is no failure, as the recoverer's reboot wait), so that nobody waits for the
/// deploy and the takeover does not fail while it runs. An adopted machine keeps its backoffs.
pub async fn record_deploying_machine(
    session: &Session,
    kind: ProviderKind,
    machine: &ProviderMachine,
    deploy_wait: Duration,
) -> Result<Recorded, RecordError> {
    let recording = Recording {
        deploy_wait,
        bare: None,
    };
    record_machine(session, kind, machine, &recording).await
}

/// [`record_new_machine`] as `recording` says: with a first wait of the initializer, or at the
/// start of a bare machine's way, in the same transaction. An adopted machine is left as it is.
pub async fn record_machine(
    session: &Session,
    kind: ProviderKind,
    machine: &ProviderMachine,
    recording: &Recording,
) -> Result<Recorded, RecordError> {
    let deploy_wait = recording.deploy_wait;
    let bare = recording.bare.clone();
    let session_id = session.id();
    let id = machine
        .valid_id()
        .ok_or(RecordError::NoValidId)?
        .to_string();
    let bmdb = |error| RecordError::Bmdb {
        provider_id: machine.id.clone().unwrap_or_default(),
        error,
    };
    let provided = Provided {
        provider: kind,
        provider_id: id,
        reservation_id: machine.reservation.clone(),
        ip_address: machine.addr.clone(),
        location: machine.location.clone(),
        status: machine.status,
        facts: machine.facts.clone(),
    };
    let inserted = session
        .transact({
            let provided = provided.clone();
            move |tx| {
                let (provided, bare) = (provided.clone(), bare.clone());
                Box::pin(async move {
                    if tx
                        .is_decommissioned(provided.provider, &provided.provider_id)
                        .await?
                    {
                        return Ok(Insert::Decommissioned);
                    }
                    if let Some(existing) = tx
                        .machine_by_provider_id(provided.provider, &provided.provider_id)
                        .await?
                    {
                        let recorded = tx.provided(existing).await?;
                        let former = provided.reservation_id.is_some()
                            && recorded.and_then(|p| p.reservation_id) != provided.reservation_id;
                        if !former {
                            return Ok(Insert::Recorded(Recorded {
                                machine: existing,
                                adopted: true,
                            }));
                        }
                        // The provider id came back under a new claim (an Ironic node undeployed
                        // and claimed again): the machine recorded for the old claim is gone for
                        // good, and this is a new machine.
                        let cause = format!(
                            "provider id {} was claimed again under reservation {}; this machine of its former claim is removed",
                            provided.provider_id,
                            provided.reservation_id.as_deref().unwrap_or_default()
                        );
                        tx.remove_machine(existing, &cause).await?;
                        tracing::warn!(machine = %existing, provider_id = provided.provider_id, "a provider id came back under a new claim: the machine of its former claim is removed, and a new one recorded");
                    }
                    let id = tx.create_machine().await?;
                    tx.set_provided(id, &provided).await?;
                    if let Some(detail) = &bare {
                        tx.record_bare(id, None, detail, Some(session_id)).await?;
                    }
                    if let Ok(wait) = chrono::TimeDelta::from_std(deploy_wait) {
                        if !wait.is_zero() {
                            let cause = format!(
                                "the provider is deploying this machine; first takeover attempt after {}",
                                humantime::format_duration(deploy_wait)
                            );
                            let at = tx.now().await? + wait;
                            tx.set_backoff(id, Process::ShepherdAgentStart, at, 0, &cause)
                                .await?;
                        }
                    }
                    Ok(Insert::Recorded(Recorded {
                        machine: id,
                        adopted: false,
                    }))
                })
            }
        })
        .await;
    match inserted {
        Ok(Insert::Recorded(r)) => Ok(r),
        Ok(Insert::Decommissioned) => Err(RecordError::Decommissioned(provided.provider_id)),
        Err(e) if e.is_unique_violation() => {
            let (kind, provider_id) = (provided.provider, provided.provider_id.clone());
            let existing = session
                .transact(move |tx| {
                    let provider_id = provider_id.clone();
                    Box::pin(async move { tx.machine_by_provider_id(kind, &provider_id).await })
                })
                .await
                .map_err(bmdb)?;
            let machine = existing.ok_or(RecordError::Vanished(provided.provider_id))?;
            Ok(Recorded {
                machine,
                adopted: true,
            })
        }
        Err(e) => Err(bmdb(e)),
    }
}
