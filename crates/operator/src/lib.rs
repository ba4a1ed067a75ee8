//! `shepherd-operator`: everything operators reach Shepherd through, as a library the
//! `shepherd` binary calls. The operator API (`api/`: authentication by local tokens and
//! OpenID Connect, one role policy, the web sign-in), the web UI (`web.rs`, `web/`, the
//! overview and its failure-cause shapes), the `/metrics` endpoint with the fleet statistics
//! and the tasks' view, the audit trail's writer, operators' actions on one machine, the
//! machines as operators see them (`inventory.rs`), and the bounds every operator listener
//! applies (per-peer rate limits, security headers).

pub mod actions;
pub mod api;
pub mod audit;
pub mod cause_shapes;
pub mod fleet_stats;
pub mod inventory;
pub mod metrics_http;
pub mod overview;
pub mod rate_limit;
pub mod security_headers;
pub mod task_view;
pub mod web;
