//! `shepherd demo`: the whole lifecycle on one machine. A fresh SQLite BMDB, a simulated fleet
//! with injected failures, and every loop running with demo-speed settings; live progress bars
//! per lifecycle state, and a summary table once every machine's agent is heartbeating.

mod report;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use clap::Args;
use shepherd_bmdb::{Backoff, Bmdb, OpenOptions, RecoveryThresholds};
use shepherd_loops::initializer::InitializerConfig;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::ProvisionerConfig;
use shepherd_loops::reconcile::Limits;
use shepherd_provider::metrics::{CallMetrics, InstrumentedProvider};
use shepherd_server::{
    heartbeat_writes, HeartbeatWrites, LoopbackServer, ServerLimits, SlowHeartbeats,
};
use shepherd_sim::{BetweenHeartbeats, HeartbeatFailures, RealAgents, SimFleet, SimKnobs};

use crate::flags::duration;
use crate::plumbing::shutdown_on_signals;
use shepherd_loops::fleet::{run_loops, FleetSettings, LoopSettings};
use tokio_util::sync::CancellationToken;

use report::{print_table, summary, watch};

/// Settings of the demo.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Simulated machines.
    #[arg(long, default_value_t = 1000)]
    pub machines: usize,
    /// Give up (exit 1) if the fleet has not converged by then.
    #[arg(long, default_value = "5m", value_parser = duration)]
    pub timeout: Duration,
    /// Initializer workers.
    #[arg(long, default_value_t = 16)]
    pub initializer_parallelism: usize,
    /// Probability an SSH connection fails.
    #[arg(long, default_value_t = 0.03)]
    pub connect_failure_rate: f64,
    /// Probability an agent answers garbage.
    #[arg(long, default_value_t = 0.02)]
    pub bad_agent_rate: f64,
    /// Probability an agent never heartbeats (its machine gets rebooted and retaken).
    #[arg(long, default_value_t = 0.02)]
    pub silent_agent_rate: f64,
    /// Share of heartbeats the server holds before writing them, as a slow BMDB would (0: none).
    /// The recoverer must not reboot their machines: the server reports the trouble.
    #[arg(long, default_value_t = 0.0)]
    pub slow_heartbeat_share: f64,
    /// How long each of them is held.
    #[arg(long, default_value = "15s", value_parser = duration)]
    pub slow_heartbeat_delay: Duration,
    /// For how long from the start heartbeats are held.
    #[arg(long, default_value = "30s", value_parser = duration)]
    pub slow_heartbeat_for: Duration,
    /// How often each agent heartbeats; by default every 2 s, or slower in fleets over 2,000
    /// machines, so that the fleet sends about 1,000 heartbeats a second.
    #[arg(long, value_parser = duration)]
    pub heartbeat_interval: Option<Duration>,
    /// Time one simulated takeover takes.
    #[arg(long, default_value = "100ms", value_parser = duration)]
    pub takeover_time: Duration,
    /// Keep the demo database (its path is printed) instead of deleting it.
    #[arg(long)]
    pub keep: bool,
    /// Where the web UI and `/metrics` are served; if the port is taken, a free one is used.
    #[arg(long, default_value = "127.0.0.1:9465")]
    pub http_listen: std::net::SocketAddr,
    /// After converging, keep the fleet, the web UI and the metrics up until Ctrl-C.
    #[arg(long)]
    pub stay: bool,
}

fn settings(args: &DemoArgs) -> FleetSettings {
    let fast = |ms, burst| RateSpec::new(Duration::from_millis(ms), burst);
    let mut initializer =
        InitializerConfig::new(b"simulated agent".to_vec(), "bmaas.demo.invalid:443");
    initializer.exec_timeout = Duration::from_secs(10);
    initializer.backoff =
        Backoff::exponential(Duration::from_secs(1), Duration::from_secs(10), 1.5);
    FleetSettings {
        provisioner: ProvisionerConfig {
            limits: Limits::new(0, 100),
            reconcile_rate: fast(500, 1),
            creation_rate: fast(2, 20),
            creation_parallelism: 4,
        },
        initializer,
        initializer_loop: LoopSettings {
            parallelism: args.initializer_parallelism.max(1),
            db_rate: fast(1, 32),
        },
        recoverer_loop: LoopSettings {
            parallelism: 4,
            db_rate: fast(50, 8),
        },
        recovery: RecoveryThresholds {
            no_heartbeat_after_start: recovery_threshold(args),
            heartbeat_older_than: recovery_threshold(args),
        },
        recoverer_backoff: Backoff::exponential(
            Duration::from_secs(1),
            Duration::from_secs(10),
            1.5,
        ),
        recovery_brake: shepherd_loops::brake::BrakeConfig {
            interval: Duration::from_secs(2),
            ..Default::default()
        },
        recovery_brake_metrics: Default::default(),
        recovery_repeat: shepherd_loops::recoverer::RepeatPolicy {
            backoff: Backoff::exponential(Duration::from_secs(5), Duration::from_secs(60), 2.0)
                .with_jitter(0.1),
            give_up_after: 6,
        },
        recoverer_metrics: Default::default(),
        provisioner_metrics: Default::default(),
        updater_rate: fast(2000, 1),
        session_interval: Duration::from_secs(5),
        retention: Default::default(),
        tasks: Default::default(),
        bare: None,
    }
}

/// How often the demo's agents heartbeat: `--heartbeat-interval`, or every 2 s in small fleets
/// and slower in large ones so that the whole fleet sends about 1,000 heartbeats a second
/// (real agents: every 30 s). The recovery thresholds are four intervals, so only silent
/// agents look lost.
fn agent_heartbeat_interval(args: &DemoArgs) -> Duration {
    args.heartbeat_interval
        .unwrap_or_else(|| Duration::from_millis(args.machines as u64).max(Duration::from_secs(2)))
}

/// How long the demo's agents may be silent before their machine is due for recovery: four
/// heartbeat intervals, and never so short that a heartbeat the server holds past
/// `heartbeat_writes::LATE` could look like silence before the server has reported the trouble
/// (the arithmetic in ARCHITECTURE.md: interval + late + report period, and a margin).
fn recovery_threshold(args: &DemoArgs) -> Duration {
    let interval = agent_heartbeat_interval(args);
    let reported = interval + heartbeat_writes::LATE + heartbeat_writes::REPORT_EVERY;
    (4 * interval).max(reported + Duration::from_secs(2))
}

/// Whether this process may open both ends of a connection for each of `machines` agents, with
/// room to spare (the limit is read from `/proc/self/limits`; unknown counts as enough).
fn open_files_hold_every_connection(machines: usize) -> bool {
    let limit = std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|limits| {
            let line = limits.lines().find(|l| l.starts_with("Max open files"))?;
            line.split_whitespace().nth(3)?.parse::<usize>().ok()
        });
    limit.is_none_or(|limit| 2 * machines + 1024 <= limit)
}

/// Runs the demo: a simulated fleet with real agents against the real server, every loop,
/// progress until every agent heartbeats, then a summary table.
pub async fn run(args: DemoArgs) -> Result<()> {
    if args.machines == 0 {
        bail!("machines: must be at least 1");
    }
    if !(0.0..=1.0).contains(&args.slow_heartbeat_share) {
        bail!("slow-heartbeat-share: must be between 0 and 1");
    }
    if args
        .heartbeat_interval
        .is_some_and(|i| i < Duration::from_millis(100))
    {
        bail!("heartbeat-interval: must be at least 100ms");
    }
    let dir = tempfile::Builder::new()
        .prefix("shepherd-demo-")
        .tempdir()?;
    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let db = Bmdb::open_with(&url, &OpenOptions::migrating(true)).await?;
    eprintln!(
        "shepherd demo: {} simulated machines, BMDB {url}\n  injected: {:.0}% SSH connect failures, {:.0}% garbage agent answers, {:.0}% silent agents (rebooted by the recoverer)",
        args.machines,
        args.connect_failure_rate * 100.0,
        args.bad_agent_rate * 100.0,
        args.silent_agent_rate * 100.0
    );
    let cancel = shutdown_on_signals();
    let (server, fleet, heartbeat_failures) = start_fleet(&args, &db, dir.path()).await?;
    if args.slow_heartbeat_share > 0.0 {
        eprintln!(
            "  injected: the server holds {:.0}% of heartbeats for {} during the first {}",
            args.slow_heartbeat_share * 100.0,
            humantime::format_duration(args.slow_heartbeat_delay),
            humantime::format_duration(args.slow_heartbeat_for),
        );
        server.slow_heartbeats(SlowHeartbeats {
            share: args.slow_heartbeat_share,
            delay: args.slow_heartbeat_delay,
            until: tokio::time::Instant::now() + args.slow_heartbeat_for,
        });
    }
    let writes = server.heartbeat_writes().clone();
    let settings = settings(&args);
    let provider_metrics = Arc::new(CallMetrics::default());
    let http =
        serve_operator_view(&args, &db, &settings, &provider_metrics, &writes, &cancel).await?;
    eprintln!("  web UI: http://{http}/machines · metrics: http://{http}/metrics");

    let provider = Arc::new(InstrumentedProvider::new(fleet.clone(), provider_metrics));
    let started = Instant::now();
    let loops = tokio::spawn(run_loops(
        db.clone(),
        provider,
        fleet.clone(),
        settings,
        cancel.clone(),
    ));
    let until = (args.machines, args.timeout);
    let outcome = watch(until, &db, &fleet, &cancel, started).await?;
    if outcome.converged && args.stay {
        eprintln!(
            "converged in {:.1} s; the fleet keeps running and the web UI stays at \
             http://{http}/machines (Ctrl-C to stop)",
            outcome.elapsed.as_secs_f64()
        );
        cancel.cancelled().await;
    }
    fleet.stop_agents();
    cancel.cancel();
    loops.await??;
    server.close().await?;

    print_table(summary(&db, &fleet, &heartbeat_failures, &writes, &outcome).await?);
    db.close().await;
    if args.keep {
        let path = dir.keep();
        println!("BMDB kept at {}", path.join("bmdb.sqlite").display());
    }
    if !outcome.converged {
        bail!("the fleet did not converge (interrupted or timed out)");
    }
    Ok(())
}

/// The real BMaaS server on loopback TLS and the simulated fleet, every machine's agent
/// running the real agent heartbeat code against it; the agents count their failed heartbeats
/// for the summary rather than print them.
async fn start_fleet(
    args: &DemoArgs,
    db: &Bmdb,
    dir: &std::path::Path,
) -> Result<(LoopbackServer, Arc<SimFleet>, Arc<HeartbeatFailures>)> {
    let knobs = SimKnobs {
        connect_failure: args.connect_failure_rate,
        bad_agent: args.bad_agent_rate,
        silent_agent: args.silent_agent_rate,
        takeover_time: args.takeover_time,
        ..SimKnobs::default()
    };
    let mut limits = ServerLimits::for_loopback_fleet(args.machines);
    let mut between_heartbeats = BetweenHeartbeats::Keep;
    if !open_files_hold_every_connection(args.machines) {
        // Both ends of every agent's connection live in this process: when the file limit
        // cannot hold them all, the server closes a connection idle for half a heartbeat
        // interval, so each agent connects for its heartbeat and fewer are open at once.
        // The agents then close their connection after each heartbeat themselves, rather
        // than hold both ends' buffers for the half interval until the server does.
        limits.idle_timeout = agent_heartbeat_interval(args) / 2;
        between_heartbeats = BetweenHeartbeats::Close;
    }
    let server = LoopbackServer::start(db, &dir.join("certs"), 4, limits).await?;
    let heartbeat_failures = Arc::new(HeartbeatFailures::default());
    let fleet = Arc::new(
        SimFleet::new(args.machines, knobs)?.with_real_agents(RealAgents {
            endpoint: server.endpoint(),
            ca_der: server.ca_der().to_vec(),
            heartbeat_interval: agent_heartbeat_interval(args),
            between_heartbeats,
            failures: heartbeat_failures.clone(),
        }),
    );
    Ok((server, fleet, heartbeat_failures))
}

/// The operator's view, web UI and metrics as `shepherd server` and `shepherd run` serve them,
/// on `--http-listen` or, if that port is taken, a free one; its address.
async fn serve_operator_view(
    args: &DemoArgs,
    db: &Bmdb,
    settings: &FleetSettings,
    provider_metrics: &CallMetrics,
    writes: &HeartbeatWrites,
    cancel: &CancellationToken,
) -> Result<std::net::SocketAddr> {
    let (refresh, stats_interval) = (Duration::from_secs(2), Duration::from_secs(1));
    let mut operator = shepherd_operator::metrics_http::OperatorEndpoint::for_fleet(
        db,
        settings,
        refresh,
        stats_interval,
        cancel.clone(),
    );
    let registry = &mut operator.registry;
    provider_metrics.register(registry, "shepherd_provider", "Provider API");
    writes.register(registry);
    let app = operator.router(db.clone());
    let wanted = shepherd_operator::metrics_http::serve(
        args.http_listen,
        "http-listen",
        app.clone(),
        shepherd_operator::rate_limit::DEFAULT_RATE,
        cancel.clone(),
    )
    .await;
    match wanted {
        Ok(addr) => Ok(addr),
        Err(_) => {
            let any = std::net::SocketAddr::new(args.http_listen.ip(), 0);
            Ok(shepherd_operator::metrics_http::serve(
                any,
                "http-listen",
                app,
                shepherd_operator::rate_limit::DEFAULT_RATE,
                cancel.clone(),
            )
            .await?)
        }
    }
}
