//! Keyset pages of the operators' lists (tokens, the audit trail): a page is read with one
//! item more than asked, which tells whether more follow and where the next page starts.

use crate::Error;

/// A page's `limit` must be 1 to `most`.
pub(crate) fn check_page_limit(limit: usize, most: usize) -> Result<(), Error> {
    if limit == 0 || limit > most {
        let problem = format!("must be 1 to {most}");
        return Err(Error::InvalidArgument {
            what: "limit",
            problem,
        });
    }
    Ok(())
}

/// A page read with one item more than `limit` (which tells whether more follow): the first
/// `limit` items, and the last one's `key` if more follow (where the next page starts).
pub(crate) fn last_page_key<T, K>(
    mut items: Vec<T>,
    limit: usize,
    key: impl Fn(&T) -> K,
) -> (Vec<T>, Option<K>) {
    let more = items.len() > limit;
    items.truncate(limit);
    let next = if more { items.last().map(key) } else { None };
    (items, next)
}
