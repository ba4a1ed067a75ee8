//! The formats of the OS images written onto a disk (design.md §21): raw, raw compressed
//! with gzip, xz or zstd, and qcow2, told apart by their magic bytes. An entry may name the format; the
//! agent then refuses an image of another before it writes anything.

use std::fmt;

/// A format the agent writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ImageFormat {
    /// The disk's bytes as they are.
    Raw,
    /// A raw image compressed with gzip (`.img.gz`).
    Gzip,
    /// A raw image compressed with xz (`.img.xz`).
    Xz,
    /// A raw image compressed with zstd (`.img.zst`).
    Zstd,
    /// QEMU's copy-on-write format (most distributions' cloud `.img`, `.qcow2`).
    Qcow2,
}

/// A format name that is not one the agent writes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// No format at all.
    #[error("{0:?} is not a format; the formats are raw, gzip, xz, zstd, qcow2")]
    Unknown(String),
}

/// What an image's first bytes say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sniffed {
    /// A format the agent writes.
    Writable(ImageFormat),
    /// A format it recognises and does not write (named).
    Unwritable(&'static str),
}

/// How many of an image's first bytes [`ImageFormat::sniff`] needs.
pub const SNIFFED_BYTES: usize = 8;

/// Magic bytes of formats the agent does not write, and what to say of them.
const UNWRITABLE: [(&[u8], &str); 4] = [
    (b"BZh", "bzip2"),
    (b"KDMV", "VMDK"),
    (b"vhdxfile", "VHDX"),
    (b"conectix", "VHD"),
];

impl ImageFormat {
    /// Every format.
    pub const ALL: [ImageFormat; 5] = [
        ImageFormat::Raw,
        ImageFormat::Gzip,
        ImageFormat::Xz,
        ImageFormat::Zstd,
        ImageFormat::Qcow2,
    ];

    /// The format named `name` (`raw`, `gzip`, `xz`, `zstd`, `qcow2`), as an entry's `Format`
    /// says it.
    pub fn parse(name: &str) -> Result<ImageFormat, FormatError> {
        match name.trim().to_ascii_lowercase().as_str() {
            "raw" => Ok(ImageFormat::Raw),
            "gzip" | "gz" => Ok(ImageFormat::Gzip),
            "xz" => Ok(ImageFormat::Xz),
            "zstd" | "zst" => Ok(ImageFormat::Zstd),
            "qcow2" => Ok(ImageFormat::Qcow2),
            other => Err(FormatError::Unknown(other.to_string())),
        }
    }

    /// Its name, as [`ImageFormat::parse`] reads it.
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Gzip => "gzip",
            ImageFormat::Xz => "xz",
            ImageFormat::Zstd => "zstd",
            ImageFormat::Qcow2 => "qcow2",
        }
    }

    /// What an image whose first bytes are `head` is; anything without a known magic is raw
    /// (a disk's first sector is boot code or zeros).
    pub fn sniff(head: &[u8]) -> Sniffed {
        if let Some((_, name)) = UNWRITABLE.iter().find(|(m, _)| head.starts_with(m)) {
            return Sniffed::Unwritable(name);
        }
        let format = if head.starts_with(&[0x1f, 0x8b]) {
            ImageFormat::Gzip
        } else if head.starts_with(&[0xfd, b'7', b'z', b'X', b'Z', 0x00]) {
            ImageFormat::Xz
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            ImageFormat::Zstd
        } else if head.starts_with(b"QFI\xfb") {
            ImageFormat::Qcow2
        } else {
            ImageFormat::Raw
        };
        Sniffed::Writable(format)
    }
}

impl fmt::Display for ImageFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_format_is_told_by_its_magic_bytes() {
        let cases: [(&[u8], Sniffed); 8] = [
            (&[0x1f, 0x8b, 8, 0], Sniffed::Writable(ImageFormat::Gzip)),
            (b"\xfd7zXZ\x00\x00\x04", Sniffed::Writable(ImageFormat::Xz)),
            (
                &[0x28, 0xb5, 0x2f, 0xfd, 0],
                Sniffed::Writable(ImageFormat::Zstd),
            ),
            (
                b"QFI\xfb\x00\x00\x00\x03",
                Sniffed::Writable(ImageFormat::Qcow2),
            ),
            (b"BZh91AY&", Sniffed::Unwritable("bzip2")),
            (&[0xeb, 0x63, 0x90, 0], Sniffed::Writable(ImageFormat::Raw)),
            (&[0; 8], Sniffed::Writable(ImageFormat::Raw)),
            (&[], Sniffed::Writable(ImageFormat::Raw)),
        ];
        for (head, want) in cases {
            assert_eq!(ImageFormat::sniff(head), want, "{head:?}");
        }
    }

    #[test]
    fn a_named_format_is_parsed_or_refused_with_the_known_ones() {
        for f in ImageFormat::ALL {
            assert_eq!(ImageFormat::parse(f.name()), Ok(f));
        }
        assert_eq!(ImageFormat::parse(" ZST "), Ok(ImageFormat::Zstd));
        let other = ImageFormat::parse("iso").unwrap_err().to_string();
        assert!(
            other.contains("the formats are raw, gzip, xz, zstd, qcow2"),
            "{other}"
        );
    }
}
