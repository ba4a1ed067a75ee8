//! The operator API over a large fleet: `shepherd server` (the release binary) on a seeded
//! SQLite BMDB, with a real OpenID provider (panva's oidc-provider under Node, as the tests
//! run it) issuing RS256 JWT access tokens. Measured side by side in one run, on loopback,
//! requests interleaved so that both sides see the same machine:
//! - the p99 of `GET /api/v1/machines?limit=100` with a JWT (HTTPS) against the web UI's same
//!   page, `/machines?limit=100` (plain HTTP): `api_p99_vs_web`;
//! - what a JWT costs a request: the median of `GET /api/v1/whoami` with the JWT minus its
//!   median with a local token, which is found by its SHA-256 in a cache:
//!   `api_auth_us_per_request`. The server remembers a token it verified (until its `exp`),
//!   so this is the cost of every request but a token's first; that one, which checks the
//!   RS256 signature with the cached key, is measured apart with tokens used once each:
//!   `api_first_jwt_us`.
//!
//! Then, on Postgres, two servers over one fresh BMDB:
//! - the token lookups (index and table scans of `api_tokens`, from Postgres' statistics) that
//!   1000 requests with a junk credential cost, a malformed one and one shaped like a token,
//!   against 1000 distinct unknown tokens, which must each be looked up:
//!   `junk_cookie_db_reads_per_1000` (a cookie and a bearer credential go through the same
//!   lookup);
//! - how long a token revoked through one server is still accepted by the other, against the
//!   revoking server itself: `revocation_seen_by_other_server_s`, the longest of five.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

use crate::stats::quantile;

/// Settings of `shepherd-bench api`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Machines in the BMDB.
    #[arg(long, default_value_t = 100_000)]
    machines: usize,
    /// Requests of each kind measured (after a warm-up of a tenth as many).
    #[arg(long, default_value_t = 2_000)]
    requests: usize,
    /// Tokens used once each, for the cost of a token's first verification.
    #[arg(long, default_value_t = 300)]
    fresh_tokens: usize,
    /// Where to write the report.
    #[arg(long, default_value = "bench/results/api.md")]
    out: PathBuf,
}

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Reads `child`'s stdout until a line starts with each of `prefixes`; the rest of each.
fn announced(child: &mut Child, prefixes: &[&str]) -> Result<Vec<String>> {
    let stdout = child.stdout.take().context("stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let mut found = vec![None; prefixes.len()];
    while found.iter().any(Option::is_none) {
        let line = lines
            .next()
            .context("the child exited before it was ready")??;
        for (i, prefix) in prefixes.iter().enumerate() {
            if let Some(rest) = line.strip_prefix(prefix) {
                found[i] = Some(rest.to_string());
            }
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    Ok(found.into_iter().flatten().collect())
}

/// The OpenID provider, on a free loopback port; its issuer URL.
fn start_provider() -> Result<(Killed, String)> {
    let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
    let dir = std::env::var("SHEPHERD_OIDC_PROVIDER_DIR")
        .unwrap_or_else(|_| format!("{home}/.cache/shepherd/oidc-provider"));
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shepherd/tests/it/common/oidc-idp.mjs"
    );
    let port = shepherd_loops::testing::free_loopback_port().to_string();
    let child = Command::new("node")
        .args([script, &dir, &port])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("node (scripts/test-deps.sh installs it and oidc-provider)")?;
    let mut child = Killed(child);
    let issuer = announced(&mut child.0, &["idp: listening at "])?.remove(0);
    Ok((child, issuer))
}

/// A viewer's JWT from the provider (client credentials).
async fn jwt(issuer: &str) -> Result<String> {
    let form = [
        ("grant_type", "client_credentials"),
        ("scope", "shepherd:viewer"),
        ("resource", "urn:shepherd:api"),
    ];
    let answer: serde_json::Value = reqwest::Client::new()
        .post(format!("{issuer}/token"))
        .basic_auth("ci-pipeline", Some("ci-pipeline-secret"))
        .form(&form)
        .send()
        .await?
        .json()
        .await?;
    let token = answer["access_token"].as_str();
    Ok(token
        .with_context(|| format!("no token: {answer}"))?
        .to_string())
}

/// Times one GET of `url` (with `token`, if any), which must succeed.
async fn timed(client: &reqwest::Client, url: &str, token: Option<&str>) -> Result<Duration> {
    let started = Instant::now();
    let mut request = client.get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    let response = request.send().await?;
    let status = response.status();
    let body = response.bytes().await?;
    ensure!(
        status.is_success(),
        "{url}: {status}: {}",
        String::from_utf8_lossy(&body)
    );
    Ok(started.elapsed())
}

/// Runs `a` and `b`, `a` first on even rounds and `b` first on odd ones; their times.
async fn pair<A, B>(
    round: usize,
    a: impl FnOnce() -> A,
    b: impl FnOnce() -> B,
) -> Result<(Duration, Duration)>
where
    A: std::future::Future<Output = Result<Duration>>,
    B: std::future::Future<Output = Result<Duration>>,
{
    if round.is_multiple_of(2) {
        let a = a().await?;
        Ok((a, b().await?))
    } else {
        let b = b().await?;
        Ok((a().await?, b))
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Starts `shepherd server` over the BMDB at `url` with its operator API (trusting `issuer`)
/// and its web UI, certificates made under `dir`: the server, a client of the API, the API's
/// base URL and the web UI's.
fn start_server(
    shepherd: &std::path::Path,
    url: &str,
    issuer: &str,
    dir: &std::path::Path,
) -> Result<(Killed, reqwest::Client, String, String)> {
    let server = Command::new(shepherd)
        .args(["server", "--database", url, "--listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0", "--web-refresh", "0s"])
        .args([
            "--api-listen",
            "127.0.0.1:0",
            "--api-rate",
            "1000000",
            "--api-burst",
            "1000000",
        ])
        .args(["--oidc-issuer", issuer, "--oidc-audience", "shepherd"])
        .args([
            "--oidc-role-claim",
            "scope",
            "--oidc-scope-clients",
            "ci-pipeline",
            "--oidc-role",
            "shepherd:viewer=viewer",
        ])
        .arg("--dev-certs")
        .arg(dir.join("certs"))
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut server = Killed(server);
    let lines = announced(
        &mut server.0,
        &[
            "shepherd server: operator API at https://",
            "shepherd server: web UI at http://",
        ],
    )?;
    let api_addr: std::net::SocketAddr = lines[0].trim_end_matches("/api/v1").parse()?;
    let web = format!(
        "http://{}",
        lines[1].split('/').next().context("web address")?
    );
    let ca = std::fs::read(dir.join("certs/ca.pem"))?;
    let api_client = reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(&ca)?)
        .resolve("localhost", api_addr)
        .build()?;
    let api = format!("https://localhost:{}/api/v1", api_addr.port());
    Ok((server, api_client, api, web))
}

/// The times measured, per kind of request.
struct Samples {
    web_pages: Vec<Duration>,
    api_pages: Vec<Duration>,
    with_local: Vec<Duration>,
    with_jwt: Vec<Duration>,
    local_alongside: Vec<Duration>,
    first_use: Vec<Duration>,
}

/// The report: a table of both sides and the figures' `key = value` lines.
fn report(args: &Args, warm_up: usize, samples: Samples) -> String {
    let Samples {
        mut web_pages,
        mut api_pages,
        mut with_local,
        mut with_jwt,
        mut local_alongside,
        mut first_use,
    } = samples;

    let (api_p99, web_p99) = (
        quantile(&mut api_pages, 0.99),
        quantile(&mut web_pages, 0.99),
    );
    let (jwt_p50, local_p50) = (quantile(&mut with_jwt, 0.5), quantile(&mut with_local, 0.5));
    let auth_us = (jwt_p50.as_secs_f64() - local_p50.as_secs_f64()).max(0.0) * 1e6;
    let (first_p50, alongside_p50) = (
        quantile(&mut first_use, 0.5),
        quantile(&mut local_alongside, 0.5),
    );
    let first_us = (first_p50.as_secs_f64() - alongside_p50.as_secs_f64()).max(0.0) * 1e6;
    let ratio = ms(api_p99) / ms(web_p99).max(1e-9);
    format!(
        "# Operator API\n\n\
         Run on {} with `shepherd-bench api` (2 cores; release build; loopback). `shepherd server`\n\
         over a SQLite BMDB of {} machines; a real OpenID provider (oidc-provider under Node)\n\
         issues the RS256 JWT. {} requests of each kind, in pairs whose order alternates, after a\n\
         warm-up of {}.\n\n\
         | What | Operator API | Baseline |\n|---|---|---|\n\
         | p99 of a page of 100 machines | {:.2} ms (`/api/v1/machines?limit=100`, HTTPS, JWT) | {:.2} ms (web UI `/machines?limit=100`, plain HTTP) |\n\
         | median of `/api/v1/whoami` | {:.0} µs with the JWT | {:.0} µs with a local token |\n\
         | median of `/api/v1/whoami`, each token's first use | {:.0} µs with {} fresh JWTs | {:.0} µs with a local token |\n\n\
         api_p99_vs_web = {ratio:.2}\n\
         api_auth_us_per_request = {auth_us:.0}\n\
         api_first_jwt_us = {first_us:.0}\n\
         api_p99_ms = {:.2}\n\
         web_p99_ms = {:.2}\n",
        chrono::Utc::now().format("%Y-%m-%d %H:%M UTC"),
        args.machines,
        args.requests,
        warm_up,
        ms(api_p99),
        ms(web_p99),
        jwt_p50.as_secs_f64() * 1e6,
        local_p50.as_secs_f64() * 1e6,
        first_p50.as_secs_f64() * 1e6,
        args.fresh_tokens,
        alongside_p50.as_secs_f64() * 1e6,
        ms(api_p99),
        ms(web_p99),
    )
}

/// What the Postgres part measured.
struct Credentials {
    /// Lookups for 1000 requests with one malformed credential.
    malformed: u64,
    /// Lookups for 1000 requests with one credential shaped like a token, unknown.
    shaped: u64,
    /// Lookups for 1000 distinct unknown tokens.
    distinct: u64,
    /// Longest time the other server still accepted a revoked token, and the revoking one.
    other_server: Duration,
    same_server: Duration,
}

/// Index and table scans of `api_tokens` so far, from Postgres' statistics (written by each
/// backend when it goes idle, so read after a pause).
async fn token_reads(url: &str) -> Result<u64> {
    tokio::time::sleep(Duration::from_secs(11)).await;
    let sql = "SELECT coalesce(idx_scan, 0) + coalesce(seq_scan, 0) FROM pg_stat_user_tables \
               WHERE relname = 'api_tokens'";
    // psql does not take sqlx's parameters (`statement-cache-capacity`).
    let url = url.split('?').next().unwrap_or(url);
    let out = Command::new("psql").args([url, "-Atc", sql]).output()?;
    ensure!(
        out.status.success(),
        "psql: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?.trim().parse()?)
}

/// Runs `shepherd ARGS --database URL`; its stdout.
fn shepherd_on(shepherd: &std::path::Path, url: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(shepherd)
        .args(args)
        .args(["--database", url])
        .output()?;
    ensure!(
        out.status.success(),
        "shepherd {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?.trim().to_string())
}

/// The status of `GET whoami` on `api` with `token`.
async fn whoami(client: &reqwest::Client, api: &str, token: &str) -> Result<reqwest::StatusCode> {
    let url = format!("{api}/whoami");
    Ok(client.get(url).bearer_auth(token).send().await?.status())
}

/// The Postgres part: token lookups for junk credentials, and revocation across servers.
async fn credentials(shepherd: &std::path::Path, issuer: &str) -> Result<Credentials> {
    let url = shepherd_bmdb::testing::fresh_postgres_database()
        .await
        .context("Postgres (SHEPHERD_TEST_POSTGRES_URL)")?;
    shepherd_on(shepherd, &url, &["bmdb", "migrate"])?;
    let token = |name: &str, role: &str| {
        let args = format!("tokens create --name {name} --role {role} --expires 1d");
        shepherd_on(shepherd, &url, &args.split(' ').collect::<Vec<_>>())
    };
    let admin = token("admin", "admin")?;
    let (dir_a, dir_b) = (tempfile::tempdir()?, tempfile::tempdir()?);
    let (_a, client_a, api_a, _) = start_server(shepherd, &url, issuer, dir_a.path())?;
    let (_b, client_b, api_b, _) = start_server(shepherd, &url, issuer, dir_b.path())?;

    let mut reads = Vec::new();
    let shaped = format!("shp_{}", "0".repeat(64));
    let kinds: [&dyn Fn(usize) -> String; 3] =
        [&|_| "shp_junk".to_string(), &|_| shaped.clone(), &|n| {
            format!("shp_{n:064x}")
        }];
    for credential in kinds {
        let before = token_reads(&url).await?;
        for n in 0..1000 {
            let status = whoami(&client_a, &api_a, &credential(n)).await?;
            ensure!(
                status == reqwest::StatusCode::UNAUTHORIZED,
                "a junk credential: {status}"
            );
        }
        reads.push(token_reads(&url).await? - before);
    }

    let (mut other_server, mut same_server) = (Duration::ZERO, Duration::ZERO);
    for round in 0..5 {
        let name = format!("doomed-{round}");
        let doomed = token(&name, "viewer")?;
        ensure!(
            whoami(&client_b, &api_b, &doomed).await?.is_success(),
            "a fresh token refused"
        );
        let revoke = client_a
            .delete(format!("{api_a}/tokens/{name}"))
            .bearer_auth(&admin);
        ensure!(
            revoke.send().await?.status().is_success(),
            "revoking {name}"
        );
        let revoked = Instant::now();
        ensure!(
            !whoami(&client_a, &api_a, &doomed).await?.is_success(),
            "A accepts {name}"
        );
        same_server = same_server.max(revoked.elapsed());
        while whoami(&client_b, &api_b, &doomed).await?.is_success() {
            ensure!(
                revoked.elapsed() < Duration::from_secs(30),
                "B accepts {name} for 30 s"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        other_server = other_server.max(revoked.elapsed());
    }
    Ok(Credentials {
        malformed: reads[0],
        shaped: reads[1],
        distinct: reads[2],
        other_server,
        same_server,
    })
}

/// The report's section of the Postgres part, and its figures.
fn credentials_report(c: &Credentials) -> String {
    format!(
        "\nOn Postgres, two servers over one BMDB; token lookups are the index and table scans of\n\
         `api_tokens` in Postgres' statistics.\n\n\
         | What | Shepherd | Baseline |\n|---|---|---|\n\
         | token lookups for 1000 requests with one junk credential | {} (shaped like a token, unknown); {} (malformed) | {} (1000 distinct unknown tokens) |\n\
         | a revoked token still accepted, longest of 5 | {:.2} s by the other server | {:.3} s by the revoking server |\n\n\
         junk_cookie_db_reads_per_1000 = {}\n\
         revocation_seen_by_other_server_s = {:.2}\n",
        c.shaped,
        c.malformed,
        c.distinct,
        c.other_server.as_secs_f64(),
        c.same_server.as_secs_f64(),
        c.shaped.max(c.malformed),
        c.other_server.as_secs_f64(),
    )
}

/// Runs the benchmark and writes its report.
pub async fn run(args: Args) -> Result<()> {
    let shepherd = crate::binaries::release_binary("shepherd")?;
    eprintln!("api: seeding {} machines", args.machines);
    let (t, _) = crate::scale::writer::seeded(args.machines).await?;
    let made = Command::new(&shepherd)
        .args([
            "tokens",
            "create",
            "--name",
            "bench",
            "--role",
            "viewer",
            "--expires",
            "1d",
        ])
        .args(["--database", &t.url])
        .output()?;
    if !made.status.success() {
        bail!("tokens create: {}", String::from_utf8_lossy(&made.stderr));
    }
    let local = String::from_utf8(made.stdout)?.trim().to_string();
    let (_provider, issuer) = start_provider()?;
    let jwt = jwt(&issuer).await?;
    let dir = tempfile::tempdir()?;
    let (server, api_client, api, web) = start_server(&shepherd, &t.url, &issuer, dir.path())?;
    let web_client = reqwest::Client::new();

    // Each pair is measured in both orders, alternately: the request that follows a heavier
    // one would otherwise be charged for it.
    let warm_up = args.requests / 10;
    let web_page = format!("{web}/machines?limit=100");
    let api_page = format!("{api}/machines?limit=100");
    let (mut web_pages, mut api_pages) = (Vec::new(), Vec::new());
    for i in 0..warm_up + args.requests {
        let (w, a) = pair(
            i,
            || timed(&web_client, &web_page, None),
            || timed(&api_client, &api_page, Some(&jwt)),
        )
        .await?;
        if i >= warm_up {
            web_pages.push(w);
            api_pages.push(a);
        }
    }
    let whoami = format!("{api}/whoami");
    let (mut with_local, mut with_jwt) = (Vec::new(), Vec::new());
    for i in 0..warm_up + args.requests {
        let (l, j) = pair(
            i,
            || timed(&api_client, &whoami, Some(&local)),
            || timed(&api_client, &whoami, Some(&jwt)),
        )
        .await?;
        if i >= warm_up {
            with_local.push(l);
            with_jwt.push(j);
        }
    }
    // Tokens used once each: their first verification, against local tokens alongside.
    let mut fresh = Vec::with_capacity(args.fresh_tokens);
    for _ in 0..args.fresh_tokens {
        fresh.push(self::jwt(&issuer).await?);
    }
    let (mut local_alongside, mut first_use) = (Vec::new(), Vec::new());
    for (i, token) in fresh.iter().enumerate() {
        let (l, f) = pair(
            i,
            || timed(&api_client, &whoami, Some(&local)),
            || timed(&api_client, &whoami, Some(token)),
        )
        .await?;
        local_alongside.push(l);
        first_use.push(f);
    }
    drop(server);
    t.cleanup().await;
    eprintln!("api: token lookups and revocation on Postgres");
    let credentials = credentials(&shepherd, &issuer).await?;
    let samples = Samples {
        web_pages,
        api_pages,
        with_local,
        with_jwt,
        local_alongside,
        first_use,
    };
    let md = report(&args, warm_up, samples) + &credentials_report(&credentials);
    eprint!("{md}");
    std::fs::write(&args.out, md).with_context(|| format!("writing {}", args.out.display()))?;
    Ok(())
}
