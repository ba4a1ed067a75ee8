//! `shepherd config print run|server`: the effective configuration of a command after flags,
//! environment and config file are merged, with where each value came from and secrets
//! redacted. The output is valid TOML, so it can seed a config file.

use clap::parser::ValueSource;
use clap::{ArgMatches, Command};

/// What replaces a secret.
pub const REDACTED: &str = "<redacted>";

/// Whether a setting holds a secret (its value is never printed).
fn is_secret(name: &str) -> bool {
    ["password", "secret", "token", "api-key", "auth"]
        .iter()
        .any(|s| name.contains(s))
}

/// `url` with any password in its user-info or query replaced.
pub fn redact_url(url: &str) -> String {
    let mut out = url.to_string();
    if let Some(scheme_end) = out.find("://") {
        let rest = &out[scheme_end + 3..];
        let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
        if let Some(at) = rest[..authority_end].rfind('@') {
            if let Some(colon) = rest[..at].find(':') {
                let (start, end) = (scheme_end + 3 + colon + 1, scheme_end + 3 + at);
                out.replace_range(start..end, REDACTED);
            }
        }
    }
    if let Some(q) = out.find('?') {
        let (head, query) = out.split_at(q + 1);
        let query: Vec<String> = query
            .split('&')
            .map(|kv| match kv.split_once('=') {
                Some((k, _)) if is_secret(&k.to_ascii_lowercase()) => format!("{k}={REDACTED}"),
                _ => kv.to_string(),
            })
            .collect();
        out = format!("{head}{}", query.join("&"));
    }
    out
}

fn toml_value(raw: &str, takes_values: bool) -> String {
    if !takes_values && (raw == "true" || raw == "false") {
        return raw.to_string();
    }
    if raw.parse::<i64>().is_ok() || (raw.parse::<f64>().is_ok() && raw.contains('.')) {
        return raw.to_string();
    }
    format!("{raw:?}")
}

/// Renders the settings of `sub` (a `run` or `server` command) as parsed into `matches`;
/// `root` supplies the global settings, `from_file` the ones the config file set.
pub fn render(root: &Command, sub: &Command, matches: &ArgMatches, from_file: &[String]) -> String {
    let mut out = format!(
        "# shepherd {}: effective configuration (flag > environment > config file > default)\n",
        sub.get_name()
    );
    let args = root
        .get_arguments()
        .filter(|a| a.is_global_set())
        .chain(sub.get_arguments());
    for arg in args {
        let Some(name) = arg.get_long() else { continue };
        if matches!(name, "help" | "version" | "config") {
            continue;
        }
        let id = arg.get_id().as_str();
        let values: Option<Vec<String>> = matches
            .get_raw(id)
            .map(|v| v.map(|s| s.to_string_lossy().into_owned()).collect());
        let source = if from_file.iter().any(|f| f == name) {
            "config file".to_string()
        } else {
            match matches.value_source(id) {
                Some(ValueSource::CommandLine) => "flag".into(),
                Some(ValueSource::EnvVariable) => format!(
                    "environment {}",
                    arg.get_env()
                        .map(|e| e.to_string_lossy())
                        .unwrap_or_default()
                ),
                Some(ValueSource::DefaultValue) => "default".into(),
                _ => "not set".into(),
            }
        };
        let Some(values) = values else {
            out += &format!("# {name} is not set\n");
            continue;
        };
        let joined = values.join(",");
        let shown = if is_secret(name) {
            format!("{REDACTED:?}")
        } else if name == "database" {
            format!("{:?}", redact_url(&joined))
        } else {
            toml_value(&joined, arg.get_action().takes_values())
        };
        out += &format!("{name} = {shown}  # {source}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_in_urls_are_redacted() {
        assert_eq!(
            redact_url("postgres://shepherd:hunter2@db.example:5432/bmdb?sslmode=require"),
            "postgres://shepherd:<redacted>@db.example:5432/bmdb?sslmode=require"
        );
        assert_eq!(
            redact_url("postgres://db.example/bmdb?user=s&password=hunter2"),
            "postgres://db.example/bmdb?user=s&password=<redacted>"
        );
        assert_eq!(
            redact_url("sqlite:/var/lib/shepherd/bmdb.sqlite"),
            "sqlite:/var/lib/shepherd/bmdb.sqlite"
        );
        assert_eq!(
            redact_url("postgres://shepherd@db/bmdb"),
            "postgres://shepherd@db/bmdb"
        );
    }

    #[test]
    fn values_are_toml() {
        assert_eq!(toml_value("8", true), "8");
        assert_eq!(toml_value("0.5", true), "0.5");
        assert_eq!(toml_value("250ms,8", true), "\"250ms,8\"");
        assert_eq!(toml_value("true", false), "true");
        assert_eq!(toml_value("a\"b", true), "\"a\\\"b\"");
    }
}
