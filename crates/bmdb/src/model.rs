//! Portable enumerations and tag records of the BMDB data model (design.md §2).
//!
//! Enumerations are stored as text and validated both by the database (CHECK constraints) and
//! by [`std::str::FromStr`] here, so a row written by a newer binary with an unknown value is a
//! clear error instead of silently misread data.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::Error;

/// Defines a closed enumeration stored as text: the enum, `ALL`, `as_str` (the stored text:
/// the variant's name), `Display`, and a `FromStr` that refuses anything else with
/// [`Error::UnknownName`]. Variants listed after `test_only` exist only with the `testing`
/// feature (for tests of the mechanism itself): a production build cannot name them.
///
/// Kept as a macro on purpose: the stored text of each variant is its name, and a macro is the
/// only way to write that once — by hand, every enumeration would repeat each name in four
/// places, where a typo in one silently misreads rows. It has no control flow of its own.
macro_rules! text_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident),+ $(,)? }) => {
        text_enum! { $(#[$meta])* $name { $($(#[$vmeta])* $variant),+ } test_only {} }
    };
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident),+ $(,)? }
        test_only { $($(#[$tmeta:meta])* $test:ident),* $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $(#[cfg(feature = "testing")] $(#[$tmeta])* $test,)*
            $($(#[$vmeta])* $variant),+
        }

        impl $name {
            /// Every value, in declaration order.
            #[cfg(not(feature = "testing"))]
            pub const ALL: &'static [$name] = &[$($name::$variant),+];
            /// Every value, in declaration order (the test-only ones first).
            #[cfg(feature = "testing")]
            pub const ALL: &'static [$name] = &[$($name::$test,)* $($name::$variant),+];

            /// The value as stored in the database.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(#[cfg(feature = "testing")] $name::$test => stringify!($test),)*
                    $($name::$variant => stringify!($variant)),+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $name {
            type Err = Error;
            fn from_str(s: &str) -> Result<Self, Error> {
                match s {
                    $(#[cfg(feature = "testing")] stringify!($test) => Ok($name::$test),)*
                    $(stringify!($variant) => Ok($name::$variant),)+
                    other => Err(Error::UnknownName {
                        kind: stringify!($name),
                        name: other.to_string(),
                        known: Self::ALL.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(", "),
                    }),
                }
            }
        }
    };
}
pub(crate) use text_enum;

text_enum! {
    /// A kind of work that can hold a per-machine lock: the `process` of work, backoff and
    /// history rows. Not to be confused with a session's [`Processor`] (design.md §3).
    Process {
        /// Legacy upstream process; kept so old rows stay readable and keep excluding.
        ShepherdAccess,
        /// The Initializer taking a machine over and starting its agent.
        ShepherdAgentStart,
        /// The Recoverer rebooting a machine whose agent is not heartbeating.
        ShepherdRecovery,
        /// The bare-metal loop driving a bare machine's BMC: virtual media, boot, power.
        ShepherdBareMetal,
    }
    test_only {
        /// Reserved for tests of the work mechanism itself (the schema allows it, as
        /// upstream's does).
        UnitTest1,
        /// Reserved for tests of the work mechanism itself.
        UnitTest2,
    }
}

impl Process {
    /// Processes that must never run at the same time on one machine as `self`.
    ///
    /// Agent start, recovery and the bare-metal steps all take a machine over by SSH or power
    /// control, so they (and the legacy access process) exclude each other.
    pub fn exclusion_set(self) -> &'static [Process] {
        use Process::*;
        match self {
            ShepherdAccess | ShepherdAgentStart | ShepherdRecovery | ShepherdBareMetal => &[
                ShepherdAccess,
                ShepherdAgentStart,
                ShepherdRecovery,
                ShepherdBareMetal,
            ],
            #[cfg(feature = "testing")]
            UnitTest1 => &[UnitTest1],
            #[cfg(feature = "testing")]
            UnitTest2 => &[UnitTest2],
        }
    }
}

text_enum! {
    /// Where a machine came from.
    ProviderKind { Equinix, Lumen, None, Static, Redfish, Sim, Ironic }
}

text_enum! {
    /// A provider's last known view of a machine's state.
    ProviderStatus { Missing, Provisioning, ProvisioningFailedPermanent, Running, Stopped, Unknown, Maintenance }
}

text_enum! {
    /// What a person or a program may do through the operator API, each role including the
    /// ones before it.
    Role {
        /// Reads: machines, sessions, the overview, background tasks.
        Viewer,
        /// Also acts on machines: maintenance, retry, forgetting a host key, installation.
        Operator,
        /// Also manages API tokens and decommissions machines.
        Admin,
    }
}

text_enum! {
    /// Outcome of an OS installation as reported by the agent.
    InstallationResult { Success, Error }
}

text_enum! {
    /// An entry of the work audit history.
    WorkEvent { Started, Finished, Failed, Canceled }
}

text_enum! {
    /// Something an operator did to a machine, recorded in `operator_actions`.
    OperatorAction {
        /// Took the machine out of the loops' hands.
        MaintenanceOn,
        /// Gave the machine back to the loops.
        MaintenanceOff,
        /// Ended the machine's backoffs now.
        Retry,
        /// Forgot the machine's pinned SSH host key.
        ForgetHostKey,
        /// Removed the machine from the BMDB, keeping its history and barring its provider id.
        Decommission,
        /// Let the provisioner bring a decommissioned provider id back.
        Recommission,
        /// Asked the machine's agent to install an OS.
        Install,
        /// Sent the machine back to its live environment to install its OS again.
        Reimage,
    }
}

impl OperatorAction {
    /// The action as operators type it ("maintenance-on").
    pub fn slug(self) -> &'static str {
        match self {
            OperatorAction::MaintenanceOn => "maintenance-on",
            OperatorAction::MaintenanceOff => "maintenance-off",
            OperatorAction::Retry => "retry",
            OperatorAction::ForgetHostKey => "forget-host-key",
            OperatorAction::Decommission => "decommission",
            OperatorAction::Recommission => "recommission",
            OperatorAction::Install => "install",
            OperatorAction::Reimage => "reimage",
        }
    }
}

text_enum! {
    /// Which component a session belongs to; the `processor` label of BMDB metrics (design.md
    /// §16). Not to be confused with the [`Process`] of work (design.md §3).
    Processor {
        /// Shown as `shepherd-initializer`.
        ShepherdInitializer,
        /// Shown as `shepherd-provisioner`.
        ShepherdProvisioner,
        /// Shown as `shepherd-recoverer`.
        ShepherdRecoverer,
        /// Shown as `shepherd-updater`.
        ShepherdUpdater,
        /// Shown as `bmsrv`.
        Bmsrv,
        /// Shown as `scruffy-stats`.
        ScruffyStats,
        /// Shown as `shepherd-operator`: an operator's command (`shepherd machines …`).
        ShepherdOperator,
        /// Shown as `shepherd-retention`: history retention.
        ShepherdRetention,
        /// Shown as `shepherd-bare-metal`: the bare-metal loop.
        ShepherdBareMetal,
        /// Shown as `unknown`.
        Unknown,
    }
}

impl Processor {
    /// The metrics label value, spelled as design.md §16 requires.
    pub fn label(self) -> &'static str {
        match self {
            Processor::ShepherdInitializer => "shepherd-initializer",
            Processor::ShepherdProvisioner => "shepherd-provisioner",
            Processor::ShepherdRecoverer => "shepherd-recoverer",
            Processor::ShepherdUpdater => "shepherd-updater",
            Processor::Bmsrv => "bmsrv",
            Processor::ScruffyStats => "scruffy-stats",
            Processor::ShepherdOperator => "shepherd-operator",
            Processor::ShepherdRetention => "shepherd-retention",
            Processor::ShepherdBareMetal => "shepherd-bare-metal",
            Processor::Unknown => "unknown",
        }
    }
}

/// Longest provider id accepted, as the schema bounds it.
pub const MAX_PROVIDER_ID_LEN: usize = 128;

/// The public key length of an ed25519 agent key.
pub const AGENT_KEY_LEN: usize = 32;

/// Longest failure cause stored; longer causes are cut (at a character boundary).
pub const MAX_CAUSE_LEN: usize = 2048;

/// `cause` as it is stored: NUL characters (which Postgres' text cannot hold) replaced, cut
/// to [`MAX_CAUSE_LEN`] bytes at a character boundary.
pub(crate) fn stored_cause(cause: &str) -> String {
    let cause = cause.replace('\0', "\u{fffd}");
    if cause.len() <= MAX_CAUSE_LEN {
        return cause;
    }
    let mut end = MAX_CAUSE_LEN;
    while !cause.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &cause[..end])
}

/// The `machine_provided` tag: which provider a machine came from and how to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provided {
    /// Provider the machine belongs to.
    pub provider: ProviderKind,
    /// The provider's own id of the machine; unique within the provider.
    pub provider_id: String,
    /// Reservation the machine was created from, if the provider has such a notion.
    pub reservation_id: Option<String>,
    /// Address reachable over SSH, if known.
    pub ip_address: Option<String>,
    /// Free-form location (site, rack, metro).
    pub location: Option<String>,
    /// The provider's last known status of the machine.
    pub status: Option<ProviderStatus>,
    /// What the provider says about the machine's hardware, refreshed by the updater.
    pub facts: ProviderFacts,
}

/// Most facts a [`ProviderFacts`] holds.
pub const MAX_FACTS: usize = 32;
/// Longest fact name kept.
const MAX_FACT_NAME: usize = 64;
/// Longest fact value kept; a longer one is cut at a character boundary.
const MAX_FACT_VALUE: usize = 256;

/// Facts a provider states about a machine's hardware, by name (Ironic: the resource class,
/// the hardware type, the scalar `properties` such as `cpus` and `memory_mb`). Shown to
/// operators next to the agent's own hardware report, which they may contradict. Bounded as it
/// is built, so that a provider with a lot to say cannot grow a row without limit: at most
/// [`MAX_FACTS`], names of at most 64 bytes, values cut to 256.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProviderFacts(std::collections::BTreeMap<String, String>);

impl ProviderFacts {
    /// Records `name = value`; returns false (and keeps nothing) when the name is empty or too
    /// long, or when [`MAX_FACTS`] other facts are held already.
    pub fn insert(&mut self, name: &str, value: &str) -> bool {
        if name.is_empty()
            || name.len() > MAX_FACT_NAME
            || (self.0.len() >= MAX_FACTS && !self.0.contains_key(name))
        {
            return false;
        }
        let mut end = value.len().min(MAX_FACT_VALUE);
        while !value.is_char_boundary(end) {
            end -= 1;
        }
        self.0.insert(name.to_string(), value[..end].to_string());
        true
    }

    /// The value of `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str)
    }

    /// Whether the provider stated nothing.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The facts, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    /// The column's value: a JSON object of strings, `NULL` for none.
    pub(crate) fn to_column(&self) -> Option<String> {
        (!self.is_empty()).then(|| serde_json::to_string(&self.0).expect("strings serialize"))
    }

    /// Reads the column back through [`ProviderFacts::insert`], so that a row written by hand
    /// is bounded as well.
    pub(crate) fn from_column(column: Option<&str>) -> Result<ProviderFacts, Error> {
        let Some(text) = column else {
            return Ok(ProviderFacts::default());
        };
        let map: std::collections::BTreeMap<String, String> =
            serde_json::from_str(text).map_err(|e| Error::UnreadableValue {
                what: "machine_provided.facts",
                problem: e.to_string(),
            })?;
        let mut facts = ProviderFacts::default();
        for (k, v) in &map {
            facts.insert(k, v);
        }
        Ok(facts)
    }
}

impl Provided {
    /// A tag with only the mandatory fields set.
    pub fn new(provider: ProviderKind, provider_id: impl Into<String>) -> Self {
        Provided {
            provider,
            provider_id: provider_id.into(),
            reservation_id: None,
            ip_address: None,
            location: None,
            status: None,
            facts: ProviderFacts::default(),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.provider_id.is_empty() || self.provider_id.len() > MAX_PROVIDER_ID_LEN {
            return Err(Error::InvalidArgument {
                what: "provider id",
                problem: format!(
                    "must be 1..={MAX_PROVIDER_ID_LEN} bytes, got {}",
                    self.provider_id.len()
                ),
            });
        }
        Ok(())
    }
}

/// The `machine_agent_started` tag: the agent was started and this is its public key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentStarted {
    /// When the Initializer finished the takeover.
    pub started_at: DateTime<Utc>,
    /// The agent's ed25519 public key (32 bytes).
    pub public_key: Vec<u8>,
}

/// The `machine_os_installation_request` tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OsInstallationRequest {
    /// Bumped by every new request; a report with the same generation fulfils it.
    pub generation: i64,
    /// Serialized `OSInstallationRequest` protobuf.
    pub request_raw: Vec<u8>,
}

/// The `machine_os_installation_report` tag.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OsInstallationReport {
    /// Generation of the request this report answers.
    pub generation: i64,
    /// Whether the installation succeeded.
    pub result: InstallationResult,
    /// Serialized `OSInstallationReport` protobuf.
    pub report_raw: Vec<u8>,
}

/// What an agent sent with a heartbeat, besides the heartbeat itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentReport {
    /// A serialized `AgentHardwareReport`.
    pub hardware: Option<Vec<u8>>,
    /// An installation report.
    pub installation: Option<OsInstallationReport>,
}

impl AgentReport {
    /// Whether there is nothing but the heartbeat.
    pub fn is_empty(&self) -> bool {
        self.hardware.is_none() && self.installation.is_none()
    }
}

/// What recording an agent's heartbeat found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AgentHeartbeat {
    /// The machine is unknown or its agent has another key; nothing was written.
    Unauthorized,
    /// The key did not match, but the machine's takeover is being recorded (or was just
    /// recorded): the agent may well be the one taking it over, and should try again in a
    /// moment. Nothing was written.
    KeyPending,
    /// The heartbeat (and report) was recorded.
    Recorded {
        /// The serialized installation request no report has fulfilled yet, if any.
        pending_request: Option<Vec<u8>>,
    },
}

/// The `machine_ssh_host_key` tag: the pinned SSH host key of a machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshHostKey {
    /// The host key in OpenSSH public key format.
    pub key: String,
    /// When it was first seen (and pinned).
    pub first_seen_at: DateTime<Utc>,
}

/// The `machine_recovery` tag: how the recoverer has been rebooting a machine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recovery {
    /// When the recoverer last rebooted it.
    pub rebooted_at: DateTime<Utc>,
    /// Reboots since its agent last heartbeated: 1 after a reboot that followed a heartbeat,
    /// more when earlier reboots did not bring the agent back.
    pub in_a_row: i64,
}

/// One entry of a machine's work history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HistoryEntry {
    /// Monotonic id; orders entries written in the same instant.
    pub id: i64,
    /// The machine the work was about.
    pub machine_id: Uuid,
    /// The process of the work.
    pub process: Process,
    /// What happened.
    pub event: WorkEvent,
    /// When it happened (database clock).
    pub at: DateTime<Utc>,
    /// The session that did it, if known.
    pub session_id: Option<Uuid>,
    /// Why the work failed or was canceled, if it did.
    pub cause: Option<String>,
}

/// A row of the `work` table: a machine locked for a process by a session.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveWork {
    /// The locked machine.
    pub machine_id: Uuid,
    /// The process holding the lock.
    pub process: Process,
    /// The session holding the lock.
    pub session_id: Uuid,
}

/// A row of the `work_backoff` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackoffEntry {
    /// The machine in backoff.
    pub machine_id: Uuid,
    /// The process that failed.
    pub process: Process,
    /// Until when the machine is not eligible again for the process.
    pub until: DateTime<Utc>,
    /// Why the last attempt failed.
    pub cause: String,
    /// The interval that produced `until`; the base of the next exponential step.
    pub last_interval_seconds: i64,
}

/// A row of the `sessions` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionInfo {
    /// Session id.
    pub session_id: Uuid,
    /// Component that started it, e.g. `shepherd-initializer`.
    pub component_name: String,
    /// Free-form runtime description (host, pid, version).
    pub runtime_info: String,
    /// Metrics processor label.
    pub processor: String,
    /// When it was started.
    pub created_at: DateTime<Utc>,
    /// Keep-alive interval.
    pub interval_seconds: i64,
    /// It is expired once the database clock passes this.
    pub deadline: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_bounded_on_char_boundaries() {
        assert_eq!(stored_cause("short"), "short");
        let long = "é".repeat(MAX_CAUSE_LEN);
        let cut = stored_cause(&long);
        assert!(cut.len() <= MAX_CAUSE_LEN + '…'.len_utf8());
        assert!(cut.ends_with('…'));
    }
    use std::str::FromStr;

    #[test]
    fn provider_facts_are_bounded_as_they_are_built_and_read() {
        let mut facts = ProviderFacts::default();
        assert!(!facts.insert("", "x"), "an empty name");
        assert!(!facts.insert(&"n".repeat(65), "x"), "a name too long");
        // Cut at a character boundary: 'é' is two bytes and would straddle byte 256.
        assert!(facts.insert("long", &format!("a{}", "é".repeat(200))));
        let long = facts.get("long").unwrap();
        assert!(long.len() <= 256 && long.len() >= 255, "{}", long.len());
        for i in 1..MAX_FACTS {
            assert!(facts.insert(&format!("f{i}"), "v"));
        }
        assert!(!facts.insert("one-more", "v"), "no more than MAX_FACTS");
        assert!(
            facts.insert("f1", "replaced"),
            "an existing name is replaced"
        );
        assert_eq!(facts.iter().count(), MAX_FACTS);

        let column = facts.to_column().unwrap();
        assert_eq!(ProviderFacts::from_column(Some(&column)).unwrap(), facts);
        assert_eq!(ProviderFacts::default().to_column(), None);
        assert!(ProviderFacts::from_column(None).unwrap().is_empty());
        // A row written by hand is bounded as it is read, and garbage is a clear error.
        let oversized: std::collections::BTreeMap<String, String> = (0..100)
            .map(|i| (format!("k{i}"), "v".repeat(1000)))
            .collect();
        let read =
            ProviderFacts::from_column(Some(&serde_json::to_string(&oversized).unwrap())).unwrap();
        assert_eq!(read.iter().count(), MAX_FACTS);
        assert!(read.iter().all(|(_, v)| v.len() == 256));
        let err = ProviderFacts::from_column(Some("[1,2]")).unwrap_err();
        assert!(err.to_string().contains("machine_provided.facts"), "{err}");
    }

    #[test]
    fn enums_round_trip_and_reject_unknown_values() {
        for p in Process::ALL {
            assert_eq!(Process::from_str(p.as_str()).unwrap(), *p);
        }
        for p in ProviderKind::ALL {
            assert_eq!(ProviderKind::from_str(p.as_str()).unwrap(), *p);
        }
        let err = Process::from_str("Nope").unwrap_err().to_string();
        assert!(err.contains("unknown Process \"Nope\""), "{err}");
    }

    #[test]
    fn shepherd_processes_exclude_each_other_but_not_tests() {
        assert!(Process::ShepherdRecovery
            .exclusion_set()
            .contains(&Process::ShepherdAgentStart));
        assert_eq!(Process::UnitTest1.exclusion_set(), &[Process::UnitTest1]);
    }

    #[test]
    fn provider_id_is_bounded() {
        assert!(Provided::new(ProviderKind::Sim, "x".repeat(128))
            .validate()
            .is_ok());
        assert!(Provided::new(ProviderKind::Sim, "x".repeat(129))
            .validate()
            .is_err());
        assert!(Provided::new(ProviderKind::Sim, "").validate().is_err());
    }
}

/// Who did an operator action and why; both are kept in the history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operator {
    /// The operator's name: the principal the operator API proved (`token:NAME`, or the
    /// identity provider's issuer and subject), or on the database directly the login name
    /// or what `--by` says.
    pub by: String,
    /// Why (`--reason`); may be empty where the command does not require one.
    pub reason: String,
    /// The operator API's id of the request that made the action; `None` on the database.
    pub request_id: Option<String>,
}

impl Operator {
    /// Longest name or reason kept.
    pub const MAX_LEN: usize = 1000;

    /// An operator with a name and a reason, checked: the name must not be empty, neither
    /// may exceed [`Operator::MAX_LEN`] bytes, and neither may hold a control character (a
    /// newline would print as a made-up line of the history, an escape sequence would
    /// rewrite the operator's terminal).
    pub fn new(by: impl Into<String>, reason: impl Into<String>) -> Result<Operator, Error> {
        let (by, reason) = (by.into(), reason.into());
        if by.trim().is_empty() {
            return Err(Error::InvalidArgument {
                what: "operator",
                problem: "the name is empty".into(),
            });
        }
        for (what, text) in [("operator", &by), ("reason", &reason)] {
            if let Some(c) = text.chars().find(|&c| crate::moves_text(c)) {
                return Err(Error::InvalidArgument {
                    what,
                    problem: format!(
                        "holds the character {c:?}, which moves printed text (a new line, a \
                         terminal escape); write plain text on one line"
                    ),
                });
            }
        }
        if by.len() > Self::MAX_LEN || reason.len() > Self::MAX_LEN {
            return Err(Error::InvalidArgument {
                what: "operator",
                problem: format!(
                    "the name and the reason may be at most {} bytes each",
                    Self::MAX_LEN
                ),
            });
        }
        Ok(Operator {
            by,
            reason,
            request_id: None,
        })
    }

    /// The same operator, acting in the operator API's request `id`.
    pub fn in_request(self, id: impl Into<String>) -> Operator {
        Operator {
            request_id: Some(id.into()),
            ..self
        }
    }
}

/// The `machine_maintenance` tag: an operator took the machine out of the loops' hands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Maintenance {
    /// When maintenance began.
    pub since: DateTime<Utc>,
    /// Who began it.
    pub by: String,
    /// Why.
    pub reason: String,
}

/// One entry of the operators' history of a machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionEntry {
    /// Ordering key.
    pub id: i64,
    /// The machine acted on.
    pub machine_id: Uuid,
    /// What was done.
    pub action: OperatorAction,
    /// The process it concerned, where it concerned one (a retry of one process's backoff).
    pub process: Option<Process>,
    /// When (the database clock).
    pub at: DateTime<Utc>,
    /// Who.
    pub by: String,
    /// Why, and what the action found (e.g. the forgotten key).
    pub reason: String,
    /// The operator API's id of the request that made it, if it came through the API.
    pub request_id: Option<String>,
}

/// A provider id its provider refused to make a machine of (Ironic refusing a node's deploy,
/// say), skipped by every replica until `until`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderSkip {
    /// The provider's id of the machine (or of the capacity it would have come from).
    pub provider_id: String,
    /// When provisioners may try it again.
    pub until: DateTime<Utc>,
    /// When it was refused.
    pub at: DateTime<Utc>,
    /// The provider's answer, bounded.
    pub cause: String,
}

/// A provider id an operator decommissioned; the provisioner leaves it alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decommissioned {
    /// The machine's provider.
    pub provider: ProviderKind,
    /// The provider's id of the machine.
    pub provider_id: String,
    /// The machine id it had (its history is kept under it).
    pub machine_id: Uuid,
    /// When it was decommissioned.
    pub at: DateTime<Utc>,
    /// Who decommissioned it.
    pub by: String,
    /// Why.
    pub reason: String,
    /// Whether the provider is to tear the machine down (Ironic: undeploy and clean the node)
    /// rather than only release it.
    pub undeploy: bool,
}

/// A server that has not reported for this long may have lost what it received since its
/// last report: its silence excuses like a trouble since then (for a bounded time).
pub const WRITER_STALE: std::time::Duration = std::time::Duration::from_secs(10);

/// One server's last report of the heartbeats it received ([`crate::Tx::heartbeat_writers`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatWriter {
    /// The server process: a new id at each start.
    pub writer_id: Uuid,
    /// Heartbeats waiting to be written at its last report: its write backlog, bounded by its
    /// `max_heartbeats_in_flight`.
    pub backlog: i64,
    /// Heartbeats it refused since it started.
    pub refused: i64,
    /// From its clean point (every heartbeat it received before was recorded in time or
    /// refused) to its last report: empty while it is clean, the trouble so far while not.
    pub in_doubt: std::ops::Range<DateTime<Utc>>,
}

impl HeartbeatWriter {
    /// Whether it has not reported for longer than [`WRITER_STALE`] by `now` (the
    /// database's clock): it may be gone without saying so, or cut off from the BMDB.
    pub fn is_stale(&self, now: DateTime<Utc>) -> bool {
        (now - self.in_doubt.end).to_std().unwrap_or_default() > WRITER_STALE
    }

    /// Whether, by `now`, it reported a trouble going on or stopped reporting.
    pub fn in_trouble(&self, now: DateTime<Utc>) -> bool {
        self.is_stale(now) || !self.in_doubt.is_empty()
    }
}

/// A window in which a server refused heartbeats or recorded them late.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeartbeatTrouble {
    /// The server process.
    pub writer_id: Uuid,
    /// From the arrival of the first heartbeat refused or recorded late (or, if earlier, the
    /// server's last clean report) to that of the last.
    pub window: std::ops::Range<DateTime<Utc>>,
    /// How many were refused; the others in the window were recorded late, and what they
    /// recorded stands.
    pub refused: i64,
    /// Why, as the server saw it.
    pub cause: String,
}

/// What one server says of the heartbeats it received.
#[derive(Debug, Clone)]
pub enum WriterState {
    /// Everything received was recorded in time.
    Clean,
    /// Heartbeats received since `since` ago were refused or are late, and it goes on.
    Trouble {
        /// How long ago the first of them arrived.
        since: std::time::Duration,
    },
    /// A trouble ended: heartbeats received from `since` ago to `last` ago were refused or
    /// recorded late; everything after was recorded in time.
    Ended {
        /// How long ago the first of them arrived.
        since: std::time::Duration,
        /// How long ago the last of them arrived.
        last: std::time::Duration,
        /// How many were refused.
        refused: i64,
        /// Why, as the server saw it (stored bounded).
        cause: String,
    },
}

/// One report of a server ([`Tx::report_heartbeat_writer`]).
#[derive(Debug, Clone)]
pub struct WriterReport {
    /// The server process, new at each start.
    pub writer_id: Uuid,
    /// Its component name, for operators.
    pub component: String,
    /// Heartbeats waiting to be written now.
    pub backlog: i64,
    /// Heartbeats refused since it started.
    pub refused: i64,
    /// How its writes went since the last report.
    pub state: WriterState,
}
