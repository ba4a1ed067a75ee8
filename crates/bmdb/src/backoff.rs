//! Backoff arithmetic for failed work (design.md §4), exact to the second.

use std::time::Duration;

/// How long a machine stays ineligible for a process after a failure.
///
/// Values are normalized before use: exponent below 1 becomes 1, initial below one second
/// becomes one second, a maximum below the initial becomes the initial. Periods are whole
/// seconds, rounded up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// First interval after a failure with no previous backoff.
    pub initial: Duration,
    /// Upper bound of exponential growth.
    pub maximum: Duration,
    /// Growth factor between consecutive failures; 1 (or less) means constant.
    pub exponent: f64,
    /// Extra random delay, as a fraction of the interval, added to `until` (not persisted as
    /// the interval, so growth stays deterministic). 0 disables it.
    pub jitter: f64,
}

impl Backoff {
    /// A backoff that always waits `interval`.
    pub fn constant(interval: Duration) -> Self {
        Backoff {
            initial: interval,
            maximum: interval,
            exponent: 1.0,
            jitter: 0.0,
        }
    }

    /// An exponential backoff from `initial` to `maximum`, multiplied by `exponent` per failure.
    pub fn exponential(initial: Duration, maximum: Duration, exponent: f64) -> Self {
        Backoff {
            initial,
            maximum,
            exponent,
            jitter: 0.0,
        }
    }

    /// The backoff after a server asked to be left alone for `wait` (`Retry-After`): that
    /// long, at least this backoff's first interval and at most an hour (a wait longer than
    /// that is a server's mistake, or a hostile one's), with this backoff's jitter.
    pub fn as_asked(self, wait: Duration) -> Self {
        let wait = wait.min(Duration::from_secs(3600)).max(self.initial);
        Backoff::constant(wait).with_jitter(self.jitter)
    }

    /// The same backoff with `fraction` of random extra delay.
    pub fn with_jitter(self, fraction: f64) -> Self {
        Backoff {
            jitter: fraction,
            ..self
        }
    }

    fn normalized(&self) -> (i64, i64, f64) {
        let exponent = if self.exponent.is_nan() || self.exponent < 1.0 {
            1.0
        } else {
            self.exponent
        };
        let initial = ceil_seconds(self.initial).max(1);
        let maximum = ceil_seconds(self.maximum).max(initial);
        (initial, maximum, exponent)
    }

    /// The interval in whole seconds to use after a failure, given the interval persisted by the
    /// previous failure (if any).
    pub fn next_interval_seconds(&self, previous: Option<i64>) -> i64 {
        let (initial, maximum, exponent) = self.normalized();
        if exponent == 1.0 {
            return initial;
        }
        let Some(prev) = previous.filter(|p| *p >= 1) else {
            return initial;
        };
        // Multiply in whole nanoseconds (truncating), then round up to seconds. Working in
        // nanoseconds keeps binary floating point noise (10 × 1.1 = 11.000000000000002) from
        // adding a second.
        let nanos = prev as f64 * 1e9 * exponent;
        if !nanos.is_finite() || nanos >= i64::MAX as f64 {
            return maximum;
        }
        let nanos = nanos as i64;
        let secs = nanos / 1_000_000_000 + i64::from(nanos % 1_000_000_000 != 0);
        secs.min(maximum)
    }

    /// The delay until the machine is eligible again, for an interval from
    /// [`Backoff::next_interval_seconds`]: the interval plus up to `jitter` of it at random.
    pub fn delay_with_jitter(&self, interval_seconds: i64) -> Duration {
        let base = Duration::from_secs(interval_seconds.max(0) as u64);
        if self.jitter.is_nan() || self.jitter <= 0.0 {
            return base;
        }
        let fraction = self.jitter.min(1.0) * rand::random::<f64>();
        base + base.mul_f64(fraction)
    }
}

/// The interval after a failure when the caller gave no backoff: one second, or the previous
/// persisted interval if that is longer.
pub fn default_interval_seconds(previous: Option<i64>) -> i64 {
    previous.unwrap_or(1).max(1)
}

fn ceil_seconds(d: Duration) -> i64 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() != 0);
    secs.min(i64::MAX as u64) as i64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn exponent_one_point_one_always_makes_progress() {
        let b = Backoff::exponential(secs(1), secs(1_000_000), 1.1);
        let mut prev = None;
        let mut seen = vec![];
        for _ in 0..14 {
            let next = b.next_interval_seconds(prev);
            seen.push(next);
            prev = Some(next);
        }
        assert_eq!(seen, vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 13, 15, 17]);
    }

    #[test]
    fn normalization_table() {
        // (initial, maximum, exponent, previous) -> expected
        let cases: &[(Duration, Duration, f64, Option<i64>, i64)] = &[
            // initial below one second becomes one second
            (Duration::from_millis(10), secs(60), 2.0, None, 1),
            // fractional initial rounds up
            (Duration::from_millis(1500), secs(60), 1.0, None, 2),
            // exponent below 1 becomes 1: constant
            (secs(5), secs(60), 0.5, Some(40), 5),
            // exponent 0 is constant
            (secs(5), secs(60), 0.0, Some(40), 5),
            // maximum below initial becomes initial
            (secs(10), secs(3), 2.0, Some(10), 10),
            // exponential with no previous: initial
            (secs(5), secs(60), 2.0, None, 5),
            // previous of zero counts as no previous
            (secs(5), secs(60), 2.0, Some(0), 5),
            // growth
            (secs(5), secs(60), 2.0, Some(5), 10),
            // clamp to maximum
            (secs(5), secs(60), 2.0, Some(40), 60),
            // fractional maximum rounds up
            (secs(5), Duration::from_millis(60_001), 2.0, Some(40), 61),
            // overflow uses maximum
            (
                secs(1),
                secs(u64::MAX / 4),
                1e300,
                Some(i64::MAX),
                ceil_seconds(secs(u64::MAX / 4)),
            ),
            (secs(1), secs(100), f64::INFINITY, Some(3), 100),
            // NaN exponent is treated as constant
            (secs(7), secs(100), f64::NAN, Some(3), 7),
        ];
        for (i, (initial, maximum, exponent, prev, want)) in cases.iter().enumerate() {
            let b = Backoff::exponential(*initial, *maximum, *exponent);
            assert_eq!(
                b.next_interval_seconds(*prev),
                *want,
                "case {i}: {b:?} prev {prev:?}"
            );
        }
    }

    #[test]
    fn upstream_loop_defaults() {
        // Initializer: 5 min -> 4 h, x1.2
        let b = Backoff::exponential(secs(300), secs(4 * 3600), 1.2);
        assert_eq!(b.next_interval_seconds(None), 300);
        assert_eq!(b.next_interval_seconds(Some(300)), 360);
        assert_eq!(b.next_interval_seconds(Some(14_000)), 14_400);
    }

    #[test]
    fn no_descriptor_keeps_larger_previous() {
        assert_eq!(default_interval_seconds(None), 1);
        assert_eq!(default_interval_seconds(Some(0)), 1);
        assert_eq!(default_interval_seconds(Some(30)), 30);
    }

    #[test]
    fn jitter_only_adds_and_stays_bounded() {
        let b = Backoff::constant(secs(10)).with_jitter(0.5);
        for _ in 0..200 {
            let d = b.delay_with_jitter(10);
            assert!(d >= secs(10) && d <= secs(15), "{d:?}");
        }
        assert_eq!(Backoff::constant(secs(10)).delay_with_jitter(10), secs(10));
    }

    /// A server's `Retry-After` is waited as asked, within this backoff's first interval and
    /// an hour, after any previous interval, with the same jitter.
    #[test]
    fn a_wait_as_asked_is_bounded() {
        let b = Backoff::exponential(secs(5), secs(1800), 2.0).with_jitter(0.1);
        let asked = |wait: u64| b.as_asked(secs(wait)).next_interval_seconds(Some(960));
        assert_eq!((asked(120), asked(1), asked(86_400)), (120, 5, 3600));
        assert_eq!(b.as_asked(secs(120)).jitter, 0.1);
        let long = Backoff::constant(secs(7200));
        assert_eq!(long.as_asked(secs(1)).next_interval_seconds(None), 7200);
    }
}
