//! The headers every page and API answer carries, whatever route made it: no other
//! site may frame a page (the machine page has decommission buttons), nothing an operator saw
//! is kept in a cache, responses are not sniffed into another type, no address leaks to
//! another site in a referrer, and over HTTPS browsers are told to stay on HTTPS. Set on the
//! router each listener serves, so no route can be added without them.

use axum::http::header::{
    HeaderName, HeaderValue, CACHE_CONTROL, REFERRER_POLICY, STRICT_TRANSPORT_SECURITY,
    X_CONTENT_TYPE_OPTIONS, X_FRAME_OPTIONS,
};
use axum::response::Response;
use axum::Router;

/// The headers of every answer, and their values.
const ALWAYS: [(HeaderName, &str); 5] = [
    (X_FRAME_OPTIONS, "DENY"),
    // The pages run no script and load nothing from elsewhere; their styles are inline.
    (axum::http::header::CONTENT_SECURITY_POLICY, CSP),
    (X_CONTENT_TYPE_OPTIONS, "nosniff"),
    // Not `no-referrer`: with it a browser sends `Origin: null` on a form POST, which the
    // web actions' same-origin check rightly refuses.
    (REFERRER_POLICY, "same-origin"),
    (CACHE_CONTROL, "no-store"),
];

/// What a page may load and who may frame it: its own site only, no script at all, inline
/// styles (each page carries its own), forms posted only to this site, no framing.
pub const CSP: &str = "default-src 'self'; script-src 'none'; style-src 'self' 'unsafe-inline'; \
                       img-src 'self' data:; form-action 'self'; base-uri 'none'; \
                       frame-ancestors 'none'";

/// One year, as HSTS preload lists ask.
const HSTS: &str = "max-age=31536000";

/// `app` with the headers on every answer; `https` adds HSTS (never sent over plain HTTP,
/// where browsers ignore it).
pub fn secured(app: Router, https: bool) -> Router {
    app.layer(axum::middleware::map_response(
        move |mut response: Response| async move {
            let headers = response.headers_mut();
            for (name, value) in ALWAYS {
                headers
                    .entry(name)
                    .or_insert(HeaderValue::from_static(value));
            }
            if https {
                headers.insert(STRICT_TRANSPORT_SECURITY, HeaderValue::from_static(HSTS));
            }
            response
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::get;
    use tower::ServiceExt;

    #[tokio::test]
    async fn every_answer_carries_the_headers_and_hsts_only_over_https() {
        for https in [false, true] {
            let app = secured(Router::new().route("/x", get(|| async { "x" })), https);
            for path in ["/x", "/no-such-route"] {
                let request = axum::http::Request::get(path)
                    .body(axum::body::Body::empty())
                    .unwrap();
                let response = app.clone().oneshot(request).await.unwrap();
                let headers = response.headers();
                for (name, value) in ALWAYS {
                    assert_eq!(headers[&name], value, "{path}");
                }
                assert_eq!(
                    headers.get(STRICT_TRANSPORT_SECURITY).is_some(),
                    https,
                    "{path}"
                );
            }
        }
    }
}
