//! File descriptors: a server holding many agent connections needs one per connection, and
//! the soft limit processes start with (often 1,024) is far below what the hard limit allows.

/// Raises the soft open-files limit to the hard limit, and warns if that still leaves fewer
/// than `wanted` descriptors (plus a margin for the database, logs and listeners), since the
/// connection caps would then never be reached: accepts would fail first.
pub fn raise_limit_for(wanted: usize) {
    const MARGIN: u64 = 256;
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) if limit < wanted as u64 + MARGIN => tracing::warn!(
            limit,
            wanted = wanted as u64 + MARGIN,
            "the open-files limit is below the connection caps; raise it (LimitNOFILE=) or lower max-connections"
        ),
        Ok(limit) => tracing::debug!(limit, "open-files limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open-files limit"),
    }
}
