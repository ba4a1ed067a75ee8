//! Simulated agents for the benchmarks: each with its own self-signed ed25519 client
//! certificate and its own TLS connection, made with the real agent's client settings, and a
//! machine in the BMDB that has its key pinned.

use anyhow::Result;
use futures::stream::{self, StreamExt};
use shepherd_agent::connection::{AgentClient, ServerConnector};
use shepherd_bmdb::Bmdb;
use shepherd_proto::bmaas::agent_callback_client::AgentCallbackClient;
use shepherd_proto::bmaas::HeartbeatRequest;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use uuid::Uuid;

/// Machines (and keys) written per transaction when pinning many agents.
const CHUNK: usize = 1000;

/// One agent's identity: its raw ed25519 public key and its self-signed certificate.
pub struct AgentIdentity {
    pub public_key: Vec<u8>,
    pub cert_pem: String,
    pub key_pem: String,
}

/// `n` fresh agent identities.
pub fn identities(n: usize) -> Vec<AgentIdentity> {
    (0..n)
        .map(|_| {
            let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).expect("keygen");
            let cert = rcgen::CertificateParams::new(vec!["agent".into()])
                .expect("params")
                .self_signed(&key)
                .expect("self-sign");
            AgentIdentity {
                public_key: key.public_key_raw().to_vec(),
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
            }
        })
        .collect()
}

/// Creates one machine per identity with the agent started and its key pinned, as a takeover
/// leaves it; returns the machines in the identities' order.
pub async fn pin(db: &Bmdb, identities: &[AgentIdentity]) -> Result<Vec<Uuid>> {
    let mut machines = Vec::with_capacity(identities.len());
    for chunk in identities.chunks(CHUNK) {
        let keys: Vec<Vec<u8>> = chunk.iter().map(|i| i.public_key.clone()).collect();
        let ids = db
            .transact(move |tx| {
                let keys = keys.clone();
                Box::pin(async move {
                    let mut ids = Vec::with_capacity(keys.len());
                    for k in &keys {
                        let id = tx.create_machine().await?;
                        tx.set_agent_started(id, k).await?;
                        ids.push(id);
                    }
                    Ok(ids)
                })
            })
            .await?;
        machines.extend(ids);
    }
    Ok(machines)
}

/// A connected simulated agent.
pub struct Agent {
    pub machine: Uuid,
    client: Client,
}

/// A simulated agent's client, as [`ClientSettings`] chose it.
enum Client {
    /// The real agent's client; one heartbeat at a time, as the agent sends them.
    RealAgent(tokio::sync::Mutex<AgentClient>),
    Plain(AgentCallbackClient<Channel>),
}

impl Agent {
    /// Connections the agent's client has made, with the real agent's client.
    pub fn connections(&self) -> Option<u64> {
        match &self.client {
            Client::RealAgent(client) => client.try_lock().ok().map(|c| c.connections()),
            Client::Plain(_) => None,
        }
    }

    /// Whether one heartbeat (no reports) was answered with success.
    pub async fn heartbeat(&self) -> bool {
        let request = HeartbeatRequest {
            machine_id: self.machine.to_string(),
            ..Default::default()
        };
        match &self.client {
            Client::RealAgent(client) => client.lock().await.heartbeat(request).await.is_ok(),
            Client::Plain(client) => client.clone().heartbeat(request).await.is_ok(),
        }
    }
}

/// How a simulated agent's client connects.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientSettings {
    /// The real agent's client (`shepherd_agent::connection`: connected on first use, a 30 s
    /// deadline per request): what an agent holds.
    RealAgent,
    /// A plain tonic channel, connected eagerly, no deadline: the lightest client, so that a
    /// throughput benchmark spends the shared CPU on the server.
    Plain,
}

/// Connects one agent per identity to the server on loopback `port` that `ca_pem` certifies
/// (as `localhost`), `parallel` handshakes at a time, each followed by one heartbeat. Returns
/// the agents and how many of those heartbeats succeeded.
pub async fn connect(
    port: u16,
    ca_pem: &str,
    identities: &[AgentIdentity],
    machines: &[Uuid],
    parallel: usize,
    settings: ClientSettings,
) -> Result<(Vec<Agent>, usize)> {
    let ca_der = rustls_pemfile::certs(&mut ca_pem.as_bytes())
        .next()
        .ok_or_else(|| anyhow::anyhow!("no certificate in the CA PEM"))??
        .to_vec();
    let connected: Vec<(Agent, bool)> = stream::iter(identities.iter().zip(machines))
        .map(|(identity, &machine)| {
            let ca_der = &ca_der;
            async move {
                let client = match settings {
                    ClientSettings::RealAgent => {
                        let cert = rustls_pemfile::certs(&mut identity.cert_pem.as_bytes())
                            .next()
                            .ok_or_else(|| {
                                anyhow::anyhow!("no certificate in the agent's PEM")
                            })??;
                        let key = rustls_pemfile::private_key(&mut identity.key_pem.as_bytes())?
                            .ok_or_else(|| anyhow::anyhow!("no key in the agent's PEM"))?;
                        let connector =
                            ServerConnector::new(&format!("localhost:{port}"), ca_der, cert, key)?;
                        Client::RealAgent(tokio::sync::Mutex::new(AgentClient::new(connector)))
                    }
                    ClientSettings::Plain => {
                        let tls = ClientTlsConfig::new()
                            .ca_certificate(Certificate::from_pem(ca_pem))
                            .identity(Identity::from_pem(&identity.cert_pem, &identity.key_pem))
                            .domain_name("localhost");
                        let channel = Endpoint::from_shared(format!("https://127.0.0.1:{port}"))?
                            .tls_config(tls)?
                            .connect()
                            .await?;
                        Client::Plain(AgentCallbackClient::new(channel))
                    }
                };
                let agent = Agent { machine, client };
                let ok = agent.heartbeat().await;
                Ok::<_, anyhow::Error>((agent, ok))
            }
        })
        .buffer_unordered(parallel)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<_>>()?;
    let ok = connected.iter().filter(|(_, ok)| *ok).count();
    Ok((connected.into_iter().map(|(a, _)| a).collect(), ok))
}

/// Heartbeats once from every agent, `parallel` at a time; returns how many succeeded.
pub async fn heartbeat_all(agents: &[Agent], parallel: usize) -> usize {
    stream::iter(agents)
        .map(Agent::heartbeat)
        .buffer_unordered(parallel)
        .filter(|ok| std::future::ready(*ok))
        .count()
        .await
}
