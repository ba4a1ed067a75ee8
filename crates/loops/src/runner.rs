//! The control loop runner shared by the Initializer, the Recoverer and later loops (design.md §10):
//! N workers, each with its own session, claim one machine at a time at a rate-limited pace,
//! process it, and finish the work, or end it as the loop's [`MachineTask::error_policy`] says
//! for the error (as kube-runtime's `error_policy` does for a reconcile error). A worker's
//! ending is written while it claims its next machine, one ending in flight per worker, and
//! every ending is written before the worker closes its session.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use shepherd_bmdb::{
    Backoff, Bmdb, Claim, Error as BmdbError, Lease, Processor, Retrieval, Session, SessionConfig,
    TagWrites, Work,
};
use shepherd_retry::{Delays, Streak};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;
use uuid::Uuid;

use crate::limiter::{Limiter, RateSpec};
use shepherd_tasks::{panic_message, Outcome, TaskHandle, TaskKind, Tasks};

/// How a loop ends work whose processing or finishing failed.
#[derive(Debug, Clone, PartialEq)]
pub enum OnError {
    /// End the work as Failed with the error as its cause, and hold the machine back from this
    /// process as `Backoff` says (design.md §4).
    Backoff(Backoff),
    /// Release the machine without a verdict and without a backoff: the failure was not the
    /// machine's (the BMDB was unreachable, a lock was lost), so it may be claimed again.
    Cancel,
    /// Release the machine like [`OnError::Cancel`], and have this worker wait before it
    /// claims again, longer after each such failure in a row (100 ms doubling to 10 s):
    /// something every machine needs (the provider's API) is unavailable, so the next
    /// machine would fail alike and its failure would say nothing about it either.
    Wait,
    /// The session's lease ended before a side effect could start, or cut one off
    /// ([`shepherd_bmdb::Lease`]): the work is canceled with the cause "lease lost" and counted
    /// in `shepherd_work_fenced_total`.
    Fenced,
}

/// How a machine's processing ended, as the runner saw it.
enum Processed<T, E> {
    /// `process_machine` returned.
    Done(Result<T, E>),
    /// The loop was cancelled first (shutdown).
    Shutdown,
    /// The session's lease ended first: the processing was dropped where it stood.
    Fenced,
}

/// The cause recorded with work canceled because its loop shut down (a SIGTERM, say): it
/// names the loop; the entry's session names the process and its host.
fn shutdown_cause(processor: Processor) -> String {
    format!("shutting down: {} stopped", processor.label())
}

/// What a control loop does with one machine.
#[async_trait]
pub trait MachineTask: Send + Sync + 'static {
    /// Why processing a machine failed. A failed finish (the BMDB, or its tags refused) is
    /// converted into it too, so that one policy decides every ending.
    type Error: std::fmt::Display + From<BmdbError> + Send + Sync + 'static;
    /// Which machines the loop takes; the rule also names the work process (and lock) and
    /// the metrics label of the loop's sessions.
    fn retrieval(&self) -> Retrieval;
    /// Whether the loop may claim now (a recoverer that cannot reboot anything claims nothing),
    /// given the database it claims from.
    async fn active(&self, _db: &Bmdb) -> bool {
        true
    }
    /// Processes one claimed machine; the returned tags are written with its finish.
    async fn process_machine(
        &self,
        session: &Session,
        machine: Uuid,
    ) -> Result<TagWrites, Self::Error>;
    /// How to end the work after `error`.
    fn error_policy(&self, error: &Self::Error) -> OnError;
    /// Whether `error` is an expected stage of a machine's way rather than a fault (a machine
    /// its BMC just booted that does not answer yet): logged at debug, not as a warning. Its
    /// work ends as [`MachineTask::error_policy`] says all the same.
    fn is_expected(&self, _error: &Self::Error) -> bool {
        false
    }
}

/// Runner settings (design.md §17 defaults: one worker, `250ms,8`, 5 s sessions).
#[derive(Debug, Clone)]
pub struct RunnerConfig {
    /// Independent workers, each with its own session.
    pub parallelism: usize,
    /// Pace of claim attempts, shared by the loop's workers.
    pub db_rate: RateSpec,
    /// Session settings (component name, interval).
    pub session: SessionConfig,
    /// Where the loop reports each machine's ending and its workers' panics.
    pub status: TaskHandle,
}

impl RunnerConfig {
    /// `parallelism` workers claiming at `db_rate`, their sessions as `session` says.
    pub fn new(parallelism: usize, db_rate: RateSpec, session: SessionConfig) -> Self {
        let status = Tasks::default().task_of(session.processor.label(), TaskKind::Machines);
        RunnerConfig {
            parallelism,
            db_rate,
            session,
            status,
        }
    }
}

/// Runs `task` until `cancel`; returns once every worker stopped and closed its session. Work
/// held at cancellation is canceled (not failed), so no backoff is charged for the shutdown.
pub async fn run<T: MachineTask>(
    db: Bmdb,
    task: Arc<T>,
    config: RunnerConfig,
    cancel: CancellationToken,
) {
    let limiter = Arc::new(Limiter::new(config.db_rate));
    let session = SessionConfig {
        processor: task.retrieval().processor(),
        ..config.session
    };
    let workers: Vec<_> = (0..config.parallelism.max(1))
        .map(|n| {
            let worker = Worker {
                n,
                db: db.clone(),
                task: task.clone(),
                limiter: limiter.clone(),
                session: session.clone(),
                status: config.status.clone(),
            };
            tokio::spawn(supervised(worker, cancel.clone()))
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
}

/// One worker of a machine loop: what it claims with and reports to.
struct Worker<T> {
    n: usize,
    db: Bmdb,
    task: Arc<T>,
    limiter: Arc<Limiter>,
    session: SessionConfig,
    status: TaskHandle,
}

// By hand: `derive(Clone)` would ask `T: Clone`, which sharing the task through an `Arc`
// does not need.
impl<T> Clone for Worker<T> {
    fn clone(&self) -> Self {
        Worker {
            n: self.n,
            db: self.db.clone(),
            task: self.task.clone(),
            limiter: self.limiter.clone(),
            session: self.session.clone(),
            status: self.status.clone(),
        }
    }
}

/// Runs `worker` until `cancel`, starting it again if it panics: a worker that died would
/// leave the loop one worker short without a trace. The panic is logged with its message,
/// reported to the loop's task (which then shows failed), and the worker restarts after the
/// error delays (100 ms doubling to 10 s, reset by a worker that ran a minute). The machine
/// it held is released when its session expires.
async fn supervised<T: MachineTask>(worker: Worker<T>, cancel: CancellationToken) {
    let mut panics = Streak::new(ERROR_DELAYS);
    loop {
        let started = std::time::Instant::now();
        let Err(e) = tokio::spawn(work_loop(worker.clone(), cancel.clone())).await else {
            return;
        };
        if !e.is_panic() || cancel.is_cancelled() {
            return;
        }
        let message = panic_message(&*e.into_panic());
        if started.elapsed() > Duration::from_secs(60) {
            panics.succeeded();
        }
        let wait = panics.failed();
        let n = worker.n;
        tracing::error!(worker = n, panic = %message, ?wait, "a worker panicked; starting it again");
        worker.status.ended(Outcome::Panicked, message);
        tokio::select! { _ = cancel.cancelled() => return, _ = tokio::time::sleep(wait) => {} }
    }
}

/// Ends `work` after `failure` as the task's error policy says.
/// Returns how the task reports it: a backoff is the machine's failure; a release without a
/// verdict (an outage, a lost lease) is a wait.
async fn end_failed<T: MachineTask>(
    work: &mut Work,
    lease: &Lease,
    task: &T,
    failure: &T::Error,
) -> Outcome {
    let cause = format!("{failure:#}");
    let (ended, outcome) = match task.error_policy(failure) {
        OnError::Backoff(backoff) => (
            write(work, lease, Ending::Fail(&backoff, &cause)).await,
            Outcome::Failed,
        ),
        OnError::Cancel | OnError::Wait => (
            write(work, lease, Ending::Cancel(&cause)).await,
            Outcome::Waited,
        ),
        OnError::Fenced => (work.fenced().await, Outcome::Waited),
    };
    if let Err(e) = ended {
        tracing::warn!(error = %e, "ending failed work failed");
    }
    outcome
}

/// An ending the runner writes.
enum Ending<'a> {
    Finish(&'a TagWrites),
    Fail(&'a Backoff, &'a str),
    Cancel(&'a str),
}

/// Writes `ending` until it is written, fails for good, or the session's lease ends: an
/// ending the database could not write for the moment (an outage, a full disk) is tried again
/// after the worker's error delays while the lease holds, so that the machine's work is not
/// left held by a session that lives on.
async fn write(work: &mut Work, lease: &Lease, ending: Ending<'_>) -> Result<(), BmdbError> {
    let mut errors = Streak::new(ERROR_DELAYS);
    loop {
        let written = match ending {
            Ending::Finish(tags) => work.finish(tags.clone()).await,
            Ending::Fail(backoff, cause) => work.fail(Some(backoff), cause).await,
            Ending::Cancel(cause) => work.cancel(cause).await,
        };
        match written {
            Err(e) if is_gone(&e) => return Err(e),
            Err(e) if e.is_transient() => {
                let wait = errors.failed();
                match lease.left() {
                    Ok(left) if left > wait => tokio::time::sleep(wait).await,
                    _ => return Err(e),
                }
            }
            other => return other,
        }
    }
}

/// Waits of a worker after consecutive errors (a claim failed, no session could be started):
/// from 100 ms, doubling, at most 10 s.
const ERROR_DELAYS: Delays = Delays::new(Duration::from_millis(100), Duration::from_secs(10));

/// A claim slower than this means the BMDB is busy (its commits wait, or its one SQLite writer
/// is taken by more urgent writes): the worker then waits as long again before its next claim.
const SLOW_CLAIM: Duration = Duration::from_millis(250);

/// The longest a worker waits after a slow claim.
const MAX_CLAIM_PAUSE: Duration = Duration::from_secs(10);

/// How long a worker waits before its next claim when its last claim took `took`: nothing
/// while the BMDB answers fast; as long again, at most [`MAX_CLAIM_PAUSE`], when it does not.
/// With every worker doing so, the loops' claims on a slow BMDB halve at least, and the
/// writes that matter more (keep-alives, heartbeats) get through.
fn pause_after_claim(took: Duration) -> Duration {
    if took < SLOW_CLAIM {
        Duration::ZERO
    } else {
        took.min(MAX_CLAIM_PAUSE)
    }
}

async fn work_loop<T: MachineTask>(worker: Worker<T>, cancel: CancellationToken) {
    let Worker {
        n,
        db,
        task,
        limiter,
        session: session_config,
        status,
    } = worker;
    let mut session: Option<Session> = None;
    let mut errors = Streak::new(ERROR_DELAYS);
    // The ending of the worker's last machine, written while the worker claims its next one.
    let mut ending: Option<tokio::task::JoinHandle<()>> = None;
    let mut pause = Duration::ZERO;
    loop {
        tokio::select! {
            biased; // a cancelled loop must not claim more work
            _ = cancel.cancelled() => break,
            _ = async { tokio::time::sleep(pause).await; limiter.wait().await } => {}
        }
        if !task.active(&db).await {
            status.alive();
            continue;
        }
        let s = match db.live_session(&session_config, session.take()).await {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(worker = n, error = %e, "cannot start a session");
                tokio::select! { _ = cancel.cancelled() => break, _ = tokio::time::sleep(errors.failed()) => {} }
                continue;
            }
        };
        let retrieval = task.retrieval();
        let asked = tokio::time::Instant::now();
        let claimed = s.work(retrieval.process(), retrieval).await;
        pause = pause_after_claim(asked.elapsed());
        if !pause.is_zero() {
            status.claim_paused();
        }
        match claimed {
            Ok(Claim::Work(work)) => {
                status.started();
                let machine = work.machine_id();
                // The task records the provider id once it has read the machine's tags. At the
                // highest level so that the context is there whatever level the logs are
                // filtered at (a span's level only decides whether it exists).
                let span = tracing::error_span!(
                    "work",
                    %machine,
                    provider_id = tracing::field::Empty,
                    process = %retrieval.process(),
                );
                // Raced against the lease as well as the shutdown: a machine task never runs on
                // past its session's lease, whatever step it is in.
                let lease = s.lease();
                let outcome = async {
                    tokio::select! {
                        biased;
                        _ = lease.lost() => Processed::Fenced,
                        _ = cancel.cancelled() => Processed::Shutdown,
                        r = task.process_machine(&s, machine) => Processed::Done(r),
                    }
                }
                .instrument(span.clone())
                .await;
                // One ending in flight per worker: the previous one is written by now (it had
                // this whole machine's processing to be).
                if let Some(previous) = ending.take() {
                    written(previous).await;
                }
                let waits = matches!(&outcome, Processed::Done(Err(e)) if task.error_policy(e) == OnError::Wait);
                let end = end_work(work, lease, task.clone(), outcome, status.clone());
                let end = end.instrument(span);
                ending = Some(tokio::spawn(end));
                if !waits {
                    errors.succeeded();
                } else {
                    let wait = errors.failed();
                    tracing::debug!(
                        worker = n,
                        ?wait,
                        "a dependency of every machine is unavailable; waiting"
                    );
                    tokio::select! { _ = cancel.cancelled() => { session = Some(s); break }, _ = tokio::time::sleep(wait) => {} }
                }
            }
            Ok(Claim::NothingToDo) | Ok(Claim::Conflict) => {
                status.alive();
                errors.succeeded();
            }
            Err(BmdbError::SessionExpired) => {
                tracing::warn!(worker = n, "session expired; starting a new one");
                continue;
            }
            Err(e) => {
                tracing::warn!(worker = n, error = %e, "claiming work failed");
                tokio::select! { _ = cancel.cancelled() => { session = Some(s); break }, _ = tokio::time::sleep(errors.failed()) => {} }
            }
        }
        session = Some(s);
    }
    if let Some(last) = ending {
        written(last).await;
    }
    if let Some(s) = session {
        let _ = s.close().await;
    }
}

/// Waits for an ending's task. A panic in it is the worker's own, as it was when the worker
/// wrote its endings itself.
async fn written(ending: tokio::task::JoinHandle<()>) {
    if let Err(e) = ending.await {
        if e.is_panic() {
            std::panic::resume_unwind(e.into_panic());
        }
    }
}

/// How a machine's processing came out, before its work is ended: reported to the loop's task
/// as it is, or a failure the task's error policy decides on (and that decision reported).
enum Ended<E> {
    Reported(Outcome, String),
    Failed(E),
}

/// Ends a claimed machine's work after its processing: finished with its tags, canceled if
/// the loop was cancelled first, fenced if the lease ended first, or as the task's error
/// policy says.
/// Run in a task of its own, so that the worker claims its next machine meanwhile: a worker's
/// claim and its last ending then share the time one of them took, and the database gathers
/// more of the loop's claims and endings into each batch.
async fn end_work<T: MachineTask>(
    mut work: Work,
    lease: Lease,
    task: Arc<T>,
    outcome: Processed<TagWrites, T::Error>,
    status: TaskHandle,
) {
    let machine = work.machine_id();
    let ended = match outcome {
        Processed::Shutdown => {
            let cause = shutdown_cause(task.retrieval().processor());
            if let Err(e) = work.cancel(&cause).await {
                tracing::warn!(error = %e, "canceling work failed");
            }
            Ended::Reported(Outcome::Waited, format!("{machine}: {cause}"))
        }
        Processed::Fenced => {
            tracing::warn!("the session's lease ended during processing; stopped");
            if let Err(e) = work.fenced().await {
                tracing::warn!(error = %e, "canceling fenced work failed");
            }
            Ended::Reported(Outcome::Waited, format!("{machine}: lease lost"))
        }
        Processed::Done(Ok(tags)) => match write(&mut work, &lease, Ending::Finish(&tags)).await {
            Ok(()) => Ended::Reported(Outcome::Succeeded, format!("{machine}: finished")),
            // The lock or the session is gone: there is nothing left to end. Or still
            // unavailable when the lease ended: given up below.
            Err(e) if e.is_transient() || is_gone(&e) => {
                tracing::warn!(error = %e, "finishing work failed");
                let summary = format!("{machine}: finishing failed: {e}");
                Ended::Reported(Outcome::Waited, summary)
            }
            Err(e) => {
                tracing::warn!(error = %e, "finishing work failed");
                Ended::Failed(T::Error::from(e))
            }
        },
        Processed::Done(Err(e)) => {
            if task.is_expected(&e) {
                tracing::debug!(error = %format!("{e:#}"), "not yet");
            } else {
                tracing::warn!(error = %format!("{e:#}"), "processing failed");
            }
            Ended::Failed(e)
        }
    };
    let (outcome, summary) = match ended {
        Ended::Failed(failure) => {
            let outcome = end_failed(&mut work, &lease, &*task, &failure).await;
            (outcome, format!("{machine}: {failure:#}"))
        }
        Ended::Reported(outcome, summary) => (outcome, summary),
    };
    status.ended(outcome, summary);
    if work.is_active() {
        work.give_up();
    }
}

/// Whether `e` says the work's lock or session is gone, so that nothing is left to end.
fn is_gone(e: &BmdbError) -> bool {
    matches!(e, BmdbError::SessionExpired | BmdbError::WorkLost { .. })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_claim_makes_its_worker_wait_as_long_again_up_to_a_cap() {
        assert_eq!(pause_after_claim(Duration::from_millis(20)), Duration::ZERO);
        assert_eq!(
            pause_after_claim(Duration::from_secs(2)),
            Duration::from_secs(2)
        );
        assert_eq!(pause_after_claim(Duration::from_secs(60)), MAX_CLAIM_PAUSE);
    }
}
