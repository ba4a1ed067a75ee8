//! A process's background tasks as JSON: the one shape the web UI's `/tasks.json`, the
//! operator API's `/api/v1/tasks` and `shepherd tasks` share.

use chrono::{DateTime, Utc};
use serde_json::{json, Value};
use shepherd_tasks::{Outcome, TaskStatus, Tasks};

/// Every task of `tasks` at `now`, as `{"tasks": [...]}`.
pub fn tasks_json(tasks: &Tasks, now: DateTime<Utc>) -> Value {
    let stale_after = tasks.stale_after();
    let list: Vec<Value> = tasks
        .statuses()
        .iter()
        .map(|t| task_json(t, now, stale_after))
        .collect();
    json!({ "stale_after_seconds": stale_after.as_secs(), "tasks": list })
}

fn task_json(t: &TaskStatus, now: DateTime<Utc>, stale_after: std::time::Duration) -> Value {
    let by_outcome: serde_json::Map<String, Value> = Outcome::ALL
        .iter()
        .map(|o| (o.label().to_string(), json!(t.count(*o))))
        .collect();
    json!({
        "name": t.name,
        "kind": t.kind.label(),
        "state": t.state(now, stale_after).label(),
        "stale": t.is_stale(now, stale_after),
        "running": t.running,
        "passes": t.passes,
        "by_outcome": by_outcome,
        "started": t.started,
        "last_start": t.last_start,
        "last_end": t.last_end,
        "last_outcome": t.last_outcome.map(|o| o.label()),
        "last_summary": t.last_summary,
        "last_success": t.last_success,
        "last_panic": t.last_panic.as_ref().map(|p| json!({ "at": p.at, "message": p.message })),
    })
}
