//! Group commit of agent heartbeats. A fleet of 100,000 agents heartbeating every 30 s is
//! 3,300 small writes a second; one transaction each leaves the database little else to do
//! (and SQLite has one writer). Concurrent bare heartbeats of one session are therefore
//! gathered — at most [`MAX_BATCH`], waiting at most [`BATCH_WAIT`] after the first — and
//! written in one transaction: on Postgres one statement over arrays, on SQLite one write
//! transaction applying `Tx::record_agent_heartbeat` to each (the writing is
//! `Session::write_heartbeats`; this module only gathers and answers). Every caller is answered only
//! after its batch committed, with its own authorization and its own pending installation
//! request, exactly as if it had been written alone. Heartbeats carrying a report keep their
//! own transaction (`Session::agent_heartbeat`).

use std::time::Duration;

use futures::future::BoxFuture;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use crate::{AgentHeartbeat, Error};

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

/// Writes one batch of (machine, key) heartbeats in one transaction and returns one outcome per
/// heartbeat, in order (the session provides it: `Session::write_heartbeats`).
pub(crate) type WriteBatch = Box<
    dyn Fn(Vec<(Uuid, Vec<u8>)>) -> BoxFuture<'static, Result<Vec<AgentHeartbeat>, Error>>
        + Send
        + Sync,
>;

/// The queue into one session's heartbeat writer. The writer stops when this is dropped (with
/// the session).
pub(crate) struct Batcher {
    queue: mpsc::Sender<Beat>,
}

impl Batcher {
    /// Starts the task that gathers heartbeats into batches and hands each to `write`.
    pub(crate) fn start(write: WriteBatch) -> Batcher {
        let (queue, incoming) = mpsc::channel(QUEUE);
        tokio::spawn(write_batches(write, incoming));
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
async fn write_batches(write: WriteBatch, mut incoming: mpsc::Receiver<Beat>) {
    while let Some(first) = incoming.recv().await {
        let mut batch = vec![first];
        let deadline = tokio::time::Instant::now() + BATCH_WAIT;
        while batch.len() < MAX_BATCH {
            match tokio::time::timeout_at(deadline, incoming.recv()).await {
                Ok(Some(beat)) => batch.push(beat),
                Ok(None) | Err(_) => break,
            }
        }
        let (beats, replies): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .map(|b| ((b.machine, b.key), b.reply))
            .unzip();
        match write(beats).await {
            Ok(outcomes) => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let _ = reply.send(Ok(outcome));
                }
            }
            Err(e) => {
                for reply in replies {
                    let _ = reply.send(Err(e.for_each_of_a_batch()));
                }
            }
        }
    }
}
