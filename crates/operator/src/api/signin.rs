//! Web UI sign-in: the OpenID Connect authorization-code flow with PKCE against the operator
//! API's identity provider, and the session it ends in.
//!
//! `/signin` sends the browser to the provider with a fresh `state`, `nonce` and PKCE
//! verifier, kept meanwhile in a short-lived cookie (`SameSite=Lax`, so that it comes back with
//! the provider's redirect). `/signin/callback` checks `state`, exchanges the code (with the
//! verifier) for an ID token, verifies it (`oidc.rs`, for this client and this `nonce`), and
//! records the sign-in in the BMDB as a token named `session.…` that acts as the signed-in
//! identity, with the role its claims map to and a bounded lifetime. The browser holds that
//! token in a `__Host-` cookie: HttpOnly, Secure, `SameSite=Strict`. Signing out revokes it, as
//! an admin can with `shepherd tokens revoke`.
//!
//! Every page goes through [`require_session`]; a form that changes something must carry the
//! session's CSRF token ([`WebUser::csrf`]), derived from the cookie's secret, which a page of
//! another site can neither read nor guess.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, Form, Query, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use base64::engine::general_purpose::URL_SAFE_NO_PAD as B64;
use base64::Engine;
use maud::{html, DOCTYPE};
use rand::RngCore;
use serde::Deserialize;
use sha2::{Digest, Sha256};
use shepherd_bmdb::{Actor, Bmdb};

use super::auth::Authenticator;
use super::oidc::{IdentityProviderError, OidcVerifier};
use super::policy::Principal;
use super::problem::{Kind, Problem};
use super::DenialLog;
use crate::audit::AuditTrail;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use shepherd_bmdb::{one_line, one_line_cut};

/// The cookie that holds a sign-in's token. `__Host-`: the browser keeps it only if it is
/// Secure, for `/`, and for this host alone.
pub const SESSION_COOKIE: &str = "__Host-shepherd-session";
/// The cookie that holds a sign-in in progress.
const PENDING_COOKIE: &str = "__Host-shepherd-signin";
/// How long a sign-in may take at the identity provider.
const PENDING_LIFETIME: Duration = Duration::from_secs(600);
/// The longest session a configuration may ask for.
pub const MAX_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);
/// Largest answer read from the token endpoint.
const MAX_TOKEN_ANSWER: usize = 64 << 10;

/// A sign-in setting that cannot work, found at start-up; the message names the setting.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidSignIn(String);

/// Why a sign-in's code could not be exchanged for its ID token.
#[derive(Debug, thiserror::Error)]
enum ExchangeError {
    #[error(transparent)]
    Discovery(#[from] IdentityProviderError),
    /// The request or its answer failed on the way (the reason, one line).
    #[error("the identity provider's token endpoint: {0}")]
    Transport(String),
    #[error("the identity provider's token answer is too large")]
    TooLarge,
    #[error("the identity provider refused the code ({status}): {error} {detail}")]
    Refused {
        status: StatusCode,
        error: String,
        detail: String,
    },
    #[error("the identity provider answered no id_token")]
    NoIdToken,
}

/// How the web UI signs people in.
#[derive(Debug, Clone)]
pub struct SignInSettings {
    /// The client id the identity provider knows the web UI by; ID tokens must be for it.
    pub client_id: String,
    /// Its secret, if the provider gave it one (client_secret_basic); else a public client.
    pub client_secret: Option<String>,
    /// Where browsers reach the web UI (`https://shepherd.example.com:8443`): the redirect
    /// URI registered at the provider is this and `/signin/callback`.
    pub public_url: String,
    /// Scopes asked for besides `openid` (those that put the role claim into the ID token).
    pub scopes: Vec<String>,
    /// How long a login and a sign-in last.
    pub times: SignInTimes,
}

/// How long a person stays signed in to the web UI.
#[derive(Debug, Clone, Copy)]
pub struct SignInTimes {
    /// How long a login at the provider lasts for the web UI: sign-ins ask the provider to
    /// have the person log in again after this (`max_age`).
    pub lifetime: Duration,
    /// How long one sign-in lasts before the browser passes through the provider again and
    /// comes back with the role the provider gives now.
    pub role_refresh: Duration,
}

impl SignInSettings {
    /// Checks what can be checked at start-up; the message names the setting.
    pub fn validate(&self) -> Result<(), InvalidSignIn> {
        let bad = |m: String| Err(InvalidSignIn(m));
        if self.client_id.trim().is_empty() {
            return bad("web-client-id: empty".into());
        }
        let url = match reqwest::Url::parse(&self.public_url) {
            Ok(url) => url,
            Err(e) => return bad(format!("web-url: {:?} is not a URL: {e}", self.public_url)),
        };
        if url.scheme() != "https" || url.path() != "/" || url.query().is_some() {
            return bad(format!(
                "web-url: {} must be https://HOST[:PORT], where browsers reach the API listener",
                self.public_url
            ));
        }
        if self.times.lifetime.is_zero() || self.times.lifetime > MAX_LIFETIME {
            return bad("web-session-lifetime: more than 0s and at most 7d".into());
        }
        if self.times.role_refresh.is_zero() || self.times.role_refresh > self.times.lifetime {
            return bad("web-role-refresh: more than 0s and at most web-session-lifetime".into());
        }
        Ok(())
    }

    fn redirect_uri(&self) -> String {
        format!("{}/signin/callback", self.public_url.trim_end_matches('/'))
    }
}

/// The peer's address, as the listener recorded it (absent where a test serves the routes
/// without one).
pub(crate) type Peer = Option<Extension<ConnectInfo<SocketAddr>>>;

/// The address of `peer`, as the audit trail records it.
fn address(peer: &Peer) -> Option<String> {
    peer.as_ref().map(|p| p.0 .0.ip().to_string())
}

/// A new request id, as the log and the audit trail name a request the page answered.
fn new_request_id() -> String {
    uuid::Uuid::new_v4().to_string()
}

/// What the sign-in routes and the page guard share.
pub struct SignIn {
    settings: SignInSettings,
    oidc: Arc<OidcVerifier>,
    auth: Arc<Authenticator>,
    db: Bmdb,
    /// Refusals, logged at most every ten seconds.
    denials: DenialLog,
    /// Sign-ins by outcome.
    outcomes: Family<OutcomeLabels, Counter>,
    /// The pending sign-ins (by `state`) whose code was exchanged, so that each is exchanged
    /// once: a replayed or repeated callback costs no token request to the provider.
    exchanged: std::sync::Mutex<ExchangedStates>,
}

/// The `state`s whose callback went to the provider, with when: kept for the pending
/// cookie's lifetime, at most [`ExchangedStates::MAX`] of them.
#[derive(Default)]
struct ExchangedStates(std::collections::HashMap<String, std::time::Instant>);

impl ExchangedStates {
    const MAX: usize = 10_000;

    /// Records `state`; false if it was recorded already (within the pending lifetime).
    fn first_time(&mut self, state: &str) -> bool {
        if self.0.len() >= Self::MAX {
            self.0.retain(|_, at| at.elapsed() < PENDING_LIFETIME);
            if self.0.len() >= Self::MAX {
                // Every entry is recent: a flood of sign-ins. Forgetting them lets a replay
                // through to the provider, which refuses a used code itself.
                self.0.clear();
            }
        }
        match self.0.get(state) {
            Some(at) if at.elapsed() < PENDING_LIFETIME => false,
            _ => {
                self.0.insert(state.to_string(), std::time::Instant::now());
                true
            }
        }
    }
}

/// Who is signed in to the web UI, put into each page request by [`require_session`].
#[derive(Debug, Clone)]
pub struct WebUser {
    /// Who, and what they may do.
    pub principal: Principal,
    /// The token a form must carry to change anything.
    pub csrf: String,
    /// The sign-in's token name (signing out revokes it).
    token_name: String,
}

impl WebUser {
    /// Whether `presented` is this session's CSRF token.
    pub fn csrf_matches(&self, presented: &str) -> bool {
        // Equal length and every byte compared: the comparison takes as long for a near miss.
        let (a, b) = (self.csrf.as_bytes(), presented.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl SignIn {
    /// Sign-in for `settings` (validated) through `oidc`'s provider; sessions are checked by
    /// `auth` and recorded in `db`; `shepherd_web_signins_total{outcome}` is registered in
    /// `registry`.
    pub fn new(
        settings: SignInSettings,
        oidc: Arc<OidcVerifier>,
        auth: Arc<Authenticator>,
        db: Bmdb,
        audit: AuditTrail,
        registry: &mut Registry,
    ) -> Result<SignIn, InvalidSignIn> {
        settings.validate()?;
        let outcomes = Family::default();
        registry.register(
            "shepherd_web_signins",
            "Web UI sign-ins and sign-outs by outcome",
            outcomes.clone(),
        );
        Ok(SignIn {
            settings,
            oidc,
            auth,
            db,
            denials: DenialLog::new(audit),
            outcomes,
            exchanged: Default::default(),
        })
    }
}

/// `/signin`, `/signin/callback` and `/account` (where one signs out).
pub fn routes(signin: Arc<SignIn>) -> Router {
    let account = Router::new()
        .route("/account", get(account))
        .route("/signout", post(sign_out))
        .route_layer(axum::middleware::from_fn_with_state(
            signin.clone(),
            require_session,
        ));
    Router::new()
        .route("/signin", get(start))
        .route("/signin/callback", get(callback))
        .merge(account)
        .with_state(signin)
}

/// The CSRF token of the session whose secret is `secret`.
fn csrf_of(secret: &str) -> String {
    let digest = Sha256::new()
        .chain_update(b"shepherd web csrf\0")
        .chain_update(secret.as_bytes())
        .finalize();
    B64.encode(digest)
}

/// The value of cookie `name` in `headers`.
fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
}

/// A `Set-Cookie` value: `name=value` for `max_age` (zero deletes it).
fn set_cookie(name: &str, value: &str, max_age: Duration, same_site: &str) -> HeaderValue {
    let text = format!(
        "{name}={value}; Path=/; Max-Age={}; HttpOnly; Secure; SameSite={same_site}",
        max_age.as_secs()
    );
    HeaderValue::from_str(&text).expect("cookie values are base64 or token text")
}

/// Random bytes as base64url (a `state`, a `nonce`, a PKCE verifier).
pub fn random_text(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    rand::rng().fill_bytes(&mut buf);
    B64.encode(buf)
}

/// The PKCE S256 challenge of `verifier` (RFC 7636).
pub fn pkce_challenge(verifier: &str) -> String {
    B64.encode(Sha256::digest(verifier.as_bytes()))
}

/// A path of this site to return to after signing in, else the machines list. `next` is
/// resolved against the web UI's address (`public_url`) and followed only if it stays on that
/// origin and holds no control character: browsers drop TAB and LF from URLs, so
/// `/\t/evil.example` would otherwise become `//evil.example`, another host. What is returned
/// is the resolved path and query, which cannot name another host either.
fn local_path(next: Option<&str>, public_url: &str) -> String {
    let fallback = || "/machines".to_string();
    let Some(next) = next else {
        return fallback();
    };
    if !next.starts_with('/') || next.chars().any(|c| c.is_control() || c == '\\') {
        return fallback();
    }
    let Ok(base) = reqwest::Url::parse(public_url) else {
        return fallback();
    };
    match base.join(next) {
        Ok(url) if url.origin() == base.origin() && !url.path().starts_with("//") => {
            let mut path = url.path().to_string();
            if let Some(query) = url.query() {
                path.push('?');
                path.push_str(query);
            }
            path
        }
        _ => fallback(),
    }
}

/// A small page of the sign-in flow (its errors, its hand-over).
fn small_page(status: StatusCode, title: &str, body: maud::Markup) -> Response {
    let page = html! {
        (DOCTYPE)
        html lang="en" { head { meta charset="utf-8"; title { (title) " · Shepherd" } }
        body style="font-family:system-ui,sans-serif;margin:2rem" { h1 { (title) } (body) } }
    };
    (status, Html(page.into_string())).into_response()
}

impl SignIn {
    /// A sign-in (or a form) that cannot go on: counted, logged (never with a credential),
    /// and said plainly with a way to start again. What failed on this side (the database,
    /// the identity provider's token endpoint) is the log's, not the stranger's: the page
    /// says only that sign-in cannot be completed now.
    fn refuse(&self, status: StatusCode, why: &str, peer: &Peer) -> Response {
        self.refuse_told(status, "Sign-in cannot be completed now", why, peer)
    }

    /// [`SignIn::refuse`], a failure on this side (5xx) shown as `told` (what failed, in
    /// general words: never a host, an error text or a database) with the request id under
    /// which the log has `why`.
    fn refuse_told(&self, status: StatusCode, told: &str, why: &str, peer: &Peer) -> Response {
        let request = new_request_id();
        let (outcome, shown) = if status.is_server_error() {
            let shown = format!("{told}; try again shortly (request {request}).");
            ("unavailable", shown)
        } else {
            ("refused", why.to_string())
        };
        self.count(outcome);
        let problem = Problem::new(Kind::Unauthenticated, why);
        let peer = address(peer);
        self.denials
            .note(&problem, "web sign-in", peer.as_deref(), &request, None);
        small_page(
            status,
            "Sign-in failed",
            html! { p.error { (shown) } p { a href="/signin" { "Sign in again" } } },
        )
    }

    /// Notes a web form refused to `user` (a CSRF token not of the session, a role too low):
    /// logged and written to the audit trail like the API's refusals.
    pub(crate) fn note_refused_form(&self, user: &WebUser, route: &str, why: &str, peer: &Peer) {
        let problem = Problem::new(Kind::Forbidden, why);
        let request = new_request_id();
        let peer = address(peer);
        let who = Some(user.principal.name.as_str());
        self.denials
            .note(&problem, route, peer.as_deref(), &request, who);
    }

    fn count(&self, outcome: &'static str) {
        self.outcomes
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }
}

/// Labels of `shepherd_web_signins_total`.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    /// `signed_in`, `signed_out`, `refused` (the browser's or the provider's answer was not
    /// good) or `unavailable` (the provider or the BMDB could not be reached).
    outcome: &'static str,
}

#[derive(Deserialize)]
struct StartQuery {
    next: Option<String>,
}

/// `GET /signin`: off to the identity provider.
async fn start(
    State(signin): State<Arc<SignIn>>,
    peer: Peer,
    Query(q): Query<StartQuery>,
) -> Response {
    let endpoints = match signin.oidc.endpoints().await {
        Ok(endpoints) => endpoints,
        Err(why) => {
            let why = format!("the identity provider cannot be reached: {why}");
            let told = "The identity provider cannot be reached";
            return signin.refuse_told(StatusCode::SERVICE_UNAVAILABLE, told, &why, &peer);
        }
    };
    let (state, verifier, nonce) = (random_text(16), random_text(32), random_text(16));
    let next = B64.encode(local_path(q.next.as_deref(), &signin.settings.public_url));
    let challenge = pkce_challenge(&verifier);
    let mut scope = vec!["openid".to_string()];
    scope.extend(signin.settings.scopes.iter().cloned());
    let Ok(mut url) = reqwest::Url::parse(&endpoints.authorization) else {
        let why = "the identity provider's authorization_endpoint is not a URL";
        return signin.refuse(StatusCode::BAD_GATEWAY, why, &peer);
    };
    url.query_pairs_mut()
        .append_pair("response_type", "code")
        .append_pair("client_id", &signin.settings.client_id)
        .append_pair("redirect_uri", &signin.settings.redirect_uri())
        .append_pair(
            "max_age",
            &signin.settings.times.lifetime.as_secs().to_string(),
        )
        .append_pair("scope", &scope.join(" "))
        .append_pair("state", &state)
        .append_pair("nonce", &nonce)
        .append_pair("code_challenge", &challenge)
        .append_pair("code_challenge_method", "S256");
    let pending = format!("{state}.{verifier}.{nonce}.{next}");
    let mut response = Redirect::to(url.as_str()).into_response();
    let cookie = set_cookie(PENDING_COOKIE, &pending, PENDING_LIFETIME, "Lax");
    response.headers_mut().insert(header::SET_COOKIE, cookie);
    response
}

#[derive(Deserialize)]
struct CallbackQuery {
    code: Option<String>,
    state: Option<String>,
    error: Option<String>,
    error_description: Option<String>,
}

/// The refusal of a callback that carries the provider's `error` and `description`. Anyone
/// can send a browser here with any text: it is shown and logged on one line, cut short.
fn provider_said(error: &str, description: Option<&str>) -> String {
    let error = one_line_cut(error, 100);
    let detail = one_line_cut(description.unwrap_or(""), 300);
    format!("the identity provider said {error}: {detail}")
}

/// `GET /signin/callback`: the provider's answer; on success, a session.
async fn callback(
    State(signin): State<Arc<SignIn>>,
    peer: Peer,
    headers: HeaderMap,
    Query(q): Query<CallbackQuery>,
) -> Response {
    if let Some(error) = &q.error {
        let why = provider_said(error, q.error_description.as_deref());
        return signin.refuse(StatusCode::UNAUTHORIZED, &why, &peer);
    }
    let pending = cookie(&headers, PENDING_COOKIE).unwrap_or("");
    let parts: Vec<&str> = pending.split('.').collect();
    let [state, verifier, nonce, next] = parts[..] else {
        let why = "no sign-in was started in this browser (or it took over 10 minutes)";
        return signin.refuse(StatusCode::BAD_REQUEST, why, &peer);
    };
    if q.state.as_deref() != Some(state) {
        let why = "the answer is not for the sign-in this browser started (state)";
        return signin.refuse(StatusCode::BAD_REQUEST, why, &peer);
    }
    let Some(code) = &q.code else {
        let why = "the identity provider sent no code";
        return signin.refuse(StatusCode::BAD_REQUEST, why, &peer);
    };
    if !signin.exchanged.lock().unwrap().first_time(state) {
        let why = "this sign-in was already answered; start again";
        return signin.refuse(StatusCode::BAD_REQUEST, why, &peer);
    }
    let id_token = match exchange(&signin, code, verifier).await {
        Ok(id_token) => id_token,
        Err(why) => {
            let told = "The identity provider did not complete the sign-in";
            return signin.refuse_told(StatusCode::BAD_GATEWAY, told, &why.to_string(), &peer);
        }
    };
    let client_id = &signin.settings.client_id;
    let who = match signin
        .oidc
        .verify_id_token(&id_token, client_id, nonce, signin.settings.times.lifetime)
        .await
    {
        Ok(who) => who,
        Err(problem) => return signin.refuse(StatusCode::FORBIDDEN, &problem.detail, &peer),
    };
    // The sign-in ends at the role refresh; the next page goes through the provider again.
    let lifetime = signin.settings.times.role_refresh;
    let actor =
        Actor::named(&who.name).in_request(address(&peer), "web sign-in", &new_request_id());
    let made = signin
        .db
        .create_web_session(&actor, who.role, lifetime)
        .await;
    let secret = match made {
        Ok((_, secret)) => secret,
        Err(e) => return signin.refuse(StatusCode::SERVICE_UNAVAILABLE, &e.to_string(), &peer),
    };
    tracing::info!(who = %one_line(&who.name), role = %who.role, "signed in to the web UI");
    signin.count("signed_in");
    let next = B64
        .decode(next)
        .ok()
        .and_then(|b| String::from_utf8(b).ok());
    let next = local_path(next.as_deref(), &signin.settings.public_url);
    // A page, not a redirect: the browser came here from the provider's site, so it would
    // not send a `SameSite=Strict` cookie with a redirect's request; the page's own
    // navigation is of this site.
    let mut response = small_page(
        StatusCode::OK,
        "Signed in",
        html! {
            meta http-equiv="refresh" content={"0;url=" (next)};
            p { "Signed in as " strong { (who.name) } " (" (who.role) "). "
                a href=(next) { "Continue" } }
        },
    );
    let session = set_cookie(SESSION_COOKIE, secret.reveal(), lifetime, "Strict");
    let done = set_cookie(PENDING_COOKIE, "", Duration::ZERO, "Lax");
    response.headers_mut().append(header::SET_COOKIE, session);
    response.headers_mut().append(header::SET_COOKIE, done);
    response
}

/// Exchanges `code` (with the PKCE `verifier`) for the sign-in's ID token.
async fn exchange(signin: &SignIn, code: &str, verifier: &str) -> Result<String, ExchangeError> {
    let endpoints = signin.oidc.endpoints().await?;
    let settings = &signin.settings;
    let redirect_uri = settings.redirect_uri();
    let form = [
        ("grant_type", "authorization_code"),
        ("code", code),
        ("redirect_uri", &redirect_uri),
        ("code_verifier", verifier),
        ("client_id", &settings.client_id),
    ];
    let mut request = signin.oidc.http().post(&endpoints.token).form(&form);
    if let Some(secret) = &settings.client_secret {
        request = request.basic_auth(&settings.client_id, Some(secret));
    }
    let transport = |e: reqwest::Error| ExchangeError::Transport(e.to_string());
    let answer = request.send().await.map_err(transport)?;
    let status = answer.status();
    let body = answer.bytes().await.map_err(transport)?;
    if body.len() > MAX_TOKEN_ANSWER {
        return Err(ExchangeError::TooLarge);
    }
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    if !status.is_success() {
        let said = |field: &str, otherwise: &str| json[field].as_str().unwrap_or(otherwise).into();
        return Err(ExchangeError::Refused {
            status,
            error: said("error", "an error"),
            detail: said("error_description", ""),
        });
    }
    json["id_token"]
        .as_str()
        .map(str::to_string)
        .ok_or(ExchangeError::NoIdToken)
}

/// In front of every page: the signed-in user as a [`WebUser`], or off to sign in (a page
/// read) or refused (a form sent without a session).
pub async fn require_session(
    State(signin): State<Arc<SignIn>>,
    mut req: Request,
    next: Next,
) -> Response {
    let peer: Peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .cloned()
        .map(Extension);
    let secret = cookie(req.headers(), SESSION_COOKIE).map(str::to_string);
    let session = match &secret {
        Some(secret) => signin.auth.web_session(secret).await.ok(),
        None => None,
    };
    let (Some(secret), Some((principal, token))) = (secret, session) else {
        if req.method() == Method::GET || req.method() == Method::HEAD {
            let here = req.uri().path_and_query().map_or("/", |p| p.as_str());
            let next: String = url_encode(here);
            return Redirect::to(&format!("/signin?next={next}")).into_response();
        }
        return signin.refuse(StatusCode::UNAUTHORIZED, "not signed in", &peer);
    };
    if signin.auth.admit(&principal).is_err() {
        return crate::rate_limit::slow_down();
    }
    req.extensions_mut().insert(WebUser {
        principal,
        csrf: csrf_of(&secret),
        token_name: token.name,
    });
    req.extensions_mut().insert(signin.clone());
    next.run(req).await
}

/// `s` as a query value.
fn url_encode(s: &str) -> String {
    reqwest::Url::parse_with_params("x:", [("v", s)])
        .ok()
        .and_then(|u| u.query().map(|q| q.trim_start_matches("v=").to_string()))
        .unwrap_or_default()
}

/// `GET /account`: who is signed in, and the sign-out button.
async fn account(Extension(user): Extension<WebUser>) -> Response {
    small_page(
        StatusCode::OK,
        "Account",
        html! {
            p id="signed-in" { "Signed in as " strong { (user.principal.name) } " (" (user.principal.role) ")." }
            form method="post" action="/signout" {
                input type="hidden" name="csrf" value=(user.csrf);
                button id="sign-out" type="submit" { "Sign out" }
            }
            p { a href="/machines" { "Back to machines" } }
        },
    )
}

/// A form that carries only the CSRF token; without it, the form is refused like one with
/// a wrong token (a styled 403, not the form parser's plain 422).
#[derive(Deserialize)]
struct CsrfOnly {
    #[serde(default)]
    csrf: String,
}

/// `POST /signout`: ends the sign-in (its token is revoked) and forgets the cookie.
async fn sign_out(
    State(signin): State<Arc<SignIn>>,
    peer: Peer,
    Extension(user): Extension<WebUser>,
    Form(form): Form<CsrfOnly>,
) -> Response {
    if !user.csrf_matches(&form.csrf) {
        return signin.refuse(
            StatusCode::FORBIDDEN,
            "the form is not from this session",
            &peer,
        );
    }
    let actor = Actor::named(&user.principal.name).in_request(
        address(&peer),
        "/signout",
        &new_request_id(),
    );
    if let Err(e) = signin.db.revoke_api_token(&user.token_name, &actor).await {
        return signin.refuse(StatusCode::SERVICE_UNAVAILABLE, &e.to_string(), &peer);
    }
    signin.auth.forget_cached();
    tracing::info!(who = %one_line(&user.principal.name), "signed out of the web UI");
    signin.count("signed_out");
    let mut response = small_page(
        StatusCode::OK,
        "Signed out",
        html! { p id="signed-out" { "Signed out. " a href="/signin" { "Sign in again" } } },
    );
    let gone = set_cookie(SESSION_COOKIE, "", Duration::ZERO, "Strict");
    response.headers_mut().insert(header::SET_COOKIE, gone);
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A role refresh longer than the login it refreshes, or of zero, fails at start-up,
    /// naming the setting.
    #[test]
    fn the_role_refresh_is_checked_at_start_up() {
        let settings = |role_refresh| SignInSettings {
            client_id: "shepherd-web".into(),
            client_secret: None,
            public_url: "https://shepherd.example:8443".into(),
            scopes: vec![],
            times: SignInTimes {
                lifetime: Duration::from_secs(8 * 3600),
                role_refresh,
            },
        };
        assert_eq!(settings(Duration::from_secs(300)).validate(), Ok(()));
        for bad in [Duration::ZERO, Duration::from_secs(9 * 3600)] {
            let refused = settings(bad).validate().unwrap_err().to_string();
            assert!(refused.starts_with("web-role-refresh:"), "{refused}");
        }
    }

    /// Where a browser goes after signing in: only a path of this site. A TAB or LF after
    /// the first slash (which browsers drop, making `//evil.example`) failed before.
    #[test]
    fn after_sign_in_only_a_path_of_this_site_is_followed() {
        let site = "https://shepherd.example:8443";
        let back = |next: &str| local_path(Some(next), site);
        assert_eq!(back("/machines?state=stale"), "/machines?state=stale");
        assert_eq!(back("/machines/../overview"), "/overview");
        for hostile in [
            "/\t/evil.example",
            "/\n/evil.example",
            "/\r\n/evil.example",
            "//evil.example",
            "/\\evil.example",
            "https://evil.example/",
            "/.//evil.example",
            "evil.example",
            "",
        ] {
            assert_eq!(back(hostile), "/machines", "{hostile:?}");
        }
        assert_eq!(local_path(None, site), "/machines");
    }

    /// A pending sign-in's code goes to the provider once: a second callback with the same
    /// state is refused before any token request.
    #[test]
    fn a_pending_sign_in_is_exchanged_once() {
        let mut exchanged = ExchangedStates::default();
        assert!(exchanged.first_time("s1"));
        assert!(!exchanged.first_time("s1"));
        assert!(exchanged.first_time("s2"));
        for n in 0..ExchangedStates::MAX + 5 {
            exchanged.first_time(&format!("flood-{n}"));
        }
        assert!(exchanged.0.len() <= ExchangedStates::MAX);
    }

    /// A callback's error text is anyone's: it cannot start a line of its own in the log or
    /// the page, and it is cut short.
    #[test]
    fn a_providers_error_is_told_on_one_short_line() {
        let forged = "y\n2030-01-01T00:00:00Z  WARN forged";
        let why = provider_said("x", Some(forged));
        assert_eq!(
            why,
            "the identity provider said x: y\\n2030-01-01T00:00:00Z  WARN forged"
        );
        let long = provider_said(&"e".repeat(5000), Some(&"d".repeat(5000)));
        assert!(long.chars().count() < 450, "{}", long.len());
    }
}
