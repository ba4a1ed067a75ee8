//! What can go wrong talking to a machine, worded so the text is a useful work-failure cause.
//! Messages carry their cause in their text and do not also name it as `source()`.

use std::time::Duration;

/// An SSH failure. The `Display` text names the stage that failed.
#[derive(Debug, thiserror::Error)]
pub enum SshError {
    /// The TCP connection could not be made.
    #[error("connecting to {addr}: {error}")]
    Connect {
        /// Where we tried to connect.
        addr: String,
        /// Why it failed.
        error: std::io::Error,
    },
    /// TCP connect, SSH handshake and authentication did not finish in time.
    #[error("connecting to {addr}: no SSH session after {after:?}")]
    ConnectTimeout {
        /// Where we tried to connect.
        addr: String,
        /// The connect timeout.
        after: Duration,
    },
    /// The machine presented another host key than the one pinned for it.
    #[error("host key mismatch: the machine presented {presented} but {pinned} is pinned for it (reinstalled, or someone in the middle?)")]
    HostKeyMismatch {
        /// The pinned key, OpenSSH format.
        pinned: String,
        /// The presented key, OpenSSH format.
        presented: String,
    },
    /// A pinned host key could not be parsed.
    #[error("bad pinned host key {0}")]
    BadHostKey(String),
    /// The server refused our credentials.
    #[error("authentication as {user:?} rejected by the server")]
    AuthRejected {
        /// The user we tried.
        user: String,
    },
    /// The SSH protocol failed (disconnect, bad packet...).
    #[error("ssh: {0}")]
    Protocol(russh::Error),
    /// The SFTP upload failed.
    #[error("sftp upload to {path}: {message}")]
    Sftp {
        /// The remote path.
        path: String,
        /// Why.
        message: String,
    },
    /// The remote command did not finish in time.
    #[error("command did not finish within {after:?}{}", if *killed { "; killed on the machine" } else { "; it may still be running on the machine" })]
    ExecTimeout {
        /// The exec timeout.
        after: Duration,
        /// Whether the command was killed on the machine afterwards.
        killed: bool,
    },
}

impl From<russh::Error> for SshError {
    fn from(e: russh::Error) -> Self {
        SshError::Protocol(e)
    }
}
