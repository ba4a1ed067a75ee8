//! The shepherd's own SSH key: loaded from a path, or generated and saved there on first use.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use russh::keys::ssh_key::private::Ed25519Keypair;
use russh::keys::ssh_key::LineEnding;
use russh::keys::{Algorithm, PrivateKey};

/// Why the key could not be loaded or created. Never contains key material.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file is readable or writable by group or others.
    #[error(
        "SSH key {path}: mode {mode:04o} lets group or others access it; run `chmod 400 {path}`"
    )]
    TooOpen {
        /// The key file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Reading or writing the file failed.
    #[error("SSH key {path}: {error}")]
    Io {
        /// The key file.
        path: PathBuf,
        /// Why.
        error: std::io::Error,
    },
    /// The file is not an OpenSSH private key we can use.
    #[error("SSH key {path}: {message}")]
    Invalid {
        /// The key file.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

/// Loads the ed25519 private key at `path`, or, if there is no file, generates one and writes it
/// there (OpenSSH format, mode 0400, never overwriting a file that appears meanwhile).
pub fn load_or_generate_key(path: &Path) -> Result<PrivateKey, KeyError> {
    let io = |error| KeyError::Io {
        path: path.to_owned(),
        error,
    };
    match std::fs::metadata(path) {
        Ok(meta) => {
            let mode = meta.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                return Err(KeyError::TooOpen {
                    path: path.to_owned(),
                    mode,
                });
            }
            let text = std::fs::read_to_string(path).map_err(io)?;
            let key = PrivateKey::from_openssh(text.as_bytes()).map_err(|e| KeyError::Invalid {
                path: path.to_owned(),
                message: format!("not an OpenSSH private key: {e}"),
            })?;
            if key.algorithm() != Algorithm::Ed25519 {
                return Err(KeyError::Invalid {
                    path: path.to_owned(),
                    message: format!("is {}, want an ed25519 key", key.algorithm()),
                });
            }
            if key.is_encrypted() {
                return Err(KeyError::Invalid {
                    path: path.to_owned(),
                    message: "is encrypted; shepherd needs an unencrypted key".into(),
                });
            }
            Ok(key)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut seed = [0u8; 32];
            rand::fill(&mut seed);
            let key = PrivateKey::from(Ed25519Keypair::from_seed(&seed));
            let text = key
                .to_openssh(LineEnding::LF)
                .map_err(|e| KeyError::Invalid {
                    path: path.to_owned(),
                    message: format!("encoding a new key: {e}"),
                })?;
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o400)
                .open(path)
                .map_err(io)?;
            file.write_all(text.as_bytes())
                .and_then(|_| file.sync_all())
                .map_err(io)?;
            tracing::info!(path = %path.display(), public_key = %public_key_openssh(&key), "generated a new SSH key");
            Ok(key)
        }
        Err(e) => Err(io(e)),
    }
}

/// The public half in OpenSSH `authorized_keys` format, for operators to install.
pub fn public_key_openssh(key: &PrivateKey) -> String {
    key.public_key()
        .to_openssh()
        .unwrap_or_else(|e| format!("<unencodable key: {e}>"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_then_loads_the_same_key() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id_ed25519");
        let first = load_or_generate_key(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o400);
        let second = load_or_generate_key(&path).unwrap();
        assert_eq!(first.public_key(), second.public_key());
        assert!(public_key_openssh(&first).starts_with("ssh-ed25519 "));
    }

    #[test]
    fn refuses_a_key_readable_by_others() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id_ed25519");
        load_or_generate_key(&path).unwrap();
        for mode in [0o440, 0o404, 0o600 | 0o004, 0o640] {
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
            let err = load_or_generate_key(&path).unwrap_err();
            assert!(matches!(err, KeyError::TooOpen { .. }), "{mode:o}: {err}");
            assert!(err.to_string().contains("chmod 400"), "{err}");
        }
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        load_or_generate_key(&path).unwrap();
    }

    #[test]
    fn refuses_garbage_without_echoing_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("id_ed25519");
        std::fs::write(&path, "-----BEGIN SECRET-----\nhunter2\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o400)).unwrap();
        let err = load_or_generate_key(&path).unwrap_err().to_string();
        assert!(err.contains("not an OpenSSH private key"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn missing_directory_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nope/id_ed25519");
        let err = load_or_generate_key(&path).unwrap_err().to_string();
        assert!(err.contains("nope/id_ed25519"), "{err}");
    }
}
