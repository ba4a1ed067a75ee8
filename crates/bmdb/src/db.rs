//! [`Bmdb`]: a connection pool to one BMDB, its schema, and BEGIN (transactions themselves run
//! through `transaction.rs`).

use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use sqlx::postgres::{PgPool, PgPoolOptions};
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};
use sqlx::{ConnectOptions, Connection};
use uuid::Uuid;

use crate::batch_reports::{BatchReporter, HeartbeatBatchReports};
use crate::batches::{ClaimBatches, EndingBatches, MAX_CLAIM_BATCH, MAX_ENDING_BATCH};
use crate::claim_hints::ClaimHints;
use crate::disk_full::DiskFullWarning;
use crate::failover::FailoverMark;
use crate::metrics::BmdbMetrics;
use crate::migrations::{Migration, SchemaWindow, MIGRATIONS, SCHEMA_VERSION};
use crate::model::{Processor, WriterReport};
use crate::sql::engine::{Autocommit, Conn, Sql, SqliteTx, SqliteTxConn, Tx};
use crate::url::DatabaseUrl;
use crate::writer_turns::{Urgency, WriterTurns};
use crate::Error;

/// Settings for opening a BMDB.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Create the SQLite file if it does not exist (only `bmdb migrate` and demos want this).
    pub create: bool,
    /// Apply pending migrations on open.
    pub migrate: bool,
    /// Maximum Postgres connections in the pool.
    pub max_connections: u32,
    /// How long to wait for a connection (also bounds connecting to an unreachable server).
    pub connect_timeout: Duration,
    /// SQLite busy timeout: how long to wait for another process's write lock.
    pub busy_timeout: Duration,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            create: false,
            migrate: false,
            max_connections: 32,
            connect_timeout: Duration::from_secs(10),
            busy_timeout: Duration::from_secs(10),
        }
    }
}

impl OpenOptions {
    /// The defaults, creating (SQLite) and migrating the database when `migrate` is set: what
    /// `--migrate`, the demo and tests ask for.
    pub fn migrating(migrate: bool) -> OpenOptions {
        OpenOptions {
            create: migrate,
            migrate,
            ..OpenOptions::default()
        }
    }
}

/// Which database engine backs a [`Bmdb`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendKind {
    /// Embedded SQLite file.
    Sqlite,
    /// PostgreSQL server.
    Postgres,
}

pub(crate) enum Pools {
    /// One writer connection (all read-then-write transactions) and a small pool of readers.
    Sqlite {
        writer: SqlitePool,
        reader: SqlitePool,
    },
    Postgres(PgPool),
}

pub(crate) struct Inner {
    pub(crate) pools: Pools,
    pub(crate) metrics: BmdbMetrics,
    /// Leftover claim candidates, shared by every session of this handle.
    pub(crate) claim_hints: ClaimHints,
    /// Concurrent claims gathered into shared statements.
    pub(crate) claims: ClaimBatches,
    /// Concurrent work endings gathered into shared transactions.
    pub(crate) endings: EndingBatches,
    /// What the transaction runner remembers of the errors it saw.
    pub(crate) seen: SeenErrors,
    /// Where the sessions' heartbeat batches are reported, if anywhere.
    pub(crate) heartbeat_reports: BatchReporter,
    /// Turns at SQLite's one writer, most urgent first (unused on Postgres).
    writer_turns: Arc<WriterTurns>,
    /// How long a SQLite write waits for its turn before the database counts as unavailable.
    writer_wait: Duration,
    target: String,
    /// The last diagnosis of an unreachable database, and when it was made.
    diagnosis: tokio::sync::Mutex<Option<(std::time::Instant, String)>>,
    /// When this handle's last background garbage collection started, and whether it is
    /// still under way (one at a time, at most one per session interval).
    collecting: std::sync::Mutex<(Option<std::time::Instant>, bool)>,
}

/// What the transaction runner (`transaction.rs`) remembers of the errors it saw, per handle.
#[derive(Debug, Default)]
pub(crate) struct SeenErrors {
    /// When a failover error was last seen; Postgres connections opened before are dropped.
    pub(crate) failover: Arc<FailoverMark>,
    /// When a full disk was last told.
    pub(crate) disk_full: DiskFullWarning,
    /// When a transaction last failed because the database could not be reached or written.
    pub(crate) outage: std::sync::Mutex<Option<std::time::Instant>>,
}

impl SeenErrors {
    /// Remembers what `e`, a failed transaction's error, says about the database.
    pub(crate) fn saw(&self, e: &Error) {
        if e.is_failover() {
            // The connection may lead to a standby: no one is handed it again.
            self.failover.seen();
        }
        if e.is_outage() {
            *self.outage.lock().unwrap() = Some(std::time::Instant::now());
        }
        self.disk_full.saw(e);
    }
}

/// How long one diagnosis of an unreachable database is reused: an outage makes every waiting
/// caller time out at once, and one probe connection per second is enough to name the cause.
const DIAGNOSIS_TTL: Duration = Duration::from_secs(1);

/// What every Postgres connection of a BMDB sets, so that no replica can stall the others
/// (see ARCHITECTURE.md, "Leases"):
/// - `idle_in_transaction_session_timeout`: a transaction whose client stopped talking (a
///   process paused, or cut off by a silent partition) is ended by the server, and the row
///   locks it held (a session row its keep-alive updated, work rows) are released. BMDB
///   transactions never wait on anything but the database between statements;
/// - `statement_timeout`: no statement runs unbounded (migrations lift it, `schema.rs`);
/// - `tcp_keepalives_*` and `tcp_user_timeout`: the server notices a peer that is gone within
///   about ten seconds, instead of TCP's two hours.
pub(crate) const SESSION_LIMITS: [(&str, &str); 6] = [
    ("idle_in_transaction_session_timeout", "3s"),
    ("statement_timeout", "60s"),
    ("tcp_keepalives_idle", "5"),
    ("tcp_keepalives_interval", "2"),
    ("tcp_keepalives_count", "3"),
    ("tcp_user_timeout", "10000"),
];

/// `pg` with [`SESSION_LIMITS`] set at connection start.
fn with_session_limits(pg: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
    pg.options(SESSION_LIMITS)
}

/// The longest a background garbage collection may take; the next keep-alive that asks for
/// one starts it again.
const GC_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a diagnostic connection attempt may take.
const DIAGNOSIS_TIMEOUT: Duration = Duration::from_secs(3);

impl Inner {
    async fn begin_now(&self, mode: Mode) -> Result<Tx, Error> {
        let inner = match (&self.pools, mode) {
            (Pools::Sqlite { reader, .. }, Mode::Read) => {
                let explain = |e| self.explain_sqlite(e, "a SQLite reader");
                let conn = reader.acquire().await.map_err(explain)?;
                let tx = SqliteTxConn::begin(conn, "BEGIN").await.map_err(explain)?;
                Conn::Sqlite(SqliteTx {
                    tx,
                    now: Utc::now().timestamp_micros(),
                    _turn: None,
                })
            }
            (Pools::Sqlite { writer, .. }, mode) => {
                let asked = std::time::Instant::now();
                let explain = |e| self.explain_sqlite(e, "the SQLite writer");
                let turn =
                    tokio::time::timeout(self.writer_wait, self.writer_turns.take(mode.urgency()))
                        .await
                        .map_err(|_| explain(sqlx::Error::PoolTimedOut))?;
                let conn = writer.acquire().await.map_err(explain)?;
                let tx = SqliteTxConn::begin(conn, "BEGIN IMMEDIATE")
                    .await
                    .map_err(explain)?;
                self.metrics.writer_waited(asked.elapsed());
                Conn::Sqlite(SqliteTx {
                    tx,
                    now: Utc::now().timestamp_micros(),
                    _turn: Some(turn),
                })
            }
            (Pools::Postgres(pool), mode) => {
                let begun = match mode {
                    Mode::Batch => {
                        pool.begin_with("BEGIN; SET LOCAL plan_cache_mode = force_generic_plan")
                            .await
                    }
                    Mode::Write | Mode::Read | Mode::Facts | Mode::Lease => pool.begin().await,
                };
                match begun {
                    Ok(tx) => Conn::Postgres(tx),
                    Err(e) => return Err(self.explain(e).await),
                }
            }
        };
        Ok(Tx::new(inner))
    }

    fn explain_sqlite(&self, e: sqlx::Error, what: &str) -> Error {
        match e {
            sqlx::Error::PoolTimedOut => Error::Unavailable {
                target: self.target.clone(),
                cause: format!("timed out waiting for {what} (another transaction held it)"),
            },
            e => Error::Database(crate::error::DriverError(e)),
        }
    }

    /// Turns the pool's bare "timed out" into its cause: the pool retries failed connections
    /// until its timeout and then forgets why they failed, so one direct connection attempt
    /// (at most one per [`DIAGNOSIS_TTL`], shared by every caller) asks the server again.
    pub(crate) async fn explain(&self, e: sqlx::Error) -> Error {
        let Pools::Postgres(pool) = &self.pools else {
            return self.explain_sqlite(e, "the SQLite pool");
        };
        if !matches!(e, sqlx::Error::PoolTimedOut) {
            return Error::Database(crate::error::DriverError(e));
        }
        let mut cached = self.diagnosis.lock().await;
        let cause = match cached.as_ref() {
            Some((at, cause)) if at.elapsed() < DIAGNOSIS_TTL => cause.clone(),
            _ => {
                let options = pool.connect_options();
                let cause = match tokio::time::timeout(DIAGNOSIS_TIMEOUT, options.connect()).await {
                    Err(_) => format!("connecting timed out after {DIAGNOSIS_TIMEOUT:?}"),
                    Ok(Err(e)) => e.to_string(),
                    Ok(Ok(conn)) => {
                        let _ = conn.close().await;
                        "every pooled connection stayed busy".to_string()
                    }
                };
                *cached = Some((std::time::Instant::now(), cause.clone()));
                cause
            }
        };
        Error::Unavailable {
            target: self.target.clone(),
            cause,
        }
    }
}

/// A handle to one BMDB. Cheap to clone; all clones share the pool and metrics.
#[derive(Clone)]
pub struct Bmdb {
    pub(crate) inner: Arc<Inner>,
}

/// Whether a transaction may write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Write,
    Read,
    /// A write transaction of a batch (`ending_batch.rs`). On Postgres its statements use their
    /// generic plan: a statement over arrays of the batch's members would otherwise be planned
    /// again for every batch (its custom plan, fitted to the arrays' length, always looks
    /// cheaper), which costs more than running it.
    Batch,
    /// A write of what agents and servers report (heartbeats): on SQLite it goes before the
    /// loops' writes waiting for the writer (`writer_turns.rs`).
    Facts,
    /// A session's keep-alive: on SQLite it goes before every other waiting writer.
    Lease,
}

impl Mode {
    /// How soon a write in this mode gets SQLite's writer.
    fn urgency(self) -> Urgency {
        match self {
            Mode::Lease => Urgency::Lease,
            Mode::Facts => Urgency::Facts,
            Mode::Write | Mode::Batch | Mode::Read => Urgency::Work,
        }
    }
}

impl Bmdb {
    /// Opens the database at `url` with default options: it must exist and have exactly the
    /// schema this binary knows.
    pub async fn open(url: &str) -> Result<Bmdb, Error> {
        Self::open_with(url, &OpenOptions::default()).await
    }

    /// Opens the database at `url`, optionally creating and migrating it, and checks its schema.
    pub async fn open_with(url: &str, opts: &OpenOptions) -> Result<Bmdb, Error> {
        let db = Self::connect(url, opts).await?;
        if opts.migrate {
            db.migrate().await?;
        }
        db.check_schema().await?;
        Ok(db)
    }

    /// Connects without looking at the schema (for `bmdb migrate`).
    pub async fn connect(url: &str, opts: &OpenOptions) -> Result<Bmdb, Error> {
        let parsed = DatabaseUrl::parse(url)?;
        let target = parsed.display_target();
        let connect_err = |error| Error::Connect {
            target: target.clone(),
            error: crate::error::DriverError(error),
        };
        let failover = Arc::new(FailoverMark::default());
        let sqlite_path = match &parsed {
            DatabaseUrl::Sqlite(path) => Some(path.clone()),
            DatabaseUrl::Postgres(_) => None,
        };
        let pools = match parsed {
            DatabaseUrl::Sqlite(path) => {
                if !opts.create && !path.exists() {
                    return Err(Error::MissingDatabaseFile(path.display().to_string()));
                }
                let base = SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(opts.create)
                    .journal_mode(SqliteJournalMode::Wal)
                    .synchronous(SqliteSynchronous::Normal)
                    .busy_timeout(opts.busy_timeout)
                    .foreign_keys(true);
                let writer = SqlitePoolOptions::new()
                    .max_connections(1)
                    .acquire_timeout(opts.connect_timeout.max(opts.busy_timeout))
                    .connect_with(base.clone())
                    .await
                    .map_err(connect_err)?;
                let reader = SqlitePoolOptions::new()
                    .max_connections(4)
                    .acquire_timeout(opts.connect_timeout.max(opts.busy_timeout))
                    .connect_with(base)
                    .await
                    .map_err(connect_err)?;
                Pools::Sqlite { writer, reader }
            }
            DatabaseUrl::Postgres(pg) => {
                let pg = Box::new(with_session_limits(*pg));
                // One direct connection first: the pool retries refused connections until its
                // timeout and then reports only "timed out", hiding the real cause.
                let probe = tokio::time::timeout(opts.connect_timeout, pg.connect())
                    .await
                    .map_err(|_| connect_err(sqlx::Error::PoolTimedOut))?
                    .map_err(connect_err)?;
                probe.close().await.map_err(connect_err)?;
                let mark = failover.clone();
                let pool = PgPoolOptions::new()
                    .max_connections(opts.max_connections)
                    .acquire_timeout(opts.connect_timeout)
                    // A connection opened before a failover error may lead to a standby.
                    .before_acquire(move |_, meta| {
                        let fresh = !mark.predates(meta.age);
                        Box::pin(async move { Ok(fresh) })
                    })
                    .connect_with(*pg)
                    .await
                    .map_err(connect_err)?;
                Pools::Postgres(pool)
            }
        };
        Ok(Bmdb {
            inner: Arc::new(Inner {
                pools,
                metrics: BmdbMetrics::default(),
                claim_hints: ClaimHints::default(),
                claims: ClaimBatches::new(MAX_CLAIM_BATCH),
                endings: EndingBatches::new(MAX_ENDING_BATCH),
                seen: SeenErrors {
                    failover,
                    disk_full: DiskFullWarning::new(sqlite_path),
                    outage: Default::default(),
                },
                heartbeat_reports: BatchReporter::default(),
                writer_turns: Arc::default(),
                writer_wait: opts.connect_timeout.max(opts.busy_timeout),
                target,
                diagnosis: tokio::sync::Mutex::new(None),
                collecting: Default::default(),
            }),
        })
    }

    /// The engine behind this handle.
    pub fn backend(&self) -> BackendKind {
        match self.inner.pools {
            Pools::Sqlite { .. } => BackendKind::Sqlite,
            Pools::Postgres(_) => BackendKind::Postgres,
        }
    }

    /// Where this handle points, without secrets.
    pub fn target(&self) -> &str {
        &self.inner.target
    }

    /// Counters of this handle's sessions, transactions and work.
    pub fn metrics(&self) -> &BmdbMetrics {
        &self.inner.metrics
    }

    /// Reports every heartbeat batch this handle's sessions write to `reports` (the BMaaS
    /// server's task status); false if a receiver was set already, which stays.
    pub fn report_heartbeat_batches_to(&self, reports: Arc<dyn HeartbeatBatchReports>) -> bool {
        self.inner.heartbeat_reports.set(reports)
    }

    /// Records a BMaaS server's report of the heartbeats it received (`heartbeat_writers`):
    /// on SQLite it takes the writer with the keep-alives, before every other writer, since
    /// the recoverer's view of silence depends on it.
    pub async fn report_heartbeat_writer(&self, report: WriterReport) -> Result<(), Error> {
        self.run(Processor::Bmsrv, Mode::Lease, None, |tx| {
            let report = report.clone();
            Box::pin(async move { tx.report_heartbeat_writer(&report).await })
        })
        .await
    }

    /// Forgets a BMaaS server that stopped gracefully.
    pub async fn forget_heartbeat_writer(&self, writer_id: Uuid) -> Result<(), Error> {
        self.run(Processor::Bmsrv, Mode::Lease, None, |tx| {
            Box::pin(async move { tx.forget_heartbeat_writer(writer_id).await })
        })
        .await
    }

    /// The schema version stored in the database (0 if never migrated).
    pub async fn schema_version(&self) -> Result<i64, Error> {
        Ok(self.schema_window().await?.version)
    }

    /// The database's schema version and the oldest binary schema that may run on it.
    pub async fn schema_window(&self) -> Result<SchemaWindow, Error> {
        let mut tx = self.begin(Mode::Read).await?;
        let w = tx.schema_window().await?;
        tx.rollback().await?;
        Ok(w)
    }

    /// Fails unless this binary may run on the database: its schema is this binary's, or a
    /// newer one whose migrations all declared binaries of this schema compatible.
    pub async fn check_schema(&self) -> Result<(), Error> {
        self.schema_window().await?.check_this_binary()
    }

    /// Applies pending migrations in one transaction; concurrent migrators wait for each
    /// other. Returns the versions before and after. On a newer schema that still admits this
    /// binary there is nothing to do; one that does not is refused, writing nothing.
    pub async fn migrate(&self) -> Result<(i64, i64), Error> {
        self.migrate_up_to(SCHEMA_VERSION).await
    }

    /// [`Bmdb::migrate`], stopping at schema `version`: what tests use to make a database of
    /// an older schema.
    pub(crate) async fn migrate_up_to(&self, version: i64) -> Result<(i64, i64), Error> {
        let mut tx = self.begin(Mode::Write).await?;
        tx.lock_for_migration().await?;
        let found = tx.schema_window().await?;
        if found.version >= SCHEMA_VERSION {
            tx.rollback().await?;
            found.check_this_binary()?;
            return Ok((found.version, found.version));
        }
        let pending = |m: &&Migration| m.version > found.version && m.version <= version;
        for m in MIGRATIONS.iter().filter(pending) {
            let script = m.script.text(tx.engine());
            tx.apply_migration(m.version, m.name, m.oldest_compatible, script)
                .await?;
            tracing::info!(version = m.version, name = m.name, "applied BMDB migration");
        }
        tx.commit().await?;
        Ok((found.version, version.min(SCHEMA_VERSION)))
    }

    /// Test support: migrates an empty database up to schema `version` only.
    #[cfg(feature = "testing")]
    pub async fn migrate_for_test_up_to(&self, version: i64) -> Result<(), Error> {
        self.migrate_up_to(version).await.map(|_| ())
    }

    /// Test support: applies a migration this binary does not know, as a newer binary would
    /// (`oldest_compatible` says which binaries it still admits).
    #[cfg(feature = "testing")]
    pub async fn apply_foreign_migration(
        &self,
        version: i64,
        name: &str,
        oldest_compatible: i64,
        script: &str,
    ) -> Result<(), Error> {
        let mut tx = self.begin(Mode::Write).await?;
        tx.lock_for_migration().await?;
        tx.apply_migration(version, name, oldest_compatible, script)
            .await?;
        tx.commit().await
    }

    /// Begins a transaction. BEGIN runs in a task of its own, so a caller dropped half-way
    /// (shutdown, a timeout) cannot leave a connection inside a transaction nobody owns: the
    /// task finishes, and the transaction it made is dropped and rolled back. sqlx's own
    /// `begin_with` is not safe there on SQLite: cancelled after the worker ran BEGIN IMMEDIATE
    /// but before the `Transaction` exists, it returns the connection to the pool still in the
    /// transaction, and every later BEGIN on it fails.
    pub(crate) async fn begin(&self, mode: Mode) -> Result<Tx, Error> {
        let inner = self.inner.clone();
        tokio::spawn(async move { inner.begin_now(mode).await })
            .await
            .unwrap_or_else(|e| Err(Error::BeginFailed(e.to_string())))
    }

    /// A pooled Postgres connection outside any transaction, or why none could be had.
    pub(crate) async fn autocommit(&self, pool: &PgPool) -> Result<Autocommit, Error> {
        match pool.acquire().await {
            Ok(c) => Ok(Autocommit::new(c)),
            Err(e) => Err(self.inner.explain(e).await),
        }
    }

    /// Deletes expired sessions and their work (recording Canceled history); returns how
    /// many sessions were removed. Sessions run this periodically; it is safe to run anywhere.
    pub async fn collect_garbage(&self) -> Result<u64, Error> {
        self.transact(|tx| Box::pin(async move { tx.collect_garbage().await }))
            .await
    }

    /// The database's unavailability with its cause, named by one direct connection attempt
    /// (as a pool that timed out is): for a caller that gave up waiting on its own.
    pub(crate) async fn unavailable(&self) -> Error {
        match self.inner.pools {
            Pools::Postgres(_) => self.inner.explain(sqlx::Error::PoolTimedOut).await,
            // Another process's transaction (one paused or stuck while writing) holds the
            // file's write lock, or this process's writer is busy.
            Pools::Sqlite { .. } => Error::Unavailable {
                target: self.inner.target.clone(),
                cause: "the SQLite write lock was not free in time: another transaction or \
                        process holds it (a process paused or stuck while writing?)"
                    .into(),
            },
        }
    }

    /// How long ago this handle last saw the database unreachable or unwritable (an outage, a
    /// failover, a full disk), if it ever did. Facts the database could not record meanwhile
    /// (agents' heartbeats) are missing, not absent: the recoverer waits a whole silence
    /// threshold after an outage before it believes a silence.
    pub fn since_last_outage(&self) -> Option<Duration> {
        let last = *self.inner.seen.outage.lock().unwrap();
        last.map(|at| at.elapsed())
    }

    /// Starts a garbage collection in a task of its own unless one of this handle's is under
    /// way or started less than `every` ago: sessions' keep-alives ask for one after each
    /// keep-alive and never wait for it, so a collection that waits (on a row another
    /// replica's stuck transaction holds) cannot make them late, and one process collects
    /// about once per session interval. Bounded by [`GC_TIMEOUT`].
    pub(crate) fn collect_garbage_in_background(&self, every: Duration) {
        {
            let mut collecting = self.inner.collecting.lock().unwrap();
            let recent = collecting.0.is_some_and(|at| at.elapsed() < every);
            if collecting.1 || recent {
                return;
            }
            *collecting = (Some(std::time::Instant::now()), true);
        }
        let db = self.clone();
        tokio::spawn(async move {
            match tokio::time::timeout(GC_TIMEOUT, db.collect_garbage()).await {
                Ok(Ok(0)) => {}
                Ok(Ok(n)) => tracing::info!(sessions = n, "garbage-collected expired sessions"),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "garbage collection of expired sessions failed")
                }
                Err(_) => tracing::warn!(
                    "garbage collection of expired sessions did not end within {GC_TIMEOUT:?}"
                ),
            }
            db.inner.collecting.lock().unwrap().1 = false;
        });
    }

    /// Closes the pools, waiting for connections to be returned.
    pub async fn close(&self) {
        match &self.inner.pools {
            Pools::Sqlite { writer, reader } => {
                reader.close().await;
                writer.close().await;
            }
            Pools::Postgres(p) => p.close().await,
        }
    }
}
