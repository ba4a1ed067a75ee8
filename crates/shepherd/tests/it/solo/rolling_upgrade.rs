//! Rolling upgrades with real processes, on both backends: a `shepherd run` of this build keeps
//! claiming and finishing work after another process applies a newer migration that declares
//! this build's schema compatible, and stops cleanly — its work canceled, its sessions closed,
//! a message naming both versions — once a migration no longer admits it.

use crate::common;

use std::process::Stdio;
use std::time::{Duration, Instant};

use common::{shepherd, sim_replica, succeeds, ChildGuard, Pace};
use shepherd_bmdb::testing::{all_history, eventually};
use shepherd_bmdb::{Bmdb, OpenOptions, WorkEvent, SCHEMA_VERSION};

/// Finished takeovers recorded so far.
async fn finished(db: &Bmdb) -> usize {
    all_history(db)
        .await
        .iter()
        .filter(|e| e.event == WorkEvent::Finished)
        .count()
}

async fn old_binary_across_an_expand_then_a_contract_migration(url: &str) {
    succeeds(shepherd().args(["bmdb", "migrate", "--database", url]));
    let log = tempfile::NamedTempFile::new().unwrap();
    let mut run = ChildGuard(Some(
        sim_replica(
            url,
            2000,
            "50ms",
            Pace {
                reconcile_rate: "100ms,1",
                ..Pace::default()
            },
        )
        .args(["--schema-check-interval", "200ms"])
        .stdout(Stdio::null())
        .stderr(log.reopen().unwrap())
        .spawn()
        .unwrap(),
    ));
    // The handle of "another process": it migrates without checking the schema first.
    let db = Bmdb::connect(url, &OpenOptions::default()).await.unwrap();
    eventually("the first takeovers", Duration::from_secs(60), async || {
        let n = finished(&db).await;
        if n >= 5 {
            Ok(n)
        } else {
            Err(n)
        }
    })
    .await;

    // An additive migration that admits this build's schema.
    let expand = SCHEMA_VERSION + 1;
    db.apply_foreign_migration(
        expand,
        "future_expand",
        SCHEMA_VERSION,
        "CREATE TABLE future_expand (x integer)",
    )
    .await
    .unwrap();
    let before = finished(&db).await;
    eventually(
        "takeovers after the compatible migration",
        Duration::from_secs(60),
        async || {
            let n = finished(&db).await;
            if n >= before + 10 {
                Ok(n)
            } else {
                Err(n)
            }
        },
    )
    .await;
    assert!(
        run.child().try_wait().unwrap().is_none(),
        "run stopped on a compatible schema: {}",
        std::fs::read_to_string(log.path()).unwrap()
    );
    let status = succeeds(shepherd().args(["bmdb", "status", "--database", url]));
    let status = String::from_utf8_lossy(&status.stdout).into_owned();
    assert!(
        status.contains(&format!(
            "binaries:        schema {SCHEMA_VERSION} to {expand} may run on it"
        )),
        "{status}"
    );

    // A contracting migration: binaries older than it must stop.
    let contract = SCHEMA_VERSION + 2;
    db.apply_foreign_migration(
        contract,
        "future_contract",
        contract,
        "CREATE TABLE future_contract (x integer)",
    )
    .await
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let exit = loop {
        if let Some(status) = run.child().try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "run kept running on a schema that no longer admits it"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let stderr = std::fs::read_to_string(log.path()).unwrap();
    assert!(!exit.success(), "{stderr}");
    let want = format!(
        "database schema version {contract} admits binaries of schema {contract} or later, and this binary is schema {SCHEMA_VERSION}"
    );
    assert!(stderr.contains(&want), "want {want:?} in:\n{stderr}");
    // Stopped cleanly: nothing held, every session closed.
    let counts = db.status_counts().await.unwrap();
    assert!(
        counts.work.is_empty(),
        "work left behind: {:?}",
        counts.work
    );
    assert_eq!(counts.sessions_live, 0, "sessions left open");
    // And it refuses to start again, with the same message.
    let again = shepherd()
        .args(["run", "--provider", "sim", "--database", url])
        .args(["--agent-endpoint", "bmaas.test:443"])
        .output()
        .unwrap();
    common::refused(&again, &want);
    db.close().await;
}

shepherd_bmdb::url_conformance_tests!(old_binary_across_an_expand_then_a_contract_migration);
