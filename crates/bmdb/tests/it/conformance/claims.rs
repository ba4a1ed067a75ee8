//! Claims (`sql/claims.rs`): exclusive under parallelism, eligibility against a model of
//! design.md §5, sparse fleets, two SQLite handles, Postgres hints.

use super::*;

/// 16 workers in 4 sessions over 1,000 machines: every machine is processed exactly once and
/// no two work intervals on one machine overlap, as the audit history shows.
async fn claims_are_exclusive_under_parallelism(db: Bmdb) {
    const MACHINES: usize = 1000;
    testing::provision(&db, MACHINES, ProviderKind::Sim).await;
    let conflicts = Arc::new(AtomicU64::new(0));
    let claims = Arc::new(AtomicU64::new(0));
    let mut workers = vec![];
    for s in 0..4 {
        let session = session(&db, &format!("replica-{s}")).await;
        for _ in 0..4 {
            let (session, conflicts, claims) = (session.clone(), conflicts.clone(), claims.clone());
            workers.push(tokio::spawn(async move {
                let mut idle = 0;
                while idle < 3 {
                    match session
                        .work(Process::ShepherdAgentStart, START)
                        .await
                        .unwrap()
                    {
                        Claim::Work(mut w) => {
                            idle = 0;
                            claims.fetch_add(1, Ordering::Relaxed);
                            tokio::task::yield_now().await;
                            w.finish(TagWrites::none().agent_started(key(9)))
                                .await
                                .unwrap();
                        }
                        Claim::Conflict => {
                            conflicts.fetch_add(1, Ordering::Relaxed);
                        }
                        Claim::NothingToDo => {
                            idle += 1;
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    }
                }
            }));
        }
    }
    for w in workers {
        w.await.unwrap();
    }
    let claims = claims.load(Ordering::Relaxed);
    let conflicts = conflicts.load(Ordering::Relaxed);
    assert_eq!(claims, MACHINES as u64, "each machine claimed exactly once");
    assert!(
        (conflicts as f64) < 0.01 * (claims + conflicts) as f64,
        "conflict rate too high: {conflicts} conflicts in {} attempts",
        claims + conflicts
    );
    let status = db.status_counts().await.unwrap();
    assert_eq!(status.agent_started, MACHINES as i64);
    assert!(status.work.is_empty());
    // The workers' concurrent claims were served together, not one statement each.
    let (batches, requests) = db.metrics().claim_batches(Processor::ShepherdInitializer);
    assert!(
        requests >= claims + conflicts,
        "every request was in a batch"
    );
    assert!(
        batches < requests,
        "{requests} claims in {batches} batches: none shared"
    );

    // Audit: per (machine, process) events alternate Started / ending, never two Started in a row.
    let entries = testing::all_history(&db).await;
    let mut open: HashMap<(Uuid, Process), Uuid> = HashMap::new();
    let mut started: HashMap<Uuid, u32> = HashMap::new();
    for e in &entries {
        let k = (e.machine_id, e.process);
        match e.event {
            WorkEvent::Started => {
                assert!(
                    open.insert(k, e.session_id.unwrap()).is_none(),
                    "overlapping work on {k:?}"
                );
                *started.entry(e.machine_id).or_default() += 1;
            }
            _ => {
                let holder = open
                    .remove(&k)
                    .unwrap_or_else(|| panic!("{:?} without Started on {k:?}", e.event));
                assert_eq!(Some(holder), e.session_id, "ended by another session");
            }
        }
    }
    assert!(open.is_empty());
    assert_eq!(started.len(), MACHINES);
    assert!(started.values().all(|n| *n == 1));
}
/// A fleet where almost every machine is ineligible (agents started): claims still find the
/// few eligible ones wherever they are, then report nothing to do.
async fn sparse_eligible_machines_are_found(db: Bmdb) {
    let ids = testing::provision(&db, 1500, ProviderKind::Sim).await;
    let keep: BTreeSet<Uuid> = [ids[3], ids[700], ids[1499]].into_iter().collect();
    start_all_but(&db, &ids, &keep).await;
    let s = session(&db, "sparse").await;
    let mut found = BTreeSet::new();
    for _ in 0..3 {
        found.insert(claim_and_start(&s).await);
    }
    assert_eq!(found, keep);
    for _ in 0..5 {
        assert!(matches!(
            s.work(Process::ShepherdAgentStart, START).await.unwrap(),
            Claim::NothingToDo
        ));
    }
}
#[derive(Debug, Clone)]
struct Fleet {
    id: Uuid,
    provider: ProviderKind,
    started_min_ago: Option<i64>,
    heartbeat_min_ago: Option<i64>,
    request_gen: Option<i64>,
    report: Option<(i64, InstallationResult)>,
    work: Option<Process>,
    backoff: Option<(Process, bool)>,
    /// Phase, minutes since it was entered, installation generation asked for.
    bare: Option<(BarePhase, i64, Option<i64>)>,
}
fn model_eligible(m: &Fleet, process: Process, retrieval: &Retrieval) -> bool {
    if m.provider != retrieval.provider() {
        return false;
    }
    if m.work.is_some_and(|w| process.exclusion_set().contains(&w)) {
        return false;
    }
    if m.backoff.is_some_and(|(p, active)| p == process && active) {
        return false;
    }
    let report_gen_matches = |req: i64, need_success: bool| {
        m.report
            .is_some_and(|(g, r)| g == req && (!need_success || r == InstallationResult::Success))
    };
    let bare_phase = m.bare.map(|(phase, _, _)| phase);
    match retrieval {
        Retrieval::AgentStart { .. } => {
            m.started_min_ago.is_none()
                && !m.request_gen.is_some_and(|g| report_gen_matches(g, false))
                && bare_phase.is_none_or(|p| BarePhase::TAKEOVER.contains(&p))
        }
        Retrieval::AgentRecovery { thresholds, .. } => {
            let Some(started) = m.started_min_ago else {
                return false;
            };
            if m.request_gen.is_some_and(|g| report_gen_matches(g, true)) {
                return false;
            }
            if bare_phase.is_some_and(|p| p != BarePhase::Done) {
                return false;
            }
            let start_limit = thresholds.no_heartbeat_after_start.as_secs() as i64 / 60;
            let hb_limit = thresholds.heartbeat_older_than.as_secs() as i64 / 60;
            match m.heartbeat_min_ago {
                None => started > start_limit,
                Some(hb) => hb > hb_limit,
            }
        }
        Retrieval::BareMetal { timeouts, .. } => {
            let Some((phase, min_ago, generation)) = m.bare else {
                return false;
            };
            let past = |limit: Duration| min_ago > limit.as_secs() as i64 / 60;
            match phase {
                BarePhase::Bare
                | BarePhase::Inserting
                | BarePhase::StartingLive
                | BarePhase::Ejecting
                | BarePhase::StartingDisk => true,
                BarePhase::LiveBoot => past(timeouts.live_boot) || m.started_min_ago.is_some(),
                BarePhase::Installing => {
                    past(timeouts.install) || m.report.is_some_and(|(g, _)| Some(g) == generation)
                }
                BarePhase::DiskBoot => past(timeouts.disk_boot) || m.heartbeat_min_ago.is_some(),
                BarePhase::Done | BarePhase::Failed => false,
            }
        }
    }
}
async fn eligibility_matches_model(db: Bmdb) {
    let seed: u64 = rand::random();
    eprintln!("eligibility fleet seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let holder = session(&db, "holder").await;
    let procs = [
        Process::ShepherdAgentStart,
        Process::ShepherdRecovery,
        Process::ShepherdAccess,
        Process::ShepherdBareMetal,
        Process::UnitTest1,
    ];
    let mut fleet = vec![];
    for _ in 0..400 {
        let pick = |rng: &mut StdRng, p: f64| rng.random_bool(p);
        let started = pick(&mut rng, 0.6).then(|| [1, 20, 45, 120][rng.random_range(0..4)]);
        fleet.push(Fleet {
            id: Uuid::nil(),
            provider: if pick(&mut rng, 0.8) {
                ProviderKind::Sim
            } else {
                ProviderKind::Static
            },
            started_min_ago: started,
            heartbeat_min_ago: (started.is_some() && pick(&mut rng, 0.6))
                .then(|| [1, 5, 15, 60][rng.random_range(0..4)]),
            request_gen: pick(&mut rng, 0.3).then(|| rng.random_range(1..3)),
            report: pick(&mut rng, 0.3).then(|| {
                let r = if pick(&mut rng, 0.5) {
                    InstallationResult::Success
                } else {
                    InstallationResult::Error
                };
                (rng.random_range(1..3), r)
            }),
            work: pick(&mut rng, 0.2).then(|| procs[rng.random_range(0..procs.len())]),
            backoff: pick(&mut rng, 0.25).then(|| {
                let p = if pick(&mut rng, 0.5) {
                    Process::ShepherdAgentStart
                } else {
                    Process::ShepherdRecovery
                };
                (p, pick(&mut rng, 0.5))
            }),
            bare: pick(&mut rng, 0.3).then(|| {
                let phase = BarePhase::ALL[rng.random_range(0..BarePhase::ALL.len())];
                let generation = pick(&mut rng, 0.7).then(|| rng.random_range(1..3));
                (phase, [1, 20, 45, 120][rng.random_range(0..4)], generation)
            }),
        });
    }
    let sid = holder.id();
    let fleet = db
        .transact(move |tx| {
            let mut fleet = fleet.clone();
            Box::pin(async move {
                let now = tx.now().await?;
                let ago = |min: i64| now - chrono::Duration::minutes(min);
                for m in fleet.iter_mut() {
                    m.id = tx.create_machine().await?;
                    tx.set_provided(m.id, &Provided::new(m.provider, m.id.to_string()))
                        .await?;
                    if let Some(min) = m.started_min_ago {
                        tx.set_agent_started_at(m.id, Some(ago(min)), &key(3))
                            .await?;
                    }
                    if let Some(min) = m.heartbeat_min_ago {
                        tx.set_heartbeat_at(m.id, ago(min)).await?;
                    }
                    if let Some(g) = m.request_gen {
                        tx.set_os_installation_request(
                            m.id,
                            &OsInstallationRequest {
                                generation: g,
                                request_raw: vec![],
                            },
                        )
                        .await?;
                    }
                    if let Some((g, result)) = m.report {
                        tx.set_os_installation_report(
                            m.id,
                            &OsInstallationReport {
                                generation: g,
                                result,
                                report_raw: vec![],
                            },
                        )
                        .await?;
                    }
                    if let Some(p) = m.work {
                        tx.insert_work_raw(m.id, sid, p).await?;
                    }
                    if let Some((phase, min, generation)) = m.bare {
                        tx.set_bare_metal_raw(m.id, phase, ago(min), generation)
                            .await?;
                    }
                    if let Some((p, active)) = m.backoff {
                        let until = if active {
                            now + chrono::Duration::hours(1)
                        } else {
                            ago(1)
                        };
                        tx.set_backoff(m.id, p, until, 60, "test").await?;
                    }
                }
                Ok(fleet)
            })
        })
        .await
        .unwrap();

    let thresholds = RecoveryThresholds::default();
    let short = RecoveryThresholds {
        no_heartbeat_after_start: Duration::from_secs(600),
        heartbeat_older_than: Duration::from_secs(180),
    };
    let cases = [
        (
            Process::ShepherdAgentStart,
            Retrieval::AgentStart {
                provider: ProviderKind::Sim,
            },
        ),
        (
            Process::ShepherdAgentStart,
            Retrieval::AgentStart {
                provider: ProviderKind::Static,
            },
        ),
        (
            Process::UnitTest1,
            Retrieval::AgentStart {
                provider: ProviderKind::Sim,
            },
        ),
        (
            Process::ShepherdRecovery,
            Retrieval::AgentRecovery {
                provider: ProviderKind::Sim,
                thresholds,
            },
        ),
        (
            Process::ShepherdRecovery,
            Retrieval::AgentRecovery {
                provider: ProviderKind::Static,
                thresholds,
            },
        ),
        (
            Process::ShepherdRecovery,
            Retrieval::AgentRecovery {
                provider: ProviderKind::Sim,
                thresholds: short,
            },
        ),
        (
            Process::ShepherdBareMetal,
            Retrieval::BareMetal {
                provider: ProviderKind::Sim,
                timeouts: BareTimeouts::default(),
            },
        ),
        (
            Process::ShepherdBareMetal,
            Retrieval::BareMetal {
                provider: ProviderKind::Static,
                timeouts: BareTimeouts {
                    live_boot: Duration::from_secs(10 * 60),
                    install: Duration::from_secs(30 * 60),
                    disk_boot: Duration::from_secs(60 * 60),
                },
            },
        ),
    ];
    for (process, retrieval) in cases {
        let want: BTreeSet<Uuid> = fleet
            .iter()
            .filter(|m| model_eligible(m, process, &retrieval))
            .map(|m| m.id)
            .collect();
        let (got, count) = db
            .read(move |tx| {
                Box::pin(async move {
                    Ok((
                        tx.eligible_machines(process, &retrieval, 10_000).await?,
                        tx.count_eligible(process, &retrieval).await?,
                    ))
                })
            })
            .await
            .unwrap();
        let got: BTreeSet<Uuid> = got.into_iter().collect();
        assert_eq!(
            count as usize,
            got.len(),
            "count query disagrees for {process} {retrieval:?}"
        );
        if got != want {
            let extra: Vec<_> = fleet
                .iter()
                .filter(|m| got.contains(&m.id) && !want.contains(&m.id))
                .collect();
            let missing: Vec<_> = fleet
                .iter()
                .filter(|m| !got.contains(&m.id) && want.contains(&m.id))
                .collect();
            panic!(
                "{process} {retrieval:?} (seed {seed}):\nextra {extra:#?}\nmissing {missing:#?}"
            );
        }
        assert!(
            !want.is_empty() || process == Process::ShepherdRecovery,
            "degenerate fleet for {process}"
        );
    }
}
/// A worker that goes away while its claim is being made (its loop was cancelled) leaves no
/// machine locked: the work claimed for it is released with Canceled history.
async fn a_claim_nobody_waits_for_is_released(db: Bmdb) {
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let s = session(&db, "goes-away").await;
    let mut claim = Box::pin(s.work(Process::ShepherdAgentStart, START));
    assert!(
        futures::poll!(claim.as_mut()).is_pending(),
        "the claim was asked for"
    );
    drop(claim);
    let events = testing::eventually("the claim released", Duration::from_secs(10), async || {
        let events = testing::history_as(&db, |e| (e.machine_id, e.event)).await;
        let work = db.status_counts().await.unwrap().work;
        testing::when(events.len() == 2 && work.is_empty(), events)
    })
    .await;
    assert_eq!(
        events,
        [(id, WorkEvent::Started), (id, WorkEvent::Canceled)],
        "claimed, then released"
    );
    // Released, the machine is claimed again at once.
    assert_eq!(
        claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap()).machine_id(),
        id
    );
    s.close().await.unwrap();
}
/// Two handles on one SQLite file behave like two processes: they contend for the file's write
/// lock (BEGIN IMMEDIATE plus the busy timeout) and still never claim a machine twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_processes_share_one_sqlite_file() {
    let t = shepherd_bmdb::testing::sqlite().await;
    let other = Bmdb::open(&t.url).await.expect("second handle");
    testing::provision(&t.db, 300, ProviderKind::Sim).await;
    let mut workers = vec![];
    for db in [t.db.clone(), other.clone()] {
        for w in 0..4 {
            let s = session(&db, &format!("proc-worker-{w}")).await;
            workers.push(tokio::spawn(async move {
                let mut done = 0u32;
                loop {
                    match s.work(Process::ShepherdAgentStart, START).await.unwrap() {
                        Claim::Work(mut work) => {
                            work.finish(TagWrites::none().agent_started(key(5)))
                                .await
                                .unwrap();
                            done += 1;
                        }
                        Claim::Conflict => {}
                        Claim::NothingToDo => return done,
                    }
                }
            }));
        }
    }
    let mut total = 0;
    for w in workers {
        total += w.await.unwrap();
    }
    assert_eq!(total, 300);
    let counts = other.status_counts().await.unwrap();
    assert_eq!((counts.agent_started, counts.history_entries), (300, 600));
    other.close().await;
    t.cleanup().await;
}
fn searches(db: &Bmdb, search: ClaimSearch, claimed: bool) -> u64 {
    db.metrics().claim_searches(
        Processor::ShepherdInitializer,
        Process::ShepherdAgentStart,
        search,
        claimed,
    )
}
/// On Postgres a full search keeps its other candidates as hints for the next claims of the
/// same handle: a sparse fleet drains with one full search per many claims, each machine
/// claimed once; hints made stale by another replica are re-checked and never claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_claims_reuse_leftover_candidates() {
    let Some(t) = shepherd_bmdb::testing::postgres().await else {
        return;
    };
    let db = t.db.clone();
    let mut ids = testing::provision(&db, 3000, ProviderKind::Sim).await;
    // 40 eligible machines next to each other in the id index of 3,000: a window search (128
    // index entries after a random point) finds them only if it starts just before them,
    // about one claim in eighteen, so the first claims search everywhere. Spread out, the
    // window would hit most of the time and a run could go without a full search at all.
    ids.sort();
    let eligible: BTreeSet<Uuid> = ids[1000..1040].iter().copied().collect();
    start_all_but(&db, &ids, &eligible).await;

    let s = session(&db, "hinted").await;
    let mut found = BTreeSet::new();
    let mut searched = Vec::new();
    for _ in 0..20 {
        let before = [
            ClaimSearch::Hinted,
            ClaimSearch::Window,
            ClaimSearch::Everywhere,
        ]
        .map(|search| searches(&db, search, true));
        assert!(found.insert(claim_and_start(&s).await), "claimed twice");
        let after = [
            ClaimSearch::Hinted,
            ClaimSearch::Window,
            ClaimSearch::Everywhere,
        ]
        .map(|search| searches(&db, search, true));
        let served = (0..3)
            .filter(|i| after[*i] == before[*i] + 1)
            .collect::<Vec<_>>();
        assert_eq!(served.len(), 1, "each claim is served by one search");
        searched.push(["hinted", "window", "full"][served[0]]);
    }
    // Claims before the first full search may hit in the random window; the full search keeps
    // the other 39 candidates as hints and every later claim is served by them. Without hints
    // each later claim would search everywhere again.
    let first_full = searched.iter().position(|s| *s == "full");
    assert!(
        first_full.is_some_and(|i| i < 19 && searched[i + 1..].iter().all(|s| *s == "hinted")),
        "one full search, then hints serve every claim: {searched:?}"
    );

    // Another replica (its own handle, so it has no hints) processes the other 20. Our hints
    // now name machines that are no longer eligible: they must be dropped, not claimed.
    let other = Bmdb::open(&t.url).await.unwrap();
    let o = session(&other, "other-replica").await;
    for _ in 0..20 {
        assert!(found.insert(claim_and_start(&o).await), "claimed twice");
    }
    assert_eq!(found, eligible);
    let stale_before = searches(&db, ClaimSearch::Hinted, false);
    assert!(matches!(
        s.work(Process::ShepherdAgentStart, START).await.unwrap(),
        Claim::NothingToDo
    ));
    assert_eq!(
        searches(&db, ClaimSearch::Hinted, false),
        stale_before + 1,
        "the stale hints were checked"
    );
    // The full search found nothing, so no hints remain: the next claim searches afresh.
    let hinted_total = searches(&db, ClaimSearch::Hinted, false);
    assert!(matches!(
        s.work(Process::ShepherdAgentStart, START).await.unwrap(),
        Claim::NothingToDo
    ));
    assert_eq!(searches(&db, ClaimSearch::Hinted, false), hinted_total);
    for id in &eligible {
        let started = history(&db, *id)
            .await
            .iter()
            .filter(|e| e.event == WorkEvent::Started)
            .count();
        assert_eq!(started, 1, "machine {id} claimed once");
    }
    s.close().await.unwrap();
    o.close().await.unwrap();
    other.close().await;
    t.cleanup().await;
}

shepherd_bmdb::conformance_tests!(
    claims_are_exclusive_under_parallelism,
    sparse_eligible_machines_are_found,
    eligibility_matches_model,
    a_claim_nobody_waits_for_is_released,
);
