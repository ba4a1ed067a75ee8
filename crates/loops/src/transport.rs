//! How the Initializer reaches a machine to start its agent: over SSH for real machines, or
//! in-process for the simulated fleet. One call covers connect, upload and run, so the
//! simulator does not have to pretend to be an SSH server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::FutureExt;
use shepherd_ssh::{parse_public_key, shell_quote, SshClient};

use crate::metrics::{CallMetrics, CallResult};

/// One agent start: upload `agent` to `target_path` on `addr` and run it with `stdin`.
#[derive(Debug, Clone, Copy)]
pub struct AgentRun<'a> {
    /// Where the machine listens for SSH (`host` or `host:port`).
    pub addr: &'a str,
    /// The host key the machine must present (OpenSSH format), if one is pinned.
    pub pinned_host_key: Option<&'a str>,
    /// The agent executable.
    pub agent: &'a [u8],
    /// Where to put it.
    pub target_path: &'a str,
    /// What to feed it (a serialized `TakeoverInit`).
    pub stdin: &'a [u8],
    /// Bound on the whole step (connect, upload, run).
    pub timeout: Duration,
}

/// What the agent did.
#[derive(Debug, Clone, Default)]
pub struct AgentOutput {
    /// The host key the machine presented (OpenSSH format).
    pub host_key: String,
    /// Exit status, if it exited normally.
    pub exit_status: Option<u32>,
    /// Standard output (bounded).
    pub stdout: Vec<u8>,
    /// Standard error (bounded).
    pub stderr: Vec<u8>,
}

/// A way to start agents on machines.
#[async_trait]
pub trait Transport: Send + Sync {
    /// Uploads and runs the agent; an error's text becomes the work failure cause.
    async fn run_agent(&self, run: AgentRun<'_>) -> anyhow::Result<AgentOutput>;
}

/// The real thing: SSH with SFTP upload.
pub struct SshTransport {
    client: Arc<SshClient>,
    metrics: Arc<CallMetrics>,
}

impl SshTransport {
    /// Uses `client` (shared, so its handshake cap covers all workers).
    pub fn new(client: Arc<SshClient>) -> Self {
        SshTransport {
            client,
            metrics: Arc::default(),
        }
    }

    /// Records connect, upload and exec calls into `metrics` (`shepherd_ssh_*`).
    pub fn with_metrics(mut self, metrics: Arc<CallMetrics>) -> Self {
        self.metrics = metrics;
        self
    }
}

fn ok_or_error<T, E>(r: &Result<T, E>) -> CallResult {
    if r.is_ok() {
        CallResult::Ok
    } else {
        CallResult::Error
    }
}

#[async_trait]
impl Transport for SshTransport {
    async fn run_agent(&self, run: AgentRun<'_>) -> anyhow::Result<AgentOutput> {
        let deadline = Instant::now() + run.timeout;
        let left = || deadline.saturating_duration_since(Instant::now());
        let pinned = run.pinned_host_key.map(parse_public_key).transpose()?;
        let session = self
            .metrics
            .time(
                "connect",
                ok_or_error,
                tokio::time::timeout(left(), self.client.connect(run.addr, pinned.as_ref())).map(
                    |r| {
                        r.map_err(|_| {
                            anyhow::anyhow!("connecting: exec timeout of {:?} reached", run.timeout)
                        })
                        .and_then(|r| r.map_err(anyhow::Error::from))
                    },
                ),
            )
            .await?;
        let host_key = session.host_key();
        let result = async {
            self.metrics
                .time(
                    "upload",
                    ok_or_error,
                    tokio::time::timeout(left(), session.upload(run.target_path, run.agent, 0o755))
                        .map(|r| {
                            r.map_err(|_| {
                                anyhow::anyhow!(
                                    "uploading the agent: exec timeout of {:?} reached",
                                    run.timeout
                                )
                            })
                            .and_then(|r| r.map_err(anyhow::Error::from))
                        }),
                )
                .await?;
            let out = self
                .metrics
                .time(
                    "exec",
                    ok_or_error,
                    session.exec(&shell_quote(run.target_path), run.stdin, left()),
                )
                .await
                .map_err(|e| anyhow::anyhow!("running the agent: {e}"))?;
            Ok::<_, anyhow::Error>(out)
        }
        .await;
        session.close().await;
        let out = result?;
        Ok(AgentOutput {
            host_key,
            exit_status: out.exit_status,
            stdout: out.stdout,
            stderr: out.stderr,
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn paths_are_quoted_for_the_shell() {
        assert_eq!(super::shell_quote("/root/agent"), "'/root/agent'");
        assert_eq!(super::shell_quote("/tmp/it's"), r"'/tmp/it'\''s'");
    }
}
