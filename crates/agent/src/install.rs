//! OS installation (design.md §13, §21): find the one whole disk the request names, stream
//! the image onto it (decompressing raw images compressed with gzip, xz or zstd, unpacking
//! qcow2 ones cluster by cluster), verify the
//! sha256 and length of what was served and every write, then report (and reboot).

use bytes::Bytes;
use sha2::{Digest, Sha256};
use shepherd_disks::format::SNIFFED_BYTES;
use shepherd_disks::{
    url_shown, DiskChoice, DiskFacts, FormatError, HintError, ImageFormat, NoDisk, RootDeviceHints,
    Sniffed,
};
use shepherd_proto::bmaas::{ConfigDriveFile, ImageInstallationRequest};

use crate::blank;
use crate::config_drive::{self, Drive, DriveError};
use crate::disks::{self, DiskRoots};
use crate::download::{Download, DownloadError};
use crate::image_writer::{ImageWriter, Unpack, WriteFailure};
use crate::nic_macs::{self, NicError};
use crate::qcow2::{self, Qcow2Error};
use crate::wipe::{self, Wiped};

/// Why an installation failed; its message is the report's error the server records. Only
/// the errors after the disk was opened (a download that broke off, a write, a checksum) may
/// leave a partial image on it; before that, nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    /// The request's checksum is not a sha256.
    #[error("sha256 {0:?} is not 64 hex digits")]
    BadChecksum(String),
    /// The request names no device to write.
    #[error("no target device")]
    NoTargetDevice,
    /// The request's disk (path or hints) cannot be used. Nothing was written.
    #[error("the installation's disk: {0}")]
    BadDisk(HintError),
    /// No whole disk, or more than one, is the one the request names. Nothing was written.
    #[error("{0}; nothing was written")]
    NoDisk(NoDisk),
    /// The request's format is not one the agent writes. Nothing was written.
    #[error("the installation's format: {0}")]
    BadFormat(FormatError),
    /// The image is of a format the agent does not write. Nothing was written.
    #[error("the image is {0}, which the agent does not write: serve it raw, raw compressed with gzip, xz or zstd, or qcow2; nothing was written")]
    UnwritableFormat(&'static str),
    /// The image is not of the format the request names. Nothing was written.
    #[error("the image is {found}, and the installation says {named}; nothing was written")]
    FormatMismatch {
        /// The request's format.
        named: ImageFormat,
        /// What the image's magic bytes say.
        found: ImageFormat,
    },
    /// The qcow2 image cannot be written as it is. Nothing was written.
    #[error("the qcow2 image {url}: {error}; nothing was written")]
    Qcow2 {
        /// The image's URL.
        url: String,
        /// Why not.
        error: Qcow2Error,
    },
    /// The installed OS's network cannot be tied to a NIC. Nothing was written.
    #[error("{0}; nothing was written")]
    Network(NicError),
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
        /// What went wrong.
        error: DownloadError,
        /// Whether part of the image was written onto the disk before.
        disk_written: bool,
    },
    /// The image's server sent fewer or more bytes than it announced.
    #[error("{url} announced {announced} bytes and served {served}")]
    ShortBody {
        /// The image's URL.
        url: String,
        /// What was served.
        served: u64,
        /// Its `Content-Length`.
        announced: u64,
    },
    /// The disk could not be read or opened.
    #[error("{doing} {device}: {error}")]
    Device {
        /// `reading` or `opening`.
        doing: &'static str,
        /// The disk.
        device: String,
        /// What the system said.
        error: std::io::Error,
    },
    /// The kernel refused to open the disk exclusively: something holds it. Nothing was written.
    #[error("{device} is in use ({error}): mounted, or part of a RAID, LVM or multipath device; the agent writes only a disk nothing holds (if this should be the live environment, its CD boot fell through to an installed OS); nothing was written")]
    Busy {
        /// The disk.
        device: String,
        /// What the system said.
        error: std::io::Error,
    },
    /// Clearing the disk's signatures before the image failed; they may be partly cleared.
    #[error("clearing the signatures on {device} before the image: {error}")]
    Wipe {
        /// The disk.
        device: String,
        /// What the system said.
        error: std::io::Error,
    },
    /// The image was written, and its config drive could not be added to the disk.
    #[error(
        "the image was written onto {device}, and its config drive could not be added: {error}"
    )]
    ConfigDrive {
        /// The disk.
        device: String,
        /// Why not.
        error: DriveError,
    },
    /// Writing the image onto the disk failed.
    #[error("writing onto {device}: {failure}")]
    Write {
        /// The disk.
        device: String,
        /// What went wrong.
        failure: WriteFailure,
    },
    /// The bytes served do not have the requested checksum.
    #[error(
        "image checksum mismatch: got sha256 {got} over the {served} bytes served, want {want}"
    )]
    Mismatch {
        /// The checksum of what was served.
        got: String,
        /// How many bytes were served.
        served: u64,
        /// The requested checksum.
        want: String,
    },
    /// The disk holds something (a partition table, a file system, data) and the request
    /// does not allow overwriting it. Nothing was written.
    #[error("{device} holds {holds}; it is overwritten only if the installation allows a wipe (the inventory entry's Bare.Wipe, or an operator's reimage --wipe)")]
    NotBlank {
        /// The target device.
        device: String,
        /// What it holds.
        holds: String,
    },
    /// The image is larger than the disk. Nothing was written.
    #[error("the image is {image} bytes and {device} only {size}; nothing was written")]
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

impl InstallError {
    /// Whether the image's server failed, not the machine nor the request: unreachable, a
    /// timeout, a 5xx, 408 or 429 answer, a body that broke off for good or came short. Such
    /// an installation may be asked again.
    pub fn is_unavailable(&self) -> bool {
        match self {
            InstallError::Download { error, .. } => match error {
                DownloadError::Http(e) => e.status().is_none_or(|status| {
                    status.is_server_error() || matches!(status.as_u16(), 408 | 429)
                }),
                DownloadError::NotResumable { .. } | DownloadError::GaveUp { .. } => true,
                DownloadError::NoRange { .. } => false,
            },
            InstallError::ShortBody { .. } => true,
            _ => false,
        }
    }

    /// Whether part of an image was written onto the disk before the installation failed.
    pub fn disk_written(&self) -> bool {
        match self {
            InstallError::Download { disk_written, .. } => *disk_written,
            InstallError::ShortBody { .. }
            | InstallError::Wipe { .. }
            | InstallError::ConfigDrive { .. }
            | InstallError::Write { .. }
            | InstallError::Mismatch { .. } => true,
            _ => false,
        }
    }
}

/// Starts [`install`] on a thread of its own, with a runtime of its own, at the lowest CPU
/// priority; the outcome arrives on the returned channel. A machine being installed may have
/// one slow CPU (a small VM, an emulated guest): downloading, hashing and writing an image
/// would then keep the agent's heartbeats from running for longer than the recoverer waits
/// before it power-cycles a silent machine, mid-write. At the lowest priority the installation
/// takes only the CPU the heartbeats leave.
pub fn spawn(image: ImageInstallationRequest) -> tokio::sync::oneshot::Receiver<Attempt> {
    let (done, outcome) = tokio::sync::oneshot::channel();
    let started = std::thread::Builder::new()
        .name("install".into())
        .spawn(move || {
            lowest_cpu_priority();
            let attempt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt.block_on(install(&image, &DiskRoots::from_env())),
                Err(e) => {
                    Attempt::failed(InstallError::NotRun(format!("starting its runtime: {e}")))
                }
            };
            if let Ok(installed) = &attempt.outcome {
                eprintln!(
                    "shepherd-agent: wrote {} bytes ({}) onto {}",
                    installed.written, installed.format, installed.disk
                );
            }
            let _ = done.send(attempt);
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

/// What an installation wrote.
#[derive(Debug, Clone)]
pub struct Installed {
    /// The disk, with the facts it was chosen by.
    pub disk: DiskFacts,
    /// The image's format.
    pub format: ImageFormat,
    /// The bytes written onto the disk (after decompression).
    pub written: u64,
    /// What the agent did to the disk around the image.
    pub around: AroundImage,
}

/// What an installation did to the disk around the image.
#[derive(Debug, Clone, Default)]
pub struct AroundImage {
    /// What the wipe before the image cleared, if the installation allowed one.
    pub wiped: Option<Wiped>,
    /// The config drive added after the image, if the request carried one.
    pub config_drive: Option<Drive>,
}

/// The disk `image` names: its root device hints, or else its target device.
fn disk_choice(image: &ImageInstallationRequest) -> Result<DiskChoice, InstallError> {
    if !image.root_device_hints.is_empty() {
        return RootDeviceHints::from_json(&image.root_device_hints)
            .map(DiskChoice::Hints)
            .map_err(InstallError::BadDisk);
    }
    if image.target_device.is_empty() {
        return Err(InstallError::NoTargetDevice);
    }
    DiskChoice::path(&image.target_device).map_err(InstallError::BadDisk)
}

/// The image's first chunks, enough to tell its format, and the format they show; `url` is the
/// image's URL as shown, for errors.
async fn sniff(download: &mut Download, url: &str) -> Result<(Vec<Bytes>, Sniffed), InstallError> {
    let mut head = Vec::new();
    let mut bytes = Vec::with_capacity(SNIFFED_BYTES);
    while bytes.len() < SNIFFED_BYTES {
        let Some(chunk) = download.next().await else {
            break;
        };
        let chunk = chunk.map_err(|error| InstallError::Download {
            doing: "downloading",
            url: url.to_string(),
            error,
            disk_written: false,
        })?;
        let wanted = SNIFFED_BYTES - bytes.len();
        bytes.extend_from_slice(&chunk[..wanted.min(chunk.len())]);
        head.push(chunk);
    }
    Ok((head, ImageFormat::sniff(&bytes)))
}

/// Writes `image.url` onto the one whole disk the request names (design.md §21), checking
/// the sha256 and the length of the image as served and every write onto the disk. Nothing is
/// written unless the disk was found, is blank or may be wiped, nobody holds it open (it is
/// opened exclusively: a mounted disk is refused by the kernel), and the image is in a format
/// the agent writes (and the one the request names). Once writing started, an error means the
/// disk may hold a partial image; it is never reported as success.
pub async fn install(image: &ImageInstallationRequest, roots: &DiskRoots) -> Attempt {
    let mut chosen = None;
    let outcome = write_image(image, roots, &mut chosen).await;
    Attempt { chosen, outcome }
}

/// One installation as it went: the disk the agent chose, if it got so far, and how it ended.
/// The report names the chosen disk by its identity either way, so that Shepherd's next
/// request after a failure (an image server that was down) names that very disk.
#[derive(Debug)]
pub struct Attempt {
    /// The disk chosen.
    pub chosen: Option<DiskFacts>,
    /// What was written, or why not.
    pub outcome: Result<Installed, InstallError>,
}

impl Attempt {
    /// An installation that failed before it chose a disk.
    pub fn failed(error: InstallError) -> Attempt {
        Attempt {
            chosen: None,
            outcome: Err(error),
        }
    }
}

/// [`install`], noting the disk in `chosen` once it is chosen.
async fn write_image(
    image: &ImageInstallationRequest,
    roots: &DiskRoots,
    chosen: &mut Option<DiskFacts>,
) -> Result<Installed, InstallError> {
    let (want, named) = (wanted_sha256(image)?, named_format(image)?);
    let choice = disk_choice(image)?;
    let drive_files = with_nic_macs(&image.config_drive)?;
    let disks = disks::whole_disks(roots);
    let disk = shepherd_disks::choose(&choice, &disks)
        .map_err(InstallError::NoDisk)?
        .clone();
    *chosen = Some(disk.clone());
    let node = roots.node(&disk);
    let device = disk.name.clone();
    let device_error = |doing| {
        let device = device.clone();
        move |error| InstallError::Device {
            doing,
            device,
            error,
        }
    };
    if !image.wipe_allowed {
        let holds = tokio::task::spawn_blocking({
            let node = node.clone();
            move || blank::what_it_holds(&node)
        })
        .await
        .map_err(|e| InstallError::NotRun(format!("checking the disk: {e}")))?
        .map_err(device_error("reading"))?;
        if let Some(holds) = holds {
            return Err(InstallError::NotBlank {
                device: device.clone(),
                holds,
            });
        }
    }
    let fetched = fetch(image, named, &disk).await?;
    let file = open_exclusively(&node, &device)?;
    let (file, wiped) = match image.wipe_allowed {
        true => clear(file, roots, &disk).await.map(|(f, w)| (f, Some(w)))?,
        false => (file, None),
    };
    eprintln!(
        "shepherd-agent: writing {} ({}) onto {disk}, which is {choice}",
        url_shown(&image.url),
        fetched.unpack.format()
    );
    let (format, written) = fetched.write_onto(image, file, &disk, &want).await?;
    let config_drive = match image.config_drive.is_empty() {
        true => None,
        false => Some(add_config_drive(&node, &disk, &drive_files).await?),
    };
    Ok(Installed {
        disk,
        format,
        written,
        around: AroundImage {
            wiped,
            config_drive,
        },
    })
}

/// The installed OS's config drive `files`, its `network_data.json` completed with the MAC of
/// the live environment's NIC that holds each static address whose link names none.
fn with_nic_macs(files: &[ConfigDriveFile]) -> Result<Vec<ConfigDriveFile>, InstallError> {
    let mut files = files.to_vec();
    let network = files
        .iter_mut()
        .find(|f| f.path.ends_with("openstack/latest/network_data.json"));
    if let Some(network) = network {
        let nics = nic_macs::live_nics(std::path::Path::new("/sys/class/net"));
        let completed = nic_macs::complete(&network.content, &nics);
        if let Some(completed) = completed.map_err(InstallError::Network)? {
            network.content = completed;
        }
    }
    Ok(files)
}

/// The request's sha256, checked to be one.
fn wanted_sha256(image: &ImageInstallationRequest) -> Result<String, InstallError> {
    let want = image.sha256.trim().to_ascii_lowercase();
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(InstallError::BadChecksum(image.sha256.clone()));
    }
    Ok(want)
}

/// The format the request names, if it names one.
fn named_format(image: &ImageInstallationRequest) -> Result<Option<ImageFormat>, InstallError> {
    match image.format.trim() {
        "" => Ok(None),
        name => Ok(Some(
            ImageFormat::parse(name).map_err(InstallError::BadFormat)?,
        )),
    }
}

/// An image whose download has begun, its format told (and, for qcow2, its tables read),
/// known to fit its disk: ready to be written once the disk is opened. Nothing is written yet.
struct Fetched {
    body: Download,
    /// The chunks read to tell its format.
    head: Vec<Bytes>,
    unpack: Unpack,
    announced: Option<u64>,
}

/// Begins downloading `image.url` for `disk`, and tells its format (which must be `named`, if
/// given).
async fn fetch(
    image: &ImageInstallationRequest,
    named: Option<ImageFormat>,
    disk: &DiskFacts,
) -> Result<Fetched, InstallError> {
    let shown = url_shown(&image.url);
    let mut body = Download::start(&image.url)
        .await
        .map_err(|error| InstallError::Download {
            doing: "fetching",
            url: shown.clone(),
            error,
            disk_written: false,
        })?;
    let announced = body.announced();
    let (head, sniffed) = sniff(&mut body, &shown).await?;
    let format = match (sniffed, named) {
        (Sniffed::Unwritable(what), _) => return Err(InstallError::UnwritableFormat(what)),
        (Sniffed::Writable(found), Some(named)) if found != named => {
            return Err(InstallError::FormatMismatch { named, found })
        }
        (Sniffed::Writable(found), _) => found,
    };
    if let (ImageFormat::Raw, Some(len)) = (format, announced) {
        if len > disk.size_bytes {
            return Err(InstallError::TooSmall {
                device: disk.name.clone(),
                size: disk.size_bytes,
                image: len,
            });
        }
    }
    let unpack = match format {
        ImageFormat::Qcow2 => Unpack::Qcow2(Box::new(qcow2_layout(&body, &shown, disk).await?)),
        other => Unpack::Stream(other),
    };
    Ok(Fetched {
        body,
        head,
        unpack,
        announced,
    })
}

impl Fetched {
    /// Writes the image onto `file`, the disk `disk`, and checks that what was served has the
    /// sha256 `want` and its announced length: its format and the bytes written.
    async fn write_onto(
        self,
        image: &ImageInstallationRequest,
        file: std::fs::File,
        disk: &DiskFacts,
        want: &str,
    ) -> Result<(ImageFormat, u64), InstallError> {
        let format = self.unpack.format();
        let streamed = stream(
            image,
            self.head,
            self.body,
            file,
            self.unpack,
            disk,
            self.announced,
        );
        let written = streamed.await?.check(want, format, &disk.name)?;
        Ok((format, written))
    }
}

/// Writes the image at `url` (its sha256 `sha256`, of `format` if named) onto `target`, a file
/// or a block device an operator names, as an installation writes its disk: opened
/// exclusively, its format told by its magic bytes, the sha256 and the length as served
/// checked, and every write. Nothing chooses the target, checks that it is blank, wipes it or
/// adds a config drive: the operator who names it decides, as with `dd`. A file or device
/// is written up to its size (a file of size 0, without bound). Its format and the bytes
/// written. The agent's `write-image` mode, for a rescue shell and for the benchmark that
/// compares the agent's writing with `curl | dd`.
pub async fn write_image_onto(
    url: &str,
    sha256: &str,
    format: &str,
    target: &std::path::Path,
) -> Result<(ImageFormat, u64), InstallError> {
    use std::io::{Seek, SeekFrom};
    let image = ImageInstallationRequest {
        url: url.to_string(),
        sha256: sha256.to_string(),
        format: format.to_string(),
        ..Default::default()
    };
    let (want, named) = (wanted_sha256(&image)?, named_format(&image)?);
    let name = target.display().to_string();
    let mut file = open_exclusively(target, &name)?;
    let size = file.seek(SeekFrom::End(0)).and_then(|size| {
        file.seek(SeekFrom::Start(0))?;
        Ok(size)
    });
    let size = size.map_err(|error| InstallError::Device {
        doing: "reading the size of",
        device: name.clone(),
        error,
    })?;
    let disk = DiskFacts {
        name,
        size_bytes: if size == 0 { u64::MAX } else { size },
        ..DiskFacts::default()
    };
    let fetched = fetch(&image, named, &disk).await?;
    fetched.write_onto(&image, file, &disk, &want).await
}

/// Reads the qcow2 image's header and tables with range requests beside its download, and
/// maps it; refuses it if it does not fit `disk` or cannot be written faithfully (`url` is
/// the image's URL as shown, for errors).
async fn qcow2_layout(
    body: &Download,
    url: &str,
    disk: &DiskFacts,
) -> Result<qcow2::Layout, InstallError> {
    let refused = |error| InstallError::Qcow2 {
        url: url.to_string(),
        error,
    };
    let fetched = |error| InstallError::Download {
        doing: "reading the qcow2 tables of",
        url: url.to_string(),
        error,
        disk_written: false,
    };
    let head = body.range(0, qcow2::HEADER_BYTES).await.map_err(fetched)?;
    let header = qcow2::Header::parse(&head).map_err(refused)?;
    if header.virtual_size() > disk.size_bytes {
        return Err(InstallError::TooSmall {
            device: disk.name.clone(),
            size: disk.size_bytes,
            image: header.virtual_size(),
        });
    }
    let (at, len) = header.l1_table();
    let l1 = body.range(at, len).await.map_err(fetched)?;
    let mut tables = Vec::new();
    for (index, at) in header.l2_tables(&l1).map_err(refused)? {
        let table = body.range(at, header.cluster_size()).await;
        tables.push((index, table.map_err(fetched)?));
    }
    qcow2::Layout::build(&header, &tables).map_err(refused)
}

/// Adds the installed OS's config drive holding `files` to `disk` (its node `node`), which
/// now holds the image, off the runtime's thread.
async fn add_config_drive(
    node: &std::path::Path,
    disk: &DiskFacts,
    files: &[ConfigDriveFile],
) -> Result<Drive, InstallError> {
    let file = open_exclusively(node, &disk.name)?;
    let (size, files) = (disk.size_bytes, files.to_vec());
    let written = tokio::task::spawn_blocking(move || config_drive::write(&file, size, &files))
        .await
        .map_err(|e| InstallError::NotRun(format!("writing the config drive: {e}")))?;
    let drive = written.map_err(|error| InstallError::ConfigDrive {
        device: disk.name.clone(),
        error,
    })?;
    eprintln!("shepherd-agent: added {drive} on {}", disk.name);
    Ok(drive)
}

/// Clears the signatures on `disk` (opened as `file`) and its partitions, off the runtime's
/// thread; gives the file back with what was cleared.
async fn clear(
    file: std::fs::File,
    roots: &DiskRoots,
    disk: &DiskFacts,
) -> Result<(std::fs::File, Wiped), InstallError> {
    let regions = disks::wipe_regions(roots, disk);
    let wiped = tokio::task::spawn_blocking(move || wipe::wipe(&file, &regions).map(|w| (file, w)))
        .await
        .map_err(|e| InstallError::NotRun(format!("wiping the disk: {e}")))?;
    let (file, wiped) = wiped.map_err(|error| InstallError::Wipe {
        device: disk.name.clone(),
        error,
    })?;
    eprintln!("shepherd-agent: cleared from {}: {wiped}", disk.name);
    Ok((file, wiped))
}

/// Opens `node` (the disk `device`) for writing, exclusively: the kernel refuses a block
/// device that is mounted or held by md, LVM or multipath. It is opened for reading too, for
/// a wipe to read what it clears.
fn open_exclusively(node: &std::path::Path, device: &str) -> Result<std::fs::File, InstallError> {
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_EXCL)
        .open(node);
    opened.map_err(|error| match error.raw_os_error() {
        Some(libc::EBUSY) => InstallError::Busy {
            device: device.to_string(),
            error,
        },
        _ => InstallError::Device {
            doing: "opening",
            device: device.to_string(),
            error,
        },
    })
}

/// What [`stream`] counted.
struct Streamed {
    /// Over the bytes served.
    hasher: Sha256,
    /// The bytes served.
    served: u64,
    /// The bytes written onto the disk.
    written: u64,
}

impl Streamed {
    /// The bytes written onto `device`, if what was served has the sha256 `want` and, for a
    /// raw image, all of it was written.
    fn check(self, want: &str, format: ImageFormat, device: &str) -> Result<u64, InstallError> {
        let got: String = self
            .hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if got != want {
            return Err(InstallError::Mismatch {
                got,
                served: self.served,
                want: want.to_string(),
            });
        }
        if format == ImageFormat::Raw && self.written != self.served {
            return Err(InstallError::Write {
                device: device.to_string(),
                failure: WriteFailure::Thread(format!(
                    "wrote {} of {} bytes",
                    self.written, self.served
                )),
            });
        }
        Ok(self.written)
    }
}

/// Streams the image (its first chunks `head`, then the rest of `body`) onto `file`, the disk
/// `disk`, hashing what is served; checks that the server served what it announced.
async fn stream(
    image: &ImageInstallationRequest,
    head: Vec<Bytes>,
    mut body: Download,
    file: std::fs::File,
    unpack: Unpack,
    disk: &DiskFacts,
    announced: Option<u64>,
) -> Result<Streamed, InstallError> {
    let write_error = |failure| InstallError::Write {
        device: disk.name.clone(),
        failure,
    };
    let writer = ImageWriter::start(file, unpack, disk.size_bytes).map_err(write_error)?;
    let mut hasher = Sha256::new();
    let mut served = 0u64;
    let mut broke_off = None;
    let mut head = head.into_iter();
    loop {
        let next = match head.next() {
            Some(chunk) => Some(Ok(chunk)),
            None => body.next().await,
        };
        let Some(chunk) = next else { break };
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(error) => {
                broke_off = Some(error);
                break;
            }
        };
        hasher.update(&chunk);
        served += chunk.len() as u64;
        if !writer.write(chunk).await {
            break;
        }
    }
    let written = writer.finish().await;
    if let Some(error) = broke_off {
        return Err(InstallError::Download {
            doing: "downloading",
            url: url_shown(&image.url),
            error,
            disk_written: true,
        });
    }
    let written = written.map_err(write_error)?;
    if let Some(len) = announced.filter(|len| *len != served) {
        return Err(InstallError::ShortBody {
            url: url_shown(&image.url),
            served,
            announced: len,
        });
    }
    Ok(Streamed {
        hasher,
        served,
        written,
    })
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
    use crate::disks::tests::{FakeDisk, FakeMachine};
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Serves `body` over plain HTTP on loopback to any number of requests; counts the
    /// requests. If `announce`, it announces the body's length and answers byte ranges
    /// (`bytes=a-b` or `bytes=a-`), as every static file server does.
    fn serve(body: Vec<u8>, announce: bool) -> (String, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/image", listener.local_addr().unwrap());
        let served = Arc::new(AtomicUsize::new(0));
        let count = served.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut conn) = conn else { return };
                count.fetch_add(1, Ordering::SeqCst);
                let range = crate::download::tests::read_range(&mut conn, body.len());
                let range = range.filter(|_| announce);
                let head = match range {
                    Some((from, to)) => format!(
                        "HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {from}-{}/{}\r\nContent-Length: {}\r\n",
                        to - 1,
                        body.len(),
                        to - from
                    ),
                    None if announce => format!(
                        "HTTP/1.1 200 OK\r\nAccept-Ranges: bytes\r\nContent-Length: {}\r\n",
                        body.len()
                    ),
                    None => "HTTP/1.1 200 OK\r\n".to_string(),
                };
                let (from, to) = range.unwrap_or((0, body.len()));
                let _ = conn.write_all(format!("{head}Connection: close\r\n\r\n").as_bytes());
                let _ = conn.write_all(&body[from..to]);
            }
        });
        (url, served)
    }

    /// Answers one request with `head` and the first `cut` bytes of `body`, then closes.
    fn serve_once(head: String, body: Vec<u8>, cut: usize) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/image", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            if let Ok((mut conn, _)) = listener.accept() {
                let mut request = [0u8; 4096];
                let _ = conn.read(&mut request);
                let _ = conn.write_all(head.as_bytes());
                let _ = conn.write_all(&body[..cut]);
            }
        });
        url
    }

    /// Whether the disk at `path` holds nothing but zeros.
    fn is_blank(path: &std::path::Path) -> bool {
        std::fs::read(path).unwrap().iter().all(|b| *b == 0)
    }

    /// Whether the disk at `path` begins with `image`.
    fn begins_with(path: &std::path::Path, image: &[u8]) -> bool {
        std::fs::read(path).unwrap().starts_with(image)
    }

    fn sha256_hex(bytes: &[u8]) -> String {
        Sha256::digest(bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// A machine with two blank virtio disks of 4 MiB, serials FIRST and SECOND.
    fn two_disks(dir: &std::path::Path) -> (FakeMachine, [std::path::PathBuf; 2]) {
        let m = FakeMachine::new(dir);
        let disks = [("vda", 5, "FIRST"), ("vdb", 6, "SECOND")].map(|(name, slot, serial)| {
            let place = format!("pci0000:00/0000:00:0{slot}.0/virtio{slot}");
            m.add(FakeDisk {
                name,
                place: &place,
                sectors: 8192,
                device: None,
                files: &[("serial", serial.as_bytes())],
            })
        });
        (m, disks)
    }

    fn request(url: &str, image: &[u8], device: &str, hints: &str) -> ImageInstallationRequest {
        ImageInstallationRequest {
            url: url.into(),
            sha256: sha256_hex(image),
            target_device: device.into(),
            root_device_hints: hints.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_disk_that_holds_a_partition_table_is_written_only_with_permission() {
        let dir = tempfile::tempdir().unwrap();
        let (m, [vda, _]) = two_disks(dir.path());
        let mut mbr = std::fs::read(&vda).unwrap();
        mbr[510..512].copy_from_slice(&[0x55, 0xaa]);
        std::fs::write(&vda, &mbr).unwrap();
        let image = vec![7u8; 64 << 10];
        let (url, served) = serve(image.clone(), true);
        let mut request = request(&url, &image, "/dev/vda", "");
        let err = install(&request, &m.roots)
            .await
            .outcome
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("holds an MBR partition table") && err.contains("wipe"),
            "{err}"
        );
        assert_eq!(std::fs::read(&vda).unwrap(), mbr, "untouched");
        assert_eq!(
            served.load(Ordering::SeqCst),
            0,
            "the image was not even fetched"
        );

        request.wipe_allowed = true;
        let installed = install(&request, &m.roots).await.outcome.unwrap();
        assert_eq!(installed.disk.name, "/dev/vda");
        assert!(begins_with(&vda, &image));
    }

    /// A wipe clears what lies past the image's end: here an md 1.0 superblock at the end of
    /// a partition and a GPT's backup header at the end of the disk, which an image of 64 KiB
    /// never reaches; and the report says so.
    #[tokio::test]
    async fn a_wipe_clears_the_signatures_the_image_does_not_cover() {
        let dir = tempfile::tempdir().unwrap();
        let (m, [vda, _]) = two_disks(dir.path());
        let partition = m.roots.sys.join("block/vda/vda1");
        std::fs::create_dir_all(&partition).unwrap();
        for (file, text) in [("partition", "1"), ("start", "2048"), ("size", "4096")] {
            std::fs::write(partition.join(file), text).unwrap();
        }
        let md_10 = (1 << 20) + ((4096 - 16) & !7) * 512;
        let backup_gpt = (4 << 20) - 512;
        let mut data = std::fs::read(&vda).unwrap();
        data[md_10..md_10 + 4].copy_from_slice(&[0xfc, 0x4e, 0x2b, 0xa9]);
        data[backup_gpt..backup_gpt + 8].copy_from_slice(b"EFI PART");
        std::fs::write(&vda, &data).unwrap();
        let image = vec![7u8; 64 << 10];
        let (url, _) = serve(image.clone(), true);
        let mut request = request(&url, &image, "/dev/vda", "");
        request.wipe_allowed = true;
        let installed = install(&request, &m.roots).await.outcome.unwrap();
        let data = std::fs::read(&vda).unwrap();
        assert!(data.starts_with(&image));
        assert!(data[image.len()..].iter().all(|b| *b == 0), "both are gone");
        assert_eq!(
            installed.around.wiped.unwrap().to_string(),
            "a Linux RAID member (md 1.0) on /dev/vda1; \
             a GPT partition table's backup header on /dev/vda"
        );
    }

    /// A request with a config drive gets it after the image, in the image's partition
    /// table; an image with no table fails, saying the image was written.
    #[tokio::test]
    async fn a_config_drive_follows_the_image_into_its_partition_table() {
        let dir = tempfile::tempdir().unwrap();
        let m = FakeMachine::new(dir.path());
        let vda = m.add(FakeDisk {
            name: "vda",
            place: "pci0000:00/0000:00:05.0/virtio5",
            sectors: 100 << 11,
            device: None,
            files: &[("serial", b"ONE")],
        });
        let mut image = vec![0u8; 1 << 20];
        image[446 + 4] = 0x83;
        image[446 + 8..446 + 12].copy_from_slice(&2048u32.to_le_bytes());
        image[446 + 12..446 + 16].copy_from_slice(&2048u32.to_le_bytes());
        image[510..512].copy_from_slice(&[0x55, 0xaa]);
        let (url, _) = serve(image.clone(), true);
        let mut request = request(&url, &image, "/dev/vda", "");
        let meta = br#"{"uuid":"m","public_keys":{"shepherd-0":"ssh-ed25519 AAAA"}}"#;
        request.config_drive = vec![ConfigDriveFile {
            path: "openstack/latest/meta_data.json".into(),
            content: meta.to_vec(),
        }];
        let installed = install(&request, &m.roots).await.outcome.unwrap();
        let drive = installed.around.config_drive.unwrap();
        assert_eq!((drive.table, drive.partition), ("MBR", 2));
        let disk = std::fs::File::open(&vda).unwrap();
        let read = config_drive::read_back(&disk, &drive, "openstack/latest/meta_data.json");
        assert_eq!(read, meta);

        let raw = vec![5u8; 64 << 10];
        let (url, _) = serve(raw.clone(), true);
        let mut again = self::request(&url, &raw, "/dev/vda", "");
        again.wipe_allowed = true;
        again.config_drive = request.config_drive.clone();
        let err = install(&again, &m.roots).await.outcome.unwrap_err();
        assert!(err.disk_written(), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("the image was written onto /dev/vda")
                && text.contains("no partition table"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn hints_choose_the_one_disk_they_match_and_the_others_are_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let (m, [vda, vdb]) = two_disks(dir.path());
        let image = vec![3u8; 100_000];
        let (url, _) = serve(image.clone(), true);
        let installed = install(
            &request(&url, &image, "", r#"{"serial": "second"}"#),
            &m.roots,
        )
        .await
        .outcome
        .unwrap();
        assert_eq!(installed.disk.name, "/dev/vdb");
        assert_eq!(installed.written, image.len() as u64);
        assert!(begins_with(&vdb, &image));
        assert!(is_blank(&vda), "the first disk is untouched");
    }

    #[tokio::test]
    async fn a_disk_that_is_not_there_or_not_one_writes_nothing_and_lists_the_disks_seen() {
        let dir = tempfile::tempdir().unwrap();
        let (m, disks) = two_disks(dir.path());
        let image = vec![3u8; 1000];
        let (url, served) = serve(image.clone(), true);
        for (device, hints, want) in [
            ("/dev/sdz", "", "no whole disk is /dev/sdz"),
            ("/dev/vda1", "", "no whole disk is /dev/vda1"),
            ("", r#"{"serial": "third"}"#, "no whole disk is the hints"),
            ("", r#"{"size": "<= 1"}"#, "2 whole disks match the hints"),
        ] {
            let err = install(&request(&url, &image, device, hints), &m.roots)
                .await
                .outcome
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(want)
                    && err.contains("/dev/vda (0.0 GiB, serial FIRST)")
                    && err.contains("/dev/vdb (0.0 GiB, serial SECOND)")
                    && err.ends_with("nothing was written"),
                "{device}{hints}: {err}"
            );
        }
        assert_eq!(served.load(Ordering::SeqCst), 0, "no image was fetched");
        for disk in disks {
            assert!(is_blank(&disk));
            assert_eq!(std::fs::metadata(&disk).unwrap().len(), 4 << 20);
        }
        assert!(
            !m.roots.dev.join("sdz").exists(),
            "nothing was created in /dev"
        );
    }

    #[tokio::test]
    async fn an_image_of_another_format_than_named_or_one_not_written_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (m, [vda, _]) = two_disks(dir.path());
        let mut vmdk = b"KDMV\x01\x00\x00\x00".to_vec();
        vmdk.resize(4096, 0);
        let mut bad_qcow2 = b"QFI\xfb\x00\x00\x00\x03".to_vec();
        bad_qcow2.resize(4096, 0);
        let qcow2 = qemu_img_qcow2(&[3u8; 65_536]);
        let raw = vec![5u8; 4096];
        for (image, format, ranges, want) in [
            (
                &vmdk,
                "",
                true,
                "the image is VMDK, which the agent does not write",
            ),
            (&bad_qcow2, "", true, "its clusters are 2^0 bytes"),
            (
                &qcow2,
                "",
                false,
                "its server answered 200 OK (it takes no byte ranges",
            ),
            (
                &raw,
                "zstd",
                true,
                "the image is raw, and the installation says zstd",
            ),
            (
                &raw,
                "qcow2",
                true,
                "the image is raw, and the installation says qcow2",
            ),
        ] {
            let (url, _) = serve(image.clone(), ranges);
            let mut request = request(&url, image, "/dev/vda", "");
            request.format = format.into();
            let err = install(&request, &m.roots)
                .await
                .outcome
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
            assert!(is_blank(&vda), "{want}");
        }
    }

    /// `raw` made a compressed qcow2 image by qemu-img, not by anything of ours.
    fn qemu_img_qcow2(raw: &[u8]) -> Vec<u8> {
        crate::qcow2::tests::qemu_img(raw, &["-c"])
    }

    #[tokio::test]
    async fn write_image_writes_onto_the_file_named_up_to_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let image: Vec<u8> = (0..1_000_448u32).map(|i| (i % 7) as u8).collect();
        let served = qemu_img_qcow2(&image);
        let (url, _) = serve(served.clone(), true);
        let onto = dir.path().join("new-file");
        std::fs::File::create(&onto).unwrap();
        let written = write_image_onto(&url, &sha256_hex(&served), "", &onto).await;
        assert_eq!(written.unwrap(), (ImageFormat::Qcow2, image.len() as u64));
        assert!(std::fs::read(&onto).unwrap() == image);
        let small = dir.path().join("small");
        std::fs::File::create(&small)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let (url, _) = serve(image.clone(), true);
        let err = write_image_onto(&url, &sha256_hex(&image), "raw", &small).await;
        let err = err.unwrap_err().to_string();
        assert!(err.contains("and "), "{err}");
        assert!(err.contains("only 4096; nothing was written"), "{err}");
        assert_eq!(std::fs::metadata(&small).unwrap().len(), 4096);
    }

    #[tokio::test]
    async fn a_qcow2_image_is_checked_as_served_and_unpacked_onto_the_disk() {
        let dir = tempfile::tempdir().unwrap();
        let (m, [vda, _]) = two_disks(dir.path());
        let mut image: Vec<u8> = (0..2_000_384u32).map(|i| (i % 13) as u8).collect();
        image[300_000..1_200_000].fill(0);
        let served = qemu_img_qcow2(&image);
        let (url, requests) = serve(served.clone(), true);
        let installed = install(&request(&url, &served, "/dev/vda", ""), &m.roots)
            .await
            .outcome
            .unwrap();
        assert_eq!(
            (installed.format, installed.written),
            (ImageFormat::Qcow2, image.len() as u64)
        );
        assert!(begins_with(&vda, &image));
        // The header, the L1 table and one L2 table by ranges, then the file once.
        assert_eq!(requests.load(Ordering::SeqCst), 4);
        let mut wrong = request(&url, &served, "/dev/vda", "");
        wrong.sha256 = sha256_hex(b"another image");
        wrong.wipe_allowed = true;
        let err = install(&wrong, &m.roots).await.outcome.unwrap_err();
        assert!(
            matches!(err, InstallError::Mismatch { served: n, .. } if n == served.len() as u64),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_compressed_image_is_checked_as_served_and_written_decompressed() {
        let dir = tempfile::tempdir().unwrap();
        let (m, [vda, _]) = two_disks(dir.path());
        let image: Vec<u8> = (0..1_000_000u32).map(|i| (i % 13) as u8).collect();
        let served = zstd::encode_all(image.as_slice(), 3).unwrap();
        let (url, _) = serve(served.clone(), true);
        let mut request = request(&url, &served, "/dev/vda", "");
        request.format = "zstd".into();
        let installed = install(&request, &m.roots).await.outcome.unwrap();
        assert_eq!(
            (installed.format, installed.written),
            (ImageFormat::Zstd, image.len() as u64)
        );
        assert!(begins_with(&vda, &image));
    }

    #[tokio::test]
    async fn an_image_larger_than_its_disk_is_a_failure_announced_or_not() {
        let dir = tempfile::tempdir().unwrap();
        let (m, [vda, _]) = two_disks(dir.path());
        let image = vec![1u8; (4 << 20) + 4096];
        for (announce, want) in [
            (true, "nothing was written"),
            (false, "the image is larger than the disk's 4194304 bytes"),
        ] {
            let (url, _) = serve(image.clone(), announce);
            let err = install(&request(&url, &image, "/dev/vda", ""), &m.roots)
                .await
                .outcome
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{err}");
            assert_eq!(
                std::fs::metadata(&vda).unwrap().len(),
                4 << 20,
                "nothing past the end"
            );
        }
    }

    #[tokio::test]
    async fn a_failing_image_server_is_told_apart_from_a_wrong_request() {
        let dir = tempfile::tempdir().unwrap();
        let (m, _) = two_disks(dir.path());
        let image = vec![4u8; 100_000];
        let closed = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("http://{}/image", listener.local_addr().unwrap())
        };
        let answer = |status: &str, cut: usize| {
            let head = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                image.len()
            );
            serve_once(head, image.clone(), cut)
        };
        // (URL, unavailable, disk written)
        let cases = [
            (closed, true, false),
            (answer("503 Service Unavailable", image.len()), true, false),
            (answer("404 Not Found", image.len()), false, false),
            // A body that breaks off, from a server that takes no ranges.
            (answer("200 OK", 60_000), true, true),
        ];
        for (url, unavailable, written) in cases {
            // The URL carries a password and a presigned query's signature, as an image
            // server's basic auth and an object store's do: the error names neither.
            let url = url.replace("http://", "http://admin:hunter2@") + "?X-Amz-Signature=s3cr3t";
            let mut request = request(&url, &image, "/dev/vda", "");
            request.wipe_allowed = true;
            let attempt = install(&request, &m.roots).await;
            let err = attempt.outcome.unwrap_err();
            assert_eq!(
                (err.is_unavailable(), err.disk_written()),
                (unavailable, written),
                "{err}"
            );
            let said = err.to_string();
            assert!(
                !said.contains("hunter2")
                    && !said.contains("s3cr3t")
                    && said.contains("http://…@127.0.0.1:"),
                "{said}"
            );
            // The disk was chosen before anything was fetched, and the report names it.
            assert_eq!(attempt.chosen.map(|d| d.serial), Some("FIRST".into()));
        }
    }
}
