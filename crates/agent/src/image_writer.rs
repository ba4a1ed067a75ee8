//! Writes an image onto a disk on a thread of its own, decompressing or unpacking it as it
//! arrives, and
//! tells of every write and flush error: the download hands it chunks and goes on fetching
//! while the disk writes. Nothing past the disk's end is written, and the written length is
//! counted, so an image larger than its disk is a failure, never a truncated success.

use std::io::{Read, Write};

use bytes::{Buf, Bytes};
use shepherd_disks::ImageFormat;

use crate::qcow2::{self, UnpackError};

/// Chunks in flight between the download and the disk (each as large as the network's reads).
const CHUNKS_IN_FLIGHT: usize = 64;

/// How much decompressed image is written at once.
const WRITE_BYTES: usize = 1 << 20;

/// Why the writer stopped.
#[derive(Debug, thiserror::Error)]
pub enum WriteFailure {
    /// A write or the final flush failed.
    #[error("{doing}: {error}")]
    Device {
        /// `writing` or `flushing`.
        doing: &'static str,
        /// What the system said.
        error: std::io::Error,
    },
    /// The image goes on past the disk's end; nothing past it was written.
    #[error("the image is larger than the disk's {capacity} bytes")]
    Overflow {
        /// The disk's size.
        capacity: u64,
    },
    /// The compressed image is not valid in its format.
    #[error("the {format} image cannot be decompressed: {error}")]
    Decode {
        /// Its format.
        format: ImageFormat,
        /// What the decoder said.
        error: std::io::Error,
    },
    /// The qcow2 image is not what its tables say (cut short, a cluster that does not
    /// inflate).
    #[error("the qcow2 image: {0}")]
    Qcow2(qcow2::Qcow2Error),
    /// The writer's thread could not be started, or ended without an outcome.
    #[error("the writer's thread: {0}")]
    Thread(String),
}

/// How the image as served becomes the disk's bytes.
pub enum Unpack {
    /// Written as it comes, decompressed if it is compressed (any format but qcow2).
    Stream(ImageFormat),
    /// Each cluster written at its place, as its tables (read before) say.
    Qcow2(Box<qcow2::Layout>),
}

impl Unpack {
    /// The image's format.
    pub fn format(&self) -> ImageFormat {
        match self {
            Unpack::Stream(format) => *format,
            Unpack::Qcow2(_) => ImageFormat::Qcow2,
        }
    }
}

impl From<UnpackError> for WriteFailure {
    fn from(error: UnpackError) -> WriteFailure {
        match error {
            UnpackError::Write(error) => WriteFailure::Device {
                doing: "writing",
                error,
            },
            UnpackError::Image(error) => WriteFailure::Qcow2(error),
        }
    }
}

/// A running writer: hand it chunks with [`ImageWriter::write`], then [`ImageWriter::finish`].
pub struct ImageWriter {
    chunks: tokio::sync::mpsc::Sender<Bytes>,
    outcome: tokio::sync::oneshot::Receiver<Result<u64, WriteFailure>>,
}

impl ImageWriter {
    /// Starts writing an image onto `disk` as `unpack` says, at most `capacity` bytes of it.
    pub fn start(
        disk: std::fs::File,
        unpack: Unpack,
        capacity: u64,
    ) -> Result<ImageWriter, WriteFailure> {
        let (chunks, received) = tokio::sync::mpsc::channel(CHUNKS_IN_FLIGHT);
        let (done, outcome) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("image-writer".into())
            .spawn(move || {
                let written = match unpack {
                    Unpack::Stream(format) => write_all(&disk, format, capacity, received),
                    Unpack::Qcow2(layout) => unpack_qcow2(&disk, *layout, capacity, received),
                };
                let flushed = written.and_then(|written| {
                    disk.sync_all().map_err(|error| WriteFailure::Device {
                        doing: "flushing",
                        error,
                    })?;
                    Ok(written)
                });
                let _ = done.send(flushed);
            })
            .map_err(|e| WriteFailure::Thread(e.to_string()))?;
        Ok(ImageWriter { chunks, outcome })
    }

    /// Hands over the next chunk of the image as served; `false` once the writer has stopped
    /// (its failure comes from [`ImageWriter::finish`]).
    pub async fn write(&self, chunk: Bytes) -> bool {
        self.chunks.send(chunk).await.is_ok()
    }

    /// Ends the image and waits for the disk: the bytes written, flushed to the disk, or why
    /// not.
    pub async fn finish(self) -> Result<u64, WriteFailure> {
        drop(self.chunks);
        self.outcome
            .await
            .unwrap_or_else(|_| Err(WriteFailure::Thread("ended without an outcome".into())))
    }
}

/// The chunks of the image as a reader, for the decompressors; ends when the download does.
struct Chunks {
    received: tokio::sync::mpsc::Receiver<Bytes>,
    current: Bytes,
}

impl Read for Chunks {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        while self.current.is_empty() {
            match self.received.blocking_recv() {
                Some(chunk) => self.current = chunk,
                None => return Ok(0),
            }
        }
        let n = buf.len().min(self.current.len());
        buf[..n].copy_from_slice(&self.current[..n]);
        self.current.advance(n);
        Ok(n)
    }
}

/// Writes `bytes` at the disk's current end of what was written, within `capacity`.
fn put(
    mut disk: &std::fs::File,
    bytes: &[u8],
    written: &mut u64,
    capacity: u64,
) -> Result<(), WriteFailure> {
    if *written + bytes.len() as u64 > capacity {
        return Err(WriteFailure::Overflow { capacity });
    }
    disk.write_all(bytes)
        .map_err(|error| WriteFailure::Device {
            doing: "writing",
            error,
        })?;
    *written += bytes.len() as u64;
    Ok(())
}

/// Writes a qcow2 image described by `layout` as its file arrives, within `capacity`.
fn unpack_qcow2(
    disk: &std::fs::File,
    layout: qcow2::Layout,
    capacity: u64,
    mut received: tokio::sync::mpsc::Receiver<Bytes>,
) -> Result<u64, WriteFailure> {
    if layout.virtual_size() > capacity {
        return Err(WriteFailure::Overflow { capacity });
    }
    let mut unpacker = qcow2::Unpacker::new(layout);
    while let Some(chunk) = received.blocking_recv() {
        unpacker.feed(disk, &chunk)?;
    }
    Ok(unpacker.finish(disk)?)
}

/// Writes a raw or compressed image as it arrives, within `capacity`.
fn write_all(
    disk: &std::fs::File,
    format: ImageFormat,
    capacity: u64,
    mut received: tokio::sync::mpsc::Receiver<Bytes>,
) -> Result<u64, WriteFailure> {
    let mut written = 0u64;
    if format == ImageFormat::Raw {
        while let Some(chunk) = received.blocking_recv() {
            put(disk, &chunk, &mut written, capacity)?;
        }
    } else {
        let chunks = Chunks {
            received,
            current: Bytes::new(),
        };
        let decode = |error| WriteFailure::Decode { format, error };
        let mut decoder: Box<dyn Read> = match format {
            ImageFormat::Gzip => Box::new(flate2::read::MultiGzDecoder::new(chunks)),
            ImageFormat::Xz => Box::new(liblzma::read::XzDecoder::new_multi_decoder(chunks)),
            ImageFormat::Zstd => {
                Box::new(zstd::stream::read::Decoder::new(chunks).map_err(decode)?)
            }
            ImageFormat::Raw => unreachable!("raw images are written as they come"),
            ImageFormat::Qcow2 => {
                return Err(WriteFailure::Thread(
                    "a qcow2 image is unpacked by its layout, not streamed".into(),
                ))
            }
        };
        let mut buf = vec![0u8; WRITE_BYTES];
        loop {
            let n = match decoder.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(decode(e)),
            };
            put(disk, &buf[..n], &mut written, capacity)?;
        }
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn write(
        disk: std::fs::File,
        format: ImageFormat,
        capacity: u64,
        image: &[u8],
    ) -> Result<u64, WriteFailure> {
        let writer = ImageWriter::start(disk, Unpack::Stream(format), capacity).unwrap();
        for chunk in image.chunks(1000) {
            if !writer.write(Bytes::copy_from_slice(chunk)).await {
                break;
            }
        }
        writer.finish().await
    }

    #[tokio::test]
    async fn a_write_error_is_never_lost() {
        // /dev/full fails every write with ENOSPC: tokio's File would have kept that error
        // for a later call, and sync_all would then have answered success.
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        let err = write(full, ImageFormat::Raw, u64::MAX, &[7u8; 5000])
            .await
            .unwrap_err();
        assert!(
            matches!(&err, WriteFailure::Device { doing: "writing", error } if error.raw_os_error() == Some(libc::ENOSPC)),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_image_larger_than_its_disk_fails_and_nothing_past_the_end_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk");
        for format in [ImageFormat::Raw, ImageFormat::Zstd] {
            let disk = std::fs::File::create(&path).unwrap();
            let image = vec![9u8; 10_000];
            let served = match format {
                ImageFormat::Zstd => zstd::encode_all(image.as_slice(), 3).unwrap(),
                _ => image.clone(),
            };
            let err = write(disk, format, 4096, &served).await.unwrap_err();
            assert!(
                matches!(err, WriteFailure::Overflow { capacity: 4096 }),
                "{err}"
            );
            assert!(std::fs::metadata(&path).unwrap().len() <= 4096, "{format}");
        }
    }

    #[tokio::test]
    async fn compressed_images_are_written_decompressed() {
        let dir = tempfile::tempdir().unwrap();
        let image: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        gz.write_all(&image).unwrap();
        let mut xz = liblzma::write::XzEncoder::new(Vec::new(), 1);
        xz.write_all(&image).unwrap();
        for (format, served) in [
            (ImageFormat::Gzip, gz.finish().unwrap()),
            (ImageFormat::Xz, xz.finish().unwrap()),
            (
                ImageFormat::Zstd,
                zstd::encode_all(image.as_slice(), 3).unwrap(),
            ),
        ] {
            let path = dir.path().join(format.name());
            let disk = std::fs::File::create(&path).unwrap();
            let written = write(disk, format, u64::MAX, &served).await.unwrap();
            assert_eq!(written, image.len() as u64, "{format}");
            assert!(std::fs::read(&path).unwrap() == image, "{format}");
        }
        let disk = std::fs::File::create(dir.path().join("bad")).unwrap();
        let err = write(disk, ImageFormat::Xz, u64::MAX, b"\xfd7zXZ\x00garbage")
            .await
            .unwrap_err();
        assert!(matches!(err, WriteFailure::Decode { .. }), "{err}");
    }
}
