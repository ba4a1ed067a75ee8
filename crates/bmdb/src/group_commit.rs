//! Group commit: many concurrent callers' small writes gathered into one transaction. A fleet
//! of 100,000 agents heartbeating every 30 s is 3,300 small writes a second, and a loop's
//! workers claim and end work as fast as the database lets them; one transaction each leaves
//! the database little else to do (and SQLite has one writer).
//!
//! A caller [`GroupCommit::join`]s the open batch with its item and gets the receiver of its
//! own answer. The caller that opens a batch is its leader: it [`GroupCommit::gather`]s the
//! batch — waiting for the previous batch of the group to be answered, then for at most the
//! group's `wait` after the batch opened or until it holds `max` items — has the items written
//! in one transaction, and [`Gathered::answer`]s every member, each only after the batch
//! committed and with its own outcome. The writing stays with the caller (the
//! session's heartbeats, `claim_batch.rs`, `ending_batch.rs`): this module only gathers and
//! answers, and calls nothing back.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{oneshot, Notify, OwnedMutexGuard};
use tokio::time::Instant;

use crate::Error;

/// What a member is told: its own outcome, or the batch's failure.
pub(crate) type Answer<R> = Result<R, Error>;

/// The items of one batch and where their answers go.
struct Members<T, R> {
    items: Vec<T>,
    replies: Vec<oneshot::Sender<Answer<R>>>,
}

/// One batch while it gathers members; `full` wakes its leader when it holds `max` items.
struct Batch<T, R> {
    members: Mutex<Members<T, R>>,
    full: Notify,
}

/// Gathers concurrent items into batches, one batch written at a time. (Writing a few at once
/// was measured: batches shrink, and the database works more per item.)
pub(crate) struct GroupCommit<T, R> {
    /// The batch new items join; `None` once it is full or gathered (the next item opens one).
    open: Mutex<Option<Arc<Batch<T, R>>>>,
    /// Held from a batch's gathering until it is answered, so batches are written in turn.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// Most items in one batch.
    max: usize,
    /// Longest a batch gathers after it opened.
    wait: Duration,
}

/// The caller opened a batch: it must [`GroupCommit::gather`] it and have it written.
pub(crate) struct Leader<T, R> {
    batch: Arc<Batch<T, R>>,
    opened: Instant,
}

/// A gathered batch: its items, to be written together, and the members to answer.
pub(crate) struct Gathered<T, R> {
    members: Members<T, R>,
    /// The group's turn, given back when the batch is answered (or dropped).
    _turn: OwnedMutexGuard<()>,
}

impl<T, R> GroupCommit<T, R> {
    /// Batches of at most `max` items, gathering for at most `wait`.
    pub(crate) fn new(max: usize, wait: Duration) -> Self {
        GroupCommit {
            open: Mutex::new(None),
            turn: Arc::new(tokio::sync::Mutex::new(())),
            max: max.max(1),
            wait,
        }
    }

    /// Adds `item` to the open batch (opening one if there is none) and returns the receiver
    /// of its answer, and the batch to lead if this call opened it. A receiver whose batch is
    /// dropped unanswered (its writer never ran: the runtime is shutting down) is closed.
    pub(crate) fn join(&self, item: T) -> (oneshot::Receiver<Answer<R>>, Option<Leader<T, R>>) {
        let (reply, answer) = oneshot::channel();
        let mut open = self.open.lock().expect("group commit state");
        let (batch, leader) = match &*open {
            Some(batch) => (batch.clone(), None),
            None => {
                let batch = Arc::new(Batch {
                    members: Mutex::new(Members {
                        items: Vec::new(),
                        replies: Vec::new(),
                    }),
                    full: Notify::new(),
                });
                *open = Some(batch.clone());
                let leader = Leader {
                    batch: batch.clone(),
                    opened: Instant::now(),
                };
                (batch, Some(leader))
            }
        };
        let mut members = batch.members.lock().expect("batch members");
        members.items.push(item);
        members.replies.push(reply);
        if members.items.len() >= self.max {
            // Full: later items open the next batch, and the leader need not wait longer.
            *open = None;
            batch.full.notify_one();
        }
        (answer, leader)
    }

    /// Closes the leader's batch once the previous batch was answered and the batch is full
    /// or has gathered for the group's `wait`; returns it to be written.
    pub(crate) async fn gather(&self, leader: Leader<T, R>) -> Gathered<T, R> {
        let turn = self.turn.clone().lock_owned().await;
        if self.wait.is_zero() {
            // A batch that does not wait takes what joined while the previous one was written,
            // and what the callers already woken (by the previous batch's answers) bring when
            // they run: yielding twice lets them, and makes batches half as large again at no
            // cost in latency. A timer, even one already due, would cost a tick of the timer
            // wheel (a millisecond).
            for _ in 0..2 {
                tokio::task::yield_now().await;
            }
        } else {
            tokio::select! {
                _ = tokio::time::sleep_until(leader.opened + self.wait) => {}
                _ = leader.batch.full.notified() => {}
            }
        }
        {
            let mut open = self.open.lock().expect("group commit state");
            if open.as_ref().is_some_and(|b| Arc::ptr_eq(b, &leader.batch)) {
                *open = None;
            }
        }
        let members = std::mem::replace(
            &mut *leader.batch.members.lock().expect("batch members"),
            Members {
                items: Vec::new(),
                replies: Vec::new(),
            },
        );
        Gathered {
            members,
            _turn: turn,
        }
    }
}

impl<T, R> Gathered<T, R> {
    /// The batch's items, in the order they joined.
    pub(crate) fn items(&self) -> &[T] {
        &self.members.items
    }

    /// Answers every member: with its own outcome when the batch was written (`outcomes`, one
    /// per item, in order), else with the batch's error — [`Error::SessionExpired`] as it is,
    /// anything else as [`Error::BatchFailed`]. An outcome whose caller went away is dropped:
    /// a caller that must act on its outcome even then receives it in a task of its own
    /// (`claim_batch.rs`).
    pub(crate) fn answer(self, written: Result<Vec<Answer<R>>, Error>) {
        let replies = self.members.replies;
        debug_assert!(
            written.as_ref().map_or(true, |o| o.len() == replies.len()),
            "one outcome per member"
        );
        match written {
            Ok(outcomes) => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(outcome);
                }
            }
            Err(Error::SessionExpired) => {
                for reply in replies {
                    let _ = reply.send(Err(Error::SessionExpired));
                }
            }
            Err(e) => {
                let shared = Arc::new(e);
                for reply in replies {
                    let _ = reply.send(Err(Error::BatchFailed(shared.clone())));
                }
            }
        }
    }
}

/// Group commits kept apart by key (items of different keys never share a batch), each
/// gathering without a timer, created on first use.
pub(crate) struct GroupsByKey<K, T, R> {
    max: usize,
    groups: Mutex<HashMap<K, Arc<GroupCommit<T, R>>>>,
}

impl<K: Eq + Hash, T, R> GroupsByKey<K, T, R> {
    /// Groups whose batches hold at most `max` items.
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            groups: Mutex::new(HashMap::new()),
        }
    }

    /// The group of `key`.
    pub(crate) fn group(&self, key: K) -> Arc<GroupCommit<T, R>> {
        let mut groups = self.groups.lock().expect("group commits by key");
        groups
            .entry(key)
            .or_insert_with(|| Arc::new(GroupCommit::new(self.max, Duration::ZERO)))
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Joins `n` items concurrently and has each batch written by its leader, recording the
    /// batches; returns each item's answer and the batches.
    async fn run(group: Arc<GroupCommit<u32, u32>>, n: u32) -> (Vec<u32>, Vec<Vec<u32>>) {
        let batches = Arc::new(Mutex::new(Vec::new()));
        let calls = (0..n).map(|i| {
            let (group, batches) = (group.clone(), batches.clone());
            tokio::spawn(async move {
                let (answer, leader) = group.join(i);
                if let Some(leader) = leader {
                    let gathered = group.gather(leader).await;
                    let items = gathered.items().to_vec();
                    batches.lock().unwrap().push(items.clone());
                    gathered.answer(Ok(items.iter().map(|i| Ok(i * 10)).collect()));
                }
                answer.await.unwrap().unwrap()
            })
        });
        let answers = futures::future::join_all(calls).await;
        let answers = answers.into_iter().map(|a| a.unwrap()).collect();
        let batches = batches.lock().unwrap().clone();
        (answers, batches)
    }

    #[tokio::test]
    async fn concurrent_items_share_batches_of_at_most_max_and_each_gets_its_own_answer() {
        let group = Arc::new(GroupCommit::new(8, Duration::from_millis(20)));
        let (answers, batches) = run(group, 50).await;
        assert_eq!(answers, (0..50).map(|i| i * 10).collect::<Vec<_>>());
        assert!(
            batches.iter().all(|b| !b.is_empty() && b.len() <= 8),
            "{batches:?}"
        );
        assert!(batches.len() < 50, "nothing was batched: {batches:?}");
        let mut all: Vec<u32> = batches.concat();
        all.sort();
        assert_eq!(
            all,
            (0..50).collect::<Vec<_>>(),
            "each item in exactly one batch"
        );
    }

    #[tokio::test]
    async fn a_failed_batch_fails_its_members_and_only_them() {
        let group = GroupCommit::<u32, u32>::new(2, Duration::from_millis(10));
        let (first, leader) = group.join(1);
        let (second, none) = group.join(2);
        assert!(none.is_none());
        let (third, next) = group.join(3);
        let gathered = group.gather(leader.unwrap()).await;
        assert_eq!(gathered.items(), &[1, 2]);
        gathered.answer(Err(Error::Unavailable {
            target: "db".into(),
            cause: "refused".into(),
        }));
        for answer in [first, second] {
            let e = answer.await.unwrap().unwrap_err();
            assert!(
                matches!(e, Error::BatchFailed(_)) && e.is_transient(),
                "{e}"
            );
        }
        let gathered = group
            .gather(next.expect("a full batch opens the next"))
            .await;
        assert_eq!(gathered.items(), &[3]);
        gathered.answer(Ok(vec![Ok(30)]));
        assert_eq!(third.await.unwrap().unwrap(), 30);
    }

    #[tokio::test]
    async fn an_expired_session_is_told_as_it_is() {
        let group = GroupCommit::<u32, u32>::new(4, Duration::ZERO);
        let (answer, leader) = group.join(1);
        group
            .gather(leader.unwrap())
            .await
            .answer(Err(Error::SessionExpired));
        assert!(matches!(answer.await.unwrap(), Err(Error::SessionExpired)));
    }
}
