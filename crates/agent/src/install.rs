//! OS installation: stream an image to a block device, verifying its sha256, then reboot.

use futures::StreamExt;
use sha2::{Digest, Sha256};
use shepherd_proto::bmaas::ImageInstallationRequest;
use tokio::io::AsyncWriteExt;

/// Downloads `image.url` into `image.target_device`, checking the sha256 over exactly the
/// bytes written. An error means the device may hold a partial image; it is never reported as
/// success.
pub async fn install(image: &ImageInstallationRequest) -> Result<(), String> {
    let want = image.sha256.trim().to_ascii_lowercase();
    if want.len() != 64 || !want.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!("sha256 {:?} is not 64 hex digits", image.sha256));
    }
    if image.target_device.is_empty() {
        return Err("no target device".into());
    }
    let response = reqwest::get(&image.url)
        .await
        .and_then(|r| r.error_for_status())
        .map_err(|e| format!("fetching {}: {e}", image.url))?;
    let mut device = tokio::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .create(true)
        .open(&image.target_device)
        .await
        .map_err(|e| format!("opening {}: {e}", image.target_device))?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| format!("downloading {}: {e}", image.url))?;
        hasher.update(&chunk);
        device
            .write_all(&chunk)
            .await
            .map_err(|e| format!("writing {}: {e}", image.target_device))?;
        written += chunk.len() as u64;
    }
    device
        .sync_all()
        .await
        .map_err(|e| format!("flushing {}: {e}", image.target_device))?;
    let got: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    if got != want {
        return Err(format!(
            "image checksum mismatch: got sha256 {got} over {written} bytes, want {want}"
        ));
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
