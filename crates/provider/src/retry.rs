//! How provider REST clients retry a failed call: a bounded number of attempts, each with its
//! own timeout, separated by capped exponential delays with jitter (so that many replicas do
//! not retry in step). The Equinix and Ironic clients share this one convention.

use std::future::Future;
use std::time::Duration;

pub use shepherd_retry::Delays;

use crate::metrics::{CallMetrics, CallResult};

/// What the retry loop of [`RetryPolicy::run`] reads from a failed attempt.
pub trait AttemptError: std::fmt::Display {
    /// The server's `Retry-After`, if it sent one.
    fn retry_after(&self) -> Option<Duration> {
        None
    }
    /// Whether the call failed because what it asked for does not exist (counted apart).
    fn is_not_found(&self) -> bool {
        false
    }
}

/// How failed calls are retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Attempts in all (the first included).
    pub attempts: u32,
    /// Waits between attempts; `delays.max` also caps a server's `Retry-After`.
    pub delays: Delays,
    /// Timeout of one attempt.
    pub timeout: Duration,
}

impl Default for RetryPolicy {
    /// Five attempts, 0.5 s doubling to at most 30 s between them, 30 s each.
    fn default() -> Self {
        RetryPolicy {
            attempts: 5,
            delays: Delays::new(Duration::from_millis(500), Duration::from_secs(30)),
            timeout: Duration::from_secs(30),
        }
    }
}

impl RetryPolicy {
    /// `attempts` attempts of at most `timeout` each, waiting from `first` up to `max` between
    /// them.
    pub fn new(attempts: u32, first: Duration, max: Duration, timeout: Duration) -> Self {
        RetryPolicy {
            attempts,
            delays: Delays::new(first, max),
            timeout,
        }
    }

    /// Runs `attempt` until it succeeds, fails with an error `retry_if` refuses, or the
    /// attempts are used up, sleeping [`RetryPolicy::delay_after`] between attempts. Every
    /// attempt is recorded in `metrics` under `call`; a retry is logged at debug level with
    /// `api` (the API's name) and the error, since the caller reports the call's outcome once
    /// (a start-up against an API that does not answer says one line, not one per attempt).
    pub async fn run<T, E: AttemptError, Fut: Future<Output = Result<T, E>>>(
        &self,
        metrics: &CallMetrics,
        api: &'static str,
        call: &'static str,
        retry_if: impl Fn(&E) -> bool,
        mut attempt: impl FnMut() -> Fut,
    ) -> Result<T, E> {
        let attempts = self.attempts.max(1);
        let mut n = 0;
        loop {
            let classify = |r: &Result<T, E>| match r {
                Ok(_) => CallResult::Ok,
                Err(e) if e.is_not_found() => CallResult::NotFound,
                Err(_) => CallResult::Error,
            };
            match metrics.time(call, classify, attempt()).await {
                Err(e) if retry_if(&e) && n + 1 < attempts => {
                    let delay = self.delay_after(n, e.retry_after());
                    tracing::debug!(api, call, attempt = n + 1, error = %e, ?delay, "API call failed; retrying");
                    tokio::time::sleep(delay).await;
                    n += 1;
                }
                other => return other,
            }
        }
    }

    /// The delay before retry number `retry` (0-based, see [`Delays`]), at least the server's
    /// `Retry-After` (itself capped at `delays.max`).
    pub fn delay_after(&self, retry: u32, retry_after: Option<Duration>) -> Duration {
        let delay = self.delays.delay(retry);
        match retry_after {
            Some(after) => delay.max(after.min(self.delays.max)),
            None => delay,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_is_honoured_up_to_the_largest_delay() {
        let p = RetryPolicy {
            attempts: 10,
            delays: Delays::new(Duration::from_millis(100), Duration::from_secs(1)),
            timeout: Duration::from_secs(1),
        };
        let long = p.delay_after(0, Some(Duration::from_secs(60)));
        assert_eq!(long, Duration::from_secs(1), "Retry-After is capped");
        let short = p.delay_after(3, Some(Duration::from_millis(1)));
        assert!(short >= Duration::from_millis(400));
    }
}
