//! Tidy checks: the invariants ARCHITECTURE.md states, checked by machine rather than by hope.
//! Every file the repository tracks is in scope (`git ls-files`), not only `crates/`:
//!
//! - every Rust file opens with a `//!` comment;
//! - ARCHITECTURE.md is a map, not an inventory: at most 250 lines; every path it names exists
//!   (a Rust file's path names exactly one file); every invariant it states names the tests
//!   that hold it, and each of those tests exists; every folder of Rust sources has its line in
//!   its folder table;
//! - no crate but the BMDB names `sqlx`, and inside it only `sql/` and the files that open
//!   pools, classify errors and make test databases do;
//! - no control loop imports another loop, and no provider depends on the loops;
//! - no library crate depends on `anyhow`; no crate, binaries included, returns
//!   `Result<_, String>` from a public function or carries a `Box<dyn …>` in a public enum;
//! - no file imports another that imports it back, directly or through a chain, re-exports
//!   included (`graph.rs`), in any crate;
//! - comments explain the code as it is rather than narrate its history;
//! - no function outside tests is over 120 lines (a reader steps through functions, not
//!   scrolls them), and no file of the binary crate over 400 (it parses and calls);
//! - background work is spawned only where `SPAWN_ALLOWED` says why (the rest runs as tasks
//!   under the one driver);
//! - each crate's integration tests are one binary (`tests/it/main.rs`), linked once;
//! - nothing stray (logs, databases) is tracked;
//! - the behaviour is specified inside the repository: every `design.md §N` cited names a
//!   section of `docs/design.md`, and nothing cites a specification a clone does not have.

mod api_types;
mod citations;
mod errors;
mod graph;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .unwrap()
}

/// Every file git tracks (or will: new files not ignored), relative to the workspace.
fn tracked() -> Vec<String> {
    let out = std::process::Command::new("git")
        .args(["ls-files", "--cached", "--others", "--exclude-standard"])
        .current_dir(workspace())
        .output()
        .expect("git ls-files");
    assert!(out.status.success(), "git ls-files failed");
    let mut files: Vec<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter(|f| workspace().join(f).exists())
        .map(String::from)
        .collect();
    files.sort();
    files
}

fn rust_files() -> Vec<String> {
    tracked()
        .into_iter()
        .filter(|f| f.ends_with(".rs"))
        .collect()
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(workspace().join(rel)).unwrap()
}

fn architecture_md() -> String {
    read("ARCHITECTURE.md")
}

/// The library source files: `crates/NAME/src/**.rs` (binaries' `main.rs` included).
fn source_files() -> Vec<String> {
    rust_files()
        .into_iter()
        .filter(|f| f.starts_with("crates/") && f.contains("/src/"))
        .collect()
}

/// The backticked tokens of ARCHITECTURE.md that look like paths.
fn named_paths(map: &str) -> Vec<&str> {
    map.split('`')
        .skip(1)
        .step_by(2)
        .filter(|t| {
            // Not URL paths (`/metrics`), patterns or code.
            !t.starts_with('/')
                && !t.contains([' ', '{', '*', '<', ':', '('])
                && (t.contains('/')
                    || [
                        ".rs", ".sh", ".md", ".sql", ".toml", ".proto", ".yml", ".json",
                    ]
                    .iter()
                    .any(|ext| t.ends_with(ext)))
        })
        .collect()
}

/// Whether `named` names `file`: it is the file's path, or its end on a path boundary.
fn names(named: &str, file: &str) -> bool {
    let named = named.trim_end_matches('/');
    file == named || file.ends_with(&format!("/{named}"))
}

#[test]
fn every_rust_file_opens_with_a_module_comment() {
    let missing: Vec<_> = rust_files()
        .into_iter()
        .filter(|f| !read(f).starts_with("//!"))
        .collect();
    assert!(missing.is_empty(), "no `//!` comment first: {missing:?}");
}

/// The most lines ARCHITECTURE.md may have: a map a newcomer reads in one sitting.
const MAP_LINES: usize = 250;

#[test]
fn architecture_md_is_a_map_of_at_most_250_lines() {
    let lines = architecture_md().lines().count();
    assert!(
        lines <= MAP_LINES,
        "ARCHITECTURE.md has {lines} lines; keep it a map of at most {MAP_LINES}"
    );
}

/// The bullets of ARCHITECTURE.md's "Invariants" section, each as one string.
fn invariants(map: &str) -> Vec<String> {
    let section = map
        .split("\n## Invariants\n")
        .nth(1)
        .expect("ARCHITECTURE.md has an \"## Invariants\" section");
    let section = section.split("\n## ").next().unwrap_or(section);
    let mut bullets: Vec<String> = Vec::new();
    for line in section.lines() {
        if let Some(first) = line.strip_prefix("- ") {
            bullets.push(first.to_string());
        } else if let Some(last) = bullets.last_mut() {
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    bullets
}

/// Every function name defined in the tracked Rust files (`fn NAME`).
fn defined_functions() -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for file in rust_files() {
        let text = read(&file);
        for rest in text.split("fn ").skip(1) {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                names.insert(name);
            }
        }
    }
    names
}

#[test]
fn every_invariant_names_tests_that_exist() {
    let map = architecture_md();
    let bullets = invariants(&map);
    assert!(
        bullets.len() >= 10,
        "found only {} invariants",
        bullets.len()
    );
    let defined = defined_functions();
    for bullet in &bullets {
        let held_by = bullet
            .split_once("Held by")
            .map(|(_, tests)| tests)
            .unwrap_or_else(|| panic!("an invariant names no test (\"Held by `test`\"): {bullet}"));
        let named: Vec<&str> = held_by.split('`').skip(1).step_by(2).collect();
        assert!(!named.is_empty(), "an invariant names no test: {bullet}");
        let missing: Vec<_> = named.iter().filter(|n| !defined.contains(**n)).collect();
        assert!(
            missing.is_empty(),
            "an invariant names tests that do not exist, {missing:?}: {bullet}"
        );
    }
}

#[test]
fn every_path_architecture_md_names_exists_and_a_rust_path_names_one_file() {
    let (map, all) = (architecture_md(), tracked());
    let named = named_paths(&map);
    assert!(named.len() > 50, "found only {} paths", named.len());
    let exists = |n: &str| {
        let n = n.trim_end_matches('/');
        all.iter().any(|f| {
            names(n, f) || f.starts_with(&format!("{n}/")) || f.contains(&format!("/{n}/"))
        })
    };
    let missing: Vec<_> = named.iter().filter(|n| !exists(n)).collect();
    assert!(
        missing.is_empty(),
        "ARCHITECTURE.md names paths that do not exist: {missing:?}"
    );
    let ambiguous: Vec<_> = named
        .iter()
        .filter(|n| n.ends_with(".rs") && all.iter().filter(|f| names(n, f)).count() > 1)
        .collect();
    assert!(
        ambiguous.is_empty(),
        "ARCHITECTURE.md names Rust files by paths that name several: {ambiguous:?}"
    );
}

/// Every folder of Rust sources (`crates/NAME/src` and the folders under it) has its line in
/// ARCHITECTURE.md's folder table: a newcomer finds where each thing lives from the map, and a
/// new folder cannot slip in unexplained.
#[test]
fn every_source_folder_has_its_line_in_architecture_md() {
    let map = architecture_md();
    let table = map
        .split("| folder | owns | start at |")
        .nth(1)
        .and_then(|rest| rest.split("\n\n").next())
        .expect("ARCHITECTURE.md has a table `| folder | owns | start at |`");
    let named: BTreeSet<&str> = table.split('`').skip(1).step_by(2).collect();
    let folders: BTreeSet<String> = source_files()
        .iter()
        .filter_map(|f| f.rsplit_once('/').map(|(dir, _)| dir.to_string()))
        .collect();
    let missing: Vec<_> = folders
        .iter()
        .filter(|dir| !named.contains(dir.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "source folders without a line in ARCHITECTURE.md's folder table: {missing:?}"
    );
}

/// The source that may name `sqlx`: in the BMDB, the statements (`sql/`) and the files that
/// open pools (`db.rs`), parse database URLs into the driver's options (`url.rs`), classify
/// the driver's errors (`error.rs`, `failover.rs`) and make test databases (`testing.rs`);
/// and the benchmarks, whose baselines are raw statements.
const SQLX_ALLOWED: &[&str] = &[
    "crates/bmdb/src/sql/",
    "crates/bmdb/src/db.rs",
    "crates/bmdb/src/url.rs",
    "crates/bmdb/src/error.rs",
    "crates/bmdb/src/failover.rs",
    "crates/bmdb/src/testing/mod.rs",
    "crates/bench/src/",
];

#[test]
fn only_the_bmdb_names_sqlx_and_inside_it_only_sql_and_the_pools() {
    let word = regex_lite::Regex::new(r"\bsqlx\b").unwrap();
    let offenders: Vec<_> = source_files()
        .into_iter()
        .filter(|f| word.is_match(&read(f)))
        .filter(|f| !SQLX_ALLOWED.iter().any(|allowed| f.starts_with(allowed)))
        .collect();
    assert!(
        offenders.is_empty(),
        "sqlx outside the BMDB's one door (tests and benchmarks' raw baselines aside): {offenders:?}"
    );
}

#[test]
fn no_loop_imports_another_loop() {
    let loops = [
        "provisioner",
        "updater",
        "initializer",
        "recoverer",
        "retention",
    ];
    let mut offenders = Vec::new();
    for this in loops {
        let text = read(&format!("crates/loops/src/{this}.rs"));
        for other in loops.iter().filter(|o| **o != this) {
            if text.contains(&format!("crate::{other}"))
                || text.contains(&format!("super::{other}"))
            {
                offenders.push(format!("{this} imports {other}"));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "loops coordinate through the BMDB only: {offenders:?}"
    );
}

/// Crates that are libraries (their binaries, if any, are `src/main.rs`).
fn library_crates() -> Vec<String> {
    let all = tracked();
    all.iter()
        .filter_map(|f| f.strip_suffix("/src/lib.rs"))
        .map(String::from)
        .collect()
}

#[test]
fn no_library_crate_depends_on_anyhow() {
    let mut offenders = Vec::new();
    for krate in library_crates() {
        let manifest = read(&format!("{krate}/Cargo.toml"));
        let deps = manifest
            .split("\n[")
            .find(|s| s.starts_with("[dependencies]") || s.starts_with("dependencies]"))
            .unwrap_or_default();
        if deps.contains("anyhow") {
            offenders.push(format!("{krate}/Cargo.toml"));
        }
        for f in source_files()
            .into_iter()
            .filter(|f| f.starts_with(&format!("{krate}/src/")) && !f.ends_with("/main.rs"))
        {
            if read(&f).contains("anyhow") {
                offenders.push(f);
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "library crates return typed errors; anyhow is for binaries, tests and benchmarks: {offenders:?}"
    );
}

/// Library crates that implement `Provider` (the provider crate itself aside).
fn provider_crates() -> Vec<String> {
    library_crates()
        .into_iter()
        .filter(|krate| krate != "crates/provider")
        .filter(|krate| {
            source_files()
                .iter()
                .filter(|f| f.starts_with(&format!("{krate}/src/")))
                .any(|f| read(f).contains("impl Provider for"))
        })
        .collect()
}

#[test]
fn providers_sit_below_the_loops() {
    let providers = provider_crates();
    for expected in ["crates/ironic", "crates/equinix", "crates/sim"] {
        assert!(
            providers.iter().any(|p| p == expected),
            "{expected} implements Provider but was not found: {providers:?}"
        );
    }
    let offenders: Vec<_> = providers
        .iter()
        .filter(|krate| read(&format!("{krate}/Cargo.toml")).contains("shepherd-loops"))
        .collect();
    assert!(
        offenders.is_empty(),
        "a provider depends on shepherd-provider, never on shepherd-loops, not even for its tests \
         (tests that drive it through the loops live in crates/loops/tests): {offenders:?}"
    );
}

/// Every crate root: libraries, binaries, and each integration test.
fn crate_roots() -> Vec<PathBuf> {
    let root = workspace();
    tracked()
        .into_iter()
        .filter(|f| {
            f.ends_with("/src/lib.rs")
                || f.ends_with("/src/main.rs")
                || (f.starts_with("crates/")
                    && f.split('/').nth(2) == Some("tests")
                    && (f.matches('/').count() == 3 || f.ends_with("/main.rs"))
                    && f.ends_with(".rs"))
        })
        .map(|f| root.join(f))
        .collect()
}

#[test]
fn no_file_imports_one_that_imports_it_back() {
    let root = workspace();
    let mut found = Vec::new();
    let roots = crate_roots();
    assert!(roots.len() > 20, "found only {} crate roots", roots.len());
    for krate in roots {
        for cycle in graph::cycles(&graph::Crate::read(&krate).edges()) {
            let files: Vec<String> = cycle
                .iter()
                .map(|f| f.strip_prefix(&root).unwrap().display().to_string())
                .collect();
            if !found.contains(&files) {
                found.push(files);
            }
        }
    }
    assert!(found.is_empty(), "files that import each other: {found:?}");
}

/// Words that narrate how the code came to be rather than say what it does.
const NARRATION: &str = r"(?i)\b(issue\s*(\d+|:)|before (the|this) (fix|change)\b|after (the|this) (fix|change)\b|used to\b|previously\b|formerly\b|was changed\b|we changed\b|in an earlier session|this session's work)";

#[test]
fn comments_explain_rather_than_narrate_history() {
    let narration = regex_lite::Regex::new(NARRATION).unwrap();
    let mut offenders = Vec::new();
    for f in rust_files() {
        if f.ends_with("tidy/main.rs") {
            continue;
        }
        for (n, line) in read(&f).lines().enumerate() {
            let Some((_, comment)) = line.split_once("//") else {
                continue;
            };
            if narration.is_match(comment) {
                offenders.push(format!("{f}:{}: {}", n + 1, line.trim()));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "comments that narrate history (say why the code is as it is, not what it was):\n{}",
        offenders.join("\n")
    );
}

#[test]
fn nothing_stray_is_tracked() {
    let stray: BTreeSet<_> = tracked()
        .into_iter()
        .filter(|f| {
            [
                ".log", ".db", ".sqlite", ".db-wal", ".db-shm", ".tmp", ".orig", ".rej",
            ]
            .iter()
            .any(|ext| f.ends_with(ext))
                || f.starts_with("target/")
        })
        .collect();
    assert!(stray.is_empty(), "stray files tracked: {stray:?}");
}

/// Every crate with sources: each library, and each binary (whose modules are libraries in
/// all but name).
fn crates_with_sources() -> Vec<String> {
    let all = tracked();
    let roots = all.iter().filter_map(|f| {
        f.strip_suffix("/src/lib.rs")
            .or(f.strip_suffix("/src/main.rs"))
    });
    let crates: BTreeSet<String> = roots.map(String::from).collect();
    crates.into_iter().collect()
}

#[test]
fn no_crate_says_what_went_wrong_in_a_string_or_a_box() {
    let offending: Vec<String> = crates_with_sources()
        .iter()
        .flat_map(|krate| {
            source_files().into_iter().filter(move |f| {
                f.starts_with(&format!("{krate}/src/")) && !f.ends_with("/main.rs")
            })
        })
        .flat_map(|f| api_types::stringly_or_boxed(&f, &read(&f)))
        .collect();
    assert!(
        offending.is_empty(),
        "a crate's public API returns Result<_, String> or carries Box<dyn …> in an enum: {offending:?}"
    );
}

/// The integration-test binaries of `krate`: each `tests/*.rs`, and each `tests/*/main.rs`.
fn test_binaries(krate: &str) -> Vec<String> {
    let prefix = format!("{krate}/tests/");
    tracked()
        .into_iter()
        .filter(|f| {
            f.strip_prefix(&prefix).is_some_and(|rest| {
                let parts: Vec<&str> = rest.split('/').collect();
                matches!(parts.as_slice(), [file] if file.ends_with(".rs"))
                    || matches!(parts.as_slice(), [_, "main.rs"])
            })
        })
        .collect()
}

#[test]
fn integration_tests_are_one_binary_per_crate() {
    // A test that sets a process-wide variable needs a process of its own.
    let own_process = ["crates/provider/tests/bmc_system_trust.rs"];
    let crates: BTreeSet<String> = tracked()
        .iter()
        .filter_map(|f| f.strip_suffix("/Cargo.toml"))
        .filter(|c| c.starts_with("crates/"))
        .map(String::from)
        .collect();
    let offenders: Vec<Vec<String>> = crates
        .iter()
        .map(|krate| {
            let mut binaries = test_binaries(krate);
            binaries.retain(|b| !own_process.contains(&b.as_str()));
            binaries
        })
        .filter(|binaries| binaries.len() > 1)
        .collect();
    assert!(
        offenders.is_empty(),
        "each crate links its integration tests once (tests/it/main.rs with a module per concern): {offenders:?}"
    );
}

/// `scripts/test.sh` keeps every test whose name holds `solo::` out of its first run and then
/// runs only the `shepherd` crate's `solo::` modules, so a test elsewhere whose path held
/// `solo::` (a module, or a test function ending in `solo` that a macro makes a module of)
/// would run nowhere.
#[test]
fn tests_named_solo_live_only_in_the_shepherd_crate() {
    let named = regex_lite::Regex::new(r"\b(mod|fn)\s+[a-z0-9_]*solo\b").unwrap();
    let offenders: Vec<String> = rust_files()
        .into_iter()
        .filter(|f| f != "crates/shepherd/tests/it/main.rs")
        .filter(|f| named.is_match(&read(f)))
        .collect();
    assert!(
        offenders.is_empty(),
        "`scripts/test.sh` would skip these files' `solo` tests everywhere: {offenders:?}"
    );
}

#[test]
fn no_error_prints_the_cause_it_reports_as_its_source() {
    let offending: Vec<String> = source_files()
        .iter()
        .flat_map(|f| errors::printing_their_source(f, &read(f)))
        .collect();
    assert!(
        offending.is_empty(),
        "errors whose message prints the field they report as source() (chains print it twice; \
         drop it from the message, or report it only in the message): {offending:#?}"
    );
}

/// Longest function (signature to closing brace) a source file may hold outside its tests.
const LONGEST_FUNCTION: usize = 120;

/// The functions of `text` (Rust source) longer than `longest` lines, outside `#[cfg(test)]`
/// modules, as (first line, length). A function is a line opening with `fn` (after its
/// visibility and `async`) up to the first line that holds only `}` at its indentation.
fn long_functions(text: &str, longest: usize) -> Vec<(usize, usize)> {
    let opens =
        regex_lite::Regex::new(r"^(\s*)(pub(\([a-z]+\))? )?(const )?(async )?fn \w+").unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut long = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            break;
        }
        let Some(m) = opens.captures(line) else {
            continue;
        };
        let close = format!("{}}}", &m[1]);
        if let Some(end) = lines[i..].iter().position(|l| *l == close) {
            if end + 1 > longest {
                long.push((i + 1, end + 1));
            }
        }
    }
    long
}

/// Where production code may call `tokio::spawn`, and why. Every background activity of a
/// running Shepherd is a task (`crates/tasks`) whose units run under the one driver
/// (`tasks/src/driver.rs`); the spawns left start such a task, are a mechanism below the
/// tasks, or serve connections. Test and benchmark support (`crates/bench`, `crates/sim`,
/// `testing` modules, fakes) may spawn freely.
const SPAWN_ALLOWED: &[(&str, &str)] = &[
    (
        "crates/agent/src/connection.rs",
        "the agent's own HTTP/2 connection driver",
    ),
    (
        "crates/bmdb/src/claim_batch.rs",
        "a batch's write outlives a canceled caller",
    ),
    (
        "crates/bmdb/src/ending_batch.rs",
        "a batch's write outlives a canceled caller",
    ),
    (
        "crates/bmdb/src/db.rs",
        "BEGIN and session collection outlive a canceled caller",
    ),
    (
        "crates/bmdb/src/session.rs",
        "a session's keep-alive: its lease, not a task",
    ),
    (
        "crates/loops/src/runner.rs",
        "the machine loops' driver: its workers and endings",
    ),
    (
        "crates/operator/src/audit.rs",
        "starts the audit-trail task",
    ),
    (
        "crates/operator/src/metrics_http.rs",
        "starts fleet statistics and the HTTP listener",
    ),
    (
        "crates/server/src/heartbeat_writes.rs",
        "starts the heartbeat-reports task",
    ),
    (
        "crates/server/src/loopback.rs",
        "the demo's in-process server",
    ),
    (
        "crates/shepherd/src/bare_flags.rs",
        "the media server's listener",
    ),
    (
        "crates/shepherd/src/demo.rs",
        "the demo's loops beside its progress",
    ),
    ("crates/shepherd/src/plumbing.rs", "the signal handler"),
    (
        "crates/shepherd/src/run_cmd.rs",
        "the simulated agents of --provider sim",
    ),
    (
        "crates/shepherd/src/schema_watch.rs",
        "starts the schema-watch task",
    ),
    (
        "crates/shepherd/src/server_cmd.rs",
        "the API listener and the token-uses task",
    ),
];

/// Whether `file` is test or benchmark support, where spawning is free.
fn is_support(file: &str) -> bool {
    file.starts_with("crates/bench/")
        || file.starts_with("crates/sim/")
        || file.contains("/testing")
        || file.ends_with("/fake.rs")
}

/// How many times `text`, outside its `#[cfg(test)] mod tests`, spawns a tokio task.
fn spawns(text: &str) -> usize {
    let code = text
        .split("#[cfg(test)]\nmod tests")
        .next()
        .unwrap_or_default();
    code.matches("tokio::spawn(").count() + code.matches("tokio::task::spawn(").count()
}

#[test]
fn background_work_is_spawned_only_where_the_list_says_why() {
    let allowed: BTreeSet<&str> = SPAWN_ALLOWED.iter().map(|(f, _)| *f).collect();
    let mut stray = Vec::new();
    let mut stale = Vec::new();
    for f in source_files() {
        if !f.starts_with("crates/") || !f.contains("/src/") || is_support(&f) {
            continue;
        }
        match (spawns(&read(&f)) > 0, allowed.contains(f.as_str())) {
            (true, false) => stray.push(f),
            (false, true) => stale.push(f),
            _ => {}
        }
    }
    assert!(
        stray.is_empty(),
        "tokio::spawn outside the task driver (run the work as a task under \
         tasks/src/driver.rs, or add the file to SPAWN_ALLOWED with why): {stray:?}"
    );
    assert!(
        stale.is_empty(),
        "SPAWN_ALLOWED names files that spawn nothing: {stale:?}"
    );
    // The count skips tests and counts both spellings.
    assert_eq!(
        spawns("tokio::spawn(a);\n#[cfg(test)]\nmod tests {\n tokio::spawn(b);\n}"),
        1
    );
    assert_eq!(spawns("tokio::task::spawn(a); tokio::spawn(b);"), 2);
}

/// Longest file of the binary crate: it parses flags and calls the libraries.
const LONGEST_BINARY_FILE: usize = 400;

#[test]
fn the_binary_is_thin_no_file_of_it_over_400_lines() {
    let long: Vec<String> = source_files()
        .into_iter()
        .filter(|f| f.starts_with("crates/shepherd/src/"))
        .filter_map(|f| {
            let lines = read(&f).lines().count();
            (lines > LONGEST_BINARY_FILE).then(|| format!("{f}: {lines} lines"))
        })
        .collect();
    assert!(
        long.is_empty(),
        "files of the binary over {LONGEST_BINARY_FILE} lines (move what is not parsing flags and \
         calling the libraries into a library, or split the command):\n{}",
        long.join("\n")
    );
}

#[test]
fn no_function_outside_tests_is_over_120_lines() {
    let mut offenders = Vec::new();
    for f in source_files() {
        for (line, length) in long_functions(&read(&f), LONGEST_FUNCTION) {
            offenders.push(format!("{f}:{line}: {length} lines"));
        }
    }
    assert!(
        offenders.is_empty(),
        "functions over {LONGEST_FUNCTION} lines (split them into steps a reader can follow):\n{}",
        offenders.join("\n")
    );
    // The check itself finds a long function and passes over a short one and over tests.
    let body = "    x();\n".repeat(LONGEST_FUNCTION);
    let long = format!("pub async fn long() {{\n{body}}}\n");
    assert_eq!(
        long_functions(&long, LONGEST_FUNCTION),
        vec![(1, LONGEST_FUNCTION + 2)]
    );
    let short = "fn short() {\n    x();\n}\n";
    assert!(long_functions(short, LONGEST_FUNCTION).is_empty());
    let in_tests = format!("#[cfg(test)]\nmod tests {{\n{long}}}\n");
    assert!(long_functions(&in_tests, LONGEST_FUNCTION).is_empty());
}
