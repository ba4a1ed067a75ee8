//! A small pool of live BMDB sessions shared by all requests: a session per request would
//! cost a session insert and a keep-alive task per heartbeat.

use std::sync::atomic::{AtomicUsize, Ordering};

use shepherd_bmdb::{Bmdb, Error, Session, SessionConfig};
use tokio::sync::Mutex;

/// Round-robin over `size` sessions, each replaced when it expires.
pub struct SessionPool {
    db: Bmdb,
    config: SessionConfig,
    slots: Vec<Mutex<Option<Session>>>,
    next: AtomicUsize,
}

impl SessionPool {
    /// A pool of `size` sessions (started lazily).
    pub fn new(db: Bmdb, config: SessionConfig, size: usize) -> Self {
        SessionPool {
            db,
            config,
            slots: (0..size.max(1)).map(|_| Mutex::new(None)).collect(),
            next: AtomicUsize::new(0),
        }
    }

    /// A live session.
    pub async fn get(&self) -> Result<Session, Error> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let mut slot = self.slots[i].lock().await;
        if let Some(s) = slot.as_ref().filter(|s| !s.is_expired()) {
            return Ok(s.clone());
        }
        let s = self.db.start_session(self.config.clone()).await?;
        *slot = Some(s.clone());
        Ok(s)
    }

    /// Closes every session (graceful shutdown).
    pub async fn close(&self) {
        for slot in &self.slots {
            if let Some(s) = slot.lock().await.take() {
                let _ = s.close().await;
            }
        }
    }
}
