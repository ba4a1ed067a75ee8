//! Helpers shared by the CLI integration tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::process::Command;

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
