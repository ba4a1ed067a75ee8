//! `shepherd machines …` and `shepherd sessions list`: what the BMDB knows, for operators.

use crate::flags::ThresholdArgs;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::Value;
use shepherd_bmdb::{Bmdb, Lifecycle, Operator, Process};
use uuid::Uuid;

use crate::actions::{self, InstallImage, MachineAction};
use crate::api_client::{ApiArgs, ApiClient};
use crate::inventory;
use crate::one_line::one_line;

fn parse_state(s: &str) -> Result<Lifecycle, String> {
    s.parse().map_err(|e: shepherd_bmdb::Error| e.to_string())
}

/// Subcommands of `shepherd machines`.
#[derive(Debug, Subcommand)]
pub enum MachinesCommand {
    /// One line per machine, in machine-id order.
    List {
        /// Only machines of this provider (e.g. Static, Sim).
        #[arg(long)]
        provider: Option<String>,
        /// Only machines in this state (provided, agent-starting, heartbeating, stale,
        /// in-backoff, in-work, installing, installed, unprovided).
        #[arg(long, value_parser = parse_state)]
        state: Option<Lifecycle>,
        /// Start after this machine id (paging).
        #[arg(long)]
        after: Option<Uuid>,
        /// Most machines to show.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// JSON instead of a table.
        #[arg(long)]
        json: bool,
        /// The recoverer's thresholds (what counts as stale).
        #[command(flatten)]
        thresholds: ThresholdArgs,
    },
    /// Every tag of one machine, its work, backoffs and history.
    Show {
        /// Machine id.
        id: Uuid,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
        /// The recoverer's thresholds (what counts as stale).
        #[command(flatten)]
        thresholds: ThresholdArgs,
    },
    /// The work history of one machine.
    History {
        /// Machine id.
        id: Uuid,
    },
    /// Ends the machine's backoffs now, so the loops may take it again at once: after a
    /// machine was left alone by the recoverer, or once a failure's cause is fixed.
    Retry {
        /// Machine id.
        id: Uuid,
        /// Only this process's backoff (ShepherdAccess, ShepherdAgentStart, ShepherdRecovery).
        #[arg(long)]
        process: Option<Process>,
        /// Who and why, for the history.
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Forgets the machine's pinned SSH host key, after the operator checked that it changed
    /// legitimately (the machine was reinstalled): the next takeover pins the key it finds,
    /// and the takeover's backoff ends now.
    ForgetHostKey {
        /// Machine id.
        id: Uuid,
        /// Who and why, for the history.
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Takes a machine out of the loops' hands (`on`) or gives it back (`off`). In
    /// maintenance no loop claims it (work already running finishes); the updater still
    /// refreshes its facts and its agent still heartbeats.
    Maintenance {
        /// `on` or `off`.
        switch: Switch,
        /// Machine id.
        id: Uuid,
        /// Who and why, for the history (`on` needs a reason).
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Removes a machine from the BMDB: its tags, locks and backoffs go, its history stays, and
    /// the provisioner does not bring its provider id back until `recommission`. The
    /// provisioner hands it back to its provider where the provider knows how (Ironic: the
    /// node's reservation is released).
    Decommission {
        /// Machine id.
        id: Uuid,
        /// Also tear the machine down at its provider (Ironic: undeploy the node, so Ironic
        /// cleans it), not only release it. Its disks are lost.
        #[arg(long)]
        undeploy: bool,
        /// Who and why, for the history (a reason is needed).
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Undoes `decommission`: the provisioner may bring the provider id back, as a new machine.
    Recommission {
        /// The decommissioned machine's id.
        id: Uuid,
        /// Who and why, for the history.
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Asks the machine's agent to install an OS image (the next heartbeat response carries
    /// the request; the generation is bumped so a new request is never mistaken for an old one).
    Install {
        /// Machine id.
        id: Uuid,
        /// Where the agent downloads the image from (http or https).
        #[arg(long)]
        image: String,
        /// SHA-256 of the image, 64 hex digits; the agent refuses anything else.
        #[arg(long)]
        sha256: String,
        /// Block device (or file) the agent writes the image to.
        #[arg(long)]
        device: String,
        /// The device may be overwritten although it holds a partition table or a file system
        /// (without it the agent writes only a blank device and reports what it found).
        #[arg(long)]
        wipe: bool,
        /// Who asks, and why (recorded in the machine's operators' history).
        #[command(flatten)]
        who: WhoArgs,
    },
    /// Sends a machine that came bare back to its live environment: its BMC boots it from the
    /// live image and its inventory entry's OS image is installed again (admin). Needs a
    /// reason.
    Reimage {
        /// Machine id.
        id: Uuid,
        /// Its disk may be overwritten although it holds an OS (it does, once installed);
        /// recorded as who allowed the wipe.
        #[arg(long)]
        wipe: bool,
        /// Who asks, and why (recorded in the machine's operators' history).
        #[command(flatten)]
        who: WhoArgs,
    },
}

/// `on` or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Switch {
    /// Begin.
    On,
    /// End.
    Off,
}

/// Who runs an operator action and why, kept in the machine's history.
#[derive(Debug, Clone, clap::Args)]
pub struct WhoArgs {
    /// Who does this (default: the login name from `USER` or `LOGNAME`).
    #[arg(long)]
    by: Option<String>,
    /// Why.
    #[arg(long)]
    reason: Option<String>,
}

impl WhoArgs {
    /// The operator on the database: `--by`, else the login name, else the user id.
    fn operator(&self) -> Result<Operator> {
        // Without --by or a login name in the environment (a cron job, a container), the
        // user id still says who.
        let by = self.by.clone().unwrap_or_else(|| {
            ["USER", "LOGNAME"]
                .iter()
                .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
                .unwrap_or_else(|| {
                    use std::os::unix::fs::MetadataExt;
                    std::fs::metadata("/proc/self")
                        .map(|m| format!("uid {}", m.uid()))
                        .unwrap_or_else(|_| "unknown".into())
                })
        });
        let reason = self.reason.clone().unwrap_or_default();
        Ok(Operator::new(by, reason)?)
    }
}

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
                let provider: Option<shepherd_bmdb::Provider> = provider
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
