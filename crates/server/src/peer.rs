//! What a request and its connection tell each other. The accept loop (`serve.rs`) puts the
//! [`Peer`] of a connection into every request's extensions; the service (`service.rs`) puts
//! [`Authorized`] into the extensions of a response to a request it authorized, and the accept
//! loop, which owns the connection's state, records it. Neither imports the other.

use std::net::SocketAddr;

/// Who is on the other end of a request's connection.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The ed25519 key the client certificate certifies, if it certifies one.
    pub key: Option<[u8; 32]>,
    /// The remote address.
    pub addr: SocketAddr,
}

/// Marks a response to a request the service authorized as an agent's: the connection is no
/// longer unauthenticated (see `ServerLimits::unauthenticated_timeout`).
#[derive(Debug, Clone, Copy)]
pub struct Authorized;
