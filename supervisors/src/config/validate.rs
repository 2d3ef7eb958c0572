//! Validation: every entry's plugin looked up in the catalogue and its config
//! checked against the plugin's config type and schema, problems reported
//! with the file and line they come from (a patch's own file for its fields).

use std::collections::HashMap;

use super::PlannedEntry;
use super::interpolate::to_json;
use super::yaml::{Node, Origin, Parser, RawEntry, Yaml};
use crate::runtime::plugin::{Catalogue, FieldError};

pub(super) fn check_duplicates(parser: &mut Parser, entries: &[RawEntry]) {
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

pub(super) fn plan_entries(
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
fn unknown_fields(value: &serde_json::Value, schema: &serde_json::Value) -> Result<(), FieldError> {
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
    ) -> Result<(), FieldError> {
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
                            return Err(FieldError {
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
