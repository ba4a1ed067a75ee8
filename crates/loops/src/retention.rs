//! History retention as a periodic loop: every pass deletes history past the retention, in
//! bounded batches (see [`shepherd_bmdb::HistoryRetention`]), so the work history stays
//! bounded at steady state however long the fleet runs; and the web sign-ins that ended, so
//! that the tokens table does not grow by one row per sign-in for good.

use std::time::Duration;

use async_trait::async_trait;
use shepherd_bmdb::{HistoryRetention, Processor, PrunedHistory, Session};

use crate::limiter::RateSpec;
use crate::periodic::Pass;

/// How often retention passes: often enough that one pass's bounded batches keep up with a
/// fleet's history, rarely enough to cost nothing.
pub const RETENTION_RATE: RateSpec = RateSpec::new(std::time::Duration::from_secs(600), 1);

/// Prunes history past its retention, and web sign-ins that ended longer ago than theirs.
pub struct HistoryPruner {
    history: Option<HistoryRetention>,
    sign_ins: Duration,
}

impl HistoryPruner {
    /// A pruner keeping history as `history` says (`None`: forever) and ended sign-ins for
    /// `sign_ins`.
    pub fn new(history: Option<HistoryRetention>, sign_ins: Duration) -> Self {
        HistoryPruner { history, sign_ins }
    }
}

/// Sign-ins deleted per transaction, and most batches per pass.
const SIGN_IN_BATCH: (i64, u32) = (1000, 100);

#[async_trait]
impl Pass for HistoryPruner {
    const PROCESSOR: Processor = Processor::ShepherdRetention;
    type Report = PrunedHistory;
    type Error = shepherd_bmdb::Error;

    fn rate(&self) -> RateSpec {
        RETENTION_RATE
    }

    async fn pass(&self, session: &Session) -> Result<PrunedHistory, shepherd_bmdb::Error> {
        let mut pruned = match &self.history {
            Some(retention) => session.prune_history(retention).await?,
            None => PrunedHistory::default(),
        };
        let (batch, batches) = SIGN_IN_BATCH;
        pruned.sign_ins = session
            .prune_sign_ins(self.sign_ins, batch, batches)
            .await?;
        if pruned != PrunedHistory::default() {
            tracing::info!(
                work_entries = pruned.work,
                operator_entries = pruned.operator,
                sign_ins = pruned.sign_ins,
                "pruned history and sign-ins past their retention"
            );
        }
        Ok(pruned)
    }
}
