//! Shepherd's wire protocols, generated from `proto/` (design.md §11). Field numbers and packages
//! match upstream, so upstream agents and servers interoperate with ours.

/// Generated code, nested as the protobuf packages are (cross-package references need it).
#[allow(missing_docs, clippy::all)]
pub mod cloud {
    /// Package `cloud.agent`.
    pub mod agent {
        /// Package `cloud.agent.api`.
        pub mod api {
            tonic::include_proto!("cloud.agent.api");
        }
    }
    /// Package `cloud.bmaas`.
    pub mod bmaas {
        /// Package `cloud.bmaas.server`.
        pub mod server {
            /// Package `cloud.bmaas.server.api`.
            pub mod api {
                tonic::include_proto!("cloud.bmaas.server.api");
            }
        }
    }
}

/// Shepherd's own messages.
#[allow(missing_docs, clippy::all)]
pub mod shepherd {
    /// Package `shepherd.agent`: the agent's state file.
    pub mod agent {
        tonic::include_proto!("shepherd.agent");
    }
}

pub mod raw;

/// Messages the agent speaks: the takeover protocol and the hardware report.
pub use cloud::agent::api as agent;
/// The agent-facing BMaaS service and its messages.
pub use cloud::bmaas::server::api as bmaas;

pub use prost::{DecodeError, Message};

/// A takeover whose fencing token (`TakeoverInit.claim_generation`) is lower than one the
/// agent has already seen: it comes from a replica whose lease on the machine ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stale takeover: claim generation {offered} is lower than {seen}, already seen")]
pub struct StaleTakeover {
    /// The highest generation the agent has seen.
    pub seen: u64,
    /// The generation of the refused takeover.
    pub offered: u64,
}

/// The fencing rule every agent applies to a takeover offering generation `offered`, having
/// seen `seen`: a lower one is refused; 0 (an Initializer that sends none) is never refused.
pub fn check_fencing_token(seen: u64, offered: u64) -> Result<(), StaleTakeover> {
    if offered != 0 && offered < seen {
        Err(StaleTakeover { seen, offered })
    } else {
        Ok(())
    }
}

/// The variable a live environment's config drive gives the agent's SSH session: the proof
/// that the agent runs in the live environment of its machine's current live boot, which the
/// agent shows in its `TakeoverSuccess` (design.md §21).
pub const LIVE_PROOF_VAR: &str = "SHEPHERD_AGENT_LIVE_PROOF";

/// Shepherd's hints on a heartbeat's `Unavailable` answer, in the answer's gRPC metadata
/// (upstream agents ignore them and retry as they always do).
pub mod hints {
    use std::time::Duration;

    /// How long the agent should wait before it heartbeats again, in milliseconds: the
    /// server is shedding load, or the agent's key is about to be recorded.
    pub const RETRY_AFTER_MS: &str = "shepherd-retry-after-ms";
    /// Present when the agent's key did not match but its machine's takeover is being
    /// recorded: the agent is most likely the one taking it over, and the refusal is no
    /// failure of its own.
    pub const KEY_PENDING: &str = "shepherd-key-pending";

    /// An `Unavailable` status saying `message`, asking the agent to wait `retry_after`, and
    /// marked as a key about to be recorded when `key_pending`.
    pub fn unavailable(message: &str, retry_after: Duration, key_pending: bool) -> tonic::Status {
        let mut status = tonic::Status::unavailable(message);
        let ms = retry_after.as_millis().to_string();
        if let Ok(value) = ms.parse() {
            status.metadata_mut().insert(RETRY_AFTER_MS, value);
        }
        if key_pending {
            status.metadata_mut().insert(
                KEY_PENDING,
                tonic::metadata::MetadataValue::from_static("1"),
            );
        }
        status
    }

    /// The wait `status` asks for, if it asks for one (at most a minute).
    pub fn retry_after(status: &tonic::Status) -> Option<Duration> {
        let ms = status.metadata().get(RETRY_AFTER_MS)?.to_str().ok()?;
        let ms: u64 = ms.parse().ok()?;
        Some(Duration::from_millis(ms.min(60_000)))
    }

    /// Whether `status` says the agent's key is about to be recorded.
    pub fn key_pending(status: &tonic::Status) -> bool {
        status.metadata().contains_key(KEY_PENDING)
    }
}
