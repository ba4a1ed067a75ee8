//! `shepherd run`'s settings for machines of a static inventory that come bare (design.md §21): the
//! live image, the media server that hands it to BMCs, and the bare-metal loop's timeouts.
//! Checked at start-up: an inventory with a `Bare` entry needs them all, and a live image
//! without its config-drive slots is refused.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{BareTimeouts, Bmdb};
use shepherd_loops::bare_metal::{BareMetrics, BareSettings};
use shepherd_loops::fleet::{BareMetalSettings, LoopSettings};
use shepherd_loops::limiter::RateSpec;
use shepherd_media::{LiveImage, MediaMetrics, MediaServer};
use shepherd_provider::redfish::Bmc;
use shepherd_provider::static_provider::StaticProvider;
use tokio_util::sync::CancellationToken;

use crate::flags::duration;

/// Where the media server listens unless told.
const LISTEN: &str = "127.0.0.1:8443";

/// Machines that come bare: the live image, its media server, the bare-metal loop.
#[derive(Debug, Clone, Args)]
pub struct BareArgs {
    /// Bare machines: the live image their BMCs boot (an ISO `scripts/live-image.sh` built,
    /// or one with the same config-drive slots). Required when an inventory entry says `Bare`.
    #[arg(long, env = "SHEPHERD_BARE_LIVE_IMAGE")]
    pub bare_live_image: Option<PathBuf>,
    /// Bare machines: where the media server listens (HTTPS). Loopback by default: BMCs sit
    /// on a management network, which it must listen on to be reached.
    #[arg(long, env = "SHEPHERD_BARE_MEDIA_LISTEN", default_value = LISTEN)]
    pub bare_media_listen: std::net::SocketAddr,
    /// Bare machines: the media server's address as BMCs reach it (`https://HOST:PORT`).
    #[arg(long, env = "SHEPHERD_BARE_MEDIA_URL")]
    pub bare_media_url: Option<url::Url>,
    /// Bare machines: PEM certificate (chain) of the media server.
    #[arg(long, env = "SHEPHERD_BARE_MEDIA_CERT")]
    pub bare_media_cert: Option<PathBuf>,
    /// Bare machines: PEM private key of the media server.
    #[arg(long, env = "SHEPHERD_BARE_MEDIA_KEY")]
    pub bare_media_key: Option<PathBuf>,
    /// Bare machines: how long a machine's live image URL may be fetched.
    #[arg(long, env = "SHEPHERD_BARE_MEDIA_TTL", default_value = "2h", value_parser = duration)]
    pub bare_media_ttl: Duration,
    /// Bare machines: how long a live environment may take to answer SSH before the machine
    /// is powered off, its media ejected, and booted again later.
    #[arg(long, env = "SHEPHERD_BARE_LIVE_BOOT_TIMEOUT", default_value = "15m", value_parser = duration)]
    pub bare_live_boot_timeout: Duration,
    /// Bare machines: live boots before a machine is given up on.
    #[arg(long, env = "SHEPHERD_BARE_LIVE_BOOT_ATTEMPTS", default_value_t = 3)]
    pub bare_live_boot_attempts: i32,
    /// Bare machines: how long an installation may take.
    #[arg(long, env = "SHEPHERD_BARE_INSTALL_TIMEOUT", default_value = "1h", value_parser = duration)]
    pub bare_install_timeout: Duration,
    /// Bare machines: how long the installed OS may take to heartbeat.
    #[arg(long, env = "SHEPHERD_BARE_DISK_BOOT_TIMEOUT", default_value = "30m", value_parser = duration)]
    pub bare_disk_boot_timeout: Duration,
    /// Bare machines: how long after a boot the first takeover is attempted.
    #[arg(long, env = "SHEPHERD_BARE_BOOT_WAIT", default_value = "30s", value_parser = duration)]
    pub bare_boot_wait: Duration,
    /// Bare machines: the first wait before a live boot is tried again, and the backoff after
    /// a BMC failed a step (doubling up to 30 minutes).
    #[arg(long, env = "SHEPHERD_BARE_RETRY_WAIT", default_value = "1m", value_parser = duration)]
    pub bare_retry_wait: Duration,
    /// Bare machines: a setting of the agent in the live environment, `SHEPHERD_AGENT_…=VALUE`
    /// (repeatable), e.g. `SHEPHERD_AGENT_HEARTBEAT_INTERVAL=10s`.
    #[arg(long = "bare-agent-env", env = "SHEPHERD_BARE_AGENT_ENV", value_delimiter = ',', value_parser = agent_env)]
    pub bare_agent_env: Vec<(String, String)>,
    /// Bare machines: parallel workers of the bare-metal loop.
    #[arg(long, env = "SHEPHERD_BARE_PARALLELISM", default_value_t = 4)]
    pub bare_parallelism: usize,
    /// Bare machines: the bare-metal loop's BMDB query rate, "DURATION,BURST".
    #[arg(long, env = "SHEPHERD_BARE_DB_RATE", default_value = "250ms,8")]
    pub bare_db_rate: RateSpec,
}

/// `SHEPHERD_AGENT_NAME=VALUE`.
fn agent_env(s: &str) -> std::result::Result<(String, String), String> {
    let (k, v) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not NAME=VALUE"))?;
    let named =
        k.starts_with("SHEPHERD_AGENT_") && k.bytes().all(|b| b.is_ascii_uppercase() || b == b'_');
    if !named || v.is_empty() || v.contains(['\n', '\r', '"', '\\']) {
        return Err(format!(
            "{s:?}: the name must be SHEPHERD_AGENT_… (capitals and _) and the value one line, without quotes or backslashes"
        ));
    }
    if k == shepherd_loops::bare_metal::LIVE_PROOF_VAR {
        return Err(format!(
            "{k} is Shepherd's own: each live boot's config drive sets it (design.md §21)"
        ));
    }
    Ok((k.to_string(), v.to_string()))
}

/// The bare-metal loop and its media server, ready to run.
pub struct Bare {
    fleet: BareMetalSettings,
    media: Arc<MediaServer>,
    tls: Arc<rustls::ServerConfig>,
    listener: tokio::net::TcpListener,
}

impl BareArgs {
    /// Whether any bare setting was given.
    fn configured(&self) -> bool {
        self.bare_live_image.is_some() || self.bare_media_url.is_some()
    }

    /// Checks the settings and opens what they name (the live image, the TLS files, the
    /// listener), when the inventory has a bare entry (`needed`) or the settings are given;
    /// `None` when neither. `public_key` is what the live environment lets in; `ssh_user`, whom
    /// Shepherd logs in as.
    pub async fn prepare(
        &self,
        needed: bool,
        public_key: Option<String>,
        ssh_user: &str,
        db: &Bmdb,
        registry: &mut Registry,
    ) -> Result<Option<Bare>> {
        if !needed && !self.configured() {
            return Ok(None);
        }
        let required = |what: &str| {
            format!(
                "{what}: is required for machines that come bare (an inventory entry says Bare)"
            )
        };
        let image = self
            .bare_live_image
            .as_ref()
            .with_context(|| required("bare-live-image"))?;
        let url = self
            .bare_media_url
            .clone()
            .with_context(|| required("bare-media-url"))?;
        let (Some(cert), Some(key)) = (&self.bare_media_cert, &self.bare_media_key) else {
            bail!("{}", required("bare-media-cert and bare-media-key"));
        };
        let public_key = public_key.context(
            "ssh-key: machines that come bare need a key (its public half is what their live environment lets in)",
        )?;
        let mut settings = BareSettings::new(url, vec![public_key]);
        settings.media_ttl = self.bare_media_ttl;
        settings.timeouts = BareTimeouts {
            live_boot: self.bare_live_boot_timeout,
            install: self.bare_install_timeout,
            disk_boot: self.bare_disk_boot_timeout,
        };
        settings.live_boot_attempts = self.bare_live_boot_attempts;
        settings.boot_wait = self.bare_boot_wait;
        settings.backoff = shepherd_bmdb::Backoff::exponential(
            self.bare_retry_wait,
            self.bare_retry_wait.max(Duration::from_secs(1800)),
            2.0,
        )
        .with_jitter(0.1);
        settings.agent_env = self.bare_agent_env.clone();
        settings.ssh_user = ssh_user.to_string();
        settings.validate()?;
        let image = Arc::new(LiveImage::open(image).context("bare-live-image")?);
        let tls = shepherd_server::load_https_config(cert, key).context("bare-media-cert")?;
        let listener = tokio::net::TcpListener::bind(self.bare_media_listen)
            .await
            .with_context(|| format!("bare-media-listen: {}", self.bare_media_listen))?;
        let media_metrics = MediaMetrics::default();
        media_metrics.register(registry);
        let bare_metrics = BareMetrics::default();
        bare_metrics.register(registry);
        tracing::info!(
            image = %image.path().display(),
            bytes = image.len(),
            listen = %self.bare_media_listen,
            url = %settings.media_url,
            "bare machines: the media server serves the live image"
        );
        Ok(Some(Bare {
            fleet: BareMetalSettings {
                settings,
                runner: LoopSettings {
                    parallelism: self.bare_parallelism.max(1),
                    db_rate: self.bare_db_rate,
                },
                metrics: bare_metrics,
            },
            media: MediaServer::new(image, db.clone(), media_metrics),
            tls: Arc::new(tls),
            listener,
        }))
    }
}

/// Most BMCs probed at start-up, and at once.
const PROBED: usize = 16;
const PROBING_AT_ONCE: usize = 8;

/// Probes the BMCs of bare machines the BMDB does not record yet (new servers, which the
/// provisioner will record next): one that answers without a virtual CD, or without the
/// actions needed, stops start-up with the entries named, since no retry would help; one that
/// cannot be reached now is a warning (its machine backs off with the BMC's answer once
/// recorded). At most [`PROBED`] entries, so that a large inventory starts as fast.
pub async fn probe_new_bmcs(provider: &StaticProvider, db: &Bmdb) -> Result<()> {
    use futures::StreamExt;
    let inventory = provider.refresh(Duration::ZERO).await?;
    let kind = shepherd_provider::Provider::kind(provider);
    let bare: Vec<_> = inventory
        .entries()
        .iter()
        .filter(|e| e.bare.is_some())
        .cloned()
        .collect();
    // One read transaction for the whole inventory: at start-up, before any loop writes.
    let new = db
        .read(move |tx| Box::pin(not_recorded(tx, kind, bare.clone())))
        .await?;
    let probes = futures::stream::iter(new)
        .map(|entry| async move {
            let bmc = entry.bmc.as_ref().expect("a bare entry names a BMC");
            let timeout = Duration::from_secs(10);
            let probed = match Bmc::new(bmc, timeout) {
                Ok(bmc) => bmc.virtual_cd().await.map(drop),
                Err(e) => Err(e),
            };
            (entry.id, probed)
        })
        .buffer_unordered(PROBING_AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    let (lacking, unreachable): (Vec<_>, Vec<_>) = probes
        .into_iter()
        .filter_map(|(id, probed)| probed.err().map(|e| (id, e)))
        .partition(|(_, e)| e.is_configuration());
    if !unreachable.is_empty() {
        let examples: Vec<String> = unreachable
            .iter()
            .take(3)
            .map(|(id, e)| format!("{id}: {e}"))
            .collect();
        tracing::warn!(count = unreachable.len(), examples = ?examples, "bare machines' BMCs that could not be asked about virtual media at start-up; their machines back off once recorded");
    }
    if let Some((id, e)) = lacking.first() {
        match lacking.len() {
            1 => bail!("static-inventory: 1 bare entry names a BMC that cannot boot it, e.g. {id}: {e}"),
            n => bail!("static-inventory: {n} bare entries name a BMC that cannot boot them, e.g. {id}: {e}"),
        }
    }
    Ok(())
}

/// The first [`PROBED`] of `entries` that the BMDB does not record yet.
async fn not_recorded(
    tx: &mut shepherd_bmdb::Tx,
    kind: shepherd_bmdb::ProviderKind,
    entries: Vec<shepherd_provider::static_inventory::InventoryEntry>,
) -> Result<Vec<shepherd_provider::static_inventory::InventoryEntry>, shepherd_bmdb::Error> {
    let mut new = Vec::new();
    for entry in entries {
        if new.len() == PROBED {
            break;
        }
        if tx.machine_by_provider_id(kind, &entry.id).await?.is_none() {
            new.push(entry);
        }
    }
    Ok(new)
}

impl Bare {
    /// Starts serving the live image until `cancel`; the loop's settings are for the fleet.
    pub fn start(
        self,
        cancel: CancellationToken,
    ) -> (BareMetalSettings, tokio::task::JoinHandle<()>) {
        let app = self.media.router();
        let limits = shepherd_server::https::HttpsLimits::default();
        let serving = tokio::spawn(shepherd_server::https::serve(
            "media",
            self.listener,
            self.tls,
            app,
            limits,
            cancel,
        ));
        (self.fleet, serving)
    }
}

#[cfg(test)]
mod tests {
    use super::agent_env;

    #[test]
    fn an_agent_setting_is_one_plain_line_and_never_shepherds_own() {
        assert_eq!(
            agent_env("SHEPHERD_AGENT_HEARTBEAT_INTERVAL=2s").unwrap(),
            ("SHEPHERD_AGENT_HEARTBEAT_INTERVAL".into(), "2s".into())
        );
        for (bad, want) in [
            ("SHEPHERD_AGENT_X", "is not NAME=VALUE"),
            ("PATH=/bin", "the name must be SHEPHERD_AGENT_"),
            ("SHEPHERD_AGENT_X=a\"b", "without quotes or backslashes"),
            ("SHEPHERD_AGENT_X=a\\b", "without quotes or backslashes"),
            (
                "SHEPHERD_AGENT_LIVE_PROOF=x",
                "each live boot's config drive sets it",
            ),
        ] {
            let err = agent_env(bad).unwrap_err();
            assert!(err.contains(want), "{bad}: {err}");
        }
    }
}
