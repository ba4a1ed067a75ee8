//! What operators install, tried the way they meet it: `scripts/package.sh` packages this
//! build (the `dev` profile the test run already built: a release build would add about ten
//! minutes on CI) as the two .debs and the OCI image; lintian finds nothing in the packages; and
//! `scripts/package-check.sh` installs them with apt on a clean Debian bookworm, runs the
//! packaged server as its user, purges them, upgrades a fleet's database from the packages of
//! an older build on an older schema (`scripts/previous-build.sh`), and runs the image's own
//! command from its unpacked root filesystem (see that script for each check). Alone on the
//! machine: chroots, mmdebstrap's cache, a server.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The repository's root.
fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The output of `command`, which must succeed.
fn run(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("{command:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{command:?} failed:\n{text}");
    text
}

/// `scripts/package.sh` over this build's binaries into `dir`, with the image.
fn package(dir: &Path) -> String {
    run(Command::new(repository().join("scripts/package.sh"))
        .args(["--profile", "dev", "--no-build"])
        .env("SHEPHERD_PACKAGE_DIR", dir))
}

/// The packages of the older build `scripts/previous-build.sh` keeps (an earlier commit of
/// main, on an older schema), into `dir`, versioned by that commit as package.sh versions
/// HEAD; the manual pages come from this build (that one predates `shepherd dist`). Its
/// version.
fn package_previous(dir: &Path) -> String {
    // The script prints the directory on stdout, what it builds on stderr.
    let built = Command::new(repository().join("scripts/previous-build.sh"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("scripts/previous-build.sh runs");
    assert!(built.status.success(), "scripts/previous-build.sh failed");
    let cache = String::from_utf8(built.stdout).unwrap();
    let cache = Path::new(cache.trim());
    let commit = cache.file_name().unwrap().to_str().unwrap();
    let made = run(Command::new(repository().join("scripts/package.sh"))
        .args(["--profile", "dev", "--no-build", "--no-image"])
        .env("CARGO_TARGET_DIR", cache)
        .env("SHEPHERD_DIST_BIN", env!("CARGO_BIN_EXE_shepherd"))
        .env("SHEPHERD_VERSION_COMMIT", commit)
        .env("SHEPHERD_PACKAGE_DIR", dir));
    // "package.sh: DIR/shepherd_VERSION_ARCH.deb (N KiB)"
    let deb = made
        .split("/shepherd_")
        .nth(1)
        .expect("package.sh made shepherd_*.deb");
    let version = deb.split('_').next().unwrap();
    assert!(version.contains(&commit[..12]), "{made}");
    version.to_string()
}

#[test]
fn the_packages_and_the_image_install_upgrade_purge_and_run_on_a_clean_debian() {
    let dir = tempfile::tempdir().unwrap();
    let (previous, current) = (dir.path().join("previous"), dir.path().join("current"));
    let previous_version = package_previous(&previous);
    let made = package(&current);
    for thing in ["shepherd_", "shepherd-agent_", "shepherd-image"] {
        assert!(
            made.contains(&format!("/{thing}")),
            "package.sh made no {thing}:\n{made}"
        );
    }
    let debs: Vec<PathBuf> = std::fs::read_dir(&current)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "deb"))
        .collect();
    assert_eq!(debs.len(), 2, "{debs:?}");
    // Every tag lintian knows at warning level or above fails the test; README's "Install"
    // lists none kept.
    run(Command::new("lintian")
        .args(["--fail-on", "error,warning"])
        .args(&debs));
    let checked = run(Command::new(repository().join("scripts/package-check.sh"))
        .arg(&previous)
        .arg(&current));
    // Each check says it passed: one that was skipped fails here.
    let passed = checked
        .lines()
        .filter(|l| l.starts_with("package-check: ok: "))
        .count();
    assert_eq!(passed, 13, "{checked}");
    assert!(
        checked.contains("clean_root_to_server_answering_s = "),
        "{checked}"
    );
    assert!(
        checked.contains(&format!(
            "an upgrade from {previous_version} migrates the schema from version"
        )),
        "{checked}"
    );
}
