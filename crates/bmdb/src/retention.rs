//! History retention: the work history and the operators' history are pruned by age in
//! bounded batches, each its own short transaction, so pruning a large backlog never holds
//! SQLite's writer or a Postgres lock for long. Failed entries — the causes an operator digs
//! for — and operators' actions are kept longest.

use std::time::Duration;

use crate::sql::retention::HistoryTable;
use crate::{Error, Session};

/// How long history is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HistoryRetention {
    /// Started, Finished and Canceled entries older than this go.
    pub keep: Duration,
    /// Failed entries and operators' actions older than this go (at least `keep`).
    pub keep_failed: Duration,
    /// Entries deleted per transaction.
    pub batch: i64,
    /// Most batches per pass, so one pass is bounded too; the next pass goes on.
    pub max_batches: u32,
}

impl HistoryRetention {
    /// How many times longer than the rest Failed entries and operators' actions are kept.
    pub const FAILED_FACTOR: u32 = 4;

    /// Keeps history for `keep`, Failed entries and operators' actions four times as long,
    /// deleting at most 1,000 entries per transaction and 100 batches per pass.
    pub fn new(keep: Duration) -> HistoryRetention {
        HistoryRetention {
            keep,
            keep_failed: keep.saturating_mul(Self::FAILED_FACTOR),
            batch: 1000,
            max_batches: 100,
        }
    }
}

/// How long a web sign-in's token row is kept after it expired or was revoked, unless
/// configured otherwise.
pub const SIGN_IN_RETENTION: Duration = Duration::from_secs(30 * 86_400);

/// How long audit events are kept, unless configured otherwise.
pub const AUDIT_RETENTION: Duration = Duration::from_secs(90 * 86_400);

/// Records kept for a time of their own, each pruned by [`Session::prune_ended`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Web sign-ins that expired or were revoked.
    SignIns,
    /// Audit events, by when they were seen.
    AuditEvents,
}

impl Ended {
    /// The table its rows are in.
    fn table(self) -> HistoryTable {
        match self {
            Ended::SignIns => HistoryTable::SignIns,
            Ended::AuditEvents => HistoryTable::AuditEvents,
        }
    }
}

/// What one retention pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrunedHistory {
    /// Work history entries.
    pub work: u64,
    /// Operators' history entries.
    pub operator: u64,
    /// Web sign-ins that had ended (expired or revoked) longer ago than their retention.
    pub sign_ins: u64,
    /// Audit events older than their retention.
    pub audit_events: u64,
}

impl std::fmt::Display for PrunedHistory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pruned {} work and {} operator history entries, {} ended sign-ins, {} audit events",
            self.work, self.operator, self.sign_ins, self.audit_events
        )
    }
}

/// A retention (`what`: which) too long to subtract from a time.
fn retention_too_long(what: &'static str) -> Error {
    Error::InvalidArgument {
        what,
        problem: "is too long".into(),
    }
}

impl Session {
    /// One retention pass: deletes expired history, oldest first, a batch per transaction,
    /// until a batch comes back short or the pass has run `max_batches`.
    pub async fn prune_history(
        &self,
        retention: &HistoryRetention,
    ) -> Result<PrunedHistory, Error> {
        let keep = chrono::Duration::from_std(retention.keep)
            .map_err(|_| retention_too_long("history retention"))?;
        let keep_failed = chrono::Duration::from_std(retention.keep_failed.max(retention.keep))
            .map_err(|_| retention_too_long("history retention"))?;
        let mut pruned = PrunedHistory::default();
        for table in [HistoryTable::Work, HistoryTable::Operator] {
            for _ in 0..retention.max_batches {
                let limit = retention.batch;
                let deleted = self
                    .transact(move |tx| {
                        Box::pin(async move {
                            let now = tx.now().await?;
                            tx.prune_oldest(table, now - keep, now - keep_failed, limit)
                                .await
                        })
                    })
                    .await?;
                match table {
                    HistoryTable::Work => pruned.work += deleted,
                    _ => pruned.operator += deleted,
                }
                if deleted < limit as u64 {
                    break;
                }
            }
        }
        Ok(pruned)
    }

    /// Deletes the `what` that ended (a sign-in expired or was revoked, an audit event was
    /// seen) more than `keep` ago, in batches as [`Session::prune_history`] does; returns how
    /// many went.
    pub async fn prune_ended(
        &self,
        what: Ended,
        keep: Duration,
        batch: i64,
        max_batches: u32,
    ) -> Result<u64, Error> {
        let keep = chrono::Duration::from_std(keep).map_err(|_| {
            retention_too_long(match what {
                Ended::SignIns => "sign-in retention",
                Ended::AuditEvents => "audit retention",
            })
        })?;
        let mut pruned = 0;
        for _ in 0..max_batches {
            let deleted = self
                .transact(move |tx| {
                    Box::pin(async move {
                        let before = tx.now().await? - keep;
                        tx.prune_oldest(what.table(), before, before, batch).await
                    })
                })
                .await?;
            pruned += deleted;
            if deleted < batch as u64 {
                break;
            }
        }
        Ok(pruned)
    }
}
