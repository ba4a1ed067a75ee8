//! Redfish power control against the sushy-tools emulator (fake driver, HTTPS, basic auth),
//! installed by `scripts/test-deps.sh`: the right system is power-cycled, wrong credentials
//! and an unreachable BMC fail with clear causes, and the recoverer drives it all through the
//! static provider with backoff on failure.

use crate::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::free_port;
use common::sushy::{start_emulator, CertForm, Emulator, FakeSystem};
use shepherd_bmdb::*;
use shepherd_loops::recoverer::Recoverer;
use shepherd_loops::testing::spawn_loop;
use shepherd_provider::redfish::{Bmc, BmcEntry};
use shepherd_provider::static_provider::StaticProvider;

const SYSTEM_A: &str = "8b5e2a5c-0000-4000-8000-00000000000a";
const SYSTEM_B: &str = "8b5e2a5c-0000-4000-8000-00000000000b";
const SYSTEMS: [FakeSystem<'static>; 2] = [
    FakeSystem {
        uuid: SYSTEM_A,
        name: "node-a",
    },
    FakeSystem {
        uuid: SYSTEM_B,
        name: "node-b",
    },
];

fn entry(e: &Emulator, system: &str) -> BmcEntry {
    BmcEntry {
        url: e.url.clone(),
        system: Some(format!("/redfish/v1/Systems/{system}")),
        username: "admin".into(),
        password_file: Some(e.password_file.clone()),
        password_env: None,
        ca: Some(e.ca.clone()),
        insecure: false,
    }
}

async fn power(e: &Emulator, system: &str) -> String {
    Bmc::new(&entry(e, system), Duration::from_secs(10))
        .unwrap()
        .power_state()
        .await
        .unwrap()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_right_system_is_power_cycled() {
    let dir = tempfile::tempdir().unwrap();
    // The certificate most BMCs ship, pinned through `CA` (refused before as CaUsedAsEndEntity).
    let emu = start_emulator(dir.path(), CertForm::SelfSigned, &SYSTEMS, None);
    assert_eq!(power(&emu, SYSTEM_A).await, "On");
    assert_eq!(power(&emu, SYSTEM_B).await, "On");
    let used = Bmc::new(&entry(&emu, SYSTEM_B), Duration::from_secs(10))
        .unwrap()
        .reset()
        .await
        .unwrap();
    assert_eq!(used, "ForceRestart");
    // The emulator powers the system off at once and back on a few seconds later.
    assert_eq!(power(&emu, SYSTEM_B).await, "Off");
    assert_eq!(
        power(&emu, SYSTEM_A).await,
        "On",
        "the other system is untouched"
    );
    testing::eventually(
        "system B to come back on",
        Duration::from_secs(20),
        async || {
            let power = power(&emu, SYSTEM_B).await;
            testing::when(power == "On", power)
        },
    )
    .await;

    // Without a System, a BMC listing two systems is an error that says what to do.
    let mut no_system = entry(&emu, SYSTEM_A);
    no_system.system = None;
    let err = reset_error(&no_system).await;
    assert!(err.contains("lists 2 systems"), "{err}");

    // Wrong credentials.
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "nope\n").unwrap();
    let mut bad = entry(&emu, SYSTEM_A);
    bad.password_file = Some(wrong);
    let err = reset_error(&bad).await;
    assert!(
        err.contains("credentials") && err.contains("refused"),
        "{err}"
    );
    assert!(
        !err.contains("nope"),
        "the password is not in the error: {err}"
    );
    assert_eq!(power(&emu, SYSTEM_A).await, "On");

    // TLS is verified: without `CA` the system's trust store does not know the certificate.
    let mut untrusted = entry(&emu, SYSTEM_A);
    untrusted.ca = None;
    let err = reset_error(&untrusted).await;
    assert!(
        err.contains("invalid peer certificate: Other(OtherError(CaUsedAsEndEntity))"),
        "the cause names the untrusted certificate: {err}"
    );
}

/// Why a power cycle through `entry` failed; panics if it succeeded.
async fn reset_error(entry: &BmcEntry) -> String {
    let bmc = Bmc::new(entry, Duration::from_secs(10)).unwrap();
    bmc.reset().await.unwrap_err().to_string()
}

/// Machines whose agents went silent, with BMCs: reachable (B), wrong password, unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recoverer_power_cycles_through_the_inventory_bmc() {
    let dir = tempfile::tempdir().unwrap();
    let emu = start_emulator(dir.path(), CertForm::CaSigned, &SYSTEMS, None);
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "nope\n").unwrap();
    let bmc = |e: BmcEntry| {
        serde_json::json!({
            "URL": e.url, "System": e.system, "Username": e.username,
            "PasswordFile": e.password_file, "CA": e.ca,
        })
    };
    let mut wrong_entry = entry(&emu, SYSTEM_A);
    wrong_entry.password_file = Some(wrong);
    let mut unreachable = entry(&emu, SYSTEM_A);
    unreachable.url = format!("https://localhost:{}", free_port());
    let inventory = serde_json::json!([
        {"ID": "box-b", "Addr": "10.0.0.2:22", "BMC": bmc(entry(&emu, SYSTEM_B))},
        {"ID": "box-wrong", "Addr": "10.0.0.3:22", "BMC": bmc(wrong_entry)},
        {"ID": "box-gone", "Addr": "10.0.0.4:22", "BMC": bmc(unreachable)},
        {"ID": "box-none", "Addr": "10.0.0.5:22"},
    ]);
    let inv_path = dir.path().join("inventory.json");
    std::fs::write(&inv_path, inventory.to_string()).unwrap();
    let provider = Arc::new(
        StaticProvider::new(
            &format!("file://{}", inv_path.display()),
            ProviderKind::Static,
        )
        .unwrap()
        .with_bmc_timing(Duration::from_secs(5), Duration::ZERO),
    );
    assert!(provider.load_at_start().await.unwrap().has_bmcs());

    let t = testing::sqlite().await;
    let ids =
        t.db.transact(|tx| {
            Box::pin(async move {
                let mut ids = vec![];
                for name in ["box-b", "box-wrong", "box-gone", "box-none"] {
                    let id = tx.create_machine().await?;
                    tx.set_provided(id, &Provided::new(ProviderKind::Static, name))
                        .await?;
                    ids.push(id);
                }
                Ok(ids)
            })
        })
        .await
        .unwrap();
    testing::agents_silent_for_hours(&t.db, &ids).await;
    let task = Recoverer::new(provider, RecoveryThresholds::default());
    let (run, cancel) = spawn_loop(t.db.clone(), task, 2, 4);
    let deadline = Instant::now() + Duration::from_secs(60);
    let histories = loop {
        let mut all = vec![];
        for id in &ids {
            let id = *id;
            all.push(
                t.db.read(move |tx| Box::pin(async move { tx.machine_history(id).await }))
                    .await
                    .unwrap(),
            );
        }
        if all
            .iter()
            .all(|h| h.iter().any(|e| e.event != WorkEvent::Started))
        {
            break all;
        }
        assert!(
            Instant::now() < deadline,
            "recoverer made no progress: {all:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    cancel.cancel();
    run.await.unwrap();

    let ended = |h: &Vec<HistoryEntry>| {
        h.iter()
            .find(|e| e.event != WorkEvent::Started)
            .cloned()
            .unwrap()
    };
    assert_eq!(
        ended(&histories[0]).event,
        WorkEvent::Finished,
        "box-b rebooted: {:?}",
        histories[0]
    );
    assert_eq!(
        power(&emu, SYSTEM_A).await,
        "On",
        "box-wrong's system was not touched"
    );
    for (i, want) in [
        (1, "credentials for user"),
        (2, "connection refused"),
        (3, "names no bmc"),
    ] {
        let e = ended(&histories[i]);
        assert_eq!(e.event, WorkEvent::Failed, "{e:?}");
        let cause = e.cause.as_deref().unwrap_or("").to_lowercase();
        assert!(cause.contains(want), "want {want:?}: {e:?}");
        let backoffs =
            t.db.read({
                let id = ids[i];
                move |tx| Box::pin(async move { tx.machine_backoffs(id).await })
            })
            .await
            .unwrap();
        assert_eq!(backoffs.len(), 1, "failed recovery backs off");
    }
    // The recovered machine's agent tags were cleared for a new takeover.
    let id = ids[0];
    let agent =
        t.db.read(move |tx| Box::pin(async move { tx.agent_started(id).await }))
            .await
            .unwrap();
    assert!(agent.is_none());
    t.cleanup().await;
}
