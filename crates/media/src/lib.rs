//! The media server of bare machines (design.md §21): serves Shepherd's live image to BMCs over
//! HTTPS, each machine's config drive spliced into its slots as the image streams from disk
//! (`image.rs`), behind a URL that names one machine and carries a secret the bare-metal loop
//! recorded for it, until it expires (`serve.rs`). It runs in `shepherd run` beside the loop
//! that hands the URLs out, on the bounded HTTPS listener every Shepherd listener uses.

pub mod image;
pub mod serve;
#[cfg(feature = "testing")]
pub mod testing;

pub use image::{FillError, ImageError, LiveImage};
pub use serve::{MediaMetrics, MediaServer};
