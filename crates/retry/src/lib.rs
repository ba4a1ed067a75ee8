//! How long Shepherd waits before trying again: capped exponential delays with jitter, the one
//! convention every retry follows (BMDB transactions, the loops' workers after an error, the
//! provider REST clients, the static inventory's first read, the agent's heartbeats).
//!
//! The convention, in one place:
//! - retries are counted from 0: [`Delays::delay`]`(0)` is the wait before the first retry;
//! - the ceiling of retry `n` is `first × 2ⁿ`, never more than `max`;
//! - the wait is uniform between half the ceiling and the ceiling ("equal jitter"), so that many
//!   clients failing together (a fleet that lost its server, replicas contending for a row) do
//!   not retry in step, while each still waits at least half of what the schedule says.
//!
//! A [`Streak`] counts consecutive failures for loops that retry until they succeed.

use std::time::Duration;

/// A schedule of waits between attempts: doubling from `first`, capped at `max`, jittered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delays {
    /// The ceiling of the wait before the first retry.
    pub first: Duration,
    /// The largest ceiling any retry reaches.
    pub max: Duration,
}

impl Delays {
    /// A schedule starting at `first` and capped at `max`.
    pub const fn new(first: Duration, max: Duration) -> Self {
        Delays { first, max }
    }

    /// The ceiling of retry `retry` (0-based): `first × 2^retry`, at most `max`.
    pub fn ceiling(&self, retry: u32) -> Duration {
        let factor = 1u32.checked_shl(retry).unwrap_or(u32::MAX);
        self.first.saturating_mul(factor).min(self.max)
    }

    /// The wait before retry `retry` (0-based): uniform in [ceiling / 2, ceiling].
    pub fn delay(&self, retry: u32) -> Duration {
        self.ceiling(retry)
            .mul_f64(0.5 + rand::random::<f64>() / 2.0)
    }
}

/// Consecutive failures of a loop that retries until it succeeds, and the wait each one earns.
#[derive(Debug, Clone)]
pub struct Streak {
    delays: Delays,
    failures: u32,
}

impl Streak {
    /// No failures yet.
    pub fn new(delays: Delays) -> Self {
        Streak {
            delays,
            failures: 0,
        }
    }

    /// Counts one more failure and returns how long to wait before the next attempt.
    pub fn failed(&mut self) -> Duration {
        let delay = self.delays.delay(self.failures);
        self.failures = self.failures.saturating_add(1);
        delay
    }

    /// The failures counted since the last success.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// An attempt succeeded: the next failure starts the schedule over.
    pub fn succeeded(&mut self) {
        self.failures = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const D: Delays = Delays::new(Duration::from_millis(100), Duration::from_secs(1));

    #[test]
    fn ceilings_double_from_the_first_and_stop_at_the_max() {
        assert_eq!(D.ceiling(0), Duration::from_millis(100));
        assert_eq!(D.ceiling(3), Duration::from_millis(800));
        assert_eq!(D.ceiling(4), Duration::from_secs(1));
        assert_eq!(D.ceiling(40), Duration::from_secs(1));
        assert_eq!(D.ceiling(u32::MAX), Duration::from_secs(1));
    }

    #[test]
    fn delays_lie_between_half_the_ceiling_and_the_ceiling_and_vary() {
        for retry in 0..64 {
            let (d, ceiling) = (D.delay(retry), D.ceiling(retry));
            assert!(d >= ceiling / 2 && d <= ceiling, "retry {retry}: {d:?}");
        }
        let samples: std::collections::BTreeSet<_> = (0..20).map(|_| D.delay(3)).collect();
        assert!(samples.len() > 1, "no jitter");
    }

    #[test]
    fn a_streak_grows_with_failures_and_starts_over_after_a_success() {
        let mut s = Streak::new(D);
        assert!(s.failed() <= Duration::from_millis(100));
        assert!(s.failed() >= Duration::from_millis(100));
        assert_eq!(s.failures(), 2);
        s.succeeded();
        assert_eq!(s.failures(), 0);
        assert!(s.failed() <= Duration::from_millis(100));
    }
}
