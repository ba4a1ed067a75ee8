//! A token-bucket rate limiter configured as `"DURATION,BURST"` (design.md §10): a bucket of BURST
//! tokens, refilled with one token every DURATION, starting full. It runs on tokio's clock, so
//! tests drive it with paused time.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio::time::Instant;

/// A parsed `"DURATION,BURST"` setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RateSpec {
    /// One token is added every `every`.
    pub every: Duration,
    /// Bucket size; also how many events may happen at once after a quiet period.
    pub burst: u32,
}

impl RateSpec {
    /// A spec from its parts.
    pub const fn new(every: Duration, burst: u32) -> Self {
        RateSpec { every, burst }
    }
}

/// Why a rate setting was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid rate {input:?}: {reason} (expected \"DURATION,BURST\", e.g. \"250ms,8\" or \"2m,10\")"
)]
pub struct RateSpecError {
    input: String,
    reason: String,
}

impl FromStr for RateSpec {
    type Err = RateSpecError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason: &str| RateSpecError {
            input: s.to_string(),
            reason: reason.to_string(),
        };
        let (d, b) = s.split_once(',').ok_or_else(|| err("missing ','"))?;
        let every =
            humantime::parse_duration(d.trim()).map_err(|e| err(&format!("bad duration: {e}")))?;
        if every.is_zero() {
            return Err(err("duration must be positive"));
        }
        let burst: u32 = b
            .trim()
            .parse()
            .map_err(|_| err("burst must be a whole number"))?;
        if burst == 0 {
            return Err(err("burst must be at least 1"));
        }
        Ok(RateSpec { every, burst })
    }
}

impl fmt::Display for RateSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{},{}",
            humantime::format_duration(self.every),
            self.burst
        )
    }
}

struct Bucket {
    tokens: f64,
    last: Instant,
}

/// The limiter. Waiters are served one at a time in arrival order.
pub struct Limiter {
    spec: RateSpec,
    bucket: Mutex<Bucket>,
}

impl Limiter {
    /// A full bucket.
    pub fn new(spec: RateSpec) -> Self {
        Limiter {
            spec,
            bucket: Mutex::new(Bucket {
                tokens: f64::from(spec.burst),
                last: Instant::now(),
            }),
        }
    }

    /// The setting this limiter enforces.
    pub fn spec(&self) -> RateSpec {
        self.spec
    }

    /// Waits until a token is available and takes it. Cancel-safe: a caller dropped while
    /// waiting takes no token.
    pub async fn wait(&self) {
        let mut b = self.bucket.lock().await;
        loop {
            let now = Instant::now();
            let refill = now.duration_since(b.last).as_secs_f64() / self.spec.every.as_secs_f64();
            b.tokens = (b.tokens + refill).min(f64::from(self.spec.burst));
            b.last = now;
            if b.tokens >= 1.0 {
                b.tokens -= 1.0;
                return;
            }
            let missing = 1.0 - b.tokens;
            tokio::time::sleep(self.spec.every.mul_f64(missing)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_good_and_rejects_bad_specs() {
        let good = [
            ("250ms,8", RateSpec::new(Duration::from_millis(250), 8)),
            ("2m,10", RateSpec::new(Duration::from_secs(120), 10)),
            ("1m,1", RateSpec::new(Duration::from_secs(60), 1)),
            ("5s,1", RateSpec::new(Duration::from_secs(5), 1)),
            (" 1h , 3 ", RateSpec::new(Duration::from_secs(3600), 3)),
            ("1m30s,2", RateSpec::new(Duration::from_secs(90), 2)),
        ];
        for (s, want) in good {
            assert_eq!(s.parse::<RateSpec>(), Ok(want), "{s}");
        }
        for (s, why) in [
            ("", "missing ','"),
            ("5s", "missing ','"),
            ("5,1", "bad duration"),
            ("xs,1", "bad duration"),
            ("0s,1", "positive"),
            ("1s,0", "at least 1"),
            ("1s,-1", "whole number"),
            ("1s,1.5", "whole number"),
            ("1s,", "whole number"),
        ] {
            let e = s.parse::<RateSpec>().unwrap_err().to_string();
            assert!(e.contains(why) && e.contains("DURATION,BURST"), "{s}: {e}");
        }
    }

    #[test]
    fn display_round_trips() {
        let spec: RateSpec = "250ms,8".parse().unwrap();
        assert_eq!(spec.to_string().parse::<RateSpec>().unwrap(), spec);
    }

    #[tokio::test(start_paused = true)]
    async fn bursts_then_paces() {
        let l = Limiter::new("1s,3".parse().unwrap());
        let t0 = Instant::now();
        for _ in 0..3 {
            l.wait().await;
        }
        assert_eq!(
            t0.elapsed(),
            Duration::ZERO,
            "a full bucket lets the burst through at once"
        );
        l.wait().await;
        assert_eq!(t0.elapsed(), Duration::from_secs(1));
        l.wait().await;
        assert_eq!(t0.elapsed(), Duration::from_secs(2));
        // A quiet period refills up to the burst, not beyond.
        tokio::time::sleep(Duration::from_secs(60)).await;
        let t1 = Instant::now();
        for _ in 0..3 {
            l.wait().await;
        }
        assert_eq!(t1.elapsed(), Duration::ZERO);
        l.wait().await;
        assert_eq!(t1.elapsed(), Duration::from_secs(1));
    }

    #[tokio::test(start_paused = true)]
    async fn cancelled_waiters_take_no_token() {
        let l = Limiter::new("10s,1".parse().unwrap());
        l.wait().await;
        // This waiter gives up after 5 s; the token that arrives at 10 s must still be there.
        assert!(tokio::time::timeout(Duration::from_secs(5), l.wait())
            .await
            .is_err());
        let t = Instant::now();
        l.wait().await;
        assert_eq!(t.elapsed(), Duration::from_secs(5));
    }
}
