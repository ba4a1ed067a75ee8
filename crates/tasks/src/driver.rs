//! The driver of a background task that does one unit of work at a time (the recovery brake's
//! count, the fleet statistics' refresh): every unit is reported to the task's
//! [`TaskHandle`] as it ended, a panic included. A panicking unit is a defect: it is reported
//! `Panicked` with its message and logged, and the next unit comes after the usual pause, so
//! that one task's defect neither ends the process's other loops (they often run in one
//! `join!`) nor goes unseen in `/tasks` and `shepherd_task_passes_total`.
//!
//! The periodic passes (`periodic.rs`) and the machine workers (`runner.rs`) catch panics the
//! same way, around a unit that also needs a session or a claim.

use std::future::Future;
use std::panic::AssertUnwindSafe;

use futures::FutureExt;
use tokio_util::sync::CancellationToken;

use crate::{panic_message, Outcome, TaskHandle};

/// Runs `unit` until `cancel`, with `pause` between units; each unit returns how it ended and
/// a one-line summary, and is reported to `task` ([`one_unit`]).
pub async fn repeat<U, P>(
    task: &TaskHandle,
    cancel: &CancellationToken,
    mut unit: impl FnMut() -> U,
    mut pause: impl FnMut() -> P,
) where
    U: Future<Output = (Outcome, String)>,
    P: Future<Output = ()>,
{
    loop {
        one_unit(task, unit()).await;
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return,
            _ = pause() => {}
        }
    }
}

/// Runs one unit of `task`'s work, which returns how it ended and a one-line summary, and
/// reports it to `task`: for a task driven by events rather than a timer (the audit trail's
/// batches). A unit that panics is reported `Panicked` with its message and logged; whatever
/// it held is dropped while unwinding (a guard in it can make that safe).
pub async fn one_unit(task: &TaskHandle, unit: impl Future<Output = (Outcome, String)>) {
    task.started();
    let (outcome, summary) = match AssertUnwindSafe(unit).catch_unwind().await {
        Ok(ended) => ended,
        Err(payload) => {
            let message = panic_message(&*payload);
            tracing::error!(task = task.name(), panic = %message, "a task's unit of work panicked; the next one comes as usual");
            (Outcome::Panicked, message)
        }
    };
    task.ended(outcome, summary);
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::{TaskKind, Tasks};

    /// A unit that panics is shown panicked with its message, and the units after it run:
    /// the task goes on, and so does anything beside it.
    #[tokio::test]
    async fn a_panicking_unit_is_reported_and_the_task_goes_on() {
        let tasks = Tasks::default();
        let task = tasks.task_of("counting", TaskKind::Periodic);
        let cancel = CancellationToken::new();
        let units = AtomicU32::new(0);
        let beside = AtomicU32::new(0);
        let driven = repeat(
            &task,
            &cancel,
            || async {
                let n = units.fetch_add(1, Ordering::Relaxed);
                if n == 1 {
                    panic!("injected: count {n}");
                }
                if n == 4 {
                    cancel.cancel();
                }
                (Outcome::Succeeded, format!("count {n}"))
            },
            || tokio::time::sleep(Duration::from_millis(1)),
        );
        let other_loop = async {
            while !cancel.is_cancelled() {
                beside.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(driven, other_loop)
        })
        .await
        .expect("the task ends when canceled");
        let status = tasks.statuses().into_iter().find(|s| s.name == "counting");
        let status = status.expect("the task is listed");
        assert_eq!(status.count(Outcome::Panicked), 1, "{status:?}");
        assert_eq!(status.count(Outcome::Succeeded), 4, "{status:?}");
        assert!(beside.load(Ordering::Relaxed) > 0);
        assert_eq!(units.load(Ordering::Relaxed), 5);
    }
}
