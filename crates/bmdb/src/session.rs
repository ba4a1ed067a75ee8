//! Sessions (design.md §3): a component's lease on the BMDB, kept alive in the background. Work
//! and transactions run through a session can never commit after the session died.

use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use uuid::Uuid;

use crate::db::{Mode, Pools};
use crate::group_commit::GroupCommit;
use crate::lease::{drift_margin, Lease, LeaseClock, LeaseEvent};
use crate::metrics::WorkResult;
use crate::sql::engine::{Tx, TxFuture};
use crate::transaction::{retrying, Guard};
use crate::{AgentHeartbeat, AgentReport, Bmdb, Error, Process, Processor, Retrieval};

/// Default keep-alive interval (design.md §17).
pub const DEFAULT_SESSION_INTERVAL: Duration = Duration::from_secs(5);

/// Keep-alives per interval: a healthy session renews this often, so that one or two failed
/// keep-alives still leave it most of its lease (see `lease.rs`).
const POKES_PER_INTERVAL: u32 = 3;

/// After a failed keep-alive, the next one comes after this share of the interval.
const RETRY_SHARE: u32 = 10;

/// Most bare agent heartbeats of one session written in one transaction.
pub const MAX_BATCH: usize = 256;

/// Longest a bare agent heartbeat waits for others to join its batch.
pub const BATCH_WAIT: Duration = Duration::from_millis(2);

/// A bare agent heartbeat as its batch holds it: the machine and the key it presented.
type Beat = (Uuid, Vec<u8>);

/// What a new session says about itself.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Component name, e.g. `shepherd-initializer`.
    pub component_name: String,
    /// Free-form runtime description; defaults to host, pid and version.
    pub runtime_info: String,
    /// Metrics processor label.
    pub processor: Processor,
    /// Keep-alive interval; the session expires if not poked for this long. Rounded up to
    /// whole seconds, at least one.
    pub interval: Duration,
}

impl SessionConfig {
    /// A config with the default interval and runtime info.
    pub fn new(component_name: impl Into<String>, processor: Processor) -> Self {
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "unknown-host".into());
        SessionConfig {
            component_name: component_name.into(),
            runtime_info: format!(
                "host={host} pid={} version={}",
                std::process::id(),
                env!("CARGO_PKG_VERSION")
            ),
            processor,
            interval: DEFAULT_SESSION_INTERVAL,
        }
    }

    /// The same config with another keep-alive interval.
    pub fn with_interval(self, interval: Duration) -> Self {
        SessionConfig { interval, ..self }
    }
}

pub(crate) struct SessionInner {
    pub(crate) id: Uuid,
    pub(crate) db: Bmdb,
    pub(crate) processor: Processor,
    interval: Duration,
    /// The lease's local deadline (`lease.rs`): if no keep-alive commits before it, the
    /// session counts as expired here.
    lease: Arc<LeaseClock>,
    keepalive: Mutex<Option<JoinHandle<()>>>,
    /// This session's bare agent heartbeats, gathered into batches (`group_commit.rs`).
    heartbeats: GroupCommit<Beat, AgentHeartbeat>,
}

impl SessionInner {
    /// Marks the session expired, counting it the first time.
    fn mark_expired(&self) {
        self.lease.end(true);
    }

    /// Marks a session its owner closed: it can no longer commit, and did not expire.
    fn mark_closed(&self) {
        self.lease.end(false);
    }

    pub(crate) fn ensure_alive(&self) -> Result<(), Error> {
        match self.lease.deadline() {
            Ok(_) => Ok(()),
            Err(_) => Err(Error::SessionExpired),
        }
    }

    /// Checks inside `tx` that the session row is alive (and, on Postgres, keeps it from being
    /// deleted until `tx` ends).
    pub(crate) async fn check_in(&self, tx: &mut Tx) -> Result<(), Error> {
        let id = self.id;
        if tx.session_alive(id).await? {
            Ok(())
        } else {
            self.mark_expired();
            Err(Error::SessionExpired)
        }
    }

    fn stop_keepalive(&self) {
        if let Some(h) = self.keepalive.lock().unwrap().take() {
            h.abort();
        }
    }
}

/// Every session transaction re-checks, inside the transaction, that the session is alive:
/// a session that expired can never commit.
impl Guard for SessionInner {
    fn before(&self) -> Result<(), Error> {
        self.ensure_alive()
    }

    fn inside<'t>(&'t self, tx: &'t mut Tx) -> TxFuture<'t, ()> {
        Box::pin(self.check_in(tx))
    }
}

impl Drop for SessionInner {
    fn drop(&mut self) {
        self.stop_keepalive();
    }
}

/// What [`Session::still_holds_due`] found right before an act that cannot be undone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Holding {
    /// The work is still this session's and the machine still eligible: act.
    Due,
    /// The work is still this session's, but the machine is no longer eligible: release it.
    NoLongerDue,
    /// The session no longer holds the work (or is gone): do nothing.
    Lost,
}

/// A live session. Cheap to clone; the keep-alive stops when the last clone is dropped (the
/// row then expires at its deadline) or on [`Session::close`].
#[derive(Clone)]
pub struct Session {
    pub(crate) inner: Arc<SessionInner>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Bmdb {
    /// The held session if it is still alive, else a new one (the old one expired): how a
    /// long-running loop keeps working across a session's expiry.
    pub async fn live_session(
        &self,
        config: &SessionConfig,
        held: Option<Session>,
    ) -> Result<Session, Error> {
        match held.filter(|s| !s.is_expired()) {
            Some(s) => Ok(s),
            None => self.start_session(config.clone()).await,
        }
    }

    /// Starts a session and its background keep-alive.
    pub async fn start_session(&self, config: SessionConfig) -> Result<Session, Error> {
        let interval_secs = config.interval.as_secs().max(1)
            + u64::from(config.interval.subsec_nanos() != 0 && config.interval.as_secs() >= 1);
        let interval = Duration::from_secs(interval_secs);
        let id = Uuid::new_v4();
        let started = Instant::now();
        let (component, runtime, processor) = (
            config.component_name.clone(),
            config.runtime_info.clone(),
            config.processor.label(),
        );
        self.run(config.processor, Mode::Write, None, |tx| {
            let (component, runtime) = (component.clone(), runtime.clone());
            Box::pin(async move {
                tx.create_session(id, &component, &runtime, processor, interval_secs as i64)
                    .await
            })
        })
        .await?;
        self.metrics().session_started(config.processor);
        let inner = Arc::new(SessionInner {
            id,
            db: self.clone(),
            processor: config.processor,
            interval,
            lease: Arc::new(LeaseClock::new(
                started + interval - drift_margin(interval),
                {
                    let (db, processor) = (self.clone(), config.processor);
                    move |event| match event {
                        LeaseEvent::Expired => db.metrics().session_expired(processor),
                        LeaseEvent::Fenced(step) => db.metrics().step_fenced(processor, step),
                    }
                },
            )),
            keepalive: Mutex::new(None),
            heartbeats: GroupCommit::new(MAX_BATCH, BATCH_WAIT),
        });
        let task = tokio::spawn(keepalive(Arc::downgrade(&inner), interval));
        *inner.keepalive.lock().unwrap() = Some(task);
        tracing::debug!(session = %id, component = %config.component_name, "session started");
        Ok(Session { inner })
    }
}

async fn keepalive(session: Weak<SessionInner>, interval: Duration) {
    let period = interval / POKES_PER_INTERVAL;
    let mut wait = period;
    loop {
        tokio::time::sleep(wait).await;
        let Some(s) = session.upgrade() else { return };
        let attempt_started = Instant::now();
        let id = s.id;
        // Bounded, so that a keep-alive stuck on a silent partition gives way to the next one
        // (on a fresh connection) instead of holding the loop past the deadline.
        let poke = s.db.run(s.processor, Mode::Lease, None, |tx| {
            Box::pin(async move { tx.poke_session(id).await })
        });
        let poked = match tokio::time::timeout(period, poke).await {
            Ok(poked) => poked,
            // Named by one direct connection attempt, as a pool that timed out is.
            Err(_) => Err(s.db.unavailable().await),
        };
        match poked {
            Ok(true) => {
                s.lease
                    .renew(attempt_started + s.interval - drift_margin(s.interval));
                wait = period;
            }
            Ok(false) => {
                tracing::warn!(session = %id, "session expired: its row is gone or past its deadline");
                s.mark_expired();
                return;
            }
            Err(e) => {
                tracing::warn!(session = %id, error = %e, "session keep-alive failed");
                if s.ensure_alive().is_err() {
                    tracing::warn!(session = %id, "session expired: keep-alive failed until the deadline");
                    return;
                }
                wait = interval / RETRY_SHARE;
                continue;
            }
        }
        // Expired sessions (another replica's, cut off or crashed) are released about once
        // per interval by each process, in a task of its own that never delays this loop.
        s.db.collect_garbage_in_background(s.interval);
    }
}

impl Session {
    /// The session id.
    pub fn id(&self) -> Uuid {
        self.inner.id
    }

    /// The metrics processor label of this session.
    pub fn processor(&self) -> Processor {
        self.inner.processor
    }

    /// The database this session lives in.
    pub fn db(&self) -> &Bmdb {
        &self.inner.db
    }

    /// This session's lease: checked before every side effect of its work (`lease.rs`).
    pub fn lease(&self) -> Lease {
        Lease::of(&self.inner.lease)
    }

    /// Whether this session, alive in the database, still holds `machine`'s work for
    /// `process`, read in the database right now: the last check before a side effect whose
    /// far side cannot refuse a stale holder (a BMC reset). The lease must still be checked
    /// after it (`Lease::left`).
    pub async fn still_holds(&self, machine: Uuid, process: Process) -> Result<bool, Error> {
        let id = self.inner.id;
        self.read(move |tx| Box::pin(async move { tx.holds_work(id, machine, process).await }))
            .await
    }

    /// Whether this session still holds `machine`'s work for `retrieval`'s process and the
    /// machine is still eligible under `retrieval` apart from that work: the re-check right
    /// before an act that cannot be undone, since what made the machine eligible may have
    /// ended after the claim (a heartbeat recorded, a server's trouble that excuses it).
    pub async fn still_holds_due(
        &self,
        machine: Uuid,
        retrieval: Retrieval,
    ) -> Result<Holding, Error> {
        let id = self.inner.id;
        self.read(move |tx| {
            Box::pin(async move {
                let process = retrieval.process();
                if !tx.holds_work(id, machine, process).await? {
                    return Ok(Holding::Lost);
                }
                Ok(if tx.still_due(machine, process, &retrieval).await? {
                    Holding::Due
                } else {
                    Holding::NoLongerDue
                })
            })
        })
        .await
    }

    /// Whether the session is known to be expired. A false answer can turn true at any time.
    pub fn is_expired(&self) -> bool {
        self.inner.ensure_alive().is_err()
    }

    /// Runs `body` in a transaction that first checks, inside the same transaction, that this
    /// session is alive; retried like [`Bmdb::transact`]. Fails with [`Error::SessionExpired`]
    /// once the session is gone.
    pub async fn transact<T, F>(&self, body: F) -> Result<T, Error>
    where
        F: for<'t> FnMut(&'t mut Tx) -> TxFuture<'t, T>,
    {
        self.transact_in(Mode::Write, body).await
    }

    /// [`Session::transact`] in `mode`: agents' facts go before the loops' work on SQLite.
    async fn transact_in<T, F>(&self, mode: Mode, body: F) -> Result<T, Error>
    where
        F: for<'t> FnMut(&'t mut Tx) -> TxFuture<'t, T>,
    {
        let guard: &dyn Guard = &*self.inner;
        self.inner
            .db
            .run(self.inner.processor, mode, Some(guard), body)
            .await
    }

    /// Runs `body` in a read-only transaction, counted under this session's processor. A read
    /// cannot commit anything, so only the local liveness is checked; on SQLite it does not
    /// wait for the writer.
    pub async fn read<T, F>(&self, body: F) -> Result<T, Error>
    where
        F: for<'t> FnMut(&'t mut Tx) -> TxFuture<'t, T>,
    {
        self.inner.ensure_alive()?;
        self.inner
            .db
            .run(self.inner.processor, Mode::Read, None, body)
            .await
    }

    /// The one entry point for what an agent sends (design.md §12): if `key` is the agent key of
    /// `machine`, records its heartbeat and `report`, and returns the pending installation
    /// request; otherwise writes nothing. The BMaaS server's hot path: a bare heartbeat joins
    /// this session's group commit (`group_commit.rs`: many heartbeats, one transaction; on
    /// Postgres one statement, the same rule in SQL) and is answered once its batch committed;
    /// a heartbeat with a report is one session transaction through
    /// [`Tx::record_agent_heartbeat`]. The session is checked inside either.
    pub async fn agent_heartbeat(
        &self,
        machine: Uuid,
        key: &[u8],
        report: &AgentReport,
    ) -> Result<AgentHeartbeat, Error> {
        match self.record_agent_heartbeat(machine, key, report).await? {
            // The agent of a takeover under way heartbeats as soon as it answered, before the
            // initializer's ending has recorded its key: told apart from a wrong key by a read.
            AgentHeartbeat::Unauthorized => {
                let key = key.to_vec();
                let pending = self
                    .read(move |tx| {
                        let key = key.clone();
                        Box::pin(async move { tx.agent_key_pending(machine, &key).await })
                    })
                    .await?;
                Ok(match pending {
                    true => AgentHeartbeat::KeyPending,
                    false => AgentHeartbeat::Unauthorized,
                })
            }
            outcome => Ok(outcome),
        }
    }

    /// [`Session::agent_heartbeat`]'s write: a bare heartbeat in a group commit, one with a
    /// report in a transaction of its own.
    async fn record_agent_heartbeat(
        &self,
        machine: Uuid,
        key: &[u8],
        report: &AgentReport,
    ) -> Result<AgentHeartbeat, Error> {
        self.inner.ensure_alive()?;
        if report.is_empty() {
            let (answer, leader) = self.inner.heartbeats.join((machine, key.to_vec()));
            if let Some(leader) = leader {
                // Written by a task of its own, so that a caller that goes away (a client that
                // hung up) neither cancels the other members' write nor leaves them waiting.
                let session = self.clone();
                tokio::spawn(async move {
                    let batch = session.inner.heartbeats.gather(leader).await;
                    let reports = &session.inner.db.inner.heartbeat_reports;
                    reports.started();
                    let written = session.write_heartbeats(batch.items()).await;
                    reports.ended(batch.items().len(), &written);
                    batch.answer(written);
                });
            }
            return answer.await.unwrap_or(Err(Error::SessionExpired));
        }
        let (key, report) = (key.to_vec(), report.clone());
        self.transact_in(Mode::Facts, move |tx| {
            let (key, report) = (key.clone(), report.clone());
            Box::pin(async move { tx.record_agent_heartbeat(machine, &key, &report).await })
        })
        .await
    }

    /// Writes one batch of bare heartbeats in one transaction: on Postgres one statement over
    /// arrays, on SQLite the agent-report rule for each inside one session transaction. One
    /// outcome per heartbeat, in order.
    async fn write_heartbeats(
        &self,
        beats: &[Beat],
    ) -> Result<Vec<Result<AgentHeartbeat, Error>>, Error> {
        let inner = &self.inner;
        let db = &inner.db;
        db.metrics().heartbeat_batch(inner.processor, beats.len());
        let Pools::Postgres(pool) = &db.inner.pools else {
            let beats = beats.to_vec();
            return self
                .transact_in(Mode::Facts, move |tx| {
                    let beats = beats.clone();
                    Box::pin(async move {
                        let bare = AgentReport::default();
                        let mut outcomes = Vec::with_capacity(beats.len());
                        for (machine, key) in &beats {
                            let outcome = tx.record_agent_heartbeat(*machine, key, &bare).await?;
                            outcomes.push(Ok(outcome));
                        }
                        Ok(outcomes)
                    })
                })
                .await;
        };
        let (machines, keys): (Vec<Uuid>, Vec<Vec<u8>>) = beats.iter().cloned().unzip();
        let rows = retrying(db.metrics(), &db.inner.seen, inner.processor, || async {
            inner.ensure_alive()?;
            let mut conn = db.autocommit(pool).await?;
            conn.agent_heartbeats(inner.id, &machines, &keys).await
        })
        .await?;
        Ok(rows
            .into_iter()
            .map(
                |(alive, authorized, pending_request)| match (alive, authorized) {
                    (false, _) => {
                        inner.mark_expired();
                        Err(Error::SessionExpired)
                    }
                    (true, false) => Ok(AgentHeartbeat::Unauthorized),
                    (true, true) => Ok(AgentHeartbeat::Recorded { pending_request }),
                },
            )
            .collect())
    }

    pub(crate) fn record_work_end(&self, process: Process, result: WorkResult) {
        self.inner
            .db
            .metrics()
            .work_ended(self.inner.processor, process, result);
    }

    pub(crate) fn mark_expired(&self) {
        self.inner.mark_expired();
    }

    /// Stops poking without closing: the session expires at its deadline, exactly as if this
    /// process had crashed or lost the database. For failure drills and tests.
    pub fn stop_keepalive(&self) {
        self.inner.stop_keepalive();
    }

    /// Abandons the session: its keep-alive stops and it counts as expired here at once, so
    /// that the database lets go of it (and its work) at its deadline. For work whose ending
    /// could not be written ([`crate::Work::give_up`]).
    pub(crate) fn abandon(&self) {
        self.inner.stop_keepalive();
        self.inner.mark_expired();
    }

    /// Closes the session: stops the keep-alive and deletes the row; work it still held is
    /// released (recorded as Canceled). An ending of its work that races the close is either
    /// written in full (and the close leaves that work alone) or finds the work gone; a
    /// machine's history never gets both. Later use fails with [`Error::SessionExpired`].
    pub async fn close(&self) -> Result<(), Error> {
        self.inner.stop_keepalive();
        let id = self.inner.id;
        let result = self
            .inner
            .db
            .run(self.inner.processor, Mode::Write, None, |tx| {
                Box::pin(async move { tx.delete_session(id).await })
            })
            .await;
        self.inner.mark_closed();
        result
    }
}
