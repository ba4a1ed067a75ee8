//! Helpers for this and other crates' tests.

use std::path::{Path, PathBuf};

/// Writes `dir/live.iso`: an "ISO" of 64 sectors of `x` with a 4 KiB slot for each
/// config-drive file at sectors 3 and 7, as
/// [`crate::LiveImage::open`] finds them in an image `scripts/live-image.sh` built.
pub fn image_with_slots(dir: &Path) -> PathBuf {
    let mut data = vec![b'x'; 64 * 2048];
    for (sector, name) in [(3usize, "meta_data.json"), (7, "network_data.json")] {
        let mut slot = format!("{{\"shepherd_slot\":\"{name}\",\"bytes\":4096}}").into_bytes();
        slot.resize(4095, b' ');
        slot.push(b'\n');
        data[sector * 2048..sector * 2048 + 4096].copy_from_slice(&slot);
    }
    let path = dir.join("live.iso");
    std::fs::write(&path, data).unwrap();
    path
}
