//! What a process's background tasks did last, as omicron's background tasks report it. Every
//! background activity is a task with a typed [`TaskStatus`]: the periodic loops (the
//! provisioner, the updater, history retention, the fleet statistics, the schema watch, the
//! server's writer of token uses and its heartbeat reports), whose unit of work is a pass; the machine loops (the
//! initializer, the recoverer with its brake), whose unit is one machine's work; and the BMaaS
//! server's heartbeat group commit and audit-trail writer, whose unit is a batch. Units run
//! under [`driver`] (or the machine runner and the periodic passes, which do the same), so a
//! panic is caught, shown and followed by the next unit. (The listeners, whose units are
//! connections, are not tasks.) A status says when the last unit started and ended, how it
//! ended, a short summary of what it did or why it failed, counts by outcome, and the last
//! panic. The web UI's `/tasks` and `/tasks.json`, the operator API's `/api/v1/tasks` and
//! `shepherd tasks` show them, and they are exported as metrics:
//!
//! - `shepherd_task_passes_total{task, outcome}`: units of work by how they ended (a panic is
//!   the outcome `panicked`);
//! - `shepherd_task_started_timestamp_seconds{task}`: when the task started in this process;
//! - `shepherd_task_last_success_timestamp_seconds{task}`: when the task last succeeded
//!   (absent until it does); a machine loop that found nothing to claim counts as succeeding;
//! - `shepherd_task_stale_after_seconds{task}`: how long without a success is too long
//!   (`--task-stale-after`).
//!
//! `deploy/prometheus/shepherd-alerts.yml` alerts on a stale task and on a panic in any task.
//!
//! This crate sits above the BMDB and below everything that runs tasks (the loops, the BMaaS
//! server, the operator surfaces, the binary), so each can report to one registry; the BMDB
//! reports its heartbeat batches through its own `HeartbeatBatchReports`, which a
//! [`TaskHandle`] implements.

pub mod driver;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// How long a task may go without a successful pass before it counts as stale, by default.
pub const DEFAULT_STALE_AFTER: Duration = Duration::from_secs(3600);

/// How a pass ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The pass did its work.
    Succeeded,
    /// The BMDB was unavailable (down, failing over, the session lost): the pass stopped and
    /// the next one tries again. No failure of the task's own.
    Waited,
    /// The pass failed for a reason of its own (the provider, a refused discrepancy, bad data).
    Failed,
    /// The code panicked: a defect. The pass or the worker is started again after a bounded
    /// wait, and the task shows failed for its stale-after time.
    Panicked,
}

impl Outcome {
    /// Every outcome, for series present at zero.
    pub const ALL: [Outcome; 4] = [
        Outcome::Succeeded,
        Outcome::Waited,
        Outcome::Failed,
        Outcome::Panicked,
    ];

    /// The metrics label and the word the web UI shows.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Waited => "waited",
            Outcome::Failed => "failed",
            Outcome::Panicked => "panicked",
        }
    }

    /// How a unit that failed with the BMDB's `error` ended: waited when the database was
    /// unavailable (the next unit tries again), failed otherwise.
    pub fn of_bmdb_error(error: &shepherd_bmdb::Error) -> Outcome {
        match error.is_transient() {
            true => Outcome::Waited,
            false => Outcome::Failed,
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What a task's unit of work is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskKind {
    /// One pass at a time (the provisioner, the updater, retention, fleet statistics).
    Periodic,
    /// One machine's work per unit, by several workers (the initializer, the recoverer).
    Machines,
    /// One batch of concurrent callers' writes per unit (the BMaaS server's heartbeat group
    /// commit): driven by its callers, not by a timer. Without callers (no agent heartbeats
    /// yet) it has nothing to do, so it is never stale; its state is its last batch's.
    Batches,
}

impl TaskKind {
    /// The word the web UI and the JSON show.
    pub fn label(self) -> &'static str {
        match self {
            TaskKind::Periodic => "periodic",
            TaskKind::Machines => "machines",
            TaskKind::Batches => "batches",
        }
    }
}

/// A task's state as an operator reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TaskState {
    /// Its last unit succeeded, or it has done nothing wrong yet.
    Ok,
    /// Its last unit stopped for an outage (the BMDB, the provider): waiting it out.
    Waiting,
    /// Its last pass failed, or it panicked within its stale-after time. (A machine loop's
    /// failed machine is the machine's failure, not the task's.)
    Failed,
    /// It has gone longer than its stale-after time without a success.
    Stale,
}

impl TaskState {
    /// The word the web UI, the JSON and `shepherd tasks` show.
    pub fn label(self) -> &'static str {
        match self {
            TaskState::Ok => "ok",
            TaskState::Waiting => "waiting",
            TaskState::Failed => "failed",
            TaskState::Stale => "stale",
        }
    }
}

/// A panic in a task: when, and its message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Panic {
    /// When it happened.
    pub at: DateTime<Utc>,
    /// The panic's message.
    pub message: String,
}

/// The message a panic carried (`panic!("…")` gives a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// The status of one background task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStatus {
    /// The task's name (`provisioner`, `fleet-statistics` …).
    pub name: &'static str,
    /// Whether its unit of work is a pass or a machine.
    pub kind: TaskKind,
    /// When the task started in this process.
    pub started: DateTime<Utc>,
    /// Units of work (passes, or machines) ended so far.
    pub passes: u64,
    /// Units of work ended so far, by outcome (see [`TaskStatus::count`]).
    pub by_outcome: [u64; Outcome::ALL.len()],
    /// Whether a unit of work is under way (for a machine loop, the last one started has not
    /// ended yet).
    pub running: bool,
    /// When the last pass started.
    pub last_start: Option<DateTime<Utc>>,
    /// When the last pass ended.
    pub last_end: Option<DateTime<Utc>>,
    /// How the last pass ended.
    pub last_outcome: Option<Outcome>,
    /// What the last pass did, or why it failed (one line).
    pub last_summary: String,
    /// When a pass last succeeded.
    pub last_success: Option<DateTime<Utc>>,
    /// The last panic, if the task ever panicked.
    pub last_panic: Option<Panic>,
    /// Claims so slow (the BMDB busy) that a worker waited as long again before its next.
    pub claim_pauses: u64,
}

impl TaskStatus {
    /// Units of work that ended with `outcome`.
    pub fn count(&self, outcome: Outcome) -> u64 {
        self.by_outcome[outcome.index()]
    }

    /// The task's state at `now`: failed if its last pass failed or it panicked within
    /// `stale_after` (a panic stays visible after the restarted work goes on), else stale,
    /// waiting or ok.
    pub fn state(&self, now: DateTime<Utc>, stale_after: Duration) -> TaskState {
        let recent_panic = self.last_panic.as_ref().is_some_and(|p| {
            chrono::Duration::from_std(stale_after).is_ok_and(|d| now - p.at <= d)
        });
        // A machine loop's failed unit is a machine's failure (counted, and backed off), not
        // the loop's; only a pass's failure is the task's own.
        let failed = match self.kind {
            TaskKind::Periodic | TaskKind::Batches => {
                matches!(self.last_outcome, Some(Outcome::Failed | Outcome::Panicked))
            }
            TaskKind::Machines => self.last_outcome == Some(Outcome::Panicked),
        };
        if failed || recent_panic {
            TaskState::Failed
        } else if self.is_stale(now, stale_after) {
            TaskState::Stale
        } else if self.last_outcome == Some(Outcome::Waited) {
            TaskState::Waiting
        } else {
            TaskState::Ok
        }
    }

    /// Whether the task has gone without a successful pass (counted from its start) for
    /// longer than `stale_after` at `now`.
    pub fn is_stale(&self, now: DateTime<Utc>, stale_after: Duration) -> bool {
        if self.kind == TaskKind::Batches {
            return false;
        }
        let since = self.last_success.unwrap_or(self.started);
        chrono::Duration::from_std(stale_after).is_ok_and(|d| now - since > d)
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TaskLabel {
    task: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PassLabels {
    task: &'static str,
    outcome: &'static str,
}

/// The tasks' metrics; clones share values.
#[derive(Debug, Clone, Default)]
struct TaskMetrics {
    passes: Family<PassLabels, Counter>,
    started: Family<TaskLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    last_success: Family<TaskLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
    stale_after: Family<TaskLabel, Gauge<f64, std::sync::atomic::AtomicU64>>,
}

/// The background tasks of one process. Cheap to clone; clones share the statuses.
#[derive(Debug, Clone)]
pub struct Tasks {
    statuses: Arc<Mutex<BTreeMap<&'static str, TaskStatus>>>,
    metrics: TaskMetrics,
    stale_after: Duration,
}

impl Default for Tasks {
    fn default() -> Self {
        Tasks::new(DEFAULT_STALE_AFTER)
    }
}

impl Tasks {
    /// No tasks yet; a task counts as stale after `stale_after` without a successful pass.
    pub fn new(stale_after: Duration) -> Self {
        Tasks {
            statuses: Arc::default(),
            metrics: TaskMetrics::default(),
            stale_after,
        }
    }

    /// How long without a successful pass makes a task stale.
    pub fn stale_after(&self) -> Duration {
        self.stale_after
    }

    /// Adds the tasks' metrics to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        let m = &self.metrics;
        registry.register(
            "shepherd_task_passes",
            "Passes of this process's background tasks, by task and outcome (succeeded; waited: the BMDB was unavailable; failed)",
            m.passes.clone(),
        );
        registry.register(
            "shepherd_task_started_timestamp_seconds",
            "When each background task started in this process",
            m.started.clone(),
        );
        registry.register(
            "shepherd_task_last_success_timestamp_seconds",
            "When each background task last finished a pass successfully (absent until one does)",
            m.last_success.clone(),
        );
        registry.register(
            "shepherd_task_stale_after_seconds",
            "How long a background task may go without a successful pass before it is stale (--task-stale-after)",
            m.stale_after.clone(),
        );
    }

    /// Starts tracking periodic task `name` (again, if it was tracked before) and returns the
    /// handle its loop reports through.
    pub fn task(&self, name: &'static str) -> TaskHandle {
        self.task_of(name, TaskKind::Periodic)
    }

    /// Starts tracking task `name` whose units of work are `kind`, as [`Tasks::task`] does.
    pub fn task_of(&self, name: &'static str, kind: TaskKind) -> TaskHandle {
        let now = Utc::now();
        let label = TaskLabel { task: name };
        self.metrics.started.get_or_create(&label).set(unix(now));
        // No stale-after series for a task that is never stale, so the alert leaves it out.
        if kind != TaskKind::Batches {
            self.metrics
                .stale_after
                .get_or_create(&label)
                .set(self.stale_after.as_secs_f64());
        }
        for outcome in Outcome::ALL {
            let _ = self.metrics.passes.get_or_create(&PassLabels {
                task: name,
                outcome: outcome.label(),
            });
        }
        self.statuses.lock().expect("task statuses").insert(
            name,
            TaskStatus {
                name,
                kind,
                started: now,
                passes: 0,
                by_outcome: [0; Outcome::ALL.len()],
                running: false,
                last_start: None,
                last_end: None,
                last_outcome: None,
                last_summary: String::new(),
                last_success: None,
                last_panic: None,
                claim_pauses: 0,
            },
        );
        TaskHandle {
            name,
            tasks: self.clone(),
        }
    }

    /// Every task's status, by name.
    pub fn statuses(&self) -> Vec<TaskStatus> {
        self.statuses
            .lock()
            .expect("task statuses")
            .values()
            .cloned()
            .collect()
    }

    fn update(&self, name: &'static str, change: impl FnOnce(&mut TaskStatus)) {
        if let Some(status) = self.statuses.lock().expect("task statuses").get_mut(name) {
            change(status);
        }
    }
}

/// Seconds since the Unix epoch.
fn unix(t: DateTime<Utc>) -> f64 {
    t.timestamp_micros() as f64 / 1e6
}

/// The handle one task's loop reports its passes through.
#[derive(Debug, Clone)]
pub struct TaskHandle {
    name: &'static str,
    tasks: Tasks,
}

impl TaskHandle {
    /// The task's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// A pass starts.
    pub fn started(&self) {
        self.tasks.update(self.name, |s| {
            s.running = true;
            s.last_start = Some(Utc::now());
        });
    }

    /// The pass ended with `outcome`; `summary` says what it did or why it failed.
    pub fn ended(&self, outcome: Outcome, summary: impl Into<String>) {
        let now = Utc::now();
        let summary = summary.into();
        self.tasks.update(self.name, |s| {
            s.running = false;
            s.passes += 1;
            s.by_outcome[outcome.index()] += 1;
            s.last_end = Some(now);
            s.last_outcome = Some(outcome);
            if outcome == Outcome::Panicked {
                s.last_panic = Some(Panic {
                    at: now,
                    message: summary.clone(),
                });
            }
            s.last_summary = summary;
            if outcome == Outcome::Succeeded {
                s.last_success = Some(now);
            }
        });
        let metrics = &self.tasks.metrics;
        metrics
            .passes
            .get_or_create(&PassLabels {
                task: self.name,
                outcome: outcome.label(),
            })
            .inc();
        if outcome == Outcome::Succeeded {
            self.set_last_success(now);
        }
    }

    /// A machine loop's worker found its claim slow and waits before the next one.
    pub fn claim_paused(&self) {
        self.tasks.update(self.name, |s| s.claim_pauses += 1);
    }

    /// The task is turning without a unit of work to end: a machine loop's worker found
    /// nothing to claim, or its brake holds it. It counts as a success for staleness, and
    /// changes nothing else.
    pub fn alive(&self) {
        let now = Utc::now();
        self.tasks.update(self.name, |s| s.last_success = Some(now));
        self.set_last_success(now);
    }

    fn set_last_success(&self, now: DateTime<Utc>) {
        self.tasks
            .metrics
            .last_success
            .get_or_create(&TaskLabel { task: self.name })
            .set(unix(now));
    }
}

/// The heartbeat group commit reports each batch to its task: a written batch succeeded; one
/// that could not be written waited if the BMDB was unavailable or the session gone (the
/// agents retry), and failed otherwise.
impl shepherd_bmdb::HeartbeatBatchReports for TaskHandle {
    fn started(&self) {
        TaskHandle::started(self);
    }

    fn written(&self, members: usize) {
        self.ended(
            Outcome::Succeeded,
            format!("{members} heartbeats written in one transaction"),
        );
    }

    fn failed(&self, members: usize, error: &shepherd_bmdb::Error) {
        self.ended(
            Outcome::of_bmdb_error(error),
            format!("{members} heartbeats not written: {error}"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pass_is_recorded_with_its_outcome_and_summary() {
        let tasks = Tasks::new(Duration::from_secs(60));
        let t = tasks.task("provisioner");
        let fresh = tasks.statuses().pop().unwrap();
        assert_eq!((fresh.passes, fresh.last_outcome), (0, None));
        t.started();
        assert!(tasks.statuses()[0].running);
        t.ended(Outcome::Failed, "the provider refused");
        let s = tasks.statuses().pop().unwrap();
        assert_eq!(s.last_outcome, Some(Outcome::Failed));
        assert_eq!(s.last_summary, "the provider refused");
        assert_eq!(s.last_success, None);
        assert!(!s.running);
        t.started();
        t.ended(Outcome::Succeeded, "created 2");
        let s = tasks.statuses().pop().unwrap();
        assert_eq!((s.passes, s.last_outcome), (2, Some(Outcome::Succeeded)));
        assert_eq!(
            (s.count(Outcome::Failed), s.count(Outcome::Succeeded)),
            (1, 1)
        );
        assert!(s.last_success.is_some());
    }

    #[test]
    fn a_panic_shows_failed_for_the_stale_after_time_though_work_goes_on() {
        let stale_after = Duration::from_secs(60);
        let tasks = Tasks::new(stale_after);
        let t = tasks.task_of("initializer", TaskKind::Machines);
        t.alive();
        t.ended(Outcome::Failed, "m: connecting: refused");
        let s = tasks.statuses().pop().unwrap();
        assert_eq!(
            s.state(Utc::now(), stale_after),
            TaskState::Ok,
            "a machine's failure is not the machine loop's"
        );
        t.ended(Outcome::Panicked, "index out of bounds");
        t.ended(Outcome::Succeeded, "finished a machine");
        let s = tasks.statuses().pop().unwrap();
        let panic = s.last_panic.clone().unwrap();
        assert_eq!(panic.message, "index out of bounds");
        assert_eq!(
            (s.count(Outcome::Panicked), s.count(Outcome::Failed)),
            (1, 1)
        );
        assert_eq!(s.state(panic.at, stale_after), TaskState::Failed);
        let later = panic.at + chrono::Duration::seconds(61);
        t.alive();
        assert_eq!(
            tasks.statuses()[0].state(later, stale_after),
            TaskState::Stale,
            "61 s after the last success it is stale, and no longer failed for the panic"
        );
    }

    #[test]
    fn heartbeat_batches_are_units_of_their_task_and_only_a_batch_of_its_own_fails_it() {
        use shepherd_bmdb::{Error, HeartbeatBatchReports};
        let stale_after = Duration::from_secs(60);
        let tasks = Tasks::new(stale_after);
        let t = tasks.task_of("heartbeat-batches", TaskKind::Batches);
        HeartbeatBatchReports::started(&t);
        assert!(tasks.statuses()[0].running);
        t.written(12);
        let s = tasks.statuses().pop().unwrap();
        assert_eq!(
            (s.kind.label(), s.count(Outcome::Succeeded)),
            ("batches", 1)
        );
        assert_eq!(s.last_summary, "12 heartbeats written in one transaction");
        assert_eq!(s.state(Utc::now(), stale_after), TaskState::Ok);
        let outage = Error::Unavailable {
            target: "db".into(),
            cause: "refused".into(),
        };
        t.failed(3, &outage);
        let s = tasks.statuses().pop().unwrap();
        assert_eq!(s.state(Utc::now(), stale_after), TaskState::Waiting);
        assert!(
            s.last_summary.starts_with("3 heartbeats not written: "),
            "{}",
            s.last_summary
        );
        t.failed(2, &Error::WorkAlreadyDone("a defect"));
        let s = tasks.statuses().pop().unwrap();
        assert_eq!(s.state(Utc::now(), stale_after), TaskState::Failed);
        assert_eq!(
            (s.count(Outcome::Waited), s.count(Outcome::Failed), s.passes),
            (1, 1, 3)
        );
        let next_day = s.started + chrono::Duration::days(1);
        assert!(
            !s.is_stale(next_day, stale_after),
            "no heartbeats is nothing to do"
        );
    }

    #[test]
    fn a_task_is_stale_once_it_went_too_long_without_a_success() {
        let tasks = Tasks::new(Duration::from_secs(60));
        let t = tasks.task("updater");
        let s = tasks.statuses().pop().unwrap();
        assert!(!s.is_stale(
            s.started + chrono::Duration::seconds(59),
            tasks.stale_after()
        ));
        assert!(s.is_stale(
            s.started + chrono::Duration::seconds(61),
            tasks.stale_after()
        ));
        t.ended(Outcome::Succeeded, "");
        let s = tasks.statuses().pop().unwrap();
        let success = s.last_success.unwrap();
        assert!(!s.is_stale(success + chrono::Duration::seconds(59), tasks.stale_after()));
    }

    #[test]
    fn metrics_carry_every_outcome_and_the_last_success() {
        let tasks = Tasks::new(Duration::from_secs(90));
        let mut registry = Registry::default();
        tasks.register(&mut registry);
        let t = tasks.task("retention");
        t.ended(Outcome::Waited, "the BMDB is unavailable");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        for want in [
            r#"shepherd_task_passes_total{task="retention",outcome="waited"} 1"#,
            r#"shepherd_task_passes_total{task="retention",outcome="succeeded"} 0"#,
            r#"shepherd_task_stale_after_seconds{task="retention"} 90.0"#,
            "shepherd_task_started_timestamp_seconds{task=\"retention\"}",
        ] {
            assert!(text.contains(want), "{want} missing in\n{text}");
        }
        assert!(!text.contains("shepherd_task_last_success_timestamp_seconds{"));
        t.ended(Outcome::Succeeded, "pruned 3");
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("shepherd_task_last_success_timestamp_seconds{task=\"retention\"}"));
    }
}
