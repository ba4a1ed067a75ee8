//! The integration tests of the provider crate, one test binary (`bmc_system_trust.rs`, which
//! sets a process-wide variable, is the one other).

mod bmc;
