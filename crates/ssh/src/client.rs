//! Connecting, uploading and running commands, each step bounded.

use std::borrow::Cow;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use russh::client::{self, Handle};
use russh::keys::{PrivateKey, PrivateKeyWithHashAlg, PublicKey, PublicKeyOrCertificate};
use russh::{cipher, ChannelMsg, Disconnect, Preferred};
use russh_sftp::client::SftpSession;
use russh_sftp::protocol::{FileAttributes, OpenFlags};
use tokio::io::AsyncWriteExt;
use tokio::sync::Semaphore;

use crate::announce::{announcing, kill_group_command, shell_quote, PidLine};
use crate::error::SshError;

/// How long killing a timed-out command may take.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

/// How we prove who we are.
#[derive(Clone)]
pub enum Auth {
    /// Public-key authentication with the shepherd's key.
    Key(Arc<PrivateKey>),
    /// Password authentication.
    Password(String),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Key(k) => write!(f, "Key({})", crate::public_key_openssh(k)),
            Auth::Password(_) => f.write_str("Password(<redacted>)"),
        }
    }
}

/// Client settings (design.md §17 defaults: user root, connect timeout 2 s).
#[derive(Debug, Clone)]
pub struct SshConfig {
    /// Remote user.
    pub user: String,
    /// Credentials.
    pub auth: Auth,
    /// Bound on TCP connect + SSH handshake + authentication.
    pub connect_timeout: Duration,
    /// Most handshakes in flight at once; sshd's MaxStartups drops connections beyond its limit.
    pub max_handshakes: usize,
    /// Port used when an address has none.
    pub default_port: u16,
    /// Most stdout bytes kept from a command (the rest is read and dropped).
    pub max_stdout: usize,
    /// Most stderr bytes kept from a command.
    pub max_stderr: usize,
}

impl SshConfig {
    /// Defaults for `auth`: user root, 2 s connect timeout, 8 concurrent handshakes, port 22,
    /// 1 MiB of stdout and 64 KiB of stderr.
    pub fn new(auth: Auth) -> Self {
        SshConfig {
            user: "root".into(),
            auth,
            connect_timeout: Duration::from_secs(2),
            max_handshakes: 8,
            default_port: 22,
            max_stdout: 1 << 20,
            max_stderr: 64 << 10,
        }
    }
}

/// An SSH client shared by all workers of a loop (it owns the handshake cap).
pub struct SshClient {
    config: SshConfig,
    russh: Arc<client::Config>,
    handshakes: Semaphore,
}

/// What a remote command did.
#[derive(Debug, Clone, Default)]
pub struct ExecOutput {
    /// Exit status, if the command exited (rather than dying of a signal).
    pub exit_status: Option<u32>,
    /// Signal that killed it, if any.
    pub exit_signal: Option<String>,
    /// Standard output, at most `max_stdout` bytes.
    pub stdout: Vec<u8>,
    /// Standard error, at most `max_stderr` bytes.
    pub stderr: Vec<u8>,
    /// Output was cut at the bound.
    pub truncated: bool,
}

/// One authenticated connection to a machine.
pub struct SshSession {
    handle: Handle<HostKeyCheck>,
    host_key: PublicKey,
    max_stdout: usize,
    max_stderr: usize,
}

/// Records the presented host key and refuses it if another one is pinned.
struct HostKeyCheck {
    pinned: Option<PublicKey>,
    presented: Arc<Mutex<Option<PublicKey>>>,
}

impl client::Handler for HostKeyCheck {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        server_key: &PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let key = match server_key {
            PublicKeyOrCertificate::PublicKey { key, .. } => key.clone(),
            PublicKeyOrCertificate::Certificate(cert) => PublicKey::from(cert.public_key().clone()),
        };
        let ok = self
            .pinned
            .as_ref()
            .is_none_or(|p| p.key_data() == key.key_data());
        *self.presented.lock().unwrap() = Some(key);
        Ok(ok)
    }
}

fn openssh(key: &PublicKey) -> String {
    let mut key = key.clone();
    key.set_comment("");
    key.to_openssh()
        .unwrap_or_else(|e| format!("<unencodable: {e}>"))
}

impl SshClient {
    /// A client with these settings.
    pub fn new(config: SshConfig) -> Self {
        let russh = client::Config {
            // A safety net for stuck connections; callers bound each step more tightly.
            inactivity_timeout: Some(Duration::from_secs(300)),
            nodelay: true,
            preferred: Preferred {
                // AES-GCM first: with AES-NI on both ends it costs a fraction of the CPU of
                // chacha20-poly1305 (russh's and OpenSSH's first choice), and agent uploads
                // are megabytes per machine.
                cipher: Cow::Borrowed(&[
                    cipher::AES_256_GCM,
                    cipher::AES_128_GCM,
                    cipher::CHACHA20_POLY1305,
                    cipher::AES_256_CTR,
                    cipher::AES_128_CTR,
                ]),
                ..Preferred::default()
            },
            ..Default::default()
        };
        SshClient {
            handshakes: Semaphore::new(config.max_handshakes.max(1)),
            config,
            russh: Arc::new(russh),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SshConfig {
        &self.config
    }

    /// Connects and authenticates to `addr` (`host`, `host:port`, `[v6]:port`). With `pinned`,
    /// a machine presenting any other host key is refused with [`SshError::HostKeyMismatch`].
    pub async fn connect(
        &self,
        addr: &str,
        pinned: Option<&PublicKey>,
    ) -> Result<SshSession, SshError> {
        let target = with_port(addr, self.config.default_port);
        let _permit = self
            .handshakes
            .acquire()
            .await
            .expect("handshake semaphore is never closed");
        let presented = Arc::new(Mutex::new(None));
        let handler = HostKeyCheck {
            pinned: pinned.cloned(),
            presented: presented.clone(),
        };
        let attempt = async {
            let socket = tokio::net::TcpStream::connect(&target)
                .await
                .map_err(|error| SshError::Connect {
                    addr: target.clone(),
                    error,
                })?;
            let _ = socket.set_nodelay(true);
            let mut handle = match client::connect_stream(self.russh.clone(), socket, handler).await
            {
                Ok(h) => h,
                Err(russh::Error::UnknownKey) => {
                    let presented = presented.lock().unwrap().clone();
                    return Err(SshError::HostKeyMismatch {
                        pinned: pinned.map(openssh).unwrap_or_default(),
                        presented: presented.as_ref().map(openssh).unwrap_or_default(),
                    });
                }
                Err(e) => return Err(e.into()),
            };
            let auth = match &self.config.auth {
                Auth::Key(key) => {
                    handle
                        .authenticate_publickey(
                            self.config.user.clone(),
                            PrivateKeyWithHashAlg::new(key.clone(), None),
                        )
                        .await?
                }
                Auth::Password(pw) => {
                    handle
                        .authenticate_password(self.config.user.clone(), pw.clone())
                        .await?
                }
            };
            if !auth.success() {
                let _ = handle.disconnect(Disconnect::ByApplication, "", "").await;
                return Err(SshError::AuthRejected {
                    user: self.config.user.clone(),
                });
            }
            Ok(handle)
        };
        let handle = tokio::time::timeout(self.config.connect_timeout, attempt)
            .await
            .map_err(|_| SshError::ConnectTimeout {
                addr: target.clone(),
                after: self.config.connect_timeout,
            })??;
        let host_key = presented
            .lock()
            .unwrap()
            .clone()
            .expect("the handshake checked a host key");
        Ok(SshSession {
            handle,
            host_key,
            max_stdout: self.config.max_stdout,
            max_stderr: self.config.max_stderr,
        })
    }
}

/// `addr` with `default_port` appended unless it names a port.
fn with_port(addr: &str, default_port: u16) -> String {
    if addr.parse::<SocketAddr>().is_ok() {
        return addr.to_string();
    }
    if let Ok(ip) = addr.parse::<IpAddr>() {
        return SocketAddr::new(ip, default_port).to_string();
    }
    match addr.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => addr.to_string(),
        _ => format!("{addr}:{default_port}"),
    }
}

/// How long the remote `mv` that puts an upload into place may take.
const RENAME_TIMEOUT: Duration = Duration::from_secs(10);

impl SshSession {
    /// The host key the machine presented, OpenSSH format without comment.
    pub fn host_key(&self) -> String {
        openssh(&self.host_key)
    }

    /// Uploads `bytes` to `path` with `mode`: written to a temporary name next to it first and
    /// renamed into place, so a running old copy is never overwritten in place (ETXTBSY) and a
    /// cut-off upload never leaves a half-written executable at `path`.
    pub async fn upload(&self, path: &str, bytes: &[u8], mode: u32) -> Result<(), SshError> {
        self.stage(path, bytes, mode)
            .await?
            .put_in_place(self, RENAME_TIMEOUT)
            .await
    }

    /// The first half of [`SshSession::upload`]: writes `bytes` with `mode` to a temporary
    /// name next to `path`. Nothing is at `path` until [`Staged::put_in_place`]; a caller that
    /// drops the [`Staged`] instead leaves the temporary file behind (and touches the machine
    /// no more).
    pub async fn stage(&self, path: &str, bytes: &[u8], mode: u32) -> Result<Staged, SshError> {
        let err = |message: String| SshError::Sftp {
            path: path.to_string(),
            message,
        };
        let channel = self.handle.channel_open_session().await?;
        channel.request_subsystem(true, "sftp").await?;
        let sftp = SftpSession::new(channel.into_stream())
            .await
            .map_err(|e| err(format!("starting sftp: {e}")))?;
        let tmp = format!("{path}.upload-{:08x}", rand::random::<u32>());
        let written = async {
            let attrs = FileAttributes {
                permissions: Some(mode),
                ..Default::default()
            };
            let mut file = sftp
                .open_with_flags_and_attributes(
                    tmp.clone(),
                    OpenFlags::CREATE | OpenFlags::TRUNCATE | OpenFlags::WRITE,
                    attrs.clone(),
                )
                .await
                .map_err(|e| err(format!("creating {tmp}: {e}")))?;
            file.write_all(bytes)
                .await
                .map_err(|e| err(format!("writing: {e}")))?;
            file.shutdown()
                .await
                .map_err(|e| err(format!("closing: {e}")))?;
            // The server's umask applies at creation; set the mode explicitly.
            sftp.set_metadata(tmp.clone(), attrs)
                .await
                .map_err(|e| err(format!("setting mode {mode:o}: {e}")))
        }
        .await;
        if let Err(e) = written {
            let _ = sftp.remove_file(tmp).await;
            let _ = sftp.close().await;
            return Err(e);
        }
        Ok(Staged {
            sftp,
            tmp,
            path: path.to_string(),
        })
    }

    /// Runs `command` with `stdin` as its input and waits for it to end, at most `timeout`.
    /// The channel is closed explicitly on every path (a dropped channel stays open on the
    /// server, keeping the command's session alive). A command that overruns `timeout` is
    /// killed on the machine first, with everything it started (module `announce` says how):
    /// left running, it could still act after the caller gave up on it.
    pub async fn exec(
        &self,
        command: &str,
        stdin: &[u8],
        timeout: Duration,
    ) -> Result<ExecOutput, SshError> {
        let mut channel = self.handle.channel_open_session().await?;
        let mut out = ExecOutput::default();
        let mut announced = PidLine::default();
        let run = async {
            channel.exec(true, announcing(command)).await?;
            channel.data(stdin).await?;
            channel.eof().await?;
            while let Some(msg) = channel.wait().await {
                match msg {
                    ChannelMsg::Data { data } => {
                        let data = announced.output(&data);
                        keep(&mut out.stdout, &data, self.max_stdout, &mut out.truncated)
                    }
                    ChannelMsg::ExtendedData { data, ext: 1 } => {
                        keep(&mut out.stderr, &data, self.max_stderr, &mut out.truncated)
                    }
                    ChannelMsg::ExitStatus { exit_status } => out.exit_status = Some(exit_status),
                    ChannelMsg::ExitSignal { signal_name, .. } => {
                        out.exit_signal = Some(format!("{signal_name:?}"))
                    }
                    ChannelMsg::Close => break,
                    _ => {}
                }
            }
            let rest = announced.rest();
            keep(&mut out.stdout, &rest, self.max_stdout, &mut out.truncated);
            Ok::<_, SshError>(())
        };
        let result = tokio::time::timeout(timeout, run).await;
        let killed = match result {
            Err(_) => self.kill_group(announced.pid()).await,
            Ok(_) => false,
        };
        let _ = channel.close().await;
        match result {
            Ok(Ok(())) => Ok(out),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(SshError::ExecTimeout {
                after: timeout,
                killed,
            }),
        }
    }

    /// Kills process group `pid` (a timed-out command's) over a channel of its own, within
    /// [`KILL_TIMEOUT`]; whether `kill` said it did. A command that never announced its pid
    /// cannot be killed.
    async fn kill_group(&self, pid: Option<u32>) -> bool {
        let Some(pid) = pid else {
            return false;
        };
        let kill = async {
            let mut channel = self.handle.channel_open_session().await?;
            channel.exec(true, kill_group_command(pid)).await?;
            channel.eof().await?;
            let mut status = None;
            while let Some(msg) = channel.wait().await {
                match msg {
                    ChannelMsg::ExitStatus { exit_status } => status = Some(exit_status),
                    ChannelMsg::Close => break,
                    _ => {}
                }
            }
            let _ = channel.close().await;
            Ok::<_, russh::Error>(status == Some(0))
        };
        match tokio::time::timeout(KILL_TIMEOUT, kill).await {
            Ok(Ok(killed)) => killed,
            Ok(Err(e)) => {
                tracing::warn!(pid, error = %e, "killing a timed-out command failed; it may still run on the machine");
                false
            }
            Err(_) => {
                tracing::warn!(pid, "killing a timed-out command did not finish in time; it may still run on the machine");
                false
            }
        }
    }

    /// Disconnects politely.
    pub async fn close(self) {
        let _ = self
            .handle
            .disconnect(Disconnect::ByApplication, "", "")
            .await;
    }
}

/// An upload written to its temporary name, not yet at its path ([`SshSession::stage`]).
pub struct Staged {
    sftp: SftpSession,
    tmp: String,
    path: String,
}

impl Staged {
    /// Renames the staged file to its path, within `timeout`. Plain SFTP rename refuses an
    /// existing target, and removing it first leaves a moment without one (an agent started
    /// then is not found); rename(2) through the shell replaces it atomically. Without a
    /// shell, remove and rename.
    pub async fn put_in_place(
        self,
        session: &SshSession,
        timeout: Duration,
    ) -> Result<(), SshError> {
        let Staged { sftp, tmp, path } = self;
        let command = format!("mv -f {} {}", shell_quote(&tmp), shell_quote(&path));
        let replaced = session
            .exec(&command, b"", timeout)
            .await
            .is_ok_and(|out| out.exit_status == Some(0));
        let result = if replaced {
            Ok(())
        } else {
            let _ = sftp.remove_file(path.clone()).await;
            let renamed = sftp.rename(tmp.clone(), path.clone()).await;
            renamed.map_err(|e| SshError::Sftp {
                path: path.clone(),
                message: format!("renaming into place: {e}"),
            })
        };
        if result.is_err() {
            let _ = sftp.remove_file(tmp).await;
        }
        let _ = sftp.close().await;
        result
    }
}

fn keep(buf: &mut Vec<u8>, data: &[u8], max: usize, truncated: &mut bool) {
    let room = max.saturating_sub(buf.len());
    if data.len() > room {
        *truncated = true;
    }
    buf.extend_from_slice(&data[..data.len().min(room)]);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_port_is_added_only_when_missing() {
        assert_eq!(with_port("10.0.0.1", 22), "10.0.0.1:22");
        assert_eq!(with_port("10.0.0.1:2222", 22), "10.0.0.1:2222");
        assert_eq!(with_port("::1", 22), "[::1]:22");
        assert_eq!(with_port("[::1]:2222", 22), "[::1]:2222");
        assert_eq!(with_port("host.example", 22), "host.example:22");
        assert_eq!(with_port("host.example:2200", 22), "host.example:2200");
    }

    #[test]
    fn output_is_bounded() {
        let (mut buf, mut cut) = (Vec::new(), false);
        keep(&mut buf, b"hello", 8, &mut cut);
        assert!(!cut);
        keep(&mut buf, b"world", 8, &mut cut);
        assert_eq!(buf, b"hellowor");
        assert!(cut);
    }

    #[test]
    fn passwords_are_not_debug_printed() {
        let dbg = format!("{:?}", SshConfig::new(Auth::Password("hunter2".into())));
        assert!(!dbg.contains("hunter2"), "{dbg}");
    }
}
