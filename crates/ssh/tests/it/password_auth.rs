//! Password authentication, the alternative to the shepherd's key, against an in-process SSH
//! server (russh's server side) over real TCP: the right password gets a working session,
//! a wrong one gets AuthRejected.

use std::sync::Arc;
use std::time::Duration;

use russh::server::{Auth as ServerAuth, Msg, Session};
use russh::{Channel, ChannelId};
use shepherd_ssh::testing::random_key;
use shepherd_ssh::{Auth, SshClient, SshConfig, SshError};

#[derive(Clone)]
struct PasswordServer;

impl russh::server::Handler for PasswordServer {
    type Error = russh::Error;

    async fn auth_password(
        &mut self,
        user: &str,
        password: &str,
    ) -> Result<ServerAuth, Self::Error> {
        Ok(if user == "operator" && password == "correct horse" {
            ServerAuth::Accept
        } else {
            ServerAuth::reject()
        })
    }

    async fn channel_open_session(
        &mut self,
        _channel: Channel<Msg>,
        reply: russh::server::ChannelOpenHandle,
        _session: &mut Session,
    ) -> Result<(), Self::Error> {
        reply.accept().await;
        Ok(())
    }

    async fn exec_request(
        &mut self,
        channel: ChannelId,
        data: &[u8],
        session: &mut Session,
    ) -> Result<(), Self::Error> {
        session.channel_success(channel)?;
        session.data(
            channel,
            format!("ran {}", String::from_utf8_lossy(data)).into_bytes(),
        )?;
        session.exit_status_request(channel, 0)?;
        session.eof(channel)?;
        session.close(channel)?;
        Ok(())
    }
}

async fn server() -> String {
    let config = Arc::new(russh::server::Config {
        keys: vec![random_key()],
        auth_rejection_time: Duration::from_millis(10),
        auth_rejection_time_initial: Some(Duration::ZERO),
        ..Default::default()
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((socket, _)) = listener.accept().await {
            let config = config.clone();
            tokio::spawn(async move {
                if let Ok(session) = russh::server::run_stream(config, socket, PasswordServer).await
                {
                    let _ = session.await;
                }
            });
        }
    });
    addr
}

fn client(password: &str) -> SshClient {
    let mut config = SshConfig::new(Auth::Password(password.into()));
    config.user = "operator".into();
    config.connect_timeout = Duration::from_secs(10);
    SshClient::new(config)
}

#[tokio::test]
async fn right_password_works_wrong_one_is_rejected() {
    let addr = server().await;
    let session = client("correct horse").connect(&addr, None).await.unwrap();
    let out = session
        .exec("/root/agent", b"", Duration::from_secs(10))
        .await
        .unwrap();
    // This server is no shell: it answers with the command it was asked to run, which
    // starts the agent in place of a shell that first announced its pid.
    let ran = String::from_utf8(out.stdout).unwrap();
    assert!(
        ran.starts_with("ran ") && ran.ends_with("exec sh -c '/root/agent'"),
        "{ran}"
    );
    assert_eq!(out.exit_status, Some(0));
    session.close().await;

    match client("wrong").connect(&addr, None).await {
        Err(SshError::AuthRejected { user }) => assert_eq!(user, "operator"),
        Err(other) => panic!("want AuthRejected, got {other}"),
        Ok(_) => panic!("a wrong password was accepted"),
    }
}
