//! Takeover mode: answer the Initializer on stdout, then continue in the background.

use std::io::{Read, Write};
use std::os::unix::process::CommandExt;
use std::process::{Command, ExitCode, Stdio};

use shepherd_proto::agent::{
    takeover_response, TakeoverError, TakeoverInit, TakeoverResponse, TakeoverSuccess,
};
use shepherd_proto::shepherd::agent::AgentState;
use shepherd_proto::Message;

use crate::{identity, state};

/// Largest init accepted on stdin.
const MAX_INIT_BYTES: u64 = 1 << 20;

fn take_over() -> Result<(TakeoverInit, Vec<u8>, Vec<String>), String> {
    let mut raw = Vec::new();
    std::io::stdin()
        .take(MAX_INIT_BYTES)
        .read_to_end(&mut raw)
        .map_err(|e| format!("reading TakeoverInit from stdin: {e}"))?;
    let init =
        TakeoverInit::decode(raw.as_slice()).map_err(|e| format!("decoding TakeoverInit: {e}"))?;
    if init.bmaas_endpoint.trim().is_empty() {
        return Err("TakeoverInit has no BMaaS endpoint".into());
    }
    if init.machine_id.is_empty() {
        return Err("TakeoverInit has no machine id".into());
    }
    let path = state::default_path().map_err(|e| format!("locating the state file: {e}"))?;
    // The fencing token: a takeover from a replica whose lease ended carries a lower
    // generation than the one that took the machine over since, and is refused. Generations
    // count one BMDB machine's claims, so only the same machine's are compared.
    let seen = state::load(&path)
        .ok()
        .and_then(|st| st.init)
        .filter(|seen| seen.machine_id == init.machine_id)
        .map_or(0, |seen| seen.claim_generation);
    shepherd_proto::check_fencing_token(seen, init.claim_generation).map_err(|e| e.to_string())?;
    let (pkcs8, public) = identity::generate().map_err(|e| e.to_string())?;
    state::save(
        &path,
        &AgentState {
            // The highest generation seen is kept, even through a takeover that sent none.
            init: Some(TakeoverInit {
                claim_generation: init.claim_generation.max(seen),
                ..init.clone()
            }),
            private_key_pkcs8: pkcs8,
            installed_generation: 0,
        },
    )
    .map_err(|e| format!("writing state {}: {e}", path.display()))?;
    let mut warnings = Vec::new();
    // The background agent must not hold the SSH session's stdio, or the command never ends.
    let exe = std::env::current_exe().map_err(|e| format!("locating myself: {e}"))?;
    let spawned = Command::new(exe)
        .arg("run")
        .arg("--state")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn();
    if let Err(e) = spawned {
        warnings.push(format!("could not start the background agent: {e}"));
    }
    Ok((init, public, warnings))
}

/// Runs the takeover and writes the response; the exit code is 0 whenever a response was
/// written (an error response is a valid answer).
pub fn run() -> ExitCode {
    let response = match take_over() {
        Ok((init, key, warning)) => TakeoverResponse {
            result: Some(takeover_response::Result::Success(TakeoverSuccess {
                init_message: Some(init),
                key,
                warning,
                // Its SSH session's, as the live environment's config drive set it.
                live_proof: std::env::var(shepherd_proto::LIVE_PROOF_VAR)
                    .map(|p| p.trim().to_string())
                    .unwrap_or_default(),
            })),
        },
        Err(message) => TakeoverResponse {
            result: Some(takeover_response::Result::Error(TakeoverError { message })),
        },
    };
    let mut out = std::io::stdout().lock();
    match out
        .write_all(&response.encode_to_vec())
        .and_then(|_| out.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("shepherd-agent: writing the response: {e}");
            ExitCode::FAILURE
        }
    }
}
