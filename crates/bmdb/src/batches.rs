//! What the concurrent claims and work endings of one BMDB handle are gathered as: the keys
//! and members of its group commits (`group_commit.rs`). Claims are written by
//! `claim_batch.rs`, endings by `ending_batch.rs`; the handle (`db.rs`) only keeps the groups,
//! so these are plain data that name no session, work or handle.

use std::sync::Arc;
use std::time::Duration;

use uuid::Uuid;

use crate::eligibility::Retrieval;
use crate::group_commit::GroupsByKey;
use crate::model::{Process, Processor};
use crate::sql::claims::ClaimOutcome;
use crate::sql::endings::{EndOutcome, How, WorkEnd};
use crate::sql::finish_tags::TagWrites;

/// Most requests one claim statement serves.
pub(crate) const MAX_CLAIM_BATCH: usize = 32;

/// Which requests may share a statement: one processor's claims for one process by one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClaimKey {
    pub(crate) processor: Processor,
    pub(crate) process: Process,
    pub(crate) retrieval: Retrieval,
}

/// The claim groups of one [`crate::Bmdb`] handle, one per [`ClaimKey`] seen: each member
/// is a session asking for a machine, answered with what the statement did for it.
pub(crate) type ClaimBatches = GroupsByKey<ClaimKey, Uuid, ClaimOutcome>;

/// Most endings in one transaction.
pub(crate) const MAX_ENDING_BATCH: usize = 32;

/// How one unit of work ends.
pub(crate) enum EndingKind {
    /// Finished, writing these tags once the work row was released.
    Finish(TagWrites),
    /// Failed with `cause`, held back for `delay` (`interval` seconds remembered).
    Fail {
        cause: String,
        interval: i64,
        delay: Duration,
    },
    /// Given up without a verdict, with why if it is known.
    Cancel(Option<String>),
}

/// One ending: whose work, and how it ends.
pub(crate) struct Ending {
    pub(crate) session: Uuid,
    pub(crate) machine: Uuid,
    pub(crate) process: Process,
    pub(crate) kind: EndingKind,
}

impl Ending {
    /// Refuses an ending whose values the database would refuse, before anything is written.
    pub(crate) fn check(&self) -> Result<(), crate::Error> {
        match &self.kind {
            EndingKind::Finish(tags) => tags.check(),
            EndingKind::Fail { .. } | EndingKind::Cancel(_) => Ok(()),
        }
    }

    /// The ending as the ending statement takes it.
    pub(crate) fn work_end(&self) -> WorkEnd<'_> {
        let how = match &self.kind {
            EndingKind::Finish(tags) => How::Finish(tags),
            EndingKind::Fail {
                cause,
                interval,
                delay,
            } => How::Fail {
                cause,
                interval: *interval,
                delay: *delay,
            },
            EndingKind::Cancel(cause) => How::Cancel(cause.as_deref()),
        };
        WorkEnd {
            session: self.session,
            machine: self.machine,
            process: self.process,
            how,
        }
    }
}

/// The ending groups of one [`crate::Bmdb`] handle, one per processor.
pub(crate) type EndingBatches = GroupsByKey<Processor, Arc<Ending>, EndOutcome>;
