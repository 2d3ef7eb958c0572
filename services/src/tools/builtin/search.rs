//! `glob` and `grep` over the workspace (walked off the async workers).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;

use super::workspace::confine;
use crate::llm::ToolSchema;
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};

const GLOB_CAP: usize = 100;
const GREP_CAP: usize = 250;
/// Files visited at most per search (a bound on work, reported when hit).
const WALK_CAP: usize = 200_000;

/// Every file under `root` (VCS metadata skipped), with its mtime.
fn walk(root: &Path) -> (Vec<(PathBuf, SystemTime)>, bool) {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    let mut truncated = false;
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if kind.is_dir() {
                let name = entry.file_name();
                if matches!(name.to_str(), Some(".git" | ".hg" | ".svn")) {
                    continue;
                }
                stack.push(path);
            } else if kind.is_file() {
                let mtime = entry
                    .metadata()
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::UNIX_EPOCH);
                out.push((path, mtime));
                if out.len() >= WALK_CAP {
                    truncated = true;
                    return (out, truncated);
                }
            }
        }
    }
    (out, truncated)
}

fn matcher(pattern: &str) -> Result<globset::GlobMatcher, ToolError> {
    // A pattern without a separator matches the file name at any depth.
    let full = if pattern.contains('/') {
        pattern.to_owned()
    } else {
        format!("**/{pattern}")
    };
    globset::GlobBuilder::new(&full)
        .literal_separator(true)
        .build()
        .map(|g| g.compile_matcher())
        .map_err(|e| {
            ToolError::new(
                "INVALID_ARGS",
                format!("bad glob `{pattern}`: {}", chain(&e)),
            )
        })
}

fn search_root(cx: &ToolContext, path: Option<&str>) -> Result<PathBuf, ToolError> {
    match path {
        Some(p) if !p.is_empty() => confine(&cx.cwd, p),
        _ => confine(&cx.cwd, "."),
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ToolError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ToolError::failed(format!("the search task failed: {}", chain(&e))))
}

/// `glob`: files matching a pattern, newest first.
pub struct Glob;

/// What a `glob` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct GlobArgs {
    /// Glob pattern.
    pattern: String,
    /// Directory to search; defaults to the workspace.
    #[serde(default)]
    path: Option<String>,
}

impl Tool for Glob {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "glob".into(),
            description: "Find files by path with a glob pattern such as \"**/*.rs\" or \"src/**/mod.rs\"; a pattern without \"/\" matches file names at any depth. Searches the workspace, or `path` under it; skips version-control metadata. Returns up to 100 paths relative to the search root, most recently modified first, and says when there were more.".into(),
            parameters: parameters::<GlobArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Find files by name with `glob` and text in them with `grep`; prefer both to `find`, `ls -R` or `grep -r` in `bash`: they skip version-control metadata and cap their output.",
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
            let GlobArgs { pattern, path } = cx.parse()?;
            let m = matcher(&pattern)?;
            let root = search_root(&cx, path.as_deref())?;
            let (found, truncated) = blocking(move || {
                let (files, truncated) = walk(&root);
                let mut hits: Vec<(PathBuf, SystemTime)> = files
                    .into_iter()
                    .filter(|(p, _)| p.strip_prefix(&root).is_ok_and(|rel| m.is_match(rel)))
                    .map(|(p, t)| (p.strip_prefix(&root).map(Path::to_path_buf).unwrap_or(p), t))
                    .collect();
                hits.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
                (hits, truncated)
            })
            .await?;
            if found.is_empty() {
                return Ok(ToolOutput::text(format!("No files match `{pattern}`.")));
            }
            let total = found.len();
            let mut text: String = found
                .iter()
                .take(GLOB_CAP)
                .map(|(p, _)| format!("{}\n", p.display()))
                .collect();
            if total > GLOB_CAP {
                text.push_str(&format!(
                    "({total} files match; showing the newest {GLOB_CAP})\n"
                ));
            }
            if truncated {
                text.push_str(&format!("(the search stopped after {WALK_CAP} files)\n"));
            }
            Ok(ToolOutput::text(text))
        }
        .boxed()
    }
}

/// `grep`: lines matching a regular expression.
pub struct Grep;

/// What a `grep` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct GrepArgs {
    /// Regular expression.
    pattern: String,
    /// File or directory to search; defaults to the workspace.
    #[serde(default)]
    path: Option<String>,
    /// One glob filter for file names (e.g. "*.rs").
    #[serde(default)]
    include: Option<String>,
}

impl Tool for Grep {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "grep".into(),
            description: "Search file contents with a regular expression (Rust regex syntax). Searches the workspace, or the file or directory `path`; `include` keeps only file names matching one glob such as \"*.rs\". Returns matching lines as `path:line: text`, grouped by file, at most 250 matches; binary files are skipped.".into(),
            parameters: parameters::<GrepArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Use `grep` to find where something is defined or used before reading whole files, then `read` just the lines around a match.",
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
            let args: GrepArgs = cx.parse()?;
            let pattern = args.pattern;
            let re = regex::Regex::new(&pattern).map_err(|e| {
                ToolError::new(
                    "INVALID_ARGS",
                    format!("bad regular expression: {}", chain(&e)),
                )
            })?;
            let include = match args.include.as_deref() {
                Some(i) if !i.is_empty() => Some(matcher(i)?),
                _ => None,
            };
            let root = search_root(&cx, args.path.as_deref())?;
            let cancel = cx.cancel.clone();
            let (text, count) = blocking(move || {
                let files = if root.is_file() {
                    vec![(root.clone(), SystemTime::UNIX_EPOCH)]
                } else {
                    walk(&root).0
                };
                let base = if root.is_file() {
                    root.parent().map(Path::to_path_buf).unwrap_or_default()
                } else {
                    root.clone()
                };
                let mut out = String::new();
                let mut count = 0usize;
                let mut sorted: Vec<PathBuf> = files.into_iter().map(|(p, _)| p).collect();
                sorted.sort();
                for path in sorted {
                    if cancel.is_cancelled() || count >= GREP_CAP {
                        break;
                    }
                    let rel = path
                        .strip_prefix(&base)
                        .map(Path::to_path_buf)
                        .unwrap_or(path.clone());
                    if include.as_ref().is_some_and(|m| !m.is_match(&rel)) {
                        continue;
                    }
                    let Ok(bytes) = std::fs::read(&path) else {
                        continue;
                    };
                    if bytes.contains(&0) {
                        continue;
                    }
                    let Ok(text) = String::from_utf8(bytes) else {
                        continue;
                    };
                    let mut header = false;
                    for (n, line) in text.lines().enumerate() {
                        if re.is_match(line) {
                            if !header {
                                out.push_str(&format!("{}:\n", rel.display()));
                                header = true;
                            }
                            out.push_str(&format!("  {}: {line}\n", n + 1));
                            count += 1;
                            if count >= GREP_CAP {
                                break;
                            }
                        }
                    }
                }
                (out, count)
            })
            .await?;
            if count == 0 {
                return Ok(ToolOutput::text(format!("No lines match `{pattern}`.")));
            }
            let mut text = text;
            if count >= GREP_CAP {
                text.push_str(&format!("(stopped at {GREP_CAP} matches)\n"));
            }
            Ok(ToolOutput::text(text))
        }
        .boxed()
    }
}
