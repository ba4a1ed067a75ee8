//! The repository's tidy checks live in this crate's test (`tests/tidy/main.rs`), which reads
//! the tracked files as text and syntax (`syn`) and builds none of the workspace's crates:
//! `cargo test -p shepherd-tidy` runs them in seconds on a fresh checkout.
