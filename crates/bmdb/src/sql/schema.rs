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
        let statements = statements(script);
        for (n, statement) in statements.iter().enumerate() {
            conn.execute_script(statement).await?;
            pause_for_test(version, n + 1, statements.len()).await;
        }
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

impl Tx {
    /// Test support: the schema as the engine describes it (tables, columns, indexes and
    /// constraints, as text, sorted), to tell a half-applied migration from none.
    #[cfg(feature = "testing")]
    pub async fn schema_description(&mut self) -> Result<Vec<String>> {
        let sql = Dialects {
            postgres: "SELECT format('%s.%s %s %s', c.relname, a.attname,
                                     format_type(a.atttypid, a.atttypmod), a.attnotnull)
                         FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
                         JOIN pg_namespace n ON n.oid = c.relnamespace
                        WHERE n.nspname = 'public' AND a.attnum > 0 AND NOT a.attisdropped
                       UNION ALL
                       SELECT format('%s %s', conname, pg_get_constraintdef(oid))
                         FROM pg_constraint WHERE connamespace = 'public'::regnamespace
                       UNION ALL
                       SELECT indexdef FROM pg_indexes WHERE schemaname = 'public'
                       ORDER BY 1",
            sqlite: "SELECT type || ' ' || name || ' ' || coalesce(sql, '') FROM sqlite_master
                      ORDER BY 1",
        };
        self.conn().values(&sql, &[]).await
    }
}

/// A migration script's statements, in order: split at each `;` that ends a line, comment
/// lines dropped. The scripts hold no statement that contains such a `;` (no triggers, no
/// function bodies), which the migration tests check by running them.
fn statements(script: &str) -> Vec<String> {
    let mut statements = Vec::new();
    let mut current = String::new();
    for line in script.lines() {
        if line.trim_start().starts_with("--") {
            continue;
        }
        current.push_str(line);
        current.push('\n');
        if line.trim_end().ends_with(';') {
            statements.push(std::mem::take(&mut current));
        }
    }
    if !current.trim().is_empty() {
        statements.push(current);
    }
    statements
}

/// Test support: with `SHEPHERD_TEST_MIGRATION_PAUSE=VERSION:N` in the environment, the
/// migrator says on standard error that it applied statement `N` of migration `VERSION` and
/// waits there, so that a test can kill it with SIGKILL at that statement.
#[cfg(feature = "testing")]
async fn pause_for_test(version: i64, n: usize, total: usize) {
    let Ok(at) = std::env::var("SHEPHERD_TEST_MIGRATION_PAUSE") else {
        return;
    };
    if at == format!("{version}:{n}") {
        eprintln!("bmdb migration {version}: applied statement {n} of {total}; waiting");
        tokio::time::sleep(std::time::Duration::from_secs(120)).await;
    }
}

/// Without the test support, nothing.
#[cfg(not(feature = "testing"))]
async fn pause_for_test(_version: i64, _n: usize, _total: usize) {}

#[cfg(test)]
mod tests {
    #[test]
    fn scripts_split_into_their_statements() {
        let script =
            "-- a comment; with a semicolon\nCREATE TABLE a (x INT,\n  y INT);\nDROP TABLE b;\n";
        assert_eq!(
            super::statements(script),
            ["CREATE TABLE a (x INT,\n  y INT);\n", "DROP TABLE b;\n"]
        );
    }
}
