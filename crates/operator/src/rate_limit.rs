//! Token buckets by key (a peer, an identity), and the layer that puts every route a stranger
//! can reach behind one per peer: the operator API's guard, the sign-in routes and the web
//! pages on the API listener, `/metrics` and the pages on the plain-HTTP listener. A peer is
//! its IPv4 address, or its IPv6 /64 (one host holds a whole /64, and would otherwise get a
//! fresh bucket with each address it rotates to).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Router;

/// A rate: so many requests per second, after a burst.
#[derive(Debug, Clone, Copy)]
pub struct RateSpec {
    /// Steady requests per second.
    pub per_second: f64,
    /// Requests allowed at once.
    pub burst: f64,
}

/// The rate each peer gets on the plain-HTTP listener (`/metrics`, the read-only pages), and
/// by default on the API listener: about what a person or a scraper needs, many times over.
pub const DEFAULT_RATE: RateSpec = RateSpec {
    per_second: 50.0,
    burst: 100.0,
};

/// Token buckets by key. The map is bounded: when full it starts afresh, which only ever lets
/// more requests through, never fewer.
pub struct RateLimiter {
    rate: RateSpec,
    buckets: Mutex<HashMap<String, (f64, Instant)>>,
}

/// A request over its key's rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OverRate;

impl RateLimiter {
    const MAX_KEYS: usize = 100_000;

    /// Buckets that each hold `rate`.
    pub fn new(rate: RateSpec) -> RateLimiter {
        RateLimiter {
            rate,
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes one request from `key`'s bucket, or says it is empty.
    pub fn admit(&self, key: &str) -> Result<(), OverRate> {
        let mut buckets = self.buckets.lock().unwrap();
        if buckets.len() >= Self::MAX_KEYS && !buckets.contains_key(key) {
            buckets.clear();
        }
        let now = Instant::now();
        let (tokens, at) = buckets
            .entry(key.to_string())
            .or_insert((self.rate.burst, now));
        let refilled = *tokens + now.duration_since(*at).as_secs_f64() * self.rate.per_second;
        *tokens = refilled.min(self.rate.burst);
        *at = now;
        if *tokens < 1.0 {
            return Err(OverRate);
        }
        *tokens -= 1.0;
        Ok(())
    }
}

/// The bucket key of a peer at `ip`: the IPv4 address (also when mapped into IPv6), or the
/// IPv6 /64 the address is in.
pub fn peer_key(ip: IpAddr) -> String {
    match ip {
        IpAddr::V4(v4) => v4.to_string(),
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => v4.to_string(),
            None => {
                let s = v6.segments();
                format!("{:x}:{:x}:{:x}:{:x}::/64", s[0], s[1], s[2], s[3])
            }
        },
    }
}

/// `app` with every request counted against its peer's bucket of `rate`: one over it is
/// answered 429 with `Retry-After: 1`, before any of its work is done (a session lookup, a
/// token request to the identity provider). A request whose peer is not known (no
/// `ConnectInfo`) is let through.
pub fn per_peer(app: Router, rate: RateSpec) -> Router {
    let limiter = Arc::new(RateLimiter::new(rate));
    app.layer(axum::middleware::from_fn_with_state(limiter, admit_peer))
}

async fn admit_peer(State(limiter): State<Arc<RateLimiter>>, req: Request, next: Next) -> Response {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| peer_key(c.0.ip()));
    if let Some(peer) = peer {
        if limiter.admit(&peer).is_err() {
            return slow_down();
        }
    }
    next.run(req).await
}

/// The plain answer to a request over its peer's or its identity's rate: 429 with
/// `Retry-After: 1`.
pub fn slow_down() -> Response {
    let answer = (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::RETRY_AFTER, "1")],
        "too many requests; slow down\n",
    );
    answer.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Addresses of one IPv6 /64 share a bucket; IPv4, mapped or not, is one address each.
    #[test]
    fn a_peer_is_an_ipv4_address_or_an_ipv6_64() {
        let key = |s: &str| peer_key(s.parse().unwrap());
        assert_eq!(key("2001:db8:1:2::1"), key("2001:db8:1:2:ffff:1:2:3"));
        assert_eq!(key("2001:db8:1:2::1"), "2001:db8:1:2::/64");
        assert_ne!(key("2001:db8:1:2::1"), key("2001:db8:1:3::1"));
        assert_eq!(key("::ffff:192.0.2.7"), "192.0.2.7");
        assert_ne!(key("192.0.2.7"), key("192.0.2.8"));
        let limiter = RateLimiter::new(RateSpec {
            per_second: 0.001,
            burst: 2.0,
        });
        let rotating = ["2001:db8::1", "2001:db8::2", "2001:db8::3"].map(key);
        assert_eq!(limiter.admit(&rotating[0]), Ok(()));
        assert_eq!(limiter.admit(&rotating[1]), Ok(()));
        assert_eq!(limiter.admit(&rotating[2]), Err(OverRate));
    }

    /// Behind the layer, a peer past its burst is answered 429 before the route does any
    /// work: of 300 requests with junk cookies the route sees the burst, not 300.
    #[tokio::test]
    async fn a_peer_past_its_burst_gets_429_before_any_work() {
        use std::sync::atomic::{AtomicU64, Ordering};
        let worked = Arc::new(AtomicU64::new(0));
        let counted = worked.clone();
        let route = axum::routing::get(move || {
            counted.fetch_add(1, Ordering::Relaxed);
            async { "page" }
        });
        // So slow a refill that the burst is all the route can see, however slow the run.
        let rate = RateSpec {
            per_second: 0.001,
            burst: 20.0,
        };
        let app = per_peer(Router::new().route("/machines", route), rate);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = app.into_make_service_with_connect_info::<SocketAddr>();
        let served = tokio::spawn(async move { axum::serve(listener, app).await });
        let client = reqwest::Client::new();
        let mut limited = 0;
        for n in 0..300 {
            let answer = client
                .get(format!("http://{addr}/machines"))
                .header("cookie", format!("__Host-shepherd-session=junk{n}"))
                .send()
                .await
                .unwrap();
            if answer.status() == StatusCode::TOO_MANY_REQUESTS {
                assert_eq!(answer.headers()[header::RETRY_AFTER], "1");
                limited += 1;
            }
        }
        let worked = worked.load(Ordering::Relaxed);
        assert_eq!(worked, 20, "the route did work for {worked} requests");
        assert_eq!(limited + worked, 300);
        served.abort();
    }
}
