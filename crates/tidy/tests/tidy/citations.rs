//! Citations of the design: code and documents cite `docs/design.md` by section (`design.md
//! §12`, `design.md §3, §20`, `design.md §2–§5`), and a citation that names no section, or one
//! of a document outside the repository, leaves a reader of a clone with nothing to read.

use std::collections::BTreeSet;

use super::{read, tracked};

/// The section numbers `docs/design.md` has (`## N. Title`).
fn design_sections() -> BTreeSet<u32> {
    read("docs/design.md")
        .lines()
        .filter_map(|line| line.strip_prefix("## "))
        .filter_map(|title| title.split('.').next()?.parse().ok())
        .collect()
}

/// The section numbers cited after each `design.md ` in `text`: a `§N`, and the `, §M`,
/// `–§M` or ` and §M` that follow it.
fn cited_sections(text: &str) -> Vec<u32> {
    let mut cited = Vec::new();
    for (at, _) in text.match_indices("design.md ") {
        let mut rest = &text[at + "design.md ".len()..];
        while let Some(after) = rest.strip_prefix('§') {
            let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
            let Ok(section) = digits.parse() else { break };
            cited.push(section);
            rest = &after[digits.len()..];
            let joined = [", ", "–", " and ", ", and "]
                .iter()
                .find_map(|joint| rest.strip_prefix(joint));
            match joined {
                Some(next) if next.starts_with('§') => rest = next,
                _ => break,
            }
        }
    }
    cited
}

#[test]
fn every_design_citation_names_a_section_and_nothing_cites_the_outside_spec() {
    let sections = design_sections();
    assert!(
        sections.len() >= 20,
        "docs/design.md has sections {sections:?}"
    );
    let mut wrong = Vec::new();
    let mut total = 0;
    for file in tracked() {
        if !(file.ends_with(".rs") || file.ends_with(".md")) || file.starts_with("crates/tidy/") {
            continue;
        }
        let text = read(&file);
        if text.contains("SPEC §") || text.contains("SPEC.md") {
            wrong.push(format!(
                "{file}: cites the specification outside the repository"
            ));
        }
        for section in cited_sections(&text) {
            total += 1;
            if !sections.contains(&section) {
                wrong.push(format!("{file}: design.md §{section} is no section"));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    assert!(
        total > 50,
        "only {total} citations found: is the pattern still right?"
    );
}

#[test]
fn citations_are_read_with_their_lists() {
    assert_eq!(cited_sections("(design.md §3, §20): x"), [3, 20]);
    assert_eq!(cited_sections("design.md §2–§5 for"), [2, 5]);
    assert_eq!(cited_sections("design.md §19 and §20."), [19, 20]);
    assert_eq!(cited_sections("design.md §"), Vec::<u32>::new());
}
