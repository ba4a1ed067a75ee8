//! Provider skips (`sql/provider_skips.rs`): shared through the BMDB until they end.

use super::*;

/// Provider skips: a skip is read back until it ends, a second skip of the same id replaces
/// the first, and skips of another provider are apart.
async fn provider_skips_are_shared_until_they_end(db: Bmdb) {
    let skip = |id: &'static str, provider: ProviderKind, secs: i64| {
        db.transact(move |tx| {
            Box::pin(async move {
                let until = tx.now().await? + chrono::Duration::seconds(secs);
                tx.skip_provider_id(provider, id, until, "refused: 400\0")
                    .await
            })
        })
    };
    let skipped = |provider: ProviderKind| {
        db.read(move |tx| Box::pin(async move { tx.skipped_provider_ids(provider).await }))
    };
    skip("node-b", ProviderKind::Ironic, 600).await.unwrap();
    skip("node-a", ProviderKind::Ironic, -1).await.unwrap();
    skip("node-c", ProviderKind::Static, 600).await.unwrap();
    let now = skipped(ProviderKind::Ironic).await.unwrap();
    assert_eq!(now.len(), 1, "the ended skip is not read: {now:?}");
    assert_eq!(now[0].provider_id, "node-b");
    assert_eq!(now[0].cause, "refused: 400\u{fffd}");
    assert!(now[0].until > now[0].at);
    // Skipped again for longer, with another cause: one row, the new one.
    skip("node-b", ProviderKind::Ironic, 1200).await.unwrap();
    let again = skipped(ProviderKind::Ironic).await.unwrap();
    assert_eq!(again.len(), 1);
    assert!(again[0].until > now[0].until);
    assert_eq!(skipped(ProviderKind::Static).await.unwrap().len(), 1);
}

shepherd_bmdb::conformance_tests!(provider_skips_are_shared_until_they_end,);
