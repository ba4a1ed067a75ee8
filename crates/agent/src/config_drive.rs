//! The installed OS's config drive (design.md §21): after the image, the agent adds a
//! partition at the disk's end holding a FAT file system labelled `config-2` with the files
//! of OpenStack's config-2 layout that Shepherd sent (`openstack/latest/meta_data.json`,
//! `network_data.json`, `user_data`), as Ironic's agent does. cloud-init in a stock cloud
//! image finds it there and installs Shepherd's key and the network, so that the initializer
//! can take the installed OS over.
//!
//! The partition goes into the image's own table: a GPT (whose backup header is first moved to
//! the disk's end, since the image's lies at the image's end) or an MBR. An image with
//! neither, or with no room left at the disk's end, gets no config drive: the installation
//! fails and says so, since the installed OS would not let Shepherd in.

use std::io::Write;

use shepherd_proto::bmaas::ConfigDriveFile;

/// The config drive partition's size, as Ironic makes it.
pub const DRIVE_BYTES: u64 = 64 << 20;

/// Where partitions start: on a MiB boundary.
const ALIGN_BYTES: u64 = 1 << 20;

/// The file system's label, which cloud-init looks for (it takes either case).
const LABEL: [u8; 11] = *b"CONFIG-2   ";

/// GPT's type of Linux file system data, in its on-disk byte order.
const LINUX_DATA: [u8; 16] = [
    0xaf, 0x3d, 0xc6, 0x0f, 0x83, 0x84, 0x72, 0x47, 0x8e, 0x79, 0x3d, 0x69, 0xd8, 0x47, 0x7d, 0xe4,
];

/// MBR's type of a FAT file system addressed by LBA.
const MBR_FAT_LBA: u8 = 0x0c;

/// Why no config drive was written.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    /// The image carries no partition table to add the partition to.
    #[error("the image has no partition table (GPT or MBR) to add the config drive's partition to; an image that brings its own way in takes \"ConfigDrive\": false in its entry")]
    NoTable,
    /// The disk has no room for the partition at its end, or no free entry.
    #[error("no room for the {mib} MiB config drive: {0}", mib = DRIVE_BYTES >> 20)]
    NoRoom(String),
    /// The partition table could not be read or written.
    #[error("the image's {table} partition table: {error}")]
    Table {
        /// `GPT` or `MBR`.
        table: &'static str,
        /// What the library said.
        error: String,
    },
    /// A file's path is not a relative path of plain names.
    #[error("a config drive file's path {0:?} is not a relative path of plain names")]
    BadPath(String),
    /// Writing the file system or its files failed.
    #[error("writing the config drive: {0}")]
    Io(std::io::Error),
}

impl From<std::io::Error> for DriveError {
    fn from(error: std::io::Error) -> DriveError {
        DriveError::Io(error)
    }
}

/// The config drive written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drive {
    /// `GPT` or `MBR`.
    pub table: &'static str,
    /// Its partition's number in that table.
    pub partition: u32,
    /// Its first byte on the disk.
    pub start: u64,
    /// Its length in bytes.
    pub len: u64,
}

impl std::fmt::Display for Drive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a config drive (FAT, label config-2, {} MiB) as partition {} of its {}",
            self.len >> 20,
            self.partition,
            self.table
        )
    }
}

/// Adds the config drive holding `files` to the image just written onto `disk` (of `size`
/// bytes), and flushes it.
pub fn write(
    disk: &std::fs::File,
    size: u64,
    files: &[ConfigDriveFile],
) -> Result<Drive, DriveError> {
    for file in files {
        let plain = |part: &str| !part.is_empty() && part != "." && part != "..";
        if file.path.starts_with('/') || !file.path.split('/').all(plain) {
            return Err(DriveError::BadPath(file.path.clone()));
        }
    }
    use std::os::unix::fs::FileExt;
    let mut head = [0u8; 4608];
    disk.read_exact_at(&mut head, 0)?;
    // A GPT's header follows its protective MBR in the second sector, of 512 or 4096 bytes.
    let drive = if &head[512..520] == b"EFI PART" || &head[4096..4104] == b"EFI PART" {
        add_to_gpt(disk)?
    } else if head[510..512] == [0x55, 0xaa] {
        add_to_mbr(disk)?
    } else {
        return Err(DriveError::NoTable);
    };
    debug_assert!(drive.start + drive.len <= size, "placed within the disk");
    let region = fscommon::StreamSlice::new(disk, drive.start, drive.start + drive.len)?;
    let mut region = fscommon::BufStream::new(region);
    fatfs::format_volume(
        &mut region,
        fatfs::FormatVolumeOptions::new().volume_label(LABEL),
    )?;
    {
        let fs = fatfs::FileSystem::new(&mut region, fatfs::FsOptions::new())?;
        for file in files {
            put(&fs.root_dir(), &file.path, &file.content)?;
        }
        fs.unmount()?;
    }
    region.flush()?;
    disk.sync_all()?;
    Ok(drive)
}

/// Writes `content` at `path` under `dir`, making the directories on the way.
fn put<T: fatfs::ReadWriteSeek>(
    dir: &fatfs::Dir<'_, T>,
    path: &str,
    content: &[u8],
) -> std::io::Result<()> {
    match path.split_once('/') {
        Some((name, rest)) => {
            let sub = match dir.open_dir(name) {
                Ok(sub) => sub,
                Err(_) => dir.create_dir(name)?,
            };
            put(&sub, rest, content)
        }
        None => {
            let mut file = dir.create_file(path)?;
            file.truncate()?;
            file.write_all(content)
        }
    }
}

/// 16 random bytes, for a partition's unique GUID.
fn random_guid() -> Result<[u8; 16], DriveError> {
    let mut guid = [0u8; 16];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut guid)
        .map_err(|_| DriveError::Io(std::io::Error::other("no random bytes for a GUID")))?;
    // Version 4, variant 1, as a random UUID (its first three fields little-endian on disk).
    guid[7] = (guid[7] & 0x0f) | 0x40;
    guid[8] = (guid[8] & 0x3f) | 0x80;
    Ok(guid)
}

/// Adds the partition to the image's GPT, whose backup header and entries move to the disk's
/// end first; a plain protective MBR is made to cover the whole disk again.
fn add_to_gpt(disk: &std::fs::File) -> Result<Drive, DriveError> {
    let table_error = |error: gptman::Error| DriveError::Table {
        table: "GPT",
        error: error.to_string(),
    };
    let mut f = disk;
    let mut gpt = gptman::GPT::find_from(&mut f).map_err(table_error)?;
    let sector = gpt.sector_size;
    gpt.header
        .update_from(&mut f, sector)
        .map_err(table_error)?;
    gpt.align = ALIGN_BYTES / sector;
    let sectors = DRIVE_BYTES / sector;
    let start = gpt.find_last_place(sectors).ok_or_else(|| {
        DriveError::NoRoom("the GPT's partitions leave no aligned space at the disk's end".into())
    })?;
    let entries = gpt.header.number_of_partition_entries;
    let slot = (1..=entries)
        .find(|i| gpt[*i].is_unused())
        .ok_or_else(|| DriveError::NoRoom(format!("all {entries} entries of the GPT are used")))?;
    gpt[slot] = gptman::GPTPartitionEntry {
        partition_type_guid: LINUX_DATA,
        unique_partition_guid: random_guid()?,
        starting_lba: start,
        ending_lba: start + sectors - 1,
        attribute_bits: 0,
        partition_name: "config-2".into(),
    };
    gpt.write_into(&mut f).map_err(table_error)?;
    let mut mbr = [0u8; 512];
    use std::os::unix::fs::FileExt;
    disk.read_exact_at(&mut mbr, 0)?;
    let plain_protective = mbr[446 + 4] == 0xee && mbr[462..510].iter().all(|b| *b == 0);
    if plain_protective && mbr[446] == 0x80 {
        gptman::GPT::write_bootable_protective_mbr_into(&mut f, sector).map_err(table_error)?;
    } else if plain_protective {
        gptman::GPT::write_protective_mbr_into(&mut f, sector).map_err(table_error)?;
    }
    Ok(Drive {
        table: "GPT",
        partition: slot,
        start: start * sector,
        len: sectors * sector,
    })
}

/// Adds the partition to the image's MBR as a primary partition.
fn add_to_mbr(disk: &std::fs::File) -> Result<Drive, DriveError> {
    let table_error = |error: mbrman::Error| DriveError::Table {
        table: "MBR",
        error: error.to_string(),
    };
    let mut f = disk;
    let mut mbr = mbrman::MBR::read_from(&mut f, 512).map_err(table_error)?;
    mbr.update_from(&mut f).map_err(table_error)?;
    mbr.align = (ALIGN_BYTES / 512) as u32;
    let sectors = (DRIVE_BYTES / 512) as u32;
    let start = mbr.find_last_place(sectors).ok_or_else(|| {
        DriveError::NoRoom("the MBR's partitions leave no aligned space at the disk's end (or past 2 TiB, which an MBR cannot address)".into())
    })?;
    let slot = (1..=4)
        .find(|i| mbr[*i].is_unused())
        .ok_or_else(|| DriveError::NoRoom("all four primary entries of the MBR are used".into()))?;
    mbr[slot] = mbrman::MBRPartitionEntry {
        boot: mbrman::BOOT_INACTIVE,
        first_chs: mbrman::CHS::empty(),
        sys: MBR_FAT_LBA,
        last_chs: mbrman::CHS::empty(),
        starting_lba: start,
        sectors,
    };
    mbr.write_into(&mut f).map_err(table_error)?;
    Ok(Drive {
        table: "MBR",
        partition: slot as u32,
        start: u64::from(start) * 512,
        len: u64::from(sectors) * 512,
    })
}

/// Reads a file's bytes back from a FAT volume (for tests).
#[cfg(test)]
pub(crate) fn read_back(disk: &std::fs::File, drive: &Drive, path: &str) -> Vec<u8> {
    use std::io::Read;
    let region = fscommon::StreamSlice::new(disk, drive.start, drive.start + drive.len).unwrap();
    let fs = fatfs::FileSystem::new(region, fatfs::FsOptions::new()).unwrap();
    let mut content = Vec::new();
    fs.root_dir()
        .open_file(path)
        .unwrap()
        .read_to_end(&mut content)
        .unwrap();
    content
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn files() -> Vec<ConfigDriveFile> {
        [
            (
                "openstack/latest/meta_data.json",
                br#"{"uuid":"m"}"#.to_vec(),
            ),
            (
                "openstack/latest/network_data.json",
                br#"{"links":[]}"#.to_vec(),
            ),
            ("openstack/latest/user_data", b"#cloud-config\n".to_vec()),
        ]
        .into_iter()
        .map(|(path, content)| ConfigDriveFile {
            path: path.into(),
            content,
        })
        .collect()
    }

    /// A disk of `disk_mib` MiB holding `image` at its start.
    fn disk(dir: &std::path::Path, image: &[u8], disk_mib: u64) -> std::fs::File {
        let path = dir.join("disk");
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .unwrap();
        f.set_len(disk_mib * MIB).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(image, 0).unwrap();
        f
    }

    /// What `tool` (from util-linux or mtools, which the tests install) prints given `args`.
    fn stdout_of(tool: &str, args: &[&str]) -> Vec<u8> {
        let mut command = std::process::Command::new(tool);
        let ran = command.args(args).env("MTOOLS_SKIP_CHECK", "1").output();
        match ran {
            Ok(out) if out.status.success() => out.stdout,
            Ok(out) => panic!("{tool} {args:?}: {}", String::from_utf8_lossy(&out.stderr)),
            Err(e) => panic!("{tool}: {e}: run scripts/test-deps.sh"),
        }
    }

    /// What util-linux's sfdisk reads of the disk's partition table: its label and each
    /// partition's start, size (both in sectors) and type.
    fn sfdisk(dir: &std::path::Path) -> (String, Vec<(u64, u64, String)>) {
        let disk = dir.join("disk");
        let out = stdout_of("sfdisk", &["--json", disk.to_str().unwrap()]);
        let table: serde_json::Value = serde_json::from_slice(&out).unwrap();
        let table = &table["partitiontable"];
        let parts = table["partitions"].as_array().unwrap().iter();
        let parts = parts.map(|p| {
            let n = |k: &str| p[k].as_u64().unwrap();
            let kind = p["type"].as_str().unwrap().to_string();
            (n("start"), n("size"), kind)
        });
        let label = table["label"].as_str().unwrap().to_string();
        (label, parts.collect())
    }

    /// A file of the config drive as mtools (not the crate that wrote it) reads it, and the
    /// volume's label.
    fn mtools(dir: &std::path::Path, drive: &Drive, path: &str) -> (Vec<u8>, String) {
        let image = format!("{}@@{}", dir.join("disk").display(), drive.start);
        let content = stdout_of("mtype", &["-i", &image, &format!("::{path}")]);
        let label = stdout_of("mlabel", &["-s", "-i", &image, "::"]);
        (content, String::from_utf8(label).unwrap())
    }

    #[test]
    fn a_config_drive_is_added_at_the_end_of_an_mbr_disk() {
        let dir = tempfile::tempdir().unwrap();
        // An image of 8 MiB with one FAT partition from 1 MiB, as the test OS image has.
        let mut image = vec![0u8; 8 * MIB as usize];
        image[446] = 0x80;
        image[446 + 4] = 0x0c;
        image[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        image[446 + 12..446 + 16].copy_from_slice(&14336u32.to_le_bytes());
        image[510..512].copy_from_slice(&[0x55, 0xaa]);
        image[0..4].copy_from_slice(b"BOOT");
        let f = disk(dir.path(), &image, 100);
        let drive = write(&f, 100 * MIB, &files()).unwrap();
        assert_eq!(
            drive.to_string(),
            "a config drive (FAT, label config-2, 64 MiB) as partition 2 of its MBR"
        );
        let (label, parts) = sfdisk(dir.path());
        assert_eq!(label, "dos");
        assert_eq!(
            parts,
            [
                (2048, 14336, "c".into()),
                (36 * 2048, 64 * 2048, "c".into())
            ],
            "the image's partition, then the drive in the disk's last 64 MiB"
        );
        let (content, label) = mtools(dir.path(), &drive, "openstack/latest/meta_data.json");
        assert_eq!(content, br#"{"uuid":"m"}"#);
        assert!(label.contains("CONFIG-2"), "{label}");
        assert_eq!(
            read_back(&f, &drive, "openstack/latest/user_data"),
            b"#cloud-config\n"
        );
        let mut boot = [0u8; 4];
        use std::os::unix::fs::FileExt;
        f.read_exact_at(&mut boot, 0).unwrap();
        assert_eq!(&boot, b"BOOT", "the boot code is kept");
    }

    #[test]
    fn a_gpt_gets_its_backup_at_the_disks_end_and_the_drive_before_it() {
        let dir = tempfile::tempdir().unwrap();
        // An image of 16 MiB with a GPT (its backup at the image's end) and one partition.
        let mut cursor = std::io::Cursor::new(vec![0u8; 16 * MIB as usize]);
        let mut gpt = gptman::GPT::new_from(&mut cursor, 512, [7; 16]).unwrap();
        gpt[1] = gptman::GPTPartitionEntry {
            partition_type_guid: LINUX_DATA,
            unique_partition_guid: [9; 16],
            starting_lba: 2048,
            ending_lba: 2048 + 8192 - 1,
            attribute_bits: 0,
            partition_name: "root".into(),
        };
        gpt.write_into(&mut cursor).unwrap();
        gptman::GPT::write_protective_mbr_into(&mut cursor, 512).unwrap();
        let f = disk(dir.path(), cursor.get_ref(), 100);
        let drive = write(&f, 100 * MIB, &files()).unwrap();
        assert_eq!((drive.table, drive.partition), ("GPT", 2));
        let (label, parts) = sfdisk(dir.path());
        assert_eq!(label, "gpt");
        let last_usable = 100 * 2048 - 34;
        let start = (last_usable + 1 - 64 * 2048) / 2048 * 2048;
        assert_eq!(
            parts,
            [
                (2048, 8192, "0FC63DAF-8483-4772-8E79-3D69D8477DE4".into()),
                (
                    start,
                    64 * 2048,
                    "0FC63DAF-8483-4772-8E79-3D69D8477DE4".into()
                ),
            ]
        );
        let mut last = [0u8; 8];
        use std::os::unix::fs::FileExt;
        f.read_exact_at(&mut last, 100 * MIB - 512).unwrap();
        assert_eq!(&last, b"EFI PART", "the backup header is at the disk's end");
        let (content, _) = mtools(dir.path(), &drive, "openstack/latest/network_data.json");
        assert_eq!(content, br#"{"links":[]}"#);
    }

    #[test]
    fn no_table_no_room_or_a_bad_path_is_a_clear_refusal() {
        let dir = tempfile::tempdir().unwrap();
        let f = disk(dir.path(), &[1u8; 4096], 100);
        let err = write(&f, 100 * MIB, &files()).unwrap_err().to_string();
        assert!(
            err.contains("no partition table") && err.contains("ConfigDrive"),
            "{err}"
        );
        // An MBR partition that fills the disk.
        let mut image = vec![0u8; 512];
        image[446 + 4] = 0x83;
        image[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        image[446 + 12..446 + 16].copy_from_slice(&(100 * 2048 - 2048u32).to_le_bytes());
        image[510..512].copy_from_slice(&[0x55, 0xaa]);
        let f = disk(dir.path(), &image, 100);
        let err = write(&f, 100 * MIB, &files()).unwrap_err().to_string();
        assert!(err.contains("no room for the 64 MiB config drive"), "{err}");
        let bad = [ConfigDriveFile {
            path: "openstack/../../etc/passwd".into(),
            content: vec![],
        }];
        assert!(matches!(
            write(&f, 100 * MIB, &bad),
            Err(DriveError::BadPath(_))
        ));
    }
}
