//! The operator API through the real `shepherd server --api-listen`, over TLS with the
//! development certificate, with local API tokens made by `shepherd tokens create`:
//! - every route of the policy table × every role, and no identity: 401 without one, 403 with
//!   a role below the rule's, anything else at or above it;
//! - tokens that are unknown, tampered with, revoked or expired are refused;
//! - an action through the API lands in the operators' history under the token's name and
//!   the request's id, as `machines show` and `machines history` show it;
//! - malformed JSON, unknown fields, huge pages and oversized bodies get one clear 4xx and
//!   change nothing; requests are counted by route and result.

use crate::common;

use shepherd_operator::api::policy;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{machine_json, sample, shepherd, succeeds, ChildGuard};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};
use shepherd_bmdb::{testing, Actor, Bmdb, ProviderKind, Role};

/// A running server with its API address, a client trusting its certificate, and its BMDB.
struct ApiServer {
    _server: ChildGuard,
    base: String,
    metrics: String,
    client: reqwest::Client,
    url: String,
    dir: tempfile::TempDir,
}

impl ApiServer {
    async fn start(url: &str) -> ApiServer {
        ApiServer::start_with(url, &[]).await
    }

    /// Like [`ApiServer::start`], with the server flags `extra`.
    async fn start_with(url: &str, extra: &[&str]) -> ApiServer {
        let dir = tempfile::tempdir().unwrap();
        let mut flags = vec!["--api-listen", "127.0.0.1:0"];
        flags.extend_from_slice(extra);
        let (server, lines) = common::started_server(
            url,
            dir.path(),
            &flags,
            &[
                "shepherd server: operator API at https://",
                "shepherd server: web UI at http://",
            ],
        );
        let addr: std::net::SocketAddr = lines[0].trim_end_matches("/api/v1").parse().unwrap();
        let metrics = format!("http://{}/metrics", lines[1].split('/').next().unwrap());
        let ca = std::fs::read(dir.path().join("certs/ca.pem")).unwrap();
        let client = reqwest::Client::builder()
            .add_root_certificate(reqwest::Certificate::from_pem(&ca).unwrap())
            .resolve("localhost", addr)
            .timeout(Duration::from_secs(20))
            .build()
            .unwrap();
        ApiServer {
            _server: server,
            base: format!("https://localhost:{}", addr.port()),
            metrics,
            client,
            url: url.to_string(),
            dir,
        }
    }

    /// `method path` with `token` (if any) and a JSON `body` (if any).
    async fn call(
        &self,
        method: Method,
        path: &str,
        token: Option<&str>,
        body: Option<&Value>,
    ) -> (StatusCode, Value, Option<String>) {
        let mut req = self.client.request(method, format!("{}{path}", self.base));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status();
        let request_id = resp
            .headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_string());
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, body, request_id)
    }

    /// The server over a BMDB with one machine, its id, and a token named `name` of `role`.
    async fn with_machine(
        url: &str,
        name: &str,
        role: &str,
    ) -> (ApiServer, Bmdb, uuid::Uuid, String) {
        let api = ApiServer::start(url).await;
        let db = Bmdb::open(url).await.unwrap();
        let machine = testing::provision(&db, 1, ProviderKind::Sim).await[0];
        let token = api.token(name, role);
        (api, db, machine, token)
    }

    /// A token of `role` made with `shepherd tokens create`.
    fn token(&self, name: &str, role: &str) -> String {
        let out = succeeds(shepherd().args([
            "tokens",
            "create",
            "--name",
            name,
            "--role",
            role,
            "--expires",
            "1d",
            "--database",
            &self.url,
        ]));
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }
}

/// A body the route accepts, so that only the policy decides (the handler may still answer
/// 400 or 404, which is past the policy).
fn body_for(rule: &policy::Rule) -> Option<Value> {
    match (rule.method, rule.path) {
        ("POST", p) if p.ends_with("/maintenance") => Some(json!({"on": false})),
        ("POST", "/api/v1/tokens") => Some(json!({})),
        ("POST", _) => Some(json!({})),
        _ => None,
    }
}

async fn every_route_answers_as_the_policy_says(url: &str) {
    let api = ApiServer::start(url).await;
    let tokens = [
        (Role::Viewer, api.token("v", "viewer")),
        (Role::Operator, api.token("o", "operator")),
        (Role::Admin, api.token("a", "admin")),
    ];
    // A machine nobody has: every handler that gets this far answers 404, past the policy.
    let nobody = uuid::Uuid::new_v4().to_string();
    for rule in policy::POLICY {
        let path = rule
            .path
            .replace("{id}", &nobody)
            .replace("{name}", "no-such-token");
        let method = Method::from_bytes(rule.method.as_bytes()).unwrap();
        let body = body_for(rule);
        let (status, problem, _) = api.call(method.clone(), &path, None, body.as_ref()).await;
        assert_eq!(
            status,
            StatusCode::UNAUTHORIZED,
            "{rule:?} without a token: {problem}"
        );
        assert_eq!(problem["type"], "urn:shepherd:problem:unauthenticated");
        for (role, token) in &tokens {
            let (status, answer, _) = api
                .call(method.clone(), &path, Some(token), body.as_ref())
                .await;
            if *role >= rule.role {
                assert!(
                    ![StatusCode::UNAUTHORIZED, StatusCode::FORBIDDEN].contains(&status),
                    "{rule:?} as {role}: {status} {answer}"
                );
            } else {
                assert_eq!(
                    status,
                    StatusCode::FORBIDDEN,
                    "{rule:?} as {role}: {answer}"
                );
                assert_eq!(answer["type"], "urn:shepherd:problem:forbidden");
            }
        }
    }
    // A route the policy does not name is not served, to anyone.
    let admin = &tokens[2].1;
    let (status, _, _) = api
        .call(Method::GET, "/api/v1/secrets", Some(admin), None)
        .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

async fn bad_tokens_are_refused(url: &str) {
    let api = ApiServer::start(url).await;
    let good = api.token("good", "viewer");
    let revoked = api.token("revoked", "admin");
    succeeds(shepherd().args(["tokens", "revoke", "revoked", "--database", url]));
    let db = Bmdb::open(url).await.unwrap();
    let (second, by) = (Duration::from_secs(1), Actor::named("test"));
    let expiring = db.create_api_token("expiring", Role::Admin, second, &by);
    let (_, expiring) = expiring.await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let mut tampered = good.clone();
    let last = tampered.pop().unwrap();
    tampered.push(if last == '0' { '1' } else { '0' });
    let cases = [
        (
            "unknown",
            "shp_0000000000000000000000000000000000000000000000000000000000000000".to_string(),
        ),
        ("tampered", tampered),
        ("revoked", revoked),
        ("expired", expiring.reveal().to_string()),
        ("not a token", "eyJhbGciOiJub25lIn0.e30.".to_string()),
    ];
    for (what, token) in &cases {
        let (status, problem, _) = api
            .call(Method::GET, "/api/v1/whoami", Some(token), None)
            .await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {problem}");
        // One answer for every way a credential is wrong: which check failed is the log's.
        assert_eq!(
            problem["detail"], "invalid credentials",
            "{what}: {problem}"
        );
    }
    let (status, me, _) = api
        .call(Method::GET, "/api/v1/whoami", Some(&good), None)
        .await;
    assert_eq!(
        (status, me),
        (
            StatusCode::OK,
            json!({"name": "token:good", "role": "Viewer"})
        )
    );
    // Basic credentials and a bare token are not bearer tokens.
    let basic = api
        .client
        .get(format!("{}/api/v1/whoami", api.base))
        .basic_auth("admin", Some(&good))
        .send()
        .await
        .unwrap();
    assert_eq!(basic.status(), StatusCode::UNAUTHORIZED);
    // Refusals too carry the security headers, HSTS among them (the API is HTTPS only).
    let headers = basic.headers();
    assert_eq!(headers["strict-transport-security"], "max-age=31536000");
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["cache-control"], "no-store");
    let listed =
        String::from_utf8(succeeds(shepherd().args(["tokens", "list", "--database", url])).stdout)
            .unwrap();
    assert!(
        listed.contains("revoked") && !listed.contains(&good),
        "{listed}"
    );
    db.close().await;
}

async fn actions_are_recorded_under_the_proven_identity(url: &str) {
    let (api, db, machine, ops) = ApiServer::with_machine(url, "ops-pipeline", "operator").await;
    let path = format!("/api/v1/machines/{machine}/maintenance");
    let body = json!({"on": true, "reason": "rack 4 power work"});
    let (status, answer, request_id) = api.call(Method::POST, &path, Some(&ops), Some(&body)).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["changed"], true);
    let request_id = request_id.expect("x-request-id");
    assert_eq!(answer["request_id"], request_id.as_str());
    // A reason is needed to take a machine away.
    let off = format!("/api/v1/machines/{machine}/decommission");
    let admin = api.token("root", "admin");
    let (status, problem, _) = api
        .call(Method::POST, &off, Some(&admin), Some(&json!({})))
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{problem}");
    // A reason that would print as a second, made-up history line is refused.
    let forged = json!({"reason": "ok\n2030-01-01T00:00:00Z  operator oidc:admin  decommission"});
    let (status, problem, _) = api
        .call(Method::POST, &off, Some(&admin), Some(&forged))
        .await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{problem}");
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("moves printed text"),
        "{problem}"
    );

    let shown = machine_json(url, machine);
    let action = &shown["operator_actions"][0];
    assert_eq!(action["by"], "token:ops-pipeline", "{shown}");
    assert_eq!(action["reason"], "rack 4 power work");
    assert_eq!(action["request_id"], request_id.as_str());
    let id = machine.to_string();
    let history = succeeds(shepherd().args(["machines", "history", &id, "--database", url]));
    let history = String::from_utf8(history.stdout).unwrap();
    assert!(
        history.contains("operator token:ops-pipeline") && history.contains(&request_id),
        "{history}"
    );
    let (_, via_api, _) = api
        .call(
            Method::GET,
            &format!("/api/v1/machines/{machine}/history"),
            Some(&ops),
            None,
        )
        .await;
    assert_eq!(
        via_api["history"][0]["who"], "operator token:ops-pipeline",
        "{via_api}"
    );
    db.close().await;
}

async fn hostile_input_gets_one_clear_4xx(url: &str) {
    let (api, db, machine, ops) = ApiServer::with_machine(url, "ops", "operator").await;
    let path = format!("/api/v1/machines/{machine}/maintenance");
    let raw = |body: String| {
        api.client
            .post(format!("{}{path}", api.base))
            .bearer_auth(&ops)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let cases = [
        (
            "malformed JSON",
            "{\"on\": tru".to_string(),
            StatusCode::BAD_REQUEST,
        ),
        (
            "unknown field",
            r#"{"on": true, "reason": "x", "force": true}"#.to_string(),
            StatusCode::BAD_REQUEST,
        ),
        (
            "wrong type",
            r#"{"on": "yes"}"#.to_string(),
            StatusCode::BAD_REQUEST,
        ),
        (
            "huge body",
            format!(r#"{{"on": true, "reason": "{}"}}"#, "x".repeat(100_000)),
            StatusCode::PAYLOAD_TOO_LARGE,
        ),
        (
            "long reason",
            format!(r#"{{"on": true, "reason": "{}"}}"#, "x".repeat(2_000)),
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
    ];
    for (what, body, want) in cases {
        let resp = raw(body).await.unwrap();
        let status = resp.status();
        let kind = resp.headers()["content-type"].to_str().unwrap().to_string();
        let problem: Value = resp.json().await.unwrap();
        assert_eq!(status, want, "{what}: {problem}");
        assert_eq!(kind, "application/problem+json", "{what}");
        assert!(
            problem["detail"].as_str().is_some_and(|d| !d.is_empty()),
            "{what}: {problem}"
        );
    }
    for query in [
        "limit=100000",
        "limit=0",
        "state=flying",
        "colour=red",
        "after=nope",
    ] {
        let (status, problem, _) = api
            .call(
                Method::GET,
                &format!("/api/v1/machines?{query}"),
                Some(&ops),
                None,
            )
            .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {problem}");
    }
    // Nothing changed.
    let shown = machine_json(url, machine);
    assert_eq!(shown["operator_actions"], json!([]), "{shown}");
    let (status, page, _) = api
        .call(Method::GET, "/api/v1/machines?limit=10", Some(&ops), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(page["machines"].as_array().unwrap().len(), 1, "{page}");

    let text = common::get_text(&api.metrics).await;
    let counted = |route: &str, result: &str| {
        let series =
            format!("shepherd_api_requests_total{{route=\"{route}\",result=\"{result}\"}}");
        sample(&text, &series)
    };
    assert_eq!(
        counted("/api/v1/machines", "invalid-request"),
        Some(5.0),
        "{text}"
    );
    assert_eq!(
        counted("/api/v1/machines/{id}/maintenance", "too-large"),
        Some(1.0)
    );
    assert!(!text.contains(&ops), "a token in the metrics");
    db.close().await;
}

/// A token revoked through one server is refused by another on the same BMDB within two
/// seconds, although that server had just accepted it (and so held it in its cache).
async fn a_revocation_holds_on_every_server_within_two_seconds(url: &str) {
    let (a, b) = (ApiServer::start(url).await, ApiServer::start(url).await);
    let admin = a.token("admin", "admin");
    let doomed = a.token("doomed", "viewer");
    let (status, _, _) = b
        .call(Method::GET, "/api/v1/whoami", Some(&doomed), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let (status, answer, _) = a
        .call(Method::DELETE, "/api/v1/tokens/doomed", Some(&admin), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let revoked = Instant::now();
    loop {
        let (status, _, _) = b
            .call(Method::GET, "/api/v1/whoami", Some(&doomed), None)
            .await;
        if status == StatusCode::UNAUTHORIZED {
            break;
        }
        assert_eq!(status, StatusCode::OK);
        assert!(
            revoked.elapsed() < Duration::from_secs(2),
            "server B still accepts the token {:?} after its revocation",
            revoked.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Every kind of security event lands in the audit trail with who, from where, on which
/// route and why; the API (admin only) and the CLI read it back with filters, and a web
/// sign-in's start and end are recorded with the change itself. Before the trail, none of
/// these was recorded anywhere.
async fn every_security_event_lands_in_the_audit_trail(url: &str) {
    let api = ApiServer::start(url).await;
    let admin = api.token("root", "admin");
    let viewer = api.token("watcher", "viewer");
    let body = json!({"name": "ci", "role": "viewer", "expires_in_days": 1});
    let (status, _, _) = api
        .call(Method::POST, "/api/v1/tokens", Some(&admin), Some(&body))
        .await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, _, _) = api
        .call(Method::DELETE, "/api/v1/tokens/ci", Some(&admin), None)
        .await;
    assert_eq!(status, StatusCode::OK);
    let body = json!({"of": "oidc:mallory@issuer"});
    let (status, _, _) = api
        .call(
            Method::POST,
            "/api/v1/tokens/revoke-sessions",
            Some(&admin),
            Some(&body),
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    let junk = "shp_0000000000000000000000000000000000000000000000000000000000000000";
    let get = |path: &'static str, token: &str| {
        let token = token.to_string();
        let api = &api;
        async move { api.call(Method::GET, path, Some(&token), None).await }
    };
    let (status, _, stranger) = get("/api/v1/whoami", junk).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = get("/api/v1/audit", &viewer).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "the trail is for admins");
    let db = Bmdb::open(url).await.unwrap();
    let who = Actor::named("oidc:alice@issuer");
    let made = db.create_web_session(&who, Role::Viewer, Duration::from_secs(600));
    let (session, _) = made.await.unwrap();
    db.revoke_api_token(&session.name, &who).await.unwrap();

    // Refusals are written in batches: the trail has them within a moment.
    let kinds = [
        "SignIn",
        "SignOut",
        "TokenCreated",
        "TokenRevoked",
        "SessionsRevoked",
        "Refused",
    ];
    let events = testing::eventually(
        "every kind in the trail",
        Duration::from_secs(10),
        async || {
            let (_, listed, _) = get("/api/v1/audit?limit=1000", &admin).await;
            let events = listed["events"].as_array().cloned().unwrap_or_default();
            let seen = |k: &str| events.iter().any(|e| e["kind"] == k);
            testing::when(kinds.iter().all(|k| seen(k)), events)
        },
    )
    .await;
    let one = |kind: &str, field: &str, value: &str| {
        events
            .iter()
            .find(|e| e["kind"] == kind && e[field] == value)
            .unwrap_or_else(|| panic!("no {kind} with {field} {value}: {events:#?}"))
            .clone()
    };
    let made = one("TokenCreated", "principal", "token:root");
    assert_eq!(made["route"], "/api/v1/tokens");
    assert_eq!(made["peer"], "127.0.0.1");
    assert!(
        made["reason"].as_str().unwrap().contains("token ci"),
        "{made}"
    );
    one("TokenRevoked", "principal", "token:root");
    let swept = one("SessionsRevoked", "principal", "token:root");
    assert!(
        swept["reason"]
            .as_str()
            .unwrap()
            .contains("oidc:mallory@issuer"),
        "{swept}"
    );
    let refused = one("Refused", "request_id", stranger.as_deref().unwrap());
    assert_eq!(refused["peer"], "127.0.0.1");
    assert_eq!(refused["route"], "/api/v1/whoami");
    assert!(
        refused["principal"].is_null(),
        "no identity was proven: {refused}"
    );
    assert!(
        refused["reason"]
            .as_str()
            .unwrap()
            .starts_with("unauthenticated"),
        "{refused}"
    );
    let forbidden = one("Refused", "principal", "token:watcher");
    assert_eq!(forbidden["route"], "/api/v1/audit");
    one("SignIn", "principal", "oidc:alice@issuer");
    one("SignOut", "principal", "oidc:alice@issuer");

    // Filters, through the API and the CLI on the database.
    let (_, only, _) = get("/api/v1/audit?kind=SignOut", &admin).await;
    let only = only["events"].as_array().unwrap();
    assert_eq!(only.len(), 1, "{only:?}");
    let (status, bad, _) = get("/api/v1/audit?kind=Nonsense", &admin).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}");
    let out = succeeds(shepherd().args([
        "audit",
        "list",
        "--principal",
        "token:root",
        "--since",
        "1h",
        "--database",
        url,
    ]));
    let listed = String::from_utf8(out.stdout).unwrap();
    assert!(
        listed.lines().count() >= 3 && listed.lines().all(|l| l.contains("token:root")),
        "{listed}"
    );
    let metrics = reqwest::get(&api.metrics)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("shepherd_audit_refusals_total{reason=\"unauthenticated\"}"),
        "{metrics}"
    );
}

/// One identity has one budget on every surface: requests on the API and scrapes of
/// `/metrics` with the same token draw on it, and another identity from the same peer still
/// gets through. Before, each surface counted alone and pages and `/metrics` not at all.
async fn an_identity_has_one_budget_on_every_surface(url: &str) {
    let limits = [
        "--api-rate",
        "0.001",
        "--api-burst",
        "4",
        "--metrics-require-token",
    ];
    let api = ApiServer::start_with(url, &limits).await;
    let (a, b) = (api.token("a", "viewer"), api.token("b", "viewer"));
    for n in 0..3 {
        let (status, _, _) = api
            .call(Method::GET, "/api/v1/whoami", Some(&a), None)
            .await;
        assert_eq!(status, StatusCode::OK, "request {n}");
    }
    let scrape = |token: &str| {
        let request = reqwest::Client::new().get(&api.metrics).bearer_auth(token);
        async move { request.send().await.unwrap().status() }
    };
    assert_eq!(scrape(&a).await, StatusCode::OK, "a's fourth request");
    assert_eq!(scrape(&a).await, StatusCode::TOO_MANY_REQUESTS, "a's fifth");
    assert_eq!(scrape(&b).await, StatusCode::OK, "b from the same peer");
}

shepherd_bmdb::url_conformance_tests!(
    an_identity_has_one_budget_on_every_surface,
    every_security_event_lands_in_the_audit_trail,
    a_revocation_holds_on_every_server_within_two_seconds,
    every_route_answers_as_the_policy_says,
    bad_tokens_are_refused,
    actions_are_recorded_under_the_proven_identity,
    hostile_input_gets_one_clear_4xx,
);

/// An OpenID provider for tests, on loopback: discovery and a key set of ES256 keys that the
/// test signs tokens with, and can rotate or take down.
struct TestIssuer {
    url: String,
    keys: Arc<Mutex<Vec<Value>>>,
    stop: tokio_util::sync::CancellationToken,
    served: tokio::task::JoinHandle<()>,
}

/// A signing key of the test issuer: its id and private key.
struct SigningKey {
    kid: String,
    key: rcgen::KeyPair,
}

impl SigningKey {
    fn new(kid: &str) -> SigningKey {
        SigningKey {
            kid: kid.to_string(),
            key: rcgen::KeyPair::generate().unwrap(),
        }
    }

    /// Its public JWK.
    fn jwk(&self) -> Value {
        use base64::Engine;
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let point = self.key.public_key_raw();
        json!({"kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig", "kid": self.kid,
               "x": b64.encode(&point[1..33]), "y": b64.encode(&point[33..65])})
    }

    /// `claims` signed with it.
    fn sign(&self, claims: &Value) -> String {
        self.sign_typed(claims, "JWT")
    }

    /// `claims` signed with it, the header's `typ` being `typ`.
    fn sign_typed(&self, claims: &Value, typ: &str) -> String {
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::ES256);
        header.kid = Some(self.kid.clone());
        header.typ = Some(typ.into());
        let pem = self.key.serialize_pem();
        let key = jsonwebtoken::EncodingKey::from_ec_pem(pem.as_bytes()).unwrap();
        jsonwebtoken::encode(&header, claims, &key).unwrap()
    }
}

impl TestIssuer {
    async fn start(first: &SigningKey) -> TestIssuer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let keys = Arc::new(Mutex::new(vec![first.jwk()]));
        let discovery = json!({"issuer": url, "jwks_uri": format!("{url}/jwks")});
        let served_keys = keys.clone();
        let app = axum::Router::new()
            .route(
                "/.well-known/openid-configuration",
                axum::routing::get(move || async move { axum::Json(discovery) }),
            )
            .route(
                "/jwks",
                axum::routing::get(move || async move {
                    axum::Json(json!({"keys": *served_keys.lock().unwrap()}))
                }),
            );
        let stop = tokio_util::sync::CancellationToken::new();
        let stopped = stop.clone();
        let served = tokio::spawn(async move {
            let shutdown = async move { stopped.cancelled().await };
            axum::serve(listener, app)
                .with_graceful_shutdown(shutdown)
                .await
                .unwrap();
        });
        TestIssuer {
            url,
            keys,
            stop,
            served,
        }
    }

    /// Claims of a token for `sub` in `groups`, valid now for five minutes.
    fn claims(&self, sub: &str, groups: &[&str]) -> Value {
        let now = chrono::Utc::now().timestamp();
        json!({"iss": self.url, "aud": "shepherd", "sub": sub, "groups": groups,
               "iat": now, "nbf": now - 5, "exp": now + 300})
    }

    /// Publishes `key` instead of every key before.
    fn rotate_to(&self, key: &SigningKey) {
        *self.keys.lock().unwrap() = vec![key.jwk()];
    }

    /// Stops answering: the port is closed.
    async fn go_down(self) {
        self.stop.cancel();
        self.served.await.unwrap();
    }
}

/// `header.payload.` with the payload of `token` replaced by `claims` (base64url JSON).
fn with_payload(token: &str, claims: &Value) -> String {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let parts: Vec<&str> = token.split('.').collect();
    let payload = b64.encode(claims.to_string());
    format!("{}.{payload}.{}", parts[0], parts[2])
}

/// Tokens of an OpenID provider: the role comes from `groups` through the mapping; every
/// kind of bad token is refused; a rotated key is picked up without a restart; with the
/// provider down, tokens of keys already fetched still work and others fail saying why.
async fn identity_provider_tokens_are_verified(url: &str) {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let first = SigningKey::new("k1");
    let issuer = TestIssuer::start(&first).await;
    // A key the provider publishes for encryption only: tokens signed with it are refused.
    let for_encryption = SigningKey::new("k-enc");
    let mut enc = for_encryption.jwk();
    enc["use"] = json!("enc");
    issuer.keys.lock().unwrap().push(enc);
    let extra = [
        "--oidc-issuer",
        &issuer.url,
        "--oidc-audience",
        "shepherd",
        "--oidc-role",
        "fleet-ops=operator",
        "--oidc-role",
        "fleet-admins=admin",
        "--oidc-leeway",
        "5s",
    ];
    let api = ApiServer::start_with(url, &extra).await;
    let whoami = async |token: &str| {
        api.call(Method::GET, "/api/v1/whoami", Some(token), None)
            .await
    };

    let alice = first.sign(&issuer.claims("alice", &["fleet-ops", "visitors"]));
    let (status, me, _) = whoami(&alice).await;
    let name = format!("oidc:alice@{}", issuer.url);
    assert_eq!(
        (status, me),
        (StatusCode::OK, json!({"name": name, "role": "Operator"}))
    );
    let (status, _, _) = api
        .call(
            Method::POST,
            "/api/v1/tokens",
            Some(&alice),
            Some(&json!({})),
        )
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "an operator makes no tokens");

    let now = chrono::Utc::now().timestamp();
    let admin_claims = issuer.claims("alice", &["fleet-admins"]);
    let claims = |change: Value| {
        let mut c = admin_claims.clone();
        for (k, v) in change.as_object().unwrap() {
            c[k] = v.clone();
        }
        c
    };
    let header_none = b64.encode(r#"{"alg":"none","kid":"k1","typ":"JWT"}"#);
    let unsigned = format!(
        "{header_none}.{}.",
        b64.encode(claims(json!({})).to_string())
    );
    let hs256 = {
        let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256);
        header.kid = Some("k1".into());
        let public = first.jwk().to_string();
        let key = jsonwebtoken::EncodingKey::from_secret(public.as_bytes());
        jsonwebtoken::encode(&header, &claims(json!({})), &key).unwrap()
    };
    let stranger = SigningKey::new("k-unknown");
    let refused = [
        ("expired", first.sign(&claims(json!({"exp": now - 60})))),
        (
            "not yet valid",
            first.sign(&claims(json!({"nbf": now + 120}))),
        ),
        (
            "wrong audience",
            first.sign(&claims(json!({"aud": "someone-else"}))),
        ),
        (
            "wrong issuer",
            first.sign(&claims(json!({"iss": "http://127.0.0.1:1/evil"}))),
        ),
        ("unsigned", unsigned),
        ("HS256 with the public key", hs256),
        (
            "signed with a key published for encryption",
            for_encryption.sign(&claims(json!({}))),
        ),
        (
            "an ID token (a nonce, typ JWT)",
            first.sign(&claims(json!({"nonce": "n-1"}))),
        ),
        ("tampered", with_payload(&alice, &claims(json!({})))),
        (
            "no exp",
            first.sign(&{
                let mut c = claims(json!({}));
                c.as_object_mut().unwrap().remove("exp");
                c
            }),
        ),
    ];
    for (what, token) in &refused {
        let (status, problem, _) = whoami(token).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{what}: {problem}");
    }
    // An access token typed as one (RFC 9068) may carry a nonce.
    let typed = first.sign_typed(&claims(json!({"nonce": "n-1"})), "at+jwt");
    let (status, problem, _) = whoami(&typed).await;
    assert_eq!(status, StatusCode::OK, "{problem}");
    let (status, problem, _) = whoami(&first.sign(&issuer.claims("bob", &["visitors"]))).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "no mapped group: {problem}");
    assert!(
        problem["detail"].as_str().unwrap().contains("no role"),
        "{problem}"
    );

    // Rotation: the provider publishes a new key; its tokens work without a restart.
    let second = SigningKey::new("k2");
    issuer.rotate_to(&second);
    tokio::time::sleep(Duration::from_secs(5)).await; // the refetch floor
    let carol = second.sign(&issuer.claims("carol", &["fleet-admins"]));
    let (status, me, _) = whoami(&carol).await;
    assert_eq!(
        (status, me["role"].clone()),
        (StatusCode::OK, json!("Admin")),
        "{me}"
    );
    // A token verified once is remembered, but only until it expires: this one is past its
    // exp by 3 s, inside the 5 s allowance, and is used again after the wait below.
    let mut late = issuer.claims("dave", &["fleet-ops"]);
    late["exp"] = json!(chrono::Utc::now().timestamp() - 3);
    let brief = second.sign(&late);
    let (status, _, _) = whoami(&brief).await;
    assert_eq!(status, StatusCode::OK, "a token inside the allowance");

    // The provider goes down: tokens of the keys fetched keep working; a new key cannot be
    // fetched, and the refusal says so.
    issuer.go_down().await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (status, _, _) = whoami(&carol).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "a cached key with the provider down"
    );
    let (status, problem, _) = whoami(&brief).await;
    assert_eq!(
        status,
        StatusCode::UNAUTHORIZED,
        "a remembered token past its exp: {problem}"
    );
    // The stranger is told no more than that (the log says the key cannot be fetched).
    let (status, problem, _) = whoami(&stranger.sign(&claims(json!({})))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{problem}");
    assert_eq!(problem["detail"], "invalid credentials", "{problem}");
}

shepherd_bmdb::url_conformance_tests!(identity_provider_tokens_are_verified);

/// Every `machines` and `tokens` command through the API (`--api`, `SHEPHERD_API_TOKEN`):
/// reads print what they print on the database, actions are recorded under the token.
async fn the_cli_works_through_the_api(url: &str) {
    let (api, db, machine, admin) = ApiServer::with_machine(url, "cli-admin", "admin").await;
    let ca = api.dir.path().join("certs/ca.pem");
    let run = |through_api: bool, args: &[&str]| {
        let mut cmd = shepherd();
        cmd.args(args).args(["--database", url]);
        if through_api {
            cmd.args(["--api", &api.base]).arg("--api-ca").arg(&ca);
            cmd.env("SHEPHERD_API_TOKEN", &admin);
        }
        let out = cmd.output().unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(
            out.status.success(),
            "{args:?} (API: {through_api}): {stderr}"
        );
        stdout.to_string()
    };
    let id = machine.to_string();
    let image = [
        "--image",
        "https://images.example/os.img",
        "--sha256",
        &"ab".repeat(32),
        "--device",
        "/dev/sda",
    ];
    let actions: [(Vec<&str>, &str); 7] = [
        (
            vec!["maintenance", "on", &id, "--reason", "disk swap"],
            "in maintenance",
        ),
        (vec!["maintenance", "off", &id], "out of maintenance"),
        (vec!["retry", &id], "no backoff to clear"),
        (vec!["forget-host-key", &id], "no host key pinned"),
        (
            [vec!["install", &id], image.to_vec()].concat(),
            "generation 1 recorded",
        ),
        (
            vec!["decommission", &id, "--reason", "returned"],
            "decommissioned",
        ),
        (vec!["recommission", &id], "recommissioned"),
    ];
    for (args, said) in &actions {
        let out = run(true, &[&["machines"][..], args].concat());
        assert!(out.contains(said), "{args:?}: {out}");
    }
    let other = testing::provision(&db, 1, ProviderKind::Sim).await[0].to_string();
    for read in [
        vec!["machines", "list", "--json"],
        vec!["machines", "list"],
        vec!["machines", "show", &other, "--json"],
        vec!["machines", "show", &other],
        vec!["machines", "history", &id],
    ] {
        assert_eq!(run(true, &read), run(false, &read), "{read:?}");
    }
    // Reimage: a machine recorded bare goes back to Bare, the operator recorded as who
    // allowed the wipe; one that was not is refused with why, and nothing is written.
    let bare = testing::provision(&db, 1, ProviderKind::Static).await[0];
    db.transact(move |tx| {
        Box::pin(async move { tx.record_bare(bare, None, "recorded bare", None).await })
    })
    .await
    .unwrap();
    let bare_id = bare.to_string();
    let reimage =
        |m: &str| ["machines", "reimage", m, "--wipe", "--reason", "new disk"].map(String::from);
    let out = run(true, &reimage(&bare_id).each_ref().map(String::as_str));
    assert!(
        out.contains("reimaging") && out.contains("overwriting its disk"),
        "{out}"
    );
    let tag = db
        .read(move |tx| Box::pin(async move { tx.bare_metal(bare).await }))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(tag.phase, shepherd_bmdb::BarePhase::Bare);
    assert_eq!(
        tag.wipe_by.as_deref(),
        Some("token:cli-admin (reimage: new disk)")
    );
    let out = shepherd()
        .args(reimage(&other))
        .args(["--api", &api.base, "--database", url])
        .arg("--api-ca")
        .arg(&ca)
        .env("SHEPHERD_API_TOKEN", &admin)
        .output()
        .unwrap();
    common::refused(&out, "was not recorded bare");
    let history = run(false, &["machines", "history", &id]);
    // Retry and forget-host-key found nothing to do, so they wrote nothing.
    assert_eq!(
        history.matches("operator token:cli-admin").count(),
        5,
        "{history}"
    );

    let secret = run(
        true,
        &[
            "tokens",
            "create",
            "--name",
            "made-remotely",
            "--role",
            "viewer",
            "--expires",
            "7d",
        ],
    );
    assert!(secret.trim().starts_with("shp_"), "{secret}");
    let listed = run(true, &["tokens", "list"]);
    assert_eq!(listed, run(false, &["tokens", "list"]));
    assert!(
        listed.contains("made-remotely") && !listed.contains(secret.trim()),
        "{listed}"
    );
    // More tokens than a page holds, sign-ins among them (they sort last): every one is
    // listed, through either path.
    let day = Duration::from_secs(86_400);
    use futures::StreamExt;
    futures::stream::iter(0..1500)
        .for_each_concurrent(8, |n| {
            let db = db.clone();
            async move {
                if n % 5 == 0 {
                    let who = Actor::named("oidc:someone");
                    db.create_web_session(&who, Role::Viewer, day)
                        .await
                        .unwrap();
                } else {
                    let (name, by) = (format!("bulk-{n:04}"), Actor::named("test"));
                    db.create_api_token(&name, Role::Viewer, day, &by)
                        .await
                        .unwrap();
                }
            }
        })
        .await;
    let listed = run(true, &["tokens", "list"]);
    assert_eq!(listed, run(false, &["tokens", "list"]));
    assert_eq!(listed.lines().count(), 1502, "{listed}");
    assert_eq!(
        listed.lines().filter(|l| l.starts_with("session.")).count(),
        300
    );
    // One person's sign-ins: listed by who they are for, and revoked together.
    for who in ["oidc:dana@idp", "oidc:dana@idp", "oidc:erin@idp"] {
        let who = Actor::named(who);
        db.create_web_session(&who, Role::Viewer, day)
            .await
            .unwrap();
    }
    let danas = run(true, &["tokens", "list", "--by", "oidc:dana@idp"]);
    assert_eq!(
        danas,
        run(false, &["tokens", "list", "--by", "oidc:dana@idp"])
    );
    assert_eq!(
        danas.lines().filter(|l| l.contains(" valid ")).count(),
        2,
        "{danas}"
    );
    let said = run(true, &["tokens", "revoke-sessions", "oidc:dana@idp"]);
    assert!(
        said.contains("revoked 2 web sign-in(s) of oidc:dana@idp"),
        "{said}"
    );
    let danas = run(false, &["tokens", "list", "--by", "oidc:dana@idp"]);
    assert_eq!(
        danas.lines().filter(|l| l.contains(" revoked ")).count(),
        2,
        "{danas}"
    );
    let erins = run(false, &["tokens", "list", "--by", "oidc:erin@idp"]);
    assert!(
        erins.contains(" valid ") && erins.lines().count() == 1,
        "{erins}"
    );
    let revoked = run(true, &["tokens", "revoke", "made-remotely"]);
    assert!(revoked.contains("revoked"), "{revoked}");
    // A viewer's token cannot act, and the refusal is the command's error.
    let viewer = api.token("cli-viewer", "viewer");
    let out = shepherd()
        .args([
            "machines",
            "retry",
            &id,
            "--api",
            &api.base,
            "--database",
            url,
        ])
        .arg("--api-ca")
        .arg(&ca)
        .env("SHEPHERD_API_TOKEN", &viewer)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("403"), "{stderr}");
    db.close().await;
}

shepherd_bmdb::url_conformance_tests!(the_cli_works_through_the_api);

/// A real OpenID provider (oidc-provider under Node): its client-credentials JWTs work, the
/// role coming from their `scope`, and an action is recorded under the client's identity.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_openid_provider_s_tokens_work() {
    let idp = common::oidc::OidcProvider::start();
    let fresh = testing::fresh_sqlite_url();
    let extra = [
        "--oidc-issuer",
        &idp.issuer,
        "--oidc-audience",
        "shepherd",
        "--oidc-role-claim",
        "scope",
        "--oidc-scope-clients",
        "ci-pipeline",
        "--oidc-role",
        "shepherd:viewer=viewer,shepherd:operator=operator",
    ];
    let api = ApiServer::start_with(&fresh.url, &extra).await;
    let db = Bmdb::open(&fresh.url).await.unwrap();
    let machine = testing::provision(&db, 1, ProviderKind::Sim).await[0];
    let viewer = idp.client_token("shepherd:viewer").await;
    let operator = idp.client_token("shepherd:operator").await;

    let (status, me, _) = api
        .call(Method::GET, "/api/v1/whoami", Some(&viewer), None)
        .await;
    let name = format!("oidc:ci-pipeline@{}", idp.issuer);
    assert_eq!(
        (status, me),
        (StatusCode::OK, json!({"name": name, "role": "Viewer"}))
    );
    let path = format!("/api/v1/machines/{machine}/maintenance");
    let body = json!({"on": true, "reason": "firmware update"});
    let (status, _, _) = api
        .call(Method::POST, &path, Some(&viewer), Some(&body))
        .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, answer, _) = api
        .call(Method::POST, &path, Some(&operator), Some(&body))
        .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let shown = machine_json(&fresh.url, machine);
    assert_eq!(shown["operator_actions"][0]["by"], name.as_str(), "{shown}");
    db.close().await;
}

/// The web UI and `/metrics` ask no one who they are: the server refuses to serve them beyond
/// loopback unless told so explicitly, and serves them there when it is.
#[test]
fn the_unauthenticated_web_ui_stays_on_loopback_unless_told() {
    let fresh = testing::fresh_sqlite_url();
    let dir = tempfile::tempdir().unwrap();
    let out = common::server(&fresh.url, dir.path())
        .args(["--http-listen", "0.0.0.0:0"])
        .output()
        .unwrap();
    common::refused(&out, "http-listen: 0.0.0.0:0 is not loopback");
    let (mut server, _) = common::started_server(
        &fresh.url,
        dir.path(),
        &["--http-listen", "0.0.0.0:0", "--insecure-web-listen"],
        &["shepherd server: web UI at http://"],
    );
    assert!(server.child().try_wait().unwrap().is_none(), "it serves");
}

/// The OpenAPI document the server serves is the one committed (`docs/openapi.json`), and it
/// has one operation per rule of the policy. `SHEPHERD_UPDATE_OPENAPI=1` rewrites the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_is_committed_and_complete() {
    let fresh = testing::fresh_sqlite_url();
    let api = ApiServer::start(&fresh.url).await;
    let viewer = api.token("docs", "viewer");
    let (status, served, _) = api
        .call(Method::GET, "/api/v1/openapi.json", Some(&viewer), None)
        .await;
    assert_eq!(status, StatusCode::OK, "{served}");
    assert_eq!(served["openapi"], "3.1.0");
    let committed =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/openapi.json");
    let text = serde_json::to_string_pretty(&served).unwrap() + "\n";
    if std::env::var("SHEPHERD_UPDATE_OPENAPI").is_ok_and(|v| v == "1") {
        std::fs::write(&committed, &text).unwrap();
    }
    let on_disk = std::fs::read_to_string(&committed).unwrap_or_default();
    assert!(
        on_disk == text,
        "docs/openapi.json differs from what the server serves; \
         run SHEPHERD_UPDATE_OPENAPI=1 cargo test -p shepherd --test it api::openapi"
    );
    let mut documented: Vec<(String, String)> = Vec::new();
    for (path, item) in served["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            documented.push((method.to_uppercase(), path.clone()));
        }
    }
    let mut ruled: Vec<(String, String)> = policy::POLICY
        .iter()
        .map(|r| (r.method.to_string(), r.path.to_string()))
        .collect();
    documented.sort();
    ruled.sort();
    assert_eq!(documented, ruled);
}

/// A client that connects and sends nothing, or stops after a request, is closed by the API
/// within its header timeout (10 s), before or between requests: nobody holds a connection
/// for free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_api_connections_are_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let fresh = testing::fresh_sqlite_url();
    let api = ApiServer::start(&fresh.url).await;
    let ca = std::fs::read(api.dir.path().join("certs/ca.pem")).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut &ca[..]) {
        roots.add(c.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let port = api.base.rsplit(':').next().unwrap().to_string();
    let connect = async || {
        let tcp = tokio::net::TcpStream::connect(format!("127.0.0.1:{port}"))
            .await
            .unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        connector.connect(name, tcp).await.unwrap()
    };
    let closed_within =
        async |stream: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>| {
            let started = std::time::Instant::now();
            let mut buf = vec![0u8; 4096];
            let outcome = tokio::time::timeout(Duration::from_secs(30), async {
                loop {
                    match stream.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(_) => {}
                    }
                }
            })
            .await;
            assert!(outcome.is_ok(), "still open after 30 s");
            started.elapsed()
        };
    let (mut silent, mut after_one) = (connect().await, connect().await);
    after_one
        .write_all(b"GET /api/v1/whoami HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    let (waited, _) = tokio::join!(closed_within(&mut silent), closed_within(&mut after_one));
    assert!(
        waited >= Duration::from_secs(5),
        "closed too soon: {waited:?}"
    );
}
