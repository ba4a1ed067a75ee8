//! The OpenStack Ironic provider (design.md §19): a client of Ironic's REST API at one pinned
//! microversion ([`client`]), the node fields it reads ([`model`]), and the provider that maps
//! Ironic's node state machine onto Shepherd's provider traits ([`provider`]). Feature
//! `testing`: a real standalone Ironic started on loopback ([`testing`]).

pub mod client;
pub mod model;
mod placement;
pub mod provider;

#[cfg(feature = "testing")]
pub mod testing;

pub use client::{ApiError, Auth, Client, RetryPolicy, PINNED_VERSION};
pub use provider::{ConnectError, Image, IronicConfig, IronicError, IronicProvider, Selector};
