//! Heartbeat benchmark. K agents, each with its own TLS
//! connection and client certificate, heartbeat as fast as they can against the server on
//! Postgres; in the same run, the raw ceiling: the heartbeat upsert alone, straight to
//! Postgres, from as many tasks over as many connections as the server's pool has. Also the
//! idle RSS of the real agent and the size of its stripped release binary.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use shepherd_bmdb::testing;
use shepherd_bmdb::{Bmdb, Processor};
use shepherd_proto::agent::TakeoverInit;
use shepherd_proto::Message;
use shepherd_server::{LoopbackServer, ServerLimits};

/// Settings of the heartbeat benchmark.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Simulated agents, each with its own TLS connection.
    #[arg(long, default_value_t = 2000)]
    agents: usize,
    /// Length of each measured run.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// BMDB sessions in the server's pool.
    #[arg(long, default_value_t = 4)]
    sessions: usize,
    /// Where to write the report.
    #[arg(long, default_value = "bench/results/heartbeat.md")]
    out: PathBuf,
}

async fn hammer<F, Fut>(tasks: usize, seconds: u64, f: F) -> (u64, u64)
where
    F: Fn(usize) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let handles: Vec<_> = (0..tasks)
        .map(|i| {
            let (f, ok, failed) = (f.clone(), ok.clone(), failed.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    if f(i).await {
                        ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for h in handles {
        let _ = h.await;
    }
    (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed))
}

/// Idle RSS (MiB) of the real agent, started by takeover and heartbeating to the server.
async fn agent_rss_mib(db: &Bmdb, server: &LoopbackServer) -> Result<f64> {
    let dir = tempfile::tempdir()?;
    let exe = dir.path().join("agent");
    std::fs::copy(crate::binaries::release_binary("shepherd-agent")?, &exe)?;
    let machine = db
        .transact(|tx| Box::pin(async move { tx.create_machine().await }))
        .await?;
    let init = TakeoverInit {
        machine_id: machine.to_string(),
        bmaas_endpoint: server.endpoint(),
        ca_certificate: server.ca_der().to_vec(),
        ..Default::default()
    };
    let mut child = Command::new(&exe)
        .env("SHEPHERD_AGENT_HEARTBEAT_INTERVAL", "1s")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    std::io::Write::write_all(
        &mut child.stdin.take().context("stdin")?,
        &init.encode_to_vec(),
    )?;
    let out = child.wait_with_output()?;
    let key = shepherd_loops::initializer::verify_response(&init, &out.stdout)?;
    db.transact(move |tx| {
        let key = key.clone();
        Box::pin(async move { tx.set_agent_started(machine, &key).await })
    })
    .await?;
    // Let it connect, report hardware and settle into heartbeating.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let beat = db
        .read(move |tx| Box::pin(async move { tx.heartbeat(machine).await }))
        .await?;
    let pgrep = Command::new("pgrep")
        .arg("-f")
        .arg(exe.display().to_string())
        .output()?;
    let pid = String::from_utf8_lossy(&pgrep.stdout)
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("agent pid {pid:?}"))?;
    let _ = Command::new("kill").arg(&pid).status();
    if beat.is_none() {
        bail!("the agent never heartbeated");
    }
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS")?;
    Ok(kib / 1024.0)
}

/// Size (MB) of the release agent binary after `strip`.
fn agent_binary_mb() -> Result<f64> {
    let dir = tempfile::tempdir()?;
    let copy = dir.path().join("agent");
    std::fs::copy(crate::binaries::release_binary("shepherd-agent")?, &copy)?;
    let status = Command::new("strip")
        .arg(&copy)
        .status()
        .context("running strip")?;
    if !status.success() {
        bail!("strip failed");
    }
    Ok(std::fs::metadata(&copy)?.len() as f64 / 1e6)
}

/// Runs the benchmark and writes the report.
pub async fn run(args: Args) -> Result<()> {
    let t = testing::postgres().await.context("Postgres is required")?;
    let db = t.db.clone();
    let dir = tempfile::tempdir()?;
    let server = LoopbackServer::start(
        &db,
        dir.path(),
        args.sessions,
        ServerLimits::for_loopback_fleet(args.agents),
    )
    .await?;
    let (port, ca_pem) = (server.port(), server.ca_pem().to_string());

    println!("creating {} machines and agent identities", args.agents);
    let identities = crate::agents::identities(args.agents);
    let machines = crate::agents::pin(&db, &identities).await?;
    println!("connecting {} agents", args.agents);
    let (agents, _) = crate::agents::connect(
        port,
        &ca_pem,
        &identities,
        &machines,
        32,
        crate::agents::ClientSettings::Plain,
    )
    .await?;
    let agents = Arc::new(agents);

    println!("measuring heartbeats for {} s", args.seconds);
    // Transactions per heartbeat: the server's batches and its other transactions (reports,
    // none here), over the heartbeats answered.
    let writes = |db: &Bmdb| {
        let (batches, _) = db.metrics().heartbeat_batches(Processor::Bmsrv);
        batches + db.metrics().transactions_executed(Processor::Bmsrv)
    };
    let writes_before = writes(&db);
    let a = agents.clone();
    let (ours_ok, ours_failed) = hammer(args.agents, args.seconds, move |i| {
        let a = a.clone();
        async move { a[i].heartbeat().await }
    })
    .await;
    let txn_per_hb = (writes(&db) - writes_before) as f64 / ours_ok.max(1) as f64;
    server.close().await?;
    drop(agents);

    println!("measuring the raw upsert for {} s", args.seconds);
    let raw_pool = Arc::new(
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(shepherd_bmdb::OpenOptions::default().max_connections)
            .connect(&t.url)
            .await?,
    );
    let ids = Arc::new(
        db.read(|tx| Box::pin(async move { tx.machine_ids(None, 1_000_000).await }))
            .await?,
    );
    let (raw_ok, raw_failed) = hammer(args.agents, args.seconds, move |i| {
        let (pool, id) = (raw_pool.clone(), ids[i % ids.len()]);
        async move {
            sqlx::query(
                "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at) VALUES ($1, now()) \
                 ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
            )
            .bind(id)
            .execute(&*pool)
            .await
            .is_ok()
        }
    })
    .await;

    // The real agent, against a fresh server on the same database.
    let server = LoopbackServer::start(
        &db,
        dir.path(),
        1,
        ServerLimits::for_loopback_fleet(args.agents),
    )
    .await?;
    let rss = agent_rss_mib(&db, &server).await;
    server.close().await?;
    let rss = rss?;
    let binary = agent_binary_mb()?;

    let secs = args.seconds as f64;
    let (ours, raw) = (ours_ok as f64 / secs, raw_ok as f64 / secs);
    let ratio = ours / raw;
    let md = format!(
        "# Heartbeat benchmark\n\n\
         {agents} agents, each with its own TLS connection and self-signed ed25519 client certificate, heartbeat \
         back to back for {s} s against the BMaaS server (in-process, loopback, {sessions} pooled sessions) on \
         Postgres; the raw ceiling is the heartbeat upsert alone from {agents} tasks over a pool of the same size \
         as the server's. Client, server and Postgres share the machine ({cores} cores).\n\n\
         | path | heartbeats/s | failed |\n|---|---|---|\n\
         | ours (gRPC + TLS + authorization + upsert + pending-install lookup) | {ours:.0} | {ours_failed} |\n\
         | raw `INSERT … ON CONFLICT DO UPDATE` | {raw:.0} | {raw_failed} |\n\n\
         The agent: idle RSS measured after 5 s of heartbeating once a second; binary size after `strip`.\n\n\
         ratio p3_heartbeat_vs_upsert = {ratio:.2}\n\
         heartbeat_txn_per_hb = {txn_per_hb:.3}\n\
         agent_rss_mb = {rss:.1}\n\
         agent_binary_mb = {binary:.1}\n",
        agents = args.agents,
        s = args.seconds,
        sessions = args.sessions,
        cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    );
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.out, &md)?;
    println!("{md}");
    t.cleanup().await;
    Ok(())
}
