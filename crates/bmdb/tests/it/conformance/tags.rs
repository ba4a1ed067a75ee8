//! Tags (`sql/tags.rs`): written and read back, and the heartbeat hot path with its group commit.

use super::*;

async fn tags_round_trip(db: Bmdb) {
    let id = testing::provision(&db, 1, ProviderKind::Static).await[0];
    let t0 = Utc::now() - chrono::Duration::minutes(3);
    db.transact(move |tx| {
        Box::pin(async move {
            let mut p = Provided::new(ProviderKind::Static, id.simple().to_string());
            p.ip_address = Some("192.0.2.1".into());
            p.location = Some("rack-1".into());
            p.status = Some(ProviderStatus::Running);
            p.reservation_id = Some("res-1".into());
            p.facts.insert("cpus", "64");
            p.facts
                .insert("resource_class", "baremetal \"large\" ünïcode");
            tx.set_provided(id, &p).await?;
            tx.set_agent_started_at(id, Some(t0), &key(7)).await?;
            tx.set_heartbeat(id).await?;
            tx.set_hardware_report(id, b"hw").await?;
            tx.set_os_installation_request(
                id,
                &OsInstallationRequest {
                    generation: 3,
                    request_raw: b"req".to_vec(),
                },
            )
            .await?;
            tx.set_os_installation_report(
                id,
                &OsInstallationReport {
                    generation: 3,
                    result: InstallationResult::Error,
                    report_raw: b"rep".to_vec(),
                },
            )
            .await?;
            let pinned = tx.pin_ssh_host_key(id, "ssh-ed25519 AAAA first").await?;
            assert_eq!(pinned.key, "ssh-ed25519 AAAA first");
            // Pinning the same key again is no change; another key is refused, naming both.
            let same = tx.pin_ssh_host_key(id, "ssh-ed25519 AAAA first").await?;
            assert_eq!(same.key, "ssh-ed25519 AAAA first");
            let other = tx.pin_ssh_host_key(id, "ssh-ed25519 BBBB second").await;
            assert!(
                matches!(&other, Err(Error::HostKeyPinned { pinned, presented })
                    if pinned == "ssh-ed25519 AAAA first" && presented == "ssh-ed25519 BBBB second"),
                "{other:?}"
            );
            assert_eq!(tx.ssh_host_key(id).await?.unwrap().key, "ssh-ed25519 AAAA first");
            Ok(())
        })
    })
    .await
    .unwrap();

    db.read(move |tx| {
        Box::pin(async move {
            let p = tx.provided(id).await?.unwrap();
            assert_eq!(p.ip_address.as_deref(), Some("192.0.2.1"));
            assert_eq!(p.status, Some(ProviderStatus::Running));
            assert_eq!(p.facts.get("cpus"), Some("64"));
            assert_eq!(
                p.facts.get("resource_class"),
                Some("baremetal \"large\" ünïcode")
            );
            assert_eq!(
                tx.machine_by_provider_id(ProviderKind::Static, &p.provider_id)
                    .await?,
                Some(id)
            );
            let started = tx.agent_started(id).await?.unwrap();
            assert_eq!(started.public_key, key(7));
            assert_eq!(started.started_at.timestamp_micros(), t0.timestamp_micros());
            assert!(tx.agent_key_matches(id, &key(7)).await?);
            assert!(!tx.agent_key_matches(id, &key(8)).await?);
            let hb = tx.heartbeat(id).await?.unwrap();
            assert!(
                (Utc::now() - hb).num_seconds().abs() < 60,
                "heartbeat time {hb}"
            );
            assert_eq!(tx.hardware_report(id).await?.unwrap(), b"hw");
            assert_eq!(tx.os_installation_request(id).await?.unwrap().generation, 3);
            assert_eq!(
                tx.os_installation_report(id).await?.unwrap().result,
                InstallationResult::Error
            );
            assert_eq!(tx.provided_by(ProviderKind::Static).await?.len(), 1);
            assert!(tx.provided_by(ProviderKind::Sim).await?.is_empty());
            Ok(())
        })
    })
    .await
    .unwrap();

    // Bad values are refused with a clear error and write nothing.
    let err = db
        .transact(move |tx| Box::pin(async move { tx.set_agent_started(id, &[1, 2, 3]).await }))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("32 bytes"), "{err}");
    let err = db
        .transact(move |tx| {
            Box::pin(async move {
                tx.set_provided(id, &Provided::new(ProviderKind::Static, "x".repeat(129)))
                    .await
            })
        })
        .await
        .unwrap_err();
    assert!(err.to_string().contains("provider id"), "{err}");
    // Unique (provider, provider_id): a second machine cannot claim the same provider id.
    let other = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let dup = db
        .transact(move |tx| {
            Box::pin(async move {
                tx.set_provided(
                    other,
                    &Provided::new(ProviderKind::Static, id.simple().to_string()),
                )
                .await
            })
        })
        .await;
    assert!(dup.is_err(), "duplicate provider id accepted");

    // Each delete says whether there was a row; the second heartbeat delete finds none.
    let deleted = db
        .transact(move |tx| {
            Box::pin(async move {
                let started = tx.delete_agent_started(id).await?;
                let beats = [
                    tx.delete_heartbeat(id).await?,
                    tx.delete_heartbeat(id).await?,
                ];
                Ok((started, beats))
            })
        })
        .await
        .unwrap();
    assert_eq!(deleted, (true, [true, false]));
}
/// The heartbeat hot path: authorization by key, the write, the pending request, and an
/// expired session refusing to write.
async fn agent_heartbeats(db: Bmdb) {
    let s = session(&db, "bmsrv").await;
    let (key, other) = (vec![7u8; 32], vec![8u8; 32]);
    let m = testing::machine_with_agent(&db, &key).await;
    let beat = |db: Bmdb| async move {
        db.read(move |tx| Box::pin(async move { tx.heartbeat(m).await }))
            .await
            .unwrap()
    };
    assert_eq!(
        s.agent_heartbeat(m, &other, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Unauthorized
    );
    assert_eq!(
        s.agent_heartbeat(Uuid::new_v4(), &key, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Unauthorized
    );
    assert!(
        beat(db.clone()).await.is_none(),
        "written without authorization"
    );
    assert_eq!(
        s.agent_heartbeat(m, &key, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Recorded {
            pending_request: None
        }
    );
    let first = beat(db.clone()).await.unwrap();

    let request = |generation| OsInstallationRequest {
        generation,
        request_raw: vec![generation as u8; 3],
    };
    db.transact(move |tx| {
        Box::pin(async move { tx.set_os_installation_request(m, &request(1)).await })
    })
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(
        s.agent_heartbeat(m, &key, &AgentReport::default())
            .await
            .unwrap(),
        AgentHeartbeat::Recorded {
            pending_request: Some(vec![1; 3])
        }
    );
    assert!(
        beat(db.clone()).await.unwrap() > first,
        "heartbeat time moves"
    );
    let report = |generation| OsInstallationReport {
        generation,
        result: InstallationResult::Success,
        report_raw: vec![],
    };
    // Reports travel with a heartbeat, through the same entry point and the same key check.
    let with_report = AgentReport {
        hardware: Some(vec![9; 4]),
        installation: Some(report(1)),
    };
    let stored = |db: Bmdb| async move {
        db.read(move |tx| {
            Box::pin(async move {
                Ok((
                    tx.hardware_report(m).await?,
                    tx.os_installation_report(m).await?,
                ))
            })
        })
        .await
        .unwrap()
    };
    assert_eq!(
        s.agent_heartbeat(m, &other, &with_report).await.unwrap(),
        AgentHeartbeat::Unauthorized
    );
    assert_eq!(
        stored(db.clone()).await,
        (None, None),
        "stored without authorization"
    );
    assert_eq!(
        s.agent_heartbeat(m, &key, &with_report).await.unwrap(),
        AgentHeartbeat::Recorded {
            pending_request: None
        },
        "the report fulfils the request it answers"
    );
    assert_eq!(
        stored(db.clone()).await,
        (Some(vec![9; 4]), Some(report(1)))
    );

    // A session whose row is gone may not write.
    let dead = session(&db, "bmsrv-dead").await;
    let id = dead.id();
    dead.stop_keepalive();
    db.transact(move |tx| Box::pin(async move { tx.delete_session_raw(id).await }))
        .await
        .unwrap();
    let before = beat(db.clone()).await;
    assert!(matches!(
        dead.agent_heartbeat(m, &key, &AgentReport::default()).await,
        Err(Error::SessionExpired)
    ));
    assert_eq!(beat(db.clone()).await, before);
}
/// Concurrent bare heartbeats are group-committed: far fewer transactions than heartbeats,
/// yet each caller gets its own answer — authorized or not, with its own pending request —
/// and only authorized heartbeats are written.
async fn heartbeats_are_group_committed(db: Bmdb) {
    const MACHINES: usize = 300;
    let s = session(&db, "bmsrv").await;
    let machines: Vec<Uuid> = db
        .transact(|tx| {
            Box::pin(async move {
                let mut ids = Vec::new();
                for i in 0..MACHINES {
                    let id = tx.create_machine().await?;
                    tx.set_agent_started(id, &[(i % 200) as u8; 32]).await?;
                    if i % 3 == 0 {
                        let request = OsInstallationRequest {
                            generation: i as i64,
                            request_raw: vec![i as u8; 2],
                        };
                        tx.set_os_installation_request(id, &request).await?;
                    }
                    ids.push(id);
                }
                Ok(ids)
            })
        })
        .await
        .unwrap();
    let (batches_before, _) = db.metrics().heartbeat_batches(s.processor());
    // Every fifth agent presents the wrong key; the first ten heartbeat twice at once (the
    // same machine twice in one batch is written once and answered twice).
    let key_of = |i: usize| {
        if i % 5 == 4 {
            [255u8; 32]
        } else {
            [(i % 200) as u8; 32]
        }
    };
    let expected = |i: usize| {
        if i % 5 == 4 {
            AgentHeartbeat::Unauthorized
        } else {
            AgentHeartbeat::Recorded {
                pending_request: i.is_multiple_of(3).then(|| vec![i as u8; 2]),
            }
        }
    };
    let mut calls = Vec::new();
    for (i, &machine) in machines[..10].iter().chain(&machines).enumerate() {
        let i = if i < 10 { i } else { i - 10 };
        let (s, key) = (s.clone(), key_of(i));
        let call = tokio::spawn(async move {
            s.agent_heartbeat(machine, &key, &AgentReport::default())
                .await
                .unwrap()
        });
        calls.push((i, call));
    }
    for (i, call) in calls {
        assert_eq!(call.await.unwrap(), expected(i), "heartbeat {i}");
    }
    let written = db
        .read(move |tx| {
            let machines = machines.clone();
            Box::pin(async move {
                let mut written = Vec::new();
                for m in machines {
                    written.push(tx.heartbeat(m).await?.is_some());
                }
                Ok(written)
            })
        })
        .await
        .unwrap();
    for (i, written) in written.into_iter().enumerate() {
        assert_eq!(written, i % 5 != 4, "heartbeat {i} written");
    }
    let (batches, beats) = db.metrics().heartbeat_batches(s.processor());
    let batches = batches - batches_before;
    assert_eq!(beats, MACHINES as u64 + 10);
    assert!(
        batches * 4 <= MACHINES as u64,
        "{MACHINES} concurrent heartbeats took {batches} transactions"
    );
}

/// A finish records the live proof its agent showed with the agent's start (in the ending's
/// one statement on Postgres, after it on SQLite); a later start that shows none leaves none.
async fn a_live_proof_is_recorded_with_its_start_and_no_later_start_inherits_it(db: Bmdb) {
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let s = session(&db, "initializer").await;
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    w.finish(
        TagWrites::none()
            .agent_started(key(1))
            .live_proof("proof-1"),
    )
    .await
    .unwrap();
    let shown = || {
        db.read(move |tx| {
            Box::pin(async move {
                let key = tx.agent_started(id).await?.map(|a| a.public_key);
                Ok((key, tx.agent_live_proof(id).await?))
            })
        })
    };
    assert_eq!(
        shown().await.unwrap(),
        (Some(key(1)), Some("proof-1".into()))
    );
    db.transact(move |tx| Box::pin(async move { tx.set_agent_started(id, &key(2)).await }))
        .await
        .unwrap();
    assert_eq!(shown().await.unwrap(), (Some(key(2)), None));
    s.close().await.unwrap();
}

/// The disk an agent chose lasts for its machine's way: a phase entered without one keeps
/// it, one entered with another replaces it, and a new way (the machine recorded bare again,
/// as a reimage does) forgets it.
async fn a_chosen_disk_lasts_for_its_way(db: Bmdb) {
    use BarePhase::*;
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let record = || {
        db.transact(move |tx| Box::pin(async move { tx.record_bare(id, None, "bare", None).await }))
    };
    record().await.unwrap();
    let s = db
        .start_session(SessionConfig::new("bare", Processor::ShepherdBareMetal))
        .await
        .unwrap();
    let retrieval = Retrieval::BareMetal {
        provider: ProviderKind::Sim,
        timeouts: BareTimeouts::default(),
    };
    let w = claimed(s.work(Process::ShepherdBareMetal, retrieval).await.unwrap());
    let session = s.id();
    let enter = |from, to, chosen: Option<&str>| {
        let writes = PhaseWrites {
            chosen_disk: chosen.map(String::from),
            ..PhaseWrites::default()
        };
        db.transact(move |tx| {
            let writes = writes.clone();
            Box::pin(async move {
                tx.enter_bare_phase(session, id, (from, to), &writes, "step")
                    .await
            })
        })
    };
    let chosen = || {
        db.read(move |tx| {
            Box::pin(async move { Ok(tx.bare_metal(id).await?.unwrap().chosen_disk) })
        })
    };
    let (first, second) = (r#"{"serial":"s== A"}"#, r#"{"wwn":"s== 0x5"}"#);
    enter(Bare, Inserting, None).await.unwrap();
    assert_eq!(chosen().await.unwrap(), None);
    enter(Inserting, LiveBoot, Some(first)).await.unwrap();
    enter(LiveBoot, Installing, None).await.unwrap();
    assert_eq!(chosen().await.unwrap().as_deref(), Some(first));
    enter(Installing, LiveBoot, Some(second)).await.unwrap();
    assert_eq!(chosen().await.unwrap().as_deref(), Some(second));
    drop(w);
    record().await.unwrap();
    assert_eq!(chosen().await.unwrap(), None, "a new way chooses anew");
    s.close().await.unwrap();
}

shepherd_bmdb::conformance_tests!(
    a_chosen_disk_lasts_for_its_way,
    a_live_proof_is_recorded_with_its_start_and_no_later_start_inherits_it,
    tags_round_trip,
    agent_heartbeats,
    heartbeats_are_group_committed,
);
