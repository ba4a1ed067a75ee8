//! Which machines a process may claim (design.md §5). The SQL of each rule is in `sql/claims.rs`;
//! this is the engine-neutral description of the rule and its parameters.

use std::time::Duration;

use crate::{Process, ProviderKind};

/// When a started agent counts as lost and the machine becomes eligible for recovery.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RecoveryThresholds {
    /// The agent never heartbeated and was started longer ago than this.
    pub no_heartbeat_after_start: Duration,
    /// The last heartbeat is older than this.
    pub heartbeat_older_than: Duration,
}

impl Default for RecoveryThresholds {
    /// Upstream's defaults: 30 minutes without a first heartbeat, or 10 minutes of silence.
    fn default() -> Self {
        RecoveryThresholds {
            no_heartbeat_after_start: Duration::from_secs(30 * 60),
            heartbeat_older_than: Duration::from_secs(10 * 60),
        }
    }
}

impl RecoveryThresholds {
    /// How old a last heartbeat must be for operators' views and gauges to call the machine
    /// stale: the same silence after which the recoverer reboots it.
    pub fn stale_after(&self) -> chrono::Duration {
        chrono::Duration::from_std(self.heartbeat_older_than).unwrap_or(chrono::Duration::MAX)
    }
}

/// How long each wait of a bare machine may last before the bare-metal loop acts on it: the
/// live environment's takeover, the installation, the installed OS's first heartbeat.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BareTimeouts {
    /// From the power-on into the live environment to its agent's takeover: the server's
    /// firmware, the live image's boot over the BMC's virtual media, the takeover.
    pub live_boot: Duration,
    /// From the installation request to the agent's report.
    pub install: Duration,
    /// From the boot of the installed OS to its agent's first heartbeat.
    pub disk_boot: Duration,
}

impl BareTimeouts {
    /// 15 minutes for a live boot (a server's firmware alone may take five), an hour for an
    /// installation, 30 minutes for the installed OS.
    pub const DEFAULT: BareTimeouts = BareTimeouts {
        live_boot: Duration::from_secs(15 * 60),
        install: Duration::from_secs(3600),
        disk_boot: Duration::from_secs(30 * 60),
    };
}

impl Default for BareTimeouts {
    fn default() -> Self {
        BareTimeouts::DEFAULT
    }
}

/// A rule selecting machines in a state a process can act on.
///
/// Every rule also requires, for the claiming process: no active work of any process in its
/// [`Process::exclusion_set`], no active backoff of that process, and the machine not in
/// maintenance.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retrieval {
    /// Provided by `provider`, agent not started, and no fulfilled-or-pending installation
    /// blocking it (no request, or a request whose generation differs from the report's).
    AgentStart {
        /// Only machines of this provider.
        provider: ProviderKind,
    },
    /// Provided by `provider`, agent started, no successful installation for the current
    /// request, and the agent never heartbeated or stopped heartbeating (see thresholds).
    AgentRecovery {
        /// Only machines of this provider.
        provider: ProviderKind,
        /// When an agent counts as lost.
        thresholds: RecoveryThresholds,
    },
    /// Provided by `provider`, bare, and at a step the bare-metal loop takes: a phase that
    /// is its own to finish (`Bare`, `Inserting`, `StartingLive`, `Ejecting`, `StartingDisk`), or a wait that
    /// ended (the live environment taken over, the installation reported, the installed OS
    /// heartbeating) or ran out (see [`BareTimeouts`]).
    BareMetal {
        /// Only machines of this provider.
        provider: ProviderKind,
        /// When a wait runs out.
        timeouts: BareTimeouts,
    },
}

impl Retrieval {
    /// The process that claims machines by this rule: the initializer's takeover, the
    /// recoverer's reboot.
    pub fn process(&self) -> crate::Process {
        match self {
            Retrieval::AgentStart { .. } => crate::Process::ShepherdAgentStart,
            Retrieval::AgentRecovery { .. } => crate::Process::ShepherdRecovery,
            Retrieval::BareMetal { .. } => crate::Process::ShepherdBareMetal,
        }
    }

    /// The processor label of the loop that claims by this rule.
    pub fn processor(&self) -> crate::Processor {
        match self {
            Retrieval::AgentStart { .. } => crate::Processor::ShepherdInitializer,
            Retrieval::AgentRecovery { .. } => crate::Processor::ShepherdRecoverer,
            Retrieval::BareMetal { .. } => crate::Processor::ShepherdBareMetal,
        }
    }

    /// The provider the rule is scoped to.
    pub fn provider(&self) -> ProviderKind {
        match self {
            Retrieval::AgentStart { provider }
            | Retrieval::AgentRecovery { provider, .. }
            | Retrieval::BareMetal { provider, .. } => *provider,
        }
    }
}

/// SQL list literal of a process's exclusion set, e.g. `'A', 'B'`. Values come from the
/// closed [`Process`] enumeration, so inlining them is safe and lets statements be cached.
pub(crate) fn exclusion_list(process: Process) -> String {
    process
        .exclusion_set()
        .iter()
        .map(|p| format!("'{}'", p.as_str()))
        .collect::<Vec<_>>()
        .join(", ")
}
