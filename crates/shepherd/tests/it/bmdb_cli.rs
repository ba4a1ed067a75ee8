//! `shepherd bmdb migrate/status` as an operator runs them: real binary, real databases.

use std::process::{Command, Output};

use shepherd_bmdb::{testing, SCHEMA_VERSION};

fn shepherd(args: &[&str], database: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_shepherd"));
    cmd.args(args).env_remove("SHEPHERD_DATABASE");
    if let Some(db) = database {
        cmd.env("SHEPHERD_DATABASE", db);
    }
    cmd.output().expect("run shepherd")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// `shepherd --version` says which commit the binary is and which BMDB schemas it migrates and
/// runs on, so that an operator can tell before an upgrade whether it fits a database; `-V` is
/// the release alone.
#[test]
fn version_names_the_commit_and_the_schemas() {
    let (out, _) = text(&shepherd(&["--version"], None));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[0], format!("shepherd {}", env!("CARGO_PKG_VERSION")));
    let commit = lines[1].strip_prefix("commit:").expect(&out).trim();
    let hash = commit.split(' ').next().unwrap();
    assert!(
        hash.len() == 12 && hash.chars().all(|c| c.is_ascii_hexdigit()),
        "a test build is made in a git checkout: {out}"
    );
    assert_eq!(lines[2], format!("bmdb schema: {SCHEMA_VERSION}"));
    let window = shepherd_bmdb::SchemaWindow::THIS_BINARY;
    assert!(
        out.contains(&format!(
            "a database binaries of schema {} to {SCHEMA_VERSION} may run on",
            window.oldest_compatible
        )),
        "{out}"
    );
    let (short, _) = text(&shepherd(&["-V"], None));
    assert_eq!(short.trim(), lines[0]);
}

#[test]
fn migrate_then_status_on_sqlite_via_flag_and_env() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("s.db").display());
    let o = shepherd(&["bmdb", "migrate", "--database", &url], None);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains(&format!(
            "migrated schema from version 0 to {SCHEMA_VERSION}"
        )),
        "{out}"
    );
    let o = shepherd(&["bmdb", "migrate"], Some(&url));
    assert!(
        text(&o)
            .0
            .contains(&format!("up to date (version {SCHEMA_VERSION})")),
        "{:?}",
        text(&o)
    );
    let o = shepherd(&["bmdb", "status"], Some(&url));
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(
        out.contains(&format!("schema version:  {SCHEMA_VERSION}")),
        "{out}"
    );
    assert!(out.contains("machines:        0"), "{out}");
}

#[test]
fn bad_urls_fail_clearly_and_create_nothing() {
    let dir = tempfile::tempdir().unwrap();
    for (url, want) in [
        ("mysql://root@127.0.0.1/db", "invalid database URL"),
        ("sqlite:", "missing file path"),
        ("postgres://u:hunter2@127.0.0.1:notaport/db", "invalid port"),
        (
            "postgres://postgres@127.0.0.1:1/test",
            "cannot connect to database",
        ),
    ] {
        for cmd in ["migrate", "status"] {
            let o = shepherd(&["bmdb", cmd, "--database", url], None);
            let (_, err) = text(&o);
            assert!(!o.status.success(), "{url} {cmd} succeeded");
            assert!(err.contains(want), "{url} {cmd}: {err}");
            assert!(!err.contains("hunter2"), "password leaked: {err}");
        }
    }
    // Status on a missing SQLite file explains itself and does not create the file; migrate
    // into a directory that does not exist fails without creating it.
    let (absent, deep) = (
        dir.path().join("absent.db"),
        dir.path().join("no/such/dir/x.db"),
    );
    for (cmd, file, want) in [
        ("status", &absent, "does not exist"),
        ("migrate", &deep, "cannot connect"),
    ] {
        let url = format!("sqlite:{}", file.display());
        let o = shepherd(&["bmdb", cmd, "--database", &url], None);
        assert!(!o.status.success());
        assert!(text(&o).1.contains(want), "{cmd}: {:?}", text(&o));
    }
    assert!(!absent.exists());
    assert!(!dir.path().join("no").exists());
}

/// Marks the schema as written by a future binary, then checks both commands refuse it and
/// change nothing.
async fn newer_schema_is_refused(url: &str) {
    let o = shepherd(&["bmdb", "migrate", "--database", url], None);
    assert!(o.status.success(), "{:?}", text(&o));
    run_sql(
        url,
        "INSERT INTO bmdb_schema_migrations (version, name, applied_at) VALUES (99, 'future', 0)",
    )
    .await;
    let before = dump(url).await;
    for cmd in ["migrate", "status"] {
        let o = shepherd(&["bmdb", cmd, "--database", url], None);
        let (_, err) = text(&o);
        assert!(!o.status.success(), "{cmd} accepted a newer schema");
        assert!(
            err.contains(&format!(
                "schema version 99 admits binaries of schema 99 or later, and this binary is schema {SCHEMA_VERSION}"
            )),
            "{cmd}: {err}"
        );
    }
    assert_eq!(dump(url).await, before, "a refused command wrote something");
}

async fn run_sql(url: &str, sql: &str) {
    if url.starts_with("sqlite:") {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        sqlx::query(sql).execute(&pool).await.unwrap();
        pool.close().await;
    } else {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        sqlx::query(&sql.replace(", 0)", ", now())"))
            .execute(&pool)
            .await
            .unwrap();
        pool.close().await;
    }
}

/// The migration rows and the list of tables: what a migration would change.
async fn dump(url: &str) -> (Vec<i64>, Vec<String>) {
    if url.starts_with("sqlite:") {
        let pool = sqlx::SqlitePool::connect(url).await.unwrap();
        let v = sqlx::query_scalar("SELECT version FROM bmdb_schema_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
        let t =
            sqlx::query_scalar("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")
                .fetch_all(&pool)
                .await
                .unwrap();
        pool.close().await;
        (v, t)
    } else {
        let pool = sqlx::PgPool::connect(url).await.unwrap();
        let v = sqlx::query_scalar("SELECT version FROM bmdb_schema_migrations ORDER BY version")
            .fetch_all(&pool)
            .await
            .unwrap();
        let t = sqlx::query_scalar(
            "SELECT tablename::text FROM pg_tables WHERE schemaname = 'public' ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .unwrap();
        pool.close().await;
        (v, t)
    }
}

shepherd_bmdb::url_conformance_tests!(newer_schema_is_refused);

#[tokio::test]
async fn status_reports_counts_on_postgres() {
    let Some(t) = testing::postgres().await else {
        return;
    };
    t.db.transact(|tx| Box::pin(async move { tx.create_machine().await }))
        .await
        .unwrap();
    let o = shepherd(&["bmdb", "status", "--database", &t.url], None);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{err}");
    assert!(out.contains("machines:        1"), "{out}");
    assert!(
        out.starts_with(
            "database:        postgres://postgres@127.0.0.1:5432/st_it_bmdb_cli__status_reports"
        ),
        "{out}"
    );
    t.cleanup().await;
}

/// `bmdb check` says ok on a healthy database (one with sessions, work and history, which
/// Debian 12's sqlite3 3.40 misreports), and names what is wrong otherwise, exiting non-zero.
#[tokio::test]
async fn check_reports_ok_then_a_broken_foreign_key() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("s.db").display());
    assert!(shepherd(&["bmdb", "migrate", "--database", &url], None)
        .status
        .success());
    {
        let db = shepherd_bmdb::Bmdb::open(&url).await.unwrap();
        let seeded = testing::seed_every_state(&db).await;
        seeded.1.close().await.unwrap();
        db.close().await;
    }
    let o = shepherd(&["bmdb", "check", "--database", &url], None);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}{err}");
    assert!(
        out.contains(&format!(": ok (schema version {SCHEMA_VERSION})")),
        "{out}"
    );

    // A tag row whose machine is gone, written with foreign keys off.
    let mut conn = <sqlx::SqliteConnection as sqlx::Connection>::connect(&format!("{url}?mode=rw"))
        .await
        .unwrap();
    sqlx::query("PRAGMA foreign_keys = OFF")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("DELETE FROM machines WHERE machine_id IN (SELECT machine_id FROM machine_provided LIMIT 1)")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::Connection::close(conn).await.unwrap();
    let o = shepherd(&["bmdb", "check", "--database", &url], None);
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(
        out.contains("a machine_provided row refers to a missing machines row"),
        "{out}"
    );
    assert!(err.contains("problem(s) found"), "{err}");
}
