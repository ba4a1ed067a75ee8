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

use super::engine::{from_columns, Arg, Engine, Result, Tx};
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
/// row, deleted if the session is alive. The ending's own CTEs follow, reading `del`.
/// Parameters: `$1` the session, `$2` the machine, `$3` the process.
const OWN_WORK_ENDED: &str = "WITH sess AS (
        SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now()),
     del AS (
        DELETE FROM work WHERE machine_id = $2 AND process = $3 AND session_id = $1
        AND EXISTS (SELECT 1 FROM sess) RETURNING machine_id),
     ";

/// What a Postgres ending returns: whether the session was alive and our work row deleted.
const ENDED: &str = "SELECT EXISTS (SELECT 1 FROM sess), EXISTS (SELECT 1 FROM del)";

/// Finish's own CTEs after [`OWN_WORK_ENDED`].
const FINISH_PG: &str = "bo AS (
        DELETE FROM work_backoff
         WHERE process = $3 AND machine_id IN (SELECT machine_id FROM del)),
     hist AS (
        INSERT INTO work_history (machine_id, process, event, at, session_id)
        SELECT machine_id, $3, 'Finished', now(), $1 FROM del)
     ";

/// Fail's own CTEs after [`OWN_WORK_ENDED`]: `$4` the cause, `$5` the delay in seconds, `$6`
/// the interval remembered for the next failure.
const FAIL_PG: &str = "bo AS (
        INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
        SELECT machine_id, $3, now() + make_interval(secs => $5), $4, $6 FROM del
        ON CONFLICT (machine_id, process) DO UPDATE SET until = excluded.until,
            cause = excluded.cause, last_interval_seconds = excluded.last_interval_seconds),
     hist AS (
        INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
        SELECT machine_id, $3, 'Failed', now(), $1, $4 FROM del)
     ";

/// Sets a backoff, or replaces the process's current one.
const BACKOFF_UPSERT: &str =
    "INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
     VALUES ($1, $2, $3, $4, $5)
     ON CONFLICT (machine_id, process) DO UPDATE SET until = excluded.until,
        last_interval_seconds = excluded.last_interval_seconds, cause = excluded.cause";

impl Tx {
    /// Releases the work, clears the process's backoff and writes Finished history.
    pub(crate) async fn finish_work(
        &mut self,
        session: Uuid,
        machine: Uuid,
        process: Process,
    ) -> Result<EndOutcome> {
        match self.engine() {
            Engine::Postgres => {
                let sql = format!("{OWN_WORK_ENDED}{FINISH_PG}{ENDED}");
                let args = [
                    Arg::Uuid(session),
                    Arg::Uuid(machine),
                    Arg::Text(process.as_str()),
                ];
                self.ended_pg(&sql, &args).await
            }
            Engine::Sqlite => {
                let outcome = self.end_own_work(session, machine, process).await?;
                if outcome == EndOutcome::Done {
                    let sql = "DELETE FROM work_backoff WHERE machine_id = $1 AND process = $2";
                    let args = [Arg::Uuid(machine), Arg::Text(process.as_str())];
                    self.conn().execute(sql, &args).await?;
                    self.write_history(session, machine, process, WorkEvent::Finished, None)
                        .await?;
                }
                Ok(outcome)
            }
        }
    }

    /// Releases the work, puts the machine in backoff for `delay` (remembering
    /// `interval_seconds` for the next failure) and writes Failed history with `cause`.
    pub(crate) async fn fail_work(
        &mut self,
        session: Uuid,
        machine: Uuid,
        process: Process,
        cause: &str,
        interval_seconds: i64,
        delay: std::time::Duration,
    ) -> Result<EndOutcome> {
        match self.engine() {
            Engine::Postgres => {
                let sql = format!("{OWN_WORK_ENDED}{FAIL_PG}{ENDED}");
                let args = [
                    Arg::Uuid(session),
                    Arg::Uuid(machine),
                    Arg::Text(process.as_str()),
                    Arg::Text(cause),
                    Arg::Span(delay),
                    Arg::Int(interval_seconds),
                ];
                self.ended_pg(&sql, &args).await
            }
            Engine::Sqlite => {
                let outcome = self.end_own_work(session, machine, process).await?;
                if outcome == EndOutcome::Done {
                    let until = self.now().await? + delay;
                    self.set_backoff(machine, process, until, interval_seconds, cause)
                        .await?;
                    let failed = WorkEvent::Failed;
                    self.write_history(session, machine, process, failed, Some(cause))
                        .await?;
                }
                Ok(outcome)
            }
        }
    }

    /// Releases the work and writes Canceled history; the backoff is untouched. False if the
    /// work was no longer held.
    pub(crate) async fn cancel_work(
        &mut self,
        session: Uuid,
        machine: Uuid,
        process: Process,
    ) -> Result<bool> {
        match self.engine() {
            Engine::Postgres => {
                let sql = "WITH del AS (
                              DELETE FROM work WHERE machine_id = $2 AND process = $3 AND session_id = $1
                              RETURNING machine_id),
                           hist AS (
                              INSERT INTO work_history (machine_id, process, event, at, session_id)
                              SELECT machine_id, $3, 'Canceled', now(), $1 FROM del)
                           SELECT EXISTS (SELECT 1 FROM del)";
                let args = [
                    Arg::Uuid(session),
                    Arg::Uuid(machine),
                    Arg::Text(process.as_str()),
                ];
                Ok(self.conn().value(sql, &args).await? == Some(true))
            }
            Engine::Sqlite => {
                if !self.delete_own_work(session, machine, process).await? {
                    return Ok(false);
                }
                self.write_history(session, machine, process, WorkEvent::Canceled, None)
                    .await?;
                Ok(true)
            }
        }
    }

    /// Runs a Postgres ending and reads what it found.
    async fn ended_pg(&mut self, sql: &str, args: &[Arg<'_>]) -> Result<EndOutcome> {
        let row: Option<(bool, bool)> = self.conn().row(sql, args).await?;
        let (alive, deleted) = row.unwrap_or((false, false));
        Ok(EndOutcome::of(alive, deleted))
    }

    /// Deletes our work row after checking the session; the common first half of Finish and
    /// Fail on SQLite.
    async fn end_own_work(
        &mut self,
        session: Uuid,
        machine: Uuid,
        process: Process,
    ) -> Result<EndOutcome> {
        let alive = self.session_alive(session).await?;
        let deleted = alive && self.delete_own_work(session, machine, process).await?;
        Ok(EndOutcome::of(alive, deleted))
    }

    async fn delete_own_work(
        &mut self,
        session: Uuid,
        machine: Uuid,
        process: Process,
    ) -> Result<bool> {
        let sql = "DELETE FROM work WHERE machine_id = $1 AND process = $2 AND session_id = $3";
        let args = [
            Arg::Uuid(machine),
            Arg::Text(process.as_str()),
            Arg::Uuid(session),
        ];
        Ok(self.conn().execute(sql, &args).await? == 1)
    }

    /// Appends a history entry at the transaction's time.
    async fn write_history(
        &mut self,
        session: Uuid,
        machine: Uuid,
        process: Process,
        event: WorkEvent,
        cause: Option<&str>,
    ) -> Result<()> {
        let at = self.now().await?;
        self.insert_history(machine, process, event, at, Some(session), cause)
            .await
    }

    /// Appends a history entry.
    async fn insert_history(
        &mut self,
        machine: Uuid,
        process: Process,
        event: WorkEvent,
        at: DateTime<Utc>,
        session: Option<Uuid>,
        cause: Option<&str>,
    ) -> Result<()> {
        let sql =
            "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
                   VALUES ($1, $2, $3, $4, $5, $6)";
        let args = [
            Arg::Uuid(machine),
            Arg::Text(process.as_str()),
            Arg::Text(event.as_str()),
            Arg::Time(at),
            Arg::OptUuid(session),
            Arg::OptText(cause),
        ];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }

    /// Keeps `process` off the machine until `until`, with `cause` for operators. A
    /// `last_interval` of 0 marks a wait that is not a failure, so the process's next failure
    /// backs off from its own initial interval.
    pub async fn set_backoff(
        &mut self,
        machine: Uuid,
        process: Process,
        until: DateTime<Utc>,
        last_interval: i64,
        cause: &str,
    ) -> Result<()> {
        let args = [
            Arg::Uuid(machine),
            Arg::Text(process.as_str()),
            Arg::Time(until),
            Arg::Text(cause),
            Arg::Int(last_interval),
        ];
        self.conn().execute(BACKOFF_UPSERT, &args).await?;
        Ok(())
    }

    /// Ends the machine's backoffs for `process` (every process if `None`) now; returns how
    /// many there were.
    pub async fn clear_backoffs(&mut self, machine: Uuid, process: Option<Process>) -> Result<u64> {
        let sql = "DELETE FROM work_backoff WHERE machine_id = $1 AND ($2 IS NULL OR process = $2)";
        let args = [
            Arg::Uuid(machine),
            Arg::OptText(process.map(|p| p.as_str())),
        ];
        self.conn().execute(sql, &args).await
    }

    /// Test support: inserts a work row without claiming (to build arbitrary fleets).
    #[cfg(feature = "testing")]
    pub async fn insert_work_raw(
        &mut self,
        machine: Uuid,
        session: Uuid,
        process: Process,
    ) -> Result<()> {
        let sql = "INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3)";
        let args = [
            Arg::Uuid(machine),
            Arg::Uuid(session),
            Arg::Text(process.as_str()),
        ];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }

    /// Test support: appends a work history entry with any time (to build old history).
    #[cfg(feature = "testing")]
    pub async fn insert_history_raw(
        &mut self,
        machine: Uuid,
        process: Process,
        event: WorkEvent,
        at: DateTime<Utc>,
        cause: Option<&str>,
    ) -> Result<()> {
        self.insert_history(machine, process, event, at, None, cause)
            .await
    }

    /// A machine's work history, oldest first.
    pub async fn machine_history(&mut self, machine: Uuid) -> Result<Vec<HistoryEntry>> {
        let sql = "SELECT * FROM work_history WHERE machine_id = $1 ORDER BY id";
        self.conn().rows(sql, &[Arg::Uuid(machine)]).await
    }

    /// History entries of all machines with id above `after_id`, oldest first, at most
    /// `limit`.
    pub async fn history_after(&mut self, after_id: i64, limit: i64) -> Result<Vec<HistoryEntry>> {
        let sql = "SELECT * FROM work_history WHERE id > $1 ORDER BY id LIMIT $2";
        self.conn()
            .rows(sql, &[Arg::Int(after_id), Arg::Int(limit)])
            .await
    }

    /// Work currently held on a machine.
    pub async fn machine_work(&mut self, machine: Uuid) -> Result<Vec<ActiveWork>> {
        let sql = "SELECT machine_id, process, session_id FROM work WHERE machine_id = $1
                   ORDER BY process";
        self.conn().rows(sql, &[Arg::Uuid(machine)]).await
    }

    /// Backoffs recorded for a machine (active or expired).
    pub async fn machine_backoffs(&mut self, machine: Uuid) -> Result<Vec<BackoffEntry>> {
        let sql =
            "SELECT machine_id, process, until, cause, last_interval_seconds FROM work_backoff
                   WHERE machine_id = $1 ORDER BY process";
        self.conn().rows(sql, &[Arg::Uuid(machine)]).await
    }
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
