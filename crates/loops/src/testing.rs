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
