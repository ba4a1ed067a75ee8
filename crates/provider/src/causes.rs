//! An HTTP client error as one line with every cause (connection refused, an untrusted
//! certificate, a timeout), not just reqwest's "error sending request", which keeps the cause
//! in its `source()`. Used by the Redfish and Equinix clients for their failure causes.

/// `e` without its URL (the caller names the endpoint) and its causes, each once.
pub fn reqwest_causes(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(cause) = source {
        let msg = cause.to_string();
        // hyper's and rustls's errors sometimes embed their own cause: say it once.
        if !text.contains(&msg) {
            text.push_str(": ");
            text.push_str(&msg);
        }
        source = cause.source();
    }
    text
}
