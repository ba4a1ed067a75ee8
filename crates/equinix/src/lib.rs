//! The Equinix Metal provider (design.md §14): a REST client with bounded, jittered retries, and a
//! provider that turns hardware reservations into devices, adopts devices the BMDB lost track
//! of, and reboots devices for the recoverer. The service itself was shut down in 2026; the
//! provider is kept as the reference provider and tested against [`fake`] (feature `testing`).

pub mod client;
pub mod model;
pub mod provider;

#[cfg(feature = "testing")]
pub mod fake;

pub use client::{ApiError, Client, RetryPolicy};
pub use provider::{ConnectError, CreationFailed, EquinixConfig, EquinixProvider};
