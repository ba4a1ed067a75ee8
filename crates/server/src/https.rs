//! An HTTPS (HTTP/1.1) listener for an axum router with the bounds every Shepherd listener has:
//! the operator API's and the bare-metal media server's. Admission caps handshakes and
//! connections in all and per peer (the agent server's `Admission`, with counters of its own);
//! a TLS handshake, a request's headers and a request must each finish in time; headers and
//! bodies are bounded in size.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::admission::{Admission, AdmissionCaps};
use crate::{next_admitted, ConnectionMetrics};
use axum::extract::ConnectInfo;
use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::Service;

/// The listener's bounds.
#[derive(Debug, Clone, Copy)]
pub struct HttpsLimits {
    /// Connections and handshakes in progress, in all and per peer.
    pub caps: AdmissionCaps,
    /// A TLS handshake must finish within this.
    pub handshake_timeout: Duration,
    /// A request's headers must arrive within this (and an idle connection is closed after it).
    pub header_timeout: Duration,
    /// Largest request head (request line and headers).
    pub max_head_bytes: usize,
}

impl Default for HttpsLimits {
    fn default() -> Self {
        HttpsLimits {
            caps: AdmissionCaps {
                pending_handshakes: 256,
                pending_handshakes_per_peer: 16,
                connections: 1024,
                connections_per_peer: 64,
            },
            handshake_timeout: Duration::from_secs(5),
            header_timeout: Duration::from_secs(10),
            max_head_bytes: 16 << 10,
        }
    }
}

/// Serves `app` on `listener` over TLS (`tls`, which must offer `http/1.1`) until `shutdown`;
/// each request carries its peer's address as `ConnectInfo`. `name` names the listener in
/// its log lines (`API`, `media`).
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: Router,
    limits: HttpsLimits,
    shutdown: CancellationToken,
) {
    let acceptor = TlsAcceptor::from(tls);
    let admission = Admission::new(limits.caps, ConnectionMetrics::default());
    let tracker = TaskTracker::new();
    while let Some((tcp, peer, ticket)) = next_admitted(&listener, &admission, &shutdown).await {
        let (acceptor, app, shutdown) = (acceptor.clone(), app.clone(), shutdown.clone());
        tracker.spawn(async move {
            let handshake = tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp));
            let stream = match handshake.await {
                Ok(Ok(stream)) => stream,
                Ok(Err(e)) => {
                    tracing::debug!(%peer, error = %e, "{name}: TLS handshake failed");
                    return;
                }
                Err(_) => {
                    tracing::debug!(%peer, "{name}: TLS handshake timed out");
                    return;
                }
            };
            let Ok(_connection) = ticket.establish() else {
                tracing::debug!(%peer, "{name}: no connection slot for this peer; connection dropped");
                return;
            };
            serve_connection(name, stream, peer, app, limits, shutdown).await;
        });
    }
    drop(listener);
    tracker.close();
    tracker.wait().await;
}

/// Serves one connection until the peer closes it, a timeout, or shutdown.
async fn serve_connection(
    name: &'static str,
    stream: tokio_rustls::server::TlsStream<tokio::net::TcpStream>,
    peer: SocketAddr,
    app: Router,
    limits: HttpsLimits,
    shutdown: CancellationToken,
) {
    let svc = tower::service_fn(move |mut req: axum::http::Request<hyper::body::Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        let mut app = app.clone();
        async move {
            let response = app.call(req.map(axum::body::Body::new)).await;
            Ok::<_, Infallible>(response.unwrap_or_else(|e| match e {}))
        }
    });
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_head_bytes.max(8192));
    let conn = http.serve_connection(TokioIo::new(stream), TowerToHyperService::new(svc));
    tokio::pin!(conn);
    tokio::select! {
        served = conn.as_mut() => {
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "{name}: connection ended with an error");
            }
        }
        _ = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = tokio::time::timeout(Duration::from_secs(5), conn).await;
        }
    }
}
