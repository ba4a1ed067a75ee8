//! The SSH client the Initializer takes machines over with (design.md §8): an ed25519 client key
//! kept on disk with strict permissions, connects bounded by a timeout and a cap on concurrent
//! handshakes, host-key pinning, SFTP upload and command execution with bounded output.

mod announce;
mod client;
mod error;
mod key;

#[cfg(feature = "testing")]
pub mod testing;

pub use announce::shell_quote;
pub use client::{Auth, ExecOutput, SshClient, SshConfig, SshSession, Staged};
pub use error::SshError;
pub use key::{load_or_generate_key, public_key_openssh, KeyError};
pub use russh::keys::ssh_key::LineEnding;
pub use russh::keys::{PrivateKey, PublicKey};

/// Parses an OpenSSH public key line (`ssh-ed25519 AAAA… [comment]`), e.g. a pinned host key.
pub fn parse_public_key(openssh: &str) -> Result<PublicKey, SshError> {
    PublicKey::from_openssh(openssh.trim())
        .map_err(|e| SshError::BadHostKey(format!("{openssh:?}: {e}")))
}
