//! The test agent (design.md §13): reads a `TakeoverInit` from stdin, answers a `TakeoverResponse`
//! carrying the init echoed and a fresh random 32-byte key, and exits.
//!
//! `--misbehave MODE` makes it a broken agent, so tests can check that the Initializer refuses
//! each kind of bad answer: `garbage` (not protobuf), `error` (an error response), `wrong-echo`
//! (echoes a different init), `short-key` (a 16-byte key), `hang` (answers nothing for a minute), `exit-1`
//! (fails without output).
//!
//! Like the real agent, it refuses a takeover whose fencing token (`claim_generation`) is
//! lower than the highest it has seen for the machine, which it keeps next to itself.
//!
//! `SHEPHERD_TEST_AGENT_DELAY_MS` in its environment (an sshd's `SetEnv`) makes it take that
//! long to answer, as a real takeover does, so tests can act while takeovers are in flight.

use std::io::{Read, Write};
use std::process::ExitCode;

use shepherd_proto::agent::{
    takeover_response, TakeoverError, TakeoverInit, TakeoverResponse, TakeoverSuccess,
};
use shepherd_proto::Message;

/// Largest init message read from stdin; real ones are a few KiB (a CA certificate at most).
const MAX_INIT_LEN: u64 = 1 << 20;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = match args.as_slice() {
        [] => None,
        [flag, mode] if flag == "--misbehave" => Some(mode.as_str()),
        _ => {
            eprintln!("usage: shepherd-test-agent [--misbehave garbage|error|wrong-echo|short-key|hang|exit-1]");
            return ExitCode::from(2);
        }
    };
    if let Some(ms) = std::env::var("SHEPHERD_TEST_AGENT_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(std::time::Duration::from_millis(ms.min(60_000)));
    }
    let mut raw = Vec::new();
    if let Err(e) = std::io::stdin().take(MAX_INIT_LEN).read_to_end(&mut raw) {
        eprintln!("reading stdin: {e}");
        return ExitCode::from(1);
    }
    let response = match mode {
        Some("garbage") => return write(b"this is not a protobuf message\xff\xff\xff"),
        Some("hang") => {
            // Longer than any test's exec timeout, short enough not to pile up orphans.
            std::thread::sleep(std::time::Duration::from_secs(60));
            return ExitCode::from(1);
        }
        Some("exit-1") => {
            eprintln!("test agent: failing on purpose");
            return ExitCode::from(1);
        }
        Some("error") => error("test agent: refusing on purpose"),
        Some(other @ ("wrong-echo" | "short-key")) => match TakeoverInit::decode(raw.as_slice()) {
            Ok(mut init) => {
                let key_len = if other == "short-key" { 16 } else { 32 };
                if other == "wrong-echo" {
                    init.machine_id.push_str("-tampered");
                }
                success(init, key_len)
            }
            Err(e) => error(&format!("decoding TakeoverInit: {e}")),
        },
        Some(other) => {
            eprintln!("unknown misbehaviour {other:?}");
            return ExitCode::from(2);
        }
        None => match TakeoverInit::decode(raw.as_slice()) {
            Ok(init) if init.bmaas_endpoint.is_empty() => {
                error("no BMaaS endpoint in TakeoverInit")
            }
            Ok(init) => match fence(&init.machine_id, init.claim_generation) {
                Ok(()) => success(init, 32),
                Err(e) => error(&e),
            },
            Err(e) => error(&format!("decoding TakeoverInit: {e}")),
        },
    };
    write(&response.encode_to_vec())
}

/// The fencing token, as the real agent keeps it: the highest generation seen for a machine
/// is kept next to the executable (`<exe>.<machine>.generation`: tests run many "machines" on
/// one file system), and a takeover with a lower one is refused.
fn fence(machine: &str, offered: u64) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("locating myself: {e}"))?;
    let mut name = exe.file_name().unwrap_or_default().to_os_string();
    let safe: String = machine
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .collect();
    name.push(format!(".{safe}.generation"));
    let path = exe.with_file_name(name);
    let seen = std::fs::read_to_string(&path)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0);
    shepherd_proto::check_fencing_token(seen, offered).map_err(|e| e.to_string())?;
    if offered > seen {
        std::fs::write(&path, offered.to_string())
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

fn success(init: TakeoverInit, key_len: usize) -> TakeoverResponse {
    let mut key = vec![0u8; key_len];
    rand::fill(key.as_mut_slice());
    TakeoverResponse {
        result: Some(takeover_response::Result::Success(TakeoverSuccess {
            init_message: Some(init),
            key,
            warning: vec!["test agent: no background agent started".into()],
            live_proof: String::new(),
        })),
    }
}

fn error(message: &str) -> TakeoverResponse {
    TakeoverResponse {
        result: Some(takeover_response::Result::Error(TakeoverError {
            message: message.into(),
        })),
    }
}

fn write(bytes: &[u8]) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|_| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("writing stdout: {e}");
            ExitCode::from(1)
        }
    }
}
