//! Process plumbing shared by `run`, `server` and `demo`: shutdown on signals, and the lines
//! announced on stdout.

use tokio_util::sync::CancellationToken;

/// A token cancelled on SIGINT or SIGTERM.
pub fn shutdown_on_signals() -> CancellationToken {
    let cancel = CancellationToken::new();
    let token = cancel.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("installing a SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => tracing::warn!("SIGINT: shutting down"),
            _ = term.recv() => tracing::warn!("SIGTERM: shutting down"),
        }
        token.cancel();
    });
    cancel
}

/// Prints one line on stdout for whoever started us (addresses, mostly). A closed stdout (the
/// reader went away) must not take a long-running service down, so write errors are ignored.
pub fn announce(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}
