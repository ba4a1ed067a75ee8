//! Operators' actions on machines — maintenance, retry, forgetting a host key, an OS
//! installation request, decommission and its undo — each one session transaction that
//! changes the machine and writes who did it and why into the operators' history
//! (`operator_actions`), so it is safe while the loops run on the same machines and every
//! change can be traced to a person.

use std::sync::Arc;

use uuid::Uuid;

use crate::model::*;
use crate::sql::engine::TxFuture;
use crate::{Error, Session, Tx};

/// What an operator action found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ActionOutcome<T> {
    /// No machine has this id (it may have been decommissioned).
    NoSuchMachine,
    /// The machine was already as asked; nothing was written.
    Unchanged,
    /// Done and recorded.
    Done(T),
}

/// The cause the history gives work a decommissioning ended.
fn decommission_cause(who: &Operator) -> String {
    format!("machine decommissioned by {}", who.by)
}

/// What an action's body knows besides its transaction: the machine, who acts, and the
/// session the action runs in.
#[derive(Debug, Clone)]
struct Act {
    machine: Uuid,
    who: Operator,
    session: Uuid,
}

impl Act {
    /// Writes the action into the operators' history, in the action's transaction.
    async fn record(
        &self,
        tx: &mut Tx,
        action: OperatorAction,
        process: Option<Process>,
    ) -> Result<(), Error> {
        self.record_as(tx, action, process, &self.who).await
    }

    /// Like [`Act::record`], with another wording of who and why.
    async fn record_as(
        &self,
        tx: &mut Tx,
        action: OperatorAction,
        process: Option<Process>,
        who: &Operator,
    ) -> Result<(), Error> {
        tx.record_action(self.machine, action, process, who, Some(self.session))
            .await
    }
}

/// The transaction an action runs `body` in, once it found the machine.
type ActionBody<T> =
    dyn for<'t> Fn(&'t mut Tx, Act) -> TxFuture<'t, ActionOutcome<T>> + Send + Sync;

/// Runs `body` in one session transaction of `session` on behalf of `who`, after checking, in
/// the same transaction, that `machine` exists (else [`ActionOutcome::NoSuchMachine`]).
async fn on_existing_machine<T: Send + 'static>(
    session: &Session,
    machine: Uuid,
    who: &Operator,
    body: impl for<'t> Fn(&'t mut Tx, Act) -> TxFuture<'t, ActionOutcome<T>> + Send + Sync + 'static,
) -> Result<ActionOutcome<T>, Error> {
    let body: Arc<ActionBody<T>> = Arc::new(body);
    let act = Act {
        machine,
        who: who.clone(),
        session: session.id(),
    };
    session
        .transact(move |tx| {
            let (body, act) = (body.clone(), act.clone());
            Box::pin(async move {
                if !tx.machine_exists(act.machine).await? {
                    return Ok(ActionOutcome::NoSuchMachine);
                }
                body(tx, act).await
            })
        })
        .await
}

impl Session {
    /// Takes the machine out of the loops' hands: no loop claims it from the moment this
    /// returns, while the updater keeps its facts fresh and its agent keeps heartbeating.
    /// Work already running finishes; the processes holding it are returned.
    pub async fn maintenance_on(
        &self,
        machine: Uuid,
        who: &Operator,
    ) -> Result<ActionOutcome<Vec<Process>>, Error> {
        on_existing_machine(self, machine, who, |tx, act| {
            Box::pin(async move {
                if !tx.set_maintenance(act.machine, &act.who).await? {
                    return Ok(ActionOutcome::Unchanged);
                }
                act.record(tx, OperatorAction::MaintenanceOn, None).await?;
                let running = tx.machine_work(act.machine).await?;
                Ok(ActionOutcome::Done(
                    running.into_iter().map(|w| w.process).collect(),
                ))
            })
        })
        .await
    }

    /// Gives the machine back to the loops.
    pub async fn maintenance_off(
        &self,
        machine: Uuid,
        who: &Operator,
    ) -> Result<ActionOutcome<()>, Error> {
        on_existing_machine(self, machine, who, |tx, act| {
            Box::pin(async move {
                if !tx.clear_maintenance(act.machine).await? {
                    return Ok(ActionOutcome::Unchanged);
                }
                act.record(tx, OperatorAction::MaintenanceOff, None).await?;
                Ok(ActionOutcome::Done(()))
            })
        })
        .await
    }

    /// Ends the machine's backoffs now (of `process`, or of all); returns how many ended.
    pub async fn retry(
        &self,
        machine: Uuid,
        process: Option<Process>,
        who: &Operator,
    ) -> Result<ActionOutcome<u64>, Error> {
        on_existing_machine(self, machine, who, move |tx, act| {
            Box::pin(async move {
                let cleared = tx.clear_backoffs(act.machine, process).await?;
                if cleared == 0 {
                    return Ok(ActionOutcome::Unchanged);
                }
                act.record(tx, OperatorAction::Retry, process).await?;
                Ok(ActionOutcome::Done(cleared))
            })
        })
        .await
    }

    /// Forgets the machine's pinned SSH host key (the next takeover pins the key it finds) and
    /// ends the takeover's backoff; returns the key forgotten, which the history keeps.
    pub async fn forget_host_key(
        &self,
        machine: Uuid,
        who: &Operator,
    ) -> Result<ActionOutcome<SshHostKey>, Error> {
        on_existing_machine(self, machine, who, |tx, act| {
            Box::pin(async move {
                let Some(key) = tx.ssh_host_key(act.machine).await? else {
                    return Ok(ActionOutcome::Unchanged);
                };
                tx.delete_ssh_host_key(act.machine).await?;
                tx.clear_backoffs(act.machine, Some(Process::ShepherdAgentStart))
                    .await?;
                let noted = Operator {
                    reason: format!("{} (forgot {})", act.who.reason, key.key)
                        .trim_start()
                        .to_string(),
                    ..act.who.clone()
                };
                act.record_as(tx, OperatorAction::ForgetHostKey, None, &noted)
                    .await?;
                Ok(ActionOutcome::Done(key))
            })
        })
        .await
    }

    /// Asks the machine's agent to install an OS: `make_request` builds the serialized
    /// `OSInstallationRequest` for the generation it is given (one more than the machine's
    /// last request), which is recorded as the machine's installation request; the agent
    /// receives it with its next heartbeat. Returns the generation recorded.
    pub async fn request_installation(
        &self,
        machine: Uuid,
        who: &Operator,
        make_request: impl Fn(i64) -> Vec<u8> + Send + Sync + 'static,
    ) -> Result<ActionOutcome<i64>, Error> {
        let make_request = Arc::new(make_request);
        on_existing_machine(self, machine, who, move |tx, act| {
            let make_request = make_request.clone();
            Box::pin(async move {
                let generation = tx
                    .os_installation_request(act.machine)
                    .await?
                    .map_or(1, |r| r.generation + 1);
                let request = OsInstallationRequest {
                    generation,
                    request_raw: make_request(generation),
                };
                tx.set_os_installation_request(act.machine, &request)
                    .await?;
                act.record(tx, OperatorAction::Install, None).await?;
                Ok(ActionOutcome::Done(generation))
            })
        })
        .await
    }

    /// Sends a machine that came bare back to its live environment to install its OS again:
    /// its bare-metal way starts over (phase `Bare`, no attempt made), its agent, heartbeat,
    /// pinned host key and installation are forgotten, and the bare-metal loop boots it from
    /// its BMC's virtual media once it claims it. With `wipe`, the agent may overwrite a disk
    /// that holds a partition table or a file system (it will: the installed OS), and the
    /// operator is recorded as who allowed it. A machine never recorded bare is refused with
    /// [`Error::InvalidArgument`]: only its inventory entry can make it bare.
    pub async fn reimage(
        &self,
        machine: Uuid,
        who: &Operator,
        wipe: bool,
    ) -> Result<ActionOutcome<()>, Error> {
        on_existing_machine(self, machine, who, move |tx, act| {
            Box::pin(reimage(tx, act, wipe))
        })
        .await
    }

    /// Removes the machine from the BMDB: its tags, locks (each ended as Canceled) and
    /// backoffs go, its history stays, and its provider id is barred so the provisioner does
    /// not bring it back until [`Session::recommission`]. The provisioner hands the machine
    /// back to its provider (where the provider has a notion of that: Ironic releases the
    /// node), tearing it down first when `undeploy`. Returns the provided tag it had.
    pub async fn decommission(
        &self,
        machine: Uuid,
        who: &Operator,
        undeploy: bool,
    ) -> Result<ActionOutcome<Option<Provided>>, Error> {
        on_existing_machine(self, machine, who, move |tx, act| {
            Box::pin(async move {
                let provided = tx.provided(act.machine).await?;
                act.record(tx, OperatorAction::Decommission, None).await?;
                let cause = decommission_cause(&act.who);
                tx.decommission(act.machine, &act.who, undeploy, &cause)
                    .await?;
                Ok(ActionOutcome::Done(provided))
            })
        })
        .await
    }

    /// Lifts a decommissioning's bar: the provisioner may bring the provider id back, as a
    /// new machine. Returns the record lifted. (The machine itself is gone, so this action
    /// looks for the record, not the machine.)
    pub async fn recommission(
        &self,
        machine: Uuid,
        who: &Operator,
    ) -> Result<ActionOutcome<Decommissioned>, Error> {
        let act = Act {
            machine,
            who: who.clone(),
            session: self.id(),
        };
        self.transact(move |tx| {
            let act = act.clone();
            Box::pin(async move {
                let Some(lifted) = tx.decommissioned(act.machine).await? else {
                    return Ok(ActionOutcome::NoSuchMachine);
                };
                tx.recommission(act.machine).await?;
                act.record(tx, OperatorAction::Recommission, None).await?;
                Ok(ActionOutcome::Done(lifted))
            })
        })
        .await
    }
}

/// [`Session::reimage`]'s transaction, once the machine was found.
async fn reimage(tx: &mut Tx, act: Act, wipe: bool) -> Result<ActionOutcome<()>, Error> {
    if tx.bare_metal(act.machine).await?.is_none() {
        let problem = format!(
            "{} was not recorded bare: only a machine whose inventory entry says \"Bare\" when it is recorded can be reimaged",
            act.machine
        );
        return Err(Error::InvalidArgument {
            what: "machine",
            problem,
        });
    }
    let (by, reason) = (&act.who.by, &act.who.reason);
    let allowed = wipe.then(|| format!("{by} (reimage: {reason})"));
    let disk = if wipe {
        "may"
    } else {
        "may not (unless the inventory entry allows it)"
    };
    let detail = format!("reimaged by {by}: {reason}; the disk {disk} be overwritten");
    tx.record_bare(act.machine, allowed.as_deref(), &detail, None)
        .await?;
    act.record(tx, OperatorAction::Reimage, None).await?;
    Ok(ActionOutcome::Done(()))
}
