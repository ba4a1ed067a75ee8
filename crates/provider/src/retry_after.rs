//! A server's `Retry-After`: how long it asked to be left alone, as the Equinix and Ironic
//! APIs and BMCs send it with 429 and 503. Seconds only; an HTTP date is not read.

use std::time::Duration;

/// The `Retry-After` of an answer's `headers`, if it has one in seconds.
pub fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<Duration> {
    headers
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(Duration::from_secs)
}
