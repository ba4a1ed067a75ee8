//! History retention as a periodic loop: every pass deletes history past the retention, in
//! bounded batches (see [`shepherd_bmdb::HistoryRetention`]), so the work history stays
//! bounded at steady state however long the fleet runs; and the web sign-ins that ended, so
//! that the tokens table does not grow by one row per sign-in for good.

use std::time::Duration;

use async_trait::async_trait;
use shepherd_bmdb::{
    Ended, HistoryRetention, Processor, PrunedHistory, Session, AUDIT_RETENTION, SIGN_IN_RETENTION,
};

use crate::limiter::RateSpec;
use crate::periodic::Pass;

/// How often retention passes: often enough that one pass's bounded batches keep up with a
/// fleet's history, rarely enough to cost nothing.
pub const RETENTION_RATE: RateSpec = RateSpec::new(std::time::Duration::from_secs(600), 1);

/// Prunes history past its retention, and web sign-ins that ended longer ago than theirs.
pub struct HistoryPruner {
    retention: Retention,
}

/// How long each kind of record is kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// The work and operators' history; `None` keeps it forever.
    pub history: Option<HistoryRetention>,
    /// Web sign-ins, after they expired or were revoked.
    pub sign_ins: Duration,
    /// Audit events.
    pub audit_events: Duration,
}

impl Default for Retention {
    /// History forever; sign-ins and audit events as long as the BMDB's defaults say.
    fn default() -> Self {
        Retention {
            history: None,
            sign_ins: SIGN_IN_RETENTION,
            audit_events: AUDIT_RETENTION,
        }
    }
}

impl HistoryPruner {
    /// A pruner keeping each kind of record as `retention` says.
    pub fn new(retention: Retention) -> Self {
        HistoryPruner { retention }
    }
}

/// Sign-ins or audit events deleted per transaction, and most batches per pass.
const ENDED_BATCH: (i64, u32) = (1000, 100);

#[async_trait]
impl Pass for HistoryPruner {
    const PROCESSOR: Processor = Processor::ShepherdRetention;
    type Report = PrunedHistory;
    type Error = shepherd_bmdb::Error;

    fn rate(&self) -> RateSpec {
        RETENTION_RATE
    }

    async fn pass(&self, session: &Session) -> Result<PrunedHistory, shepherd_bmdb::Error> {
        let retention = &self.retention;
        let mut pruned = match &retention.history {
            Some(retention) => session.prune_history(retention).await?,
            None => PrunedHistory::default(),
        };
        let (batch, batches) = ENDED_BATCH;
        pruned.sign_ins = session
            .prune_ended(Ended::SignIns, retention.sign_ins, batch, batches)
            .await?;
        pruned.audit_events = session
            .prune_ended(Ended::AuditEvents, retention.audit_events, batch, batches)
            .await?;
        if pruned != PrunedHistory::default() {
            tracing::info!(
                work_entries = pruned.work,
                operator_entries = pruned.operator,
                sign_ins = pruned.sign_ins,
                audit_events = pruned.audit_events,
                "pruned history, sign-ins and audit events past their retention"
            );
        }
        Ok(pruned)
    }
}
