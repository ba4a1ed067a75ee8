//! Shepherd's control loops over the BMDB: the provider abstraction, the provisioner, the
//! generic loop runner with the recoverer on top, and the rate limiter they share
//! (SPEC §6–§10).

pub mod bmc_tls;
pub mod bounded;
pub mod brake;
pub mod initializer;
pub mod limiter;
pub mod metrics;
pub mod penalty;
mod periodic;
pub mod provider;
pub mod provisioner;
pub mod reconcile;
pub mod recoverer;
pub mod redfish;
pub mod runner;
pub mod sim;
pub mod static_provider;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;
pub mod updater;
