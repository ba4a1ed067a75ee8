//! Where the agents' heartbeat group commit (`session.rs` over `group_commit.rs`) tells each
//! batch it wrote or could not write. The BMaaS server's process shows it as a background
//! task (`shepherd_tasks`, which the BMDB does not know), so an operator sees when
//! heartbeats last landed and why they stopped, as for every other task.

use std::sync::{Arc, OnceLock};

use crate::Error;

/// Receives one report per heartbeat batch. Called from the batch's writer, once before and
/// once after its transaction; it must be quick (a fleet writes hundreds of batches a second).
pub trait HeartbeatBatchReports: Send + Sync + std::fmt::Debug {
    /// A batch of heartbeats is about to be written.
    fn started(&self);
    /// A batch of `members` heartbeats was written in one transaction (each member still gets
    /// its own answer: an unknown machine or a wrong key is that member's, not the batch's).
    fn written(&self, members: usize);
    /// A batch of `members` heartbeats could not be written; each member was told `error`.
    fn failed(&self, members: usize, error: &Error);
}

/// The receiver of a BMDB handle's heartbeat batch reports, if one was set.
#[derive(Debug, Default)]
pub(crate) struct BatchReporter(OnceLock<Arc<dyn HeartbeatBatchReports>>);

impl BatchReporter {
    /// Sends reports to `reports` from now on; false (and nothing changes) if a receiver was
    /// set already.
    pub(crate) fn set(&self, reports: Arc<dyn HeartbeatBatchReports>) -> bool {
        self.0.set(reports).is_ok()
    }

    /// A batch starts.
    pub(crate) fn started(&self) {
        if let Some(r) = self.0.get() {
            r.started();
        }
    }

    /// A batch of `members` ended with `result`.
    pub(crate) fn ended<T>(&self, members: usize, result: &Result<T, Error>) {
        let Some(r) = self.0.get() else {
            return;
        };
        match result {
            Ok(_) => r.written(members),
            Err(e) => r.failed(members, e),
        }
    }
}
