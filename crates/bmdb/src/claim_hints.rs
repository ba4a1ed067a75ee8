//! Candidate machines left over from a claim's full search, offered to later claims first.
//!
//! When eligible machines are sparse (the end of a large batch, a mostly-processed fleet) a
//! claim's cheap window search misses and it falls back to a search over every machine of the
//! provider. That search finds many eligible machines but claims one; keeping the rest lets
//! the next claims of this process check a short list instead of searching everything again.
//! Hints are only hints: a claim re-checks eligibility and locks in the database, so a stale
//! hint (claimed or changed by another replica since) costs one index probe and is dropped.

use std::collections::HashMap;
use std::sync::Mutex;

use uuid::Uuid;

use crate::eligibility::Retrieval;
use crate::{Process, ProviderKind};

/// Which claims a hint list serves: the same process looking by the same rule and provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct HintKey {
    process: Process,
    provider: ProviderKind,
    recovery: bool,
}

impl HintKey {
    pub(crate) fn new(process: Process, retrieval: &Retrieval) -> Self {
        HintKey {
            process,
            provider: retrieval.provider(),
            recovery: matches!(retrieval, Retrieval::AgentRecovery { .. }),
        }
    }
}

/// Leftover candidates per [`HintKey`], shared by every session of one `Bmdb` handle.
#[derive(Debug, Default)]
pub(crate) struct ClaimHints {
    lists: Mutex<HashMap<HintKey, Vec<Uuid>>>,
}

impl ClaimHints {
    /// Removes and returns up to `n` hints for `key`, so parallel claimers try different ones.
    pub(crate) fn take(&self, key: HintKey, n: usize) -> Vec<Uuid> {
        let mut lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        let Some(list) = lists.get_mut(&key) else {
            return Vec::new();
        };
        let taken: Vec<Uuid> = list.drain(..n.min(list.len())).collect();
        if list.is_empty() {
            lists.remove(&key);
        }
        taken
    }

    /// Replaces the hints for `key` with the candidates of a fresh full search.
    pub(crate) fn replace(&self, key: HintKey, ids: Vec<Uuid>) {
        let mut lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        if ids.is_empty() {
            lists.remove(&key);
        } else {
            lists.insert(key, ids);
        }
    }

    /// Returns hints a claim checked, found still eligible and did not claim.
    pub(crate) fn give_back(&self, key: HintKey, ids: Vec<Uuid>) {
        if ids.is_empty() {
            return;
        }
        let mut lists = self.lists.lock().unwrap_or_else(|p| p.into_inner());
        lists.entry(key).or_default().extend(ids);
    }

    /// Forgets every hint for `key`: a full search found nothing eligible.
    pub(crate) fn clear(&self, key: HintKey) {
        self.replace(key, Vec::new());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: Retrieval = Retrieval::AgentStart {
        provider: ProviderKind::Sim,
    };

    #[test]
    fn take_hands_out_each_hint_once_in_order() {
        let hints = ClaimHints::default();
        let key = HintKey::new(Process::ShepherdAgentStart, &START);
        let ids: Vec<Uuid> = (0..5).map(|_| Uuid::new_v4()).collect();
        hints.replace(key, ids.clone());
        assert_eq!(hints.take(key, 2), ids[..2]);
        assert_eq!(hints.take(key, 10), ids[2..]);
        assert!(hints.take(key, 10).is_empty());
        hints.give_back(key, ids[..1].to_vec());
        assert_eq!(hints.take(key, 10), ids[..1]);
    }

    #[test]
    fn keys_are_separate_per_process_provider_and_rule() {
        let hints = ClaimHints::default();
        let start = HintKey::new(Process::ShepherdAgentStart, &START);
        let other_provider = HintKey::new(
            Process::ShepherdAgentStart,
            &Retrieval::AgentStart {
                provider: ProviderKind::Equinix,
            },
        );
        let recovery = HintKey::new(
            Process::ShepherdRecovery,
            &Retrieval::AgentRecovery {
                provider: ProviderKind::Sim,
                thresholds: Default::default(),
            },
        );
        hints.replace(start, vec![Uuid::new_v4()]);
        assert!(hints.take(other_provider, 1).is_empty());
        assert!(hints.take(recovery, 1).is_empty());
        hints.clear(start);
        assert!(hints.take(start, 1).is_empty());
    }
}
