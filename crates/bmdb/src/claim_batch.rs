//! Claims of concurrent workers served together: the requests of one loop's workers that come
//! in while a claim is being made are gathered (`group_commit.rs`, without waiting: a batch is
//! whatever arrived during the previous one) and served by one statement on Postgres, or one
//! write transaction on SQLite, instead of one each. Every request still gets a machine of its
//! own or its own "nothing"/"conflict"/"session expired", and the claim statement keeps each
//! per-machine guarantee (`sql/claims.rs`).
//!
//! A claim is made by a task of its own, so that a worker that goes away (its loop was
//! cancelled) neither cancels the other members' claims nor leaves them waiting. Each member
//! is answered with its [`Work`] itself: claimed for a worker that went away, it is dropped
//! unread and, as any work dropped without an ending, canceled (released with Canceled
//! history).

use crate::db::{Mode, Pools};
use crate::group_commit::{Answer, GroupsByKey};
use crate::sql::claims::{ClaimOutcome, ClaimShared, ClaimStrategy};
use crate::{Bmdb, Claim, Error, Process, Processor, Retrieval, Session};

/// Most requests one claim statement serves.
pub(crate) const MAX_CLAIM_BATCH: usize = 32;

/// Which requests may share a statement: one processor's claims for one process by one rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClaimKey {
    pub(crate) processor: Processor,
    pub(crate) process: Process,
    pub(crate) retrieval: Retrieval,
}

/// The claim groups of one [`Bmdb`] handle, one per [`ClaimKey`] seen.
pub(crate) type ClaimBatches = GroupsByKey<ClaimKey, Session, Claim>;

impl Bmdb {
    /// Claims one machine for `session` as `key` says, served together with the concurrent
    /// requests of the same key.
    pub(crate) async fn claim_batched(&self, session: &Session, key: ClaimKey) -> Answer<Claim> {
        let group = self.inner.claims.group(key);
        let (answer, leader) = group.join(session.clone());
        if let Some(leader) = leader {
            let db = self.clone();
            tokio::spawn(async move {
                let batch = group.gather(leader).await;
                let written = db.claim_for(batch.items(), key).await;
                batch.answer(written);
            });
        }
        // A closed answer means the writing task never ran: the runtime is shutting down.
        answer.await.unwrap_or(Err(Error::SessionExpired))
    }

    /// One claim for each of `sessions`: one statement on Postgres, one write transaction on
    /// SQLite (committed only if it claimed anything).
    async fn claim_for(
        &self,
        sessions: &[Session],
        key: ClaimKey,
    ) -> Result<Vec<Answer<Claim>>, Error> {
        self.metrics().claim_batch(key.processor, sessions.len());
        let ids: Vec<_> = sessions.iter().map(Session::id).collect();
        let outcomes = match &self.inner.pools {
            Pools::Sqlite { .. } => {
                let mut tx = self.begin(Mode::Write).await?;
                let outcomes = tx.claim_sqlite(&ids, key.process, &key.retrieval).await?;
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
                conn.claim(
                    &ids,
                    key.process,
                    &key.retrieval,
                    ClaimStrategy::SkipLocked,
                    &shared,
                )
                .await?
            }
        };
        Ok(sessions
            .iter()
            .zip(outcomes)
            .map(|(session, outcome)| session.claimed(key.process, outcome))
            .collect())
    }
}
