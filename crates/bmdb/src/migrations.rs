//! Numbered, forward-only schema migrations, one SQL file per version and engine.

use crate::sql::engine::Dialects;

/// One schema step.
pub(crate) struct Migration {
    pub(crate) version: i64,
    pub(crate) name: &'static str,
    /// The oldest binary schema that may keep running on a database at this version: the
    /// previous migration's value for an additive ("expand") step that older binaries do not
    /// notice, this migration's own version for a "contract" step they would misread or whose
    /// rules they would break.
    pub(crate) oldest_compatible: i64,
    /// The script for each engine.
    pub(crate) script: Dialects,
}

/// Both engines' scripts of one migration, `migrations/{postgres,sqlite}/FILE`. A macro
/// because `include_str!` takes only a literal path; it does nothing else.
macro_rules! scripts {
    ($file:literal) => {
        Dialects {
            postgres: include_str!(concat!("../migrations/postgres/", $file)),
            sqlite: include_str!(concat!("../migrations/sqlite/", $file)),
        }
    };
}

impl Migration {
    const fn new(
        version: i64,
        name: &'static str,
        oldest_compatible: i64,
        script: Dialects,
    ) -> Self {
        Migration {
            version,
            name,
            oldest_compatible,
            script,
        }
    }
}

/// Every migration this binary knows, in order: version, name, oldest compatible schema, scripts.
#[rustfmt::skip] // a table: one migration per line
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration::new(1, "init", 1, scripts!("0001_init.sql")),
    Migration::new(2, "machine_recovery", 2, scripts!("0002_machine_recovery.sql")),
    // Contract: a binary of schema 2 would claim machines in maintenance and bring
    // decommissioned ones back.
    Migration::new(3, "operator_actions", 3, scripts!("0003_operator_actions.sql")),
    // Expand: more values admitted for a provider and its status. A binary of schema 3 runs
    // on as before; it cannot read machines of the Ironic provider, which only a binary of
    // schema 4 creates.
    Migration::new(4, "ironic", 3, scripts!("0004_ironic.sql")),
    // Expand: a nullable column. A binary of schema 3 or 4 neither reads nor writes it (its
    // upsert leaves it as it was).
    Migration::new(5, "provider_facts", 3, scripts!("0005_provider_facts.sql")),
    // Expand: one more value admitted for an operator action. A binary of schema 3 to 5 never
    // writes it and refuses, naming it, to show a history that holds one.
    Migration::new(6, "install_action", 3, scripts!("0006_install_action.sql")),
    // Expand: a table and a nullable column. A binary of schema 3 to 6 neither reads nor
    // writes them.
    Migration::new(7, "api_tokens", 3, scripts!("0007_api_tokens.sql")),
    // Expand: a table. A binary of schema 3 to 7 neither reads nor writes it (it keeps its
    // own skips in memory).
    Migration::new(8, "provider_skips", 3, scripts!("0008_provider_skips.sql")),
    // Expand: tables, one more work process and one more operator action. A binary of schema
    // 3 to 8 never records a bare machine nor claims one for the bare-metal process, and
    // writes no disk (the script says what else it may do meanwhile).
    Migration::new(9, "bare_metal", 3, scripts!("0009_bare_metal.sql")),
    // Expand: two tables. A binary of schema 3 to 9 neither reads nor writes them (its
    // recoverer believes a silence a server caused, as it always did).
    Migration::new(10, "heartbeat_writers", 3, scripts!("0010_heartbeat_writers.sql")),
    // Expand: a table. A binary of schema 3 to 10 neither reads nor writes it (its servers
    // keep no audit trail).
    Migration::new(11, "audit_events", 3, scripts!("0011_audit_events.sql")),
    Migration::new(12, "live_boot", 3, scripts!("0012_live_boot.sql")), // Expand: the script says.
    Migration::new(13, "chosen_disk", 3, scripts!("0013_chosen_disk.sql")), // Expand: the script says.
];

/// The schema version this binary needs and writes.
pub const SCHEMA_VERSION: i64 = 13;

/// Which binaries may run on a database: its schema version, and the oldest binary schema
/// that its newest migration declared compatible (design.md §18).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchemaWindow {
    /// The database's schema version (0: never migrated).
    pub version: i64,
    /// The oldest binary schema that may run on it.
    pub oldest_compatible: i64,
}

impl SchemaWindow {
    /// The window a database migrated by this binary has: this schema, and the oldest binary
    /// schema its newest migration admits.
    pub const THIS_BINARY: SchemaWindow = SchemaWindow {
        version: SCHEMA_VERSION,
        oldest_compatible: MIGRATIONS[MIGRATIONS.len() - 1].oldest_compatible,
    };

    /// Whether a binary of schema `binary` may run on this database: it is not newer than the
    /// database (then the database needs migrating first) nor older than the window.
    pub fn admits(&self, binary: i64) -> bool {
        (self.oldest_compatible..=self.version).contains(&binary)
    }

    /// Whether this build may run on the database: its schema is older than this binary (it
    /// needs migrating) or newer than the window admits (this binary needs upgrading) is an
    /// error saying which and what to do.
    pub fn check_this_binary(&self) -> Result<(), crate::Error> {
        if self.version < SCHEMA_VERSION {
            return Err(crate::Error::SchemaOutdated {
                found: self.version,
                known: SCHEMA_VERSION,
            });
        }
        if !self.admits(SCHEMA_VERSION) {
            return Err(crate::Error::SchemaTooNew {
                found: self.version,
                oldest_compatible: self.oldest_compatible,
                known: SCHEMA_VERSION,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_are_dense_and_end_at_schema_version() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version, i as i64 + 1, "{}", m.name);
        }
        assert_eq!(MIGRATIONS.last().unwrap().version, SCHEMA_VERSION);
    }

    #[test]
    fn compatibility_windows_never_reach_forward_or_back_in_time() {
        for pair in MIGRATIONS.windows(2) {
            assert!(
                pair[1].oldest_compatible >= pair[0].oldest_compatible,
                "{}",
                pair[1].name
            );
        }
        for m in MIGRATIONS {
            assert!(m.oldest_compatible <= m.version, "{}", m.name);
        }
    }

    #[test]
    fn a_window_admits_binaries_from_its_oldest_to_its_version() {
        let w = SchemaWindow {
            version: 5,
            oldest_compatible: 4,
        };
        assert_eq!(
            (3..=6).map(|b| w.admits(b)).collect::<Vec<_>>(),
            [false, true, true, false]
        );
    }
}
