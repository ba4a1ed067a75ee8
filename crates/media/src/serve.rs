//! `GET`/`HEAD /live/{machine}/{token}/live.iso`: a machine's live image for its BMC. The URL
//! names one machine and carries the secret the bare-metal loop recorded for it; the image is
//! served while that grant has not expired, in whole or by the byte range the BMC asks for
//! (BMCs read virtual media on demand). An unknown machine, a wrong or expired secret all get
//! the same 404; the BMDB failing is a 503 (Shepherd's own unavailability, never the
//! machine's). Grants are cached for seconds, so a BMC's many range reads cost few database
//! reads and a stranger's guesses cost a bounded number.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use sha2::{Digest, Sha256};
use shepherd_bmdb::Bmdb;
use uuid::Uuid;

use crate::image::{Filled, LiveImage};

/// How long a grant (or its absence) read from the BMDB is reused.
const GRANT_TTL: Duration = Duration::from_secs(10);
/// Most grants (and absences) cached.
const MAX_CACHED: usize = 4096;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// The media server's counters. Cheap to clone; clones share values.
#[derive(Debug, Clone, Default)]
pub struct MediaMetrics {
    requests: Family<ResultLabels, Counter>,
    bytes: Counter,
}

/// The results a request is counted under.
const RESULTS: [&str; 6] = [
    "whole",
    "range",
    "head",
    "not_found",
    "bad_range",
    "unavailable",
];

impl MediaMetrics {
    /// Adds `shepherd_media_requests_total{result}` and `shepherd_media_bytes_total`.
    pub fn register(&self, registry: &mut Registry) {
        for result in RESULTS {
            let _ = self.requests.get_or_create(&ResultLabels { result });
        }
        let requests = "Requests for live images, by result (whole, range, head, not_found, bad_range, unavailable)";
        registry.register("shepherd_media_requests", requests, self.requests.clone());
        let bytes = "Bytes of live images sent to BMCs";
        registry.register("shepherd_media_bytes", bytes, self.bytes.clone());
    }

    fn count(&self, result: &'static str) {
        self.requests.get_or_create(&ResultLabels { result }).inc();
    }
}

/// What a request found for its machine and secret.
#[derive(Clone)]
enum Lookup {
    /// The grant is good: the slots' bytes for this machine.
    Granted(Arc<Filled>),
    /// No grant for this machine and secret (unknown, wrong, expired, or not fitting).
    Refused,
}

/// Grants looked up lately, by machine and the digest of the secret asked with, with when.
type GrantCache = HashMap<(Uuid, [u8; 32]), (Instant, Lookup)>;

/// The media server: the live image, the BMDB that holds the grants, a short-lived cache of
/// them, and its counters.
pub struct MediaServer {
    image: Arc<LiveImage>,
    db: Bmdb,
    cache: Mutex<GrantCache>,
    metrics: MediaMetrics,
}

impl MediaServer {
    /// A server of `image` whose grants are in `db`.
    pub fn new(image: Arc<LiveImage>, db: Bmdb, metrics: MediaMetrics) -> Arc<MediaServer> {
        Arc::new(MediaServer {
            image,
            db,
            cache: Mutex::new(HashMap::new()),
            metrics,
        })
    }

    /// The routes.
    pub fn router(self: &Arc<Self>) -> Router {
        Router::new()
            .route(
                "/live/{machine}/{token}/live.iso",
                axum::routing::get(live_image).head(live_image),
            )
            .with_state(self.clone())
    }

    /// The grant of `machine` for `token`: from the cache, else from the BMDB. The secret is
    /// compared as a digest, so the comparison takes the same time wherever it differs.
    async fn lookup(&self, machine: Uuid, token: &str) -> Result<Lookup, shepherd_bmdb::Error> {
        let key = (machine, Sha256::digest(token.as_bytes()).into());
        if let Some((at, found)) = self.cache.lock().expect("cache").get(&key) {
            if at.elapsed() < GRANT_TTL {
                return Ok(found.clone());
            }
        }
        let grant = self
            .db
            .read(move |tx| Box::pin(async move { tx.media_grant(machine).await }))
            .await?;
        let found = match grant {
            Some(g) if Sha256::digest(g.token.as_bytes()).as_slice() == key.1 => {
                match self.image.fill(&g.config) {
                    Ok(filled) => Lookup::Granted(Arc::new(filled)),
                    Err(e) => {
                        tracing::warn!(%machine, error = %e, "a machine's config drive does not fit the live image");
                        Lookup::Refused
                    }
                }
            }
            _ => Lookup::Refused,
        };
        let mut cache = self.cache.lock().expect("cache");
        if cache.len() >= MAX_CACHED {
            cache.retain(|_, (at, _)| at.elapsed() < GRANT_TTL);
            if cache.len() >= MAX_CACHED {
                cache.clear();
            }
        }
        cache.insert(key, (Instant::now(), found.clone()));
        Ok(found)
    }
}

/// The one byte range a `Range` header asks for, within an image of `len` bytes: `Ok(None)`
/// for no header, or one the server may ignore (several ranges, another unit); `Err` for one
/// that cannot be satisfied.
fn requested_range(headers: &HeaderMap, len: u64) -> Result<Option<Range<u64>>, ()> {
    let Some(value) = headers.get(header::RANGE).and_then(|v| v.to_str().ok()) else {
        return Ok(None);
    };
    let Some(spec) = value.trim().strip_prefix("bytes=") else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None);
    }
    let (first, last) = spec.split_once('-').ok_or(())?;
    let number = |s: &str| s.trim().parse::<u64>().map_err(|_| ());
    let range = match (first.trim(), last.trim()) {
        ("", suffix) => {
            let n = number(suffix)?.min(len);
            len - n..len
        }
        (start, "") => number(start)?..len,
        (start, end) => number(start)?..number(end)?.saturating_add(1).min(len),
    };
    if range.start >= len || range.start >= range.end {
        return Err(());
    }
    Ok(Some(range))
}

async fn live_image(
    State(server): State<Arc<MediaServer>>,
    Path((machine, token)): Path<(String, String)>,
    method: Method,
    headers: HeaderMap,
) -> Response {
    let metrics = &server.metrics;
    let not_found = || {
        metrics.count("not_found");
        StatusCode::NOT_FOUND.into_response()
    };
    let Ok(machine) = machine.parse::<Uuid>() else {
        return not_found();
    };
    if token.is_empty() || token.len() > 128 {
        return not_found();
    }
    let filled = match server.lookup(machine, &token).await {
        Ok(Lookup::Granted(filled)) => filled,
        Ok(Lookup::Refused) => return not_found(),
        Err(e) => {
            tracing::warn!(%machine, error = %e, "cannot read a live image's grant: the BMDB is unavailable");
            metrics.count("unavailable");
            return StatusCode::SERVICE_UNAVAILABLE.into_response();
        }
    };
    let len = server.image.len();
    let (status, range) = match requested_range(&headers, len) {
        Ok(Some(range)) => (StatusCode::PARTIAL_CONTENT, range),
        Ok(None) => (StatusCode::OK, 0..len),
        Err(()) => {
            metrics.count("bad_range");
            let mut refused = StatusCode::RANGE_NOT_SATISFIABLE.into_response();
            refused.headers_mut().insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&format!("bytes */{len}")).expect("ascii"),
            );
            return refused;
        }
    };
    let mut response = if method == Method::HEAD {
        metrics.count("head");
        Response::new(Body::empty())
    } else {
        metrics.count(if status == StatusCode::OK {
            "whole"
        } else {
            "range"
        });
        metrics.bytes.inc_by(range.end - range.start);
        Response::new(Body::from_stream(
            server.image.stream(filled, range.clone()),
        ))
    };
    *response.status_mut() = status;
    let h = response.headers_mut();
    let value = |s: String| HeaderValue::from_str(&s).expect("ascii");
    h.insert(
        header::CONTENT_LENGTH,
        value((range.end - range.start).to_string()),
    );
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-iso9660-image"),
    );
    h.insert(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    if status == StatusCode::PARTIAL_CONTENT {
        let end = range.end - 1;
        h.insert(
            header::CONTENT_RANGE,
            value(format!("bytes {}-{end}/{len}", range.start)),
        );
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(value: &str, len: u64) -> Result<Option<Range<u64>>, ()> {
        let mut h = HeaderMap::new();
        h.insert(header::RANGE, HeaderValue::from_str(value).unwrap());
        requested_range(&h, len)
    }

    #[test]
    fn byte_ranges_are_read_as_rfc_9110_says() {
        assert_eq!(requested_range(&HeaderMap::new(), 100), Ok(None));
        assert_eq!(range("bytes=0-9", 100), Ok(Some(0..10)));
        assert_eq!(range("bytes=90-", 100), Ok(Some(90..100)));
        assert_eq!(range("bytes=-10", 100), Ok(Some(90..100)));
        assert_eq!(range("bytes=-1000", 100), Ok(Some(0..100)));
        assert_eq!(range("bytes=50-1000", 100), Ok(Some(50..100)));
        assert_eq!(
            range("bytes=0-1,5-6", 100),
            Ok(None),
            "several ranges: the whole"
        );
        assert_eq!(range("items=0-1", 100), Ok(None));
        assert_eq!(range("bytes=100-", 100), Err(()));
        assert_eq!(range("bytes=9-3", 100), Err(()));
        assert_eq!(range("bytes=x-3", 100), Err(()));
    }
}
