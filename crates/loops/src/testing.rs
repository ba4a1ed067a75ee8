//! Helpers for tests and benchmarks (feature `testing`).

pub mod bmc;

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Path of a freshly built `shepherd-test-agent` binary in this workspace's target directory
/// (built on first call, so a test run of a single crate still finds it).
pub fn test_agent_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| workspace_binary("shepherd-test-agent"))
        .clone()
}

/// Path of a freshly built `shepherd-agent` binary (the real agent).
pub fn agent_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| workspace_binary("shepherd-agent"))
        .clone()
}

/// Builds the binary of workspace package `package` (same name) in the current profile.
fn workspace_binary(package: &str) -> PathBuf {
    {
        let exe = std::env::current_exe().expect("current exe");
        // target/<profile>/deps/<test> or target/<profile>/<bin>
        let mut profile_dir = exe.parent().expect("exe dir").to_path_buf();
        if profile_dir.ends_with("deps") {
            profile_dir.pop();
        }
        let release = profile_dir.ends_with("release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "--quiet", "-p", package]);
        if release {
            build.arg("--release");
        }
        let status = build.status().expect("running cargo build");
        assert!(status.success(), "building {package} failed");
        let path = profile_dir.join(package);
        assert!(path.exists(), "{} missing after build", path.display());
        path
    }
}

/// A transport that runs the stand-in agent (`shepherd-test-agent`) as a local process with the
/// takeover message on its stdin, as SSH would on a machine: for tests of the initializer
/// that need no sshd.
pub struct LocalTestAgent;

#[async_trait::async_trait]
impl crate::transport::Transport for LocalTestAgent {
    async fn run_agent(
        &self,
        run: crate::transport::AgentRun<'_>,
    ) -> anyhow::Result<crate::transport::AgentOutput> {
        use tokio::io::AsyncWriteExt;
        let mut child = tokio::process::Command::new(test_agent_path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()?;
        let mut stdin = child.stdin.take().expect("piped stdin");
        stdin.write_all(run.stdin).await?;
        drop(stdin);
        let out = child.wait_with_output().await?;
        Ok(crate::transport::AgentOutput {
            host_key: String::new(),
            exit_status: out.status.code().map(|c| c as u32),
            stdout: out.stdout,
            stderr: out.stderr,
        })
    }
}
