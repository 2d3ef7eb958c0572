//! `read`, `write`, `edit`: UTF-8 files inside the workspace root.
//!
//! Paths reach files as [`Place`] says: beneath the workspace, resolved by
//! the kernel, unless the call's policy is `danger-full-access`. Under
//! `read-only`, `write` and `edit` refuse (a call may ask to escalate).
//! `edit` (and `write` over an existing file) requires that this agent read
//! the file's *current* content first: a file changed since the read must
//! be read again.

use std::collections::HashMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use super::workspace::{ESCALATE, Place};
use crate::llm::ToolSchema;
use crate::sandbox::PermissionMode;
use crate::tools::{Escalation, Tool, ToolContext, ToolError, ToolOutput, parameters};

/// What each agent has seen of each file: (scope id, path) → content hash.
#[derive(Default)]
pub struct Observed {
    seen: Mutex<HashMap<(u64, PathBuf), u64>>,
}

impl Observed {
    fn key(cx: &ToolContext, path: &Path) -> (u64, PathBuf) {
        (
            cx.ctx.scope_key().map(|k| k.id()).unwrap_or(0),
            path.to_path_buf(),
        )
    }

    fn record(&self, cx: &ToolContext, path: &Path, content: &str) {
        if let Ok(mut seen) = self.seen.lock() {
            seen.insert(Self::key(cx, path), digest(content));
        }
    }

    fn check(&self, cx: &ToolContext, path: &Path, current: &str) -> Result<(), ToolError> {
        let seen = self
            .seen
            .lock()
            .ok()
            .and_then(|s| s.get(&Self::key(cx, path)).copied());
        match seen {
            None => Err(ToolError::new(
                "NOT_READ",
                format!("read {} before changing it", path.display()),
            )),
            Some(h) if h != digest(current) => Err(ToolError::new(
                "STALE_READ",
                format!(
                    "{} changed since it was read; read it again",
                    path.display()
                ),
            )),
            Some(_) => Ok(()),
        }
    }
}

fn digest(text: &str) -> u64 {
    let mut h = DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

/// The file's text; a missing file is an error naming it.
async fn read_text(place: &Place, given: &str) -> Result<String, ToolError> {
    place.read(given).await?.ok_or_else(|| {
        ToolError::new(
            "NOT_FOUND",
            format!("cannot read \"{}\": not found", place.shown().display()),
        )
    })
}

/// Refuses a change under `read-only` (the call may ask to escalate).
fn writable(cx: &ToolContext, place: &Place) -> Result<(), ToolError> {
    if cx.policy.mode == PermissionMode::ReadOnly {
        return Err(ToolError::new(
            "DENIED",
            format!(
                "the permission mode is read-only: {} cannot be changed. {ESCALATE}",
                place.shown().display()
            ),
        ));
    }
    Ok(())
}

/// What a `read` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct ReadArgs {
    /// Path to read, relative to the workspace.
    file_path: String,
    /// 1-based first line to return. Defaults to 1.
    #[serde(default)]
    offset: Option<f64>,
    /// Maximum number of lines to return. Defaults to 2000.
    #[serde(default)]
    limit: Option<f64>,
}

/// What a `write` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct WriteArgs {
    /// Path to write, relative to the workspace.
    file_path: String,
    /// Full UTF-8 text content to write.
    content: String,
    // Read by the pipeline, before the body runs.
    #[allow(dead_code)]
    #[serde(flatten)]
    escalation: Escalation,
}

/// What an `edit` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct EditArgs {
    /// Path to edit, relative to the workspace.
    file_path: String,
    /// Literal text to replace. Must match exactly.
    old_string: String,
    /// Replacement text.
    new_string: String,
    /// Replace every match (default: exactly one match required).
    #[serde(default)]
    replace_all: Option<bool>,
    // Read by the pipeline, before the body runs.
    #[allow(dead_code)]
    #[serde(flatten)]
    escalation: Escalation,
}

fn schema(name: &str, description: &str, parameters: serde_json::Value) -> ToolSchema {
    ToolSchema {
        name: name.into(),
        description: description.into(),
        parameters,
    }
}

/// `read`: line-numbered content.
pub struct Read {
    observed: Arc<Observed>,
}

/// `write`: create or replace a file.
pub struct Write {
    observed: Arc<Observed>,
}

/// `edit`: replace literal text.
pub struct Edit {
    observed: Arc<Observed>,
}

/// The three file tools, sharing what each agent has read.
pub fn file_tools() -> (Read, Write, Edit) {
    let observed = Arc::new(Observed::default());
    (
        Read {
            observed: observed.clone(),
        },
        Write {
            observed: observed.clone(),
        },
        Edit { observed },
    )
}

impl Tool for Read {
    fn schema(&self) -> ToolSchema {
        schema(
            "read",
            "Read a UTF-8 text file and return its lines numbered from 1 (`N: text`). Returns at most `limit` lines (default 2000) from line `offset` (default 1) and says when more follow. Paths are relative to the workspace; reading is allowed under every permission mode. A binary or non-UTF-8 file is refused rather than garbled.",
            parameters::<ReadArgs>(),
        )
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Read a file before you edit or overwrite it: a change to a file you have not read in its current state is refused. Read a large file in parts with `offset` and `limit` instead of all at once, and read only the part the task needs.",
        )
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: ReadArgs = cx.parse()?;
            let place = match Place::spilled(&cx, &args.file_path) {
                Some(place) => place,
                None => Place::of(&cx, &args.file_path)?,
            };
            let text = read_text(&place, &args.file_path).await?;
            let path = place.shown();
            self.observed.record(&cx, &path, &text);
            let offset = args.offset.map(|o| o.max(1.0) as usize).unwrap_or(1);
            let limit = args.limit.map(|l| l.max(1.0) as usize).unwrap_or(2000);
            let lines: Vec<&str> = text.lines().collect();
            let total = lines.len();
            let mut body = String::new();
            for (i, line) in lines.iter().enumerate().skip(offset - 1).take(limit) {
                body.push_str(&format!("{}: {line}\n", i + 1));
            }
            let shown_end = (offset - 1 + limit).min(total);
            let tail = if shown_end < total {
                format!("\n(Showing lines {offset}-{shown_end} of {total}; use offset to read more)")
            } else {
                format!("\n(End of file - total {total} lines)")
            };
            let out = format!("<path>{}</path>\n<type>file</type>\n<content>\n{body}{tail}\n</content>", path.display());
            Ok(ToolOutput {
                content: vec![crate::llm::ContentBlock::text(out)],
                meta: Some(json!({"path": path.display().to_string(), "offset": offset, "totalLines": total})),
            })
        }
        .boxed()
    }
}

impl Tool for Write {
    fn escalates(&self) -> bool {
        true
    }

    fn schema(&self) -> ToolSchema {
        schema(
            "write",
            "Create a UTF-8 text file, or replace one completely, with `content`; missing parent directories are created. Replacing an existing file requires reading it first in its current state. Under workspace-write only paths inside the workspace may be written; under read-only none. A refused path can be retried once with `sandbox_permissions` naming the mode it needs and a `justification`; the user decides.",
            parameters::<WriteArgs>(),
        )
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Use `write` for a new file or a complete rewrite; for a change inside an existing file use `edit`, which cannot lose the parts you did not mean to touch.",
        )
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let WriteArgs {
                file_path, content, ..
            } = cx.parse()?;
            let place = Place::of(&cx, &file_path)?;
            writable(&cx, &place)?;
            let path = place.shown();
            let current = place.read(&file_path).await?;
            let existed = current.is_some();
            if let Some(current) = current {
                self.observed.check(&cx, &path, &current)?;
            }
            place
                .write(&file_path, content.clone().into_bytes())
                .await?;
            self.observed.record(&cx, &path, &content);
            let what = if existed {
                "Replaced file"
            } else {
                "Created file"
            };
            Ok(ToolOutput::text(format!(
                "<path>{}</path>\n<type>file</type>\n<content>\n{what}\n</content>",
                path.display()
            )))
        }
        .boxed()
    }
}

impl Tool for Edit {
    fn escalates(&self) -> bool {
        true
    }

    fn schema(&self) -> ToolSchema {
        schema(
            "edit",
            "Replace literal text in an existing UTF-8 text file: `old_string` must occur exactly once (or set `replace_all` to replace every occurrence) and is matched character for character, whitespace included. Read the file first in its current state. The same path rules as `write` apply, with the same `sandbox_permissions` retry.",
            parameters::<EditArgs>(),
        )
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "`edit` replaces text that occurs exactly once: copy `old_string` from what `read` showed (without the line-number prefix), with enough surrounding lines to make it unique and its indentation exact. Make several small edits rather than one that rewrites a whole block.",
        )
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: EditArgs = cx.parse()?;
            let (old, new) = (args.old_string.as_str(), args.new_string.as_str());
            let all = args.replace_all.unwrap_or(false);
            let place = Place::of(&cx, &args.file_path)?;
            writable(&cx, &place)?;
            let path = place.shown();
            let current = read_text(&place, &args.file_path).await?;
            self.observed.check(&cx, &path, &current)?;
            if old.is_empty() {
                return Err(ToolError::new("INVALID_ARGS", "old_string is empty"));
            }
            let count = current.matches(old).count();
            let updated = match (count, all) {
                (0, _) => {
                    return Err(ToolError::new(
                        "NO_MATCH",
                        "old_string does not occur in the file",
                    ));
                }
                (1, _) | (_, true) => current.replace(old, new),
                (n, false) => {
                    return Err(ToolError::new(
                        "AMBIGUOUS",
                        format!("old_string occurs {n} times; add context or set replace_all"),
                    ));
                }
            };
            place
                .write(&args.file_path, updated.clone().into_bytes())
                .await?;
            self.observed.record(&cx, &path, &updated);
            Ok(ToolOutput::text(format!(
                "Edited {} ({count} replacement{})",
                path.display(),
                if count == 1 { "" } else { "s" }
            )))
        }
        .boxed()
    }
}
