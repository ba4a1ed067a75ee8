//! A loopback TCP proxy that can stop forwarding bytes without closing anything: a silent
//! network partition as the two ends see it (`../shared/notes/faults.md`). While it is cut,
//! neither side gets an error; what they send waits in the kernel's buffers and arrives once
//! the partition heals, as TCP's retransmissions would deliver it. Tests put it between one
//! replica and Postgres.

use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A running proxy to one upstream address; it stops with the test's runtime. Clones share
/// one switch.
#[derive(Clone)]
pub struct Blackhole {
    port: u16,
    open: Arc<watch::Sender<bool>>,
}

impl Blackhole {
    /// Listens on a free loopback port and forwards every connection to `upstream`
    /// (`host:port`).
    pub async fn start(upstream: &str) -> Blackhole {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let port = listener.local_addr().expect("local address").port();
        let open = Arc::new(watch::Sender::new(true));
        let (upstream, gate) = (upstream.to_string(), open.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                let (from_client, to_client) = client.into_split();
                let (from_server, to_server) = server.into_split();
                tokio::spawn(forward(from_client, to_server, gate.subscribe()));
                tokio::spawn(forward(from_server, to_client, gate.subscribe()));
            }
        });
        Blackhole { port, open }
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `url` (a `postgres://` URL naming `upstream`) rewritten to go through this proxy.
    pub fn url_through(&self, url: &str, upstream: &str) -> String {
        url.replace(upstream, &format!("127.0.0.1:{}", self.port))
    }

    /// Stops forwarding in both directions; every socket stays open.
    pub fn cut(&self) {
        self.open.send_replace(false);
    }

    /// Forwards again, what was held first.
    pub fn heal(&self) {
        self.open.send_replace(true);
    }
}

/// Copies `from` to `to` while the gate is open; while it is closed, reads nothing (so the
/// bytes wait in the kernel), and a chunk read just before is held until it opens again.
async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut gate: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        if gate.wait_for(|open| *open).await.is_err() {
            return;
        }
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if gate.wait_for(|open| *open).await.is_err() {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
