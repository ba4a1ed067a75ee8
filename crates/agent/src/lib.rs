//! The Shepherd agent (design.md §13). Run with no arguments by the Initializer over SSH, it takes
//! the machine over: reads a `TakeoverInit` from stdin, creates its ed25519 key, saves its state,
//! answers a `TakeoverResponse` on stdout and starts itself in the background. In the
//! background (`run`), it heartbeats to the BMaaS server over TLS with a certificate of that key,
//! sends a hardware report once, and installs an OS image when asked. The heartbeat loop is a
//! library too, so simulated fleets run the real agent code in-process.

mod blank;
pub mod clock;
mod config_drive;
pub mod connection;
mod disks;
mod download;
mod ethtool;
pub mod hardware;
pub mod heartbeat;
pub mod identity;
mod image_writer;
mod install;
mod nic_macs;
mod qcow2;
pub mod state;
pub mod takeover;
mod wipe;

use std::path::PathBuf;
use std::time::Duration;

pub use install::{write_image_onto, InstallError};

/// Settings of the background agent.
#[derive(Debug, Clone)]
pub struct RunArgs {
    /// The state file written at takeover.
    pub state: PathBuf,
    /// Time between heartbeats.
    pub heartbeat_interval: Duration,
    /// Shell command run after a successful installation was reported.
    pub reboot_command: String,
    /// Cap on the delay between failed heartbeats.
    pub retry_max: Duration,
}
