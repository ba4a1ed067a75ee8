//! Turns at SQLite's one writer connection. Every write transaction of a SQLite BMDB waits
//! for the one writer; under load dozens wait at once (heartbeat batches, claims, endings),
//! and a session's keep-alive queued behind them all can miss its deadline: the session
//! expires, and every write made through it fails until a new one is started, which adds
//! more writes. So a lease's keep-alive ([`Urgency::Lease`]) goes before every waiting
//! writer, and the facts agents send ([`Urgency::Facts`]: heartbeat batches) before the
//! loops' work, which only slows down. Within an urgency, turns go in arrival order.
//!
//! Slowing down must not become stopping: while facts arrive faster than the writer records
//! them, strict priority would leave the loops' work waiting for good (their claims time out,
//! expired sessions are never collected, takeovers stop). So waiting work is passed over at
//! most [`WORK_PASSED_OVER`] times in a row by facts; then it gets the next turn. Keep-alives
//! still go first: one per session and interval, they cannot crowd anything out.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// How soon a writer must write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Urgency {
    /// The loops' work: claims, endings, tags. Waits for the others.
    Work = 0,
    /// What agents and servers report: heartbeats and the server's own state.
    Facts = 1,
    /// Keeping a session alive.
    Lease = 2,
}

const URGENCIES: usize = 3;

/// How many turns in a row facts may take while work waits: work gets at least one writer
/// turn in `WORK_PASSED_OVER + 1` that facts or work ask for.
pub(crate) const WORK_PASSED_OVER: u32 = 3;

/// The writer's turns: who holds it, and who waits, by urgency.
#[derive(Debug, Default)]
pub(crate) struct WriterTurns {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    held: bool,
    waiting: [VecDeque<oneshot::Sender<()>>; URGENCIES],
    /// Turns facts took in a row while work waited.
    work_passed_over: u32,
}

impl State {
    /// The urgency whose first waiter goes next: a keep-alive; then work, if facts passed it
    /// over [`WORK_PASSED_OVER`] times; then facts; then work. `None` if nobody waits.
    fn next(&mut self) -> Option<Urgency> {
        let waits = |u: Urgency| !self.waiting[u as usize].is_empty();
        let next = if waits(Urgency::Lease) {
            Urgency::Lease
        } else if waits(Urgency::Work)
            && (self.work_passed_over >= WORK_PASSED_OVER || !waits(Urgency::Facts))
        {
            Urgency::Work
        } else if waits(Urgency::Facts) {
            Urgency::Facts
        } else {
            return None;
        };
        match next {
            Urgency::Work => self.work_passed_over = 0,
            Urgency::Facts if waits(Urgency::Work) => self.work_passed_over += 1,
            _ => {}
        }
        Some(next)
    }
}

/// The writer's turn, held until dropped; then the most urgent waiter gets it.
#[derive(Debug)]
pub(crate) struct WriterTurn {
    turns: Arc<WriterTurns>,
}

/// A waiter: if it is dropped after it was given the turn but before it took it (its caller
/// went away), it passes the turn on.
struct Waiting {
    turns: Arc<WriterTurns>,
    given: Option<oneshot::Receiver<()>>,
}

impl WriterTurns {
    /// Waits for the writer's turn at `urgency`.
    pub(crate) async fn take(self: &Arc<Self>, urgency: Urgency) -> WriterTurn {
        let given = {
            let mut state = self.state.lock().expect("writer turns");
            if !state.held {
                state.held = true;
                return WriterTurn {
                    turns: self.clone(),
                };
            }
            let (give, given) = oneshot::channel();
            state.waiting[urgency as usize].push_back(give);
            given
        };
        let mut waiting = Waiting {
            turns: self.clone(),
            given: Some(given),
        };
        let given = waiting.given.as_mut().expect("waiting");
        // A queued waiter's sender serves one purpose: giving it the turn (`pass_on`).
        given
            .await
            .expect("a waiter's turn is given, never dropped");
        waiting.given = None;
        WriterTurn {
            turns: self.clone(),
        }
    }

    /// Gives the turn to the waiter [`State::next`] names, or frees the writer.
    fn pass_on(&self) {
        let mut state = self.state.lock().expect("writer turns");
        while let Some(urgency) = state.next() {
            let give = state.waiting[urgency as usize]
                .pop_front()
                .expect("next names an urgency with a waiter");
            // A waiter that went away has dropped its receiver: the next one gets it.
            if give.send(()).is_ok() {
                return;
            }
        }
        state.held = false;
    }

    /// How many writers wait for the turn, by urgency (least urgent first).
    #[cfg(test)]
    fn waiting(&self) -> [usize; URGENCIES] {
        let state = self.state.lock().expect("writer turns");
        [0, 1, 2].map(|u| state.waiting[u].len())
    }
}

impl Drop for WriterTurn {
    fn drop(&mut self) {
        self.turns.pass_on();
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if let Some(mut given) = self.given.take() {
            if given.try_recv().is_ok() {
                self.turns.pass_on();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Queues a waiter for each of `queue`, in that order (each is waiting before the next
    /// comes); each, given the turn, appends its name to the returned order and holds the turn
    /// for `hold`. Their tasks, to wait for.
    async fn queue_waiters(
        turns: &Arc<WriterTurns>,
        queue: impl IntoIterator<Item = (String, Urgency)>,
        hold: Duration,
    ) -> (Arc<Mutex<Vec<String>>>, Vec<tokio::task::JoinHandle<()>>) {
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiters = Vec::new();
        for (name, urgency) in queue {
            let (turns, order) = (turns.clone(), order.clone());
            waiters.push(tokio::spawn(async move {
                let _turn = turns.take(urgency).await;
                order.lock().unwrap().push(name);
                tokio::time::sleep(hold).await;
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (order, waiters)
    }

    /// The holder's successor is the most urgent waiter, in arrival order within an urgency;
    /// a waiter that went away is skipped, even one that had already been given the turn.
    #[tokio::test]
    async fn the_most_urgent_waiter_goes_next_and_no_turn_is_lost() {
        let turns = Arc::new(WriterTurns::default());
        let first = turns.take(Urgency::Work).await;
        let queue = [
            ("work-1", Urgency::Work),
            ("facts", Urgency::Facts),
            ("work-2", Urgency::Work),
            ("lease", Urgency::Lease),
        ]
        .map(|(name, urgency)| (name.to_string(), urgency));
        let (order, waiters) = queue_waiters(&turns, queue, Duration::from_millis(5)).await;
        // One more that goes away while it waits.
        let gone = {
            let turns = turns.clone();
            tokio::spawn(async move { turns.take(Urgency::Lease).await })
        };
        tokio::time::sleep(Duration::from_millis(5)).await;
        gone.abort();
        assert_eq!(turns.waiting(), [2, 1, 2]);
        drop(first);
        for w in waiters {
            w.await.unwrap();
        }
        assert_eq!(
            *order.lock().unwrap(),
            ["lease", "facts", "work-1", "work-2"]
        );
        // The writer is free again.
        assert_eq!(turns.waiting(), [0, 0, 0]);
        drop(turns.take(Urgency::Work).await);

        // A waiter given the turn that goes away before taking it passes it on.
        let held = turns.take(Urgency::Work).await;
        let turns2 = turns.clone();
        let mut late = Box::pin(async move { turns2.take(Urgency::Work).await });
        assert!(futures::poll!(late.as_mut()).is_pending());
        drop(held);
        drop(late);
        tokio::time::timeout(Duration::from_secs(1), turns.take(Urgency::Work))
            .await
            .expect("the turn was passed on");
    }

    /// Facts that keep coming do not stop work: a work waiter queued behind a crowd of facts
    /// goes after at most `WORK_PASSED_OVER` of them, and again after as many more.
    #[tokio::test]
    async fn work_is_passed_over_a_bounded_number_of_times() {
        let turns = Arc::new(WriterTurns::default());
        let first = turns.take(Urgency::Facts).await;
        let queue = (0..12)
            .map(|i| (format!("facts-{i}"), Urgency::Facts))
            .chain((0..2).map(|i| (format!("work-{i}"), Urgency::Work)));
        let (order, waiters) = queue_waiters(&turns, queue, Duration::ZERO).await;
        assert_eq!(turns.waiting(), [2, 12, 0]);
        drop(first);
        for w in waiters {
            w.await.unwrap();
        }
        let order = order.lock().unwrap();
        let at = |name: &str| order.iter().position(|n| n == name).unwrap();
        let k = WORK_PASSED_OVER as usize;
        assert_eq!(at("work-0"), k, "{order:?}");
        assert_eq!(at("work-1"), 2 * k + 1, "{order:?}");
    }
}
