//! A database failover as a connection pool meets it: a pooled connection that reaches a node
//! which became a standby answers writes with SQLSTATE 25006. That is the database's
//! unavailability (the caller releases its work without penalty), and the connection is not
//! handed out again, so the next transaction connects afresh through the router.

use shepherd_bmdb::{testing, Bmdb, OpenOptions};

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
