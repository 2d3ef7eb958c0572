//! `${NAME}` / `${NAME:-default}` interpolation, and the YAML tree turned
//! into JSON with it (a value that is exactly one reference is re-typed).

use std::collections::HashMap;

use super::yaml::{Node, Origin, Yaml};

/// Why a string could not be interpolated. Fatal for the config: the text
/// (or the environment) must change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InterpolationError {
    /// A `${` without its `}`.
    #[error("unclosed `${{` in `{text}`")]
    Unclosed {
        /// The whole string.
        text: String,
    },
    /// `${…}` around something that is not a variable name.
    #[error(
        "`${{{body}}}` is not a variable reference (expected `${{NAME}}` or `${{NAME:-default}}`)"
    )]
    NotAReference {
        /// What stood between the braces.
        body: String,
    },
    /// `${NAME}` with no default, and `NAME` is not set.
    #[error("environment variable `{name}` is not set (use `${{{name}:-default}}` for a fallback)")]
    Unset {
        /// The variable.
        name: String,
    },
}

/// `${NAME}` / `${NAME:-default}` substitution. `None` from `lookup` means unset.
pub fn interpolate(
    text: &str,
    lookup: &dyn Fn(&str) -> Option<String>,
) -> Result<String, InterpolationError> {
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
            return Err(InterpolationError::Unclosed { text: text.into() });
        };
        let body = &body_start[..end];
        let (name, default) = match body.split_once(":-") {
            Some((n, d)) => (n, Some(d)),
            None => (body, None),
        };
        let valid = !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid {
            return Err(InterpolationError::NotAReference { body: body.into() });
        }
        match (lookup(name), default) {
            (Some(v), _) => out.push_str(&v),
            (None, Some(d)) => out.push_str(d),
            (None, None) => {
                return Err(InterpolationError::Unset { name: name.into() });
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
pub(super) fn to_json(
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
                errors.push((node.origin.clone(), path.to_owned(), reason.to_string()));
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
