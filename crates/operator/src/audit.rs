//! The server's side of the security audit trail: refusals seen by the operator API, the
//! sign-in routes and the web UI's forms are handed to a bounded queue and written to the
//! BMDB's `audit_events` in batches by one task, so that a flood of refusals costs each
//! request a counter and a queue slot, never a database round trip. What the queue cannot
//! take is counted as dropped, never waited for. (Tokens made and revoked, sign-ins and
//! sign-outs are written with the change itself, in its transaction: see
//! `shepherd_bmdb::Actor`.)

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{AuditEvent, Bmdb};
use shepherd_tasks::driver;
use shepherd_tasks::{Outcome, TaskHandle};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Events waiting to be written, at most; more are dropped and counted.
const QUEUE: usize = 10_000;

/// Most events written in one transaction.
const BATCH: usize = 500;

/// The writer's task, as `/tasks` shows it (of the kind driven by its callers: each batch is
/// a unit).
pub const TASK: &str = "audit-trail";

/// Labels of `shepherd_audit_refusals_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    /// The refusal's kind: the problem type (`unauthenticated`, `forbidden`,
    /// `rate_limited` …) or the sign-in's outcome. Bounded: never request text.
    reason: &'static str,
}

/// Labels of `shepherd_audit_events_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    /// `written`, `dropped` (the queue was full) or `lost` (the BMDB refused the batch).
    outcome: &'static str,
}

/// The trail's counters.
#[derive(Debug, Clone, Default)]
struct AuditMetrics {
    refusals: Family<RefusalLabels, Counter>,
    events: Family<OutcomeLabels, Counter>,
}

impl AuditMetrics {
    fn count(&self, outcome: &'static str, n: usize) {
        let labels = OutcomeLabels { outcome };
        self.events.get_or_create(&labels).inc_by(n as u64);
    }
}

/// Where refusals go. Cheap to clone; clones share the queue.
#[derive(Debug, Clone)]
pub struct AuditTrail {
    queue: Option<mpsc::Sender<AuditEvent>>,
    metrics: Arc<AuditMetrics>,
}

impl AuditTrail {
    /// A trail written to `db` by `task` (one unit per batch), which runs until `cancel`
    /// (then writes what is queued and ends); its counters go to `registry`.
    pub fn start(
        db: Bmdb,
        registry: &mut Registry,
        task: TaskHandle,
        cancel: CancellationToken,
    ) -> AuditTrail {
        let metrics = Arc::new(AuditMetrics::default());
        registry.register(
            "shepherd_audit_refusals",
            "Requests refused by the operator API, the sign-in routes and the web UI's forms, by reason",
            metrics.refusals.clone(),
        );
        shepherd_provider::metrics::register_at_zero(
            registry,
            "shepherd_audit_events",
            "Refusals handed to the audit trail: written, dropped (its queue was full) or lost (the BMDB refused the batch)",
            &metrics.events,
            ["written", "dropped", "lost"].map(|outcome| OutcomeLabels { outcome }),
        );
        let (queue, received) = mpsc::channel(QUEUE);
        tokio::spawn(write(db, received, metrics.clone(), task, cancel));
        AuditTrail {
            queue: Some(queue),
            metrics,
        }
    }

    /// A trail that keeps nothing: for tests of what does not need one.
    #[cfg(test)]
    pub fn none() -> AuditTrail {
        AuditTrail {
            queue: None,
            metrics: Arc::default(),
        }
    }

    /// Counts a refusal under `reason` that is not written on its own (a request refused for
    /// its rate, written with the next that is).
    pub fn counted(&self, reason: &'static str) {
        let labels = RefusalLabels { reason };
        self.metrics.refusals.get_or_create(&labels).inc();
    }

    /// Records a refusal: counted under `reason` at once, written with the next batch.
    pub fn refused(&self, reason: &'static str, event: AuditEvent) {
        self.counted(reason);
        let Some(queue) = &self.queue else {
            return;
        };
        if queue.try_send(event).is_err() {
            self.metrics.count("dropped", 1);
        }
    }
}

/// Writes queued events in batches of up to [`BATCH`], one transaction and one unit of
/// `task` each, until `cancel`; then what is left in the queue.
async fn write(
    db: Bmdb,
    mut received: mpsc::Receiver<AuditEvent>,
    metrics: Arc<AuditMetrics>,
    task: TaskHandle,
    cancel: CancellationToken,
) {
    let mut batch = Vec::with_capacity(BATCH);
    let mut stopping = false;
    loop {
        let got = tokio::select! {
            got = received.recv_many(&mut batch, BATCH) => got,
            _ = cancel.cancelled(), if !stopping => {
                // What is queued is still written; nothing more is taken.
                received.close();
                stopping = true;
                continue;
            }
        };
        if got == 0 {
            return;
        }
        let events = std::mem::take(&mut batch);
        driver::one_unit(&task, write_batch(&db, events, &metrics)).await;
    }
}

/// Writes `events`; a batch the BMDB refuses is counted as lost and logged with its size
/// (never its text). How that ended, in one line.
async fn write_batch(
    db: &Bmdb,
    events: Vec<AuditEvent>,
    metrics: &AuditMetrics,
) -> (Outcome, String) {
    let n = events.len();
    match db.record_audit_events(&events).await {
        Ok(()) => {
            metrics.count("written", n);
            (
                Outcome::Succeeded,
                format!("{n} refusals written in one transaction"),
            )
        }
        Err(e) => {
            metrics.count("lost", n);
            tracing::warn!(events = n, error = %e, "the audit trail lost a batch of refusals");
            (
                Outcome::of_bmdb_error(&e),
                format!("{n} refusals lost: {e}"),
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use shepherd_bmdb::AuditKind;
    use shepherd_tasks::{TaskKind, Tasks};

    use super::*;

    /// The writer is a task: each batch it writes is a unit shown at `/tasks`, and what is
    /// queued when it is told to stop is still written.
    #[tokio::test]
    async fn each_batch_is_a_unit_of_the_audit_task_and_the_queue_is_written_at_the_end() {
        let t = shepherd_bmdb::testing::sqlite().await;
        let tasks = Tasks::default();
        let cancel = CancellationToken::new();
        let task = tasks.task_of(TASK, TaskKind::Batches);
        let trail = AuditTrail::start(t.db.clone(), &mut Registry::default(), task, cancel.clone());
        for n in 0..3 {
            trail.refused(
                "forbidden",
                AuditEvent::now(AuditKind::Refused, format!("test {n}")),
            );
        }
        cancel.cancel();
        let status = || {
            tasks
                .statuses()
                .into_iter()
                .find(|s| s.name == TASK)
                .unwrap()
        };
        let written = || {
            let labels = OutcomeLabels { outcome: "written" };
            trail.metrics.events.get_or_create(&labels).get()
        };
        // Done once all three are written and the unit that wrote the last has ended.
        let started = std::time::Instant::now();
        while written() < 3 || status().running {
            assert!(
                started.elapsed() < Duration::from_secs(10),
                "{:?}",
                status()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let status = status();
        assert_eq!(status.last_outcome, Some(Outcome::Succeeded), "{status:?}");
        assert!(status.passes >= 1, "{status:?}");
        assert!(
            status
                .last_summary
                .ends_with("refusals written in one transaction"),
            "{status:?}"
        );
    }
}
