//! Flags that more than one subcommand takes: the duration parser and the recoverer's
//! thresholds, which also decide what the web UI, `machines` and the fleet gauges call stale, so
//! that every process of a site says "stale" about the machines its recoverer would reboot.

use std::time::Duration;

use clap::Args;
use shepherd_bmdb::RecoveryThresholds;

/// Parses a human duration (`500ms`, `2s`, `5m`, `1h`).
pub(crate) fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("{e} (want e.g. 500ms, 2s, 5m)"))
}

/// When the recoverer counts an agent as lost (design.md §9).
#[derive(Debug, Clone, Args)]
pub struct ThresholdArgs {
    /// Recoverer: reboot when an agent never heartbeated this long after its start.
    #[arg(long, env = "SHEPHERD_RECOVERY_NO_HEARTBEAT_AFTER", default_value = "30m", value_parser = duration)]
    pub recovery_no_heartbeat_after: Duration,
    /// Recoverer: reboot when the last heartbeat is older than this. Views and gauges call
    /// such a machine stale.
    #[arg(long, env = "SHEPHERD_RECOVERY_HEARTBEAT_OLDER_THAN", default_value = "10m", value_parser = duration)]
    pub recovery_heartbeat_older_than: Duration,
}

impl ThresholdArgs {
    /// The thresholds these flags set.
    pub fn thresholds(&self) -> RecoveryThresholds {
        RecoveryThresholds {
            no_heartbeat_after_start: self.recovery_no_heartbeat_after,
            heartbeat_older_than: self.recovery_heartbeat_older_than,
        }
    }
}

/// What every long-running process (`run`, `server`) takes besides its own work: its
/// configuration file, whether it migrates the BMDB, and how often it checks the schema,
/// refreshes the fleet statistics and judges its background tasks.
#[derive(Debug, Clone, Args)]
pub struct ProcessArgs {
    /// TOML file whose keys are these flags' names; flags and environment variables win.
    #[arg(long, env = "SHEPHERD_CONFIG")]
    pub config: Option<std::path::PathBuf>,
    /// Apply pending BMDB migrations at start-up.
    #[arg(long, env = "SHEPHERD_MIGRATE")]
    pub migrate: bool,
    /// How often the fleet statistics gauges are recomputed from the BMDB.
    #[arg(long, env = "SHEPHERD_STATS_INTERVAL", default_value = "30s", value_parser = duration)]
    pub stats_interval: Duration,
    /// How often the BMDB's schema is checked while running: a migration that no longer admits
    /// this binary stops it cleanly (see deploy/README.md, Upgrades).
    #[arg(long, env = "SHEPHERD_SCHEMA_CHECK_INTERVAL", default_value = "30s", value_parser = duration)]
    pub schema_check_interval: Duration,
    /// A background task (provisioner, updater, retention, fleet statistics) that has gone
    /// this long without a successful pass is stale: the `/tasks` page marks it and the
    /// `ShepherdTaskStale` alert fires.
    #[arg(long, env = "SHEPHERD_TASK_STALE_AFTER", default_value = "1h", value_parser = duration)]
    pub task_stale_after: Duration,
    /// Serve the web UI and `/metrics`, which ask no one who they are, on an address other
    /// than loopback (a management network, behind a firewall). Without it, such an address
    /// is refused at start-up.
    #[arg(long, env = "SHEPHERD_INSECURE_WEB_LISTEN")]
    pub insecure_web_listen: bool,
}

impl ProcessArgs {
    /// Refuses to serve the unauthenticated web UI and `/metrics` on `addr` (the flag named
    /// `setting`) unless it is a loopback address or `--insecure-web-listen` says so.
    pub fn check_web_listen(
        &self,
        setting: &str,
        addr: std::net::SocketAddr,
    ) -> anyhow::Result<()> {
        if addr.ip().is_loopback() || self.insecure_web_listen {
            return Ok(());
        }
        anyhow::bail!(
            "{setting}: {addr} is not loopback, and the web UI and /metrics there ask no one who \
             they are; keep it on 127.0.0.1, or pass --insecure-web-listen to serve them on a \
             network you trust"
        )
    }
    /// The process's task registry, judged as these flags say.
    pub fn tasks(&self) -> shepherd_tasks::Tasks {
        shepherd_tasks::Tasks::new(self.task_stale_after)
    }
}
