//! Operators' read-only views: one row of tags per machine, fleet-wide counts, the counts of
//! `shepherd bmdb status`, hardware reports, and each engine's own integrity checks.

use uuid::Uuid;

use super::engine::{
    from_columns, now_in, parse_counts, span_ago, Arg, Columns, Engine, FromColumns, Result, Tx,
};
use super::tags::ProvidedRow;
use crate::model::{Process, ProviderKind};
use crate::summary::{FleetCounts, MachineSummary};

/// Counts shown by `shepherd bmdb status`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatusCounts {
    /// Rows in `machines`.
    pub machines: i64,
    /// Machines with a `machine_provided` tag.
    pub provided: i64,
    /// Machines with an `agent_started` tag.
    pub agent_started: i64,
    /// Machines with a heartbeat tag.
    pub heartbeating: i64,
    /// Sessions before their deadline.
    pub sessions_live: i64,
    /// Sessions past their deadline, not yet garbage-collected.
    pub sessions_expired: i64,
    /// Active work rows per process.
    pub work: Vec<(Process, i64)>,
    /// Active (until in the future) backoffs per process.
    pub backoffs: Vec<(Process, i64)>,
    /// Rows in `work_history`.
    pub history_entries: i64,
}

/// The single-number counts of [`StatusCounts`].
struct StatusRow {
    machines: i64,
    provided: i64,
    agent_started: i64,
    heartbeating: i64,
    sessions_live: i64,
    sessions_expired: i64,
    history_entries: i64,
}

/// The single-number counts of [`FleetCounts`].
struct FleetRow {
    machines: i64,
    maintenance: i64,
    decommissioned: i64,
    missing: i64,
    agent_started: i64,
    heartbeating: i64,
    stale: i64,
    pending_install: i64,
    installed: i64,
    install_failed: i64,
}

/// A row `PRAGMA foreign_key_check` reports: a row of `table` whose `parent` row is missing.
struct ForeignKeyProblem {
    table: String,
    parent: String,
}

from_columns! {
    StatusRow {
        machines: get, provided: get, agent_started: get, heartbeating: get, sessions_live: get,
        sessions_expired: get, history_entries: get,
    }
    FleetRow {
        machines: get, maintenance: get, decommissioned: get, missing: get, agent_started: get,
        heartbeating: get, stale: get, pending_install: get, installed: get, install_failed: get,
    }
    ForeignKeyProblem { table: get, parent: get }
}

/// The three installation counts of [`FleetCounts`], as upstream's statistics count them:
/// requests without a report of their generation (pending), requests with one whatever its
/// result (installed), and of those the ones that report an error (failed).
const INSTALLATION_COUNTS: &str = "(SELECT count(*) FROM machine_os_installation_request q
       WHERE NOT EXISTS (SELECT 1 FROM machine_os_installation_report r
          WHERE r.machine_id = q.machine_id AND r.generation = q.generation)) AS pending_install,
     (SELECT count(*) FROM machine_os_installation_request q
       WHERE EXISTS (SELECT 1 FROM machine_os_installation_report r
          WHERE r.machine_id = q.machine_id AND r.generation = q.generation)) AS installed,
     (SELECT count(*) FROM machine_os_installation_request q
       WHERE EXISTS (SELECT 1 FROM machine_os_installation_report r
          WHERE r.machine_id = q.machine_id AND r.generation = q.generation
            AND r.result = 'Error')) AS install_failed";

/// One row of tags per machine; `{now}` is where each engine reads the time. The recoverer's
/// backoff is read apart from the others (see [`MachineSummary::recovery_backoff_until`]).
fn summary_select(now: &str) -> String {
    let recovery = Process::ShepherdRecovery.as_str();
    format!(
        "SELECT m.machine_id, p.provider, p.provider_id, p.reservation_id, p.ip_address,
                p.location, p.status, p.facts, a.started_at, h.heartbeat_at,
                (SELECT string_agg(w.process, ',' ORDER BY w.process) FROM work w
                  WHERE w.machine_id = m.machine_id) AS work,
                (SELECT max(b.until) FROM work_backoff b
                  WHERE b.machine_id = m.machine_id AND b.until > {now}
                    AND b.process <> '{recovery}') AS backoff_until,
                (SELECT max(b.until) FROM work_backoff b
                  WHERE b.machine_id = m.machine_id AND b.until > {now}
                    AND b.process = '{recovery}') AS recovery_backoff_until,
                q.generation AS request_generation, r.generation AS report_generation,
                r.result AS report_result,
                EXISTS (SELECT 1 FROM machine_maintenance mm
                         WHERE mm.machine_id = m.machine_id) AS maintenance
           FROM machines m
           LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
           LEFT JOIN machine_agent_started a ON a.machine_id = m.machine_id
           LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
           LEFT JOIN machine_os_installation_request q ON q.machine_id = m.machine_id
           LEFT JOIN machine_os_installation_report r ON r.machine_id = m.machine_id"
    )
}

fn summary_from_row(r: &impl Columns) -> Result<MachineSummary> {
    let provider: Option<String> = r.get("provider")?;
    let provided = match provider {
        Some(_) => Some(ProvidedRow::from_columns(r)?.1),
        None => None,
    };
    let work: Option<String> = r.get("work")?;
    let report_generation: Option<i64> = r.get("report_generation")?;
    let report_result: Option<String> = r.get("report_result")?;
    Ok(MachineSummary {
        machine_id: r.get("machine_id")?,
        provided,
        agent_started_at: r.opt_time("started_at")?,
        heartbeat_at: r.opt_time("heartbeat_at")?,
        work: work
            .iter()
            .flat_map(|w| w.split(','))
            .map(|p| p.parse())
            .collect::<Result<_>>()?,
        backoff_until: r.opt_time("backoff_until")?,
        recovery_backoff_until: r.opt_time("recovery_backoff_until")?,
        request_generation: r.get("request_generation")?,
        report: match (report_generation, report_result) {
            (Some(g), Some(res)) => Some((g, res.parse()?)),
            _ => None,
        },
        maintenance: r.get("maintenance")?,
    })
}

impl Tx {
    /// Active work rows and active backoffs, per process.
    async fn active_work_counts(&mut self) -> Result<(Vec<(Process, i64)>, Vec<(Process, i64)>)> {
        let engine = self.engine();
        let conn = self.conn();
        let work = "SELECT process, count(*) FROM work GROUP BY process ORDER BY process";
        let work: Vec<(String, i64)> = conn.rows(work, &[]).await?;
        let backoffs = format!(
            "SELECT process, count(*) FROM work_backoff WHERE until > {}
              GROUP BY process ORDER BY process",
            now_in(engine, 1)
        );
        let backoffs: Vec<(String, i64)> = conn.rows(&backoffs, &[Arg::Now]).await?;
        Ok((parse_counts(work)?, parse_counts(backoffs)?))
    }

    /// Counts for `shepherd bmdb status`.
    pub async fn status_counts(&mut self) -> Result<StatusCounts> {
        let now = now_in(self.engine(), 1);
        let sql = format!(
            "SELECT (SELECT count(*) FROM machines) AS machines,
                    (SELECT count(*) FROM machine_provided) AS provided,
                    (SELECT count(*) FROM machine_agent_started) AS agent_started,
                    (SELECT count(*) FROM machine_agent_heartbeat) AS heartbeating,
                    (SELECT count(*) FROM sessions WHERE deadline > {now}) AS sessions_live,
                    (SELECT count(*) FROM sessions WHERE deadline <= {now}) AS sessions_expired,
                    (SELECT count(*) FROM work_history) AS history_entries"
        );
        let row: Option<StatusRow> = self.conn().row(&sql, &[Arg::Now]).await?;
        let row = row.expect("a SELECT without FROM returns one row");
        let (work, backoffs) = self.active_work_counts().await?;
        Ok(StatusCounts {
            machines: row.machines,
            provided: row.provided,
            agent_started: row.agent_started,
            heartbeating: row.heartbeating,
            sessions_live: row.sessions_live,
            sessions_expired: row.sessions_expired,
            work,
            backoffs,
            history_entries: row.history_entries,
        })
    }

    /// Up to `limit` machines after `after` in id order, each as one row of tags; only those
    /// of `provider` if given.
    pub async fn machine_summaries(
        &mut self,
        after: Option<Uuid>,
        provider: Option<ProviderKind>,
        limit: i64,
    ) -> Result<Vec<MachineSummary>> {
        let sql = format!(
            "{}
              WHERE ($1 IS NULL OR m.machine_id > $1) AND ($2 IS NULL OR p.provider = $2)
              ORDER BY m.machine_id LIMIT $3",
            summary_select(&now_in(self.engine(), 4))
        );
        let args = [
            Arg::OptUuid(after),
            Arg::OptText(provider.map(|p| p.as_str())),
            Arg::Int(limit),
            Arg::Now,
        ];
        self.conn().rows(&sql, &args).await
    }

    /// One machine as one row of tags; `None` if it does not exist.
    pub async fn machine_summary(&mut self, id: Uuid) -> Result<Option<MachineSummary>> {
        let sql = format!(
            "{} WHERE m.machine_id = $1",
            summary_select(&now_in(self.engine(), 2))
        );
        self.conn().row(&sql, &[Arg::Uuid(id), Arg::Now]).await
    }

    /// Fleet-wide counts for the statistics gauges; heartbeats older than `stale_after` count
    /// as stale.
    pub async fn fleet_counts(&mut self, stale_after: chrono::Duration) -> Result<FleetCounts> {
        let stale_after = stale_after.to_std().unwrap_or_default();
        let ago = span_ago(self.engine(), 1, 2);
        let sql = format!(
            "SELECT (SELECT count(*) FROM machines) AS machines,
                    (SELECT count(*) FROM machine_maintenance) AS maintenance,
                    (SELECT count(*) FROM decommissioned) AS decommissioned,
                    (SELECT count(*) FROM machine_provided
                      WHERE status = 'Missing') AS missing,
                    (SELECT count(*) FROM machine_agent_started) AS agent_started,
                    (SELECT count(*) FROM machine_agent_heartbeat
                      WHERE heartbeat_at > {ago}) AS heartbeating,
                    (SELECT count(*) FROM machine_agent_heartbeat
                      WHERE heartbeat_at <= {ago}) AS stale,
                    {INSTALLATION_COUNTS}"
        );
        let args = [Arg::Span(stale_after), Arg::Now];
        let row: Option<FleetRow> = self.conn().row(&sql, &args).await?;
        let row = row.expect("a SELECT without FROM returns one row");
        let provided = "SELECT provider, count(*) FROM machine_provided
                         GROUP BY provider ORDER BY provider";
        let provided: Vec<(String, i64)> = self.conn().rows(provided, &[]).await?;
        let (work, backoffs) = self.active_work_counts().await?;
        Ok(FleetCounts {
            machines: row.machines,
            provided: parse_counts(provided)?,
            agent_started: row.agent_started,
            heartbeating: row.heartbeating,
            stale: row.stale,
            pending_install: row.pending_install,
            installed: row.installed,
            install_failed: row.install_failed,
            work,
            backoffs,
            maintenance: row.maintenance,
            decommissioned: row.decommissioned,
            missing: row.missing,
        })
    }

    /// Up to `limit` raw hardware reports of provided machines after machine `after`, with
    /// the machine's provider and location (as upstream's statistics, machines without a
    /// `machine_provided` tag are not counted).
    pub async fn hardware_reports(
        &mut self,
        after: Option<Uuid>,
        limit: i64,
    ) -> Result<Vec<(Uuid, ProviderKind, Option<String>, Vec<u8>)>> {
        let sql = "SELECT h.machine_id, p.provider, p.location, h.report_raw
                     FROM machine_hardware_report h
                     JOIN machine_provided p ON p.machine_id = h.machine_id
                    WHERE $1 IS NULL OR h.machine_id > $1 ORDER BY h.machine_id LIMIT $2";
        let rows: Vec<HardwareRow> = self
            .conn()
            .rows(sql, &[Arg::OptUuid(after), Arg::Int(limit)])
            .await?;
        rows.into_iter()
            .map(|r| Ok((r.machine_id, r.provider.parse()?, r.location, r.report_raw)))
            .collect()
    }

    /// What the database engine's own consistency checks find wrong (empty when healthy).
    /// Postgres, without scanning tables: constraints left unvalidated and indexes left
    /// invalid (a failed concurrent build) in the BMDB's schema. SQLite: `PRAGMA
    /// integrity_check` (pages, indexes, NOT NULL and CHECK constraints) and `PRAGMA
    /// foreign_key_check`, as the SQLite linked into this binary sees them (older command-line
    /// shells misreport WITHOUT ROWID tables).
    pub async fn integrity_problems(&mut self) -> Result<Vec<String>> {
        let conn = self.conn();
        match conn.engine() {
            Engine::Postgres => {
                let sql = "SELECT format('constraint %s on %s is not validated', conname, conrelid::regclass)
                             FROM pg_constraint
                            WHERE NOT convalidated AND connamespace = current_schema()::regnamespace
                           UNION ALL
                           SELECT format('index %s is not valid', indexrelid::regclass)
                             FROM pg_index JOIN pg_class ON pg_class.oid = indexrelid
                            WHERE NOT indisvalid AND relnamespace = current_schema()::regnamespace";
                conn.values(sql, &[]).await
            }
            Engine::Sqlite => {
                let checked: Vec<String> = conn.values("PRAGMA integrity_check", &[]).await?;
                let mut problems: Vec<String> = checked.into_iter().filter(|r| r != "ok").collect();
                let orphans: Vec<ForeignKeyProblem> =
                    conn.rows("PRAGMA foreign_key_check", &[]).await?;
                problems.extend(
                    orphans
                        .into_iter()
                        .map(|o| format!("a {} row refers to a missing {} row", o.table, o.parent)),
                );
                Ok(problems)
            }
        }
    }
}

/// A hardware report with its machine's provider and location.
struct HardwareRow {
    machine_id: Uuid,
    provider: String,
    location: Option<String>,
    report_raw: Vec<u8>,
}

from_columns! {
    HardwareRow { machine_id: get, provider: get, location: get, report_raw: get }
}

impl FromColumns for MachineSummary {
    fn from_columns(r: &impl Columns) -> Result<Self> {
        summary_from_row(r)
    }
}
