//! Disks by identity (design.md §21). An inventory entry names the disk an OS goes onto by a
//! device path or by root device hints in Ironic's vocabulary ([`hints`]); the agent, in the
//! live environment, lists the machine's whole disks and [`choose`]s the one the entry names:
//! exactly one, or nothing is written and the cause lists every disk it saw. Checked once when
//! the inventory is read ([`DiskChoice`] deserializes and validates), matched on the machine.
//! The formats of the images written onto a disk are here too ([`format`]): the entry names
//! one, the agent checks the image against it; and how an image's URL is shown, without its
//! secrets ([`url_shown`]).

mod facts;
pub mod format;
pub mod hints;
mod url_shown;

use std::fmt;

pub use facts::DiskFacts;
pub use format::{FormatError, ImageFormat, Sniffed};
pub use hints::{HintError, RootDeviceHints};
pub use url_shown::url_shown;

/// Which disk an OS goes onto: an inventory entry's `Disk`, a JSON string (a device path) or
/// a JSON object (root device hints).
#[derive(Debug, Clone, PartialEq)]
pub enum DiskChoice {
    /// A device path: `/dev/sda`, or a udev-style `/dev/disk/by-path/…` name.
    Path(String),
    /// Root device hints.
    Hints(RootDeviceHints),
}

impl DiskChoice {
    /// Reads `Disk` from an inventory entry's JSON, checking it.
    pub fn from_value(value: &serde_json::Value) -> Result<Self, HintError> {
        match value {
            serde_json::Value::String(path) => DiskChoice::path(path),
            serde_json::Value::Object(object) => {
                RootDeviceHints::parse(object).map(DiskChoice::Hints)
            }
            other => Err(HintError {
                hint: String::new(),
                problem: format!("{other} is neither a device path nor an object of hints"),
            }),
        }
    }

    /// A device path, checked: `/dev/` and a name of letters, digits and `/_-.:` without `..`.
    pub fn path(path: &str) -> Result<Self, HintError> {
        let name = path.strip_prefix("/dev/").unwrap_or_default();
        if name.is_empty()
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"/_-.:".contains(&b))
            || name.contains("..")
        {
            return Err(HintError {
                hint: String::new(),
                problem: format!(
                    "{path:?} is not a device path like /dev/sda or /dev/nvme0n1, nor an object of root device hints"
                ),
            });
        }
        Ok(DiskChoice::Path(path.to_string()))
    }

    /// Whether `disk` is the one this choice names.
    pub fn matches(&self, disk: &DiskFacts) -> bool {
        match self {
            DiskChoice::Path(path) => {
                *path == disk.name || (!disk.by_path.is_empty() && *path == disk.by_path)
            }
            DiskChoice::Hints(hints) => hints.matches(disk),
        }
    }
}

impl fmt::Display for DiskChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DiskChoice::Path(path) => write!(f, "{path}"),
            DiskChoice::Hints(hints) => write!(f, "{hints}"),
        }
    }
}

/// How many disks a cause lists by name; a larger machine's are counted after them.
const LISTED: usize = 24;

/// The disks of a cause, each with its facts, at most [`LISTED`] of them.
fn listing(disks: &[&DiskFacts]) -> String {
    if disks.is_empty() {
        return "none".into();
    }
    let mut text = disks
        .iter()
        .take(LISTED)
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join("; ");
    if disks.len() > LISTED {
        text.push_str(&format!("; and {} more", disks.len() - LISTED));
    }
    text
}

/// Why no disk was chosen. Nothing is written then.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoDisk {
    /// No whole disk is the one named.
    #[error("no whole disk is {wanted}; the whole disks this machine has: {seen}")]
    None {
        /// The entry's choice.
        wanted: String,
        /// Every whole disk seen, with its facts.
        seen: String,
    },
    /// More than one whole disk matches: hints must name one.
    #[error("{count} whole disks match {wanted}, and the hints must name one: {matched}; add a hint that tells them apart (serial or wwn)")]
    Several {
        /// The entry's choice.
        wanted: String,
        /// How many matched.
        count: usize,
        /// The matching disks, with their facts.
        matched: String,
    },
}

/// The one whole disk of `disks` that `choice` names.
pub fn choose<'a>(choice: &DiskChoice, disks: &'a [DiskFacts]) -> Result<&'a DiskFacts, NoDisk> {
    let matched: Vec<&DiskFacts> = disks.iter().filter(|d| choice.matches(d)).collect();
    match matched.as_slice() {
        [one] => Ok(one),
        [] => Err(NoDisk::None {
            wanted: choice.to_string(),
            seen: listing(&disks.iter().collect::<Vec<_>>()),
        }),
        several => Err(NoDisk::Several {
            wanted: choice.to_string(),
            count: several.len(),
            matched: listing(several),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(name: &str, serial: &str, gib: u64) -> DiskFacts {
        DiskFacts {
            name: format!("/dev/{name}"),
            size_bytes: gib << 30,
            serial: serial.into(),
            by_path: format!("/dev/disk/by-path/pci-{name}"),
            ..DiskFacts::default()
        }
    }

    fn choice(json: &str) -> DiskChoice {
        DiskChoice::from_value(&serde_json::from_str(json).unwrap()).unwrap()
    }

    #[test]
    fn exactly_one_disk_is_chosen_or_the_cause_lists_every_disk_seen() {
        let disks = [disk("vda", "FIRST", 10), disk("vdb", "SECOND", 10)];
        assert_eq!(
            choose(&choice(r#"{"serial": "second"}"#), &disks)
                .unwrap()
                .name,
            "/dev/vdb"
        );
        assert_eq!(
            choose(&choice(r#""/dev/vda""#), &disks).unwrap().name,
            "/dev/vda"
        );
        let refused = |json| choose(&choice(json), &disks).unwrap_err().to_string();
        let none = refused(r#""/dev/sdz""#);
        assert!(
            none.contains("no whole disk is /dev/sdz")
                && none.contains("/dev/vda (10.0 GiB, serial FIRST)")
                && none.contains("/dev/vdb (10.0 GiB, serial SECOND)"),
            "{none}"
        );
        let both = refused(r#"{"size": 10}"#);
        assert!(
            both.contains("2 whole disks match the hints {\"size\":10}")
                && both.contains("serial FIRST")
                && both.contains("serial SECOND"),
            "{both}"
        );
        let empty = choose(&choice(r#""/dev/sda""#), &[])
            .unwrap_err()
            .to_string();
        assert!(
            empty.ends_with("the whole disks this machine has: none"),
            "{empty}"
        );
    }

    #[test]
    fn a_long_list_of_disks_is_bounded() {
        let disks: Vec<_> = (0..100).map(|i| disk(&format!("sd{i}"), "S", 1)).collect();
        let err = choose(&choice(r#""/dev/nvme0n1""#), &disks)
            .unwrap_err()
            .to_string();
        assert!(err.ends_with("; and 76 more"), "{err}");
    }

    #[test]
    fn a_by_path_name_is_a_path_too() {
        let disks = [disk("vda", "A", 1), disk("sda", "B", 1)];
        let by_path = disks[0].by_path.clone();
        assert_eq!(
            choose(&DiskChoice::path(&by_path).unwrap(), &disks)
                .unwrap()
                .name,
            "/dev/vda"
        );
    }

    #[test]
    fn a_disk_that_is_neither_path_nor_hints_is_refused() {
        for (json, want) in [
            (r#""sda""#, "is not a device path"),
            (r#""/dev/../etc/passwd""#, "is not a device path"),
            (r#""/dev/sda; rm -rf /""#, "is not a device path"),
            ("5", "neither a device path nor an object"),
            (r#"{"serial": []}"#, "serial: [] is not text"),
        ] {
            let err = DiskChoice::from_value(&serde_json::from_str(json).unwrap())
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{json}: {err}");
        }
    }
}
