//! A session's lease as this process sees it (SPEC §3, §20): the time within which the
//! database still counts the session alive, so that work the session holds is this
//! process's alone. Side effects on machines (an SSH step, a BMC reset, a provider call that
//! changes something) run only while it holds: each is checked right before it starts, and
//! every machine task is raced against [`Lease::lost`], so a step under way is dropped (its
//! connection closed) once the lease ends.
//!
//! The arithmetic, with `I` the keep-alive interval:
//! - a keep-alive that starts at local instant `t` and commits moves the row's deadline to
//!   the database's `now() + I`, and the database's `now()` is later than `t`; so the row's
//!   deadline is at least `t + I` measured in the database's seconds;
//! - the lease ends locally at `t + I − I/20` ([`drift_margin`]): the margin covers a rate
//!   difference of up to 5 % between this host's monotonic clock and the database's (NTP
//!   keeps them within 0.05 %), plus the moment between a check and its side effect;
//! - another replica can claim the machine only after its own `now()` passed the row's
//!   deadline and its collector released the session, so no two leases on one machine
//!   overlap in real time;
//! - a paused or partitioned process makes no keep-alive; its lease runs out on its monotonic
//!   clock, which keeps counting through a pause (`SIGSTOP`), so after `SIGCONT` the lease is
//!   seen lost before any step starts.
//!
//! The keep-alive runs every `I/3` and retries a failed one after `I/10`, so a healthy
//! session renews two or three times per interval and never comes near its deadline.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

/// What a lease gives up to clock-rate differences and the check-to-effect gap: a twentieth
/// of the keep-alive interval.
pub(crate) fn drift_margin(interval: Duration) -> Duration {
    interval / 20
}

/// The lease ended before a step could start: the session expired, was closed, or its last
/// successful keep-alive is too long ago. The work's machine may belong to another replica
/// now; nothing more is done to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("lease lost")]
pub struct LeaseLost;

/// A session's lease as its process keeps it: the local deadline, moved by each successful
/// keep-alive, and whether the session ended. Owned by the session; [`Lease`] handles hold it
/// weakly.
pub(crate) struct LeaseClock {
    state: Mutex<ClockState>,
    /// Woken when the lease ends early (expired, closed, or its session dropped), so that
    /// [`Lease::lost`] resolves.
    changed: Arc<Notify>,
    /// Called once when the lease is found expired (not when it is closed).
    on_expiry: Box<dyn Fn() + Send + Sync>,
}

struct ClockState {
    ended: bool,
    deadline: Instant,
}

impl LeaseClock {
    /// A lease held until `deadline`; `on_expiry` counts its expiry.
    pub(crate) fn new(deadline: Instant, on_expiry: impl Fn() + Send + Sync + 'static) -> Self {
        LeaseClock {
            state: Mutex::new(ClockState {
                ended: false,
                deadline,
            }),
            changed: Arc::default(),
            on_expiry: Box::new(on_expiry),
        }
    }

    /// The local deadline while the lease holds; once it has passed, the lease is marked
    /// expired (counted the first time) and lost.
    pub(crate) fn deadline(&self) -> Result<Instant, LeaseLost> {
        let mut st = self.state.lock().unwrap();
        if !st.ended && Instant::now() >= st.deadline {
            st.ended = true;
            drop(st);
            self.ended(true);
            return Err(LeaseLost);
        }
        if st.ended {
            Err(LeaseLost)
        } else {
            Ok(st.deadline)
        }
    }

    /// Moves the deadline (after a keep-alive that committed) unless the lease already ended.
    pub(crate) fn renew(&self, deadline: Instant) {
        let mut st = self.state.lock().unwrap();
        if !st.ended {
            st.deadline = deadline;
        }
    }

    /// Ends the lease: `expired` (the database let go, or keep-alives failed past the
    /// deadline; counted) or closed by its owner.
    pub(crate) fn end(&self, expired: bool) {
        let mut st = self.state.lock().unwrap();
        if !st.ended {
            st.ended = true;
            drop(st);
            self.ended(expired);
        }
    }

    fn ended(&self, expired: bool) {
        if expired {
            (self.on_expiry)();
        }
        self.changed.notify_waiters();
    }
}

impl Drop for LeaseClock {
    fn drop(&mut self) {
        self.changed.notify_waiters();
    }
}

/// A session's lease, cheap to clone and to check. Holding one does not keep the session
/// alive: once every [`crate::Session`] handle is gone, the lease is lost.
#[derive(Clone)]
pub struct Lease {
    clock: Option<Weak<LeaseClock>>,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.clock {
            Some(_) => f.debug_struct("Lease").field("left", &self.left()).finish(),
            None => f.write_str("Lease(unbounded)"),
        }
    }
}

impl Lease {
    pub(crate) fn of(clock: &Arc<LeaseClock>) -> Lease {
        Lease {
            clock: Some(Arc::downgrade(clock)),
        }
    }

    /// A lease that never ends, for steps taken outside any claimed work (benchmarks, tools
    /// that act on one machine an operator named).
    pub fn unbounded() -> Lease {
        Lease { clock: None }
    }

    /// How long the lease still holds, or [`LeaseLost`]. Check right before each side
    /// effect; a step that needs longer than this may be cut off when the lease ends.
    pub fn left(&self) -> Result<Duration, LeaseLost> {
        let Some(clock) = &self.clock else {
            return Ok(Duration::MAX);
        };
        let deadline = clock.upgrade().ok_or(LeaseLost)?.deadline()?;
        Ok(deadline.saturating_duration_since(Instant::now()))
    }

    /// Resolves once the lease has ended (at its local deadline, or when the session is
    /// expired or closed); never, for an unbounded lease. Renewals push it back.
    pub async fn lost(&self) {
        let Some(weak) = &self.clock else {
            return std::future::pending().await;
        };
        loop {
            // The clock is not held while waiting, so that dropping the session ends the
            // lease; the notification is registered before the deadline is read.
            let Some(clock) = weak.upgrade() else { return };
            let notify = clock.changed.clone();
            let changed = notify.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let Ok(deadline) = clock.deadline() else {
                return;
            };
            drop(clock);
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {}
                _ = changed => {}
            }
        }
    }
}
