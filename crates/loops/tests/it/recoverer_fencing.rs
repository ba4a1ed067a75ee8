//! The recoverer's resets are fenced by its lease (Postgres). Two recoverers ("replicas") over
//! one BMDB reboot machines whose agents went silent, through a provider whose lookups are
//! slow (a BMC that takes seconds to answer); replica a reaches Postgres through a proxy that
//! is cut, silently, while a looks a machine up. Every reset is logged with the replica that
//! sent it. Asserted: a sends no reset after its lease could have ended, and no machine is
//! reset by a after b reset it; b reboots every machine once.
//!
//! On both backends: a machine whose agent heartbeats while the recoverer looks it up is not
//! reset; the silence is read again right before the reset.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use shepherd_bmdb::testing::{self, Blackhole};
use shepherd_bmdb::*;
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::recoverer::Recoverer;
use shepherd_loops::runner::{run, RunnerConfig};
use shepherd_provider::{
    Availability, Provider, ProviderError, ProviderMachine, Rebooter, Recorded,
};
use tokio_util::sync::CancellationToken;

const MACHINES: usize = 3;
const INTERVAL: Duration = Duration::from_secs(2);
/// How long a lookup at the provider takes: longer than the lease outlives the partition.
const LOOKUP: Duration = Duration::from_secs(3);

/// What the provider saw: when, which replica, what, which machine.
type Calls = Arc<Mutex<Vec<(Instant, &'static str, &'static str, String)>>>;

/// One replica's view of a provider whose BMCs answer lookups slowly.
struct SlowBmcs {
    replica: &'static str,
    calls: Calls,
}

#[async_trait]
impl Provider for SlowBmcs {
    /// The one call the recoverer makes before a reset: slow.
    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        let call = (Instant::now(), self.replica, "lookup", id.to_string());
        self.calls.lock().unwrap().push(call);
        tokio::time::sleep(LOOKUP).await;
        Ok(ProviderMachine::new(id, None, Availability::KnownUsed))
    }
    fn kind(&self) -> ProviderKind {
        ProviderKind::Sim
    }
    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        Err(ProviderError::NotSupported("list"))
    }
    async fn create_machine(
        &self,
        _session: &Session,
        _unused: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        Err(ProviderError::NotSupported("create"))
    }
}

#[async_trait]
impl Rebooter for SlowBmcs {
    async fn reboot(&self, _lease: &Lease, machine: &ProviderMachine) -> Result<(), ProviderError> {
        let id = machine.id.clone().unwrap_or_default();
        let call = (Instant::now(), self.replica, "reset", id);
        self.calls.lock().unwrap().push(call);
        Ok(())
    }
}

/// Two silent machines, one recoverer with one worker; the first machine it looks up
/// heartbeats during that lookup. Only the other machine is reset, and the history shows the
/// first one's recovery canceled without a backoff. Before the re-check before the reset, the
/// first machine was reset too.
async fn a_heartbeat_during_the_lookup_prevents_the_reset(db: Bmdb) {
    let machines = testing::provision(&db, 2, ProviderKind::Sim).await;
    testing::agents_silent_for_hours(&db, &machines).await;
    let calls: Calls = Arc::default();
    let cancel = CancellationToken::new();
    recoverer(db.clone(), "a", &calls, &cancel);
    let first = testing::eventually("a first lookup", Duration::from_secs(30), async || {
        let seen = calls.lock().unwrap().clone();
        let lookup = seen.iter().find(|c| c.2 == "lookup").map(|c| c.3.clone());
        testing::when(lookup.is_some(), lookup)
    })
    .await
    .unwrap();
    let woke = *machines
        .iter()
        .find(|m| m.simple().to_string() == first)
        .unwrap();
    db.transact(move |tx| {
        Box::pin(async move {
            let now = tx.now().await?;
            tx.set_heartbeat_at(woke, now).await
        })
    })
    .await
    .unwrap();
    let other = *machines.iter().find(|m| **m != woke).unwrap();
    testing::eventually(
        "the other machine to be reset",
        Duration::from_secs(30),
        async || {
            let seen = calls.lock().unwrap().clone();
            let resets: Vec<_> = seen.into_iter().filter(|c| c.2 == "reset").collect();
            testing::when(!resets.is_empty(), resets)
        },
    )
    .await;
    cancel.cancel();
    let resets: Vec<_> = calls
        .lock()
        .unwrap()
        .iter()
        .filter(|c| c.2 == "reset")
        .map(|c| c.3.clone())
        .collect();
    assert_eq!(resets, [other.simple().to_string()], "{:?}", calls.lock());
    let history = testing::all_history(&db).await;
    let of_woke: Vec<_> = history
        .iter()
        .filter(|h| h.machine_id == woke && h.process == Process::ShepherdRecovery)
        .map(|h| (h.event, h.cause.clone()))
        .collect();
    assert!(
        of_woke.iter().any(|(e, _)| *e == WorkEvent::Canceled)
            && !of_woke
                .iter()
                .any(|(e, _)| matches!(e, WorkEvent::Finished | WorkEvent::Failed)),
        "{of_woke:?}"
    );
    let backoffs = db.read(move |tx| Box::pin(async move { tx.machine_backoffs(woke).await }));
    assert_eq!(backoffs.await.unwrap(), [], "released without a backoff");
}

shepherd_bmdb::conformance_tests!(a_heartbeat_during_the_lookup_prevents_the_reset);

/// Replica `name`'s recoverer on `db`, until `cancel`.
fn recoverer(db: Bmdb, name: &'static str, calls: &Calls, cancel: &CancellationToken) {
    let provider = Arc::new(SlowBmcs {
        replica: name,
        calls: calls.clone(),
    });
    let task = Arc::new(Recoverer::new(provider, RecoveryThresholds::default()));
    let session = SessionConfig::new(name, Processor::ShepherdRecoverer).with_interval(INTERVAL);
    let config = RunnerConfig::new(1, RateSpec::new(Duration::from_millis(10), 4), session);
    tokio::spawn(run(db, task, config, cancel.clone()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partitioned_recoverer_resets_nothing_after_its_lease() {
    let _turn = crate::alone().await;
    let Some(t) = testing::postgres().await else {
        return;
    };
    let machines = testing::provision(&t.db, MACHINES, ProviderKind::Sim).await;
    testing::agents_silent_for_hours(&t.db, &machines).await;
    let upstream = t.url.split('@').nth(1).unwrap().split('/').next().unwrap();
    let proxy = Blackhole::start(upstream).await;
    let cut_off = Bmdb::open(&proxy.url_through(&t.url, upstream))
        .await
        .unwrap();
    let calls: Calls = Arc::default();
    let (stop_a, stop_b) = (CancellationToken::new(), CancellationToken::new());
    recoverer(cut_off.clone(), "a", &calls, &stop_a);

    // The partition comes while a looks a machine up, holding its work.
    let looked_up = "replica a to look a machine up";
    testing::eventually(looked_up, Duration::from_secs(30), async || {
        let seen = calls.lock().unwrap().clone();
        testing::when(seen.iter().any(|c| c.1 == "a" && c.2 == "lookup"), seen)
    })
    .await;
    proxy.cut();
    let cut = Instant::now();
    recoverer(t.db.clone(), "b", &calls, &stop_b);
    let resets_of = |replica: &str| {
        let seen = calls.lock().unwrap().clone();
        seen.into_iter()
            .filter(|c| c.1 == replica && c.2 == "reset")
            .collect::<Vec<_>>()
    };
    testing::eventually(
        "replica b to reset every machine",
        Duration::from_secs(60),
        async || {
            let b = resets_of("b");
            testing::when(b.len() >= MACHINES, b)
        },
    )
    .await;
    proxy.heal();
    tokio::time::sleep(LOOKUP + INTERVAL).await;
    stop_a.cancel();
    stop_b.cancel();

    // a's last keep-alive came before the cut, so its lease ended within an interval of it.
    let lease_end = cut + INTERVAL;
    let a = resets_of("a");
    let late: Vec<_> = a.iter().filter(|c| c.0 > lease_end).collect();
    assert!(late.is_empty(), "resets of a after its lease: {late:?}");
    let b = resets_of("b");
    for (at, _, _, machine) in &a {
        assert!(
            !b.iter().any(|r| &r.3 == machine && r.0 < *at),
            "a reset {machine} after b did"
        );
    }
    let mut reset: Vec<_> = b.iter().map(|c| c.3.clone()).collect();
    reset.sort();
    reset.dedup();
    assert_eq!(reset.len(), MACHINES, "b resets every machine: {b:?}");
    println!(
        "fence_side_effects_after_lease_reboot_partition = {}",
        late.len()
    );
    cut_off.close().await;
    t.cleanup().await;
}
