//! Accepting TLS connections and serving the gRPC service on them until shutdown.
//!
//! Every connection is bounded: it needs an admission slot (in all and per peer) to start a
//! TLS handshake, which must finish within the handshake timeout, and another slot to stay
//! established. An established connection is closed when it makes no authorized request
//! within a grace period, when it makes no request at all for the idle timeout, or when it
//! stops answering HTTP/2 pings. Each connection is served by hyper directly, so these rules
//! are ours rather than a transport's defaults.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use shepherd_proto::raw::agent_callback_server::AgentCallbackServer;
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::Service;

use crate::admission::{Admission, AdmissionCaps, ConnectionTicket, HandshakeTicket};
use crate::metrics::{CloseReason, ConnectionMetrics, Rejection};
use crate::peer::{Authorized, Peer};
use crate::service::{BmaasService, MAX_MESSAGE_BYTES};
use crate::status::upstream_status_codes;
use crate::tls::peer_ed25519_key;

/// A connection limit that makes no sense; shown as `SETTING: PROBLEM`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {problem}")]
pub struct InvalidLimit {
    /// The limit's flag, without dashes.
    pub setting: &'static str,
    /// What is wrong with it.
    pub problem: &'static str,
}

/// Connection limits. The defaults suit one server of a large fleet; see the README.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// A TLS handshake must finish within this.
    pub handshake_timeout: Duration,
    /// TLS handshakes in progress, in all.
    pub max_pending_handshakes: usize,
    /// TLS handshakes in progress from one peer (IPv4 address or IPv6 /64).
    pub max_pending_handshakes_per_peer: usize,
    /// Established connections, in all.
    pub max_connections: usize,
    /// Established connections from one peer.
    pub max_connections_per_peer: usize,
    /// A connection with no request for this long is closed (agents reconnect on their next
    /// heartbeat). Set it to a few agent heartbeat intervals.
    pub idle_timeout: Duration,
    /// A connection that has made no authorized request this long after its handshake is
    /// closed: a TLS connection costs nothing to open, an agent key must be on record.
    pub unauthenticated_timeout: Duration,
    /// How often an HTTP/2 ping checks that a quiet peer is still there.
    pub keepalive_interval: Duration,
    /// How long a ping may go unanswered before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Requests in flight per connection (HTTP/2 concurrent streams).
    pub concurrency_per_connection: u32,
    /// Agent heartbeats being written at once; more are answered Unavailable with a "retry
    /// after" hint (`heartbeat_writes.rs`), so a slow BMDB sheds load instead of queueing it.
    pub max_heartbeats_in_flight: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            handshake_timeout: Duration::from_secs(5),
            max_pending_handshakes: 1024,
            max_pending_handshakes_per_peer: 16,
            max_connections: 20_000,
            max_connections_per_peer: 1_024,
            idle_timeout: Duration::from_secs(120),
            unauthenticated_timeout: Duration::from_secs(30),
            keepalive_interval: Duration::from_secs(60),
            keepalive_timeout: Duration::from_secs(20),
            concurrency_per_connection: 16,
            max_heartbeats_in_flight: 2_048,
        }
    }
}

impl ServerLimits {
    /// Limits for `agents` simulated agents that all connect from one loopback address (the
    /// demo, benchmarks): that address is one peer, so its shares are the whole.
    pub fn for_loopback_fleet(agents: usize) -> ServerLimits {
        let d = ServerLimits::default();
        let connections = d.max_connections.max(agents + 64);
        let handshakes = d.max_pending_handshakes.max(agents);
        ServerLimits {
            max_connections: connections,
            max_connections_per_peer: connections,
            max_pending_handshakes: handshakes,
            max_pending_handshakes_per_peer: handshakes,
            ..d
        }
    }

    /// Checks the limits make sense; the message names the setting.
    pub fn validate(&self) -> Result<(), InvalidLimit> {
        for (name, d) in [
            ("handshake-timeout", self.handshake_timeout),
            ("idle-timeout", self.idle_timeout),
            ("unauthenticated-timeout", self.unauthenticated_timeout),
            ("keepalive-interval", self.keepalive_interval),
            ("keepalive-timeout", self.keepalive_timeout),
        ] {
            if d.is_zero() {
                return Err(InvalidLimit {
                    setting: name,
                    problem: "must be more than zero",
                });
            }
        }
        for (name, n) in [
            ("max-pending-handshakes", self.max_pending_handshakes),
            (
                "max-pending-handshakes-per-peer",
                self.max_pending_handshakes_per_peer,
            ),
            ("max-connections", self.max_connections),
            ("max-connections-per-peer", self.max_connections_per_peer),
            (
                "concurrency-per-connection",
                self.concurrency_per_connection as usize,
            ),
            ("max-heartbeats-in-flight", self.max_heartbeats_in_flight),
        ] {
            if n == 0 {
                return Err(InvalidLimit {
                    setting: name,
                    problem: "must be at least 1",
                });
            }
        }
        Ok(())
    }

    fn caps(&self) -> AdmissionCaps {
        AdmissionCaps {
            pending_handshakes: self.max_pending_handshakes,
            pending_handshakes_per_peer: self.max_pending_handshakes_per_peer,
            connections: self.max_connections,
            connections_per_peer: self.max_connections_per_peer,
        }
    }
}

/// Request activity on one connection, which decides when it is idle.
#[derive(Debug)]
struct Activity {
    start: Instant,
    /// Milliseconds since `start` of the last request's start or end.
    last_ms: AtomicU64,
    in_flight: AtomicUsize,
    /// Whether a request on this connection was authorized as an agent's.
    authorized: AtomicBool,
}

impl Activity {
    fn new() -> Activity {
        Activity {
            start: Instant::now(),
            last_ms: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
            authorized: AtomicBool::new(false),
        }
    }

    fn touch(&self) {
        let ms = self.start.elapsed().as_millis() as u64;
        self.last_ms.fetch_max(ms, Ordering::Relaxed);
    }

    /// Records that the service authorized a request on this connection.
    fn authorized(&self) {
        self.authorized.store(true, Ordering::Relaxed);
    }

    fn begin(self: &Arc<Self>) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        self.touch();
        InFlight(self.clone())
    }

    /// Resolves when the connection should be closed, with why.
    async fn expired(&self, limits: &ServerLimits) -> CloseReason {
        loop {
            let (deadline, reason) = if !self.authorized.load(Ordering::Relaxed) {
                (
                    self.start + limits.unauthenticated_timeout,
                    CloseReason::Unauthenticated,
                )
            } else {
                let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
                (self.start + last + limits.idle_timeout, CloseReason::Idle)
            };
            let busy = self.in_flight.load(Ordering::Relaxed) > 0;
            if !busy && Instant::now() >= deadline {
                return reason;
            }
            // A request in flight keeps the connection; look again once it could be done. A
            // connection not yet authorized may be authorized while this waits, and then its
            // idle deadline can come before the unauthenticated one: it is at least one idle
            // timeout after now, so look again then at the latest.
            let next = if busy {
                Instant::now() + limits.idle_timeout.min(Duration::from_secs(1))
            } else if reason == CloseReason::Unauthenticated {
                deadline.min(Instant::now() + limits.idle_timeout)
            } else {
                deadline
            };
            tokio::time::sleep_until(next).await;
        }
    }
}

/// A request in flight; ending it counts as activity.
struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.touch();
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How long a closing connection may take to finish its requests before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(5);

/// Serves `service` on `listener` with TLS until `shutdown`, counting connections into
/// `metrics`. On shutdown every connection is asked to close (HTTP/2 GOAWAY) and given a few
/// seconds to finish its requests.
pub async fn serve_with_metrics(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    service: BmaasService,
    limits: ServerLimits,
    metrics: ConnectionMetrics,
    shutdown: CancellationToken,
) -> Result<(), InvalidLimit> {
    limits.validate()?;
    let acceptor = TlsAcceptor::from(tls);
    let admission = Admission::new(limits.caps(), metrics);
    let routes = tonic::service::Routes::new(
        AgentCallbackServer::new(service)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES),
    )
    .prepare();
    let tracker = TaskTracker::new();
    while let Some((tcp, peer, ticket)) = next_admitted(&listener, &admission, &shutdown).await {
        let _ = tcp.set_nodelay(true);
        let (acceptor, routes, admission) = (acceptor.clone(), routes.clone(), admission.clone());
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            let stream = tokio::select! {
                _ = shutdown.cancelled() => return,
                r = tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)) => match r {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(e)) => {
                        admission.metrics().rejected(Rejection::HandshakeFailed);
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        admission.metrics().rejected(Rejection::HandshakeTimeout);
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                },
            };
            let Ok(ticket) = ticket.establish() else {
                tracing::debug!(%peer, "no connection slot for this peer; connection dropped");
                return;
            };
            serve_connection(stream, peer, ticket, routes, limits, admission, shutdown).await;
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// Waits for the next connection that `admission` gives a handshake slot; `None` once
/// `shutdown` fires. A failed accept (out of file descriptors, usually) backs off instead of
/// spinning; a peer without a slot has its socket dropped, which closes it (the rejection is
/// counted by reason).
pub async fn next_admitted(
    listener: &TcpListener,
    admission: &Arc<Admission>,
    shutdown: &CancellationToken,
) -> Option<(TcpStream, SocketAddr, HandshakeTicket)> {
    loop {
        let (tcp, peer) = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return None,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        match admission.handshake(peer.ip()) {
            Ok(ticket) => return Some((tcp, peer, ticket)),
            Err(_) => tracing::debug!(%peer, "no handshake slot for this peer; connection dropped"),
        }
    }
}

/// Serves one established connection until the peer closes it, it expires, or shutdown.
async fn serve_connection(
    stream: tokio_rustls::server::TlsStream<TcpStream>,
    addr: SocketAddr,
    _ticket: ConnectionTicket,
    routes: tonic::service::Routes,
    limits: ServerLimits,
    admission: Arc<Admission>,
    shutdown: CancellationToken,
) {
    let key = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|certs| certs.first())
        .and_then(|c| peer_ed25519_key(c));
    let activity = Arc::new(Activity::new());
    let peer = Peer { key, addr };
    let requests = activity.clone();
    let svc = tower::service_fn(move |mut req: http::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(peer.clone());
        let in_flight = requests.begin();
        let response = routes.clone().call(req);
        async move {
            let response = response.await.unwrap_or_else(|e| match e {});
            if response.extensions().get::<Authorized>().is_some() {
                in_flight.0.authorized();
            }
            drop(in_flight);
            Ok::<_, Infallible>(upstream_status_codes(response))
        }
    });
    let mut http = hyper::server::conn::http2::Builder::new(TokioExecutor::new());
    http.timer(TokioTimer::new())
        .keep_alive_interval(Some(limits.keepalive_interval))
        .keep_alive_timeout(limits.keepalive_timeout)
        .max_concurrent_streams(Some(limits.concurrency_per_connection))
        .max_header_list_size(16 << 10)
        .max_pending_accept_reset_streams(Some(20))
        .max_local_error_reset_streams(Some(64));
    let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc));
    tokio::pin!(conn);
    let reason = tokio::select! {
        r = conn.as_mut() => {
            if let Err(e) = r {
                tracing::debug!(peer = %addr, error = %e, "connection ended with an error");
            }
            return;
        }
        _ = shutdown.cancelled() => CloseReason::Shutdown,
        reason = activity.expired(&limits) => reason,
    };
    admission.metrics().closed(reason);
    tracing::debug!(peer = %addr, reason = reason.label(), "closing connection");
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection authorized soon after its handshake closes once idle for the idle
    /// timeout, even when that is shorter than the unauthenticated timeout it was waiting on.
    #[tokio::test(start_paused = true)]
    async fn an_authorized_connection_closes_when_idle_not_at_the_unauthenticated_deadline() {
        let limits = ServerLimits {
            idle_timeout: Duration::from_secs(2),
            unauthenticated_timeout: Duration::from_secs(30),
            ..ServerLimits::default()
        };
        let activity = Arc::new(Activity::new());
        let expired = tokio::spawn({
            let activity = activity.clone();
            async move { (activity.expired(&limits).await, Instant::now()) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        activity.authorized();
        drop(activity.begin());
        let (reason, at) = expired.await.unwrap();
        assert_eq!(reason, CloseReason::Idle);
        let idle_for = at - activity.start;
        assert!(
            idle_for < Duration::from_secs(3),
            "closed {idle_for:?} after the handshake; the last request was at 0.1 s"
        );
    }
}
