//! The architecture invariants ARCHITECTURE.md states, checked against the
//! source: each crate's modules form the layers its code map lists (no
//! import circles, and the map names every module), only the fiber stops
//! other actors, no public library function returns `Result<_, String>`,
//! the agent's functions stay short, and no test reads outside the
//! repository.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    out.sort();
    out
}

/// A file's text without its `#[cfg(test)] mod …` blocks (tests may reach
/// anywhere) and without line comments.
fn code(path: &Path) -> String {
    let mut text = std::fs::read_to_string(path).unwrap();
    while let Some(at) = text.find("#[cfg(test)]\nmod ") {
        let open = text[at..].find('{').map(|o| at + o);
        let end = open
            .and_then(|o| matching(&text, o))
            .map_or(text.len(), |c| c + 1);
        text.replace_range(at..end, "");
    }
    text.lines()
        .map(|l| match l.find("//") {
            Some(at) if !l[..at].contains('"') => &l[..at],
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The index of the `}` that closes the `{` at `open`.
fn matching(text: &str, open: usize) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i);
                }
            }
            _ => {}
        }
    }
    None
}

/// The module order of a crate's code map: the `- [`name`]` bullets under
/// `## Code map` in its root file's docs.
fn code_map(root: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(root).unwrap();
    let mut in_map = false;
    let mut order = Vec::new();
    for line in text.lines() {
        let Some(doc) = line.strip_prefix("//!") else {
            continue;
        };
        let doc = doc.trim_start();
        if doc.starts_with("## ") {
            in_map = doc.starts_with("## Code map");
            continue;
        }
        // `- [`m`]` (a link) or `- `m`` (a module the docs hide).
        if in_map && let Some(rest) = doc.strip_prefix("- [`").or_else(|| doc.strip_prefix("- `")) {
            let name: String = rest.chars().take_while(|c| *c != '`').collect();
            order.push(name);
        }
    }
    order
}

/// The modules a crate root declares (`mod x;` / `pub mod x;`).
fn declared(root: &Path) -> BTreeSet<String> {
    std::fs::read_to_string(root)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let l = l.strip_prefix("pub ").unwrap_or(l);
            l.strip_prefix("mod ")?.strip_suffix(';').map(str::to_owned)
        })
        .collect()
}

/// The top-level module a crate-root item re-exported by `pub use m::…`
/// comes from (so `crate::Context` counts as a use of `runtime`).
fn reexports(root: &Path) -> BTreeMap<String, String> {
    let text = std::fs::read_to_string(root).unwrap();
    let mut out = BTreeMap::new();
    for stmt in text.split(';') {
        let stmt = stmt.trim();
        let Some(path) = stmt.strip_prefix("pub use ") else {
            continue;
        };
        let module: String = path.chars().take_while(|c| *c != ':').collect();
        let items = match (path.find('{'), path.rfind("::")) {
            (Some(open), _) => &path[open + 1..path.len() - 1],
            (None, Some(at)) => &path[at + 2..],
            _ => continue,
        };
        for item in items.split(',') {
            let item = item.trim();
            if !item.is_empty() {
                out.insert(item.to_owned(), module.clone());
            }
        }
    }
    out
}

/// Identifiers following `prefix` in `text` (`crate::` → the names after it).
fn after<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.match_indices(prefix)
        .filter(|(at, _)| {
            text[..*at]
                .chars()
                .next_back()
                .is_none_or(|c| !c.is_alphanumeric() && c != '_')
        })
        .map(|(at, _)| {
            let rest = &text[at + prefix.len()..];
            let end = rest
                .find(|c: char| !c.is_alphanumeric() && c != '_')
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .collect()
}

/// The first names of the paths in a `use` group body (`a::{B}, c::D, e`
/// → `a`, `c`, `e`), nested groups skipped.
fn group_heads(body: &str) -> Vec<String> {
    let mut heads = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in body.char_indices().chain([(body.len(), ',')]) {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                let item = body[start..i].trim();
                let head = item.split("::").next().unwrap_or_default().trim();
                if !head.is_empty() {
                    heads.push(head.to_owned());
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    heads
}

/// Which top-level modules each top-level module of the crate at `src`
/// uses: `crate::m` (and each path of a `use crate::{…}` group), `super::`
/// chains that climb to the crate root (`super::m` in `m2.rs` or
/// `m2/mod.rs`, `super::super::m` in `m2/x.rs`, …), and items re-exported
/// at the crate root (`crate::Context` counts as a use of `runtime`).
fn module_uses(src: &Path, root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let modules = declared(root);
    let items = reexports(root);
    let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in rust_files(src) {
        let rel = file.strip_prefix(src).unwrap();
        let parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let top = parts[0].trim_end_matches(".rs").to_owned();
        if !modules.contains(&top) {
            continue; // the crate root, main.rs
        }
        // How deep the file's module is: `m.rs` and `m/mod.rs` are 1,
        // `m/x.rs` and `m/x/mod.rs` are 2, …
        let depth = parts.len() - usize::from(parts.last().is_some_and(|f| f == "mod.rs"));
        let text = code(&file);
        let mut names: Vec<String> = after(&text, "crate::")
            .into_iter()
            .map(str::to_owned)
            .collect();
        for (at, _) in text.match_indices("crate::{") {
            let open = at + "crate::".len();
            if let Some(close) = matching(&text, open) {
                names.extend(group_heads(&text[open + 1..close]));
            }
        }
        names.extend(names_after(&text, &"super::".repeat(depth)));
        let entry = uses.entry(top.clone()).or_default();
        entry.extend(modules_named(names, &modules, &items, &top));
    }
    uses
}

/// The names that follow `prefix` (a `super::` chain, a module path) in
/// `text`: one path's first name, or each of a `{…}` group's; a longer
/// `super::` chain than `prefix` is not counted.
fn names_after(text: &str, prefix: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (at, _) in text.match_indices(prefix) {
        if text[..at].ends_with("::") || text[..at].ends_with(char::is_alphanumeric) {
            continue;
        }
        let rest = &text[at + prefix.len()..];
        if rest.starts_with("super::") {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let close = matching(rest, 0).unwrap_or(rest.len());
            names.extend(group_heads(&group[..close.saturating_sub(1)]));
        } else {
            let end = rest
                .find(|c: char| !c.is_alphanumeric() && c != '_')
                .unwrap_or(rest.len());
            names.push(rest[..end].to_owned());
        }
    }
    names
}

/// The modules `names` refer to: a module by its name, an item by the
/// module that re-exports it (`items`); `top` itself left out.
fn modules_named(
    names: Vec<String>,
    modules: &BTreeSet<String>,
    items: &BTreeMap<String, String>,
    top: &str,
) -> Vec<String> {
    names
        .into_iter()
        .filter_map(|name| {
            if modules.contains(&name) {
                Some(name)
            } else {
                items.get(&name).cloned()
            }
        })
        .filter(|m| m != top)
        .collect()
}

#[test]
fn each_crate_is_layered_as_its_code_map_lists() {
    let crates = [
        ("supervisors/src", "lib.rs"),
        ("services/src", "lib.rs"),
        ("actors/src", "lib.rs"),
        ("src", "lib.rs"),
        ("src", "main.rs"),
    ];
    for (dir, root) in crates {
        let src = repo().join(dir);
        let root = src.join(root);
        let order = code_map(&root);
        let modules = declared(&root);
        let listed: BTreeSet<String> = order.iter().cloned().collect();
        assert_eq!(
            listed, modules,
            "{dir}: the code map must name every module, once each ({order:?})"
        );
        let rank: BTreeMap<&str, usize> = order
            .iter()
            .enumerate()
            .map(|(i, m)| (m.as_str(), i))
            .collect();
        for (module, used) in module_uses(&src, &root) {
            for other in used {
                assert!(
                    rank[other.as_str()] < rank[module.as_str()],
                    "{dir}: `{module}` uses `{other}`, which the code map lists after it \
                     (an upward import, or a circle)"
                );
            }
        }
    }
}

/// The sibling modules of the folder module at `dir` (module path `path`
/// from its crate root), each with the siblings it uses: `super::x` from a
/// file of the folder (`super::super::x` from one folder down, …),
/// `crate::<path>::x`, and items the folder's `mod.rs` re-exports from a
/// sibling.
fn sibling_uses(dir: &Path, path: &str) -> BTreeMap<String, BTreeSet<String>> {
    let root = dir.join("mod.rs");
    let siblings = declared(&root);
    let items = reexports(&root);
    let mut uses: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in rust_files(dir) {
        let parts: Vec<String> = file
            .strip_prefix(dir)
            .unwrap()
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        let top = parts[0].trim_end_matches(".rs").to_owned();
        if !siblings.contains(&top) {
            continue; // mod.rs itself
        }
        let depth = parts.len() - usize::from(parts.last().is_some_and(|f| f == "mod.rs"));
        let text = code(&file);
        let mut names = names_after(&text, &"super::".repeat(depth));
        names.extend(names_after(&text, &format!("crate::{path}::")));
        let entry = uses.entry(top.clone()).or_default();
        entry.extend(modules_named(names, &siblings, &items, &top));
    }
    uses
}

/// A circle in `uses`, as the modules along it (the first one repeated at
/// the end), if there is one.
fn circle(uses: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn walk(
        at: &str,
        uses: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(start) = path.iter().position(|m| m == at) {
            let mut found = path[start..].to_vec();
            found.push(at.to_owned());
            return Some(found);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_owned());
        for next in uses.get(at).into_iter().flatten() {
            if let Some(found) = walk(next, uses, path, done) {
                return Some(found);
            }
        }
        path.pop();
        done.insert(at.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    uses.keys()
        .find_map(|m| walk(m, uses, &mut Vec::new(), &mut done))
}

/// No import circles between the modules of one folder either, except in
/// the fiber runtime (ARCHITECTURE.md says why).
#[test]
fn no_module_folder_has_an_import_circle_but_the_fiber_runtime() {
    let allowed = repo().join("supervisors/src/runtime/fiber");
    let mut circles = Vec::new();
    for krate in ["supervisors/src", "services/src", "actors/src", "src"] {
        let src = repo().join(krate);
        let mut folders = vec![src.clone()];
        while let Some(dir) = folders.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                if entry.path().is_dir() {
                    folders.push(entry.path());
                }
            }
            if dir == src || dir == allowed || !dir.join("mod.rs").exists() {
                continue;
            }
            let path = dir
                .strip_prefix(&src)
                .unwrap()
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("::");
            if let Some(found) = circle(&sibling_uses(&dir, &path)) {
                circles.push(format!("{}: {}", dir.display(), found.join(" → ")));
            }
        }
    }
    assert!(
        circles.is_empty(),
        "import circles:\n{}",
        circles.join("\n")
    );
}

/// ARCHITECTURE.md's code map section for one crate (`### `name``): its
/// text, up to the next heading.
fn map_section(map: &str, krate: &str) -> String {
    let head = format!("### `{krate}`");
    let start = map
        .find(&head)
        .unwrap_or_else(|| panic!("ARCHITECTURE.md has no `{head}` section"));
    let body = &map[start + head.len()..];
    let end = body.find("\n#").unwrap_or(body.len());
    body[..end].to_owned()
}

/// The modules a map section's bullets are headed by: the backticked names
/// before a bullet's `:`, outside parentheses.
fn map_heads(section: &str) -> BTreeSet<String> {
    // A bullet goes on over its indented lines.
    let mut bullets: Vec<String> = Vec::new();
    for line in section.lines() {
        if let Some(start) = line.strip_prefix("- ") {
            bullets.push(start.to_owned());
        } else if let (Some(last), true) = (bullets.last_mut(), line.starts_with("  ")) {
            last.push(' ');
            last.push_str(line.trim());
        }
    }
    let mut heads = BTreeSet::new();
    for bullet in &bullets {
        let (mut depth, mut name, mut inside) = (0usize, String::new(), false);
        for c in bullet.chars() {
            match c {
                '(' => depth += 1,
                ')' => depth = depth.saturating_sub(1),
                ':' if depth == 0 && !inside => break,
                '`' if depth == 0 => {
                    if inside {
                        heads.insert(std::mem::take(&mut name));
                    }
                    inside = !inside;
                }
                c if inside && depth == 0 => name.push(c),
                _ => {}
            }
        }
    }
    heads
}

/// Every module below the top level of the crate at `src`: the names of
/// the files and folders inside its module folders.
fn nested_modules(src: &Path) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for file in rust_files(src) {
        let parts: Vec<String> = file
            .strip_prefix(src)
            .unwrap()
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        for (i, part) in parts.iter().enumerate().skip(1) {
            let name = part.trim_end_matches(".rs");
            if name != "mod" && (i + 1 < parts.len() || part.ends_with(".rs")) {
                out.insert(name.to_owned());
            }
        }
    }
    out
}

/// ARCHITECTURE.md's code map cannot drift: each crate's section heads a
/// bullet with every top-level module and with nothing else, and names
/// every module below them.
#[test]
fn the_architecture_map_names_every_module_and_nothing_gone() {
    let map = std::fs::read_to_string(repo().join("ARCHITECTURE.md")).unwrap();
    let mut wrong = Vec::new();
    for (krate, dir, roots) in [
        ("supervisors", "supervisors/src", &["lib.rs"][..]),
        ("services", "services/src", &["lib.rs"][..]),
        ("actors", "actors/src", &["lib.rs"][..]),
        ("dsh", "src", &["lib.rs", "main.rs"][..]),
    ] {
        let src = repo().join(dir);
        let section = map_section(&map, krate);
        let mut modules = BTreeSet::new();
        for root in roots {
            modules.extend(declared(&src.join(root)));
        }
        let heads = map_heads(&section);
        for m in modules.difference(&heads) {
            wrong.push(format!("{krate}: module `{m}` heads no bullet of the map"));
        }
        for m in heads.difference(&modules) {
            wrong.push(format!("{krate}: the map lists `{m}`, which is no module"));
        }
        for m in nested_modules(&src) {
            if !section.contains(&format!("`{m}`")) {
                wrong.push(format!("{krate}: the map does not name the module `{m}`"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "ARCHITECTURE.md's code map:\n{}",
        wrong.join("\n")
    );
}

/// A Markdown heading's anchor as GitHub makes it: lower case, spaces to
/// `-`, punctuation but `-` and `_` dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut fenced = false;
    let mut out = BTreeSet::new();
    for line in text.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.insert(slug(line.trim_start_matches('#')));
        }
    }
    out
}

/// Every relative link in README.md, ARCHITECTURE.md and `docs/` leads
/// somewhere: the file exists, and a `#anchor` names one of its headings.
#[test]
fn every_relative_link_in_the_docs_resolves() {
    let mut pages = vec![repo().join("README.md"), repo().join("ARCHITECTURE.md")];
    for entry in std::fs::read_dir(repo().join("docs")).unwrap().flatten() {
        if entry.path().extension().is_some_and(|e| e == "md") {
            pages.push(entry.path());
        }
    }
    let mut broken = Vec::new();
    for page in &pages {
        let text = std::fs::read_to_string(page).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = &rest[..end];
            if target.contains("://") || target.starts_with("mailto:") || target.contains(' ') {
                continue;
            }
            let (file, anchor) = target.split_once('#').unwrap_or((target, ""));
            let linked = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !linked.exists() {
                broken.push(format!("{}: `{target}`: no such file", page.display()));
                continue;
            }
            if !anchor.is_empty() {
                let headings = anchors(&std::fs::read_to_string(&linked).unwrap_or_default());
                if !headings.contains(anchor) {
                    broken.push(format!("{}: `{target}`: no such heading", page.display()));
                }
            }
        }
    }
    assert!(pages.len() > 3, "the docs were not found");
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn only_the_fiber_stops_kills_or_drains_another_actor() {
    let fiber = repo().join("supervisors/src/runtime/fiber");
    let mut offenders = Vec::new();
    for dir in ["supervisors/src", "services/src", "actors/src", "src"] {
        for file in rust_files(&repo().join(dir)) {
            if file.starts_with(&fiber) {
                continue;
            }
            let text = code(&file);
            for (n, line) in text.lines().enumerate() {
                let others = [
                    ".kill()",
                    ".kill_and_wait(",
                    ".drain(",
                    ".drain_and_wait(",
                    ".stop_and_wait(",
                ];
                let touches_another =
                    others.iter().any(|p| line.contains(p)) || stops_another(line);
                // `drain(..)` on a collection is not an actor's drain.
                if touches_another && !line.contains(".drain(..") {
                    offenders.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
    }
    assert!(offenders.is_empty(), "{}", offenders.join("\n"));
}

/// `x.stop(reason)` (ractor's stop takes a reason; a stop without
/// arguments is some other handle's, like the script host's) on an actor
/// that is not the caller itself (`me`, `myself`). The kernel benchmark's
/// bare `ractor` actor (`bare`) is the one exception: it measures an actor
/// outside the tree, on purpose.
fn stops_another(line: &str) -> bool {
    [".stop("].iter().any(|call| {
        line.match_indices(call).any(|(at, _)| {
            if line[at + call.len()..].starts_with(')') {
                return false;
            }
            let receiver: String = line[..at]
                .chars()
                .rev()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect::<String>()
                .chars()
                .rev()
                .collect();
            !matches!(receiver.as_str(), "me" | "myself" | "bare")
        })
    })
}

/// Whether a signature (from `fn` to its body or `;`) returns a
/// `Result` whose error is `String`.
fn returns_string_error(signature: &str) -> bool {
    let Some(ret) = signature.split("->").nth(1) else {
        return false;
    };
    let ret = ret.split(" where ").next().unwrap_or(ret).trim();
    ret.contains("Result<") && ret.ends_with("String>")
}

#[test]
fn no_public_library_function_returns_a_string_error() {
    let mut offenders = Vec::new();
    for dir in ["supervisors/src", "services/src", "actors/src"] {
        for file in rust_files(&repo().join(dir)) {
            let text = code(&file);
            // Spans of public traits: every method there is public.
            let traits: Vec<(usize, usize)> = text
                .match_indices("pub trait ")
                .filter_map(|(at, _)| {
                    let open = at + text[at..].find('{')?;
                    Some((open, matching(&text, open)?))
                })
                .collect();
            for (at, _) in text.match_indices("fn ") {
                let before = text[..at].trim_end();
                let public = before.ends_with("pub")
                    || before.ends_with("pub async")
                    || traits.iter().any(|(o, c)| *o < at && at < *c);
                let is_item = text[..at]
                    .chars()
                    .next_back()
                    .is_none_or(|c| c.is_whitespace());
                if !public || !is_item {
                    continue;
                }
                let rest = &text[at..];
                let end = rest.find(['{', ';']).unwrap_or(rest.len());
                let signature: String =
                    rest[..end].split_whitespace().collect::<Vec<_>>().join(" ");
                if returns_string_error(&signature) {
                    offenders.push(format!("{}: {signature}", file.display()));
                }
            }
            for (at, _) in text.match_indices("pub type ") {
                let rest = &text[at..];
                let end = rest.find(';').unwrap_or(rest.len());
                let alias: String = rest[..end].split_whitespace().collect::<Vec<_>>().join(" ");
                let target = alias.split('=').nth(1).unwrap_or_default().trim();
                if target.starts_with("Result<") && target.ends_with("String>") {
                    offenders.push(format!("{}: {alias}", file.display()));
                }
            }
        }
    }
    assert!(offenders.is_empty(), "{}", offenders.join("\n"));
}

#[test]
fn the_agent_module_has_no_function_over_a_hundred_lines() {
    let mut long = Vec::new();
    for file in rust_files(&repo().join("actors/src/agent")) {
        let text = std::fs::read_to_string(&file).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        for (i, line) in lines.iter().enumerate() {
            let trimmed = line.trim_start();
            let is_fn = [
                "fn ",
                "pub fn ",
                "async fn ",
                "pub async fn ",
                "pub(super) fn ",
                "pub(super) async fn ",
            ]
            .iter()
            .any(|p| trimmed.starts_with(p));
            if !is_fn || line.trim_end().ends_with(';') {
                continue;
            }
            let indent = line.len() - trimmed.len();
            let closing = format!("{}}}", " ".repeat(indent));
            let end = lines[i + 1..]
                .iter()
                .position(|l| l.starts_with(&closing) && !l[indent..].starts_with("} else"))
                .map_or(lines.len(), |p| i + 1 + p);
            if end - i + 1 > 100 {
                long.push(format!(
                    "{}:{} ({} lines)",
                    file.display(),
                    i + 1,
                    end - i + 1
                ));
            }
        }
    }
    assert!(long.is_empty(), "{}", long.join("\n"));
}

#[test]
fn no_test_reads_outside_the_repository() {
    let mut offenders = Vec::new();
    for dir in [
        "tests",
        "supervisors/tests",
        "services/tests",
        "actors/tests",
        "src",
    ] {
        for file in rust_files(&repo().join(dir)) {
            let text = std::fs::read_to_string(&file).unwrap();
            let needle = ["..", "/shared"].concat();
            if text.contains(&needle) {
                offenders.push(file.display().to_string());
            }
        }
    }
    assert!(offenders.is_empty(), "{}", offenders.join("\n"));
}
