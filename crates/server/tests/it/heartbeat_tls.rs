//! The BMaaS server over real TLS on both backends: authorization by agent key, what a
//! heartbeat writes, size bounds, and the installation request/report cycle.

use shepherd_bmdb::{testing, Bmdb, InstallationResult};
use shepherd_proto::agent::Node;
use shepherd_proto::bmaas::agent_callback_client::AgentCallbackClient;
use shepherd_proto::bmaas::*;
use shepherd_proto::Message;
use shepherd_server::*;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic::Code;
use uuid::Uuid;

/// The server under test and the directory holding its certificates.
struct Server {
    bmaas: LoopbackServer,
    _dir: tempfile::TempDir,
}

impl Server {
    fn addr(&self) -> String {
        format!("https://127.0.0.1:{}", self.bmaas.port())
    }
}

async fn start(db: &Bmdb) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let bmaas = LoopbackServer::start(db, dir.path(), 2, ServerLimits::default())
        .await
        .unwrap();
    Server { bmaas, _dir: dir }
}

/// An agent identity: a self-signed certificate of a fresh ed25519 key.
struct Agent {
    key: Vec<u8>,
    cert_pem: String,
    key_pem: String,
}

fn agent() -> Agent {
    let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
    let cert = rcgen::CertificateParams::new(vec!["agent".into()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    Agent {
        key: key.public_key_raw().to_vec(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    }
}

async fn client(
    server: &Server,
    agent: Option<&Agent>,
) -> Result<AgentCallbackClient<Channel>, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(server.bmaas.ca_pem()))
        .domain_name("localhost");
    if let Some(a) = agent {
        tls = tls.identity(Identity::from_pem(&a.cert_pem, &a.key_pem));
    }
    let channel = Endpoint::from_shared(server.addr())?
        .tls_config(tls)?
        .connect()
        .await?;
    Ok(AgentCallbackClient::new(channel).max_encoding_message_size(8 << 20))
}

/// A message whose field 1 is a varint: `machine_id` (field 1) is a string, so a
/// HeartbeatRequest cannot be decoded from it.
#[derive(Clone, PartialEq, prost::Message)]
struct NotAHeartbeat {
    #[prost(uint64, tag = "1")]
    field: u64,
}

/// Sends `message` to the Heartbeat method, whatever its type.
async fn send_raw<M: prost::Message + Send + Sync + 'static>(
    server: &Server,
    agent: &Agent,
    message: M,
) -> Result<HeartbeatResponse, tonic::Status> {
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(server.bmaas.ca_pem()))
        .domain_name("localhost")
        .identity(Identity::from_pem(&agent.cert_pem, &agent.key_pem));
    let channel = Endpoint::from_shared(server.addr())
        .unwrap()
        .tls_config(tls)
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(
        "/cloud.bmaas.server.api.AgentCallback/Heartbeat",
    );
    let codec = tonic_prost::ProstCodec::<M, HeartbeatResponse>::default();
    grpc.unary(tonic::Request::new(message), path, codec)
        .await
        .map(|r| r.into_inner())
}

/// Sends bytes that do not decode as a HeartbeatRequest to the Heartbeat method.
async fn garbage_heartbeat(server: &Server, agent: &Agent) -> tonic::Status {
    send_raw(server, agent, NotAHeartbeat { field: 7 })
        .await
        .unwrap_err()
}

/// `message` encoded, with field 99 (a varint no build knows) appended.
fn with_unknown_field(message: &impl Message) -> Vec<u8> {
    let mut bytes = message.encode_to_vec();
    bytes.extend([0x98, 0x06, 0x07]);
    bytes
}

/// Reports are stored as the agent sent them, fields this build does not know included
/// (prost drops those when it decodes); a report that does not decode is refused.
async fn reports_are_stored_as_received(db: Bmdb) {
    let server = start(&db).await;
    let good = agent();
    let m = testing::machine_with_agent(&db, &good.key).await;
    let hardware = with_unknown_field(&AgentHardwareReport {
        report: Some(Node {
            manufacturer: "Acme".into(),
            ..Default::default()
        }),
        warning: vec![],
    });
    testing::request_installation(&db, m, 3, vec![]).await;
    let installation = with_unknown_field(&OsInstallationReport {
        generation: 3,
        result: Some(os_installation_report::Result::Success(
            os_installation_report::Success::default(),
        )),
        chosen_disk: String::new(),
    });
    send_raw(
        &server,
        &good,
        shepherd_proto::raw::HeartbeatRequest {
            machine_id: m.to_string(),
            hardware_report: Some(hardware.clone()),
            installation_report: Some(installation.clone()),
        },
    )
    .await
    .unwrap();
    let stored = db
        .read(move |tx| Box::pin(async move { tx.hardware_report(m).await }))
        .await
        .unwrap();
    assert_eq!(stored, Some(hardware), "hardware report bytes as sent");
    let report = testing::installation_report(&db, m).await.unwrap();
    assert_eq!(
        report.report_raw, installation,
        "installation report bytes as sent"
    );
    assert_eq!(report.result, InstallationResult::Success);

    let m2 = testing::machine_with_agent(&db, &good.key).await;
    let e = send_raw(
        &server,
        &good,
        shepherd_proto::raw::HeartbeatRequest {
            machine_id: m2.to_string(),
            hardware_report: Some(vec![0xff, 0xff]),
            installation_report: None,
        },
    )
    .await
    .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");
    assert!(e.message().contains("hardware_report"), "{e}");
    assert!(heartbeat_of(&db, m2).await.is_none(), "nothing written");
    let _ = server.bmaas.close().await;
}

async fn heartbeat_of(db: &Bmdb, id: Uuid) -> Option<chrono::DateTime<chrono::Utc>> {
    db.read(move |tx| Box::pin(async move { tx.heartbeat(id).await }))
        .await
        .unwrap()
}

fn beat(id: &str) -> HeartbeatRequest {
    HeartbeatRequest {
        machine_id: id.into(),
        ..Default::default()
    }
}

/// The installation request a bare heartbeat for `m` is answered with.
async fn pending(c: &mut AgentCallbackClient<Channel>, m: Uuid) -> Option<OsInstallationRequest> {
    let answer = c.heartbeat(beat(&m.to_string())).await.unwrap();
    answer.into_inner().installation_request
}

async fn agents_are_authorized_by_key(db: Bmdb) {
    let server = start(&db).await;
    let (good, other) = (agent(), agent());
    let m = testing::machine_with_agent(&db, &good.key).await;
    let mut c = client(&server, Some(&good)).await.unwrap();

    let report = AgentHardwareReport {
        report: Some(Node {
            manufacturer: "Acme".into(),
            memory_installed_bytes: 64 << 30,
            ..Default::default()
        }),
        warning: vec!["no DMI".into()],
    };
    let resp = c
        .heartbeat(HeartbeatRequest {
            machine_id: m.to_string(),
            hardware_report: Some(report.clone()),
            installation_report: None,
        })
        .await
        .unwrap()
        .into_inner();
    assert!(resp.installation_request.is_none());
    assert!(heartbeat_of(&db, m).await.is_some());
    let stored = db
        .read(move |tx| Box::pin(async move { tx.hardware_report(m).await }))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        AgentHardwareReport::decode(stored.as_slice()).unwrap(),
        report
    );

    // Another key for this machine, and any key for an unknown machine: the same answer.
    let m2 = testing::machine_with_agent(&db, &good.key).await;
    let mut wrong = client(&server, Some(&other)).await.unwrap();
    let e1 = wrong.heartbeat(beat(&m2.to_string())).await.unwrap_err();
    let e2 = c
        .heartbeat(beat(&Uuid::new_v4().to_string()))
        .await
        .unwrap_err();
    assert_eq!(
        (e1.code(), e2.code()),
        (Code::Unauthenticated, Code::Unauthenticated)
    );
    assert_eq!(e1.message(), e2.message());
    assert!(
        heartbeat_of(&db, m2).await.is_none(),
        "nothing written for a wrong key"
    );

    // A machine with no agent key recorded at all (a takeover whose ending was lost started
    // this agent; the next one replaces it): "not yet recorded", told apart and written nowhere.
    let bare = db
        .transact(|tx| Box::pin(async move { tx.create_machine().await }))
        .await
        .unwrap();
    let e = wrong.heartbeat(beat(&bare.to_string())).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert!(shepherd_proto::hints::key_pending(&e), "{e}");
    assert!(heartbeat_of(&db, bare).await.is_none());
    // Once a key is recorded, another one is wrong.
    db.transact(move |tx| Box::pin(async move { tx.set_agent_started(bare, &[7; 32]).await }))
        .await
        .unwrap();
    let e = wrong.heartbeat(beat(&bare.to_string())).await.unwrap_err();
    assert_eq!(e.code(), Code::Unauthenticated, "{e}");

    let e = c.heartbeat(beat("not-a-uuid")).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);

    // An oversized report is refused and nothing is written.
    let m3 = testing::machine_with_agent(&db, &good.key).await;
    let huge = HeartbeatRequest {
        machine_id: m3.to_string(),
        hardware_report: Some(AgentHardwareReport {
            report: None,
            warning: vec!["x".repeat(MAX_MESSAGE_BYTES + 1)],
        }),
        installation_report: None,
    };
    let e = c.heartbeat(huge).await.unwrap_err();
    // As upstream's grpc-go server answers (tonic alone says OutOfRange).
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(heartbeat_of(&db, m3).await.is_none());

    // Bytes that are not a HeartbeatRequest are the caller's fault, not an internal error.
    let e = garbage_heartbeat(&server, &good).await;
    assert_eq!(e.code(), Code::InvalidArgument, "{e}");

    // No client certificate: the TLS handshake itself fails.
    let anonymous = match client(&server, None).await {
        Ok(mut c) => c.heartbeat(beat(&m.to_string())).await.err(),
        Err(e) => Some(tonic::Status::unavailable(e.to_string())),
    };
    assert!(
        anonymous.is_some(),
        "a client without a certificate got through"
    );
    server.bmaas.close().await.unwrap();
}

async fn installation_requests_until_reported(db: Bmdb) {
    let server = start(&db).await;
    let a = agent();
    let m = testing::machine_with_agent(&db, &a.key).await;
    let mut c = client(&server, Some(&a)).await.unwrap();
    let request = |generation| OsInstallationRequest {
        generation,
        r#type: Some(os_installation_request::Type::Image(
            ImageInstallationRequest {
                url: "https://images.example/os.img".into(),
                sha256: "00".repeat(32),
                target_device: "/dev/sda".into(),
                ..Default::default()
            },
        )),
    };
    let set = |generation| {
        testing::request_installation(&db, m, generation, request(generation).encode_to_vec())
    };
    set(1).await;
    for _ in 0..2 {
        assert_eq!(pending(&mut c, m).await, Some(request(1)));
    }
    let report = |generation, error: Option<&str>| OsInstallationReport {
        generation,
        result: Some(match error {
            Some(e) => os_installation_report::Result::Error(os_installation_report::Error {
                error: e.into(),
                ..Default::default()
            }),
            None => os_installation_report::Result::Success(Default::default()),
        }),
        chosen_disk: String::new(),
    };
    let resp = c
        .heartbeat(HeartbeatRequest {
            machine_id: m.to_string(),
            installation_report: Some(report(1, Some("checksum mismatch"))),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert!(
        resp.installation_request.is_none(),
        "a reported generation is no longer pending"
    );
    let stored = testing::installation_report(&db, m).await.unwrap();
    assert_eq!(
        (stored.generation, stored.result),
        (1, InstallationResult::Error)
    );

    // A new generation is pending again; a report without a result is refused.
    set(2).await;
    assert_eq!(pending(&mut c, m).await, Some(request(2)));
    let e = c
        .heartbeat(HeartbeatRequest {
            machine_id: m.to_string(),
            installation_report: Some(OsInstallationReport {
                generation: 2,
                result: None,
                chosen_disk: String::new(),
            }),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    c.heartbeat(HeartbeatRequest {
        machine_id: m.to_string(),
        installation_report: Some(report(2, None)),
        ..Default::default()
    })
    .await
    .unwrap();
    let stored = testing::installation_report(&db, m).await.unwrap();
    assert_eq!(
        (stored.generation, stored.result),
        (2, InstallationResult::Success)
    );
    server.bmaas.close().await.unwrap();
}

/// A stored installation request that does not decode is logged and left out of the answer;
/// the heartbeat itself succeeds and is recorded.
async fn an_undecodable_stored_request_does_not_fail_the_heartbeat(db: Bmdb) {
    let server = start(&db).await;
    let a = agent();
    let m = testing::machine_with_agent(&db, &a.key).await;
    testing::request_installation(&db, m, 4, vec![0xff, 0xff, 0xff]).await;
    let mut c = client(&server, Some(&a)).await.unwrap();
    assert_eq!(pending(&mut c, m).await, None);
    assert!(
        heartbeat_of(&db, m).await.is_some(),
        "the heartbeat was recorded"
    );
    let _ = server.bmaas.close().await;
}

shepherd_bmdb::conformance_tests!(
    agents_are_authorized_by_key,
    installation_requests_until_reported,
    reports_are_stored_as_received,
    an_undecodable_stored_request_does_not_fail_the_heartbeat,
);

/// A server-certificate verifier that offers only the signature schemes BoringSSL offers by
/// default — what gRPC C-core clients (Python, C++, Ruby …) send in `signature_algorithms`,
/// which has no Ed25519 — and otherwise checks like any client.
#[derive(Debug)]
struct CCoreSchemes(std::sync::Arc<rustls::client::WebPkiServerVerifier>);

type Cert<'a> = rustls::pki_types::CertificateDer<'a>;
type Dss = rustls::DigitallySignedStruct;
type Signed = Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error>;

impl rustls::client::danger::ServerCertVerifier for CCoreSchemes {
    fn verify_server_cert(
        &self,
        end_entity: &rustls::pki_types::CertificateDer<'_>,
        intermediates: &[rustls::pki_types::CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        self.0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
    }

    fn verify_tls12_signature(&self, m: &[u8], c: &Cert<'_>, d: &Dss) -> Signed {
        self.0.verify_tls12_signature(m, c, d)
    }

    fn verify_tls13_signature(&self, m: &[u8], c: &Cert<'_>, d: &Dss) -> Signed {
        self.0.verify_tls13_signature(m, c, d)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        use rustls::SignatureScheme::*;
        vec![
            ECDSA_NISTP256_SHA256,
            RSA_PSS_SHA256,
            RSA_PKCS1_SHA256,
            ECDSA_NISTP384_SHA384,
            RSA_PSS_SHA384,
            RSA_PKCS1_SHA384,
            RSA_PSS_SHA512,
            RSA_PKCS1_SHA512,
        ]
    }
}

/// `--dev-certs` must serve certificates gRPC C-core clients can verify: with an Ed25519
/// server key their handshake ends in NoSignatureSchemesInCommon. The agent's own client
/// certificate stays Ed25519.
#[tokio::test]
async fn clients_without_ed25519_complete_the_handshake_with_dev_certs() {
    let t = testing::sqlite().await;
    let server = start(&t.db).await;
    let mut roots = rustls::RootCertStore::empty();
    let ca = rustls_pemfile::certs(&mut server.bmaas.ca_pem().as_bytes())
        .next()
        .unwrap()
        .unwrap();
    roots.add(ca).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        std::sync::Arc::new(roots),
        provider.clone(),
    )
    .build()
    .unwrap();
    let a = agent();
    let cert = rustls_pemfile::certs(&mut a.cert_pem.as_bytes())
        .next()
        .unwrap()
        .unwrap();
    let key = rustls_pemfile::private_key(&mut a.key_pem.as_bytes())
        .unwrap()
        .unwrap();
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(std::sync::Arc::new(CCoreSchemes(webpki)))
        .with_client_auth_cert(vec![cert], key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", server.bmaas.port()))
        .await
        .unwrap();
    let connector = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config));
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let tls = connector.connect(name, tcp).await;
    assert!(tls.is_ok(), "handshake failed: {:?}", tls.err());
    let ca_key = x509_parser::parse_x509_certificate(
        &rustls_pemfile::certs(&mut server.bmaas.ca_pem().as_bytes())
            .next()
            .unwrap()
            .unwrap(),
    )
    .unwrap()
    .1
    .public_key()
    .algorithm
    .algorithm
    .to_id_string();
    assert_eq!(ca_key, "1.2.840.10045.2.1", "the dev CA key is ECDSA");
    let _ = server.bmaas.close().await;
    t.cleanup().await;
}

/// A database error during a heartbeat is answered Unavailable, not Internal and not a
/// refusal of the agent, and asks the agent back within `SHED_WAIT`, as a shed one does, so
/// that its next attempt falls in the same trouble: here the heartbeat table is gone under the
/// server.
#[tokio::test]
async fn a_database_error_during_a_heartbeat_is_unavailable() {
    let t = testing::sqlite().await;
    let server = start(&t.db).await;
    let a = agent();
    let m = testing::machine_with_agent(&t.db, &a.key).await;
    let mut c = client(&server, Some(&a)).await.unwrap();
    c.heartbeat(beat(&m.to_string())).await.unwrap();
    let raw = sqlx::SqlitePool::connect(&t.url).await.unwrap();
    sqlx::query("DROP TABLE machine_agent_heartbeat")
        .execute(&raw)
        .await
        .unwrap();
    raw.close().await;
    let e = c.heartbeat(beat(&m.to_string())).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e}");
    assert_eq!(
        shepherd_proto::hints::retry_after(&e),
        Some(heartbeat_writes::SHED_WAIT)
    );
    let _ = server.bmaas.close().await;
}

/// Past `max_heartbeats_in_flight` a heartbeat is shed at once with a retry-after hint, not
/// queued; the server reports itself in trouble from the shed heartbeat's arrival while the
/// held one is late, then one window with its cause once both are answered and `QUIET` has
/// passed, and its row goes when it closes.
#[tokio::test]
async fn heartbeats_past_the_bound_are_shed_and_the_trouble_is_reported() {
    let t = testing::sqlite().await;
    let dir = tempfile::tempdir().unwrap();
    let limits = ServerLimits {
        max_heartbeats_in_flight: 1,
        ..ServerLimits::default()
    };
    let bmaas = LoopbackServer::start(&t.db, dir.path(), 2, limits)
        .await
        .unwrap();
    let server = Server { bmaas, _dir: dir };
    let a = agent();
    let m = testing::machine_with_agent(&t.db, &a.key).await;
    let mut c = client(&server, Some(&a)).await.unwrap();
    server.bmaas.slow_heartbeats(SlowHeartbeats {
        share: 1.0,
        delay: std::time::Duration::from_secs(6),
        until: tokio::time::Instant::now() + std::time::Duration::from_secs(60),
    });
    let mut held = c.clone();
    let held = tokio::spawn(async move { held.heartbeat(beat(&m.to_string())).await });
    let writes = server.bmaas.heartbeat_writes().clone();
    testing::eventually(
        "the first heartbeat in flight",
        std::time::Duration::from_secs(5),
        async || testing::when(writes.in_flight() == 1, ()),
    )
    .await;
    let shed = c.heartbeat(beat(&m.to_string())).await.unwrap_err();
    assert_eq!(shed.code(), Code::Unavailable, "{shed}");
    assert_eq!(
        shepherd_proto::hints::retry_after(&shed),
        Some(heartbeat_writes::SHED_WAIT)
    );
    assert!(!shepherd_proto::hints::key_pending(&shed));
    assert_eq!(writes.refusals(Refusal::Shed), 1);

    let reported = |db: &Bmdb| {
        let db = db.clone();
        async move {
            db.read(|tx| {
                Box::pin(async move {
                    let now = tx.now().await?;
                    let writers = tx.heartbeat_writers().await?;
                    let troubles = tx.recent_heartbeat_troubles(5).await?;
                    Ok((now, writers, troubles))
                })
            })
            .await
            .unwrap()
        }
    };
    let secs = std::time::Duration::from_secs;
    testing::eventually("the trouble reported", secs(5), async || {
        let (now, writers, _) = reported(&t.db).await;
        testing::when(writers.len() == 1 && writers[0].in_trouble(now), ())
    })
    .await;
    held.await
        .unwrap()
        .expect("the held heartbeat is recorded, late");
    assert_eq!(writes.late(), 1);
    // One window: the shed heartbeat's and the held one's, late from 5 s in flight until it
    // was answered, are one trouble, which ends once none was seen for `QUIET`. It spans the
    // arrivals of the heartbeats that may have been lost: the held one's to the shed one's.
    let troubles = testing::eventually(
        "the trouble ended",
        heartbeat_writes::QUIET + secs(5),
        async || {
            let (now, writers, troubles) = reported(&t.db).await;
            let clean = writers.len() == 1 && !writers[0].in_trouble(now);
            testing::when(clean && !troubles.is_empty(), troubles)
        },
    )
    .await;
    assert_eq!(troubles.len(), 1, "{troubles:?}");
    let window = &troubles[0];
    assert_eq!((window.refused, window.cause.as_str()), (1, "shed"));
    server.bmaas.close().await.unwrap();
    let (_, writers, _) = reported(&t.db).await;
    assert!(writers.is_empty(), "a server that stops is forgotten");
}
