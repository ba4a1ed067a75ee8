//! Fault suite: a broken static inventory is a start-up error. `shepherd run` exits non-zero
//! with one line naming the setting and the problem, and writes nothing (not even the
//! database file it was asked to create). An http(s) inventory gets a few attempts first.

use crate::common;

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use common::shepherd;

/// Runs `shepherd run` against `inventory_url` and waits (bounded) for it to exit.
fn run_with_inventory(dir: &std::path::Path, inventory_url: &str, within: Duration) -> Output {
    let db = dir.join("bmdb.sqlite");
    let mut child = shepherd()
        .args(["run", "--provider", "static", "--migrate"])
        .arg(format!("--database=sqlite:{}", db.display()))
        .arg(format!("--static-inventory={inventory_url}"))
        .args(["--agent-endpoint", "bmaas.test:443", "--ssh-password", "pw"])
        .args(["--agent-executable", "/bin/true"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + within;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "shepherd run kept running with inventory {inventory_url}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!db.exists(), "the database was created for {inventory_url}");
    out
}

/// The one `error:` line of a failed start.
fn error_line(out: &Output) -> String {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one error line expected: {stderr}");
    errors[0].to_string()
}

#[test]
fn every_broken_file_inventory_fails_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "bad-json",
            "[{\"ID\": \"m1\", \"Addr\": ",
            "not a valid JSON list",
        ),
        (
            "duplicate",
            r#"[{"ID": "m1", "Addr": "a:22"}, {"ID": "m1", "Addr": "b:22"}]"#,
            "duplicate ID \"m1\"",
        ),
        ("no-addr", r#"[{"ID": "m1"}]"#, "missing field `Addr`"),
        (
            "unknown-field",
            r#"[{"ID": "m1", "Addr": "a:22", "Rack": "r1"}]"#,
            "unknown field `Rack`",
        ),
        (
            "not-a-list",
            r#"{"ID": "m1", "Addr": "a:22"}"#,
            "not a valid JSON list",
        ),
    ];
    for (name, text, why) in cases {
        let path = dir.path().join(format!("{name}.json"));
        std::fs::write(&path, text).unwrap();
        let url = format!("file://{}", path.display());
        let out = run_with_inventory(dir.path(), &url, Duration::from_secs(20));
        assert!(!out.status.success(), "{name}: exit {}", out.status);
        let line = error_line(&out);
        assert!(line.contains("static-inventory"), "{name}: {line}");
        assert!(line.contains(&url), "{name}: {line}");
        assert!(line.contains(why), "{name}: {line}");
    }
    // An entry whose BMC names a password file that is not there.
    let path = dir.path().join("bmc.json");
    let no_password = dir.path().join("no-such-password");
    std::fs::write(
        &path,
        format!(
            r#"[{{"ID": "m1", "Addr": "a:22", "BMC": {{"URL": "https://bmc.test", "Username": "u", "PasswordFile": "{}"}}}}]"#,
            no_password.display()
        ),
    )
    .unwrap();
    let out = run_with_inventory(
        dir.path(),
        &format!("file://{}", path.display()),
        Duration::from_secs(20),
    );
    assert!(!out.status.success());
    let line = error_line(&out);
    assert!(line.contains("entry 0 (m1)"), "{line}");
    assert!(
        line.contains("BMC password file") && line.contains("no-such-password"),
        "{line}"
    );

    let missing = format!("file://{}", dir.path().join("missing.json").display());
    let out = run_with_inventory(dir.path(), &missing, Duration::from_secs(20));
    assert!(!out.status.success());
    let line = error_line(&out);
    assert!(line.contains("No such file"), "{line}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_inventory_that_keeps_failing_is_fatal_after_a_few_attempts() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let served = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = served.clone();
    // At most a bounded number of answers; the listener goes when the test ends.
    tokio::spawn(async move {
        for _ in 0..20 {
            let Ok((mut conn, _)) = listener.accept().await else {
                return;
            };
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = conn
                .write_all(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await;
        }
    });
    let dir = tempfile::tempdir().unwrap();
    let url = format!("http://{addr}/inventory.json");
    let out = tokio::task::spawn_blocking({
        let dir = dir.path().to_path_buf();
        let url = url.clone();
        move || run_with_inventory(&dir, &url, Duration::from_secs(40))
    })
    .await
    .unwrap();
    assert!(!out.status.success());
    let line = error_line(&out);
    assert!(line.contains("503"), "{line}");
    assert!(line.contains("attempt"), "{line}");
    let n = served.load(std::sync::atomic::Ordering::SeqCst);
    assert!((2..=10).contains(&n), "{n} attempts");
}
