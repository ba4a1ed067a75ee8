//! The database as a whole: migrations, transactions dropped midway, the summary views.

use super::*;

async fn migrations_are_idempotent(db: Bmdb) {
    assert_eq!(db.schema_version().await.unwrap(), SCHEMA_VERSION);
    assert_eq!(
        db.migrate().await.unwrap(),
        (SCHEMA_VERSION, SCHEMA_VERSION)
    );
    db.check_schema().await.unwrap();
}
async fn summaries_and_fleet_counts(db: Bmdb) {
    let (seeded, session) = testing::seed_every_state(&db).await;
    let now = Utc::now();
    let all = db
        .read(|tx| Box::pin(async move { tx.machine_summaries(None, None, 1000).await }))
        .await
        .unwrap();
    assert_eq!(all.len(), seeded.len());
    for m in &seeded {
        let s = all.iter().find(|s| s.machine_id == m.id).expect("listed");
        assert_eq!(
            s.lifecycle(now, RecoveryThresholds::default().stale_after()),
            m.state,
            "{m:?}: {s:?}"
        );
        assert_eq!(
            s.provided.as_ref().map(|p| p.provider_id.clone()),
            m.provider_id
        );
    }
    let in_work = seeded
        .iter()
        .find(|m| m.state == Lifecycle::InWork)
        .unwrap();
    let one = db
        .read({
            let id = in_work.id;
            move |tx| Box::pin(async move { tx.machine_summary(id).await })
        })
        .await
        .unwrap()
        .unwrap();
    assert_eq!(one.work, vec![Process::ShepherdAgentStart]);
    let sid = session.id();
    let held = db
        .read(move |tx| Box::pin(async move { tx.session_work(sid).await }))
        .await
        .unwrap();
    assert_eq!(held, vec![(in_work.id, Process::ShepherdAgentStart)]);
    assert!(db
        .read(|tx| Box::pin(async move { tx.machine_summary(Uuid::new_v4()).await }))
        .await
        .unwrap()
        .is_none());

    // Paging in id order with a provider filter visits every Static machine exactly once.
    let mut after = None;
    let mut paged = vec![];
    loop {
        let page = db
            .read(move |tx| {
                Box::pin(async move {
                    tx.machine_summaries(after, Some(ProviderKind::Static), 3)
                        .await
                })
            })
            .await
            .unwrap();
        let Some(last) = page.last() else { break };
        after = Some(last.machine_id);
        paged.extend(page.into_iter().map(|s| s.machine_id));
    }
    let mut want: Vec<Uuid> = seeded
        .iter()
        .filter(|m| m.provider_id.as_deref().is_some_and(|p| p != "box-0"))
        .map(|m| m.id)
        .collect();
    want.sort();
    assert_eq!(paged, want);

    let c = fleet_counts(&db).await;
    assert_eq!(c.machines, 9);
    assert_eq!(
        c.provided,
        vec![(ProviderKind::Sim, 1), (ProviderKind::Static, 7)]
    );
    assert_eq!(c.agent_started, 5);
    assert_eq!((c.heartbeating, c.stale), (3, 1));
    assert_eq!((c.pending_install, c.installed), (1, 1));
    assert_eq!(c.work, vec![(Process::ShepherdAgentStart, 1)]);
    assert_eq!(c.backoffs, vec![(Process::ShepherdAgentStart, 1)]);
    assert_eq!(c.missing, 0);

    // A provided machine the provider stopped listing counts as missing.
    let listed = seeded
        .iter()
        .find(|m| m.provider_id.is_some())
        .expect("a provided machine")
        .id;
    db.transact(move |tx| {
        Box::pin(async move {
            let mut p = tx.provided(listed).await?.expect("provided");
            p.status = Some(ProviderStatus::Missing);
            tx.set_provided(listed, &p).await
        })
    })
    .await
    .unwrap();
    assert_eq!(fleet_counts(&db).await.missing, 1);

    // As upstream counts: an Error report of the current generation is installed (no longer
    // pending), and counted among the failed ones too.
    db.transact(|tx| {
        Box::pin(async move {
            let id = tx.create_machine().await?;
            tx.set_os_installation_request(
                id,
                &OsInstallationRequest {
                    generation: 2,
                    request_raw: vec![],
                },
            )
            .await?;
            tx.set_os_installation_report(
                id,
                &OsInstallationReport {
                    generation: 2,
                    result: InstallationResult::Error,
                    report_raw: vec![],
                },
            )
            .await
        })
    })
    .await
    .unwrap();
    let c = fleet_counts(&db).await;
    assert_eq!(
        (c.pending_install, c.installed, c.install_failed),
        (1, 2, 1)
    );
    session.close().await.unwrap();
}
/// A transaction dropped at any point (a shutdown, a timeout) leaves no transaction open on
/// its connection and nothing half-written: every later transaction works, and each
/// transaction's two machines were written together or not at all.
async fn cancelled_transactions_leave_nothing_open(db: Bmdb) {
    let session = db
        .start_session(SessionConfig::new("cancel-test", Processor::Unknown))
        .await
        .unwrap();
    let mut rng = StdRng::seed_from_u64(7);
    for i in 0..300 {
        // From "before BEGIN is sent" to "after COMMIT": cancellation lands everywhere.
        let within = Duration::from_micros(rng.random_range(0..3_000));
        fn two_machines(tx: &mut Tx) -> TxFuture<'_, ()> {
            Box::pin(async move {
                tx.create_machine().await?;
                tx.create_machine().await?;
                Ok(())
            })
        }
        if i % 2 == 0 {
            let _ = tokio::time::timeout(within, db.transact(two_machines)).await;
        } else {
            let _ = tokio::time::timeout(within, session.transact(two_machines)).await;
        }
    }
    for _ in 0..20 {
        db.transact(|tx| Box::pin(async move { tx.create_machine().await }))
            .await
            .expect("a transaction after cancellations");
        session
            .transact(|tx| Box::pin(async move { tx.create_machine().await }))
            .await
            .expect("a session transaction after cancellations");
    }
    let machines = db
        .read(|tx| Box::pin(async move { tx.machine_ids(None, 100_000).await }))
        .await
        .unwrap()
        .len();
    assert_eq!(
        machines % 2,
        0,
        "a transaction was half-written: {machines} machines"
    );
    session.close().await.unwrap();
}

/// The recoverer's backoff is read apart from the others: a machine whose agent heartbeats
/// again after its reboot shows heartbeating, one still silent shows in backoff.
async fn the_recoverers_backoff_holds_back_only_a_silent_machine(db: Bmdb) {
    let until = Utc::now() + chrono::Duration::minutes(5);
    let (heartbeating, silent) = db
        .transact(move |tx| {
            Box::pin(async move {
                let mut ids = vec![];
                for beats in [true, false] {
                    let id = tx.create_machine().await?;
                    tx.set_agent_started(id, &[7; 32]).await?;
                    if beats {
                        tx.set_heartbeat(id).await?;
                    }
                    let cause = "rebooted 2 times in a row";
                    tx.set_backoff(id, Process::ShepherdRecovery, until, 60, cause)
                        .await?;
                    ids.push(id);
                }
                Ok((ids[0], ids[1]))
            })
        })
        .await
        .unwrap();
    let stale_after = RecoveryThresholds::default().stale_after();
    for (id, state) in [
        (heartbeating, Lifecycle::Heartbeating),
        (silent, Lifecycle::InBackoff),
    ] {
        let s = db
            .read(move |tx| Box::pin(async move { tx.machine_summary(id).await }))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(s.backoff_until, None, "{s:?}");
        assert!(s.recovery_backoff_until.is_some(), "{s:?}");
        assert_eq!(s.lifecycle(Utc::now(), stale_after), state, "{s:?}");
    }
}

shepherd_bmdb::conformance_tests!(
    migrations_are_idempotent,
    summaries_and_fleet_counts,
    the_recoverers_backoff_holds_back_only_a_silent_machine,
    cancelled_transactions_leave_nothing_open,
);
