//! `shepherd machines …` and `shepherd sessions list`: what the BMDB knows, for operators.

use crate::flags::ThresholdArgs;
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::Value;
use shepherd_bmdb::{Bmdb, Lifecycle, Operator, Process};
use uuid::Uuid;

use crate::actions::{self, InstallImage, MachineAction};
use crate::inventory;

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
    /// The operator, checked; `reason_needed` refuses a missing or blank reason.
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

/// Runs one action of operator `who` in a session of its own, closed afterwards.
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

/// Checks an image request before it reaches the BMDB, so a typo fails here rather than on
/// the machine.
async fn run_on(db: &Bmdb, command: MachinesCommand) -> Result<()> {
    match command {
        MachinesCommand::List {
            provider,
            state,
            after,
            limit,
            json,
            thresholds,
        } => {
            let provider: Option<shepherd_bmdb::Provider> = provider
                .map(|p| p.parse().with_context(|| format!("provider {p:?}")))
                .transpose()?;
            let listing = inventory::list(
                db,
                provider,
                state,
                after,
                limit,
                usize::MAX,
                thresholds.thresholds().stale_after(),
            )
            .await?;
            let rows: Vec<Value> = listing
                .machines
                .iter()
                .map(|m| inventory::summary_json(m, listing.state_of(m)))
                .collect();
            if json {
                println!("{}", serde_json::to_string_pretty(&rows)?);
            } else {
                if let Some(next) = listing.next {
                    eprintln!("more machines may follow: add --after {next}");
                }
                print!(
                    "{}",
                    table(
                        &rows,
                        &[
                            "machine_id",
                            "state",
                            "provider",
                            "provider_id",
                            "address",
                            "location",
                            "heartbeat_at",
                        ]
                    )
                );
            }
        }
        MachinesCommand::Show {
            id,
            json,
            thresholds,
        } => {
            let stale_after = thresholds.thresholds().stale_after();
            let Some(detail) = inventory::detail(db, id, stale_after).await? else {
                bail!(actions::no_such_machine(db, id).await?);
            };
            let v = inventory::detail_json(&detail);
            if json {
                println!("{}", serde_json::to_string_pretty(&v)?);
            } else if let Value::Object(map) = v {
                for (k, val) in map {
                    match (&detail.hardware, k.as_str()) {
                        // The whole report, a line per part, rather than one JSON line.
                        (Some(Ok(report)), "hardware_report") => {
                            println!("hardware_report");
                            for (label, line) in inventory::hardware_lines(report) {
                                println!("  {label:<20} {line}");
                            }
                        }
                        _ => println!("{k:<22} {}", text(&val)),
                    }
                }
            }
        }
        MachinesCommand::History { id } => {
            let (lines, decommissioned) = inventory::history(db, id).await?;
            if lines.is_empty() && decommissioned.is_none() {
                let exists = db
                    .read(move |tx| Box::pin(async move { tx.machine_exists(id).await }))
                    .await?;
                if !exists {
                    bail!("machine {id} does not exist and has no history");
                }
            }
            for l in lines {
                println!(
                    "{}  {:<20} {:<15} {}",
                    l.at.to_rfc3339(),
                    l.who,
                    l.what,
                    l.why
                );
            }
        }
        MachinesCommand::Retry { id, process, who } => {
            act(db, id, MachineAction::Retry { process }, &who).await?;
        }
        MachinesCommand::ForgetHostKey { id, who } => {
            act(db, id, MachineAction::ForgetHostKey, &who).await?;
        }
        MachinesCommand::Maintenance { switch, id, who } => {
            let action = match switch {
                Switch::On => MachineAction::MaintenanceOn,
                Switch::Off => MachineAction::MaintenanceOff,
            };
            act(db, id, action, &who).await?;
        }
        MachinesCommand::Decommission { id, undeploy, who } => {
            act(db, id, MachineAction::Decommission { undeploy }, &who).await?;
        }
        MachinesCommand::Recommission { id, who } => {
            act(db, id, MachineAction::Recommission, &who).await?;
        }
        MachinesCommand::Install {
            id,
            image,
            sha256,
            device,
            who,
        } => {
            let image = InstallImage::new(image, sha256, device)?;
            act(db, id, MachineAction::Install(image), &who).await?;
        }
    }
    Ok(())
}

/// Performs `action` on machine `id` for the operator `who` names, and says what it did.
async fn act(db: &Bmdb, id: Uuid, action: MachineAction, who: &WhoArgs) -> Result<()> {
    if action.needs_reason() && who.reason.as_deref().unwrap_or("").trim().is_empty() {
        bail!("--reason is needed: say why, for the machine's history");
    }
    let performed = actions::perform(db, "shepherd-cli", id, action, &who.operator()?).await?;
    println!("machine {id}: {}", performed.message());
    Ok(())
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
            s.component_name,
            s.processor,
            if s.deadline > now { "live" } else { "expired" },
            s.deadline.to_rfc3339(),
            s.runtime_info
        );
    }
    Ok(())
}
