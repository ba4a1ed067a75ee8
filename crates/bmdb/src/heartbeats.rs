//! Group commit of agent heartbeats. A fleet of 100,000 agents heartbeating every 30 s is
//! 3,300 small writes a second; one transaction each leaves the database little else to do
//! (and SQLite has one writer). Concurrent bare heartbeats of one session are therefore
//! gathered — at most [`MAX_BATCH`], waiting at most [`BATCH_WAIT`] after the first — and
//! written in one transaction: on Postgres one statement over arrays, on SQLite one write
//! transaction applying [`Tx::record_agent_heartbeat`] to each. Every caller is answered only
//! after its batch committed, with its own authorization and its own pending installation
//! request, exactly as if it had been written alone. Heartbeats carrying a report keep their
//! own transaction (`Session::agent_heartbeat`).

use std::sync::Weak;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use crate::db::Pools;
use crate::session::SessionInner;
use crate::sql;
use crate::transaction::retrying;
use crate::tx::Tx;
use crate::{AgentHeartbeat, AgentReport, Error, Session};

/// Most heartbeats written in one transaction.
pub const MAX_BATCH: usize = 256;

/// Longest a heartbeat waits for others to join its batch.
pub const BATCH_WAIT: Duration = Duration::from_millis(2);

/// Heartbeats queued for one session's writer at most; callers beyond wait their turn.
const QUEUE: usize = 4 * MAX_BATCH;

/// One heartbeat waiting for its batch.
struct Beat {
    machine: Uuid,
    key: Vec<u8>,
    reply: oneshot::Sender<Result<AgentHeartbeat, Error>>,
}

/// The queue into one session's heartbeat writer. The writer stops when this is dropped (with
/// the session).
pub(crate) struct Batcher {
    queue: mpsc::Sender<Beat>,
}

impl Batcher {
    /// Starts the writer of `session`'s batches.
    pub(crate) fn start(session: Weak<SessionInner>) -> Batcher {
        let (queue, incoming) = mpsc::channel(QUEUE);
        tokio::spawn(write_batches(session, incoming));
        Batcher { queue }
    }

    /// Queues a bare heartbeat and waits until its batch committed.
    pub(crate) async fn beat(&self, machine: Uuid, key: &[u8]) -> Result<AgentHeartbeat, Error> {
        let (reply, answer) = oneshot::channel();
        let beat = Beat {
            machine,
            key: key.to_vec(),
            reply,
        };
        self.queue
            .send(beat)
            .await
            .map_err(|_| Error::SessionExpired)?;
        answer.await.map_err(|_| Error::SessionExpired)?
    }
}

/// Takes batches off the queue and writes them, one at a time, until the session is gone.
async fn write_batches(session: Weak<SessionInner>, mut incoming: mpsc::Receiver<Beat>) {
    while let Some(first) = incoming.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + BATCH_WAIT;
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout_at(deadline, incoming.recv()).await {
                Ok(Some(beat)) => batch.push(beat),
                Ok(None) | Err(_) => break,
            }
        }
        let outcomes = match session.upgrade() {
            Some(inner) => write(&Session { inner }, &batch).await,
            None => Err(Error::SessionExpired),
        };
        match outcomes {
            Ok(outcomes) => {
                for (beat, outcome) in batch.into_iter().zip(outcomes) {
                    let _ = beat.reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                for beat in batch {
                    let _ = beat.reply.send(Err(e.for_each_of_a_batch()));
                }
            }
        }
    }
}

/// Writes one batch in one transaction; one outcome per heartbeat, in order.
async fn write(session: &Session, batch: &[Beat]) -> Result<Vec<AgentHeartbeat>, Error> {
    let inner = &session.inner;
    let db = &inner.db;
    inner
        .db
        .metrics()
        .heartbeat_batch(inner.processor, batch.len());
    match &db.inner.pools {
        Pools::Postgres(pool) => {
            let machines: Vec<Uuid> = batch.iter().map(|b| b.machine).collect();
            let keys: Vec<Vec<u8>> = batch.iter().map(|b| b.key.clone()).collect();
            let rows = retrying(db.metrics(), inner.processor, || async {
                inner.ensure_alive()?;
                let mut conn = db.acquire_pg(pool).await?;
                sql::sessions::agent_heartbeats_pg(&mut conn, inner.id, &machines, &keys).await
            })
            .await?;
            rows.into_iter()
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
                .collect()
        }
        Pools::Sqlite { .. } => {
            let beats: Vec<(Uuid, Vec<u8>)> =
                batch.iter().map(|b| (b.machine, b.key.clone())).collect();
            session
                .transact(move |tx| {
                    let beats = beats.clone();
                    Box::pin(async move { record_each(tx, &beats).await })
                })
                .await
        }
    }
}

/// The agent-report rule for each bare heartbeat of a batch, inside one transaction.
async fn record_each(tx: &mut Tx, beats: &[(Uuid, Vec<u8>)]) -> Result<Vec<AgentHeartbeat>, Error> {
    let bare = AgentReport::default();
    let mut outcomes = Vec::with_capacity(beats.len());
    for (machine, key) in beats {
        outcomes.push(tx.record_agent_heartbeat(*machine, key, &bare).await?);
    }
    Ok(outcomes)
}
