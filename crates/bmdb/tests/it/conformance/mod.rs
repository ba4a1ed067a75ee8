//! One conformance suite for the BMDB, run against SQLite and Postgres (design.md §2–§5), by
//! concern as `sql/` is: each module runs its tests on both engines. Here: what they share.
use chrono::Utc;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use shepherd_bmdb::*;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;
const START: Retrieval = Retrieval::AgentStart {
    provider: ProviderKind::Sim,
};
fn key(byte: u8) -> Vec<u8> {
    vec![byte; AGENT_KEY_LEN]
}
async fn session(db: &Bmdb, name: &str) -> Session {
    db.start_session(SessionConfig::new(name, Processor::ShepherdInitializer))
        .await
        .expect("start session")
}
/// Long enough after a [`doomed_session`]'s keep-alive stopped for it to have expired.
const PAST_EXPIRY: Duration = Duration::from_millis(2200);
/// A session with a one-second interval, which expires two seconds after its keep-alive
/// stops.
async fn doomed_session(db: &Bmdb) -> Session {
    testing::session_every(db, Processor::ShepherdInitializer, Duration::from_secs(1)).await
}
fn claimed(c: Claim) -> Work {
    match c {
        Claim::Work(w) => w,
        other => panic!("expected work, got {other:?}"),
    }
}
/// The fleet counts at the default thresholds.
async fn fleet_counts(db: &Bmdb) -> FleetCounts {
    db.read(|tx| {
        Box::pin(async move {
            tx.fleet_counts(RecoveryThresholds::default().stale_after())
                .await
        })
    })
    .await
    .unwrap()
}
async fn history(db: &Bmdb, id: Uuid) -> Vec<HistoryEntry> {
    db.read(|tx| Box::pin(async move { tx.machine_history(id).await }))
        .await
        .unwrap()
}
/// Starts the agent of every machine in `ids` except those in `keep`, making them ineligible
/// for agent start.
async fn start_all_but(db: &Bmdb, ids: &[Uuid], keep: &BTreeSet<Uuid>) {
    let started: Vec<Uuid> = ids
        .iter()
        .copied()
        .filter(|id| !keep.contains(id))
        .collect();
    db.transact(move |tx| {
        let started = started.clone();
        Box::pin(async move {
            for id in started {
                tx.set_agent_started(id, &key(4)).await?;
            }
            Ok(())
        })
    })
    .await
    .unwrap();
}
/// Claims one machine for agent start and finishes it with its agent started.
async fn claim_and_start(s: &Session) -> Uuid {
    let mut w = claimed(s.work(Process::ShepherdAgentStart, START).await.unwrap());
    let id = w.machine_id();
    w.finish(TagWrites::none().agent_started(key(4)))
        .await
        .unwrap();
    id
}
async fn count_start(db: &Bmdb) -> i64 {
    db.read(|tx| {
        Box::pin(async move { tx.count_eligible(Process::ShepherdAgentStart, &START).await })
    })
    .await
    .unwrap()
}
/// Every claim of each of `ids` has exactly one ending after its Started, and no work is held.
async fn every_claim_ended_once(db: &Bmdb, ids: &[Uuid]) {
    for id in ids {
        let events: Vec<WorkEvent> = history(db, *id).await.iter().map(|e| e.event).collect();
        let alternates = events.chunks(2).all(|pair| {
            pair.len() == 2 && pair[0] == WorkEvent::Started && pair[1] != WorkEvent::Started
        });
        assert!(alternates, "one ending per claim for {id}: {events:?}");
    }
    let work = fleet_counts(db).await.work;
    assert!(work.iter().all(|(_, n)| *n == 0), "no work left: {work:?}");
}

mod claims;
mod database;
mod endings;
mod heartbeat_writers;
mod provider_skips;
mod sessions;
mod tags;
