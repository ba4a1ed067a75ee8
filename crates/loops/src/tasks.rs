//! What a process's background tasks did last, as omicron's background tasks report it: each
//! periodic task (the provisioner, the updater, history retention, the fleet statistics, the
//! recovery brake) keeps a typed [`TaskStatus`] — when its last pass started and ended, how it
//! ended, and a short summary of what it did or why it failed. The web UI's `/tasks` page
//! shows them, and they are exported as metrics:
//!
//! - `shepherd_task_passes_total{task, outcome}`: passes by how they ended;
//! - `shepherd_task_started_timestamp_seconds{task}`: when the task started in this process;
//! - `shepherd_task_last_success_timestamp_seconds{task}`: when a pass last succeeded (absent
//!   until one does);
//! - `shepherd_task_stale_after_seconds{task}`: how long without a success is too long
//!   (`--task-stale-after`), which `deploy/prometheus/rules.yml` alerts on.

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
}

impl Outcome {
    /// Every outcome, for series present at zero.
    pub const ALL: [Outcome; 3] = [Outcome::Succeeded, Outcome::Waited, Outcome::Failed];

    /// The metrics label and the word the web UI shows.
    pub fn label(self) -> &'static str {
        match self {
            Outcome::Succeeded => "succeeded",
            Outcome::Waited => "waited",
            Outcome::Failed => "failed",
        }
    }
}

/// The status of one background task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskStatus {
    /// The task's name (`provisioner`, `fleet-statistics` …).
    pub name: &'static str,
    /// When the task started in this process.
    pub started: DateTime<Utc>,
    /// Passes made so far.
    pub passes: u64,
    /// Whether a pass is under way.
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
}

impl TaskStatus {
    /// Whether the task has gone without a successful pass (counted from its start) for
    /// longer than `stale_after` at `now`.
    pub fn is_stale(&self, now: DateTime<Utc>, stale_after: Duration) -> bool {
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

    /// Starts tracking task `name` (again, if it was tracked before) and returns the handle
    /// its loop reports through.
    pub fn task(&self, name: &'static str) -> TaskHandle {
        let now = Utc::now();
        let label = TaskLabel { task: name };
        self.metrics.started.get_or_create(&label).set(unix(now));
        self.metrics
            .stale_after
            .get_or_create(&label)
            .set(self.stale_after.as_secs_f64());
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
                started: now,
                passes: 0,
                running: false,
                last_start: None,
                last_end: None,
                last_outcome: None,
                last_summary: String::new(),
                last_success: None,
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
            s.last_end = Some(now);
            s.last_outcome = Some(outcome);
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
            metrics
                .last_success
                .get_or_create(&TaskLabel { task: self.name })
                .set(unix(now));
        }
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
        assert!(s.last_success.is_some());
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
