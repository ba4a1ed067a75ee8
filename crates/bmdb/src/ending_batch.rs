//! Work endings of concurrent workers committed together. Finishing, failing and canceling
//! work are small write transactions, one per machine processed; the endings of one
//! processor's workers that come in while another batch is being written are gathered
//! (`group_commit.rs`, without waiting) and written in one transaction.
//!
//! On Postgres the batch's endings are one statement, followed by the commit functions of its
//! finishes. A member whose commit function fails (its finishing writes refused) is told its
//! own error and nothing of it is kept, while the others commit: the batch is written again
//! without it. Only a failure of
//! the transaction itself (beginning it, the commit) fails the whole batch, and then every
//! member tries again in a later one. A finish's commit function may therefore run more than
//! once, as it may whenever a transaction is retried.

use std::sync::Arc;

use crate::batches::{Ending, EndingKind};
use crate::db::Mode;
use crate::group_commit::Answer;
use crate::sql::endings::{EndOutcome, WorkEnd};
use crate::transaction::retrying;
use crate::{Bmdb, Error, Processor};

impl Bmdb {
    /// Ends work as `ending` says, committed together with the concurrent endings of
    /// `processor`'s workers; retried (in later batches) as any transaction is.
    pub(crate) async fn end_work(
        &self,
        processor: Processor,
        ending: Ending,
    ) -> Result<EndOutcome, Error> {
        let ending = Arc::new(ending);
        retrying(self.metrics(), &self.inner.failover, processor, || {
            self.end_batched(processor, ending.clone())
        })
        .await
    }

    async fn end_batched(&self, processor: Processor, ending: Arc<Ending>) -> Answer<EndOutcome> {
        let group = self.inner.endings.group(processor);
        let (answer, leader) = group.join(ending);
        if let Some(leader) = leader {
            // Written by a task of its own, so that a caller that goes away neither cancels
            // the other members' endings nor leaves them waiting.
            let db = self.clone();
            tokio::spawn(async move {
                let batch = group.gather(leader).await;
                db.metrics().ending_batch(processor, batch.items().len());
                let written = db.write_endings(batch.items()).await;
                batch.answer(written);
            });
        }
        // A closed answer means the writing task never ran: the runtime is shutting down.
        answer.await.unwrap_or(Err(Error::SessionExpired))
    }

    /// Writes `endings` in one transaction: their statements together (`Tx::end_works`), then
    /// the commit function of each finish that found its work; one outcome per member, in
    /// order. A member whose commit function fails rolls the transaction back; it is told its
    /// error and the others are written again without it (so a batch is written at most once
    /// more than it has failing members).
    async fn write_endings(
        &self,
        endings: &[Arc<Ending>],
    ) -> Result<Vec<Answer<EndOutcome>>, Error> {
        let mut failed: Vec<Option<Error>> = endings.iter().map(|_| None).collect();
        let mut written = Vec::new();
        loop {
            let members: Vec<usize> = (0..endings.len())
                .filter(|i| failed[*i].is_none())
                .collect();
            if members.is_empty() {
                break;
            }
            let ends: Vec<WorkEnd<'_>> = members.iter().map(|i| endings[*i].work_end()).collect();
            let mut tx = self.begin(Mode::Batch).await?;
            let outcomes = tx.end_works(&ends).await?;
            let mut refused = None;
            for (i, outcome) in members.iter().zip(&outcomes) {
                if let (EndingKind::Finish(commit), EndOutcome::Done) = (&endings[*i].kind, outcome)
                {
                    let pending = (commit.lock().expect("a commit function panicked"))(&mut tx);
                    if let Err(e) = pending.await {
                        refused = Some((*i, e));
                        break;
                    }
                }
            }
            let Some((i, e)) = refused else {
                tx.commit().await?;
                written = outcomes;
                break;
            };
            // Nothing of this attempt is kept; the rollback may fail with the connection.
            let _ = tx.rollback().await;
            failed[i] = Some(e);
        }
        let mut written = written.into_iter();
        Ok(failed
            .into_iter()
            .map(|f| match f {
                Some(e) => Err(e),
                None => Ok(written.next().expect("an outcome per member written")),
            })
            .collect())
    }
}
