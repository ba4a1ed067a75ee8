//! A database failover as a connection pool meets it: a pooled connection that reaches a node
//! which became a standby answers writes with SQLSTATE 25006. That is the database's
//! unavailability (the caller releases its work without penalty), and the connection is not
//! handed out again, so the next transaction connects afresh through the router. A primary
//! that dies as it commits leaves the commit in doubt: the caller sees an error for a write
//! the database may have kept, and counts it as such.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use shepherd_bmdb::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::test]
async fn a_connection_that_reached_a_standby_is_unavailability_and_is_dropped() {
    let Some(url) = testing::fresh_postgres_database().await else {
        return;
    };
    // One connection, so that the pool would hand the same one out again.
    let db = Bmdb::open_with(
        &url,
        &OpenOptions {
            max_connections: 1,
            ..OpenOptions::migrating(true)
        },
    )
    .await
    .unwrap();
    testing::make_a_pooled_connection_read_only(&db).await;
    let write = || db.transact(|tx| Box::pin(async move { tx.create_machine().await }));
    let err = write().await.unwrap_err();
    assert!(err.to_string().contains("read-only"), "{err}");
    assert!(err.is_failover(), "{err}");
    assert!(
        err.is_transient(),
        "a standby's refusal is the database's unavailability: {err}"
    );
    write()
        .await
        .expect("the next write runs on a new connection, not on the standby's");
    db.close().await;
}

/// A loopback TCP proxy to Postgres that, once armed, lets the next COMMIT it sees through and
/// then cuts that connection before the server's answer gets back: the primary dying just as
/// it commits, as the client sees it.
struct CommitCutter {
    port: u16,
    armed: Arc<AtomicBool>,
}

impl CommitCutter {
    async fn start(upstream: String) -> CommitCutter {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let armed = Arc::new(AtomicBool::new(false));
        let cutter = armed.clone();
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(&upstream).await else {
                    continue;
                };
                tokio::spawn(Self::pipe(client, server, cutter.clone()));
            }
        });
        CommitCutter { port, armed }
    }

    async fn pipe(client: TcpStream, server: TcpStream, armed: Arc<AtomicBool>) {
        let (mut from_client, mut to_client) = client.into_split();
        let (mut from_server, mut to_server) = server.into_split();
        let frozen = Arc::new(AtomicBool::new(false));
        let answers = tokio::spawn({
            let frozen = frozen.clone();
            async move {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n @ 1..) = from_server.read(&mut buf).await {
                    if frozen.load(Ordering::SeqCst)
                        || to_client.write_all(&buf[..n]).await.is_err()
                    {
                        return;
                    }
                }
            }
        });
        let mut buf = vec![0u8; 64 * 1024];
        while let Ok(n @ 1..) = from_client.read(&mut buf).await {
            let commit = buf[..n].windows(6).any(|w| w == b"COMMIT");
            if commit && armed.swap(false, Ordering::SeqCst) {
                // Nothing the server says from here on reaches the client.
                frozen.store(true, Ordering::SeqCst);
                let _ = to_server.write_all(&buf[..n]).await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                answers.abort();
                return;
            }
            if to_server.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        answers.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ending_whose_commit_is_cut_off_is_counted_in_doubt() {
    let Some(t) = testing::postgres().await else {
        return;
    };
    let upstream = t.url.split('@').nth(1).unwrap().split('/').next().unwrap();
    let cutter = CommitCutter::start(upstream.to_string()).await;
    let through = t
        .url
        .replace(upstream, &format!("127.0.0.1:{}", cutter.port))
        .replace("sslmode=prefer", "sslmode=disable");
    assert!(through.contains("sslmode=disable"), "{through}");
    let db = Bmdb::open(&through).await.unwrap();
    let id = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    // A long interval: no keep-alive commits while the cutter is armed.
    let processor = Processor::ShepherdInitializer;
    let s = testing::session_every(&db, processor, Duration::from_secs(60)).await;
    let start = Retrieval::AgentStart {
        provider: ProviderKind::Sim,
    };
    let Claim::Work(mut w) = s.work(Process::ShepherdAgentStart, start).await.unwrap() else {
        panic!("nothing claimed");
    };
    assert_eq!(db.metrics().endings_in_doubt(processor), 0);

    cutter.armed.store(true, Ordering::SeqCst);
    let err = w
        .finish(TagWrites::none().agent_started(vec![7; AGENT_KEY_LEN]))
        .await
        .unwrap_err();
    assert!(!cutter.armed.load(Ordering::SeqCst), "the COMMIT was cut");
    assert!(err.is_transient(), "{err}");
    assert_eq!(db.metrics().endings_in_doubt(processor), 1);
    // The database kept it: the history, read directly, says so.
    let events: Vec<WorkEvent> =
        t.db.read(move |tx| Box::pin(async move { tx.machine_history(id).await }))
            .await
            .unwrap()
            .into_iter()
            .map(|e| e.event)
            .collect();
    assert_eq!(events, [WorkEvent::Started, WorkEvent::Finished]);
    std::mem::forget(w);
    s.close().await.unwrap();
    db.close().await;
    t.cleanup().await;
}
