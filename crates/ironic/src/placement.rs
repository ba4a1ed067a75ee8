//! How long Ironic's conductor takes to place an allocation, learnt from the claims of this
//! process, so that a claim looks at its allocation once, when it is most likely placed,
//! instead of polling it from the moment it was made.
//!
//! The estimate tracks a high quantile of placement times: every claim whose first look found
//! the allocation placed lowers it by [`DOWN`] (it may have been placed well before); one that
//! had to look again raises it by [`UP`]. In balance about one claim in forty looks more than
//! once (where `(1 - DOWN)^(1 - p) * (1 + UP)^p = 1`), and the estimate follows Ironic when it
//! slows down or speeds up. A miss raises it by a share, not to the time the claim took: an
//! early look can itself delay a placement (a marking patch holds the node's lock, and
//! Ironic's allocator then waits a second before trying the node again), and that second is
//! no placement time to learn.

use std::sync::Mutex;
use std::time::Duration;

/// The first estimate, before any claim was made: generous, since a look that comes too early
/// can slow the placement it looks for (see above), and a process's first claims are the ones
/// most likely to meet a busy Ironic (every replica starting at once). Claims that find their
/// allocation placed bring it down within a few hundred claims.
const INITIAL: Duration = Duration::from_secs(1);
/// The least estimate: below it the look is all but free of waiting anyway.
const FLOOR: Duration = Duration::from_millis(20);
/// The greatest estimate: a claim never waits longer than this before its first look.
const CEILING: Duration = Duration::from_secs(5);
/// The share the estimate drops by after a first look that found the allocation placed.
const DOWN: f64 = 0.01;
/// The share the estimate grows by (at least) after a first look that was too early.
const UP: f64 = 0.5;

/// The learnt placement time. Shared by every claim of one provider.
#[derive(Debug)]
pub struct PlacementEstimate {
    estimate: Mutex<Duration>,
}

impl Default for PlacementEstimate {
    fn default() -> Self {
        PlacementEstimate {
            estimate: Mutex::new(INITIAL),
        }
    }
}

impl PlacementEstimate {
    /// How long a new claim waits before its first look at its allocation.
    pub fn first_look(&self) -> Duration {
        *self.estimate.lock().unwrap()
    }

    /// A first look found the allocation placed.
    pub fn placed_at_first_look(&self) {
        let mut e = self.estimate.lock().unwrap();
        *e = e.mul_f64(1.0 - DOWN).max(FLOOR);
    }

    /// A first look was too early.
    pub fn placed_later(&self) {
        let mut e = self.estimate.lock().unwrap();
        *e = e.mul_f64(1.0 + UP).clamp(FLOOR, CEILING);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_settles_where_first_looks_rarely_miss() {
        // Placements take 300 ms to 400 ms (uniform); a claim looks after the estimate and,
        // when that is too early, again 50 ms later, until it sees the allocation placed.
        let e = PlacementEstimate::default();
        let (mut looks, claims) = (0u32, 5000u32);
        for i in 0..claims {
            let placement = Duration::from_millis(300 + u64::from(i * 37 % 101));
            let mut seen = e.first_look();
            looks += 1;
            if seen >= placement {
                e.placed_at_first_look();
                continue;
            }
            while seen < placement {
                seen += Duration::from_millis(50);
                looks += 1;
            }
            e.placed_later();
        }
        let per_claim = f64::from(looks) / f64::from(claims);
        assert!(per_claim < 1.1, "{per_claim} looks per claim");
        let settled = e.first_look();
        assert!(
            (Duration::from_millis(300)..=Duration::from_millis(700)).contains(&settled),
            "{settled:?}"
        );
    }

    #[test]
    fn the_estimate_stays_within_its_bounds() {
        let e = PlacementEstimate::default();
        for _ in 0..1000 {
            e.placed_at_first_look();
        }
        assert_eq!(e.first_look(), FLOOR);
        for _ in 0..100 {
            e.placed_later();
        }
        assert_eq!(e.first_look(), CEILING);
    }
}
