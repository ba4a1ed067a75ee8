//! Shepherd's control loops over the BMDB (design.md §6–§10): the provisioner and the updater (one
//! pass at a time); the per-machine runner with the initializer, the recoverer and the bare-metal loop
//! on it, and the recovery brake; and what they share: the rate limiter and bounded log lists.
//! What the loops reach the world through (providers, the transport to a machine, call
//! metrics) is the `shepherd-provider` crate below this one; they report as tasks of the
//! `shepherd-tasks` crate; the simulated fleet is the `shepherd-sim` crate.

pub mod bare_metal;
pub mod bounded;
pub mod brake;
pub mod fleet;
pub mod initializer;
mod install_report;
pub mod limiter;
pub mod periodic;
pub mod provisioner;
pub mod reconcile;
pub mod recoverer;
pub mod retention;
pub mod runner;
#[cfg(feature = "testing")]
pub mod testing;
pub mod updater;
