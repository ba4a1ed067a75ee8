//! `shepherd tasks`: a process's background tasks as the CLI prints them, read from the web
//! UI's `/tasks.json` or the operator API's `/api/v1/tasks` (both [`shepherd_operator::task_view`]).

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// Where `shepherd tasks` reads from.
#[derive(Debug, Clone, clap::Args)]
pub struct TasksArgs {
    /// A process's web listener (`shepherd run --metrics-listen`, `shepherd server`'s web
    /// UI), read at `/tasks.json`: `http://127.0.0.1:9464`.
    #[arg(long, conflicts_with = "api")]
    pub at: Option<String>,
    /// The operator API to read instead (`/api/v1/tasks`, a viewer's token).
    #[command(flatten)]
    pub api: crate::api_client::ApiArgs,
}

/// `shepherd tasks`: prints each task's state, last outcome, counts and summary, and fails
/// (exit 1) if any task is failed or stale, so that a script can check a process.
pub async fn run(args: TasksArgs) -> Result<()> {
    let body = match (&args.at, args.api.client()?) {
        (Some(at), _) => {
            let url = format!("{}/tasks.json", at.trim_end_matches('/'));
            let answer = reqwest::get(&url).await.with_context(|| url.clone())?;
            if !answer.status().is_success() {
                bail!("{url}: HTTP {}", answer.status());
            }
            answer
                .json::<Value>()
                .await
                .with_context(|| format!("{url}: not JSON"))?
        }
        (None, Some(client)) => client.get("/api/v1/tasks").await?,
        (None, None) => {
            bail!("shepherd tasks needs --at URL (a process's web listener) or --api URL")
        }
    };
    let (table, unhealthy) = render(&body)?;
    print!("{table}");
    if !unhealthy.is_empty() {
        bail!(
            "{} task(s) failed or stale: {}",
            unhealthy.len(),
            unhealthy.join(", ")
        );
    }
    Ok(())
}

/// The table `shepherd tasks` prints, and the names of the tasks that are failed or stale.
fn render(body: &Value) -> Result<(String, Vec<String>)> {
    let tasks = body["tasks"]
        .as_array()
        .context("the answer has no task list")?;
    let mut out = format!(
        "{:<18} {:<9} {:<8} {:<9} {:>8} {:>8} {}\n",
        "TASK", "KIND", "STATE", "LAST", "PASSES", "FAILED", "SUMMARY"
    );
    let mut unhealthy = Vec::new();
    for t in tasks {
        let text = |k: &str| t[k].as_str().unwrap_or("-").to_string();
        let failed = t["by_outcome"]["failed"].as_u64().unwrap_or(0)
            + t["by_outcome"]["panicked"].as_u64().unwrap_or(0);
        let mut summary = text("last_summary");
        if let Some(message) = t["last_panic"]["message"].as_str() {
            summary = format!("{summary} (last panic: {message})");
        }
        out += &format!(
            "{:<18} {:<9} {:<8} {:<9} {:>8} {:>8} {}\n",
            text("name"),
            text("kind"),
            text("state"),
            text("last_outcome"),
            t["passes"].as_u64().unwrap_or(0),
            failed,
            summary
        );
        if matches!(t["state"].as_str(), Some("failed" | "stale")) {
            unhealthy.push(text("name"));
        }
    }
    Ok((out, unhealthy))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use shepherd_operator::task_view::tasks_json;
    use shepherd_tasks::{Outcome, TaskKind, Tasks};

    #[test]
    fn a_panicked_task_is_failed_in_the_json_and_in_the_table() {
        let tasks = Tasks::new(std::time::Duration::from_secs(3600));
        tasks
            .task("updater")
            .ended(Outcome::Succeeded, "refreshed 3");
        let init = tasks.task_of("initializer", TaskKind::Machines);
        init.ended(Outcome::Panicked, "injected: a bug");
        init.ended(Outcome::Succeeded, "m: finished");
        let body = tasks_json(&tasks, Utc::now());
        let init = &body["tasks"][0];
        assert_eq!(init["name"], "initializer");
        assert_eq!(init["state"], "failed");
        assert_eq!(init["by_outcome"]["panicked"], 1);
        assert_eq!(init["last_panic"]["message"], "injected: a bug");
        assert_eq!(body["tasks"][1]["state"], "ok");
        let (table, unhealthy) = render(&body).unwrap();
        assert_eq!(unhealthy, ["initializer"]);
        assert!(table.contains("last panic: injected: a bug"), "{table}");
    }
}
