//! OpenID Connect bearer tokens: JWT access tokens from one identity provider, given by its
//! issuer URL. The provider's keys come from discovery and its JWKS, are cached, and are
//! fetched again when a token names a key not seen yet (at most every ten seconds, so that
//! made-up key ids cannot make Shepherd hammer the provider). A token must be signed by one of
//! those keys with that key's own algorithm — so `none`, and HS256 "signed" with a public key,
//! never verify — and carry this issuer, this audience, and `exp`/`nbf` within a bounded
//! clock allowance. Its role comes from one claim through the configured mapping.
//!
//! While the provider is down, keys already fetched keep verifying tokens until they expire;
//! a token signed with a key not yet fetched is refused with the reason.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::Value;
use shepherd_bmdb::Role;

use super::policy::Principal;
use super::problem::{Kind, Problem};

/// Keys are fetched again at most this often for an unknown key id.
pub const MIN_REFETCH: Duration = Duration::from_secs(5);
/// Keys older than this are fetched again when next used (kept if that fails).
const KEYS_MAX_AGE: Duration = Duration::from_secs(3600);
/// Largest discovery document or key set read.
const MAX_DOCUMENT: usize = 256 << 10;
/// Each request to the provider must finish within this.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest clock allowance a configuration may ask for.
pub const MAX_LEEWAY: Duration = Duration::from_secs(300);

/// Which claim holds a token's roles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RoleClaim {
    /// `groups`: an array of group names.
    Groups,
    /// `roles`: an array of role names.
    Roles,
    /// `scope`: scopes separated by spaces (OAuth 2.0).
    Scope,
}

impl RoleClaim {
    fn name(self) -> &'static str {
        match self {
            RoleClaim::Groups => "groups",
            RoleClaim::Roles => "roles",
            RoleClaim::Scope => "scope",
        }
    }

    /// The values the claim holds in `claims`.
    fn values(self, claims: &serde_json::Map<String, Value>) -> Vec<String> {
        match claims.get(self.name()) {
            Some(Value::String(s)) => s.split_whitespace().map(str::to_string).collect(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_str())
                .map(str::to_string)
                .collect(),
            _ => Vec::new(),
        }
    }
}

/// How to trust one identity provider.
#[derive(Debug, Clone)]
pub struct OidcSettings {
    /// The issuer URL (`https://id.example.com/realms/ops`), exactly as tokens carry it.
    pub issuer: String,
    /// The audience tokens must be for.
    pub audience: String,
    /// The claim that holds roles.
    pub role_claim: RoleClaim,
    /// Claim values and the role each gives; a token gets the highest of its values' roles.
    pub roles: Vec<(String, Role)>,
    /// Clock allowance for `exp` and `nbf`.
    pub leeway: Duration,
    /// A CA (PEM) to trust for the provider's certificate, besides the system's.
    pub ca_pem: Option<Vec<u8>>,
}

/// A configuration problem, found at start-up.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct InvalidOidc(String);

impl OidcSettings {
    /// Checks what can be checked without the provider.
    pub fn validate(&self) -> Result<(), InvalidOidc> {
        let bad = |m: String| Err(InvalidOidc(m));
        let url = match reqwest::Url::parse(&self.issuer) {
            Ok(url) => url,
            Err(e) => return bad(format!("oidc-issuer: {:?} is not a URL: {e}", self.issuer)),
        };
        let loopback = matches!(url.host_str(), Some("127.0.0.1" | "localhost" | "[::1]"));
        if url.scheme() != "https" && !(url.scheme() == "http" && loopback) {
            return bad(format!(
                "oidc-issuer: {} must be https (http only on loopback)",
                self.issuer
            ));
        }
        if self.audience.trim().is_empty() {
            return bad("oidc-audience: required with oidc-issuer".into());
        }
        if self.roles.is_empty() {
            return bad("oidc-role: give at least one VALUE=ROLE, or no token gets a role".into());
        }
        if self.leeway > MAX_LEEWAY {
            return bad(format!("oidc-leeway: at most {}s", MAX_LEEWAY.as_secs()));
        }
        Ok(())
    }
}

/// A `VALUE=ROLE` mapping as the command line gives it.
pub fn parse_role_mapping(text: &str) -> Result<(String, Role), String> {
    let (value, role) = text
        .rsplit_once('=')
        .ok_or_else(|| format!("{text:?}: expected VALUE=ROLE (e.g. shepherd-admins=admin)"))?;
    let role = super::policy::parse_role(role)?;
    if value.is_empty() {
        return Err(format!("{text:?}: the claim value is empty"));
    }
    Ok((value.to_string(), role))
}

/// The keys last fetched, when fetching was last tried, and why that failed if it did.
#[derive(Default)]
struct Keys {
    set: Option<(Instant, JwkSet)>,
    last_try: Option<Instant>,
    last_error: Option<String>,
}

/// Verifies the provider's tokens.
pub struct OidcVerifier {
    settings: OidcSettings,
    http: reqwest::Client,
    keys: tokio::sync::Mutex<Keys>,
    roles: HashMap<String, Role>,
}

/// The claims read from a token besides those `jsonwebtoken` checks.
#[derive(Deserialize)]
struct Claims {
    sub: String,
    iss: String,
    #[serde(flatten)]
    rest: serde_json::Map<String, Value>,
}

fn unauthenticated(detail: impl Into<String>) -> Problem {
    Problem::new(Kind::Unauthenticated, detail)
}

impl OidcVerifier {
    /// A verifier for `settings` (validated first).
    pub fn new(settings: OidcSettings) -> Result<OidcVerifier, InvalidOidc> {
        settings.validate()?;
        let mut http = reqwest::Client::builder()
            .timeout(FETCH_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none());
        if let Some(pem) = &settings.ca_pem {
            let ca = reqwest::Certificate::from_pem(pem)
                .map_err(|e| InvalidOidc(format!("oidc-ca: {e}")))?;
            http = http.add_root_certificate(ca);
        }
        let http = http
            .build()
            .map_err(|e| InvalidOidc(format!("oidc: HTTP client: {e}")))?;
        let roles = settings.roles.iter().cloned().collect();
        Ok(OidcVerifier {
            settings,
            http,
            keys: tokio::sync::Mutex::new(Keys::default()),
            roles,
        })
    }

    /// Fetches the provider's keys now; the error says why they could not be fetched.
    pub async fn prefetch(&self) -> Result<(), String> {
        let mut keys = self.keys.lock().await;
        self.refetch(&mut keys).await
    }

    /// The principal `token` proves.
    pub async fn verify(&self, token: &str) -> Result<Principal, Problem> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| unauthenticated(format!("not a signed JWT: {e}")))?;
        let kid = header
            .kid
            .ok_or_else(|| unauthenticated("the token names no signing key (kid)"))?;
        let jwk = self.key(&kid).await?;
        let algorithm = key_algorithm(&jwk)
            .ok_or_else(|| unauthenticated(format!("key {kid:?} is of a kind not accepted")))?;
        if header.alg != algorithm {
            return Err(unauthenticated(format!(
                "the token says {:?}, but key {kid:?} is for {algorithm:?}",
                header.alg
            )));
        }
        let key = DecodingKey::from_jwk(&jwk)
            .map_err(|e| unauthenticated(format!("key {kid:?} is unusable: {e}")))?;
        let mut validation = Validation::new(algorithm);
        validation.set_issuer(&[&self.settings.issuer]);
        validation.set_audience(&[&self.settings.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.validate_nbf = true;
        validation.leeway = self.settings.leeway.as_secs();
        let data = jsonwebtoken::decode::<Claims>(token, &key, &validation)
            .map_err(|e| unauthenticated(format!("the token does not verify: {e}")))?;
        let claims = data.claims;
        let claim = self.settings.role_claim;
        let role = claim
            .values(&claims.rest)
            .iter()
            .filter_map(|v| self.roles.get(v))
            .max()
            .copied();
        let name = format!("oidc:{}@{}", claims.sub, claims.iss);
        let role = role.ok_or_else(|| {
            let detail = format!(
                "{name} has no role: its {:?} claim holds no mapped value",
                claim.name()
            );
            Problem::new(Kind::Forbidden, detail)
        })?;
        Ok(Principal { name, role })
    }

    /// The key `kid`, fetching the keys again if it is not known (or they are old).
    async fn key(&self, kid: &str) -> Result<Jwk, Problem> {
        let mut keys = self.keys.lock().await;
        let fresh = keys
            .set
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < KEYS_MAX_AGE);
        if let Some(jwk) = find(&keys, kid).filter(|_| fresh) {
            return Ok(jwk);
        }
        if keys.last_try.is_none_or(|at| at.elapsed() >= MIN_REFETCH) {
            // A failure is kept in `last_error`; the keys fetched before stay usable.
            let _ = self.refetch(&mut keys).await;
        }
        let fetched = keys.last_error.clone().map_or(Ok(()), Err);
        match (find(&keys, kid), fetched) {
            (Some(jwk), _) => Ok(jwk),
            (None, Err(why)) => Err(unauthenticated(format!(
                "key {kid:?} is not known and the identity provider's keys cannot be fetched: {why}"
            ))),
            (None, Ok(())) => Err(unauthenticated(format!(
                "key {kid:?} is not one of the identity provider's keys"
            ))),
        }
    }

    /// Fetches the keys again, noting the outcome in `keys`.
    async fn refetch(&self, keys: &mut Keys) -> Result<(), String> {
        keys.last_try = Some(Instant::now());
        let fetched = self.fetch_keys().await;
        match fetched {
            Ok(set) => {
                keys.set = Some((Instant::now(), set));
                keys.last_error = None;
                Ok(())
            }
            Err(why) => {
                keys.last_error = Some(why.clone());
                Err(why)
            }
        }
    }

    /// Discovery, then the key set it names.
    async fn fetch_keys(&self) -> Result<JwkSet, String> {
        let issuer = self.settings.issuer.trim_end_matches('/');
        let discovery: Value = self
            .fetch(&format!("{issuer}/.well-known/openid-configuration"))
            .await?;
        if discovery["issuer"].as_str() != Some(&self.settings.issuer) {
            return Err(format!(
                "discovery names issuer {}, not {}",
                discovery["issuer"], self.settings.issuer
            ));
        }
        let jwks_uri = discovery["jwks_uri"]
            .as_str()
            .ok_or("discovery names no jwks_uri")?
            .to_string();
        self.fetch(&jwks_uri).await
    }

    /// GETs `url` as JSON of at most [`MAX_DOCUMENT`] bytes.
    async fn fetch<T: serde::de::DeserializeOwned>(&self, url: &str) -> Result<T, String> {
        let mut response = self
            .http
            .get(url)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| format!("{url}: {e}"))?;
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| format!("{url}: {e}"))? {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_DOCUMENT {
                return Err(format!("{url}: larger than {MAX_DOCUMENT} bytes"));
            }
        }
        serde_json::from_slice(&body).map_err(|e| format!("{url}: {e}"))
    }
}

fn find(keys: &Keys, kid: &str) -> Option<Jwk> {
    let (_, set) = keys.set.as_ref()?;
    set.find(kid).cloned()
}

/// The one algorithm a key verifies: the one it names, else the one its kind implies. Keys
/// for HMAC (`oct`) verify nothing: a public key set holding a shared secret is a mistake.
fn key_algorithm(jwk: &Jwk) -> Option<Algorithm> {
    let named = jwk.common.key_algorithm.and_then(|a| match a {
        KeyAlgorithm::RS256 => Some(Algorithm::RS256),
        KeyAlgorithm::RS384 => Some(Algorithm::RS384),
        KeyAlgorithm::RS512 => Some(Algorithm::RS512),
        KeyAlgorithm::PS256 => Some(Algorithm::PS256),
        KeyAlgorithm::PS384 => Some(Algorithm::PS384),
        KeyAlgorithm::PS512 => Some(Algorithm::PS512),
        KeyAlgorithm::ES256 => Some(Algorithm::ES256),
        KeyAlgorithm::ES384 => Some(Algorithm::ES384),
        KeyAlgorithm::EdDSA => Some(Algorithm::EdDSA),
        _ => None,
    });
    let implied = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Some(Algorithm::RS256),
        AlgorithmParameters::EllipticCurve(ec) => match ec.curve {
            EllipticCurve::P256 => Some(Algorithm::ES256),
            EllipticCurve::P384 => Some(Algorithm::ES384),
            _ => None,
        },
        AlgorithmParameters::OctetKeyPair(_) => Some(Algorithm::EdDSA),
        AlgorithmParameters::OctetKey(_) => return None,
    };
    named.or(implied)
}
