//! Fault suite: `shepherd bmdb migrate` killed with SIGKILL at each statement of the latest
//! migration, on both engines. Every pending migration is one transaction, so the database
//! is left at the schema it had, never half-migrated; the next `bmdb migrate` finishes the
//! job, and the database is whole.

use crate::common;

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use common::{shepherd, signal, succeeds, ChildGuard};
use shepherd_bmdb::{Bmdb, OpenOptions, SCHEMA_VERSION};

/// The statements of the latest migration on the engine of `url` (what the migrator splits).
fn latest_migration_statements(url: &str) -> usize {
    let engine = if url.starts_with("sqlite:") {
        "sqlite"
    } else {
        "postgres"
    };
    let dir = format!("{}/../bmdb/migrations/{engine}", env!("CARGO_MANIFEST_DIR"));
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let script = std::fs::read_to_string(files.last().unwrap()).unwrap();
    script
        .lines()
        .filter(|l| !l.trim_start().starts_with("--") && l.trim_end().ends_with(';'))
        .count()
}

async fn migrate_killed_at_each_statement_of_the_latest_migration(url: &str) {
    let create = OpenOptions {
        create: true,
        ..OpenOptions::default()
    };
    let db = Bmdb::connect(url, &create).await.unwrap();
    db.migrate_for_test_up_to(SCHEMA_VERSION - 1).await.unwrap();
    let schema = || db.read(|tx| Box::pin(async move { tx.schema_description().await }));
    let before = schema().await.unwrap();
    let statements = latest_migration_statements(url);
    assert!(statements >= 1);
    for n in 1..=statements {
        let mut migrate = ChildGuard(Some(
            shepherd()
                .args(["bmdb", "migrate", "--database", url])
                .env(
                    "SHEPHERD_TEST_MIGRATION_PAUSE",
                    format!("{SCHEMA_VERSION}:{n}"),
                )
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        ));
        let stderr = migrate.child().stderr.take().unwrap();
        let paused = BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .find(|l| l.contains("applied statement"))
            .expect("the migrator pauses at the statement");
        assert!(
            paused.contains(&format!("statement {n} of {statements}")),
            "{paused}"
        );
        signal(migrate.child(), "KILL");
        let _ = migrate.0.take().unwrap().wait();
        assert_eq!(
            db.schema_version().await.unwrap(),
            SCHEMA_VERSION - 1,
            "killed at statement {n}: the migration must leave nothing behind"
        );
        assert_eq!(schema().await.unwrap(), before, "killed at statement {n}");
    }
    let out = succeeds(shepherd().args(["bmdb", "migrate", "--database", url]));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(&format!("to {SCHEMA_VERSION}")), "{said}");
    assert_eq!(db.schema_version().await.unwrap(), SCHEMA_VERSION);
    assert_ne!(
        schema().await.unwrap(),
        before,
        "the migration changed the schema"
    );
    let problems = shepherd_bmdb::testing::integrity_problems(&db).await;
    assert!(problems.is_empty(), "{problems:?}");
    db.close().await;
}

shepherd_bmdb::url_conformance_tests!(migrate_killed_at_each_statement_of_the_latest_migration);
