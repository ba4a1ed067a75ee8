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
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Events waiting to be written, at most; more are dropped and counted.
const QUEUE: usize = 10_000;

/// Most events written in one transaction.
const BATCH: usize = 500;

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
    /// A trail written to `db` by a task that runs until `cancel` (then writes what is
    /// queued and ends); its counters go to `registry`.
    pub fn start(db: Bmdb, registry: &mut Registry, cancel: CancellationToken) -> AuditTrail {
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
        tokio::spawn(write(db, received, metrics.clone(), cancel));
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

/// Writes queued events in batches of up to [`BATCH`], one transaction each, until `cancel`;
/// then what is left in the queue.
async fn write(
    db: Bmdb,
    mut received: mpsc::Receiver<AuditEvent>,
    metrics: Arc<AuditMetrics>,
    cancel: CancellationToken,
) {
    let mut batch = Vec::with_capacity(BATCH);
    loop {
        let got = tokio::select! {
            got = received.recv_many(&mut batch, BATCH) => got,
            _ = cancel.cancelled() => {
                received.close();
                while received.recv_many(&mut batch, BATCH).await > 0 {
                    write_batch(&db, &mut batch, &metrics).await;
                }
                return;
            }
        };
        if got == 0 {
            return;
        }
        write_batch(&db, &mut batch, &metrics).await;
    }
}

/// Writes `batch` and empties it; a batch the BMDB refuses is counted as lost and logged
/// with its size (never its text).
async fn write_batch(db: &Bmdb, batch: &mut Vec<AuditEvent>, metrics: &AuditMetrics) {
    match db.record_audit_events(batch).await {
        Ok(()) => metrics.count("written", batch.len()),
        Err(e) => {
            metrics.count("lost", batch.len());
            tracing::warn!(events = batch.len(), error = %e, "the audit trail lost a batch of refusals");
        }
    }
    batch.clear();
}
