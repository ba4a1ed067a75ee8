//! SQLite's one writer under a large fleet: the updater refreshes 90,000 machines every second
//! (each pass, a different twentieth of them has moved, so every pass writes), while worker
//! sessions make small writes back to back, as loops and the BMaaS server do, and keep their
//! sessions alive. Measured: the longest any write transaction waited for the writer, and how
//! many sessions expired. The baseline is an updater that compares and writes the whole
//! listing inside one write transaction.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use async_trait::async_trait;
use shepherd_bmdb::{testing, Bmdb, Processor, ProviderKind, SessionConfig};
use shepherd_loops::limiter::RateSpec;
use shepherd_loops::updater::{refreshed, Updater};
use shepherd_provider::{Availability, Provider, ProviderError, ProviderMachine, Recorded};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// Share of the fleet that moves between two passes.
const MOVING: usize = 20;

/// What one run measured.
pub struct WriterRun {
    /// The longest a write transaction waited for the writer.
    pub longest_wait: Duration,
    /// Sessions that expired while the run held them.
    pub sessions_expired: u64,
    /// Updater passes completed.
    pub passes: usize,
}

/// A provider listing `n` simulated machines, a different twentieth of which has moved to
/// another rack at each listing.
struct Churning {
    n: usize,
    listings: AtomicUsize,
}

impl Churning {
    fn listing(&self) -> Vec<ProviderMachine> {
        let pass = self.listings.fetch_add(1, Ordering::Relaxed);
        let moved = pass % MOVING;
        (0..self.n)
            .map(|i| {
                let addr = format!("10.{}.{}.{}", i >> 16, (i >> 8) & 255, i & 255);
                let mut m = ProviderMachine::new(
                    format!("sim-{i:05}"),
                    Some(addr),
                    Availability::KnownUsed,
                );
                let rack = if i % MOVING == moved {
                    100 + pass
                } else {
                    i % 100
                };
                m.location = Some(format!("rack-{rack}"));
                m
            })
            .collect()
    }
}

#[async_trait]
impl Provider for Churning {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Sim
    }

    async fn list_machines(&self) -> Result<Vec<ProviderMachine>, ProviderError> {
        Ok(self.listing())
    }

    async fn get_machine(&self, id: &str) -> Result<ProviderMachine, ProviderError> {
        Err(ProviderError::NotFound(id.into()))
    }

    async fn create_machine(
        &self,
        _: &shepherd_bmdb::Session,
        _: &ProviderMachine,
    ) -> Result<Recorded, ProviderError> {
        Err(ProviderError::NotSupported(
            "creating machines in a fixed fleet",
        ))
    }
}

/// Seeds `n` machines into a fresh SQLite BMDB; returns it and their ids.
pub async fn seeded(n: usize) -> Result<(testing::TestDb, Vec<Uuid>)> {
    let t = testing::sqlite().await;
    let ids = super::seed::fleet(&t.db, n).await?;
    Ok((t, ids))
}

/// Runs the updater (ours, or the one-transaction baseline) every second for `seconds`
/// against the fleet at `url`, with `workers` sessions writing meanwhile.
pub async fn run(
    url: &str,
    ids: &[Uuid],
    seconds: u64,
    workers: usize,
    baseline: bool,
) -> Result<WriterRun> {
    // A handle of its own, so the metrics count this run only.
    let db = Bmdb::open(url).await?;
    let provider = Arc::new(Churning {
        n: ids.len(),
        listings: AtomicUsize::new(0),
    });
    let cancel = CancellationToken::new();
    let passes = Arc::new(AtomicUsize::new(0));
    let updating = {
        let (db, cancel, passes, provider) =
            (db.clone(), cancel.clone(), passes.clone(), provider.clone());
        tokio::spawn(async move {
            let session = db
                .start_session(SessionConfig::new("updater", Processor::ShepherdUpdater))
                .await?;
            let updater = Updater::new(provider.clone(), RateSpec::new(Duration::from_secs(1), 1));
            while !cancel.is_cancelled() {
                let pass = tokio::time::sleep(Duration::from_secs(1));
                if baseline {
                    one_transaction_update(&session, &provider).await?;
                } else {
                    updater.iterate(&session).await?;
                }
                passes.fetch_add(1, Ordering::Relaxed);
                pass.await;
            }
            session.close().await?;
            anyhow::Ok(())
        })
    };
    let ids = Arc::new(ids.to_vec());
    let writers: Vec<_> = (0..workers)
        .map(|w| {
            let (db, cancel, ids) = (db.clone(), cancel.clone(), ids.clone());
            tokio::spawn(async move {
                let session = db
                    .start_session(SessionConfig::new(
                        format!("worker-{w}"),
                        Processor::ShepherdInitializer,
                    ))
                    .await?;
                let mut i = w;
                while !cancel.is_cancelled() {
                    let id = ids[i % ids.len()];
                    i += workers * 7919;
                    session
                        .transact(move |tx| Box::pin(async move { tx.set_heartbeat(id).await }))
                        .await?;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                session.close().await?;
                anyhow::Ok(())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    cancel.cancel();
    let mut failures = Vec::new();
    for task in std::iter::once(updating).chain(writers) {
        if let Err(e) = task.await? {
            failures.push(e.to_string());
        }
    }
    let expired: u64 = [Processor::ShepherdUpdater, Processor::ShepherdInitializer]
        .into_iter()
        .map(|p| db.metrics().sessions_expired(p))
        .sum();
    if !failures.is_empty() && expired == 0 {
        anyhow::bail!("writers failed: {failures:?}");
    }
    let run = WriterRun {
        longest_wait: db.metrics().longest_writer_wait(),
        sessions_expired: expired,
        passes: passes.load(Ordering::Relaxed),
    };
    db.close().await;
    Ok(run)
}

/// The baseline updater: read every provided row and write the changes in one write
/// transaction, holding the writer throughout.
async fn one_transaction_update(
    session: &shepherd_bmdb::Session,
    provider: &Churning,
) -> Result<()> {
    let listed = provider.listing();
    session
        .transact(move |tx| {
            let listed = listed.clone();
            Box::pin(async move {
                let by_id: std::collections::HashMap<&str, &ProviderMachine> = listed
                    .iter()
                    .filter_map(|m| m.valid_id().map(|id| (id, m)))
                    .collect();
                for (id, current) in tx.provided_by(ProviderKind::Sim).await? {
                    let next =
                        refreshed(&current, by_id.get(current.provider_id.as_str()).copied());
                    if next != current {
                        tx.set_provided(id, &next).await?;
                    }
                }
                Ok(())
            })
        })
        .await?;
    Ok(())
}
