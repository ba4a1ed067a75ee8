//! A session's lease as this process sees it (design.md §3, §20): the time within which the
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

/// What a lease reports to its session's metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseEvent {
    /// The lease was found expired (once; not when it is closed).
    Expired,
    /// The side effect named here was not started, or was cut off, because the lease ended.
    Fenced(&'static str),
}

/// A session's lease as its process keeps it: the local deadline, moved by each successful
/// keep-alive, and whether the session ended. Owned by the session; [`Lease`] handles hold it
/// weakly.
pub(crate) struct LeaseClock {
    state: Mutex<ClockState>,
    /// Woken when the lease ends early (expired, closed, or its session dropped), so that
    /// [`Lease::lost`] resolves.
    changed: Arc<Notify>,
    /// Told of the lease's expiry and of each side effect it fenced.
    on_event: Box<dyn Fn(LeaseEvent) + Send + Sync>,
}

struct ClockState {
    ended: bool,
    deadline: Instant,
}

impl LeaseClock {
    /// A lease held until `deadline`; `on_event` counts its expiry and the steps it fenced.
    pub(crate) fn new(
        deadline: Instant,
        on_event: impl Fn(LeaseEvent) + Send + Sync + 'static,
    ) -> Self {
        LeaseClock {
            state: Mutex::new(ClockState {
                ended: false,
                deadline,
            }),
            changed: Arc::default(),
            on_event: Box::new(on_event),
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
            (self.on_event)(LeaseEvent::Expired);
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

    /// Runs `effect`, the side effect on a machine or at a provider that `step` names (an SSH
    /// exec, a BMC power action, a creation at a provider), fenced by the lease (design.md
    /// §20): not started once the lease has ended, and dropped (its connection closed, its
    /// request abandoned) if the lease ends while it runs. A step fenced either way is counted
    /// in `shepherd_fenced_steps_total{processor,step}`. The SSH steps, the bare-metal loop's
    /// BMC calls and the recoverer's reboot go through it; the providers' own requests (a
    /// creation, a reboot's reset, a hand-back) go through [`Lease::may_start`] instead, since
    /// cutting one off does not undo it at the provider.
    pub async fn fenced<T>(
        &self,
        step: &'static str,
        effect: impl std::future::Future<Output = T>,
    ) -> Result<T, LeaseLost> {
        self.may_start(step)?;
        tokio::select! {
            biased;
            _ = self.lost() => {
                self.count_fenced(step);
                Err(LeaseLost)
            }
            done = effect => Ok(done),
        }
    }

    /// Whether the side effect `step` names may start: `Ok` while the lease holds; once it
    /// has ended, [`LeaseLost`], and the step is counted as fenced like one [`Lease::fenced`]
    /// stopped. For a step that must not be cut off once started (a provider's request that
    /// may already have taken effect when dropped): check right before it, then let it run.
    pub fn may_start(&self, step: &'static str) -> Result<(), LeaseLost> {
        if self.left().is_err() {
            self.count_fenced(step);
            return Err(LeaseLost);
        }
        Ok(())
    }

    /// Counts `step` as fenced, while the session is there to count it.
    fn count_fenced(&self, step: &'static str) {
        if let Some(clock) = self.clock.as_ref().and_then(Weak::upgrade) {
            (clock.on_event)(LeaseEvent::Fenced(step));
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A lease until `deadline` whose fenced steps are collected in the returned list.
    fn clock_until(deadline: Instant) -> (Arc<LeaseClock>, Arc<Mutex<Vec<LeaseEvent>>>) {
        let events = Arc::new(Mutex::new(Vec::new()));
        let seen = events.clone();
        let clock = LeaseClock::new(deadline, move |e| seen.lock().unwrap().push(e));
        (Arc::new(clock), events)
    }

    #[tokio::test(start_paused = true)]
    async fn a_fenced_step_runs_only_while_the_lease_holds_and_is_counted_when_stopped() {
        let (clock, events) = clock_until(Instant::now() + Duration::from_secs(10));
        let lease = Lease::of(&clock);

        // Within the lease: the step runs and its result comes back; nothing is counted.
        assert_eq!(lease.fenced("reset", async { 7 }).await, Ok(7));
        assert!(events.lock().unwrap().is_empty());

        // A step still running when the lease ends is cut off there, and counted.
        let started = Instant::now();
        let slow = tokio::time::sleep(Duration::from_secs(60));
        assert_eq!(lease.fenced("power off", slow).await, Err(LeaseLost));
        assert_eq!(started.elapsed(), Duration::from_secs(10));

        // Once the lease has ended, a step does not start at all.
        let ran = std::sync::atomic::AtomicBool::new(false);
        let effect = async { ran.store(true, std::sync::atomic::Ordering::SeqCst) };
        assert_eq!(lease.fenced("deploy", effect).await, Err(LeaseLost));
        assert!(!ran.load(std::sync::atomic::Ordering::SeqCst));
        assert_eq!(
            *events.lock().unwrap(),
            [
                LeaseEvent::Expired,
                LeaseEvent::Fenced("power off"),
                LeaseEvent::Fenced("deploy"),
            ]
        );

        // A lease that never ends fences nothing.
        assert_eq!(Lease::unbounded().fenced("reset", async { 1 }).await, Ok(1));
    }

    /// A step checked before it starts (a provider's request, not to be cut off) is refused
    /// and counted once the lease has ended, and only then.
    #[tokio::test(start_paused = true)]
    async fn a_step_that_may_not_start_is_counted_as_fenced() {
        let (clock, events) = clock_until(Instant::now() + Duration::from_secs(10));
        let lease = Lease::of(&clock);
        assert_eq!(lease.may_start("create allocation"), Ok(()));
        assert!(events.lock().unwrap().is_empty());
        tokio::time::sleep(Duration::from_secs(11)).await;
        assert_eq!(lease.may_start("deploy"), Err(LeaseLost));
        let fenced: Vec<_> = events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| matches!(e, LeaseEvent::Fenced(_)))
            .copied()
            .collect();
        assert_eq!(fenced, [LeaseEvent::Fenced("deploy")]);
        assert_eq!(Lease::unbounded().may_start("deploy"), Ok(()));
    }
}
