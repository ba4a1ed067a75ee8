//! Operators' actions on machines: maintenance, decommissioning and the operators' history
//! (`operator_actions`), each statement once for both engines, as methods of [`Tx`].

use uuid::Uuid;

use super::engine::{from_columns, Arg, Dialects, Result, Tx};
use crate::model::*;

const SET_MAINTENANCE: Dialects = Dialects {
    postgres: "INSERT INTO machine_maintenance (machine_id, since, actor, reason)
               VALUES ($1, now(), $2, $3) ON CONFLICT (machine_id) DO NOTHING",
    sqlite: "INSERT INTO machine_maintenance (machine_id, since, actor, reason)
             VALUES ($1, $4, $2, $3) ON CONFLICT (machine_id) DO NOTHING",
};

const RECORD_ACTION: Dialects = Dialects {
    postgres: "INSERT INTO operator_actions
                      (machine_id, action, process, at, actor, reason, session_id, request_id)
               VALUES ($1, $2, $3, now(), $4, $5, $6, $7)",
    sqlite: "INSERT INTO operator_actions
                    (machine_id, action, process, at, actor, reason, session_id, request_id)
             VALUES ($1, $2, $3, $8, $4, $5, $6, $7)",
};

const DECOMMISSION: Dialects = Dialects {
    postgres: "INSERT INTO decommissioned
                      (provider, provider_id, machine_id, at, actor, reason, undeploy)
               SELECT provider, provider_id, machine_id, now(), $2, $3, $4
                 FROM machine_provided WHERE machine_id = $1",
    sqlite: "INSERT INTO decommissioned
                    (provider, provider_id, machine_id, at, actor, reason, undeploy)
             SELECT provider, provider_id, machine_id, $5, $2, $3, $4
               FROM machine_provided WHERE machine_id = $1",
};

/// Every lock held on the machine is released and ends as Canceled, with `$2` as the cause.
/// On Postgres the delete takes each lock row first: a holder finishing at the same moment
/// either ended first (nothing left to cancel) or finds its lock gone (work lost), never both.
/// SQLite's single writer serializes the two; its rows go with the `DELETE` that follows.
const CANCEL_MACHINE_WORK: Dialects = Dialects {
    postgres: "WITH del AS (
                  DELETE FROM work WHERE machine_id = $1 RETURNING machine_id, process, session_id)
               INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
               SELECT machine_id, process, 'Canceled', now(), session_id, $2 FROM del",
    sqlite: "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
             SELECT machine_id, process, 'Canceled', $3, session_id, $2
               FROM work WHERE machine_id = $1",
};

impl Tx {
    /// Puts the machine in maintenance unless it is; true if this call did. Bumps the
    /// machine's claim count, so a Postgres claim that read the machine before this commit
    /// cannot lock it after (its claim-count check fails): once this commits, no new work
    /// starts on the machine.
    pub(crate) async fn set_maintenance(&mut self, id: Uuid, who: &Operator) -> Result<bool> {
        let args = [
            Arg::Uuid(id),
            Arg::Text(&who.by),
            Arg::Text(&who.reason),
            Arg::Now,
        ];
        if self.conn().execute(&SET_MAINTENANCE, &args).await? == 0 {
            return Ok(false);
        }
        self.fence_claims(id).await?;
        Ok(true)
    }

    /// Locks the machine's row until the transaction ends and bumps its claim count: a
    /// Postgres claim that holds the row finishes first, one that read the machine before
    /// cannot lock it after (its claim-count check fails), and later ones see what this
    /// transaction wrote.
    async fn fence_claims(&mut self, id: Uuid) -> Result<()> {
        let sql = "UPDATE machines SET claim_count = claim_count + 1 WHERE machine_id = $1";
        self.conn().execute(sql, &[Arg::Uuid(id)]).await?;
        Ok(())
    }

    /// Ends the machine's maintenance; true if it was in maintenance.
    pub(crate) async fn clear_maintenance(&mut self, id: Uuid) -> Result<bool> {
        let sql = "DELETE FROM machine_maintenance WHERE machine_id = $1";
        Ok(self.conn().execute(sql, &[Arg::Uuid(id)]).await? > 0)
    }

    /// The machine's maintenance, if an operator put it in maintenance.
    pub async fn maintenance(&mut self, id: Uuid) -> Result<Option<Maintenance>> {
        let sql = "SELECT since, actor, reason FROM machine_maintenance WHERE machine_id = $1";
        self.conn().row(sql, &[Arg::Uuid(id)]).await
    }

    /// Appends an entry to the operators' history.
    pub(crate) async fn record_action(
        &mut self,
        id: Uuid,
        action: OperatorAction,
        process: Option<Process>,
        who: &Operator,
        session: Option<Uuid>,
    ) -> Result<()> {
        let args = [
            Arg::Uuid(id),
            Arg::Text(action.as_str()),
            Arg::OptText(process.map(|p| p.as_str())),
            Arg::Text(&who.by),
            Arg::Text(&who.reason),
            Arg::OptUuid(session),
            Arg::OptText(who.request_id.as_deref()),
            Arg::Now,
        ];
        self.conn().execute(&RECORD_ACTION, &args).await?;
        Ok(())
    }

    /// The operators' history of a machine, oldest first.
    pub async fn machine_actions(&mut self, id: Uuid) -> Result<Vec<ActionEntry>> {
        let sql = "SELECT id, machine_id, action, process, at, actor, reason, request_id
                     FROM operator_actions WHERE machine_id = $1 ORDER BY id";
        self.conn().rows(sql, &[Arg::Uuid(id)]).await
    }

    /// Removes the machine: its provider id is barred (if it has one, with whether the
    /// provider is to tear it down), then [`Self::remove_machine`].
    pub(crate) async fn decommission(
        &mut self,
        id: Uuid,
        who: &Operator,
        undeploy: bool,
        cause: &str,
    ) -> Result<()> {
        let bar = [
            Arg::Uuid(id),
            Arg::Text(&who.by),
            Arg::Text(&who.reason),
            Arg::Bool(undeploy),
            Arg::Now,
        ];
        self.conn().execute(&DECOMMISSION, &bar).await?;
        self.remove_machine(id, cause).await
    }

    /// Deletes machine `id`: claims are fenced off first, every lock it holds ends as
    /// Canceled with `cause`, and the row goes with every tag, lock and backoff (they
    /// cascade). History is not tied to the row and stays. Used by decommissioning, and when
    /// a provider id comes back under a new claim (the old machine is gone for good).
    pub async fn remove_machine(&mut self, id: Uuid, cause: &str) -> Result<()> {
        self.fence_claims(id).await?;
        let conn = self.conn();
        let cancel = [Arg::Uuid(id), Arg::Text(cause), Arg::Now];
        conn.execute(&CANCEL_MACHINE_WORK, &cancel).await?;
        let id = [Arg::Uuid(id)];
        conn.execute("DELETE FROM work WHERE machine_id = $1", &id)
            .await?;
        conn.execute("DELETE FROM machines WHERE machine_id = $1", &id)
            .await?;
        Ok(())
    }

    /// The decommissioning record of a machine id, if it was decommissioned.
    pub async fn decommissioned(&mut self, id: Uuid) -> Result<Option<Decommissioned>> {
        let sql = "SELECT provider, provider_id, machine_id, at, actor, reason, undeploy
                     FROM decommissioned WHERE machine_id = $1 ORDER BY at DESC";
        self.conn().row(sql, &[Arg::Uuid(id)]).await
    }

    /// Lifts the bar on a decommissioned machine's provider id; true if there was one.
    pub(crate) async fn recommission(&mut self, id: Uuid) -> Result<bool> {
        let sql = "DELETE FROM decommissioned WHERE machine_id = $1";
        Ok(self.conn().execute(sql, &[Arg::Uuid(id)]).await? > 0)
    }

    /// The provider ids of `provider` an operator decommissioned, in id order, each with
    /// whether the provider is to tear the machine down.
    pub async fn decommissioned_ids(
        &mut self,
        provider: ProviderKind,
    ) -> Result<Vec<(String, bool)>> {
        let sql = "SELECT provider_id, undeploy FROM decommissioned WHERE provider = $1
                    ORDER BY provider_id";
        self.conn().rows(sql, &[Arg::Text(provider.as_str())]).await
    }

    /// Whether an operator decommissioned this provider id.
    pub async fn is_decommissioned(
        &mut self,
        provider: ProviderKind,
        provider_id: &str,
    ) -> Result<bool> {
        let sql = "SELECT 1 FROM decommissioned WHERE provider = $1 AND provider_id = $2";
        let args = [Arg::Text(provider.as_str()), Arg::Text(provider_id)];
        let found: Option<i32> = self.conn().value(sql, &args).await?;
        Ok(found.is_some())
    }
}

from_columns! {
    Maintenance { since: time, by: get("actor"), reason: get }
    ActionEntry {
        id: get, machine_id: get, action: parsed, process: opt_parsed, at: time,
        by: get("actor"), reason: get, request_id: get,
    }
    Decommissioned {
        provider: parsed, provider_id: get, machine_id: get, at: time, by: get("actor"),
        reason: get, undeploy: get,
    }
}
