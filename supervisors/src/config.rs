//! `cordis.yml`: the plugin tree a runtime boots.
//!
//! ```yaml
//! plugins:
//!   - id: llm            # unique across the file
//!     name: openai       # a plugin from the compiled-in catalogue
//!     config:            # validated against the plugin's schema before apply
//!       base_url: ${OPENAI_BASE_URL:-http://127.0.0.1:8080/v1}
//!   - id: tools
//!     group:             # a group: a fiber owning nested entries
//!       - { id: bash, name: bash, disabled: true }
//! ```
//!
//! Strings may use `${NAME}` (the variable must be set) and `${NAME:-default}`;
//! `$${` is a literal `${`. A value that is exactly one `${…}` is re-typed
//! after substitution (`true`, `8080`, `0.5` become a bool or a number).
//! Patch files (`--patch`) have the same shape and are applied by `id`: their
//! fields replace the base entry's, their `config` is merged key by key
//! (`null` deletes a key), and unknown ids are appended.
//!
//! Every problem is reported with the file, line, entry id, field path and
//! reason; all problems of a file are reported together.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use crate::plugin::{Catalogue, CatalogueEntry, ValidConfig};

/// One problem found in a config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    /// The file it was found in.
    pub file: String,
    /// 1-based line, when known.
    pub line: Option<u64>,
    /// The entry id, when the problem belongs to an entry.
    pub entry: Option<String>,
    /// Dotted field path (`config.retry.max_attempts`), empty for the whole entry or file.
    pub path: String,
    /// What is wrong.
    pub reason: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file)?;
        if let Some(line) = self.line {
            write!(f, ":{line}")?;
        }
        write!(f, ":")?;
        if let Some(entry) = &self.entry {
            write!(f, " entry `{entry}`")?;
        }
        if !self.path.is_empty() {
            if self.entry.is_some() {
                write!(f, ",")?;
            }
            write!(f, " field `{}`", self.path)?;
        }
        if self.entry.is_some() || !self.path.is_empty() {
            write!(f, ":")?;
        }
        write!(f, " {}", self.reason)
    }
}

/// A config that cannot be used; lists every problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    /// The problems, in file order.
    pub problems: Vec<Problem>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, p) in self.problems.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{p}")?;
        }
        Ok(())
    }
}

/// Where a YAML node came from.
#[derive(Debug, Clone, PartialEq)]
struct Origin {
    file: Arc<str>,
    line: u64,
}

/// A YAML value with the origin of every node.
#[derive(Debug, Clone, PartialEq)]
enum Yaml {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(String),
    Seq(Vec<Node>),
    Map(Vec<(Key, Node)>),
}

#[derive(Debug, Clone, PartialEq)]
struct Node {
    value: Yaml,
    origin: Origin,
}

#[derive(Debug, Clone, PartialEq)]
struct Key {
    name: String,
    origin: Origin,
}

/// The raw parse tree: spans but no file name yet.
enum Raw {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(String),
    Seq(Vec<Spanned<Raw>>),
    Map(Vec<(Spanned<String>, Spanned<Raw>)>),
}

impl<'de> Deserialize<'de> for Raw {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Raw, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Raw;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any YAML value")
            }
            fn visit_unit<E: de::Error>(self) -> Result<Raw, E> {
                Ok(Raw::Null)
            }
            fn visit_none<E: de::Error>(self) -> Result<Raw, E> {
                Ok(Raw::Null)
            }
            fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Raw, D::Error> {
                Raw::deserialize(d)
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Raw, E> {
                Ok(Raw::Bool(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Raw, E> {
                Ok(Raw::Int(v))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Raw, E> {
                Ok(Raw::Uint(v))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Raw, E> {
                Ok(Raw::Float(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Raw, E> {
                Ok(Raw::Str(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Raw, E> {
                Ok(Raw::Str(v))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Raw, A::Error> {
                let mut out = Vec::new();
                while let Some(item) = seq.next_element::<Spanned<Raw>>()? {
                    out.push(item);
                }
                Ok(Raw::Seq(out))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Raw, A::Error> {
                let mut out = Vec::new();
                while let Some((k, v)) = map.next_entry::<Spanned<String>, Spanned<Raw>>()? {
                    out.push((k, v));
                }
                Ok(Raw::Map(out))
            }
        }
        d.deserialize_any(V)
    }
}

fn adopt(raw: Spanned<Raw>, file: &Arc<str>) -> Node {
    let origin = Origin {
        file: file.clone(),
        line: raw.referenced.line(),
    };
    let value = match raw.value {
        Raw::Null => Yaml::Null,
        Raw::Bool(b) => Yaml::Bool(b),
        Raw::Int(i) => Yaml::Int(i),
        Raw::Uint(u) => Yaml::Uint(u),
        Raw::Float(x) => Yaml::Float(x),
        Raw::Str(s) => Yaml::Str(s),
        Raw::Seq(items) => Yaml::Seq(items.into_iter().map(|i| adopt(i, file)).collect()),
        Raw::Map(pairs) => Yaml::Map(
            pairs
                .into_iter()
                .map(|(k, v)| {
                    let key = Key {
                        name: k.value,
                        origin: Origin {
                            file: file.clone(),
                            line: k.referenced.line(),
                        },
                    };
                    (key, adopt(v, file))
                })
                .collect(),
        ),
    };
    Node { value, origin }
}

fn kind_of(y: &Yaml) -> &'static str {
    match y {
        Yaml::Null => "null",
        Yaml::Bool(_) => "a boolean",
        Yaml::Int(_) | Yaml::Uint(_) | Yaml::Float(_) => "a number",
        Yaml::Str(_) => "a string",
        Yaml::Seq(_) => "a list",
        Yaml::Map(_) => "a mapping",
    }
}

/// One entry as written (after patches, before interpolation).
#[derive(Debug, Clone)]
struct RawEntry {
    id: String,
    origin: Origin,
    name: Option<(String, Origin)>,
    config: Option<Node>,
    disabled: Option<Node>,
    group: Option<(Vec<RawEntry>, Origin)>,
}

struct Parser {
    problems: Vec<Problem>,
}

impl Parser {
    fn problem(
        &mut self,
        origin: &Origin,
        entry: Option<&str>,
        path: &str,
        reason: impl Into<String>,
    ) {
        self.problems.push(Problem {
            file: origin.file.to_string(),
            line: Some(origin.line),
            entry: entry.map(str::to_owned),
            path: path.to_owned(),
            reason: reason.into(),
        });
    }

    fn file(&mut self, text: &str, file: &Arc<str>) -> Vec<RawEntry> {
        if text.trim().is_empty() {
            self.problems.push(Problem {
                file: file.to_string(),
                line: None,
                entry: None,
                path: String::new(),
                reason: "the file is empty; expected a mapping with a `plugins` list".into(),
            });
            return Vec::new();
        }
        let raw: Spanned<Raw> = match serde_saphyr::from_str(text) {
            Ok(r) => r,
            Err(e) => {
                let line = e.location().map(|l| l.line());
                let reason = e.to_string();
                let first = reason.lines().next().unwrap_or("invalid YAML").to_owned();
                self.problems.push(Problem {
                    file: file.to_string(),
                    line,
                    entry: None,
                    path: String::new(),
                    reason: format!("invalid YAML: {first}"),
                });
                return Vec::new();
            }
        };
        let root = adopt(raw, file);
        let Yaml::Map(pairs) = root.value else {
            self.problem(
                &root.origin,
                None,
                "",
                format!(
                    "expected a mapping with a `plugins` list, found {}",
                    kind_of(&root.value)
                ),
            );
            return Vec::new();
        };
        let mut entries = Vec::new();
        let mut seen = false;
        for (key, value) in pairs {
            match key.name.as_str() {
                "plugins" => {
                    seen = true;
                    entries = self.entries(value, "plugins");
                }
                other => self.problem(
                    &key.origin,
                    None,
                    other,
                    "unknown top-level field (expected `plugins`)",
                ),
            }
        }
        if !seen {
            self.problem(&root.origin, None, "plugins", "missing field `plugins`");
        }
        entries
    }

    fn entries(&mut self, node: Node, path: &str) -> Vec<RawEntry> {
        match node.value {
            Yaml::Seq(items) => items
                .into_iter()
                .enumerate()
                .filter_map(|(i, item)| self.entry(item, &format!("{path}[{i}]")))
                .collect(),
            Yaml::Null => Vec::new(),
            other => {
                self.problem(
                    &node.origin,
                    None,
                    path,
                    format!("expected a list of entries, found {}", kind_of(&other)),
                );
                Vec::new()
            }
        }
    }

    fn entry(&mut self, node: Node, path: &str) -> Option<RawEntry> {
        let origin = node.origin.clone();
        let Yaml::Map(pairs) = node.value else {
            self.problem(
                &origin,
                None,
                path,
                format!("expected an entry mapping, found {}", kind_of(&node.value)),
            );
            return None;
        };
        let id = pairs
            .iter()
            .find(|(k, _)| k.name == "id")
            .map(|(_, v)| v.clone());
        let id = match id {
            Some(Node {
                value: Yaml::Str(s),
                ..
            }) if !s.trim().is_empty() => s,
            Some(other) => {
                self.problem(
                    &other.origin,
                    None,
                    &format!("{path}.id"),
                    format!(
                        "expected a non-empty string, found {}",
                        kind_of(&other.value)
                    ),
                );
                return None;
            }
            None => {
                self.problem(&origin, None, &format!("{path}.id"), "missing field `id`");
                return None;
            }
        };
        let mut entry = RawEntry {
            id: id.clone(),
            origin: origin.clone(),
            name: None,
            config: None,
            disabled: None,
            group: None,
        };
        for (key, value) in pairs {
            match key.name.as_str() {
                "id" => {}
                "name" => match value.value {
                    Yaml::Str(s) => entry.name = Some((s, value.origin)),
                    other => self.problem(
                        &value.origin,
                        Some(&id),
                        "name",
                        format!(
                            "expected a plugin name (a string), found {}",
                            kind_of(&other)
                        ),
                    ),
                },
                "config" => entry.config = Some(value),
                "disabled" => entry.disabled = Some(value),
                "group" => {
                    let at = value.origin.clone();
                    let children = self.entries(value, &format!("{id}.group"));
                    entry.group = Some((children, at));
                }
                other => self.problem(
                    &key.origin,
                    Some(&id),
                    other,
                    "unknown field (expected one of `id`, `name`, `config`, `disabled`, `group`)",
                ),
            }
        }
        Some(entry)
    }
}

/// Merges a patch entry into a base entry.
fn patch_entry(base: &mut RawEntry, patch: RawEntry) {
    if patch.name.is_some() {
        base.name = patch.name;
    }
    if patch.disabled.is_some() {
        base.disabled = patch.disabled;
    }
    if let Some(p) = patch.config {
        base.config = Some(match base.config.take() {
            Some(b) => merge(b, p),
            None => p,
        });
    }
    if let Some((children, origin)) = patch.group {
        let base_children = match base.group.take() {
            Some((c, _)) => c,
            None => Vec::new(),
        };
        base.group = Some((apply_patch(base_children, children), origin));
    }
}

fn merge(base: Node, patch: Node) -> Node {
    match (base.value, patch.value) {
        (Yaml::Map(mut b), Yaml::Map(p)) => {
            for (k, v) in p {
                let pos = b.iter().position(|(bk, _)| bk.name == k.name);
                match (pos, &v.value) {
                    (Some(i), Yaml::Null) => {
                        b.remove(i);
                    }
                    (Some(i), _) => {
                        let (bk, bv) = b.remove(i);
                        b.insert(i, (bk, merge(bv, v)));
                    }
                    (None, Yaml::Null) => {}
                    (None, _) => b.push((k, v)),
                }
            }
            Node {
                value: Yaml::Map(b),
                origin: base.origin,
            }
        }
        (_, value) => Node {
            value,
            origin: patch.origin,
        },
    }
}

fn find_mut<'a>(entries: &'a mut [RawEntry], id: &str) -> Option<&'a mut RawEntry> {
    for e in entries.iter_mut() {
        if e.id == id {
            return Some(e);
        }
        if let Some((children, _)) = &mut e.group
            && let Some(found) = find_mut(children, id)
        {
            return Some(found);
        }
    }
    None
}

fn apply_patch(mut base: Vec<RawEntry>, patch: Vec<RawEntry>) -> Vec<RawEntry> {
    for p in patch {
        match find_mut(&mut base, &p.id) {
            Some(target) => patch_entry(target, p),
            None => base.push(p),
        }
    }
    base
}

/// `${NAME}` / `${NAME:-default}` substitution. `None` from `lookup` means unset.
pub fn interpolate(text: &str, lookup: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos..];
        if let Some(stripped) = after.strip_prefix("$${") {
            out.push_str("${");
            rest = stripped;
            continue;
        }
        let Some(body_start) = after.strip_prefix("${") else {
            out.push('$');
            rest = &after[1..];
            continue;
        };
        let Some(end) = body_start.find('}') else {
            return Err(format!("unclosed `${{` in `{text}`"));
        };
        let body = &body_start[..end];
        let (name, default) = match body.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (body, None),
        };
        let valid = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(format!(
                "`${{{body}}}` is not a variable reference (expected `${{NAME}}` or `${{NAME:-default}}`)"
            ));
        }
        match (lookup(name), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => {
                return Err(format!(
                    "environment variable `{name}` is not set (use `${{{name}:-default}}` for a fallback)"
                ));
            }
        }
        rest = &body_start[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

fn is_single_reference(s: &str) -> bool {
    s.starts_with("${") && s.ends_with('}') && s.matches("${").count() == 1
}

/// Turns a node into JSON, interpolating strings and recording the line of
/// every path.
fn to_json(
    node: &Node,
    path: &str,
    lines: &mut HashMap<String, u64>,
    lookup: &dyn Fn(&str) -> Option<String>,
    errors: &mut Vec<(Origin, String, String)>,
) -> serde_json::Value {
    use serde_json::Value;
    lines.insert(path.to_owned(), node.origin.line);
    match &node.value {
        Yaml::Null => Value::Null,
        Yaml::Bool(b) => Value::Bool(*b),
        Yaml::Int(i) => Value::from(*i),
        Yaml::Uint(u) => Value::from(*u),
        Yaml::Float(x) => serde_json::Number::from_f64(*x)
            .map(Value::Number)
            .unwrap_or(Value::Null),
        Yaml::Str(s) => match interpolate(s, lookup) {
            Ok(v) if is_single_reference(s) => retype(v),
            Ok(v) => Value::String(v),
            Err(reason) => {
                errors.push((node.origin.clone(), path.to_owned(), reason));
                Value::Null
            }
        },
        Yaml::Seq(items) => Value::Array(
            items
                .iter()
                .enumerate()
                .map(|(i, item)| to_json(item, &format!("{path}[{i}]"), lines, lookup, errors))
                .collect(),
        ),
        Yaml::Map(pairs) => {
            let mut map = serde_json::Map::new();
            for (k, v) in pairs {
                let child = if path.is_empty() {
                    k.name.clone()
                } else {
                    format!("{path}.{}", k.name)
                };
                let value = to_json(v, &child, lines, lookup, errors);
                map.insert(k.name.clone(), value);
            }
            Value::Object(map)
        }
    }
}

fn retype(v: String) -> serde_json::Value {
    use serde_json::Value;
    match v.as_str() {
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => {
            if let Ok(i) = v.parse::<i64>() {
                Value::from(i)
            } else if let Some(n) = v.parse::<f64>().ok().and_then(serde_json::Number::from_f64)
                && v.contains('.')
            {
                Value::Number(n)
            } else {
                Value::String(v)
            }
        }
    }
}

/// One validated entry, ready to start.
#[derive(Clone)]
pub struct PlannedEntry {
    /// Unique id.
    pub id: String,
    /// Plugin name (`group` for groups).
    pub plugin: String,
    /// Line of the entry in its file.
    pub line: u64,
    /// Whether it is switched off.
    pub disabled: bool,
    /// The config after interpolation, as JSON (for display and diffing).
    pub config: serde_json::Value,
    /// Nested entries of a group.
    pub group: Vec<PlannedEntry>,
    pub(crate) entry: Option<Arc<dyn CatalogueEntry>>,
    pub(crate) valid: Option<ValidConfig>,
}

impl PlannedEntry {
    /// A fingerprint that changes whenever the entry's own settings change
    /// (not its group children, which are compared one by one).
    pub fn fingerprint(&self) -> String {
        format!("{}|{}|{}", self.plugin, self.disabled, self.config)
    }

    /// Whether this entry is a group.
    pub fn is_group(&self) -> bool {
        self.entry.is_none()
    }
}

impl fmt::Debug for PlannedEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PlannedEntry")
            .field("id", &self.id)
            .field("plugin", &self.plugin)
            .field("disabled", &self.disabled)
            .field("config", &self.config)
            .field("group", &self.group)
            .finish()
    }
}

/// A whole validated config.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Top-level entries in file order.
    pub entries: Vec<PlannedEntry>,
}

impl Plan {
    /// Every entry, depth first, with its parent group id.
    pub fn flatten(&self) -> Vec<(&PlannedEntry, Option<&str>)> {
        fn walk<'a>(
            list: &'a [PlannedEntry],
            parent: Option<&'a str>,
            out: &mut Vec<(&'a PlannedEntry, Option<&'a str>)>,
        ) {
            for e in list {
                out.push((e, parent));
                walk(&e.group, Some(&e.id), out);
            }
        }
        let mut out = Vec::new();
        walk(&self.entries, None, &mut out);
        out
    }
}

/// Where a config comes from: a base file and patch files, in order.
#[derive(Clone, Debug)]
pub struct Source {
    /// The base `cordis.yml`.
    pub base: PathBuf,
    /// Patch layers, applied in order.
    pub patches: Vec<PathBuf>,
}

impl Source {
    /// A source with no patches.
    pub fn new(base: impl Into<PathBuf>) -> Source {
        Source {
            base: base.into(),
            patches: Vec::new(),
        }
    }

    /// Reads, merges, interpolates and validates everything, with the
    /// process environment.
    pub fn plan(&self, catalogue: &Catalogue) -> Result<Plan, ConfigError> {
        let mut texts = Vec::new();
        for path in std::iter::once(&self.base).chain(self.patches.iter()) {
            match std::fs::read_to_string(path) {
                Ok(t) => texts.push((path.display().to_string(), t)),
                Err(e) => {
                    return Err(ConfigError {
                        problems: vec![Problem {
                            file: path.display().to_string(),
                            line: None,
                            entry: None,
                            path: String::new(),
                            reason: format!("cannot read the file: {e}"),
                        }],
                    });
                }
            }
        }
        plan_texts(&texts, catalogue, &|name| std::env::var(name).ok())
    }

    /// Every file this source reads.
    pub fn files(&self) -> Vec<&Path> {
        std::iter::once(self.base.as_path())
            .chain(self.patches.iter().map(PathBuf::as_path))
            .collect()
    }
}

/// Plans from in-memory texts `(file name, contents)`: the first is the base,
/// the rest are patches. `lookup` resolves `${NAME}`.
pub fn plan_texts(
    texts: &[(String, String)],
    catalogue: &Catalogue,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<Plan, ConfigError> {
    let mut parser = Parser {
        problems: Vec::new(),
    };
    let mut merged: Option<Vec<RawEntry>> = None;
    for (name, text) in texts {
        let file: Arc<str> = Arc::from(name.as_str());
        let entries = parser.file(text, &file);
        merged = Some(match merged {
            None => {
                check_duplicates(&mut parser, &entries);
                entries
            }
            Some(base) => {
                check_duplicates(&mut parser, &entries);
                apply_patch(base, entries)
            }
        });
    }
    let entries = merged.unwrap_or_default();
    let planned = plan_entries(&mut parser, &entries, catalogue, lookup);
    if parser.problems.is_empty() {
        Ok(Plan { entries: planned })
    } else {
        Err(ConfigError {
            problems: parser.problems,
        })
    }
}

fn check_duplicates(parser: &mut Parser, entries: &[RawEntry]) {
    fn walk<'a>(
        list: &'a [RawEntry],
        seen: &mut HashMap<&'a str, &'a Origin>,
        parser: &mut Parser,
    ) {
        for e in list {
            if let Some(first) = seen.get(e.id.as_str()) {
                let reason = format!("duplicate id (first used at line {})", first.line);
                let origin = e.origin.clone();
                parser.problem(&origin, Some(&e.id), "id", reason);
            } else {
                seen.insert(&e.id, &e.origin);
            }
            if let Some((children, _)) = &e.group {
                walk(children, seen, parser);
            }
        }
    }
    let mut seen = HashMap::new();
    walk(entries, &mut seen, parser);
}

fn plan_entries(
    parser: &mut Parser,
    entries: &[RawEntry],
    catalogue: &Catalogue,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Vec<PlannedEntry> {
    let mut out = Vec::new();
    for e in entries {
        let disabled = match &e.disabled {
            None => false,
            Some(node) => {
                let mut lines = HashMap::new();
                let mut errors = Vec::new();
                let v = to_json(node, "disabled", &mut lines, lookup, &mut errors);
                for (origin, path, reason) in errors {
                    parser.problem(&origin, Some(&e.id), &path, reason);
                }
                match v {
                    serde_json::Value::Bool(b) => b,
                    serde_json::Value::Null
                        if e.disabled.as_ref().is_some_and(|n| n.value == Yaml::Null) =>
                    {
                        false
                    }
                    other => {
                        parser.problem(
                            &node.origin,
                            Some(&e.id),
                            "disabled",
                            format!("expected true or false, found {other}"),
                        );
                        false
                    }
                }
            }
        };
        if let Some((children, _)) = &e.group {
            if let Some((name, origin)) = &e.name
                && name != "group"
            {
                parser.problem(
                    origin,
                    Some(&e.id),
                    "name",
                    "a group entry takes no plugin name (or `group`)",
                );
            }
            if let Some(c) = &e.config {
                parser.problem(
                    &c.origin,
                    Some(&e.id),
                    "config",
                    "a group entry takes no config",
                );
            }
            out.push(PlannedEntry {
                id: e.id.clone(),
                plugin: "group".into(),
                line: e.origin.line,
                disabled,
                config: serde_json::Value::Null,
                group: plan_entries(parser, children, catalogue, lookup),
                entry: None,
                valid: None,
            });
            continue;
        }
        let Some((name, name_origin)) = &e.name else {
            parser.problem(
                &e.origin,
                Some(&e.id),
                "name",
                "missing field `name` (the plugin to load)",
            );
            continue;
        };
        let Some(entry) = catalogue.get(name) else {
            let known = catalogue.names().join("`, `");
            parser.problem(
                name_origin,
                Some(&e.id),
                "name",
                format!("unknown plugin `{name}` (known: `{known}`)"),
            );
            continue;
        };
        let mut lines = HashMap::new();
        let mut errors = Vec::new();
        let config = match &e.config {
            Some(node) => to_json(node, "", &mut lines, lookup, &mut errors),
            None => serde_json::Value::Null,
        };
        let had_errors = !errors.is_empty();
        for (origin, path, reason) in errors {
            parser.problem(
                &origin,
                Some(&e.id),
                format!("config.{path}").trim_end_matches('.'),
                reason,
            );
        }
        if had_errors {
            continue;
        }
        let config_line = e
            .config
            .as_ref()
            .map(|c| c.origin.line)
            .unwrap_or(e.origin.line);
        let validated = entry.validate(config.clone()).or_else(|first| {
            // An omitted config also stands for `{}` (a struct with defaults).
            if config.is_null() {
                entry.validate(serde_json::Value::Object(Default::default()))
            } else {
                Err(first)
            }
        });
        match validated.and_then(|v| unknown_fields(&config, &entry.schema()).map(|()| v)) {
            Ok(valid) => out.push(PlannedEntry {
                id: e.id.clone(),
                plugin: name.clone(),
                line: e.origin.line,
                disabled,
                config,
                group: Vec::new(),
                entry: Some(entry.clone()),
                valid: Some(valid),
            }),
            Err(fe) => {
                let line = line_for(&lines, &fe.path).unwrap_or(config_line);
                let origin = Origin {
                    file: e.origin.file.clone(),
                    line,
                };
                let path = if fe.path.is_empty() {
                    "config".to_owned()
                } else {
                    format!("config.{}", fe.path)
                };
                // A field from a patch file reports that file.
                let origin = e
                    .config
                    .as_ref()
                    .and_then(|c| origin_of(c, &fe.path))
                    .unwrap_or(origin);
                parser.problem(&origin, Some(&e.id), &path, fe.reason);
            }
        }
    }
    out
}

/// The line recorded for `path`, or for its nearest recorded ancestor.
fn line_for(lines: &HashMap<String, u64>, path: &str) -> Option<u64> {
    let mut p = path.to_owned();
    loop {
        if let Some(l) = lines.get(&p) {
            return Some(*l);
        }
        let cut = p.rfind(['.', '['])?;
        p.truncate(cut);
    }
}

/// The origin of the node at `path` (or its nearest ancestor) inside `node`.
fn origin_of(node: &Node, path: &str) -> Option<Origin> {
    let mut current = node;
    if path.is_empty() {
        return Some(current.origin.clone());
    }
    for segment in path.split('.') {
        let (key, indexes) = match segment.find('[') {
            Some(i) => (&segment[..i], &segment[i..]),
            None => (segment, ""),
        };
        if !key.is_empty() {
            let Yaml::Map(pairs) = &current.value else {
                break;
            };
            match pairs.iter().find(|(k, _)| k.name == key) {
                Some((_, v)) => current = v,
                None => break,
            }
        }
        for idx in indexes.split('[').filter(|s| !s.is_empty()) {
            let i: usize = idx.trim_end_matches(']').parse().ok()?;
            let Yaml::Seq(items) = &current.value else {
                break;
            };
            match items.get(i) {
                Some(v) => current = v,
                None => break,
            }
        }
    }
    Some(current.origin.clone())
}

/// Rejects keys the plugin's schema does not declare, wherever the schema
/// lists `properties` (so a plugin need not remember `deny_unknown_fields`).
fn unknown_fields(
    value: &serde_json::Value,
    schema: &serde_json::Value,
) -> Result<(), crate::plugin::FieldError> {
    fn resolve<'a>(
        schema: &'a serde_json::Value,
        root: &'a serde_json::Value,
    ) -> &'a serde_json::Value {
        let mut s = schema;
        for _ in 0..16 {
            match s.get("$ref").and_then(|r| r.as_str()) {
                Some(r) => {
                    let name = r.rsplit('/').next().unwrap_or("");
                    match root.get("$defs").and_then(|d| d.get(name)) {
                        Some(next) => s = next,
                        None => return s,
                    }
                }
                None => return s,
            }
        }
        s
    }
    fn walk(
        value: &serde_json::Value,
        schema: &serde_json::Value,
        root: &serde_json::Value,
        path: &str,
    ) -> Result<(), crate::plugin::FieldError> {
        let mut schema = resolve(schema, root);
        // `Option<T>` and enums: follow the branch that describes this
        // object — the first whose tag constants match and that declares
        // every key; else the closest one, so its unknown key is reported.
        if let Some(map) = value.as_object()
            && schema.get("properties").is_none()
        {
            let branches: Vec<&serde_json::Value> = ["anyOf", "oneOf", "allOf"]
                .iter()
                .filter_map(|key| schema.get(*key).and_then(|b| b.as_array()))
                .flatten()
                .map(|s| resolve(s, root))
                .filter(|s| s.get("properties").is_some())
                .collect();
            let misfit = |b: &serde_json::Value| -> usize {
                let Some(props) = b.get("properties").and_then(|p| p.as_object()) else {
                    return usize::MAX;
                };
                let tag_mismatch = props.iter().any(|(k, sub)| {
                    let sub = resolve(sub, root);
                    let constant = sub.get("const").or_else(|| {
                        sub.get("enum")
                            .and_then(|e| e.as_array())
                            .filter(|e| e.len() == 1)
                            .and_then(|e| e.first())
                    });
                    matches!((constant, map.get(k)), (Some(c), Some(v)) if c != v)
                });
                let unknown = map.keys().filter(|k| !props.contains_key(*k)).count();
                usize::from(tag_mismatch) * 1_000 + unknown
            };
            if let Some(best) = branches.into_iter().min_by_key(|b| misfit(b)) {
                schema = best;
            }
        }
        match value {
            serde_json::Value::Object(map) => {
                let Some(props) = schema.get("properties").and_then(|p| p.as_object()) else {
                    return Ok(());
                };
                let open = schema
                    .get("additionalProperties")
                    .is_some_and(|a| a != &serde_json::Value::Bool(false));
                for (k, v) in map {
                    let child = if path.is_empty() {
                        k.clone()
                    } else {
                        format!("{path}.{k}")
                    };
                    match props.get(k) {
                        Some(sub) => walk(v, sub, root, &child)?,
                        None if open => {}
                        None => {
                            let mut known: Vec<&str> = props.keys().map(String::as_str).collect();
                            known.sort_unstable();
                            return Err(crate::plugin::FieldError {
                                path: child,
                                reason: format!(
                                    "unknown field `{k}` (expected one of `{}`)",
                                    known.join("`, `")
                                ),
                            });
                        }
                    }
                }
                Ok(())
            }
            serde_json::Value::Array(items) => {
                if let Some(sub) = schema.get("items") {
                    for (i, item) in items.iter().enumerate() {
                        walk(item, sub, root, &format!("{path}[{i}]"))?;
                    }
                }
                Ok(())
            }
            _ => Ok(()),
        }
    }
    walk(value, schema, schema, "")
}

/// Entries that differ between two plans, by id.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Ids present only in the new plan.
    pub added: Vec<String>,
    /// Ids present only in the old plan.
    pub removed: Vec<String>,
    /// Ids whose own settings changed.
    pub changed: Vec<String>,
}

/// Compares two plans entry by entry.
pub fn diff(old: &Plan, new: &Plan) -> Diff {
    let index = |p: &Plan| -> BTreeMap<String, (String, Option<String>)> {
        p.flatten()
            .into_iter()
            .map(|(e, parent)| (e.id.clone(), (e.fingerprint(), parent.map(str::to_owned))))
            .collect()
    };
    let (a, b) = (index(old), index(new));
    let mut d = Diff::default();
    let old_ids: HashSet<&String> = a.keys().collect();
    for (id, fp) in &b {
        match a.get(id) {
            None => d.added.push(id.clone()),
            Some(old_fp) if old_fp != fp => d.changed.push(id.clone()),
            Some(_) => {}
        }
    }
    for id in old_ids {
        if !b.contains_key(id) {
            d.removed.push(id.clone());
        }
    }
    d.removed.sort();
    d
}
