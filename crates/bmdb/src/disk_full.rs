//! A full disk under the database, told to the operator: at most one WARN a minute per
//! database handle, naming the SQLite file's directory and the space left there, however
//! many transactions fail meanwhile. The failures themselves are the database's
//! unavailability (`Error::is_disk_full`, within `Error::is_transient`): no machine is
//! charged a backoff for them, and writes resume by themselves once space returns (a SQLite
//! connection whose COMMIT failed is closed, not reused: `sql/engine.rs`).

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::Error;

/// How often a full disk is told at most.
const WARN_EVERY: Duration = Duration::from_secs(60);

/// The warning's state for one database handle.
#[derive(Debug, Default)]
pub(crate) struct DiskFullWarning {
    /// The SQLite file (none for Postgres, whose server's disk this process cannot see).
    path: Option<PathBuf>,
    last: Mutex<Option<Instant>>,
}

impl DiskFullWarning {
    /// For a database at `path` (SQLite), or on a server (`None`).
    pub(crate) fn new(path: Option<PathBuf>) -> Self {
        DiskFullWarning {
            path,
            last: Mutex::new(None),
        }
    }

    /// Warns about `e` if it is a full disk and no warning was given in the last minute.
    pub(crate) fn saw(&self, e: &Error) {
        if !e.is_disk_full() {
            return;
        }
        {
            let mut last = self.last.lock().unwrap();
            if last.is_some_and(|at| at.elapsed() < WARN_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        match &self.path {
            Some(path) => {
                let dir = path.parent().map(PathBuf::from).unwrap_or_default();
                let free = free_bytes(&dir).map_or("unknown".to_string(), |b| format!("{b} bytes"));
                tracing::warn!(
                    path = %path.display(),
                    free = %free,
                    "the BMDB's disk is full: nothing is written until space is freed (work is released without a backoff); next warning in a minute at most"
                );
            }
            None => tracing::warn!(
                error = %e,
                "the BMDB server's disk is full: nothing is written until space is freed (work is released without a backoff); next warning in a minute at most"
            ),
        }
    }
}

/// Space left for unprivileged writes on the file system holding `dir`.
fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    let stats = rustix::fs::statvfs(dir).ok()?;
    Some(stats.f_bavail.saturating_mul(stats.f_frsize))
}
