//! Sessions (design.md §3): creation, keep-alive, liveness, closing, garbage collection, and the
//! batch of agent heartbeats that Postgres writes as one statement outside a transaction.

use sqlx::PgConnection;
use uuid::Uuid;

use super::engine::{
    from_columns, Arg, Autocommit, Conn, Dialects, FromColumns, Result, SqliteTx, Tx,
};
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

/// A live session's work on one machine for one process.
const HOLDS_WORK: Dialects = Dialects {
    postgres: "SELECT 1 FROM work w JOIN sessions s ON s.session_id = w.session_id
                WHERE w.session_id = $1 AND w.machine_id = $2 AND w.process = $3
                  AND s.deadline > now()",
    sqlite: "SELECT 1 FROM work w JOIN sessions s ON s.session_id = w.session_id
              WHERE w.session_id = $1 AND w.machine_id = $2 AND w.process = $3
                AND s.deadline > $4",
};

/// Locks one session's row to release it (on Postgres `FOR UPDATE`: claims under way hold it
/// `FOR KEY SHARE` and commit first, new ones wait and then find it gone).
const LOCK_SESSION: Dialects = Dialects {
    postgres: "SELECT session_id FROM sessions WHERE session_id = $1 FOR UPDATE",
    sqlite: "SELECT session_id FROM sessions WHERE session_id = $1",
};

/// Locks the expired sessions' rows to release them. On Postgres a row another transaction
/// holds is skipped, never waited for: a keep-alive under way (its session may be alive
/// after all), another collector, or the open transaction of a replica cut off from the
/// database, which Postgres ends at `idle_in_transaction_session_timeout` (`db.rs`); a later
/// collection takes what was skipped. The transaction's `lock_timeout` bounds the wait for a
/// work row such a transaction holds.
const LOCK_EXPIRED: Dialects = Dialects {
    postgres: "SELECT session_id FROM sessions WHERE deadline < now()
               ORDER BY session_id FOR UPDATE SKIP LOCKED",
    sqlite: "SELECT session_id FROM sessions WHERE deadline < $1 ORDER BY session_id",
};

/// How long a collection waits for a row lock (a work row another transaction holds) before
/// it gives up with `lock_not_available`; the next collection tries again.
const GC_LOCK_TIMEOUT: &str = "SET LOCAL lock_timeout = '2s'";

/// Releases a locked session's work, recording each as Canceled with the cause `$2`. On
/// Postgres the history names exactly the rows this statement deleted: an ending of the same
/// work holds its row until it commits, and then the row is gone here, so the machine gets
/// that ending alone. With the session locked first, every claim of it has committed and is
/// seen here. SQLite's single writer has neither race.
const CANCEL_SESSION_WORK: Dialects = Dialects {
    postgres: "WITH gone AS (DELETE FROM work WHERE session_id = $1
                             RETURNING machine_id, process, session_id)
               INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
               SELECT machine_id, process, 'Canceled', now(), session_id, $2
                 FROM gone",
    sqlite: "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
             SELECT machine_id, process, 'Canceled', $3, session_id, $2
               FROM work WHERE session_id = $1",
};

/// Whether the session is alive, in a SQLite transaction a caller holds as such (claims).
pub(super) async fn alive_sqlite(c: &mut SqliteTx, id: Uuid) -> Result<bool> {
    let row = sqlx::query(CHECK.sqlite)
        .bind(id)
        .bind(c.now)
        .fetch_optional(&mut *c.tx)
        .await?;
    Ok(row.is_some())
}

/// Whether the session is alive, on a Postgres connection inside a transaction or not.
pub(super) async fn alive_pg(c: &mut PgConnection, id: Uuid) -> Result<bool> {
    let row = sqlx::query(CHECK.postgres)
        .bind(id)
        .fetch_optional(&mut *c)
        .await?;
    Ok(row.is_some())
}

impl Tx {
    /// Records a new session with a deadline `interval_seconds` from now.
    pub(crate) async fn create_session(
        &mut self,
        id: Uuid,
        component: &str,
        runtime_info: &str,
        processor: &str,
        interval_seconds: i64,
    ) -> Result<()> {
        let args = [
            Arg::Uuid(id),
            Arg::Text(component),
            Arg::Text(runtime_info),
            Arg::Text(processor),
            Arg::Int(interval_seconds),
            Arg::Now,
        ];
        self.conn().execute(&CREATE, &args).await?;
        Ok(())
    }

    /// Extends a live session's deadline; false if it is gone or already past its deadline.
    pub(crate) async fn poke_session(&mut self, id: Uuid) -> Result<bool> {
        let args = [Arg::Uuid(id), Arg::Now];
        Ok(self.conn().execute(&POKE, &args).await? == 1)
    }

    /// Whether the session is alive (see [`CHECK`]; on Postgres it then cannot be deleted
    /// until this transaction ends).
    pub(crate) async fn session_alive(&mut self, id: Uuid) -> Result<bool> {
        let row: Option<i32> = self
            .conn()
            .value(&CHECK, &[Arg::Uuid(id), Arg::Now])
            .await?;
        Ok(row.is_some())
    }

    /// Closes a session: its work is recorded as Canceled and released with it.
    pub(crate) async fn delete_session(&mut self, id: Uuid) -> Result<()> {
        let locked: Option<Uuid> = self.conn().value(&LOCK_SESSION, &[Arg::Uuid(id)]).await?;
        if locked.is_some() {
            self.release_session(id, "session closed").await?;
        }
        Ok(())
    }

    /// Deletes expired sessions, recording each lock they held as Canceled; returns how many.
    /// Each is locked first, then released like a closed one (see [`CANCEL_SESSION_WORK`]).
    pub(crate) async fn collect_garbage(&mut self) -> Result<u64> {
        if let Conn::Postgres(c) = self.conn() {
            sqlx::query(GC_LOCK_TIMEOUT).execute(&mut **c).await?;
        }
        let dead: Vec<Uuid> = self.conn().values(&LOCK_EXPIRED, &[Arg::Now]).await?;
        for id in &dead {
            self.release_session(*id, "session expired").await?;
        }
        Ok(dead.len() as u64)
    }

    /// Releases a session whose row this transaction locked: its work ends as Canceled with
    /// `cause`, and the row goes.
    async fn release_session(&mut self, id: Uuid, cause: &str) -> Result<()> {
        let conn = self.conn();
        let args = [Arg::Uuid(id), Arg::Text(cause), Arg::Now];
        conn.execute(&CANCEL_SESSION_WORK, &args).await?;
        conn.execute(
            "DELETE FROM sessions WHERE session_id = $1",
            &[Arg::Uuid(id)],
        )
        .await?;
        Ok(())
    }

    /// One session by id.
    pub async fn session(&mut self, id: Uuid) -> Result<Option<SessionInfo>> {
        let sql = "SELECT * FROM sessions WHERE session_id = $1";
        self.conn().row(sql, &[Arg::Uuid(id)]).await
    }

    /// All sessions, oldest first.
    pub async fn sessions(&mut self) -> Result<Vec<SessionInfo>> {
        let sql = "SELECT * FROM sessions ORDER BY created_at, session_id";
        self.conn().rows(sql, &[]).await
    }

    /// Whether `session` is alive and holds `machine`'s work for `process`: the re-check right
    /// before a side effect that cannot be fenced by the far side (a BMC reset).
    pub(crate) async fn holds_work(
        &mut self,
        session: Uuid,
        machine: Uuid,
        process: Process,
    ) -> Result<bool> {
        let args = [
            Arg::Uuid(session),
            Arg::Uuid(machine),
            Arg::Text(process.as_str()),
            Arg::Now,
        ];
        let held: Option<i32> = self.conn().value(&HOLDS_WORK, &args).await?;
        Ok(held.is_some())
    }

    /// Work held by a session: (machine, process), in machine order.
    pub async fn session_work(&mut self, session: Uuid) -> Result<Vec<(Uuid, Process)>> {
        let sql = "SELECT machine_id, process FROM work WHERE session_id = $1
                   ORDER BY machine_id, process";
        let rows: Vec<(Uuid, String)> = self.conn().rows(sql, &[Arg::Uuid(session)]).await?;
        rows.into_iter().map(|(m, p)| Ok((m, p.parse()?))).collect()
    }

    /// Test support: a session's keep-alive statement, inside a transaction the test holds
    /// (to hold the row's lock as a keep-alive cut off before its COMMIT would).
    #[cfg(feature = "testing")]
    pub async fn poke_session_for_test(&mut self, session: Uuid) -> Result<bool> {
        self.poke_session(session).await
    }

    /// Test support: deletes a session row (its work cascades) behind its owner's back, as a
    /// partition plus another replica's garbage collection would.
    #[cfg(feature = "testing")]
    pub async fn delete_session_raw(&mut self, session: Uuid) -> Result<()> {
        self.delete_session(session).await
    }
}

/// A batch of bare agent heartbeats in one autocommitted Postgres statement (the group commit
/// of `group_commit.rs`): session liveness, each agent's key, the heartbeat upserts of those
/// authorized (each machine once, in id order so concurrent batches lock alike) and each
/// machine's pending installation request. Returns one (session alive, key matches, pending
/// request) per input, in input order; a heartbeat is written only if both hold.
impl Autocommit {
    pub(crate) async fn agent_heartbeats(
        &mut self,
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
        .fetch_all(self.conn())
        .await?;
        rows.iter().map(FromColumns::from_columns).collect()
    }
}

from_columns! {
    SessionInfo {
        session_id: get, component_name: get, runtime_info: get, processor: get,
        created_at: time, interval_seconds: get, deadline: time,
    }
}
