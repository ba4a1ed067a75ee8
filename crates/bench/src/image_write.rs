//! The agent's image writing against `curl | dd` (figures for
//! bench/results/baremetal.md): one raw image, its zstd form and its qcow2 forms (with and
//! without compressed clusters, by qemu-img) are served over loopback HTTP by a static file server, and written
//! onto the same preallocated file by the release agent's `write-image` mode (the code an
//! installation runs: format by magic bytes, sha256 as served, every write checked, one fsync)
//! and by `curl | dd conv=fsync`, in turns, `--repeat` times each; medians are kept. The
//! agent's peak RSS is the kernel's high-water mark of each run (`VmHWM`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

#[derive(Debug, clap::Args)]
pub struct Args {
    /// The raw image's size in MiB.
    #[arg(long, default_value_t = 2048)]
    size_mib: u64,
    /// Runs of each writer; the median is kept.
    #[arg(long, default_value_t = 3)]
    repeat: usize,
}

/// The image's content: of every four MiB, three of bytes with six bits of entropy each (an
/// OS's files compress about so) and one of zeros (free space), so that compression and
/// qcow2's unallocated clusters both count as they do for a real image.
fn make_image(path: &Path, size: u64) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut block = vec![0u8; 1 << 20];
    for i in 0..size >> 20 {
        if i % 4 == 3 {
            block.fill(0);
        } else {
            for b in block.iter_mut() {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                *b = (state >> 58) as u8;
            }
        }
        out.write_all(&block)?;
    }
    out.flush()?;
    Ok(())
}

fn sha256_of(path: &Path) -> Result<String> {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    std::io::copy(&mut std::fs::File::open(path)?, &mut hasher)?;
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Serves `dir` over plain HTTP on a loopback port (with byte ranges, as qcow2 needs).
async fn serve(dir: &Path) -> Result<u16> {
    let app = axum::Router::new().fallback_service(tower_http::services::ServeDir::new(dir));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(port)
}

/// One run of `command`: how long it took, and its peak RSS in MiB, as the kernel keeps it for
/// the program run (`VmHWM`, read until it exits; the rusage of a child would count the pages
/// it shared with this process before its exec).
fn timed(command: &mut Command) -> Result<(Duration, f64)> {
    let started = Instant::now();
    let mut child = command.spawn().context("starting a writer")?;
    let status_file = format!("/proc/{}/status", child.id());
    let mut peak_kib = 0u64;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        let status = std::fs::read_to_string(&status_file).unwrap_or_default();
        let hwm = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok());
        peak_kib = peak_kib.max(hwm.unwrap_or(0));
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = started.elapsed();
    if !status.success() {
        bail!("{command:?} failed: {status}");
    }
    Ok((took, peak_kib as f64 / 1024.0))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

/// `raw` converted to qcow2 at `to` by qemu-img with `options`.
fn qemu_img(raw: &Path, to: &Path, options: &[&str]) -> Result<()> {
    let status = Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .args(options)
        .arg(raw)
        .arg(to)
        .status()
        .context("qemu-img (scripts/test-deps.sh installs it)")?;
    if !status.success() {
        bail!("qemu-img convert failed");
    }
    Ok(())
}

/// A form of the image the agent writes: its name in the figures and its file.
struct Form {
    name: &'static str,
    file: PathBuf,
    sha256: String,
    seconds: Vec<f64>,
    peak_rss_mib: f64,
}

pub async fn run(args: Args) -> Result<()> {
    let agent = crate::binaries::release_binary("shepherd-agent")?;
    let dir = tempfile::tempdir_in(std::env::temp_dir())?;
    let size = args.size_mib << 20;
    let file = |name: &str| dir.path().join(name);
    eprintln!(
        "image-write: making a {} MiB image and its forms",
        args.size_mib
    );
    make_image(&file("raw"), size)?;
    zstd::stream::copy_encode(
        std::fs::File::open(file("raw"))?,
        std::fs::File::create(file("zstd"))?,
        3,
    )?;
    qemu_img(&file("raw"), &file("qcow2"), &["-c"])?;
    qemu_img(&file("raw"), &file("qcow2_plain"), &[])?;
    let mut forms = Vec::new();
    for name in ["raw", "zstd", "qcow2", "qcow2_plain"] {
        forms.push(Form {
            name,
            file: file(name),
            sha256: sha256_of(&file(name))?,
            seconds: vec![],
            peak_rss_mib: 0.0,
        });
    }
    let port = serve(dir.path()).await?;
    let target = file("target");
    std::fs::File::create(&target)?.set_len(size)?;
    let url = |name: &str| format!("http://127.0.0.1:{port}/{name}");
    let mut dd = Command::new("sh");
    dd.args([
        "-c",
        &format!(
            "curl -sSf {} | dd of={} bs=1M conv=notrunc,fsync iflag=fullblock status=none",
            url("raw"),
            target.display()
        ),
    ]);
    let mut dd_s = vec![];
    for round in 1..=args.repeat {
        eprintln!("image-write: round {round} of {}", args.repeat);
        dd_s.push(timed(&mut dd)?.0.as_secs_f64());
        for form in &mut forms {
            let mut agent_writes = Command::new(&agent);
            agent_writes
                .args(["write-image", "--url", &url(form.name), "--sha256"])
                .arg(&form.sha256)
                .arg("--onto")
                .arg(&target);
            let (took, peak) = timed(&mut agent_writes)?;
            form.seconds.push(took.as_secs_f64());
            form.peak_rss_mib = form.peak_rss_mib.max(peak);
        }
    }
    let dd_s = median(dd_s);
    let raw_s = median(forms[0].seconds.clone());
    let mib = args.size_mib as f64;
    println!("image_mib = {mib:.0}");
    println!("dd_mib_s = {:.0}", mib / dd_s);
    println!("agent_raw_mib_s = {:.0}", mib / raw_s);
    println!("install_vs_dd = {:.2}", dd_s / raw_s);
    for form in &forms {
        let served = std::fs::metadata(&form.file)?.len() as f64 / (1 << 20) as f64;
        println!("image_{}_mib = {served:.0}", form.name);
        if form.name != "raw" {
            let ratio = median(form.seconds.clone()) / raw_s;
            println!("{}_install_vs_raw = {ratio:.2}", form.name);
        }
        println!("{}_agent_peak_rss_mb = {:.1}", form.name, form.peak_rss_mib);
    }
    Ok(())
}
