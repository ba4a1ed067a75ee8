//! Whether a disk is blank, and if not, what it holds (a partition table, a file system, a
//! RAID member), told by the signatures at its ends: the agent overwrites only a blank disk
//! unless a wipe is allowed (design.md §21), and a wipe names what it cleared.

use std::io::{Seek, SeekFrom};
use std::os::unix::fs::FileExt;

/// How far a device's (or a partition's) ends are read to tell whether it is blank, and
/// how far a wipe clears them: every signature `wipefs` knows of lies within it.
pub const END_BYTES: u64 = 1 << 20;

/// The first and last bytes of a region of a device (at most [`END_BYTES`] each, never
/// overlapping), read to tell what it holds.
pub struct Ends {
    /// The region's first bytes.
    pub head: Vec<u8>,
    /// Its last bytes, after the head.
    pub tail: Vec<u8>,
    /// The region's length.
    pub len: u64,
}

impl Ends {
    /// Reads the ends of the `len` bytes of `f` from `start`, leaving its position as it was.
    pub fn read(f: &std::fs::File, start: u64, len: u64) -> std::io::Result<Ends> {
        let mut head = vec![0u8; END_BYTES.min(len) as usize];
        f.read_exact_at(&mut head, start)?;
        let tail_len = END_BYTES.min(len - head.len() as u64);
        let mut tail = vec![0u8; tail_len as usize];
        f.read_exact_at(&mut tail, start + len - tail_len)?;
        Ok(Ends { head, tail, len })
    }

    /// Whether both ends are all zeros.
    pub fn is_blank(&self) -> bool {
        self.head.iter().chain(&self.tail).all(|b| *b == 0)
    }

    /// What the region holds, by its signatures, or `None` if its ends are zeros: anything
    /// else that is not zeros is "data".
    pub fn holds(&self) -> Option<String> {
        if self.is_blank() {
            return None;
        }
        let found = signatures(self);
        Some(if found.is_empty() {
            "data (its first or last MiB is not blank)".to_string()
        } else {
            found.join(" and ")
        })
    }

    /// Whether the region's bytes at `offset` from its start are `magic`.
    fn at(&self, offset: u64, magic: &[u8]) -> bool {
        let head_at = usize::try_from(offset).ok().and_then(|o| {
            self.head
                .get(o..o.checked_add(magic.len())?)
                .map(|b| b == magic)
        });
        let tail_start = self.len - self.tail.len() as u64;
        let tail_at = offset.checked_sub(tail_start).and_then(|o| {
            let o = o as usize;
            self.tail.get(o..o + magic.len()).map(|b| b == magic)
        });
        head_at == Some(true) || tail_at == Some(true)
    }
}

/// What `device` holds, or `None` if it is blank: its first and last MiB all zeros.
pub fn what_it_holds(device: &std::path::Path) -> std::io::Result<Option<String>> {
    let mut f = std::fs::File::open(device)?;
    let size = f.seek(SeekFrom::End(0))?;
    Ok(Ends::read(&f, 0, size)?.holds())
}

/// The md RAID superblock's magic, as x86's little-endian kernels write it.
const MD_MAGIC: [u8; 4] = [0xfc, 0x4e, 0x2b, 0xa9];

/// The partition tables, file systems and RAID superblocks whose signatures `ends` carries,
/// each named once, in the order of the list below.
fn signatures(ends: &Ends) -> Vec<&'static str> {
    let len = ends.len;
    // md 0.90 keeps its superblock in the last 64 KiB-aligned 64 KiB, md 1.0 at least 8 KiB
    // from the end, 4 KiB-aligned; a GPT's backup header is the last sector.
    let md_090 = (len & !0xffff).checked_sub(0x1_0000);
    let md_10 = (len / 512).checked_sub(16).map(|s| (s & !7) * 512);
    let last_sector = len.checked_sub(512);
    let found: [(Option<u64>, &[u8], &str); 16] = [
        (Some(512), b"EFI PART", "a GPT partition table"),
        (Some(4096), b"EFI PART", "a GPT partition table"),
        (
            last_sector,
            b"EFI PART",
            "a GPT partition table's backup header",
        ),
        (Some(0), b"LUKS\xba\xbe", "a LUKS encrypted volume"),
        (Some(0), b"XFSB", "an XFS file system"),
        (Some(1080), &[0x53, 0xef], "an ext2/3/4 file system"),
        (Some(65600), b"_BHRfS_M", "a btrfs file system"),
        (Some(32769), b"CD001", "an ISO 9660 file system"),
        (Some(536), b"LVM2 001", "an LVM physical volume"),
        (Some(4086), b"SWAPSPACE2", "a swap area"),
        (Some(0), &MD_MAGIC, "a Linux RAID member (md 1.1)"),
        (Some(4096), &MD_MAGIC, "a Linux RAID member (md 1.2)"),
        (md_10, &MD_MAGIC, "a Linux RAID member (md 1.0)"),
        (md_090, &MD_MAGIC, "a Linux RAID member (md 0.90)"),
        (Some(82), b"FAT32", "a FAT file system"),
        (Some(54), b"FAT", "a FAT file system"),
    ];
    let mut names: Vec<&str> = Vec::new();
    for (offset, magic, name) in found {
        if offset.is_some_and(|o| ends.at(o, magic)) && !names.contains(&name) {
            names.push(name);
        }
    }
    // A GPT's primary header follows its protective MBR, which is not named apart.
    let has_gpt = names.contains(&"a GPT partition table");
    if !has_gpt && !names.iter().any(|n| n.contains("FAT")) && ends.at(510, &[0x55, 0xaa]) {
        names.insert(0, "an MBR partition table");
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A disk image of 4 MiB of zeros with `bytes` written at `offset`.
    fn disk(dir: &std::path::Path, name: &str, offset: usize, bytes: &[u8]) -> std::path::PathBuf {
        let mut data = vec![0u8; 4 << 20];
        data[offset..offset + bytes.len()].copy_from_slice(bytes);
        let path = dir.join(name);
        std::fs::write(&path, data).unwrap();
        path
    }

    #[test]
    fn a_device_is_blank_only_if_its_ends_are_zeros_and_what_it_holds_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let holds = |name: &str, offset, bytes: &[u8]| {
            what_it_holds(&disk(dir.path(), name, offset, bytes)).unwrap()
        };
        assert!(
            what_it_holds(&dir.path().join("absent")).is_err(),
            "a disk that is not there is not blank"
        );
        // What is written where, and what the disk is then said to hold; only the ends are read.
        let cases: [(usize, &[u8], Option<&str>); 11] = [
            (0, &[], None),
            (510, &[0x55, 0xaa], Some("an MBR partition table")),
            (512, b"EFI PART", Some("a GPT partition table")),
            (1080, &[0x53, 0xef], Some("an ext2/3/4 file system")),
            (0, b"XFSB", Some("an XFS file system")),
            (
                (4 << 20) - 512,
                b"EFI PART",
                Some("a GPT partition table's backup header"),
            ),
            (4096, &MD_MAGIC, Some("a Linux RAID member (md 1.2)")),
            (4186112, &MD_MAGIC, Some("a Linux RAID member (md 1.0)")),
            (4128768, &MD_MAGIC, Some("a Linux RAID member (md 0.90)")),
            (100, b"x", Some("data (its first or last MiB is not blank)")),
            (2 << 20, b"x", None),
        ];
        for (i, (offset, bytes, want)) in cases.into_iter().enumerate() {
            let got = holds(&format!("disk{i}"), offset, bytes);
            assert_eq!(got.as_deref(), want, "bytes {bytes:?} at {offset}");
        }
    }
}
