//! Operators' actions on one machine, performed the one way both the CLI (on the database) and
//! the operator API use: each is one session transaction of `shepherd_bmdb`'s operator
//! actions, and what it did is told in one sentence.

use shepherd_bmdb::{ActionOutcome, Bmdb, Operator, Process, Processor, SessionConfig};
use shepherd_proto::bmaas as proto;
use shepherd_proto::Message;
use uuid::Uuid;

/// An image for an installation request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallImage {
    /// Where the agent downloads it (http or https).
    pub url: String,
    /// Its SHA-256, 64 hex digits.
    pub sha256: String,
    /// The block device it is written to.
    pub device: String,
    /// The device may be overwritten although it holds a partition table or a file system
    /// (without it the agent writes only a blank device).
    pub wipe: bool,
}

impl InstallImage {
    /// The image, checked; the message names the bad field.
    pub fn new(
        url: String,
        sha256: String,
        device: String,
        wipe: bool,
    ) -> Result<Self, ActionError> {
        let invalid = |m: String| Err(ActionError::Invalid(m));
        if !(url.starts_with("https://") || url.starts_with("http://")) {
            return invalid(format!("image: {url:?} is not an http(s) URL"));
        }
        if sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
            return invalid(format!("sha256: {sha256:?} is not 64 hex digits"));
        }
        if device.is_empty() {
            return invalid("device: must not be empty".into());
        }
        let sha256 = sha256.to_ascii_lowercase();
        Ok(InstallImage {
            url,
            sha256,
            device,
            wipe,
        })
    }

    /// The serialized `OSInstallationRequest` of `generation`.
    fn request(&self, generation: i64) -> Vec<u8> {
        let image = proto::ImageInstallationRequest {
            url: self.url.clone(),
            sha256: self.sha256.clone(),
            target_device: self.device.clone(),
            root_device_hints: String::new(),
            format: String::new(),
            wipe_allowed: self.wipe,
            no_reboot: false,
            // An operator's own image brings its own way in: no config drive is added.
            config_drive: Vec::new(),
        };
        proto::OsInstallationRequest {
            generation,
            r#type: Some(proto::os_installation_request::Type::Image(image)),
        }
        .encode_to_vec()
    }
}

/// What an operator can do to a machine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MachineAction {
    /// Take it out of the loops' hands.
    MaintenanceOn,
    /// Give it back to the loops.
    MaintenanceOff,
    /// End its backoffs (of one process, or all) now.
    Retry {
        /// Only this process's backoff.
        process: Option<Process>,
    },
    /// Forget its pinned SSH host key.
    ForgetHostKey,
    /// Remove it from the BMDB and bar its provider id.
    Decommission {
        /// Also tear it down at its provider.
        undeploy: bool,
    },
    /// Lift a decommissioning's bar.
    Recommission,
    /// Ask its agent to install an OS image.
    Install(InstallImage),
    /// Send a machine that came bare back to its live environment to install its OS again.
    Reimage {
        /// Its disk may be overwritten although it holds an OS (it does, once installed).
        wipe: bool,
    },
}

impl MachineAction {
    /// Whether the history needs a reason for it: actions that take a machine away.
    pub fn needs_reason(&self) -> bool {
        matches!(
            self,
            MachineAction::MaintenanceOn
                | MachineAction::Decommission { .. }
                | MachineAction::Reimage { .. }
        )
    }
}

/// The operator API's route (under `/api/v1/machines/{id}/`) and body (without the reason)
/// for `action`: what the CLI sends when it acts through the API.
pub fn api_request(action: &MachineAction) -> (&'static str, serde_json::Value) {
    use serde_json::json;
    match action {
        MachineAction::MaintenanceOn => ("maintenance", json!({"on": true})),
        MachineAction::MaintenanceOff => ("maintenance", json!({"on": false})),
        MachineAction::Retry { process } => {
            let process = process.map(|p| p.as_str());
            ("retry", json!({ "process": process }))
        }
        MachineAction::ForgetHostKey => ("forget-host-key", json!({})),
        MachineAction::Decommission { undeploy } => {
            ("decommission", json!({ "undeploy": undeploy }))
        }
        MachineAction::Recommission => ("recommission", json!({})),
        MachineAction::Install(image) => (
            "install",
            json!({"image": image.url, "sha256": image.sha256, "device": image.device,
                   "wipe": image.wipe}),
        ),
        MachineAction::Reimage { wipe } => ("reimage", json!({ "wipe": wipe })),
    }
}

/// What an action did, in a sentence for people.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Performed {
    /// It changed the machine and was recorded.
    Done(String),
    /// The machine was already as asked; nothing was written.
    Unchanged(String),
}

impl Performed {
    /// The sentence.
    pub fn message(&self) -> &str {
        match self {
            Performed::Done(m) | Performed::Unchanged(m) => m,
        }
    }
}

/// Why an action was not performed.
#[derive(Debug, thiserror::Error)]
pub enum ActionError {
    /// The request is invalid (a reason missing, a bad image); nothing was written.
    #[error("{0}")]
    Invalid(String),
    /// No machine has that id; the message says whether it was decommissioned.
    #[error("{0}")]
    NoSuchMachine(String),
    /// The BMDB failed; nothing was written.
    #[error(transparent)]
    Bmdb(#[from] shepherd_bmdb::Error),
}

/// Performs `action` on machine `id` for `who`, in one transaction of a short session named
/// `component` (`shepherd-cli`, `shepherd-api`).
pub async fn perform(
    db: &Bmdb,
    component: &str,
    id: Uuid,
    action: MachineAction,
    who: &Operator,
) -> Result<Performed, ActionError> {
    if action.needs_reason() && who.reason.trim().is_empty() {
        return Err(ActionError::Invalid(
            "a reason is needed: say why, for the machine's history".into(),
        ));
    }
    let recommission = action == MachineAction::Recommission;
    let config = SessionConfig::new(component, Processor::ShepherdOperator);
    let session = db.start_session(config).await?;
    let performed = perform_in(&session, id, action, who).await;
    // The action committed or failed on its own; a session that cannot close expires.
    let _ = session.close().await;
    let performed = match performed {
        // What the BMDB refused as invalid is the request's fault (reimaging a machine that
        // never came bare): nothing was written.
        Err(shepherd_bmdb::Error::InvalidArgument { what, problem }) => {
            return Err(ActionError::Invalid(format!("{what}: {problem}")))
        }
        other => other?,
    };
    match performed {
        Some(p) => Ok(p),
        None if recommission => Err(ActionError::NoSuchMachine(format!(
            "machine {id} is not decommissioned"
        ))),
        None => Err(ActionError::NoSuchMachine(no_such_machine(db, id).await?)),
    }
}

/// The action in `session`; `None` if there is no such machine.
async fn perform_in(
    s: &shepherd_bmdb::Session,
    id: Uuid,
    action: MachineAction,
    who: &Operator,
) -> Result<Option<Performed>, shepherd_bmdb::Error> {
    Ok(match action {
        MachineAction::MaintenanceOn => told(
            s.maintenance_on(id, who).await?,
            "already in maintenance",
            |running| {
                let mut line = "in maintenance; no loop will claim it".to_string();
                if !running.is_empty() {
                    let names: Vec<String> = running.iter().map(|p| p.to_string()).collect();
                    let names = names.join(", ");
                    line += &format!(" (work already running finishes first: {names})");
                }
                line
            },
        ),
        MachineAction::MaintenanceOff => told(
            s.maintenance_off(id, who).await?,
            "was not in maintenance",
            |()| "out of maintenance; the loops may take it again".into(),
        ),
        MachineAction::Retry { process } => told(
            s.retry(id, process, who).await?,
            "no backoff to clear",
            |n| format!("{n} backoff(s) cleared; the loops may take it again now"),
        ),
        MachineAction::ForgetHostKey => told(
            s.forget_host_key(id, who).await?,
            "no host key pinned",
            |key| {
                let key = key.key;
                format!("forgot host key {key}; the next takeover pins the key it finds")
            },
        ),
        MachineAction::Decommission { undeploy } => {
            let outcome = s.decommission(id, who, undeploy).await?;
            told(outcome, "", |provided| match provided {
                Some(p) => format!(
                    "decommissioned; the provisioner {} and leaves {} machine {:?} alone \
                     until `shepherd machines recommission {id}`",
                    if undeploy {
                        "tears it down at its provider"
                    } else {
                        "releases it at its provider"
                    },
                    p.provider,
                    p.provider_id
                ),
                None => "decommissioned (it had no provider id)".into(),
            })
        }
        MachineAction::Recommission => told(s.recommission(id, who).await?, "", |d| {
            format!(
                "recommissioned; the provisioner may bring {} machine {:?} back as a new machine",
                d.provider, d.provider_id
            )
        }),
        MachineAction::Install(image) => {
            let wipe = image.wipe;
            let request = move |generation| image.request(generation);
            told(s.request_installation(id, who, request).await?, "", |g| {
                format!(
                    "installation request generation {g} recorded; the agent receives it \
                     with its next heartbeat{}",
                    if wipe {
                        " (and may overwrite a device that holds data)"
                    } else {
                        " (and writes only a blank device)"
                    }
                )
            })
        }
        MachineAction::Reimage { wipe } => told(s.reimage(id, who, wipe).await?, "", |()| {
            format!(
                "reimaging: the bare-metal loop boots it into its live environment and installs \
                 its inventory entry's image{}",
                if wipe {
                    ", overwriting its disk"
                } else {
                    " (onto a blank disk only, unless the entry says Wipe)"
                }
            )
        }),
    })
}

/// An outcome told in a sentence (`unchanged` where nothing was to do); `None` for no such
/// machine.
fn told<T>(
    outcome: ActionOutcome<T>,
    unchanged: &str,
    done: impl FnOnce(T) -> String,
) -> Option<Performed> {
    match outcome {
        ActionOutcome::NoSuchMachine => None,
        ActionOutcome::Unchanged => Some(Performed::Unchanged(unchanged.into())),
        ActionOutcome::Done(t) => Some(Performed::Done(done(t))),
    }
}

/// Why machine `id` is not there: decommissioned (when, by whom, how to undo), or unknown.
pub async fn no_such_machine(db: &Bmdb, id: Uuid) -> Result<String, shepherd_bmdb::Error> {
    let decommissioned = db
        .read(move |tx| Box::pin(async move { tx.decommissioned(id).await }))
        .await?;
    Ok(match decommissioned {
        Some(d) => format!(
            "machine {id} was decommissioned at {} by {} ({}); \
             `shepherd machines recommission {id}` undoes that",
            d.at.to_rfc3339(),
            d.by,
            d.reason
        ),
        None => format!("machine {id} does not exist"),
    })
}
