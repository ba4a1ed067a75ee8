//! `shepherd machines …` and `shepherd sessions list`: what the BMDB knows, for operators.

mod commands;

pub use commands::{MachinesCommand, Switch, WhoArgs};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use shepherd_bmdb::{Bmdb, Lifecycle};
use uuid::Uuid;

use crate::api_client::{ApiArgs, ApiClient};
use shepherd_bmdb::one_line;
use shepherd_operator::actions::{self, InstallImage, MachineAction};
use shepherd_operator::inventory;

/// A JSON value as one table cell, on one line whatever it holds.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => one_line(s).into_owned(),
        other => other.to_string(),
    }
}

/// Runs a `machines` subcommand on the BMDB at `url`, or through the operator API.
pub async fn run(url: &str, api: &ApiArgs, command: MachinesCommand) -> Result<()> {
    if let Some(client) = api.client()? {
        return run_on(&Source::Api(client), command).await;
    }
    let db = Bmdb::open(url).await?;
    let source = Source::Db(db.clone());
    let result = run_on(&source, command).await;
    db.close().await;
    result
}

/// Where `machines` reads and acts: the BMDB itself (administrators' break-glass path), or
/// the operator API. Both answer in the same JSON, so each command prints one way.
enum Source {
    Db(Bmdb),
    Api(ApiClient),
}

/// A page of machines as JSON rows, and where the next page starts.
type Page = (Vec<Value>, Option<Uuid>);

impl Source {
    /// A page of machines matching the filters.
    async fn list(
        &self,
        provider: Option<String>,
        state: Option<Lifecycle>,
        after: Option<Uuid>,
        limit: usize,
        stale_after: chrono::Duration,
    ) -> Result<Page> {
        match self {
            Source::Db(db) => {
                let provider: Option<shepherd_bmdb::ProviderKind> = provider
                    .map(|p| p.parse().with_context(|| format!("provider {p:?}")))
                    .transpose()?;
                let listing =
                    inventory::list(db, provider, state, after, limit, usize::MAX, stale_after)
                        .await?;
                let rows = listing.machines.iter();
                let rows = rows.map(|m| inventory::summary_json(m, listing.state_of(m)));
                Ok((rows.collect(), listing.next))
            }
            Source::Api(api) => {
                let mut query = vec![format!("limit={limit}")];
                query.extend(provider.map(|p| format!("provider={p}")));
                query.extend(state.map(|s| format!("state={}", s.slug())));
                query.extend(after.map(|a| format!("after={a}")));
                let page = api.get(&format!("/machines?{}", query.join("&"))).await?;
                let rows = page["machines"].as_array().cloned().unwrap_or_default();
                let next = page["next"].as_str().and_then(|n| n.parse().ok());
                Ok((rows, next))
            }
        }
    }

    /// Everything about one machine as JSON, and its hardware report as labelled lines where
    /// the BMDB itself was read.
    async fn show(
        &self,
        id: Uuid,
        stale_after: chrono::Duration,
    ) -> Result<(Value, Vec<(String, String)>)> {
        match self {
            Source::Db(db) => {
                let Some(detail) = inventory::detail(db, id, stale_after).await? else {
                    bail!(actions::no_such_machine(db, id).await?);
                };
                let hardware = match &detail.hardware {
                    Some(Ok(report)) => inventory::hardware_lines(report)
                        .into_iter()
                        .map(|(label, line)| (label.to_string(), line))
                        .collect(),
                    _ => Vec::new(),
                };
                Ok((inventory::detail_json(&detail), hardware))
            }
            Source::Api(api) => Ok((api.get(&format!("/machines/{id}")).await?, Vec::new())),
        }
    }

    /// A machine's whole history as `{at, who, what, why}` rows, oldest first.
    async fn history(&self, id: Uuid) -> Result<Vec<Value>> {
        match self {
            Source::Db(db) => {
                let (lines, decommissioned) = inventory::history(db, id).await?;
                if lines.is_empty() && decommissioned.is_none() {
                    let exists = db
                        .read(move |tx| Box::pin(async move { tx.machine_exists(id).await }))
                        .await?;
                    if !exists {
                        bail!("machine {id} does not exist and has no history");
                    }
                }
                Ok(lines.iter().map(inventory::history_line_json).collect())
            }
            Source::Api(api) => {
                let answer = api.get(&format!("/machines/{id}/history")).await?;
                Ok(answer["history"].as_array().cloned().unwrap_or_default())
            }
        }
    }

    /// Performs `action` on machine `id` for the operator `who` names (through the API: for
    /// the identity its token proves) and says what it did.
    async fn act(&self, id: Uuid, action: MachineAction, who: &WhoArgs) -> Result<String> {
        if action.needs_reason() && who.reason.as_deref().unwrap_or("").trim().is_empty() {
            bail!("--reason is needed: say why, for the machine's history");
        }
        match self {
            Source::Db(db) => {
                let operator = who.operator()?;
                let performed = actions::perform(db, "shepherd-cli", id, action, &operator).await?;
                Ok(performed.message().to_string())
            }
            Source::Api(api) => {
                if who.by.is_some() {
                    bail!("--by: through the API, the token says who acts");
                }
                let (route, mut body) = actions::api_request(&action);
                body["reason"] = who.reason.clone().map_or(Value::Null, Value::String);
                let path = format!("/machines/{id}/{route}");
                let answer = api.call(reqwest::Method::POST, &path, Some(body)).await?;
                Ok(answer["message"].as_str().unwrap_or_default().to_string())
            }
        }
    }
}

fn table(rows: &[Value], cols: &[&str]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| cols.iter().map(|c| text(&r[*c])).collect())
        .collect();
    let widths: Vec<usize> = cols
        .iter()
        .enumerate()
        .map(|(i, c)| {
            cells
                .iter()
                .map(|r| r[i].len())
                .max()
                .unwrap_or(0)
                .max(c.len())
        })
        .collect();
    let line = |vals: Vec<String>| {
        vals.iter()
            .zip(&widths)
            .map(|(v, w)| format!("{v:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = line(cols.iter().map(|c| c.to_uppercase()).collect()) + "\n";
    for r in cells {
        out += &line(r);
        out += "\n";
    }
    out
}

/// Runs `command` on `source`: reads print their rows one way, actions their sentence.
async fn run_on(source: &Source, command: MachinesCommand) -> Result<()> {
    let action = match command {
        MachinesCommand::List {
            provider,
            state,
            after,
            limit,
            json,
            thresholds,
        } => {
            let stale_after = thresholds.thresholds().stale_after();
            let (rows, next) = source
                .list(provider, state, after, limit, stale_after)
                .await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                if let Some(next) = next {
                    eprintln!("more machines may follow: add --after {next}");
                }
                let columns = [
                    "machine_id",
                    "state",
                    "provider",
                    "provider_id",
                    "address",
                    "location",
                    "heartbeat_at",
                ];
                print!("{}", table(&rows, &columns));
            }
            return Ok(());
        }
        MachinesCommand::Show {
            id,
            json,
            thresholds,
        } => {
            let stale_after = thresholds.thresholds().stale_after();
            let (v, hardware) = source.show(id, stale_after).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                print_detail(&v, &hardware);
            }
            return Ok(());
        }
        MachinesCommand::History { id } => {
            for l in source.history(id).await? {
                println!(
                    "{}  {:<20} {:<15} {}",
                    text(&l["at"]),
                    text(&l["who"]),
                    text(&l["what"]),
                    text(&l["why"])
                );
            }
            return Ok(());
        }
        MachinesCommand::Retry { id, process, who } => (id, MachineAction::Retry { process }, who),
        MachinesCommand::ForgetHostKey { id, who } => (id, MachineAction::ForgetHostKey, who),
        MachinesCommand::Maintenance { switch, id, who } => {
            let action = match switch {
                Switch::On => MachineAction::MaintenanceOn,
                Switch::Off => MachineAction::MaintenanceOff,
            };
            (id, action, who)
        }
        MachinesCommand::Decommission { id, undeploy, who } => {
            (id, MachineAction::Decommission { undeploy }, who)
        }
        MachinesCommand::Recommission { id, who } => (id, MachineAction::Recommission, who),
        MachinesCommand::Install {
            id,
            image,
            sha256,
            device,
            wipe,
            who,
        } => {
            let image = InstallImage::new(image, sha256, device, wipe)?;
            (id, MachineAction::Install(image), who)
        }
        MachinesCommand::Reimage { id, wipe, who } => (id, MachineAction::Reimage { wipe }, who),
    };
    let (id, action, who) = action;
    let message = source.act(id, action, &who).await?;
    println!("machine {id}: {message}");
    Ok(())
}

/// A machine's detail for people: a line per field; the hardware report a line per part
/// (`hardware`, where known), and the loops' history and the operators' actions as tables.
fn print_detail(v: &Value, hardware: &[(String, String)]) {
    let Value::Object(map) = v else { return };
    for (k, val) in map {
        match (k.as_str(), val) {
            ("hardware_report", _) if !hardware.is_empty() => {
                println!("hardware_report");
                for (label, line) in hardware {
                    println!("  {label:<20} {line}");
                }
            }
            (
                "history" | "operator_actions" | "backoffs" | "work" | "bare_steps",
                Value::Array(rows),
            ) if !rows.is_empty() => {
                let mut columns: Vec<&str> = Vec::new();
                for row in rows.iter().filter_map(Value::as_object) {
                    for key in row.keys() {
                        if !columns.contains(&key.as_str()) {
                            columns.push(key);
                        }
                    }
                }
                println!("{k}");
                for line in table(rows, &columns).lines() {
                    println!("  {line}");
                }
            }
            _ => println!("{k:<22} {}", text(val)),
        }
    }
}

/// `shepherd sessions list`.
pub async fn sessions(url: &str) -> Result<()> {
    let db = Bmdb::open(url).await?;
    let sessions = db
        .read(|tx| Box::pin(async move { Ok((tx.sessions().await?, tx.now().await?)) }))
        .await;
    db.close().await;
    let (sessions, now) = sessions?;
    for s in sessions {
        println!(
            "{}  {:<22} {:<22} {:<8} deadline {} ({})",
            s.session_id,
            one_line(&s.component_name),
            s.processor,
            if s.deadline > now { "live" } else { "expired" },
            s.deadline.to_rfc3339(),
            one_line(&s.runtime_info)
        );
    }
    Ok(())
}
