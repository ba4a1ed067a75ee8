//! The BMaaS server (design.md §12): agents heartbeat over gRPC with TLS, presenting self-signed
//! certificates of their ed25519 key; each request is authorized against the `agent_started`
//! tag, and heartbeats, hardware reports and installation reports land in the BMDB.

pub mod admission;
pub mod heartbeat_writes;
pub mod https;
pub mod loopback;
pub mod metrics;
pub mod peer;
pub mod pool;
pub mod serve;
pub mod service;
pub mod status;
pub mod tls;

pub use heartbeat_writes::{HeartbeatWrites, Refusal, Reporter};
pub use loopback::{LoopbackError, LoopbackServer};
pub use metrics::{CloseReason, ConnectionMetrics, Rejection};
pub use peer::{Authorized, Peer};
pub use pool::SessionPool;
pub use serve::{next_admitted, serve_with_metrics, InvalidLimit, ServerLimits};
pub use service::{BmaasService, SlowHeartbeats, MAX_MESSAGE_BYTES};
pub use tls::{
    dev_certs, load_https_config, load_server_config, peer_ed25519_key, DevCerts, TlsError,
};
