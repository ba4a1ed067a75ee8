//! An in-memory penalty box: keys (bad reservations, machines whose creation failed) that are
//! skipped until their penalty expires. Process-local by design: a restart forgives everything.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Keys under penalty, each until its own deadline.
pub struct PenaltyBox<K> {
    penalty: Duration,
    until: Mutex<HashMap<K, Instant>>,
}

impl<K: Eq + Hash + Clone> PenaltyBox<K> {
    /// A box that keeps each key for `penalty`.
    pub fn new(penalty: Duration) -> Self {
        PenaltyBox {
            penalty,
            until: Mutex::new(HashMap::new()),
        }
    }

    /// Penalizes `key` from now on (extending an existing penalty).
    pub fn penalize(&self, key: K) {
        self.until
            .lock()
            .unwrap()
            .insert(key, Instant::now() + self.penalty);
    }

    /// Whether `key` is still under penalty; forgets expired keys as it goes.
    pub fn is_penalized(&self, key: &K) -> bool {
        let mut until = self.until.lock().unwrap();
        match until.get(key) {
            Some(t) if *t > Instant::now() => true,
            Some(_) => {
                until.remove(key);
                false
            }
            None => false,
        }
    }

    /// How many keys are penalized right now.
    pub fn len(&self) -> usize {
        let now = Instant::now();
        let mut until = self.until.lock().unwrap();
        until.retain(|_, t| *t > now);
        until.len()
    }

    /// Whether no key is penalized right now.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn penalties_expire() {
        let b = PenaltyBox::new(Duration::from_secs(3600));
        b.penalize("res-1".to_string());
        assert!(b.is_penalized(&"res-1".to_string()));
        assert!(!b.is_penalized(&"res-2".to_string()));
        tokio::time::advance(Duration::from_secs(3599)).await;
        assert!(b.is_penalized(&"res-1".to_string()));
        tokio::time::advance(Duration::from_secs(2)).await;
        assert!(!b.is_penalized(&"res-1".to_string()));
        assert!(b.is_empty());
    }
}
