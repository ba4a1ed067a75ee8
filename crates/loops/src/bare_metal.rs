//! The bare-metal loop (design.md §21): brings a machine that has nothing but a BMC from empty disks
//! to heartbeating from its installed OS, one step per phase of its `machine_bare_metal` tag:
//!
//! ```text
//! Bare ─► Inserting ─► StartingLive ─► LiveBoot ─► Installing ─► Ejecting ─► StartingDisk ─► DiskBoot ─► Done
//!  (grant)  (off, insert)  (boot CD, on)   (initializer)  (agent)    (eject, off)  (boot disk, on)  (initializer)
//! ```
//!
//! A phase is entered (a compare-and-set that also checks the work is still held) *before* the
//! BMC calls that finish it, and each of those calls looks first at what the BMC already did,
//! so that a replica that takes over from one that died mid-step neither inserts, powers on,
//! nor asks for an installation twice. Every BMC call is fenced by the work's lease. The waits
//! between (the live environment's takeover, the installation, the installed OS's first
//! heartbeat) hold no worker: the machine is claimed again when the wait ended or ran out
//! (`Retrieval::BareMetal`). A BMC that lacks what is needed fails the machine, said once; a
//! BMC that fails for the moment backs it off with its answer as the cause; the BMDB, the
//! provider or a lost lease release it without a verdict.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{
    live_proof_of, Backoff, BareMetal, BarePhase, BareTimeouts, ForgetSystem, Lease, LeaseLost,
    MediaGrant, OsInstallationReport, OsInstallationRequest, PhaseWrites, Process, Provided,
    Retrieval, Session, TagWrites, Tx,
};
use shepherd_disks::{DiskChoice, RootDeviceHints};
use shepherd_proto::bmaas as proto;
use shepherd_proto::Message;
/// The variable that carries each live boot's proof to its agent; never an operator's.
pub use shepherd_proto::LIVE_PROOF_VAR;
use shepherd_provider::bare::{
    config_drive, installed_config_drive, BootMode, ConfigTooLarge, LiveFacts,
};
use shepherd_provider::metrics::register_at_zero;
use shepherd_provider::redfish::{Bmc, BmcError};
use shepherd_provider::settings::InvalidSetting;
use shepherd_provider::virtual_media::BootTarget;
use shepherd_provider::{look_up, BarePlan, LookupFailed, ProviderError, Rebooter};
use uuid::Uuid;

use crate::install_report::{self, ReportedFailure};
use crate::runner::{MachineTask, OnError};

/// What the bare-metal loop needs besides its provider.
#[derive(Debug, Clone)]
pub struct BareSettings {
    /// The media server's base URL as BMCs reach it (`https://shepherd.example:8443`).
    pub media_url: url::Url,
    /// How long a live image URL may be fetched after it is handed out.
    pub media_ttl: Duration,
    /// When the waits run out.
    pub timeouts: BareTimeouts,
    /// Live boots a machine gets before it is given up on.
    pub live_boot_attempts: i32,
    /// The wait before the next live boot after one ran out, growing with the attempts; and
    /// the backoff after a BMC failed a step.
    pub backoff: Backoff,
    /// How long the initializer waits after a boot before its first takeover attempt.
    pub boot_wait: Duration,
    /// The SSH public keys the live environment lets in (Shepherd's), OpenSSH lines.
    pub public_keys: Vec<String>,
    /// The user Shepherd logs in to machines as (`--ssh-user`): when it is root, the
    /// installed OS's config drive asks cloud-init to let Shepherd's keys in as root.
    pub ssh_user: String,
    /// The agent's settings in the live environment (`SHEPHERD_AGENT_*`).
    pub agent_env: Vec<(String, String)>,
}

impl BareSettings {
    /// Settings for the media server at `media_url`, letting in `public_keys`: 2 h URLs,
    /// [`BareTimeouts::default`], three live boots, 1 min doubling to 30 min between them
    /// (±10 %), 30 s before the first takeover attempt after a boot, and logging in as root.
    pub fn new(media_url: url::Url, public_keys: Vec<String>) -> Self {
        BareSettings {
            media_url,
            media_ttl: Duration::from_secs(2 * 3600),
            timeouts: BareTimeouts::default(),
            live_boot_attempts: 3,
            backoff: Backoff::exponential(Duration::from_secs(60), Duration::from_secs(1800), 2.0)
                .with_jitter(0.1),
            boot_wait: Duration::from_secs(30),
            public_keys,
            ssh_user: "root".to_string(),
            agent_env: Vec::new(),
        }
    }

    /// The start-up checks; the message names the setting.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        let zero = "must be more than zero";
        let wrong = [
            (
                self.media_url.scheme() != "https",
                "bare-media-url",
                "must be https:// (BMCs fetch the live image over TLS)",
            ),
            (
                self.public_keys.is_empty(),
                "ssh-key",
                "bare machines need a key: its public half is what their live environment lets in",
            ),
            (
                self.live_boot_attempts < 1,
                "bare-live-boot-attempts",
                "must be at least 1",
            ),
            (self.media_ttl.is_zero(), "bare-media-ttl", zero),
            (
                self.timeouts.live_boot.is_zero(),
                "bare-live-boot-timeout",
                zero,
            ),
            (
                self.timeouts.install.is_zero(),
                "bare-install-timeout",
                zero,
            ),
            (
                self.timeouts.disk_boot.is_zero(),
                "bare-disk-boot-timeout",
                zero,
            ),
        ];
        match wrong.into_iter().find(|(is_wrong, _, _)| *is_wrong) {
            Some((_, setting, problem)) => Err(InvalidSetting::new(setting, problem)),
            None => Ok(()),
        }
    }

    /// The URL of `machine`'s live image with secret `token`.
    pub fn media_url_of(&self, machine: Uuid, token: &str) -> String {
        let base = self.media_url.as_str().trim_end_matches('/');
        format!("{base}/live/{machine}/{token}/live.iso")
    }

    /// The same URL with its secret left out, for the history and the logs.
    fn media_url_shown(&self, machine: Uuid) -> String {
        let base = self.media_url.as_str().trim_end_matches('/');
        format!("{base}/live/{machine}/…/live.iso")
    }
}

/// Why a step of a bare machine failed; [`BareMetalLoop`]'s error policy decides per kind.
#[derive(Debug, thiserror::Error)]
pub enum BareError {
    /// The BMDB failed (reading the machine, or entering a phase): nothing was done at the
    /// BMC since the last phase it recorded.
    #[error(transparent)]
    Bmdb(#[from] shepherd_bmdb::Error),
    /// The machine has no `machine_provided` tag or is not bare.
    #[error("machine has no provided tag, or was not recorded bare")]
    NotBare,
    /// The provider could not be asked about the machine.
    #[error(transparent)]
    Lookup(#[from] LookupFailed),
    /// The provider has no bare plan for the machine (its entry no longer says `Bare`, or its
    /// BMC entry cannot be used).
    #[error("the inventory entry: {0}")]
    Plan(ProviderError),
    /// The machine's config drive would not fit the live image.
    #[error(transparent)]
    Config(#[from] ConfigTooLarge),
    /// The inventory entry's `Bare` cannot be used (checked when the inventory was read, so
    /// only an entry changed since then gets here).
    #[error("the inventory entry: {0}")]
    Entry(InvalidSetting),
    /// The BMC failed a step (unreachable, a timeout, an error status), or lacks what it needs.
    #[error("{step}: {error}")]
    Bmc {
        /// What was asked of it.
        step: &'static str,
        /// Its answer.
        error: BmcError,
    },
    /// The work's lease ended before a BMC call, or cut one off.
    #[error("{step}: {error}")]
    LeaseLost {
        /// The call not made, or cut off.
        step: &'static str,
        /// The lease.
        error: LeaseLost,
    },
}

impl BareError {
    /// Whether an operator must change something before a retry can help: the machine is
    /// failed with the cause, said once, instead of being retried in a loop.
    fn is_configuration(&self) -> bool {
        match self {
            BareError::Bmc { error, .. } => error.is_configuration(),
            BareError::Plan(ProviderError::NotSupported(_) | ProviderError::Bmc(_))
            | BareError::Config(_)
            | BareError::Entry(_) => true,
            _ => false,
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailureLabels {
    step: &'static str,
}

/// The bare-metal loop's counters. Cheap to clone; clones share values.
#[derive(Debug, Clone, Default)]
pub struct BareMetrics {
    entered: Family<PhaseLabels, Counter>,
    failures: Family<FailureLabels, Counter>,
}

/// The steps a failure is counted under.
const STEPS: [&str; 9] = [
    "power off",
    "insert the live image",
    "boot once from the CD",
    "power on",
    "eject the live image",
    "boot from the disk from now on",
    "read the virtual CD",
    "inventory",
    "config drive",
];

impl BareMetrics {
    /// Adds `shepherd_bare_metal_phases_entered_total{phase}` and
    /// `shepherd_bare_metal_step_failures_total{step}` to `registry`, every series at 0.
    pub fn register(&self, registry: &mut Registry) {
        register_at_zero(
            registry,
            "shepherd_bare_metal_phases_entered",
            "Phases bare machines entered on their way from a BMC to their installed OS",
            &self.entered,
            BarePhase::ALL
                .iter()
                .map(|p| PhaseLabels { phase: p.as_str() }),
        );
        register_at_zero(
            registry,
            "shepherd_bare_metal_step_failures",
            "Steps of the bare-metal loop that failed, by step (a BMC's answer, or what it lacks)",
            &self.failures,
            STEPS.iter().map(|step| FailureLabels { step }),
        );
    }

    fn entered(&self, phase: BarePhase) {
        let phase = phase.as_str();
        self.entered.get_or_create(&PhaseLabels { phase }).inc();
    }

    fn failed(&self, error: &BareError) {
        let step = match error {
            BareError::Bmc { step, .. } => step,
            BareError::Plan(_) | BareError::Lookup(_) | BareError::NotBare => "inventory",
            BareError::Config(_) => "config drive",
            _ => return,
        };
        self.failures.get_or_create(&FailureLabels { step }).inc();
    }
}

/// The bare-metal loop over one provider.
pub struct BareMetalLoop<P: Rebooter> {
    provider: Arc<P>,
    settings: BareSettings,
    metrics: BareMetrics,
}

impl<P: Rebooter> BareMetalLoop<P> {
    /// The loop; fails if `settings` do not pass [`BareSettings::validate`].
    pub fn new(provider: Arc<P>, settings: BareSettings) -> Result<Self, InvalidSetting> {
        settings.validate()?;
        Ok(BareMetalLoop {
            provider,
            settings,
            metrics: BareMetrics::default(),
        })
    }

    /// The same loop, counting into `metrics`.
    pub fn with_metrics(self, metrics: BareMetrics) -> Self {
        BareMetalLoop { metrics, ..self }
    }
}

/// Why a live boot ended without an installation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LiveBootEnd {
    /// Nothing was taken over within the live-boot timeout.
    NoAnswer,
    /// An agent was taken over, but not in this live boot's environment.
    FellThrough,
}

/// What the loop reads of a machine before it acts, in one transaction.
struct Known {
    provided: Option<Provided>,
    bare: Option<BareMetal>,
    agent_started: bool,
    /// The live proof the started agent showed, if any.
    live_proof: Option<String>,
    heartbeat: bool,
    request: Option<OsInstallationRequest>,
    report: Option<OsInstallationReport>,
}

impl Known {
    /// What the BMDB knows of `machine`, read in one transaction of `session`.
    async fn of(session: &Session, machine: Uuid) -> Result<Known, shepherd_bmdb::Error> {
        session
            .read(move |tx| Box::pin(Known::read(tx, machine)))
            .await
    }

    async fn read(tx: &mut Tx, machine: Uuid) -> Result<Known, shepherd_bmdb::Error> {
        let (provided, bare) = (tx.provided(machine).await?, tx.bare_metal(machine).await?);
        let agent_started = tx.agent_started(machine).await?.is_some();
        let live_proof = tx.agent_live_proof(machine).await?;
        let heartbeat = tx.heartbeat(machine).await?.is_some();
        let request = tx.os_installation_request(machine).await?;
        let report = tx.os_installation_report(machine).await?;
        Ok(Known {
            provided,
            bare,
            agent_started,
            live_proof,
            heartbeat,
            request,
            report,
        })
    }
}

/// One claimed machine on its way: where it is, what the BMDB knows, and how to act on it.
struct Step<'a, P: Rebooter> {
    lp: &'a BareMetalLoop<P>,
    session: &'a Session,
    machine: Uuid,
    lease: Lease,
    /// Its phase as last read or entered.
    phase: BarePhase,
    /// Its provided tag.
    provided: Provided,
    /// Its bare-metal tag as read.
    bare: BareMetal,
    /// The rest of what was read.
    known: Known,
}

impl<P: Rebooter> Step<'_, P> {
    /// Whether its started agent runs in the live environment of its current live boot: it
    /// showed the proof of the media grant that boot fetched (design.md §21).
    fn runs_live(&self) -> bool {
        match (&self.known.live_proof, &self.bare.media_token) {
            (Some(shown), Some(token)) => *shown == live_proof_of(token),
            _ => false,
        }
    }

    /// Enters `to` from the current phase with `writes`, recording `detail`.
    async fn enter(
        &mut self,
        to: BarePhase,
        writes: PhaseWrites,
        detail: String,
    ) -> Result<(), BareError> {
        self.enter_and(to, writes, detail, None).await
    }

    /// [`Step::enter`], also recording `request` as the installation request in the same
    /// transaction.
    async fn enter_and(
        &mut self,
        to: BarePhase,
        writes: PhaseWrites,
        detail: String,
        request: Option<OsInstallationRequest>,
    ) -> Result<(), BareError> {
        let (session, machine, from) = (self.session.id(), self.machine, self.phase);
        let logged = detail.clone();
        self.session
            .transact(move |tx| {
                let (writes, detail, request) = (writes.clone(), detail.clone(), request.clone());
                Box::pin(async move {
                    tx.enter_bare_phase(session, machine, (from, to), &writes, &detail)
                        .await?;
                    if let Some(request) = &request {
                        tx.set_os_installation_request(machine, request).await?;
                    }
                    Ok(())
                })
            })
            .await?;
        self.lp.metrics.entered(to);
        tracing::info!(machine = %self.machine, from = %from, to = %to, detail = logged, "bare machine moved on");
        self.phase = to;
        Ok(())
    }

    /// Runs one BMC call for `step` under the work's lease: not started once the lease is
    /// gone, and cut off if it ends meanwhile.
    async fn bmc<T>(
        &self,
        step: &'static str,
        call: impl std::future::Future<Output = Result<T, BmcError>>,
    ) -> Result<T, BareError> {
        let result = self.lease.fenced(step, call).await;
        let result = result.map_err(|error| BareError::LeaseLost { step, error })?;
        result.map_err(|error| BareError::Bmc { step, error })
    }

    /// Powers the machine off and takes whatever media it holds but `keep` out: the state
    /// every boot starts from, and what a machine given up on is left in.
    async fn quiesce(&self, bmc: &Bmc, keep: Option<&str>) -> Result<String, BareError> {
        let off = self.bmc("power off", bmc.power_off()).await?;
        let cd = self.bmc("read the virtual CD", bmc.virtual_cd()).await?;
        let ejected = if !cd.is_empty() && keep.is_none_or(|url| !cd.holds(url)) {
            self.bmc("eject the live image", bmc.eject_media(&cd))
                .await?;
            "; ejected what its virtual CD held"
        } else {
            ""
        };
        Ok(format!("powered off ({off}){ejected}"))
    }

    /// Powers the machine on after setting its boot from `target` (the CD once, the disk from
    /// now on) in boot mode `mode` (else the system's), unless it is on already (which it is
    /// only because this step was done before: it was powered off first).
    async fn start(
        &self,
        bmc: &Bmc,
        target: BootTarget,
        mode: Option<BootMode>,
    ) -> Result<String, BareError> {
        let state = self.bmc("power on", bmc.power_state()).await?;
        if state.as_deref() == Some("On") {
            return Ok("it was on already: powered on before".into());
        }
        let boot = match target {
            BootTarget::Cd => "boot once from the CD",
            BootTarget::Hdd => "boot from the disk from now on",
        };
        let mode = self.bmc(boot, bmc.boot_from(target, mode)).await?;
        let done = self.bmc("power on", bmc.power_on()).await?;
        Ok(format!("{mode}; powered on ({done})"))
    }
}

#[async_trait]
impl<P: Rebooter + 'static> MachineTask for BareMetalLoop<P> {
    type Error = BareError;

    /// A lost lease is fenced; the BMDB failing, or the machine's phase moved by someone
    /// else, releases the machine; a provider that cannot be reached makes the worker wait;
    /// a BMC's answer backs the machine off, as long as it asked (`Retry-After`) if it did
    /// (configuration errors never get here: the machine is failed with them).
    fn error_policy(&self, error: &BareError) -> OnError {
        match error {
            BareError::LeaseLost { .. } => OnError::Fenced,
            BareError::Bmdb(e) if e.is_transient() => OnError::Cancel,
            BareError::Bmdb(shepherd_bmdb::Error::BarePhaseMoved { .. }) => OnError::Cancel,
            BareError::Lookup(l) if l.error.is_unavailable() => OnError::Wait,
            BareError::Bmc {
                error:
                    BmcError::Status {
                        retry_after: Some(wait),
                        ..
                    },
                ..
            } => OnError::Backoff(self.settings.backoff.as_asked(*wait)),
            _ => OnError::Backoff(self.settings.backoff),
        }
    }

    /// Machines at a step of their own, or whose wait ended or ran out.
    fn retrieval(&self) -> Retrieval {
        let timeouts = self.settings.timeouts;
        let provider = self.provider.kind();
        Retrieval::BareMetal { provider, timeouts }
    }

    async fn process_machine(
        &self,
        session: &Session,
        machine: Uuid,
    ) -> Result<TagWrites, BareError> {
        let known = Known::of(session, machine).await?;
        let (Some(provided), Some(bare)) = (known.provided.clone(), known.bare.clone()) else {
            return Err(BareError::NotBare);
        };
        tracing::Span::current().record("provider_id", provided.provider_id.as_str());
        let mut step = Step {
            lp: self,
            session,
            machine,
            lease: session.lease(),
            phase: bare.phase,
            provided,
            bare,
            known,
        };
        match self.advance(&mut step).await {
            Ok(tags) => Ok(tags),
            Err(error) => {
                self.metrics.failed(&error);
                if !error.is_configuration() {
                    return Err(error);
                }
                // Said once: the machine is failed with the cause, and left alone until an
                // operator fixes what is wrong and reimages it.
                let cause = format!("{error:#}");
                tracing::warn!(%machine, provider_id = step.provided.provider_id, %cause, "a bare machine cannot go on: failed until an operator reimages it");
                let detail = format!("{cause}; fix it, then `shepherd machines reimage {machine}`");
                step.enter(BarePhase::Failed, PhaseWrites::default(), detail)
                    .await?;
                Ok(TagWrites::none())
            }
        }
    }
}

impl<P: Rebooter + 'static> BareMetalLoop<P> {
    /// Takes the step the machine's phase calls for, then the steps that follow at once, until
    /// one leaves the machine waiting (for a boot, its agent, a retry) or done.
    async fn advance(&self, step: &mut Step<'_, P>) -> Result<TagWrites, BareError> {
        let at_provider = look_up(&*self.provider, &step.provided.provider_id).await?;
        let plan = self
            .provider
            .bare_plan(&at_provider)
            .await
            .map_err(BareError::Plan)?;
        let mut token = step.bare.media_token.clone();
        loop {
            let waits = match step.phase {
                BarePhase::Bare => {
                    token = Some(self.grant(step, &plan).await?);
                    None
                }
                BarePhase::Inserting => {
                    let token = token.as_deref().ok_or(BareError::NotBare)?;
                    self.insert(step, &plan, token).await?;
                    None
                }
                BarePhase::StartingLive => Some(self.boot(step, &plan, BootTarget::Cd).await?),
                BarePhase::LiveBoot if step.known.agent_started && !step.runs_live() => Some(
                    self.live_boot_failed(step, LiveBootEnd::FellThrough, &plan)
                        .await?,
                ),
                BarePhase::LiveBoot if step.known.agent_started => {
                    let (request, detail) =
                        self.installation(step, &plan).map_err(BareError::Entry)?;
                    let writes = PhaseWrites {
                        install_generation: Some(request.generation),
                        ..PhaseWrites::default()
                    };
                    step.enter_and(BarePhase::Installing, writes, detail, Some(request))
                        .await?;
                    Some(TagWrites::none())
                }
                BarePhase::LiveBoot => Some(
                    self.live_boot_failed(step, LiveBootEnd::NoAnswer, &plan)
                        .await?,
                ),
                BarePhase::Installing => self.installed(step, &plan).await?,
                BarePhase::Ejecting => {
                    self.eject(step, &plan).await?;
                    None
                }
                BarePhase::StartingDisk => Some(self.boot(step, &plan, BootTarget::Hdd).await?),
                BarePhase::DiskBoot if step.known.heartbeat => {
                    let detail = "heartbeating from its installed OS".into();
                    step.enter(BarePhase::Done, PhaseWrites::default(), detail)
                        .await?;
                    Some(TagWrites::none())
                }
                BarePhase::DiskBoot => Some(self.disk_boot_ran_out(step).await?),
                BarePhase::Done | BarePhase::Failed => Some(TagWrites::none()),
            };
            if let Some(tags) = waits {
                return Ok(tags);
            }
        }
    }

    /// A live boot begins: a fresh media URL with the machine's config drive, its system
    /// forgotten (a new live environment has a new host key). Returns the URL's secret.
    async fn grant(&self, step: &mut Step<'_, P>, plan: &BarePlan) -> Result<String, BareError> {
        let machine = step.machine;
        let now = step
            .session
            .read(|tx| Box::pin(async move { tx.now().await }))
            .await?;
        let mut grant = MediaGrant::new(String::new(), now, self.settings.media_ttl);
        // The live environment's agent shows this grant's proof at its takeover: only then
        // is it asked to install (an installed OS the boot fell through to has none).
        let mut agent_env = self.settings.agent_env.clone();
        agent_env.retain(|(name, _)| name != LIVE_PROOF_VAR);
        agent_env.push((LIVE_PROOF_VAR.to_string(), grant.live_proof()));
        let facts = LiveFacts {
            machine,
            hostname: &step.provided.provider_id,
            public_keys: &self.settings.public_keys,
            agent_env: &agent_env,
        };
        grant.config = config_drive(&facts, &plan.entry)?;
        let token = grant.token.clone();
        let detail = format!(
            "live boot {} of {}: {} goes into the virtual CD of BMC {}",
            step.bare.attempts + 1,
            self.settings.live_boot_attempts,
            self.settings.media_url_shown(machine),
            plan.bmc.base()
        );
        let writes = PhaseWrites {
            count_attempt: true,
            media: Some(Some(grant)),
            forget_system: Some(ForgetSystem { installation: true }),
            ..PhaseWrites::default()
        };
        step.enter(BarePhase::Inserting, writes, detail).await?;
        Ok(token)
    }

    /// Powers the machine off and inserts its live image, unless the virtual CD holds it.
    async fn insert(
        &self,
        step: &mut Step<'_, P>,
        plan: &BarePlan,
        token: &str,
    ) -> Result<(), BareError> {
        let url = self.settings.media_url_of(step.machine, token);
        let off = step.quiesce(&plan.bmc, Some(&url)).await?;
        let cd = step
            .bmc("read the virtual CD", plan.bmc.virtual_cd())
            .await?;
        let inserted = if cd.holds(&url) {
            "the live image was in its virtual CD already"
        } else {
            let insert = plan.bmc.insert_media(&cd, &url);
            step.bmc("insert the live image", insert).await?;
            "inserted the live image into its virtual CD"
        };
        let detail = format!("{off}; {inserted}");
        step.enter(BarePhase::StartingLive, PhaseWrites::default(), detail)
            .await
    }

    /// The installation's end: on its report of success the machine goes on to eject (`None`:
    /// at once); on a failure, or none within its time, it is given up on.
    async fn installed(
        &self,
        step: &mut Step<'_, P>,
        plan: &BarePlan,
    ) -> Result<Option<TagWrites>, BareError> {
        let generation = step.bare.install_generation;
        let reported = step.known.report.as_ref();
        let reported = reported.filter(|r| Some(r.generation) == generation);
        let cause = match reported.map(|r| (r.result, install_report::read(&r.report_raw))) {
            Some((shepherd_bmdb::InstallationResult::Success, report)) => {
                let wiped = report
                    .wiped
                    .map(|w| format!("cleared {w}, then "))
                    .unwrap_or_default();
                let drive = report
                    .config_drive
                    .map(|d| format!(", then added {d}"))
                    .unwrap_or_default();
                let detail = match report.written_onto {
                    Some(disk) => format!(
                        "the agent {wiped}wrote the image onto {disk} and checked its sha256 as served{drive}"
                    ),
                    None => format!("the agent {wiped}wrote the image and checked its sha256{drive}"),
                };
                step.enter(BarePhase::Ejecting, PhaseWrites::default(), detail)
                    .await?;
                return Ok(None);
            }
            Some((_, report)) => {
                let failure = &report.failure;
                if failure.unavailable {
                    let failed = self.image_server_failed(step, failure, report.chosen_disk);
                    return Ok(Some(failed.await?));
                }
                format!("the installation failed: {}", failure.cause)
            }
            None => format!(
                "the installation did not report within {}",
                humantime::format_duration(self.settings.timeouts.install)
            ),
        };
        Ok(Some(self.give_up(step, plan, &cause).await?))
    }

    /// The `n`th wait in a row (the first for `n` ≤ 1) of the loop's backoff: its interval in
    /// seconds, and the wait with jitter.
    fn nth_backoff(&self, n: u32) -> (i64, Duration) {
        let mut interval = None;
        for _ in 0..n.max(1) {
            interval = Some(self.settings.backoff.next_interval_seconds(interval));
        }
        let interval = interval.unwrap_or_default();
        (interval, self.settings.backoff.delay_with_jitter(interval))
    }

    /// The image's server failed the installation: nothing is wrong with the machine. Its live
    /// environment stays up, and is asked again after a backoff that grows with each such
    /// failure in a row. If the agent had begun writing the disk, Shepherd allows itself to
    /// write it again during this live boot (the disk was blank, or might be wiped, before).
    async fn image_server_failed(
        &self,
        step: &mut Step<'_, P>,
        failure: &ReportedFailure,
        chosen_disk: Option<String>,
    ) -> Result<TagWrites, BareError> {
        let (interval, wait) = self.nth_backoff(failure.in_a_row);
        let generation = step.bare.install_generation.unwrap_or_default();
        let began = match failure.disk_written {
            true => format!("; installation {generation} began writing the disk, so Shepherd may write it again during this live boot"),
            false => String::new(),
        };
        let detail = format!(
            "the image's server failed the installation ({}): nothing is wrong with the machine; its live environment stays up and is asked again in {}{began}",
            failure.cause,
            humantime::format_duration(Duration::from_secs(wait.as_secs()))
        );
        tracing::warn!(machine = %step.machine, "{detail}");
        let writes = PhaseWrites {
            began_writing: failure.disk_written,
            chosen_disk,
            ..PhaseWrites::default()
        };
        step.enter(BarePhase::LiveBoot, writes, detail.clone())
            .await?;
        Ok(TagWrites::none().hold_back(Process::ShepherdBareMetal, wait, interval, &detail))
    }

    /// The live environment is done: the machine is powered off, its media ejected and its
    /// URL revoked, and what tied it to its live environment forgotten.
    async fn eject(&self, step: &mut Step<'_, P>, plan: &BarePlan) -> Result<(), BareError> {
        let off = step.quiesce(&plan.bmc, None).await?;
        let detail = format!("{off} (its live environment is done)");
        let writes = PhaseWrites {
            media: Some(None),
            forget_system: Some(ForgetSystem { installation: true }),
            ..PhaseWrites::default()
        };
        step.enter(BarePhase::StartingDisk, writes, detail).await
    }

    /// The installed OS did not heartbeat in time: the machine fails (its image must let
    /// Shepherd in), left as it is.
    async fn disk_boot_ran_out(&self, step: &mut Step<'_, P>) -> Result<TagWrites, BareError> {
        let machine = step.machine;
        let detail = format!(
            "its installed OS did not heartbeat within {}: its image must let Shepherd in over SSH (with the key of `shepherd run`) and reach the BMaaS server; fix the image, then `shepherd machines reimage {machine} --wipe`",
            humantime::format_duration(self.settings.timeouts.disk_boot)
        );
        tracing::warn!(%machine, "{detail}");
        step.enter(BarePhase::Failed, PhaseWrites::default(), detail)
            .await?;
        Ok(TagWrites::none())
    }

    /// Boots the machine once from `target` (its live environment, or its installed OS) and
    /// leaves it to the initializer, which waits `boot_wait` first: a hold that is no failure.
    async fn boot(
        &self,
        step: &mut Step<'_, P>,
        plan: &BarePlan,
        target: BootTarget,
    ) -> Result<TagWrites, BareError> {
        let (from, next, booting) = match target {
            BootTarget::Cd => (
                "a one-time boot from the virtual CD",
                BarePhase::LiveBoot,
                "its live environment",
            ),
            BootTarget::Hdd => (
                "the disk set as its boot device from now on",
                BarePhase::DiskBoot,
                "its installed OS",
            ),
        };
        let on = step.start(&plan.bmc, target, plan.entry.boot_mode).await?;
        let detail = format!("{from}; {on}");
        step.enter(next, PhaseWrites::default(), detail).await?;
        let wait = self.settings.boot_wait;
        if wait.is_zero() {
            return Ok(TagWrites::none());
        }
        let cause = format!(
            "{booting} is booting: first takeover attempt after {}",
            humantime::format_duration(wait)
        );
        Ok(TagWrites::none().hold_back(Process::ShepherdAgentStart, wait, 0, &cause))
    }

    /// The installation request for a machine its initializer took over in its live
    /// environment, and the history's words for it (who allowed a wipe).
    fn installation(
        &self,
        step: &Step<'_, P>,
        plan: &BarePlan,
    ) -> Result<(OsInstallationRequest, String), InvalidSetting> {
        let (bare, known) = (&step.bare, &step.known);
        let asked = known.request.as_ref().map(|r| r.generation);
        let generation = asked.max(bare.install_generation).unwrap_or(0) + 1;
        let entry = &plan.entry;
        // Shepherd began writing the disk during this very live boot, then the image's
        // server failed: the disk holds part of Shepherd's image, not the machine's data.
        let rewriting = bare.rewrite_grant.is_some() && bare.rewrite_grant == bare.media_token;
        let allowed_by = match (&bare.wipe_by, entry.wipe) {
            (Some(who), _) => Some(who.clone()),
            (None, true) => Some("the inventory entry (Bare.Wipe)".to_string()),
            (None, false) if rewriting => Some(
                "Shepherd itself, since an installation of this live boot began writing it before the image's server failed".to_string(),
            ),
            (None, false) => None,
        };
        let named = entry.disk_choice()?;
        // The disk its agent chose before in this way, by its identity: a retry writes that
        // very disk, whatever kernel name a reboot gave it.
        let pinned = bare.chosen_disk.as_deref();
        let pinned = pinned.and_then(|hints| RootDeviceHints::from_json(hints).ok());
        let (disk, onto) = match pinned {
            Some(hints) => {
                let onto =
                    format!("the disk its agent chose before, {hints} (the entry names {named})");
                (DiskChoice::Hints(hints), onto)
            }
            None => (named.clone(), named.to_string()),
        };
        let format = entry.image_format()?;
        let (target_device, root_device_hints) = match &disk {
            DiskChoice::Path(path) => (path.clone(), String::new()),
            DiskChoice::Hints(hints) => (String::new(), hints.to_json()),
        };
        let keys = &self.settings.public_keys;
        let hostname = &step.provided.provider_id;
        let config_drive: Vec<proto::ConfigDriveFile> =
            installed_config_drive(step.machine, hostname, keys, &self.settings.ssh_user, entry)
                .into_iter()
                .map(|(path, content)| proto::ConfigDriveFile { path, content })
                .collect();
        let drive = match config_drive.is_empty() {
            true => "no config drive (the entry's ConfigDrive is false)",
            false => "then a config drive with Shepherd's keys",
        };
        let image = proto::ImageInstallationRequest {
            url: entry.image_url.clone(),
            sha256: entry.image_sha256.to_ascii_lowercase(),
            target_device,
            root_device_hints,
            format: format.map(|f| f.name().to_string()).unwrap_or_default(),
            wipe_allowed: allowed_by.is_some(),
            no_reboot: true,
            config_drive,
        };
        let request_raw = proto::OsInstallationRequest {
            generation,
            r#type: Some(proto::os_installation_request::Type::Image(image)),
        }
        .encode_to_vec();
        let wipe = match &allowed_by {
            Some(who) => format!("overwriting a disk that holds data is allowed by {who}"),
            None => "the disk is written only if it is blank".into(),
        };
        let detail = format!(
            "its live environment was taken over; asked its agent (installation {generation}) to write {} (sha256 {}) onto {onto}, {drive}: {wipe}",
            shepherd_disks::url_shown(&entry.image_url),
            entry.image_sha256
        );
        Ok((
            OsInstallationRequest {
                generation,
                request_raw,
            },
            detail,
        ))
    }

    /// The live boot ended without a live environment to install from (`why`): the machine
    /// is powered off and the media ejected, then it waits and boots again, or, after its last
    /// attempt, fails. Nothing was written.
    async fn live_boot_failed(
        &self,
        step: &mut Step<'_, P>,
        why: LiveBootEnd,
        plan: &BarePlan,
    ) -> Result<TagWrites, BareError> {
        let limit = humantime::format_duration(self.settings.timeouts.live_boot);
        let (happened, advice) = match why {
            LiveBootEnd::NoAnswer => (
                format!("its live environment did not answer SSH within {limit}"),
                "check the machine's network (DHCP, or Bare.Network) and that it boots from its virtual CD",
            ),
            LiveBootEnd::FellThrough => (
                "the CD boot fell through to the installed OS: what answered SSH showed no proof of this live boot, so no installation was asked of it".to_string(),
                "check that the BMC boots its virtual CD (the boot override and boot mode, Secure Boot) and can fetch the live image; nothing was written",
            ),
        };
        let attempts = step.bare.attempts;
        let max = self.settings.live_boot_attempts;
        if attempts >= max {
            let cause = format!("{happened}, {attempts} times: {advice}");
            return self.give_up(step, plan, &cause).await;
        }
        let off = step.quiesce(&plan.bmc, None).await?;
        let (interval, wait) = self.nth_backoff(u32::try_from(attempts).unwrap_or(0));
        let detail = format!(
            "{happened} (live boot {attempts} of {max}); {off}; the next live boot in {}",
            humantime::format_duration(Duration::from_secs(wait.as_secs()))
        );
        tracing::warn!(machine = %step.machine, "{detail}");
        let writes = PhaseWrites {
            media: Some(None),
            ..PhaseWrites::default()
        };
        step.enter(BarePhase::Bare, writes, detail.clone()).await?;
        Ok(TagWrites::none().hold_back(Process::ShepherdBareMetal, wait, interval, &detail))
    }

    /// Leaves the machine off with its media ejected, failed with `cause`, until an operator
    /// reimages it.
    async fn give_up(
        &self,
        step: &mut Step<'_, P>,
        plan: &BarePlan,
        cause: &str,
    ) -> Result<TagWrites, BareError> {
        let off = step.quiesce(&plan.bmc, None).await?;
        let machine = step.machine;
        tracing::warn!(%machine, %cause, "a bare machine failed; it is left off until an operator reimages it");
        let detail = format!("{cause}; {off}; `shepherd machines reimage {machine}` tries again");
        let writes = PhaseWrites {
            media: Some(None),
            ..PhaseWrites::default()
        };
        step.enter(BarePhase::Failed, writes, detail).await?;
        Ok(TagWrites::none())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> BareSettings {
        BareSettings::new(
            "https://shepherd.example:8443/".parse().unwrap(),
            vec!["ssh-ed25519 AAAA shepherd".into()],
        )
    }

    #[test]
    fn settings_are_checked_and_urls_keep_their_secret_out_of_the_history() {
        settings().validate().unwrap();
        type Break = fn(&mut BareSettings);
        let broken: [(Break, &str); 3] = [
            (
                |s| s.media_url = "http://shepherd.example/".parse().unwrap(),
                "bare-media-url",
            ),
            (|s| s.public_keys.clear(), "ssh-key"),
            (|s| s.live_boot_attempts = 0, "bare-live-boot-attempts"),
        ];
        for (break_it, setting) in broken {
            let mut s = settings();
            break_it(&mut s);
            let err = s.validate().unwrap_err().to_string();
            assert!(err.contains(setting), "{err}");
        }
        let id = Uuid::nil();
        assert_eq!(
            settings().media_url_of(id, "s3cret"),
            format!("https://shepherd.example:8443/live/{id}/s3cret/live.iso")
        );
        assert!(!settings().media_url_shown(id).contains("s3cret"));
    }
}
