//! How an image's URL is shown in logs, errors and the history: without what may be a secret.
//! An image server's basic auth puts a password in the URL's user information, and an object
//! store's presigned URL (S3's `X-Amz-Signature`, Swift's `temp_url_sig`) puts its signature
//! in the query; both let anyone who reads them fetch the image. The machine's agent still
//! gets the whole URL in its installation request: only what people read is cut.

/// `url` with its user information and its query each replaced by `…`, and its fragment left
/// out: `https://…@images.example/os.img?…`. A text that is not a URL is shown up to its
/// first `?` or `#`, and with no `user@`.
pub fn url_shown(url: &str) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let rest = rest.split('#').next().unwrap_or_default();
    let (rest, query) = match rest.split_once('?') {
        Some((rest, _)) => (rest, "?…"),
        None => (rest, ""),
    };
    let end = rest.find('/').unwrap_or(rest.len());
    let (authority, path) = rest.split_at(end);
    let authority = match authority.rsplit_once('@') {
        Some((_, host)) => format!("…@{host}"),
        None => authority.to_string(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{authority}{path}{query}"),
        None => format!("{authority}{path}{query}"),
    }
}

#[cfg(test)]
mod tests {
    use super::url_shown;

    #[test]
    fn secrets_are_cut_and_the_rest_is_kept() {
        let cases = [
            (
                "https://images.example/os.img",
                "https://images.example/os.img",
            ),
            (
                "https://admin:hunter2@images.example:8443/a/os.img",
                "https://…@images.example:8443/a/os.img",
            ),
            (
                "https://bucket.s3.example/os.img?X-Amz-Credential=AKIA&X-Amz-Signature=abc",
                "https://bucket.s3.example/os.img?…",
            ),
            ("http://10.0.2.101/os.img#part", "http://10.0.2.101/os.img"),
            ("http://u:p@host?sig=1", "http://…@host?…"),
            ("not a url?secret", "not a url?…"),
        ];
        for (url, shown) in cases {
            assert_eq!(url_shown(url), shown, "{url}");
        }
    }
}
