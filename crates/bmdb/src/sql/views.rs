//! Operators' read-only views: one row of tags per machine, fleet-wide counts, the counts of
//! `shepherd bmdb status`, hardware reports, and each engine's own integrity checks.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{from_us, on_engine, parse_counts, Columns, Conn, Dialects, FromColumns, Result};
use crate::model::{Process, Provider};
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

/// The transaction's notion of the current time (the database clock on Postgres).
pub(crate) async fn now(conn: &mut Conn) -> Result<DateTime<Utc>> {
    match conn {
        Conn::Postgres(c) => Ok(sqlx::query_scalar("SELECT now()")
            .fetch_one(&mut **c)
            .await?),
        Conn::Sqlite(c) => from_us(c.now),
    }
}

const STATUS_COUNTS: Dialects = Dialects {
    postgres: "SELECT (SELECT count(*) FROM machines), (SELECT count(*) FROM machine_provided),
                      (SELECT count(*) FROM machine_agent_started),
                      (SELECT count(*) FROM machine_agent_heartbeat),
                      (SELECT count(*) FROM sessions WHERE deadline > now()),
                      (SELECT count(*) FROM sessions WHERE deadline <= now()),
                      (SELECT count(*) FROM work_history)",
    sqlite: "SELECT (SELECT count(*) FROM machines), (SELECT count(*) FROM machine_provided),
                    (SELECT count(*) FROM machine_agent_started),
                    (SELECT count(*) FROM machine_agent_heartbeat),
                    (SELECT count(*) FROM sessions WHERE deadline > $1),
                    (SELECT count(*) FROM sessions WHERE deadline <= $1),
                    (SELECT count(*) FROM work_history)",
};

const ACTIVE_BACKOFFS: Dialects = Dialects {
    postgres: "SELECT process, count(*) FROM work_backoff WHERE until > now()
                GROUP BY process ORDER BY process",
    sqlite: "SELECT process, count(*) FROM work_backoff WHERE until > $1
              GROUP BY process ORDER BY process",
};

/// Active work rows and active backoffs, per process.
async fn active_work_counts(conn: &mut Conn) -> Result<(Vec<(Process, i64)>, Vec<(Process, i64)>)> {
    on_engine!(conn, |c, e| {
        let work =
            sqlx::query_as("SELECT process, count(*) FROM work GROUP BY process ORDER BY process")
                .fetch_all(&mut *c)
                .await?;
        let backoffs = e
            .with_now(sqlx::query_as(e.sql(&ACTIVE_BACKOFFS)))
            .fetch_all(&mut *c)
            .await?;
        Ok((parse_counts(work)?, parse_counts(backoffs)?))
    })
}

pub(crate) async fn status_counts(conn: &mut Conn) -> Result<StatusCounts> {
    type Row = (i64, i64, i64, i64, i64, i64, i64);
    let (machines, provided, agent_started, heartbeating, live, expired, history): Row =
        on_engine!(conn, |c, e| {
            e.with_now(sqlx::query_as(e.sql(&STATUS_COUNTS)))
                .fetch_one(c)
                .await?
        });
    let (work, backoffs) = active_work_counts(conn).await?;
    Ok(StatusCounts {
        machines,
        provided,
        agent_started,
        heartbeating,
        sessions_live: live,
        sessions_expired: expired,
        work,
        backoffs,
        history_entries: history,
    })
}

/// One row of tags per machine; `{now}` is where each engine reads the time.
fn summary_select(now: &str) -> String {
    format!(
        "SELECT m.machine_id, p.provider, p.provider_id, p.reservation_id, p.ip_address,
                p.location, p.status, p.facts, a.started_at, h.heartbeat_at,
                (SELECT string_agg(w.process, ',' ORDER BY w.process) FROM work w
                  WHERE w.machine_id = m.machine_id) AS work,
                (SELECT max(b.until) FROM work_backoff b
                  WHERE b.machine_id = m.machine_id AND b.until > {now}) AS backoff_until,
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
        Some(_) => Some(<(Uuid, crate::Provided)>::from_columns(r)?.1),
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
        request_generation: r.get("request_generation")?,
        report: match (report_generation, report_result) {
            (Some(g), Some(res)) => Some((g, res.parse()?)),
            _ => None,
        },
        maintenance: r.get("maintenance")?,
    })
}

/// The time as [`summary_select`] reads it, after `params` parameters of its own.
fn summary_now(conn: &Conn, params: usize) -> String {
    match conn {
        Conn::Postgres(_) => "now()".into(),
        Conn::Sqlite(_) => format!("${}", params + 1),
    }
}

pub(crate) async fn machine_summaries(
    conn: &mut Conn,
    after: Option<Uuid>,
    provider: Option<Provider>,
    limit: i64,
) -> Result<Vec<MachineSummary>> {
    let sql = format!(
        "{}
          WHERE ($1 IS NULL OR m.machine_id > $1) AND ($2 IS NULL OR p.provider = $2)
          ORDER BY m.machine_id LIMIT $3",
        summary_select(&summary_now(conn, 3))
    );
    on_engine!(conn, |c, e| {
        let q = sqlx::query(&sql)
            .bind(after)
            .bind(provider.map(|p| p.as_str()))
            .bind(limit);
        let rows = e.with_now(q).fetch_all(c).await?;
        rows.iter().map(summary_from_row).collect()
    })
}

pub(crate) async fn machine_summary(conn: &mut Conn, id: Uuid) -> Result<Option<MachineSummary>> {
    let sql = format!(
        "{} WHERE m.machine_id = $1",
        summary_select(&summary_now(conn, 1))
    );
    on_engine!(conn, |c, e| {
        let row = e
            .with_now(sqlx::query(&sql).bind(id))
            .fetch_optional(c)
            .await?;
        row.as_ref().map(summary_from_row).transpose()
    })
}

/// The three installation counts of [`FLEET_COUNTS`], as upstream's statistics count them:
/// requests without a report of their generation (pending), requests with one whatever its
/// result (installed), and of those the ones that report an error (failed).
macro_rules! installation_counts {
    () => {
        "(SELECT count(*) FROM machine_os_installation_request q
           WHERE NOT EXISTS (SELECT 1 FROM machine_os_installation_report r
              WHERE r.machine_id = q.machine_id AND r.generation = q.generation)),
         (SELECT count(*) FROM machine_os_installation_request q
           WHERE EXISTS (SELECT 1 FROM machine_os_installation_report r
              WHERE r.machine_id = q.machine_id AND r.generation = q.generation)),
         (SELECT count(*) FROM machine_os_installation_request q
           WHERE EXISTS (SELECT 1 FROM machine_os_installation_report r
              WHERE r.machine_id = q.machine_id AND r.generation = q.generation
                AND r.result = 'Error'))"
    };
}

const FLEET_COUNTS: Dialects = Dialects {
    postgres: concat!(
        "SELECT (SELECT count(*) FROM machines),
                      (SELECT count(*) FROM machine_maintenance),
                      (SELECT count(*) FROM decommissioned),
                      (SELECT count(*) FROM machine_agent_started),
                      (SELECT count(*) FROM machine_agent_heartbeat
                        WHERE heartbeat_at > now() - make_interval(secs => $1)),
                      (SELECT count(*) FROM machine_agent_heartbeat
                        WHERE heartbeat_at <= now() - make_interval(secs => $1)),
                      ",
        installation_counts!()
    ),
    sqlite: concat!(
        "SELECT (SELECT count(*) FROM machines),
                    (SELECT count(*) FROM machine_maintenance),
                    (SELECT count(*) FROM decommissioned),
                    (SELECT count(*) FROM machine_agent_started),
                    (SELECT count(*) FROM machine_agent_heartbeat WHERE heartbeat_at > $2 - $1),
                    (SELECT count(*) FROM machine_agent_heartbeat WHERE heartbeat_at <= $2 - $1),
                    ",
        installation_counts!()
    ),
};

/// Fleet-wide counts; heartbeats older than `stale_after` count as stale.
pub(crate) async fn fleet_counts(
    conn: &mut Conn,
    stale_after: std::time::Duration,
) -> Result<FleetCounts> {
    type Row = (i64, i64, i64, i64, i64, i64, i64, i64, i64);
    let (
        machines,
        maintenance,
        decommissioned,
        agent_started,
        heartbeating,
        stale,
        pending_install,
        installed,
        install_failed,
    ): Row = on_engine!(conn, |c, e| {
        let q = sqlx::query_as(e.sql(&FLEET_COUNTS)).bind(e.span(stale_after));
        e.with_now(q).fetch_one(c).await?
    });
    let provided: Vec<(String, i64)> = on_engine!(conn, |c, _| {
        sqlx::query_as(
            "SELECT provider, count(*) FROM machine_provided GROUP BY provider ORDER BY provider",
        )
        .fetch_all(c)
        .await?
    });
    let (work, backoffs) = active_work_counts(conn).await?;
    Ok(FleetCounts {
        machines,
        provided: parse_counts(provided)?,
        agent_started,
        heartbeating,
        stale,
        pending_install,
        installed,
        install_failed,
        work,
        backoffs,
        maintenance,
        decommissioned,
    })
}

/// Up to `limit` raw hardware reports of provided machines after machine `after`, with the
/// machine's provider and location (as upstream's statistics, machines without a
/// `machine_provided` tag are not counted).
pub(crate) async fn hardware_reports(
    conn: &mut Conn,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<(Uuid, Provider, Option<String>, Vec<u8>)>> {
    let rows: Vec<(Uuid, String, Option<String>, Vec<u8>)> = on_engine!(conn, |c, _| {
        sqlx::query_as(
            "SELECT h.machine_id, p.provider, p.location, h.report_raw
               FROM machine_hardware_report h
               JOIN machine_provided p ON p.machine_id = h.machine_id
              WHERE $1 IS NULL OR h.machine_id > $1 ORDER BY h.machine_id LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(c)
        .await?
    });
    rows.into_iter()
        .map(|(id, provider, location, raw)| Ok((id, provider.parse()?, location, raw)))
        .collect()
}

/// What the engine's own checks find wrong. Postgres, without scanning tables: constraints
/// left unvalidated and indexes left invalid (a failed concurrent build) in the BMDB's schema.
/// SQLite: `PRAGMA integrity_check` (pages, indexes, NOT NULL and CHECK constraints) and
/// `PRAGMA foreign_key_check`, as the SQLite linked into this binary sees them (older
/// command-line shells misreport WITHOUT ROWID tables).
pub(crate) async fn integrity_problems(conn: &mut Conn) -> Result<Vec<String>> {
    match conn {
        Conn::Postgres(c) => {
            let rows: Vec<(String,)> = sqlx::query_as(
                "SELECT format('constraint %s on %s is not validated', conname, conrelid::regclass)
                   FROM pg_constraint
                  WHERE NOT convalidated AND connamespace = current_schema()::regnamespace
                 UNION ALL
                 SELECT format('index %s is not valid', indexrelid::regclass)
                   FROM pg_index JOIN pg_class ON pg_class.oid = indexrelid
                  WHERE NOT indisvalid AND relnamespace = current_schema()::regnamespace",
            )
            .fetch_all(&mut **c)
            .await?;
            Ok(rows.into_iter().map(|(r,)| r).collect())
        }
        Conn::Sqlite(c) => {
            let rows: Vec<(String,)> = sqlx::query_as("PRAGMA integrity_check")
                .fetch_all(&mut *c.tx)
                .await?;
            let mut problems: Vec<String> = rows
                .into_iter()
                .map(|(r,)| r)
                .filter(|r| r != "ok")
                .collect();
            let orphans: Vec<(String, Option<i64>, String, i64)> =
                sqlx::query_as("PRAGMA foreign_key_check")
                    .fetch_all(&mut *c.tx)
                    .await?;
            problems.extend(orphans.into_iter().map(|(table, _, parent, _)| {
                format!("a {table} row refers to a missing {parent} row")
            }));
            Ok(problems)
        }
    }
}
