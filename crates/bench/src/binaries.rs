//! The release binaries a benchmark measures, built before it measures them: a benchmark is a
//! program a person runs, so it builds what it runs rather than trusting a stale build.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Result};

/// Builds workspace package `package`'s binary of the same name in the release profile and
/// returns its path.
pub fn release_binary(package: &str) -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let status = Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "--quiet",
            "-p",
            package,
            "--bin",
            package,
        ])
        .current_dir(&root)
        .status()?;
    if !status.success() {
        bail!("cargo build --release -p {package} failed");
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    Ok(target.join("release").join(package))
}
