//! Work (design.md §4): claiming a machine for a process ([`Session::work`]) and the claimed
//! [`Work`]'s three endings: finish, fail, cancel.

use crate::backoff::{default_interval_seconds, Backoff};
use crate::batches::{ClaimKey, Ending, EndingKind};
use crate::db::Pools;
use crate::metrics::WorkResult;
use crate::model::stored_cause;
use crate::sql::claims::{ClaimOutcome, ClaimStrategy};
use crate::sql::endings::EndOutcome;
use crate::sql::finish_tags::TagWrites;
use crate::transaction::retrying;
use crate::{Error, Process, Retrieval, Session};
use uuid::Uuid;

/// The result of trying to claim work.
#[derive(Debug)]
pub enum Claim {
    /// A machine is locked for this session and process.
    Work(Work),
    /// No machine is eligible right now.
    NothingToDo,
    /// Machines were eligible but concurrent claimers took them; try again.
    Conflict,
}

impl Session {
    /// Claims one machine eligible under `retrieval` for `process` (design.md §4). Returns
    /// [`Claim::NothingToDo`] when none is eligible and [`Claim::Conflict`] when every candidate
    /// was taken by concurrent claimers.
    pub async fn work(&self, process: Process, retrieval: Retrieval) -> Result<Claim, Error> {
        self.work_with_strategy(process, retrieval, ClaimStrategy::SkipLocked)
            .await
    }

    /// [`Session::work`] with a chosen claim shape; only benchmarks use anything but the default.
    #[doc(hidden)]
    pub async fn work_with_strategy(
        &self,
        process: Process,
        retrieval: Retrieval,
        strategy: ClaimStrategy,
    ) -> Result<Claim, Error> {
        retrying(
            self.db().metrics(),
            &self.db().inner.seen,
            self.processor(),
            || self.attempt_claim(process, &retrieval, strategy),
        )
        .await
    }

    async fn attempt_claim(
        &self,
        process: Process,
        retrieval: &Retrieval,
        strategy: ClaimStrategy,
    ) -> Result<Claim, Error> {
        self.inner.ensure_alive()?;
        let key = ClaimKey {
            processor: self.processor(),
            process,
            retrieval: *retrieval,
        };
        let db = self.db();
        match (&db.inner.pools, strategy) {
            // Upstream's shape, a benchmark baseline: one claim, on its own.
            (Pools::Postgres(_), ClaimStrategy::UpstreamFirstRow) => {
                let outcomes = db.claim_for(&[self.id()], key, strategy).await?;
                self.claimed(process, outcomes[0])
            }
            _ => db.claim_batched(self, key).await,
        }
    }

    /// What a claim statement's `outcome` for this session means to its caller.
    pub(crate) fn claimed(&self, process: Process, outcome: ClaimOutcome) -> Result<Claim, Error> {
        match outcome {
            ClaimOutcome::Claimed {
                machine_id,
                last_interval,
            } => {
                self.db().metrics().work_started(self.processor(), process);
                Ok(Claim::Work(Work::new(
                    self.clone(),
                    machine_id,
                    process,
                    last_interval,
                )))
            }
            ClaimOutcome::SessionExpired => {
                self.mark_expired();
                Err(Error::SessionExpired)
            }
            ClaimOutcome::Nothing => Ok(Claim::NothingToDo),
            ClaimOutcome::Conflict => Ok(Claim::Conflict),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Active,
    Finished,
    Failed,
    Canceled,
    Lost,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::Active => "active",
            State::Finished => "finished",
            State::Failed => "failed",
            State::Canceled => "canceled",
            State::Lost => "lost",
        }
    }
}

/// A machine locked for one process by one session. End it with exactly one of
/// [`Work::finish`], [`Work::fail`] or [`Work::cancel`]; dropping it unended cancels it in the
/// background.
#[derive(Debug)]
pub struct Work {
    session: Session,
    machine_id: Uuid,
    process: Process,
    last_interval: Option<i64>,
    state: State,
}

impl Work {
    pub(crate) fn new(
        session: Session,
        machine_id: Uuid,
        process: Process,
        last_interval: Option<i64>,
    ) -> Self {
        Work {
            session,
            machine_id,
            process,
            last_interval,
            state: State::Active,
        }
    }

    /// The locked machine.
    pub fn machine_id(&self) -> Uuid {
        self.machine_id
    }

    /// The process holding the lock.
    pub fn process(&self) -> Process {
        self.process
    }

    /// The backoff interval persisted by this machine's previous failure, if any.
    pub fn previous_backoff_seconds(&self) -> Option<i64> {
        self.last_interval
    }

    fn ensure_active(&self) -> Result<(), Error> {
        match self.state {
            State::Active => Ok(()),
            other => Err(Error::WorkAlreadyDone(other.name())),
        }
    }

    /// Ends the work successfully: releases the lock, clears the backoff, writes Finished
    /// history and writes `tags`, all in one transaction, which it may share with the endings
    /// of concurrent workers (`ending_batch.rs`). If the tags are refused (a host key pinned
    /// already, a malformed agent key), nothing of this ending is written, the work is still
    /// held, and the error is this work's alone.
    pub async fn finish(&mut self, tags: TagWrites) -> Result<(), Error> {
        self.ensure_active()?;
        let kind = EndingKind::Finish(tags);
        let outcome = self.end(kind).await?;
        self.ended(outcome, State::Finished, WorkResult::Finished)
    }

    /// Ends the work as failed: releases the lock, writes Failed history with `cause`, and
    /// puts the machine in backoff for this process (see [`Backoff`]; `None` means one second
    /// or the previous interval if longer).
    pub async fn fail(&mut self, backoff: Option<&Backoff>, cause: &str) -> Result<(), Error> {
        self.ensure_active()?;
        let interval = match backoff {
            Some(b) => b.next_interval_seconds(self.last_interval),
            None => default_interval_seconds(self.last_interval),
        };
        let delay = match backoff {
            Some(b) => b.delay_with_jitter(interval),
            None => std::time::Duration::from_secs(interval as u64),
        };
        let kind = EndingKind::Fail {
            cause: stored_cause(cause),
            interval,
            delay,
        };
        let outcome = self.end(kind).await?;
        self.ended(outcome, State::Failed, WorkResult::Failed)
    }

    /// Writes this work's ending.
    async fn end(&self, kind: EndingKind) -> Result<EndOutcome, Error> {
        end(&self.session, self.machine_id, self.process, kind).await
    }

    fn ended(
        &mut self,
        outcome: EndOutcome,
        state: State,
        result: WorkResult,
    ) -> Result<(), Error> {
        match outcome {
            EndOutcome::Done => {
                self.state = state;
                self.session.record_work_end(self.process, result);
                Ok(())
            }
            EndOutcome::SessionExpired => {
                self.session.mark_expired();
                Err(Error::SessionExpired)
            }
            EndOutcome::Lost => {
                self.state = State::Lost;
                Err(Error::WorkLost {
                    machine_id: self.machine_id,
                    process: self.process.as_str(),
                })
            }
        }
    }

    /// Gives the work up without a verdict: releases the lock and writes Canceled history
    /// with `cause` (a shutdown, an outage, a lost lease: every Canceled entry says why);
    /// backoff is untouched. A no-op after the work already ended. Works on an expired session.
    pub async fn cancel(&mut self, cause: &str) -> Result<(), Error> {
        if self.state != State::Active {
            return Ok(());
        }
        cancel(&self.session, self.machine_id, self.process, cause).await?;
        self.state = State::Canceled;
        Ok(())
    }

    /// Ends work whose session's lease ended before or during a side effect (`lease.rs`):
    /// counted in `shepherd_work_fenced_total{process}`, and canceled with the cause "lease
    /// lost" if the work row is still this session's (once another replica's collector
    /// released it, nothing is written).
    pub async fn fenced(&mut self) -> Result<(), Error> {
        if self.state != State::Active {
            return Ok(());
        }
        self.session.db().metrics().work_fenced(self.process);
        self.cancel(&crate::LeaseLost.to_string()).await
    }

    /// Gives up on writing this work's ending (the database could not be written, and the
    /// caller stopped retrying): the session is abandoned (its keep-alive stops and it counts
    /// as expired here), so that once its row expires any replica's collector releases the
    /// work with a Canceled entry. Without this, a session kept alive would hold the machine
    /// until its process ends.
    pub fn give_up(mut self) {
        if self.state == State::Active {
            tracing::warn!(machine = %self.machine_id, process = %self.process, "the work's ending could not be written; its session is abandoned, so the database releases the work when the session expires");
            self.session.abandon();
            self.state = State::Lost;
        }
    }

    /// Whether the work still waits for its ending.
    pub fn is_active(&self) -> bool {
        self.state == State::Active
    }
}

/// Writes the ending of `session`'s work on `machine` for `process`.
async fn end(
    session: &Session,
    machine: Uuid,
    process: Process,
    kind: EndingKind,
) -> Result<EndOutcome, Error> {
    let ending = Ending {
        session: session.id(),
        machine,
        process,
        kind,
    };
    session.db().end_work(session.processor(), ending).await
}

/// Cancels `session`'s work on `machine` for `process`, recording `cause` (stored bounded).
async fn cancel(
    session: &Session,
    machine: Uuid,
    process: Process,
    cause: &str,
) -> Result<(), Error> {
    let cause = Some(stored_cause(cause));
    if end(session, machine, process, EndingKind::Cancel(cause)).await? == EndOutcome::Done {
        session.record_work_end(process, WorkResult::Canceled);
    }
    Ok(())
}

/// The cause recorded with work dropped without an ending: its worker panicked or was
/// aborted mid-work.
const DROPPED_CAUSE: &str = "dropped without an ending (its worker panicked or was aborted)";

impl Drop for Work {
    fn drop(&mut self) {
        if self.state != State::Active {
            return;
        }
        tracing::warn!(machine = %self.machine_id, process = %self.process, "work dropped without an ending; canceling it");
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (session, machine, process) = (self.session.clone(), self.machine_id, self.process);
            rt.spawn(async move {
                if let Err(e) = cancel(&session, machine, process, DROPPED_CAUSE).await {
                    tracing::warn!(%machine, error = %e, "canceling dropped work failed; its session is abandoned, so the database releases it when the session expires");
                    session.abandon();
                }
            });
        }
    }
}
