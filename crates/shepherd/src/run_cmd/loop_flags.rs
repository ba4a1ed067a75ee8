//! The flags of `shepherd run` that steer its loops: the provisioner, the initializer and the
//! agent it starts over SSH, the recoverer and its brake.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use shepherd_loops::brake::BrakeConfig;
use shepherd_loops::initializer::InitializerConfig;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::ProvisionerConfig;
use shepherd_loops::reconcile::Limits;
use shepherd_loops::recoverer::RepeatPolicy;
use shepherd_provider::metrics::CallMetrics;
use shepherd_provider::transport::SshTransport;
use shepherd_ssh::{load_or_generate_key, public_key_openssh, Auth, SshClient, SshConfig};

use crate::flags::{duration, ThresholdArgs};
use shepherd_loops::fleet::LoopSettings;

/// The provisioner.
#[derive(Debug, Clone, Args)]
pub struct ProvisionerArgs {
    /// Provisioner: most machines to manage (0 = no limit).
    #[arg(long, env = "SHEPHERD_PROVISIONER_MAX_MACHINES", default_value_t = 50)]
    pub provisioner_max_machines: usize,
    /// Provisioner: most machines created per reconciliation.
    #[arg(long, env = "SHEPHERD_PROVISIONER_CHUNK_SIZE", default_value_t = 20)]
    pub provisioner_chunk_size: usize,
    /// Provisioner: reconciliation rate, "DURATION,BURST".
    #[arg(
        long,
        env = "SHEPHERD_PROVISIONER_RECONCILE_RATE",
        default_value = "1m,1"
    )]
    pub provisioner_reconcile_rate: RateSpec,
    /// Provisioner: machine creation rate, "DURATION,BURST".
    #[arg(
        long,
        env = "SHEPHERD_PROVISIONER_CREATION_RATE",
        default_value = "5s,1"
    )]
    pub provisioner_creation_rate: RateSpec,
    /// Provisioner: most machine creations in flight at once. More fills a slow provider's
    /// pipeline (Ironic places allocations and deploys in the background); if the BMDB fails
    /// mid-pass, up to this many machines may have been created that it cannot yet record
    /// (a later pass adopts each).
    #[arg(long, env = "SHEPHERD_PROVISIONER_PARALLELISM", default_value_t = 1)]
    pub provisioner_parallelism: usize,
    /// Provisioner: how many machines the BMDB records may be gone from the provider's
    /// listing while the others are still provisioned, as a share of them (`10%`, and
    /// always one) or a count (`5`); more, or an empty listing, looks like a broken listing
    /// and stops every pass.
    #[arg(long, env = "SHEPHERD_PROVISIONER_MAX_MISSING", default_value = "10%")]
    pub provisioner_max_missing: shepherd_loops::reconcile::MissingAllowance,
}

impl ProvisionerArgs {
    pub(super) fn config(&self) -> Result<ProvisionerConfig> {
        if self.provisioner_chunk_size == 0 {
            bail!("provisioner-chunk-size: must be at least 1");
        }
        if !(1..=64).contains(&self.provisioner_parallelism) {
            bail!("provisioner-parallelism: must be 1 to 64");
        }
        let mut limits = Limits::new(self.provisioner_max_machines, self.provisioner_chunk_size);
        limits.max_missing = self.provisioner_max_missing;
        Ok(ProvisionerConfig {
            limits,
            reconcile_rate: self.provisioner_reconcile_rate,
            creation_rate: self.provisioner_creation_rate,
            creation_parallelism: self.provisioner_parallelism,
        })
    }
}

/// The initializer and the agent it starts.
#[derive(Debug, Clone, Args)]
pub struct InitializerArgs {
    /// Initializer: parallel workers.
    #[arg(long, env = "SHEPHERD_INITIALIZER_PARALLELISM", default_value_t = 1)]
    pub initializer_parallelism: usize,
    /// Initializer: BMDB query rate, "DURATION,BURST".
    #[arg(long, env = "SHEPHERD_INITIALIZER_DB_RATE", default_value = "250ms,8")]
    pub initializer_db_rate: RateSpec,
    /// Agent executable uploaded to each machine (not needed with the sim provider).
    #[arg(long, env = "SHEPHERD_AGENT_EXECUTABLE")]
    pub agent_executable: Option<PathBuf>,
    /// Where the agent is put on the machine.
    #[arg(
        long,
        env = "SHEPHERD_AGENT_TARGET_PATH",
        default_value = "/root/agent"
    )]
    pub agent_target_path: String,
    /// BMaaS endpoint agents heartbeat to (required).
    #[arg(long, env = "SHEPHERD_AGENT_ENDPOINT")]
    pub agent_endpoint: Option<String>,
    /// PEM file of the CA that signs the BMaaS server's certificate.
    #[arg(long, env = "SHEPHERD_AGENT_CA")]
    pub agent_ca: Option<PathBuf>,
}

impl InitializerArgs {
    /// The initializer's settings, with the agent's bytes and the CA certificate (DER) read.
    pub(super) fn config(
        &self,
        agent: Vec<u8>,
        ca: Option<Vec<u8>>,
        exec_timeout: Duration,
    ) -> Result<InitializerConfig> {
        let endpoint = self
            .agent_endpoint
            .clone()
            .filter(|e| !e.trim().is_empty())
            .context("agent-endpoint: is required (the BMaaS address agents heartbeat to)")?;
        let mut initializer = InitializerConfig::new(agent, endpoint);
        initializer.target_path = self.agent_target_path.clone();
        initializer.ca_certificate = ca;
        initializer.exec_timeout = exec_timeout;
        initializer.validate()?;
        Ok(initializer)
    }

    pub(super) fn loop_settings(&self) -> LoopSettings {
        LoopSettings {
            parallelism: self.initializer_parallelism.max(1),
            db_rate: self.initializer_db_rate,
        }
    }
}

/// The recoverer.
#[derive(Debug, Clone, Args)]
pub struct RecovererArgs {
    /// Recoverer: parallel workers.
    #[arg(long, env = "SHEPHERD_RECOVERER_PARALLELISM", default_value_t = 1)]
    pub recoverer_parallelism: usize,
    /// Recoverer: BMDB query rate, "DURATION,BURST".
    #[arg(long, env = "SHEPHERD_RECOVERER_DB_RATE", default_value = "250ms,8")]
    pub recoverer_db_rate: RateSpec,
    /// Recoverer thresholds (also what views call stale).
    #[command(flatten)]
    pub thresholds: ThresholdArgs,
    /// Recoverer: stop rebooting while more than this share of the provider's machines have
    /// no recent heartbeat at once (the server or the network is the likelier cause).
    #[arg(long, env = "SHEPHERD_RECOVERY_BRAKE_SHARE", default_value_t = 0.5)]
    pub recovery_brake_share: f64,
    /// Recoverer: ... and at least this many have none (small fleets still recover). Also the
    /// most reboots between two counts of the brake.
    #[arg(long, env = "SHEPHERD_RECOVERY_BRAKE_MIN_SILENT", default_value_t = 5)]
    pub recovery_brake_min_silent: i64,
    /// Recoverer: how often the brake counts the machines due for recovery.
    #[arg(long, env = "SHEPHERD_RECOVERY_BRAKE_INTERVAL", default_value = "30s", value_parser = duration)]
    pub recovery_brake_interval: Duration,
    /// Recoverer: when a reboot did not bring a machine's agent back, wait this long (on top
    /// of the thresholds) before rebooting it again, doubling per further reboot up to 24 h.
    #[arg(long, env = "SHEPHERD_RECOVERY_REPEAT_BACKOFF", default_value = "1h", value_parser = duration)]
    pub recovery_repeat_backoff: Duration,
    /// Recoverer: leave a machine alone after this many reboots in a row without its agent
    /// heartbeating, until an operator runs `shepherd machines retry` (0: never give up).
    #[arg(long, env = "SHEPHERD_RECOVERY_GIVE_UP_AFTER", default_value_t = 6)]
    pub recovery_give_up_after: u32,
}

impl RecovererArgs {
    pub(super) fn brake(&self) -> Result<BrakeConfig> {
        let brake = BrakeConfig {
            max_silent_share: self.recovery_brake_share,
            min_silent: self.recovery_brake_min_silent,
            interval: self.recovery_brake_interval,
        };
        brake.validate()?;
        Ok(brake)
    }

    pub(super) fn repeat(&self) -> Result<RepeatPolicy> {
        let repeat =
            RepeatPolicy::doubling_from(self.recovery_repeat_backoff, self.recovery_give_up_after);
        repeat.validate()?;
        Ok(repeat)
    }

    pub(super) fn loop_settings(&self) -> LoopSettings {
        LoopSettings {
            parallelism: self.recoverer_parallelism.max(1),
            db_rate: self.recoverer_db_rate,
        }
    }
}

/// How the initializer reaches machines.
#[derive(Debug, Clone, Args)]
pub struct SshArgs {
    /// SSH: connect (TCP + handshake + auth) timeout.
    #[arg(long, env = "SHEPHERD_SSH_CONNECT_TIMEOUT", default_value = "2s", value_parser = duration)]
    pub ssh_connect_timeout: Duration,
    /// SSH: bound on connect + upload + run of the agent.
    #[arg(long, env = "SHEPHERD_SSH_EXEC_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub ssh_exec_timeout: Duration,
    /// SSH: ed25519 private key; generated (mode 0400) if missing. Required unless a password is set.
    #[arg(long, env = "SHEPHERD_SSH_KEY")]
    pub ssh_key: Option<PathBuf>,
    /// SSH: remote user.
    #[arg(long, env = "SHEPHERD_SSH_USER", default_value = "root")]
    pub ssh_user: String,
    /// SSH: password (prefer the environment variable or config file over the command line).
    #[arg(long, env = "SHEPHERD_SSH_PASSWORD", hide_env_values = true)]
    pub ssh_password: Option<String>,
    /// SSH: most handshakes in flight at once.
    #[arg(long, env = "SHEPHERD_SSH_MAX_HANDSHAKES", default_value_t = 8)]
    pub ssh_max_handshakes: usize,
}

impl SshArgs {
    /// The SSH client, and the public key line of its key (if it uses one).
    pub(super) fn client(&self) -> Result<(SshClient, Option<String>)> {
        let mut public = None;
        let auth = match (&self.ssh_key, &self.ssh_password) {
            (Some(path), _) => {
                let key = load_or_generate_key(path)?;
                let line = public_key_openssh(&key);
                tracing::info!(public_key = %line, "SSH key loaded; machines must trust it");
                public = Some(line);
                Auth::Key(Arc::new(key))
            }
            (None, Some(pw)) if !pw.is_empty() => Auth::Password(pw.clone()),
            _ => bail!("ssh-key: is required unless ssh-password is set"),
        };
        let mut config = SshConfig::new(auth);
        config.user = self.ssh_user.clone();
        config.connect_timeout = self.ssh_connect_timeout;
        config.max_handshakes = self.ssh_max_handshakes.max(1);
        Ok((SshClient::new(config), public))
    }

    /// The SSH transport agents are started through, its calls counted in `metrics`, and the
    /// public key line of its key (if it uses one).
    pub(super) fn transport(
        &self,
        metrics: &Arc<CallMetrics>,
    ) -> Result<(Arc<SshTransport>, Option<String>)> {
        let (ssh, public_key) = self.client()?;
        let transport = SshTransport::new(Arc::new(ssh)).with_metrics(metrics.clone());
        Ok((Arc::new(transport), public_key))
    }
}
