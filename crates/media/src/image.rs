//! The live image on disk and its config-drive slots: fixed-size files of the ISO
//! (`openstack/latest/meta_data.json`, `network_data.json`) whose bytes, at the start of an ISO
//! sector, name them (`{"shepherd_slot":"meta_data.json","bytes":16384}`, padded with spaces).
//! A machine's image is the file as it is, with its own config drive's files in the slots:
//! streamed from disk a chunk at a time, never read whole, never copied per machine. The file
//! opened at start-up is the one served until the server restarts: an image rebuilt and moved
//! into place meanwhile is never mixed into it (its length and slots are the old file's).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use futures::Stream;

/// ISO 9660 files start at sector boundaries.
const SECTOR: u64 = 2048;
/// How a slot's first bytes begin.
const MARK: &[u8] = b"{\"shepherd_slot\":\"";
/// The bytes read and sent at a time.
const CHUNK: usize = 64 << 10;
/// The slots every live image has.
pub const SLOT_NAMES: [&str; 2] = ["meta_data.json", "network_data.json"];

/// Why a live image cannot be served.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// It could not be read.
    #[error("live image {path}: {error}")]
    Io {
        /// The file.
        path: PathBuf,
        /// What the system said.
        error: std::io::Error,
    },
    /// A slot every live image has is missing, or there are two of it.
    #[error("live image {path}: {found} slots named {name:?}, want exactly one (is it an image scripts/live-image.sh built, or one with the same config-drive slots?)")]
    Slot {
        /// The file.
        path: PathBuf,
        /// The slot.
        name: &'static str,
        /// How many were found.
        found: usize,
    },
}

/// Why a machine's config drive does not go into the image.
#[derive(Debug, thiserror::Error)]
pub enum FillError {
    /// The config is no JSON object of file texts by name.
    #[error("the config drive is not a JSON object of file texts: {0}")]
    NotFiles(String),
    /// A file has no slot, or a slot no file.
    #[error("the config drive's files do not match the image's slots: want {SLOT_NAMES:?}")]
    Names,
    /// A file is larger than its slot.
    #[error("the config drive's {name} is {bytes} bytes; its slot holds {slot}")]
    TooLarge {
        /// The file.
        name: String,
        /// Its size.
        bytes: usize,
        /// The slot's.
        slot: u64,
    },
}

/// One slot: where it is in the file, and how long.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Slot {
    name: &'static str,
    offset: u64,
    len: u64,
}

/// A live image: its file, held open, its length and its slots.
#[derive(Debug)]
pub struct LiveImage {
    path: PathBuf,
    file: Arc<std::fs::File>,
    len: u64,
    slots: Vec<Slot>,
}

/// One machine's slot contents, each padded with spaces to its slot's length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filled(Vec<(Range<u64>, Vec<u8>)>);

impl LiveImage {
    /// Opens the image at `path` and finds its slots, reading it once a megabyte at a time
    /// (a start-up check: an image without them is refused).
    pub fn open(path: &Path) -> Result<LiveImage, ImageError> {
        use std::io::Read;
        let io = |error| ImageError::Io {
            path: path.to_path_buf(),
            error,
        };
        let mut file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let mut found: Vec<Slot> = Vec::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut at = 0u64;
        loop {
            let mut n = 0;
            while n < buf.len() {
                match file.read(&mut buf[n..]).map_err(io)? {
                    0 => break,
                    k => n += k,
                }
            }
            if n == 0 {
                break;
            }
            for start in (0..n).step_by(SECTOR as usize) {
                if let Some(slot) = slot_at(&buf[start..n], at + start as u64) {
                    found.push(slot);
                }
            }
            at += n as u64;
        }
        for name in SLOT_NAMES {
            let count = found.iter().filter(|s| s.name == name).count();
            if count != 1 {
                return Err(ImageError::Slot {
                    path: path.to_path_buf(),
                    name,
                    found: count,
                });
            }
        }
        Ok(LiveImage {
            path: path.to_path_buf(),
            file: Arc::new(file),
            len,
            slots: found,
        })
    }

    /// The image's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the image is empty (it never is once opened).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `config` (a JSON object of file texts by slot name, see
    /// `shepherd_provider::bare::config_drive`) as it goes into the slots.
    pub fn fill(&self, config: &str) -> Result<Filled, FillError> {
        let files: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(config).map_err(|e| FillError::NotFiles(e.to_string()))?;
        if files.len() != self.slots.len() {
            return Err(FillError::Names);
        }
        let mut filled = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let text = files
                .get(slot.name)
                .and_then(|v| v.as_str())
                .ok_or(FillError::Names)?;
            if text.len() as u64 >= slot.len {
                return Err(FillError::TooLarge {
                    name: slot.name.to_string(),
                    bytes: text.len(),
                    slot: slot.len,
                });
            }
            let mut bytes = text.as_bytes().to_vec();
            bytes.resize(slot.len as usize - 1, b' ');
            bytes.push(b'\n');
            filled.push((slot.offset..slot.offset + slot.len, bytes));
        }
        Ok(Filled(filled))
    }

    /// The bytes `range` of the image with `filled` in its slots, a chunk at a time.
    pub fn stream(
        self: &Arc<Self>,
        filled: Arc<Filled>,
        range: Range<u64>,
    ) -> impl Stream<Item = std::io::Result<Bytes>> + Send + 'static {
        let state = (self.clone(), filled, range);
        futures::stream::try_unfold(state, |(image, filled, range)| async move {
            if range.is_empty() {
                return Ok(None);
            }
            let want = (range.end - range.start).min(CHUNK as u64) as usize;
            let (file, at) = (image.file.clone(), range.start);
            let chunk = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let mut chunk = vec![0u8; want];
                file.read_exact_at(&mut chunk, at).map(|()| chunk)
            });
            let mut chunk = chunk.await.map_err(std::io::Error::other)??;
            filled.overlay(range.start, &mut chunk);
            let rest = range.start + want as u64..range.end;
            Ok(Some((Bytes::from(chunk), (image, filled, rest))))
        })
    }
}

impl Filled {
    /// Copies the slot bytes that fall into `chunk`, which starts at `at` in the image.
    fn overlay(&self, at: u64, chunk: &mut [u8]) {
        let end = at + chunk.len() as u64;
        for (slot, bytes) in &self.0 {
            let (from, to) = (slot.start.max(at), slot.end.min(end));
            if from < to {
                let src = &bytes[(from - slot.start) as usize..(to - slot.start) as usize];
                chunk[(from - at) as usize..(to - at) as usize].copy_from_slice(src);
            }
        }
    }
}

/// The slot that starts at the beginning of `sector` (at `offset` in the file), if one does.
fn slot_at(sector: &[u8], offset: u64) -> Option<Slot> {
    if !sector.starts_with(MARK) {
        return None;
    }
    let end = sector.iter().take(256).position(|b| *b == b'}')?;
    #[derive(serde::Deserialize)]
    struct Head {
        shepherd_slot: String,
        bytes: u64,
    }
    let head: Head = serde_json::from_slice(&sector[..=end]).ok()?;
    let name = SLOT_NAMES.into_iter().find(|n| *n == head.shepherd_slot)?;
    Some(Slot {
        name,
        offset,
        len: head.bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::TryStreamExt;

    /// Everything `stream` yields, in one vector.
    async fn collect(stream: impl Stream<Item = std::io::Result<Bytes>>) -> Vec<u8> {
        stream
            .try_fold(Vec::new(), |mut all, chunk| async move {
                all.extend_from_slice(&chunk);
                Ok(all)
            })
            .await
            .unwrap()
    }

    /// An "ISO" of `sectors` sectors of `x` with the two slots at sectors 3 and 7.
    pub(crate) fn fake_image(dir: &Path, sectors: u64) -> PathBuf {
        let mut data = vec![b'x'; (sectors * SECTOR) as usize];
        for (sector, name) in [(3u64, "meta_data.json"), (7, "network_data.json")] {
            let head = format!("{{\"shepherd_slot\":\"{name}\",\"bytes\":4096}}");
            let at = (sector * SECTOR) as usize;
            let mut slot = head.into_bytes();
            slot.resize(4095, b' ');
            slot.push(b'\n');
            data[at..at + 4096].copy_from_slice(&slot);
        }
        let path = dir.join("live.iso");
        std::fs::write(&path, data).unwrap();
        path
    }

    fn config(meta: &str) -> String {
        serde_json::json!({"meta_data.json": meta, "network_data.json": "{}"}).to_string()
    }

    /// A live image rebuilt and moved into place (as scripts/live-image.sh does, with `mv`)
    /// while BMCs read the old one: every request, in progress or new, reads the image opened
    /// at start-up whole, never the new file's bytes at the old one's offsets.
    #[tokio::test]
    async fn an_image_moved_into_place_meanwhile_is_never_mixed_into_the_one_served() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_image(dir.path(), 40);
        let old = std::fs::read(&path).unwrap();
        let image = Arc::new(LiveImage::open(&path).unwrap());
        let filled = Arc::new(image.fill(&config("{}")).unwrap());
        let whole = collect(image.stream(filled.clone(), 0..image.len())).await;
        let rebuilt = dir.path().join("live.iso.new");
        std::fs::write(&rebuilt, vec![b'y'; old.len() + 4096]).unwrap();
        std::fs::rename(&rebuilt, &path).unwrap();
        let again = collect(image.stream(filled.clone(), 0..image.len())).await;
        assert!(again == whole, "a request after the move read the new file");
        let part = collect(image.stream(filled, 8192..20_000)).await;
        assert!(
            part == whole[8192..20_000],
            "a range after the move read the new file"
        );
    }

    #[tokio::test]
    async fn slots_are_found_and_filled_in_any_range_that_crosses_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = fake_image(dir.path(), 40);
        let image = Arc::new(LiveImage::open(&path).unwrap());
        assert_eq!(image.len(), 40 * SECTOR);
        let filled = Arc::new(image.fill(&config(r#"{"k":1}"#)).unwrap());
        let whole = collect(image.stream(filled.clone(), 0..image.len())).await;
        let at = (3 * SECTOR) as usize;
        assert_eq!(&whole[at..at + 7], br#"{"k":1}"#);
        assert!(whole[at + 7..at + 4095].iter().all(|b| *b == b' '));
        assert_eq!(&whole[at + 4096..at + 4100], b"xxxx");
        let net = (7 * SECTOR) as usize;
        assert_eq!(&whole[net..net + 3], b"{} ");
        // Any range is the same bytes as the whole.
        for range in [
            0..1,
            at as u64 - 5..at as u64 + 9,
            7000..70000,
            81910..81920,
        ] {
            let part = collect(image.stream(filled.clone(), range.clone())).await;
            assert_eq!(
                part,
                whole[range.start as usize..range.end as usize],
                "{range:?}"
            );
        }
        // The file itself is untouched.
        assert!(std::fs::read(&path).unwrap()[at..].starts_with(MARK));
    }

    #[test]
    fn images_without_their_slots_and_configs_that_do_not_fit_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let plain = dir.path().join("plain.iso");
        std::fs::write(&plain, vec![0u8; 8192]).unwrap();
        let err = LiveImage::open(&plain).unwrap_err().to_string();
        assert!(err.contains("0 slots named \"meta_data.json\""), "{err}");
        let image = LiveImage::open(&fake_image(dir.path(), 10)).unwrap();
        let big = config(&"y".repeat(5000));
        assert!(matches!(image.fill(&big), Err(FillError::TooLarge { .. })));
        assert!(matches!(image.fill("[]"), Err(FillError::NotFiles(_))));
        assert!(matches!(
            image.fill(&serde_json::json!({"meta_data.json": "{}"}).to_string()),
            Err(FillError::Names)
        ));
    }
}
