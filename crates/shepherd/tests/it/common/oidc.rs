//! A real OpenID provider for tests: panva's `oidc-provider` under Node
//! (`common/oidc-idp.mjs`), installed by `scripts/test-deps.sh`, on a free loopback port.

use std::process::{Command, Stdio};

use super::{announced, free_port, ChildGuard};

/// A running provider.
pub struct OidcProvider {
    /// Its issuer URL (`http://127.0.0.1:PORT`).
    pub issuer: String,
    /// The file of group overrides the provider reads at each use (`IDP_GROUPS_FILE`).
    groups: tempfile::NamedTempFile,
    _node: ChildGuard,
}

impl OidcProvider {
    /// Starts it; fails the test, naming the fix, when it is not installed.
    pub fn start() -> OidcProvider {
        Self::start_with(None)
    }

    /// Starts it; with `web_redirect`, it also knows the web UI's client `shepherd-web`
    /// (secret `shepherd-web-secret`) with that redirect URI.
    pub fn start_with(web_redirect: Option<&str>) -> OidcProvider {
        let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
        let dir = std::env::var("SHEPHERD_OIDC_PROVIDER_DIR")
            .unwrap_or_else(|_| format!("{home}/.cache/shepherd/oidc-provider"));
        let package = std::path::Path::new(&dir).join("node_modules/oidc-provider/package.json");
        assert!(
            package.exists(),
            "{} is missing: run scripts/test-deps.sh (installs Node and oidc-provider)",
            package.display()
        );
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/it/common/oidc-idp.mjs");
        let port = free_port().to_string();
        let groups = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(groups.path(), "{}").unwrap();
        let child = Command::new("node")
            .args([script, &dir, &port])
            .args(web_redirect)
            .env("IDP_GROUPS_FILE", groups.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("node (scripts/test-deps.sh installs it)");
        let mut node = ChildGuard(Some(child));
        let issuer = announced(node.child(), "idp: listening at ");
        OidcProvider {
            issuer,
            groups,
            _node: node,
        }
    }

    /// From now on, the provider puts `name` in `groups` (whatever its name says).
    pub fn set_groups(&self, name: &str, groups: &[&str]) {
        let overrides = serde_json::json!({ name: groups });
        std::fs::write(self.groups.path(), overrides.to_string()).unwrap();
    }

    /// An access token (a JWT) for the client `ci-pipeline` with `scope`, by the client
    /// credentials grant.
    pub async fn client_token(&self, scope: &str) -> String {
        let form = [
            ("grant_type", "client_credentials"),
            ("scope", scope),
            ("resource", "urn:shepherd:api"),
        ];
        let answer: serde_json::Value = reqwest::Client::new()
            .post(format!("{}/token", self.issuer))
            .basic_auth("ci-pipeline", Some("ci-pipeline-secret"))
            .form(&form)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let token = answer["access_token"].as_str();
        token
            .unwrap_or_else(|| panic!("no token: {answer}"))
            .to_string()
    }
}
