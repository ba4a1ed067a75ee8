//! The static provider feeding the provisioner, from a file and over HTTP, on both backends.

use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::*;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{Provisioner, ProvisionerConfig};
use shepherd_loops::reconcile::Limits;
use shepherd_loops::static_provider::StaticProvider;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config() -> ProvisionerConfig {
    let fast = RateSpec::new(Duration::from_millis(1), 100);
    ProvisionerConfig {
        limits: Limits {
            max_machines: 0,
            chunk_size: 20,
        },
        reconcile_rate: fast,
        creation_rate: fast,
    }
}

async fn provided(db: &Bmdb) -> Vec<Provided> {
    db.read(|tx| Box::pin(async move { tx.provided_by(Provider::Static).await }))
        .await
        .unwrap()
        .into_iter()
        .map(|(_, p)| p)
        .collect()
}

async fn file_inventory_is_reconciled_and_edits_are_picked_up(db: Bmdb) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inventory.json");
    std::fs::write(&path, r#"[{"ID": "m1", "Addr": "10.0.0.1", "Location": "rack-1"}, {"ID": "m2", "Addr": "10.0.0.2"}]"#).unwrap();
    let provider = Arc::new(
        StaticProvider::new(&format!("file://{}", path.display()), Provider::Static).unwrap(),
    );
    let p = Provisioner::new(provider, config());
    let s = db
        .start_session(SessionConfig::new(
            "provisioner",
            Processor::ShepherdProvisioner,
        ))
        .await
        .unwrap();

    assert_eq!(p.iterate(&s).await.unwrap().created, 2);
    let got = provided(&db).await;
    assert_eq!(
        got.iter()
            .map(|p| p.provider_id.as_str())
            .collect::<Vec<_>>(),
        vec!["m1", "m2"]
    );
    assert_eq!(got[0].ip_address.as_deref(), Some("10.0.0.1"));
    assert_eq!(got[0].location.as_deref(), Some("rack-1"));
    assert_eq!(got[0].status, Some(ProviderStatus::Running));
    // Known machines are recognized as ours: nothing more to do.
    let r = p.iterate(&s).await.unwrap();
    assert_eq!((r.managed, r.created), (2, 0));

    // The operator adds a machine: it is brought in at the next iteration.
    std::fs::write(&path, r#"[{"ID": "m1", "Addr": "10.0.0.1"}, {"ID": "m2", "Addr": "10.0.0.2"}, {"ID": "m3", "Addr": "10.0.0.3"}]"#).unwrap();
    assert_eq!(p.iterate(&s).await.unwrap().created, 1);
    // The operator removes a machine the BMDB knows: refuse to act, change nothing.
    std::fs::write(
        &path,
        r#"[{"ID": "m1", "Addr": "10.0.0.1"}, {"ID": "m4", "Addr": "10.0.0.4"}]"#,
    )
    .unwrap();
    let e = format!("{:#}", p.iterate(&s).await.unwrap_err());
    assert!(
        e.contains("BMDB machine m2 is missing") && e.contains("BMDB machine m3 is missing"),
        "{e}"
    );
    assert_eq!(provided(&db).await.len(), 3);
    // A broken inventory fails the iteration with a message naming the problem.
    std::fs::write(&path, r#"[{"ID": "m1", "Addr": "10.0.0.1", "Rack": 3}]"#).unwrap();
    let e = format!("{:#}", p.iterate(&s).await.unwrap_err());
    assert!(e.contains("unknown field `Rack`"), "{e}");
}

/// Serves `body` to every HTTP request on a loopback port, for `requests` requests.
async fn serve_once(body: &'static str, requests: usize) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        for _ in 0..requests {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            let reply = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            conn.write_all(reply.as_bytes()).await.unwrap();
        }
    });
    format!("http://{addr}/inventory.json")
}

async fn http_inventory_is_reconciled(db: Bmdb) {
    let url = serve_once(
        r#"[{"ID": "h1", "Addr": "10.1.0.1"}, {"ID": "h2", "Addr": "10.1.0.2"}]"#,
        1,
    )
    .await;
    let p = Provisioner::new(
        Arc::new(StaticProvider::new(&url, Provider::Static).unwrap()),
        config(),
    );
    let s = db
        .start_session(SessionConfig::new(
            "provisioner",
            Processor::ShepherdProvisioner,
        ))
        .await
        .unwrap();
    assert_eq!(p.iterate(&s).await.unwrap().created, 2);
    assert_eq!(provided(&db).await.len(), 2);
}

shepherd_bmdb::conformance_tests!(
    file_inventory_is_reconciled_and_edits_are_picked_up,
    http_inventory_is_reconciled
);
