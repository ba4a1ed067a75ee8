//! The subcommands of `shepherd machines` and who runs an operator action, as flags.

use crate::flags::ThresholdArgs;
use anyhow::Result;
use clap::Subcommand;
use shepherd_bmdb::{Lifecycle, Operator, Process};
use uuid::Uuid;

fn parse_state(s: &str) -> Result<Lifecycle, String> {
    s.parse().map_err(|e: shepherd_bmdb::Error| e.to_string())
}

/// Subcommands of `shepherd machines`.
#[derive(Debug, Subcommand)]
pub enum MachinesCommand {
    /// One line per machine, in machine-id order.
    List {
        /// Only machines of this provider (e.g. Static, Sim).
        #[arg(long)]
        provider: Option<String>,
        /// Only machines in this state (provided, agent-starting, heartbeating, stale,
        /// in-backoff, in-work, installing, installed, unprovided).
        #[arg(long, value_parser = parse_state)]
        state: Option<Lifecycle>,
        /// Start after this machine id (paging).
        #[arg(long)]
        after: Option<Uuid>,
        /// Most machines to show.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// The recoverer's thresholds (what counts as stale).
        #[command(flatten)]
        thresholds: ThresholdArgs,
    },
    /// Every tag of one machine, its work, backoffs and history.
    Show {
        /// Machine id.
        id: Uuid,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
        /// The recoverer's thresholds (what counts as stale).
        #[command(flatten)]
        thresholds: ThresholdArgs,
    },
    /// The work history of one machine.
    History {
        /// Machine id.
        id: Uuid,
    },
    /// Ends the machine's backoffs now, so the loops may take it again at once: after a
    /// machine was left alone by the recoverer, or once a failure's cause is fixed.
    Retry {
        /// Machine id.
        id: Uuid,
        /// Only this process's backoff (ShepherdAccess, ShepherdAgentStart, ShepherdRecovery).
        #[arg(long)]
        process: Option<Process>,
        /// Who and why, for the history.
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Forgets the machine's pinned SSH host key, after the operator checked that it changed
    /// legitimately (the machine was reinstalled): the next takeover pins the key it finds,
    /// and the takeover's backoff ends now.
    ForgetHostKey {
        /// Machine id.
        id: Uuid,
        /// Who and why, for the history.
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Takes a machine out of the loops' hands (`on`) or gives it back (`off`). In
    /// maintenance no loop claims it (work already running finishes); the updater still
    /// refreshes its facts and its agent still heartbeats.
    Maintenance {
        /// `on` or `off`.
        switch: Switch,
        /// Machine id.
        id: Uuid,
        /// Who and why, for the history (`on` needs a reason).
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Removes a machine from the BMDB: its tags, locks and backoffs go, its history stays, and
    /// the provisioner does not bring its provider id back until `recommission`. The
    /// provisioner hands it back to its provider where the provider knows how (Ironic: the
    /// node's reservation is released).
    Decommission {
        /// Machine id.
        id: Uuid,
        /// Also tear the machine down at its provider (Ironic: undeploy the node, so Ironic
        /// cleans it), not only release it. Its disks are lost.
        #[arg(long)]
        undeploy: bool,
        /// Who and why, for the history (a reason is needed).
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Undoes `decommission`: the provisioner may bring the provider id back, as a new machine.
    Recommission {
        /// The decommissioned machine's id.
        id: Uuid,
        /// Who and why, for the history.
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Asks the machine's agent to install an OS image (the next heartbeat response carries
    /// the request; the generation is bumped so a new request is never mistaken for an old one).
    Install {
        /// Machine id.
        id: Uuid,
        /// Where the agent downloads the image from (http or https).
        #[arg(long)]
        image: String,
        /// SHA-256 of the image, 64 hex digits; the agent refuses anything else.
        #[arg(long)]
        sha256: String,
        /// Block device (or file) the agent writes the image to.
        #[arg(long)]
        device: String,
        /// The device may be overwritten although it holds a partition table or a file system
        /// (without it the agent writes only a blank device and reports what it found).
        #[arg(long)]
        wipe: bool,
        /// Who asks, and why (recorded in the machine's operators' history).
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Sends a machine that came bare back to its live environment: its BMC boots it from the
    /// live image and its inventory entry's OS image is installed again (admin). Needs a
    /// reason.
    Reimage {
        /// Machine id.
        id: Uuid,
        /// Its disk may be overwritten although it holds an OS (it does, once installed);
        /// recorded as who allowed the wipe.
        #[arg(long)]
        wipe: bool,
        /// Who asks, and why (recorded in the machine's operators' history).
        #[command(flatten)]
        who: WhoArgs,
    },
}

/// `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// Begin.
    On,
    /// End.
    Off,
}

/// Who runs an operator action and why, kept in the machine's history.
#[derive(Debug, Clone, clap::Args)]
pub struct WhoArgs {
    /// Who does this (default: the login name from `USER` or `LOGNAME`).
    #[arg(long)]
    pub(super) by: Option<String>,
    /// Why.
    #[arg(long)]
    pub(super) reason: Option<String>,
}

impl WhoArgs {
    /// The operator on the database: `--by`, else the login name, else the user id.
    pub(super) fn operator(&self) -> Result<Operator> {
        // Without --by or a login name in the environment (a cron job, a container), the
        // user id still says who.
        let by = self.by.clone().unwrap_or_else(|| {
            ["USER", "LOGNAME"]
                .iter()
                .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
                .unwrap_or_else(|| {
                    use std::os::unix::fs::MetadataExt;
                    std::fs::metadata("/proc/self")
                        .map(|m| format!("uid {}", m.uid()))
                        .unwrap_or_else(|_| "unknown".into())
                })
        });
        let reason = self.reason.clone().unwrap_or_default();
        Ok(Operator::new(by, reason)?)
    }
}
