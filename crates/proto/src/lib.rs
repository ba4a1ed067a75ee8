//! Shepherd's wire protocols, generated from `proto/` (SPEC §11). Field numbers and packages
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
