//! The module graph has no import loops: reading the sources of the library (`src/`,
//! not the command line) and of the crate its bottom layer lives in
//! (`crates/bloomgate-core/src/`, whose modules the library re-exports under the same
//! names), every path a module's code names from the crate root (`crate::`,
//! `bloomgate_core::`) or from its parent (`super::`), tests aside, is an edge to the
//! module that defines the item, and the graph of those edges between files is acyclic.
//! A module and its own submodules are one unit here (a parent re-exporting its child's
//! items and the child using its parent's is how Rust modules are built), so the check is
//! between modules that are not nested in each other.
//!
//! The layers: the bottom is the `bloomgate-core` crate, and the compiler keeps it from
//! importing anything above it; this test checks that the crate holds exactly the bottom
//! layer and that the library re-exports all of it, and itself holds the rule between
//! the middle and the top, which are one crate.

#[path = "support/sources.rs"]
mod sources;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use sources::rust_files;

/// A module path such as `pattern::route` ("" for the crate root).
type Module = String;

struct Source {
    /// The code, with comments and `#[cfg(test)]` items removed.
    code: String,
    /// Names of the public items it defines.
    items: BTreeSet<String>,
}

fn module_of(src: &Path, file: &Path) -> Option<Module> {
    let rel = file.strip_prefix(src).ok()?.with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if let Some("main" | "cli") = parts.first().map(String::as_str) {
        return None;
    }
    if parts.last().is_some_and(|p| p == "mod" || p == "lib") {
        parts.pop();
    }
    Some(parts.join("::"))
}

/// Drops line comments and everything from the first `#[cfg(test)]` on (test modules
/// sit at the end of a file in this crate).
fn strip(text: &str) -> String {
    let text = text.split("#[cfg(test)]").next().unwrap_or("");
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn public_items(code: &str) -> BTreeSet<String> {
    let mut items = BTreeSet::new();
    let words: Vec<&str> = code
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .collect();
    for w in words.windows(3) {
        if w[0] == "pub"
            && matches!(
                w[1],
                "struct" | "enum" | "fn" | "type" | "const" | "static" | "trait"
            )
        {
            items.insert(w[2].to_owned());
        }
        if w[0] == "pub" && w[1] == "async" {
            items.insert(w[2].to_owned());
        }
    }
    items
}

/// Expands the paths found in the code of `module` into flat paths from the crate root:
/// `crate::a::{b, c::{d, e}}` style paths, the same paths into the core crate
/// (`bloomgate_core::a`, whose modules keep their names here), and paths relative to the
/// module's parent (`super::b`, `super::super::c`).
fn crate_paths(module: &str, code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some((i, prefix)) = next_path(rest) {
        let mut after = &rest[i + prefix.len()..];
        let mut base = String::new();
        if prefix == "super::" {
            let mut parent: Vec<&str> = module.split("::").filter(|s| !s.is_empty()).collect();
            parent.pop();
            while let Some(more) = after.strip_prefix("super::") {
                parent.pop();
                after = more;
            }
            if !parent.is_empty() {
                base = format!("{}::", parent.join("::"));
            }
        }
        let end = path_end(after);
        expand(&base, &after[..end], &mut out);
        rest = &after[end..];
    }
    out
}

/// The first path in `code` that starts at `crate::`, `bloomgate_core::` or `super::`
/// (not in the middle of a longer path or word), with the prefix it starts with.
fn next_path(code: &str) -> Option<(usize, &'static str)> {
    ["crate::", "bloomgate_core::", "super::"]
        .into_iter()
        .filter_map(|prefix| {
            let mut from = 0;
            while let Some(i) = code[from..].find(prefix) {
                let at = from + i;
                let before = code[..at].chars().next_back();
                if !before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    return Some((at, prefix));
                }
                from = at + prefix.len();
            }
            None
        })
        .min_by_key(|(at, _)| *at)
}

/// Where a path (possibly with nested braces) ends.
fn path_end(s: &str) -> usize {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => return i,
            '}' => depth -= 1,
            c if depth == 0 && !(c.is_alphanumeric() || c == '_' || c == ':') => return i,
            _ => {}
        }
    }
    s.len()
}

fn expand(prefix: &str, path: &str, out: &mut Vec<String>) {
    match path.find('{') {
        None => {
            let p = format!("{prefix}{path}");
            out.push(p.trim_end_matches(':').to_owned());
        }
        Some(open) => {
            let head = format!("{prefix}{}", &path[..open]);
            let inner = &path[open + 1..path.rfind('}').unwrap_or(path.len())];
            let mut depth = 0usize;
            let mut start = 0;
            let mut parts = Vec::new();
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => depth = depth.saturating_sub(1),
                    ',' if depth == 0 => {
                        parts.push(&inner[start..i]);
                        start = i + 1;
                    }
                    _ => {}
                }
            }
            parts.push(&inner[start..]);
            for part in parts {
                let part = part.split(" as ").next().unwrap_or("").trim();
                if part == "self" {
                    out.push(head.trim_end_matches(':').to_owned());
                } else if !part.is_empty() {
                    expand(&head, part, out);
                }
            }
        }
    }
}

/// The module that defines what `path` names: the deepest module on the path, or the
/// child module that defines the item when the parent only re-exports it.
fn resolve(path: &str, sources: &BTreeMap<Module, Source>) -> Module {
    let mut current = String::new();
    for segment in path.split("::").filter(|s| !s.is_empty()) {
        let next = if current.is_empty() {
            segment.to_owned()
        } else {
            format!("{current}::{segment}")
        };
        if sources.contains_key(&next) {
            current = next;
            continue;
        }
        if sources
            .get(&current)
            .is_some_and(|s| s.items.contains(segment))
        {
            return current;
        }
        let depth = current.matches("::").count() + usize::from(!current.is_empty());
        let child = sources.iter().find(|(m, s)| {
            m.starts_with(&format!("{current}::"))
                && m.matches("::").count() + 1 == depth + 1
                && s.items.contains(segment)
        });
        return child.map_or(current, |(m, _)| m.clone());
    }
    current
}

fn nested(a: &str, b: &str) -> bool {
    a.is_empty()
        || b.is_empty()
        || a.starts_with(&format!("{b}::"))
        || b.starts_with(&format!("{a}::"))
}

/// The library's sources.
fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// The sources of the crate that holds the bottom layer.
fn core_src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("crates/bloomgate-core/src")
}

fn graph() -> BTreeMap<Module, BTreeSet<Module>> {
    let mut sources = BTreeMap::new();
    for root in [core_src(), src()] {
        let mut files = Vec::new();
        rust_files(&root, &mut files);
        for file in files {
            let Some(module) = module_of(&root, &file) else {
                continue;
            };
            // The core crate's root only declares its modules, which the library's root
            // re-exports.
            if module.is_empty() && root == core_src() {
                continue;
            }
            let code = strip(&std::fs::read_to_string(&file).expect("read source"));
            let items = public_items(&code);
            sources.insert(module, Source { code, items });
        }
    }
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, source) in &sources {
        let targets = edges.entry(module.clone()).or_default();
        for path in crate_paths(module, &source.code) {
            let target = resolve(&path, &sources);
            if target != *module && !nested(module, &target) {
                targets.insert(target);
            }
        }
    }
    edges
}

/// A cycle in the graph, if there is one (depth-first).
fn cycle(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Option<Vec<Module>> {
    fn visit(
        node: &Module,
        edges: &BTreeMap<Module, BTreeSet<Module>>,
        stack: &mut Vec<Module>,
        done: &mut BTreeSet<Module>,
    ) -> Option<Vec<Module>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut c = stack[at..].to_vec();
            c.push(node.clone());
            return Some(c);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.clone());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(c) = visit(next, edges, stack, done) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(node.clone());
        None
    }
    let mut done = BTreeSet::new();
    for node in edges.keys() {
        if let Some(c) = visit(node, edges, &mut Vec::new(), &mut done) {
            return Some(c);
        }
    }
    None
}

#[test]
fn the_module_graph_has_no_import_loops() {
    let edges = graph();
    assert!(
        edges.len() > 30,
        "the scan found only {} modules: is src/ laid out as expected?",
        edges.len()
    );
    assert!(
        edges.values().map(BTreeSet::len).sum::<usize>() > 50,
        "the scan found almost no imports: {edges:?}"
    );
    if let Some(c) = cycle(&edges) {
        panic!("import loop: {}", c.join(" → "));
    }
}

#[test]
fn the_checker_sees_a_loop_when_there_is_one() {
    let mut edges = graph();
    // cache imports origin's types; make origin import the cache back.
    assert!(
        edges["cache"].contains("origin"),
        "cache → origin expected: {:?}",
        edges["cache"]
    );
    edges
        .get_mut("origin")
        .expect("origin module")
        .insert("cache".into());
    let c = cycle(&edges).expect("a loop");
    assert!(
        c.contains(&"cache".to_owned()) && c.contains(&"origin".to_owned()),
        "{c:?}"
    );
}

#[test]
fn paths_in_braces_resolve_to_the_defining_file() {
    let mut out = Vec::new();
    expand(
        "",
        "pipeline::{route::{MatchOptions, PathPattern}, response::json as j, self}",
        &mut out,
    );
    assert_eq!(
        out,
        [
            "pipeline::route::MatchOptions",
            "pipeline::route::PathPattern",
            "pipeline::response::json",
            "pipeline"
        ]
    );
    assert_eq!(
        crate_paths(
            "config::audit",
            "use super::validate::Problems; fn f(_: super::super::key::Key, _: pub(super) u8) {}",
        ),
        ["config::validate::Problems", "key::Key"]
    );
    assert_eq!(
        crate_paths(
            "gate",
            "use bloomgate_core::config::{Backend, self}; x::super::y"
        ),
        ["config::Backend", "config"]
    );
    let edges = graph();
    // A sibling named through `super::` is an edge like any other.
    assert!(
        edges["server::connection"].contains("server::long_target"),
        "{:?}",
        edges["server::connection"]
    );
    // `crate::config::Normalize` is defined in key.rs and re-exported by the config.
    assert!(
        edges["gate::build"].contains("key"),
        "{:?}",
        edges["gate::build"]
    );
}

/// The layers of the library, bottom first: a module may import from its own layer and
/// the layers below it, never from a layer above (lib.rs's `# Layout` names them). The
/// bottom layer is the `bloomgate-core` crate.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "bottom",
        &[
            "key",
            "filter",
            "watermark",
            "pattern",
            "cert",
            "config",
            "metrics",
            "db",
            "access_log",
            "notify",
            "serving",
            "report",
            "redis_conn",
        ],
    ),
    ("middle", &["origin", "cache", "gate", "fleet", "audit"]),
    (
        "top",
        &["pipeline", "server", "stages", "reload", "admin", "app", ""],
    ),
];

/// The layer of a module (by its first path segment), as an index into [`LAYERS`].
fn layer(module: &str) -> Option<usize> {
    let top = module.split("::").next().unwrap_or("");
    LAYERS
        .iter()
        .position(|(_, members)| members.contains(&top))
}

/// Every import that runs from a lower layer to a higher one.
fn upward(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<String> {
    let mut found = Vec::new();
    for (from, targets) in edges {
        let Some(low) = layer(from) else { continue };
        for to in targets {
            if let Some(high) = layer(to)
                && high > low
            {
                found.push(format!(
                    "{from} ({}) imports {to} ({})",
                    LAYERS[low].0, LAYERS[high].0
                ));
            }
        }
    }
    found
}

#[test]
fn every_module_belongs_to_a_layer_and_no_import_runs_up() {
    let edges = graph();
    let unplaced: Vec<&Module> = edges.keys().filter(|m| layer(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "modules in no layer (add them to LAYERS and lib.rs's # Layout): {unplaced:?}"
    );
    let up = upward(&edges);
    assert!(
        up.is_empty(),
        "imports that run up a layer:\n{}",
        up.join("\n")
    );
}

#[test]
fn the_checker_sees_an_import_that_runs_up() {
    let mut edges = graph();
    edges
        .get_mut("key")
        .expect("key module")
        .insert("pipeline::outcome".into());
    edges
        .get_mut("gate::verdict")
        .expect("gate::verdict module")
        .insert("pipeline::outcome".into());
    let up = upward(&edges);
    assert_eq!(
        up,
        [
            "gate::verdict (middle) imports pipeline::outcome (top)",
            "key (bottom) imports pipeline::outcome (top)",
        ],
        "{up:?}"
    );
}

/// The modules a crate root declares (`pub mod name;` or `mod name;`).
fn declared_modules(lib: &str) -> BTreeSet<String> {
    strip(lib)
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect()
}

/// The modules `lib` re-exports from the core crate (`pub use bloomgate_core::{a, b};`
/// or one `pub use bloomgate_core::a;` each).
fn reexported_modules(lib: &str) -> BTreeSet<String> {
    let code = strip(lib);
    let mut out = Vec::new();
    let mut rest = code.as_str();
    while let Some(i) = rest.find("pub use bloomgate_core::") {
        let after = &rest[i + "pub use bloomgate_core::".len()..];
        let end = path_end(after);
        expand("", &after[..end], &mut out);
        rest = &after[end..];
    }
    out.into_iter().collect()
}

#[test]
fn the_core_crate_is_the_bottom_layer_and_the_library_re_exports_it() {
    let read = |dir: PathBuf| std::fs::read_to_string(dir.join("lib.rs")).expect("read lib.rs");
    let bottom: BTreeSet<String> = LAYERS[0].1.iter().map(|m| (*m).to_owned()).collect();
    let declared = declared_modules(&read(core_src()));
    assert_eq!(
        declared, bottom,
        "the modules crates/bloomgate-core/src/lib.rs declares are the bottom layer"
    );
    let reexported = reexported_modules(&read(src()));
    assert_eq!(
        reexported, bottom,
        "src/lib.rs re-exports every module of the bottom layer from bloomgate_core"
    );
    // Nothing of the bottom layer is left in the library's own sources.
    let mut files = Vec::new();
    rust_files(&src(), &mut files);
    let stray: Vec<Module> = files
        .iter()
        .filter_map(|f| module_of(&src(), f))
        .filter(|m| layer(m) == Some(0))
        .collect();
    assert!(
        stray.is_empty(),
        "bottom-layer modules under src/ (they belong in crates/bloomgate-core/src/): {stray:?}"
    );
}

#[test]
fn module_lists_are_read_from_declarations_and_re_exports() {
    assert_eq!(
        declared_modules("//! Doc.\n\npub mod a;\nmod b;\n#[cfg(test)]\nmod tests;\n"),
        BTreeSet::from(["a".to_owned(), "b".to_owned()])
    );
    assert_eq!(
        reexported_modules(
            "pub use bloomgate_core::{\n    a, b,\n};\npub use bloomgate_core::c;\n"
        ),
        BTreeSet::from(["a".to_owned(), "b".to_owned(), "c".to_owned()])
    );
}
