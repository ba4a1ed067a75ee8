//! Every SQL statement of the BMDB, organised by concern, both engines side by side, each a
//! method of [`engine::Tx`] (or, for the two autocommitted Postgres hot paths, of
//! [`engine::Autocommit`]) defined next to its SQL:
//!
//! - `engine.rs` — how a statement runs on either engine: `Tx`, the parameters (`Arg`), the
//!   runner, row decoding (`Columns`, `FromColumns`) and `DbTime`;
//! - `schema.rs` — migrations' bookkeeping;
//! - `sessions.rs` — sessions and the one-statement batch of agent heartbeats;
//! - `tags.rs` — machines and the facts about them;
//! - `claims.rs` — eligibility (design.md §5) and claiming work (design.md §4);
//! - `endings.rs` — finishing, failing and canceling work, backoffs and the audit history;
//! - `finish_tags.rs` — the tag writes of finishes (`TagWrites`), a batch's in one statement;
//! - `views.rs` — operators' read-only views and counts;
//! - `operator.rs` — operators' actions (maintenance, decommission) and their history;
//! - `overview.rs` — fleet counts over time, work endings per minute, top failure causes;
//! - `provider_skips.rs` — provider ids skipped after their provider refused them;
//! - `retention.rs` — pruning old history in bounded batches;
//! - `api_tokens.rs` — the operator API's local tokens;
//! - `audit.rs` — the security audit trail;
//! - `bare_metal.rs` — bare machines' phases, their steps' history and the media server's lookup;
//! - `heartbeat_writers.rs` — what the BMaaS servers could not record, which excuses silence.
//!
//! This is the one door to the database: `Tx`'s connection is private to `engine.rs`, so the
//! rest of the crate can only call these methods, and no other crate names `sqlx` (tidy
//! checks it). A statement both engines accept is written once; where the texts differ —
//! mostly Postgres' `now()` against SQLite's time bound at `BEGIN` — the two texts stand next
//! to each other in a `Dialects`. Statements only one engine can express (Postgres'
//! data-modifying CTEs, SQLite's `PRAGMA`s) are the arms of one `match` on the engine.

pub(crate) mod api_tokens;
pub(crate) mod audit;
pub(crate) mod bare_metal;
pub(crate) mod claims;
pub(crate) mod endings;
pub(crate) mod engine;
pub(crate) mod finish_tags;
pub(crate) mod heartbeat_writers;
pub(crate) mod operator;
pub(crate) mod overview;
pub(crate) mod provider_skips;
pub(crate) mod retention;
pub(crate) mod schema;
pub(crate) mod sessions;
pub(crate) mod tags;
pub(crate) mod views;
