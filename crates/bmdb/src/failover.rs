//! What a database failover looks like from a connection pool, and what is done about it.
//!
//! When a highly available Postgres fails over, connections that were open meet one of: the
//! old primary shutting down (SQLSTATE 57P01 admin shutdown, 57P02 crash shutdown, "unexpected
//! postmaster exit"), a server not ready yet (57P03 cannot connect now, "the database system is
//! starting up"), a broken connection (class 08), or, worst, a node that is now a standby and
//! answers every write with 25006 read-only transaction while reads still work. All of them
//! are the database's unavailability, never a fault of the data or the work: callers retry
//! later without charging anyone a backoff ([`crate::Error::is_transient`]).
//!
//! A pooled connection that met one of them is not handed out again: the [`FailoverMark`]
//! remembers when the last such error was seen, and the pool's `before_acquire` check drops
//! every connection opened before it, so the next transaction connects afresh (through the
//! router, to the new primary) instead of reaching the standby again.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Whether a driver error means the database is failing over (see the module docs).
pub(crate) fn is_failover_sqlx(e: &sqlx::Error) -> bool {
    let Some(db) = e.as_database_error() else {
        return false;
    };
    let code = db.code();
    let code = code.as_deref().unwrap_or_default();
    matches!(code, "25006" | "57P01" | "57P02" | "57P03")
        || code.starts_with("08")
        || db.message().contains("unexpected postmaster exit")
}

/// When this process last saw a failover error, for dropping the connections opened before.
#[derive(Debug)]
pub(crate) struct FailoverMark {
    origin: Instant,
    /// Microseconds after `origin` at which the last failover error was seen; 0 for never.
    seen_at: AtomicU64,
}

impl Default for FailoverMark {
    fn default() -> Self {
        FailoverMark {
            origin: Instant::now(),
            seen_at: AtomicU64::new(0),
        }
    }
}

impl FailoverMark {
    /// Records that a failover error was just seen.
    pub(crate) fn seen(&self) {
        let micros = self.origin.elapsed().as_micros().max(1);
        self.seen_at
            .fetch_max(u64::try_from(micros).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Whether a connection opened `age` ago predates the last failover error seen: it may
    /// lead to a standby or to a server that is gone.
    pub(crate) fn predates(&self, age: Duration) -> bool {
        let seen_at = self.seen_at.load(Ordering::Relaxed);
        if seen_at == 0 {
            return false;
        }
        let opened_at = self.origin.elapsed().saturating_sub(age);
        opened_at <= Duration::from_micros(seen_at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_connections_opened_before_the_last_failover_error_are_dropped() {
        let mark = FailoverMark::default();
        assert!(!mark.predates(Duration::from_secs(3600)), "never seen");
        std::thread::sleep(Duration::from_millis(5));
        mark.seen();
        assert!(mark.predates(Duration::from_millis(5)), "opened before");
        std::thread::sleep(Duration::from_millis(5));
        assert!(!mark.predates(Duration::from_millis(1)), "opened after");
    }
}
