//! Gives the binary the git commit it was built from, for `shepherd --version`:
//! `SHEPHERD_COMMIT` from the environment when set (a build from a source tarball, a package
//! build), else `git rev-parse` of the checkout, else "unknown". Cargo runs this again when the
//! checkout's HEAD moves.

use std::path::Path;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    let text = String::from_utf8(out.stdout).ok()?;
    (out.status.success() && !text.trim().is_empty()).then(|| text.trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=SHEPHERD_COMMIT");
    let commit = match std::env::var("SHEPHERD_COMMIT") {
        Ok(commit) if !commit.is_empty() => commit,
        _ => {
            if let Some(dir) = git(&["rev-parse", "--absolute-git-dir"]) {
                let dir = Path::new(&dir);
                // A missing file would make cargo run this on every build; watch those there are.
                let reference = git(&["rev-parse", "--symbolic-full-name", "HEAD"]);
                let watched = [
                    "HEAD",
                    "packed-refs",
                    reference.as_deref().unwrap_or("HEAD"),
                ];
                for file in watched.map(|f| dir.join(f)).iter().filter(|f| f.exists()) {
                    println!("cargo:rerun-if-changed={}", file.display());
                }
            }
            let hash = git(&["rev-parse", "--short=12", "HEAD"]);
            let date = git(&["log", "-1", "--format=%cs", "HEAD"]);
            match (hash, date) {
                (Some(hash), Some(date)) => format!("{hash} ({date})"),
                (Some(hash), None) => hash,
                _ => "unknown".into(),
            }
        }
    };
    println!("cargo:rustc-env=SHEPHERD_COMMIT={commit}");
}
