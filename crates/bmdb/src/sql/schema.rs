//! Migrations' bookkeeping: which schema version a database has and which binaries may run on
//! it, and recording one migration applied.

use super::engine::{Arg, Dialects, Engine, Result, Sql, Tx};
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

impl Tx {
    /// The highest applied migration and the oldest binary schema it admits; 0 and 0 for an
    /// empty database. A version recorded without a window admits only its own binaries.
    pub(crate) async fn schema_window(&mut self) -> Result<SchemaWindow> {
        let conn = self.conn();
        let empty = SchemaWindow {
            version: 0,
            oldest_compatible: 0,
        };
        if conn.value(&TABLE_EXISTS, &[]).await? != Some(true) {
            return Ok(empty);
        }
        let windowed = conn.value(&HAS_WINDOW, &[]).await? == Some(true);
        let sql = if windowed {
            "SELECT version, oldest_compatible FROM bmdb_schema_migrations
              ORDER BY version DESC LIMIT 1"
        } else {
            "SELECT version, NULL AS oldest_compatible FROM bmdb_schema_migrations
              ORDER BY version DESC LIMIT 1"
        };
        let row: Option<(i64, Option<i64>)> = conn.row(sql, &[]).await?;
        Ok(match row {
            None => empty,
            Some((version, oldest)) => SchemaWindow {
                version,
                oldest_compatible: oldest.unwrap_or(version),
            },
        })
    }

    /// Makes concurrent migrators wait for each other until the transaction ends. SQLite
    /// needs nothing: a write transaction already holds its single writer lock.
    pub(crate) async fn lock_for_migration(&mut self) -> Result<()> {
        if self.engine() == Engine::Postgres {
            // Migrations may rewrite every row of a large fleet, and a second migrator waits
            // here for the first: neither is bounded by the connection's statement timeout.
            self.conn()
                .execute("SET LOCAL statement_timeout = 0", &[])
                .await?;
            let sql = "SELECT pg_advisory_xact_lock($1)";
            self.conn()
                .execute(sql, &[Arg::Int(MIGRATION_LOCK)])
                .await?;
        }
        Ok(())
    }

    /// Runs migration `version`'s `script` and records it under `name`, admitting binaries of
    /// schema `oldest_compatible` and later.
    pub(crate) async fn apply_migration(
        &mut self,
        version: i64,
        name: &str,
        oldest_compatible: i64,
        script: &str,
    ) -> Result<()> {
        let engine = self.engine();
        let conn = self.conn();
        conn.execute_script(CREATE_TABLE.text(engine)).await?;
        if conn.value(&HAS_WINDOW, &[]).await? != Some(true) {
            let add = "ALTER TABLE bmdb_schema_migrations ADD COLUMN oldest_compatible BIGINT";
            conn.execute_script(add).await?;
        }
        conn.execute_script(script).await?;
        let args = [
            Arg::Int(version),
            Arg::Text(name),
            Arg::Int(oldest_compatible),
            Arg::Now,
        ];
        conn.execute(&RECORD, &args).await?;
        Ok(())
    }
}
