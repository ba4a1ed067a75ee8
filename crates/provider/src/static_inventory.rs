//! A static inventory's text (design.md §6): a strict JSON list `[{"ID", "Addr", "Location",
//! "BMC"}]`, parsed and checked into [`InventoryEntry`]s and indexed by id, and why an
//! inventory could not be used ([`InventoryError`]). `static_provider.rs` reads it from its
//! URL and serves it as a provider.

use std::collections::{BTreeSet, HashMap};

use serde::Deserialize;
use shepherd_bmdb::MAX_PROVIDER_ID_LEN;

use crate::bare::BareEntry;
use crate::redfish::{BmcEntry, BmcError};
use crate::settings::InvalidSetting;

/// Largest inventory accepted.
pub const MAX_INVENTORY_BYTES: usize = 16 << 20;

/// What is wrong with an inventory's text.
#[derive(Debug, thiserror::Error)]
pub enum InventoryProblem {
    /// It is larger than [`MAX_INVENTORY_BYTES`].
    #[error("{0} bytes, more than the {MAX_INVENTORY_BYTES} allowed")]
    TooLarge(u64),
    /// It is no JSON list of entries.
    #[error("not a valid JSON list of {{\"ID\", \"Addr\", \"Location\"}}: {0}")]
    NotAList(serde_json::Error),
    /// An entry's ID is empty or too long.
    #[error("entry {0}: ID must be 1..={MAX_PROVIDER_ID_LEN} bytes")]
    BadId(usize),
    /// An entry's address is empty.
    #[error("entry {index} ({id}): Addr is empty")]
    NoAddr {
        /// Its place in the list.
        index: usize,
        /// Its ID.
        id: String,
    },
    /// Two entries share an ID.
    #[error("entry {index}: duplicate ID {id:?}")]
    DuplicateId {
        /// Its place in the list.
        index: usize,
        /// The ID.
        id: String,
    },
    /// An entry's `Bare` is wrong, or it has no BMC to boot it by.
    #[error("entry {index} ({id}): {error}")]
    Bare {
        /// Its place in the list.
        index: usize,
        /// Its ID.
        id: String,
        /// What is wrong.
        error: InvalidSetting,
    },
    /// An entry's BMC is wrong, or names a password or a CA that is not there.
    #[error("entry {index} ({id}): {error}")]
    Bmc {
        /// Its place in the list.
        index: usize,
        /// Its ID.
        id: String,
        /// What is wrong.
        error: Box<BmcError>,
    },
}

/// Why the static inventory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum InventoryError {
    /// The inventory's URL is unusable.
    #[error(transparent)]
    Url(#[from] InvalidSetting),
    /// The inventory file could not be read.
    #[error("inventory {url}: reading {path}: {error}")]
    File {
        /// The inventory's URL.
        url: String,
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// The inventory could not be fetched over HTTP.
    #[error("inventory {url}: {cause}")]
    Http {
        /// The inventory's URL.
        url: String,
        /// Every cause, one line.
        cause: String,
    },
    /// The inventory's text is wrong.
    #[error("inventory {url}: {problem}")]
    Invalid {
        /// The inventory's URL.
        url: String,
        /// What is wrong.
        problem: InventoryProblem,
    },
    /// Every attempt of the first read failed; the last one's error.
    #[error("{last} (after {attempts} attempts)")]
    GaveUp {
        /// Attempts made.
        attempts: u32,
        /// The last attempt's error.
        last: Box<InventoryError>,
    },
}

/// One inventory entry, exactly as written in the file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "PascalCase")]
pub struct InventoryEntry {
    /// Stable, unique id of the machine within this inventory.
    #[serde(rename = "ID")]
    pub id: String,
    /// Address reachable over SSH.
    pub addr: String,
    /// Free-form location.
    pub location: Option<String>,
    /// The machine's BMC, for power control by the recoverer (Redfish).
    #[serde(rename = "BMC")]
    pub bmc: Option<BmcEntry>,
    /// The machine comes bare: its BMC boots it into Shepherd's live environment, which
    /// installs this OS image (design.md §21). Needs `BMC`.
    pub bare: Option<BareEntry>,
}

/// Parses and validates an inventory: every entry needs a non-empty id of at most 128 bytes,
/// unique, and a non-empty address.
pub fn parse_inventory(bytes: &[u8]) -> Result<Vec<InventoryEntry>, InventoryProblem> {
    if bytes.len() > MAX_INVENTORY_BYTES {
        return Err(InventoryProblem::TooLarge(bytes.len() as u64));
    }
    let entries: Vec<InventoryEntry> =
        serde_json::from_slice(bytes).map_err(InventoryProblem::NotAList)?;
    let mut seen = BTreeSet::new();
    for (index, e) in entries.iter().enumerate() {
        let id = || e.id.clone();
        if e.id.is_empty() || e.id.len() > MAX_PROVIDER_ID_LEN {
            return Err(InventoryProblem::BadId(index));
        }
        if e.addr.trim().is_empty() {
            return Err(InventoryProblem::NoAddr { index, id: id() });
        }
        if !seen.insert(e.id.as_str()) {
            return Err(InventoryProblem::DuplicateId { index, id: id() });
        }
        if let Some(b) = &e.bmc {
            b.validate().map_err(|e| InventoryProblem::Bmc {
                index,
                id: id(),
                error: Box::new(e.into()),
            })?;
        }
        if let Some(bare) = &e.bare {
            let bare_problem = |error| InventoryProblem::Bare {
                index,
                id: id(),
                error,
            };
            if e.bmc.is_none() {
                return Err(bare_problem(InvalidSetting::new(
                    "Bare",
                    "needs a BMC to boot the machine by",
                )));
            }
            bare.validate().map_err(bare_problem)?;
        }
    }
    Ok(entries)
}

/// A parsed inventory, indexed by machine id.
#[derive(Debug, Default)]
pub struct Inventory {
    entries: Vec<InventoryEntry>,
    by_id: HashMap<String, usize>,
}

impl Inventory {
    pub(crate) fn new(entries: Vec<InventoryEntry>) -> Inventory {
        let by_id = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.id.clone(), i))
            .collect();
        Inventory { entries, by_id }
    }

    /// Every entry, in file order.
    pub fn entries(&self) -> &[InventoryEntry] {
        &self.entries
    }

    /// The entry with this id.
    pub fn get(&self, id: &str) -> Option<&InventoryEntry> {
        self.by_id.get(id).map(|&i| &self.entries[i])
    }

    /// Whether any entry names a BMC (the recoverer has work only then).
    pub fn has_bmcs(&self) -> bool {
        self.entries.iter().any(|e| e.bmc.is_some())
    }

    /// Whether any entry comes bare (the bare-metal loop and its media server are needed).
    pub fn has_bare(&self) -> bool {
        self.entries.iter().any(|e| e.bare.is_some())
    }
}

/// Checks what each entry's BMC names on this host (password, CA file): see
/// [`BmcEntry::check_local`]. Separate from parsing, which needs nothing but the text.
pub fn check_local(entries: &[InventoryEntry]) -> Result<(), InventoryProblem> {
    for (index, e) in entries.iter().enumerate() {
        if let Some(b) = &e.bmc {
            b.check_local().map_err(|error| InventoryProblem::Bmc {
                index,
                id: e.id.clone(),
                error: Box::new(error),
            })?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_parsing() {
        let good = br#"[{"ID": "m1", "Addr": "10.0.0.1", "Location": "rack-1"}, {"ID": "m2", "Addr": "10.0.0.2"}]"#;
        let inv = parse_inventory(good).unwrap();
        assert_eq!(inv.len(), 2);
        assert_eq!(inv[1].location, None);
        for (bad, why) in [
            (
                &br#"[{"ID": "m1", "Addr": "a", "Rack": "x"}]"#[..],
                "unknown field `Rack`",
            ),
            (br#"[{"ID": "m1"}]"#, "missing field `Addr`"),
            (br#"[{"ID": "", "Addr": "a"}]"#, "ID must be"),
            (br#"[{"ID": "m1", "Addr": " "}]"#, "Addr is empty"),
            (
                br#"[{"ID": "m1", "Addr": "a"}, {"ID": "m1", "Addr": "b"}]"#,
                "duplicate ID \"m1\"",
            ),
            (br#"{"ID": "m1", "Addr": "a"}"#, "valid JSON list"),
            (b"not json", "valid JSON list"),
        ] {
            let e = parse_inventory(bad).unwrap_err().to_string();
            assert!(e.contains(why), "{}: {e}", String::from_utf8_lossy(bad));
        }
        let long = format!(r#"[{{"ID": "{}", "Addr": "a"}}]"#, "x".repeat(129));
        assert!(parse_inventory(long.as_bytes()).is_err());
        assert!(parse_inventory(&vec![b' '; MAX_INVENTORY_BYTES + 1]).is_err());
    }
}
