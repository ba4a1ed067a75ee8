//! The machine's whole disks as sysfs shows them, with the facts root device hints match
//! (design.md §21). The live environment has no udev, so nothing here reads `/dev/disk/…`:
//! serials, WWNs, SCSI addresses and by-path names come from sysfs, where each driver keeps
//! them in its own place.
//!
//! Only whole disks that can hold an OS count: a partition, a CD, a loop, RAM or zram device,
//! a device-mapper or md node, a network block device, a floppy, a removable device, a USB
//! device (a BMC's virtual media and USB sticks are USB) and an empty device never do.

use std::path::{Path, PathBuf};

use shepherd_disks::DiskFacts;

use crate::wipe::Region;

/// Where the agent reads disks and opens them: sysfs and the device directory. Tests point
/// both at trees of their own (`SHEPHERD_AGENT_SYSFS`, `SHEPHERD_AGENT_DEV`).
#[derive(Debug, Clone)]
pub struct DiskRoots {
    /// Sysfs, `/sys`.
    pub sys: PathBuf,
    /// The device directory, `/dev`.
    pub dev: PathBuf,
}

impl DiskRoots {
    /// `/sys` and `/dev`, unless the environment names others.
    pub fn from_env() -> DiskRoots {
        let var = |name: &str, default: &str| {
            std::env::var_os(name)
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(default))
        };
        DiskRoots {
            sys: var("SHEPHERD_AGENT_SYSFS", "/sys"),
            dev: var("SHEPHERD_AGENT_DEV", "/dev"),
        }
    }

    /// The node to open for `disk` (whose name is `/dev/NAME`).
    pub fn node(&self, disk: &DiskFacts) -> PathBuf {
        self.dev
            .join(disk.name.strip_prefix("/dev/").unwrap_or(&disk.name))
    }
}

/// Kernel name prefixes of block devices that are never an OS's disk.
const NOT_DISKS: [&str; 10] = [
    "loop", "ram", "zram", "dm-", "sr", "md", "nbd", "fd", "zd", "drbd",
];

fn read(path: impl AsRef<Path>) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_string())
}

/// The whole disks under `roots.sys`, by name.
pub fn whole_disks(roots: &DiskRoots) -> Vec<DiskFacts> {
    let Ok(entries) = std::fs::read_dir(roots.sys.join("block")) else {
        return Vec::new();
    };
    let mut disks: Vec<DiskFacts> = entries
        .filter_map(|e| e.ok())
        .filter_map(|e| facts(&e.file_name().to_string_lossy(), &e.path()))
        .collect();
    disks.sort_by(|a, b| a.name.cmp(&b.name));
    disks
}

/// What a wipe of `disk` clears: each partition the kernel found on it (sysfs lists them
/// under the disk, with their first sector and length in 512-byte sectors), by name, then
/// the whole disk.
pub fn wipe_regions(roots: &DiskRoots, disk: &DiskFacts) -> Vec<Region> {
    let name = disk.name.strip_prefix("/dev/").unwrap_or(&disk.name);
    let sectors = |path: &Path, file: &str| -> Option<u64> { read(path.join(file))?.parse().ok() };
    let mut regions: Vec<Region> = std::fs::read_dir(roots.sys.join("block").join(name))
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok())
        .filter(|e| e.path().join("partition").exists())
        .filter_map(|e| {
            let path = e.path();
            let start = sectors(&path, "start")? * 512;
            let len = sectors(&path, "size")? * 512;
            (len > 0 && start + len <= disk.size_bytes).then(|| Region {
                name: format!("/dev/{}", e.file_name().to_string_lossy()),
                start,
                len,
            })
        })
        .collect();
    regions.sort_by_key(|r| r.start);
    regions.push(Region {
        name: disk.name.clone(),
        start: 0,
        len: disk.size_bytes,
    });
    regions
}

/// The facts of block device `name` at sysfs `path`, if it is a whole disk that counts.
fn facts(name: &str, path: &Path) -> Option<DiskFacts> {
    if NOT_DISKS.iter().any(|p| name.starts_with(p)) || path.join("partition").exists() {
        return None;
    }
    if read(path.join("removable")).as_deref() == Some("1") {
        return None;
    }
    // Where the device sits: `/sys/devices/pci0000:00/0000:00:05.0/virtio2/block/vda`.
    let place = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let place = place.to_string_lossy().to_string();
    if place.contains("/usb") {
        return None;
    }
    let sectors: u64 = read(path.join("size"))?.parse().ok()?;
    if sectors == 0 {
        return None;
    }
    let device = path.join("device");
    let hctl = std::fs::canonicalize(&device)
        .ok()
        .and_then(|d| d.file_name().map(|n| n.to_string_lossy().to_string()))
        .filter(|n| is_hctl(n))
        .unwrap_or_default();
    let wwid = read(path.join("wwid")).or_else(|| read(device.join("wwid")));
    let (wwn, wwn_vendor_extension, wwn_with_extension) = wwns(wwid.as_deref());
    Some(DiskFacts {
        name: format!("/dev/{name}"),
        size_bytes: sectors * 512,
        serial: serial(path).unwrap_or_default(),
        wwn,
        wwn_with_extension,
        wwn_vendor_extension,
        model: read(device.join("model")).unwrap_or_default(),
        vendor: read(device.join("vendor")).unwrap_or_default(),
        by_path: by_path(name, &place, &hctl).unwrap_or_default(),
        hctl,
        rotational: read(path.join("queue/rotational")).as_deref() == Some("1"),
    })
}

/// A disk's serial: virtio keeps it in `serial`, NVMe and MMC in `device/serial`, SCSI, SATA
/// and SAS disks in the unit serial number page of their VPD (`device/vpd_pg80`: a 4-byte
/// header, then the serial).
fn serial(path: &Path) -> Option<String> {
    read(path.join("serial"))
        .or_else(|| read(path.join("device/serial")))
        .or_else(|| {
            let page = std::fs::read(path.join("device/vpd_pg80")).ok()?;
            let text: String = page
                .get(4..)?
                .iter()
                .filter(|b| b.is_ascii_graphic() || **b == b' ')
                .map(|b| *b as char)
                .collect();
            let text = text.trim();
            (!text.is_empty()).then(|| text.to_string())
        })
}

/// `H:C:T:L`.
fn is_hctl(name: &str) -> bool {
    let parts: Vec<&str> = name.split(':').collect();
    parts.len() == 4
        && parts
            .iter()
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
}

/// The WWN, its vendor extension and the WWN with it, as udev names them (`ID_WWN`,
/// `ID_WWN_VENDOR_EXTENSION`, `ID_WWN_WITH_EXTENSION`), from the kernel's `wwid`: an NAA id
/// (`naa.` and 16 hex digits, or 32 of which the last 16 are the extension) becomes `0x…`;
/// an NVMe id (`eui.…`, `nvme.…`) is kept as it is; a T10 vendor id is no WWN.
fn wwns(wwid: Option<&str>) -> (String, String, String) {
    let Some(wwid) = wwid else {
        return Default::default();
    };
    if let Some(hex) = wwid.strip_prefix("naa.") {
        let hex = hex.to_lowercase();
        if hex.len() == 32 {
            let (id, extension) = hex.split_at(16);
            return (
                format!("0x{id}"),
                format!("0x{extension}"),
                format!("0x{hex}"),
            );
        }
        return (format!("0x{hex}"), String::new(), format!("0x{hex}"));
    }
    if wwid.starts_with("eui.") || wwid.starts_with("nvme.") {
        return (wwid.to_string(), String::new(), wwid.to_string());
    }
    Default::default()
}

/// The name udev's path_id gives a disk under `/dev/disk/by-path/`, for the buses whose form
/// is plain: a virtio disk (`pci-ADDR`), an NVMe namespace (`pci-ADDR-nvme-N`), a disk behind
/// virtio-scsi (`pci-ADDR-scsi-H:C:T:L`) and an ATA disk (`pci-ADDR-ata-PORT`); none for the
/// others (SAS, iSCSI, Fibre Channel), whose hints take a serial or WWN instead.
fn by_path(name: &str, place: &str, hctl: &str) -> Option<String> {
    let parts: Vec<&str> = place.split('/').collect();
    let pci = parts.iter().rev().find(|p| is_pci_address(p))?;
    let tail = if name.starts_with("nvme") {
        let namespace = name.rsplit_once('n')?.1;
        format!("-nvme-{namespace}")
    } else if let Some(port) = parts.iter().find_map(|p| p.strip_prefix("ata")) {
        port.bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| format!("-ata-{port}"))?
    } else if !hctl.is_empty() && place.contains("/virtio") {
        format!("-scsi-{hctl}")
    } else if name.starts_with("vd") && hctl.is_empty() {
        String::new()
    } else {
        return None;
    };
    Some(format!("/dev/disk/by-path/pci-{pci}{tail}"))
}

/// `0000:00:05.0`.
fn is_pci_address(text: &str) -> bool {
    let b = text.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| [4, 7, 10].contains(&i) || c.is_ascii_hexdigit())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A fake sysfs and /dev under `root`, filled by [`FakeDisk::add`].
    pub struct FakeMachine {
        pub roots: DiskRoots,
    }

    /// One block device to put into a [`FakeMachine`].
    pub struct FakeDisk<'a> {
        pub name: &'a str,
        /// Where the device sits under `/sys/devices`.
        pub place: &'a str,
        pub sectors: u64,
        /// Where its `device` link points under `/sys/devices`, if it has one.
        pub device: Option<&'a str>,
        /// Files under the device's sysfs directory, and their text.
        pub files: &'a [(&'a str, &'a [u8])],
    }

    impl FakeMachine {
        pub fn new(root: &Path) -> FakeMachine {
            let roots = DiskRoots {
                sys: root.join("sys"),
                dev: root.join("dev"),
            };
            std::fs::create_dir_all(roots.sys.join("block")).unwrap();
            std::fs::create_dir_all(&roots.dev).unwrap();
            FakeMachine { roots }
        }

        /// Adds `disk`: its sysfs directory, the `block/NAME` link to it, and a node of
        /// zeros in /dev as large as it says.
        pub fn add(&self, disk: FakeDisk<'_>) -> PathBuf {
            let dir = self
                .roots
                .sys
                .join("devices")
                .join(disk.place)
                .join("block")
                .join(disk.name);
            std::fs::create_dir_all(dir.join("queue")).unwrap();
            std::fs::write(dir.join("size"), format!("{}\n", disk.sectors)).unwrap();
            if let Some(device) = disk.device {
                let target = self.roots.sys.join("devices").join(device);
                std::fs::create_dir_all(&target).unwrap();
                std::os::unix::fs::symlink(target, dir.join("device")).unwrap();
            }
            for (file, text) in disk.files {
                let path = dir.join(file);
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(path, text).unwrap();
            }
            std::os::unix::fs::symlink(&dir, self.roots.sys.join("block").join(disk.name)).unwrap();
            let node = self.roots.dev.join(disk.name);
            let file = std::fs::File::create(&node).unwrap();
            file.set_len(disk.sectors * 512).unwrap();
            node
        }
    }

    #[test]
    fn whole_disks_are_read_from_sysfs_and_the_rest_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let m = FakeMachine::new(dir.path());
        let virtio = "pci0000:00/0000:00:05.0/virtio2";
        m.add(FakeDisk {
            name: "vda",
            place: virtio,
            sectors: 20 << 21,
            device: None,
            files: &[("serial", b"FIRST\n"), ("queue/rotational", b"1\n")],
        });
        // A SCSI disk behind virtio-scsi, with its serial in its VPD page and an NAA wwid.
        let scsi_place = "pci0000:00/0000:00:04.0/virtio1/host0/target0:0:1/0:0:1:0";
        m.add(FakeDisk {
            name: "sda",
            place: scsi_place,
            sectors: 1 << 21,
            device: Some(scsi_place),
            files: &[
                ("device/vpd_pg80", b"\x00\x80\x00\x06SECOND"),
                ("device/wwid", b"naa.5000C500A0B1C2D3\n"),
                ("device/model", b"QEMU HARDDISK   \n"),
                ("device/vendor", b"QEMU    \n"),
            ],
        });
        m.add(FakeDisk {
            name: "nvme0n1",
            place: "pci0000:00/0000:00:06.0/nvme/nvme0",
            sectors: 1 << 22,
            device: Some("pci0000:00/0000:00:06.0/nvme/nvme0"),
            files: &[("device/serial", b"NV1"), ("wwid", b"eui.0025388b71b2c3d4")],
        });
        // What never counts: a USB stick, a removable device, an empty one, a CD, a loop.
        for (name, place, sectors, files) in [
            (
                "sdb",
                "pci0000:00/0000:00:14.0/usb1/1-1/host2/target2:0:0/2:0:0:0",
                1 << 20,
                &[][..],
            ),
            (
                "sdc",
                "pci0000:00/0000:00:07.0/virtio3",
                1 << 20,
                &[("removable", &b"1"[..])][..],
            ),
            ("vdb", "pci0000:00/0000:00:08.0/virtio4", 0, &[][..]),
            ("sr0", "pci0000:00/0000:00:1f.2/ata1", 1 << 20, &[][..]),
            ("loop0", "virtual", 1 << 20, &[][..]),
        ] {
            m.add(FakeDisk {
                name,
                place,
                sectors,
                device: None,
                files,
            });
        }
        let disks = whole_disks(&m.roots);
        let names: Vec<_> = disks.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["/dev/nvme0n1", "/dev/sda", "/dev/vda"]);
        let [nvme, sda, vda] = [&disks[0], &disks[1], &disks[2]];
        assert_eq!(
            (
                vda.serial.as_str(),
                vda.size_bytes,
                vda.rotational,
                vda.by_path.as_str()
            ),
            (
                "FIRST",
                20 << 30,
                true,
                "/dev/disk/by-path/pci-0000:00:05.0"
            )
        );
        assert_eq!(
            (
                sda.serial.as_str(),
                sda.wwn.as_str(),
                sda.model.as_str(),
                sda.vendor.as_str()
            ),
            ("SECOND", "0x5000c500a0b1c2d3", "QEMU HARDDISK", "QEMU")
        );
        assert_eq!(
            (sda.hctl.as_str(), sda.by_path.as_str()),
            ("0:0:1:0", "/dev/disk/by-path/pci-0000:00:04.0-scsi-0:0:1:0")
        );
        assert_eq!(
            (
                nvme.serial.as_str(),
                nvme.wwn.as_str(),
                nvme.by_path.as_str()
            ),
            (
                "NV1",
                "eui.0025388b71b2c3d4",
                "/dev/disk/by-path/pci-0000:00:06.0-nvme-1"
            )
        );
        assert_eq!(m.roots.node(vda), m.roots.dev.join("vda"));
    }

    #[test]
    fn a_wwid_becomes_udevs_wwn_names() {
        let long = "naa.600508B1001C5D0C5E4F6A1F4B0E2F3A";
        assert_eq!(
            wwns(Some(long)),
            (
                "0x600508b1001c5d0c".into(),
                "0x5e4f6a1f4b0e2f3a".into(),
                "0x600508b1001c5d0c5e4f6a1f4b0e2f3a".into()
            )
        );
        assert_eq!(wwns(Some("t10.ATA     QEMU")), Default::default());
        assert_eq!(wwns(None), Default::default());
    }
}
