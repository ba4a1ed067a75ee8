//! What `shepherd --version` says: the release, the commit it was built from, and which BMDB
//! schemas it can migrate and run on, so an operator can tell before an upgrade whether a
//! binary fits a database (README, "Upgrade and rollback").

use shepherd_bmdb::{SchemaWindow, SCHEMA_VERSION};

/// The text of `shepherd --version`.
pub fn long_version() -> String {
    let oldest = SchemaWindow::THIS_BINARY.oldest_compatible;
    let migrates = match SCHEMA_VERSION {
        1 => "a new database".to_string(),
        v => format!("a new database, or one of schema 1 to {}", v - 1),
    };
    format!(
        "{version}\n\
         commit:      {commit}\n\
         bmdb schema: {SCHEMA_VERSION}\n\
         \x20 migrates:  {migrates}, to schema {SCHEMA_VERSION} (`shepherd bmdb migrate`)\n\
         \x20 runs on:   schema {SCHEMA_VERSION}, and newer schemas whose migrations admit {SCHEMA_VERSION} (`shepherd bmdb status`)\n\
         \x20 leaves:    a database binaries of schema {oldest} to {SCHEMA_VERSION} may run on",
        version = env!("CARGO_PKG_VERSION"),
        commit = env!("SHEPHERD_COMMIT"),
    )
}
