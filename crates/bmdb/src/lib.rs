//! The Bare Metal Database (BMDB): machines, facts about them (tags), sessions, per-machine
//! work locks, backoff and an audit history, on embedded SQLite or PostgreSQL behind one API.
//!
//! Every Shepherd component coordinates only through this crate. See `ARCHITECTURE.md` and
//! design.md §2–§5 for the model; every SQL statement lives in `sql/`, by concern.

mod api_tokens;
mod audit;
mod backoff;
mod bare_metal;
mod batch_reports;
mod batches;
mod claim_batch;
mod claim_hints;
mod db;
mod disk_full;
mod eligibility;
mod ending_batch;
mod error;
mod failover;
mod group_commit;
mod lease;
mod metrics;
mod migrations;
mod model;
mod operator;
mod paging;
mod retention;
mod session;
mod sql;
mod summary;
mod text;
mod transaction;
mod url;
mod work;
mod writer_turns;

#[cfg(feature = "testing")]
pub mod testing;

pub use api_tokens::{
    digest as api_token_digest, is_token_shaped, ApiToken, TokenSecret, TokenTimes,
    MAX_PAGE as MAX_TOKEN_PAGE, SESSION_PREFIX, TOKEN_PREFIX,
};
pub use audit::{Actor, AuditEvent, AuditFilter, AuditKind, MAX_AUDIT_PAGE, MAX_AUDIT_TEXT};
pub use backoff::{default_interval_seconds, Backoff};
pub use bare_metal::{
    live_proof_of, BareHistoryEntry, BareMetal, BarePhase, ForgetSystem, MediaGrant, PhaseWrites,
    MAX_DETAIL_LEN,
};
pub use batch_reports::HeartbeatBatchReports;
pub use db::{BackendKind, Bmdb, OpenOptions};
pub use eligibility::{BareTimeouts, RecoveryThresholds, Retrieval};
pub use error::{DriverError, Error};
pub use lease::{Lease, LeaseLost};
pub use metrics::{BmdbMetrics, ClaimSearch};
pub use migrations::{SchemaWindow, SCHEMA_VERSION};
pub use model::*;
pub use operator::ActionOutcome;
pub use retention::{Ended, HistoryRetention, PrunedHistory, AUDIT_RETENTION, SIGN_IN_RETENTION};
pub use session::{
    Holding, Session, SessionConfig, BATCH_WAIT, DEFAULT_SESSION_INTERVAL, MAX_BATCH,
};
pub use sql::claims::ClaimStrategy;
pub use sql::engine::{Tx, TxFuture};
pub use sql::finish_tags::TagWrites;
pub use sql::overview::RecentFailure;
pub use sql::views::StatusCounts;
pub use summary::{FleetCounts, Lifecycle, MachineSummary};
pub use text::{moves_text, one_line, one_line_cut};
pub use url::{DatabaseUrl, DEFAULT_DATABASE_URL};
pub use work::{Claim, Work};
