//! Accepting TLS connections and serving the gRPC service on them until shutdown.

use std::sync::Arc;
use std::time::Duration;

use shepherd_proto::bmaas::agent_callback_server::AgentCallbackServer;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::service::{BmaasService, MAX_MESSAGE_BYTES};

/// Connection limits.
#[derive(Debug, Clone, Copy)]
pub struct ServerLimits {
    /// A TLS handshake must finish within this.
    pub handshake_timeout: Duration,
    /// Requests in flight per connection.
    pub concurrency_per_connection: usize,
    /// Connections being handshaken at once.
    pub max_pending_handshakes: usize,
}

impl Default for ServerLimits {
    fn default() -> Self {
        ServerLimits {
            handshake_timeout: Duration::from_secs(10),
            concurrency_per_connection: 16,
            max_pending_handshakes: 256,
        }
    }
}

/// Serves `service` on `listener` with TLS until `shutdown`.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    service: BmaasService,
    limits: ServerLimits,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let handshakes = Arc::new(tokio::sync::Semaphore::new(limits.max_pending_handshakes));
    let accept_shutdown = shutdown.clone();
    let accepting = tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                biased;
                _ = accept_shutdown.cancelled() => break,
                r = listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                tracing::warn!(%peer, "too many pending TLS handshakes; dropping connection");
                continue;
            };
            let (acceptor, tx) = (acceptor.clone(), tx.clone());
            tokio::spawn(async move {
                let _permit = permit;
                match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(stream)) => {
                        let _ = tx.send(Ok::<_, std::io::Error>(stream)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%peer, "TLS handshake timed out"),
                }
            });
        }
    });
    let svc = AgentCallbackServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let result = tonic::transport::Server::builder()
        .concurrency_limit_per_connection(limits.concurrency_per_connection)
        .add_service(svc)
        .serve_with_incoming_shutdown(ReceiverStream::new(rx), shutdown.cancelled())
        .await;
    accepting.abort();
    result.map_err(Into::into)
}
