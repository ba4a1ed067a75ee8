//! The test support's Postgres databases: named after the test that made them, kept when it
//! fails, dropped by the next run of the same test.

use shepherd_bmdb::testing;

async fn exists(name: &str) -> bool {
    let pool = sqlx::PgPool::connect(&testing::postgres_admin_url())
        .await
        .expect("admin connection");
    let found: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&pool)
            .await
            .expect("pg_database");
    pool.close().await;
    found
}

fn database_of(url: &str) -> String {
    url.rsplit('/')
        .next()
        .unwrap()
        .split('?')
        .next()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn a_failed_runs_database_is_named_after_the_test_and_dropped_by_the_next_run() {
    // A first run that "fails": it makes its database and never drops it.
    let Some(first) = testing::fresh_postgres_database().await else {
        return;
    };
    let first = database_of(&first);
    assert!(
        first.starts_with("st_it_test_databases__a_failed_runs_database_is_named"),
        "{first}"
    );
    assert!(exists(&first).await);
    // The next run of the same test finds it unused and drops it before making its own.
    let second = database_of(&testing::fresh_postgres_database().await.unwrap());
    assert_ne!(first, second);
    assert!(!exists(&first).await, "{first} was left behind");
    assert!(exists(&second).await);
    let pool = sqlx::PgPool::connect(&testing::postgres_admin_url())
        .await
        .expect("admin connection");
    sqlx::query(&format!("DROP DATABASE \"{second}\""))
        .execute(&pool)
        .await
        .expect("drop");
}
