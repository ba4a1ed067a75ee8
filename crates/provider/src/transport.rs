//! How the Initializer reaches a machine to start its agent: over SSH for real machines, or
//! in-process for the simulated fleet. One call covers connect, upload and run, so the
//! simulator does not have to pretend to be an SSH server.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::FutureExt;
use shepherd_bmdb::Lease;
use shepherd_ssh::{parse_public_key, shell_quote, SshClient, SshError};

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
    /// The lease of the work this start belongs to: each step starts only while it holds,
    /// and a step under way is cut off when it ends.
    pub lease: &'a Lease,
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

/// A step of an agent start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Getting an SSH session.
    Connect,
    /// Uploading the agent (to a temporary name).
    Upload,
    /// Renaming the upload into place.
    Rename,
    /// Running it.
    Run,
}

impl Step {
    /// The step's name in `shepherd_fenced_steps_total`.
    fn label(self) -> &'static str {
        match self {
            Step::Connect => "ssh connect",
            Step::Upload => "ssh upload",
            Step::Rename => "ssh rename",
            Step::Run => "ssh run",
        }
    }
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Step::Connect => "connecting",
            Step::Upload => "uploading the agent",
            Step::Rename => "putting the agent in place",
            Step::Run => "running the agent",
        })
    }
}

/// Why an agent could not be started; the text becomes the work's failure cause.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// No session could be had: the connection was refused, the machine is unreachable, or
    /// no SSH session came up in time. Often a machine still booting.
    #[error("connecting: {0}")]
    Unreachable(SshError),
    /// The machine presented another host key than the one pinned for it.
    #[error("connecting: {0}")]
    HostKeyMismatch(SshError),
    /// A step ran past the bound of the whole start.
    #[error("{step}: exec timeout of {after:?} reached")]
    TimedOut {
        /// The step under way.
        step: Step,
        /// The bound.
        after: Duration,
    },
    /// A step failed otherwise (authentication, the SSH protocol, SFTP, the command).
    #[error("{step}: {error}")]
    Failed {
        /// The step that failed.
        step: Step,
        /// Why.
        error: SshError,
    },
    /// The work's lease ended before `step` could start, or while it ran (the step was cut
    /// off): the machine may be another replica's now.
    #[error("{step}: lease lost")]
    LeaseLost {
        /// The step not started, or cut off.
        step: Step,
    },
    /// An in-process transport (the simulator, a test's) could not run its agent.
    #[error("running the agent: {0}")]
    Local(String),
}

impl TransportError {
    /// Sorts what the SSH client said at `step`.
    pub fn at(step: Step, error: SshError) -> Self {
        match (step, error) {
            (_, e @ SshError::HostKeyMismatch { .. }) => TransportError::HostKeyMismatch(e),
            (Step::Connect, e @ (SshError::Connect { .. } | SshError::ConnectTimeout { .. })) => {
                TransportError::Unreachable(e)
            }
            (step, error) => TransportError::Failed { step, error },
        }
    }
}

/// A way to start agents on machines.
#[async_trait]
pub trait Transport: Send + Sync {
    /// Uploads and runs the agent.
    async fn run_agent(&self, run: AgentRun<'_>) -> Result<AgentOutput, TransportError>;
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

/// What bounds each step of one agent start: the work's lease, and the start's timeout.
struct Bounds<'a> {
    lease: &'a Lease,
    deadline: Instant,
    after: Duration,
}

impl Bounds<'_> {
    /// What is left of the start's timeout.
    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// `work`, the side effect of `step`: started only while the lease holds, dropped (its
    /// channel closed with the connection) once the lease ends, and bounded by what is left
    /// of the start's timeout.
    async fn fenced<T>(
        &self,
        step: Step,
        work: impl std::future::Future<Output = Result<T, SshError>>,
    ) -> Result<T, TransportError> {
        self.fenced_within(step, self.left(), work).await
    }

    /// [`Bounds::fenced`] with a bound of its own: `within` (a step that bounds itself).
    async fn fenced_within<T>(
        &self,
        step: Step,
        within: Duration,
        work: impl std::future::Future<Output = Result<T, SshError>>,
    ) -> Result<T, TransportError> {
        let after = self.after;
        let bounded = tokio::time::timeout(within, work).map(|r| match r {
            Err(_) => Err(TransportError::TimedOut { step, after }),
            Ok(r) => r.map_err(|e| TransportError::at(step, e)),
        });
        self.lease
            .fenced(step.label(), bounded)
            .await
            .map_err(|_| TransportError::LeaseLost { step })?
    }
}

#[async_trait]
impl Transport for SshTransport {
    async fn run_agent(&self, run: AgentRun<'_>) -> Result<AgentOutput, TransportError> {
        let pinned = run
            .pinned_host_key
            .map(parse_public_key)
            .transpose()
            .map_err(|e| TransportError::at(Step::Connect, e))?;
        let bounds = Bounds {
            lease: run.lease,
            deadline: Instant::now() + run.timeout,
            after: run.timeout,
        };
        let metrics = &self.metrics;
        let connect = self.client.connect(run.addr, pinned.as_ref());
        let session = metrics.time(
            "connect",
            ok_or_error,
            bounds.fenced(Step::Connect, connect),
        );
        let session = session.await?;
        let host_key = session.host_key();
        let result = async {
            let upload = session.stage(run.target_path, run.agent, 0o755);
            let staged = metrics.time("upload", ok_or_error, bounds.fenced(Step::Upload, upload));
            let rename = staged.await?.put_in_place(&session, bounds.left());
            bounds.fenced(Step::Rename, rename).await?;
            let command = shell_quote(run.target_path);
            // `exec` bounds itself by the rest of the timeout, and closes its channel then.
            let exec = session.exec(&command, run.stdin, bounds.left());
            let run = bounds.fenced_within(Step::Run, Duration::MAX, exec);
            metrics.time("exec", ok_or_error, run).await
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
