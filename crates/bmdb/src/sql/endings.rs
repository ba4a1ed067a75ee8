//! How work ends (design.md §4): finished, failed (with a backoff) or canceled, each with its audit
//! history entry; backoffs set and cleared by hand; the history and work an operator reads.
//!
//! On Postgres the endings of a batch (`ending_batch.rs`) are one statement (its
//! data-modifying CTEs keep it to one round trip); SQLite, which has no such CTEs, runs the same
//! steps as statements inside its transaction.
//! Finish and Fail need no lock on the session row: our work row is the lock. If garbage
//! collection deleted it first, nothing is deleted and the work is reported lost; if we delete
//! it first, the collector's cascade waits for our commit.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::engine::{from_columns, Arg, Conn, Result, Tx};
use super::finish_tags::{Refusal, TagColumns, TagWrites};
use crate::model::*;
use crate::Error;

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

/// How one unit of work ends.
#[derive(Debug, Clone, Copy)]
pub(crate) enum How<'a> {
    /// Finished: the process's backoff is cleared, and these tags written.
    Finish(&'a TagWrites),
    /// Failed with `cause`: held back from the process for `delay`, `interval` seconds
    /// remembered for its next failure.
    Fail {
        cause: &'a str,
        interval: i64,
        delay: std::time::Duration,
    },
    /// Given up without a verdict, with why if it is known ("lease lost"); the backoff is
    /// untouched. Works on an expired session.
    Cancel(Option<&'a str>),
}

impl How<'_> {
    /// The history event the ending writes.
    fn event(self) -> WorkEvent {
        match self {
            How::Finish(_) => WorkEvent::Finished,
            How::Fail { .. } => WorkEvent::Failed,
            How::Cancel(_) => WorkEvent::Canceled,
        }
    }
}

/// One ending: `session`'s work on `machine` for `process`, ended as `how` says.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WorkEnd<'a> {
    pub(crate) session: Uuid,
    pub(crate) machine: Uuid,
    pub(crate) process: Process,
    pub(crate) how: How<'a>,
}

/// Many endings in one Postgres statement, finishes with their tag writes. Parameters, one
/// array element per ending: `$1` sessions, `$2` machines, `$3` processes, `$4` events, `$5`
/// failure causes, `$6` backoff delays in seconds, `$7` intervals remembered; then a finish's
/// tags (`finish_tags.rs`): `$8` host keys to pin, `$9` agent keys started (with `$18` their
/// live proofs), `$10` agents and `$11` heartbeats forgotten, `$12` recoveries; and one element
/// per hold, `$13` its ending's position, `$14`–`$17` process, seconds, cause, interval. An ending other than a cancel
/// needs its session alive; each deletes its own work row (`del`), and only those deleted
/// write. No machine may have two endings in one statement (a row is written once per
/// statement). A finish's backoff for its own process is cleared unless it holds that process
/// again. A pin leaves a pinned key as it is, and returns the key the machine has now, even
/// one pinned concurrently, so that the caller can refuse a finish whose key differs.
const END_WORKS_PG: &str = "WITH e AS (
        SELECT * FROM unnest($1::uuid[], $2::uuid[], $3::text[], $4::text[], $5::text[],
                             $6::float8[], $7::int8[], $8::text[], $9::bytea[], $10::bool[],
                             $11::bool[], $12::int4[], $18::text[])
            WITH ORDINALITY AS e(session_id, machine_id, process, event, cause, delay,
                                 last_interval, pin, agent_key, forget_agent,
                                 forget_heartbeat, recovery, live_proof, n)),
     holds AS (
        SELECT * FROM unnest($13::int8[], $14::text[], $15::float8[], $16::text[], $17::int8[])
            AS h(n, process, delay, cause, last_interval)),
     alive AS (
        SELECT e.n FROM e WHERE e.event = 'Canceled' OR EXISTS (
            SELECT 1 FROM sessions s WHERE s.session_id = e.session_id AND s.deadline > now())),
     del AS (
        DELETE FROM work w USING e
         WHERE w.machine_id = e.machine_id AND w.process = e.process
           AND w.session_id = e.session_id AND e.n IN (SELECT n FROM alive)
        RETURNING e.*),
     cleared AS (
        DELETE FROM work_backoff b USING del
         WHERE del.event = 'Finished' AND b.machine_id = del.machine_id
           AND b.process = del.process
           AND NOT EXISTS (SELECT 1 FROM holds h WHERE h.n = del.n AND h.process = del.process)),
     held AS (
        INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
        SELECT machine_id, process, now() + make_interval(secs => delay), cause, last_interval
          FROM del WHERE event = 'Failed'
        UNION ALL
        SELECT del.machine_id, h.process, now() + make_interval(secs => h.delay), h.cause,
               h.last_interval
          FROM holds h JOIN del ON del.n = h.n
        ON CONFLICT (machine_id, process) DO UPDATE SET until = excluded.until,
            cause = excluded.cause, last_interval_seconds = excluded.last_interval_seconds),
     hist AS (
        INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
        SELECT machine_id, process, event, now(), session_id, cause
          FROM del ORDER BY n),
     pinned AS (
        INSERT INTO machine_ssh_host_key (machine_id, key, first_seen_at)
        SELECT machine_id, pin, now() FROM del WHERE pin IS NOT NULL
        ON CONFLICT (machine_id) DO UPDATE SET key = machine_ssh_host_key.key
        RETURNING machine_id, key),
     started AS (
        INSERT INTO machine_agent_started (machine_id, started_at, public_key, live_proof)
        SELECT machine_id, now(), agent_key, live_proof FROM del WHERE agent_key IS NOT NULL
        ON CONFLICT (machine_id) DO UPDATE
        SET started_at = excluded.started_at, public_key = excluded.public_key,
            live_proof = excluded.live_proof),
     unstarted AS (
        DELETE FROM machine_agent_started a USING del
         WHERE a.machine_id = del.machine_id AND del.forget_agent),
     silenced AS (
        DELETE FROM machine_agent_heartbeat a USING del
         WHERE a.machine_id = del.machine_id AND del.forget_heartbeat),
     recovered AS (
        INSERT INTO machine_recovery (machine_id, rebooted_at, in_a_row)
        SELECT machine_id, now(), recovery FROM del WHERE recovery IS NOT NULL
        ON CONFLICT (machine_id) DO UPDATE
        SET rebooted_at = excluded.rebooted_at, in_a_row = excluded.in_a_row)
     SELECT e.n IN (SELECT n FROM alive), e.n IN (SELECT n FROM del), p.key
       FROM e LEFT JOIN pinned p ON p.machine_id = e.machine_id ORDER BY e.n";

/// Sets a backoff, or replaces the process's current one.
const BACKOFF_UPSERT: &str =
    "INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
     VALUES ($1, $2, $3, $4, $5)
     ON CONFLICT (machine_id, process) DO UPDATE SET until = excluded.until,
        last_interval_seconds = excluded.last_interval_seconds, cause = excluded.cause";

impl Tx {
    /// Ends each of `ends` (releasing its work, writing its history, clearing or setting its
    /// backoff, writing a finish's tags); what each found, in order, or the first ending whose
    /// tags were refused, and then the transaction must be rolled back. On Postgres one
    /// statement for them all, unless two name the same machine.
    pub(crate) async fn end_works(
        &mut self,
        ends: &[WorkEnd<'_>],
    ) -> Result<std::result::Result<Vec<EndOutcome>, Refusal>> {
        let postgres = matches!(self.conn(), Conn::Postgres(_));
        if postgres && each_machine_once(ends) {
            return self.end_works_together(ends).await;
        }
        let mut outcomes = Vec::with_capacity(ends.len());
        for (member, end) in ends.iter().enumerate() {
            let ended = if postgres {
                let one = self.end_works_together(std::slice::from_ref(end)).await?;
                one.map(|outcomes| outcomes[0])
                    .map_err(|refusal| refusal.error)
            } else {
                self.end_work_sqlite(end).await?
            };
            match ended {
                Ok(outcome) => outcomes.push(outcome),
                Err(error) => return Ok(Err(Refusal { member, error })),
            }
        }
        Ok(Ok(outcomes))
    }

    /// `ends` in one Postgres statement ([`END_WORKS_PG`]); their machines differ.
    async fn end_works_together(
        &mut self,
        ends: &[WorkEnd<'_>],
    ) -> Result<std::result::Result<Vec<EndOutcome>, Refusal>> {
        let Conn::Postgres(c) = self.conn() else {
            unreachable!("one statement on Postgres only")
        };
        let column = |f: &dyn Fn(&WorkEnd<'_>) -> _| ends.iter().map(f).collect();
        let sessions: Vec<Uuid> = column(&|e| e.session);
        let machines: Vec<Uuid> = column(&|e| e.machine);
        let processes: Vec<&str> = ends.iter().map(|e| e.process.as_str()).collect();
        let events: Vec<&str> = ends.iter().map(|e| e.how.event().as_str()).collect();
        let (mut causes, mut delays, mut intervals) = (vec![], vec![], vec![]);
        let mut tags = TagColumns::default();
        for e in ends {
            let (cause, delay, interval) = match e.how {
                How::Fail {
                    cause,
                    interval,
                    delay,
                } => (Some(cause), Some(delay.as_secs_f64()), Some(interval)),
                How::Cancel(cause) => (cause, None, None),
                How::Finish(_) => (None, None, None),
            };
            causes.push(cause);
            delays.push(delay);
            intervals.push(interval);
            tags.push(match e.how {
                How::Finish(writes) => Some(writes),
                How::Fail { .. } | How::Cancel(_) => None,
            });
        }
        let rows: Vec<(bool, bool, Option<String>)> = sqlx::query_as(END_WORKS_PG)
            .bind(sessions)
            .bind(machines)
            .bind(processes)
            .bind(events)
            .bind(causes)
            .bind(delays)
            .bind(intervals)
            .bind(tags.pins)
            .bind(tags.agent_keys)
            .bind(tags.forget_agents)
            .bind(tags.forget_heartbeats)
            .bind(tags.recoveries)
            .bind(tags.holds.endings)
            .bind(tags.holds.processes)
            .bind(tags.holds.seconds)
            .bind(tags.holds.causes)
            .bind(tags.holds.intervals)
            .bind(tags.live_proofs)
            .fetch_all(&mut **c)
            .await?;
        let mut outcomes = Vec::with_capacity(rows.len());
        for (member, (end, (alive, deleted, pinned))) in ends.iter().zip(rows).enumerate() {
            let outcome = EndOutcome::of(alive, deleted);
            if let (How::Finish(tags), EndOutcome::Done) = (end.how, outcome) {
                if let Some(error) = tags.refused_by_pin(end.machine, pinned) {
                    return Ok(Err(Refusal { member, error }));
                }
            }
            outcomes.push(outcome);
        }
        Ok(Ok(outcomes))
    }

    /// One ending on SQLite, statement by statement, a finish's tags last; `Ok(Err(_))` when
    /// those tags were refused (the transaction must then be rolled back).
    async fn end_work_sqlite(
        &mut self,
        end: &WorkEnd<'_>,
    ) -> Result<std::result::Result<EndOutcome, Error>> {
        let WorkEnd {
            session,
            machine,
            process,
            how,
        } = *end;
        let outcome = match how {
            How::Cancel(_) => match self.delete_own_work(session, machine, process).await? {
                true => EndOutcome::Done,
                false => EndOutcome::Lost,
            },
            How::Finish(_) | How::Fail { .. } => {
                self.end_own_work(session, machine, process).await?
            }
        };
        if outcome != EndOutcome::Done {
            return Ok(Ok(outcome));
        }
        let cause = match how {
            How::Finish(_) => {
                let sql = "DELETE FROM work_backoff WHERE machine_id = $1 AND process = $2";
                let args = [Arg::Uuid(machine), Arg::Text(process.as_str())];
                self.conn().execute(sql, &args).await?;
                None
            }
            How::Fail {
                cause,
                interval,
                delay,
            } => {
                let until = self.now().await? + delay;
                self.set_backoff(machine, process, until, interval, cause)
                    .await?;
                Some(cause)
            }
            How::Cancel(cause) => cause,
        };
        self.write_history(session, machine, process, how.event(), cause)
            .await?;
        if let How::Finish(tags) = how {
            if let Err(refused) = self.write_tags_of(machine, tags).await {
                return Ok(Err(refused));
            }
        }
        Ok(Ok(outcome))
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

    /// Keeps `process` off the machine until `until`, with `cause` for operators (stored as
    /// a failure cause is: NULs replaced, bounded). A
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
        let cause = crate::model::stored_cause(cause);
        let args = [
            Arg::Uuid(machine),
            Arg::Text(process.as_str()),
            Arg::Time(until),
            Arg::Text(&cause),
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

/// Whether no machine has two endings in `ends` (one statement cannot write a row twice, so
/// such a batch is written ending by ending).
fn each_machine_once(ends: &[WorkEnd<'_>]) -> bool {
    let mut seen = std::collections::HashSet::with_capacity(ends.len());
    ends.iter().all(|e| seen.insert(e.machine))
}
