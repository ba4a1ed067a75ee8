//! Log lines stay bounded at fleet scale: a list of problems is shown as its count and the
//! first few items, never the whole fleet in one line.

use std::fmt::Display;

/// How many items a bounded list shows.
pub const SHOWN: usize = 5;

/// `"a; b; c"` for a short list, `"a; b; c; d; e (and 95 more)"` for a long one.
pub fn first_few<T: Display>(items: &[T]) -> String {
    let mut text = items
        .iter()
        .take(SHOWN)
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    if items.len() > SHOWN {
        text.push_str(&format!(" (and {} more)", items.len() - SHOWN));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lists_are_cut_to_a_count_and_a_few() {
        assert_eq!(first_few(&["a", "b"]), "a; b");
        let many: Vec<String> = (0..100_000)
            .map(|i| format!("machine-{i} is wrong"))
            .collect();
        let text = first_few(&many);
        assert!(text.ends_with("(and 99995 more)"), "{text}");
        assert!(text.len() < 200, "{}", text.len());
    }
}
