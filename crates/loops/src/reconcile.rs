//! The provisioner's decision (design.md §7 steps 2–5) as a pure function: given what the provider
//! lists and what the BMDB says this provider provided, which unused machines to bring in.

use std::collections::BTreeSet;

use shepherd_provider::{Availability, ProviderMachine};

/// Limits of one reconciliation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Stop bringing machines in once this many are managed; 0 means no limit.
    pub max_machines: usize,
    /// Bring at most this many machines in per iteration.
    pub chunk_size: usize,
    /// How many machines the BMDB records may be missing at the provider while the pass
    /// still acts on the others.
    pub max_missing: MissingAllowance,
}

impl Limits {
    /// At most `max_machines` managed (0: no limit), `chunk_size` brought in per iteration,
    /// and the default allowance of missing machines.
    pub fn new(max_machines: usize, chunk_size: usize) -> Limits {
        Limits {
            max_machines,
            chunk_size,
            max_missing: MissingAllowance::default(),
        }
    }
}

impl Default for Limits {
    /// design.md §17: at most 50 machines, 20 per iteration.
    fn default() -> Self {
        Limits::new(50, 20)
    }
}

/// How many of the machines the BMDB records for a provider may be missing from its listing
/// before the pass takes the listing for broken and refuses to act. A machine removed at the
/// provider on purpose (deleted, undeployed by an operator) is one of a few; a listing that
/// is empty, truncated or of the wrong project misses many at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MissingAllowance {
    /// At most this share of the recorded machines, in percent (and always one).
    Percent(u32),
    /// At most this many.
    Count(usize),
}

impl Default for MissingAllowance {
    /// 10 %, and always one.
    fn default() -> Self {
        MissingAllowance::Percent(10)
    }
}

impl MissingAllowance {
    /// Whether `missing` of `recorded` machines may be missing.
    pub fn allows(self, missing: usize, recorded: usize) -> bool {
        let most = match self {
            MissingAllowance::Percent(p) => (recorded * p as usize / 100).max(1),
            MissingAllowance::Count(n) => n,
        };
        missing <= most
    }
}

/// A `--provisioner-max-missing` that is neither a share nor a count.
#[derive(Debug, thiserror::Error)]
#[error("{0:?}: a share like 10% or a count like 5")]
pub struct BadMissingAllowance(String);

impl std::str::FromStr for MissingAllowance {
    type Err = BadMissingAllowance;

    /// `10%` (a share of the recorded machines) or `5` (a count).
    fn from_str(text: &str) -> Result<Self, BadMissingAllowance> {
        let bad = || BadMissingAllowance(text.to_string());
        match text.strip_suffix('%') {
            Some(p) => match p.trim().parse::<u32>() {
                Ok(p) if p <= 100 => Ok(MissingAllowance::Percent(p)),
                _ => Err(bad()),
            },
            None => text
                .trim()
                .parse()
                .map(MissingAllowance::Count)
                .map_err(|_| bad()),
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
    /// Provider ids the BMDB records that the provider no longer lists (within the
    /// allowance): removed at the provider; the updater marks them Missing.
    pub missing: Vec<String>,
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
    /// The provider lists machines as ours that the BMDB does not record; acting could leak
    /// or duplicate machines, so nothing is done until an operator looks.
    #[error(
        "provider and BMDB disagree on {} machine(s), refusing to act: {}",
        .0.len(),
        crate::bounded::first_few(.0)
    )]
    Discrepancy(Vec<String>),
    /// More machines the BMDB records are missing at the provider than the allowance, or the
    /// listing is empty: the listing looks broken, so nothing is done.
    #[error(
        "{} of {recorded} machine(s) the BMDB records are missing at the provider, more than --provisioner-max-missing allows: the listing looks broken, refusing to act ({}); if they were removed on purpose, run `shepherd machines decommission ID` for each, or raise --provisioner-max-missing",
        .missing.len(),
        crate::bounded::first_few(.missing)
    )]
    TooManyMissing {
        /// The provider ids missing.
        missing: Vec<String>,
        /// Machines the BMDB records for the provider.
        recorded: usize,
    },
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

    let problems: Vec<String> = used
        .difference(in_bmdb)
        .map(|id| format!("provider machine {id} is ours but missing from the BMDB"))
        .collect();
    if !problems.is_empty() {
        return Err(ReconcileError::Discrepancy(problems));
    }
    let missing: Vec<String> = in_bmdb
        .difference(&used)
        .filter(|id| !failed.contains(*id))
        .cloned()
        .collect();
    let empty_listing = in_provider.is_empty() && !in_bmdb.is_empty();
    if empty_listing || !limits.max_missing.allows(missing.len(), in_bmdb.len()) {
        return Err(ReconcileError::TooManyMissing {
            missing,
            recorded: in_bmdb.len(),
        });
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
        missing,
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
        let plan = reconcile(&provider, &bmdb(&["b"]), Limits::new(0, 10)).unwrap();
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
        // Both at once: the leak is refused whatever else is missing.
        let e = reconcile(&[m("a", KnownUsed)], &bmdb(&["gone"]), Limits::default()).unwrap_err();
        assert!(matches!(e, ReconcileError::Discrepancy(p) if p.len() == 1));
        // A used machine without an id cannot be checked at all.
        let mut bad = m("a", KnownUsed);
        bad.id = Some(String::new());
        assert!(matches!(
            reconcile(&[bad], &bmdb(&[]), Limits::default()),
            Err(ReconcileError::UsedWithoutId { .. })
        ));
    }

    #[test]
    fn a_few_missing_machines_do_not_stop_the_others_and_many_do() {
        let recorded: Vec<String> = (0..20).map(|i| format!("m{i}")).collect();
        let refs: Vec<&str> = recorded.iter().map(String::as_str).collect();
        let listed = |n: usize| {
            let mut l: Vec<_> = refs[n..].iter().map(|id| m(id, KnownUsed)).collect();
            l.push(m("new", KnownUnused));
            l
        };
        // One gone (deleted at the provider on purpose): reported, and "new" is brought in.
        let plan = reconcile(&listed(1), &bmdb(&refs), Limits::new(0, 10)).unwrap();
        assert_eq!(
            (plan.missing.clone(), ids(&plan)),
            (vec!["m0".to_string()], vec!["new"])
        );
        // Two of twenty is 10 %: still within the default.
        let plan = reconcile(&listed(2), &bmdb(&refs), Limits::new(0, 10)).unwrap();
        assert_eq!(plan.missing.len(), 2);
        // Four of twenty (20 %) looks like a broken listing: nothing is done, and the message
        // names the remedy.
        let e = reconcile(&listed(4), &bmdb(&refs), Limits::new(0, 10)).unwrap_err();
        assert!(
            matches!(&e, ReconcileError::TooManyMissing { missing, recorded: 20 } if missing.len() == 4),
            "{e}"
        );
        assert!(
            e.to_string().contains("shepherd machines decommission"),
            "{e}"
        );
        assert!(e.to_string().contains("--provisioner-max-missing"), "{e}");
        // An empty listing is refused even for one recorded machine.
        let e = reconcile(&[], &bmdb(&["m0"]), Limits::default()).unwrap_err();
        assert!(matches!(e, ReconcileError::TooManyMissing { .. }), "{e}");
        // The allowance is configurable as a share or a count.
        let mut limits = Limits::new(0, 10);
        limits.max_missing = "5".parse().unwrap();
        assert!(reconcile(&listed(4), &bmdb(&refs), limits).is_ok());
        limits.max_missing = "0".parse().unwrap();
        assert!(reconcile(&listed(1), &bmdb(&refs), limits).is_err());
        assert!("200%".parse::<MissingAllowance>().is_err());
        assert!("ten".parse::<MissingAllowance>().is_err());
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
            let plan = reconcile(&all, &in_bmdb, Limits::new(max, chunk)).unwrap();
            assert_eq!(plan.managed, 8);
            assert_eq!(plan.create.len(), want, "max {max} chunk {chunk}");
            assert_eq!(
                plan.create.first().map(|m| m.id.clone().unwrap()),
                (want > 0).then(|| "u00".to_string())
            );
        }
    }
}
