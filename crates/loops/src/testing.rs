//! Helpers for tests and benchmarks (feature `testing`).

use std::path::PathBuf;

pub use shepherd_ssh::testing::free_loopback_port;

/// Path of the `shepherd-test-agent` binary built beside the running test.
pub fn test_agent_path() -> PathBuf {
    built_binary("shepherd-test-agent")
}

/// Path of the `shepherd-agent` binary (the real agent) built beside the running test.
pub fn agent_path() -> PathBuf {
    built_binary("shepherd-agent")
}

/// The binary `name` in the target directory of the running executable's profile. Tests do
/// not build binaries themselves: `scripts/test.sh` builds every binary of the workspace
/// before any test runs, and a test run without them says so.
fn built_binary(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the running test's path");
    // target/<profile>/deps/<test>, or target/<profile>/<binary>
    let mut profile_dir = exe.parent().expect("a directory").to_path_buf();
    if profile_dir.ends_with("deps") {
        profile_dir.pop();
    }
    let path = profile_dir.join(name);
    let release = if profile_dir.ends_with("release") {
        " --release"
    } else {
        ""
    };
    assert!(
        path.exists(),
        "{} is missing: build the workspace's binaries first with `cargo build --workspace --bins{release}` (scripts/test.sh does)",
        path.display()
    );
    path
}

/// A provisioner over `provider` that creates up to `chunk` machines a pass, one at a time,
/// unpaced: how tests drive a provider through a pass.
pub fn unpaced_provisioner<P: shepherd_provider::Provider>(
    provider: std::sync::Arc<P>,
    chunk: usize,
) -> crate::provisioner::Provisioner<P> {
    unpaced_parallel_provisioner(provider, chunk, 1)
}

/// [`unpaced_provisioner`] with up to `parallelism` creations in flight.
pub fn unpaced_parallel_provisioner<P: shepherd_provider::Provider>(
    provider: std::sync::Arc<P>,
    chunk: usize,
    parallelism: usize,
) -> crate::provisioner::Provisioner<P> {
    crate::provisioner::Provisioner::new(
        provider,
        crate::provisioner::ProvisionerConfig {
            limits: crate::reconcile::Limits::new(0, chunk),
            reconcile_rate: crate::limiter::RateSpec::new(std::time::Duration::from_millis(1), 1),
            creation_rate: crate::limiter::RateSpec::new(std::time::Duration::from_millis(1), 1000),
            creation_parallelism: parallelism,
        },
    )
}

/// Runs `task` in the background with `workers` workers claiming every 10 ms (at most `burst`
/// at once), each on a session named after the loop's processor, until the returned token is
/// canceled; the handle ends once every worker stopped.
pub fn spawn_loop<T: crate::runner::MachineTask>(
    db: shepherd_bmdb::Bmdb,
    task: T,
    workers: usize,
    burst: u32,
) -> (
    tokio::task::JoinHandle<()>,
    tokio_util::sync::CancellationToken,
) {
    let processor = task.retrieval().processor();
    let session = shepherd_bmdb::SessionConfig::new(processor.label(), processor);
    let rate = crate::limiter::RateSpec::new(std::time::Duration::from_millis(10), burst);
    let config = crate::runner::RunnerConfig::new(workers, rate, session);
    let cancel = tokio_util::sync::CancellationToken::new();
    let run = crate::runner::run(db, std::sync::Arc::new(task), config, cancel.clone());
    (tokio::spawn(run), cancel)
}

/// A transport that runs the stand-in agent (`shepherd-test-agent`) as a local process with the
/// takeover message on its stdin, as SSH would on a machine: for tests of the initializer
/// that need no sshd.
pub struct LocalTestAgent;

#[async_trait::async_trait]
impl shepherd_provider::transport::Transport for LocalTestAgent {
    async fn run_agent(
        &self,
        run: shepherd_provider::transport::AgentRun<'_>,
    ) -> Result<
        shepherd_provider::transport::AgentOutput,
        shepherd_provider::transport::TransportError,
    > {
        use tokio::io::AsyncWriteExt;
        let failed = |e: std::io::Error| {
            shepherd_provider::transport::TransportError::Local(format!("the stand-in agent: {e}"))
        };
        let mut child = tokio::process::Command::new(test_agent_path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(failed)?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin.write_all(run.stdin).await.map_err(failed)?;
        drop(stdin);
        let out = child.wait_with_output().await.map_err(failed)?;
        Ok(shepherd_provider::transport::AgentOutput {
            host_key: String::new(),
            exit_status: out.status.code().map(|c| c as u32),
            stdout: out.stdout,
            stderr: out.stderr,
        })
    }
}
