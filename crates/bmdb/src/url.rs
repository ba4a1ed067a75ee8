//! Parsing of database URLs: `sqlite:PATH` or `postgres://...`.

use std::path::PathBuf;
use std::str::FromStr;

use sqlx::postgres::PgConnectOptions;

use crate::Error;

/// Where the BMDB lives.
#[derive(Debug, Clone)]
pub enum DatabaseUrl {
    /// An SQLite database file.
    Sqlite(PathBuf),
    /// A PostgreSQL database.
    Postgres(Box<PgConnectOptions>),
}

/// The default database: `shepherd.db` in the working directory.
pub const DEFAULT_DATABASE_URL: &str = "sqlite:./shepherd.db";

impl DatabaseUrl {
    /// Parses `sqlite:PATH` (also `sqlite://PATH`) or `postgres://` / `postgresql://` URLs.
    pub fn parse(url: &str) -> Result<Self, Error> {
        let invalid = |reason: &str| Error::InvalidUrl {
            url: redact(url),
            reason: reason.to_string(),
        };
        if let Some(rest) = url.strip_prefix("sqlite:") {
            let path = rest.strip_prefix("//").unwrap_or(rest);
            if path.is_empty() {
                return Err(invalid("missing file path"));
            }
            if path.starts_with(':') {
                return Err(invalid(
                    "in-memory SQLite is not supported; give a file path",
                ));
            }
            return Ok(DatabaseUrl::Sqlite(PathBuf::from(path)));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let opts = PgConnectOptions::from_str(url).map_err(|e| invalid(&e.to_string()))?;
            return Ok(DatabaseUrl::Postgres(Box::new(opts)));
        }
        Err(invalid("unknown scheme"))
    }

    /// A description of the target safe to print (no password).
    pub fn display_target(&self) -> String {
        match self {
            DatabaseUrl::Sqlite(p) => format!("sqlite:{}", p.display()),
            DatabaseUrl::Postgres(o) => format!(
                "postgres://{}@{}:{}/{}",
                o.get_username(),
                o.get_host(),
                o.get_port(),
                o.get_database().unwrap_or("")
            ),
        }
    }
}

/// The URL with any password replaced, for error messages. Works on text, not a parsed URL,
/// because the URLs it redacts are the ones that failed to parse.
fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_string();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:REDACTED{}",
            &url[..scheme_end],
            &rest[..colon],
            &rest[at..]
        ),
        None => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_good_urls() {
        assert!(
            matches!(DatabaseUrl::parse("sqlite:./x.db").unwrap(), DatabaseUrl::Sqlite(p) if p.as_path() == std::path::Path::new("./x.db"))
        );
        assert!(
            matches!(DatabaseUrl::parse("sqlite:///tmp/x.db").unwrap(), DatabaseUrl::Sqlite(p) if p.as_path() == std::path::Path::new("/tmp/x.db"))
        );
        assert!(matches!(
            DatabaseUrl::parse("postgres://postgres@127.0.0.1/test").unwrap(),
            DatabaseUrl::Postgres(_)
        ));
        assert!(matches!(
            DatabaseUrl::parse("postgresql://u:p@h:5433/d").unwrap(),
            DatabaseUrl::Postgres(_)
        ));
    }

    #[test]
    fn rejects_bad_urls_without_echoing_passwords() {
        for bad in [
            "",
            "mysql://h/d",
            "sqlite:",
            "sqlite::memory:",
            "http://x",
            "postgres://u:secret@h:notaport/d",
            "postgres://u:p%40ss:secret@h:x/d",
        ] {
            let err = DatabaseUrl::parse(bad).unwrap_err().to_string();
            assert!(err.contains("invalid database URL"), "{bad}: {err}");
            assert!(!err.contains("secret"), "{err}");
        }
    }
}
