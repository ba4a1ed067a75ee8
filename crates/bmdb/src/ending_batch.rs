//! Work endings of concurrent workers committed together. Finishing, failing and canceling
//! work are small write transactions, one per machine processed; the endings of one
//! processor's workers that come in while another batch is being written are gathered
//! (`group_commit.rs`, without waiting) and written in one transaction.
//!
//! On Postgres the batch's endings are one statement, the tag writes of its finishes
//! (`sql/finish_tags.rs`) with them. A finish whose tags are refused is told its own error
//! and nothing of it is kept, while the others commit: the batch is written again without it.
//! Tag writes the database would refuse for their values are checked before anything is
//! written, so the shared statement fails only with the transaction itself (the connection,
//! the commit): that fails the whole batch, and then every member tries again in a later one.

use std::sync::Arc;

use crate::batches::Ending;
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
        retrying(self.metrics(), &self.inner.seen, processor, || {
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
                let written = db.write_endings(processor, batch.items()).await;
                batch.answer(written);
            });
        }
        // A closed answer means the writing task never ran: the runtime is shutting down.
        answer.await.unwrap_or(Err(Error::SessionExpired))
    }

    /// Writes `endings` in one transaction (`Tx::end_works`: on Postgres one statement, each
    /// finish's tags with it); one outcome per member, in order. A finish whose tags cannot be
    /// written is told so at once; one whose tags are refused (a host key pinned already) rolls
    /// the transaction back, is told its error, and the others are written again without it
    /// (so a batch is written at most once more than it has refused members).
    ///
    /// A COMMIT that fails with the connection (the primary died as it committed) leaves the
    /// batch in doubt: it may be written, and its members are told the error all the same.
    /// They are counted in `bmdb_endings_in_doubt`, so that endings a process saw fail can be
    /// told from endings the database lost.
    async fn write_endings(
        &self,
        processor: Processor,
        endings: &[Arc<Ending>],
    ) -> Result<Vec<Answer<EndOutcome>>, Error> {
        let mut failed: Vec<Option<Error>> = endings.iter().map(|e| e.check().err()).collect();
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
            match tx.end_works(&ends).await? {
                Ok(outcomes) => {
                    if let Err(e) = tx.commit().await {
                        if !e.is_retryable() {
                            self.metrics()
                                .ending_batch_in_doubt(processor, members.len());
                        }
                        return Err(e);
                    }
                    written = outcomes;
                    break;
                }
                Err(refusal) => {
                    // Nothing of this attempt is kept; the rollback may fail with the connection.
                    let _ = tx.rollback().await;
                    failed[members[refusal.member]] = Some(refusal.error);
                }
            }
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
