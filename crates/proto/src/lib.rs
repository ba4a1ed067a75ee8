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
