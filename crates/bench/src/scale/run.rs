//! `shepherd run --provider sim` (release binary) on Postgres with a large fleet that is
//! provided already (seeded into the BMDB; the simulated machines exist, `--sim-deployed`):
//! takeovers are counted over a window while the initializer works through the backlog. The bound is what the workers can do at all: workers ÷
//! takeover time. Measured: takeovers per second over the window ÷ that bound, and the
//! process's peak RSS over the whole run.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use shepherd_bmdb::{testing, Bmdb, OpenOptions};

/// Settings of one run.
pub struct RunSpec {
    /// Machines of the simulated fleet.
    pub machines: usize,
    /// Initializer workers.
    pub workers: usize,
    /// Time one simulated takeover takes.
    pub takeover: Duration,
    /// How long takeovers are counted once every machine is provided.
    pub window: Duration,
}

/// What one run measured.
pub struct RunResult {
    /// Time from the start of the process to its first takeover.
    pub provisioned_in: Duration,
    /// Takeovers per second over the window.
    pub takeovers_per_second: f64,
    /// Peak RSS of the `shepherd run` process, MB.
    pub peak_rss_mb: f64,
}

/// Runs `shepherd run` as `spec` says against a fresh Postgres database.
pub async fn measure(shepherd: &Path, spec: &RunSpec) -> Result<RunResult> {
    let url = testing::fresh_postgres_database()
        .await
        .context("Postgres is required")?;
    let seeding = Instant::now();
    let db = Bmdb::open_with(&url, &OpenOptions::migrating(true)).await?;
    super::seed::provided(&db, spec.machines).await?;
    eprintln!(
        "seeded {} provided machines in {:.0?}",
        spec.machines,
        seeding.elapsed()
    );
    let mut child = Command::new(shepherd)
        .args(["run", "--provider", "sim", "--database", &url])
        .args([
            "--sim-machines",
            &spec.machines.to_string(),
            "--sim-deployed",
        ])
        .arg(format!(
            "--sim-takeover-time={}ms",
            spec.takeover.as_millis()
        ))
        .args(["--agent-endpoint", "bmaas.test:443"])
        .args(["--provisioner-max-machines", "0"])
        .args(["--initializer-parallelism", &spec.workers.to_string()])
        .args(["--initializer-db-rate", "1ms,64"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()?;
    let result = watch(&mut child, &db, spec).await;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    db.close().await;
    result
}

async fn watch(child: &mut std::process::Child, db: &Bmdb, spec: &RunSpec) -> Result<RunResult> {
    let pid = child.id();
    let started = Instant::now();
    let mut peak_kib = 0u64;
    let mut sample = |child: &mut std::process::Child| -> Result<()> {
        if let Some(status) = child.try_wait()? {
            bail!("shepherd run exited early: {status}");
        }
        peak_kib = peak_kib.max(crate::stats::vm_hwm_kib(pid).unwrap_or(0));
        Ok(())
    };
    let n = spec.machines as i64;
    // The window starts with the first takeover, once the process is up.
    let provisioned_in = loop {
        sample(child)?;
        if db.status_counts().await?.agent_started > 0 {
            break started.elapsed();
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(120),
            "no takeover within 2 minutes"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let before = db.status_counts().await?.agent_started;
    let window_started = Instant::now();
    while window_started.elapsed() < spec.window {
        sample(child)?;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let after = db.status_counts().await?.agent_started;
    let elapsed = window_started.elapsed().as_secs_f64();
    anyhow::ensure!(after < n, "the fleet ran out of machines inside the window");
    sample(child)?;
    Ok(RunResult {
        provisioned_in,
        takeovers_per_second: (after - before) as f64 / elapsed,
        peak_rss_mb: peak_kib as f64 / 1024.0,
    })
}
