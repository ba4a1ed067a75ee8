//! Failure causes grouped by shape: the same failure on a hundred machines reads as a hundred
//! causes (`connecting to 10.0.0.219:22: refused`, `… 10.0.0.60:22 …`) until its addresses,
//! ids and numbers are masked. The overview counts causes per shape and shows one example.

use std::collections::HashMap;

/// One shape of failure cause: how many failures had it, and one of its causes as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CauseShape {
    /// The cause with addresses (`<addr>`), ids (`<id>`) and numbers (`<n>`) masked.
    pub shape: String,
    /// Failures with a cause of this shape.
    pub failures: i64,
    /// The most frequent cause of this shape.
    pub example: String,
}

/// The web UI's page of the machines that failed with a cause of `shape`.
pub fn machines_link(shape: &str) -> String {
    let url = reqwest::Url::parse_with_params("http://ui/failures", [("shape", shape)]);
    url.map_or_else(
        |_| "/failures".into(),
        |u| format!("/failures?{}", u.query().unwrap_or("")),
    )
}

/// Groups `causes` (each with its failure count) by shape; the `limit` largest shapes, by
/// failures, then shape.
pub fn group(causes: &[(String, i64)], limit: usize) -> Vec<CauseShape> {
    let mut shapes: HashMap<String, (i64, &str, i64)> = HashMap::new();
    for (cause, n) in causes {
        let entry = shapes.entry(mask(cause)).or_insert((0, cause, 0));
        entry.0 += n;
        if *n > entry.2 {
            (entry.1, entry.2) = (cause, *n);
        }
    }
    let mut grouped: Vec<CauseShape> = shapes
        .into_iter()
        .map(|(shape, (failures, example, _))| CauseShape {
            shape,
            failures,
            example: example.to_string(),
        })
        .collect();
    grouped.sort_by(|a, b| b.failures.cmp(&a.failures).then(a.shape.cmp(&b.shape)));
    grouped.truncate(limit);
    grouped
}

/// `cause` with every word that holds an address, an id or a number masked.
pub fn mask(cause: &str) -> String {
    let mut out = String::with_capacity(cause.len());
    let mut word = String::new();
    for c in cause.chars() {
        if c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '-' | '_' | '[' | ']') {
            word.push(c);
        } else {
            out.push_str(&mask_word(&word));
            word.clear();
            out.push(c);
        }
    }
    out.push_str(&mask_word(&word));
    out
}

/// One word masked: an IP address (with a port) is `<addr>`, a UUID or a long hex string
/// `<id>`, a number (with a unit, `30s`, `5ms`) `<n>`; anything else stays. Punctuation that
/// ends a sentence stays outside the mask.
fn mask_word(word: &str) -> String {
    let core = word.trim_end_matches(['.', ':', ']']);
    let tail = &word[core.len()..];
    let masked = if is_address(core) {
        "<addr>"
    } else if is_id(core) {
        "<id>"
    } else if is_number(core) {
        "<n>"
    } else {
        return word.to_string();
    };
    format!("{masked}{tail}")
}

fn is_address(w: &str) -> bool {
    let host = match w.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => w,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.parse::<std::net::IpAddr>().is_ok()
}

fn is_id(w: &str) -> bool {
    let hex = w.bytes().filter(|b| *b != b'-').collect::<Vec<_>>();
    let digits = hex.iter().any(u8::is_ascii_digit);
    hex.len() >= 12 && digits && hex.iter().all(u8::is_ascii_hexdigit)
}

fn is_number(w: &str) -> bool {
    let number = w.trim_end_matches(|c: char| c.is_ascii_alphabetic());
    let unit = &w[number.len()..];
    !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && number.bytes().next().is_some_and(|b| b.is_ascii_digit())
        && matches!(
            unit,
            "" | "s"
                | "ms"
                | "us"
                | "m"
                | "h"
                | "d"
                | "b"
                | "kb"
                | "mb"
                | "gb"
                | "kib"
                | "mib"
                | "gib"
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_ids_and_numbers_are_masked() {
        let cases = [
            (
                "connecting to 10.0.0.219:22: simulated",
                "connecting to <addr>: simulated",
            ),
            (
                "connecting to [fd00::1]:22: refused",
                "connecting to <addr>: refused",
            ),
            (
                "machine 5d169ff0-938b-4ae7-88f6-3b7a520937f4 gone",
                "machine <id> gone",
            ),
            (
                "provider id c26208da821e4b44be8f2a1f6e0513a9 missing",
                "provider id <id> missing",
            ),
            (
                "timed out after 30s (attempt 3)",
                "timed out after <n> (attempt <n>)",
            ),
            ("HTTP 503 from BMC.", "HTTP <n> from BMC."),
            ("ssh: connection refused", "ssh: connection refused"),
            ("ed25519 key mismatch", "ed25519 key mismatch"),
            ("sha256 deadbeef", "sha256 deadbeef"),
        ];
        for (cause, shape) in cases {
            assert_eq!(mask(cause), shape, "{cause}");
        }
    }

    #[test]
    fn causes_of_one_shape_count_together() {
        let mut causes: Vec<(String, i64)> = (0..100)
            .map(|i| (format!("connecting to 10.0.0.{i}:22: simulated"), 2))
            .collect();
        causes.push(("agent answered garbage".into(), 5));
        causes.push(("connecting to 10.0.0.7:22: simulated".into(), 3));
        let grouped = group(&causes, 10);
        assert_eq!(grouped.len(), 2);
        assert_eq!(grouped[0].shape, "connecting to <addr>: simulated");
        assert_eq!(grouped[0].failures, 203);
        assert_eq!(grouped[0].example, "connecting to 10.0.0.7:22: simulated");
        assert_eq!(
            (grouped[1].failures, grouped[1].example.as_str()),
            (5, "agent answered garbage")
        );
    }
}
