//! All PostgreSQL SQL of the BMDB. Transactions run at READ COMMITTED; the server clock
//! (`now()`) is the single source of time so replicas with skewed clocks agree.

use chrono::{DateTime, Utc};
use sqlx::{postgres::PgRow, Acquire, PgConnection, Postgres, Row};
use uuid::Uuid;

use super::{ClaimOutcome, ClaimStrategy, EndOutcome, StatusCounts};
use crate::claim_hints::{ClaimHints, HintKey};
use crate::eligibility::{exclusion_list, Retrieval};
use crate::metrics::{BmdbMetrics, ClaimSearch};
use crate::model::*;
use crate::summary::{FleetCounts, MachineSummary};
use crate::Error;

/// A Postgres transaction as the typed queries use it.
pub(crate) type PgTx = sqlx::Transaction<'static, Postgres>;

type Result<T> = std::result::Result<T, Error>;

/// How many candidates a claim considers before giving up as conflicted.
const CLAIM_CANDIDATES: i64 = 32;

/// Advisory lock key serializing concurrent migrations ("shepherd" in ASCII).
pub(crate) const MIGRATION_LOCK: i64 = 0x7368_6570_6865_7264;

pub(crate) async fn schema_version(c: &mut PgTx) -> Result<i64> {
    let exists: bool =
        sqlx::query_scalar("SELECT to_regclass('bmdb_schema_migrations') IS NOT NULL")
            .fetch_one(&mut **c)
            .await?;
    if !exists {
        return Ok(0);
    }
    let v: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM bmdb_schema_migrations")
        .fetch_one(&mut **c)
        .await?;
    Ok(v.unwrap_or(0))
}

pub(crate) async fn lock_for_migration(c: &mut PgTx) -> Result<()> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut **c)
        .await?;
    Ok(())
}

pub(crate) async fn apply_migration(
    c: &mut PgTx,
    version: i64,
    name: &str,
    sql: &str,
) -> Result<()> {
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS bmdb_schema_migrations (
            version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&mut **c)
    .await?;
    sqlx::raw_sql(sql).execute(&mut **c).await?;
    sqlx::query("INSERT INTO bmdb_schema_migrations (version, name) VALUES ($1, $2)")
        .bind(version)
        .bind(name)
        .execute(&mut **c)
        .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Sessions

pub(crate) async fn create_session(
    c: &mut PgTx,
    id: Uuid,
    component: &str,
    runtime_info: &str,
    processor: &str,
    interval_seconds: i64,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO sessions (session_id, component_name, runtime_info, processor, interval_seconds, deadline)
         VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $5))",
    )
    .bind(id)
    .bind(component)
    .bind(runtime_info)
    .bind(processor)
    .bind(interval_seconds)
    .execute(&mut **c)
    .await?;
    Ok(())
}

/// Extends a live session's deadline; false if it is gone or already past its deadline.
pub(crate) async fn poke_session(c: &mut PgTx, id: Uuid) -> Result<bool> {
    let r = sqlx::query(
        "UPDATE sessions SET deadline = now() + make_interval(secs => interval_seconds)
         WHERE session_id = $1 AND deadline > now()",
    )
    .bind(id)
    .execute(&mut **c)
    .await?;
    Ok(r.rows_affected() == 1)
}

/// An agent heartbeat in one autocommitted statement: session liveness, the agent's key, the
/// heartbeat upsert and the pending installation request. Returns (session alive, key
/// matches, pending request); the heartbeat is written only if both hold.
pub(crate) async fn agent_heartbeat(
    c: &mut PgConnection,
    session: Uuid,
    machine: Uuid,
    key: &[u8],
) -> Result<(bool, bool, Option<Vec<u8>>)> {
    let row = sqlx::query(
        "WITH alive AS (
             SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now() FOR KEY SHARE
         ), authorized AS (
             SELECT 1 FROM machine_agent_started WHERE machine_id = $2 AND public_key = $3
         ), beat AS (
             INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at)
             SELECT $2, now()
             WHERE EXISTS (SELECT 1 FROM alive) AND EXISTS (SELECT 1 FROM authorized)
             ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at
             RETURNING 1
         )
         SELECT EXISTS (SELECT 1 FROM alive), EXISTS (SELECT 1 FROM authorized),
                (SELECT q.request_raw FROM machine_os_installation_request q
                  WHERE q.machine_id = $2
                    AND NOT EXISTS (SELECT 1 FROM machine_os_installation_report r
                                     WHERE r.machine_id = $2 AND r.generation = q.generation)),
                (SELECT count(*) FROM beat)",
    )
    .bind(session)
    .bind(machine)
    .bind(key)
    .fetch_one(&mut *c)
    .await?;
    Ok((row.try_get(0)?, row.try_get(1)?, row.try_get(2)?))
}

/// Whether the session is alive; holds a key-share lock so it cannot be deleted before commit.
pub(crate) async fn check_session(c: &mut PgConnection, id: Uuid) -> Result<bool> {
    let row = sqlx::query(
        "SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now() FOR KEY SHARE",
    )
    .bind(id)
    .fetch_optional(&mut *c)
    .await?;
    Ok(row.is_some())
}

pub(crate) async fn delete_session(c: &mut PgTx, id: Uuid) -> Result<()> {
    sqlx::query(
        "WITH hist AS (
            INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
            SELECT machine_id, process, 'Canceled', now(), session_id, 'session closed'
            FROM work WHERE session_id = $1)
         DELETE FROM sessions WHERE session_id = $1",
    )
    .bind(id)
    .execute(&mut **c)
    .await?;
    Ok(())
}

/// Deletes expired sessions (their work cascades), recording each lost lock as Canceled.
pub(crate) async fn collect_garbage(c: &mut PgTx) -> Result<u64> {
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

fn session_from_row(r: &PgRow) -> Result<SessionInfo> {
    Ok(SessionInfo {
        session_id: r.try_get("session_id")?,
        component_name: r.try_get("component_name")?,
        runtime_info: r.try_get("runtime_info")?,
        processor: r.try_get("processor")?,
        created_at: r.try_get("created_at")?,
        interval_seconds: r.try_get("interval_seconds")?,
        deadline: r.try_get("deadline")?,
    })
}

pub(crate) async fn session(c: &mut PgTx, id: Uuid) -> Result<Option<SessionInfo>> {
    let row = sqlx::query("SELECT * FROM sessions WHERE session_id = $1")
        .bind(id)
        .fetch_optional(&mut **c)
        .await?;
    row.as_ref().map(session_from_row).transpose()
}

pub(crate) async fn sessions(c: &mut PgTx) -> Result<Vec<SessionInfo>> {
    let rows = sqlx::query("SELECT * FROM sessions ORDER BY created_at, session_id")
        .fetch_all(&mut **c)
        .await?;
    rows.iter().map(session_from_row).collect()
}

// ---------------------------------------------------------------------------------------------
// Machines and tags

pub(crate) async fn create_machine(c: &mut PgTx, id: Uuid) -> Result<()> {
    sqlx::query("INSERT INTO machines (machine_id) VALUES ($1)")
        .bind(id)
        .execute(&mut **c)
        .await?;
    Ok(())
}

pub(crate) async fn machine_exists(c: &mut PgTx, id: Uuid) -> Result<bool> {
    Ok(
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM machines WHERE machine_id = $1)")
            .bind(id)
            .fetch_one(&mut **c)
            .await?,
    )
}

pub(crate) async fn machine_ids(
    c: &mut PgTx,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT machine_id FROM machines WHERE $1::uuid IS NULL OR machine_id > $1
         ORDER BY machine_id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(&mut **c)
    .await?)
}

pub(crate) async fn set_provided(c: &mut PgTx, id: Uuid, p: &Provided) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_provided (machine_id, provider, provider_id, reservation_id, ip_address, location, status)
         VALUES ($1, $2, $3, $4, $5, $6, $7)
         ON CONFLICT (machine_id) DO UPDATE SET provider = EXCLUDED.provider,
            provider_id = EXCLUDED.provider_id, reservation_id = EXCLUDED.reservation_id,
            ip_address = EXCLUDED.ip_address, location = EXCLUDED.location, status = EXCLUDED.status",
    )
    .bind(id)
    .bind(p.provider.as_str())
    .bind(&p.provider_id)
    .bind(&p.reservation_id)
    .bind(&p.ip_address)
    .bind(&p.location)
    .bind(p.status.map(|s| s.as_str()))
    .execute(&mut **c)
    .await?;
    Ok(())
}

fn provided_from_row(r: &PgRow) -> Result<(Uuid, Provided)> {
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

pub(crate) async fn provided(c: &mut PgTx, id: Uuid) -> Result<Option<Provided>> {
    let row = sqlx::query("SELECT * FROM machine_provided WHERE machine_id = $1")
        .bind(id)
        .fetch_optional(&mut **c)
        .await?;
    Ok(row
        .as_ref()
        .map(provided_from_row)
        .transpose()?
        .map(|(_, p)| p))
}

pub(crate) async fn provided_by(c: &mut PgTx, provider: Provider) -> Result<Vec<(Uuid, Provided)>> {
    let rows =
        sqlx::query("SELECT * FROM machine_provided WHERE provider = $1 ORDER BY provider_id")
            .bind(provider.as_str())
            .fetch_all(&mut **c)
            .await?;
    rows.iter().map(provided_from_row).collect()
}

pub(crate) async fn machine_by_provider_id(
    c: &mut PgTx,
    provider: Provider,
    provider_id: &str,
) -> Result<Option<Uuid>> {
    Ok(sqlx::query_scalar(
        "SELECT machine_id FROM machine_provided WHERE provider = $1 AND provider_id = $2",
    )
    .bind(provider.as_str())
    .bind(provider_id)
    .fetch_optional(&mut **c)
    .await?)
}

pub(crate) async fn set_agent_started(
    c: &mut PgTx,
    id: Uuid,
    at: Option<DateTime<Utc>>,
    key: &[u8],
) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_agent_started (machine_id, started_at, public_key) VALUES ($1, coalesce($2, now()), $3)
         ON CONFLICT (machine_id) DO UPDATE SET started_at = EXCLUDED.started_at, public_key = EXCLUDED.public_key",
    )
    .bind(id)
    .bind(at)
    .bind(key)
    .execute(&mut **c)
    .await?;
    Ok(())
}

pub(crate) async fn agent_started(c: &mut PgTx, id: Uuid) -> Result<Option<AgentStarted>> {
    let row = sqlx::query(
        "SELECT started_at, public_key FROM machine_agent_started WHERE machine_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut **c)
    .await?;
    row.map(|r| {
        Ok(AgentStarted {
            started_at: r.try_get(0)?,
            public_key: r.try_get(1)?,
        })
    })
    .transpose()
}

pub(crate) async fn agent_key_matches(c: &mut PgTx, id: Uuid, key: &[u8]) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "SELECT EXISTS (SELECT 1 FROM machine_agent_started WHERE machine_id = $1 AND public_key = $2)",
    )
    .bind(id)
    .bind(key)
    .fetch_one(&mut **c)
    .await?)
}

pub(crate) async fn set_heartbeat(c: &mut PgTx, id: Uuid, at: Option<DateTime<Utc>>) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at) VALUES ($1, coalesce($2, now()))
         ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = EXCLUDED.heartbeat_at",
    )
    .bind(id)
    .bind(at)
    .execute(&mut **c)
    .await?;
    Ok(())
}

pub(crate) async fn heartbeat(c: &mut PgTx, id: Uuid) -> Result<Option<DateTime<Utc>>> {
    Ok(
        sqlx::query_scalar(
            "SELECT heartbeat_at FROM machine_agent_heartbeat WHERE machine_id = $1",
        )
        .bind(id)
        .fetch_optional(&mut **c)
        .await?,
    )
}

pub(crate) async fn set_recovery(c: &mut PgTx, id: Uuid, in_a_row: i64) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_recovery (machine_id, rebooted_at, in_a_row) VALUES ($1, now(), $2)
         ON CONFLICT (machine_id) DO UPDATE SET rebooted_at = EXCLUDED.rebooted_at, in_a_row = EXCLUDED.in_a_row",
    )
    .bind(id)
    .bind(i32::try_from(in_a_row).unwrap_or(i32::MAX))
    .execute(&mut **c)
    .await?;
    Ok(())
}

pub(crate) async fn recovery(c: &mut PgTx, id: Uuid) -> Result<Option<Recovery>> {
    let row: Option<(DateTime<Utc>, i32)> =
        sqlx::query_as("SELECT rebooted_at, in_a_row FROM machine_recovery WHERE machine_id = $1")
            .bind(id)
            .fetch_optional(&mut **c)
            .await?;
    Ok(row.map(|(rebooted_at, in_a_row)| Recovery {
        rebooted_at,
        in_a_row: in_a_row.into(),
    }))
}

pub(crate) async fn set_hardware_report(c: &mut PgTx, id: Uuid, raw: &[u8]) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_hardware_report (machine_id, report_raw) VALUES ($1, $2)
         ON CONFLICT (machine_id) DO UPDATE SET report_raw = EXCLUDED.report_raw",
    )
    .bind(id)
    .bind(raw)
    .execute(&mut **c)
    .await?;
    Ok(())
}

pub(crate) async fn hardware_report(c: &mut PgTx, id: Uuid) -> Result<Option<Vec<u8>>> {
    Ok(
        sqlx::query_scalar("SELECT report_raw FROM machine_hardware_report WHERE machine_id = $1")
            .bind(id)
            .fetch_optional(&mut **c)
            .await?,
    )
}

pub(crate) async fn set_os_installation_request(
    c: &mut PgTx,
    id: Uuid,
    r: &OsInstallationRequest,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_os_installation_request (machine_id, generation, request_raw) VALUES ($1, $2, $3)
         ON CONFLICT (machine_id) DO UPDATE SET generation = EXCLUDED.generation, request_raw = EXCLUDED.request_raw",
    )
    .bind(id)
    .bind(r.generation)
    .bind(&r.request_raw)
    .execute(&mut **c)
    .await?;
    Ok(())
}

pub(crate) async fn os_installation_request(
    c: &mut PgTx,
    id: Uuid,
) -> Result<Option<OsInstallationRequest>> {
    let row = sqlx::query(
        "SELECT generation, request_raw FROM machine_os_installation_request WHERE machine_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut **c)
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
    c: &mut PgTx,
    id: Uuid,
    r: &OsInstallationReport,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO machine_os_installation_report (machine_id, generation, result, report_raw) VALUES ($1, $2, $3, $4)
         ON CONFLICT (machine_id) DO UPDATE SET generation = EXCLUDED.generation, result = EXCLUDED.result,
            report_raw = EXCLUDED.report_raw",
    )
    .bind(id)
    .bind(r.generation)
    .bind(r.result.as_str())
    .bind(&r.report_raw)
    .execute(&mut **c)
    .await?;
    Ok(())
}

pub(crate) async fn os_installation_report(
    c: &mut PgTx,
    id: Uuid,
) -> Result<Option<OsInstallationReport>> {
    let row = sqlx::query("SELECT generation, result, report_raw FROM machine_os_installation_report WHERE machine_id = $1")
        .bind(id)
        .fetch_optional(&mut **c)
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

pub(crate) async fn pin_ssh_host_key(c: &mut PgTx, id: Uuid, key: &str) -> Result<SshHostKey> {
    sqlx::query(
        "INSERT INTO machine_ssh_host_key (machine_id, key, first_seen_at) VALUES ($1, $2, now())
         ON CONFLICT (machine_id) DO NOTHING",
    )
    .bind(id)
    .bind(key)
    .execute(&mut **c)
    .await?;
    ssh_host_key(c, id)
        .await?
        .ok_or_else(|| Error::InvalidValue("host key vanished".into()))
}

pub(crate) async fn ssh_host_key(c: &mut PgTx, id: Uuid) -> Result<Option<SshHostKey>> {
    let row =
        sqlx::query("SELECT key, first_seen_at FROM machine_ssh_host_key WHERE machine_id = $1")
            .bind(id)
            .fetch_optional(&mut **c)
            .await?;
    row.map(|r| {
        Ok(SshHostKey {
            key: r.try_get(0)?,
            first_seen_at: r.try_get(1)?,
        })
    })
    .transpose()
}

/// Deletes one tag row; `table` is one of the fixed tag table names chosen by the caller.
pub(crate) async fn delete_tag(c: &mut PgTx, table: &'static str, id: Uuid) -> Result<bool> {
    let r = sqlx::query(&format!("DELETE FROM {table} WHERE machine_id = $1"))
        .bind(id)
        .execute(&mut **c)
        .await?;
    Ok(r.rows_affected() > 0)
}

// ---------------------------------------------------------------------------------------------
// Eligibility (SPEC §5)

/// How the `EXISTS` checks of an eligibility condition are planned.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Each check stays a per-row index probe (`OFFSET 0` keeps Postgres from flattening it into
    /// a join). For queries that stop after a few rows: claims and limited listings. Without it
    /// the planner may pick merge anti-joins that read every started machine per claim.
    Probe,
    /// Checks may become hash or merge anti-joins. For queries that read every machine: counts.
    Join,
}

/// The WHERE condition over `machine_provided p` for `process` claiming by `retrieval`.
/// Threshold parameters are `$first` and `$first + 1`.
fn eligibility(process: Process, retrieval: &Retrieval, first: usize, shape: Shape) -> String {
    let fence = if shape == Shape::Probe {
        " OFFSET 0"
    } else {
        ""
    };
    let excluded = exclusion_list(process);
    let work = if excluded.is_empty() {
        String::new()
    } else {
        format!(
            "AND NOT EXISTS (SELECT 1 FROM work w WHERE w.machine_id = p.machine_id AND w.process IN ({excluded}){fence})"
        )
    };
    let common = format!(
        "p.provider = '{provider}' {work}
         AND NOT EXISTS (SELECT 1 FROM work_backoff b WHERE b.machine_id = p.machine_id
                         AND b.process = '{process}' AND b.until > now(){fence})",
        provider = retrieval.provider().as_str(),
        process = process.as_str(),
    );
    match retrieval {
        Retrieval::AgentStart { .. } => format!(
            "NOT EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = p.machine_id{fence})
             AND NOT EXISTS (SELECT 1 FROM machine_os_installation_request r
                             JOIN machine_os_installation_report o ON o.machine_id = r.machine_id
                             WHERE r.machine_id = p.machine_id AND o.generation = r.generation{fence})
             AND {common}"
        ),
        Retrieval::AgentRecovery { .. } => format!(
            "NOT EXISTS (SELECT 1 FROM machine_os_installation_request r
                             JOIN machine_os_installation_report o ON o.machine_id = r.machine_id
                             WHERE r.machine_id = p.machine_id AND o.generation = r.generation
                             AND o.result = 'Success'{fence})
             AND EXISTS (SELECT 1 FROM machine_agent_started s WHERE s.machine_id = p.machine_id AND (
                    (s.started_at < now() - make_interval(secs => ${first}::float8)
                     AND NOT EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id{fence}))
                 OR EXISTS (SELECT 1 FROM machine_agent_heartbeat h WHERE h.machine_id = p.machine_id
                            AND h.heartbeat_at < now() - make_interval(secs => ${second}::float8){fence})){fence})
             AND {common}",
            second = first + 1
        ),
    }
}

fn bind_thresholds<'q, O>(
    q: sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments>,
    retrieval: &Retrieval,
) -> sqlx::query::QueryAs<'q, Postgres, O, sqlx::postgres::PgArguments> {
    match retrieval {
        Retrieval::AgentStart { .. } => q,
        Retrieval::AgentRecovery { thresholds, .. } => q
            .bind(thresholds.no_heartbeat_after_start.as_secs_f64())
            .bind(thresholds.heartbeat_older_than.as_secs_f64()),
    }
}

pub(crate) async fn eligible(
    c: &mut PgConnection,
    process: Process,
    retrieval: &Retrieval,
    limit: i64,
) -> Result<Vec<Uuid>> {
    let sql = format!(
        "SELECT p.machine_id FROM machine_provided p WHERE {} ORDER BY p.machine_id LIMIT $1",
        eligibility(process, retrieval, 2, Shape::Probe)
    );
    let q = sqlx::query_as::<_, (Uuid,)>(&sql).bind(limit);
    let rows = bind_thresholds(q, retrieval).fetch_all(&mut *c).await?;
    Ok(rows.into_iter().map(|(id,)| id).collect())
}

pub(crate) async fn count_eligible(
    c: &mut PgTx,
    process: Process,
    retrieval: &Retrieval,
) -> Result<i64> {
    let sql = format!(
        "SELECT count(*) FROM machine_provided p WHERE {}",
        eligibility(process, retrieval, 1, Shape::Join)
    );
    let q = sqlx::query_as::<_, (i64,)>(&sql);
    Ok(bind_thresholds(q, retrieval).fetch_one(&mut **c).await?.0)
}

pub(crate) async fn count_heartbeating(
    c: &mut PgTx,
    provider: Provider,
    fresh_within: std::time::Duration,
) -> Result<(i64, i64)> {
    Ok(sqlx::query_as(
        "SELECT count(*), count(h.machine_id) FILTER (WHERE h.heartbeat_at > now() - make_interval(secs => $2))
         FROM machine_provided p LEFT JOIN machine_agent_heartbeat h ON h.machine_id = p.machine_id
         WHERE p.provider = $1",
    )
    .bind(provider.as_str())
    .bind(fresh_within.as_secs_f64())
    .fetch_one(&mut **c)
    .await?)
}

// ---------------------------------------------------------------------------------------------
// Work (SPEC §4)

/// Claims one eligible machine for `process` with autocommitted statements, cheapest search
/// first. Leftover candidates of an earlier full search (`hints`) are checked first; then a
/// small window of the id index after a random point, checking each machine with index
/// probes: cheap when eligible machines are common, and it spreads parallel claimers over the
/// fleet. If neither yields a machine to lock, the last statement searches the whole provider
/// (wrapping around) with a join-shaped query the planner can run as an anti-join, which stays
/// cheap when eligible machines are rare or absent, and leaves its other candidates as hints.
pub(crate) async fn claim(
    conn: &mut PgConnection,
    session: Uuid,
    process: Process,
    retrieval: &Retrieval,
    strategy: ClaimStrategy,
    shared: &ClaimShared<'_>,
) -> Result<ClaimOutcome> {
    if strategy == ClaimStrategy::UpstreamFirstRow {
        let mut tx = conn.begin().await?;
        let outcome = claim_upstream(&mut tx, session, process, retrieval).await?;
        if matches!(outcome, ClaimOutcome::Claimed { .. }) {
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        return Ok(outcome);
    }
    let key = HintKey::new(process, retrieval);
    let hints = shared.hints;
    let hinted = hints.take(key, HINTS_PER_CLAIM);
    if !hinted.is_empty() {
        let (outcome, unused) = claim_statement(
            conn,
            session,
            process,
            retrieval,
            shared,
            Search::Given(hinted),
        )
        .await?;
        hints.give_back(key, unused);
        if !matches!(outcome, ClaimOutcome::Nothing | ClaimOutcome::Conflict) {
            return Ok(outcome);
        }
    }
    let start = Uuid::new_v4();
    let (outcome, _) = claim_statement(
        conn,
        session,
        process,
        retrieval,
        shared,
        Search::Window(start),
    )
    .await?;
    if !matches!(outcome, ClaimOutcome::Nothing | ClaimOutcome::Conflict) {
        return Ok(outcome);
    }
    let (outcome, leftovers) = claim_statement(
        conn,
        session,
        process,
        retrieval,
        shared,
        Search::Everywhere(start),
    )
    .await?;
    match outcome {
        ClaimOutcome::Nothing => hints.clear(key),
        _ => hints.replace(key, leftovers),
    }
    Ok(outcome)
}

/// What every claim of one `Bmdb` handle shares: leftover candidates and the metrics.
pub(crate) struct ClaimShared<'a> {
    pub(crate) hints: &'a ClaimHints,
    pub(crate) metrics: &'a BmdbMetrics,
    pub(crate) processor: Processor,
}

/// Where a claim statement looks for candidates.
enum Search {
    /// Leftover candidates of an earlier full search.
    Given(Vec<Uuid>),
    /// The next `CLAIM_WINDOW` machines of the provider at or after the start point.
    Window(Uuid),
    /// Every machine of the provider, from the start point, wrapping around.
    Everywhere(Uuid),
}

impl Search {
    /// The `search` label of the claim search metric.
    fn label(&self) -> ClaimSearch {
        match self {
            Search::Given(_) => ClaimSearch::Hinted,
            Search::Window(_) => ClaimSearch::Window,
            Search::Everywhere(_) => ClaimSearch::Everywhere,
        }
    }

    /// Candidates the statement considers at most; a full search keeps its extra ones as hints.
    fn limit(&self) -> i64 {
        match self {
            Search::Given(_) | Search::Window(_) => CLAIM_CANDIDATES,
            Search::Everywhere(_) => CLAIM_HINTS,
        }
    }
}

/// Index entries the window search looks at.
const CLAIM_WINDOW: i64 = 64;

/// Candidates a full search collects: one is claimed, the rest become hints.
const CLAIM_HINTS: i64 = 256;

/// Hints one claim checks. Few, so parallel claimers check different ones; those still
/// eligible but not claimed go back to the list.
const HINTS_PER_CLAIM: usize = 8;

/// One claim statement: live-session check; candidates evaluated lazily until one locks; a
/// `SKIP LOCKED` row lock that also skips machines claimed since our snapshot (their
/// `claim_count` moved on, and READ COMMITTED re-checks the condition against the newest
/// version of the locked row while `seen` keeps the snapshot's); the lock insert (a lost race
/// yields no row instead of an error); Started history; the previous backoff interval. Also
/// returns, for a full or hinted search, the eligible candidates it did not lock.
async fn claim_statement(
    conn: &mut PgConnection,
    session: Uuid,
    process: Process,
    retrieval: &Retrieval,
    shared: &ClaimShared<'_>,
    search: Search,
) -> Result<(ClaimOutcome, Vec<Uuid>)> {
    let provider = retrieval.provider().as_str();
    let limit = search.limit();
    let candidates = match &search {
        Search::Given(_) => {
            let cond = eligibility(process, retrieval, 4, Shape::Probe);
            format!(
                "SELECT p.machine_id FROM machine_provided p
                 WHERE p.machine_id = ANY($2::uuid[]) AND {cond} ORDER BY p.machine_id LIMIT $3"
            )
        }
        Search::Window(_) => {
            let cond = eligibility(process, retrieval, 4, Shape::Probe);
            format!(
                "SELECT p.machine_id FROM (
                    SELECT * FROM machine_provided WHERE provider = '{provider}' AND machine_id >= $2
                    ORDER BY machine_id LIMIT {CLAIM_WINDOW}) p
                 WHERE {cond} ORDER BY p.machine_id LIMIT $3"
            )
        }
        Search::Everywhere(_) => {
            let cond = eligibility(process, retrieval, 4, Shape::Join);
            format!(
                "(SELECT p.machine_id FROM machine_provided p
                  WHERE p.machine_id >= $2 AND {cond} ORDER BY p.machine_id LIMIT $3)
                 UNION ALL
                 (SELECT p.machine_id FROM machine_provided p
                  WHERE p.machine_id < $2 AND {cond} ORDER BY p.machine_id LIMIT $3)
                 LIMIT $3"
            )
        }
    };
    let leftovers = match search {
        Search::Window(_) => "NULL::uuid[]",
        Search::Given(_) | Search::Everywhere(_) => {
            "(SELECT array_agg(machine_id) FROM cand
              WHERE machine_id NOT IN (SELECT machine_id FROM locked))"
        }
    };
    let proc = process.as_str();
    let sql = format!(
        "WITH sess AS (
            SELECT session_id FROM sessions WHERE session_id = $1 AND deadline > now()),
         cand AS ({candidates}),
         locked AS (
            SELECT m.machine_id FROM cand
            JOIN machines seen ON seen.machine_id = cand.machine_id
            JOIN machines m ON m.machine_id = cand.machine_id
            WHERE m.claim_count = seen.claim_count AND EXISTS (SELECT 1 FROM sess)
            LIMIT 1 FOR NO KEY UPDATE OF m SKIP LOCKED),
         ins AS (
            INSERT INTO work (machine_id, session_id, process)
            SELECT machine_id, $1, '{proc}' FROM locked
            ON CONFLICT DO NOTHING RETURNING machine_id),
         bump AS (
            UPDATE machines SET claim_count = claim_count + 1
            WHERE machine_id IN (SELECT machine_id FROM ins)),
         hist AS (
            INSERT INTO work_history (machine_id, process, event, at, session_id)
            SELECT machine_id, '{proc}', 'Started', now(), $1 FROM ins)
         SELECT EXISTS (SELECT 1 FROM sess),
                EXISTS (SELECT 1 FROM locked),
                (SELECT machine_id FROM ins),
                (SELECT b.last_interval_seconds FROM work_backoff b JOIN ins ON b.machine_id = ins.machine_id
                 WHERE b.process = '{proc}'),
                CASE WHEN EXISTS (SELECT 1 FROM locked) THEN 0 ELSE (SELECT count(*) FROM cand) END,
                {leftovers}"
    );
    type ClaimRow = (
        bool,
        bool,
        Option<Uuid>,
        Option<i64>,
        i64,
        Option<Vec<Uuid>>,
    );
    let label = search.label();
    let q = sqlx::query_as::<_, ClaimRow>(&sql).bind(session);
    let q = match search {
        Search::Given(ids) => q.bind(ids),
        Search::Window(start) | Search::Everywhere(start) => q.bind(start),
    };
    let row = bind_thresholds(q.bind(limit), retrieval)
        .fetch_one(&mut *conn)
        .await;
    let (session_ok, locked, machine, last_interval, candidates, leftovers) = match row {
        // The session row was deleted (garbage-collected) after our snapshot saw it alive: the
        // lock insert's foreign key check, which key-share locks the session, refused it.
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("23503") => {
            return Ok((ClaimOutcome::SessionExpired, Vec::new()))
        }
        other => other?,
    };
    let outcome = match machine {
        Some(machine_id) => ClaimOutcome::Claimed {
            machine_id,
            last_interval,
        },
        None if !session_ok => ClaimOutcome::SessionExpired,
        // Locked a row but the unique lock said no: the constraint backstop caught a race.
        None if locked => ClaimOutcome::Conflict,
        // Every candidate we saw is being or has been claimed by others. If the search was cut
        // at the candidate limit, more may lie beyond it; otherwise nothing is left for us.
        None if candidates >= limit => ClaimOutcome::Conflict,
        None => ClaimOutcome::Nothing,
    };
    let claimed = matches!(outcome, ClaimOutcome::Claimed { .. });
    shared
        .metrics
        .claim_search(shared.processor, process, label, claimed);
    Ok((outcome, leftovers.unwrap_or_default()))
}

/// Upstream's claim shape, kept only as a benchmark baseline: first eligible row, plain insert,
/// and a unique violation as the conflict signal.
async fn claim_upstream(
    c: &mut PgConnection,
    session: Uuid,
    process: Process,
    retrieval: &Retrieval,
) -> Result<ClaimOutcome> {
    if !check_session(c, session).await? {
        return Ok(ClaimOutcome::SessionExpired);
    }
    let ids = eligible(c, process, retrieval, 1).await?;
    let Some(machine_id) = ids.first().copied() else {
        return Ok(ClaimOutcome::Nothing);
    };
    let inserted =
        sqlx::query("INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3)")
            .bind(machine_id)
            .bind(session)
            .bind(process.as_str())
            .execute(&mut *c)
            .await;
    match inserted {
        Ok(_) => {}
        Err(e) if e.as_database_error().and_then(|d| d.code()).as_deref() == Some("23505") => {
            return Ok(ClaimOutcome::Conflict)
        }
        Err(e) => return Err(e.into()),
    }
    sqlx::query(
        "INSERT INTO work_history (machine_id, process, event, at, session_id) VALUES ($1, $2, 'Started', now(), $3)",
    )
    .bind(machine_id)
    .bind(process.as_str())
    .bind(session)
    .execute(&mut *c)
    .await?;
    let last_interval = sqlx::query_scalar(
        "SELECT last_interval_seconds FROM work_backoff WHERE machine_id = $1 AND process = $2",
    )
    .bind(machine_id)
    .bind(process.as_str())
    .fetch_optional(&mut *c)
    .await?;
    Ok(ClaimOutcome::Claimed {
        machine_id,
        last_interval,
    })
}

fn end_outcome(session_ok: bool, deleted: bool) -> EndOutcome {
    if !session_ok {
        EndOutcome::SessionExpired
    } else if !deleted {
        EndOutcome::Lost
    } else {
        EndOutcome::Done
    }
}

// Finish and Fail need no lock on the session row: our work row is the lock. If garbage
// collection deleted it first, `del` is empty and the work is reported lost; if we delete it
// first, the collector's cascade waits for our commit.

pub(crate) async fn finish_work(
    c: &mut PgTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<EndOutcome> {
    let (session_ok, deleted): (bool, bool) = sqlx::query_as(
        "WITH sess AS (
            SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now()),
         del AS (
            DELETE FROM work WHERE machine_id = $2 AND process = $3 AND session_id = $1
            AND EXISTS (SELECT 1 FROM sess) RETURNING machine_id),
         bo AS (
            DELETE FROM work_backoff WHERE process = $3 AND machine_id IN (SELECT machine_id FROM del)),
         hist AS (
            INSERT INTO work_history (machine_id, process, event, at, session_id)
            SELECT machine_id, $3, 'Finished', now(), $1 FROM del)
         SELECT EXISTS (SELECT 1 FROM sess), EXISTS (SELECT 1 FROM del)",
    )
    .bind(session)
    .bind(machine)
    .bind(process.as_str())
    .fetch_one(&mut **c)
    .await?;
    Ok(end_outcome(session_ok, deleted))
}

pub(crate) async fn fail_work(
    c: &mut PgTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
    cause: &str,
    interval_seconds: i64,
    delay: std::time::Duration,
) -> Result<EndOutcome> {
    let (session_ok, deleted): (bool, bool) = sqlx::query_as(
        "WITH sess AS (
            SELECT 1 FROM sessions WHERE session_id = $1 AND deadline > now()),
         del AS (
            DELETE FROM work WHERE machine_id = $2 AND process = $3 AND session_id = $1
            AND EXISTS (SELECT 1 FROM sess) RETURNING machine_id),
         bo AS (
            INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds)
            SELECT machine_id, $3, now() + make_interval(secs => $5), $4, $6 FROM del
            ON CONFLICT (machine_id, process) DO UPDATE SET until = EXCLUDED.until,
                cause = EXCLUDED.cause, last_interval_seconds = EXCLUDED.last_interval_seconds),
         hist AS (
            INSERT INTO work_history (machine_id, process, event, at, session_id, failed_cause)
            SELECT machine_id, $3, 'Failed', now(), $1, $4 FROM del)
         SELECT EXISTS (SELECT 1 FROM sess), EXISTS (SELECT 1 FROM del)",
    )
    .bind(session)
    .bind(machine)
    .bind(process.as_str())
    .bind(cause)
    .bind(delay.as_secs_f64())
    .bind(interval_seconds)
    .fetch_one(&mut **c)
    .await?;
    Ok(end_outcome(session_ok, deleted))
}

pub(crate) async fn cancel_work(
    c: &mut PgTx,
    session: Uuid,
    machine: Uuid,
    process: Process,
) -> Result<bool> {
    Ok(sqlx::query_scalar(
        "WITH del AS (
            DELETE FROM work WHERE machine_id = $2 AND process = $3 AND session_id = $1 RETURNING machine_id),
         hist AS (
            INSERT INTO work_history (machine_id, process, event, at, session_id)
            SELECT machine_id, $3, 'Canceled', now(), $1 FROM del)
         SELECT EXISTS (SELECT 1 FROM del)",
    )
    .bind(session)
    .bind(machine)
    .bind(process.as_str())
    .fetch_one(&mut **c)
    .await?)
}

// ---------------------------------------------------------------------------------------------
// Inspection

fn history_from_row(r: &PgRow) -> Result<HistoryEntry> {
    Ok(HistoryEntry {
        id: r.try_get("id")?,
        machine_id: r.try_get("machine_id")?,
        process: r.try_get::<String, _>("process")?.parse()?,
        event: r.try_get::<String, _>("event")?.parse()?,
        at: r.try_get("at")?,
        session_id: r.try_get("session_id")?,
        cause: r.try_get("failed_cause")?,
    })
}

pub(crate) async fn machine_history(c: &mut PgTx, machine: Uuid) -> Result<Vec<HistoryEntry>> {
    let rows = sqlx::query("SELECT * FROM work_history WHERE machine_id = $1 ORDER BY id")
        .bind(machine)
        .fetch_all(&mut **c)
        .await?;
    rows.iter().map(history_from_row).collect()
}

pub(crate) async fn history_after(
    c: &mut PgTx,
    after_id: i64,
    limit: i64,
) -> Result<Vec<HistoryEntry>> {
    let rows = sqlx::query("SELECT * FROM work_history WHERE id > $1 ORDER BY id LIMIT $2")
        .bind(after_id)
        .bind(limit)
        .fetch_all(&mut **c)
        .await?;
    rows.iter().map(history_from_row).collect()
}

pub(crate) async fn machine_work(c: &mut PgTx, machine: Uuid) -> Result<Vec<ActiveWork>> {
    let rows: Vec<(Uuid, String, Uuid)> = sqlx::query_as(
        "SELECT machine_id, process, session_id FROM work WHERE machine_id = $1 ORDER BY process",
    )
    .bind(machine)
    .fetch_all(&mut **c)
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

pub(crate) async fn machine_backoffs(c: &mut PgTx, machine: Uuid) -> Result<Vec<BackoffEntry>> {
    let rows: Vec<(Uuid, String, DateTime<Utc>, String, i64)> = sqlx::query_as(
        "SELECT machine_id, process, until, cause, last_interval_seconds FROM work_backoff
         WHERE machine_id = $1 ORDER BY process",
    )
    .bind(machine)
    .fetch_all(&mut **c)
    .await?;
    rows.into_iter()
        .map(|(machine_id, process, until, cause, last)| {
            Ok(BackoffEntry {
                machine_id,
                process: process.parse()?,
                until,
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
async fn active_work_counts(c: &mut PgTx) -> Result<(Vec<(Process, i64)>, Vec<(Process, i64)>)> {
    let work =
        sqlx::query_as("SELECT process, count(*) FROM work GROUP BY process ORDER BY process")
            .fetch_all(&mut **c)
            .await?;
    let backoffs = sqlx::query_as(
        "SELECT process, count(*) FROM work_backoff WHERE until > now() GROUP BY process ORDER BY process",
    )
    .fetch_all(&mut **c)
    .await?;
    Ok((parse_counts(work)?, parse_counts(backoffs)?))
}

pub(crate) async fn status_counts(c: &mut PgTx) -> Result<StatusCounts> {
    let (machines, provided, agent_started, heartbeating, sessions_live, sessions_expired, history_entries):
        (i64, i64, i64, i64, i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM machines), (SELECT count(*) FROM machine_provided),
                (SELECT count(*) FROM machine_agent_started), (SELECT count(*) FROM machine_agent_heartbeat),
                (SELECT count(*) FROM sessions WHERE deadline > now()),
                (SELECT count(*) FROM sessions WHERE deadline <= now()),
                (SELECT count(*) FROM work_history)",
    )
    .fetch_one(&mut **c)
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
    c: &mut PgTx,
    machine: Uuid,
    session: Uuid,
    process: Process,
) -> Result<()> {
    sqlx::query("INSERT INTO work (machine_id, session_id, process) VALUES ($1, $2, $3)")
        .bind(machine)
        .bind(session)
        .bind(process.as_str())
        .execute(&mut **c)
        .await?;
    Ok(())
}

pub(crate) async fn set_backoff(
    c: &mut PgTx,
    machine: Uuid,
    process: Process,
    until: DateTime<Utc>,
    last: i64,
    cause: &str,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO work_backoff (machine_id, process, until, cause, last_interval_seconds) VALUES ($1, $2, $3, $5, $4)
         ON CONFLICT (machine_id, process) DO UPDATE SET until = EXCLUDED.until, last_interval_seconds = EXCLUDED.last_interval_seconds, cause = EXCLUDED.cause",
    )
    .bind(machine)
    .bind(process.as_str())
    .bind(until)
    .bind(last)
    .bind(cause)
    .execute(&mut **c)
    .await?;
    Ok(())
}

pub(crate) async fn clear_backoffs(
    c: &mut PgTx,
    machine: Uuid,
    process: Option<Process>,
) -> Result<u64> {
    let done = sqlx::query(
        "DELETE FROM work_backoff WHERE machine_id = $1 AND ($2::text IS NULL OR process = $2)",
    )
    .bind(machine)
    .bind(process.map(|p| p.as_str()))
    .execute(&mut **c)
    .await?;
    Ok(done.rows_affected())
}

pub(crate) async fn now(c: &mut PgTx) -> Result<DateTime<Utc>> {
    Ok(sqlx::query_scalar("SELECT now()")
        .fetch_one(&mut **c)
        .await?)
}

// ---------------------------------------------------------------------------------------------
// Operator views: one row per machine, fleet-wide counts.

const SUMMARY_SELECT: &str = "
    SELECT m.machine_id, p.provider, p.provider_id, p.reservation_id, p.ip_address, p.location,
           p.status, a.started_at, h.heartbeat_at,
           (SELECT string_agg(w.process, ',' ORDER BY w.process) FROM work w
             WHERE w.machine_id = m.machine_id) AS work,
           (SELECT max(b.until) FROM work_backoff b
             WHERE b.machine_id = m.machine_id AND b.until > now()) AS backoff_until,
           q.generation AS request_generation, r.generation AS report_generation,
           r.result AS report_result
      FROM machines m
      LEFT JOIN machine_provided p ON p.machine_id = m.machine_id
      LEFT JOIN machine_agent_started a ON a.machine_id = m.machine_id
      LEFT JOIN machine_agent_heartbeat h ON h.machine_id = m.machine_id
      LEFT JOIN machine_os_installation_request q ON q.machine_id = m.machine_id
      LEFT JOIN machine_os_installation_report r ON r.machine_id = m.machine_id";

fn summary_from_row(r: &PgRow) -> Result<MachineSummary> {
    let provider: Option<String> = r.try_get("provider")?;
    let provided = match provider {
        Some(_) => Some(provided_from_row(r)?.1),
        None => None,
    };
    let work: Option<String> = r.try_get("work")?;
    let report_generation: Option<i64> = r.try_get("report_generation")?;
    let report_result: Option<String> = r.try_get("report_result")?;
    Ok(MachineSummary {
        machine_id: r.try_get("machine_id")?,
        provided,
        agent_started_at: r.try_get("started_at")?,
        heartbeat_at: r.try_get("heartbeat_at")?,
        work: work
            .iter()
            .flat_map(|w| w.split(','))
            .map(|p| p.parse())
            .collect::<Result<_>>()?,
        backoff_until: r.try_get("backoff_until")?,
        request_generation: r.try_get("request_generation")?,
        report: match (report_generation, report_result) {
            (Some(g), Some(res)) => Some((g, res.parse()?)),
            _ => None,
        },
    })
}

pub(crate) async fn machine_summaries(
    c: &mut PgTx,
    after: Option<Uuid>,
    provider: Option<Provider>,
    limit: i64,
) -> Result<Vec<MachineSummary>> {
    let sql = format!(
        "{SUMMARY_SELECT}
          WHERE ($1::uuid IS NULL OR m.machine_id > $1) AND ($2::text IS NULL OR p.provider = $2)
          ORDER BY m.machine_id LIMIT $3"
    );
    let rows = sqlx::query(&sql)
        .bind(after)
        .bind(provider.map(|p| p.as_str()))
        .bind(limit)
        .fetch_all(&mut **c)
        .await?;
    rows.iter().map(summary_from_row).collect()
}

pub(crate) async fn machine_summary(c: &mut PgTx, id: Uuid) -> Result<Option<MachineSummary>> {
    let sql = format!("{SUMMARY_SELECT} WHERE m.machine_id = $1");
    let row = sqlx::query(&sql).bind(id).fetch_optional(&mut **c).await?;
    row.as_ref().map(summary_from_row).transpose()
}

pub(crate) async fn fleet_counts(c: &mut PgTx, stale_after_secs: f64) -> Result<FleetCounts> {
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
                (SELECT count(*) FROM machine_agent_heartbeat
                  WHERE heartbeat_at > now() - make_interval(secs => $1)),
                (SELECT count(*) FROM machine_agent_heartbeat
                  WHERE heartbeat_at <= now() - make_interval(secs => $1)),
                (SELECT count(*) FROM machine_os_installation_request q
                  WHERE NOT EXISTS (SELECT 1 FROM machine_os_installation_report r
                     WHERE r.machine_id = q.machine_id AND r.generation = q.generation
                       AND r.result = 'Success')),
                (SELECT count(*) FROM machine_os_installation_request q
                  WHERE EXISTS (SELECT 1 FROM machine_os_installation_report r
                     WHERE r.machine_id = q.machine_id AND r.generation = q.generation
                       AND r.result = 'Success'))",
    )
    .bind(stale_after_secs)
    .fetch_one(&mut **c)
    .await?;
    let provided: Vec<(String, i64)> = sqlx::query_as(
        "SELECT provider, count(*) FROM machine_provided GROUP BY provider ORDER BY provider",
    )
    .fetch_all(&mut **c)
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
    c: &mut PgTx,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<(Uuid, Option<String>, Vec<u8>)>> {
    Ok(sqlx::query_as(
        "SELECT h.machine_id, p.location, h.report_raw FROM machine_hardware_report h
           LEFT JOIN machine_provided p ON p.machine_id = h.machine_id
          WHERE $1::uuid IS NULL OR h.machine_id > $1 ORDER BY h.machine_id LIMIT $2",
    )
    .bind(after)
    .bind(limit)
    .fetch_all(&mut **c)
    .await?)
}

pub(crate) async fn session_work(c: &mut PgTx, session: Uuid) -> Result<Vec<(Uuid, Process)>> {
    let rows: Vec<(Uuid, String)> = sqlx::query_as(
        "SELECT machine_id, process FROM work WHERE session_id = $1 ORDER BY machine_id, process",
    )
    .bind(session)
    .fetch_all(&mut **c)
    .await?;
    rows.into_iter().map(|(m, p)| Ok((m, p.parse()?))).collect()
}

/// What Postgres can tell is wrong without scanning tables: constraints left unvalidated
/// and indexes left invalid (a failed concurrent build) in the BMDB's schema.
pub(crate) async fn integrity_problems(c: &mut PgTx) -> Result<Vec<String>> {
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
