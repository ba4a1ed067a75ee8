//! Shepherd's control loops over the BMDB (SPEC §6–§10): the provider traits and the static,
//! Redfish-backed provider; the provisioner and the updater (one pass at a time); the
//! per-machine runner with the initializer and the recoverer on it, and the recovery brake;
//! and what they share: the rate limiter, the penalty box, call metrics, the background tasks'
//! status and bounded log lists. The simulated fleet is the `shepherd-sim` crate.

pub mod bmc_tls;
pub mod bounded;
pub mod brake;
pub mod causes;
pub mod fleet;
pub mod http_body;
pub mod initializer;
pub mod limiter;
pub mod metrics;
pub mod penalty;
pub mod periodic;
pub mod provider;
pub mod provisioner;
pub mod reconcile;
pub mod recoverer;
pub mod redfish;
pub mod retention;
pub mod retry;
pub mod runner;
pub mod settings;
pub mod static_inventory;
pub mod static_provider;
pub mod tasks;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
pub mod updater;
