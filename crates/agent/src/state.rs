//! The agent's state file: the init it was given and its private key (mode 0600).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use shepherd_proto::shepherd::agent::AgentState;
use shepherd_proto::Message;

/// Largest state file read (a key and an init with a CA certificate).
const MAX_STATE_BYTES: u64 = 1 << 20;

/// `<executable>.state`, next to the agent binary.
pub fn default_path() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let mut name = exe.file_name().unwrap_or_default().to_os_string();
    name.push(".state");
    Ok(exe.with_file_name(name))
}

/// Writes the state atomically (temporary file, fsync, rename), readable only by its owner.
pub fn save(path: &Path, state: &AgentState) -> std::io::Result<()> {
    let tmp = path.with_extension("state.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(&state.encode_to_vec())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

/// Why the state file could not be read.
#[derive(Debug)]
pub enum StateError {
    /// The file could not be read.
    Read {
        /// The state file.
        path: PathBuf,
        /// What reading it said.
        error: std::io::Error,
    },
    /// The file is not an `AgentState`.
    Decode {
        /// The state file.
        path: PathBuf,
        /// What decoding it said.
        error: shepherd_proto::DecodeError,
    },
}

impl std::fmt::Display for StateError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StateError::Read { path, error } => {
                write!(f, "reading state {}: {error}", path.display())
            }
            StateError::Decode { path, error } => {
                write!(f, "decoding state {}: {error}", path.display())
            }
        }
    }
}

impl std::error::Error for StateError {}

/// Reads the state.
pub fn load(path: &Path) -> Result<AgentState, StateError> {
    use std::io::Read;
    let mut raw = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_STATE_BYTES).read_to_end(&mut raw))
        .map_err(|error| StateError::Read {
            path: path.to_path_buf(),
            error,
        })?;
    AgentState::decode(raw.as_slice()).map_err(|error| StateError::Decode {
        path: path.to_path_buf(),
        error,
    })
}
