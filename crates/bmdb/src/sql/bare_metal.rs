//! Bare machines (design.md §21): the `machine_bare_metal` tag, its phases entered only by the work
//! holder and only from the phase it read, the steps' history, and the media server's lookup.

use uuid::Uuid;

use super::engine::{from_columns, now_in, Arg, Engine, Result, Tx};
use crate::bare_metal::{phase_moved, BareHistoryEntry, BareMetal, BarePhase, PhaseWrites};
use crate::bare_metal::{MediaGrant, MAX_DETAIL_LEN};
use crate::model::Process;
use crate::Error;

/// Records a machine bare, or starts its way over; the transaction's time is `$3` on SQLite.
fn record_sql(engine: Engine) -> String {
    let now = now_in(engine, 3);
    format!(
        "INSERT INTO machine_bare_metal (machine_id, phase, phase_at, wipe_by)
         VALUES ($1, 'Bare', {now}, $2)
         ON CONFLICT (machine_id) DO UPDATE SET phase = 'Bare', phase_at = {now},
            attempts = 0, media_token = NULL, media_expires_at = NULL, config = NULL,
            wipe_by = excluded.wipe_by, install_generation = NULL, rewrite_grant = NULL,
            chosen_disk = NULL"
    )
}

/// Moves the phase on only from the phase the loop read: a compare-and-set, so that neither a
/// stale holder nor a race with an operator's reimage moves it twice.
fn enter_sql(engine: Engine) -> String {
    format!(
        "UPDATE machine_bare_metal SET phase = $3, phase_at = {now}, attempts = attempts + $4,
            media_token = CASE WHEN $5 THEN $6 ELSE media_token END,
            media_expires_at = CASE WHEN $5 THEN $7 ELSE media_expires_at END,
            config = CASE WHEN $5 THEN $8 ELSE config END,
            install_generation = coalesce($9, install_generation),
            rewrite_grant = CASE WHEN $10 THEN media_token ELSE rewrite_grant END,
            chosen_disk = coalesce($11, chosen_disk)
         WHERE machine_id = $1 AND phase = $2",
        now = now_in(engine, 12)
    )
}

fn history_sql(engine: Engine) -> String {
    format!(
        "INSERT INTO bare_metal_history (machine_id, at, phase, session_id, detail)
         VALUES ($1, {now}, $2, $3, $4)",
        now = now_in(engine, 5)
    )
}

fn grant_sql(engine: Engine) -> String {
    format!(
        "SELECT media_token AS token, media_expires_at AS expires_at, config
           FROM machine_bare_metal
          WHERE machine_id = $1 AND media_token IS NOT NULL AND config IS NOT NULL
            AND media_expires_at > {now}",
        now = now_in(engine, 2)
    )
}

from_columns! {
    BareMetal {
        phase: parsed, phase_at: time, attempts: get, media_token: get,
        media_expires_at: opt_time, config: get, wipe_by: get, install_generation: get,
        rewrite_grant: get, chosen_disk: get,
    }
    BareHistoryEntry { id: get, machine_id: get, at: time, phase: parsed, session_id: get, detail: get }
    MediaGrant { token: get, expires_at: time, config: get }
}

/// `detail` as it is stored: at most [`MAX_DETAIL_LEN`] bytes, cut at a character boundary.
fn stored_detail(detail: &str) -> String {
    crate::model::stored_cause(detail)
        .char_indices()
        .take_while(|(i, _)| *i < MAX_DETAIL_LEN)
        .map(|(_, c)| c)
        .collect()
}

impl Tx {
    /// Records `machine` as bare, at the start of its way (phase `Bare`, no attempt yet), with
    /// `detail` in its history; `wipe_by` names who allowed its disk to be overwritten besides
    /// its inventory entry. A machine recorded bare before starts over.
    pub async fn record_bare(
        &mut self,
        machine: Uuid,
        wipe_by: Option<&str>,
        detail: &str,
        session: Option<Uuid>,
    ) -> Result<()> {
        let args = [Arg::Uuid(machine), Arg::OptText(wipe_by), Arg::Now];
        let sql = record_sql(self.engine());
        self.conn().execute(sql.as_str(), &args).await?;
        self.forget_system(machine, true).await?;
        self.bare_history_entry(machine, BarePhase::Bare, session, detail)
            .await
    }

    /// The machine's `machine_bare_metal` tag, if it was recorded bare.
    pub async fn bare_metal(&mut self, machine: Uuid) -> Result<Option<BareMetal>> {
        let sql = "SELECT phase, phase_at, attempts, media_token, media_expires_at, config,
                          wipe_by, install_generation, rewrite_grant, chosen_disk
                     FROM machine_bare_metal WHERE machine_id = $1";
        self.conn().row(sql, &[Arg::Uuid(machine)]).await
    }

    /// Moves `machine` from phase `from` to `to` with `writes`, and records the step with
    /// `detail`: only while `session` holds the machine's bare-metal work, and only if the
    /// phase is still `from` ([`Error::BarePhaseMoved`] otherwise, [`Error::WorkLost`] when
    /// the work is not held; nothing is written either way).
    pub async fn enter_bare_phase(
        &mut self,
        session: Uuid,
        machine: Uuid,
        (from, to): (BarePhase, BarePhase),
        writes: &PhaseWrites,
        detail: &str,
    ) -> Result<()> {
        let process = Process::ShepherdBareMetal;
        if !self.holds_work(session, machine, process).await? {
            return Err(Error::WorkLost {
                machine_id: machine,
                process: process.as_str(),
            });
        }
        let media = writes.media.as_ref();
        let grant = media.and_then(|m| m.as_ref());
        let args = [
            Arg::Uuid(machine),
            Arg::Text(from.as_str()),
            Arg::Text(to.as_str()),
            Arg::Int32(i32::from(writes.count_attempt)),
            Arg::Bool(media.is_some()),
            Arg::OptText(grant.map(|g| g.token.as_str())),
            Arg::OptTime(grant.map(|g| g.expires_at)),
            Arg::OptText(grant.map(|g| g.config.as_str())),
            Arg::OptInt(writes.install_generation),
            Arg::Bool(writes.began_writing),
            Arg::OptText(writes.chosen_disk.as_deref()),
            Arg::Now,
        ];
        let sql = enter_sql(self.engine());
        if self.conn().execute(sql.as_str(), &args).await? != 1 {
            let found = self.bare_metal(machine).await?.map(|b| b.phase);
            return Err(phase_moved(machine, from, found));
        }
        if let Some(forget) = writes.forget_system {
            self.forget_system(machine, forget.installation).await?;
        }
        self.bare_history_entry(machine, to, Some(session), detail)
            .await
    }

    /// Deletes what tied `machine` to the system it ran: its agent, heartbeat and pinned host
    /// key, and with `installation` its installation request and report.
    async fn forget_system(&mut self, machine: Uuid, installation: bool) -> Result<()> {
        self.delete_agent_started(machine).await?;
        self.delete_heartbeat(machine).await?;
        self.delete_ssh_host_key(machine).await?;
        if installation {
            self.delete_os_installation(machine).await?;
        }
        Ok(())
    }

    async fn bare_history_entry(
        &mut self,
        machine: Uuid,
        phase: BarePhase,
        session: Option<Uuid>,
        detail: &str,
    ) -> Result<()> {
        let detail = stored_detail(detail);
        let args = [
            Arg::Uuid(machine),
            Arg::Text(phase.as_str()),
            Arg::OptUuid(session),
            Arg::Text(&detail),
            Arg::Now,
        ];
        let sql = history_sql(self.engine());
        self.conn().execute(sql.as_str(), &args).await?;
        Ok(())
    }

    /// The machine's bare-metal steps, oldest first, at most `limit`.
    pub async fn bare_history(
        &mut self,
        machine: Uuid,
        limit: i64,
    ) -> Result<Vec<BareHistoryEntry>> {
        let sql = "SELECT id, machine_id, at, phase, session_id, detail FROM bare_metal_history
                    WHERE machine_id = $1 ORDER BY id LIMIT $2";
        self.conn()
            .rows(sql, &[Arg::Uuid(machine), Arg::Int(limit)])
            .await
    }

    /// What the media server hands `machine`'s BMC: its URL secret and config drive, while
    /// the grant has not expired.
    pub async fn media_grant(&mut self, machine: Uuid) -> Result<Option<MediaGrant>> {
        let args = [Arg::Uuid(machine), Arg::Now];
        let sql = grant_sql(self.engine());
        self.conn().row(sql.as_str(), &args).await
    }

    /// How many bare machines are in each phase (the loop's gauges and the overview).
    pub async fn count_bare_phases(&mut self) -> Result<Vec<(BarePhase, i64)>> {
        let sql = "SELECT phase, count(*) FROM machine_bare_metal GROUP BY phase ORDER BY phase";
        let rows: Vec<(String, i64)> = self.conn().rows(sql, &[]).await?;
        super::engine::parse_counts(rows)
    }

    /// Test support: sets a machine's bare-metal tag to any phase, entered at any time, with
    /// an installation generation (to build arbitrary fleets).
    #[cfg(feature = "testing")]
    pub async fn set_bare_metal_raw(
        &mut self,
        machine: Uuid,
        phase: BarePhase,
        phase_at: chrono::DateTime<chrono::Utc>,
        install_generation: Option<i64>,
    ) -> Result<()> {
        let sql = "INSERT INTO machine_bare_metal (machine_id, phase, phase_at, install_generation)
                   VALUES ($1, $2, $3, $4)
                   ON CONFLICT (machine_id) DO UPDATE SET phase = excluded.phase,
                      phase_at = excluded.phase_at, install_generation = excluded.install_generation";
        let args = [
            Arg::Uuid(machine),
            Arg::Text(phase.as_str()),
            Arg::Time(phase_at),
            Arg::OptInt(install_generation),
        ];
        self.conn().execute(sql, &args).await?;
        Ok(())
    }
}
