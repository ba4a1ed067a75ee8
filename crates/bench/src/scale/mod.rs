//! Fleet-scale benchmark. Each figure is measured in the run that writes it, next
//! to its baseline:
//! - the static provider's lookup in a 100,000-machine inventory, against re-reading and
//!   re-parsing the inventory per lookup (what the provider did before it indexed by id);
//! - `shepherd demo` (release binary, SQLite, the default) with 1,000 and with 10,000 machines:
//!   time to converge, their ratio (linear is 10) and the 10,000-machine run's peak RSS;
//! - `shepherd run --provider sim` on Postgres with 100,000 machines (`run.rs`): takeovers per
//!   second against the workers' bound, and peak RSS;
//! - SQLite's writer under the updater with 90,000 machines (`writer.rs`): the longest wait
//!   for the writer and the sessions that expired, against the one-transaction updater;
//! - the web UI's p99 with 100,000 machines against 1,000 (`web.rs`);
//! - memory per connected agent in `shepherd server` against a grpc-go server (`agents.rs`).

mod agents;
mod run;
mod seed;
mod web;
pub(crate) mod writer;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use shepherd_bmdb::ProviderKind;
use shepherd_provider::static_inventory::parse_inventory;
use shepherd_provider::static_provider::StaticProvider;
use shepherd_provider::Provider;

/// The parts of the benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    /// Static inventory lookups.
    Static,
    /// The demo at two sizes, and on one core.
    Demo,
    /// `shepherd run --provider sim` on Postgres.
    Run,
    /// SQLite's writer under the updater.
    Sqlite,
    /// The web UI at two sizes.
    Web,
    /// Server memory per connected agent, against grpc-go.
    Agents,
}

/// Settings of the scale benchmark.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The parts to run (all by default); the report holds the figures of those only.
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Part>,
    /// Machines in the static inventory.
    #[arg(long, default_value_t = 100_000)]
    inventory: usize,
    /// The small and the large demo fleet.
    #[arg(long, default_values_t = [1_000, 10_000], num_args = 2)]
    demo: Vec<usize>,
    /// How long one demo run may take before it counts as not converging.
    #[arg(long, default_value = "600")]
    demo_timeout_secs: u64,
    /// The demo fleet run on one core (`taskset -c 0`): a machine slower than the fleet needs.
    #[arg(long, default_value_t = 3_000)]
    demo_one_core: usize,
    /// Machines of the `shepherd run` fleet.
    #[arg(long, default_value_t = 100_000)]
    run_machines: usize,
    /// Initializer workers of `shepherd run`.
    #[arg(long, default_value_t = 32)]
    run_workers: usize,
    /// Simulated takeover time, ms.
    #[arg(long, default_value_t = 100)]
    run_takeover_ms: u64,
    /// The window takeovers are counted over, s.
    #[arg(long, default_value_t = 60)]
    run_window_secs: u64,
    /// Machines on SQLite for the writer part.
    #[arg(long, default_value_t = 90_000)]
    sqlite_machines: usize,
    /// How long each updater of the writer part runs, s.
    #[arg(long, default_value_t = 30)]
    sqlite_seconds: u64,
    /// Worker sessions writing meanwhile.
    #[arg(long, default_value_t = 8)]
    sqlite_workers: usize,
    /// The small and the large web UI fleet.
    #[arg(long, default_values_t = [1_000, 100_000], num_args = 2)]
    web: Vec<usize>,
    /// Rounds of paging through every filter.
    #[arg(long, default_value_t = 20)]
    web_rounds: usize,
    /// Agents connected at once for the memory part.
    #[arg(long, default_value_t = 10_000)]
    agents: usize,
    /// How long the agents stay idle, after their first heartbeat, before the measurement, s
    /// (below the servers' 120 s idle timeout).
    #[arg(long, default_value_t = 10)]
    agents_idle_secs: u64,
    /// Where to write the report.
    #[arg(long, default_value = "bench/results/scale.md")]
    out: PathBuf,
}

impl Args {
    fn runs(&self, part: Part) -> bool {
        self.only.is_empty() || self.only.contains(&part)
    }
}

/// What one demo run measured.
struct DemoRun {
    converged_in: Option<Duration>,
    peak_rss_mb: f64,
    /// Its summary table, as printed.
    summary: Vec<String>,
}

impl DemoRun {
    /// Time to converge, s, or why not.
    fn converge_s(&self) -> String {
        self.converged_in
            .map(|d| format!("{:.1}", d.as_secs_f64()))
            .unwrap_or_else(|| "did not converge".into())
    }

    /// The value of the summary's row `name`, or `?`.
    fn value(&self, name: &str) -> String {
        summary_value(&self.summary, name).unwrap_or_else(|| "?".into())
    }
}

/// A report: table rows and `key = value` figures.
#[derive(Default)]
struct Report {
    rows: String,
    figures: String,
}

impl Report {
    fn row(&mut self, what: &str, ours: String, baseline: &str) {
        self.rows
            .push_str(&format!("| {what} | {ours} | {baseline} |\n"));
    }

    fn figure(&mut self, key: &str, value: String) {
        eprintln!("{key} = {value}");
        self.figures.push_str(&format!("{key} = {value}\n"));
    }
}

/// Runs the benchmark and writes the report.
pub async fn run(args: Args) -> Result<()> {
    let mut report = Report::default();
    if args.runs(Part::Static) {
        let (ours_ms, baseline_ms) = static_lookup(args.inventory).await?;
        report.row(
            &format!("static provider lookup, {} machines, ms", args.inventory),
            format!("{ours_ms:.4}"),
            &format!("{baseline_ms:.1} (re-read and re-parse per lookup)"),
        );
        report.figure("static_lookup_ms_100k", format!("{ours_ms:.4}"));
    }
    let needs_binary = [Part::Demo, Part::Run, Part::Web, Part::Agents]
        .iter()
        .any(|&p| args.runs(p));
    let shepherd = if needs_binary {
        Some(crate::binaries::release_binary("shepherd")?)
    } else {
        None
    };
    if let (true, Some(shepherd)) = (args.runs(Part::Demo), &shepherd) {
        demos(shepherd, &args, &mut report)?;
    }
    if let (true, Some(shepherd)) = (args.runs(Part::Run), &shepherd) {
        let spec = run::RunSpec {
            machines: args.run_machines,
            workers: args.run_workers,
            takeover: Duration::from_millis(args.run_takeover_ms),
            window: Duration::from_secs(args.run_window_secs),
        };
        let r = run::measure(shepherd, &spec).await?;
        let bound = spec.workers as f64 / spec.takeover.as_secs_f64();
        report.row(
            &format!(
                "`shepherd run --provider sim --sim-deployed`, Postgres, {} machines provided, {} workers × {} ms: takeovers/s / bound; first takeover after, s; peak RSS, MB",
                spec.machines, spec.workers, args.run_takeover_ms
            ),
            format!(
                "{:.0} / {bound:.0}; {:.0}; {:.0}",
                r.takeovers_per_second,
                r.provisioned_in.as_secs_f64(),
                r.peak_rss_mb
            ),
            "the workers' bound",
        );
        report.figure(
            "run_100k_vs_bound",
            format!("{:.2}", r.takeovers_per_second / bound),
        );
        report.figure("run_100k_rss_mb", format!("{:.0}", r.peak_rss_mb));
    }
    if args.runs(Part::Sqlite) {
        sqlite_writer(&args, &mut report).await?;
    }
    if let (true, Some(shepherd)) = (args.runs(Part::Web), &shepherd) {
        let (small, large) = (args.web[0], args.web[args.web.len() - 1]);
        let (p99_small, n_small) = web::p99_ms(shepherd, small, args.web_rounds).await?;
        let (p99_large, n_large) = web::p99_ms(shepherd, large, args.web_rounds).await?;
        report.row(
            &format!("web UI p99, one client paging and filtering, {large} machines ({n_large} requests), ms"),
            format!("{p99_large:.1}"),
            &format!("{p99_small:.1} with {small} machines ({n_small} requests)"),
        );
        report.figure(
            "web_p99_100k_vs_1k",
            format!("{:.2}", p99_large / p99_small),
        );
    }
    if let (true, Some(shepherd)) = (args.runs(Part::Agents), &shepherd) {
        agent_memory(shepherd, &args, &mut report).await?;
    }
    let md = format!(
        "# Fleet-scale benchmark\n\n\
         Run on {} with `cargo run --release -p shepherd-bench -- scale` (2 cores). Method: \
         `bench/README.md`.\n\n\
         | measurement | ours | baseline |\n|---|---:|---:|\n{}\n{}",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        report.rows,
        report.figures,
    );
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.out, &md).with_context(|| format!("writing {}", args.out.display()))?;
    print!("{md}");
    Ok(())
}

/// The demo with the small and the large fleet, then the middle one on one core.
fn demos(shepherd: &Path, args: &Args, report: &mut Report) -> Result<()> {
    let timeout = Duration::from_secs(args.demo_timeout_secs);
    let mut runs = Vec::new();
    for &machines in &args.demo {
        let run = demo(shepherd, machines, timeout, false)?;
        eprintln!(
            "demo {machines}: {:?}, peak RSS {:.0} MB",
            run.converged_in, run.peak_rss_mb
        );
        report.row(
            &format!("`shepherd demo --machines {machines}`: time to converge, s / peak RSS, MB"),
            format!("{} / {:.0}", run.converge_s(), run.peak_rss_mb),
            "",
        );
        runs.push(run);
    }
    let (small, large) = (&runs[0], &runs[runs.len() - 1]);
    let ratio = match (small.converged_in, large.converged_in) {
        (Some(a), Some(b)) => format!("{:.2}", b.as_secs_f64() / a.as_secs_f64()),
        _ => "did not converge".into(),
    };
    report.figure("demo_10k_vs_1k", ratio);
    report.figure("demo_10k_converge_s", large.converge_s());
    report.figure("demo_10k_rss_mb", format!("{:.0}", large.peak_rss_mb));
    let machines = args.demo_one_core;
    let one = demo(shepherd, machines, timeout, true)?;
    let healthy = one.value("  of healthy machines");
    report.row(
        &format!(
            "`taskset -c 0 shepherd demo --machines {machines}`: time to converge, s / peak RSS, MB; \
             reboots of healthy machines / of silent ones injected; heartbeats failed"
        ),
        format!(
            "{} / {:.0}; {healthy} / {}; {}",
            one.converge_s(),
            one.peak_rss_mb,
            one.value("  injected silent agents"),
            one.value("agent heartbeats failed"),
        ),
        "",
    );
    report.figure("demo_3k_one_core_converge_s", one.converge_s());
    report.figure("demo_3k_one_core_rss_mb", format!("{:.0}", one.peak_rss_mb));
    report.figure("overload_healthy_reboots", healthy);
    Ok(())
}

/// Server memory per connected agent, ours against grpc-go.
async fn agent_memory(shepherd: &Path, args: &Args, report: &mut Report) -> Result<()> {
    let n = args.agents;
    let idle = Duration::from_secs(args.agents_idle_secs);
    let (ours, grpc) = agents::measure(shepherd, n, idle).await?;
    for (who, m) in [("shepherd server", &ours), ("grpc-go", &grpc)] {
        anyhow::ensure!(
            m.first_ok == n && m.second_ok == n,
            "{who}: {} and {} of {n} heartbeats succeeded",
            m.first_ok,
            m.second_ok
        );
    }
    report.row(
        &format!(
            "server memory per connected agent, {n} agents idle {}s after one heartbeat (all heartbeat again after), KiB; the clients' side, KiB",
            args.agents_idle_secs
        ),
        format!(
            "{:.1}; {:.1}",
            ours.server_kib_per_agent, ours.client_kib_per_agent
        ),
        &format!(
            "{:.1} (grpc-go 1.33, Debian, same service, mutual TLS and limits)",
            grpc.server_kib_per_agent
        ),
    );
    report.figure(
        "server_kib_per_agent",
        format!("{:.1}", ours.server_kib_per_agent),
    );
    report.figure(
        "server_kib_per_agent_vs_grpc",
        format!(
            "{:.2}",
            ours.server_kib_per_agent / grpc.server_kib_per_agent
        ),
    );
    report.figure(
        "client_kib_per_agent",
        format!("{:.1}", ours.client_kib_per_agent),
    );
    Ok(())
}

/// SQLite's writer with a large fleet: the updater as it is, then the one-transaction
/// baseline, each over the same seeded database.
async fn sqlite_writer(args: &Args, report: &mut Report) -> Result<()> {
    let n = args.sqlite_machines;
    let (t, ids) = writer::seeded(n).await?;
    let (secs, workers) = (args.sqlite_seconds, args.sqlite_workers);
    let ours = writer::run(&t.url, &ids, secs, workers, false).await?;
    let baseline = writer::run(&t.url, &ids, secs, workers, true).await?;
    t.cleanup().await;
    for (what, r) in [("ours", &ours), ("baseline", &baseline)] {
        eprintln!(
            "sqlite writer, {what}: longest wait {:?}, {} sessions expired, {} passes",
            r.longest_wait, r.sessions_expired, r.passes
        );
    }
    let cell = |r: &writer::WriterRun| {
        format!(
            "{:.0} / {} / {}",
            r.longest_wait.as_secs_f64() * 1e3,
            r.sessions_expired,
            r.passes
        )
    };
    report.row(
        &format!("SQLite, {n} machines, updater every second and {workers} writing sessions for {secs} s: longest writer wait, ms / sessions expired / updater passes"),
        cell(&ours),
        &format!("{} (one write transaction per pass)", cell(&baseline)),
    );
    report.figure(
        "sqlite_max_writer_wait_ms_90k",
        format!("{:.0}", ours.longest_wait.as_secs_f64() * 1e3),
    );
    report.figure(
        "sqlite_sessions_expired_90k",
        ours.sessions_expired.to_string(),
    );
    Ok(())
}

/// Timed rounds of the static provider's lookups, and lookups in each.
const LOOKUP_ROUNDS: usize = 7;
const LOOKUPS_PER_ROUND: usize = 20_000;

/// Milliseconds per lookup in an inventory of `n` machines: the provider's (parsed once,
/// indexed by id) and the baseline's (read and parse the file, then search it).
async fn static_lookup(n: usize) -> Result<(f64, f64)> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("inventory.json");
    let entries: Vec<String> = (0..n)
        .map(|i| {
            format!(
                r#"{{"ID":"m-{i:06}","Addr":"10.{}.{}.{}","Location":"rack-{}"}}"#,
                i >> 16,
                (i >> 8) & 255,
                i & 255,
                i % 100
            )
        })
        .collect();
    std::fs::write(&path, format!("[{}]", entries.join(",")))?;
    let url = format!("file://{}", path.display());
    let provider = StaticProvider::new(&url, ProviderKind::Static)?;
    provider.load_at_start().await?;
    let ids: Vec<String> = (0..LOOKUPS_PER_ROUND)
        .map(|i| format!("m-{:06}", (i * 7919) % n))
        .collect();
    // A lookup takes about a microsecond, so one round of a thousand was at the mercy of a
    // single scheduler hiccup: the median of several rounds is reported.
    let mut rounds = Vec::with_capacity(LOOKUP_ROUNDS);
    for _ in 0..LOOKUP_ROUNDS {
        let started = Instant::now();
        for id in &ids {
            provider.get_machine(id).await.context("lookup")?;
        }
        rounds.push(started.elapsed() / LOOKUPS_PER_ROUND as u32);
    }
    let ours = crate::stats::quantile(&mut rounds, 0.5).as_secs_f64() * 1e3;
    let rounds = 5;
    let started = Instant::now();
    for id in ids.iter().take(rounds) {
        let inventory = parse_inventory(&std::fs::read(&path)?)?;
        inventory
            .iter()
            .find(|e| &e.id == id)
            .context("baseline lookup")?;
    }
    let baseline = started.elapsed().as_secs_f64() * 1e3 / rounds as f64;
    Ok((ours, baseline))
}

/// Runs `shepherd demo --machines N` to convergence (on the first core alone if `one_core`),
/// polling its peak RSS.
fn demo(shepherd: &Path, machines: usize, timeout: Duration, one_core: bool) -> Result<DemoRun> {
    let mut command = if one_core {
        let mut taskset = Command::new("taskset");
        taskset.args(["-c", "0"]).arg(shepherd);
        taskset
    } else {
        Command::new(shepherd)
    };
    let mut child = command
        .args(["demo", "--machines", &machines.to_string()])
        .args(["--http-listen", "127.0.0.1:0"])
        .args(["--timeout", &format!("{}s", timeout.as_secs())])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let pid = child.id();
    let stdout = child.stdout.take().context("stdout")?;
    let reader = std::thread::spawn(move || {
        BufReader::new(stdout)
            .lines()
            .map_while(|l| l.ok())
            .collect::<Vec<_>>()
    });
    let mut peak_kib = 0u64;
    let deadline = Instant::now() + timeout + Duration::from_secs(30);
    loop {
        if let Some(kib) = crate::stats::vm_hwm_kib(pid) {
            peak_kib = peak_kib.max(kib);
        }
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let status = child.wait()?;
    let lines = reader.join().unwrap_or_default();
    let converged_in = status.success().then(|| converge_time(&lines)).flatten();
    Ok(DemoRun {
        converged_in,
        peak_rss_mb: peak_kib as f64 / 1024.0,
        summary: lines,
    })
}

/// The value of the demo summary's row `name` (rows are `name   value`).
fn summary_value(lines: &[String], name: &str) -> Option<String> {
    let line = lines.iter().find(|l| l.starts_with(name))?;
    Some(line[name.len()..].trim().to_string())
}

/// The demo's "time to converge" summary line, e.g. `time to converge  12.3 s`.
fn converge_time(lines: &[String]) -> Option<Duration> {
    let line = lines.iter().find(|l| l.starts_with("time to converge"))?;
    let value = line.trim_start_matches("time to converge").trim();
    let secs: f64 = value.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_secs_f64(secs))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_summary_line_is_read() {
        let lines = vec![
            "summary  value".to_string(),
            "time to converge    14.7 s".into(),
        ];
        assert_eq!(converge_time(&lines), Some(Duration::from_millis(14_700)));
        assert_eq!(converge_time(&["other".to_string()]), None);
        let rows = vec!["  of healthy machines      0".to_string()];
        assert_eq!(
            summary_value(&rows, "  of healthy machines").as_deref(),
            Some("0")
        );
    }
}
