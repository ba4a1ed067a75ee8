//! SSH takeover benchmark. N takeovers of one real sshd
//! — upload a ~5 MB agent, run it with a TakeoverInit on stdin, check its TakeoverResponse —
//! at parallelism P, measured in the same run for Shepherd's SSH transport and for an
//! `xargs -P` pipeline of OpenSSH `scp` + `ssh` doing the same upload and run.
//!
//! Both sides get a target path per takeover (one sshd stands in for N machines, and real
//! machines do not share a filesystem). BMDB work around a takeover is not included on either
//! side; `bench/results/bmdb.md` measures that.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use futures::stream::{self, StreamExt};
use shepherd_loops::initializer::verify_response;
use shepherd_proto::agent::TakeoverInit;
use shepherd_proto::Message;
use shepherd_provider::transport::{AgentRun, SshTransport, Transport};
use shepherd_ssh::testing::{random_key, Sshd};
use shepherd_ssh::{Auth, SshClient, SshConfig};

/// Settings of the SSH benchmark.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Takeovers per measured run.
    #[arg(long, default_value_t = 200)]
    takeovers: usize,
    /// Takeovers in flight at once (both sides).
    #[arg(long, default_value_t = 16)]
    parallelism: usize,
    /// Size of the uploaded agent (the test agent, padded).
    #[arg(long, default_value_t = 5 << 20)]
    agent_bytes: usize,
    /// Measured runs per side, alternating; the report shows each and compares the medians.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Where to write the report.
    #[arg(long, default_value = "bench/results/ssh.md")]
    out: PathBuf,
}

fn user() -> String {
    let out = Command::new("id").arg("-un").output().ok();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|u| !u.is_empty())
        .unwrap_or_else(|| "root".into())
}

async fn ours(
    sshd: &Sshd,
    transport: Arc<SshTransport>,
    agent: Arc<Vec<u8>>,
    args: &Args,
    round: usize,
) -> Result<Duration> {
    let dir = sshd.dir().join(format!("ours-{round}"));
    std::fs::create_dir_all(&dir)?;
    let init = TakeoverInit {
        machine_id: "00000000-0000-4000-8000-000000000001".into(),
        bmaas_endpoint: "bmaas.bench:443".into(),
        ca_certificate: Vec::new(),
        ..Default::default()
    };
    let stdin = init.encode_to_vec();
    let addr = sshd.addr();
    let started = Instant::now();
    let results: Vec<Result<()>> = stream::iter(0..args.takeovers)
        .map(|i| {
            let (transport, agent, stdin, init, addr) = (
                transport.clone(),
                agent.clone(),
                stdin.clone(),
                init.clone(),
                addr.clone(),
            );
            let target = dir.join(format!("agent-{i}")).display().to_string();
            async move {
                let out = transport
                    .run_agent(AgentRun {
                        addr: &addr,
                        pinned_host_key: None,
                        agent: &agent,
                        target_path: &target,
                        stdin: &stdin,
                        timeout: Duration::from_secs(120),
                        lease: &shepherd_bmdb::Lease::unbounded(),
                    })
                    .await?;
                verify_response(&init, &out.stdout)?;
                Ok(())
            }
        })
        .buffer_unordered(args.parallelism)
        .collect()
        .await;
    let elapsed = started.elapsed();
    let failed: Vec<_> = results.into_iter().filter_map(|r| r.err()).collect();
    if let Some(e) = failed.first() {
        bail!("{} of our takeovers failed, first: {e:#}", failed.len());
    }
    std::fs::remove_dir_all(&dir)?;
    Ok(elapsed)
}

fn openssh(
    sshd: &Sshd,
    key: &Path,
    agent: &Path,
    init: &Path,
    args: &Args,
    round: usize,
) -> Result<Duration> {
    let dir = sshd.dir().join(format!("openssh-{round}"));
    let outs = sshd.dir().join(format!("openssh-out-{round}"));
    std::fs::create_dir_all(&dir)?;
    std::fs::create_dir_all(&outs)?;
    let port = sshd.addr().rsplit_once(':').unwrap().1.to_string();
    let opts = format!(
        "-o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -i {}",
        key.display()
    );
    let host = format!("{}@127.0.0.1", user());
    // One takeover: upload, then run with the init on stdin, keeping stdout for the check.
    let script = format!(
        "scp -q {opts} -P {port} {agent} {host}:{dir}/agent-$1 && ssh {opts} -p {port} {host} {dir}/agent-$1 < {init} > {outs}/$1",
        agent = agent.display(),
        dir = dir.display(),
        init = init.display(),
        outs = outs.display(),
    );
    let started = Instant::now();
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "seq 0 {} | xargs -P {} -I{{}} sh -c '{script}' takeover {{}}",
            args.takeovers - 1,
            args.parallelism
        ))
        .status()?;
    let elapsed = started.elapsed();
    if !status.success() {
        bail!("the OpenSSH pipeline failed: {status}");
    }
    let sent = TakeoverInit::decode(std::fs::read(init)?.as_slice())?;
    for i in 0..args.takeovers {
        let out = std::fs::read(outs.join(i.to_string()))?;
        verify_response(&sent, &out).with_context(|| format!("OpenSSH takeover {i}"))?;
    }
    std::fs::remove_dir_all(&dir)?;
    std::fs::remove_dir_all(&outs)?;
    Ok(elapsed)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Runs the benchmark and writes the report.
pub async fn run(args: Args) -> Result<()> {
    for tool in ["scp", "ssh", "xargs"] {
        if Command::new("sh")
            .arg("-c")
            .arg(format!("command -v {tool}"))
            .output()?
            .stdout
            .is_empty()
        {
            bail!("{tool} is missing: run scripts/test-deps.sh");
        }
    }
    let key = random_key();
    let sshd = Sshd::start(&[key.public_key()]);
    let work = tempfile::tempdir()?;
    let key_path = work.path().join("id_ed25519");
    std::fs::write(
        &key_path,
        key.to_openssh(shepherd_ssh::LineEnding::LF)?.as_bytes(),
    )?;
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))?;

    let mut agent = std::fs::read(crate::binaries::release_binary("shepherd-test-agent")?)?;
    let binary_len = agent.len();
    agent.resize(agent.len().max(args.agent_bytes), 0); // an ELF runs with trailing padding
    let agent_path = work.path().join("agent");
    std::fs::File::create(&agent_path)?.write_all(&agent)?;
    std::fs::set_permissions(&agent_path, std::fs::Permissions::from_mode(0o755))?;
    let init = TakeoverInit {
        machine_id: "00000000-0000-4000-8000-000000000001".into(),
        bmaas_endpoint: "bmaas.bench:443".into(),
        ca_certificate: Vec::new(),
        ..Default::default()
    };
    let init_path = work.path().join("init.bin");
    std::fs::write(&init_path, init.encode_to_vec())?;

    let mut config = SshConfig::new(Auth::Key(Arc::new(key.clone())));
    config.user = user();
    config.max_handshakes = args.parallelism;
    config.connect_timeout = Duration::from_secs(30);
    let transport = Arc::new(SshTransport::new(Arc::new(SshClient::new(config))));
    let agent = Arc::new(agent);

    // Warm-up: one small round each, so page cache and sshd are in the same state for both.
    let warm = Args {
        takeovers: args.parallelism,
        ..clone_args(&args)
    };
    ours(&sshd, transport.clone(), agent.clone(), &warm, 99).await?;
    openssh(&sshd, &key_path, &agent_path, &init_path, &warm, 99)?;

    let (mut ours_t, mut openssh_t) = (Vec::new(), Vec::new());
    for round in 0..args.rounds {
        let o = ours(&sshd, transport.clone(), agent.clone(), &args, round).await?;
        let b = openssh(&sshd, &key_path, &agent_path, &init_path, &args, round)?;
        println!(
            "round {round}: ours {:.2} s, openssh {:.2} s",
            o.as_secs_f64(),
            b.as_secs_f64()
        );
        ours_t.push(o);
        openssh_t.push(b);
    }
    let rate = |d: Duration| args.takeovers as f64 / d.as_secs_f64();
    let (o, b) = (median(ours_t.clone()), median(openssh_t.clone()));
    let ratio = rate(o) / rate(b);

    let mut md = String::new();
    md.push_str("# SSH takeover benchmark\n\n");
    md.push_str(&format!(
        "{} takeovers of one real OpenSSH sshd on loopback per run, {} in flight; each uploads a {:.1} MB agent \
         (the {:.1} MB test agent, padded) to its own path, runs it with a TakeoverInit on stdin and checks the \
         TakeoverResponse. Ours: `SshTransport` (russh, one connection per takeover: SFTP upload + exec; \
         prefers aes256-gcm@openssh.com). Baseline: `xargs -P{}` of `scp` then `ssh` per takeover, \
         OpenSSH client defaults (chacha20-poly1305 first), no connection sharing. {} alternating rounds after a warm-up; medians compared. \
         Machine: {} cores.\n\n",
        args.takeovers,
        args.parallelism,
        agent.len() as f64 / 1e6,
        binary_len as f64 / 1e6,
        args.parallelism,
        args.rounds,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    ));
    md.push_str("| round | ours (s) | ours (takeovers/s) | openssh (s) | openssh (takeovers/s) |\n|---|---|---|---|---|\n");
    for (i, (o, b)) in ours_t.iter().zip(&openssh_t).enumerate() {
        md.push_str(&format!(
            "| {i} | {:.2} | {:.1} | {:.2} | {:.1} |\n",
            o.as_secs_f64(),
            rate(*o),
            b.as_secs_f64(),
            rate(*b)
        ));
    }
    md.push_str(&format!(
        "| median | {:.2} | {:.1} | {:.2} | {:.1} |\n\nratio p4_takeover_vs_openssh = {ratio:.2}\n",
        o.as_secs_f64(),
        rate(o),
        b.as_secs_f64(),
        rate(b)
    ));
    if let Some(parent) = args.out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.out, &md)?;
    println!("{md}");
    Ok(())
}

fn clone_args(a: &Args) -> Args {
    Args {
        takeovers: a.takeovers,
        parallelism: a.parallelism,
        agent_bytes: a.agent_bytes,
        rounds: a.rounds,
        out: a.out.clone(),
    }
}
