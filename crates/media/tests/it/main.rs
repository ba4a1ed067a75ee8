//! The media server over its real HTTPS listener, with grants in a real BMDB: a machine's URL
//! serves its image with its own config drive, whole or by byte range; a wrong secret, another
//! machine's, an expired or revoked grant all get the same 404; a BMDB that cannot be read is
//! a 503, Shepherd's own unavailability; and many BMCs reading at once each get the same bytes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::testing;
use shepherd_bmdb::{BarePhase, Bmdb, MediaGrant, PhaseWrites, Process, Session, SessionConfig};
use shepherd_media::{LiveImage, MediaMetrics, MediaServer};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Grants `machine` its media with `meta` as its meta_data.json for `ttl`, moving it from
/// Bare to Inserting as the bare-metal loop does; returns the secret and the session that
/// holds the machine's work.
async fn grant(db: &Bmdb, machine: Uuid, meta: &str, ttl: Duration) -> (String, Session) {
    let session = db
        .start_session(SessionConfig::new(
            "bare",
            shepherd_bmdb::Processor::ShepherdBareMetal,
        ))
        .await
        .unwrap();
    let sid = session.id();
    let config = serde_json::json!({"meta_data.json": meta, "network_data.json": "{}"}).to_string();
    let token = db
        .transact(move |tx| {
            let config = config.clone();
            Box::pin(async move {
                tx.record_bare(machine, None, "test", None).await?;
                tx.insert_work_raw(machine, sid, Process::ShepherdBareMetal)
                    .await?;
                let grant = MediaGrant::new(config, tx.now().await?, ttl);
                let token = grant.token.clone();
                let writes = PhaseWrites {
                    media: Some(Some(grant)),
                    ..PhaseWrites::default()
                };
                tx.enter_bare_phase(
                    sid,
                    machine,
                    (BarePhase::Bare, BarePhase::Inserting),
                    &writes,
                    "granted",
                )
                .await?;
                Ok(token)
            })
        })
        .await
        .unwrap();
    (token, session)
}

/// The server on a free loopback port with a development certificate; its base URL.
async fn serve(db: &Bmdb, image: &Path, dir: &Path, cancel: &CancellationToken) -> String {
    let certs = shepherd_server::dev_certs(&dir.join("certs"), &["127.0.0.1".into()]).unwrap();
    let tls = shepherd_server::load_https_config(&certs.cert_pem, &certs.key_pem).unwrap();
    let image = Arc::new(LiveImage::open(image).unwrap());
    let server = MediaServer::new(image, db.clone(), MediaMetrics::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(shepherd_server::https::serve(
        "media",
        listener,
        Arc::new(tls),
        server.router(),
        shepherd_server::https::HttpsLimits::default(),
        cancel.clone(),
    ));
    url
}

fn client() -> reqwest::Client {
    // As BMCs do by default: the URL's secret is the credential, the certificate unchecked.
    reqwest::Client::builder()
        .danger_accept_invalid_certs(true)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machines_url_serves_its_image_and_nothing_else_does() {
    let dir = tempfile::tempdir().unwrap();
    let image = shepherd_media::testing::image_with_slots(dir.path());
    let t = testing::sqlite().await;
    let [a, b]: [Uuid; 2] = testing::provision(&t.db, 2, shepherd_bmdb::ProviderKind::Static)
        .await
        .try_into()
        .unwrap();
    let (token_a, _a) = grant(&t.db, a, r#"{"who":"a"}"#, Duration::from_secs(3600)).await;
    let (token_b, _b) = grant(&t.db, b, r#"{"who":"b"}"#, Duration::from_secs(3600)).await;
    let cancel = CancellationToken::new();
    let base = serve(&t.db, &image, dir.path(), &cancel).await;
    let url = |m: Uuid, token: &str| format!("{base}/live/{m}/{token}/live.iso");
    let http = client();

    let whole = http.get(url(a, &token_a)).send().await.unwrap();
    assert_eq!(whole.status(), 200);
    assert_eq!(
        whole.headers()["content-length"],
        (64 * 2048).to_string().as_str()
    );
    let bytes = whole.bytes().await.unwrap();
    assert_eq!(&bytes[3 * 2048..3 * 2048 + 11], br#"{"who":"a"}"#);
    assert!(bytes[3 * 2048 + 11..3 * 2048 + 4095]
        .iter()
        .all(|b| *b == b' '));
    assert_eq!(&bytes[..4], b"xxxx");

    let part = http
        .get(url(b, &token_b))
        .header("Range", format!("bytes={}-{}", 3 * 2048, 3 * 2048 + 10))
        .send()
        .await
        .unwrap();
    assert_eq!(part.status(), 206);
    assert_eq!(
        part.headers()["content-range"],
        format!("bytes {}-{}/{}", 3 * 2048, 3 * 2048 + 10, 64 * 2048).as_str()
    );
    assert_eq!(&part.bytes().await.unwrap()[..], br#"{"who":"b"}"#);
    let head = http.head(url(a, &token_a)).send().await.unwrap();
    assert_eq!(head.status(), 200);

    // Wrong secrets, another machine's, a machine that is not bare: the same 404.
    for (m, token) in [
        (a, "0".repeat(64)),
        (a, token_b.clone()),
        (Uuid::new_v4(), token_a.clone()),
    ] {
        let r = http.get(url(m, &token)).send().await.unwrap();
        assert_eq!(r.status(), 404, "{m} {token}");
    }
    let r = http
        .get(format!("{base}/live/not-a-uuid/x/live.iso"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);

    // Several reads at once (a peer may have a handful of handshakes in flight: the
    // listener's bound) each get the bytes of their own machine.
    let reads: Vec<_> = (0..12)
        .map(|i| {
            let (http, u) = (
                http.clone(),
                if i % 2 == 0 {
                    url(a, &token_a)
                } else {
                    url(b, &token_b)
                },
            );
            tokio::spawn(async move { http.get(u).send().await.unwrap().bytes().await.unwrap() })
        })
        .collect();
    for (i, read) in reads.into_iter().enumerate() {
        let bytes = read.await.unwrap();
        let who = if i % 2 == 0 { "a" } else { "b" };
        assert_eq!(
            &bytes[3 * 2048..3 * 2048 + 11],
            format!(r#"{{"who":"{who}"}}"#).as_bytes()
        );
    }

    // A grant that expired is refused once the cache of a few seconds lets it go.
    let c = testing::provision(&t.db, 1, shepherd_bmdb::ProviderKind::Static).await[0];
    let (token_c, _c) = grant(&t.db, c, "{}", Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(10)).await;
    let r = http.get(url(c, &token_c)).send().await.unwrap();
    assert_eq!(r.status(), 404, "an expired grant");

    // The BMDB gone is the server's unavailability, never the machine's.
    t.db.close().await;
    let d = Uuid::new_v4();
    let r = http.get(url(d, &token_a)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    cancel.cancel();
}
