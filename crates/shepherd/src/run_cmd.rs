//! `shepherd run`: the provisioner, initializer and recoverer against a real provider.
//! Every setting is a flag, an environment variable (`SHEPHERD_` + the flag in upper snake
//! case) and a config-file key (the flag name); see `config_file.rs` for precedence.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use shepherd_bmdb::{Bmdb, HistoryRetention, OpenOptions, Provider as ProviderKind};
use shepherd_equinix::{Client, EquinixConfig, EquinixProvider, RetryPolicy};
use shepherd_ironic::{Auth as IronicAuth, IronicConfig, IronicProvider};
use shepherd_loops::brake::{BrakeConfig, BrakeMetrics};
use shepherd_loops::initializer::InitializerConfig;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::ProvisionerConfig;
use shepherd_loops::reconcile::Limits;
use shepherd_loops::recoverer::{failed_reboot_backoff, RecovererMetrics, RepeatPolicy};
use shepherd_loops::retention::Retention;
use shepherd_provider::metrics::{CallMetrics, InstrumentedProvider};
use shepherd_provider::static_provider::StaticProvider;
use shepherd_provider::transport::{SshTransport, Transport};
use shepherd_provider::Recoverer;
use shepherd_sim::{SimFleet, SimKnobs};
use shepherd_ssh::{load_or_generate_key, public_key_openssh, Auth, SshClient, SshConfig};

use crate::flags::{duration, ThresholdArgs};
use crate::fleet::shutdown_on_signals;
use shepherd_loops::fleet::{run_loops, FleetSettings, LoopSettings};

/// Where machines come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ProviderChoice {
    /// A JSON inventory (`--static-inventory`).
    Static,
    /// Equinix Metal hardware reservations (`--equinix-*`; the service closed on 2026-06-30).
    Equinix,
    /// OpenStack Ironic's available nodes (`--ironic-*`).
    Ironic,
    /// An in-process simulated fleet (`--sim-machines`).
    Sim,
}

/// Provider type recorded for machines of a static inventory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StaticKind {
    /// `Static`.
    Static,
    /// `Lumen`.
    Lumen,
    /// `Equinix`.
    Equinix,
    /// `None`.
    None,
}

impl From<StaticKind> for ProviderKind {
    fn from(k: StaticKind) -> Self {
        match k {
            StaticKind::Static => ProviderKind::Static,
            StaticKind::Lumen => ProviderKind::Lumen,
            StaticKind::Equinix => ProviderKind::Equinix,
            StaticKind::None => ProviderKind::None,
        }
    }
}

/// Settings of `shepherd run` (SPEC §17), grouped by the part of Shepherd they steer.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Configuration, migration, schema checks, statistics and background tasks.
    #[command(flatten)]
    pub process: crate::flags::ProcessArgs,
    /// Where machines come from.
    #[command(flatten)]
    pub source: SourceArgs,
    /// The simulated fleet of `--provider sim`.
    #[command(flatten)]
    pub sim: SimArgs,
    /// The provisioner.
    #[command(flatten)]
    pub provisioner: ProvisionerArgs,
    /// The initializer and the agent it starts.
    #[command(flatten)]
    pub initializer: InitializerArgs,
    /// The recoverer.
    #[command(flatten)]
    pub recoverer: RecovererArgs,
    /// How the initializer reaches machines.
    #[command(flatten)]
    pub ssh: SshArgs,
    /// The Equinix Metal provider.
    #[command(flatten)]
    pub equinix: EquinixArgs,
    /// The OpenStack Ironic provider.
    #[command(flatten)]
    pub ironic: IronicArgs,
    /// BMCs of a static inventory.
    #[command(flatten)]
    pub bmc: BmcArgs,
    /// Machines of a static inventory that come bare.
    #[command(flatten)]
    pub bare: crate::bare_flags::BareArgs,
    /// Where `/metrics` (Prometheus text format) and the web UI are served; port 0 picks a
    /// free port.
    #[arg(
        long,
        env = "SHEPHERD_METRICS_LISTEN",
        default_value = "127.0.0.1:9464"
    )]
    pub metrics_listen: std::net::SocketAddr,
    /// Pace of the updater, which refreshes address, location, status and reservation of every
    /// machine from one provider listing and marks vanished machines Missing.
    #[arg(long, env = "SHEPHERD_UPDATER_RATE", default_value = "5m,1")]
    pub updater_rate: RateSpec,
    /// BMDB session keep-alive interval.
    #[arg(long, env = "SHEPHERD_SESSION_INTERVAL", default_value = "5s", value_parser = duration)]
    pub session_interval: Duration,
    /// How long work history is kept (e.g. 90d); Failed entries and operators' actions are
    /// kept four times as long. Pruned every 10 minutes in batches of 1,000. Left out, history
    /// is kept forever.
    #[arg(long, env = "SHEPHERD_HISTORY_RETENTION", value_parser = duration)]
    pub history_retention: Option<Duration>,
    /// How long a web UI sign-in's token is kept after it expired or was revoked (then the
    /// retention task deletes it; tokens made by name are never deleted).
    #[arg(long, env = "SHEPHERD_TOKEN_RETENTION", default_value = "30d", value_parser = duration)]
    pub token_retention: Duration,
    /// How long the security audit trail (sign-ins, tokens made and revoked, refused
    /// requests) is kept; then the retention task deletes the oldest events.
    #[arg(long, env = "SHEPHERD_AUDIT_RETENTION", default_value = "90d", value_parser = duration)]
    pub audit_retention: Duration,
}

/// Where machines come from.
#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    /// Where machines come from.
    #[arg(long, env = "SHEPHERD_PROVIDER", value_enum, default_value = "static")]
    pub provider: ProviderChoice,
    /// Static provider: inventory URL (file:// or http(s)://).
    #[arg(long, env = "SHEPHERD_STATIC_INVENTORY")]
    pub static_inventory: Option<String>,
    /// Static provider: provider type recorded for its machines.
    #[arg(
        long,
        env = "SHEPHERD_STATIC_PROVIDER_TYPE",
        value_enum,
        default_value = "static"
    )]
    pub static_provider_type: StaticKind,
}

/// The simulated fleet of `--provider sim`.
#[derive(Debug, Clone, Args)]
pub struct SimArgs {
    /// Sim provider: fleet size.
    #[arg(long, env = "SHEPHERD_SIM_MACHINES", default_value_t = 1000)]
    pub sim_machines: usize,
    /// Sim provider: probability an SSH connection fails.
    #[arg(long, env = "SHEPHERD_SIM_CONNECT_FAILURE_RATE", default_value_t = 0.0)]
    pub sim_connect_failure_rate: f64,
    /// Sim provider: probability an agent answers garbage.
    #[arg(long, env = "SHEPHERD_SIM_BAD_AGENT_RATE", default_value_t = 0.0)]
    pub sim_bad_agent_rate: f64,
    /// Sim provider: probability an agent never heartbeats.
    #[arg(long, env = "SHEPHERD_SIM_SILENT_AGENT_RATE", default_value_t = 0.0)]
    pub sim_silent_agent_rate: f64,
    /// Sim provider: time one takeover takes.
    #[arg(long, env = "SHEPHERD_SIM_TAKEOVER_TIME", default_value = "100ms", value_parser = duration)]
    pub sim_takeover_time: Duration,
    /// Sim provider: how often each simulated agent heartbeats (real agents: 30 s).
    #[arg(long, env = "SHEPHERD_SIM_HEARTBEAT_INTERVAL", default_value = "30s", value_parser = duration)]
    pub sim_heartbeat_interval: Duration,
    /// Sim provider: the machines exist already and the BMDB records them as provided (as
    /// after a restart): nothing is left to provision.
    #[arg(long, env = "SHEPHERD_SIM_DEPLOYED")]
    pub sim_deployed: bool,
}

impl SimArgs {
    fn knobs(&self) -> SimKnobs {
        SimKnobs {
            connect_failure: self.sim_connect_failure_rate,
            bad_agent: self.sim_bad_agent_rate,
            silent_agent: self.sim_silent_agent_rate,
            takeover_time: self.sim_takeover_time,
            heartbeat_interval: self.sim_heartbeat_interval,
            deployed: self.sim_deployed,
            ..SimKnobs::default()
        }
    }
}

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
    fn config(&self) -> Result<ProvisionerConfig> {
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
    fn config(
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

    fn loop_settings(&self) -> LoopSettings {
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
    fn brake(&self) -> Result<BrakeConfig> {
        let brake = BrakeConfig {
            max_silent_share: self.recovery_brake_share,
            min_silent: self.recovery_brake_min_silent,
            interval: self.recovery_brake_interval,
        };
        brake.validate()?;
        Ok(brake)
    }

    fn repeat(&self) -> Result<RepeatPolicy> {
        let repeat =
            RepeatPolicy::doubling_from(self.recovery_repeat_backoff, self.recovery_give_up_after);
        repeat.validate()?;
        Ok(repeat)
    }

    fn loop_settings(&self) -> LoopSettings {
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
    fn client(&self) -> Result<(SshClient, Option<String>)> {
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
    fn transport(&self, metrics: &Arc<CallMetrics>) -> Result<(Arc<SshTransport>, Option<String>)> {
        let (ssh, public_key) = self.client()?;
        let transport = SshTransport::new(Arc::new(ssh)).with_metrics(metrics.clone());
        Ok((Arc::new(transport), public_key))
    }
}

/// The Equinix Metal provider.
#[derive(Debug, Clone, Args)]
pub struct EquinixArgs {
    /// Equinix Metal: API base URL.
    #[arg(
        long,
        env = "SHEPHERD_EQUINIX_API_URL",
        default_value = "https://api.equinix.com/metal/v1"
    )]
    pub equinix_api_url: String,
    /// Equinix Metal: API token (prefer the environment variable; never logged).
    #[arg(long, env = "SHEPHERD_EQUINIX_API_TOKEN", hide_env_values = true)]
    pub equinix_api_token: Option<String>,
    /// Equinix Metal: project id.
    #[arg(long, env = "SHEPHERD_EQUINIX_PROJECT_ID")]
    pub equinix_project_id: Option<String>,
    /// Equinix Metal: hostname prefix of devices Shepherd owns.
    #[arg(
        long,
        env = "SHEPHERD_EQUINIX_DEVICE_PREFIX",
        default_value = "shepherd-"
    )]
    pub equinix_device_prefix: String,
    /// Equinix Metal: operating system of new devices.
    #[arg(long, env = "SHEPHERD_EQUINIX_OS", default_value = "ubuntu_20_04")]
    pub equinix_os: String,
    /// Equinix Metal: label of the project SSH key Shepherd keeps up to date.
    #[arg(
        long,
        env = "SHEPHERD_EQUINIX_SSH_KEY_LABEL",
        default_value = "shepherd"
    )]
    pub equinix_ssh_key_label: String,
    /// Equinix Metal: how long a hardware reservation listing is reused.
    #[arg(long, env = "SHEPHERD_EQUINIX_RESERVATION_CACHE", default_value = "5m", value_parser = duration)]
    pub equinix_reservation_cache: Duration,
    /// Equinix Metal: how long the recoverer waits after asking for a reboot.
    #[arg(long, env = "SHEPHERD_EQUINIX_REBOOT_WAIT", default_value = "30s", value_parser = duration)]
    pub equinix_reboot_wait: Duration,
}

impl EquinixArgs {
    /// The Equinix client and provider settings (the SSH public key becomes the project key).
    fn client(
        &self,
        public_key: Option<String>,
        metrics: Arc<CallMetrics>,
    ) -> Result<(Client, EquinixConfig)> {
        let token = self
            .equinix_api_token
            .as_deref()
            .filter(|t| !t.is_empty())
            .context("equinix-api-token: is required with --provider equinix")?;
        let project = self
            .equinix_project_id
            .as_deref()
            .context("equinix-project-id: is required with --provider equinix")?;
        let client = Client::new(
            &self.equinix_api_url,
            token,
            project,
            RetryPolicy::default(),
            metrics,
        )
        .context("equinix-api-url")?;
        let key = public_key.context(
            "ssh-key: --provider equinix needs a key (its public half becomes the project SSH key)",
        )?;
        let mut config = EquinixConfig::new(&self.equinix_device_prefix, &key);
        config.os = self.equinix_os.clone();
        config.ssh_key_label = self.equinix_ssh_key_label.clone();
        config.reservation_cache = self.equinix_reservation_cache;
        config.reboot_wait = self.equinix_reboot_wait;
        Ok((client, config))
    }
}

/// The OpenStack Ironic provider.
#[derive(Debug, Clone, Args)]
pub struct IronicArgs {
    /// Ironic: API address (`http(s)://host:6385`); required with `--provider ironic`.
    #[arg(long, env = "SHEPHERD_IRONIC_URL")]
    pub ironic_url: Option<String>,
    /// Ironic: user for HTTP basic authentication (`auth_strategy = http_basic`); none for
    /// `noauth`.
    #[arg(long, env = "SHEPHERD_IRONIC_USER")]
    pub ironic_user: Option<String>,
    /// Ironic: password for HTTP basic authentication (prefer the environment variable or the
    /// config file; never logged).
    #[arg(long, env = "SHEPHERD_IRONIC_PASSWORD", hide_env_values = true)]
    pub ironic_password: Option<String>,
    /// Ironic: this deployment's id, written into `extra.shepherd_deployment` of every node it
    /// takes. Replicas of one deployment share it; nodes of another id are not ours.
    #[arg(long, env = "SHEPHERD_IRONIC_DEPLOYMENT", default_value = "shepherd")]
    pub ironic_deployment: String,
    /// Ironic: take only nodes of this resource class.
    #[arg(long, env = "SHEPHERD_IRONIC_RESOURCE_CLASS")]
    pub ironic_resource_class: Option<String>,
    /// Ironic: take only nodes of this conductor group.
    #[arg(long, env = "SHEPHERD_IRONIC_CONDUCTOR_GROUP")]
    pub ironic_conductor_group: Option<String>,
    /// Ironic: take only nodes of this owner.
    #[arg(long, env = "SHEPHERD_IRONIC_OWNER")]
    pub ironic_owner: Option<String>,
    /// Ironic: take only nodes whose `extra` holds this `KEY=VALUE`.
    #[arg(long, env = "SHEPHERD_IRONIC_EXTRA", value_parser = key_value)]
    pub ironic_extra: Option<(String, String)>,
    /// Ironic: take only nodes with this trait (repeatable; every one required), and ask
    /// for it in each allocation.
    #[arg(
        long = "ironic-trait",
        env = "SHEPHERD_IRONIC_TRAITS",
        value_delimiter = ','
    )]
    pub ironic_traits: Vec<String>,
    /// Ironic: URL of the image to deploy (`instance_info.image_source`); left out, the
    /// deploy interface's defaults apply.
    #[arg(long, env = "SHEPHERD_IRONIC_IMAGE")]
    pub ironic_image: Option<String>,
    /// Ironic: the image's checksum (`instance_info.image_checksum`), required with
    /// `--ironic-image`.
    #[arg(long, env = "SHEPHERD_IRONIC_IMAGE_CHECKSUM")]
    pub ironic_image_checksum: Option<String>,
    /// Ironic: deploy the image each node's `instance_info` names (`image_source`, set by the
    /// operator), instead of one `--ironic-image` for all.
    #[arg(long, env = "SHEPHERD_IRONIC_IMAGE_FROM_NODE")]
    pub ironic_image_from_node: bool,
    /// Ironic: put `network_data` into each config drive, from the node's ports (DHCP on
    /// each), for images whose cloud-init configures the network from it.
    #[arg(long, env = "SHEPHERD_IRONIC_NETWORK_DATA")]
    pub ironic_network_data: bool,
    /// Ironic: the node field holding the SSH address (`host` or `host:port`), as a dotted
    /// path into `extra`, `properties`, or a top-level field.
    #[arg(
        long,
        env = "SHEPHERD_IRONIC_ADDRESS_FIELD",
        default_value = "extra.ssh_address"
    )]
    pub ironic_address_field: String,
    /// Ironic: when the field holds no address, look one up in the node's inspection
    /// inventory (one call per node, then remembered).
    #[arg(long, env = "SHEPHERD_IRONIC_ADDRESS_FROM_INVENTORY", default_value_t = true, action = clap::ArgAction::Set)]
    pub ironic_address_from_inventory: bool,
    /// Ironic: how long after requesting a deploy the first takeover is attempted (no worker
    /// waits; a deploy still running then is asked again with a growing backoff).
    #[arg(long, env = "SHEPHERD_IRONIC_DEPLOY_WAIT", default_value = "5m", value_parser = duration)]
    pub ironic_deploy_wait: Duration,
    /// Ironic: how long a node this deployment reserved, unknown to the BMDB, must have been
    /// unchanged before it is adopted as an orphan (until then another replica may still be
    /// creating it).
    #[arg(long, env = "SHEPHERD_IRONIC_ORPHAN_GRACE", default_value = "1m", value_parser = duration)]
    pub ironic_orphan_grace: Duration,
    /// Ironic: how long a deploy may take before the node counts as failed.
    #[arg(long, env = "SHEPHERD_IRONIC_DEPLOY_TIMEOUT", default_value = "1h", value_parser = duration)]
    pub ironic_deploy_timeout: Duration,
    /// Ironic: how long the recoverer waits after asking Ironic for a reboot.
    #[arg(long, env = "SHEPHERD_IRONIC_REBOOT_WAIT", default_value = "60s", value_parser = duration)]
    pub ironic_reboot_wait: Duration,
}

/// `KEY=VALUE`, both non-empty.
fn key_value(s: &str) -> std::result::Result<(String, String), String> {
    match s.split_once('=') {
        Some((k, v)) if !k.is_empty() && !v.is_empty() => Ok((k.to_string(), v.to_string())),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

impl IronicArgs {
    /// The Ironic client and provider settings; the SSH public key goes into config drives.
    fn client(
        &self,
        public_key: Option<String>,
        metrics: Arc<CallMetrics>,
    ) -> Result<(shepherd_ironic::Client, IronicConfig)> {
        let url = self
            .ironic_url
            .as_deref()
            .context("ironic-url: is required with --provider ironic")?;
        let auth = match (&self.ironic_user, &self.ironic_password) {
            (None, None) => IronicAuth::None,
            (Some(user), Some(password)) => IronicAuth::Basic {
                user: user.clone(),
                password: password.clone(),
            },
            (Some(_), None) => bail!("ironic-password: is required with --ironic-user"),
            (None, Some(_)) => bail!("ironic-user: is required with --ironic-password"),
        };
        let client = shepherd_ironic::Client::new(
            url,
            auth,
            shepherd_ironic::RetryPolicy::default(),
            metrics,
        )?;
        let key = public_key.context(
            "ssh-key: --provider ironic needs a key (its public half goes into each node's config drive)",
        )?;
        let mut config = IronicConfig::new(&self.ironic_deployment, &key);
        config.selector = shepherd_ironic::Selector {
            resource_class: self.ironic_resource_class.clone(),
            conductor_group: self.ironic_conductor_group.clone(),
            owner: self.ironic_owner.clone(),
            extra: self.ironic_extra.clone(),
            traits: self.ironic_traits.clone(),
        };
        config.image = match (&self.ironic_image, &self.ironic_image_checksum) {
            (Some(url), checksum) => Some(shepherd_ironic::Image {
                url: url.clone(),
                checksum: checksum.clone().unwrap_or_default(),
            }),
            (None, Some(_)) => bail!("ironic-image: is required with --ironic-image-checksum"),
            (None, None) => None,
        };
        config.image_from_node = self.ironic_image_from_node;
        config.network_data = self.ironic_network_data;
        config.address_field = Some(self.ironic_address_field.clone()).filter(|f| !f.is_empty());
        config.address_from_inventory = self.ironic_address_from_inventory;
        config.deploy_wait = self.ironic_deploy_wait;
        config.orphan_grace = self.ironic_orphan_grace;
        config.deploy_timeout = self.ironic_deploy_timeout;
        config.reboot_wait = self.ironic_reboot_wait;
        config.validate()?;
        Ok((client, config))
    }
}

/// BMCs of a static inventory.
#[derive(Debug, Clone, Args)]
pub struct BmcArgs {
    /// Static provider: timeout of each request to a machine's BMC (Redfish).
    #[arg(long, env = "SHEPHERD_BMC_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub bmc_timeout: Duration,
    /// Static provider: how long the recoverer waits after a BMC power-cycle.
    #[arg(long, env = "SHEPHERD_BMC_REBOOT_WAIT", default_value = "30s", value_parser = duration)]
    pub bmc_reboot_wait: Duration,
}

impl RunArgs {
    /// Checks and converts everything that does not need I/O; the message names the setting.
    pub fn settings(&self, agent: Vec<u8>, ca: Option<Vec<u8>>) -> Result<FleetSettings> {
        for (name, d) in [
            ("ssh-connect-timeout", self.ssh.ssh_connect_timeout),
            ("ssh-exec-timeout", self.ssh.ssh_exec_timeout),
            ("session-interval", self.session_interval),
            ("schema-check-interval", self.process.schema_check_interval),
            (
                "history-retention",
                self.history_retention.unwrap_or(Duration::MAX),
            ),
            ("token-retention", self.token_retention),
            ("audit-retention", self.audit_retention),
        ] {
            if d.is_zero() {
                bail!("{name}: must be more than zero");
            }
        }
        Ok(FleetSettings {
            provisioner: self.provisioner.config()?,
            initializer: self
                .initializer
                .config(agent, ca, self.ssh.ssh_exec_timeout)?,
            initializer_loop: self.initializer.loop_settings(),
            recoverer_loop: self.recoverer.loop_settings(),
            recovery: self.recoverer.thresholds.thresholds(),
            recoverer_backoff: failed_reboot_backoff(),
            recovery_brake: self.recoverer.brake()?,
            recovery_brake_metrics: BrakeMetrics::default(),
            recovery_repeat: self.recoverer.repeat()?,
            recoverer_metrics: RecovererMetrics::default(),
            provisioner_metrics: Default::default(),
            updater_rate: self.updater_rate,
            session_interval: self.session_interval,
            retention: Retention {
                history: self.history_retention.map(HistoryRetention::new),
                sign_ins: self.token_retention,
                audit_events: self.audit_retention,
            },
            tasks: self.process.tasks(),
            bare: None,
        })
    }
}

fn read_ca(path: &PathBuf) -> Result<Vec<u8>> {
    let pem =
        std::fs::read_to_string(path).with_context(|| format!("agent-ca: {}", path.display()))?;
    let der = pem_to_der(&pem).with_context(|| format!("agent-ca: {}", path.display()))?;
    Ok(der)
}

/// The DER bytes of the first certificate in a PEM text (rustls-pemfile reads it).
pub(crate) fn pem_to_der(pem: &str) -> Result<Vec<u8>> {
    let first = rustls_pemfile::certs(&mut pem.as_bytes())
        .next()
        .context("no PEM certificate found")?
        .context("the PEM certificate cannot be read")?;
    Ok(first.to_vec())
}

/// The provider (and how to reach its machines) chosen at start-up.
enum Chosen {
    /// With the SSH key's public half, for the live environment of bare machines.
    Static(Arc<StaticProvider>, Arc<SshTransport>, Option<String>),
    Equinix(Arc<EquinixProvider>, Arc<SshTransport>),
    Ironic(Arc<IronicProvider>, Arc<SshTransport>),
    Sim(Arc<SimFleet>),
}

/// The provider `--provider` chose, connected and checked (a broken static inventory, an
/// unreachable API or refused credentials stop start-up here, with what was wrong), with the
/// SSH transport its machines are taken over with.
async fn choose(
    args: &RunArgs,
    ssh_metrics: &Arc<CallMetrics>,
    equinix_metrics: &Arc<CallMetrics>,
    ironic_metrics: &Arc<CallMetrics>,
) -> Result<Chosen> {
    let chosen = match args.source.provider {
        ProviderChoice::Static => {
            let url = args
                .source
                .static_inventory
                .as_deref()
                .context("static-inventory: is required with --provider static")?;
            let provider = Arc::new(
                StaticProvider::new(url, args.source.static_provider_type.into())
                    .context("static-inventory")?
                    .with_bmc_timing(args.bmc.bmc_timeout, args.bmc.bmc_reboot_wait),
            );
            let (transport, public_key) = args.ssh.transport(ssh_metrics)?;
            // A broken inventory is a start-up error: nothing is written, no loop starts.
            let inventory = provider.load_at_start().await.context("static-inventory")?;
            if !inventory.has_bmcs() {
                tracing::warn!(
                    "no inventory entry names a BMC: machines cannot be rebooted until one does; the recoverer waits for it"
                );
            }
            Chosen::Static(provider, transport, public_key)
        }
        ProviderChoice::Equinix => {
            let (transport, public_key) = args.ssh.transport(ssh_metrics)?;
            let (client, config) = args
                .equinix
                .client(public_key, Arc::clone(equinix_metrics))?;
            let connected = EquinixProvider::connect(client, config).await;
            Chosen::Equinix(Arc::new(connected.context("Equinix Metal")?), transport)
        }
        ProviderChoice::Ironic => {
            let (transport, public_key) = args.ssh.transport(ssh_metrics)?;
            let (client, config) = args.ironic.client(public_key, Arc::clone(ironic_metrics))?;
            // An unreachable Ironic, one older than the pinned microversion, or refused
            // credentials stop start-up here, with what was wrong.
            let connected = IronicProvider::connect(client, config).await;
            Chosen::Ironic(Arc::new(connected.context("OpenStack Ironic")?), transport)
        }
        ProviderChoice::Sim => Chosen::Sim(Arc::new(SimFleet::new(
            args.sim.sim_machines,
            args.sim.knobs(),
        )?)),
    };
    Ok(chosen)
}

/// Runs `shepherd run` until SIGINT/SIGTERM.
pub async fn run(database: &str, args: RunArgs) -> Result<()> {
    args.process
        .check_web_listen("metrics-listen", args.metrics_listen)?;
    let ca = args
        .initializer
        .agent_ca
        .as_ref()
        .map(read_ca)
        .transpose()?;
    let agent = match (&args.initializer.agent_executable, args.source.provider) {
        (Some(path), _) => {
            std::fs::read(path).with_context(|| format!("agent-executable: {}", path.display()))?
        }
        // The simulated agent is in-process; the bytes are never run.
        (None, ProviderChoice::Sim) => b"simulated agent".to_vec(),
        (None, _) => bail!("agent-executable: is required"),
    };
    let mut settings = args.settings(agent, ca)?;
    let provider_metrics = Arc::new(CallMetrics::default());
    let ssh_metrics = Arc::new(CallMetrics::default());
    let equinix_metrics = Arc::new(CallMetrics::default());
    let ironic_metrics = Arc::new(CallMetrics::default());
    // Everything that can be checked without the database is checked before connecting.
    let chosen = choose(&args, &ssh_metrics, &equinix_metrics, &ironic_metrics).await?;
    let db = Bmdb::open_with(database, &OpenOptions::migrating(args.process.migrate)).await?;
    let cancel = shutdown_on_signals();
    let schema = tokio::spawn(crate::schema_watch::watch(
        db.clone(),
        args.process.schema_check_interval,
        cancel.clone(),
    ));
    // The web UI here also shows the recovery brake of this process's recoverer.
    let mut operator = crate::metrics_http::OperatorEndpoint::for_fleet(
        &db,
        &settings,
        Duration::from_secs(5),
        args.process.stats_interval,
        cancel.clone(),
    );
    let registry = &mut operator.registry;
    provider_metrics.register(registry, "shepherd_provider", "Provider API");
    ssh_metrics.register(registry, "shepherd_ssh", "SSH");
    equinix_metrics.register(registry, "shepherd_equinix_api", "Equinix Metal API");
    ironic_metrics.register(registry, "shepherd_ironic_api", "OpenStack Ironic API");
    let mut bare = None;
    if let Chosen::Static(provider, _, public_key) = &chosen {
        provider.metrics().register(registry);
        let needed = provider.has_bare().await;
        bare = args
            .bare
            .prepare(needed, public_key.clone(), &db, registry)
            .await?;
        if bare.is_some() {
            crate::bare_flags::probe_new_bmcs(provider, &db).await?;
        }
    }
    let app = operator.router(db.clone());
    let metrics = crate::metrics_http::serve(
        args.metrics_listen,
        "metrics-listen",
        app,
        crate::rate_limit::DEFAULT_RATE,
        cancel.clone(),
    )
    .await?;
    crate::fleet::announce(&format!(
        "shepherd run: metrics at http://{metrics}/metrics"
    ));
    crate::fleet::announce(&format!(
        "shepherd run: web UI at http://{metrics}/machines"
    ));
    let media = bare.map(|bare| {
        let (loop_settings, serving) = bare.start(cancel.clone());
        settings.bare = Some(loop_settings);
        serving
    });
    let loops = Loops {
        db: db.clone(),
        metrics: provider_metrics,
        settings,
        cancel: cancel.clone(),
    };
    let result = match chosen {
        // Machines of a static inventory are power-cycled through the BMCs their entries
        // name; the recoverer claims nothing while the last good inventory names none.
        Chosen::Static(provider, transport, _) => loops.run(provider, transport).await,
        Chosen::Equinix(provider, transport) => loops.run(provider, transport).await,
        Chosen::Ironic(provider, transport) => loops.run(provider, transport).await,
        Chosen::Sim(fleet) => {
            fleet.share_through(db.clone());
            let agents = tokio::spawn(fleet.clone().run_agents(db.clone(), cancel.clone()));
            let r = loops.run(fleet.clone(), fleet).await;
            let _ = agents.await;
            r
        }
    };
    if let Some(media) = media {
        let _ = media.await;
    }
    db.close().await;
    // A schema that moved past this binary is why the loops stopped: say so and fail.
    if let Ok(Err(e)) = schema.await {
        return Err(e.into());
    }
    result
}

/// Runs the loops over `provider`, which also reboots machines, with its calls counted in
/// `metrics`.
/// What every provider's loops run with.
struct Loops {
    db: Bmdb,
    metrics: Arc<CallMetrics>,
    settings: FleetSettings,
    cancel: tokio_util::sync::CancellationToken,
}

impl Loops {
    /// Runs the loops over `provider`, its calls counted in the provider metrics, taking
    /// machines over through `transport`, until cancelled.
    async fn run<P: Recoverer + 'static>(
        self,
        provider: Arc<P>,
        transport: Arc<dyn Transport>,
    ) -> Result<()> {
        let provider = Arc::new(InstrumentedProvider::new(provider, self.metrics));
        run_loops(self.db, provider, transport, self.settings, self.cancel).await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pem_certificates_are_decoded() {
        let pem = "junk\n-----BEGIN CERTIFICATE-----\nAQID\nBA==\n-----END CERTIFICATE-----\n";
        assert_eq!(pem_to_der(pem).unwrap(), vec![1, 2, 3, 4]);
        assert!(pem_to_der("nothing").is_err());
        assert!(pem_to_der("-----BEGIN CERTIFICATE-----\n!!\n-----END CERTIFICATE-----").is_err());
    }
}
