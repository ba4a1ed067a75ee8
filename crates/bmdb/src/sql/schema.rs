//! Migrations' bookkeeping: which schema version a database has, and recording one applied.

use super::{on_engine, Conn, Dialects, Result};

/// Advisory lock key serializing concurrent migrations on Postgres ("shepherd" in ASCII).
const MIGRATION_LOCK: i64 = 0x7368_6570_6865_7264;

const TABLE_EXISTS: Dialects = Dialects {
    postgres: "SELECT to_regclass('bmdb_schema_migrations') IS NOT NULL",
    sqlite: "SELECT EXISTS (SELECT 1 FROM sqlite_master
                             WHERE type = 'table' AND name = 'bmdb_schema_migrations')",
};

const CREATE_TABLE: Dialects = Dialects {
    postgres: "CREATE TABLE IF NOT EXISTS bmdb_schema_migrations (
        version bigint PRIMARY KEY, name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
    sqlite: "CREATE TABLE IF NOT EXISTS bmdb_schema_migrations (
        version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at INTEGER NOT NULL)",
};

const RECORD: Dialects = Dialects {
    postgres:
        "INSERT INTO bmdb_schema_migrations (version, name, applied_at) VALUES ($1, $2, now())",
    sqlite: "INSERT INTO bmdb_schema_migrations (version, name, applied_at) VALUES ($1, $2, $3)",
};

/// The highest applied migration, 0 for an empty database.
pub(crate) async fn schema_version(conn: &mut Conn) -> Result<i64> {
    on_engine!(conn, |c, e| {
        let exists: bool = sqlx::query_scalar(e.sql(&TABLE_EXISTS))
            .fetch_one(&mut *c)
            .await?;
        if !exists {
            return Ok(0);
        }
        let v: Option<i64> = sqlx::query_scalar("SELECT max(version) FROM bmdb_schema_migrations")
            .fetch_one(&mut *c)
            .await?;
        Ok(v.unwrap_or(0))
    })
}

/// Makes concurrent migrators wait for each other until the transaction ends. SQLite needs
/// nothing: a write transaction already holds its single writer lock.
pub(crate) async fn lock_for_migration(conn: &mut Conn) -> Result<()> {
    if let Conn::Postgres(c) = conn {
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(MIGRATION_LOCK)
            .execute(&mut **c)
            .await?;
    }
    Ok(())
}

/// Runs migration `version`'s `script` and records it under `name`.
pub(crate) async fn apply_migration(
    conn: &mut Conn,
    version: i64,
    name: &str,
    script: &Dialects,
) -> Result<()> {
    on_engine!(conn, |c, e| {
        sqlx::raw_sql(e.sql(&CREATE_TABLE)).execute(&mut *c).await?;
        sqlx::raw_sql(e.sql(script)).execute(&mut *c).await?;
        e.with_now(sqlx::query(e.sql(&RECORD)).bind(version).bind(name))
            .execute(&mut *c)
            .await?;
        Ok(())
    })
}
