//! Test support shared by every crate's tests: fresh SQLite and Postgres databases, and a
//! macro that runs one test body against both backends.
//!
//! Postgres comes from `SHEPHERD_TEST_POSTGRES` (default `postgres://postgres@127.0.0.1/test`);
//! each test gets its own database, named after the test, so tests run in parallel and a failed
//! test's database can be found and inspected. If Postgres is unreachable the Postgres variant
//! fails, naming the fix; only with `SHEPHERD_ALLOW_SKIP=1` does it print a skip notice and
//! pass instead (`SHEPHERD_REQUIRE_POSTGRES=1`, which CI sets, overrides that). A pass that
//! silently tested one backend must be asked for.

mod blackhole;
mod small_disk;

pub use blackhole::Blackhole;
pub use small_disk::SmallDisk;

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::ConnectOptions;

use crate::{Bmdb, OpenOptions};

/// Admin URL of the Postgres used by tests.
pub fn postgres_admin_url() -> String {
    std::env::var("SHEPHERD_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1/test".into())
}

/// Whether Postgres tests must run rather than skip: unless skipping was asked for
/// (`SHEPHERD_ALLOW_SKIP`), and always when `SHEPHERD_REQUIRE_POSTGRES` says so.
pub fn postgres_required() -> bool {
    let set = |name: &str| std::env::var(name).is_ok_and(|v| is_truthy(&v));
    set("SHEPHERD_REQUIRE_POSTGRES") || !set("SHEPHERD_ALLOW_SKIP")
}

/// Whether an environment value means yes: `1`, `true`, `yes` or `on`, in any case.
pub fn is_truthy(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// A fresh, migrated database for one test.
pub struct TestDb {
    /// The opened database.
    pub db: Bmdb,
    /// Its URL, for handing to a CLI or another process.
    pub url: String,
    dropper: Option<(String, String)>,
    _dir: Option<tempfile::TempDir>,
}

impl TestDb {
    /// Closes the pool and removes the database (Postgres) or file (SQLite).
    pub async fn cleanup(self) {
        self.db.close().await;
        if let Some((admin, name)) = &self.dropper {
            if let Ok(pool) = PgPoolOptions::new().max_connections(1).connect(admin).await {
                let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
                    .execute(&pool)
                    .await;
                pool.close().await;
            }
        }
    }
}

/// A fresh SQLite database in a temporary directory.
pub async fn sqlite() -> TestDb {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let db = Bmdb::open_with(&url, &OpenOptions::migrating(true))
        .await
        .expect("open sqlite test database");
    TestDb {
        db,
        url,
        dropper: None,
        _dir: Some(dir),
    }
}

/// A fresh Postgres database, or `None` (after printing a notice) if Postgres is unreachable
/// and not required.
pub async fn postgres() -> Option<TestDb> {
    let url = fresh_postgres_database().await?;
    let db = Bmdb::open_with(
        &url,
        &OpenOptions {
            migrate: true,
            ..Default::default()
        },
    )
    .await
    .expect("open postgres test database");
    let name = url.rsplit('/').next().unwrap().to_string();
    Some(TestDb {
        db,
        url,
        dropper: Some((postgres_admin_url(), name)),
        _dir: None,
    })
}

/// Creates an empty Postgres database for the running test and returns its URL (not
/// migrated). Like `#[sqlx::test]`, the database is named after the test (see
/// [`test_database_prefix`]) and its name is printed, which the harness shows only when the
/// test fails; a passing test drops it in [`TestDb::cleanup`], a failing one leaves it to be
/// inspected, and the next run of the same test drops it first.
pub async fn fresh_postgres_database() -> Option<String> {
    fresh_postgres_databases::<1>().await.map(|[url]| url)
}

/// [`fresh_postgres_database`] for a test that needs `N` databases (the BMDB and a
/// service's own, such as Ironic's): all are made at once, because making one drops the
/// test's others that nobody is connected to yet, as leftovers of an earlier run.
pub async fn fresh_postgres_databases<const N: usize>() -> Option<[String; N]> {
    let admin = postgres_admin_url();
    let pool = match PgPoolOptions::new()
        .max_connections(1)
        .acquire_timeout(Duration::from_secs(5))
        .connect(&admin)
        .await
    {
        Ok(p) => p,
        Err(e) => {
            if postgres_required() {
                panic!("Postgres is unreachable at {admin}: {e}; start it (scripts/test-deps.sh), point SHEPHERD_TEST_POSTGRES at one, or set SHEPHERD_ALLOW_SKIP=1 to skip the Postgres variants");
            }
            eprintln!("SKIP: Postgres unreachable at {admin} ({e}); set SHEPHERD_TEST_POSTGRES or start Postgres");
            return None;
        }
    };
    let prefix = test_database_prefix();
    drop_leftovers(&pool, &prefix).await;
    let mut urls = Vec::with_capacity(N);
    for _ in 0..N {
        let name = format!(
            "{prefix}_{}",
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        );
        create_database(&pool, &name).await;
        eprintln!("test database: {name} (kept if the test fails)");
        let opts = PgConnectOptions::from_str(&admin)
            .expect("admin URL")
            .database(&name);
        urls.push(opts.to_url_lossy().to_string());
    }
    pool.close().await;
    Some(urls.try_into().expect("N urls"))
}

/// Creates database `name`, trying again a few times: concurrent `CREATE DATABASE`s copying
/// the same template can fail with "source database is being accessed by other users".
async fn create_database(pool: &sqlx::PgPool, name: &str) {
    let mut last_err = None;
    for _ in 0..5 {
        match sqlx::query(&format!("CREATE DATABASE \"{name}\""))
            .execute(pool)
            .await
        {
            Ok(_) => {
                last_err = None;
                break;
            }
            Err(e) => {
                last_err = Some(e);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    if let Some(e) = last_err {
        panic!("cannot create test database {name}: {e}");
    }
}

/// `st_` + the test binary + the test's name (libtest names each test's thread after it),
/// reduced to `[a-z0-9_]` and cut so that a unique suffix still fits Postgres' 63 bytes.
fn test_database_prefix() -> String {
    let binary = std::env::current_exe()
        .ok()
        .and_then(|p| p.file_stem().map(|s| s.to_string_lossy().into_owned()))
        .map(|stem| match stem.rsplit_once('-') {
            Some((name, _hash)) => name.to_string(),
            None => stem,
        })
        .unwrap_or_default();
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed")
        .to_string();
    let raw = format!("st_{binary}_{test}");
    let mut name: String = raw
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '_',
        })
        .collect();
    name.truncate(54);
    name
}

/// Drops the databases an earlier run of the same test left behind (it failed), skipping any
/// that someone is connected to: a concurrent run of the same test.
async fn drop_leftovers(pool: &sqlx::PgPool, prefix: &str) {
    let pattern = format!("{prefix}_");
    let leftovers: Vec<(String,)> = sqlx::query_as(
        "SELECT datname FROM pg_database d
          WHERE left(datname, length($1)) = $1 AND length(datname) = length($1) + 8
            AND NOT EXISTS (SELECT 1 FROM pg_stat_activity a WHERE a.datname = d.datname)",
    )
    .bind(&pattern)
    .fetch_all(pool)
    .await
    .unwrap_or_default();
    for (name,) in leftovers {
        let _ = sqlx::query(&format!("DROP DATABASE IF EXISTS \"{name}\""))
            .execute(pool)
            .await;
    }
}

/// Defines, for each named `async fn NAME(db: Bmdb)`, a module `NAME` with two tests,
/// `sqlite` and `postgres`, running the body against a fresh database of each backend.
///
/// Kept as a macro on purpose: a test must be a function item the test harness finds, and
/// this is the one way to make two of them per body without writing both out for every test;
/// the body itself is a plain function a debugger steps into.
#[macro_export]
macro_rules! conformance_tests {
    ($($name:ident),+ $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn sqlite() {
                    let t = $crate::testing::sqlite().await;
                    super::$name(t.db.clone()).await;
                    t.cleanup().await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn postgres() {
                    let Some(t) = $crate::testing::postgres().await else { return };
                    super::$name(t.db.clone()).await;
                    t.cleanup().await;
                }
            }
        )+
    };
}

/// A SQLite URL in a fresh temporary directory; the file does not exist yet, so the process
/// under test creates it (`--migrate`). The directory goes when this is dropped.
pub struct FreshSqliteUrl {
    /// The URL.
    pub url: String,
    _dir: tempfile::TempDir,
}

/// See [`FreshSqliteUrl`].
pub fn fresh_sqlite_url() -> FreshSqliteUrl {
    let dir = tempfile::tempdir().expect("temp dir");
    FreshSqliteUrl {
        url: format!("sqlite:{}", dir.path().join("bmdb.sqlite").display()),
        _dir: dir,
    }
}

/// Like [`conformance_tests!`] for tests of whole processes, which take a database URL: each
/// `async fn NAME(url: &str)` runs once on a fresh SQLite URL ([`fresh_sqlite_url`]) and once
/// on a fresh Postgres database ([`fresh_postgres_database`]).
#[macro_export]
macro_rules! url_conformance_tests {
    ($($name:ident),+ $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    let fresh = $crate::testing::fresh_sqlite_url();
                    super::$name(&fresh.url).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    let Some(url) = $crate::testing::fresh_postgres_database().await else {
                        return;
                    };
                    super::$name(&url).await;
                }
            }
        )+
    };
}

/// One seeded machine of [`seed_every_state`].
#[derive(Debug, Clone)]
pub struct SeededMachine {
    /// The machine.
    pub id: uuid::Uuid,
    /// The lifecycle state its tags put it in.
    pub state: crate::Lifecycle,
    /// Its provider id, if provided.
    pub provider_id: Option<String>,
}

/// Seeds one machine per lifecycle state (the in-work one held by the returned session, which
/// must stay open for it to stay in work); machines are provided by Sim (`box-0`) and Static
/// (`box-1`…), with addresses `10.0.0.N` in `rack-1`; the backoff's cause is
/// `"ssh: connection refused"`.
pub async fn seed_every_state(db: &Bmdb) -> (Vec<SeededMachine>, crate::Session) {
    use crate::*;
    use chrono::{Duration as Delta, Utc};
    let session = self::session(db, Processor::ShepherdInitializer).await;
    let sid = session.id();
    let seeded = db
        .transact(move |tx| {
            Box::pin(async move {
                let mut out = Vec::new();
                let provided = async |tx: &mut Tx, n: usize| -> Result<uuid::Uuid, Error> {
                    let id = tx.create_machine().await?;
                    tx.set_provided(
                        id,
                        &Provided {
                            provider: if n == 0 {
                                ProviderKind::Sim
                            } else {
                                ProviderKind::Static
                            },
                            provider_id: format!("box-{n}"),
                            reservation_id: None,
                            ip_address: Some(format!("10.0.0.{n}")),
                            location: Some("rack-1".into()),
                            status: Some(ProviderStatus::Running),
                            facts: ProviderFacts::default(),
                        },
                    )
                    .await?;
                    Ok(id)
                };
                let mut push = |id, state, n: Option<usize>| {
                    out.push(SeededMachine {
                        id,
                        state,
                        provider_id: n.map(|n| format!("box-{n}")),
                    })
                };
                push(tx.create_machine().await?, Lifecycle::Unprovided, None);
                push(provided(tx, 0).await?, Lifecycle::Provided, Some(0));
                let id = provided(tx, 1).await?;
                tx.set_agent_started(id, &[1; 32]).await?;
                push(id, Lifecycle::AgentStarting, Some(1));
                let id = provided(tx, 2).await?;
                tx.set_agent_started(id, &[2; 32]).await?;
                tx.set_heartbeat(id).await?;
                push(id, Lifecycle::Heartbeating, Some(2));
                let id = provided(tx, 3).await?;
                tx.set_agent_started(id, &[3; 32]).await?;
                tx.set_heartbeat_at(id, Utc::now() - Delta::minutes(11))
                    .await?;
                push(id, Lifecycle::Stale, Some(3));
                let id = provided(tx, 4).await?;
                tx.set_backoff(
                    id,
                    Process::ShepherdAgentStart,
                    Utc::now() + Delta::minutes(5),
                    300,
                    "ssh: connection refused",
                )
                .await?;
                push(id, Lifecycle::InBackoff, Some(4));
                let id = provided(tx, 5).await?;
                tx.insert_work_raw(id, sid, Process::ShepherdAgentStart)
                    .await?;
                push(id, Lifecycle::InWork, Some(5));
                for (n, generation, report, state) in [
                    (6, 2, None, Lifecycle::Installing),
                    (7, 3, Some(3), Lifecycle::Installed),
                ] {
                    let id = provided(tx, n).await?;
                    tx.set_agent_started(id, &[n as u8; 32]).await?;
                    tx.set_heartbeat(id).await?;
                    record_installation(tx, id, Some(generation), report).await?;
                    push(id, state, Some(n));
                }
                Ok(out)
            })
        })
        .await
        .expect("seed");
    (seeded, session)
}

/// Every claim statement variant the loops run, named, as the claims run them: Postgres' three
/// searches and SQLite's two candidate queries, for the initializer's start rule and the
/// recoverer's recovery rule on `provider`. For the snapshot test of the statements' text.
pub fn claim_statements(provider: crate::ProviderKind) -> Vec<(String, String)> {
    crate::sql::claims::claim_statement_variants(&loop_rules(provider))
        .into_iter()
        .map(|(name, _, _, _, sql)| (name, sql))
        .collect()
}

fn loop_rules(
    provider: crate::ProviderKind,
) -> [(&'static str, crate::Process, crate::Retrieval); 3] {
    [
        (
            "start",
            crate::Process::ShepherdAgentStart,
            crate::Retrieval::AgentStart { provider },
        ),
        (
            "recovery",
            crate::Process::ShepherdRecovery,
            crate::Retrieval::AgentRecovery {
                provider,
                thresholds: crate::RecoveryThresholds::default(),
            },
        ),
        (
            "bare metal",
            crate::Process::ShepherdBareMetal,
            crate::Retrieval::BareMetal {
                provider,
                timeouts: crate::BareTimeouts::default(),
            },
        ),
    ]
}

/// The executed Postgres query plan (`EXPLAIN ANALYZE`, one line a row, the claim rolled
/// back) of each Postgres claim statement variant of [`claim_statements`], named, with
/// parameters bound as a claim of `session` binds them. For the test that claims use the
/// indexes.
pub async fn explain_claims(
    db: &Bmdb,
    session: uuid::Uuid,
    provider: crate::ProviderKind,
) -> Result<Vec<(String, Vec<String>)>, crate::Error> {
    let crate::db::Pools::Postgres(pool) = &db.inner.pools else {
        return Err(crate::Error::InvalidArgument {
            what: "database",
            problem: "query plans are Postgres only".into(),
        });
    };
    let mut conn = db.autocommit(pool).await?;
    let mut plans = Vec::new();
    for (name, _, retrieval, search, sql) in
        crate::sql::claims::claim_statement_variants(&loop_rules(provider))
    {
        if name.starts_with("postgres") {
            let plan = conn
                .explain_claim(session, &retrieval, &search, &sql)
                .await?;
            plans.push((name, plan));
        }
    }
    Ok(plans)
}

/// A session of `processor`, named after it (`shepherd-initializer`, …), for tests that drive
/// a loop or the BMDB by hand.
pub async fn session(db: &Bmdb, processor: crate::Processor) -> crate::Session {
    db.start_session(crate::SessionConfig::new(processor.label(), processor))
        .await
        .expect("start a test session")
}

/// What `PRAGMA integrity_check` (SQLite) or its Postgres counterpart finds wrong with the
/// database; empty when it is whole.
pub async fn integrity_problems(db: &Bmdb) -> Vec<String> {
    db.read(|tx| Box::pin(async move { tx.integrity_problems().await }))
        .await
        .expect("read the integrity check")
}

/// The work of a claim that must have claimed a machine; any other answer fails the test.
pub fn held(claim: crate::Claim) -> crate::Work {
    match claim {
        crate::Claim::Work(w) => w,
        other => panic!("expected work, got {other:?}"),
    }
}

/// Like [`session`], kept alive every `interval`: a short one lets a test see the session
/// expire, a long one keeps its keep-alives out of the way.
pub async fn session_every(
    db: &Bmdb,
    processor: crate::Processor,
    interval: std::time::Duration,
) -> crate::Session {
    let config = crate::SessionConfig::new(processor.label(), processor).with_interval(interval);
    db.start_session(config)
        .await
        .expect("start a test session")
}

/// Polls `f` every 50 ms until it returns `Ok` and returns that value, failing the test when
/// `within` passes first with a message naming `what` and the last `Err` (the state it was
/// stuck in). Tests that wait for the system to get somewhere wait through this, so no wait is
/// unbounded and every timeout says where things stood.
pub async fn eventually<T, D: std::fmt::Debug>(
    what: &str,
    within: Duration,
    f: impl AsyncFnMut() -> Result<T, D>,
) -> T {
    eventually_every(what, within, Duration::from_millis(50), f).await
}

/// [`eventually`], polling every `every`: for polls that cost more (a process per poll).
pub async fn eventually_every<T, D: std::fmt::Debug>(
    what: &str,
    within: Duration,
    every: Duration,
    mut f: impl AsyncFnMut() -> Result<T, D>,
) -> T {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return v,
            Err(state) => assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {within:?} waiting for {what}; last seen: {state:?}"
            ),
        }
        tokio::time::sleep(every).await;
    }
}

/// What an [`eventually`] poll returns: `Ok(state)` once `done`, else `Err(state)`.
pub fn when<T>(done: bool, state: T) -> Result<T, T> {
    if done {
        Ok(state)
    } else {
        Err(state)
    }
}

/// Stores `raw` (a serialized `OSInstallationRequest`) as machine `m`'s installation request
/// of `generation`, as `shepherd machines install` does.
pub async fn request_installation(db: &Bmdb, m: uuid::Uuid, generation: i64, raw: Vec<u8>) {
    let request = crate::OsInstallationRequest {
        generation,
        request_raw: raw,
    };
    db.transact(move |tx| {
        let request = request.clone();
        Box::pin(async move { tx.set_os_installation_request(m, &request).await })
    })
    .await
    .expect("store the installation request");
}

/// Records an empty installation request of generation `request` and a successful report of
/// generation `report` for machine `id`, each only if given.
pub async fn record_installation(
    tx: &mut crate::Tx,
    id: uuid::Uuid,
    request: Option<i64>,
    report: Option<i64>,
) -> Result<(), crate::Error> {
    if let Some(generation) = request {
        let request = crate::OsInstallationRequest {
            generation,
            request_raw: vec![],
        };
        tx.set_os_installation_request(id, &request).await?;
    }
    if let Some(generation) = report {
        let report = crate::OsInstallationReport {
            generation,
            result: crate::InstallationResult::Success,
            report_raw: vec![],
        };
        tx.set_os_installation_report(id, &report).await?;
    }
    Ok(())
}

/// Machine `m`'s stored installation report, if any.
pub async fn installation_report(db: &Bmdb, m: uuid::Uuid) -> Option<crate::OsInstallationReport> {
    db.read(move |tx| Box::pin(async move { tx.os_installation_report(m).await }))
        .await
        .expect("read the installation report")
}

/// Every work history entry, oldest first, each seen through `view`.
pub async fn history_as<T>(db: &Bmdb, view: impl Fn(&crate::HistoryEntry) -> T) -> Vec<T> {
    all_history(db).await.iter().map(view).collect()
}

/// Every work history entry, oldest first, read page by page.
pub async fn all_history(db: &Bmdb) -> Vec<crate::HistoryEntry> {
    let mut entries = Vec::new();
    loop {
        let after = entries.last().map_or(0, |e: &crate::HistoryEntry| e.id);
        let page = db
            .read(move |tx| Box::pin(async move { tx.history_after(after, 5000).await }))
            .await
            .expect("read the work history");
        if page.is_empty() {
            return entries;
        }
        entries.extend(page);
    }
}

/// A new machine whose agent was started with public key `key` (the `agent_started` tag an
/// initializer leaves), so agents holding that key may heartbeat for it.
pub async fn machine_with_agent(db: &Bmdb, key: &[u8]) -> uuid::Uuid {
    let key = key.to_vec();
    db.transact(move |tx| {
        let key = key.clone();
        Box::pin(async move {
            let id = tx.create_machine().await?;
            tx.set_agent_started(id, &key).await?;
            Ok(id)
        })
    })
    .await
    .expect("create a machine with an agent")
}

/// Records for each of `machines` an agent start two hours ago (each with a key of its own)
/// and no heartbeat since: every one is due for recovery at the default thresholds.
pub async fn agents_silent_for_hours(db: &Bmdb, machines: &[uuid::Uuid]) {
    let machines = machines.to_vec();
    db.transact(move |tx| {
        let machines = machines.clone();
        Box::pin(async move {
            let long_ago = tx.now().await? - chrono::Duration::hours(2);
            for (n, id) in machines.into_iter().enumerate() {
                tx.set_agent_started_at(id, Some(long_ago), &[n as u8 + 1; 32])
                    .await?;
            }
            Ok(())
        })
    })
    .await
    .expect("record silent agents")
}

/// Creates `n` machines provided by `provider` in one transaction, each with its machine id
/// (simple form) as provider id; returns their ids.
pub async fn provision(db: &Bmdb, n: usize, provider: crate::ProviderKind) -> Vec<uuid::Uuid> {
    db.transact(move |tx| {
        Box::pin(async move {
            let mut ids = Vec::with_capacity(n);
            for _ in 0..n {
                let id = tx.create_machine().await?;
                tx.set_provided(id, &crate::Provided::new(provider, id.simple().to_string()))
                    .await?;
                ids.push(id);
            }
            Ok(ids)
        })
    })
    .await
    .expect("provision machines")
}

/// What the BMDB records as provided by `provider`: (machine, provided tag), by provider id.
pub async fn provided_by(
    db: &Bmdb,
    provider: crate::ProviderKind,
) -> Vec<(uuid::Uuid, crate::Provided)> {
    db.read(move |tx| Box::pin(async move { tx.provided_by(provider).await }))
        .await
        .expect("read the provided machines")
}

/// Makes the next pooled Postgres connection's session read-only, as a connection that reached
/// a node which became a standby in a failover: every write on it fails with SQLSTATE 25006
/// while reads still work. Panics on SQLite.
pub async fn make_a_pooled_connection_read_only(db: &Bmdb) {
    db.transact(|tx| Box::pin(async move { tx.make_connection_read_only().await }))
        .await
        .unwrap();
}

#[cfg(test)]
mod tests {
    #[test]
    fn yes_is_said_many_ways_and_anything_else_is_no() {
        for yes in ["1", "true", "TRUE", " yes ", "On"] {
            assert!(super::is_truthy(yes), "{yes:?}");
        }
        for no in ["", "0", "false", "no", "off", "2", "y"] {
            assert!(!super::is_truthy(no), "{no:?}");
        }
    }
}
