//! OS installation: stream an image to a block device, verifying its sha256, then reboot.

use futures::StreamExt;
use sha2::{Digest, Sha256};
use shepherd_proto::bmaas::ImageInstallationRequest;
use tokio::io::AsyncWriteExt;

/// Why an installation failed; its message is the report's error the server records. The
/// device may hold a partial image after any of them.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The request's checksum is not a sha256.
    #[error("sha256 {0:?} is not 64 hex digits")]
    BadChecksum(String),
    /// The request names no device to write.
    #[error("no target device")]
    NoTargetDevice,
    /// The request asks for an installation this agent cannot do.
    #[error("{0}")]
    Unsupported(&'static str),
    /// The image could not be fetched or its download broke off.
    #[error("{doing} {url}: {error}")]
    Download {
        /// `fetching` or `downloading`.
        doing: &'static str,
        /// The image's URL.
        url: String,
        /// What the HTTP client said.
        error: reqwest::Error,
    },
    /// The device could not be opened, written or flushed.
    #[error("{doing} {device}: {error}")]
    Device {
        /// `reading`, `opening`, `writing` or `flushing`.
        doing: &'static str,
        /// The target device.
        device: String,
        /// What the system said.
        error: std::io::Error,
    },
    /// The bytes written do not have the requested checksum.
    #[error("image checksum mismatch: got sha256 {got} over {written} bytes, want {want}")]
    Mismatch {
        /// The checksum of what was written.
        got: String,
        /// How many bytes were written.
        written: u64,
        /// The requested checksum.
        want: String,
    },
    /// The device holds something (a partition table, a file system, data) and the request
    /// does not allow overwriting it. Nothing was written.
    #[error("{device} holds {holds}; it is overwritten only if the installation allows a wipe (the inventory entry's Bare.Wipe, or an operator's reimage --wipe)")]
    NotBlank {
        /// The target device.
        device: String,
        /// What it holds.
        holds: String,
    },
    /// The image is larger than the device. Nothing was written.
    #[error("the image is {image} bytes and {device} only {size}")]
    TooSmall {
        /// The target device.
        device: String,
        /// Its size.
        size: u64,
        /// The image's size, as its server announced it.
        image: u64,
    },
    /// The installation's thread or runtime could not run it to the end.
    #[error("the installation could not run: {0}")]
    NotRun(String),
}

/// Starts [`install`] on a thread of its own, with a runtime of its own, at the lowest CPU
/// priority; the outcome arrives on the returned channel. A machine being installed may have
/// one slow CPU (a small VM, an emulated guest): downloading, hashing and writing an image
/// would then keep the agent's heartbeats from running for longer than the recoverer waits
/// before it power-cycles a silent machine, mid-write. At the lowest priority the installation
/// takes only the CPU the heartbeats leave.
pub fn spawn(
    image: ImageInstallationRequest,
) -> tokio::sync::oneshot::Receiver<Result<(), InstallError>> {
    let (done, outcome) = tokio::sync::oneshot::channel();
    let started = std::thread::Builder::new()
        .name("install".into())
        .spawn(move || {
            lowest_cpu_priority();
            let result = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(install(&image)),
                Err(e) => Err(InstallError::NotRun(format!("starting its runtime: {e}"))),
            };
            let _ = done.send(result);
        });
    if let Err(e) = started {
        // The sender went with the closure: the receiver reports the failure as a closed channel.
        eprintln!("shepherd-agent: starting the installation thread: {e}");
    }
    outcome
}

/// Lowers the calling thread's CPU priority as far as it goes (nice 19); on Linux the nice
/// value is per thread. Failing to is harmless: the installation then competes as equals.
fn lowest_cpu_priority() {
    // SAFETY: setpriority only reads its arguments; `0` names the calling thread.
    let r = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, 19) };
    if r != 0 {
        eprintln!(
            "shepherd-agent: lowering the installation's CPU priority: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Downloads `image.url` into `image.target_device`, checking the sha256 over exactly the
/// bytes written. An error means the device may hold a partial image; it is never reported as
/// success.
pub async fn install(image: &ImageInstallationRequest) -> Result<(), InstallError> {
    let want = image.sha256.trim().to_ascii_lowercase();
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(InstallError::BadChecksum(image.sha256.clone()));
    }
    if image.target_device.is_empty() {
        return Err(InstallError::NoTargetDevice);
    }
    let download = |doing| {
        move |error| InstallError::Download {
            doing,
            url: image.url.clone(),
            error,
        }
    };
    let device_error = |doing| {
        move |error| InstallError::Device {
            doing,
            device: image.target_device.clone(),
            error,
        }
    };
    let size = device_size(&image.target_device).map_err(device_error("reading"))?;
    if !image.wipe_allowed {
        let holds = tokio::task::spawn_blocking({
            let device = image.target_device.clone();
            move || what_it_holds(std::path::Path::new(&device))
        })
        .await
        .map_err(|e| InstallError::NotRun(format!("checking the device: {e}")))?
        .map_err(device_error("reading"))?;
        if let Some(holds) = holds {
            return Err(InstallError::NotBlank {
                device: image.target_device.clone(),
                holds,
            });
        }
    }
    let response = reqwest::get(&image.url)
        .await
        .and_then(|r| r.error_for_status())
        .map_err(download("fetching"))?;
    if let (Some(size), Some(len)) = (size, response.content_length()) {
        if len > size {
            return Err(InstallError::TooSmall {
                device: image.target_device.clone(),
                size,
                image: len,
            });
        }
    }
    let mut device = tokio::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .create(true)
        .open(&image.target_device)
        .await
        .map_err(device_error("opening"))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(download("downloading"))?;
        hasher.update(&chunk);
        device
            .write_all(&chunk)
            .await
            .map_err(device_error("writing"))?;
        written += chunk.len() as u64;
    }
    device.sync_all().await.map_err(device_error("flushing"))?;
    let got: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if got != want {
        return Err(InstallError::Mismatch { got, written, want });
    }
    Ok(())
}

/// How far a device's ends are read to tell whether it is blank.
const CHECKED_BYTES: u64 = 1 << 20;

/// The size of `device` if it is a block device (a regular file, as tests use, grows as it is
/// written); `None` otherwise, or if it does not exist yet.
fn device_size(device: &str) -> std::io::Result<Option<u64>> {
    use std::io::Seek;
    use std::os::unix::fs::FileTypeExt;
    match std::fs::metadata(device) {
        Ok(m) if m.file_type().is_block_device() => {
            let mut f = std::fs::File::open(device)?;
            Ok(Some(f.seek(std::io::SeekFrom::End(0))?))
        }
        Ok(_) => Ok(None),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// What `device` holds, or `None` if it is blank: its first and last MiB all zeros (or it does
/// not exist yet). Recognises partition tables and the common file systems by their
/// signatures, to say what would be overwritten; anything else that is not zeros is "data".
pub fn what_it_holds(device: &std::path::Path) -> std::io::Result<Option<String>> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = match std::fs::File::open(device) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
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

/// Runs the reboot action (a shell command, so tests can observe instead of rebooting).
pub async fn reboot(command: &str) {
    match tokio::process::Command::new("sh")
        .arg("-c")
        .arg(command)
        .status()
        .await
    {
        Ok(s) if s.success() => {}
        Ok(s) => eprintln!("shepherd-agent: reboot command {command:?} exited with {s}"),
        Err(e) => eprintln!("shepherd-agent: running reboot command {command:?}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

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
        assert_eq!(
            what_it_holds(&dir.path().join("absent")).unwrap(),
            None,
            "a target that does not exist yet is blank"
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

    /// Serves `body` over plain HTTP on loopback to any number of requests; counts them.
    fn serve(body: Vec<u8>) -> (String, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/image.raw", listener.local_addr().unwrap());
        let served = Arc::new(AtomicUsize::new(0));
        let count = served.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                count.fetch_add(1, Ordering::SeqCst);
                let mut request = [0u8; 4096];
                let _ = conn.read(&mut request);
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(head.as_bytes());
                let _ = conn.write_all(&body);
            }
        });
        (url, served)
    }

    fn sha256_hex(bytes: &[u8]) -> String {
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[tokio::test]
    async fn a_disk_that_holds_a_partition_table_is_written_only_with_permission() {
        let dir = tempfile::tempdir().unwrap();
        let image = vec![7u8; 64 << 10];
        let (url, served) = serve(image.clone());
        let target = disk(dir.path(), "disk", 510, &[0x55, 0xaa]);
        let before = std::fs::read(&target).unwrap();
        let mut request = ImageInstallationRequest {
            url,
            sha256: sha256_hex(&image),
            target_device: target.display().to_string(),
            ..Default::default()
        };
        let err = install(&request).await.unwrap_err().to_string();
        assert!(
            err.contains("holds an MBR partition table") && err.contains("wipe"),
            "{err}"
        );
        assert_eq!(std::fs::read(&target).unwrap(), before, "untouched");
        assert_eq!(
            served.load(Ordering::SeqCst),
            0,
            "the image was not even fetched"
        );

        request.wipe_allowed = true;
        install(&request).await.unwrap();
        assert_eq!(std::fs::read(&target).unwrap(), image);
    }
}
