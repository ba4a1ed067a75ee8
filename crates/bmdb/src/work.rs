//! A claimed unit of work and its three endings: finish, fail, cancel (SPEC §4).

use crate::backend::{postgres, sqlite, EndOutcome};
use crate::backoff::{default_interval_seconds, Backoff};
use crate::db::{Mode, TxFuture};
use crate::metrics::WorkResult;
use crate::retry::Retry;
use crate::tx::{dispatch, Tx, TxInner};
use crate::{Error, Process, Session};
use uuid::Uuid;

/// Longest failure cause stored; longer causes are cut (at a character boundary).
pub const MAX_CAUSE_LEN: usize = 2048;

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
    /// history and runs `commit` (which sets tags), all in one transaction. `commit` may run
    /// more than once if the transaction is retried.
    pub async fn finish<F>(&mut self, mut commit: F) -> Result<(), Error>
    where
        F: for<'t> FnMut(&'t mut Tx) -> TxFuture<'t, ()>,
    {
        self.ensure_active()?;
        let (session, machine, process) = (self.session.id(), self.machine_id, self.process);
        let db = self.session.db().clone();
        let mut retry = Retry::new(db.metrics(), self.session.processor());
        loop {
            let attempt = async {
                let mut tx = db.begin(Mode::Write).await?;
                let outcome = dispatch!(tx.finish_work(session, machine, process))?;
                if outcome == EndOutcome::Done {
                    commit(&mut tx).await?;
                    tx.commit().await?;
                } else {
                    tx.rollback().await?;
                }
                Ok(outcome)
            };
            match attempt.await {
                Ok(outcome) => {
                    retry.succeeded();
                    return self.ended(outcome, State::Finished, WorkResult::Finished);
                }
                Err(e) => retry.on_error(e).await?,
            }
        }
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
        let cause = bounded_cause(cause);
        let (session, machine, process) = (self.session.id(), self.machine_id, self.process);
        let db = self.session.db().clone();
        let mut retry = Retry::new(db.metrics(), self.session.processor());
        loop {
            let attempt = async {
                let mut tx = db.begin(Mode::Write).await?;
                let outcome =
                    dispatch!(tx.fail_work(session, machine, process, &cause, interval, delay))?;
                if outcome == EndOutcome::Done {
                    tx.commit().await?;
                } else {
                    tx.rollback().await?;
                }
                Ok::<_, Error>(outcome)
            };
            match attempt.await {
                Ok(outcome) => {
                    retry.succeeded();
                    return self.ended(outcome, State::Failed, WorkResult::Failed);
                }
                Err(e) => retry.on_error(e).await?,
            }
        }
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
                    process: self.process,
                })
            }
        }
    }

    /// Gives the work up without a verdict: releases the lock and writes Canceled history;
    /// backoff is untouched. A no-op after the work already ended. Works on an expired session.
    pub async fn cancel(&mut self) -> Result<(), Error> {
        if self.state != State::Active {
            return Ok(());
        }
        cancel(&self.session, self.machine_id, self.process).await?;
        self.state = State::Canceled;
        Ok(())
    }
}

async fn cancel(session: &Session, machine: Uuid, process: Process) -> Result<(), Error> {
    let id = session.id();
    let released = session
        .db()
        .run(session.processor(), Mode::Write, None, |tx| {
            Box::pin(async move { dispatch!(tx.cancel_work(id, machine, process)) })
        })
        .await?;
    if released {
        session.record_work_end(process, WorkResult::Canceled);
    }
    Ok(())
}

impl Drop for Work {
    fn drop(&mut self) {
        if self.state != State::Active {
            return;
        }
        tracing::warn!(machine = %self.machine_id, process = %self.process, "work dropped without an ending; canceling it");
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (session, machine, process) = (self.session.clone(), self.machine_id, self.process);
            rt.spawn(async move {
                if let Err(e) = cancel(&session, machine, process).await {
                    tracing::warn!(%machine, error = %e, "canceling dropped work failed; it is released when the session ends");
                }
            });
        }
    }
}

fn bounded_cause(cause: &str) -> String {
    if cause.len() <= MAX_CAUSE_LEN {
        return cause.to_string();
    }
    let mut end = MAX_CAUSE_LEN;
    while !cause.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &cause[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causes_are_bounded_on_char_boundaries() {
        assert_eq!(bounded_cause("short"), "short");
        let long = "é".repeat(MAX_CAUSE_LEN);
        let cut = bounded_cause(&long);
        assert!(cut.len() <= MAX_CAUSE_LEN + '…'.len_utf8());
        assert!(cut.ends_with('…'));
    }
}
