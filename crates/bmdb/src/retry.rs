//! Bounded, jittered retries of transactions that failed on serialization or lock contention.

use std::time::Duration;

use crate::metrics::BmdbMetrics;
use crate::{Error, Processor};

/// Attempts per transaction before giving up.
pub(crate) const MAX_ATTEMPTS: u32 = 10;
const BASE_DELAY: Duration = Duration::from_millis(2);
const MAX_DELAY: Duration = Duration::from_millis(500);

/// Tracks attempts of one logical transaction and records their metrics.
pub(crate) struct Retry<'a> {
    metrics: &'a BmdbMetrics,
    processor: Processor,
    attempt: u32,
}

impl<'a> Retry<'a> {
    pub(crate) fn new(metrics: &'a BmdbMetrics, processor: Processor) -> Self {
        Retry {
            metrics,
            processor,
            attempt: 0,
        }
    }

    /// Records a committed transaction.
    pub(crate) fn succeeded(&self) {
        self.metrics.transaction_executed(self.processor);
    }

    /// Sleeps before the next attempt if `err` is retryable and attempts remain; otherwise
    /// records the failure and returns the error.
    pub(crate) async fn on_error(&mut self, err: Error) -> Result<(), Error> {
        self.attempt += 1;
        if !err.is_retryable() || self.attempt >= MAX_ATTEMPTS {
            self.metrics.transaction_failed(self.processor);
            return Err(err);
        }
        self.metrics.transaction_retried(self.processor);
        tokio::time::sleep(delay(self.attempt)).await;
        Ok(())
    }
}

/// Full-jitter exponential delay: uniform in [0, min(MAX, BASE × 2^attempt)].
pub(crate) fn delay(attempt: u32) -> Duration {
    let cap = BASE_DELAY
        .saturating_mul(1u32 << attempt.min(16))
        .min(MAX_DELAY);
    cap.mul_f64(rand::random::<f64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_are_bounded() {
        for attempt in 0..40 {
            assert!(delay(attempt) <= MAX_DELAY);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_after_max_attempts_and_not_on_other_errors() {
        let metrics = BmdbMetrics::default();
        let mut r = Retry::new(&metrics, Processor::Unknown);
        assert!(r.on_error(Error::SessionExpired).await.is_err());
        let mut r = Retry::new(&metrics, Processor::Unknown);
        // A protocol error is not a serialization or lock error: not retried either.
        let protocol = Error::Database(sqlx::Error::Protocol("unexpected message".into()));
        assert!(r.on_error(protocol).await.is_err());
        assert_eq!(metrics.transactions_retried(Processor::Unknown), 0);
    }
}
