//! An image's download that survives a dropped connection: when its body breaks off, it is
//! asked again from the byte where it stopped (an HTTP range request, checked against the
//! image's ETag or Last-Modified so that a changed image is never spliced onto the old one),
//! a bounded number of times with jittered, capped waits. A server that stops sending for
//! [`STALL`] is a broken-off body too.

use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use futures::StreamExt;
use reqwest::header::{
    HeaderMap, HeaderValue, ACCEPT_RANGES, CONTENT_RANGE, ETAG, IF_RANGE, LAST_MODIFIED, RANGE,
};
use reqwest::StatusCode;
use shepherd_retry::{Delays, Streak};

/// How long the image's server may send nothing before the download counts as broken off.
pub const STALL: Duration = Duration::from_secs(60);

/// How many times a broken-off download is resumed, in a row without progress in between.
pub const RESUMES: u32 = 5;

/// The waits before resuming: from 1 s, doubling, at most 30 s.
const RESUME_DELAYS: Delays = Delays::new(Duration::from_secs(1), Duration::from_secs(30));

/// Why a download failed.
#[derive(Debug, thiserror::Error)]
pub enum DownloadError {
    /// The HTTP client's error: unreachable, an error status, a body that broke off; without
    /// its URL (which may carry a secret: the installation's error names the URL as shown).
    #[error(transparent)]
    Http(reqwest::Error),
    /// The body broke off and the server cannot resume it where it stopped.
    #[error("it broke off after {served} bytes and cannot be resumed: {why}")]
    NotResumable {
        /// The bytes received before.
        served: u64,
        /// Why not (no ranges, a changed image, a wrong range answered).
        why: String,
    },
    /// A range of the image was asked for, and its server did not answer with that range.
    #[error("asked for bytes {from} to {to}, its server {why}")]
    NoRange {
        /// The range's first byte.
        from: u64,
        /// Its last byte.
        to: u64,
        /// What it answered instead.
        why: String,
    },
    /// It broke off more than [`RESUMES`] times in a row.
    #[error("it broke off {resumes} times in a row, the last time: {last}")]
    GaveUp {
        /// The resumes tried.
        resumes: u32,
        /// The last break's error, without its URL.
        last: reqwest::Error,
    },
}

impl From<reqwest::Error> for DownloadError {
    fn from(error: reqwest::Error) -> Self {
        DownloadError::Http(error.without_url())
    }
}

/// A download in progress.
pub struct Download {
    client: reqwest::Client,
    url: String,
    body: BoxStream<'static, reqwest::Result<Bytes>>,
    /// Its `Content-Length` as first announced.
    announced: Option<u64>,
    /// What a resume is checked against: the ETag, else the Last-Modified time.
    validator: Option<HeaderValue>,
    /// Whether the server said it takes byte ranges.
    ranges: bool,
    served: u64,
    breaks: Streak,
}

impl Download {
    /// Starts downloading `url`.
    pub async fn start(url: &str) -> Result<Download, DownloadError> {
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(30))
            .read_timeout(STALL)
            .build()?;
        let response = client.get(url).send().await?.error_for_status()?;
        let headers = response.headers();
        let validator = headers
            .get(ETAG)
            .filter(|etag| !etag.as_bytes().starts_with(b"W/"))
            .or_else(|| headers.get(LAST_MODIFIED))
            .cloned();
        let ranges = headers.get(ACCEPT_RANGES).is_some_and(|v| v == "bytes");
        Ok(Download {
            announced: response.content_length(),
            validator,
            ranges,
            body: response.bytes_stream().boxed(),
            client,
            url: url.to_string(),
            served: 0,
            breaks: Streak::new(RESUME_DELAYS),
        })
    }

    /// Its length as its server first announced it, if it did.
    pub fn announced(&self) -> Option<u64> {
        self.announced
    }

    /// The image's `len` bytes from `from`, fetched beside the download by a range request
    /// checked against the image's version (qcow2's tables are read so, before its body).
    pub async fn range(&self, from: u64, len: u64) -> Result<Bytes, DownloadError> {
        let to = from + len.max(1) - 1;
        let no_range = |why: String| DownloadError::NoRange { from, to, why };
        let mut headers = HeaderMap::new();
        let range = HeaderValue::from_str(&format!("bytes={from}-{to}"))
            .expect("a range of digits is a header value");
        headers.insert(RANGE, range);
        if let Some(validator) = &self.validator {
            headers.insert(IF_RANGE, validator.clone());
        }
        let response = self
            .client
            .get(&self.url)
            .headers(headers)
            .send()
            .await?
            .error_for_status()?;
        if response.status() != StatusCode::PARTIAL_CONTENT {
            return Err(no_range(format!(
                "answered {} (it takes no byte ranges, or the image changed)",
                response.status()
            )));
        }
        if starts_at(&response) != Some(from) {
            return Err(no_range("answered another range".into()));
        }
        if response.content_length().is_some_and(|n| n != len) {
            return Err(no_range(format!(
                "announced {} bytes",
                response.content_length().unwrap_or_default()
            )));
        }
        let bytes = response.bytes().await?;
        if bytes.len() as u64 != len {
            return Err(no_range(format!("sent {} bytes", bytes.len())));
        }
        Ok(bytes)
    }

    /// The next chunk, resuming where the body broke off; `None` at its end.
    pub async fn next(&mut self) -> Option<Result<Bytes, DownloadError>> {
        loop {
            match self.body.next().await? {
                Ok(chunk) => {
                    self.served += chunk.len() as u64;
                    if !chunk.is_empty() {
                        self.breaks.succeeded();
                    }
                    return Some(Ok(chunk));
                }
                Err(error) => {
                    if let Err(e) = self.resume(error).await {
                        return Some(Err(e));
                    }
                }
            }
        }
    }

    /// Asks for the rest of the image, from the byte where it broke off with `error`.
    async fn resume(&mut self, error: reqwest::Error) -> Result<(), DownloadError> {
        let error = error.without_url();
        let served = self.served;
        let not_resumable = |why: &str| DownloadError::NotResumable {
            served,
            why: format!("{why} ({error})"),
        };
        let Some(validator) = self.validator.clone().filter(|_| self.ranges) else {
            return Err(not_resumable(
                "its server takes no byte ranges or names no version of the image",
            ));
        };
        if self.breaks.failures() >= RESUMES {
            return Err(DownloadError::GaveUp {
                resumes: RESUMES,
                last: error,
            });
        }
        let wait = self.breaks.failed();
        eprintln!(
            "shepherd-agent: the download of {} broke off after {served} bytes ({}); resuming in {} ms",
            shepherd_disks::url_shown(&self.url),
            error,
            wait.as_millis()
        );
        tokio::time::sleep(wait).await;
        let mut headers = HeaderMap::new();
        let range = HeaderValue::from_str(&format!("bytes={served}-"))
            .expect("a range of digits is a header value");
        headers.insert(RANGE, range);
        headers.insert(IF_RANGE, validator);
        let response = match self.client.get(&self.url).headers(headers).send().await {
            // Not answering at all is one more break: the next resume waits longer.
            Err(e) => return Box::pin(self.resume(e)).await,
            Ok(r) => r,
        };
        if response.status() != StatusCode::PARTIAL_CONTENT {
            return Err(not_resumable(&format!(
                "asked for the rest, its server answered {} (the image changed, or it ignores ranges)",
                response.status()
            )));
        }
        if starts_at(&response) != Some(served) {
            return Err(not_resumable("its server answered another range"));
        }
        self.body = response.bytes_stream().boxed();
        Ok(())
    }
}

/// The first byte of the range `response` says it holds.
fn starts_at(response: &reqwest::Response) -> Option<u64> {
    response
        .headers()
        .get(CONTENT_RANGE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("bytes "))
        .and_then(|v| v.split_once('-'))
        .and_then(|(start, _)| start.parse::<u64>().ok())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// Reads a test server's request from `conn`: the byte range it asks for, as its first byte
    /// and the byte after its last (`len`, the image's length, when open-ended), if it asks for one.
    pub(crate) fn read_range(conn: &mut std::net::TcpStream, len: usize) -> Option<(usize, usize)> {
        let mut request = [0u8; 4096];
        let got = conn.read(&mut request).unwrap_or(0);
        let request = String::from_utf8_lossy(&request[..got]).to_lowercase();
        let range = request
            .lines()
            .find_map(|l| l.strip_prefix("range: bytes="))?;
        let (from, to) = range.trim().split_once('-')?;
        let to = to.parse().map_or(len, |to: usize| to + 1);
        Some((from.parse().ok()?, to.min(len)))
    }

    /// How the test's image server behaves.
    #[derive(Clone, Copy)]
    struct Serving {
        /// It says it takes byte ranges, with this ETag.
        etag: Option<&'static str>,
        /// The first response breaks off after this many bytes of the body.
        breaks_after: usize,
        /// A range request whose If-Range names another ETag gets the whole image (200).
        changed: bool,
    }

    /// Serves `image` on loopback as `how` says; answers at most 8 requests.
    fn serve(image: Vec<u8>, how: Serving) -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/image", listener.local_addr().unwrap());
        std::thread::spawn(move || {
            for (n, conn) in listener.incoming().take(8).enumerate() {
                let Ok(mut conn) = conn else { return };
                let from = read_range(&mut conn, image.len()).map(|(from, _)| from);
                let etag = how
                    .etag
                    .map(|e| format!("ETag: \"{e}\"\r\nAccept-Ranges: bytes\r\n"));
                let etag = etag.unwrap_or_default();
                let (status, range, body) = match from {
                    Some(from) if !how.changed => (
                        "206 Partial Content",
                        format!(
                            "Content-Range: bytes {from}-{}/{}\r\n",
                            image.len() - 1,
                            image.len()
                        ),
                        &image[from..],
                    ),
                    _ => ("200 OK", String::new(), &image[..]),
                };
                let head = format!(
                    "HTTP/1.1 {status}\r\n{etag}{range}Content-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = conn.write_all(head.as_bytes());
                let cut = if n == 0 {
                    how.breaks_after.min(body.len())
                } else {
                    body.len()
                };
                let _ = conn.write_all(&body[..cut]);
            }
        });
        url
    }

    async fn fetch(url: &str) -> Result<Vec<u8>, DownloadError> {
        let mut download = Download::start(url).await?;
        let mut got = Vec::new();
        while let Some(chunk) = download.next().await {
            got.extend_from_slice(&chunk?);
        }
        Ok(got)
    }

    fn image() -> Vec<u8> {
        (0..300_000u32).map(|i| (i % 253) as u8).collect()
    }

    #[tokio::test]
    async fn a_broken_off_download_is_resumed_where_it_stopped() {
        let how = Serving {
            etag: Some("v1"),
            breaks_after: 100_000,
            changed: false,
        };
        let url = serve(image(), how);
        assert!(fetch(&url).await.unwrap() == image());
    }

    #[tokio::test]
    async fn a_download_that_cannot_be_resumed_fails_saying_why() {
        for (how, want) in [
            (
                Serving {
                    etag: None,
                    breaks_after: 1000,
                    changed: false,
                },
                "takes no byte ranges",
            ),
            (
                Serving {
                    etag: Some("v1"),
                    breaks_after: 1000,
                    changed: true,
                },
                "the image changed",
            ),
        ] {
            let err = fetch(&serve(image(), how)).await.unwrap_err().to_string();
            assert!(
                err.contains("broke off after 1000 bytes") && err.contains(want),
                "{err}"
            );
        }
    }
}
