//! The one transaction runner. Every BMDB transaction, claim and single-statement write goes
//! through [`retrying`]: attempts are retried, bounded and jittered, while they fail on
//! serialization failures or lock contention, and each logical transaction is counted once in
//! the metrics (executed, retried, failed). [`Bmdb::transact`], [`Bmdb::read`] and the session
//! layer's transactions are built on it; a [`Guard`] lets a caller (a session) check its own
//! liveness in every attempt without this module knowing what a session is.

use std::future::Future;
use std::time::Duration;

use shepherd_retry::{Delays, Streak};

use crate::db::Mode;
use crate::db::SeenErrors;
use crate::metrics::{BmdbMetrics, TransactionEnd};
use crate::sql::engine::{Tx, TxFuture};
use crate::{Bmdb, Error, Processor};

/// Attempts per transaction before giving up.
pub(crate) const MAX_ATTEMPTS: u32 = 10;
/// Waits between attempts: from 2 ms, doubling, at most half a second.
const DELAYS: Delays = Delays::new(Duration::from_millis(2), Duration::from_millis(500));

/// Runs `attempt` until it succeeds, fails with an error that is not worth retrying, or has
/// failed [`MAX_ATTEMPTS`] times. Each attempt must be a whole transaction (or one autocommitted
/// statement), so that a retry starts from scratch.
pub(crate) async fn retrying<T, F, Fut>(
    metrics: &BmdbMetrics,
    seen: &SeenErrors,
    processor: Processor,
    mut attempt: F,
) -> Result<T, Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    let mut failures = Streak::new(DELAYS);
    loop {
        match attempt().await {
            Ok(v) => {
                metrics.transaction(processor, TransactionEnd::Executed);
                return Ok(v);
            }
            Err(e) => {
                seen.saw(&e);
                let delay = failures.failed();
                if !e.is_retryable() || failures.failures() >= MAX_ATTEMPTS {
                    metrics.transaction(processor, TransactionEnd::Failed);
                    return Err(e);
                }
                metrics.transaction(processor, TransactionEnd::Retried);
                tokio::time::sleep(delay).await;
            }
        }
    }
}

/// A precondition of every attempt of a transaction (the session layer's: "this session is
/// still alive"), checked cheaply before BEGIN and again inside the transaction.
pub(crate) trait Guard: Send + Sync {
    /// Fails fast, before a connection is taken.
    fn before(&self) -> Result<(), Error>;
    /// Runs first inside the transaction; an error rolls the attempt back.
    fn inside<'t>(&'t self, tx: &'t mut Tx) -> TxFuture<'t, ()>;
}

impl Bmdb {
    /// Runs `body` in a read-write transaction and commits it, retrying (bounded, jittered)
    /// on serialization failures and lock contention. `body` may run more than once, so it
    /// must have no side effects outside the database.
    ///
    /// ```ignore
    /// let id = db.transact(|tx| Box::pin(async move { tx.create_machine().await })).await?;
    /// ```
    pub async fn transact<T, F>(&self, body: F) -> Result<T, Error>
    where
        F: for<'t> FnMut(&'t mut Tx) -> TxFuture<'t, T>,
    {
        self.run(Processor::Unknown, Mode::Write, None, body).await
    }

    /// Like [`Bmdb::transact`] for read-only work; on SQLite it does not wait for the writer.
    pub async fn read<T, F>(&self, body: F) -> Result<T, Error>
    where
        F: for<'t> FnMut(&'t mut Tx) -> TxFuture<'t, T>,
    {
        self.run(Processor::Unknown, Mode::Read, None, body).await
    }

    /// The machine and session counts of `shepherd bmdb status`, the demo and many tests, in
    /// one read transaction.
    pub async fn status_counts(&self) -> Result<crate::StatusCounts, Error> {
        self.read(|tx| Box::pin(async move { tx.status_counts().await }))
            .await
    }

    /// Runs `body` in a transaction of `mode` through [`retrying`], with `guard` checked in
    /// every attempt, and commits it.
    pub(crate) async fn run<T, F>(
        &self,
        processor: Processor,
        mode: Mode,
        guard: Option<&dyn Guard>,
        body: F,
    ) -> Result<T, Error>
    where
        F: for<'t> FnMut(&'t mut Tx) -> TxFuture<'t, T>,
    {
        // Each attempt's future needs `body` for a while; attempts never overlap, so the lock
        // is never contended: it only hands the one `FnMut` to the attempt under way.
        let body = &std::sync::Mutex::new(body);
        retrying(self.metrics(), &self.inner.seen, processor, || async move {
            let attempt = async {
                if let Some(g) = guard {
                    g.before()?;
                }
                let mut tx = self.begin(mode).await?;
                if let Some(g) = guard {
                    g.inside(&mut tx).await?;
                }
                let pending = (body.lock().expect("a transaction body panicked"))(&mut tx);
                let v = pending.await?;
                tx.commit().await?;
                Ok(v)
            };
            attempt.await
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_once_on_errors_that_are_not_contention() {
        let metrics = BmdbMetrics::default();
        let mut attempts = 0;
        let r: Result<(), _> =
            retrying(&metrics, &SeenErrors::default(), Processor::Unknown, || {
                attempts += 1;
                // An expired session is no serialization or lock error: not retried.
                async { Err(Error::SessionExpired) }
            })
            .await;
        assert!(r.is_err());
        assert_eq!(attempts, 1);
        assert_eq!(metrics.transactions_retried(Processor::Unknown), 0);
    }
}
