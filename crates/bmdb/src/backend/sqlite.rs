//! All SQLite SQL of the BMDB. Every read-then-write transaction starts with `BEGIN IMMEDIATE`
//! on the single writer connection, so claims never race inside one process and take the
//! database write lock up front across processes. Times are integer microseconds (UTC); the
//! transaction's `now` is read once when it begins, like Postgres' `now()`.

use chrono::{DateTime, Utc};
use sqlx::{sqlite::SqliteRow, Row, Sqlite};
use uuid::Uuid;

use super::{ClaimOutcome, EndOutcome, StatusCounts};
use crate::eligibility::{exclusion_list, Retrieval};
use crate::model::*;
use crate::summary::{FleetCounts, MachineSummary};
use crate::Error;

type Result<T> = std::result::Result<T, Error>;

/// A SQLite transaction plus its fixed notion of "now".
pub(crate) struct SqliteTx {
    pub(crate) tx: sqlx::Transaction<'static, Sqlite>,
    pub(crate) now: i64,
}

pub(crate) fn to_us(t: DateTime<Utc>) -> i64 {
    t.timestamp_micros()
}

pub(crate) fn from_us(us: i64) -> Result<DateTime<Utc>> {
    DateTime::from_timestamp_micros(us)
        .ok_or_else(|| Error::InvalidValue(format!("timestamp {us} out of range")))
}

fn secs_us(secs: f64) -> i64 {
    (secs * 1e6).round() as i64
}

pub(crate) async fn schema_version(c: &mut SqliteTx) -> Result<i64> {
    let exists: bool = sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'bmdb_schema_migrations')",
    )
    .fetch_one(&mut *c.tx)
    .await?;
    if !exists {
        return Ok(0);
    }
    let v: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM bmdb_schema_migrations")
        .fetch_one(&mut *c.tx)
        .await?;
    Ok(v.unwrap_or(0))
}

pub(crate) async fn apply_migration(
    c: &mut SqliteTx,
    version: i64,
    name: &str,
    sql: &str,
) -> Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bmdb_schema_migrations (
            version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)",
    )
    .execute(&mut *c.tx)
    .await?;
    sqlx::raw_sql(sql).execute(&mut *c.tx).await?;
    sqlx::query(
        "INSERT INTO bmdb_schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
    )
    .bind(version)
    .bind(name)
    .bind(c.now)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Sessions

pub(crate) async fn create_session(
    c: &mut SqliteTx,
    id: Uuid,
    component: &str,
    runtime_info: &str,
    processor: &str,
    interval_seconds: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO sessions (session_id, component_name, runtime_info, processor, created_at, interval_seconds, deadline)
         VALUES ($1, $2, $3, $4, $5, $6, $5 + $6 * 1000000)",
    )
    .bind(id)
    .bind(component)
    .bind(runtime_info)
    .bind(processor)
    .bind(c.now)
    .bind(interval_seconds)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn poke_session(c: &mut SqliteTx, id: Uuid) -> Result<bool> {
    let r = sqlx::query(
        "UPDATE sessions SET deadline = $2 + interval_seconds * 1000000 WHERE session_id = $1 AND deadline > $2",
    )
    .bind(id)
    .bind(c.now)
    .execute(&mut *c.tx)
    .await?;
    Ok(r.rows_affected() == 1)
}

pub(crate) async fn check_session(c: &mut SqliteTx, id: Uuid) -> Result<bool> {
    let row = sqlx::query("SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > $2")
        .bind(id)
        .bind(c.now)
        .fetch_optional(&mut *c.tx)
        .await?;
    Ok(row.is_some())
}

pub(crate) async fn delete_session(c: &mut SqliteTx, id: Uuid) -> Result<()> {
    sqlx::query(
        "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
         SELECT machine_id, process, 'Canceled', $2, session_id, 'session closed' FROM work WHERE session_id = $1",
    )
    .bind(id)
    .bind(c.now)
    .execute(&mut *c.tx)
    .await?;
    sqlx::query("DELETE FROM sessions WHERE session_id = $1")
        .bind(id)
        .execute(&mut *c.tx)
        .await?;
    Ok(())
}

pub(crate) async fn collect_garbage(c: &mut SqliteTx) -> Result<u64> {
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

fn session_from_row(r: &SqliteRow) -> Result<SessionInfo> {
    Ok(SessionInfo {
        session_id: r.try_get("session_id")?,
        component_name: r.try_get("component_name")?,
        runtime_info: r.try_get("runtime_info")?,
        processor: r.try_get("processor")?,
        created_at: from_us(r.try_get("created_at")?)?,
        interval_seconds: r.try_get("interval_seconds")?,
        deadline: from_us(r.try_get("deadline")?)?,
    })
}

pub(crate) async fn session(c: &mut SqliteTx, id: Uuid) -> Result<Option<SessionInfo>> {
    let row = sqlx::query("SELECT * FROM sessions WHERE session_id = $1")
        .bind(id)
        .fetch_optional(&mut *c.tx)
        .await?;
    row.as_ref().map(session_from_row).transpose()
}

pub(crate) async fn sessions(c: &mut SqliteTx) -> Result<Vec<SessionInfo>> {
    let rows = sqlx::query("SELECT * FROM sessions ORDER BY created_at, session_id")
        .fetch_all(&mut *c.tx)
        .await?;
    rows.iter().map(session_from_row).collect()
}

// ---------------------------------------------------------------------------------------------
// Machines and tags

pub(crate) async fn create_machine(c: &mut SqliteTx, id: Uuid) -> Result<()> {
    sqlx::query("INSERT INTO machines (machine_id, created_at) VALUES ($1, $2)")
        .bind(id)
        .bind(c.now)
        .execute(&mut *c.tx)
        .await?;
    Ok(())
}

pub(crate) async fn machine_exists(c: &mut SqliteTx, id: Uuid) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM machines WHERE machine_id = $1)")
            .bind(id)
            .fetch_one(&mut *c.tx)
            .await?,
    )
}

pub(crate) async fn machine_ids(
    c: &mut SqliteTx,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT machine_id FROM machines WHERE $1 IS NULL OR machine_id > $1 ORDER BY machine_id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(&mut *c.tx)
    .await?)
}

pub(crate) async fn set_provided(c: &mut SqliteTx, id: Uuid, p: &Provided) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_provided (machine_id, provider, provider_id, reservation_id, ip_address, location, status)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (machine_id) DO UPDATE SET provider = excluded.provider,
            provider_id = excluded.provider_id, reservation_id = excluded.reservation_id,
            ip_address = excluded.ip_address, location = excluded.location, status = excluded.status",
    )
    .bind(id)
    .bind(p.provider.as_str())
    .bind(&p.provider_id)
    .bind(&p.reservation_id)
    .bind(&p.ip_address)
    .bind(&p.location)
    .bind(p.status.map(|s| s.as_str()))
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

fn provided_from_row(r: &SqliteRow) -> Result<(Uuid, Provided)> {
    let status: Option<String> = r.try_get("status")?;
    Ok((
        r.try_get("machine_id")?,
        Provided {
            provider: r.try_get::<String, _>("provider")?.parse()?,
            provider_id: r.try_get("provider_id")?,
            reservation_id: r.try_get("reservation_id")?,
            ip_address: r.try_get("ip_address")?,
            location: r.try_get("location")?,
            status: status.map(|s| s.parse()).transpose()?,
        },
    ))
}

pub(crate) async fn provided(c: &mut SqliteTx, id: Uuid) -> Result<Option<Provided>> {
    let row = sqlx::query("SELECT * FROM machine_provided WHERE machine_id = $1")
        .bind(id)
        .fetch_optional(&mut *c.tx)
        .await?;
    Ok(row
        .as_ref()
        .map(provided_from_row)
        .transpose()?
        .map(|(_, p)| p))
}

pub(crate) async fn provided_by(
    c: &mut SqliteTx,
    provider: Provider,
) -> Result<Vec<(Uuid, Provided)>> {
    let rows =
        sqlx::query("SELECT * FROM machine_provided WHERE provider = $1 ORDER BY provider_id")
            .bind(provider.as_str())
            .fetch_all(&mut *c.tx)
            .await?;
    rows.iter().map(provided_from_row).collect()
}

pub(crate) async fn machine_by_provider_id(
    c: &mut SqliteTx,
    provider: Provider,
    provider_id: &str,
) -> Result<Option<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT machine_id FROM machine_provided WHERE provider = $1 AND provider_id = $2",
    )
    .bind(provider.as_str())
    .bind(provider_id)
    .fetch_optional(&mut *c.tx)
    .await?)
}

pub(crate) async fn set_agent_started(
    c: &mut SqliteTx,
    id: Uuid,
    at: Option<DateTime<Utc>>,
    key: &[u8],
) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_agent_started (machine_id, started_at, public_key) VALUES ($1, $2, $3)
         ON CONFLICT (machine_id) DO UPDATE SET started_at = excluded.started_at, public_key = excluded.public_key",
    )
    .bind(id)
    .bind(at.map(to_us).unwrap_or(c.now))
    .bind(key)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn agent_started(c: &mut SqliteTx, id: Uuid) -> Result<Option<AgentStarted>> {
    let row = sqlx::query(
        "SELECT started_at, public_key FROM machine_agent_started WHERE machine_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *c.tx)
    .await?;
    row.map(|r| {
        Ok(AgentStarted {
            started_at: from_us(r.try_get(0)?)?,
            public_key: r.try_get(1)?,
        })
    })
    .transpose()
}

pub(crate) async fn agent_key_matches(c: &mut SqliteTx, id: Uuid, key: &[u8]) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM machine_agent_started WHERE machine_id = $1 AND public_key = $2)",
    )
    .bind(id)
    .bind(key)
    .fetch_one(&mut *c.tx)
    .await?)
}

pub(crate) async fn set_heartbeat(
    c: &mut SqliteTx,
    id: Uuid,
    at: Option<DateTime<Utc>>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at) VALUES ($1, $2)
         ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
    )
    .bind(id)
    .bind(at.map(to_us).unwrap_or(c.now))
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn heartbeat(c: &mut SqliteTx, id: Uuid) -> Result<Option<DateTime<Utc>>> {
    let us: Option<i64> = sqlx::query_scalar(
        "SELECT heartbeat_at FROM machine_agent_heartbeat WHERE machine_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *c.tx)
    .await?;
    us.map(from_us).transpose()
}

pub(crate) async fn set_recovery(c: &mut SqliteTx, id: Uuid, in_a_row: i64) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_recovery (machine_id, rebooted_at, in_a_row) VALUES ($1, $2, $3)
         ON CONFLICT (machine_id) DO UPDATE SET rebooted_at = excluded.rebooted_at, in_a_row = excluded.in_a_row",
    )
    .bind(id)
    .bind(c.now)
    .bind(in_a_row)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn recovery(c: &mut SqliteTx, id: Uuid) -> Result<Option<Recovery>> {
    let row: Option<(i64, i64)> =
        sqlx::query_as("SELECT rebooted_at, in_a_row FROM machine_recovery WHERE machine_id = $1")
            .bind(id)
            .fetch_optional(&mut *c.tx)
            .await?;
    row.map(|(at, in_a_row)| {
        Ok(Recovery {
            rebooted_at: from_us(at)?,
            in_a_row,
        })
    })
    .transpose()
}

pub(crate) async fn set_hardware_report(c: &mut SqliteTx, id: Uuid, raw: &[u8]) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_hardware_report (machine_id, report_raw) VALUES ($1, $2)
         ON CONFLICT (machine_id) DO UPDATE SET report_raw = excluded.report_raw",
    )
    .bind(id)
    .bind(raw)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn hardware_report(c: &mut SqliteTx, id: Uuid) -> Result<Option<Vec<u8>>> {
    Ok(
        sqlx::query_scalar("SELECT report_raw FROM machine_hardware_report WHERE machine_id = $1")
            .bind(id)
            .fetch_optional(&mut *c.tx)
            .await?,
    )
}

pub(crate) async fn set_os_installation_request(
    c: &mut SqliteTx,
    id: Uuid,
    r: &OsInstallationRequest,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_os_installation_request (machine_id, generation, request_raw) VALUES ($1, $2, $3)
         ON CONFLICT (machine_id) DO UPDATE SET generation = excluded.generation, request_raw = excluded.request_raw",
    )
    .bind(id)
    .bind(r.generation)
    .bind(&r.request_raw)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn os_installation_request(
    c: &mut SqliteTx,
    id: Uuid,
) -> Result<Option<OsInstallationRequest>> {
    let row = sqlx::query(
        "SELECT generation, request_raw FROM machine_os_installation_request WHERE machine_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *c.tx)
    .await?;
    row.map(|r| {
        Ok(OsInstallationRequest {
            generation: r.try_get(0)?,
            request_raw: r.try_get(1)?,
        })
    })
    .transpose()
}

pub(crate) async fn set_os_installation_report(
    c: &mut SqliteTx,
    id: Uuid,
    r: &OsInstallationReport,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_os_installation_report (machine_id, generation, result, report_raw) VALUES ($1, $2, $3, $4)
         ON CONFLICT (machine_id) DO UPDATE SET generation = excluded.generation, result = excluded.result,
            report_raw = excluded.report_raw",
    )
    .bind(id)
    .bind(r.generation)
    .bind(r.result.as_str())
    .bind(&r.report_raw)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn os_installation_report(
    c: &mut SqliteTx,
    id: Uuid,
) -> Result<Option<OsInstallationReport>> {
    let row = sqlx::query("SELECT generation, result, report_raw FROM machine_os_installation_report WHERE machine_id = $1")
        .bind(id)
        .fetch_optional(&mut *c.tx)
        .await?;
    row.map(|r| {
        Ok(OsInstallationReport {
            generation: r.try_get(0)?,
            result: r.try_get::<String, _>(1)?.parse()?,
            report_raw: r.try_get(2)?,
        })
    })
    .transpose()
}

pub(crate) async fn pin_ssh_host_key(c: &mut SqliteTx, id: Uuid, key: &str) -> Result<SshHostKey> {
    sqlx::query(
        "INSERT INTO machine_ssh_host_key (machine_id, key, first_seen_at) VALUES ($1, $2, $3)
         ON CONFLICT (machine_id) DO NOTHING",
    )
    .bind(id)
    .bind(key)
    .bind(c.now)
    .execute(&mut *c.tx)
    .await?;
    ssh_host_key(c, id)
        .await?
        .ok_or_else(|| Error::InvalidValue("host key vanished".into()))
}

pub(crate) async fn ssh_host_key(c: &mut SqliteTx, id: Uuid) -> Result<Option<SshHostKey>> {
    let row =
        sqlx::query("SELECT key, first_seen_at FROM machine_ssh_host_key WHERE machine_id = $1")
            .bind(id)
            .fetch_optional(&mut *c.tx)
            .await?;
    row.map(|r| {
        Ok(SshHostKey {
            key: r.try_get(0)?,
            first_seen_at: from_us(r.try_get(1)?)?,
        })
    })
    .transpose()
}

pub(crate) async fn delete_tag(c: &mut SqliteTx, table: &'static str, id: Uuid) -> Result<bool> {
    let r = sqlx::query(&format!("DELETE FROM {table} WHERE machine_id = $1"))
        .bind(id)
        .execute(&mut *c.tx)
        .await?;
    Ok(r.rows_affected() > 0)
}

// ---------------------------------------------------------------------------------------------
// Eligibility (SPEC §5)

/// The WHERE condition over `machine_provided p`. `$first` is now (µs); for recovery,
/// `$first + 1` and `$first + 2` are the two thresholds (µs).
fn eligibility(process: Process, retrieval: &Retrieval, first: usize) -> String {
    let excluded = exclusion_list(process);
    let work = if excluded.is_empty() {
        String::new()
    } else {
        format!(
            "AND NOT EXISTS (SELECT 1 FROM work w WHERE w.machine_id = p.machine_id AND w.process IN ({excluded}))"
        )
    };
    let common = format!(
        "p.provider = '{provider}' {work}
         AND NOT EXISTS (SELECT 1 FROM work_backoff b WHERE b.machine_id = p.machine_id
                         AND b.process = '{process}' AND b.until > ${first})",
        provider = retrieval.provider().as_str(),
        process = process.as_str(),
    );
    match retrieval {
        Retrieval::AgentStart { .. } => format!(
            "NOT EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = p.machine_id)
             AND NOT EXISTS (SELECT 1 FROM machine_os_installation_request r
                             JOIN machine_os_installation_report o ON o.machine_id = r.machine_id
                             WHERE r.machine_id = p.machine_id AND o.generation = r.generation)
             AND {common}"
        ),
        Retrieval::AgentRecovery { .. } => format!(
            "NOT EXISTS (SELECT 1 FROM machine_os_installation_request r
                             JOIN machine_os_installation_report o ON o.machine_id = r.machine_id
                             WHERE r.machine_id = p.machine_id AND o.generation = r.generation
                             AND o.result = 'Success')
             AND EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = p.machine_id AND (
                    (s.started_at < ${first} - ${a}
                     AND NOT EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id))
                 OR EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id
                            AND h.heartbeat_at < ${first} - ${b})))
             AND {common}",
            a = first + 1,
            b = first + 2
        ),
    }
}

fn bind_params<'q, O>(
    q: sqlx::query::QueryAs<'q, Sqlite, O, sqlx::sqlite::SqliteArguments<'q>>,
    now: i64,
    retrieval: &Retrieval,
) -> sqlx::query::QueryAs<'q, Sqlite, O, sqlx::sqlite::SqliteArguments<'q>> {
    let q = q.bind(now);
    match retrieval {
        Retrieval::AgentStart { .. } => q,
        Retrieval::AgentRecovery { thresholds, .. } => q
            .bind(secs_us(thresholds.no_heartbeat_after_start.as_secs_f64()))
            .bind(secs_us(thresholds.heartbeat_older_than.as_secs_f64())),
    }
}

pub(crate) async fn eligible(
    c: &mut SqliteTx,
    process: Process,
    retrieval: &Retrieval,
    limit: i64,
) -> Result<Vec<Uuid>> {
    let sql = format!(
        "SELECT p.machine_id FROM machine_provided p WHERE {} ORDER BY p.machine_id LIMIT $1",
        eligibility(process, retrieval, 2)
    );
    let q = sqlx::query_as::<_, (Uuid,)>(&sql).bind(limit);
    let rows = bind_params(q, c.now, retrieval)
        .fetch_all(&mut *c.tx)
        .await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

pub(crate) async fn count_eligible(
    c: &mut SqliteTx,
    process: Process,
    retrieval: &Retrieval,
) -> Result<i64> {
    let sql = format!(
        "SELECT count(*) FROM machine_provided p WHERE {}",
        eligibility(process, retrieval, 1)
    );
    let q = sqlx::query_as::<_, (i64,)>(&sql);
    Ok(bind_params(q, c.now, retrieval)
        .fetch_one(&mut *c.tx)
        .await?
        .0)
}

pub(crate) async fn count_heartbeating(
    c: &mut SqliteTx,
    provider: Provider,
    fresh_within: std::time::Duration,
) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(h.machine_id) FILTER (WHERE h.heartbeat_at > $2)
         FROM machine_provided p LEFT JOIN machine_agent_heartbeat h ON h.machine_id = p.machine_id
         WHERE p.provider = $1",
    )
    .bind(provider.as_str())
    .bind(c.now - secs_us(fresh_within.as_secs_f64()))
    .fetch_one(&mut *c.tx)
    .await?)
}

// ---------------------------------------------------------------------------------------------
// Work (SPEC §4)

/// Claims the first eligible machine. The transaction holds SQLite's write lock from its
/// first statement (`BEGIN IMMEDIATE`), so there are no concurrent claimers to lose against.
pub(crate) async fn claim(
    c: &mut SqliteTx,
    session: Uuid,
    process: Process,
    retrieval: &Retrieval,
) -> Result<ClaimOutcome> {
    if !check_session(c, session).await? {
        return Ok(ClaimOutcome::SessionExpired);
    }
    let Some(machine_id) = first_eligible_from_random_point(c, process, retrieval).await? else {
        return Ok(ClaimOutcome::Nothing);
    };
    let inserted = sqlx::query(
        "INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3) ON CONFLICT DO NOTHING",
    )
    .bind(machine_id)
    .bind(session)
    .bind(process.as_str())
    .execute(&mut *c.tx)
    .await?;
    if inserted.rows_affected() == 0 {
        return Ok(ClaimOutcome::Conflict);
    }
    sqlx::query("UPDATE machines SET claim_count = claim_count + 1 WHERE machine_id = $1")
        .bind(machine_id)
        .execute(&mut *c.tx)
        .await?;
    sqlx::query(
        "INSERT INTO work_history (machine_id, process, event, at, session_id) VALUES ($1, $2, 'Started', $3, $4)",
    )
    .bind(machine_id)
    .bind(process.as_str())
    .bind(c.now)
    .bind(session)
    .execute(&mut *c.tx)
    .await?;
    let last_interval = sqlx::query_scalar(
        "SELECT last_interval_seconds FROM work_backoff WHERE machine_id = $1 AND process = $2",
    )
    .bind(machine_id)
    .bind(process.as_str())
    .fetch_optional(&mut *c.tx)
    .await?;
    Ok(ClaimOutcome::Claimed {
        machine_id,
        last_interval,
    })
}

/// The first eligible machine at or after a random id, wrapping around. Starting at a random
/// point keeps a claim from re-scanning every machine processed before it (which would make a
/// pass over the fleet quadratic) and spreads retries of failing machines.
async fn first_eligible_from_random_point(
    c: &mut SqliteTx,
    process: Process,
    retrieval: &Retrieval,
) -> Result<Option<Uuid>> {
    let start = Uuid::new_v4();
    for op in [">=", "<"] {
        let sql = format!(
            "SELECT p.machine_id FROM machine_provided p WHERE p.machine_id {op} $1 AND {}
             ORDER BY p.machine_id LIMIT 1",
            eligibility(process, retrieval, 2)
        );
        let q = sqlx::query_as::<_, (Uuid,)>(&sql).bind(start);
        if let Some((id,)) = bind_params(q, c.now, retrieval)
            .fetch_optional(&mut *c.tx)
            .await?
        {
            return Ok(Some(id));
        }
    }
    Ok(None)
}

/// Deletes our work row after checking the session; the common first half of Finish and Fail.
async fn end_work(
    c: &mut SqliteTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<EndOutcome> {
    if !check_session(c, session).await? {
        return Ok(EndOutcome::SessionExpired);
    }
    let r =
        sqlx::query("DELETE FROM work WHERE machine_id = $1 AND process = $2 AND session_id = $3")
            .bind(machine)
            .bind(process.as_str())
            .bind(session)
            .execute(&mut *c.tx)
            .await?;
    Ok(if r.rows_affected() == 1 {
        EndOutcome::Done
    } else {
        EndOutcome::Lost
    })
}

async fn write_history(
    c: &mut SqliteTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
    event: WorkEvent,
    cause: Option<&str>,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause) VALUES ($1, $2, $3, $4, $5, $6)",
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

pub(crate) async fn finish_work(
    c: &mut SqliteTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<EndOutcome> {
    let outcome = end_work(c, session, machine, process).await?;
    if outcome != EndOutcome::Done {
        return Ok(outcome);
    }
    sqlx::query("DELETE FROM work_backoff WHERE machine_id = $1 AND process = $2")
        .bind(machine)
        .bind(process.as_str())
        .execute(&mut *c.tx)
        .await?;
    write_history(c, session, machine, process, WorkEvent::Finished, None).await?;
    Ok(outcome)
}

pub(crate) async fn fail_work(
    c: &mut SqliteTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
    cause: &str,
    interval_seconds: i64,
    delay: std::time::Duration,
) -> Result<EndOutcome> {
    let outcome = end_work(c, session, machine, process).await?;
    if outcome != EndOutcome::Done {
        return Ok(outcome);
    }
    let until = from_us(c.now + secs_us(delay.as_secs_f64()))?;
    set_backoff(c, machine, process, until, interval_seconds, cause).await?;
    write_history(c, session, machine, process, WorkEvent::Failed, Some(cause)).await?;
    Ok(outcome)
}

pub(crate) async fn cancel_work(
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
    if r.rows_affected() == 0 {
        return Ok(false);
    }
    write_history(c, session, machine, process, WorkEvent::Canceled, None).await?;
    Ok(true)
}

// ---------------------------------------------------------------------------------------------
// Inspection

fn history_from_row(r: &SqliteRow) -> Result<HistoryEntry> {
    Ok(HistoryEntry {
        id: r.try_get("id")?,
        machine_id: r.try_get("machine_id")?,
        process: r.try_get::<String, _>("process")?.parse()?,
        event: r.try_get::<String, _>("event")?.parse()?,
        at: from_us(r.try_get("at")?)?,
        session_id: r.try_get("session_id")?,
        cause: r.try_get("failed_cause")?,
    })
}

pub(crate) async fn machine_history(c: &mut SqliteTx, machine: Uuid) -> Result<Vec<HistoryEntry>> {
    let rows = sqlx::query("SELECT * FROM work_history WHERE machine_id = $1 ORDER BY id")
        .bind(machine)
        .fetch_all(&mut *c.tx)
        .await?;
    rows.iter().map(history_from_row).collect()
}

pub(crate) async fn history_after(
    c: &mut SqliteTx,
    after_id: i64,
    limit: i64,
) -> Result<Vec<HistoryEntry>> {
    let rows = sqlx::query("SELECT * FROM work_history WHERE id > $1 ORDER BY id LIMIT $2")
        .bind(after_id)
        .bind(limit)
        .fetch_all(&mut *c.tx)
        .await?;
    rows.iter().map(history_from_row).collect()
}

pub(crate) async fn machine_work(c: &mut SqliteTx, machine: Uuid) -> Result<Vec<ActiveWork>> {
    let rows: Vec<(Uuid, String, Uuid)> = sqlx::query_as(
        "SELECT machine_id, process, session_id FROM work WHERE machine_id = $1 ORDER BY process",
    )
    .bind(machine)
    .fetch_all(&mut *c.tx)
    .await?;
    rows.into_iter()
        .map(|(machine_id, process, session_id)| {
            Ok(ActiveWork {
                machine_id,
                process: process.parse()?,
                session_id,
            })
        })
        .collect()
}

pub(crate) async fn machine_backoffs(c: &mut SqliteTx, machine: Uuid) -> Result<Vec<BackoffEntry>> {
    let rows: Vec<(Uuid, String, i64, String, i64)> = sqlx::query_as(
        "SELECT machine_id, process, until, cause, last_interval_seconds FROM work_backoff
         WHERE machine_id = $1 ORDER BY process",
    )
    .bind(machine)
    .fetch_all(&mut *c.tx)
    .await?;
    rows.into_iter()
        .map(|(machine_id, process, until, cause, last)| {
            Ok(BackoffEntry {
                machine_id,
                process: process.parse()?,
                until: from_us(until)?,
                cause,
                last_interval_seconds: last,
            })
        })
        .collect()
}

/// Parses the names of `(name, count)` rows (processes, providers).
fn parse_counts<T>(rows: Vec<(String, i64)>) -> Result<Vec<(T, i64)>>
where
    T: std::str::FromStr,
    Error: From<T::Err>,
{
    rows.into_iter().map(|(p, n)| Ok((p.parse()?, n))).collect()
}

/// Active work rows and active backoffs, per process.
async fn active_work_counts(
    c: &mut SqliteTx,
) -> Result<(Vec<(Process, i64)>, Vec<(Process, i64)>)> {
    let work =
        sqlx::query_as("SELECT process, count(*) FROM work GROUP BY process ORDER BY process")
            .fetch_all(&mut *c.tx)
            .await?;
    let backoffs = sqlx::query_as(
        "SELECT process, count(*) FROM work_backoff WHERE until > $1 GROUP BY process ORDER BY process",
    )
    .bind(c.now)
    .fetch_all(&mut *c.tx)
    .await?;
    Ok((parse_counts(work)?, parse_counts(backoffs)?))
}

pub(crate) async fn status_counts(c: &mut SqliteTx) -> Result<StatusCounts> {
    let (machines, provided, agent_started, heartbeating, sessions_live, sessions_expired, history_entries):
        (i64, i64, i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM machines), (SELECT count(*) FROM machine_provided),
                (SELECT count(*) FROM machine_agent_started), (SELECT count(*) FROM machine_agent_heartbeat),
                (SELECT count(*) FROM sessions WHERE deadline > $1),
                (SELECT count(*) FROM sessions WHERE deadline <= $1),
                (SELECT count(*) FROM work_history)",
    )
    .bind(c.now)
    .fetch_one(&mut *c.tx)
    .await?;
    let (work, backoffs) = active_work_counts(c).await?;
    Ok(StatusCounts {
        machines,
        provided,
        agent_started,
        heartbeating,
        sessions_live,
        sessions_expired,
        work,
        backoffs,
        history_entries,
    })
}

// ---------------------------------------------------------------------------------------------
// Test support: raw writes that bypass the work protocol, to build fleets in arbitrary states.

#[cfg(feature = "testing")]
pub(crate) async fn insert_work_raw(
    c: &mut SqliteTx,
    machine: Uuid,
    session: Uuid,
    process: Process,
) -> Result<()> {
    sqlx::query("INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3)")
        .bind(machine)
        .bind(session)
        .bind(process.as_str())
        .execute(&mut *c.tx)
        .await?;
    Ok(())
}

pub(crate) async fn set_backoff(
    c: &mut SqliteTx,
    machine: Uuid,
    process: Process,
    until: DateTime<Utc>,
    last: i64,
    cause: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds) VALUES ($1, $2, $3, $5, $4)
         ON CONFLICT (machine_id, process) DO UPDATE SET until = excluded.until, last_interval_seconds = excluded.last_interval_seconds, cause = excluded.cause",
    )
    .bind(machine)
    .bind(process.as_str())
    .bind(to_us(until))
    .bind(last)
    .bind(cause)
    .execute(&mut *c.tx)
    .await?;
    Ok(())
}

pub(crate) async fn clear_backoffs(
    c: &mut SqliteTx,
    machine: Uuid,
    process: Option<Process>,
) -> Result<u64> {
    let done = sqlx::query(
        "DELETE FROM work_backoff WHERE machine_id = $1 AND ($2 IS NULL OR process = $2)",
    )
    .bind(machine)
    .bind(process.map(|p| p.as_str()))
    .execute(&mut *c.tx)
    .await?;
    Ok(done.rows_affected())
}

pub(crate) fn now(c: &SqliteTx) -> Result<DateTime<Utc>> {
    from_us(c.now)
}

// ---------------------------------------------------------------------------------------------
// Operator views: one row per machine, fleet-wide counts.

const SUMMARY_SELECT: &str = "
    SELECT m.machine_id, p.provider, p.provider_id, p.reservation_id, p.ip_address, p.location,
           p.status, a.started_at, h.heartbeat_at,
           (SELECT group_concat(process, ',') FROM (SELECT w.process FROM work w
             WHERE w.machine_id = m.machine_id ORDER BY w.process)) AS work,
           (SELECT max(b.until) FROM work_backoff b
             WHERE b.machine_id = m.machine_id AND b.until > $1) AS backoff_until,
           q.generation AS request_generation, r.generation AS report_generation,
           r.result AS report_result
      FROM machines m
      LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
      LEFT JOIN machine_agent_started a ON a.machine_id = m.machine_id
      LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
      LEFT JOIN machine_os_installation_request q ON q.machine_id = m.machine_id
      LEFT JOIN machine_os_installation_report r ON r.machine_id = m.machine_id";

fn summary_from_row(r: &SqliteRow) -> Result<MachineSummary> {
    let provider: Option<String> = r.try_get("provider")?;
    let provided = match provider {
        Some(_) => Some(provided_from_row(r)?.1),
        None => None,
    };
    let time = |col: &str| -> Result<Option<DateTime<Utc>>> {
        r.try_get::<Option<i64>, _>(col)?.map(from_us).transpose()
    };
    let work: Option<String> = r.try_get("work")?;
    let report_generation: Option<i64> = r.try_get("report_generation")?;
    let report_result: Option<String> = r.try_get("report_result")?;
    Ok(MachineSummary {
        machine_id: r.try_get("machine_id")?,
        provided,
        agent_started_at: time("started_at")?,
        heartbeat_at: time("heartbeat_at")?,
        work: work
            .iter()
            .flat_map(|w| w.split(','))
            .map(|p| p.parse())
            .collect::<Result<_>>()?,
        backoff_until: time("backoff_until")?,
        request_generation: r.try_get("request_generation")?,
        report: match (report_generation, report_result) {
            (Some(g), Some(res)) => Some((g, res.parse()?)),
            _ => None,
        },
    })
}

pub(crate) async fn machine_summaries(
    c: &mut SqliteTx,
    after: Option<Uuid>,
    provider: Option<Provider>,
    limit: i64,
) -> Result<Vec<MachineSummary>> {
    let sql = format!(
        "{SUMMARY_SELECT}
          WHERE ($2 IS NULL OR m.machine_id > $2) AND ($3 IS NULL OR p.provider = $3)
          ORDER BY m.machine_id LIMIT $4"
    );
    let rows = sqlx::query(&sql)
        .bind(c.now)
        .bind(after)
        .bind(provider.map(|p| p.as_str()))
        .bind(limit)
        .fetch_all(&mut *c.tx)
        .await?;
    rows.iter().map(summary_from_row).collect()
}

pub(crate) async fn machine_summary(c: &mut SqliteTx, id: Uuid) -> Result<Option<MachineSummary>> {
    let sql = format!("{SUMMARY_SELECT} WHERE m.machine_id = $2");
    let row = sqlx::query(&sql)
        .bind(c.now)
        .bind(id)
        .fetch_optional(&mut *c.tx)
        .await?;
    row.as_ref().map(summary_from_row).transpose()
}

pub(crate) async fn fleet_counts(c: &mut SqliteTx, stale_after_secs: f64) -> Result<FleetCounts> {
    let fresh_after = c.now - secs_us(stale_after_secs);
    let (machines, agent_started, heartbeating, stale, pending_install, installed): (
        i64,
        i64,
        i64,
        i64,
        i64,
        i64,
    ) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM machines),
                (SELECT count(*) FROM machine_agent_started),
                (SELECT count(*) FROM machine_agent_heartbeat WHERE heartbeat_at > $1),
                (SELECT count(*) FROM machine_agent_heartbeat WHERE heartbeat_at <= $1),
                (SELECT count(*) FROM machine_os_installation_request q
                  WHERE NOT EXISTS (SELECT 1 FROM machine_os_installation_report r
                     WHERE r.machine_id = q.machine_id AND r.generation = q.generation
                       AND r.result = 'Success')),
                (SELECT count(*) FROM machine_os_installation_request q
                  WHERE EXISTS (SELECT 1 FROM machine_os_installation_report r
                     WHERE r.machine_id = q.machine_id AND r.generation = q.generation
                       AND r.result = 'Success'))",
    )
    .bind(fresh_after)
    .fetch_one(&mut *c.tx)
    .await?;
    let provided: Vec<(String, i64)> = sqlx::query_as(
        "SELECT provider, count(*) FROM machine_provided GROUP BY provider ORDER BY provider",
    )
    .fetch_all(&mut *c.tx)
    .await?;
    let (work, backoffs) = active_work_counts(c).await?;
    Ok(FleetCounts {
        machines,
        provided: parse_counts(provided)?,
        agent_started,
        heartbeating,
        stale,
        pending_install,
        installed,
        work,
        backoffs,
    })
}

pub(crate) async fn hardware_reports(
    c: &mut SqliteTx,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<(Uuid, Option<String>, Vec<u8>)>> {
    Ok(sqlx::query_as(
        "SELECT h.machine_id, p.location, h.report_raw FROM machine_hardware_report h
           LEFT JOIN machine_provided p ON p.machine_id = h.machine_id
          WHERE $1 IS NULL OR h.machine_id > $1 ORDER BY h.machine_id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(&mut *c.tx)
    .await?)
}

pub(crate) async fn session_work(c: &mut SqliteTx, session: Uuid) -> Result<Vec<(Uuid, Process)>> {
    let rows: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT machine_id, process FROM work WHERE session_id = $1 ORDER BY machine_id, process",
    )
    .bind(session)
    .fetch_all(&mut *c.tx)
    .await?;
    rows.into_iter().map(|(m, p)| Ok((m, p.parse()?))).collect()
}

/// What SQLite's own checks find wrong: `PRAGMA integrity_check` (pages, indexes, NOT NULL
/// and CHECK constraints) and `PRAGMA foreign_key_check`, as the SQLite linked into this
/// binary sees them (older command-line shells misreport WITHOUT ROWID tables).
pub(crate) async fn integrity_problems(c: &mut SqliteTx) -> Result<Vec<String>> {
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
    problems.extend(
        orphans
            .into_iter()
            .map(|(table, _, parent, _)| format!("a {table} row refers to a missing {parent} row")),
    );
    Ok(problems)
}
