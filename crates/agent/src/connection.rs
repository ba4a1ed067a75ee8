//! The agent's connection to the BMaaS server: one TLS + HTTP/2 connection, made on first use
//! and made again after it fails, under tonic's generated client.
//!
//! Why not tonic's `Channel`: an agent holds one connection for its whole life, and in-process
//! fleets (the demo, benchmarks) hold ten thousand of them, so what one connection holds is
//! what an agent costs. A `Channel` puts a tower `Buffer` (an mpsc block of about 9 KiB) in
//! front of its connection so that it can be cloned and shared, and tonic's TLS settings give
//! every connection its own 256-entry TLS session cache (about 14 KiB) that an agent, which
//! speaks to one server, never fills (heaptrack on the demo, `bench/README.md`). This client
//! is hyper's HTTP/2 connection with the TLS settings an agent needs (no TLS sessions kept),
//! and keeps what the agent had from the `Channel`: a connect timeout, a deadline per
//! request (sent to the server as `grpc-timeout`), and a new connection after a failed one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use shepherd_proto::bmaas::agent_callback_client::AgentCallbackClient;
use shepherd_proto::bmaas::{HeartbeatRequest, HeartbeatResponse};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::clock::{AtCertificateTime, CertificateTime};

/// How long making a connection (TCP, TLS and HTTP/2 handshakes) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long one request may take, from sending it to its whole answer.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A setting that cannot make a connection; found when the agent starts, not per heartbeat.
#[derive(Debug)]
pub enum SettingsError {
    /// The endpoint is not `host:port`.
    Endpoint(String),
    /// The CA certificate, client certificate or key is unusable.
    Tls(String),
}

impl std::fmt::Display for SettingsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SettingsError::Endpoint(e) => write!(f, "BMaaS endpoint: {e}"),
            SettingsError::Tls(e) => write!(f, "TLS settings: {e}"),
        }
    }
}

impl std::error::Error for SettingsError {}

/// Where and how to connect: the server's address and the agent's TLS identity.
pub struct ServerConnector {
    /// `host:port`, resolved on every connection attempt.
    endpoint: String,
    /// The name the server's certificate must carry.
    server_name: ServerName<'static>,
    /// The `https://host:port` origin every request is sent to.
    origin: http::Uri,
    tls: tokio_rustls::TlsConnector,
}

impl ServerConnector {
    /// A connector to `endpoint` (`host:port`) presenting `cert` with `key`, trusting `ca_der`
    /// (or the web PKI's roots if it is empty), checking certificates' dates by the machine's
    /// clock.
    pub fn new(
        endpoint: &str,
        ca_der: &[u8],
        cert: CertificateDer<'static>,
        key: PrivateKeyDer<'static>,
    ) -> Result<Self, SettingsError> {
        Self::checking_dates_at(endpoint, ca_der, cert, key, CertificateTime::wall_clock())
    }

    /// [`ServerConnector::new`], checking the server certificate's dates at `time`
    /// (`clock.rs`).
    pub fn checking_dates_at(
        endpoint: &str,
        ca_der: &[u8],
        cert: CertificateDer<'static>,
        key: PrivateKeyDer<'static>,
        time: CertificateTime,
    ) -> Result<Self, SettingsError> {
        let origin: http::Uri = format!("https://{endpoint}")
            .parse()
            .map_err(|e| SettingsError::Endpoint(format!("{endpoint:?}: {e}")))?;
        let host = origin
            .host()
            .ok_or_else(|| SettingsError::Endpoint(format!("{endpoint:?} names no host")))?
            .trim_start_matches('[')
            .trim_end_matches(']');
        if origin.port().is_none() {
            return Err(SettingsError::Endpoint(format!(
                "{endpoint:?} names no port"
            )));
        }
        let server_name = ServerName::try_from(host.to_string())
            .map_err(|e| SettingsError::Endpoint(format!("{endpoint:?}: {e}")))?;
        let tls_error = |e: rustls::Error| SettingsError::Tls(e.to_string());
        let mut roots = rustls::RootCertStore::empty();
        if ca_der.is_empty() {
            roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
        } else {
            roots
                .add(CertificateDer::from(ca_der.to_vec()))
                .map_err(tls_error)?;
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .map_err(|e| SettingsError::Tls(e.to_string()))?;
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(tls_error)?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AtCertificateTime::new(webpki, time)))
            .with_client_auth_cert(vec![cert], key)
            .map_err(tls_error)?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        // No session resumption: the server remembers its last 256 sessions (rustls's
        // default) while a fleet has thousands of agents, so an agent's ticket would seldom
        // be honoured, and keeping one (with the server's certificate chain) costs every
        // agent about 3 KiB. An agent connects once and reconnects only after a failure.
        config.resumption = rustls::client::Resumption::disabled();
        Ok(Self {
            endpoint: endpoint.to_string(),
            server_name,
            origin,
            tls: tokio_rustls::TlsConnector::from(Arc::new(config)),
        })
    }

    /// One new connection, or why there is none.
    async fn connect(&self) -> Result<Connection, ConnectError> {
        let attempt = async {
            let tcp = tokio::net::TcpStream::connect(&self.endpoint)
                .await
                .map_err(ConnectError::Tcp)?;
            let _ = tcp.set_nodelay(true);
            let tls = self
                .tls
                .connect(self.server_name.clone(), tcp)
                .await
                .map_err(ConnectError::Tls)?;
            let (sender, connection) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .handshake(TokioIo::new(tls))
                .await
                .map_err(ConnectError::Http2)?;
            let driver = tokio::spawn(async move {
                // The connection ends when the server closes it or the agent drops it; the
                // next request finds it closed and makes a new one.
                let _ = connection.await;
            });
            let client = AgentCallbackClient::with_origin(Sender(sender), self.origin.clone());
            Ok(Connection {
                client,
                driver: Some(driver),
            })
        };
        tokio::time::timeout(CONNECT_TIMEOUT, attempt)
            .await
            .unwrap_or(Err(ConnectError::TimedOut))
    }
}

/// Why a connection could not be made.
#[derive(Debug)]
enum ConnectError {
    Tcp(std::io::Error),
    Tls(std::io::Error),
    Http2(hyper::Error),
    TimedOut,
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectError::Tcp(e) => write!(f, "connecting: {e}"),
            ConnectError::Tls(e) => write!(f, "TLS handshake: {e}"),
            ConnectError::Http2(e) => write!(f, "HTTP/2 handshake: {e}"),
            ConnectError::TimedOut => write!(f, "connecting took over {CONNECT_TIMEOUT:?}"),
        }
    }
}

/// One established connection: tonic's client over it, and the task that drives it.
struct Connection {
    client: AgentCallbackClient<Sender>,
    /// `None` once the connection was closed on purpose and its task left to finish.
    driver: Option<tokio::task::JoinHandle<()>>,
}

impl Connection {
    /// Whether the connection has ended (the server closed it, or it failed).
    fn is_closed(&self) -> bool {
        self.driver.as_ref().is_none_or(|d| d.is_finished())
    }

    /// Ends the connection gracefully: without a request sender, hyper's connection task
    /// tells the server it is going away (HTTP/2 GOAWAY), closes the connection and ends.
    fn close(mut self) {
        self.driver = None;
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        if let Some(driver) = &self.driver {
            driver.abort();
        }
    }
}

/// hyper's request sender as the service tonic's generated client calls.
#[derive(Clone)]
struct Sender(http2::SendRequest<tonic::body::Body>);

type ResponseFuture = Pin<
    Box<dyn Future<Output = Result<http::Response<hyper::body::Incoming>, hyper::Error>> + Send>,
>;

impl tower_service::Service<http::Request<tonic::body::Body>> for Sender {
    type Response = http::Response<hyper::body::Incoming>;
    type Error = hyper::Error;
    type Future = ResponseFuture;

    /// Ready, or waiting for room; never an error. A closed connection is reported by `call`
    /// instead, as an error with its cause: tonic turns an error here into a status without
    /// one ("Service was not ready"), which would read as the server's answer.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self.0.poll_ready(cx) {
            Poll::Ready(Err(_closed)) => Poll::Ready(Ok(())),
            other => other,
        }
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        Box::pin(self.0.send_request(request))
    }
}

/// The agent's client: connects on first use, and again after a connection failed.
pub struct AgentClient {
    connector: ServerConnector,
    connection: Option<Connection>,
    /// Connections made so far.
    connections: u64,
}

impl AgentClient {
    /// A client that connects with `connector` when it first sends.
    pub fn new(connector: ServerConnector) -> Self {
        Self {
            connector,
            connection: None,
            connections: 0,
        }
    }

    /// How many connections this client has made: one for as long as the server keeps it.
    pub fn connections(&self) -> u64 {
        self.connections
    }

    /// Whether it holds a connection that has not ended (the server has not closed it, nor
    /// has it failed).
    pub fn is_connected(&self) -> bool {
        self.connection.as_ref().is_some_and(|c| !c.is_closed())
    }

    /// Closes the connection, if there is one, gracefully; the next heartbeat makes a new one.
    pub fn close(&mut self) {
        if let Some(connection) = self.connection.take() {
            connection.close();
        }
    }

    /// Sends one heartbeat. A connection that cannot be made or that fails, and an answer
    /// that takes over [`REQUEST_TIMEOUT`], are [`HeartbeatError::NoAnswer`] and make the
    /// next heartbeat use a new connection; a status the server answered with keeps it.
    pub async fn heartbeat(
        &mut self,
        request: HeartbeatRequest,
    ) -> Result<HeartbeatResponse, HeartbeatError> {
        if self.connection.as_ref().is_some_and(|c| c.is_closed()) {
            self.connection = None;
        }
        let connection = match &mut self.connection {
            Some(connection) => connection,
            None => {
                // Boxed, like the call below: only a connecting agent holds the handshakes'
                // state.
                let connection = Box::pin(self.connector.connect())
                    .await
                    .map_err(|e| HeartbeatError::NoAnswer(e.to_string()))?;
                self.connections += 1;
                self.connection.insert(connection)
            }
        };
        let mut request = tonic::Request::new(request);
        request.set_timeout(REQUEST_TIMEOUT);
        // Boxed: the call's state is held only while a heartbeat is in flight, not by every
        // idle agent's task.
        let call = Box::pin(connection.client.heartbeat(request));
        match tokio::time::timeout(REQUEST_TIMEOUT, call).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            // A status with a local cause: the connection failed (the server closed it as
            // the request went out, say), rather than the server answering.
            Ok(Err(status)) if std::error::Error::source(&status).is_some() => {
                self.connection = None;
                Err(HeartbeatError::NoAnswer(format!(
                    "connection failed: {}",
                    status.message()
                )))
            }
            Ok(Err(status)) => Err(HeartbeatError::Answered(status)),
            Err(_) => {
                self.connection = None;
                Err(HeartbeatError::NoAnswer(format!(
                    "no answer within {REQUEST_TIMEOUT:?}"
                )))
            }
        }
    }
}

/// Why a heartbeat failed: the server said no, or nothing came back.
#[derive(Debug)]
pub enum HeartbeatError {
    /// The server answered with this status (Unauthenticated for a key not on record,
    /// Unavailable when it could not write, …).
    Answered(tonic::Status),
    /// No answer: the connection could not be made or failed, or the answer was too late.
    NoAnswer(String),
}

impl std::fmt::Display for HeartbeatError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeartbeatError::Answered(status) => {
                write!(f, "{}: {}", status.code(), status.message())
            }
            HeartbeatError::NoAnswer(why) => write!(f, "no answer: {why}"),
        }
    }
}

impl std::error::Error for HeartbeatError {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity;

    fn connector(endpoint: &str, ca_der: &[u8]) -> Result<ServerConnector, SettingsError> {
        let (pkcs8, _) = identity::generate().unwrap();
        let cert = identity::client_certificate(&pkcs8, "m-1").unwrap();
        let key = rustls_pki_types::PrivatePkcs8KeyDer::from(pkcs8).into();
        ServerConnector::new(endpoint, ca_der, cert, key)
    }

    /// Settings that can never connect are refused when the agent starts, with the setting
    /// named; they are not found on every heartbeat.
    #[test]
    fn unusable_settings_are_refused_up_front() {
        for endpoint in ["server.example", "bad host:443", ""] {
            let error = connector(endpoint, &[]).err().expect(endpoint);
            assert!(
                matches!(error, SettingsError::Endpoint(_)),
                "{endpoint:?}: {error}"
            );
        }
        let error = connector("server.example:443", b"not a certificate")
            .err()
            .expect("garbage CA");
        assert!(matches!(error, SettingsError::Tls(_)), "{error}");
        connector("server.example:443", &[]).expect("web PKI roots");
        connector("[::1]:4443", &[]).expect("an IPv6 literal");
    }

    /// A connection the server has closed, before the client's task for it has ended: hyper's
    /// sender already refuses requests, which tonic would report as a status without a cause
    /// ("Service was not ready"), as if the server had answered. It is no answer, and the
    /// next heartbeat makes a new connection.
    #[tokio::test]
    async fn a_connection_closed_under_the_client_is_no_answer() {
        let (ours, theirs) = tokio::io::duplex(64 * 1024);
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake(TokioIo::new(ours))
            .await
            .unwrap();
        let ended = tokio::spawn(connection);
        drop(theirs);
        let _ = ended.await;
        assert!(sender.is_closed());
        let mut client = AgentClient::new(connector("127.0.0.1:9", &[]).unwrap());
        // Its task looks alive still: the client sends over the connection.
        let alive = tokio::spawn(std::future::pending::<()>());
        client.connection = Some(Connection {
            client: AgentCallbackClient::with_origin(
                Sender(sender),
                "https://127.0.0.1:9".parse().unwrap(),
            ),
            driver: Some(alive),
        });
        let error = client
            .heartbeat(HeartbeatRequest::default())
            .await
            .unwrap_err();
        assert!(matches!(error, HeartbeatError::NoAnswer(_)), "{error:?}");
        assert!(
            client.connection.is_none(),
            "the next heartbeat connects anew"
        );
    }
}
