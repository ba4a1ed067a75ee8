//! History retention: old entries are deleted in bounded batches, oldest first, so pruning
//! never holds the writer (SQLite) or a large lock (Postgres) for long.

use chrono::{DateTime, Utc};

use super::engine::{Arg, Result, Tx};

/// The history tables retention prunes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HistoryTable {
    /// The loops' history; Failed rows are kept until `failed_before`.
    Work,
    /// The operators' history; every row is kept until `failed_before`.
    Operator,
    /// Web sign-ins (tokens named [`crate::SESSION_PREFIX`]…) that expired or were revoked
    /// before `before`; other tokens stay (an administrator made them and revokes or keeps
    /// them by name).
    SignIns,
    /// Audit events seen before `before`.
    AuditEvents,
}

impl Tx {
    /// Deletes at most `limit` of the oldest entries older than `before` (older than
    /// `failed_before` for what is kept longest); returns how many went.
    pub(crate) async fn prune_oldest(
        &mut self,
        table: HistoryTable,
        before: DateTime<Utc>,
        failed_before: DateTime<Utc>,
        limit: i64,
    ) -> Result<u64> {
        let sql = match table {
            HistoryTable::Work => {
                "DELETE FROM work_history WHERE id IN (
                    SELECT id FROM work_history
                     WHERE at < $1 AND (event <> 'Failed' OR at < $2)
                     ORDER BY at LIMIT $3)"
            }
            HistoryTable::Operator => {
                "DELETE FROM operator_actions WHERE id IN (
                    SELECT id FROM operator_actions
                     WHERE at < $1 AND at < $2
                     ORDER BY at LIMIT $3)"
            }
            HistoryTable::SignIns => {
                "DELETE FROM api_tokens WHERE token_id IN (
                    SELECT token_id FROM api_tokens
                     WHERE name LIKE 'session.%' AND (expires_at < $1 OR revoked_at < $1)
                       AND created_at < $2
                     LIMIT $3)"
            }
            HistoryTable::AuditEvents => {
                "DELETE FROM audit_events WHERE id IN (
                    SELECT id FROM audit_events WHERE at < $1 AND at < $2 ORDER BY at LIMIT $3)"
            }
        };
        let args = [Arg::Time(before), Arg::Time(failed_before), Arg::Int(limit)];
        self.conn().execute(sql, &args).await
    }
}
