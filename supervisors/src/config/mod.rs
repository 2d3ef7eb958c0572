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

mod diff;
mod interpolate;
mod patch;
mod validate;
mod yaml;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::chain;
use crate::runtime::plugin::{Catalogue, CatalogueEntry, ValidConfig};

pub use diff::{Diff, diff};
pub use interpolate::{InterpolationError, interpolate};
use patch::apply_patch;
use validate::{check_duplicates, plan_entries};
use yaml::{Parser, RawEntry};

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

/// A config that cannot be used; lists every problem found, each with its
/// place. Fatal until the files change; nothing was started.
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
                            reason: format!("cannot read the file: {}", chain(&e)),
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
