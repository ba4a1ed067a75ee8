//! Claims of concurrent workers served together: the requests of one loop's workers that come
//! in while a claim is being made are gathered (`group_commit.rs`, without waiting: a batch is
//! whatever arrived during the previous one) and served by one statement on Postgres, or one
//! write transaction on SQLite, instead of one each. Every request still gets a machine of its
//! own or its own "nothing"/"conflict"/"session expired", and the claim statement keeps each
//! per-machine guarantee (`sql/claims.rs`).
//!
//! Each member's claim runs in a task of its own, which the worker awaits but does not own:
//! a worker that goes away (its loop was cancelled) neither cancels the other members' claims
//! (the leader's task writes them) nor leaves them waiting, and its own answer is still
//! received and turned into its [`crate::Work`]: claimed for a worker that went away, the work
//! is dropped unread and, as any work dropped without an ending, canceled (released with
//! Canceled history).

use uuid::Uuid;

use crate::batches::ClaimKey;
use crate::db::{Mode, Pools};
use crate::group_commit::Answer;
use crate::sql::claims::{ClaimOutcome, ClaimShared, ClaimStrategy};
use crate::{Bmdb, Claim, Error, Session};

impl Bmdb {
    /// Claims one machine for `session` as `key` says, served together with the concurrent
    /// requests of the same key.
    pub(crate) async fn claim_batched(&self, session: &Session, key: ClaimKey) -> Answer<Claim> {
        let group = self.inner.claims.group(key);
        let (answer, leader) = group.join(session.id());
        let db = self.clone();
        let session = session.clone();
        // One task per member: the leader's writes the batch first and then finds its own
        // answer ready (a lone claimer, the common case on a quiet fleet, pays one task hop).
        let claimed = tokio::spawn(async move {
            if let Some(leader) = leader {
                // Boxed: only a leader's task holds the writing's state, not every member's.
                Box::pin(async {
                    let batch = group.gather(leader).await;
                    db.metrics().claim_batch(key.processor, batch.items().len());
                    let written = db
                        .claim_for(batch.items(), key, ClaimStrategy::SkipLocked)
                        .await
                        .map(|outcomes| outcomes.into_iter().map(Ok).collect());
                    batch.answer(written);
                })
                .await;
            }
            // A closed answer means the writing task never ran: the runtime is shutting down.
            let outcome = answer.await.unwrap_or(Err(Error::SessionExpired))?;
            session.claimed(key.process, outcome)
        });
        claimed.await.unwrap_or(Err(Error::SessionExpired))
    }

    /// One claim for each of `sessions`: one statement on Postgres, picking machines as
    /// `strategy` says; one write transaction on SQLite, which has one way to claim
    /// (committed only if it claimed anything).
    pub(crate) async fn claim_for(
        &self,
        sessions: &[Uuid],
        key: ClaimKey,
        strategy: ClaimStrategy,
    ) -> Result<Vec<ClaimOutcome>, Error> {
        let outcomes = match &self.inner.pools {
            Pools::Sqlite { .. } => {
                let mut tx = self.begin(Mode::Write).await?;
                let outcomes = tx
                    .claim_sqlite(sessions, key.process, &key.retrieval)
                    .await?;
                if outcomes
                    .iter()
                    .any(|o| matches!(o, ClaimOutcome::Claimed { .. }))
                {
                    tx.commit().await?;
                } else {
                    tx.rollback().await?;
                }
                outcomes
            }
            Pools::Postgres(pool) => {
                let shared = ClaimShared {
                    hints: &self.inner.claim_hints,
                    metrics: self.metrics(),
                    processor: key.processor,
                };
                let mut conn = self.autocommit(pool).await?;
                conn.claim(sessions, key.process, &key.retrieval, strategy, &shared)
                    .await?
            }
        };
        Ok(outcomes)
    }
}
