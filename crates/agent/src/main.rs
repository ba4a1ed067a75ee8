//! The `shepherd-agent` binary (design.md §13). Run with no arguments by the Initializer over SSH, it takes
//! the machine over: reads a `TakeoverInit` from stdin, creates its ed25519 key, saves its state,
//! answers a `TakeoverResponse` on stdout and starts itself in the background. In the
//! background (`run`), it heartbeats to the BMaaS server over TLS with a certificate of that key,
//! sends a hardware report once, and installs an OS image when asked. `write-image` writes an
//! image onto a file or device an operator names, as an installation writes its disk.

use std::process::ExitCode;
use std::time::Duration;

use shepherd_agent::{heartbeat, state, takeover, RunArgs};

fn env_duration(name: &str, default: Duration) -> Result<Duration, String> {
    match std::env::var(name) {
        Ok(v) => humantime::parse_duration(&v).map_err(|e| format!("{name}: {e}")),
        Err(_) => Ok(default),
    }
}

fn parse_run(args: &[String]) -> Result<RunArgs, String> {
    let mut run = RunArgs {
        state: state::default_path().map_err(|e| e.to_string())?,
        heartbeat_interval: env_duration(
            "SHEPHERD_AGENT_HEARTBEAT_INTERVAL",
            Duration::from_secs(30),
        )?,
        reboot_command: std::env::var("SHEPHERD_AGENT_REBOOT_COMMAND")
            .unwrap_or_else(|_| "reboot".into()),
        retry_max: env_duration("SHEPHERD_AGENT_RETRY_MAX", heartbeat::DEFAULT_RETRY_MAX)?,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--state" => run.state = value.into(),
            "--heartbeat-interval" => {
                run.heartbeat_interval =
                    humantime::parse_duration(value).map_err(|e| format!("{flag}: {e}"))?
            }
            "--reboot-command" => run.reboot_command = value.clone(),
            "--retry-max" => {
                run.retry_max =
                    humantime::parse_duration(value).map_err(|e| format!("{flag}: {e}"))?
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if run.heartbeat_interval.is_zero() {
        return Err("heartbeat interval must be more than zero".into());
    }
    Ok(run)
}

/// `write-image --url URL --sha256 HEX [--format F] --onto PATH`: writes an image onto a
/// file or block device the operator names, as an installation writes its disk.
fn write_image(args: &[String]) -> ExitCode {
    let (mut url, mut sha256, mut format, mut onto) = (None, None, String::new(), None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let Some(value) = it.next() else {
            eprintln!("shepherd-agent: {flag} needs a value");
            return ExitCode::from(2);
        };
        match flag.as_str() {
            "--url" => url = Some(value.clone()),
            "--sha256" => sha256 = Some(value.clone()),
            "--format" => format = value.clone(),
            "--onto" => onto = Some(std::path::PathBuf::from(value)),
            other => {
                eprintln!("shepherd-agent: unknown flag {other}");
                return ExitCode::from(2);
            }
        }
    }
    let (Some(url), Some(sha256), Some(onto)) = (url, sha256, onto) else {
        eprintln!("shepherd-agent: write-image needs --url, --sha256 and --onto");
        return ExitCode::from(2);
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let written = match rt {
        Ok(rt) => rt.block_on(shepherd_agent::write_image_onto(
            &url, &sha256, &format, &onto,
        )),
        Err(e) => {
            eprintln!("shepherd-agent: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match written {
        Ok((format, bytes)) => {
            eprintln!(
                "shepherd-agent: wrote {bytes} bytes of {url} ({format}) onto {}, its sha256 as served checked",
                onto.display()
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("shepherd-agent: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("takeover") => takeover::run(),
        Some("run") => match parse_run(&args[1..]) {
            Ok(run) => {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                match rt {
                    Ok(rt) => rt.block_on(heartbeat::run(run)),
                    Err(e) => {
                        eprintln!("shepherd-agent: starting the runtime: {e}");
                        ExitCode::FAILURE
                    }
                }
            }
            Err(e) => {
                eprintln!("shepherd-agent: {e}");
                ExitCode::from(2)
            }
        },
        Some("write-image") => write_image(&args[1..]),
        Some(other) => {
            eprintln!("shepherd-agent: unknown mode {other:?}; usage: shepherd-agent [takeover] | run [--state PATH] [--heartbeat-interval 30s] [--reboot-command CMD] [--retry-max 60s] | write-image --url URL --sha256 HEX [--format F] --onto PATH");
            ExitCode::from(2)
        }
    }
}
