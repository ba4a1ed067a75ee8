//! The security audit trail (`audit_events`), each statement once for both engines.

use super::engine::{from_columns, Arg, Result, Tx};
use crate::audit::{AuditEvent, AuditFilter};

impl Tx {
    /// Inserts `events` (their ids are the table's).
    pub(crate) async fn record_audit_events(&mut self, events: &[AuditEvent]) -> Result<()> {
        for event in events {
            self.record_audit_event(event).await?;
        }
        Ok(())
    }

    /// Inserts one event (its id is the table's).
    pub(crate) async fn record_audit_event(&mut self, event: &AuditEvent) -> Result<()> {
        let sql = "INSERT INTO audit_events (at, kind, principal, peer, route, reason, request_id)
                   VALUES ($1, $2, $3, $4, $5, $6, $7)";
        let args = [
            Arg::Time(event.at),
            Arg::Text(event.kind.as_str()),
            Arg::OptText(event.principal.as_deref()),
            Arg::OptText(event.peer.as_deref()),
            Arg::OptText(event.route.as_deref()),
            Arg::Text(&event.reason),
            Arg::OptText(event.request_id.as_deref()),
        ];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }

    /// At most `limit` events `filter` selects with ids below `before`, newest first.
    pub(crate) async fn audit_events(
        &mut self,
        filter: &AuditFilter,
        before: i64,
        limit: i64,
    ) -> Result<Vec<AuditEvent>> {
        let sql = "SELECT id, at, kind, principal, peer, route, reason, request_id
                     FROM audit_events
                    WHERE id < $1
                      AND ($2 IS NULL OR principal = $2)
                      AND ($3 IS NULL OR kind = $3)
                      AND ($4 IS NULL OR at >= $4)
                    ORDER BY id DESC LIMIT $5";
        let args = [
            Arg::Int(before),
            Arg::OptText(filter.principal.as_deref()),
            Arg::OptText(filter.kind.map(|k| k.as_str())),
            Arg::OptTime(filter.since),
            Arg::Int(limit),
        ];
        self.conn().rows(sql, &args).await
    }
}

from_columns! {
    AuditEvent {
        id: get, at: time, kind: parsed, principal: get, peer: get, route: get, reason: get,
        request_id: get,
    }
}
