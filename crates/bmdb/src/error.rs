//! The one error type of the BMDB library. Messages carry their cause in their text and do
//! not also name it as `source()`, so a cause is printed once however the error is shown.

/// Everything that can go wrong talking to the BMDB.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The database URL could not be understood.
    #[error(
        "invalid database URL {url:?}: {reason} (expected sqlite:PATH or postgres://USER@HOST/DB)"
    )]
    InvalidUrl {
        /// The URL as given (passwords are not echoed back: only the scheme and host part).
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The database could not be reached or opened.
    #[error("cannot connect to database {target}: {error}")]
    Connect {
        /// Where we tried to connect (no password).
        target: String,
        /// The driver's error.
        error: DriverError,
    },
    /// The SQLite database file does not exist and we were not asked to create it.
    #[error("database file {0} does not exist; create it with `shepherd bmdb migrate`")]
    MissingDatabaseFile(String),
    /// The schema was migrated by a newer binary past what binaries of this schema may run on.
    #[error("database schema version {found} admits binaries of schema {oldest_compatible} or later, and this binary is schema {known}: upgrade shepherd on this host to a release of schema {oldest_compatible} or later (see deploy/README.md, Upgrades)")]
    SchemaTooNew {
        /// Version found in the database.
        found: i64,
        /// The oldest binary schema the database admits.
        oldest_compatible: i64,
        /// The schema of this binary.
        known: i64,
    },
    /// The schema is older than this binary needs.
    #[error("database schema version {found} is older than this binary needs ({known}); run `shepherd bmdb migrate`")]
    SchemaOutdated {
        /// Version found in the database.
        found: i64,
        /// Version this binary needs.
        known: i64,
    },
    /// The session is gone or past its deadline; start a new one.
    #[error("session expired")]
    SessionExpired,
    /// The work lock was lost (e.g. garbage-collected after the session expired).
    #[error("work on machine {machine_id} for {process} is no longer held by this session")]
    WorkLost {
        /// The machine.
        machine_id: uuid::Uuid,
        /// The process's name (`Process::as_str`).
        process: &'static str,
    },
    /// Finish or Fail was called on work that was already finished, failed or canceled.
    #[error("work was already {0}")]
    WorkAlreadyDone(&'static str),
    /// A name that should be one of a closed set is not (a process, a provider, a state …):
    /// in a row, a row written by a newer binary; from a caller, a typo.
    #[error("unknown {kind} {name:?} (one of: {known})")]
    UnknownName {
        /// What the name should name (`Process`, `state` …).
        kind: &'static str,
        /// The name found.
        name: String,
        /// The names there are, comma-separated.
        known: String,
    },
    /// A value read from the database cannot be understood (a time out of range, facts that do
    /// not decode); the row is left as it is.
    #[error("unreadable {what}: {problem}")]
    UnreadableValue {
        /// Which value.
        what: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// A value a caller passed is invalid; nothing was written.
    #[error("invalid {what}: {problem}")]
    InvalidArgument {
        /// Which value.
        what: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// Pinning a machine's SSH host key found another key pinned (by another takeover,
    /// meanwhile); nothing was written.
    #[error("host key mismatch: {presented} presented, {pinned} pinned meanwhile")]
    HostKeyPinned {
        /// The key pinned for the machine.
        pinned: String,
        /// The key the caller saw.
        presented: String,
    },
    /// A bare machine's phase was not the one the bare-metal loop read when it went to move it
    /// on (an operator reimaged it, or it was moved on meanwhile); nothing was written.
    #[error("bare machine {machine} is {} now, not {expected}", found.unwrap_or("no longer bare"))]
    BarePhaseMoved {
        /// The machine.
        machine: uuid::Uuid,
        /// The phase the loop read (`BarePhase::as_str`).
        expected: &'static str,
        /// The phase found, if the machine is still bare.
        found: Option<&'static str>,
    },
    /// The machine a transaction wrote about is gone (deleted meanwhile, e.g. decommissioned).
    #[error("machine {0} is gone")]
    MachineGone(uuid::Uuid),
    /// The task that runs a transaction's BEGIN ended without an outcome (it panicked, or the
    /// runtime is shutting down).
    #[error("starting a transaction failed: {0}")]
    BeginFailed(String),
    /// No connection to the database could be had; `cause` says why (connection refused, a
    /// timeout, authentication, or every connection busy).
    #[error("database {target} is unavailable: {cause}")]
    Unavailable {
        /// Where (no password).
        target: String,
        /// Why, as the driver or a direct connection attempt says.
        cause: String,
    },
    /// A database error that was not retried or kept failing after retries; what it means is
    /// told by [`Error::is_transient`], [`Error::is_failover`], [`Error::is_disk_full`],
    /// [`Error::is_unique_violation`].
    #[error("database error: {0}")]
    Database(DriverError),
    /// The batch this call was written in failed (see `group_commit.rs`); every member of the
    /// batch gets the batch's error.
    #[error("the batch this was written in failed: {0}")]
    BatchFailed(std::sync::Arc<Error>),
}

impl From<sqlx::Error> for Error {
    fn from(e: sqlx::Error) -> Self {
        Error::Database(DriverError(e))
    }
}

/// The database driver's error, as it said it; opaque, so that no caller depends on which
/// driver the BMDB uses: [`Error`]'s methods say what it means.
#[derive(Debug)]
pub struct DriverError(pub(crate) sqlx::Error);

impl std::fmt::Display for DriverError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl Error {
    /// Whether retrying the same transaction may succeed (serialization failure, deadlock,
    /// SQLite busy/locked).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Database(DriverError(e)) => is_retryable_sqlx(e),
            // Its members join the next batch.
            Error::BatchFailed(e) => e.is_retryable(),
            _ => false,
        }
    }
}

impl Error {
    /// Whether the failure lies with the database or this process's hold on it (unreachable,
    /// a session or lock lost, contention that outlasted the retries) rather than with the
    /// data: the same work may succeed unchanged once the BMDB is back. Control loops release
    /// such work without charging the machine a backoff.
    pub fn is_transient(&self) -> bool {
        match self {
            Error::Connect { .. }
            | Error::Unavailable { .. }
            | Error::SessionExpired
            | Error::WorkLost { .. } => true,
            Error::BatchFailed(e) => e.is_transient(),
            Error::Database(DriverError(e)) => {
                is_disk_full_sqlx(e)
                    || is_retryable_sqlx(e)
                    || crate::failover::is_failover_sqlx(e)
                    || matches!(
                        e,
                        sqlx::Error::Io(_)
                            | sqlx::Error::PoolTimedOut
                            | sqlx::Error::PoolClosed
                            | sqlx::Error::WorkerCrashed
                    )
            }
            _ => false,
        }
    }

    /// Whether the database itself could not be reached or written (refused connections, a
    /// pool that timed out, a failover, a full disk): [`Error::is_transient`] less what is
    /// about this process's hold (a session or lock lost) or contention.
    pub fn is_outage(&self) -> bool {
        match self {
            Error::SessionExpired | Error::WorkLost { .. } => false,
            Error::BatchFailed(e) => e.is_outage(),
            Error::Database(DriverError(e)) if is_retryable_sqlx(e) => false,
            e => e.is_transient(),
        }
    }

    /// Whether the database is failing over (a standby refused a write, the server shut down
    /// or is starting up, the connection broke): its unavailability, which
    /// [`Error::is_transient`] includes.
    pub fn is_failover(&self) -> bool {
        match self {
            Error::Database(DriverError(e)) => crate::failover::is_failover_sqlx(e),
            Error::BatchFailed(e) => e.is_failover(),
            _ => false,
        }
    }

    /// Whether the database's disk is full (SQLite's `SQLITE_FULL` or an `ENOSPC`, Postgres'
    /// `disk_full`): unavailability that ends when an operator frees space, never the data's
    /// fault, so [`Error::is_transient`] includes it.
    pub fn is_disk_full(&self) -> bool {
        match self {
            Error::Database(DriverError(e)) => is_disk_full_sqlx(e),
            Error::BatchFailed(e) => e.is_disk_full(),
            _ => false,
        }
    }

    /// Whether a unique constraint refused the write (another writer got there first).
    pub fn is_unique_violation(&self) -> bool {
        match self {
            Error::Database(DriverError(e)) => e
                .as_database_error()
                .is_some_and(|db| db.is_unique_violation()),
            _ => false,
        }
    }
}

/// SQLite's `SQLITE_FULL` (13, with any extended code), Postgres' `disk_full` (53100), or
/// the operating system's `ENOSPC` under either.
pub(crate) fn is_disk_full_sqlx(e: &sqlx::Error) -> bool {
    if let sqlx::Error::Io(io) = e {
        return io.raw_os_error() == Some(28);
    }
    let Some(code) = e.as_database_error().and_then(|db| db.code()) else {
        return false;
    };
    code == "53100" || code.parse::<i64>().is_ok_and(|n| n & 0xff == 13)
}

pub(crate) fn is_retryable_sqlx(e: &sqlx::Error) -> bool {
    let Some(db) = e.as_database_error() else {
        return false;
    };
    let Some(code) = db.code() else {
        return false;
    };
    // Postgres: serialization_failure, deadlock_detected.
    if code == "40001" || code == "40P01" {
        return true;
    }
    // SQLite: primary result codes SQLITE_BUSY (5) and SQLITE_LOCKED (6), extended codes too.
    match code.parse::<i64>() {
        Ok(n) => matches!(n & 0xff, 5 | 6),
        Err(_) => false,
    }
}
