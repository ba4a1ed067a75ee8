//! The tags a finished unit of work writes (design.md §4: a finish and its tag writes are one
//! transaction), described as data rather than as code, so that the finishes of one ending
//! batch (`ending_batch.rs`) are written with their endings: on Postgres, columns of the one
//! statement that ends the batch's work (`endings.rs`), instead of a few statements per
//! finish, one after another. SQLite, one writer on a local file, writes them finish by
//! finish with the methods of `tags.rs`.

use std::time::Duration;

use chrono::TimeDelta;
use uuid::Uuid;

use super::engine::{Result, Tx};
use crate::model::{Process, AGENT_KEY_LEN};
use crate::Error;

/// What a finish does to the `agent_started` tag.
#[derive(Debug, Clone, PartialEq, Eq)]
enum AgentTag {
    /// The agent was started now with this ed25519 public key.
    Started(Vec<u8>),
    /// The agent is gone (its machine was rebooted).
    Forgotten,
}

/// A hold on one process of the machine, counted from the finishing transaction's time.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HoldBack {
    process: Process,
    wait: Duration,
    interval: i64,
    cause: String,
}

/// Longest hold a finish can set: a century, which Postgres intervals and chrono both hold.
const LONGEST_HOLD: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// The tag writes that end a successful unit of work, committed in the same transaction as
/// its Finish (see [`crate::Work::finish`]). Built with the methods below; each names one
/// write on the work's machine. A finish that writes nothing is [`TagWrites::none`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TagWrites {
    pin: Option<String>,
    agent: Option<AgentTag>,
    live_proof: Option<String>,
    forget_heartbeat: bool,
    recovery: Option<i32>,
    holds: Vec<HoldBack>,
}

impl TagWrites {
    /// A finish that writes no tag.
    pub fn none() -> Self {
        TagWrites::default()
    }

    /// Pins `key` as the machine's SSH host key unless one is pinned already. The finish is
    /// refused ([`Error::HostKeyPinned`], nothing of it written) when another key is pinned.
    pub fn pin_ssh_host_key(mut self, key: impl Into<String>) -> Self {
        self.pin = Some(key.into());
        self
    }

    /// Records that the machine's agent started now with this ed25519 public key (which must
    /// be [`AGENT_KEY_LEN`] bytes, or the finish is refused with [`Error::InvalidArgument`]).
    pub fn agent_started(mut self, public_key: impl Into<Vec<u8>>) -> Self {
        self.agent = Some(AgentTag::Started(public_key.into()));
        self
    }

    /// With [`TagWrites::agent_started`]: the agent showed this proof of running in its
    /// machine's live environment (design.md §21). Without it, a start shows none.
    pub fn live_proof(mut self, proof: impl Into<String>) -> Self {
        self.live_proof = Some(proof.into());
        self
    }

    /// Removes the `agent_started` tag (the agent is gone).
    pub fn forget_agent_started(mut self) -> Self {
        self.agent = Some(AgentTag::Forgotten);
        self
    }

    /// Removes the heartbeat tag.
    pub fn forget_heartbeat(mut self) -> Self {
        self.forget_heartbeat = true;
        self
    }

    /// Records that the recoverer rebooted the machine now, the `in_a_row`th time since its
    /// agent last heartbeated.
    pub fn recovery(mut self, in_a_row: i64) -> Self {
        self.recovery = Some(i32::try_from(in_a_row).unwrap_or(i32::MAX));
        self
    }

    /// Keeps `process` off the machine for `wait` from now (at most a century), with `cause`
    /// for operators; replaces an earlier hold of the same process in these writes. An
    /// `interval` of 0 marks a wait that is not a failure (see [`Tx::set_backoff`]).
    pub fn hold_back(
        mut self,
        process: Process,
        wait: Duration,
        interval: i64,
        cause: &str,
    ) -> Self {
        self.holds.retain(|h| h.process != process);
        self.holds.push(HoldBack {
            process,
            wait: wait.min(LONGEST_HOLD),
            interval,
            cause: crate::model::stored_cause(cause),
        });
        self
    }

    /// Whether `pinned`, the host key the machine has after these writes, refuses them.
    pub(crate) fn refused_by_pin(&self, machine: Uuid, pinned: Option<String>) -> Option<Error> {
        let presented = self.pin.as_ref()?;
        match pinned {
            Some(pinned) if pinned == *presented => None,
            Some(pinned) => Some(Error::HostKeyPinned {
                pinned,
                presented: presented.clone(),
            }),
            None => Some(Error::MachineGone(machine)),
        }
    }

    /// Refuses writes the database would refuse, before anything is written, so that a
    /// finish that cannot be written fails alone and the statement shared with other
    /// finishes does not fail.
    pub(crate) fn check(&self) -> std::result::Result<(), Error> {
        if let Some(AgentTag::Started(key)) = &self.agent {
            if key.len() != AGENT_KEY_LEN {
                return Err(Error::InvalidArgument {
                    what: "agent public key",
                    problem: format!("must be {AGENT_KEY_LEN} bytes, got {}", key.len()),
                });
            }
        }
        if let Some(key) = &self.pin {
            if key.is_empty() || key.contains('\0') {
                return Err(Error::InvalidArgument {
                    what: "SSH host key",
                    problem: "must be non-empty text without NUL characters".into(),
                });
            }
        }
        Ok(())
    }
}

/// One ending of a batch that was refused: its index among those given, and why.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) member: usize,
    pub(crate) error: Error,
}

impl Tx {
    /// Writes one finish's tags statement by statement, after its ending (SQLite); any
    /// failure refuses this finish.
    pub(crate) async fn write_tags_of(&mut self, machine: Uuid, writes: &TagWrites) -> Result<()> {
        if let Some(key) = &writes.pin {
            self.pin_ssh_host_key(machine, key).await?;
        }
        match &writes.agent {
            Some(AgentTag::Started(key)) => {
                let proof = writes.live_proof.as_deref();
                self.set_agent_started_with_proof(machine, key, proof)
                    .await?
            }
            Some(AgentTag::Forgotten) => {
                self.delete_agent_started(machine).await?;
            }
            None => {}
        }
        if writes.forget_heartbeat {
            self.delete_heartbeat(machine).await?;
        }
        if let Some(in_a_row) = writes.recovery {
            self.set_recovery(machine, in_a_row.into()).await?;
        }
        if !writes.holds.is_empty() {
            let now = self.now().await?;
            for h in &writes.holds {
                let wait = TimeDelta::from_std(h.wait).unwrap_or(TimeDelta::MAX);
                self.set_backoff(machine, h.process, now + wait, h.interval, &h.cause)
                    .await?;
            }
        }
        Ok(())
    }
}

/// The tag columns of the Postgres ending statement (`endings.rs`), one element per ending
/// (writing nothing for an ending that is no finish), and the holds, each naming its ending's
/// position.
#[derive(Default)]
pub(crate) struct TagColumns {
    pub(crate) pins: Vec<Option<String>>,
    pub(crate) agent_keys: Vec<Option<Vec<u8>>>,
    pub(crate) live_proofs: Vec<Option<String>>,
    pub(crate) forget_agents: Vec<bool>,
    pub(crate) forget_heartbeats: Vec<bool>,
    pub(crate) recoveries: Vec<Option<i32>>,
    pub(crate) holds: HoldColumns,
}

/// The holds of [`TagColumns`]: ending position (from 1), process, seconds, cause, interval.
#[derive(Default)]
pub(crate) struct HoldColumns {
    pub(crate) endings: Vec<i64>,
    pub(crate) processes: Vec<&'static str>,
    pub(crate) seconds: Vec<f64>,
    pub(crate) causes: Vec<String>,
    pub(crate) intervals: Vec<i64>,
}

impl TagColumns {
    /// Adds the next ending's writes (`None` for an ending that writes no tags).
    pub(crate) fn push(&mut self, writes: Option<&TagWrites>) {
        let none = TagWrites::default();
        let writes = writes.unwrap_or(&none);
        let position = self.pins.len() as i64 + 1;
        self.pins.push(writes.pin.clone());
        self.agent_keys.push(match &writes.agent {
            Some(AgentTag::Started(key)) => Some(key.clone()),
            _ => None,
        });
        self.live_proofs.push(match &writes.agent {
            Some(AgentTag::Started(_)) => writes.live_proof.clone(),
            _ => None,
        });
        self.forget_agents
            .push(writes.agent == Some(AgentTag::Forgotten));
        self.forget_heartbeats.push(writes.forget_heartbeat);
        self.recoveries.push(writes.recovery);
        for h in &writes.holds {
            self.holds.endings.push(position);
            self.holds.processes.push(h.process.as_str());
            self.holds.seconds.push(h.wait.as_secs_f64());
            self.holds.causes.push(h.cause.clone());
            self.holds.intervals.push(h.interval);
        }
    }
}
