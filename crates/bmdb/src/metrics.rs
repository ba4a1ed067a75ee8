//! BMDB counters with the names and labels of SPEC §16.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
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

    pub(crate) fn transaction_executed(&self, processor: Processor) {
        self.transaction_executed
            .get_or_create(&Self::p(processor))
            .inc();
    }

    pub(crate) fn transaction_retried(&self, processor: Processor) {
        self.transaction_retried
            .get_or_create(&Self::p(processor))
            .inc();
    }

    pub(crate) fn transaction_failed(&self, processor: Processor) {
        self.transaction_failed
            .get_or_create(&Self::p(processor))
            .inc();
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
