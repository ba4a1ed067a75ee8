//! Whether a disk is blank, and if not, what it holds (a partition table, a file system),
//! told by the signatures at its ends: the agent overwrites only a blank disk unless a wipe
//! is allowed (design.md §21).

/// How far a device's ends are read to tell whether it is blank.
const CHECKED_BYTES: u64 = 1 << 20;

/// What `device` holds, or `None` if it is blank: its first and last MiB all zeros. Recognises partition tables and the common file systems by their
/// signatures, to say what would be overwritten; anything else that is not zeros is "data".
pub fn what_it_holds(device: &std::path::Path) -> std::io::Result<Option<String>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(device)?;
    let size = f.seek(SeekFrom::End(0))?;
    let mut head = vec![0u8; CHECKED_BYTES.min(size) as usize];
    f.seek(SeekFrom::Start(0))?;
    f.read_exact(&mut head)?;
    let tail_len = CHECKED_BYTES.min(size.saturating_sub(head.len() as u64));
    let mut tail = vec![0u8; tail_len as usize];
    f.seek(SeekFrom::Start(size - tail_len))?;
    f.read_exact(&mut tail)?;
    if head.iter().chain(&tail).all(|b| *b == 0) {
        return Ok(None);
    }
    Ok(Some(
        signature(&head, &tail)
            .unwrap_or("data (its first or last MiB is not blank)")
            .to_string(),
    ))
}

/// The partition table or file system whose signature `head` (a device's first bytes) or
/// `tail` (its last) carries.
fn signature(head: &[u8], tail: &[u8]) -> Option<&'static str> {
    let at = |offset: usize, magic: &[u8]| head.get(offset..offset + magic.len()) == Some(magic);
    let signatures: [(usize, &[u8], &str); 12] = [
        (512, b"EFI PART", "a GPT partition table"),
        (4096, b"EFI PART", "a GPT partition table"),
        (0, b"LUKS\xba\xbe", "a LUKS encrypted volume"),
        (0, b"XFSB", "an XFS file system"),
        (1080, &[0x53, 0xef], "an ext2/3/4 file system"),
        (65600, b"_BHRfS_M", "a btrfs file system"),
        (32769, b"CD001", "an ISO 9660 file system"),
        (536, b"LVM2 001", "an LVM physical volume"),
        (4086, b"SWAPSPACE2", "a swap area"),
        (4096, &[0xfc, 0x4e, 0x2b, 0xa9], "a Linux RAID member"),
        (82, b"FAT32", "a FAT file system"),
        (54, b"FAT", "a FAT file system"),
    ];
    if let Some((_, _, what)) = signatures.iter().find(|(o, m, _)| at(*o, m)) {
        return Some(what);
    }
    if at(510, &[0x55, 0xaa]) {
        return Some("an MBR partition table");
    }
    let last_sector = tail.len().checked_sub(512).and_then(|s| tail.get(s..s + 8));
    (last_sector == Some(b"EFI PART")).then_some("a GPT partition table (its backup header)")
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
        let cases: [(usize, &[u8], Option<&str>); 8] = [
            (0, &[], None),
            (510, &[0x55, 0xaa], Some("an MBR partition table")),
            (512, b"EFI PART", Some("a GPT partition table")),
            (1080, &[0x53, 0xef], Some("an ext2/3/4 file system")),
            (0, b"XFSB", Some("an XFS file system")),
            (
                (4 << 20) - 512,
                b"EFI PART",
                Some("a GPT partition table (its backup header)"),
            ),
            (100, b"x", Some("data (its first or last MiB is not blank)")),
            (2 << 20, b"x", None),
        ];
        for (i, (offset, bytes, want)) in cases.into_iter().enumerate() {
            let got = holds(&format!("disk{i}"), offset, bytes);
            assert_eq!(got.as_deref(), want, "bytes {bytes:?} at {offset}");
        }
    }
}
