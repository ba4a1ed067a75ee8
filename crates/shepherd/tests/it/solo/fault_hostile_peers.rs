//! Fault suite: a hostile peer against a real `shepherd server`. One address opens 1,000 idle
//! TLS connections (any self-signed certificate passes TLS) and then 300 sockets that never
//! start TLS; an agent on another address must still connect and heartbeat, the half-open
//! sockets must be refused beyond the per-peer cap, and every connection that never makes an
//! authorized request must be closed after the unauthenticated timeout, an agent's after the
//! idle timeout. Bounds come from the configured timeouts with generous margins.

use crate::common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{sample, TestAgent};
use shepherd_bmdb::Bmdb;
use shepherd_proto::bmaas::HeartbeatRequest;
use tokio::io::AsyncReadExt;
use tokio::net::{TcpSocket, TcpStream};
use tokio_rustls::rustls;

const IDLE_TLS: usize = 1_000;
const HALF_OPEN: usize = 300;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
const UNAUTHENTICATED_TIMEOUT: Duration = Duration::from_secs(20);
const IDLE_TIMEOUT: Duration = Duration::from_secs(3);
const PER_PEER_HANDSHAKES: usize = 16;

/// A TCP connection to `server` from the loopback address `from`.
async fn connect_from(from: &str, server: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{from}:0").parse().unwrap()).unwrap();
    socket.connect(server).await.unwrap()
}

/// A rustls client that trusts the dev CA and presents a self-signed ed25519 certificate.
fn hostile_tls(ca_pem: &[u8]) -> tokio_rustls::TlsConnector {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut &ca_pem[..]) {
        roots.add(c.unwrap()).unwrap();
    }
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let cert = rcgen::CertificateParams::new(vec!["nobody".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(
        vec![cert.der().clone()],
        rustls::pki_types::PrivateKeyDer::Pkcs8(key.serialize_der().into()),
    )
    .unwrap();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

async fn metrics(url: &str) -> String {
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// Reads until the server closes the stream (EOF or a reset), within `within`.
async fn closed_by_server<S: tokio::io::AsyncRead + Unpin>(mut s: S, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    tokio::time::timeout(within, async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_hostile_peer_cannot_lock_agents_out() {
    let _ = rlimit::increase_nofile_limit(u64::MAX);
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite:{}", dir.path().join("bmdb.sqlite").display());
    let extra = [
        ["--handshake-timeout", "5s"],
        ["--max-pending-handshakes-per-peer", "16"],
        ["--unauthenticated-timeout", "20s"],
        ["--idle-timeout", "3s"],
    ];
    let (server, lines) = common::started_server(
        &url,
        dir.path(),
        &extra.concat(),
        &[
            "shepherd server: listening on ",
            "shepherd server: web UI at http://",
        ],
    );
    let addr: SocketAddr = lines[0].trim().parse().unwrap();
    let metrics_url = format!("http://{}/metrics", lines[1].split('/').next().unwrap());
    let ca_pem = std::fs::read(dir.path().join("certs/ca.pem")).unwrap();

    // The agent's machine and key are on record.
    let identity = TestAgent::new();
    let db = Bmdb::open(&url).await.unwrap();
    let machine = identity.machine(&db).await;

    // The hostile peer, 127.0.0.2: idle TLS connections first (a few handshakes at a time,
    // within its per-peer share), then sockets that never start TLS.
    let tls = hostile_tls(&ca_pem);
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut idle = Vec::with_capacity(IDLE_TLS);
    let opening = Instant::now();
    for chunk in 0..IDLE_TLS / 8 {
        let batch = (0..8).map(|_| {
            let (tls, name) = (tls.clone(), name.clone());
            async move {
                let tcp = connect_from("127.0.0.2", addr).await;
                tls.connect(name, tcp).await
            }
        });
        for r in futures::future::join_all(batch).await {
            idle.push(r.unwrap_or_else(|e| panic!("hostile TLS connection {chunk}: {e}")));
        }
    }
    assert!(
        opening.elapsed() < UNAUTHENTICATED_TIMEOUT,
        "opening {IDLE_TLS} connections took {:?}; the test needs them all open at once",
        opening.elapsed()
    );
    eprintln!(
        "{IDLE_TLS} TLS connections opened in {:?}",
        opening.elapsed()
    );
    let mut half_open = Vec::with_capacity(HALF_OPEN);
    for _ in 0..HALF_OPEN {
        half_open.push(connect_from("127.0.0.2", addr).await);
    }

    // An agent on 127.0.0.1 connects and heartbeats within one handshake timeout.
    let mut agent = identity.client(&addr.to_string(), &ca_pem, HANDSHAKE_TIMEOUT);
    let beat = HeartbeatRequest {
        machine_id: machine.to_string(),
        ..Default::default()
    };
    agent
        .heartbeat(beat.clone())
        .await
        .expect("the agent heartbeats while the hostile peer holds its connections");

    // The hostile connections were really held, and the half-open ones refused past the cap.
    let text = metrics(&metrics_url).await;
    let established = sample(&text, "shepherd_server_connections{state=\"established\"}").unwrap();
    assert!(
        established >= (IDLE_TLS + 1) as f64,
        "established = {established}"
    );
    let refused = sample(
        &text,
        "shepherd_server_connections_rejected_total{reason=\"pending_handshakes_per_peer\"}",
    )
    .unwrap();
    assert!(
        refused >= (HALF_OPEN - PER_PEER_HANDSHAKES) as f64,
        "refused = {refused}"
    );

    // Connections that never made an authorized request are closed by the server; the
    // half-open ones time out of their handshake.
    let within = UNAUTHENTICATED_TIMEOUT + Duration::from_secs(15);
    let (idle_closed, half_open_closed) = tokio::join!(
        futures::future::join_all(idle.into_iter().map(|s| closed_by_server(s, within))),
        futures::future::join_all(half_open.into_iter().map(|s| closed_by_server(s, within))),
    );
    let still_open = idle_closed.iter().filter(|c| !**c).count();
    assert_eq!(
        still_open, 0,
        "idle TLS connections the server never closed"
    );
    let still_open = half_open_closed.iter().filter(|c| !**c).count();
    assert_eq!(still_open, 0, "half-open sockets the server never closed");
    let text = metrics(&metrics_url).await;
    let unauthenticated = sample(
        &text,
        "shepherd_server_connections_closed_total{reason=\"unauthenticated\"}",
    )
    .unwrap();
    assert!(unauthenticated >= IDLE_TLS as f64, "{unauthenticated}");

    // The agent's own connection is closed once it has been idle, and its next heartbeat
    // simply reconnects.
    let deadline = Instant::now() + IDLE_TIMEOUT + Duration::from_secs(15);
    loop {
        let text = metrics(&metrics_url).await;
        let idle = sample(
            &text,
            "shepherd_server_connections_closed_total{reason=\"idle\"}",
        );
        let established = sample(&text, "shepherd_server_connections{state=\"established\"}");
        if idle >= Some(1.0) && established == Some(0.0) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the idle agent connection was never closed: idle closes {idle:?}, established {established:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    agent
        .heartbeat(beat)
        .await
        .expect("an agent whose idle connection was closed reconnects");
    let out = server.terminate();
    assert!(out.status.success(), "server exit: {}", out.status);
    db.close().await;
}
