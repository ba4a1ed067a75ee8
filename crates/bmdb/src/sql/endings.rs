//! How work ends (SPEC §4): finished, failed (with a backoff) or canceled, each with its audit
//! history entry; backoffs set and cleared by hand; the history and work an operator reads.
//!
//! On Postgres an ending is one statement (its data-modifying CTEs keep it to one round trip);
//! SQLite, which has no such CTEs, runs the same steps as statements inside its transaction.
//! Finish and Fail need no lock on the session row: our work row is the lock. If garbage
//! collection deleted it first, nothing is deleted and the work is reported lost; if we delete
//! it first, the collector's cascade waits for our commit.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    from_columns, on_engine, rows_by_key, secs_us, Conn, DbTime, FromColumns, Result, SqliteTx,
};
use crate::model::*;

/// What ending a unit of work found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EndOutcome {
    /// Ended, history written.
    Done,
    /// The session is gone or past its deadline; nothing written.
    SessionExpired,
    /// The work row is gone (garbage-collected); nothing written.
    Lost,
}

impl EndOutcome {
    fn of(session_alive: bool, deleted: bool) -> EndOutcome {
        if !session_alive {
            EndOutcome::SessionExpired
        } else if !deleted {
            EndOutcome::Lost
        } else {
            EndOutcome::Done
        }
    }
}

/// The first steps of a Postgres ending, as CTEs: `sess`, the session if alive; `del`, our work
/// row, deleted if the session is alive. The caller's CTEs follow, reading `del`.
macro_rules! own_work_ended {
    () => {
        "WITH sess AS (
            SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now()),
         del AS (
            DELETE FROM work WHERE machine_id = $2 AND process = $3 AND session_id = $1
            AND EXISTS (SELECT 1 FROM sess) RETURNING machine_id),
         "
    };
}

/// Releases the work, clears the process's backoff and writes Finished history.
pub(crate) async fn finish_work(
    conn: &mut Conn,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<EndOutcome> {
    match conn {
        Conn::Postgres(c) => {
            let (alive, deleted): (bool, bool) = sqlx::query_as(concat!(
                own_work_ended!(),
                "bo AS (
                    DELETE FROM work_backoff
                     WHERE process = $3 AND machine_id IN (SELECT machine_id FROM del)),
                 hist AS (
                    INSERT INTO work_history (machine_id, process, event, at, session_id)
                    SELECT machine_id, $3, 'Finished', now(), $1 FROM del)
                 SELECT EXISTS (SELECT 1 FROM sess), EXISTS (SELECT 1 FROM del)",
            ))
            .bind(session)
            .bind(machine)
            .bind(process.as_str())
            .fetch_one(&mut **c)
            .await?;
            Ok(EndOutcome::of(alive, deleted))
        }
        Conn::Sqlite(c) => {
            let outcome = end_work_sqlite(c, session, machine, process).await?;
            if outcome == EndOutcome::Done {
                sqlx::query("DELETE FROM work_backoff WHERE machine_id = $1 AND process = $2")
                    .bind(machine)
                    .bind(process.as_str())
                    .execute(&mut *c.tx)
                    .await?;
                write_history_sqlite(c, session, machine, process, WorkEvent::Finished, None)
                    .await?;
            }
            Ok(outcome)
        }
    }
}

/// Releases the work, puts the machine in backoff for `delay` (remembering `interval_seconds`
/// for the next failure) and writes Failed history with `cause`.
pub(crate) async fn fail_work(
    conn: &mut Conn,
    session: Uuid,
    machine: Uuid,
    process: Process,
    cause: &str,
    interval_seconds: i64,
    delay: std::time::Duration,
) -> Result<EndOutcome> {
    match conn {
        Conn::Postgres(c) => {
            let (alive, deleted): (bool, bool) = sqlx::query_as(concat!(
                own_work_ended!(),
                "bo AS (
                    INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
                    SELECT machine_id, $3, now() + make_interval(secs => $5), $4, $6 FROM del
                    ON CONFLICT (machine_id, process) DO UPDATE SET until = excluded.until,
                        cause = excluded.cause, last_interval_seconds = excluded.last_interval_seconds),
                 hist AS (
                    INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
                    SELECT machine_id, $3, 'Failed', now(), $1, $4 FROM del)
                 SELECT EXISTS (SELECT 1 FROM sess), EXISTS (SELECT 1 FROM del)",
            ))
            .bind(session)
            .bind(machine)
            .bind(process.as_str())
            .bind(cause)
            .bind(delay.as_secs_f64())
            .bind(interval_seconds)
            .fetch_one(&mut **c)
            .await?;
            Ok(EndOutcome::of(alive, deleted))
        }
        Conn::Sqlite(c) => {
            let outcome = end_work_sqlite(c, session, machine, process).await?;
            if outcome == EndOutcome::Done {
                sqlx::query(BACKOFF_UPSERT)
                    .bind(machine)
                    .bind(process.as_str())
                    .bind(c.now + secs_us(delay.as_secs_f64()))
                    .bind(cause)
                    .bind(interval_seconds)
                    .execute(&mut *c.tx)
                    .await?;
                let failed = WorkEvent::Failed;
                write_history_sqlite(c, session, machine, process, failed, Some(cause)).await?;
            }
            Ok(outcome)
        }
    }
}

/// Releases the work and writes Canceled history; the backoff is untouched. False if the work
/// was no longer held.
pub(crate) async fn cancel_work(
    conn: &mut Conn,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<bool> {
    match conn {
        Conn::Postgres(c) => Ok(sqlx::query_scalar(
            "WITH del AS (
                DELETE FROM work WHERE machine_id = $2 AND process = $3 AND session_id = $1
                RETURNING machine_id),
             hist AS (
                INSERT INTO work_history (machine_id, process, event, at, session_id)
                SELECT machine_id, $3, 'Canceled', now(), $1 FROM del)
             SELECT EXISTS (SELECT 1 FROM del)",
        )
        .bind(session)
        .bind(machine)
        .bind(process.as_str())
        .fetch_one(&mut **c)
        .await?),
        Conn::Sqlite(c) => {
            if !delete_work_sqlite(c, session, machine, process).await? {
                return Ok(false);
            }
            write_history_sqlite(c, session, machine, process, WorkEvent::Canceled, None).await?;
            Ok(true)
        }
    }
}

/// Deletes our work row after checking the session; the common first half of Finish and Fail.
async fn end_work_sqlite(
    c: &mut SqliteTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<EndOutcome> {
    let alive = super::sessions::alive_sqlite(c, session).await?;
    let deleted = alive && delete_work_sqlite(c, session, machine, process).await?;
    Ok(EndOutcome::of(alive, deleted))
}

async fn delete_work_sqlite(
    c: &mut SqliteTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<bool> {
    let r =
        sqlx::query("DELETE FROM work WHERE machine_id = $1 AND process = $2 AND session_id = $3")
            .bind(machine)
            .bind(process.as_str())
            .bind(session)
            .execute(&mut *c.tx)
            .await?;
    Ok(r.rows_affected() == 1)
}

async fn write_history_sqlite(
    c: &mut SqliteTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
    event: WorkEvent,
    cause: Option<&str>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(machine)
    .bind(process.as_str())
    .bind(event.as_str())
    .bind(c.now)
    .bind(session)
    .bind(cause)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

/// Sets a backoff by hand (test support and operators' tools).
pub(crate) async fn set_backoff(
    conn: &mut Conn,
    machine: Uuid,
    process: Process,
    until: DateTime<Utc>,
    last_interval_seconds: i64,
    cause: &str,
) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query(BACKOFF_UPSERT)
            .bind(machine)
            .bind(process.as_str())
            .bind(DbTime(until))
            .bind(cause)
            .bind(last_interval_seconds)
            .execute(c)
            .await?;
        Ok(())
    })
}

/// Sets a backoff, or replaces the process's current one.
const BACKOFF_UPSERT: &str =
    "INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
     VALUES ($1, $2, $3, $4, $5)
     ON CONFLICT (machine_id, process) DO UPDATE SET until = excluded.until,
        last_interval_seconds = excluded.last_interval_seconds, cause = excluded.cause";

/// Clears a machine's backoffs, of one process or of all; returns how many.
pub(crate) async fn clear_backoffs(
    conn: &mut Conn,
    machine: Uuid,
    process: Option<Process>,
) -> Result<u64> {
    on_engine!(conn, |c, _| {
        let done = sqlx::query(
            "DELETE FROM work_backoff WHERE machine_id = $1 AND ($2 IS NULL OR process = $2)",
        )
        .bind(machine)
        .bind(process.map(|p| p.as_str()))
        .execute(c)
        .await?;
        Ok(done.rows_affected())
    })
}

/// Inserts a work row bypassing the claim protocol, to build fleets in arbitrary states.
#[cfg(feature = "testing")]
pub(crate) async fn insert_work_raw(
    conn: &mut Conn,
    machine: Uuid,
    session: Uuid,
    process: Process,
) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query("INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3)")
            .bind(machine)
            .bind(session)
            .bind(process.as_str())
            .execute(c)
            .await?;
        Ok(())
    })
}

/// Appends a history entry with any time, to build histories of any age.
#[cfg(feature = "testing")]
pub(crate) async fn insert_history_raw(
    conn: &mut Conn,
    machine: Uuid,
    process: Process,
    event: WorkEvent,
    at: DateTime<Utc>,
    cause: Option<&str>,
) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query(
            "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
             VALUES ($1, $2, $3, $4, NULL, $5)",
        )
        .bind(machine)
        .bind(process.as_str())
        .bind(event.as_str())
        .bind(DbTime(at))
        .bind(cause)
        .execute(c)
        .await?;
        Ok(())
    })
}

/// A machine's history, oldest first.
pub(crate) async fn machine_history(conn: &mut Conn, machine: Uuid) -> Result<Vec<HistoryEntry>> {
    let sql = "SELECT * FROM work_history WHERE machine_id = $1 ORDER BY id";
    rows_by_key(conn, sql, machine).await
}

/// History entries after `after_id`, at most `limit`, oldest first.
pub(crate) async fn history_after(
    conn: &mut Conn,
    after_id: i64,
    limit: i64,
) -> Result<Vec<HistoryEntry>> {
    on_engine!(conn, |c, _| {
        let rows = sqlx::query("SELECT * FROM work_history WHERE id > $1 ORDER BY id LIMIT $2")
            .bind(after_id)
            .bind(limit)
            .fetch_all(c)
            .await?;
        rows.iter().map(HistoryEntry::from_columns).collect()
    })
}

/// The work held on a machine, by process.
pub(crate) async fn machine_work(conn: &mut Conn, machine: Uuid) -> Result<Vec<ActiveWork>> {
    let sql =
        "SELECT machine_id, process, session_id FROM work WHERE machine_id = $1 ORDER BY process";
    rows_by_key(conn, sql, machine).await
}

/// A machine's backoffs, expired ones included, by process.
pub(crate) async fn machine_backoffs(conn: &mut Conn, machine: Uuid) -> Result<Vec<BackoffEntry>> {
    let sql = "SELECT machine_id, process, until, cause, last_interval_seconds FROM work_backoff
                WHERE machine_id = $1 ORDER BY process";
    rows_by_key(conn, sql, machine).await
}

from_columns! {
    HistoryEntry {
        id: get, machine_id: get, process: parsed, event: parsed, at: time, session_id: get,
        cause: get("failed_cause"),
    }
    ActiveWork { machine_id: get, process: parsed, session_id: get }
    BackoffEntry {
        machine_id: get, process: parsed, until: time, cause: get, last_interval_seconds: get,
    }
}
