//! Shepherd's control loops over the BMDB: the provider abstraction, the provisioner's
//! reconciliation, the generic loop runner, and the rate limiter they share (SPEC §6–§10).

pub mod limiter;
pub mod penalty;
pub mod provider;
pub mod reconcile;
