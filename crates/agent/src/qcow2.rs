//! qcow2 images written in one pass over the image as served (design.md §21), never held in
//! memory or spooled: the agent first reads the image's header, its L1 table and its L2
//! tables with HTTP range requests (one cluster per L2 table), and from them maps where each
//! allocated cluster's bytes sit in the file and where they go on the disk ([`Layout`]).
//! Then the whole file streams past once, in order, hashed as served like every other
//! format, and [`Unpacker`] writes each cluster's bytes at its place on the disk as they pass,
//! inflating compressed clusters (deflate or zstd). Clusters never allocated, or marked zero,
//! are written as zeros once the stream has ended, so the disk reads as the image's guest
//! would read it. What the agent cannot write faithfully is refused before the first write:
//! a backing file, encryption, an external data file, extended L2 entries, an image marked
//! corrupt, two clusters sharing bytes.
//!
//! The qcow2 crates of crates.io read through a seekable file; here the file is a stream
//! whose tables come first by range requests, which none of them models.

use std::os::unix::fs::FileExt;

/// How many of the image's first bytes [`Header::parse`] reads.
pub const HEADER_BYTES: u64 = 112;

/// The most bytes an L1 table may take (a 16 TiB image of 64 KiB clusters takes 256 KiB).
const MAX_L1_BYTES: u64 = 32 << 20;

/// The most L2 tables read, one range request each (8 TiB of 64 KiB clusters).
pub const MAX_L2_TABLES: usize = 16_384;

/// The most runs of clusters mapped (32 bytes each).
const MAX_RUNS: usize = 1 << 20;

/// How many zeros are written at once.
const ZEROS: usize = 1 << 20;

/// The most inflated clusters' bytes held at once: compressed clusters are inflated in
/// batches, on as many threads as the machine has (at most [`INFLATING_THREADS`]).
const BATCH_BYTES: u64 = 4 << 20;

/// The most threads that inflate a batch.
const INFLATING_THREADS: usize = 4;

/// The most file bytes held back for a batch before it is inflated whatever its size.
const MAX_KEPT: usize = 8 << 20;

/// L2 entry: the cluster is compressed.
const COMPRESSED: u64 = 1 << 62;

/// L1 and standard L2 entries: the host offset's bits.
const OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;

/// Why a qcow2 image cannot be written as it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Qcow2Error {
    /// Too few bytes for a header.
    #[error("its header is {0} bytes, fewer than a qcow2 header's")]
    Short(u64),
    /// Not version 2 or 3.
    #[error("it is qcow2 version {0}; the agent writes versions 2 and 3")]
    Version(u32),
    /// It names a backing file, whose clusters it does not hold.
    #[error("it has a backing file: serve an image that stands alone (qemu-img convert -O qcow2)")]
    Backing,
    /// Its clusters are encrypted.
    #[error("it is encrypted: serve it decrypted")]
    Encrypted,
    /// A feature whose images the agent cannot read faithfully.
    #[error("it uses {0}, which the agent does not read: convert it (qemu-img convert -O qcow2)")]
    Feature(String),
    /// QEMU marked it corrupt.
    #[error("it is marked corrupt: repair it (qemu-img check -r all) or serve another")]
    Corrupt,
    /// Its cluster size is outside qcow2's bounds.
    #[error("its clusters are 2^{0} bytes; qcow2 allows 2^9 to 2^21")]
    ClusterBits(u32),
    /// A table or an entry points where no valid table or cluster can be.
    #[error("{0}")]
    Malformed(String),
    /// Its map would take more memory than the agent allows itself.
    #[error("it maps more than {what} (its clusters are too small, or too scattered): convert it to raw and compress that with zstd")]
    TooLarge {
        /// What is counted.
        what: String,
    },
    /// A compressed cluster does not inflate to a whole cluster.
    #[error("its compressed cluster at byte {host} does not inflate to {cluster} bytes: {why}")]
    Inflate {
        /// Where its bytes start in the file.
        host: u64,
        /// The cluster's size.
        cluster: u64,
        /// What the decompressor said.
        why: String,
    },
    /// The file ended before a cluster its tables point to.
    #[error("it ended at byte {at}, before its cluster at byte {wanted}")]
    Truncated {
        /// The file's length as served.
        at: u64,
        /// The cluster's offset.
        wanted: u64,
    },
}

/// How its compressed clusters are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Compression {
    /// Raw deflate (qcow2's default).
    Deflate,
    /// zstd (qcow2 v3 with `compression_type=zstd`).
    Zstd,
}

/// What a qcow2 header says, once checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    cluster_bits: u32,
    /// The guest disk's size in bytes.
    size: u64,
    l1_offset: u64,
    /// The L1 entries the guest disk's size needs.
    l1_entries: u64,
    compression: Compression,
    /// Whether an L2 entry's bit 0 marks a zero cluster (version 3).
    zero_flag: bool,
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("four bytes"))
}

fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("eight bytes"))
}

/// The incompatible feature bits, and what is made of each.
const INCOMPATIBLE: [(u64, Option<&str>); 5] = [
    (1 << 0, None), // dirty: only its refcounts may be stale, which the agent never reads
    (1 << 1, Some("corrupt")),
    (1 << 2, Some("an external data file")),
    (1 << 3, None), // a compression type, read below
    (1 << 4, Some("extended L2 entries (subclusters)")),
];

impl Header {
    /// Checks and reads the header in the image's first bytes `b`.
    pub fn parse(b: &[u8]) -> Result<Header, Qcow2Error> {
        if (b.len() as u64) < 72 || !b.starts_with(b"QFI\xfb") {
            return Err(Qcow2Error::Short(b.len() as u64));
        }
        let version = be32(b, 4);
        if !(2..=3).contains(&version) {
            return Err(Qcow2Error::Version(version));
        }
        if be64(b, 8) != 0 {
            return Err(Qcow2Error::Backing);
        }
        let cluster_bits = be32(b, 20);
        if !(9..=21).contains(&cluster_bits) {
            return Err(Qcow2Error::ClusterBits(cluster_bits));
        }
        if be32(b, 32) != 0 {
            return Err(Qcow2Error::Encrypted);
        }
        let (size, l1_size, l1_offset) = (be64(b, 24), be32(b, 36) as u64, be64(b, 40));
        let mut compression = Compression::Deflate;
        if version == 3 {
            if (b.len() as u64) < 104 {
                return Err(Qcow2Error::Short(b.len() as u64));
            }
            let features = be64(b, 72);
            if features & (1 << 1) != 0 {
                return Err(Qcow2Error::Corrupt);
            }
            let known = INCOMPATIBLE.iter().fold(0, |all, (bit, _)| all | bit);
            if let Some((_, Some(what))) = INCOMPATIBLE.iter().find(|(bit, _)| features & bit != 0)
            {
                return Err(Qcow2Error::Feature(what.to_string()));
            }
            if features & !known != 0 {
                return Err(Qcow2Error::Feature(format!(
                    "incompatible features {:#x}",
                    features & !known
                )));
            }
            let header_length = be32(b, 100) as usize;
            if features & (1 << 3) != 0 && header_length > 104 && b.len() > 104 {
                compression = match b[104] {
                    0 => Compression::Deflate,
                    1 => Compression::Zstd,
                    other => return Err(Qcow2Error::Feature(format!("compression type {other}"))),
                };
            }
        }
        let cluster = 1u64 << cluster_bits;
        let per_table = cluster / 8;
        let l1_entries = size.div_ceil(cluster).div_ceil(per_table);
        if l1_size < l1_entries {
            return Err(Qcow2Error::Malformed(format!(
                "its L1 table has {l1_size} entries, and its size of {size} bytes needs {l1_entries}"
            )));
        }
        if l1_entries * 8 > MAX_L1_BYTES {
            return Err(Qcow2Error::TooLarge {
                what: format!("{MAX_L1_BYTES} bytes of L1 table"),
            });
        }
        if !l1_offset.is_multiple_of(cluster) {
            return Err(Qcow2Error::Malformed(format!(
                "its L1 table is at byte {l1_offset}, not at a cluster's start"
            )));
        }
        Ok(Header {
            cluster_bits,
            size,
            l1_offset,
            l1_entries,
            compression,
            zero_flag: version == 3,
        })
    }

    /// The guest disk's size, which is what the disk receives.
    pub fn virtual_size(&self) -> u64 {
        self.size
    }

    /// Its cluster size in bytes.
    pub fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }

    /// Where its L1 table is in the file: offset and length.
    pub fn l1_table(&self) -> (u64, u64) {
        (self.l1_offset, self.l1_entries * 8)
    }

    /// The L2 tables its L1 table `l1` points to: each with its L1 index and its offset in
    /// the file (a cluster long).
    pub fn l2_tables(&self, l1: &[u8]) -> Result<Vec<(u64, u64)>, Qcow2Error> {
        let mut tables = Vec::new();
        for index in 0..self.l1_entries {
            let offset = be64(l1, index as usize * 8) & OFFSET_MASK;
            if offset == 0 {
                continue;
            }
            if !offset.is_multiple_of(self.cluster_size()) {
                return Err(Qcow2Error::Malformed(format!(
                    "its L2 table {index} is at byte {offset}, not at a cluster's start"
                )));
            }
            if tables.len() == MAX_L2_TABLES {
                return Err(Qcow2Error::TooLarge {
                    what: format!("{MAX_L2_TABLES} L2 tables"),
                });
            }
            tables.push((index, offset));
        }
        Ok(tables)
    }
}

/// Bytes of the file that go onto the disk: a run of plain clusters, or one compressed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    /// Where they start in the file.
    host: u64,
    /// How many bytes of the file.
    len: u64,
    /// Where they go on the disk.
    guest: u64,
    compressed: bool,
}

/// Where each allocated cluster's bytes are in the file and go on the disk, and which parts of
/// the disk are zeros.
#[derive(Debug, Clone)]
pub struct Layout {
    /// Sorted by where they start in the file.
    runs: Vec<Run>,
    /// Offset and length on the disk, in order.
    zeros: Vec<(u64, u64)>,
    cluster_size: u64,
    size: u64,
    compression: Compression,
}

impl Layout {
    /// The layout `header`'s L2 tables `tables` (each with its L1 index) describe.
    pub fn build(header: &Header, tables: &[(u64, bytes::Bytes)]) -> Result<Layout, Qcow2Error> {
        let cluster = header.cluster_size();
        let per_table = cluster / 8;
        let mut layout = Layout {
            runs: Vec::new(),
            zeros: Vec::new(),
            cluster_size: cluster,
            size: header.size,
            compression: header.compression,
        };
        let mut tables = tables.iter().peekable();
        for index in 0..header.l1_entries {
            let span = index * per_table * cluster;
            let table = match tables.peek() {
                Some((i, table)) if *i == index => {
                    tables.next();
                    table
                }
                _ => {
                    layout.zero(span, (per_table * cluster).min(header.size - span));
                    continue;
                }
            };
            if table.len() as u64 != cluster {
                return Err(Qcow2Error::Malformed(format!(
                    "its L2 table {index} is {} bytes, not a cluster",
                    table.len()
                )));
            }
            for entry in 0..per_table {
                let guest = span + entry * cluster;
                if guest >= header.size {
                    break;
                }
                let len = cluster.min(header.size - guest);
                layout.map(header, be64(table, entry as usize * 8), guest, len)?;
            }
        }
        layout.runs.sort_unstable_by_key(|run| run.host);
        for pair in layout.runs.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            if a.host + a.len > b.host && !(a.compressed && b.compressed) {
                return Err(Qcow2Error::Malformed(format!(
                    "two of its clusters share the file's bytes at {}",
                    b.host
                )));
            }
        }
        Ok(layout)
    }

    /// Maps the guest's `len` bytes at `guest` as the L2 entry `entry` says.
    fn map(&mut self, header: &Header, entry: u64, guest: u64, len: u64) -> Result<(), Qcow2Error> {
        let cluster = self.cluster_size;
        let run = if entry & COMPRESSED != 0 {
            let bits = 62 - (header.cluster_bits - 8);
            let host = entry & ((1 << bits) - 1);
            let sectors = ((entry >> bits) & ((1 << (62 - bits)) - 1)) + 1;
            let bytes = sectors * 512 - (host % 512);
            if bytes > 2 * cluster {
                return Err(Qcow2Error::Malformed(format!(
                    "its compressed cluster at byte {host} takes {bytes} bytes, more than two clusters"
                )));
            }
            Run {
                host,
                len: bytes,
                guest,
                compressed: true,
            }
        } else {
            let host = entry & OFFSET_MASK;
            if host == 0 || (header.zero_flag && entry & 1 != 0) {
                self.zero(guest, len);
                return Ok(());
            }
            if !host.is_multiple_of(cluster) {
                return Err(Qcow2Error::Malformed(format!(
                    "its cluster at byte {host} is not at a cluster's start"
                )));
            }
            if let Some(last) = self.runs.last_mut() {
                if !last.compressed
                    && last.host + last.len == host
                    && last.guest + last.len == guest
                {
                    last.len += len;
                    return Ok(());
                }
            }
            Run {
                host,
                len,
                guest,
                compressed: false,
            }
        };
        if self.runs.len() == MAX_RUNS {
            return Err(Qcow2Error::TooLarge {
                what: format!("{MAX_RUNS} runs of clusters"),
            });
        }
        self.runs.push(run);
        Ok(())
    }

    /// Notes that the guest's `len` bytes at `guest` are zeros.
    fn zero(&mut self, guest: u64, len: u64) {
        match self.zeros.last_mut() {
            Some((at, n)) if *at + *n == guest => *n += len,
            _ => self.zeros.push((guest, len)),
        }
    }

    /// The guest disk's size, which is what the disk receives.
    pub fn virtual_size(&self) -> u64 {
        self.size
    }
}

/// Why unpacking stopped.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The disk refused a write.
    #[error("writing: {0}")]
    Write(std::io::Error),
    /// The image is not what its tables say.
    #[error("the qcow2 image: {0}")]
    Image(Qcow2Error),
}

/// Writes a qcow2 image onto a disk as its file streams past, in the file's order.
pub struct Unpacker {
    layout: Layout,
    /// The first run not yet written whole.
    next: usize,
    /// The file's bytes from `kept_from` up to the stream's end so far, which a run may
    /// still need: the batch's compressed clusters (at most [`MAX_KEPT`]), and a chunk.
    kept: Vec<u8>,
    kept_from: u64,
    /// Compressed clusters whose bytes have arrived, in the file's order, to be inflated
    /// together.
    batch: Vec<Run>,
    /// A buffer per cluster of a full batch.
    inflated: Vec<Vec<u8>>,
    threads: usize,
    written: u64,
}

impl Unpacker {
    /// Starts unpacking the image `layout` describes.
    pub fn new(layout: Layout) -> Unpacker {
        let batch = (BATCH_BYTES / layout.cluster_size).max(1) as usize;
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Unpacker {
            inflated: vec![vec![0; layout.cluster_size as usize]; batch],
            layout,
            next: 0,
            kept: Vec::new(),
            kept_from: 0,
            batch: Vec::with_capacity(batch),
            threads: threads.min(INFLATING_THREADS),
            written: 0,
        }
    }

    /// The stream's end so far, as an offset in the file.
    fn end(&self) -> u64 {
        self.kept_from + self.kept.len() as u64
    }

    /// Takes the file's next bytes, and writes what they complete onto `disk`.
    pub fn feed(&mut self, disk: &std::fs::File, chunk: &[u8]) -> Result<(), UnpackError> {
        self.kept.extend_from_slice(chunk);
        self.write_runs(disk, false)
    }

    /// Writes each run whose bytes have arrived (at the stream's end, also a compressed
    /// cluster whose padding the file leaves out), then forgets the bytes no run needs.
    fn write_runs(&mut self, disk: &std::fs::File, ended: bool) -> Result<(), UnpackError> {
        let end = self.end();
        while let Some(run) = self.layout.runs.get(self.next).copied() {
            if run.host >= end {
                break;
            }
            let from = (run.host - self.kept_from) as usize;
            if run.compressed {
                if run.host + run.len > end && !ended {
                    break;
                }
                self.batch.push(run);
                self.next += 1;
                if self.batch.len() == self.inflated.len() || self.kept.len() > MAX_KEPT {
                    self.inflate_batch(disk)?;
                }
            } else {
                // The batch holds back the bytes before this run: it goes first.
                self.inflate_batch(disk)?;
                let have = (run.host + run.len).min(end) - run.host;
                disk.write_all_at(&self.kept[from..from + have as usize], run.guest)
                    .map_err(UnpackError::Write)?;
                self.written += have;
                let run = &mut self.layout.runs[self.next];
                (run.host, run.guest, run.len) =
                    (run.host + have, run.guest + have, run.len - have);
                if run.len > 0 {
                    break;
                }
                self.next += 1;
            }
        }
        let next = self.batch.first().or(self.layout.runs.get(self.next));
        let needed = next.map_or(end, |r| r.host.min(end));
        self.kept.drain(..(needed - self.kept_from) as usize);
        self.kept_from = needed;
        Ok(())
    }

    /// Inflates the batch's clusters, on threads of their own when there are several cores,
    /// and writes them at their places.
    fn inflate_batch(&mut self, disk: &std::fs::File) -> Result<(), UnpackError> {
        if self.batch.is_empty() {
            return Ok(());
        }
        let held = Held {
            kept: &self.kept,
            from: self.kept_from,
            compression: self.layout.compression,
            cluster: self.layout.cluster_size,
        };
        let outs = &mut self.inflated[..self.batch.len()];
        let per_thread = self.batch.len().div_ceil(self.threads);
        if per_thread == self.batch.len() {
            held.inflate_all(&self.batch, outs)?;
        } else {
            std::thread::scope(|scope| {
                let inflating: Vec<_> = self
                    .batch
                    .chunks(per_thread)
                    .zip(outs.chunks_mut(per_thread))
                    .map(|(runs, outs)| scope.spawn(move || held.inflate_all(runs, outs)))
                    .collect();
                inflating.into_iter().try_for_each(|thread| {
                    thread.join().unwrap_or_else(|_| {
                        Err(UnpackError::Image(Qcow2Error::Inflate {
                            host: 0,
                            cluster: held.cluster,
                            why: "the thread inflating it panicked".into(),
                        }))
                    })
                })
            })?;
        }
        for (run, out) in self.batch.iter().zip(&self.inflated) {
            let len = self.layout.cluster_size.min(self.layout.size - run.guest);
            disk.write_all_at(&out[..len as usize], run.guest)
                .map_err(UnpackError::Write)?;
            self.written += len;
        }
        self.batch.clear();
        Ok(())
    }

    /// Ends the stream: writes what the file's end completes, then the zeros; the bytes the
    /// disk received (the guest disk's size), or why the image was not whole.
    pub fn finish(mut self, disk: &std::fs::File) -> Result<u64, UnpackError> {
        self.write_runs(disk, true)?;
        self.inflate_batch(disk)?;
        if let Some(run) = self.layout.runs.get(self.next) {
            return Err(UnpackError::Image(Qcow2Error::Truncated {
                at: self.end(),
                wanted: run.host + run.len,
            }));
        }
        let zeros = vec![0u8; ZEROS];
        for &(at, len) in &self.layout.zeros {
            let mut done = 0;
            while done < len {
                let n = (len - done).min(ZEROS as u64);
                disk.write_all_at(&zeros[..n as usize], at + done)
                    .map_err(UnpackError::Write)?;
                done += n;
            }
            self.written += len;
        }
        Ok(self.written)
    }
}

/// The file's bytes a batch is inflated from.
#[derive(Clone, Copy)]
struct Held<'a> {
    kept: &'a [u8],
    /// Where `kept` starts in the file.
    from: u64,
    compression: Compression,
    cluster: u64,
}

impl Held<'_> {
    /// Inflates each of `runs` (compressed clusters, their bytes held, up to the stream's end
    /// at the end of the file) into its buffer of `outs`.
    fn inflate_all(self, runs: &[Run], outs: &mut [Vec<u8>]) -> Result<(), UnpackError> {
        let end = self.from + self.kept.len() as u64;
        for (run, out) in runs.iter().zip(outs) {
            let from = (run.host - self.from) as usize;
            let to = ((run.host + run.len).min(end) - self.from) as usize;
            inflate(self.compression, &self.kept[from..to], out).map_err(|why| {
                UnpackError::Image(Qcow2Error::Inflate {
                    host: run.host,
                    cluster: self.cluster,
                    why,
                })
            })?;
        }
        Ok(())
    }
}

/// Inflates one compressed cluster `input` (and the padding after it) into all of `out`.
fn inflate(compression: Compression, input: &[u8], out: &mut [u8]) -> Result<(), String> {
    match compression {
        Compression::Deflate => {
            let mut inflater = flate2::Decompress::new(false);
            loop {
                let (read, wrote) = (inflater.total_in(), inflater.total_out());
                let status = inflater
                    .decompress(
                        &input[read as usize..],
                        &mut out[wrote as usize..],
                        flate2::FlushDecompress::Finish,
                    )
                    .map_err(|e| e.to_string())?;
                if inflater.total_out() as usize == out.len() {
                    return Ok(());
                }
                let stuck = inflater.total_in() == read && inflater.total_out() == wrote;
                if status == flate2::Status::StreamEnd || stuck {
                    return Err(format!("{} bytes came out", inflater.total_out()));
                }
            }
        }
        Compression::Zstd => {
            use zstd::stream::raw::{Decoder, InBuffer, Operation, OutBuffer};
            let mut decoder = Decoder::new().map_err(|e| e.to_string())?;
            let mut input = InBuffer::around(input);
            let mut output = OutBuffer::around(out);
            loop {
                let before = (input.pos(), output.pos());
                decoder
                    .run(&mut input, &mut output)
                    .map_err(|e| e.to_string())?;
                if output.pos() == output.capacity() {
                    return Ok(());
                }
                if (input.pos(), output.pos()) == before {
                    return Err(format!("{} bytes came out", output.pos()));
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::process::Command;

    /// A guest disk of 3 MiB and 24 sectors: data, a hole, data again, a zeroed stretch and
    /// a tail shorter than a cluster, so every kind of cluster appears.
    fn guest() -> Vec<u8> {
        let mut disk = vec![0u8; 3 * 1024 * 1024 + 24 * 512];
        for (i, b) in disk.iter_mut().enumerate() {
            let in_hole = (700_000..1_600_000).contains(&i);
            *b = if in_hole { 0 } else { (i * 7 % 251) as u8 };
        }
        disk[2_000_000..2_200_000].fill(0);
        disk
    }

    /// `raw` converted by qemu-img with `options` (qemu-img's own encoder, not ours).
    pub(crate) fn qemu_img(raw: &[u8], options: &[&str]) -> Vec<u8> {
        let dir = tempfile::tempdir().unwrap();
        let (from, to) = (dir.path().join("raw"), dir.path().join("qcow2"));
        std::fs::write(&from, raw).unwrap();
        let status = Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "qcow2"])
            .args(options)
            .arg(&from)
            .arg(&to)
            .status()
            .expect("qemu-img (qemu-utils) is installed by scripts/test-deps.sh");
        assert!(status.success());
        std::fs::read(&to).unwrap()
    }

    /// Reads `image`'s layout as the agent does, by ranges.
    fn layout(image: &[u8]) -> Result<Layout, Qcow2Error> {
        let header = Header::parse(&image[..HEADER_BYTES as usize])?;
        let (at, len) = header.l1_table();
        let l1 = &image[at as usize..(at + len) as usize];
        let tables: Vec<_> = header
            .l2_tables(l1)?
            .into_iter()
            .map(|(index, at)| {
                let bytes = &image[at as usize..(at + header.cluster_size()) as usize];
                (index, bytes::Bytes::copy_from_slice(bytes))
            })
            .collect();
        Layout::build(&header, &tables)
    }

    /// Streams `image` past an unpacker in chunks of `chunk` bytes onto a disk that holds
    /// old bytes everywhere; the disk's bytes, or the failure.
    fn unpack(image: &[u8], chunk: usize) -> Result<Vec<u8>, UnpackError> {
        unpack_served(image, image.len(), chunk)
    }

    /// [`unpack`], with the stream ending after the image's first `served` bytes (its tables
    /// read whole).
    fn unpack_served(image: &[u8], served: usize, chunk: usize) -> Result<Vec<u8>, UnpackError> {
        let layout = layout(image).map_err(UnpackError::Image)?;
        let size = layout.virtual_size() as usize;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk");
        std::fs::write(&path, vec![0xaa; size]).unwrap();
        let disk = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        let mut unpacker = Unpacker::new(layout);
        for piece in image[..served].chunks(chunk) {
            unpacker.feed(&disk, piece)?;
        }
        let written = unpacker.finish(&disk)?;
        assert_eq!(written, size as u64);
        Ok(std::fs::read(&path).unwrap())
    }

    #[test]
    fn every_form_qemu_img_writes_unpacks_to_the_guest_disk() {
        let raw = guest();
        let forms: [&[&str]; 5] = [
            &[],
            &["-o", "compat=0.10"],
            &["-c"],
            &["-c", "-o", "compression_type=zstd"],
            &["-c", "-o", "cluster_size=4096"],
        ];
        for options in forms {
            let image = qemu_img(&raw, options);
            for chunk in [1, 4093, 65_536, image.len()] {
                if chunk == 1 && image.len() > 400_000 {
                    continue;
                }
                let disk = unpack(&image, chunk).unwrap();
                let first = disk.iter().zip(&raw).position(|(a, b)| a != b);
                assert!(
                    disk == raw,
                    "{options:?} in chunks of {chunk}: first differs at {first:?}"
                );
            }
        }
    }

    #[test]
    fn an_image_cut_short_is_a_failure_not_a_partial_success() {
        for options in [&[][..], &["-c"][..]] {
            let image = qemu_img(&guest(), options);
            let Err(err) = unpack_served(&image, image.len() / 2, 65_536) else {
                panic!("{options:?}: half the image was written as if whole");
            };
            assert!(err.to_string().contains("before its cluster"), "{err}");
        }
    }

    #[test]
    fn what_cannot_be_written_faithfully_is_refused_by_its_header() {
        let image = qemu_img(&guest(), &[]);
        let cases = [
            (7, 1, "version 1"),
            (15, 0x70, "backing file"),
            (35, 1, "encrypted"),
            (79, 2, "corrupt"),
            (79, 4, "an external data file"),
            (79, 0x10, "extended L2 entries"),
        ];
        for (at, value, want) in cases {
            let mut head = image[..HEADER_BYTES as usize].to_vec();
            head[at] = value;
            let err = Header::parse(&head).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
        assert!(Header::parse(&image[..40]).is_err());
    }

    #[test]
    fn two_clusters_sharing_bytes_are_refused() {
        let mut image = qemu_img(&guest(), &[]);
        let header = Header::parse(&image[..HEADER_BYTES as usize]).unwrap();
        let (at, _) = header.l1_table();
        let l2 = (be64(&image, at as usize) & OFFSET_MASK) as usize;
        let first = image[l2..l2 + 8].to_vec();
        image[l2 + 8..l2 + 16].copy_from_slice(&first);
        let err = layout(&image).unwrap_err().to_string();
        assert!(err.contains("share the file's bytes"), "{err}");
    }
}
