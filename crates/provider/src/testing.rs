//! Helpers for tests and benchmarks (feature `testing`).

pub mod bmc;
pub mod cloud_init;

pub use shepherd_ssh::testing::free_loopback_port;
