//! Tidy checks that keep the docs from drifting away from the code: every Rust file opens with
//! a `//!` comment, every source file is named in ARCHITECTURE.md, and every path that
//! ARCHITECTURE.md names exists.

use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// Every file under `dir`, skipping build output and hidden directories.
fn files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy();
            if name.starts_with('.') || name == "target" {
                continue;
            }
            if path.is_dir() {
                stack.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

fn architecture_md(root: &Path) -> String {
    std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap()
}

fn rust_files(root: &Path) -> Vec<PathBuf> {
    files(&root.join("crates"))
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .collect()
}

#[test]
fn every_rust_file_opens_with_a_module_comment() {
    let root = workspace();
    let missing: Vec<_> = rust_files(&root)
        .into_iter()
        .filter(|p| !std::fs::read_to_string(p).unwrap().starts_with("//!"))
        .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    assert!(missing.is_empty(), "no `//!` comment first: {missing:?}");
}

#[test]
fn every_source_file_is_named_in_architecture_md() {
    let (root, map) = (workspace(), architecture_md(&workspace()));
    let missing: Vec<_> = rust_files(&root)
        .into_iter()
        .filter_map(|p| {
            let rel = p.strip_prefix(&root).unwrap().display().to_string();
            // crates/NAME/src/PATH: PATH must appear (as `PATH`, or inside a longer path).
            let (_, in_src) = rel.split_once("/src/")?;
            (!map.contains(in_src)).then_some(rel)
        })
        .collect();
    assert!(
        missing.is_empty(),
        "source files ARCHITECTURE.md does not name: {missing:?}"
    );
}

#[test]
fn every_path_architecture_md_names_exists() {
    let (root, map) = (workspace(), architecture_md(&workspace()));
    let all: Vec<String> = files(&root)
        .into_iter()
        .map(|p| p.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    let exists = |named: &str| {
        let named = named.trim_end_matches('/');
        all.iter().any(|f| {
            f == named
                || f.ends_with(&format!("/{named}"))
                || f.starts_with(&format!("{named}/"))
                || f.contains(&format!("/{named}/"))
        })
    };
    let named: Vec<&str> = map
        .split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| {
            // Not URL paths (`/metrics`), patterns or code.
            !t.starts_with('/')
                && !t.contains([' ', '{', '*', '<', ':'])
                && (t.contains('/')
                    || [".rs", ".sh", ".md", ".sql", ".toml", ".proto"]
                        .iter()
                        .any(|ext| t.ends_with(ext)))
        })
        .collect();
    assert!(named.len() > 50, "found only {} paths", named.len());
    let missing: Vec<_> = named.into_iter().filter(|n| !exists(n)).collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:?}"
    );
}
