//! The import graph between the files of one crate, for the check that no file imports another
//! that imports it back, directly or through a chain.
//!
//! A crate's module tree is read from its root (`lib.rs`, `main.rs`, a test file) by following
//! `mod NAME;` declarations; inline modules (`mod tests { … }`) belong to their file. Every path
//! a file names that leads into the crate — `use` trees, and paths in code and types that start
//! with `crate`, `self`, `super`, a child module or a name a `use` brought in — is an edge from
//! the file to the file of the module that *defines* what the path names: re-exports (`pub use`)
//! are followed to the definition, and a re-export is itself an edge from the re-exporting file.
//! A module declaring its children is no edge.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use syn::visit::Visit;

/// A module's path from the crate root (`[]` is the root).
type ModPath = Vec<String>;

/// What one module holds, as far as resolving paths needs.
#[derive(Default)]
struct Module {
    /// The file the module lives in.
    file: PathBuf,
    /// Child modules, by name.
    children: BTreeSet<String>,
    /// Names brought in by `use` (re-exported or not): name → the path it stands for, as
    /// written, and the module it was written in.
    uses: HashMap<String, (ModPath, Vec<String>)>,
    /// `use PATH::*` (glob) targets, as written.
    globs: Vec<Vec<String>>,
}

/// Every module of one crate and the raw paths each file names.
pub struct Crate {
    modules: BTreeMap<ModPath, Module>,
    /// (file, module the path was written in, the path as written).
    named: Vec<(PathBuf, ModPath, Vec<String>)>,
}

/// The file a `mod name;` declared in `file` (whose own module is `own`) lives in.
fn child_file(file: &Path, name: &str) -> Option<PathBuf> {
    let dir = file.parent()?;
    let stem = file.file_stem()?.to_str()?;
    let base = if matches!(stem, "lib" | "main" | "mod") || file.parent()?.ends_with("tests") {
        dir.to_path_buf()
    } else {
        dir.join(stem)
    };
    [
        base.join(format!("{name}.rs")),
        base.join(name).join("mod.rs"),
    ]
    .into_iter()
    .find(|p| p.exists())
}

/// The paths of a `use` tree, flattened: (path, name it binds or `*`).
fn flatten(tree: &syn::UseTree, prefix: &[String], out: &mut Vec<(Vec<String>, String)>) {
    match tree {
        syn::UseTree::Path(p) => {
            let mut next = prefix.to_vec();
            next.push(p.ident.to_string());
            flatten(&p.tree, &next, out);
        }
        syn::UseTree::Name(n) => {
            let name = n.ident.to_string();
            if name == "self" {
                let bound = prefix.last().cloned().unwrap_or_default();
                out.push((prefix.to_vec(), bound));
            } else {
                let mut path = prefix.to_vec();
                path.push(name.clone());
                out.push((path, name));
            }
        }
        syn::UseTree::Rename(r) => {
            let mut path = prefix.to_vec();
            path.push(r.ident.to_string());
            out.push((path, r.rename.to_string()));
        }
        syn::UseTree::Glob(_) => out.push((prefix.to_vec(), "*".into())),
        syn::UseTree::Group(g) => {
            for t in &g.items {
                flatten(t, prefix, out);
            }
        }
    }
}

/// Collects the paths in code: every `Path` with at least two segments.
struct Paths<'a> {
    out: &'a mut Vec<Vec<String>>,
}

impl<'ast> Visit<'ast> for Paths<'_> {
    fn visit_path(&mut self, p: &'ast syn::Path) {
        if p.segments.len() >= 2 {
            self.out
                .push(p.segments.iter().map(|s| s.ident.to_string()).collect());
        }
        syn::visit::visit_path(self, p);
    }

    // Items handled by `Crate::read_items` (nested modules, `use`s) are not walked here.
    fn visit_item_mod(&mut self, _: &'ast syn::ItemMod) {}
    fn visit_item_use(&mut self, _: &'ast syn::ItemUse) {}
}

impl Crate {
    /// Reads the module tree rooted at `root`.
    pub fn read(root: &Path) -> Crate {
        let mut c = Crate {
            modules: BTreeMap::new(),
            named: Vec::new(),
        };
        c.read_file(root, Vec::new());
        c
    }

    fn read_file(&mut self, file: &Path, module: ModPath) {
        let text = std::fs::read_to_string(file).unwrap();
        let parsed = syn::parse_file(&text)
            .unwrap_or_else(|e| panic!("{}: does not parse: {e}", file.display()));
        self.read_items(file, module, &parsed.items);
    }

    fn read_items(&mut self, file: &Path, module: ModPath, items: &[syn::Item]) {
        self.modules.entry(module.clone()).or_default().file = file.to_path_buf();
        for item in items {
            match item {
                syn::Item::Mod(m) => {
                    let name = m.ident.to_string();
                    let mut child = module.clone();
                    child.push(name.clone());
                    self.modules
                        .get_mut(&module)
                        .unwrap()
                        .children
                        .insert(name.clone());
                    match &m.content {
                        Some((_, inner)) => self.read_items(file, child, inner),
                        None => {
                            if let Some(f) = child_file(file, &name) {
                                self.read_file(&f, child);
                            }
                        }
                    }
                }
                syn::Item::Use(u) => {
                    let mut flat = Vec::new();
                    flatten(&u.tree, &[], &mut flat);
                    for (path, bound) in flat {
                        let m = self.modules.get_mut(&module).unwrap();
                        if bound == "*" {
                            m.globs.push(path.clone());
                        } else {
                            m.uses.insert(bound, (module.clone(), path.clone()));
                        }
                        self.named.push((file.to_path_buf(), module.clone(), path));
                    }
                }
                other => {
                    let mut paths = Vec::new();
                    Paths { out: &mut paths }.visit_item(other);
                    for path in paths {
                        self.named.push((file.to_path_buf(), module.clone(), path));
                    }
                }
            }
        }
    }

    /// The module `path` (written in module `from`) starts in, and the rest of it; `None`
    /// for a path that leaves the crate (another crate, the standard library, a local item).
    fn start(
        &self,
        from: &ModPath,
        path: &[String],
        depth: usize,
    ) -> Option<(ModPath, Vec<String>)> {
        if depth > 16 {
            return None;
        }
        let (first, rest) = path.split_first()?;
        match first.as_str() {
            "crate" => Some((Vec::new(), rest.to_vec())),
            "self" => Some((from.clone(), rest.to_vec())),
            "super" => {
                let mut m = from.clone();
                m.pop()?;
                let mut rest = rest.to_vec();
                // `super::super::…`
                while rest.first().map(String::as_str) == Some("super") {
                    m.pop()?;
                    rest.remove(0);
                }
                Some((m, rest))
            }
            name => {
                let module = self.modules.get(from)?;
                if module.children.contains(name) {
                    let mut m = from.clone();
                    m.push(name.to_string());
                    return Some((m, rest.to_vec()));
                }
                // A name a `use` of this module brought in.
                let (at, target) = module.uses.get(name)?;
                let mut full = target.clone();
                full.extend(rest.iter().cloned());
                if full == path {
                    return None;
                }
                self.start(at, &full, depth + 1)
            }
        }
    }

    /// The module that defines what `path` (written in `from`) names, following children,
    /// re-exports and glob re-exports; `None` if it leaves the crate.
    fn resolve(&self, from: &ModPath, path: &[String], depth: usize) -> Option<ModPath> {
        if depth > 16 {
            return None;
        }
        let (mut module, rest) = self.start(from, path, depth)?;
        for (i, seg) in rest.iter().enumerate() {
            let m = self.modules.get(&module)?;
            if m.children.contains(seg) {
                module.push(seg.clone());
                continue;
            }
            if let Some((at, target)) = m.uses.get(seg) {
                let mut full = target.clone();
                full.extend(rest[i + 1..].iter().cloned());
                return self.resolve(at, &full, depth + 1).or(Some(module));
            }
            for glob in &m.globs {
                let mut full = glob.clone();
                full.extend(rest[i..].iter().cloned());
                if let Some(found) = self.resolve(&module, &full, depth + 1) {
                    if self.defines(&found, seg) {
                        return Some(found);
                    }
                }
            }
            return Some(module);
        }
        Some(module)
    }

    /// Whether `module` is a plausible home of `name` (a child or anything not re-exported).
    fn defines(&self, module: &ModPath, name: &str) -> bool {
        self.modules
            .get(module)
            .is_some_and(|m| !m.uses.contains_key(name))
    }

    /// The import edges between files: file → files it imports from.
    pub fn edges(&self) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
        let mut edges: BTreeMap<PathBuf, BTreeSet<PathBuf>> = BTreeMap::new();
        for (file, from, path) in &self.named {
            let Some(target) = self.resolve(from, path, 0) else {
                continue;
            };
            let Some(to) = self.modules.get(&target).map(|m| m.file.clone()) else {
                continue;
            };
            if &to != file {
                edges.entry(file.clone()).or_default().insert(to);
            }
        }
        edges
    }
}

/// The cycles of `edges`: each strongly connected set of more than one file, sorted.
pub fn cycles(edges: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    // Tarjan's algorithm, iterative enough for a crate's handful of files.
    struct State<'a> {
        edges: &'a BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: HashMap<&'a PathBuf, usize>,
        low: HashMap<&'a PathBuf, usize>,
        stack: Vec<&'a PathBuf>,
        on_stack: BTreeSet<&'a PathBuf>,
        next: usize,
        found: Vec<Vec<PathBuf>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a PathBuf) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        if let Some(targets) = s.edges.get(v) {
            for w in targets {
                if !s.index.contains_key(w) {
                    visit(s, w);
                    let low = s.low[v].min(s.low[w]);
                    s.low.insert(v, low);
                } else if s.on_stack.contains(w) {
                    let low = s.low[v].min(s.index[w]);
                    s.low.insert(v, low);
                }
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut s = State {
        edges,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn the_graph_finds_a_cycle_through_a_re_export_and_none_without() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    let write = |name: &str, text: &str| std::fs::write(src.join(name), text).unwrap();
    write("lib.rs", "mod a;\nmod b;\npub use b::Thing;\n");
    write("a.rs", "use crate::Thing;\npub struct A(Thing);\n");
    write("b.rs", "pub struct Thing;\n");
    let acyclic = Crate::read(&src.join("lib.rs")).edges();
    assert!(cycles(&acyclic).is_empty(), "{acyclic:?}");
    assert!(
        acyclic[&src.join("a.rs")].contains(&src.join("b.rs")),
        "{acyclic:?}"
    );
    // b now uses a, which reaches b through lib.rs's re-export.
    write("b.rs", "pub struct Thing;\nfn f(_: crate::a::A) {}\n");
    let cyclic = cycles(&Crate::read(&src.join("lib.rs")).edges());
    assert_eq!(cyclic, vec![vec![src.join("a.rs"), src.join("b.rs")]]);
    // A child using its parent's item while the parent uses the child's is a cycle too.
    write(
        "lib.rs",
        "mod a;\nmod b;\npub struct Root;\nfn g(_: a::A) {}\n",
    );
    write("a.rs", "pub struct A(super::Root);\n");
    write("b.rs", "pub struct Thing;\n");
    let cyclic = cycles(&Crate::read(&src.join("lib.rs")).edges());
    assert_eq!(cyclic, vec![vec![src.join("a.rs"), src.join("lib.rs")]]);
}
