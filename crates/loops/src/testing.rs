//! Helpers for tests and benchmarks (feature `testing`).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// Path of a freshly built `shepherd-test-agent` binary in this workspace's target directory
/// (built on first call, so a test run of a single crate still finds it).
pub fn test_agent_path() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let exe = std::env::current_exe().expect("current exe");
        // target/<profile>/deps/<test> or target/<profile>/<bin>
        let mut profile_dir = exe.parent().expect("exe dir").to_path_buf();
        if profile_dir.ends_with("deps") {
            profile_dir.pop();
        }
        let release = profile_dir.ends_with("release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "--quiet", "-p", "shepherd-test-agent"]);
        if release {
            build.arg("--release");
        }
        let status = build.status().expect("running cargo build");
        assert!(status.success(), "building shepherd-test-agent failed");
        let path = profile_dir.join("shepherd-test-agent");
        assert!(path.exists(), "{} missing after build", path.display());
        path
    })
    .clone()
}
