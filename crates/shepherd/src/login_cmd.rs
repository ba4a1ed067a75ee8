//! `shepherd login`: signs a person in at the operator API's identity provider and caches the
//! access token for `--api` commands. It is the OAuth 2.0 flow for native apps (RFC 8252):
//! authorization code with PKCE, the browser sent back to a one-shot listener on loopback.
//! The token is written to a file only its owner can read (0600), and read back by
//! `api_client.rs` when `SHEPHERD_API_TOKEN` is not set.

use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use shepherd_operator::api::signin::{pkce_challenge, random_text};

/// How long the person has to sign in.
const SIGN_IN_WITHIN: Duration = Duration::from_secs(300);
/// Largest request the loopback listener reads (the browser's redirect).
const MAX_REDIRECT: usize = 16 << 10;

/// Settings of `shepherd login`.
#[derive(Debug, Clone, clap::Args)]
pub struct LoginArgs {
    /// The identity provider's issuer URL.
    #[arg(long, env = "SHEPHERD_OIDC_ISSUER")]
    pub issuer: String,
    /// Scopes to ask for besides `openid`, comma-separated (those that give the access token
    /// its role claim, where the provider wants them asked for).
    #[arg(long, env = "SHEPHERD_OIDC_SCOPES", value_delimiter = ',')]
    pub scopes: Vec<String>,
    /// The client id the provider knows the CLI by (a public client: no secret).
    #[arg(long, env = "SHEPHERD_LOGIN_CLIENT", default_value = "shepherd-cli")]
    pub client_id: String,
    /// Where the token is cached.
    #[command(flatten)]
    pub cache: TokenCache,
    /// The API's resource indicator (RFC 8707), for providers that issue JWT access tokens
    /// per resource.
    #[arg(long, env = "SHEPHERD_OIDC_RESOURCE")]
    pub resource: Option<String>,
}

/// Where `shepherd login` caches the token and `--api` commands look for it.
#[derive(Debug, Clone, clap::Args)]
pub struct TokenCache {
    /// Where `shepherd login` caches its token (default: `$XDG_CONFIG_HOME/shepherd/token`,
    /// else `~/.config/shepherd/token`).
    #[arg(long, global = true, env = "SHEPHERD_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,
}

impl TokenCache {
    /// The file: the flag's, else the default.
    pub fn path(&self) -> Option<PathBuf> {
        self.token_file.clone().or_else(|| {
            let config = std::env::var_os("XDG_CONFIG_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".config")))?;
            Some(config.join("shepherd").join("token"))
        })
    }
}

/// The cached token.
#[derive(Debug, Serialize, Deserialize)]
struct Cached {
    access_token: String,
    issuer: String,
    /// Unix seconds after which the token is not used.
    expires_at: i64,
}

/// The cached token in `path`, if there is one that has not expired.
pub fn cached_token(path: &std::path::Path) -> Result<Option<String>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("token file {}", path.display())),
    };
    let cached: Cached = serde_json::from_str(&text)
        .with_context(|| format!("token file {}: not a cached token", path.display()))?;
    let now = chrono::Utc::now().timestamp();
    Ok((cached.expires_at > now).then_some(cached.access_token))
}

/// Runs `shepherd login`.
pub async fn run(args: LoginArgs) -> Result<()> {
    let path = match args.cache.path() {
        Some(path) => path,
        None => bail!("token-file: no HOME or XDG_CONFIG_HOME; give --token-file"),
    };
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let issuer = args.issuer.trim_end_matches('/');
    let discovery: serde_json::Value = http
        .get(format!("{issuer}/.well-known/openid-configuration"))
        .send()
        .await
        .and_then(|r| r.error_for_status())
        .with_context(|| format!("issuer {issuer}: discovery"))?
        .json()
        .await
        .with_context(|| format!("issuer {issuer}: discovery"))?;
    let endpoint = |field: &str| {
        discovery[field]
            .as_str()
            .map(str::to_string)
            .with_context(|| format!("issuer {issuer}: discovery names no {field}"))
    };
    let (authorize, token_endpoint) = (
        endpoint("authorization_endpoint")?,
        endpoint("token_endpoint")?,
    );

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let redirect_uri = format!("http://{}/callback", listener.local_addr()?);
    let (state, verifier) = (random_text(16), random_text(32));
    let challenge = pkce_challenge(&verifier);
    let mut scope = vec!["openid".to_string()];
    scope.extend(args.scopes.iter().cloned());
    let mut url = reqwest::Url::parse(&authorize).context("authorization_endpoint")?;
    {
        let mut query = url.query_pairs_mut();
        query
            .append_pair("response_type", "code")
            .append_pair("client_id", &args.client_id)
            .append_pair("redirect_uri", &redirect_uri)
            .append_pair("scope", &scope.join(" "))
            .append_pair("state", &state)
            .append_pair("code_challenge", &challenge)
            .append_pair("code_challenge_method", "S256");
        if let Some(resource) = &args.resource {
            query.append_pair("resource", resource);
        }
    }
    eprintln!("shepherd login: open this in a browser to sign in:\n{url}");
    let code = tokio::time::timeout(SIGN_IN_WITHIN, receive_code(&listener, &state))
        .await
        .context("nobody signed in within 5 minutes")??;

    let mut form = vec![
        ("grant_type", "authorization_code"),
        ("code", code.as_str()),
        ("redirect_uri", redirect_uri.as_str()),
        ("code_verifier", verifier.as_str()),
        ("client_id", args.client_id.as_str()),
    ];
    if let Some(resource) = &args.resource {
        form.push(("resource", resource.as_str()));
    }
    let answer = http.post(&token_endpoint).form(&form).send().await?;
    let status = answer.status();
    let json: serde_json::Value = answer.json().await.unwrap_or_default();
    if !status.is_success() {
        bail!(
            "the identity provider refused the sign-in ({status}): {} {}",
            json["error"].as_str().unwrap_or(""),
            json["error_description"].as_str().unwrap_or("")
        );
    }
    let access_token = json["access_token"]
        .as_str()
        .context("the identity provider answered no access_token")?;
    let expires_in = json["expires_in"].as_i64().unwrap_or(3600);
    let cached = Cached {
        access_token: access_token.to_string(),
        issuer: issuer.to_string(),
        expires_at: chrono::Utc::now().timestamp() + expires_in,
    };
    write_private(&path, &serde_json::to_vec_pretty(&cached)?)?;
    eprintln!(
        "shepherd login: signed in; the token (valid {}) is in {}",
        humantime::format_duration(Duration::from_secs(expires_in.max(0) as u64)),
        path.display()
    );
    Ok(())
}

/// Waits for the browser's redirect to the loopback listener; its code, once its `state`
/// is this sign-in's. Other requests (a favicon, a stray visitor) are answered 404 and
/// waited past.
async fn receive_code(listener: &tokio::net::TcpListener, state: &str) -> Result<String> {
    loop {
        let (mut stream, _) = listener.accept().await?;
        let mut buf = vec![0u8; MAX_REDIRECT];
        let mut read = 0;
        while read < buf.len() && !buf[..read].windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buf[read..]).await? {
                0 => break,
                n => read += n,
            }
        }
        let head = String::from_utf8_lossy(&buf[..read]);
        let target = head.split_whitespace().nth(1).unwrap_or("");
        let url = reqwest::Url::parse(&format!("http://loopback{target}"));
        let Ok(url) = url.map_err(|_| ()).and_then(|u| match u.path() {
            "/callback" => Ok(u),
            _ => Err(()),
        }) else {
            let _ = stream
                .write_all(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                )
                .await;
            continue;
        };
        let param = |name: &str| {
            url.query_pairs()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.into_owned())
        };
        let (message, outcome) = match (param("state"), param("code"), param("error")) {
            (_, _, Some(error)) => {
                let detail = param("error_description").unwrap_or_default();
                (
                    "Sign-in failed.",
                    Err(anyhow::anyhow!(
                        "the identity provider said {error}: {detail}"
                    )),
                )
            }
            (Some(s), Some(code), None) if s == state => {
                ("Signed in. You can close this tab.", Ok(code))
            }
            _ => (
                "Not this sign-in.",
                Err(anyhow::anyhow!(
                    "the browser came back from another sign-in (state)"
                )),
            ),
        };
        let page = format!("<!doctype html><title>shepherd login</title><p>{message}</p>");
        let reply = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
            page.len()
        );
        let _ = stream.write_all(reply.as_bytes()).await;
        return outcome;
    }
}

/// Writes `bytes` to `path` readable and writable by its owner only, replacing it whole: a
/// temporary file beside it (made 0600 by `tempfile`), synced, then renamed over it.
fn write_private(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    let context = || format!("token file {}", path.display());
    std::fs::create_dir_all(dir).with_context(context)?;
    let mut staged = tempfile::NamedTempFile::new_in(dir).with_context(context)?;
    staged.write_all(bytes).with_context(context)?;
    staged.as_file().sync_all().with_context(context)?;
    staged.persist(path).with_context(context)?;
    Ok(())
}
