//! Ironic benchmark. N `fake-hardware` nodes in a real,
//! standalone Ironic, from enrolled and `available` to an agent heartbeating on each, with one
//! Shepherd replica (the loops `shepherd run` starts, 32 initializer workers) against the
//! simplest client that could deploy them: per node one reservation PATCH and one deploy PUT,
//! 32 at a time, then polling until every node is `active`. Each side gets a fresh Ironic with
//! the same nodes. Every request goes through a counting proxy, so the calls per node are
//! Ironic's own count, not the client's.
//!
//! Shepherd's takeovers go through the simulated transport (a fixed takeover time, no sshd)
//! and each agent runs the real agent's heartbeat code against the real BMaaS server on
//! loopback TLS: what is measured is Ironic, the provider and the loops, not SSH (the `ssh`
//! benchmark measures that).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::stream::{self, StreamExt};
use serde_json::json;
use shepherd_bmdb::{Backoff, Bmdb, OpenOptions, RecoveryThresholds};
use shepherd_ironic::testing::{FaultProxy, IronicServer, TestAuth};
use shepherd_ironic::{Client, IronicConfig, IronicProvider, RetryPolicy};
use shepherd_loops::fleet::{run_loops, FleetSettings, LoopSettings};
use shepherd_loops::initializer::InitializerConfig;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::ProvisionerConfig;
use shepherd_loops::reconcile::Limits;
use shepherd_provider::metrics::CallMetrics;
use shepherd_server::{LoopbackServer, ServerLimits};
use shepherd_sim::{RealAgents, SimFleet, SimKnobs};
use tokio_util::sync::CancellationToken;

/// Settings of the Ironic benchmark.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Fake-hardware nodes enrolled in Ironic.
    #[arg(long, default_value_t = 1000)]
    nodes: usize,
    /// Initializer workers of the replica; also the baseline's requests in flight.
    #[arg(long, default_value_t = 32)]
    workers: usize,
    /// Creations in flight per replica (`shepherd run --provisioner-parallelism`).
    #[arg(long, default_value_t = 8)]
    creation_parallelism: usize,
    /// Where each fresh Ironic keeps its database.
    #[arg(long, value_enum, default_value_t = IronicDatabase::Postgres)]
    ironic_database: IronicDatabase,
    /// Time one simulated takeover takes (connect, upload, run).
    #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
    takeover_time: Duration,
    /// Give up if a side has not finished by then.
    #[arg(long, default_value = "20m", value_parser = humantime::parse_duration)]
    timeout: Duration,
    /// Where to write the report.
    #[arg(long, default_value = "bench/results/ironic.md")]
    out: PathBuf,
}

/// Where the benchmark's Ironics keep their databases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum IronicDatabase {
    /// A fresh database on the test Postgres (`SHEPHERD_TEST_POSTGRES`), as production
    /// Ironics keep theirs (Postgres or MySQL).
    Postgres,
    /// One SQLite file, as the tests' Ironic does: its conductor then waits on "database is
    /// locked" when many allocations and deploys overlap.
    Sqlite,
}

/// The resource class the benchmark's nodes carry and the replica selects.
const RESOURCE_CLASS: &str = "shepherd-test";

/// An SSH public key line for the config drive; nothing connects with it.
const KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGq5o1Z0b7o0bVQ9oU6w0Qm5lYj3W2iV0m0rYxkz8w8m bench";

/// Nodes per listing page (Ironic's default cap).
const PAGE: usize = 1000;

/// How often both sides look at their progress.
const POLL: Duration = Duration::from_millis(500);

/// Requests a proxy saw, sorted into what they were for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Calls {
    /// Node listings (`GET /v1/nodes?…`): passes and polls, not per node.
    lists: usize,
    /// Everything else: reads, patches and state changes of one node, version negotiation.
    per_node: BTreeMap<String, usize>,
}

impl Calls {
    fn of(proxy: &FaultProxy) -> Calls {
        let mut calls = Calls::default();
        for (method, path) in proxy.faults.seen.lock().unwrap().iter() {
            let path = path.split('?').next().unwrap_or_default();
            if method == "GET" && path.trim_end_matches('/') == "/v1/nodes" {
                calls.lists += 1;
                continue;
            }
            *calls.per_node.entry(kind_of(method, path)).or_default() += 1;
        }
        calls
    }

    fn per_node_total(&self) -> usize {
        self.per_node.values().sum()
    }
}

/// `PATCH /v1/nodes/{id}` → `PATCH node`; `PUT /v1/nodes/{id}/states/provision` → `PUT
/// node/states/provision`.
fn kind_of(method: &str, path: &str) -> String {
    let parts: Vec<&str> = path.trim_matches('/').split('/').collect();
    let shape = match parts.as_slice() {
        ["v1", "nodes", _, rest @ ..] if !rest.is_empty() => format!("node/{}", rest.join("/")),
        ["v1", "nodes", _] => "node".to_string(),
        ["v1", "allocations", _] => "allocation".to_string(),
        other => other.join("/"),
    };
    format!("{method} {shape}")
}

/// A fresh Ironic with `n` available fake-hardware nodes, each naming a simulated machine's
/// address in `extra.ssh_address`, and a counting proxy in front of it (started after the
/// enrolment, so that only the measured side's requests are counted).
async fn ironic_with_nodes(
    n: usize,
    database: IronicDatabase,
) -> Result<(IronicServer, FaultProxy, Duration)> {
    let ironic = match database {
        IronicDatabase::Sqlite => IronicServer::start(TestAuth::None).await,
        IronicDatabase::Postgres => {
            let Some(url) = shepherd_bmdb::testing::fresh_postgres_database().await else {
                bail!("no Postgres for Ironic's database (SHEPHERD_TEST_POSTGRES); or pass --ironic-database sqlite");
            };
            IronicServer::start_on_postgres(TestAuth::None, &url).await
        }
    };
    let started = Instant::now();
    let nodes = ironic
        .fake_nodes(n, |i| json!({ "ssh_address": SimFleet::address_of(i) }))
        .await;
    let took = started.elapsed();
    if nodes.len() != n {
        bail!("enrolled {} nodes of {n}", nodes.len());
    }
    let proxy = FaultProxy::start(&ironic).await;
    Ok((ironic, proxy, took))
}

/// The baseline: reserve and deploy every node directly, `workers` at a time, then poll the
/// node list until every node is active. Returns the time from the first request to the last
/// node active.
async fn direct_deploy(
    proxy: &FaultProxy,
    n: usize,
    workers: usize,
    timeout: Duration,
) -> Result<Duration> {
    let http = reqwest::Client::new();
    let api = |method: reqwest::Method, path: String| {
        http.request(method, format!("{}{path}", proxy.url()))
            .header("X-OpenStack-Ironic-API-Version", "1.81")
    };
    // Page by page, as Ironic caps a page at 1,000 nodes.
    let list = || async {
        let mut nodes: Vec<(String, String)> = Vec::new();
        loop {
            let marker = nodes
                .last()
                .map(|(uuid, _)| format!("&marker={uuid}"))
                .unwrap_or_default();
            let body: serde_json::Value = api(
                reqwest::Method::GET,
                format!(
                    "/v1/nodes?resource_class={RESOURCE_CLASS}&fields=uuid,provision_state&limit={PAGE}{marker}"
                ),
            )
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
            let page = body["nodes"].as_array().cloned().unwrap_or_default();
            nodes.extend(page.iter().map(|n| {
                (
                    n["uuid"].as_str().unwrap_or_default().to_string(),
                    n["provision_state"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                )
            }));
            if page.len() < PAGE {
                return anyhow::Ok(nodes);
            }
        }
    };
    let started = Instant::now();
    let nodes = list().await?;
    if nodes.len() != n {
        bail!("the baseline listed {} nodes of {n}", nodes.len());
    }
    let failures: Vec<String> = stream::iter(nodes)
        .map(|(uuid, _)| {
            let api = &api;
            async move {
                let reserve = json!([
                    {"op": "add", "path": "/instance_uuid", "value": uuid::Uuid::new_v4().to_string()},
                ]);
                let deploy = json!({
                    "target": "active",
                    "configdrive": {"meta_data": {"uuid": uuid, "public_keys": {"bench": KEY}}},
                });
                let patched = api(reqwest::Method::PATCH, format!("/v1/nodes/{uuid}"))
                    .json(&reserve)
                    .send()
                    .await
                    .map_err(|e| e.to_string())?;
                if !patched.status().is_success() {
                    return Err(format!("reserving {uuid}: {}", patched.status()));
                }
                let deployed = api(
                    reqwest::Method::PUT,
                    format!("/v1/nodes/{uuid}/states/provision"),
                )
                .json(&deploy)
                .send()
                .await
                .map_err(|e| e.to_string())?;
                if deployed.status().as_u16() != 202 {
                    return Err(format!("deploying {uuid}: {}", deployed.status()));
                }
                Ok(())
            }
        })
        .buffer_unordered(workers)
        .filter_map(|r| async move { r.err() })
        .collect()
        .await;
    if let Some(first) = failures.first() {
        bail!(
            "the baseline failed {} node(s), e.g. {first}",
            failures.len()
        );
    }
    loop {
        let active = list()
            .await?
            .iter()
            .filter(|(_, state)| state == "active")
            .count();
        if active == n {
            return Ok(started.elapsed());
        }
        if started.elapsed() > timeout {
            bail!("the baseline: {active} of {n} nodes active after {timeout:?}");
        }
        tokio::time::sleep(POLL).await;
    }
}

/// What one replica did.
struct Ours {
    to_heartbeating: Duration,
    takeovers: u64,
}

/// The loops of one replica, as `shepherd run --provider ironic` assembles them, with the
/// pacing an operator of a fast site would choose (a pass every 2 s, creations unpaced).
fn settings(workers: usize, creation_parallelism: usize, n: usize) -> FleetSettings {
    let rate = |ms, burst| RateSpec::new(Duration::from_millis(ms), burst);
    let mut initializer = InitializerConfig::new(b"simulated agent".to_vec(), "unused");
    initializer.exec_timeout = Duration::from_secs(30);
    FleetSettings {
        provisioner: ProvisionerConfig {
            limits: Limits::new(0, n),
            reconcile_rate: rate(2000, 1),
            creation_rate: rate(1, 1000),
            creation_parallelism,
        },
        initializer,
        initializer_loop: LoopSettings {
            parallelism: workers,
            db_rate: rate(1, 32),
        },
        recoverer_loop: LoopSettings {
            parallelism: 4,
            db_rate: rate(250, 8),
        },
        recovery: RecoveryThresholds {
            no_heartbeat_after_start: Duration::from_secs(120),
            heartbeat_older_than: Duration::from_secs(120),
        },
        recoverer_backoff: Backoff::exponential(
            Duration::from_secs(60),
            Duration::from_secs(3600),
            1.2,
        ),
        recovery_brake: Default::default(),
        recovery_brake_metrics: Default::default(),
        recovery_repeat: Default::default(),
        recoverer_metrics: Default::default(),
        provisioner_metrics: Default::default(),
        updater_rate: rate(5 * 60 * 1000, 1),
        session_interval: Duration::from_secs(5),
        retention: Default::default(),
        tasks: Default::default(),
        bare: None,
    }
}

/// `replicas` replicas of one deployment over one fresh SQLite BMDB (each with its own
/// provider, as separate processes would have), until every node's agent heartbeats.
async fn shepherd_replicas(proxy: &FaultProxy, args: &Args, replicas: usize) -> Result<Ours> {
    let dir = tempfile::Builder::new()
        .prefix("shepherd-bench-ironic-")
        .tempdir()?;
    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let db = Bmdb::open_with(&url, &OpenOptions::migrating(true)).await?;
    let server = LoopbackServer::start(
        &db,
        &dir.path().join("certs"),
        4,
        ServerLimits::for_loopback_fleet(args.nodes),
    )
    .await?;
    let knobs = SimKnobs {
        takeover_time: args.takeover_time,
        heartbeat_interval: Duration::from_secs(10),
        ..SimKnobs::default()
    };
    let fleet = Arc::new(
        SimFleet::new(args.nodes, knobs)?.with_real_agents(RealAgents {
            endpoint: server.endpoint(),
            ca_der: server.ca_der().to_vec(),
            heartbeat_interval: knobs.heartbeat_interval,
            between_heartbeats: Default::default(),
            failures: Default::default(),
        }),
    );
    let mut providers = Vec::new();
    for _ in 0..replicas {
        let client = Client::new(
            &proxy.url(),
            shepherd_ironic::Auth::None,
            RetryPolicy::default(),
            Arc::new(CallMetrics::default()),
        )?;
        let mut config = IronicConfig::new("bench", KEY);
        config.selector.resource_class = Some(RESOURCE_CLASS.into());
        config.address_from_inventory = false;
        // Fake deploys finish within a second or two here; real ones take minutes.
        config.deploy_wait = Duration::from_secs(2);
        providers.push(Arc::new(IronicProvider::connect(client, config).await?));
    }

    let cancel = CancellationToken::new();
    let started = Instant::now();
    let loops: Vec<_> = providers
        .into_iter()
        .map(|provider| {
            tokio::spawn(run_loops(
                db.clone(),
                provider,
                fleet.clone(),
                settings(args.workers, args.creation_parallelism, args.nodes),
                cancel.clone(),
            ))
        })
        .collect();
    let n = args.nodes as i64;
    let mut last_progress = Instant::now();
    let outcome = loop {
        let counts = db.status_counts().await?;
        if last_progress.elapsed() >= Duration::from_secs(10) {
            last_progress = Instant::now();
            eprintln!(
                "  {:>5.1} s: provided {} · agent started {} · heartbeating {}",
                started.elapsed().as_secs_f64(),
                counts.provided,
                counts.agent_started,
                counts.heartbeating
            );
        }
        if counts.heartbeating == n {
            break Ok(started.elapsed());
        }
        if started.elapsed() > args.timeout {
            break Err(anyhow::anyhow!(
                "ours: {} provided, {} started, {} heartbeating of {n} after {:?}",
                counts.provided,
                counts.agent_started,
                counts.heartbeating,
                args.timeout
            ));
        }
        tokio::time::sleep(POLL).await;
    };
    cancel.cancel();
    for replica in loops {
        replica.await.context("the loops panicked")??;
    }
    fleet.stop_agents();
    server.close().await?;
    Ok(Ours {
        to_heartbeating: outcome?,
        takeovers: fleet.counters().takeovers,
    })
}

/// `replicas` replicas of ours on a fresh Ironic with the benchmark's nodes: what they did and
/// the requests Ironic answered.
async fn ours_on_a_fresh_ironic(args: &Args, replicas: usize) -> Result<(Ours, Calls)> {
    let n = args.nodes;
    eprintln!("ours, {replicas} replica(s): a fresh Ironic with {n} fake-hardware nodes");
    let (_ironic, proxy, enrol) = ironic_with_nodes(n, args.ironic_database).await?;
    eprintln!(
        "  enrolled in {:.1} s; {} workers per replica",
        enrol.as_secs_f64(),
        args.workers
    );
    let ours = shepherd_replicas(&proxy, args, replicas).await?;
    let calls = Calls::of(&proxy);
    eprintln!(
        "  all heartbeating in {:.1} s: {calls:?}",
        ours.to_heartbeating.as_secs_f64()
    );
    Ok((ours, calls))
}

pub async fn run(args: Args) -> Result<()> {
    let n = args.nodes;
    if n == 0 || args.workers == 0 || !(1..=64).contains(&args.creation_parallelism) {
        bail!("nodes and workers: must be at least 1; creation parallelism: 1 to 64");
    }

    eprintln!("baseline: a fresh Ironic with {n} fake-hardware nodes");
    let (ironic, proxy, enrol) = ironic_with_nodes(n, args.ironic_database).await?;
    eprintln!(
        "  enrolled in {:.1} s; deploying directly",
        enrol.as_secs_f64()
    );
    let direct = direct_deploy(&proxy, n, args.workers, args.timeout).await?;
    let direct_calls = Calls::of(&proxy);
    eprintln!(
        "  all active in {:.1} s: {direct_calls:?}",
        direct.as_secs_f64()
    );
    drop(proxy);
    drop(ironic);

    let (ours, calls) = ours_on_a_fresh_ironic(&args, 1).await?;
    let (two, two_calls) = ours_on_a_fresh_ironic(&args, 2).await?;

    let md = report(
        &args,
        direct,
        &direct_calls,
        &[(&ours, &calls), (&two, &two_calls)],
    );
    print!("{md}");
    std::fs::write(&args.out, &md)?;
    Ok(())
}

/// The report; `runs` are ours with one replica, then with two.
fn report(
    args: &Args,
    direct: Duration,
    direct_calls: &Calls,
    runs: &[(&Ours, &Calls); 2],
) -> String {
    let [(ours, calls), (two, two_calls)] = *runs;
    let n = args.nodes;
    let per_node = |c: &Calls| c.per_node_total() as f64 / n as f64;
    let table = |c: &Calls| {
        c.per_node
            .iter()
            .map(|(kind, count)| {
                format!("| `{kind}` | {count} | {:.2} |\n", *count as f64 / n as f64)
            })
            .collect::<String>()
            + &format!(
                "| `GET nodes` (listings) | {} | {:.2} |\n",
                c.lists,
                c.lists as f64 / n as f64
            )
    };
    let mut md = String::new();
    md += "# Ironic benchmark\n\n";
    md += &format!(
        "{n} nodes of Ironic's `fake-hardware` type in a standalone Ironic 39 (one all-in-one process, its database on {db}), from `available` to an agent heartbeating on every node. \
         **Ours:** one replica (the loops `shepherd run` starts: provisioner passes every 2 s, {c} creations in flight, {w} initializer workers, SQLite BMDB) claiming nodes through Ironic's Allocation API, then, on another fresh Ironic, two replicas of one deployment on one BMDB racing for the same nodes; the simulated transport ({t:?} per takeover, no sshd) and the real agent's heartbeat code on every machine against the BMaaS server over loopback TLS. \
         **Baseline:** the least a client can do to deploy the same nodes: per node one reservation PATCH and one deploy PUT with a config drive, {w} at a time, then a node listing every {p:?} until every node is `active` (no takeover, no agent). \
         Each side gets a fresh Ironic; every request goes through a counting proxy. Both share the machine (2 cores) with Ironic.\n\n",
        w = args.workers,
        c = args.creation_parallelism,
        db = match args.ironic_database {
            IronicDatabase::Postgres => "Postgres",
            IronicDatabase::Sqlite => "SQLite",
        },
        t = args.takeover_time,
        p = POLL,
    );
    md += "| side | time | takeovers |\n|---|---|---|\n";
    md += &format!(
        "| ours: enrolled → heartbeating | {:.1} s | {} |\n",
        ours.to_heartbeating.as_secs_f64(),
        ours.takeovers
    );
    md += &format!(
        "| ours, two replicas: enrolled → heartbeating | {:.1} s | {} |\n",
        two.to_heartbeating.as_secs_f64(),
        two.takeovers
    );
    md += &format!(
        "| baseline: enrolled → active | {:.1} s | – |\n\n",
        direct.as_secs_f64()
    );
    md += "Requests Ironic answered, ours (one replica):\n\n| request | count | per node |\n|---|---|---|\n";
    md += &table(calls);
    md += "\nRequests Ironic answered, ours (two replicas):\n\n| request | count | per node |\n|---|---|---|\n";
    md += &table(two_calls);
    md +=
        "\nRequests Ironic answered, baseline:\n\n| request | count | per node |\n|---|---|---|\n";
    md += &table(direct_calls);
    md += "\nListings are a pass or a poll, not per node: one per provisioner pass (every 2 s) and updater pass, whatever the fleet size; they are left out of `ironic_api_calls_per_node` and counted in `ironic_api_calls_per_node_with_listings`.\n\n";
    md += &format!(
        "ironic_1000_nodes_to_heartbeating_s = {:.1}\n",
        ours.to_heartbeating.as_secs_f64()
    );
    md += &format!("ironic_direct_deploy_s = {:.1}\n", direct.as_secs_f64());
    md += &format!(
        "ratio ironic_to_heartbeating_vs_direct_deploy = {:.2}\n",
        ours.to_heartbeating.as_secs_f64() / direct.as_secs_f64()
    );
    md += &format!("ironic_api_calls_per_node = {:.2}\n", per_node(calls));
    md += &format!(
        "ironic_api_calls_per_node_two_replicas = {:.2}\n",
        per_node(two_calls)
    );
    md += &format!(
        "ironic_1000_nodes_to_heartbeating_two_replicas_s = {:.1}\n",
        two.to_heartbeating.as_secs_f64()
    );
    md += &format!(
        "ironic_api_calls_per_node_with_listings = {:.2}\n",
        (calls.per_node_total() + calls.lists) as f64 / n as f64
    );
    md += &format!(
        "ironic_direct_api_calls_per_node = {:.2}\n",
        per_node(direct_calls)
    );
    md
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_sorted_by_shape() {
        assert_eq!(kind_of("PATCH", "/v1/nodes/abc"), "PATCH node");
        assert_eq!(
            kind_of("PUT", "/v1/nodes/abc/states/provision"),
            "PUT node/states/provision"
        );
        assert_eq!(kind_of("GET", "/v1/"), "GET v1");
        assert_eq!(kind_of("POST", "/v1/allocations"), "POST v1/allocations");
        assert_eq!(kind_of("GET", "/v1/allocations/abc"), "GET allocation");
    }
}
