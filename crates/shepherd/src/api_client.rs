//! The operator API as the CLI's client: `shepherd machines …` and `shepherd tokens …` with
//! `--api URL` talk to `/api/v1` over HTTPS with the token in `SHEPHERD_API_TOKEN` (else the
//! one `shepherd login` cached), instead of opening the BMDB. A refused request's problem detail becomes the command's one-line error.

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use reqwest::Method;
use serde_json::Value;

/// Where the CLI finds the API, its CA and the token.
#[derive(Debug, Clone, clap::Args)]
pub struct ApiArgs {
    /// The operator API to use instead of the database (`https://shepherd.example:8443`);
    /// the token comes from SHEPHERD_API_TOKEN, else from `shepherd login`'s cache.
    #[arg(long, global = true, env = "SHEPHERD_API")]
    pub api: Option<String>,
    /// A CA (PEM) to trust for the API's certificate, besides the system's.
    #[arg(long, global = true, env = "SHEPHERD_API_CA")]
    pub api_ca: Option<std::path::PathBuf>,
    /// Where `shepherd login` cached its token.
    #[command(flatten)]
    pub cache: crate::login_cmd::TokenCache,
}

impl ApiArgs {
    /// The client, if `--api` is given.
    pub fn client(&self) -> Result<Option<ApiClient>> {
        let Some(base) = &self.api else {
            return Ok(None);
        };
        let token = match std::env::var("SHEPHERD_API_TOKEN")
            .ok()
            .filter(|t| !t.trim().is_empty())
        {
            Some(token) => token,
            None => {
                let cached = match &self.cache.path() {
                    Some(file) => crate::login_cmd::cached_token(file)?,
                    None => None,
                };
                cached.context(
                    "--api needs a token: set SHEPHERD_API_TOKEN, or run shepherd login (none cached, or it expired)",
                )?
            }
        };
        Ok(Some(ApiClient::new(
            base,
            self.api_ca.as_deref(),
            token.trim(),
        )?))
    }
}

/// A client of one API with one token.
pub struct ApiClient {
    base: String,
    http: reqwest::Client,
    token: String,
}

impl ApiClient {
    /// A client of the API at `base`, trusting `ca` besides the system's CAs.
    pub fn new(base: &str, ca: Option<&Path>, token: &str) -> Result<ApiClient> {
        let url = reqwest::Url::parse(base).with_context(|| format!("--api: {base:?}"))?;
        if url.scheme() != "https" {
            bail!("--api: {base} must be https: the token must not cross the network in clear");
        }
        let mut http = reqwest::Client::builder().timeout(Duration::from_secs(60));
        if let Some(ca) = ca {
            let pem = std::fs::read(ca).with_context(|| format!("--api-ca: {}", ca.display()))?;
            let cert = reqwest::Certificate::from_pem(&pem)
                .with_context(|| format!("--api-ca: {}", ca.display()))?;
            http = http.add_root_certificate(cert);
        }
        Ok(ApiClient {
            base: base.trim_end_matches('/').to_string(),
            http: http.build()?,
            token: token.to_string(),
        })
    }

    /// `GET /api/v1{path}`.
    pub async fn get(&self, path: &str) -> Result<Value> {
        self.call(Method::GET, path, None).await
    }

    /// `method /api/v1{path}` with a JSON `body`; the answer's JSON, or the problem's detail
    /// as the error.
    pub async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Result<Value> {
        let url = format!("{}/api/v1{path}", self.base);
        let mut request = self.http.request(method, &url).bearer_auth(&self.token);
        if let Some(body) = body {
            request = request.json(&body);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("operator API {}", self.base))?;
        let status = response.status();
        let text = response.text().await?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            let detail = value["detail"]
                .as_str()
                .map_or(value.to_string(), str::to_string);
            bail!("operator API: {detail} ({status})");
        }
        Ok(value)
    }
}
