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
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm};
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;
use serde_json::Value;
use shepherd_bmdb::Role;

use super::policy::{Principal, UnknownRole};
use super::problem::{Kind, Problem};

/// Tokens remembered as verified, at most; the memory starts afresh when full.
const VERIFIED_MAX: usize = 10_000;
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
    fn values(self, claims: &Claims) -> Vec<String> {
        let claim = match self {
            RoleClaim::Groups => &claims.groups,
            RoleClaim::Roles => &claims.roles,
            RoleClaim::Scope => &claims.scope,
        };
        match claim {
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
    /// The claims that hold roles (`groups` for people, `scope` for pipelines): a token gets
    /// the highest role any of their values maps to.
    pub role_claims: Vec<RoleClaim>,
    /// The clients (`azp` or `client_id`) whose tokens' `scope` may carry roles. Needed with
    /// the `scope` claim: a provider lets many clients, public ones among them, ask for any
    /// scope it knows, and each would otherwise give itself the scope's role.
    pub scope_clients: Vec<String>,
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
        if self.role_claims.is_empty() {
            return bad("oidc-role-claim: name at least one claim".into());
        }
        if self.role_claims.contains(&RoleClaim::Scope) && self.scope_clients.is_empty() {
            return bad(
                "oidc-role-claim scope: give --oidc-scope-clients, the clients whose scopes may \
                 carry roles (any client the provider lets ask for a scope would get its role)"
                    .into(),
            );
        }
        if self.leeway > MAX_LEEWAY {
            return bad(format!("oidc-leeway: at most {}s", MAX_LEEWAY.as_secs()));
        }
        Ok(())
    }
}

/// A `VALUE=ROLE` mapping that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BadRoleMapping {
    #[error("{0:?}: expected VALUE=ROLE (e.g. shepherd-admins=admin)")]
    NoRole(String),
    #[error("{0:?}: the claim value is empty")]
    EmptyValue(String),
    #[error(transparent)]
    Role(#[from] UnknownRole),
}

/// A `VALUE=ROLE` mapping as the command line gives it.
pub fn parse_role_mapping(text: &str) -> Result<(String, Role), BadRoleMapping> {
    let (value, role) = text
        .rsplit_once('=')
        .ok_or_else(|| BadRoleMapping::NoRole(text.to_string()))?;
    let role = super::policy::parse_role(role)?;
    if value.is_empty() {
        return Err(BadRoleMapping::EmptyValue(text.to_string()));
    }
    Ok((value.to_string(), role))
}

/// Why the identity provider's discovery document or keys could not be read (kept, and
/// given as the reason, until a later fetch succeeds).
#[derive(Debug, Clone, thiserror::Error)]
pub enum IdentityProviderError {
    /// The request failed, or its answer was not the JSON expected.
    #[error("{url}: {reason}")]
    Fetch { url: String, reason: String },
    #[error("{url}: larger than {MAX_DOCUMENT} bytes")]
    TooLarge { url: String },
    #[error("discovery names issuer {found}, not {expected}")]
    OtherIssuer { found: String, expected: String },
    #[error("discovery names no {0}")]
    Unnamed(&'static str),
    #[error(
        "discovery names no authorization_endpoint and token_endpoint: the provider cannot \
         sign people in"
    )]
    NoSignIn,
}

/// Why a key the provider publishes cannot verify tokens.
#[derive(Debug, Clone, thiserror::Error)]
enum UnusableKey {
    #[error("is for encryption (use: enc), not for signatures")]
    ForEncryption,
    #[error("is of a kind not accepted")]
    Kind,
    #[error("is unusable: {0}")]
    Invalid(String),
}

/// A key made ready to verify with, once, when the keys are fetched: its one algorithm, the
/// decoding key, and the checks a token signed with it must pass.
struct Prepared {
    algorithm: Algorithm,
    key: DecodingKey,
    validation: Validation,
}

/// Keys by id: each prepared, or why it cannot be used.
type KeySet = HashMap<String, Result<Arc<Prepared>, UnusableKey>>;

/// The keys last fetched and when, when fetching was last tried, and why that failed if it
/// did.
#[derive(Default)]
struct Keys {
    set: Option<(Instant, KeySet)>,
    /// Where people sign in, as discovery last said.
    endpoints: Option<Endpoints>,
    last_try: Option<Instant>,
    last_error: Option<IdentityProviderError>,
}

/// Where the provider signs people in, from its discovery document.
#[derive(Debug, Clone)]
pub struct Endpoints {
    /// Where a browser is sent to sign in (`authorization_endpoint`).
    pub authorization: String,
    /// Where a code is exchanged for tokens (`token_endpoint`).
    pub token: String,
}

/// Verifies the provider's tokens.
pub struct OidcVerifier {
    settings: OidcSettings,
    http: reqwest::Client,
    /// Read on every request; written when keys are fetched.
    keys: RwLock<Keys>,
    /// Held while keys are fetched, so that one fetch serves every request waiting for it.
    fetching: tokio::sync::Mutex<()>,
    roles: HashMap<String, Role>,
    /// Tokens verified already, by their SHA-256: the principal and the token's `exp`. A
    /// client uses one token for many requests; only its first pays for the signature. Each
    /// use still checks `exp`, and the memory is forgotten whenever keys are fetched again, so
    /// a key the provider withdrew stops vouching for its tokens.
    verified: std::sync::Mutex<HashMap<[u8; 32], (Principal, i64)>>,
}

/// The claims read from a token besides those `jsonwebtoken` checks.
#[derive(Deserialize)]
struct Claims {
    sub: String,
    iss: String,
    exp: i64,
    groups: Option<Value>,
    roles: Option<Value>,
    scope: Option<Value>,
    nonce: Option<String>,
    /// When the person last logged in at the provider (an ID token's, when `max_age` was
    /// asked for).
    auth_time: Option<i64>,
    /// The client the token was issued to (OpenID Connect).
    azp: Option<String>,
    /// The client the token was issued to (RFC 9068 access tokens).
    client_id: Option<String>,
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
            keys: RwLock::new(Keys::default()),
            fetching: tokio::sync::Mutex::new(()),
            roles,
            verified: std::sync::Mutex::new(HashMap::new()),
        })
    }

    /// Fetches the provider's keys now; the error says why they could not be fetched.
    pub async fn prefetch(&self) -> Result<(), IdentityProviderError> {
        let _fetching = self.fetching.lock().await;
        self.refetch().await
    }

    /// The principal `token` proves: remembered if it was verified before and has not
    /// expired, else verified now.
    pub async fn verify(&self, token: &str) -> Result<Principal, Problem> {
        let digest = shepherd_bmdb::api_token_digest(token);
        let now = chrono::Utc::now().timestamp();
        let leeway = self.settings.leeway.as_secs() as i64;
        let remembered = self.verified.lock().unwrap().get(&digest).cloned();
        if let Some((principal, exp)) = remembered {
            if now <= exp + leeway {
                return Ok(principal);
            }
            self.verified.lock().unwrap().remove(&digest);
        }
        let (claims, typ) = self.verify_signed(token, None).await?;
        // An ID token (it carries the sign-in's nonce) proves who signed in to a client, not
        // that the bearer may call the API: only a token typed `at+jwt` may carry a nonce.
        if claims.nonce.is_some() && !is_access_token_type(typ.as_deref()) {
            return Err(unauthenticated(
                "an ID token is not an access token (it carries a nonce and is not typ at+jwt)",
            ));
        }
        let (principal, exp) = (self.principal(&claims)?, claims.exp);
        let mut verified = self.verified.lock().unwrap();
        if verified.len() >= VERIFIED_MAX {
            verified.clear();
        }
        verified.insert(digest, (principal.clone(), exp));
        Ok(principal)
    }

    /// The principal of a sign-in's ID token: `token` must verify like an access token, but
    /// be for `client_id` and carry `nonce` (the one the sign-in sent, so that an ID token
    /// from another sign-in cannot be replayed into this one).
    pub async fn verify_id_token(
        &self,
        token: &str,
        client_id: &str,
        nonce: &str,
        max_age: Duration,
    ) -> Result<Principal, Problem> {
        let (claims, _) = self.verify_signed(token, Some(client_id)).await?;
        if claims.nonce.as_deref() != Some(nonce) {
            return Err(unauthenticated(
                "the ID token is not for this sign-in (nonce)",
            ));
        }
        // Asked for with `max_age`: a login older than that (with the clock skew allowed for
        // expiry) means the provider did not ask the person again as it was told to.
        let leeway = self.settings.leeway.as_secs() as i64;
        let oldest = chrono::Utc::now().timestamp() - max_age.as_secs() as i64 - leeway;
        if claims.auth_time.is_some_and(|at| at < oldest) {
            return Err(unauthenticated(
                "the ID token's login (auth_time) is older than the sign-in lifetime",
            ));
        }
        self.principal(&claims)
    }

    /// The provider's sign-in endpoints, with its discovery read again first (at most every
    /// [`MIN_REFETCH`]) so that a sign-in started while the provider is down fails here, with
    /// the reason, rather than at a page the browser cannot reach.
    pub async fn endpoints(&self) -> Result<Endpoints, IdentityProviderError> {
        let _fetching = self.fetching.lock().await;
        let may_try = {
            let keys = self.keys.read().unwrap();
            keys.last_try.is_none_or(|at| at.elapsed() >= MIN_REFETCH)
        };
        if may_try {
            self.refetch().await?;
        }
        let keys = self.keys.read().unwrap();
        match (&keys.last_error, &keys.endpoints) {
            (Some(why), _) => Err(why.clone()),
            (None, Some(endpoints)) => Ok(endpoints.clone()),
            (None, None) => Err(IdentityProviderError::NoSignIn),
        }
    }

    /// The HTTP client that talks to the provider (its CA trusted, redirects not followed).
    pub fn http(&self) -> &reqwest::Client {
        &self.http
    }

    /// Verifies `token`'s signature and claims, for `audience` if given (else the configured
    /// one); its claims.
    async fn verify_signed(
        &self,
        token: &str,
        audience: Option<&str>,
    ) -> Result<(Claims, Option<String>), Problem> {
        let header = jsonwebtoken::decode_header(token)
            .map_err(|e| unauthenticated(format!("not a signed JWT: {e}")))?;
        let kid = header
            .kid
            .ok_or_else(|| unauthenticated("the token names no signing key (kid)"))?;
        let key = self.key(&kid).await?;
        if header.alg != key.algorithm {
            return Err(unauthenticated(format!(
                "the token says {:?}, but key {kid:?} is for {:?}",
                header.alg, key.algorithm
            )));
        }
        let validation = match audience {
            Some(audience) => {
                let mut validation = key.validation.clone();
                validation.set_audience(&[audience]);
                std::borrow::Cow::Owned(validation)
            }
            None => std::borrow::Cow::Borrowed(&key.validation),
        };
        let data = jsonwebtoken::decode::<Claims>(token, &key.key, &validation)
            .map_err(|e| unauthenticated(format!("the token does not verify: {e}")))?;
        Ok((data.claims, header.typ))
    }

    /// The principal `claims` name, with the highest role the values of its role claims map
    /// to; `scope` counts only for the clients listed in the settings.
    fn principal(&self, claims: &Claims) -> Result<Principal, Problem> {
        let client = claims.azp.as_ref().or(claims.client_id.as_ref());
        let scope_counts = client.is_some_and(|c| self.settings.scope_clients.contains(c));
        let counted = |claim: &&RoleClaim| **claim != RoleClaim::Scope || scope_counts;
        let claims_read = self.settings.role_claims.iter().filter(counted);
        let role = claims_read
            .flat_map(|claim| claim.values(claims))
            .filter_map(|v| self.roles.get(&v).copied())
            .max();
        let name = format!("oidc:{}@{}", claims.sub, claims.iss);
        let role = role.ok_or_else(|| {
            let names: Vec<&str> = self.settings.role_claims.iter().map(|c| c.name()).collect();
            let detail = format!(
                "{name} has no role: its {} claims hold no mapped value (scope counts only for \
                 the clients of --oidc-scope-clients)",
                names.join(", ")
            );
            Problem::new(Kind::Forbidden, detail)
        })?;
        Ok(Principal { name, role })
    }

    /// The key `kid`, prepared; the keys are fetched again if it is not known (or they are
    /// old), by one request at a time.
    async fn key(&self, kid: &str) -> Result<Arc<Prepared>, Problem> {
        if let Some(known) = self.known(kid, true) {
            return known;
        }
        let _fetching = self.fetching.lock().await;
        // Another request may have fetched them meanwhile.
        if let Some(known) = self.known(kid, true) {
            return known;
        }
        let may_try = {
            let keys = self.keys.read().unwrap();
            keys.last_try.is_none_or(|at| at.elapsed() >= MIN_REFETCH)
        };
        if may_try {
            // A failure is kept in `last_error`; the keys fetched before stay usable.
            let _ = self.refetch().await;
        }
        if let Some(known) = self.known(kid, false) {
            return known;
        }
        let why = self.keys.read().unwrap().last_error.clone();
        Err(unauthenticated(match why {
            Some(why) => format!(
                "key {kid:?} is not known and the identity provider's keys cannot be fetched: {why}"
            ),
            None => format!("key {kid:?} is not one of the identity provider's keys"),
        }))
    }

    /// Key `kid` as last fetched (only if the keys are not old, when `fresh`): prepared, or
    /// why it cannot be used; `None` if it is not among them.
    fn known(&self, kid: &str, fresh: bool) -> Option<Result<Arc<Prepared>, Problem>> {
        let keys = self.keys.read().unwrap();
        let (at, set) = keys.set.as_ref()?;
        if fresh && at.elapsed() >= KEYS_MAX_AGE {
            return None;
        }
        let prepared = set.get(kid)?.clone();
        Some(prepared.map_err(|why| unauthenticated(format!("key {kid:?} {why}"))))
    }

    /// Fetches the keys again and notes the outcome; the caller holds `fetching`.
    async fn refetch(&self) -> Result<(), IdentityProviderError> {
        self.keys.write().unwrap().last_try = Some(Instant::now());
        let fetched = self.fetch_keys().await;
        let mut keys = self.keys.write().unwrap();
        match fetched {
            Ok((set, endpoints)) => {
                keys.endpoints = endpoints;
                let prepared = set.keys.iter().filter_map(|jwk| {
                    let kid = jwk.common.key_id.clone()?;
                    Some((kid, self.prepare(jwk).map(Arc::new)))
                });
                keys.set = Some((Instant::now(), prepared.collect()));
                keys.last_error = None;
                self.verified.lock().unwrap().clear();
                Ok(())
            }
            Err(why) => {
                keys.last_error = Some(why.clone());
                Err(why)
            }
        }
    }

    /// `jwk` ready to verify with, or why it cannot be.
    fn prepare(&self, jwk: &Jwk) -> Result<Prepared, UnusableKey> {
        if jwk.common.public_key_use == Some(jsonwebtoken::jwk::PublicKeyUse::Encryption) {
            return Err(UnusableKey::ForEncryption);
        }
        let algorithm = key_algorithm(jwk).ok_or(UnusableKey::Kind)?;
        let key = DecodingKey::from_jwk(jwk).map_err(|e| UnusableKey::Invalid(e.to_string()))?;
        let mut validation = Validation::new(algorithm);
        validation.set_issuer(&[&self.settings.issuer]);
        validation.set_audience(&[&self.settings.audience]);
        validation.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        validation.validate_nbf = true;
        validation.leeway = self.settings.leeway.as_secs();
        Ok(Prepared {
            algorithm,
            key,
            validation,
        })
    }

    /// Discovery, then the key set it names; and the sign-in endpoints it names, if it names
    /// them (a provider that only issues tokens to services may not).
    async fn fetch_keys(&self) -> Result<(JwkSet, Option<Endpoints>), IdentityProviderError> {
        let issuer = self.settings.issuer.trim_end_matches('/');
        let discovery: Value = self
            .fetch(&format!("{issuer}/.well-known/openid-configuration"))
            .await?;
        if discovery["issuer"].as_str() != Some(&self.settings.issuer) {
            return Err(IdentityProviderError::OtherIssuer {
                found: discovery["issuer"].to_string(),
                expected: self.settings.issuer.clone(),
            });
        }
        let named = |field: &'static str| {
            discovery[field]
                .as_str()
                .map(str::to_string)
                .ok_or(IdentityProviderError::Unnamed(field))
        };
        let jwks_uri = named("jwks_uri")?;
        let endpoints = match (named("authorization_endpoint"), named("token_endpoint")) {
            (Ok(authorization), Ok(token)) => Some(Endpoints {
                authorization,
                token,
            }),
            _ => None,
        };
        Ok((self.fetch(&jwks_uri).await?, endpoints))
    }

    /// GETs `url` as JSON of at most [`MAX_DOCUMENT`] bytes.
    async fn fetch<T: serde::de::DeserializeOwned>(
        &self,
        url: &str,
    ) -> Result<T, IdentityProviderError> {
        let failed = |reason: &dyn std::fmt::Display| IdentityProviderError::Fetch {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let mut response = self
            .http
            .get(url)
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(|e| failed(&e))?;
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| failed(&e))? {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_DOCUMENT {
                let url = url.to_string();
                return Err(IdentityProviderError::TooLarge { url });
            }
        }
        serde_json::from_slice(&body).map_err(|e| failed(&e))
    }
}

/// The one algorithm a key verifies: the one it names, else the one its kind implies. Keys
/// for HMAC (`oct`) verify nothing: a public key set holding a shared secret is a mistake.
/// Whether a JWT header's `typ` says access token (RFC 9068: `at+jwt`, or its media type).
fn is_access_token_type(typ: Option<&str>) -> bool {
    typ.is_some_and(|t| {
        let t = t.to_ascii_lowercase();
        t == "at+jwt" || t == "application/at+jwt"
    })
}

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

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(role_claims: Vec<RoleClaim>, scope_clients: &[&str]) -> OidcSettings {
        OidcSettings {
            issuer: "https://id.example.com".into(),
            audience: "shepherd".into(),
            role_claims,
            scope_clients: scope_clients.iter().map(|c| c.to_string()).collect(),
            roles: vec![
                ("fleet-ops".into(), Role::Operator),
                ("shepherd:operator".into(), Role::Operator),
                ("shepherd:admin".into(), Role::Admin),
            ],
            leeway: Duration::from_secs(5),
            ca_pem: None,
        }
    }

    fn claims(azp: Option<&str>, groups: &[&str], scope: &str) -> Claims {
        Claims {
            sub: "someone".into(),
            iss: "https://id.example.com".into(),
            exp: 0,
            groups: Some(serde_json::json!(groups)),
            roles: None,
            scope: Some(Value::String(scope.into())),
            nonce: None,
            auth_time: None,
            azp: azp.map(str::to_string),
            client_id: None,
        }
    }

    /// One server takes people's groups and pipelines' scopes; a scope gives a role only to
    /// a listed client, so a public client that asks for the admin scope gets nothing of it.
    #[test]
    fn roles_come_from_every_claim_and_scope_only_for_listed_clients() {
        let both = vec![RoleClaim::Groups, RoleClaim::Scope];
        let verifier = OidcVerifier::new(settings(both, &["ci-pipeline"])).unwrap();
        let role = |c: &Claims| verifier.principal(c).map(|p| p.role);
        assert_eq!(
            role(&claims(Some("ci-pipeline"), &[], "shepherd:admin")).unwrap(),
            Role::Admin
        );
        let public = claims(Some("public-app"), &[], "openid shepherd:admin");
        assert_eq!(role(&public).unwrap_err().kind, Kind::Forbidden);
        let person = claims(Some("public-app"), &["fleet-ops"], "shepherd:admin");
        assert_eq!(role(&person).unwrap(), Role::Operator);
        let mut by_client_id = claims(None, &[], "shepherd:operator");
        by_client_id.client_id = Some("ci-pipeline".into());
        assert_eq!(role(&by_client_id).unwrap(), Role::Operator);
        // Scope without a list of clients is refused at start-up.
        let invalid = OidcVerifier::new(settings(vec![RoleClaim::Scope], &[]));
        assert!(invalid.is_err());
    }
}
