//! `shepherd run`: the provisioner, initializer and recoverer against a real provider.
//! Every setting is a flag, an environment variable (`SHEPHERD_` + the flag in upper snake
//! case) and a config-file key (the flag name); see `config_file.rs` for precedence.

mod loop_flags;
mod provider_flags;

pub use loop_flags::{InitializerArgs, ProvisionerArgs, RecovererArgs, SshArgs};
pub use provider_flags::{BmcArgs, EquinixArgs, IronicArgs, ProviderChoice, SimArgs, SourceArgs};

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use shepherd_bmdb::{Bmdb, HistoryRetention, OpenOptions};
use shepherd_equinix::EquinixProvider;
use shepherd_ironic::IronicProvider;
use shepherd_loops::brake::BrakeMetrics;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::recoverer::{failed_reboot_backoff, RecovererMetrics};
use shepherd_loops::retention::Retention;
use shepherd_provider::metrics::{CallMetrics, InstrumentedProvider};
use shepherd_provider::static_provider::StaticProvider;
use shepherd_provider::transport::{SshTransport, Transport};
use shepherd_provider::Rebooter;
use shepherd_sim::SimFleet;

use crate::flags::duration;
use crate::plumbing::shutdown_on_signals;
use shepherd_loops::fleet::{run_loops, FleetSettings};

/// Settings of `shepherd run` (design.md §17), grouped by the part of Shepherd they steer.
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
    // The web UI here also shows the recovery brake of this process's recoverer.
    let mut operator = shepherd_operator::metrics_http::OperatorEndpoint::for_fleet(
        &db,
        &settings,
        Duration::from_secs(5),
        args.process.stats_interval,
        cancel.clone(),
    );
    let every = args.process.schema_check_interval;
    let schema = crate::schema_watch::start(&db, every, &cancel, &operator.tasks);
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
            .prepare(
                needed,
                public_key.clone(),
                &args.ssh.ssh_user,
                &db,
                registry,
            )
            .await?;
        if bare.is_some() {
            crate::bare_flags::probe_new_bmcs(provider, &db).await?;
        }
    }
    let app = operator.router(db.clone());
    let metrics = shepherd_operator::metrics_http::serve(
        args.metrics_listen,
        "metrics-listen",
        app,
        shepherd_operator::rate_limit::DEFAULT_RATE,
        cancel.clone(),
    )
    .await?;
    crate::plumbing::announce(&format!(
        "shepherd run: metrics at http://{metrics}/metrics"
    ));
    crate::plumbing::announce(&format!(
        "shepherd run: web UI at http://{metrics}/machines"
    ));
    let media = bare.map(|bare| {
        let (loop_settings, serving) = bare.start(cancel.clone());
        settings.bare = Some(loop_settings);
        serving
    });
    let loops = ProviderLoops {
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

/// What the loops run with, whichever provider they run over.
struct ProviderLoops {
    db: Bmdb,
    metrics: Arc<CallMetrics>,
    settings: FleetSettings,
    cancel: tokio_util::sync::CancellationToken,
}

impl ProviderLoops {
    /// Runs the loops over `provider`, its calls counted in the provider metrics, taking
    /// machines over through `transport`, until cancelled.
    async fn run<P: Rebooter + 'static>(
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
