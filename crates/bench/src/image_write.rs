//! The agent's image writing against `curl | dd` (issue 63's figures in
//! bench/results/baremetal.md): one raw image, its zstd form and its qcow2 form (compressed
//! clusters, by qemu-img) are served over loopback HTTP by a static file server, and written
//! onto the same preallocated file by the release agent's `write-image` mode (the code an
//! installation runs: format by magic bytes, sha256 as served, every write checked, one fsync)
//! and by `curl | dd conv=fsync`, in turns, `--repeat` times each; medians are kept. The
//! agent's peak RSS is read from the kernel's account of each run (`wait4`).

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

/// One run of `command`: how long it took, and its peak RSS in MiB.
fn timed(command: &mut Command) -> Result<(Duration, f64)> {
    let started = Instant::now();
    let child = command.spawn().context("starting a writer")?;
    let mut status = 0;
    // SAFETY: an all-zero rusage is a valid value for wait4 to fill in.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pid is our own child's, and both pointers are to live locals.
    let pid = unsafe { libc::wait4(child.id() as i32, &mut status, 0, &mut usage) };
    let took = started.elapsed();
    if pid < 0 || !libc::WIFEXITED(status) || libc::WEXITSTATUS(status) != 0 {
        bail!("{command:?} failed (status {status})");
    }
    Ok((took, usage.ru_maxrss as f64 / 1024.0))
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

pub async fn run(args: Args) -> Result<()> {
    let agent = crate::binaries::release_binary("shepherd-agent")?;
    let dir = tempfile::tempdir_in(std::env::temp_dir())?;
    let size = args.size_mib << 20;
    let raw = dir.path().join("image.raw");
    eprintln!("image-write: making a {} MiB image", args.size_mib);
    make_image(&raw, size)?;
    let zst = dir.path().join("image.raw.zst");
    let encoded = zstd::encode_all(std::fs::File::open(&raw)?, 3)?;
    std::fs::write(&zst, encoded)?;
    let qcow2 = dir.path().join("image.qcow2");
    let status = Command::new("qemu-img")
        .args(["convert", "-c", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow2)
        .status()
        .context("qemu-img (scripts/test-deps.sh installs it)")?;
    if !status.success() {
        bail!("qemu-img convert failed");
    }
    let port = serve(dir.path()).await?;
    let target = dir.path().join("target");
    std::fs::File::create(&target)?.set_len(size)?;
    let url = |name: &str| format!("http://127.0.0.1:{port}/{name}");
    let sums = [
        (&raw, sha256_of(&raw)?),
        (&zst, sha256_of(&zst)?),
        (&qcow2, sha256_of(&qcow2)?),
    ];
    let agent_writes = |name: &str, file: &PathBuf| -> Result<Command> {
        let sum = &sums.iter().find(|(f, _)| *f == file).context("a sum")?.1;
        let mut command = Command::new(&agent);
        command
            .args(["write-image", "--url", &url(name), "--sha256"])
            .arg(sum)
            .arg("--onto")
            .arg(&target);
        Ok(command)
    };
    let mut dd = Command::new("sh");
    dd.args([
        "-c",
        &format!(
            "curl -sSf {} | dd of={} bs=1M conv=notrunc,fsync iflag=fullblock status=none",
            url("image.raw"),
            target.display()
        ),
    ]);
    let (mut dd_s, mut raw_s, mut zstd_s, mut qcow2_s, mut rss) =
        (vec![], vec![], vec![], vec![], 0f64);
    for round in 1..=args.repeat {
        eprintln!("image-write: round {round} of {}", args.repeat);
        dd_s.push(timed(&mut dd)?.0.as_secs_f64());
        raw_s.push(
            timed(&mut agent_writes("image.raw", &raw)?)?
                .0
                .as_secs_f64(),
        );
        zstd_s.push(
            timed(&mut agent_writes("image.raw.zst", &zst)?)?
                .0
                .as_secs_f64(),
        );
        let (took, peak) = timed(&mut agent_writes("image.qcow2", &qcow2)?)?;
        qcow2_s.push(took.as_secs_f64());
        rss = rss.max(peak);
    }
    let (dd_s, raw_s, zstd_s, qcow2_s) =
        (median(dd_s), median(raw_s), median(zstd_s), median(qcow2_s));
    let mib = args.size_mib as f64;
    let served = |p: &Path| std::fs::metadata(p).map(|m| m.len() as f64 / (1 << 20) as f64);
    println!("image_mib = {mib:.0}");
    println!("image_zstd_mib = {:.0}", served(&zst)?);
    println!("image_qcow2_mib = {:.0}", served(&qcow2)?);
    println!("dd_mib_s = {:.0}", mib / dd_s);
    println!("agent_raw_mib_s = {:.0}", mib / raw_s);
    println!("install_vs_dd = {:.2}", dd_s / raw_s);
    println!("zstd_install_vs_raw = {:.2}", zstd_s / raw_s);
    println!("qcow2_install_vs_raw = {:.2}", qcow2_s / raw_s);
    println!("qcow2_agent_peak_rss_mb = {rss:.1}");
    Ok(())
}
