//! What this server did with the heartbeats it received, so that the recoverer never takes a
//! silence the server caused for the machine's (ARCHITECTURE.md, "A machine is silent only
//! if it was silent").
//!
//! Each heartbeat is counted from its arrival to its answer. One refused because the BMDB
//! failed or because too many are in flight (shed, with a "retry after" hint), or answered
//! later than [`LATE`], makes the server *in trouble* from that heartbeat's arrival; a
//! heartbeat in flight longer than [`LATE`] does too. A trouble ends once none was seen for
//! [`QUIET`]. Every [`REPORT_EVERY`] a reporter task writes the state to the BMDB
//! (`heartbeat_writers`): clean, in trouble since when, or the window of a trouble that ended.
//! Bounded in-flight heartbeats are also the server's back-pressure: it sheds before its queues
//! (and its memory) grow.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{Bmdb, WriterReport, WriterState};
use shepherd_tasks::driver;
use shepherd_tasks::{Outcome, TaskHandle};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// A heartbeat answered (or still unanswered) this long after it arrived was recorded late.
pub const LATE: Duration = Duration::from_secs(5);

/// How often the state is written to the BMDB.
pub const REPORT_EVERY: Duration = Duration::from_secs(1);

/// How long an agent whose heartbeat was refused (shed, or the BMDB failed) is asked to stay
/// away; the agent waits between half of it and all of it, instead of its own backoff.
pub const SHED_WAIT: Duration = Duration::from_secs(5);

/// A trouble ends once no heartbeat was refused or late for this long: twice what a refused
/// agent is asked to wait. An agent refused at every attempt so keeps one trouble going from
/// its first refusal. Were each refusal a window of its own, the recoverer would look back
/// only a threshold from the earliest window still in sight, and an agent refused for longer
/// than that would look silent.
pub const QUIET: Duration = Duration::from_secs(10);

/// Why a heartbeat was refused: the `cause` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Too many heartbeats were in flight: shed before it reached the BMDB.
    Shed,
    /// The BMDB could not record it.
    Database,
}

impl Refusal {
    const ALL: [Refusal; 2] = [Refusal::Shed, Refusal::Database];

    /// The `cause` label, and the cause a trouble window records.
    pub fn label(self) -> &'static str {
        match self {
            Refusal::Shed => "shed",
            Refusal::Database => "database",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: &'static str,
}

/// A trouble going on: heartbeats refused or late, by arrival.
#[derive(Debug, Clone)]
struct Trouble {
    first: Instant,
    last: Instant,
    /// When it was last seen going on (a refusal, a late answer, a late heartbeat in flight).
    seen_at: Instant,
    refused: u64,
    cause: &'static str,
}

#[derive(Debug, Default)]
struct State {
    in_flight: BTreeMap<u64, Instant>,
    next: u64,
    refused: u64,
    trouble: Option<Trouble>,
}

impl State {
    fn mark(&mut self, arrived: Instant, now: Instant, refused: u64, cause: &'static str) {
        self.refused += refused;
        let t = self.trouble.get_or_insert(Trouble {
            first: arrived,
            last: arrived,
            seen_at: now,
            refused: 0,
            cause,
        });
        t.first = t.first.min(arrived);
        t.last = t.last.max(arrived);
        t.seen_at = now;
        t.refused += refused;
        if refused > 0 {
            t.cause = cause;
        }
    }
}

/// One server process's heartbeats: in flight, refused, late. Shared by its requests and its
/// reporter task.
#[derive(Debug)]
pub struct HeartbeatWrites {
    writer_id: Uuid,
    max_in_flight: usize,
    state: Mutex<State>,
    in_flight: Gauge,
    refused: Family<CauseLabels, Counter>,
    late: Counter,
    trouble: Gauge,
}

/// A heartbeat from its arrival to its answer; dropped unanswered (the request was cancelled)
/// it only leaves the in-flight set.
#[must_use = "say how the heartbeat was answered"]
pub struct Arrival {
    writes: Arc<HeartbeatWrites>,
    id: u64,
    at: Instant,
}

impl HeartbeatWrites {
    /// At most `max_in_flight` heartbeats are written at once; more are shed.
    pub fn new(max_in_flight: usize) -> Self {
        let refused = Family::<CauseLabels, Counter>::default();
        for r in Refusal::ALL {
            let _ = refused.get_or_create(&CauseLabels { cause: r.label() });
        }
        HeartbeatWrites {
            writer_id: Uuid::new_v4(),
            max_in_flight: max_in_flight.max(1),
            state: Mutex::default(),
            in_flight: Gauge::default(),
            refused,
            late: Counter::default(),
            trouble: Gauge::default(),
        }
    }

    /// This server process's id in `heartbeat_writers`.
    pub fn writer_id(&self) -> Uuid {
        self.writer_id
    }

    /// Adds the metrics to `registry`; every series exists from the start, at zero.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "shepherd_server_heartbeats_in_flight",
            "Agent heartbeats received and not answered yet (the write backlog)",
            self.in_flight.clone(),
        );
        registry.register(
            "shepherd_server_heartbeats_refused",
            "Agent heartbeats answered Unavailable, by cause (shed: too many in flight; database: the BMDB failed)",
            self.refused.clone(),
        );
        registry.register(
            "shepherd_server_heartbeats_late",
            "Agent heartbeats recorded more than 5 s after they arrived",
            self.late.clone(),
        );
        registry.register(
            "shepherd_server_heartbeat_trouble",
            "1 while the server refuses or delays heartbeats, which excuses agents' silence",
            self.trouble.clone(),
        );
    }

    /// A heartbeat arrived: counted in flight, or shed (counted refused) when too many are.
    pub fn arrive(self: &Arc<Self>) -> Option<Arrival> {
        let now = Instant::now();
        let mut s = self.state.lock().expect("heartbeat writes poisoned");
        if s.in_flight.len() >= self.max_in_flight {
            s.mark(now, now, 1, Refusal::Shed.label());
            drop(s);
            self.count_refused(Refusal::Shed);
            return None;
        }
        let id = s.next;
        s.next += 1;
        s.in_flight.insert(id, now);
        self.in_flight.set(s.in_flight.len() as i64);
        Some(Arrival {
            writes: self.clone(),
            id,
            at: now,
        })
    }

    fn count_refused(&self, r: Refusal) {
        self.refused
            .get_or_create(&CauseLabels { cause: r.label() })
            .inc();
        self.trouble.set(1);
    }

    /// Heartbeats refused so far, for `cause`.
    pub fn refusals(&self, cause: Refusal) -> u64 {
        self.refused
            .get_or_create(&CauseLabels {
                cause: cause.label(),
            })
            .get()
    }

    /// Heartbeats in flight now: the write backlog.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.get()
    }

    /// Heartbeats recorded later than [`LATE`] so far.
    pub fn late(&self) -> u64 {
        self.late.get()
    }

    /// What to write now, and the last arrival of the trouble it reports ended (to forget it
    /// once written: [`HeartbeatWrites::ended_written`]). `stopping`: nothing more will
    /// arrive, so a trouble no heartbeat in flight keeps going has ended.
    fn report(&self, component: &str, stopping: bool) -> (WriterReport, Option<Instant>) {
        let now = Instant::now();
        let mut s = self.state.lock().expect("heartbeat writes poisoned");
        if let Some((_, &oldest)) = s.in_flight.first_key_value() {
            if now.duration_since(oldest) > LATE {
                s.mark(oldest, now, 0, "heartbeats in flight for over 5 s");
            }
        }
        let (state, ended) = match &s.trouble {
            None => (WriterState::Clean, None),
            Some(t) if stopping || now.duration_since(t.seen_at) >= QUIET => (
                WriterState::Ended {
                    since: now.duration_since(t.first),
                    last: now.duration_since(t.last),
                    refused: t.refused as i64,
                    cause: t.cause.to_string(),
                },
                Some(t.last),
            ),
            Some(t) => (
                WriterState::Trouble {
                    since: now.duration_since(t.first),
                },
                None,
            ),
        };
        self.trouble.set(i64::from(s.trouble.is_some()));
        let report = WriterReport {
            writer_id: self.writer_id,
            component: component.to_string(),
            backlog: s.in_flight.len() as i64,
            refused: s.refused as i64,
            state,
        };
        (report, ended)
    }

    /// The window of the trouble whose last arrival was `last` is in the BMDB: forgotten here,
    /// unless it went on since the report.
    fn ended_written(&self, last: Instant) {
        let mut s = self.state.lock().expect("heartbeat writes poisoned");
        if s.trouble.as_ref().is_some_and(|t| t.last == last) {
            s.trouble = None;
            self.trouble.set(0);
        }
    }

    fn leave(&self, id: u64) -> usize {
        let mut s = self.state.lock().expect("heartbeat writes poisoned");
        s.in_flight.remove(&id);
        self.in_flight.set(s.in_flight.len() as i64);
        s.in_flight.len()
    }
}

impl Arrival {
    /// The BMDB could not record it; the agent is told Unavailable.
    pub fn refused(self) {
        let now = Instant::now();
        let w = &self.writes;
        w.state.lock().expect("heartbeat writes poisoned").mark(
            self.at,
            now,
            1,
            Refusal::Database.label(),
        );
        w.count_refused(Refusal::Database);
    }

    /// It was answered from the BMDB (recorded, or refused for its key); late if after
    /// [`LATE`].
    pub fn answered(self) {
        let now = Instant::now();
        if now.duration_since(self.at) > LATE {
            let w = &self.writes;
            w.state.lock().expect("heartbeat writes poisoned").mark(
                self.at,
                now,
                0,
                "heartbeats recorded over 5 s after they arrived",
            );
            w.late.inc();
            w.trouble.set(1);
        }
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        self.writes.leave(self.id);
    }
}

/// The reporter's task, as `/tasks` shows it: each report written is a unit.
pub const REPORT_TASK: &str = "heartbeat-reports";

/// The task writing a server's heartbeat state to the BMDB ([`report_heartbeat_writes`]),
/// started with the server and stopped once it has answered everything.
pub struct Reporter {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Reporter {
    /// Starts reporting `writes` of the server `component` to `db`, each report a unit of
    /// `task` ([`REPORT_TASK`]).
    pub fn start(
        db: &Bmdb,
        writes: &Arc<HeartbeatWrites>,
        component: &str,
        task: TaskHandle,
    ) -> Reporter {
        let stop = CancellationToken::new();
        let reporting = report_heartbeat_writes(
            db.clone(),
            writes.clone(),
            component.to_string(),
            task,
            stop.clone(),
        );
        Reporter {
            stop,
            task: tokio::spawn(reporting),
        }
    }

    /// Writes the last report, removes the server's row and waits until that is done.
    pub async fn stop(self) -> Result<(), tokio::task::JoinError> {
        self.stop.cancel();
        self.task.await
    }
}

/// Writes `writes`' state to the BMDB every [`REPORT_EVERY`] until `cancel`, then (the server
/// has answered everything) a last report and the row's removal; each report is a unit of
/// `task`. A report that fails is logged once per streak; the next one carries everything
/// since.
async fn report_heartbeat_writes(
    db: Bmdb,
    writes: Arc<HeartbeatWrites>,
    component: String,
    task: TaskHandle,
    cancel: CancellationToken,
) {
    let mut failing = false;
    loop {
        let stopping = tokio::select! {
            _ = cancel.cancelled() => true,
            _ = tokio::time::sleep(REPORT_EVERY) => false,
        };
        let report = write_report(&db, &writes, &component, stopping, &mut failing);
        driver::one_unit(&task, report).await;
        if stopping {
            break;
        }
    }
    if let Err(error) = db.forget_heartbeat_writer(writes.writer_id).await {
        tracing::warn!(%error, "the heartbeat writer's row could not be removed; it goes stale");
    }
}

/// Writes one report of `writes` (the last one when `stopping`); `failing` says whether the
/// reports before failed, so that a streak is logged once. How it ended, in one line.
async fn write_report(
    db: &Bmdb,
    writes: &HeartbeatWrites,
    component: &str,
    stopping: bool,
    failing: &mut bool,
) -> (Outcome, String) {
    let (report, ended) = writes.report(component, stopping);
    let summary = match &report.state {
        WriterState::Clean => format!("reported clean, {} in flight", report.backlog),
        WriterState::Trouble { since } => format!("reported a trouble of {}s", since.as_secs()),
        WriterState::Ended { refused, .. } => {
            format!("reported a trouble that ended ({refused} refused)")
        }
    };
    let written = tokio::time::timeout(4 * REPORT_EVERY, db.report_heartbeat_writer(report));
    match written.await {
        Ok(Ok(())) => {
            if let Some(last) = ended {
                writes.ended_written(last);
            }
            if *failing {
                tracing::info!("heartbeat writer reports are written again");
            }
            *failing = false;
            (Outcome::Succeeded, summary)
        }
        Ok(Err(error)) => {
            if !*failing {
                tracing::warn!(%error, "the heartbeat writer report could not be written");
            }
            *failing = true;
            let why = format!("the report could not be written: {error}");
            (Outcome::of_bmdb_error(&error), why)
        }
        Err(_) => {
            if !*failing {
                tracing::warn!("the heartbeat writer report took over 4 s; trying again");
            }
            *failing = true;
            (Outcome::Waited, "the report took over 4 s".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn refusals_late_answers_and_shedding_make_a_trouble_that_ends() {
        let w = Arc::new(HeartbeatWrites::new(2));
        let (r, _) = w.report("bmsrv", false);
        assert!(matches!(r.state, WriterState::Clean));

        let a = w.arrive().unwrap();
        let b = w.arrive().unwrap();
        assert!(w.arrive().is_none(), "a third is shed");
        assert_eq!(w.refusals(Refusal::Shed), 1);
        let (r, _) = w.report("bmsrv", false);
        assert!(matches!(r.state, WriterState::Trouble { .. }), "{r:?}");
        assert_eq!((r.backlog, r.refused), (2, 1));

        tokio::time::advance(Duration::from_secs(6)).await;
        // Still in flight after 6 s: the trouble goes on.
        let (r, ended) = w.report("bmsrv", false);
        assert!(
            matches!(r.state, WriterState::Trouble { since } if since >= Duration::from_secs(6))
        );
        assert!(ended.is_none());
        a.answered();
        b.refused();
        assert_eq!(w.refusals(Refusal::Database), 1);

        tokio::time::advance(QUIET - REPORT_EVERY).await;
        let (r, _) = w.report("bmsrv", false);
        assert!(matches!(r.state, WriterState::Trouble { .. }), "{r:?}");
        tokio::time::advance(REPORT_EVERY).await;
        let (r, ended) = w.report("bmsrv", false);
        let WriterState::Ended { since, refused, .. } = r.state else {
            panic!("{r:?}");
        };
        assert!(since >= Duration::from_secs(16));
        assert_eq!((refused, r.backlog), (2, 0));
        // Not written yet: reported again.
        assert!(matches!(
            w.report("bmsrv", false).0.state,
            WriterState::Ended { .. }
        ));
        w.ended_written(ended.unwrap());
        assert!(matches!(
            w.report("bmsrv", false).0.state,
            WriterState::Clean
        ));
    }

    /// An agent shed at every attempt, each after the wait it was asked for, keeps one trouble
    /// going from its first refusal, however long that lasts: the recoverer then excuses its
    /// whole silence. Before, each refusal made a window of its own, a second long.
    #[tokio::test(start_paused = true)]
    async fn refusals_an_agent_retries_after_make_one_trouble() {
        let w = Arc::new(HeartbeatWrites::new(1));
        let mut reports = Vec::new();
        for _ in 0..8 {
            let other = w.arrive().unwrap();
            assert!(w.arrive().is_none(), "shed");
            other.answered();
            for _ in 0..SHED_WAIT.as_secs() {
                tokio::time::advance(REPORT_EVERY).await;
                reports.push(w.report("bmsrv", false).0.state);
            }
        }
        let last = reports.last().unwrap();
        assert!(
            matches!(last, WriterState::Trouble { since } if *since >= 7 * SHED_WAIT),
            "{last:?}"
        );
        let ended: Vec<_> = reports
            .iter()
            .filter(|r| matches!(r, WriterState::Ended { .. }))
            .collect();
        assert!(ended.is_empty(), "{ended:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_heartbeat_answered_in_time_is_no_trouble() {
        let w = Arc::new(HeartbeatWrites::new(8));
        let a = w.arrive().unwrap();
        tokio::time::advance(Duration::from_secs(4)).await;
        a.answered();
        let (r, _) = w.report("bmsrv", false);
        assert!(matches!(r.state, WriterState::Clean), "{r:?}");
        assert_eq!(r.backlog, 0);
    }
}
