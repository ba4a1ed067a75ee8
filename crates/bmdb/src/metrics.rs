//! BMDB counters with the names and labels of design.md §16.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::{Process, Processor};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcessorLabels {
    processor: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkLabels {
    processor: &'static str,
    process: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkEndLabels {
    processor: &'static str,
    process: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClaimSearchLabels {
    processor: &'static str,
    process: &'static str,
    search: &'static str,
    result: &'static str,
}

/// Where a claim statement looked for an eligible machine (Postgres), cheapest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimSearch {
    /// Leftover candidates of an earlier full search.
    Hinted,
    /// A small window of machine ids after a random point.
    Window,
    /// Every machine of the provider.
    Everywhere,
}

impl ClaimSearch {
    fn label(self) -> &'static str {
        match self {
            ClaimSearch::Hinted => "hinted",
            ClaimSearch::Window => "window",
            ClaimSearch::Everywhere => "everywhere",
        }
    }
}

/// How one attempt of a transaction ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TransactionEnd {
    /// It committed.
    Executed,
    /// It failed with an error worth another attempt, which follows.
    Retried,
    /// It failed for good.
    Failed,
}

/// How a unit of work ended, for the `result` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WorkResult {
    Finished,
    Failed,
    Canceled,
}

/// Counters of sessions, transactions and work, shared by every session of one [`crate::Bmdb`].
#[derive(Debug, Default)]
pub struct BmdbMetrics {
    session_started: Family<ProcessorLabels, Counter>,
    transaction_executed: Family<ProcessorLabels, Counter>,
    transaction_retried: Family<ProcessorLabels, Counter>,
    transaction_failed: Family<ProcessorLabels, Counter>,
    work_started: Family<WorkLabels, Counter>,
    work_finished: Family<WorkEndLabels, Counter>,
    claim_searches: Family<ClaimSearchLabels, Counter>,
    heartbeat_batches: BatchCounters,
    claim_batches: BatchCounters,
    ending_batches: BatchCounters,
    endings_in_doubt: Family<ProcessorLabels, Counter>,
    sessions_expired: Family<ProcessorLabels, Counter>,
    work_fenced: Family<ProcessLabels, Counter>,
    steps_fenced: Family<StepLabels, Counter>,
    writer_wait: WriterWait,
}

/// A side effect a lease fenced ([`crate::Lease::fenced`]), and whose session's it was.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabels {
    processor: &'static str,
    step: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ProcessLabels {
    process: &'static str,
}

/// Batches one kind of group write made, and the members they held: divided, the mean batch
/// size. Exported as `bmdb_<kind>_batches` and `bmdb_<kind>s_batched`.
#[derive(Debug, Default)]
struct BatchCounters {
    batches: Family<ProcessorLabels, Counter>,
    members: Family<ProcessorLabels, Counter>,
}

impl BatchCounters {
    fn register(&self, registry: &mut Registry, kind: &str, help: &str) {
        registry.register(format!("bmdb_{kind}_batches"), help, self.batches.clone());
        registry.register(
            format!("bmdb_{kind}s_batched"),
            format!("Members of {kind} batches; divided by the batches, the mean batch size"),
            self.members.clone(),
        );
    }

    fn record(&self, processor: Processor, size: usize) {
        let p = BmdbMetrics::p(processor);
        self.batches.get_or_create(&p).inc();
        self.members.get_or_create(&p).inc_by(size as u64);
    }

    fn get(&self, processor: Processor) -> (u64, u64) {
        let p = BmdbMetrics::p(processor);
        (
            self.batches.get_or_create(&p).get(),
            self.members.get_or_create(&p).get(),
        )
    }
}

/// How long write transactions waited for SQLite's one writer: a histogram, and the longest
/// wait seen (for benchmarks and status output).
#[derive(Debug)]
struct WriterWait {
    seconds: Histogram,
    longest_us: std::sync::atomic::AtomicU64,
}

impl Default for WriterWait {
    fn default() -> Self {
        // 1 ms … ~16 s: past the session interval is what matters.
        let buckets = prometheus_client::metrics::histogram::exponential_buckets(0.001, 2.0, 15);
        WriterWait {
            seconds: Histogram::new(buckets),
            longest_us: Default::default(),
        }
    }
}

impl BmdbMetrics {
    /// Adds the counters to `registry` (exposed with the usual `_total` suffix).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "bmdb_session_started",
            "BMDB sessions started",
            self.session_started.clone(),
        );
        registry.register(
            "bmdb_transaction_executed",
            "BMDB transactions committed",
            self.transaction_executed.clone(),
        );
        registry.register(
            "bmdb_transaction_retried",
            "BMDB transaction attempts retried",
            self.transaction_retried.clone(),
        );
        registry.register(
            "bmdb_transaction_failed",
            "BMDB transactions failed",
            self.transaction_failed.clone(),
        );
        registry.register(
            "bmdb_work_started",
            "Work units claimed",
            self.work_started.clone(),
        );
        registry.register(
            "bmdb_work_finished",
            "Work units ended, by result",
            self.work_finished.clone(),
        );
        registry.register(
            "bmdb_claim_searches",
            "Claim statements on Postgres, by where they searched and whether they claimed",
            self.claim_searches.clone(),
        );
        registry.register(
            "bmdb_endings_in_doubt",
            "Work endings whose COMMIT failed with the connection: the database may have written them (the work's history says); they are not counted as ended here",
            self.endings_in_doubt.clone(),
        );
        registry.register(
            "bmdb_sessions_expired",
            "BMDB sessions of this process that expired before they were closed (keep-alives did not get through in time); their work was lost",
            self.sessions_expired.clone(),
        );
        registry.register(
            "shepherd_work_fenced",
            "Work ended because its session's lease ended before or during a side effect on the machine (canceled with the cause \"lease lost\")",
            self.work_fenced.clone(),
        );
        registry.register(
            "shepherd_fenced_steps",
            "Side effects on machines or at providers not started, or cut off, because their session's lease ended (Lease::fenced, Lease::may_start), by step",
            self.steps_fenced.clone(),
        );
        registry.register(
            "bmdb_sqlite_writer_wait_seconds",
            "How long write transactions waited for SQLite's single writer (0 on Postgres: not observed)",
            self.writer_wait.seconds.clone(),
        );
        self.heartbeat_batches.register(
            registry,
            "heartbeat",
            "Transactions that wrote a batch of agent heartbeats (group commit)",
        );
        self.claim_batches.register(
            registry,
            "claim",
            "Claims of concurrent workers served together (one statement on Postgres, one transaction on SQLite)",
        );
        self.ending_batches.register(
            registry,
            "ending",
            "Transactions that ended the work of concurrent workers together (finished, failed, canceled)",
        );
    }

    fn p(processor: Processor) -> ProcessorLabels {
        ProcessorLabels {
            processor: processor.label(),
        }
    }

    pub(crate) fn session_started(&self, processor: Processor) {
        self.session_started
            .get_or_create(&Self::p(processor))
            .inc();
    }

    /// Counts one end of a transaction attempt: committed, retried or failed for good.
    pub(crate) fn transaction(&self, processor: Processor, end: TransactionEnd) {
        let family = match end {
            TransactionEnd::Executed => &self.transaction_executed,
            TransactionEnd::Retried => &self.transaction_retried,
            TransactionEnd::Failed => &self.transaction_failed,
        };
        family.get_or_create(&Self::p(processor)).inc();
    }

    pub(crate) fn work_started(&self, processor: Processor, process: Process) {
        self.work_started
            .get_or_create(&WorkLabels {
                processor: processor.label(),
                process: process.as_str(),
            })
            .inc();
    }

    pub(crate) fn work_ended(&self, processor: Processor, process: Process, result: WorkResult) {
        let result = match result {
            WorkResult::Finished => "finished",
            WorkResult::Failed => "failed",
            WorkResult::Canceled => "canceled",
        };
        self.work_finished
            .get_or_create(&WorkEndLabels {
                processor: processor.label(),
                process: process.as_str(),
                result,
            })
            .inc();
    }

    pub(crate) fn claim_search(
        &self,
        processor: Processor,
        process: Process,
        search: ClaimSearch,
        claimed: bool,
    ) {
        self.claim_searches
            .get_or_create(&Self::search_labels(processor, process, search, claimed))
            .inc();
    }

    fn search_labels(
        processor: Processor,
        process: Process,
        search: ClaimSearch,
        claimed: bool,
    ) -> ClaimSearchLabels {
        ClaimSearchLabels {
            processor: processor.label(),
            process: process.as_str(),
            search: search.label(),
            result: if claimed { "claimed" } else { "missed" },
        }
    }

    /// Claim statements so far that searched `search` and claimed (or not) a machine.
    pub fn claim_searches(
        &self,
        processor: Processor,
        process: Process,
        search: ClaimSearch,
        claimed: bool,
    ) -> u64 {
        self.claim_searches
            .get_or_create(&Self::search_labels(processor, process, search, claimed))
            .get()
    }

    /// Counts one heartbeat batch of `size` heartbeats written for `processor`.
    pub(crate) fn heartbeat_batch(&self, processor: Processor, size: usize) {
        self.heartbeat_batches.record(processor, size);
    }

    /// Counts one claim batch of `size` requests served for `processor`.
    pub(crate) fn claim_batch(&self, processor: Processor, size: usize) {
        self.claim_batches.record(processor, size);
    }

    /// Counts one ending batch of `size` endings written for `processor`.
    pub(crate) fn ending_batch(&self, processor: Processor, size: usize) {
        self.ending_batches.record(processor, size);
    }

    /// Counts `n` endings of `processor` whose batch's COMMIT failed with the connection.
    pub(crate) fn ending_batch_in_doubt(&self, processor: Processor, n: usize) {
        self.endings_in_doubt
            .get_or_create(&Self::p(processor))
            .inc_by(n as u64);
    }

    /// Endings of `processor` so far whose batch's COMMIT failed with the connection.
    pub fn endings_in_doubt(&self, processor: Processor) -> u64 {
        self.endings_in_doubt
            .get_or_create(&Self::p(processor))
            .get()
    }

    /// Claim batches so far and the requests they served, for `processor`.
    pub fn claim_batches(&self, processor: Processor) -> (u64, u64) {
        self.claim_batches.get(processor)
    }

    /// Ending batches so far and the endings they wrote, for `processor`.
    pub fn ending_batches(&self, processor: Processor) -> (u64, u64) {
        self.ending_batches.get(processor)
    }

    pub(crate) fn work_fenced(&self, process: Process) {
        let labels = ProcessLabels {
            process: process.as_str(),
        };
        self.work_fenced.get_or_create(&labels).inc();
    }

    pub(crate) fn step_fenced(&self, processor: Processor, step: &'static str) {
        let labels = StepLabels {
            processor: processor.label(),
            step,
        };
        self.steps_fenced.get_or_create(&labels).inc();
    }

    /// Side effects named `step` that sessions of `processor` fenced so far.
    pub fn steps_fenced(&self, processor: Processor, step: &'static str) -> u64 {
        let labels = StepLabels {
            processor: processor.label(),
            step,
        };
        self.steps_fenced.get_or_create(&labels).get()
    }

    /// Work of `process` ended because its session's lease ended (`Work::fenced`).
    pub fn works_fenced(&self, process: Process) -> u64 {
        let labels = ProcessLabels {
            process: process.as_str(),
        };
        self.work_fenced.get_or_create(&labels).get()
    }

    pub(crate) fn session_expired(&self, processor: Processor) {
        self.sessions_expired
            .get_or_create(&Self::p(processor))
            .inc();
    }

    /// Sessions of `processor` that expired so far.
    pub fn sessions_expired(&self, processor: Processor) -> u64 {
        self.sessions_expired
            .get_or_create(&Self::p(processor))
            .get()
    }

    pub(crate) fn writer_waited(&self, waited: std::time::Duration) {
        use std::sync::atomic::Ordering;
        self.writer_wait.seconds.observe(waited.as_secs_f64());
        let us = u64::try_from(waited.as_micros()).unwrap_or(u64::MAX);
        self.writer_wait.longest_us.fetch_max(us, Ordering::Relaxed);
    }

    /// The longest a write transaction has waited for SQLite's writer so far.
    pub fn longest_writer_wait(&self) -> std::time::Duration {
        use std::sync::atomic::Ordering;
        std::time::Duration::from_micros(self.writer_wait.longest_us.load(Ordering::Relaxed))
    }

    /// Heartbeat batches written so far for `processor`, and the heartbeats in them.
    pub fn heartbeat_batches(&self, processor: Processor) -> (u64, u64) {
        self.heartbeat_batches.get(processor)
    }

    /// Committed transactions so far for `processor` (for tests and status output).
    pub fn transactions_executed(&self, processor: Processor) -> u64 {
        self.transaction_executed
            .get_or_create(&Self::p(processor))
            .get()
    }

    /// Retried transaction attempts so far for `processor`.
    pub fn transactions_retried(&self, processor: Processor) -> u64 {
        self.transaction_retried
            .get_or_create(&Self::p(processor))
            .get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claim_searches_are_exposed_with_their_labels() {
        let metrics = BmdbMetrics::default();
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let (p, process) = (Processor::ShepherdInitializer, Process::ShepherdAgentStart);
        metrics.claim_search(p, process, ClaimSearch::Hinted, true);
        metrics.claim_search(p, process, ClaimSearch::Hinted, true);
        metrics.claim_search(p, process, ClaimSearch::Everywhere, false);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let line = |search: &str, result: &str, n: u64| {
            format!(
                "bmdb_claim_searches_total{{processor=\"shepherd-initializer\",process=\"ShepherdAgentStart\",search=\"{search}\",result=\"{result}\"}} {n}"
            )
        };
        assert!(text.contains(&line("hinted", "claimed", 2)), "{text}");
        assert!(text.contains(&line("everywhere", "missed", 1)), "{text}");
        assert_eq!(
            metrics.claim_searches(p, process, ClaimSearch::Window, true),
            0
        );
    }
}
