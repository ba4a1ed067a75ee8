//! Operators' actions on machines: maintenance, decommissioning and the operators' history
//! (`operator_actions`), each statement once for both engines.

use uuid::Uuid;

use super::{from_columns, on_engine, row_by_key, rows_by_key, Conn, Dialects, Result};
use crate::model::*;

const SET_MAINTENANCE: Dialects = Dialects {
    postgres: "INSERT INTO machine_maintenance (machine_id, since, actor, reason)
               VALUES ($1, now(), $2, $3) ON CONFLICT (machine_id) DO NOTHING",
    sqlite: "INSERT INTO machine_maintenance (machine_id, since, actor, reason)
             VALUES ($1, $4, $2, $3) ON CONFLICT (machine_id) DO NOTHING",
};

const RECORD_ACTION: Dialects = Dialects {
    postgres:
        "INSERT INTO operator_actions (machine_id, action, process, at, actor, reason, session_id)
               VALUES ($1, $2, $3, now(), $4, $5, $6)",
    sqlite:
        "INSERT INTO operator_actions (machine_id, action, process, at, actor, reason, session_id)
             VALUES ($1, $2, $3, $7, $4, $5, $6)",
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

/// Puts the machine in maintenance unless it is; true if this call did. Bumps the machine's
/// claim count, so a Postgres claim that read the machine before this commit cannot lock it
/// after (its claim-count check fails): once this commits, no new work starts on the machine.
pub(crate) async fn set_maintenance(conn: &mut Conn, id: Uuid, who: &Operator) -> Result<bool> {
    let done = on_engine!(conn, |c, e| {
        let done = e
            .with_now(
                sqlx::query(e.sql(&SET_MAINTENANCE))
                    .bind(id)
                    .bind(&who.by)
                    .bind(&who.reason),
            )
            .execute(&mut *c)
            .await?;
        Result::Ok(done.rows_affected() > 0)
    })?;
    if !done {
        return Ok(false);
    }
    fence_claims(conn, id).await?;
    Ok(true)
}

/// Locks the machine's row until the transaction ends and bumps its claim count: a Postgres
/// claim that holds the row finishes first, one that read the machine before cannot lock it
/// after (its claim-count check fails), and later ones see what this transaction wrote.
async fn fence_claims(conn: &mut Conn, id: Uuid) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query("UPDATE machines SET claim_count = claim_count + 1 WHERE machine_id = $1")
            .bind(id)
            .execute(c)
            .await?;
        Ok(())
    })
}

/// Ends the machine's maintenance; true if it was in maintenance.
pub(crate) async fn clear_maintenance(conn: &mut Conn, id: Uuid) -> Result<bool> {
    on_engine!(conn, |c, _| {
        let done = sqlx::query("DELETE FROM machine_maintenance WHERE machine_id = $1")
            .bind(id)
            .execute(c)
            .await?;
        Ok(done.rows_affected() > 0)
    })
}

pub(crate) async fn maintenance(conn: &mut Conn, id: Uuid) -> Result<Option<Maintenance>> {
    let sql = "SELECT since, actor, reason FROM machine_maintenance WHERE machine_id = $1";
    row_by_key(conn, sql, id).await
}

/// Appends an entry to the operators' history.
pub(crate) async fn record_action(
    conn: &mut Conn,
    id: Uuid,
    action: OperatorAction,
    process: Option<Process>,
    who: &Operator,
    session: Option<Uuid>,
) -> Result<()> {
    on_engine!(conn, |c, e| {
        let q = sqlx::query(e.sql(&RECORD_ACTION))
            .bind(id)
            .bind(action.as_str())
            .bind(process.map(|p| p.as_str()))
            .bind(&who.by)
            .bind(&who.reason)
            .bind(session);
        e.with_now(q).execute(c).await?;
        Ok(())
    })
}

/// The operators' history of a machine, oldest first.
pub(crate) async fn machine_actions(conn: &mut Conn, id: Uuid) -> Result<Vec<ActionEntry>> {
    let sql = "SELECT id, machine_id, action, process, at, actor, reason FROM operator_actions
                WHERE machine_id = $1 ORDER BY id";
    rows_by_key(conn, sql, id).await
}

/// Removes the machine: claims are fenced off first, its provider id is barred (if it has
/// one, with whether the provider is to tear it down), every lock it holds ends as Canceled
/// with `cause`, and the machine row goes with every tag, lock and backoff (they cascade).
/// History is not tied to the row and stays.
pub(crate) async fn decommission(
    conn: &mut Conn,
    id: Uuid,
    who: &Operator,
    undeploy: bool,
    cause: &str,
) -> Result<()> {
    fence_claims(conn, id).await?;
    on_engine!(conn, |c, e| {
        let q = sqlx::query(e.sql(&DECOMMISSION))
            .bind(id)
            .bind(&who.by)
            .bind(&who.reason)
            .bind(undeploy);
        e.with_now(q).execute(&mut *c).await?;
        let q = sqlx::query(e.sql(&CANCEL_MACHINE_WORK))
            .bind(id)
            .bind(cause);
        e.with_now(q).execute(&mut *c).await?;
        sqlx::query("DELETE FROM work WHERE machine_id = $1")
            .bind(id)
            .execute(&mut *c)
            .await?;
        sqlx::query("DELETE FROM machines WHERE machine_id = $1")
            .bind(id)
            .execute(c)
            .await?;
        Ok(())
    })
}

/// The decommissioning record of a machine id, if it was decommissioned.
pub(crate) async fn decommissioned(conn: &mut Conn, id: Uuid) -> Result<Option<Decommissioned>> {
    let sql = "SELECT provider, provider_id, machine_id, at, actor, reason, undeploy
                 FROM decommissioned WHERE machine_id = $1 ORDER BY at DESC";
    row_by_key(conn, sql, id).await
}

/// Lifts the bar on a decommissioned machine's provider id; true if there was one.
pub(crate) async fn recommission(conn: &mut Conn, id: Uuid) -> Result<bool> {
    on_engine!(conn, |c, _| {
        let done = sqlx::query("DELETE FROM decommissioned WHERE machine_id = $1")
            .bind(id)
            .execute(c)
            .await?;
        Ok(done.rows_affected() > 0)
    })
}

/// The provider ids of `provider` that are decommissioned, in id order, each with whether
/// the provider is to tear the machine down.
pub(crate) async fn decommissioned_ids(
    conn: &mut Conn,
    provider: Provider,
) -> Result<Vec<(String, bool)>> {
    on_engine!(conn, |c, _| {
        Ok(sqlx::query_as(
            "SELECT provider_id, undeploy FROM decommissioned WHERE provider = $1
              ORDER BY provider_id",
        )
        .bind(provider.as_str())
        .fetch_all(c)
        .await?)
    })
}

/// Whether this provider id is decommissioned.
pub(crate) async fn is_decommissioned(
    conn: &mut Conn,
    provider: Provider,
    provider_id: &str,
) -> Result<bool> {
    on_engine!(conn, |c, _| {
        let found: Option<i32> = sqlx::query_scalar(
            "SELECT 1 FROM decommissioned WHERE provider = $1 AND provider_id = $2",
        )
        .bind(provider.as_str())
        .bind(provider_id)
        .fetch_optional(c)
        .await?;
        Ok(found.is_some())
    })
}

from_columns! {
    Maintenance { since: time, by: get("actor"), reason: get }
    ActionEntry {
        id: get, machine_id: get, action: parsed, process: opt_parsed, at: time,
        by: get("actor"), reason: get,
    }
    Decommissioned {
        provider: parsed, provider_id: get, machine_id: get, at: time, by: get("actor"),
        reason: get, undeploy: get,
    }
}
