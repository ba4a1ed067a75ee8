//! Operators' actions on machines — maintenance, retry, forgetting a host key, decommission
//! and its undo — each one session transaction that changes the machine and writes who did
//! it and why into the operators' history (`operator_actions`), so it is safe while the loops
//! run on the same machines and every change can be traced to a person.

use uuid::Uuid;

use crate::model::*;
use crate::sql;
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

/// Runs `$body` in one session transaction of `$session` as operator `$who`, after checking
/// that `$machine` exists (else the outcome is [`ActionOutcome::NoSuchMachine`]); inside,
/// `$tx` is the transaction, `$w` the operator and `$sid` the session id.
macro_rules! on_existing_machine {
    ($session:ident, $machine:ident, $who:ident, |$tx:ident, $w:ident, $sid:ident| $body:block) => {{
        let ($sid, who) = ($session.id(), $who.clone());
        $session
            .transact(move |$tx| {
                let who = who.clone();
                Box::pin(async move {
                    let $w = &who;
                    if !$tx.machine_exists($machine).await? {
                        return Ok(ActionOutcome::NoSuchMachine);
                    }
                    $body
                })
            })
            .await
    }};
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
        on_existing_machine!(self, machine, who, |tx, who, session| {
            if !sql::operator::set_maintenance(&mut tx.inner, machine, who).await? {
                return Ok(ActionOutcome::Unchanged);
            }
            record(
                tx,
                machine,
                OperatorAction::MaintenanceOn,
                None,
                who,
                session,
            )
            .await?;
            let running = tx.machine_work(machine).await?;
            Ok(ActionOutcome::Done(
                running.into_iter().map(|w| w.process).collect(),
            ))
        })
    }

    /// Gives the machine back to the loops.
    pub async fn maintenance_off(
        &self,
        machine: Uuid,
        who: &Operator,
    ) -> Result<ActionOutcome<()>, Error> {
        on_existing_machine!(self, machine, who, |tx, who, session| {
            if !sql::operator::clear_maintenance(&mut tx.inner, machine).await? {
                return Ok(ActionOutcome::Unchanged);
            }
            record(
                tx,
                machine,
                OperatorAction::MaintenanceOff,
                None,
                who,
                session,
            )
            .await?;
            Ok(ActionOutcome::Done(()))
        })
    }

    /// Ends the machine's backoffs now (of `process`, or of all); returns how many ended.
    pub async fn retry(
        &self,
        machine: Uuid,
        process: Option<Process>,
        who: &Operator,
    ) -> Result<ActionOutcome<u64>, Error> {
        on_existing_machine!(self, machine, who, |tx, who, session| {
            let cleared = tx.clear_backoffs(machine, process).await?;
            if cleared == 0 {
                return Ok(ActionOutcome::Unchanged);
            }
            record(tx, machine, OperatorAction::Retry, process, who, session).await?;
            Ok(ActionOutcome::Done(cleared))
        })
    }

    /// Forgets the machine's pinned SSH host key (the next takeover pins the key it finds) and
    /// ends the takeover's backoff; returns the key forgotten, which the history keeps.
    pub async fn forget_host_key(
        &self,
        machine: Uuid,
        who: &Operator,
    ) -> Result<ActionOutcome<SshHostKey>, Error> {
        on_existing_machine!(self, machine, who, |tx, who, session| {
            let Some(key) = tx.ssh_host_key(machine).await? else {
                return Ok(ActionOutcome::Unchanged);
            };
            tx.delete_ssh_host_key(machine).await?;
            tx.clear_backoffs(machine, Some(Process::ShepherdAgentStart))
                .await?;
            let noted = Operator {
                by: who.by.clone(),
                reason: format!("{} (forgot {})", who.reason, key.key)
                    .trim_start()
                    .to_string(),
            };
            record(
                tx,
                machine,
                OperatorAction::ForgetHostKey,
                None,
                &noted,
                session,
            )
            .await?;
            Ok(ActionOutcome::Done(key))
        })
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
        on_existing_machine!(self, machine, who, |tx, who, session| {
            let provided = tx.provided(machine).await?;
            record(
                tx,
                machine,
                OperatorAction::Decommission,
                None,
                who,
                session,
            )
            .await?;
            sql::operator::decommission(
                &mut tx.inner,
                machine,
                who,
                undeploy,
                &decommission_cause(who),
            )
            .await?;
            Ok(ActionOutcome::Done(provided))
        })
    }

    /// Lifts a decommissioning's bar: the provisioner may bring the provider id back, as a
    /// new machine. Returns the record lifted.
    pub async fn recommission(
        &self,
        machine: Uuid,
        who: &Operator,
    ) -> Result<ActionOutcome<Decommissioned>, Error> {
        let (session, who) = (self.id(), who.clone());
        self.transact(move |tx| {
            let who = who.clone();
            Box::pin(async move {
                let who = &who;
                let Some(record_) = tx.decommissioned(machine).await? else {
                    return Ok(ActionOutcome::NoSuchMachine);
                };
                sql::operator::recommission(&mut tx.inner, machine).await?;
                record(
                    tx,
                    machine,
                    OperatorAction::Recommission,
                    None,
                    who,
                    session,
                )
                .await?;
                Ok(ActionOutcome::Done(record_))
            })
        })
        .await
    }
}

async fn record(
    tx: &mut Tx,
    machine: Uuid,
    action: OperatorAction,
    process: Option<Process>,
    who: &Operator,
    session: Uuid,
) -> Result<(), Error> {
    sql::operator::record_action(&mut tx.inner, machine, action, process, who, Some(session)).await
}
