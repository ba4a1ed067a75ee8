//! The SSH client against a real OpenSSH sshd on loopback.

use std::os::unix::fs::PermissionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use shepherd_ssh::testing::{free_loopback_port, random_key, Sshd};
use shepherd_ssh::{parse_public_key, Auth, SshClient, SshConfig, SshError};

/// The settings of a client logging in with `key` as the user running the tests.
fn config(key: &shepherd_ssh::PrivateKey) -> SshConfig {
    let mut config = SshConfig::new(Auth::Key(Arc::new(key.clone())));
    config.user = whoami();
    config.connect_timeout = Duration::from_secs(5);
    config
}

fn client(key: &shepherd_ssh::PrivateKey) -> SshClient {
    SshClient::new(config(key))
}

fn whoami() -> String {
    let out = std::process::Command::new("id")
        .arg("-un")
        .output()
        .unwrap();
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A fresh key and a real sshd that trusts it.
fn trusting_sshd() -> (shepherd_ssh::PrivateKey, Sshd) {
    let key = random_key();
    let sshd = Sshd::start(&[key.public_key()]);
    (key, sshd)
}

#[tokio::test]
async fn exec_upload_and_host_key() {
    let (key, sshd) = trusting_sshd();
    let ssh = client(&key);
    let session = ssh.connect(&sshd.addr(), None).await.unwrap();
    assert_eq!(session.host_key(), sshd.host_key());

    let out = session
        .exec(
            "cat; echo err >&2; exit 3",
            b"from stdin",
            Duration::from_secs(10),
        )
        .await
        .unwrap();
    assert_eq!(out.stdout, b"from stdin");
    assert_eq!(out.stderr, b"err\n");
    assert_eq!(out.exit_status, Some(3));
    assert!(!out.truncated);

    let target = sshd.dir().join("agent");
    let payload: Vec<u8> = (0..3_000_000u32).map(|i| (i % 251) as u8).collect();
    session
        .upload(target.to_str().unwrap(), &payload, 0o755)
        .await
        .unwrap();
    assert_eq!(std::fs::read(&target).unwrap(), payload);
    let mode = std::fs::metadata(&target).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o755);
    // Uploading again replaces the file; no temporary files are left behind.
    session
        .upload(target.to_str().unwrap(), b"#!/bin/sh\necho v2\n", 0o755)
        .await
        .unwrap();
    let out = session
        .exec(target.to_str().unwrap(), b"", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"v2\n");
    let leftovers: Vec<_> = std::fs::read_dir(sshd.dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".upload-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    session.close().await;
}

#[tokio::test]
async fn stdout_is_bounded() {
    let (key, sshd) = trusting_sshd();
    let mut config = config(&key);
    config.max_stdout = 1000;
    let session = SshClient::new(config)
        .connect(&sshd.addr(), None)
        .await
        .unwrap();
    let out = session
        .exec("head -c 5000000 /dev/zero", b"", Duration::from_secs(20))
        .await
        .unwrap();
    assert_eq!(out.stdout.len(), 1000);
    assert!(out.truncated);
    assert_eq!(out.exit_status, Some(0));
}

#[tokio::test]
async fn pinned_host_key_must_match() {
    let key = random_key();
    let mut sshd = Sshd::start(&[key.public_key()]);
    let ssh = client(&key);
    let pinned = parse_public_key(&sshd.host_key()).unwrap();
    ssh.connect(&sshd.addr(), Some(&pinned))
        .await
        .unwrap()
        .close()
        .await;

    sshd.change_host_key();
    let err = match ssh.connect(&sshd.addr(), Some(&pinned)).await {
        Err(e) => e,
        Ok(_) => panic!("connected despite a changed host key"),
    };
    match &err {
        SshError::HostKeyMismatch {
            pinned: p,
            presented,
        } => {
            assert_eq!(p, &pinned.to_openssh().unwrap());
            assert_eq!(presented, &sshd.host_key());
        }
        other => panic!("want a host key mismatch, got {other}"),
    }
    assert!(err.to_string().contains("host key mismatch"), "{err}");
}

#[tokio::test]
async fn unknown_client_key_is_rejected() {
    let trusted = random_key();
    let sshd = Sshd::start(&[trusted.public_key()]);
    let stranger = random_key();
    match client(&stranger).connect(&sshd.addr(), None).await {
        Err(SshError::AuthRejected { .. }) => {}
        Err(other) => panic!("want AuthRejected, got {other}"),
        Ok(_) => panic!("a stranger's key was accepted"),
    }
}

/// A command that overruns its timeout is ended on the machine, not only abandoned: its
/// process (the remote shell, whose pid it wrote down) is gone soon after the timeout, long
/// before its own 30 s would have ended it.
#[tokio::test]
async fn exec_timeout_ends_the_remote_command_and_closes_the_channel() {
    let (key, sshd) = trusting_sshd();
    let session = client(&key).connect(&sshd.addr(), None).await.unwrap();
    let pid_file = sshd.dir().join("pid");
    let cmd = format!("echo $$ > {}; sleep 30; echo done", pid_file.display());
    let started = Instant::now();
    let err = session
        .exec(&cmd, b"", Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(matches!(err, SshError::ExecTimeout { .. }), "{err}");
    let pid = std::fs::read_to_string(&pid_file).unwrap();
    let proc = std::path::PathBuf::from(format!("/proc/{}", pid.trim()));
    // The sshd runs on this host as this user: its command's process is visible here.
    while proc.exists() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the timed-out command (pid {}) is still running: {:?}; sshd said: {}",
            pid.trim(),
            std::fs::read_to_string(proc.join("stat")),
            sshd.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The connection stays usable after a timed-out command.
    let out = session
        .exec("echo ok", b"", Duration::from_secs(10))
        .await
        .unwrap();
    assert_eq!(out.stdout, b"ok\n");
    session.close().await;
}

#[tokio::test]
async fn connect_failures_are_told_apart() {
    let key = random_key();
    // Nothing listens: connection refused.
    let port = free_loopback_port();
    match client(&key)
        .connect(&format!("127.0.0.1:{port}"), None)
        .await
    {
        Err(SshError::Connect { .. }) => {}
        Err(other) => panic!("want Connect, got {other}"),
        Ok(_) => panic!("connected to nothing"),
    }
    // Something accepts TCP but never speaks SSH: the connect timeout fires.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = silent.accept().await {
            held.push(s);
        }
    });
    let mut config = SshConfig::new(Auth::Key(Arc::new(key)));
    config.connect_timeout = Duration::from_millis(300);
    match SshClient::new(config).connect(&addr, None).await {
        Err(SshError::ConnectTimeout { after, .. }) => {
            assert_eq!(after, Duration::from_millis(300))
        }
        Err(other) => panic!("want ConnectTimeout, got {other}"),
        Ok(_) => panic!("connected to a silent listener"),
    }
}

#[tokio::test]
async fn handshake_bursts_beyond_the_cap_all_succeed() {
    let (key, sshd) = trusting_sshd();
    let mut config = config(&key);
    config.max_handshakes = 4;
    config.connect_timeout = Duration::from_secs(20);
    let ssh = Arc::new(SshClient::new(config));
    let tasks: Vec<_> = (0..24)
        .map(|i| {
            let (ssh, addr) = (ssh.clone(), sshd.addr());
            tokio::spawn(async move {
                let s = ssh.connect(&addr, None).await?;
                let out = s
                    .exec(&format!("echo {i}"), b"", Duration::from_secs(20))
                    .await?;
                s.close().await;
                Ok::<_, SshError>(out.stdout)
            })
        })
        .collect();
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap().unwrap(), format!("{i}\n").into_bytes());
    }
}

/// Replacing an uploaded file never leaves a moment without one: an agent started while
/// another upload of it runs (two takeovers of machines on one host, or a re-takeover while
/// the old agent runs) always finds a complete executable.
#[tokio::test]
async fn an_upload_replaces_the_file_without_a_moment_without_it() {
    let (key, sshd) = trusting_sshd();
    let session = client(&key).connect(&sshd.addr(), None).await.unwrap();
    let target = sshd.dir().join("agent");
    let path = target.to_str().unwrap().to_string();
    session
        .upload(&path, b"#!/bin/sh\necho v0\n", 0o755)
        .await
        .unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (stop, target) = (stop.clone(), target.clone());
        std::thread::spawn(move || {
            use std::os::unix::fs::PermissionsExt;
            // (missing, incomplete or not executable, seen complete)
            let mut seen = (0u32, 0u32, 0u32);
            let started = Instant::now();
            while !stop.load(std::sync::atomic::Ordering::Relaxed)
                && started.elapsed() < Duration::from_secs(60)
            {
                let (Ok(meta), Ok(bytes)) = (std::fs::metadata(&target), std::fs::read(&target))
                else {
                    seen.0 += 1;
                    continue;
                };
                let text = String::from_utf8_lossy(&bytes);
                let version = text
                    .strip_prefix("#!/bin/sh\necho v")
                    .and_then(|rest| rest.strip_suffix('\n'));
                let whole = version.is_some_and(|v| v.parse::<u32>().is_ok());
                if whole && meta.permissions().mode() & 0o111 == 0o111 {
                    seen.2 += 1;
                } else {
                    seen.1 += 1;
                }
            }
            seen
        })
    };
    for i in 0..40 {
        session
            .upload(&path, format!("#!/bin/sh\necho v{i}\n").as_bytes(), 0o755)
            .await
            .unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (missing, incomplete, complete) = watcher.join().unwrap();
    assert_eq!(
        (missing, incomplete),
        (0, 0),
        "the target was missing or incomplete while uploads replaced it ({complete} reads were whole)"
    );
    assert!(complete > 0, "the watcher read the file");
    assert_eq!(std::fs::read(&target).unwrap(), b"#!/bin/sh\necho v39\n");
}
