//! The schema compatibility window, on both backends: a binary runs on its own schema and on
//! newer ones whose migrations admit it, and is refused — migrating nothing — by one that
//! does not.

use shepherd_bmdb::*;

async fn newer_schemas_admit_or_refuse_this_binary(db: Bmdb) {
    assert_eq!(db.schema_window().await.unwrap(), SchemaWindow::THIS_BINARY);
    db.check_schema().await.unwrap();

    // A newer binary adds a table and declares this schema compatible.
    db.apply_foreign_migration(
        SCHEMA_VERSION + 1,
        "expand",
        SCHEMA_VERSION,
        "CREATE TABLE expand_only (x integer)",
    )
    .await
    .unwrap();
    let window = db.schema_window().await.unwrap();
    assert_eq!(
        window,
        SchemaWindow {
            version: SCHEMA_VERSION + 1,
            oldest_compatible: SCHEMA_VERSION,
        }
    );
    db.check_schema().await.unwrap();
    assert_eq!(
        db.migrate().await.unwrap(),
        (SCHEMA_VERSION + 1, SCHEMA_VERSION + 1),
        "nothing to migrate"
    );

    // A later one contracts: binaries of this schema may no longer run.
    db.apply_foreign_migration(
        SCHEMA_VERSION + 2,
        "contract",
        SCHEMA_VERSION + 2,
        "SELECT 1",
    )
    .await
    .unwrap();
    let err = db.check_schema().await.unwrap_err();
    assert!(
        matches!(err, Error::SchemaTooNew { found, oldest_compatible, known }
            if found == SCHEMA_VERSION + 2 && oldest_compatible == found && known == SCHEMA_VERSION),
        "{err:?}"
    );
    assert!(err.to_string().contains("upgrade shepherd"), "{err}");
    assert!(db.migrate().await.is_err());
    assert_eq!(db.schema_version().await.unwrap(), SCHEMA_VERSION + 2);
}

shepherd_bmdb::conformance_tests!(newer_schemas_admit_or_refuse_this_binary);
