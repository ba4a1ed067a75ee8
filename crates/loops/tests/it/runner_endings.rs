//! The machine-loop runner's endings, on both backends: work in progress when the loop is
//! canceled ends as Canceled (no verdict, no backoff), not Failed; and a session that expires in
//! the middle of the loop (another replica collected it) is replaced, the loop going on; and
//! endings written while the workers claim their next machines are all written before the loop
//! ends.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use shepherd_bmdb::testing::{self, all_history, eventually, when};
use shepherd_bmdb::*;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::runner::{self, MachineTask, OnError, RunnerConfig};
use shepherd_tasks::{Outcome, TaskKind, TaskState, Tasks};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A task that marks each machine done (a `machine_agent_started` tag); it blocks forever on
/// machines of `hang`, and on its first machine deletes its own session's row, as another
/// replica's garbage collection would after a partition.
struct Task {
    hang: bool,
    collect_own_session_once: Mutex<bool>,
    /// Machines processed so far (counted before their endings are written).
    processed: Arc<AtomicUsize>,
    /// While set, every machine fails as if its provider could not be reached.
    provider_down: Arc<AtomicBool>,
    /// Machines that failed so.
    failed_for_the_provider: Arc<AtomicUsize>,
    /// Panic on the first machine (a bug in a loop).
    panic_once: Mutex<bool>,
}

#[derive(Debug, thiserror::Error)]
enum TaskError {
    #[error("{0}")]
    Bmdb(#[from] Error),
    /// What a provider whose API cannot be reached makes of every machine.
    #[error("the provider is unavailable")]
    ProviderDown,
}

#[async_trait]
impl MachineTask for Task {
    type Error = TaskError;

    fn retrieval(&self) -> Retrieval {
        Retrieval::AgentStart {
            provider: ProviderKind::Sim,
        }
    }

    async fn process_machine(
        &self,
        session: &Session,
        _machine: Uuid,
    ) -> Result<TagWrites, TaskError> {
        if self.hang {
            std::future::pending::<()>().await;
        }
        if std::mem::take(&mut *self.panic_once.lock().unwrap()) {
            panic!("injected: a bug in the loop");
        }
        if self.provider_down.load(Ordering::SeqCst) {
            self.failed_for_the_provider.fetch_add(1, Ordering::SeqCst);
            return Err(TaskError::ProviderDown);
        }
        let collect = std::mem::take(&mut *self.collect_own_session_once.lock().unwrap());
        if collect {
            let id = session.id();
            session
                .db()
                .transact(move |tx| Box::pin(async move { tx.delete_session_raw(id).await }))
                .await?;
        }
        self.processed.fetch_add(1, Ordering::SeqCst);
        Ok(TagWrites::none().agent_started([1; 32]))
    }

    fn error_policy(&self, e: &TaskError) -> OnError {
        if let TaskError::ProviderDown = e {
            return OnError::Wait;
        }
        OnError::Backoff(Backoff::exponential(
            Duration::from_secs(600),
            Duration::from_secs(600),
            1.0,
        ))
    }
}

impl Task {
    fn new(hang: bool, collect_own_session_once: bool) -> Task {
        Task {
            hang,
            collect_own_session_once: Mutex::new(collect_own_session_once),
            processed: Arc::new(AtomicUsize::new(0)),
            provider_down: Arc::new(AtomicBool::new(false)),
            failed_for_the_provider: Arc::new(AtomicUsize::new(0)),
            panic_once: Mutex::new(false),
        }
    }
}

/// Provisions `machines`, runs the loop with `task` until `done` holds (within 30 s), then
/// cancels it and waits for it to end.
async fn run_until<T, D: std::fmt::Debug>(
    db: &Bmdb,
    machines: usize,
    task: Task,
    what: &str,
    done: impl AsyncFnMut() -> Result<T, D>,
) {
    run_with(db, machines, task, config(), what, done).await
}

/// [`run_until`] with `config`.
async fn run_with<T, D: std::fmt::Debug>(
    db: &Bmdb,
    machines: usize,
    task: Task,
    config: RunnerConfig,
    what: &str,
    done: impl AsyncFnMut() -> Result<T, D>,
) {
    testing::provision(db, machines, ProviderKind::Sim).await;
    let cancel = CancellationToken::new();
    let run = tokio::spawn(runner::run(
        db.clone(),
        Arc::new(task),
        config,
        cancel.clone(),
    ));
    eventually(what, Duration::from_secs(30), done).await;
    cancel.cancel();
    run.await.unwrap();
}

fn config() -> RunnerConfig {
    RunnerConfig::new(
        2,
        RateSpec::new(Duration::from_millis(1), 50),
        SessionConfig::new("runner-test", Processor::ShepherdInitializer)
            .with_interval(Duration::from_secs(1)),
    )
}

async fn cancellation_mid_processing_is_canceled_not_failed(db: Bmdb) {
    run_until(
        &db,
        4,
        Task::new(true, false),
        "both workers holding a machine",
        async || {
            let status = db.status_counts().await.unwrap();
            let held: i64 = status.work.iter().map(|(_, n)| n).sum();
            when(held == 2, held)
        },
    )
    .await;
    let history = all_history(&db).await;
    let events: Vec<WorkEvent> = history.iter().map(|e| e.event).collect();
    assert_eq!(
        events.iter().filter(|e| **e == WorkEvent::Canceled).count(),
        2,
        "{events:?}"
    );
    assert!(!events.contains(&WorkEvent::Failed), "{events:?}");
    let status = db.status_counts().await.unwrap();
    assert!(
        status.work.is_empty() && status.backoffs.is_empty(),
        "{status:?}"
    );
    assert_eq!(status.sessions_live, 0, "sessions closed");
}

async fn an_expired_session_is_replaced_and_the_loop_goes_on(db: Bmdb) {
    run_until(
        &db,
        20,
        Task::new(false, true),
        "every machine taken over",
        async || {
            let started = db.status_counts().await.unwrap().agent_started;
            when(started == 20, started)
        },
    )
    .await;
    let sessions: BTreeSet<Uuid> = all_history(&db)
        .await
        .iter()
        .filter_map(|e| e.session_id)
        .collect();
    assert!(
        sessions.len() >= 3,
        "the collected session was replaced: {} sessions did work",
        sessions.len()
    );
    assert_eq!(
        db.metrics()
            .sessions_expired(Processor::ShepherdInitializer),
        1,
        "one session expired"
    );
}

/// While every machine fails because the provider cannot be reached, the workers release each
/// (Canceled, no backoff, no Failed) and wait longer after each such failure instead of
/// claiming at their full rate; once the provider answers, every machine is taken over.
async fn a_provider_that_cannot_be_reached_is_waited_for_not_charged(db: Bmdb) {
    let task = Task::new(false, false);
    let (down, failed) = (
        task.provider_down.clone(),
        task.failed_for_the_provider.clone(),
    );
    down.store(true, Ordering::SeqCst);
    let started = std::time::Instant::now();
    run_until(&db, 5, task, "every machine taken over", async || {
        // The provider is down for 1.6 s: the workers' waits (0.1, 0.2, 0.4, 0.8 s) leave
        // each about five attempts; at the claim rate (1 ms) there would be hundreds.
        if started.elapsed() > Duration::from_millis(1600) {
            down.store(false, Ordering::SeqCst);
        }
        let n = db.status_counts().await.unwrap().agent_started;
        when(n == 5, n)
    })
    .await;
    let attempts = failed.load(Ordering::SeqCst);
    assert!(
        (1..=14).contains(&attempts),
        "{attempts} attempts while the provider was down"
    );
    let history = all_history(&db).await;
    let events: Vec<(WorkEvent, Option<&str>)> = history
        .iter()
        .map(|e| (e.event, e.cause.as_deref()))
        .collect();
    assert!(
        !events.iter().any(|(e, _)| *e == WorkEvent::Failed),
        "{events:?}"
    );
    // Each attempt released for the provider, with its cause. (Work released for another
    // reason, a claim whose worker was gone by the time it was answered, say, is no attempt.)
    let for_the_provider = events
        .iter()
        .filter(|(e, cause)| {
            *e == WorkEvent::Canceled
                && cause.is_some_and(|c| c.contains("the provider is unavailable"))
        })
        .count();
    assert_eq!(for_the_provider, attempts, "{events:?}");
    assert!(db.status_counts().await.unwrap().backoffs.is_empty());
}

/// A loop whose only worker panics on a machine (a bug) goes on: the worker is started again,
/// and every machine is still taken over (the one it held once its session expired). The
/// loop's task shows the panic: failed, with its message, counted in the metrics.
async fn a_worker_that_panics_is_started_again(db: Bmdb) {
    let task = Task::new(false, false);
    *task.panic_once.lock().unwrap() = true;
    let tasks = Tasks::new(Duration::from_secs(3600));
    let mut registry = prometheus_client::registry::Registry::default();
    tasks.register(&mut registry);
    let one_worker = RunnerConfig {
        parallelism: 1,
        status: tasks.task_of("initializer", TaskKind::Machines),
        ..config()
    };
    run_with(
        &db,
        3,
        task,
        one_worker,
        "every machine taken over",
        async || {
            let started = db.status_counts().await.unwrap().agent_started;
            when(started == 3, started)
        },
    )
    .await;
    let status = tasks.statuses().pop().unwrap();
    assert_eq!(status.count(Outcome::Panicked), 1, "{status:?}");
    assert_eq!(status.count(Outcome::Succeeded), 3, "{status:?}");
    let panic = status.last_panic.clone().expect("the panic is shown");
    assert_eq!(panic.message, "injected: a bug in the loop");
    assert_eq!(
        status.state(chrono::Utc::now(), tasks.stale_after()),
        TaskState::Failed,
        "failed for the panic though the restarted worker finished every machine"
    );
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    assert!(
        text.contains(r#"shepherd_task_passes_total{task="initializer",outcome="panicked"} 1"#),
        "{text}"
    );
}

/// A claim slowed by a busy BMDB (here SQLite's one writer held for a second by another
/// transaction) makes its worker wait as long again before its next claim: the task counts
/// the pause, and the loop goes on.
#[tokio::test]
async fn a_slow_claim_pauses_its_worker() {
    let t = testing::sqlite().await;
    let db = t.db.clone();
    let tasks = Tasks::new(Duration::from_secs(3600));
    let one_worker = RunnerConfig {
        parallelism: 1,
        status: tasks.task_of("initializer", TaskKind::Machines),
        ..RunnerConfig::new(
            1,
            RateSpec::new(Duration::from_millis(1), 50),
            SessionConfig::new("runner-test", Processor::ShepherdInitializer)
                .with_interval(Duration::from_secs(5)),
        )
    };
    let cancel = CancellationToken::new();
    let task = Arc::new(Task::new(false, false));
    let run = tokio::spawn(runner::run(db.clone(), task, one_worker, cancel.clone()));
    // With nothing to claim the worker claims over and over, each claim a write.
    let secs = Duration::from_secs;
    eventually("the worker's session", secs(10), async || {
        let live = db.status_counts().await.unwrap().sessions_live;
        when(live == 1, live)
    })
    .await;
    assert_eq!(tasks.statuses()[0].claim_pauses, 0, "claims are fast");
    db.transact(|_| {
        Box::pin(async {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok(())
        })
    })
    .await
    .unwrap();
    eventually("the slow claim counted", secs(10), async || {
        let pauses = tasks.statuses()[0].claim_pauses;
        when(pauses >= 1, pauses)
    })
    .await;
    testing::provision(&db, 3, ProviderKind::Sim).await;
    eventually("every machine taken over", secs(30), async || {
        let started = db.status_counts().await.unwrap().agent_started;
        when(started == 3, started)
    })
    .await;
    cancel.cancel();
    run.await.unwrap();
}

/// A worker writes its last ending while it claims its next machine; a loop cancelled just
/// after its workers processed the last machines still finishes every one of them (none is
/// canceled by its session's closing) before it ends.
async fn a_loop_cancelled_after_processing_writes_every_ending(db: Bmdb) {
    let task = Task::new(false, false);
    let processed = task.processed.clone();
    run_until(&db, 20, task, "every machine processed", async || {
        let n = processed.load(Ordering::SeqCst);
        when(n == 20, n)
    })
    .await;
    let history = all_history(&db).await;
    for machine in history
        .iter()
        .map(|e| e.machine_id)
        .collect::<BTreeSet<_>>()
    {
        let events: Vec<WorkEvent> = history
            .iter()
            .filter(|e| e.machine_id == machine)
            .map(|e| e.event)
            .collect();
        assert_eq!(
            events,
            [WorkEvent::Started, WorkEvent::Finished],
            "machine {machine}"
        );
    }
    let status = db.status_counts().await.unwrap();
    assert_eq!(status.agent_started, 20, "{status:?}");
    assert!(status.work.is_empty(), "{status:?}");
    assert_eq!(status.sessions_live, 0, "sessions closed");
}

shepherd_bmdb::conformance_tests!(
    cancellation_mid_processing_is_canceled_not_failed,
    an_expired_session_is_replaced_and_the_loop_goes_on,
    a_loop_cancelled_after_processing_writes_every_ending,
    a_provider_that_cannot_be_reached_is_waited_for_not_charged,
    a_worker_that_panics_is_started_again,
);
