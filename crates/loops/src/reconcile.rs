//! The provisioner's decision (SPEC §7 steps 2–5) as a pure function: given what the provider
//! lists and what the BMDB says this provider provided, which unused machines to bring in.

use std::collections::BTreeSet;

use crate::provider::{Availability, ProviderMachine};

/// Limits of one reconciliation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Stop bringing machines in once this many are managed; 0 means no limit.
    pub max_machines: usize,
    /// Bring at most this many machines in per iteration.
    pub chunk_size: usize,
}

impl Limits {
    /// At most `max_machines` managed (0: no limit), `chunk_size` brought in per iteration.
    pub fn new(max_machines: usize, chunk_size: usize) -> Limits {
        Limits {
            max_machines,
            chunk_size,
        }
    }
}

impl Default for Limits {
    /// SPEC §17: at most 50 machines, 20 per iteration.
    fn default() -> Self {
        Limits {
            max_machines: 50,
            chunk_size: 20,
        }
    }
}

/// What to do this iteration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Machines in both the provider and the BMDB.
    pub managed: usize,
    /// Unused machines to create, in provider order, already cut to the limits.
    pub create: Vec<ProviderMachine>,
}

/// Why a reconciliation refused to act.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReconcileError {
    /// The provider said a machine is ours but gave no usable id.
    #[error("provider lists a used machine without a valid id (address {addr:?})")]
    UsedWithoutId {
        /// The machine's address, to find it.
        addr: Option<String>,
    },
    /// The provider's and the BMDB's views disagree; acting on either could destroy or leak
    /// machines, so nothing is done until an operator looks.
    #[error(
        "provider and BMDB disagree on {} machine(s), refusing to act: {}",
        .0.len(),
        crate::bounded::first_few(.0)
    )]
    Discrepancy(Vec<String>),
}

/// Decides which unused machines to bring in. `in_bmdb` holds the provider ids the BMDB
/// records for this provider.
pub fn reconcile(
    in_provider: &[ProviderMachine],
    in_bmdb: &BTreeSet<String>,
    limits: Limits,
) -> Result<Plan, ReconcileError> {
    let mut used = BTreeSet::new();
    let mut failed = BTreeSet::new();
    let mut unused = vec![];
    for m in in_provider {
        if m.failed {
            if let Some(id) = m.valid_id() {
                failed.insert(id.to_string());
            }
            continue;
        }
        let availability = match m.availability {
            Availability::PossiblyUsed => match m.valid_id() {
                Some(id) if in_bmdb.contains(id) => Availability::KnownUsed,
                _ => Availability::KnownUnused,
            },
            known => known,
        };
        match availability {
            Availability::KnownUnused => unused.push(m.clone()),
            Availability::KnownUsed => match m.valid_id() {
                Some(id) => {
                    used.insert(id.to_string());
                }
                None => {
                    return Err(ReconcileError::UsedWithoutId {
                        addr: m.addr.clone(),
                    })
                }
            },
            Availability::PossiblyUsed => unreachable!("resolved above"),
        }
    }

    let mut problems = vec![];
    for id in used.difference(in_bmdb) {
        problems.push(format!(
            "provider machine {id} is ours but missing from the BMDB"
        ));
    }
    for id in in_bmdb.difference(&used) {
        if !failed.contains(id) {
            problems.push(format!("BMDB machine {id} is missing at the provider"));
        }
    }
    if !problems.is_empty() {
        return Err(ReconcileError::Discrepancy(problems));
    }

    let managed = used.len();
    let room = match limits.max_machines {
        0 => usize::MAX,
        max => max.saturating_sub(managed),
    };
    unused.truncate(room.min(limits.chunk_size));
    Ok(Plan {
        managed,
        create: unused,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use Availability::*;

    fn m(id: &str, a: Availability) -> ProviderMachine {
        ProviderMachine::new(id, Some(format!("10.0.0.{}", id.len())), a)
    }

    fn ids(plan: &Plan) -> Vec<&str> {
        plan.create
            .iter()
            .map(|m| m.id.as_deref().unwrap_or("-"))
            .collect()
    }

    fn bmdb(ids: &[&str]) -> BTreeSet<String> {
        ids.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn possibly_used_is_resolved_by_the_bmdb() {
        let provider = [
            m("a", PossiblyUsed),
            m("b", PossiblyUsed),
            m("c", PossiblyUsed),
        ];
        let plan = reconcile(
            &provider,
            &bmdb(&["b"]),
            Limits {
                max_machines: 0,
                chunk_size: 10,
            },
        )
        .unwrap();
        assert_eq!(plan.managed, 1);
        assert_eq!(ids(&plan), vec!["a", "c"]);
    }

    /// Upstream's `resolvePossiblyUsed`: a possibly-used machine whose id is not a valid
    /// provider id (empty, or longer than the BMDB stores) cannot be ours, so it is unused.
    #[test]
    fn possibly_used_with_an_invalid_id_is_unused() {
        for bad in [
            String::new(),
            "x".repeat(shepherd_bmdb::MAX_PROVIDER_ID_LEN + 1),
        ] {
            let mut r = m("x", PossiblyUsed);
            r.id = Some(bad.clone());
            let plan = reconcile(&[r], &bmdb(&[]), Limits::default()).unwrap_or_else(|e| {
                panic!("{bad:?}: {e}");
            });
            assert_eq!((plan.managed, plan.create.len()), (0, 1), "{bad:?}");
        }
    }

    #[test]
    fn unused_capacity_without_id_is_a_candidate() {
        let mut r = m("x", KnownUnused);
        r.id = None;
        let plan = reconcile(&[r], &bmdb(&[]), Limits::default()).unwrap();
        assert_eq!(ids(&plan), vec!["-"]);
    }

    #[test]
    fn discrepancies_mean_no_action() {
        // Ours at the provider but unknown to the BMDB.
        let e = reconcile(
            &[m("a", KnownUsed), m("n", KnownUnused)],
            &bmdb(&[]),
            Limits::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&e, ReconcileError::Discrepancy(p) if p.len() == 1 && p[0].contains("provider machine a")),
            "{e}"
        );
        // In the BMDB but gone from the provider.
        let e = reconcile(&[m("n", KnownUnused)], &bmdb(&["gone"]), Limits::default()).unwrap_err();
        assert!(
            e.to_string().contains("BMDB machine gone is missing"),
            "{e}"
        );
        // Both at once are all reported.
        let e = reconcile(&[m("a", KnownUsed)], &bmdb(&["gone"]), Limits::default()).unwrap_err();
        assert!(matches!(e, ReconcileError::Discrepancy(p) if p.len() == 2));
        // A used machine without an id cannot be checked at all.
        let mut bad = m("a", KnownUsed);
        bad.id = Some(String::new());
        assert!(matches!(
            reconcile(&[bad], &bmdb(&[]), Limits::default()),
            Err(ReconcileError::UsedWithoutId { .. })
        ));
    }

    #[test]
    fn failed_machines_are_ignored_both_ways() {
        let mut broken = m("b", KnownUsed);
        broken.failed = true;
        let mut broken_unused = m("u", KnownUnused);
        broken_unused.failed = true;
        // "b" is in the BMDB and failed at the provider: not a discrepancy, not managed.
        let plan = reconcile(
            &[
                m("a", KnownUsed),
                broken,
                broken_unused,
                m("n", KnownUnused),
            ],
            &bmdb(&["a", "b"]),
            Limits::default(),
        )
        .unwrap();
        assert_eq!(plan.managed, 1);
        assert_eq!(ids(&plan), vec!["n"], "failed capacity is not used");
        // A failed machine unknown to the BMDB is not a discrepancy either.
        let mut stray = m("s", KnownUsed);
        stray.failed = true;
        assert!(reconcile(&[stray], &bmdb(&[]), Limits::default()).is_ok());
    }

    #[test]
    fn max_and_chunk_limits() {
        let unused: Vec<_> = (0..30)
            .map(|i| m(&format!("u{i:02}"), KnownUnused))
            .collect();
        let used: Vec<_> = (0..8).map(|i| m(&format!("k{i}"), KnownUsed)).collect();
        let in_bmdb: BTreeSet<String> = used.iter().map(|m| m.id.clone().unwrap()).collect();
        let all: Vec<_> = used.iter().chain(unused.iter()).cloned().collect();
        let cases = [
            // (max, chunk) -> created
            ((10, 4), 2),   // room for 2
            ((10, 1), 1),   // chunk smaller than room
            ((8, 4), 0),    // at the limit
            ((5, 4), 0),    // over the limit
            ((0, 20), 20),  // no limit, chunk bounds it
            ((0, 100), 30), // no limit, everything
            ((50, 20), 20), // defaults
        ];
        for ((max, chunk), want) in cases {
            let plan = reconcile(
                &all,
                &in_bmdb,
                Limits {
                    max_machines: max,
                    chunk_size: chunk,
                },
            )
            .unwrap();
            assert_eq!(plan.managed, 8);
            assert_eq!(plan.create.len(), want, "max {max} chunk {chunk}");
            assert_eq!(
                plan.create.first().map(|m| m.id.clone().unwrap()),
                (want > 0).then(|| "u00".to_string())
            );
        }
    }
}
