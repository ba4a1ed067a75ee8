//! Sessions (SPEC §3): creation, keep-alive, liveness, closing, garbage collection, and the
//! batch of agent heartbeats that Postgres writes as one statement outside a transaction.

use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::{from_columns, on_engine, row_by_key, Conn, Dialects, FromColumns, Result, SqliteTx};
use crate::model::{Process, SessionInfo};

const CREATE: Dialects = Dialects {
    postgres: "INSERT INTO sessions (session_id, component_name, runtime_info, processor,
                                     created_at, interval_seconds, deadline)
               VALUES ($1, $2, $3, $4, now(), $5, now() + make_interval(secs => $5))",
    sqlite: "INSERT INTO sessions (session_id, component_name, runtime_info, processor,
                                   created_at, interval_seconds, deadline)
             VALUES ($1, $2, $3, $4, $6, $5, $6 + $5 * 1000000)",
};

const POKE: Dialects = Dialects {
    postgres: "UPDATE sessions SET deadline = now() + make_interval(secs => interval_seconds)
               WHERE session_id = $1 AND deadline > now()",
    sqlite: "UPDATE sessions SET deadline = $2 + interval_seconds * 1000000
             WHERE session_id = $1 AND deadline > $2",
};

/// A live session; on Postgres the key-share lock keeps it from being deleted until commit.
const CHECK: Dialects = Dialects {
    postgres: "SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now() FOR KEY SHARE",
    sqlite: "SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > $2",
};

const CANCEL_ALL_WORK: Dialects = Dialects {
    postgres: "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
               SELECT machine_id, process, 'Canceled', now(), session_id, 'session closed'
                 FROM work WHERE session_id = $1",
    sqlite: "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
             SELECT machine_id, process, 'Canceled', $2, session_id, 'session closed'
               FROM work WHERE session_id = $1",
};

pub(crate) async fn create_session(
    conn: &mut Conn,
    id: Uuid,
    component: &str,
    runtime_info: &str,
    processor: &str,
    interval_seconds: i64,
) -> Result<()> {
    on_engine!(conn, |c, e| {
        let q = sqlx::query(e.sql(&CREATE))
            .bind(id)
            .bind(component)
            .bind(runtime_info)
            .bind(processor)
            .bind(interval_seconds);
        e.with_now(q).execute(c).await?;
        Ok(())
    })
}

/// Extends a live session's deadline; false if it is gone or already past its deadline.
pub(crate) async fn poke_session(conn: &mut Conn, id: Uuid) -> Result<bool> {
    on_engine!(conn, |c, e| {
        let r = e
            .with_now(sqlx::query(e.sql(&POKE)).bind(id))
            .execute(c)
            .await?;
        Ok(r.rows_affected() == 1)
    })
}

/// Whether the session is alive (see [`CHECK`]).
pub(crate) async fn check_session(conn: &mut Conn, id: Uuid) -> Result<bool> {
    match conn {
        Conn::Sqlite(c) => alive_sqlite(c, id).await,
        Conn::Postgres(c) => alive_pg(c, id).await,
    }
}

/// [`check_session`] inside a SQLite transaction a caller holds as such (claims, endings).
pub(crate) async fn alive_sqlite(c: &mut SqliteTx, id: Uuid) -> Result<bool> {
    let row = sqlx::query(CHECK.sqlite)
        .bind(id)
        .bind(c.now)
        .fetch_optional(&mut *c.tx)
        .await?;
    Ok(row.is_some())
}

/// [`check_session`] on a Postgres connection, inside a transaction or not.
pub(crate) async fn alive_pg(c: &mut PgConnection, id: Uuid) -> Result<bool> {
    let row = sqlx::query(CHECK.postgres)
        .bind(id)
        .fetch_optional(&mut *c)
        .await?;
    Ok(row.is_some())
}

/// Closes a session: its work is recorded as Canceled and released with it.
pub(crate) async fn delete_session(conn: &mut Conn, id: Uuid) -> Result<()> {
    on_engine!(conn, |c, e| {
        e.with_now(sqlx::query(e.sql(&CANCEL_ALL_WORK)).bind(id))
            .execute(&mut *c)
            .await?;
        sqlx::query("DELETE FROM sessions WHERE session_id = $1")
            .bind(id)
            .execute(&mut *c)
            .await?;
        Ok(())
    })
}

/// Deletes expired sessions (their work cascades), recording each lost lock as Canceled.
/// On Postgres one statement, so that history names exactly the sessions it deleted even if a
/// concurrent keep-alive races it; SQLite's single writer has no such race.
pub(crate) async fn collect_garbage(conn: &mut Conn) -> Result<u64> {
    match conn {
        Conn::Postgres(c) => {
            let n: i64 = sqlx::query_scalar(
                "WITH dead AS (DELETE FROM sessions WHERE deadline < now() RETURNING session_id),
                 hist AS (
                    INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
                    SELECT w.machine_id, w.process, 'Canceled', now(), w.session_id, 'session expired'
                    FROM work w JOIN dead d ON d.session_id = w.session_id)
                 SELECT count(*) FROM dead",
            )
            .fetch_one(&mut **c)
            .await?;
            Ok(n as u64)
        }
        Conn::Sqlite(c) => {
            sqlx::query(
                "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
                 SELECT w.machine_id, w.process, 'Canceled', $1, w.session_id, 'session expired'
                 FROM work w JOIN sessions s ON s.session_id = w.session_id WHERE s.deadline < $1",
            )
            .bind(c.now)
            .execute(&mut *c.tx)
            .await?;
            let r = sqlx::query("DELETE FROM sessions WHERE deadline < $1")
                .bind(c.now)
                .execute(&mut *c.tx)
                .await?;
            Ok(r.rows_affected())
        }
    }
}

pub(crate) async fn session(conn: &mut Conn, id: Uuid) -> Result<Option<SessionInfo>> {
    row_by_key(conn, "SELECT * FROM sessions WHERE session_id = $1", id).await
}

pub(crate) async fn sessions(conn: &mut Conn) -> Result<Vec<SessionInfo>> {
    on_engine!(conn, |c, _| {
        let rows = sqlx::query("SELECT * FROM sessions ORDER BY created_at, session_id")
            .fetch_all(c)
            .await?;
        rows.iter().map(SessionInfo::from_columns).collect()
    })
}

/// The work a session holds, by machine and process.
pub(crate) async fn session_work(conn: &mut Conn, session: Uuid) -> Result<Vec<(Uuid, Process)>> {
    on_engine!(conn, |c, _| {
        let rows: Vec<(Uuid, String)> = sqlx::query_as(
            "SELECT machine_id, process FROM work WHERE session_id = $1
             ORDER BY machine_id, process",
        )
        .bind(session)
        .fetch_all(c)
        .await?;
        rows.into_iter().map(|(m, p)| Ok((m, p.parse()?))).collect()
    })
}

/// A batch of bare agent heartbeats in one autocommitted Postgres statement (the group commit
/// of `heartbeats.rs`): session liveness, each agent's key, the heartbeat upserts of those
/// authorized (each machine once, in id order so concurrent batches lock alike) and each
/// machine's pending installation request. Returns one (session alive, key matches, pending
/// request) per input, in input order; a heartbeat is written only if both hold.
pub(crate) async fn agent_heartbeats_pg(
    c: &mut PgConnection,
    session: Uuid,
    machines: &[Uuid],
    keys: &[Vec<u8>],
) -> Result<Vec<(bool, bool, Option<Vec<u8>>)>> {
    let rows = sqlx::query(
        "WITH alive AS (
             SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now() FOR KEY SHARE
         ), beats AS (
             SELECT * FROM unnest($2::uuid[], $3::bytea[]) WITH ORDINALITY AS b(machine_id, public_key, n)
         ), authorized AS (
             SELECT b.n, b.machine_id FROM beats b
               JOIN machine_agent_started s
                 ON s.machine_id = b.machine_id AND s.public_key = b.public_key
         ), written AS (
             INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at)
             SELECT DISTINCT machine_id, now() FROM authorized
              WHERE EXISTS (SELECT 1 FROM alive)
              ORDER BY machine_id
             ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at
             RETURNING 1
         )
         SELECT EXISTS (SELECT 1 FROM alive), a.n IS NOT NULL,
                (SELECT q.request_raw FROM machine_os_installation_request q
                  WHERE q.machine_id = b.machine_id
                    AND NOT EXISTS (SELECT 1 FROM machine_os_installation_report r
                                     WHERE r.machine_id = q.machine_id
                                       AND r.generation = q.generation))
           FROM beats b LEFT JOIN authorized a ON a.n = b.n
          ORDER BY b.n",
    )
    .bind(session)
    .bind(machines)
    .bind(keys)
    .fetch_all(&mut *c)
    .await?;
    rows.iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?, r.try_get(2)?)))
        .collect()
}

from_columns! {
    SessionInfo {
        session_id: get, component_name: get, runtime_info: get, processor: get,
        created_at: time, interval_seconds: get, deadline: time,
    }
}
