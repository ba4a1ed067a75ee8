//! Fleet-scale benchmark (issue 14). Each figure is measured in the run that writes it, next
//! to its baseline:
//! - the static provider's lookup in a 100,000-machine inventory, against re-reading and
//!   re-parsing the inventory per lookup (what the provider did before it indexed by id);
//! - `shepherd demo` (release binary, SQLite, the default) with 1,000 and with 10,000 machines:
//!   time to converge, their ratio (linear is 10) and the 10,000-machine run's peak RSS.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use shepherd_bmdb::Provider as ProviderKind;
use shepherd_loops::provider::Provider;
use shepherd_loops::static_provider::{parse_inventory, StaticProvider};

/// Settings of the scale benchmark.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Machines in the static inventory.
    #[arg(long, default_value_t = 100_000)]
    inventory: usize,
    /// The small and the large demo fleet.
    #[arg(long, default_values_t = [1_000, 10_000], num_args = 2)]
    demo: Vec<usize>,
    /// How long one demo run may take before it counts as not converging.
    #[arg(long, default_value = "600")]
    demo_timeout_secs: u64,
    /// Where to write the report.
    #[arg(long, default_value = "bench/results/scale.md")]
    out: PathBuf,
}

/// What one demo run measured.
struct DemoRun {
    machines: usize,
    converged_in: Option<Duration>,
    peak_rss_mb: f64,
}

/// Runs the benchmark and writes the report.
pub async fn run(args: Args) -> Result<()> {
    let (ours_ms, baseline_ms) = static_lookup(args.inventory).await?;
    eprintln!("static lookup: {ours_ms:.4} ms (re-parse per lookup: {baseline_ms:.1} ms)");
    let shepherd = build_shepherd()?;
    let mut demos = Vec::new();
    for &machines in &args.demo {
        let run = demo(
            &shepherd,
            machines,
            Duration::from_secs(args.demo_timeout_secs),
        )?;
        eprintln!(
            "demo {machines}: {:?}, peak RSS {:.0} MB",
            run.converged_in, run.peak_rss_mb
        );
        demos.push(run);
    }
    let (small, large) = (&demos[0], &demos[demos.len() - 1]);
    let mut md = format!(
        "# Fleet-scale benchmark\n\n\
         Run on {} with `cargo run --release -p shepherd-bench -- scale` (2 cores). Method: \
         `bench/README.md`.\n\n\
         | measurement | ours | baseline |\n|---|---:|---:|\n\
         | static provider lookup, {} machines, ms | {ours_ms:.4} | {baseline_ms:.1} (re-read and re-parse per lookup) |\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        args.inventory,
    );
    for run in &demos {
        md.push_str(&format!(
            "| `shepherd demo --machines {}`: time to converge, s / peak RSS, MB | {} / {:.0} | |\n",
            run.machines,
            run.converged_in
                .map(|d| format!("{:.1}", d.as_secs_f64()))
                .unwrap_or_else(|| "did not converge".into()),
            run.peak_rss_mb
        ));
    }
    md.push('\n');
    md.push_str(&format!("static_lookup_ms_100k = {ours_ms:.4}\n"));
    if let (Some(a), Some(b)) = (small.converged_in, large.converged_in) {
        md.push_str(&format!(
            "demo_10k_vs_1k = {:.2}\n",
            b.as_secs_f64() / a.as_secs_f64()
        ));
    } else {
        md.push_str("demo_10k_vs_1k = did not converge\n");
    }
    md.push_str(&format!("demo_10k_rss_mb = {:.0}\n", large.peak_rss_mb));
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.out, &md).with_context(|| format!("writing {}", args.out.display()))?;
    print!("{md}");
    Ok(())
}

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
    let ids: Vec<String> = (0..1000)
        .map(|i| format!("m-{:06}", (i * 7919) % n))
        .collect();
    let started = Instant::now();
    for id in &ids {
        provider.get_machine(id).await.context("lookup")?;
    }
    let ours = started.elapsed().as_secs_f64() * 1e3 / ids.len() as f64;
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

/// Builds the release `shepherd` binary and returns its path.
fn build_shepherd() -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let status = Command::new(env!("CARGO"))
        .args(["build", "--release", "-p", "shepherd", "--bin", "shepherd"])
        .current_dir(&root)
        .status()?;
    if !status.success() {
        bail!("cargo build of shepherd failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    Ok(target.join("release/shepherd"))
}

/// Runs `shepherd demo --machines N` to convergence, polling its peak RSS.
fn demo(shepherd: &Path, machines: usize, timeout: Duration) -> Result<DemoRun> {
    let mut child = Command::new(shepherd)
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
        if let Some(kib) = vm_hwm_kib(pid) {
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
        machines,
        converged_in,
        peak_rss_mb: peak_kib as f64 / 1024.0,
    })
}

/// The peak resident set size of a live process.
fn vm_hwm_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
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
    }
}
