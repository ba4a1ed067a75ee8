//! Memory per connected agent: N simulated agents (each with its own client certificate and
//! TLS connection, made with the real agent's client settings) connect to a server process,
//! heartbeat once and stay connected, idle, within the idle timeout. Measured: the growth of
//! the server process's resident set from before the first connection to then, per agent.
//! Ours is `shepherd server` on SQLite with every agent's key pinned; the baseline is the
//! smallest server on grpc-go with the same service, mutual TLS and connection settings
//! (`bench/grpc-go/main.go`), built by `scripts/grpc-go-baseline.sh`. Both use the same
//! server certificate. After the idle period every agent heartbeats again over its
//! connection, which shows the connections still work.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use shepherd_bmdb::{Bmdb, OpenOptions};

use crate::agents::{self, AgentIdentity};

/// TLS handshakes in flight while connecting.
const PARALLEL: usize = 32;

/// What one server measured.
pub struct Measured {
    /// Growth of the server's resident set per connected agent, KiB.
    pub server_kib_per_agent: f64,
    /// Growth of this (the clients') process's resident set per agent, KiB.
    pub client_kib_per_agent: f64,
    /// Heartbeats answered on connecting, and again after the idle period.
    pub first_ok: usize,
    pub second_ok: usize,
}

/// Measures ours and then the baseline with `n` agents, idle for `idle` after connecting.
pub async fn measure(shepherd: &Path, n: usize, idle: Duration) -> Result<(Measured, Measured)> {
    raise_open_files(n)?;
    let baseline = build_baseline()?;
    let dir = tempfile::tempdir()?;
    let certs = shepherd_server::dev_certs(&dir.path().join("certs"), &["localhost".into()])?;
    let ca_pem = std::fs::read_to_string(&certs.ca_pem)?;
    eprintln!("agent memory: {n} agent identities");
    let identities = agents::identities(n);

    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let db = Bmdb::open_with(&url, &OpenOptions::migrating(true)).await?;
    let machines = agents::pin(&db, &identities).await?;
    db.close().await;
    let limit = (n + 64).to_string();
    let mut ours = Command::new(shepherd);
    ours.args(["--database", &url, "server", "--listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0", "--web-refresh", "0s"])
        .args([
            "--max-connections",
            &limit,
            "--max-connections-per-peer",
            &limit,
        ])
        .args([
            "--max-pending-handshakes-per-peer",
            &(2 * PARALLEL).to_string(),
        ])
        .arg("--dev-certs")
        .arg(dir.path().join("certs"));
    eprintln!("agent memory: shepherd server");
    let ours = run_one(ours, &ca_pem, &identities, &machines, idle).await?;

    let mut grpc = Command::new(baseline);
    grpc.arg("-cert")
        .arg(&certs.cert_pem)
        .arg("-key")
        .arg(&certs.key_pem);
    eprintln!("agent memory: grpc-go baseline");
    let grpc = run_one(grpc, &ca_pem, &identities, &machines, idle).await?;
    Ok((ours, grpc))
}

/// Starts one server, connects every agent, idles, measures, heartbeats again, stops it.
async fn run_one(
    mut command: Command,
    ca_pem: &str,
    identities: &[AgentIdentity],
    machines: &[uuid::Uuid],
    idle: Duration,
) -> Result<Measured> {
    let mut server = command
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .context("starting the server")?;
    let result = async {
        let port = listening_port(&mut server)?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let pid = server.id();
        let server_before = rss_kib(pid)?;
        let client_before = rss_kib(std::process::id())?;
        let (connected, first_ok) =
            agents::connect(
            port,
            ca_pem,
            identities,
            machines,
            PARALLEL,
            agents::ClientSettings::RealAgent,
        )
        .await?;
        tokio::time::sleep(idle).await;
        let server_after = rss_kib(pid)?;
        let client_after = rss_kib(std::process::id())?;
        let second_ok = agents::heartbeat_all(&connected, PARALLEL).await;
        let reconnected = connected
            .iter()
            .filter(|a| a.connections() != Some(1))
            .count();
        if reconnected > 0 {
            bail!("{reconnected} agents did not keep their one connection through the idle period");
        }
        let per_agent = |before: u64, after: u64| {
            after.saturating_sub(before) as f64 / identities.len() as f64
        };
        eprintln!(
            "agent memory: server {server_before} → {server_after} KiB, clients {client_before} → {client_after} KiB; heartbeats {first_ok} and {second_ok} of {}",
            identities.len()
        );
        Ok(Measured {
            server_kib_per_agent: per_agent(server_before, server_after),
            client_kib_per_agent: per_agent(client_before, client_after),
            first_ok,
            second_ok,
        })
    }
    .await;
    let _ = server.kill();
    let _ = server.wait();
    result
}

/// Reads the server's stdout up to its "listening on ADDR" line; returns the port.
fn listening_port(server: &mut Child) -> Result<u16> {
    let stdout = server.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let port = loop {
        let line = lines
            .next()
            .context("the server exited before listening")??;
        if let Some((_, addr)) = line.split_once("listening on ") {
            let addr: std::net::SocketAddr = addr.trim().parse()?;
            break addr.port();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    Ok(port)
}

/// The current resident set of process `pid`, KiB.
fn rss_kib(pid: u32) -> Result<u64> {
    crate::stats::status_kib(pid, "VmRSS").with_context(|| format!("VmRSS of {pid}"))
}

/// This process holds one socket per agent.
fn raise_open_files(n: usize) -> Result<()> {
    let (_, hard) = rlimit::Resource::NOFILE.get()?;
    let wanted = n as u64 + 1024;
    if hard < wanted {
        bail!("{n} agents need {wanted} open files; the hard limit is {hard}");
    }
    rlimit::Resource::NOFILE.set(wanted, hard)?;
    Ok(())
}

/// Builds the grpc-go baseline; returns its path.
fn build_baseline() -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new(root.join("scripts/grpc-go-baseline.sh"))
        .stderr(Stdio::inherit())
        .output()
        .context("running scripts/grpc-go-baseline.sh")?;
    if !out.status.success() {
        bail!("scripts/grpc-go-baseline.sh failed");
    }
    let path = String::from_utf8(out.stdout)?;
    Ok(root.join(path.trim()))
}
