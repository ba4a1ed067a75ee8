//! A whole disk as the agent sees it: the facts root device hints are matched against.

use std::fmt;

/// A whole disk as the agent sees it, with the facts hints are matched against. Text facts the
/// disk does not have are empty.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiskFacts {
    /// Its device path in the live environment, `/dev/sda`.
    pub name: String,
    /// Its size in bytes.
    pub size_bytes: u64,
    /// Its serial number.
    pub serial: String,
    /// Its World Wide Name, `0x5000c500a0b1c2d3` (or an NVMe `eui.`/`nguid` id as the kernel
    /// gives it).
    pub wwn: String,
    /// The WWN with its vendor extension appended, where the disk has one (else the WWN).
    pub wwn_with_extension: String,
    /// The WWN's vendor extension, where the disk has one.
    pub wwn_vendor_extension: String,
    /// Its model.
    pub model: String,
    /// Its vendor.
    pub vendor: String,
    /// Its SCSI address, host:channel:target:lun, for SCSI, SATA and SAS disks.
    pub hctl: String,
    /// The by-path name udev would give it, `/dev/disk/by-path/pci-0000:00:05.0`.
    pub by_path: String,
    /// Whether it spins.
    pub rotational: bool,
}

impl fmt::Display for DiskFacts {
    /// `/dev/sdb (480.0 GiB, serial S3YJ, WWN 0x50…, model Samsung SSD)`: what an operator
    /// needs to write a hint for it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({:.1} GiB",
            self.name,
            self.size_bytes as f64 / (1u64 << 30) as f64
        )?;
        for (label, value) in [
            ("serial", &self.serial),
            ("WWN", &self.wwn),
            ("model", &self.model),
            ("vendor", &self.vendor),
            ("hctl", &self.hctl),
        ] {
            if !value.trim().is_empty() {
                write!(f, ", {label} {}", value.trim())?;
            }
        }
        if self.rotational {
            write!(f, ", rotational")?;
        }
        write!(f, ")")
    }
}
