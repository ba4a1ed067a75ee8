//! The check that a library's public API says what went wrong in types: no public function
//! returns `Result<_, String>`, and no public enum carries a `Box<dyn …>` (a provider's own
//! error travels in `shepherd_provider::ApiFailure`, which can be downcast).

use syn::visit::Visit;

/// `file`'s public functions returning `Result<_, String>` and public enums with a
/// `Box<dyn …>` field, as `file: name`.
pub fn stringly_or_boxed(file: &str, text: &str) -> Vec<String> {
    match syn::parse_file(text) {
        Ok(parsed) => {
            let mut api = PublicApi::default();
            api.visit_file(&parsed);
            api.offending
                .iter()
                .map(|o| format!("{file}: {o}"))
                .collect()
        }
        Err(_) => vec![format!("{file}: does not parse")],
    }
}

/// What a file's public API says wrongly: `fn name`, `enum Name`.
#[derive(Default)]
struct PublicApi {
    offending: Vec<String>,
}

fn is_public(vis: &syn::Visibility) -> bool {
    matches!(vis, syn::Visibility::Public(_))
}

fn is_test_module(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg")
            && a.parse_args::<syn::Ident>()
                .is_ok_and(|ident| ident == "test")
    })
}

/// The generic arguments of `ty`'s last path segment, if `ty` is a path named `name`.
fn generics_of<'t>(ty: &'t syn::Type, name: &str) -> Option<Vec<&'t syn::Type>> {
    let syn::Type::Path(path) = ty else {
        return None;
    };
    let last = path.path.segments.last()?;
    if last.ident != name {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return Some(Vec::new());
    };
    Some(
        args.args
            .iter()
            .filter_map(|a| match a {
                syn::GenericArgument::Type(t) => Some(t),
                _ => None,
            })
            .collect(),
    )
}

fn is_box_dyn(ty: &syn::Type) -> bool {
    generics_of(ty, "Box")
        .is_some_and(|args| args.iter().any(|a| matches!(a, syn::Type::TraitObject(_))))
}

fn is_string_result(output: &syn::ReturnType) -> bool {
    let syn::ReturnType::Type(_, ty) = output else {
        return false;
    };
    generics_of(ty, "Result").is_some_and(|args| {
        args.get(1)
            .is_some_and(|e| generics_of(e, "String").is_some())
    })
}

impl<'ast> Visit<'ast> for PublicApi {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_test_module(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if is_public(&f.vis) && is_string_result(&f.sig.output) {
            self.offending.push(format!("fn {}", f.sig.ident));
        }
    }

    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if is_public(&f.vis) && is_string_result(&f.sig.output) {
            self.offending.push(format!("fn {}", f.sig.ident));
        }
    }

    fn visit_item_enum(&mut self, e: &'ast syn::ItemEnum) {
        let boxed = e
            .variants
            .iter()
            .flat_map(|v| v.fields.iter())
            .any(|f| is_box_dyn(&f.ty));
        if is_public(&e.vis) && boxed {
            self.offending.push(format!("enum {}", e.ident));
        }
    }
}
