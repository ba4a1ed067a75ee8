//! The integration tests of the loops, one test binary for the crate: each module was once a
//! binary of its own. Tests that start real Ironics or race leases against the clock take a
//! turn ([`alone`], or [`beside_each_other`] for the fault tests that start several Ironics at
//! once by design), so that they meet no such test they did not meet as binaries of their own.

mod bare_metal;
mod initializer_sshd;
mod ironic_faults;
mod over_fake_equinix;
mod over_real_ironic;
mod recoverer_fencing;
mod recovery;
mod runner_endings;
mod sim_replicas;
mod smoke;
mod static_inventory;

/// What the turn-taking tests share.
static TURNS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The turn of a test that runs with no other turn-taking test.
async fn alone() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    TURNS.write().await
}

/// The turn of a test that runs beside others taking this turn, and with no [`alone`] one.
async fn beside_each_other() -> tokio::sync::RwLockReadGuard<'static, ()> {
    TURNS.read().await
}
