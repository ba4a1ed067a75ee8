//! The check that an error prints its cause once: a `thiserror` variant whose message
//! interpolates a field does not also report that field as its `source()` (`#[from]`,
//! `#[source]`, or a field named `source`). Otherwise a chain printer (`anyhow`'s `{:#}`,
//! `reqwest_causes`) says the cause twice: `Ironic API: refused (401): refused (401)`.

use syn::visit::Visit;

/// `file`'s variants (or structs) that print the field they report as their source:
/// `Type::Variant: message`.
pub fn printing_their_source(file: &str, text: &str) -> Vec<String> {
    let Ok(parsed) = syn::parse_file(text) else {
        return vec![format!("{file}: does not parse")];
    };
    let mut found = Finder {
        file,
        hits: Vec::new(),
    };
    found.visit_file(&parsed);
    found.hits
}

struct Finder<'f> {
    file: &'f str,
    hits: Vec<String>,
}

/// The message of an `#[error("…")]` attribute (none for `transparent`).
fn message(attrs: &[syn::Attribute]) -> Option<String> {
    let attr = attrs.iter().find(|a| a.path().is_ident("error"))?;
    let lit: syn::LitStr = attr
        .parse_args_with(|input: syn::parse::ParseStream| {
            let lit: syn::LitStr = input.parse()?;
            // The format arguments after the message are not needed.
            input.step(|cursor| {
                let mut rest = *cursor;
                while let Some((_, next)) = rest.token_tree() {
                    rest = next;
                }
                Ok(((), rest))
            })?;
            Ok(lit)
        })
        .ok()?;
    Some(lit.value())
}

/// The names a message may print each source field by (`0`, `source`, `error`).
fn source_fields(fields: &syn::Fields) -> Vec<String> {
    fields
        .iter()
        .enumerate()
        .filter(|(_, f)| {
            let marked = f
                .attrs
                .iter()
                .any(|a| a.path().is_ident("from") || a.path().is_ident("source"));
            marked || f.ident.as_ref().is_some_and(|i| i == "source")
        })
        .map(|(i, f)| f.ident.as_ref().map_or(i.to_string(), |n| n.to_string()))
        .collect()
}

impl Finder<'_> {
    fn check(&mut self, what: String, attrs: &[syn::Attribute], fields: &syn::Fields) {
        let Some(message) = message(attrs) else {
            return;
        };
        for name in source_fields(fields) {
            if message.contains(&format!("{{{name}}}")) || message.contains(&format!("{{{name}:")) {
                self.hits
                    .push(format!("{}: {what}: {message:?}", self.file));
            }
        }
    }
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_item_enum(&mut self, e: &'ast syn::ItemEnum) {
        for v in &e.variants {
            self.check(format!("{}::{}", e.ident, v.ident), &v.attrs, &v.fields);
        }
        syn::visit::visit_item_enum(self, e);
    }

    fn visit_item_struct(&mut self, s: &'ast syn::ItemStruct) {
        self.check(s.ident.to_string(), &s.attrs, &s.fields);
        syn::visit::visit_item_struct(self, s);
    }
}
