//! The agent's own client against a real BMaaS server on loopback: it keeps one connection
//! between heartbeats, keeps it when the server answers with an error, and makes a new one
//! after the server closed an idle connection or restarted, or after the agent closed its own.

use std::time::Duration;

use rustls_pki_types::PrivatePkcs8KeyDer;
use shepherd_agent::connection::{AgentClient, HeartbeatError, ServerConnector};
use shepherd_agent::identity;
use shepherd_bmdb::{testing, Bmdb};
use shepherd_proto::bmaas::HeartbeatRequest;
use shepherd_server::{CloseReason, LoopbackServer, ServerLimits};
use tonic::Code;

/// The server closes connections idle this long.
const IDLE: Duration = Duration::from_secs(1);

fn beat(machine: &str) -> HeartbeatRequest {
    HeartbeatRequest {
        machine_id: machine.to_string(),
        ..Default::default()
    }
}

/// A machine with an agent on record, and that agent's client of `server`.
async fn agent_of_a_new_machine(db: &Bmdb, server: &LoopbackServer) -> (String, AgentClient) {
    let (pkcs8, public) = identity::generate().unwrap();
    let machine = testing::machine_with_agent(db, &public).await.to_string();
    let cert = identity::client_certificate(&pkcs8, &machine).unwrap();
    let key = PrivatePkcs8KeyDer::from(pkcs8).into();
    let connector = ServerConnector::new(&server.endpoint(), server.ca_der(), cert, key).unwrap();
    (machine, AgentClient::new(connector))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_client_reuses_its_connection_and_replaces_a_closed_one() {
    let t = testing::sqlite().await;
    let dir = tempfile::tempdir().unwrap();
    let limits = ServerLimits {
        idle_timeout: IDLE,
        ..ServerLimits::default()
    };
    let mut server = LoopbackServer::start(&t.db, dir.path(), 2, limits)
        .await
        .unwrap();
    let (machine, mut client) = agent_of_a_new_machine(&t.db, &server).await;
    assert_eq!(client.connections(), 0, "connected on first use only");

    // Heartbeats, and an error the server answers with, share one connection.
    client.heartbeat(beat(&machine)).await.unwrap();
    let (_, other_key) = identity::generate().unwrap();
    let not_ours = testing::machine_with_agent(&t.db, &other_key).await;
    let refused = client
        .heartbeat(beat(&not_ours.to_string()))
        .await
        .unwrap_err();
    assert!(
        matches!(&refused, HeartbeatError::Answered(s) if s.code() == Code::Unauthenticated),
        "{refused:?}"
    );
    client.heartbeat(beat(&machine)).await.unwrap();
    assert_eq!(client.connections(), 1);

    // Idle past the server's timeout: the server closes the connection, and the next
    // heartbeat goes over a new one.
    testing::eventually("the idle connection closed", IDLE * 10, async || {
        let closed = server.connection_metrics().closes(CloseReason::Idle);
        testing::when(closed == 1 && !client.is_connected(), closed)
    })
    .await;
    client.heartbeat(beat(&machine)).await.unwrap();
    assert_eq!(
        client.connections(),
        2,
        "a new connection after the idle one closed"
    );

    // The server goes away: no answer, and back on a new connection once it returns.
    server.stop().await.unwrap();
    let down = client.heartbeat(beat(&machine)).await.unwrap_err();
    assert!(matches!(down, HeartbeatError::NoAnswer(_)), "{down:?}");
    server.restart().await.unwrap();
    client.heartbeat(beat(&machine)).await.unwrap();
    assert_eq!(client.connections(), 3);

    server.close().await.unwrap();
    t.cleanup().await;
}

/// An agent that closes its connection after a heartbeat (`BetweenHeartbeats::Close`)
/// connects again for the next one, and the server answers it as before; without the close,
/// the connection is kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_connection_is_replaced_by_the_next_heartbeat() {
    let t = testing::sqlite().await;
    let dir = tempfile::tempdir().unwrap();
    let server = LoopbackServer::start(&t.db, dir.path(), 2, ServerLimits::default())
        .await
        .unwrap();
    let (machine, mut client) = agent_of_a_new_machine(&t.db, &server).await;
    client.close();
    for expected in 1..=3 {
        client.heartbeat(beat(&machine)).await.unwrap();
        assert_eq!(client.connections(), expected);
        client.close();
    }
    client.heartbeat(beat(&machine)).await.unwrap();
    client.heartbeat(beat(&machine)).await.unwrap();
    assert_eq!(client.connections(), 4, "kept when not closed");
    server.close().await.unwrap();
    t.cleanup().await;
}
