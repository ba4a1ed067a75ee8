//! Migrations' bookkeeping: which schema version a database has and which binaries may run on
//! it, and recording one migration applied.

use super::{on_engine, Conn, Dialects, Result};
use crate::migrations::SchemaWindow;

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

/// Whether the bookkeeping has the compatibility column (databases migrated by binaries from
/// before the window lack it; each of their versions admits only its own binaries).
const HAS_WINDOW: Dialects = Dialects {
    postgres: "SELECT EXISTS (SELECT 1 FROM information_schema.columns
                WHERE table_schema = current_schema() AND table_name = 'bmdb_schema_migrations'
                  AND column_name = 'oldest_compatible')",
    sqlite: "SELECT EXISTS (SELECT 1 FROM pragma_table_info('bmdb_schema_migrations')
                             WHERE name = 'oldest_compatible')",
};

const RECORD: Dialects = Dialects {
    postgres: "INSERT INTO bmdb_schema_migrations (version, name, applied_at, oldest_compatible)
               VALUES ($1, $2, now(), $3)",
    sqlite: "INSERT INTO bmdb_schema_migrations (version, name, applied_at, oldest_compatible)
             VALUES ($1, $2, $4, $3)",
};

/// The highest applied migration and the oldest binary schema it admits; 0 and 0 for an
/// empty database. A version recorded without a window admits only its own binaries.
pub(crate) async fn schema_window(conn: &mut Conn) -> Result<SchemaWindow> {
    on_engine!(conn, |c, e| {
        let exists: bool = sqlx::query_scalar(e.sql(&TABLE_EXISTS))
            .fetch_one(&mut *c)
            .await?;
        if !exists {
            return Ok(SchemaWindow {
                version: 0,
                oldest_compatible: 0,
            });
        }
        let windowed: bool = sqlx::query_scalar(e.sql(&HAS_WINDOW))
            .fetch_one(&mut *c)
            .await?;
        let sql = if windowed {
            "SELECT version, oldest_compatible FROM bmdb_schema_migrations
              ORDER BY version DESC LIMIT 1"
        } else {
            "SELECT version, NULL AS oldest_compatible FROM bmdb_schema_migrations
              ORDER BY version DESC LIMIT 1"
        };
        let row: Option<(i64, Option<i64>)> = sqlx::query_as(sql).fetch_optional(&mut *c).await?;
        Ok(match row {
            None => SchemaWindow {
                version: 0,
                oldest_compatible: 0,
            },
            Some((version, oldest)) => SchemaWindow {
                version,
                oldest_compatible: oldest.unwrap_or(version),
            },
        })
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

/// Runs migration `version`'s `script` and records it under `name`, admitting binaries of
/// schema `oldest_compatible` and later.
pub(crate) async fn apply_migration(
    conn: &mut Conn,
    version: i64,
    name: &str,
    oldest_compatible: i64,
    script: &str,
) -> Result<()> {
    on_engine!(conn, |c, e| {
        sqlx::raw_sql(e.sql(&CREATE_TABLE)).execute(&mut *c).await?;
        let windowed: bool = sqlx::query_scalar(e.sql(&HAS_WINDOW))
            .fetch_one(&mut *c)
            .await?;
        if !windowed {
            sqlx::raw_sql("ALTER TABLE bmdb_schema_migrations ADD COLUMN oldest_compatible BIGINT")
                .execute(&mut *c)
                .await?;
        }
        sqlx::raw_sql(script).execute(&mut *c).await?;
        let q = sqlx::query(e.sql(&RECORD))
            .bind(version)
            .bind(name)
            .bind(oldest_compatible);
        e.with_now(q).execute(&mut *c).await?;
        Ok(())
    })
}
