//! History retention as a periodic loop: every pass deletes history past the retention, in
//! bounded batches (see [`shepherd_bmdb::HistoryRetention`]), so the work history stays
//! bounded at steady state however long the fleet runs.

use async_trait::async_trait;
use shepherd_bmdb::{HistoryRetention, Processor, PrunedHistory, Session};

use crate::limiter::RateSpec;
use crate::periodic::Pass;

/// How often retention passes: often enough that one pass's bounded batches keep up with a
/// fleet's history, rarely enough to cost nothing.
pub const RETENTION_RATE: RateSpec = RateSpec::new(std::time::Duration::from_secs(600), 1);

/// Prunes history past its retention.
pub struct HistoryPruner {
    retention: HistoryRetention,
}

impl HistoryPruner {
    /// A pruner keeping history as `retention` says.
    pub fn new(retention: HistoryRetention) -> Self {
        HistoryPruner { retention }
    }
}

#[async_trait]
impl Pass for HistoryPruner {
    const PROCESSOR: Processor = Processor::ShepherdRetention;
    type Report = PrunedHistory;
    type Error = shepherd_bmdb::Error;

    fn rate(&self) -> RateSpec {
        RETENTION_RATE
    }

    async fn pass(&self, session: &Session) -> Result<PrunedHistory, shepherd_bmdb::Error> {
        let pruned = session.prune_history(&self.retention).await?;
        if pruned.work + pruned.operator > 0 {
            tracing::info!(
                work_entries = pruned.work,
                operator_entries = pruned.operator,
                "pruned history past its retention"
            );
        }
        Ok(pruned)
    }
}
