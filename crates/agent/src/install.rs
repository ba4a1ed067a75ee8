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
        /// `opening`, `writing` or `flushing`.
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
    let response = reqwest::get(&image.url)
        .await
        .and_then(|r| r.error_for_status())
        .map_err(download("fetching"))?;
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
