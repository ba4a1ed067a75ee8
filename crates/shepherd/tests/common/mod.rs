//! Helpers shared by the CLI integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::io::{BufRead, BufReader};
use std::process::{Child, Command};
use std::time::Duration;

/// The `shepherd` binary with no `SHEPHERD_*` variables inherited from the caller, and its HTTP
/// endpoints on free ports (default ports would collide between tests running in parallel).
pub fn shepherd() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shepherd"));
    for (k, _) in std::env::vars() {
        if k.starts_with("SHEPHERD_") {
            cmd.env_remove(k);
        }
    }
    cmd.env("SHEPHERD_METRICS_LISTEN", "127.0.0.1:0");
    cmd.env("SHEPHERD_HTTP_LISTEN", "127.0.0.1:0");
    cmd
}

/// A loopback port nobody listens on right now.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Waits (up to 30 s) for `child` to print a stdout line starting with `prefix` and returns the
/// rest of that line. The child's stdout keeps being drained afterwards, so it never blocks.
pub fn announced(child: &mut Child, prefix: &'static str) -> String {
    let stdout = child.stdout.take().expect("child stdout is piped");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix(prefix) {
                let _ = tx.send(rest.to_string());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(30))
        .unwrap_or_else(|_| panic!("the child never printed {prefix:?}"))
}
