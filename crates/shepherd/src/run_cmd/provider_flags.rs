//! The flags of `shepherd run` that say where machines come from: the provider, the static
//! inventory and its BMCs, the simulated fleet, Equinix Metal and OpenStack Ironic.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use shepherd_bmdb::ProviderKind;
use shepherd_equinix::{Client, EquinixConfig, RetryPolicy};
use shepherd_ironic::{Auth as IronicAuth, IronicConfig};
use shepherd_provider::metrics::CallMetrics;
use shepherd_sim::SimKnobs;

use crate::flags::duration;

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
    pub(super) fn knobs(&self) -> SimKnobs {
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
    pub(super) fn client(
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
    pub(super) fn client(
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
