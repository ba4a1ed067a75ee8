//! `shepherd machines …` and `shepherd sessions list`: what the BMDB knows, for operators.

use anyhow::{bail, Context, Result};
use chrono::{DateTime, Utc};
use clap::{Subcommand, ValueEnum};
use serde_json::{json, Value};
use shepherd_bmdb::{
    ActiveWork, AgentStarted, BackoffEntry, Bmdb, InstallationResult, OsInstallationReport,
    OsInstallationRequest, Provided, Tx,
};
use shepherd_proto::bmaas::AgentHardwareReport;
use shepherd_proto::Message;
use uuid::Uuid;

/// A machine's place in its lifecycle, derived from its tags (first match wins).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum State {
    /// Held by a loop right now.
    InWork,
    /// A loop failed on it and waits.
    InBackoff,
    /// Its installation request was fulfilled successfully.
    Installed,
    /// An installation request waits for its report.
    Installing,
    /// Heartbeating, last heartbeat within 10 minutes.
    Heartbeating,
    /// Heartbeated once, but not for 10 minutes.
    Stale,
    /// Agent started, no heartbeat yet.
    AgentStarting,
    /// Provided, no agent yet.
    Provided,
    /// Known to the BMDB only.
    Unprovided,
}

impl State {
    fn name(self) -> &'static str {
        match self {
            State::InWork => "in work",
            State::InBackoff => "in backoff",
            State::Installed => "installed",
            State::Installing => "installing",
            State::Heartbeating => "heartbeating",
            State::Stale => "stale",
            State::AgentStarting => "agent starting",
            State::Provided => "provided",
            State::Unprovided => "unprovided",
        }
    }
}

/// Subcommands of `shepherd machines`.
#[derive(Debug, Subcommand)]
pub enum MachinesCommand {
    /// One line per machine, in machine-id order.
    List {
        /// Only machines of this provider (e.g. Static, Sim).
        #[arg(long)]
        provider: Option<String>,
        /// Only machines in this state.
        #[arg(long, value_enum)]
        state: Option<State>,
        /// Start after this machine id (paging).
        #[arg(long)]
        after: Option<Uuid>,
        /// Most machines to show.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Every tag of one machine, its work, backoffs and history.
    Show {
        /// Machine id.
        id: Uuid,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The work history of one machine.
    History {
        /// Machine id.
        id: Uuid,
    },
}

struct Facts {
    id: Uuid,
    provided: Option<Provided>,
    agent: Option<AgentStarted>,
    heartbeat: Option<DateTime<Utc>>,
    work: Vec<ActiveWork>,
    backoffs: Vec<BackoffEntry>,
    request: Option<OsInstallationRequest>,
    report: Option<OsInstallationReport>,
}

impl Facts {
    async fn load(tx: &mut Tx, id: Uuid) -> Result<Facts, shepherd_bmdb::Error> {
        Ok(Facts {
            id,
            provided: tx.provided(id).await?,
            agent: tx.agent_started(id).await?,
            heartbeat: tx.heartbeat(id).await?,
            work: tx.machine_work(id).await?,
            backoffs: tx.machine_backoffs(id).await?,
            request: tx.os_installation_request(id).await?,
            report: tx.os_installation_report(id).await?,
        })
    }

    fn state(&self, now: DateTime<Utc>) -> State {
        let installed = match (&self.request, &self.report) {
            (Some(q), Some(r)) => {
                Some(q.generation == r.generation && r.result == InstallationResult::Success)
            }
            (Some(_), None) => Some(false),
            _ => None,
        };
        if !self.work.is_empty() {
            State::InWork
        } else if self.backoffs.iter().any(|b| b.until > now) {
            State::InBackoff
        } else if installed == Some(true) {
            State::Installed
        } else if installed == Some(false) {
            State::Installing
        } else if let Some(h) = self.heartbeat {
            if now - h > chrono::Duration::minutes(10) {
                State::Stale
            } else {
                State::Heartbeating
            }
        } else if self.agent.is_some() {
            State::AgentStarting
        } else if self.provided.is_some() {
            State::Provided
        } else {
            State::Unprovided
        }
    }

    fn summary(&self, now: DateTime<Utc>) -> Value {
        let p = self.provided.as_ref();
        json!({
            "machine_id": self.id.to_string(),
            "state": self.state(now).name(),
            "provider": p.map(|p| p.provider.to_string()),
            "provider_id": p.map(|p| p.provider_id.clone()),
            "address": p.and_then(|p| p.ip_address.clone()),
            "location": p.and_then(|p| p.location.clone()),
            "heartbeat_at": self.heartbeat.map(|h| h.to_rfc3339()),
        })
    }
}

fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Runs a `machines` subcommand.
pub async fn run(url: &str, command: MachinesCommand) -> Result<()> {
    let db = Bmdb::open(url).await?;
    let result = run_on(&db, command).await;
    db.close().await;
    result
}

async fn run_on(db: &Bmdb, command: MachinesCommand) -> Result<()> {
    let now = Utc::now();
    match command {
        MachinesCommand::List {
            provider,
            state,
            after,
            limit,
            json,
        } => {
            let provider: Option<shepherd_bmdb::Provider> = provider
                .map(|p| p.parse().with_context(|| format!("provider {p:?}")))
                .transpose()?;
            let mut rows = Vec::new();
            let mut cursor = after;
            // Page through ids until `limit` machines pass the filters.
            'pages: loop {
                let c = cursor;
                let page = db
                    .read(move |tx| {
                        Box::pin(async move {
                            let mut facts = Vec::new();
                            for id in tx.machine_ids(c, 500).await? {
                                facts.push(Facts::load(tx, id).await?);
                            }
                            Ok(facts)
                        })
                    })
                    .await?;
                let Some(last) = page.last() else { break };
                cursor = Some(last.id);
                for f in page {
                    if provider.is_some_and(|p| f.provided.as_ref().map(|x| x.provider) != Some(p))
                    {
                        continue;
                    }
                    if state.is_some_and(|s| f.state(now) != s) {
                        continue;
                    }
                    rows.push(f.summary(now));
                    if rows.len() >= limit {
                        break 'pages;
                    }
                }
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                let cols = [
                    "machine_id",
                    "state",
                    "provider",
                    "provider_id",
                    "address",
                    "location",
                    "heartbeat_at",
                ];
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
                println!("{}", line(cols.iter().map(|c| c.to_uppercase()).collect()));
                for r in cells {
                    println!("{}", line(r));
                }
            }
        }
        MachinesCommand::Show { id, json } => {
            let (facts, hardware, history, exists) = db
                .read(move |tx| {
                    Box::pin(async move {
                        Ok((
                            Facts::load(tx, id).await?,
                            tx.hardware_report(id).await?,
                            tx.machine_history(id).await?,
                            tx.machine_exists(id).await?,
                        ))
                    })
                })
                .await?;
            if !exists {
                bail!("machine {id} does not exist");
            }
            let hardware = hardware.map(|raw| match AgentHardwareReport::decode(raw.as_slice()) {
                Ok(r) => json!(format!("{r:?}")),
                Err(e) => json!(format!("undecodable report: {e}")),
            });
            let mut v = facts.summary(now);
            v["agent_started_at"] = json!(facts.agent.as_ref().map(|a| a.started_at.to_rfc3339()));
            v["agent_key"] = json!(facts.agent.as_ref().map(|a| a
                .public_key
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect::<String>()));
            v["installation_request_generation"] =
                json!(facts.request.as_ref().map(|r| r.generation));
            v["installation_report"] = json!(facts
                .report
                .as_ref()
                .map(|r| json!({"generation": r.generation, "result": r.result.to_string()})));
            v["hardware_report"] = json!(hardware);
            v["work"] = json!(facts.work.iter().map(|w| json!({"process": w.process.to_string(), "session_id": w.session_id.to_string()})).collect::<Vec<_>>());
            v["backoffs"] = json!(facts.backoffs.iter().map(|b| json!({"process": b.process.to_string(), "until": b.until.to_rfc3339(), "cause": b.cause})).collect::<Vec<_>>());
            v["history"] = json!(history.iter().map(|h| json!({"at": h.at.to_rfc3339(), "process": h.process.to_string(), "event": h.event.to_string(), "cause": h.cause})).collect::<Vec<_>>());
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else if let Value::Object(map) = v {
                for (k, val) in map {
                    println!("{k:<34} {}", text(&val));
                }
            }
        }
        MachinesCommand::History { id } => {
            let history = db
                .read(move |tx| Box::pin(async move { tx.machine_history(id).await }))
                .await?;
            for h in history {
                println!(
                    "{}  {:<20} {:<9} {}",
                    h.at.to_rfc3339(),
                    h.process.to_string(),
                    h.event.to_string(),
                    h.cause.unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

/// `shepherd sessions list`.
pub async fn sessions(url: &str) -> Result<()> {
    let db = Bmdb::open(url).await?;
    let sessions = db
        .read(|tx| Box::pin(async move { tx.sessions().await }))
        .await;
    db.close().await;
    let now = Utc::now();
    for s in sessions? {
        println!(
            "{}  {:<22} {:<22} {:<8} deadline {} ({})",
            s.session_id,
            s.component_name,
            s.processor,
            if s.deadline > now { "live" } else { "expired" },
            s.deadline.to_rfc3339(),
            s.runtime_info
        );
    }
    Ok(())
}
