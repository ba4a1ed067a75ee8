//! Flattened views of machines for operators: one row of tags per machine (listings, the web
//! UI) and fleet-wide counts (statistics gauges). Read-only; the SQL is in `sql/views.rs`.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, Utc};
use uuid::Uuid;

use crate::{Error, InstallationResult, Process, Provided};

/// One machine's tags, as one row (what listings and the lifecycle state need).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MachineSummary {
    /// The machine.
    pub machine_id: Uuid,
    /// Its `machine_provided` tag.
    pub provided: Option<Provided>,
    /// When its agent was started, if it was.
    pub agent_started_at: Option<DateTime<Utc>>,
    /// Its last heartbeat.
    pub heartbeat_at: Option<DateTime<Utc>>,
    /// Processes holding work on it right now.
    pub work: Vec<Process>,
    /// The latest `until` among its backoffs still in the future, the recoverer's aside.
    pub backoff_until: Option<DateTime<Utc>>,
    /// The recoverer's backoff, if still in the future. It holds back another reboot, which
    /// a machine whose agent heartbeats does not need: it puts only a silent machine in
    /// backoff (a machine the recoverer just brought back heartbeats again).
    pub recovery_backoff_until: Option<DateTime<Utc>>,
    /// Generation of its OS installation request.
    pub request_generation: Option<i64>,
    /// Generation and result of its OS installation report.
    pub report: Option<(i64, InstallationResult)>,
    /// Whether an operator put it in maintenance.
    pub maintenance: bool,
}

/// A machine's place in its lifecycle, derived from its tags; the first that applies wins, in
/// the order of the variants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Lifecycle {
    /// An operator took it out of the loops' hands (work already running may still finish).
    Maintenance,
    /// Held by a loop right now.
    InWork,
    /// A loop waits before it acts on the machine again: after a failure, or while its
    /// provider deploys or reboots it. The recoverer's wait counts only while the agent does
    /// not heartbeat.
    InBackoff,
    /// Its current installation request was fulfilled successfully.
    Installed,
    /// An installation request waits for a report of its generation.
    Installing,
    /// The agent reported that its current installation request failed (or refused it).
    InstallFailed,
    /// Heartbeating, the last heartbeat within the stale threshold.
    Heartbeating,
    /// Heartbeated, but not within the stale threshold (the recoverer's silence threshold).
    Stale,
    /// Agent started, no heartbeat yet.
    AgentStarting,
    /// Provided, no agent yet.
    Provided,
    /// Known to the BMDB only (no `machine_provided` tag).
    Unprovided,
}

impl Lifecycle {
    /// Every state, in precedence order.
    pub const ALL: [Lifecycle; 11] = [
        Lifecycle::Maintenance,
        Lifecycle::InWork,
        Lifecycle::InBackoff,
        Lifecycle::Installed,
        Lifecycle::Installing,
        Lifecycle::InstallFailed,
        Lifecycle::Heartbeating,
        Lifecycle::Stale,
        Lifecycle::AgentStarting,
        Lifecycle::Provided,
        Lifecycle::Unprovided,
    ];

    /// The state's name for people ("agent starting").
    pub fn label(self) -> &'static str {
        match self {
            Lifecycle::Maintenance => "maintenance",
            Lifecycle::InWork => "in work",
            Lifecycle::InBackoff => "in backoff",
            Lifecycle::Installed => "installed",
            Lifecycle::Installing => "installing",
            Lifecycle::InstallFailed => "install failed",
            Lifecycle::Heartbeating => "heartbeating",
            Lifecycle::Stale => "stale",
            Lifecycle::AgentStarting => "agent starting",
            Lifecycle::Provided => "provided",
            Lifecycle::Unprovided => "unprovided",
        }
    }

    /// The state's name in URLs, flags and metric labels ("agent-starting").
    pub fn slug(self) -> &'static str {
        match self {
            Lifecycle::Maintenance => "maintenance",
            Lifecycle::InWork => "in-work",
            Lifecycle::InBackoff => "in-backoff",
            Lifecycle::Installed => "installed",
            Lifecycle::Installing => "installing",
            Lifecycle::InstallFailed => "install-failed",
            Lifecycle::Heartbeating => "heartbeating",
            Lifecycle::Stale => "stale",
            Lifecycle::AgentStarting => "agent-starting",
            Lifecycle::Provided => "provided",
            Lifecycle::Unprovided => "unprovided",
        }
    }
}

impl fmt::Display for Lifecycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

impl FromStr for Lifecycle {
    type Err = Error;

    /// Accepts the slug or the label ("agent-starting", "agent starting").
    fn from_str(s: &str) -> Result<Self, Error> {
        Lifecycle::ALL
            .into_iter()
            .find(|l| l.slug() == s || l.label() == s)
            .ok_or_else(|| Error::UnknownName {
                kind: "state",
                name: s.to_string(),
                known: Lifecycle::ALL.map(|l| l.slug()).join(", "),
            })
    }
}

impl MachineSummary {
    /// The report of the current installation request's generation: its result, or `None`
    /// while it waits for one; `None` as well when there is no request.
    pub fn installation_result(&self) -> Option<Option<InstallationResult>> {
        let generation = self.request_generation?;
        Some(
            self.report
                .filter(|(reported, _)| *reported == generation)
                .map(|(_, result)| result),
        )
    }

    /// Whether its last heartbeat is within `stale_after` of `now`.
    fn heartbeats(&self, now: DateTime<Utc>, stale_after: chrono::Duration) -> bool {
        self.heartbeat_at.is_some_and(|h| now - h <= stale_after)
    }

    /// Whether a backoff holds a loop back from it at `now`: any but the recoverer's, and the
    /// recoverer's only while the agent does not heartbeat (the reboot it holds back is not
    /// needed otherwise).
    fn held_back(&self, now: DateTime<Utc>, stale_after: chrono::Duration) -> bool {
        let active = |until: Option<DateTime<Utc>>| until.is_some_and(|u| u > now);
        active(self.backoff_until)
            || (active(self.recovery_backoff_until) && !self.heartbeats(now, stale_after))
    }

    /// The lifecycle state at `now` (the database's clock): a heartbeat older than
    /// `stale_after` (the recoverer's [`crate::RecoveryThresholds::stale_after`]) is stale.
    pub fn lifecycle(&self, now: DateTime<Utc>, stale_after: chrono::Duration) -> Lifecycle {
        if self.maintenance {
            Lifecycle::Maintenance
        } else if !self.work.is_empty() {
            Lifecycle::InWork
        } else if self.held_back(now, stale_after) {
            Lifecycle::InBackoff
        } else if let Some(result) = self.installation_result() {
            match result {
                Some(InstallationResult::Success) => Lifecycle::Installed,
                Some(InstallationResult::Error) => Lifecycle::InstallFailed,
                None => Lifecycle::Installing,
            }
        } else if self.heartbeat_at.is_some() {
            if self.heartbeats(now, stale_after) {
                Lifecycle::Heartbeating
            } else {
                Lifecycle::Stale
            }
        } else if self.agent_started_at.is_some() {
            Lifecycle::AgentStarting
        } else if self.provided.is_some() {
            Lifecycle::Provided
        } else {
            Lifecycle::Unprovided
        }
    }
}

/// Fleet-wide counts for the statistics gauges (design.md §12).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FleetCounts {
    /// Rows in `machines`.
    pub machines: i64,
    /// Machines with a `machine_provided` tag, per provider.
    pub provided: Vec<(crate::ProviderKind, i64)>,
    /// Machines whose agent was started.
    pub agent_started: i64,
    /// Machines whose last heartbeat is within the stale threshold asked for.
    pub heartbeating: i64,
    /// Machines that heartbeated, but not within the stale threshold asked for.
    pub stale: i64,
    /// Installation requests without a report of their generation (upstream's "pending").
    pub pending_install: i64,
    /// Installation requests with a report of their generation, whatever its result
    /// (upstream's "installed").
    pub installed: i64,
    /// Of `installed`, the requests whose report of their generation is an error.
    pub install_failed: i64,
    /// Active work rows per process.
    pub work: Vec<(Process, i64)>,
    /// Backoffs still in the future, per process.
    pub backoffs: Vec<(Process, i64)>,
    /// Machines an operator put in maintenance.
    pub maintenance: i64,
    /// Provider ids an operator decommissioned (and did not recommission).
    pub decommissioned: i64,
    /// Provided machines the provider no longer lists (status `Missing`).
    pub missing: i64,
}

impl FleetCounts {
    /// The counts as named series, as the overview's chart and its snapshots name them.
    pub fn series(&self) -> Vec<(&'static str, i64)> {
        let sum = |v: &[(Process, i64)]| v.iter().map(|(_, n)| n).sum::<i64>();
        vec![
            ("machines", self.machines),
            ("provided", self.provided.iter().map(|(_, n)| n).sum()),
            ("agent started", self.agent_started),
            ("heartbeating", self.heartbeating),
            ("stale", self.stale),
            ("installing", self.pending_install),
            ("installed", self.installed),
            ("in work", sum(&self.work)),
            ("in backoff", sum(&self.backoffs)),
            ("maintenance", self.maintenance),
            ("missing", self.missing),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALE: chrono::Duration = chrono::Duration::minutes(10);

    fn bare() -> MachineSummary {
        MachineSummary {
            machine_id: Uuid::nil(),
            provided: None,
            agent_started_at: None,
            heartbeat_at: None,
            work: vec![],
            backoff_until: None,
            recovery_backoff_until: None,
            request_generation: None,
            report: None,
            maintenance: false,
        }
    }

    #[test]
    fn lifecycle_precedence() {
        let now = Utc::now();
        let mut m = bare();
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Unprovided);
        m.provided = Some(Provided::new(crate::ProviderKind::Sim, "x"));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Provided);
        m.agent_started_at = Some(now);
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::AgentStarting);
        m.heartbeat_at = Some(now - STALE - chrono::Duration::seconds(1));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Stale);
        m.heartbeat_at = Some(now);
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Heartbeating);
        m.request_generation = Some(2);
        m.report = Some((1, InstallationResult::Success));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Installing);
        m.report = Some((2, InstallationResult::Error));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::InstallFailed);
        m.report = Some((2, InstallationResult::Success));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Installed);
        m.backoff_until = Some(now - chrono::Duration::seconds(1));
        assert_eq!(
            m.lifecycle(now, STALE),
            Lifecycle::Installed,
            "expired backoff"
        );
        m.backoff_until = Some(now + chrono::Duration::seconds(1));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::InBackoff);
        m.work = vec![Process::ShepherdRecovery];
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::InWork);
        m.maintenance = true;
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Maintenance);
    }

    /// A machine the recoverer rebooted is held back from another reboot for a while; once
    /// its agent heartbeats again it shows heartbeating, and in backoff only while silent.
    #[test]
    fn the_recoverers_backoff_shows_only_while_the_agent_is_silent() {
        let now = Utc::now();
        let mut m = bare();
        m.provided = Some(Provided::new(crate::ProviderKind::Sim, "x"));
        m.agent_started_at = Some(now);
        m.recovery_backoff_until = Some(now + chrono::Duration::minutes(1));
        m.heartbeat_at = Some(now);
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::Heartbeating);
        m.heartbeat_at = Some(now - STALE - chrono::Duration::seconds(1));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::InBackoff, "stale");
        m.heartbeat_at = None;
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::InBackoff, "silent");
        m.recovery_backoff_until = Some(now - chrono::Duration::seconds(1));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::AgentStarting, "expired");
        // Any other loop's backoff holds a heartbeating machine back as before.
        m.heartbeat_at = Some(now);
        m.backoff_until = Some(now + chrono::Duration::minutes(1));
        assert_eq!(m.lifecycle(now, STALE), Lifecycle::InBackoff);
    }

    #[test]
    fn lifecycle_names_round_trip() {
        for l in Lifecycle::ALL {
            assert_eq!(l.slug().parse::<Lifecycle>().unwrap(), l);
            assert_eq!(l.label().parse::<Lifecycle>().unwrap(), l);
        }
        let err = "asleep".parse::<Lifecycle>().unwrap_err().to_string();
        assert!(err.contains("agent-starting"), "{err}");
    }
}
