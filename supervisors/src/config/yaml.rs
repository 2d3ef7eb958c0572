//! The YAML layer: a `cordis.yml` parsed with the line of every node, and
//! its entries read into [`RawEntry`]s (as written: before patches and
//! interpolation), every problem recorded with its place.

use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_saphyr::Spanned;

use super::Problem;
use crate::error::chain;

/// Where a YAML node came from.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Origin {
    pub(super) file: Arc<str>,
    pub(super) line: u64,
}

/// A YAML value with the origin of every node.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Yaml {
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
pub(super) struct Node {
    pub(super) value: Yaml,
    pub(super) origin: Origin,
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Key {
    pub(super) name: String,
    pub(super) origin: Origin,
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
pub(super) struct RawEntry {
    pub(super) id: String,
    pub(super) origin: Origin,
    pub(super) name: Option<(String, Origin)>,
    pub(super) config: Option<Node>,
    pub(super) disabled: Option<Node>,
    pub(super) group: Option<(Vec<RawEntry>, Origin)>,
}

pub(super) struct Parser {
    pub(super) problems: Vec<Problem>,
}

impl Parser {
    pub(super) fn problem(
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

    pub(super) fn file(&mut self, text: &str, file: &Arc<str>) -> Vec<RawEntry> {
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
                let reason = chain(&e).to_string();
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
