//! Database backends. Each module holds all hand-written SQL for its database. The rest of
//! the crate reaches them through [`crate::Tx`] (every typed query, inside a transaction),
//! `db.rs` (migrations) and the two hot paths that run outside a BEGIN on Postgres as one
//! autocommitted statement: claims (`work.rs`) and agent heartbeats (`session.rs`).

pub(crate) mod postgres;
pub(crate) mod sqlite;

use uuid::Uuid;

/// What a claim statement found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClaimOutcome {
    /// The session is gone or past its deadline.
    SessionExpired,
    /// No machine is eligible.
    Nothing,
    /// Machines were eligible, but every candidate was taken by a concurrent claimer.
    Conflict,
    /// The machine is locked for us; the backoff interval persisted by its last failure.
    Claimed {
        machine_id: Uuid,
        last_interval: Option<i64>,
    },
}

/// What ending a unit of work found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndOutcome {
    /// Ended, history written.
    Done,
    /// The session is gone or past its deadline; nothing written.
    SessionExpired,
    /// The work row is gone (garbage-collected); nothing written.
    Lost,
}

/// How a claim picks its machine. Only [`ClaimStrategy::SkipLocked`] is for production; the
/// upstream shape is kept as a benchmark baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ClaimStrategy {
    /// Spread claimers over the candidates and skip rows other claimers hold (SPEC §4).
    #[default]
    SkipLocked,
    /// Upstream's shape: take the first eligible machine and rely on the unique constraint.
    /// Benchmark baseline only.
    UpstreamFirstRow,
}

/// Counts shown by `shepherd bmdb status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusCounts {
    /// Rows in `machines`.
    pub machines: i64,
    /// Machines with a `machine_provided` tag.
    pub provided: i64,
    /// Machines with an `agent_started` tag.
    pub agent_started: i64,
    /// Machines with a heartbeat tag.
    pub heartbeating: i64,
    /// Sessions before their deadline.
    pub sessions_live: i64,
    /// Sessions past their deadline, not yet garbage-collected.
    pub sessions_expired: i64,
    /// Active work rows per process.
    pub work: Vec<(crate::Process, i64)>,
    /// Active (until in the future) backoffs per process.
    pub backoffs: Vec<(crate::Process, i64)>,
    /// Rows in `work_history`.
    pub history_entries: i64,
}
