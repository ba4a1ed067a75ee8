//! The monitoring shipped in `deploy/`: the Prometheus alert rules pass `promtool check rules`
//! and their unit tests (`promtool test rules`), and the rules and the Grafana dashboard name
//! only metrics that `shepherd run` and `shepherd server` really export.

use crate::common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{announced, shepherd, ChildGuard};
use shepherd_bmdb::testing;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// Runs promtool in `deploy/prometheus` and fails the test with its output unless it succeeds.
fn promtool(args: &[&str]) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(deploy().join("prometheus"))
        .output()
        .unwrap_or_else(|e| {
            panic!("promtool: {e} (scripts/test-deps.sh installs Debian's prometheus package)")
        });
    assert!(
        out.status.success(),
        "promtool {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn alert_rules_pass_promtool_and_their_unit_tests() {
    promtool(&["check", "rules", "shepherd-alerts.yml"]);
    promtool(&["test", "rules", "shepherd-alerts.test.yml"]);
}

/// The metric families a `/metrics` page declares (its `# TYPE` lines).
async fn families(url: &str) -> BTreeSet<String> {
    let body = reqwest::get(url).await.unwrap().text().await.unwrap();
    body.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

/// Every `shepherd_…` and `bmdb_…` name a file mentions.
fn metric_names(path: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(path).unwrap();
    let name = regex_lite::Regex::new(r"\b(?:shepherd|bmdb)_[a-z0-9_]+").unwrap();
    name.find_iter(&text)
        .map(|m| m.as_str().to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_rules_name_only_exported_metrics() {
    let t = testing::sqlite().await;
    let dir = tempfile::tempdir().unwrap();
    let mut server = ChildGuard(Some(
        common::server(&t.url, dir.path())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let line = announced(server.child(), "shepherd server: web UI at ");
    let server_metrics = line.rsplit("metrics at ").next().unwrap().to_string();
    let mut run = ChildGuard(Some(
        shepherd()
            .args(["run", "--provider", "sim", "--database", &t.url])
            .args(["--sim-machines", "5", "--agent-endpoint", "bmaas.test:443"])
            .args(["--metrics-listen", "127.0.0.1:0"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap(),
    ));
    let run_metrics = announced(run.child(), "shepherd run: metrics at ");

    let mut exported = families(&server_metrics).await;
    exported.extend(families(&run_metrics).await);
    let known = |name: &str| {
        exported.contains(name)
            || ["_total", "_bucket", "_count", "_sum"]
                .iter()
                .any(|s| name.strip_suffix(s).is_some_and(|n| exported.contains(n)))
    };
    for file in [
        "prometheus/shepherd-alerts.yml",
        "prometheus/shepherd-alerts.test.yml",
        "grafana/shepherd-dashboard.json",
    ] {
        let names = metric_names(&deploy().join(file));
        assert!(!names.is_empty(), "{file} names no metric");
        let unknown: Vec<_> = names.iter().filter(|n| !known(n)).collect();
        assert!(
            unknown.is_empty(),
            "{file} names metrics no process exports: {unknown:?} (exported: {exported:?})"
        );
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy().join("grafana/shepherd-dashboard.json")).unwrap(),
    )
    .unwrap();
    let panels = dashboard["panels"].as_array().unwrap();
    assert!(panels.iter().any(|p| p["title"] == "Machines by state"));

    for child in [server, run] {
        assert!(child.terminate().status.success());
    }
    t.cleanup().await;
}
