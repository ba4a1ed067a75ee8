//! Operators' actions (maintenance, retry, forgetting a host key, decommission) and history
//! retention, on both backends, with claiming workers running on the same machines.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::testing::{self, all_history, history_as, session};
use shepherd_bmdb::*;
use tokio::task::JoinHandle;
use uuid::Uuid;

const START: Retrieval = Retrieval::AgentStart {
    provider: ProviderKind::Sim,
};

fn alice(reason: &str) -> Operator {
    Operator::new("alice", reason).unwrap()
}

/// Workers that claim agent starts over and over, hold each for `hold`, and finish without
/// setting a tag (so every machine stays eligible): loops running on the same machines as the
/// operator. A finish whose lock an operator removed (decommission) is lost, not an error.
fn busy_workers(db: &Bmdb, n: usize, hold: Duration, stop: Arc<AtomicBool>) -> Vec<JoinHandle<()>> {
    (0..n)
        .map(|_| {
            let (db, stop) = (db.clone(), stop.clone());
            tokio::spawn(async move {
                let s = session(&db, Processor::ShepherdInitializer).await;
                while !stop.load(Ordering::Relaxed) {
                    match s.work(Process::ShepherdAgentStart, START).await.unwrap() {
                        Claim::Work(mut w) => {
                            tokio::time::sleep(hold).await;
                            match w.finish(TagWrites::none()).await {
                                Ok(()) | Err(Error::WorkLost { .. }) => {}
                                Err(e) => panic!("finish: {e}"),
                            }
                        }
                        Claim::Conflict => {}
                        Claim::NothingToDo => tokio::time::sleep(Duration::from_millis(5)).await,
                    }
                }
                s.close().await.unwrap();
            })
        })
        .collect()
}

async fn max_history_id(db: &Bmdb) -> i64 {
    all_history(db).await.last().map_or(0, |e| e.id)
}

async fn actions(db: &Bmdb, id: Uuid) -> Vec<ActionEntry> {
    db.read(move |tx| Box::pin(async move { tx.machine_actions(id).await }))
        .await
        .unwrap()
}

/// From the moment `maintenance_on` returns, no loop starts work on the machine, however many
/// workers are claiming; `maintenance_off` gives it back. Asserted from the audit history.
async fn maintenance_keeps_loops_away(db: Bmdb) {
    let machines = testing::provision(&db, 40, ProviderKind::Sim).await;
    let stop = Arc::new(AtomicBool::new(false));
    let workers = busy_workers(&db, 8, Duration::from_millis(1), stop.clone());
    let operator = session(&db, Processor::ShepherdOperator).await;
    // Let the workers get going on every machine first.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let mut since: HashMap<Uuid, i64> = HashMap::new();
    for id in &machines[..20] {
        let outcome = operator
            .maintenance_on(*id, &alice("disk swap"))
            .await
            .unwrap();
        assert!(matches!(outcome, ActionOutcome::Done(_)), "{outcome:?}");
        since.insert(*id, max_history_id(&db).await);
    }
    assert_eq!(
        operator
            .maintenance_on(machines[0], &alice("again"))
            .await
            .unwrap(),
        ActionOutcome::Unchanged
    );
    let watermark = max_history_id(&db).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Until each machine is given back: work may start on it only after this mark.
    let mut until: HashMap<Uuid, i64> = HashMap::new();
    for id in &machines[..10] {
        until.insert(*id, max_history_id(&db).await);
        let outcome = operator.maintenance_off(*id, &alice("")).await.unwrap();
        assert_eq!(outcome, ActionOutcome::Done(()));
    }
    let released = max_history_id(&db).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }

    let history = all_history(&db).await;
    let started_after = |id: &Uuid, after: i64| {
        history
            .iter()
            .filter(|e| e.machine_id == *id && e.id > after && e.event == WorkEvent::Started)
            .count()
    };
    for (id, mark) in &since {
        let until = until.get(id).copied().unwrap_or(i64::MAX);
        let violations = history
            .iter()
            .filter(|e| {
                e.machine_id == *id
                    && e.id > *mark
                    && e.id <= until
                    && e.event == WorkEvent::Started
            })
            .count();
        assert_eq!(violations, 0, "machine {id} was claimed in maintenance");
    }
    // The loops really were running: the other machines kept being claimed meanwhile, and
    // the machines given back were claimed again.
    let others: usize = machines[20..]
        .iter()
        .map(|id| started_after(id, watermark))
        .sum();
    assert!(others > 0, "no machine outside maintenance was claimed");
    let back: usize = machines[..10]
        .iter()
        .map(|id| started_after(id, released))
        .sum();
    assert!(back > 0, "no machine given back was claimed again");

    // Recorded with who and why, and shown as its own state.
    let a = actions(&db, machines[0]).await;
    let kinds: Vec<_> = a
        .iter()
        .map(|e| (e.action, e.by.as_str(), e.reason.as_str()))
        .collect();
    assert_eq!(
        kinds,
        vec![
            (OperatorAction::MaintenanceOn, "alice", "disk swap"),
            (OperatorAction::MaintenanceOff, "alice", ""),
        ]
    );
    let (summary, maintenance) = db
        .read({
            let id = machines[15];
            move |tx| {
                Box::pin(
                    async move { Ok((tx.machine_summary(id).await?, tx.maintenance(id).await?)) },
                )
            }
        })
        .await
        .unwrap();
    let now = chrono::Utc::now();
    assert_eq!(
        summary
            .unwrap()
            .lifecycle(now, chrono::Duration::minutes(10)),
        Lifecycle::Maintenance
    );
    assert_eq!(maintenance.unwrap().reason, "disk swap");
    let counts = db
        .read(|tx| Box::pin(async move { tx.fleet_counts(chrono::Duration::minutes(10)).await }))
        .await
        .unwrap();
    assert_eq!(counts.maintenance, 10);
    operator.close().await.unwrap();
}

/// Decommissioning machines while workers hold them: each lock ends as Canceled in the
/// history, the machine and its tags go, the provider id is barred until recommissioned, and
/// the history stays.
async fn decommission_while_loops_run(db: Bmdb) {
    let machines = testing::provision(&db, 30, ProviderKind::Sim).await;
    // Every machine has some history from before (a takeover long ago) to keep.
    let ids = machines.clone();
    db.transact(move |tx| {
        let ids = ids.clone();
        Box::pin(async move {
            let long_ago = tx.now().await? - chrono::Duration::days(3);
            for id in ids {
                let p = Process::ShepherdAgentStart;
                tx.insert_history_raw(id, p, WorkEvent::Started, long_ago, None)
                    .await?;
                tx.insert_history_raw(id, p, WorkEvent::Finished, long_ago, None)
                    .await?;
            }
            Ok(())
        })
    })
    .await
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let workers = busy_workers(&db, 6, Duration::from_millis(20), stop.clone());
    let operator = session(&db, Processor::ShepherdOperator).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // One machine is surely held by a loop when it is decommissioned.
    let holder = session(&db, Processor::ShepherdRecoverer).await;
    let mut held = loop {
        if let Claim::Work(w) = holder
            .work(Process::ShepherdAgentStart, START)
            .await
            .unwrap()
        {
            break w;
        }
    };
    let mut doomed: Vec<Uuid> = machines
        .iter()
        .copied()
        .filter(|m| *m != held.machine_id())
        .take(9)
        .collect();
    doomed.push(held.machine_id());
    let doomed = &doomed[..];
    // Retry and forget-host-key on machines the workers are claiming meanwhile.
    for id in machines.iter().filter(|m| !doomed.contains(m)).take(10) {
        let id = *id;
        in_backoff_with_pinned_key(&db, id, &[Process::ShepherdRecovery], "AAAAkey").await;
        let who = alice("fixed");
        assert_eq!(
            operator.retry(id, None, &who).await.unwrap(),
            ActionOutcome::Done(1)
        );
        assert!(matches!(
            operator.forget_host_key(id, &who).await.unwrap(),
            ActionOutcome::Done(_)
        ));
    }
    for id in doomed {
        let outcome = operator
            .decommission(*id, &alice("failed PSU"), false)
            .await
            .unwrap();
        match outcome {
            ActionOutcome::Done(Some(p)) => assert_eq!(p.provider_id, id.simple().to_string()),
            other => panic!("{other:?}"),
        }
    }
    assert!(matches!(
        held.finish(TagWrites::none()).await,
        Err(Error::WorkLost { .. })
    ));
    holder.close().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }

    // Every Started has exactly one ending, and no work started after a decommission.
    let history = all_history(&db).await;
    let mut open: HashMap<(Uuid, Process), i64> = HashMap::new();
    for e in &history {
        let k = (e.machine_id, e.process);
        match e.event {
            WorkEvent::Started => assert!(open.insert(k, e.id).is_none(), "overlap on {k:?}"),
            _ => assert!(open.remove(&k).is_some(), "{:?} without Started", e.event),
        }
    }
    assert!(open.is_empty(), "work left without an ending: {open:?}");
    let status = db.status_counts().await.unwrap();
    assert_eq!(status.machines, 20);
    assert!(status.work.is_empty());
    for id in doomed {
        let (exists, record, barred) = db
            .read({
                let id = *id;
                move |tx| {
                    Box::pin(async move {
                        Ok((
                            tx.machine_exists(id).await?,
                            tx.decommissioned(id).await?,
                            tx.is_decommissioned(ProviderKind::Sim, &id.simple().to_string())
                                .await?,
                        ))
                    })
                }
            })
            .await
            .unwrap();
        assert!(!exists);
        assert!(barred);
        let record = record.unwrap();
        assert_eq!(
            (record.by.as_str(), record.reason.as_str()),
            ("alice", "failed PSU")
        );
        assert!(
            history
                .iter()
                .any(|e| e.machine_id == *id && e.event == WorkEvent::Finished),
            "history of {id} was not kept"
        );
        // Decommissioning it again finds no machine.
        assert_eq!(
            operator
                .decommission(*id, &alice("again"), false)
                .await
                .unwrap(),
            ActionOutcome::NoSuchMachine
        );
    }
    let held_ended: Vec<_> = history
        .iter()
        .filter(|e| e.machine_id == held.machine_id() && e.event == WorkEvent::Canceled)
        .map(|e| e.cause.as_deref())
        .collect();
    assert_eq!(held_ended, [Some("machine decommissioned by alice")]);

    // Recommission lifts the bar, once.
    let id = doomed[0];
    match operator
        .recommission(id, &alice("PSU replaced"))
        .await
        .unwrap()
    {
        ActionOutcome::Done(d) => assert_eq!(d.provider_id, id.simple().to_string()),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        operator.recommission(id, &alice("")).await.unwrap(),
        ActionOutcome::NoSuchMachine
    );
    let barred = db
        .read(move |tx| Box::pin(async move { tx.decommissioned_ids(ProviderKind::Sim).await }))
        .await
        .unwrap();
    assert_eq!(barred.len(), 9);
    let kinds: Vec<_> = actions(&db, id).await.iter().map(|a| a.action).collect();
    assert_eq!(
        kinds,
        vec![OperatorAction::Decommission, OperatorAction::Recommission]
    );
    operator.close().await.unwrap();
}

/// Puts machine `id` in an hour's backoff of each of `processes` (cause "down") and pins
/// ed25519 host key `key`.
async fn in_backoff_with_pinned_key(db: &Bmdb, id: Uuid, processes: &[Process], key: &str) {
    let processes = processes.to_vec();
    let key = format!("ssh-ed25519 {key}");
    db.transact(move |tx| {
        let (processes, key) = (processes.clone(), key.clone());
        Box::pin(async move {
            let until = tx.now().await? + chrono::Duration::hours(1);
            for p in processes {
                tx.set_backoff(id, p, until, 3600, "down").await?;
            }
            tx.pin_ssh_host_key(id, &key).await
        })
    })
    .await
    .unwrap();
}

/// Retry and forget-host-key change the machine and say so in the operators' history; an
/// action with nothing to do writes nothing.
async fn retry_and_forget_host_key_are_recorded(db: Bmdb) {
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let operator = session(&db, Processor::ShepherdOperator).await;
    let both = [Process::ShepherdAgentStart, Process::ShepherdRecovery];
    in_backoff_with_pinned_key(&db, id, &both, "AAAAold").await;
    let who = alice("cable fixed");
    assert_eq!(
        operator
            .retry(id, Some(Process::ShepherdRecovery), &who)
            .await
            .unwrap(),
        ActionOutcome::Done(1)
    );
    assert_eq!(
        operator
            .retry(id, Some(Process::ShepherdRecovery), &who)
            .await
            .unwrap(),
        ActionOutcome::Unchanged
    );
    match operator
        .forget_host_key(id, &alice("reinstalled"))
        .await
        .unwrap()
    {
        ActionOutcome::Done(key) => assert_eq!(key.key, "ssh-ed25519 AAAAold"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        operator.forget_host_key(id, &alice("")).await.unwrap(),
        ActionOutcome::Unchanged
    );
    assert_eq!(
        operator.retry(Uuid::new_v4(), None, &who).await.unwrap(),
        ActionOutcome::NoSuchMachine
    );
    let (key, backoffs) = db
        .read(move |tx| {
            Box::pin(
                async move { Ok((tx.ssh_host_key(id).await?, tx.machine_backoffs(id).await?)) },
            )
        })
        .await
        .unwrap();
    assert!(key.is_none());
    assert!(
        backoffs.is_empty(),
        "forgetting the key ends the takeover's backoff"
    );
    let a = actions(&db, id).await;
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0].action, OperatorAction::Retry);
    assert_eq!(a[0].process, Some(Process::ShepherdRecovery));
    assert_eq!(a[0].reason, "cable fixed");
    assert_eq!(a[1].action, OperatorAction::ForgetHostKey);
    assert!(a[1].reason.contains("AAAAold"), "{}", a[1].reason);
    operator.close().await.unwrap();
}

/// Retention deletes old history in bounded batches, keeps Failed entries four times as long,
/// and leaves recent history alone.
async fn retention_prunes_in_batches_and_keeps_failures_longest(db: Bmdb) {
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    db.transact(move |tx| {
        Box::pin(async move {
            let now = tx.now().await?;
            let days = |d: i64| now - chrono::Duration::days(d);
            let p = Process::ShepherdAgentStart;
            for _ in 0..25 {
                tx.insert_history_raw(id, p, WorkEvent::Finished, days(30), None)
                    .await?;
            }
            tx.insert_history_raw(id, p, WorkEvent::Failed, days(30), Some("kept"))
                .await?;
            tx.insert_history_raw(id, p, WorkEvent::Failed, days(200), Some("old"))
                .await?;
            tx.insert_history_raw(id, p, WorkEvent::Started, days(1), None)
                .await?;
            Ok(())
        })
    })
    .await
    .unwrap();
    let operator = session(&db, Processor::ShepherdOperator).await;
    operator.maintenance_on(id, &alice("recent")).await.unwrap();
    let retention = HistoryRetention {
        batch: 7,
        max_batches: 2,
        ..HistoryRetention::new(Duration::from_secs(10 * 86400))
    };
    let first = operator.prune_history(&retention).await.unwrap();
    assert_eq!(first.work, 14, "one pass is bounded by its batches");
    let second = operator.prune_history(&retention).await.unwrap();
    assert_eq!(
        second.work, 12,
        "the rest, with the Failed entry past four times the retention"
    );
    assert_eq!(
        operator.prune_history(&retention).await.unwrap(),
        PrunedHistory::default()
    );
    let left = history_as(&db, |e| (e.event, e.cause.clone())).await;
    assert_eq!(
        left,
        vec![
            (WorkEvent::Failed, Some("kept".to_string())),
            (WorkEvent::Started, None)
        ]
    );
    assert_eq!(
        actions(&db, id).await.len(),
        1,
        "recent operators' history is kept"
    );
    operator.close().await.unwrap();
}

/// API tokens: made once per name, found by their secret only (the BMDB holds a hash),
/// revocable, expiring, and their use recorded.
async fn api_tokens_are_hashed_unique_revocable_and_expire(db: Bmdb) {
    let day = Duration::from_secs(86_400);
    let [alice, bob] = ["alice", "bob"].map(Actor::named);
    let (ci, secret) = db
        .create_api_token("ci", Role::Operator, day, &alice)
        .await
        .unwrap()
        .expect("a new name");
    assert_eq!((ci.role, ci.created_by.as_str()), (Role::Operator, "alice"));
    let lifetime = ci.times.expires_at - ci.times.created_at;
    assert_eq!(lifetime.num_seconds(), 86_400, "{ci:?}");
    let again = db.create_api_token("ci", Role::Admin, day, &bob).await;
    assert!(again.unwrap().is_none(), "a name is made once");
    let bad = db
        .create_api_token("no spaces", Role::Viewer, day, &bob)
        .await;
    assert!(matches!(bad, Err(Error::InvalidArgument { .. })), "{bad:?}");

    let found = db.api_token_for(secret.reveal()).await.unwrap();
    assert_eq!(found.as_ref(), Some(&ci));
    assert!(ci.is_valid_at(chrono::Utc::now()));
    let mut wrong = secret.reveal().to_string();
    wrong.pop();
    wrong.push('x');
    for text in [wrong.as_str(), "Bearer nothing", ""] {
        assert_eq!(db.api_token_for(text).await.unwrap(), None, "{text:?}");
    }

    db.api_tokens_used(&[ci.id]).await.unwrap();
    let used = db.api_token_for(secret.reveal()).await.unwrap().unwrap();
    assert!(used.times.last_used_at.is_some());

    let revoked = db.revoke_api_token("ci", &bob).await.unwrap().unwrap();
    assert!(!revoked.is_valid_at(chrono::Utc::now()), "{revoked:?}");
    assert_eq!(db.revoke_api_token("nope", &bob).await.unwrap(), None);

    let second = Duration::from_secs(1);
    let short = db.create_api_token("short", Role::Viewer, second, &alice);
    let (short, _) = short.await.unwrap().unwrap();
    assert!(!short.is_valid_at(short.times.created_at + chrono::Duration::seconds(2)));
    let (tokens, next) = db.api_tokens(None, MAX_TOKEN_PAGE).await.unwrap();
    let names: Vec<_> = tokens.iter().map(|t| t.name.as_str()).collect();
    assert_eq!((names, next), (vec!["ci", "short"], None));
    // A page at a time: each says where the next starts, the last that none follows.
    let (_, first) = db.api_tokens(None, 1).await.unwrap();
    assert_eq!(first.as_deref(), Some("ci"));
    let (second, next) = db.api_tokens(first.as_deref(), 1).await.unwrap();
    assert_eq!((second[0].name.as_str(), next), ("short", None));
    assert!(db.api_tokens(None, 0).await.is_err());
}

/// Retention deletes web sign-ins that expired or were revoked longer ago than their
/// retention, and nothing else: not a live sign-in, not a token made by name.
async fn retention_deletes_ended_sign_ins_only(db: Bmdb) {
    let second = Duration::from_secs(1);
    let day = Duration::from_secs(86_400);
    let [a, b, c] = ["oidc:a", "oidc:b", "oidc:c"].map(Actor::named);
    let expired = db.create_web_session(&a, Role::Viewer, second);
    let (expired, _) = expired.await.unwrap();
    let (revoked, _) = db.create_web_session(&b, Role::Viewer, day).await.unwrap();
    db.revoke_api_token(&revoked.name, &b).await.unwrap();
    let (live, _) = db.create_web_session(&c, Role::Viewer, day).await.unwrap();
    let short = db.create_api_token("short", Role::Viewer, second, &a);
    short.await.unwrap().unwrap();
    let s = session(&db, Processor::ShepherdRetention).await;
    // Ended, but within the retention: kept.
    assert_eq!(s.prune_ended(Ended::SignIns, day, 10, 10).await.unwrap(), 0);
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let pruned = s.prune_ended(Ended::SignIns, second, 1, 10).await;
    assert_eq!(pruned.unwrap(), 2);
    let (left, _) = db.api_tokens(None, MAX_TOKEN_PAGE).await.unwrap();
    let mut left: Vec<_> = left.into_iter().map(|t| t.name).collect();
    left.sort();
    let mut want = vec![live.name.clone(), "short".to_string()];
    want.sort();
    assert_eq!(left, want, "gone: {} and {}", expired.name, revoked.name);
    s.close().await.unwrap();
}

/// An action made through the operator API keeps the API request's id in the history.
async fn actions_keep_their_request_id(db: Bmdb) {
    let m = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let s = session(&db, Processor::Unknown).await;
    let who = Operator::new("token:ci", "rack 4 power work")
        .unwrap()
        .in_request("req-1");
    s.maintenance_on(m, &who).await.unwrap();
    s.maintenance_off(m, &alice("")).await.unwrap();
    let actions = db
        .read(move |tx| Box::pin(async move { tx.machine_actions(m).await }))
        .await
        .unwrap();
    let ids: Vec<_> = actions.iter().map(|a| a.request_id.as_deref()).collect();
    assert_eq!(ids, [Some("req-1"), None]);
    s.close().await.unwrap();
}

shepherd_bmdb::conformance_tests!(
    maintenance_keeps_loops_away,
    decommission_while_loops_run,
    retry_and_forget_host_key_are_recorded,
    retention_prunes_in_batches_and_keeps_failures_longest,
    api_tokens_are_hashed_unique_revocable_and_expire,
    retention_deletes_ended_sign_ins_only,
    actions_keep_their_request_id,
);
