//! The web UI over a large fleet: `shepherd server` (release binary) on a seeded SQLite BMDB,
//! and one client paging `/machines` and filtering it by state, as an operator does.
//! Measured: the p99 of its requests.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result};

use crate::stats::quantile;

/// The filters an operator pages through: every machine, then each state.
const FILTERS: [&str; 6] = [
    "",
    "heartbeating",
    "stale",
    "in-backoff",
    "agent-starting",
    "provided",
];

/// Pages followed per filter and round.
const PAGES: usize = 5;

/// The p99 (ms) and the number of requests of one client paging the web UI of a fleet of `n`
/// machines for `rounds` rounds.
pub async fn p99_ms(shepherd: &Path, n: usize, rounds: usize) -> Result<(f64, usize)> {
    let (t, _) = super::writer::seeded(n).await?;
    let dir = tempfile::tempdir()?;
    let mut server = Command::new(shepherd)
        .args(["server", "--database", &t.url, "--listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0", "--web-refresh", "0s"])
        // One client measures latency, not the per-peer limit.
        .args(["--api-rate", "1000000", "--api-burst", "1000000"])
        .arg("--dev-certs")
        .arg(dir.path().join("certs"))
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let result = page_through(&mut server, rounds).await;
    let _ = server.kill();
    let _ = server.wait();
    t.cleanup().await;
    result
}

async fn page_through(server: &mut std::process::Child, rounds: usize) -> Result<(f64, usize)> {
    let stdout = server.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let base = loop {
        let line = lines.next().context("the server exited")??;
        if let Some(rest) = line.strip_prefix("shepherd server: web UI at http://") {
            let addr = rest.split('/').next().context("web UI address")?;
            break format!("http://{addr}");
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let client = reqwest::Client::new();
    let mut latencies = Vec::new();
    for _ in 0..rounds {
        for filter in FILTERS {
            let mut url = format!("{base}/machines?state={filter}");
            for _ in 0..PAGES {
                let started = Instant::now();
                let response = client.get(&url).send().await?;
                anyhow::ensure!(
                    response.status().is_success(),
                    "{url}: {}",
                    response.status()
                );
                let page = response.text().await?;
                latencies.push(started.elapsed());
                match next_page(&page) {
                    Some(next) => url = format!("{base}{next}"),
                    None => break,
                }
            }
        }
    }
    let p99 = quantile(&mut latencies, 0.99);
    Ok((p99.as_secs_f64() * 1e3, latencies.len()))
}

/// The "Next page" link of a listing page.
fn next_page(page: &str) -> Option<String> {
    let at = page.find(r#"id="next""#)?;
    let tag_start = page[..at].rfind("<a ")?;
    let href = page[tag_start..].split(r#"href=""#).nth(1)?;
    Some(href.split('"').next()?.replace("&amp;", "&"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_link_is_found() {
        let page =
            r#"<p><a href="/machines?state=stale&amp;after=abc" id="next">Next page »</a></p>"#;
        assert_eq!(
            next_page(page).as_deref(),
            Some("/machines?state=stale&after=abc")
        );
        assert_eq!(next_page("<p>no more</p>"), None);
    }
}
