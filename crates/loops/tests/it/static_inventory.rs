//! The static provider feeding the provisioner, from a file and over HTTP, on both backends.

use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::*;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::provisioner::{Provisioner, ProvisionerConfig};
use shepherd_loops::reconcile::Limits;
use shepherd_provider::static_provider::StaticProvider;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn config() -> ProvisionerConfig {
    let fast = RateSpec::new(Duration::from_millis(1), 100);
    ProvisionerConfig {
        limits: Limits::new(0, 20),
        reconcile_rate: fast,
        creation_rate: fast,
        creation_parallelism: 1,
    }
}

async fn provided(db: &Bmdb) -> Vec<Provided> {
    let provided = testing::provided_by(db, ProviderKind::Static).await;
    provided.into_iter().map(|(_, p)| p).collect()
}

async fn file_inventory_is_reconciled_and_edits_are_picked_up(db: Bmdb) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inventory.json");
    std::fs::write(&path, r#"[{"ID": "m1", "Addr": "10.0.0.1", "Location": "rack-1"}, {"ID": "m2", "Addr": "10.0.0.2"}]"#).unwrap();
    let provider = Arc::new(
        StaticProvider::new(&format!("file://{}", path.display()), ProviderKind::Static).unwrap(),
    );
    let p = Provisioner::new(provider, config());
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;

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
    // The operator removes two of the three machines the BMDB knows at once: more than the
    // allowance (10 %, and always one), so the listing looks broken: refuse, change nothing.
    std::fs::write(
        &path,
        r#"[{"ID": "m1", "Addr": "10.0.0.1"}, {"ID": "m4", "Addr": "10.0.0.4"}]"#,
    )
    .unwrap();
    let e = format!("{:#}", p.iterate(&s).await.unwrap_err());
    assert!(
        e.contains("2 of 3") && e.contains("m2") && e.contains("m3"),
        "{e}"
    );
    assert_eq!(provided(&db).await.len(), 3);
    // A broken inventory is not acted on: the last good one still decides (here, the same
    // refusal), and the failed read shows in the provider's metrics.
    std::fs::write(&path, r#"[{"ID": "m1", "Addr": "10.0.0.1", "Rack": 3}]"#).unwrap();
    let e = format!("{:#}", p.iterate(&s).await.unwrap_err());
    assert!(e.contains("2 of 3") && e.contains("m2"), "{e}");
    assert_eq!(provided(&db).await.len(), 3);
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
        Arc::new(StaticProvider::new(&url, ProviderKind::Static).unwrap()),
        config(),
    );
    let s = testing::session(&db, Processor::ShepherdProvisioner).await;
    assert_eq!(p.iterate(&s).await.unwrap().created, 2);
    assert_eq!(provided(&db).await.len(), 2);
}

/// Two provisioning replicas over one inventory race to record the same machines. Every
/// machine is recorded once; the loser of each race adopts the winner's row instead of
/// failing, and "new", "adopted" and "already managed" add up per replica.
async fn racing_replicas_adopt_instead_of_failing(db: Bmdb) {
    const MACHINES: usize = 300;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inventory.json");
    let entries: Vec<String> = (0..MACHINES)
        .map(|i| {
            format!(
                r#"{{"ID": "m{i:04}", "Addr": "10.2.{}.{}"}}"#,
                i / 250,
                i % 250
            )
        })
        .collect();
    std::fs::write(&path, format!("[{}]", entries.join(","))).unwrap();
    let url = format!("file://{}", path.display());
    let mut replicas = Vec::new();
    for n in 0..2 {
        let p = Provisioner::new(
            Arc::new(StaticProvider::new(&url, ProviderKind::Static).unwrap()),
            ProvisionerConfig {
                limits: Limits::new(0, MACHINES),
                ..config()
            },
        );
        let s = db
            .start_session(SessionConfig::new(
                format!("provisioner-{n}"),
                Processor::ShepherdProvisioner,
            ))
            .await
            .unwrap();
        replicas.push((p, s));
    }
    let (a, b) = tokio::join!(
        replicas[0].0.iterate(&replicas[0].1),
        replicas[1].0.iterate(&replicas[1].1)
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!((a.failed, b.failed), (0, 0), "{a:?} {b:?}");
    assert_eq!(a.created + b.created, MACHINES, "{a:?} {b:?}");
    // A replica whose BMDB read came after the other's first inserts already manages those.
    assert_eq!(a.created + a.adopted + a.managed, MACHINES, "{a:?}");
    assert_eq!(b.created + b.adopted + b.managed, MACHINES, "{b:?}");
    let mut ids: Vec<String> = provided(&db)
        .await
        .into_iter()
        .map(|p| p.provider_id)
        .collect();
    let recorded = ids.len();
    ids.dedup();
    assert_eq!((recorded, ids.len()), (MACHINES, MACHINES));
    let machines = db
        .read(|tx| Box::pin(async move { tx.machine_ids(None, 10_000).await }))
        .await
        .unwrap();
    assert_eq!(machines.len(), MACHINES, "no machine row without its tag");
}

/// After a good start, a broken inventory keeps the last good one (and says so in the
/// metrics), and whether the recoverer may act follows the last good inventory.
async fn a_later_broken_inventory_keeps_the_last_good_one(_db: Bmdb) {
    use shepherd_provider::{Provider as _, Rebooter as _};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("inventory.json");
    std::fs::write(&path, r#"[{"ID": "m1", "Addr": "10.0.0.1"}]"#).unwrap();
    let p =
        StaticProvider::new(&format!("file://{}", path.display()), ProviderKind::Static).unwrap();
    let mut registry = prometheus_client::registry::Registry::default();
    p.metrics().register(&mut registry);
    let metric = |registry: &prometheus_client::registry::Registry, name: &str| {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse::<f64>().ok())
    };
    assert!(!p.load_at_start().await.unwrap().has_bmcs());
    assert!(!p.can_reboot().await, "no BMC named: the recoverer waits");

    let password = dir.path().join("bmc-password");
    std::fs::write(&password, "secret\n").unwrap();
    let bmc = format!(
        r#"{{"ID": "m1", "Addr": "10.0.0.1", "BMC": {{"URL": "https://bmc.test", "Username": "u", "PasswordFile": "{}"}}}}"#,
        password.display()
    );
    std::fs::write(
        &path,
        format!("[{bmc}, {{\"ID\": \"m2\", \"Addr\": \"10.0.0.2\"}}]"),
    )
    .unwrap();
    assert_eq!(p.list_machines().await.unwrap().len(), 2);
    assert!(p.can_reboot().await, "the new inventory names a BMC");

    std::fs::write(&path, "[{\"ID\": ").unwrap();
    for _ in 0..3 {
        assert_eq!(
            p.list_machines().await.unwrap().len(),
            2,
            "last good inventory"
        );
    }
    assert!(p.get_machine("m2").await.is_ok());
    assert!(p.can_reboot().await, "a failed read changes nothing");
    assert_eq!(metric(&registry, "shepherd_inventory_stale"), Some(1.0));
    assert_eq!(
        metric(
            &registry,
            "shepherd_inventory_reads_total{result=\"error\"}"
        ),
        Some(3.0)
    );
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        p.list_machines().await.unwrap().len(),
        2,
        "a missing file too"
    );

    std::fs::write(&path, r#"[{"ID": "m3", "Addr": "10.0.0.3"}]"#).unwrap();
    let listed = p.list_machines().await.unwrap();
    assert_eq!(listed[0].id.as_deref(), Some("m3"));
    assert_eq!(metric(&registry, "shepherd_inventory_stale"), Some(0.0));
    assert!(
        !p.can_reboot().await,
        "the good inventory names no BMC again"
    );
}

shepherd_bmdb::conformance_tests!(
    file_inventory_is_reconciled_and_edits_are_picked_up,
    http_inventory_is_reconciled,
    racing_replicas_adopt_instead_of_failing,
    a_later_broken_inventory_keeps_the_last_good_one
);
