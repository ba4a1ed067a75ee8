//! Text that came from outside (an operator's reason, a peer's error, a provider's name)
//! printed for people: on one line, the characters [`moves_text`] names escaped (`\n`,
//! `\u{1b}`, `\u{2028}`), so that it can neither add a made-up line to a history or a log
//! nor move an operator's terminal.

use std::borrow::Cow;

/// Whether `c` can make text printed for people look other than it is: a control character
/// (a newline starts a made-up line; an escape sequence moves the terminal), a line or
/// paragraph separator, or a bidirectional override (which reorders what follows it).
/// Operators' text holds none; text from elsewhere is printed with them escaped.
pub fn moves_text(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{2028}' | '\u{2029}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every character [`moves_text`] names escaped as Rust writes it; borrowed if
/// it has none.
pub fn one_line(text: &str) -> Cow<'_, str> {
    if !text.chars().any(moves_text) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if moves_text(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// [`one_line`], at most `max` characters of it, with `…` where it was cut.
pub fn one_line_cut(text: &str, max: usize) -> String {
    let line = one_line(text);
    match line.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &line[..at]),
        None => line.into_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_nothing_else_changes() {
        assert!(matches!(one_line("plain — text"), Cow::Borrowed(_)));
        assert_eq!(
            one_line("a\n2030-01-01 WARN forged\x1b[2K\x1b[1A\tb\r"),
            "a\\n2030-01-01 WARN forged\\u{1b}[2K\\u{1b}[1A\\tb\\r"
        );
        assert_eq!(one_line("a\u{2028}b\u{202e}c"), "a\\u{2028}b\\u{202e}c");
        assert_eq!(one_line_cut("ab\ncd", 3), "ab\\…");
        assert_eq!(one_line_cut("abc", 3), "abc");
    }
}
