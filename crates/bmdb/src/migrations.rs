//! Numbered, forward-only schema migrations, one SQL file per version and engine.

use crate::sql::Dialects;

/// One schema step.
pub(crate) struct Migration {
    pub(crate) version: i64,
    pub(crate) name: &'static str,
    /// The script for each engine.
    pub(crate) script: Dialects,
}

/// Every migration this binary knows, in order.
pub(crate) const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "init",
        script: Dialects {
            postgres: include_str!("../migrations/postgres/0001_init.sql"),
            sqlite: include_str!("../migrations/sqlite/0001_init.sql"),
        },
    },
    Migration {
        version: 2,
        name: "machine_recovery",
        script: Dialects {
            postgres: include_str!("../migrations/postgres/0002_machine_recovery.sql"),
            sqlite: include_str!("../migrations/sqlite/0002_machine_recovery.sql"),
        },
    },
    Migration {
        version: 3,
        name: "operator_actions",
        script: Dialects {
            postgres: include_str!("../migrations/postgres/0003_operator_actions.sql"),
            sqlite: include_str!("../migrations/sqlite/0003_operator_actions.sql"),
        },
    },
];

/// The schema version this binary needs and writes.
pub const SCHEMA_VERSION: i64 = 3;

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
}
