//! The integration tests of the BMDB, one test binary for the crate: each module was once a
//! binary of its own. The lease tests, which hold sessions to a deadline on a loaded machine,
//! take [`alone`] so that no other lease test runs beside them.

mod backoff_db;
mod claim_statements;
mod claims_held;
mod conformance;
mod disk_full;
mod failover;
mod leases;
mod operator_actions;
mod overview;
mod schema_window;
mod test_databases;

/// The turn of a lease test: no two run at once, as when they were a binary of their own.
async fn alone() -> tokio::sync::MutexGuard<'static, ()> {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}
