//! A wipe (design.md §21): before an image overwrites a disk that was allowed to be wiped,
//! the signatures at both ends of each of its partitions and of the disk itself are cleared,
//! as `wipefs -a` on each and `sgdisk --zap-all` would. The image then covers the disk's
//! start, but nothing else would clear a backup GPT, an md 0.90 or 1.0 superblock, an LVM
//! label or a ZFS label past the image's end, which the installed OS's udev or mdadm would
//! find and assemble. What was cleared goes into the installation's report.

use std::os::unix::fs::FileExt;

use crate::blank::Ends;

/// A stretch of the disk whose ends are cleared: a partition, or the whole disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Region {
    /// The device that names it, e.g. `/dev/vdb1`.
    pub name: String,
    /// Its first byte on the disk.
    pub start: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// What a wipe cleared: one entry per region whose ends were not blank, in the order cleared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Wiped {
    /// `<what it held> on <region>`, e.g. "a Linux RAID member (md 1.0) on /dev/vdb1".
    pub cleared: Vec<String>,
}

/// How many cleared regions a report names before it only counts the rest.
const NAMED: usize = 8;

impl std::fmt::Display for Wiped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.cleared.is_empty() {
            return f.write_str("nothing (every end was blank)");
        }
        f.write_str(&self.cleared[..self.cleared.len().min(NAMED)].join("; "))?;
        match self.cleared.len().checked_sub(NAMED) {
            Some(more) if more > 0 => write!(f, "; and {more} more"),
            _ => Ok(()),
        }
    }
}

/// Clears the first and last MiB of each of `regions` on `disk` that is not blank there,
/// then flushes the disk. The disk's position is left at its start, where the image begins.
pub fn wipe(disk: &std::fs::File, regions: &[Region]) -> std::io::Result<Wiped> {
    let mut wiped = Wiped::default();
    for region in regions {
        let ends = Ends::read(disk, region.start, region.len)?;
        let Some(held) = ends.holds() else {
            continue;
        };
        disk.write_all_at(&vec![0; ends.head.len()], region.start)?;
        let tail_start = region.start + region.len - ends.tail.len() as u64;
        disk.write_all_at(&vec![0; ends.tail.len()], tail_start)?;
        wiped.cleared.push(format!("{held} on {}", region.name));
    }
    disk.sync_all()?;
    Ok(wiped)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    /// An 8 MiB disk with a partition from 1 MiB to 7 MiB; `marks` are (offset, bytes).
    fn disk(dir: &std::path::Path, marks: &[(u64, &[u8])]) -> std::fs::File {
        let path = dir.join("disk");
        let mut data = vec![0u8; 8 * MIB as usize];
        for (offset, bytes) in marks {
            let o = *offset as usize;
            data[o..o + bytes.len()].copy_from_slice(bytes);
        }
        // Something past every end that a wipe must leave alone: the middle of the partition.
        data[4 * MIB as usize] = 0x42;
        std::fs::write(&path, data).unwrap();
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap()
    }

    fn regions() -> [Region; 2] {
        [
            Region {
                name: "/dev/vdb1".into(),
                start: MIB,
                len: 6 * MIB,
            },
            Region {
                name: "/dev/vdb".into(),
                start: 0,
                len: 8 * MIB,
            },
        ]
    }

    #[test]
    fn a_wipe_clears_both_ends_of_each_partition_and_of_the_disk_and_says_what_it_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let md_10 = MIB + ((6 * MIB / 512 - 16) & !7) * 512;
        let f = disk(
            dir.path(),
            &[
                (512, b"EFI PART"),
                (8 * MIB - 512, b"EFI PART"),
                (MIB + 1080, &[0x53, 0xef]),
                (md_10, &[0xfc, 0x4e, 0x2b, 0xa9]),
            ],
        );
        let wiped = wipe(&f, &regions()).unwrap();
        assert_eq!(
            wiped.to_string(),
            "an ext2/3/4 file system and a Linux RAID member (md 1.0) on /dev/vdb1; \
             a GPT partition table and a GPT partition table's backup header on /dev/vdb"
        );
        let mut data = vec![0u8; 8 * MIB as usize];
        f.read_exact_at(&mut data, 0).unwrap();
        assert_eq!(data[4 * MIB as usize], 0x42, "the middle is untouched");
        data[4 * MIB as usize] = 0;
        assert!(data.iter().all(|b| *b == 0), "every signature is gone");
        assert_eq!(
            wipe(&f, &regions()).unwrap(),
            Wiped::default(),
            "a wiped disk has nothing more to clear"
        );
    }

    #[test]
    fn a_report_names_a_few_cleared_regions_and_counts_the_rest() {
        let wiped = Wiped {
            cleared: (0..11).map(|i| format!("data on /dev/sda{i}")).collect(),
        };
        let text = wiped.to_string();
        assert!(
            text.starts_with("data on /dev/sda0; data on /dev/sda1;"),
            "{text}"
        );
        assert!(text.ends_with("data on /dev/sda7; and 3 more"), "{text}");
        assert_eq!(
            Wiped::default().to_string(),
            "nothing (every end was blank)"
        );
    }
}
