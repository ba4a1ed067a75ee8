//! Machines and the facts about them (tags, SPEC §2): one upsert and one read per tag.

use chrono::{DateTime, Utc};
use uuid::Uuid;

use super::{
    from_columns, on_engine, row_by_key, Columns, Conn, DbTime, Dialects, FromColumns, Result,
};
use crate::model::*;
use crate::Error;

const CREATE_MACHINE: Dialects = Dialects {
    postgres: "INSERT INTO machines (machine_id, created_at) VALUES ($1, now())",
    sqlite: "INSERT INTO machines (machine_id, created_at) VALUES ($1, $2)",
};

const SET_AGENT_STARTED: Dialects = Dialects {
    postgres: "INSERT INTO machine_agent_started (machine_id, started_at, public_key)
               VALUES ($1, coalesce($2, now()), $3)
               ON CONFLICT (machine_id) DO UPDATE
               SET started_at = excluded.started_at, public_key = excluded.public_key",
    sqlite: "INSERT INTO machine_agent_started (machine_id, started_at, public_key)
             VALUES ($1, coalesce($2, $4), $3)
             ON CONFLICT (machine_id) DO UPDATE
             SET started_at = excluded.started_at, public_key = excluded.public_key",
};

const SET_HEARTBEAT: Dialects = Dialects {
    postgres: "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at)
               VALUES ($1, coalesce($2, now()))
               ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
    sqlite: "INSERT INTO machine_agent_heartbeat (machine_id, heartbeat_at)
             VALUES ($1, coalesce($2, $3))
             ON CONFLICT (machine_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
};

const SET_RECOVERY: Dialects = Dialects {
    postgres:
        "INSERT INTO machine_recovery (machine_id, rebooted_at, in_a_row) VALUES ($1, now(), $2)
               ON CONFLICT (machine_id) DO UPDATE
               SET rebooted_at = excluded.rebooted_at, in_a_row = excluded.in_a_row",
    sqlite: "INSERT INTO machine_recovery (machine_id, rebooted_at, in_a_row) VALUES ($1, $3, $2)
             ON CONFLICT (machine_id) DO UPDATE
             SET rebooted_at = excluded.rebooted_at, in_a_row = excluded.in_a_row",
};

const PIN_SSH_HOST_KEY: Dialects = Dialects {
    postgres:
        "INSERT INTO machine_ssh_host_key (machine_id, key, first_seen_at) VALUES ($1, $2, now())
               ON CONFLICT (machine_id) DO NOTHING",
    sqlite: "INSERT INTO machine_ssh_host_key (machine_id, key, first_seen_at) VALUES ($1, $2, $3)
             ON CONFLICT (machine_id) DO NOTHING",
};

pub(crate) async fn create_machine(conn: &mut Conn, id: Uuid) -> Result<()> {
    on_engine!(conn, |c, e| {
        e.with_now(sqlx::query(e.sql(&CREATE_MACHINE)).bind(id))
            .execute(c)
            .await?;
        Ok(())
    })
}

pub(crate) async fn machine_exists(conn: &mut Conn, id: Uuid) -> Result<bool> {
    on_engine!(conn, |c, _| {
        Ok(
            sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM machines WHERE machine_id = $1)")
                .bind(id)
                .fetch_one(c)
                .await?,
        )
    })
}

/// Machine ids in id order after `after`, at most `limit`.
pub(crate) async fn machine_ids(
    conn: &mut Conn,
    after: Option<Uuid>,
    limit: i64,
) -> Result<Vec<Uuid>> {
    on_engine!(conn, |c, _| {
        Ok(sqlx::query_scalar(
            "SELECT machine_id FROM machines WHERE $1 IS NULL OR machine_id > $1
             ORDER BY machine_id LIMIT $2",
        )
        .bind(after)
        .bind(limit)
        .fetch_all(c)
        .await?)
    })
}

pub(crate) async fn set_provided(conn: &mut Conn, id: Uuid, p: &Provided) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query(
            "INSERT INTO machine_provided
                    (machine_id, provider, provider_id, reservation_id, ip_address, location, status,
                     facts)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (machine_id) DO UPDATE SET provider = excluded.provider,
                provider_id = excluded.provider_id, reservation_id = excluded.reservation_id,
                ip_address = excluded.ip_address, location = excluded.location,
                status = excluded.status, facts = excluded.facts",
        )
        .bind(id)
        .bind(p.provider.as_str())
        .bind(&p.provider_id)
        .bind(&p.reservation_id)
        .bind(&p.ip_address)
        .bind(&p.location)
        .bind(p.status.map(|s| s.as_str()))
        .bind(p.facts.to_column())
        .execute(c)
        .await?;
        Ok(())
    })
}

/// A `machine_provided` row, also the provided half of an operator's summary row.
impl FromColumns for (Uuid, Provided) {
    fn from_columns(r: &impl Columns) -> Result<Self> {
        let status: Option<String> = r.get("status")?;
        let facts: Option<String> = r.get("facts")?;
        Ok((
            r.get("machine_id")?,
            Provided {
                provider: r.parsed("provider")?,
                provider_id: r.get("provider_id")?,
                reservation_id: r.get("reservation_id")?,
                ip_address: r.get("ip_address")?,
                location: r.get("location")?,
                status: status.map(|s| s.parse()).transpose()?,
                facts: ProviderFacts::from_column(facts.as_deref())?,
            },
        ))
    }
}

pub(crate) async fn provided(conn: &mut Conn, id: Uuid) -> Result<Option<Provided>> {
    let row: Option<(Uuid, Provided)> = row_by_key(
        conn,
        "SELECT * FROM machine_provided WHERE machine_id = $1",
        id,
    )
    .await?;
    Ok(row.map(|(_, p)| p))
}

pub(crate) async fn provided_by(
    conn: &mut Conn,
    provider: Provider,
) -> Result<Vec<(Uuid, Provided)>> {
    on_engine!(conn, |c, _| {
        let rows =
            sqlx::query("SELECT * FROM machine_provided WHERE provider = $1 ORDER BY provider_id")
                .bind(provider.as_str())
                .fetch_all(c)
                .await?;
        rows.iter().map(FromColumns::from_columns).collect()
    })
}

pub(crate) async fn machine_by_provider_id(
    conn: &mut Conn,
    provider: Provider,
    provider_id: &str,
) -> Result<Option<Uuid>> {
    on_engine!(conn, |c, _| {
        Ok(sqlx::query_scalar(
            "SELECT machine_id FROM machine_provided WHERE provider = $1 AND provider_id = $2",
        )
        .bind(provider.as_str())
        .bind(provider_id)
        .fetch_optional(c)
        .await?)
    })
}

/// Records the agent's start (`at`, or the transaction's time) and its key.
pub(crate) async fn set_agent_started(
    conn: &mut Conn,
    id: Uuid,
    at: Option<DateTime<Utc>>,
    key: &[u8],
) -> Result<()> {
    on_engine!(conn, |c, e| {
        let q = sqlx::query(e.sql(&SET_AGENT_STARTED))
            .bind(id)
            .bind(at.map(DbTime))
            .bind(key);
        e.with_now(q).execute(c).await?;
        Ok(())
    })
}

pub(crate) async fn agent_started(conn: &mut Conn, id: Uuid) -> Result<Option<AgentStarted>> {
    let sql = "SELECT started_at, public_key FROM machine_agent_started WHERE machine_id = $1";
    row_by_key(conn, sql, id).await
}

pub(crate) async fn agent_key_matches(conn: &mut Conn, id: Uuid, key: &[u8]) -> Result<bool> {
    on_engine!(conn, |c, _| {
        Ok(sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM machine_agent_started
                             WHERE machine_id = $1 AND public_key = $2)",
        )
        .bind(id)
        .bind(key)
        .fetch_one(c)
        .await?)
    })
}

/// Records a heartbeat at `at`, or at the transaction's time.
pub(crate) async fn set_heartbeat(
    conn: &mut Conn,
    id: Uuid,
    at: Option<DateTime<Utc>>,
) -> Result<()> {
    on_engine!(conn, |c, e| {
        let q = sqlx::query(e.sql(&SET_HEARTBEAT))
            .bind(id)
            .bind(at.map(DbTime));
        e.with_now(q).execute(c).await?;
        Ok(())
    })
}

pub(crate) async fn heartbeat(conn: &mut Conn, id: Uuid) -> Result<Option<DateTime<Utc>>> {
    on_engine!(conn, |c, _| {
        let at: Option<DbTime> = sqlx::query_scalar(
            "SELECT heartbeat_at FROM machine_agent_heartbeat WHERE machine_id = $1",
        )
        .bind(id)
        .fetch_optional(c)
        .await?;
        Ok(at.map(|t| t.0))
    })
}

/// Records a reboot by the recoverer now, the `in_a_row`-th without a heartbeat between.
pub(crate) async fn set_recovery(conn: &mut Conn, id: Uuid, in_a_row: i64) -> Result<()> {
    let in_a_row = i32::try_from(in_a_row).unwrap_or(i32::MAX);
    on_engine!(conn, |c, e| {
        let q = sqlx::query(e.sql(&SET_RECOVERY)).bind(id).bind(in_a_row);
        e.with_now(q).execute(c).await?;
        Ok(())
    })
}

pub(crate) async fn recovery(conn: &mut Conn, id: Uuid) -> Result<Option<Recovery>> {
    on_engine!(conn, |c, _| {
        let row: Option<(DbTime, i32)> = sqlx::query_as(
            "SELECT rebooted_at, in_a_row FROM machine_recovery WHERE machine_id = $1",
        )
        .bind(id)
        .fetch_optional(c)
        .await?;
        Ok(row.map(|(at, in_a_row)| Recovery {
            rebooted_at: at.0,
            in_a_row: in_a_row.into(),
        }))
    })
}

pub(crate) async fn set_hardware_report(conn: &mut Conn, id: Uuid, raw: &[u8]) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query(
            "INSERT INTO machine_hardware_report (machine_id, report_raw) VALUES ($1, $2)
             ON CONFLICT (machine_id) DO UPDATE SET report_raw = excluded.report_raw",
        )
        .bind(id)
        .bind(raw)
        .execute(c)
        .await?;
        Ok(())
    })
}

pub(crate) async fn hardware_report(conn: &mut Conn, id: Uuid) -> Result<Option<Vec<u8>>> {
    on_engine!(conn, |c, _| {
        Ok(sqlx::query_scalar(
            "SELECT report_raw FROM machine_hardware_report WHERE machine_id = $1",
        )
        .bind(id)
        .fetch_optional(c)
        .await?)
    })
}

pub(crate) async fn set_os_installation_request(
    conn: &mut Conn,
    id: Uuid,
    r: &OsInstallationRequest,
) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query(
            "INSERT INTO machine_os_installation_request (machine_id, generation, request_raw)
             VALUES ($1, $2, $3)
             ON CONFLICT (machine_id) DO UPDATE
             SET generation = excluded.generation, request_raw = excluded.request_raw",
        )
        .bind(id)
        .bind(r.generation)
        .bind(&r.request_raw)
        .execute(c)
        .await?;
        Ok(())
    })
}

pub(crate) async fn os_installation_request(
    conn: &mut Conn,
    id: Uuid,
) -> Result<Option<OsInstallationRequest>> {
    let sql = "SELECT generation, request_raw FROM machine_os_installation_request
                WHERE machine_id = $1";
    row_by_key(conn, sql, id).await
}

pub(crate) async fn set_os_installation_report(
    conn: &mut Conn,
    id: Uuid,
    r: &OsInstallationReport,
) -> Result<()> {
    on_engine!(conn, |c, _| {
        sqlx::query(
            "INSERT INTO machine_os_installation_report (machine_id, generation, result, report_raw)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (machine_id) DO UPDATE SET generation = excluded.generation,
                result = excluded.result, report_raw = excluded.report_raw",
        )
        .bind(id)
        .bind(r.generation)
        .bind(r.result.as_str())
        .bind(&r.report_raw)
        .execute(c)
        .await?;
        Ok(())
    })
}

pub(crate) async fn os_installation_report(
    conn: &mut Conn,
    id: Uuid,
) -> Result<Option<OsInstallationReport>> {
    let sql = "SELECT generation, result, report_raw FROM machine_os_installation_report
                WHERE machine_id = $1";
    row_by_key(conn, sql, id).await
}

/// Pins `key` unless a key is pinned already; returns the pinned key, which is `key` unless
/// another was pinned, in which case nothing is written and [`Error::HostKeyPinned`] says which.
pub(crate) async fn pin_ssh_host_key(conn: &mut Conn, id: Uuid, key: &str) -> Result<SshHostKey> {
    on_engine!(conn, |c, e| {
        e.with_now(sqlx::query(e.sql(&PIN_SSH_HOST_KEY)).bind(id).bind(key))
            .execute(c)
            .await?;
    });
    let pinned = ssh_host_key(conn, id)
        .await?
        .ok_or(Error::MachineGone(id))?;
    if pinned.key != key {
        return Err(Error::HostKeyPinned {
            pinned: pinned.key,
            presented: key.to_string(),
        });
    }
    Ok(pinned)
}

pub(crate) async fn ssh_host_key(conn: &mut Conn, id: Uuid) -> Result<Option<SshHostKey>> {
    let sql = "SELECT key, first_seen_at FROM machine_ssh_host_key WHERE machine_id = $1";
    row_by_key(conn, sql, id).await
}

/// A tag table: the closed list [`delete_tag`] may name.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TagTable {
    AgentStarted,
    AgentHeartbeat,
    SshHostKey,
}

impl TagTable {
    fn name(self) -> &'static str {
        match self {
            TagTable::AgentStarted => "machine_agent_started",
            TagTable::AgentHeartbeat => "machine_agent_heartbeat",
            TagTable::SshHostKey => "machine_ssh_host_key",
        }
    }
}

/// Deletes one machine's row of a tag; true if there was one.
pub(crate) async fn delete_tag(conn: &mut Conn, table: TagTable, id: Uuid) -> Result<bool> {
    let sql = format!("DELETE FROM {} WHERE machine_id = $1", table.name());
    on_engine!(conn, |c, _| {
        let r = sqlx::query(&sql).bind(id).execute(c).await?;
        Ok(r.rows_affected() > 0)
    })
}

from_columns! {
    AgentStarted { started_at: time, public_key: get }
    SshHostKey { key: get, first_seen_at: time }
    OsInstallationRequest { generation: get, request_raw: get }
    OsInstallationReport { generation: get, result: parsed, report_raw: get }
}
