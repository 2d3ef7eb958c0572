//! Agent definitions: named agents kept as Markdown files, a YAML front
//! matter saying what the agent is (`name`, `description`, `model`,
//! `reasoning_effort`, `tools`, `permission_mode`, `max_turns`,
//! `max_steps`, `timeout`, `max_tokens`) and the body as its system prompt.
//!
//! Roots, the first holding a name wins: for each directory from the
//! working directory up to the project root (nearest first), its
//! `.dsh/agents` then its `.claude/agents`; then the user's
//! `~/.dsh/agents`. Files are the workspace's, so hostile: a symlink (file
//! or root) is not followed, only regular UTF-8 files of at most
//! [`MAX_FILE_BYTES`] load, and every refusal names the file and the field.
//! `.dsh/agents` files are parsed strictly (an unknown field is an error);
//! `.claude/agents` files are Claude Code's own: an unknown field is a
//! warning, their `hooks` never run, Claude's tool names map to ours and
//! `model: inherit` is the parent's model.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::sandbox::PermissionMode;

/// A definition file larger than this is refused.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;

/// Most definition files read from one root.
pub const MAX_FILES: usize = 256;

/// One agent definition.
#[derive(Clone, Debug, PartialEq)]
pub struct Definition {
    /// Its name (kebab-case), how it is asked for.
    pub name: String,
    /// When to use it, shown to the model.
    pub description: String,
    /// The model: a configured route or a model id (`None`: the parent's).
    pub model: Option<String>,
    /// The reasoning effort its requests ask for.
    pub reasoning_effort: Option<String>,
    /// Tools it may use: names or globs (`mcp__github__*`), intersected with
    /// its parent's (`None`: all of the parent's).
    pub tools: Option<Vec<String>>,
    /// Its permission mode, at most the parent's.
    pub permission_mode: Option<PermissionMode>,
    /// Most turns it may take.
    pub max_turns: Option<u32>,
    /// Most model calls (steps) in one turn.
    pub max_steps: Option<u32>,
    /// Its wall-time budget.
    pub timeout: Option<Duration>,
    /// Most tokens (input and output) it may spend in all.
    pub max_tokens: Option<u64>,
    /// Its system prompt: the file's body.
    pub prompt: String,
    /// The file it came from.
    pub path: PathBuf,
    /// Which kind of root: `dsh` or `claude` (Claude Code's format).
    pub dialect: Dialect,
    /// What was left out of a Claude Code file, one line each.
    pub warnings: Vec<String>,
}

impl Definition {
    /// A definition named `name` with nothing set but its `description`,
    /// its system `prompt`, and where it came from.
    pub fn new(
        name: &str,
        description: &str,
        prompt: &str,
        path: &Path,
        dialect: Dialect,
    ) -> Definition {
        Definition {
            name: name.to_owned(),
            description: description.to_owned(),
            model: None,
            reasoning_effort: None,
            tools: None,
            permission_mode: None,
            max_turns: None,
            max_steps: None,
            timeout: None,
            max_tokens: None,
            prompt: prompt.to_owned(),
            path: path.to_path_buf(),
            dialect,
            warnings: Vec::new(),
        }
    }
}

/// The format of a definition file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dialect {
    /// `.dsh/agents` and `~/.dsh/agents`: parsed strictly.
    Dsh,
    /// `.claude/agents`: Claude Code's subagent files.
    Claude,
}

impl Dialect {
    /// Its name in listings.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Dsh => "dsh",
            Dialect::Claude => "claude",
        }
    }
}

/// A definition file that could not be read, and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct DefinitionError {
    /// The file (or root).
    pub path: PathBuf,
    /// What was wrong, naming the field when one was.
    pub reason: String,
}

impl DefinitionError {
    fn new(path: &Path, reason: impl Into<String>) -> DefinitionError {
        DefinitionError {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

/// What was found for one working directory: the definitions by name, and
/// the files refused.
#[derive(Clone, Debug, Default)]
pub struct Definitions {
    /// By name; the first root holding a name wins.
    pub found: BTreeMap<String, Definition>,
    /// Files (or roots) refused, with why.
    pub errors: Vec<DefinitionError>,
    /// Files whose name an earlier root already held.
    pub hidden: Vec<PathBuf>,
}

impl Definitions {
    /// The definition named `name`.
    pub fn get(&self, name: &str) -> Option<&Definition> {
        self.found.get(name)
    }

    /// The definition named `name`, or a refusal that lists what was found
    /// and what was refused.
    pub fn require(&self, name: &str) -> Result<&Definition, NoSuchDefinition> {
        self.get(name).ok_or_else(|| NoSuchDefinition {
            name: name.to_owned(),
            found: if self.found.is_empty() {
                "none; see `dsh agents list`".to_owned()
            } else {
                self.found.keys().cloned().collect::<Vec<_>>().join(", ")
            },
            refused: self
                .errors
                .iter()
                .map(|e| format!("\n  refused: {e}"))
                .collect(),
        })
    }
}

/// A name no definition has.
#[derive(Clone, Debug, thiserror::Error)]
#[error("no agent definition named `{name}` (found: {found}){refused}")]
pub struct NoSuchDefinition {
    /// The name asked for.
    pub name: String,
    /// The names found.
    pub found: String,
    /// The files refused, one line each.
    pub refused: String,
}

/// The roots for an agent in `cwd`, in precedence order, with their
/// dialect.
pub fn roots(cwd: &Path, home: Option<&Path>) -> Vec<(Dialect, PathBuf)> {
    let cwd = cwd.canonicalize().unwrap_or_else(|_| cwd.to_path_buf());
    let project = crate::instructions::project_root(&cwd);
    let mut out = Vec::new();
    for dir in cwd.ancestors() {
        out.push((Dialect::Dsh, dir.join(".dsh/agents")));
        out.push((Dialect::Claude, dir.join(".claude/agents")));
        if dir == project {
            break;
        }
    }
    if let Some(home) = home {
        out.push((Dialect::Dsh, home.join("agents")));
    }
    out
}

/// Every definition under the roots for `cwd` (`home` is `~/.dsh`). Reads
/// files: call it off the async workers.
pub fn discover(cwd: &Path, home: Option<&Path>) -> Definitions {
    let mut all = Definitions::default();
    for (dialect, root) in roots(cwd, home) {
        let Ok(meta) = root.symlink_metadata() else {
            continue;
        };
        // `.dsh` (or `.claude`) itself a link is not followed either.
        let linked_parent = root
            .parent()
            .and_then(|p| p.symlink_metadata().ok())
            .is_some_and(|m| m.file_type().is_symlink());
        if meta.file_type().is_symlink() || linked_parent {
            all.errors.push(DefinitionError::new(
                &root,
                "the definitions directory is a symbolic link; not followed",
            ));
            continue;
        }
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        let mut files: Vec<PathBuf> = entries
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        files.sort();
        if files.len() > MAX_FILES {
            all.errors.push(DefinitionError::new(
                &root,
                format!(
                    "{} definition files; the first {MAX_FILES} are read",
                    files.len()
                ),
            ));
            files.truncate(MAX_FILES);
        }
        let mut here: BTreeMap<String, Definition> = BTreeMap::new();
        for file in files {
            match load(&file, dialect) {
                Ok(d) => {
                    if let Some(twin) = here.get(&d.name) {
                        all.errors.push(DefinitionError::new(
                            &file,
                            format!(
                                "`name`: `{}` is also defined by {}",
                                d.name,
                                twin.path.display()
                            ),
                        ));
                    } else {
                        here.insert(d.name.clone(), d);
                    }
                }
                Err(e) => all.errors.push(e),
            }
        }
        for (name, d) in here {
            match all.found.entry(name) {
                std::collections::btree_map::Entry::Occupied(_) => all.hidden.push(d.path),
                std::collections::btree_map::Entry::Vacant(slot) => {
                    slot.insert(d);
                }
            }
        }
    }
    all
}

/// Reads one definition file written in `dialect`.
pub fn load(path: &Path, dialect: Dialect) -> Result<Definition, DefinitionError> {
    let text = read_hostile(path)?;
    let (front, body) = split_front_matter(&text)
        .ok_or_else(|| DefinitionError::new(path, "no YAML front matter (a `---` block first)"))?;
    let raw: BTreeMap<String, serde_json::Value> = serde_saphyr::from_str(front)
        .map_err(|e| DefinitionError::new(path, format!("front matter: {e}")))?;
    let mut d = Definition::new("", "", body.trim(), path, dialect);
    let bad = |field: &str, what: &str| DefinitionError::new(path, format!("`{field}`: {what}"));
    for (field, value) in &raw {
        match field.as_str() {
            "name" => {
                let name = text_of(value).ok_or_else(|| bad("name", "must be text"))?;
                if !crate::skills::valid_name(name) {
                    return Err(bad(
                        "name",
                        &format!(
                            "`{name}` is not a name (kebab-case letters and digits, at most 64)"
                        ),
                    ));
                }
                d.name = name.to_owned();
            }
            "description" => {
                d.description = text_of(value)
                    .ok_or_else(|| bad("description", "must be text"))?
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ");
            }
            "model" => {
                let model = text_of(value).ok_or_else(|| bad("model", "must be text"))?;
                d.model =
                    model_of(model, dialect, &mut d.warnings).map_err(|why| bad("model", &why))?;
            }
            "reasoning_effort" => {
                let effort = text_of(value)
                    .filter(|e| ["minimal", "low", "medium", "high", "max"].contains(e))
                    .ok_or_else(|| {
                        bad("reasoning_effort", "one of minimal, low, medium, high, max")
                    })?;
                d.reasoning_effort = Some(effort.to_owned());
            }
            "tools" => {
                d.tools = Some(
                    tools_of(value, dialect, &mut d.warnings).map_err(|why| bad("tools", &why))?,
                )
            }
            "permission_mode" | "permissionMode" => {
                let mode = text_of(value).unwrap_or_default();
                match PermissionMode::ALL.into_iter().find(|m| m.as_str() == mode) {
                    Some(m) => d.permission_mode = Some(m),
                    // Claude Code's modes (default, acceptEdits, plan, …) are not ours.
                    None if dialect == Dialect::Claude => d.warnings.push(format!(
                        "`{field}: {mode}` is Claude Code's; the parent's mode applies"
                    )),
                    None => {
                        return Err(bad(
                            field,
                            "one of read-only, workspace-write, danger-full-access",
                        ));
                    }
                }
            }
            "max_turns" => {
                d.max_turns =
                    Some(count(value).ok_or_else(|| bad("max_turns", "a whole number from 1"))?)
            }
            "max_steps" => {
                d.max_steps =
                    Some(count(value).ok_or_else(|| bad("max_steps", "a whole number from 1"))?)
            }
            "max_tokens" => {
                d.max_tokens = Some(
                    value
                        .as_u64()
                        .filter(|n| *n > 0)
                        .ok_or_else(|| bad("max_tokens", "a whole number from 1"))?,
                )
            }
            "timeout" => {
                d.timeout = Some(duration_of(value).ok_or_else(|| {
                    bad(
                        "timeout",
                        "seconds (a number) or a duration such as `90s`, `5m`, `1h`",
                    )
                })?)
            }
            "hooks" if dialect == Dialect::Claude => d
                .warnings
                .push("`hooks` are Claude Code's; they never run here".to_owned()),
            "color" if dialect == Dialect::Claude => {}
            other if dialect == Dialect::Claude => {
                d.warnings.push(format!("`{other}` is not read here"));
            }
            other => {
                return Err(DefinitionError::new(
                    path,
                    format!(
                        "unknown field `{other}` (expected name, description, model, reasoning_effort, tools, permission_mode, max_turns, max_steps, timeout, max_tokens)"
                    ),
                ));
            }
        }
    }
    if d.name.is_empty() {
        return Err(bad("name", "missing"));
    }
    if d.description.is_empty() {
        return Err(bad("description", "missing: say when to use this agent"));
    }
    if d.prompt.is_empty() {
        return Err(DefinitionError::new(
            path,
            "the body (the agent's system prompt) is empty",
        ));
    }
    Ok(d)
}

/// The text of `path`: a regular UTF-8 file of at most [`MAX_FILE_BYTES`],
/// reached without following a symlink at its last component.
fn read_hostile(path: &Path) -> Result<String, DefinitionError> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| {
            let why = if e.raw_os_error() == Some(nix::libc::ELOOP) {
                "a symbolic link; not followed".to_owned()
            } else {
                format!("cannot open: {e}")
            };
            DefinitionError::new(path, why)
        })?;
    let meta = file
        .metadata()
        .map_err(|e| DefinitionError::new(path, format!("cannot read: {e}")))?;
    if !meta.is_file() {
        return Err(DefinitionError::new(path, "not a regular file"));
    }
    if meta.len() > MAX_FILE_BYTES {
        return Err(DefinitionError::new(
            path,
            format!(
                "{} bytes; a definition is at most {MAX_FILE_BYTES}",
                meta.len()
            ),
        ));
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| DefinitionError::new(path, format!("cannot read: {e}")))?;
    String::from_utf8(bytes).map_err(|e| {
        DefinitionError::new(
            path,
            format!("not UTF-8 (byte {})", e.utf8_error().valid_up_to()),
        )
    })
}

/// `(front matter, body)` of a file that starts with a `---` block.
fn split_front_matter(text: &str) -> Option<(&str, &str)> {
    let rest = text
        .strip_prefix("---\n")
        .or_else(|| text.strip_prefix("---\r\n"))?;
    let end = if rest.starts_with("---") {
        0
    } else {
        rest.find("\n---")? + 1
    };
    let after = &rest[end + 3..];
    let body = after.split_once('\n').map_or("", |(_, b)| b);
    Some((&rest[..end], body))
}

fn text_of(value: &serde_json::Value) -> Option<&str> {
    value.as_str().map(str::trim).filter(|s| !s.is_empty())
}

fn count(value: &serde_json::Value) -> Option<u32> {
    value
        .as_u64()
        .filter(|n| *n > 0)
        .and_then(|n| u32::try_from(n).ok())
}

/// Seconds (`90`, `1.5`) or `90s`, `5m`, `1h`.
fn duration_of(value: &serde_json::Value) -> Option<Duration> {
    let secs = match value {
        serde_json::Value::Number(n) => n.as_f64()?,
        serde_json::Value::String(s) => {
            let s = s.trim();
            let (digits, unit) = s.split_at(s.find(|c: char| c.is_ascii_alphabetic())?);
            let n: f64 = digits.trim().parse().ok()?;
            n * match unit {
                "s" => 1.0,
                "m" | "min" => 60.0,
                "h" => 3600.0,
                _ => return None,
            }
        }
        _ => return None,
    };
    (secs.is_finite() && secs > 0.0 && secs <= 7.0 * 86_400.0)
        .then(|| Duration::from_secs_f64(secs))
}

/// A `model` value: a route or a model id, never a URL or a key variable;
/// Claude Code's `inherit` (and its own model names) mean the parent's.
fn model_of(
    model: &str,
    dialect: Dialect,
    warnings: &mut Vec<String>,
) -> Result<Option<String>, String> {
    if model == "inherit" {
        return Ok(None);
    }
    if model.contains("://") || model.starts_with('$') || model.contains("${") {
        return Err(format!(
            "`{model}` is not a route or a model id (a URL or a variable cannot be named here; configure the endpoint as a route)"
        ));
    }
    if model.len() > 128
        || !model
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.:/@".contains(c))
    {
        return Err(format!("`{model}` is not a route or a model id"));
    }
    if dialect == Dialect::Claude && ["sonnet", "opus", "haiku"].contains(&model) {
        warnings.push(format!(
            "`model: {model}` is Claude Code's; the parent's model applies"
        ));
        return Ok(None);
    }
    Ok(Some(model.to_owned()))
}

/// Claude Code's tool names, as ours (`None`: no tool of ours does it).
fn claude_tool(name: &str) -> Option<&'static str> {
    Some(match name {
        "Read" => "read",
        "Write" => "write",
        "Edit" | "MultiEdit" => "edit",
        "Bash" => "bash",
        "Glob" | "LS" => "glob",
        "Grep" => "grep",
        "WebFetch" => "web_fetch",
        "TodoWrite" => "todo_write",
        "Task" | "Agent" => "subagent",
        _ => return None,
    })
}

/// A `tools` value: a list, or (Claude Code's) one comma-separated text.
fn tools_of(
    value: &serde_json::Value,
    dialect: Dialect,
    warnings: &mut Vec<String>,
) -> Result<Vec<String>, String> {
    let names: Vec<String> = match value {
        serde_json::Value::Array(items) => items
            .iter()
            .map(|i| text_of(i).map(str::to_owned).ok_or("each tool is a name"))
            .collect::<Result<_, _>>()?,
        serde_json::Value::String(s) if dialect == Dialect::Claude => s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect(),
        _ => return Err("a list of tool names or globs".into()),
    };
    let mut out = Vec::with_capacity(names.len());
    if names.len() > 256 {
        return Err(format!("{} tools; at most 256", names.len()));
    }
    for name in names {
        if name.len() > 128
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "_-*".contains(c))
        {
            return Err(format!(
                "`{}` is not a tool name or glob (letters, digits, `_`, `-`, `*`; at most 128)",
                name.chars().take(128).collect::<String>()
            ));
        }
        let ours = match dialect {
            Dialect::Claude if name.starts_with(|c: char| c.is_ascii_uppercase()) => {
                match claude_tool(&name) {
                    Some(t) => t.to_owned(),
                    None => {
                        warnings.push(format!("tool `{name}` has no match here; left out"));
                        continue;
                    }
                }
            }
            _ => name,
        };
        if !out.contains(&ours) {
            out.push(ours);
        }
    }
    Ok(out)
}

/// The prompt section naming the definitions found (each name with its
/// description, made inert), or `None` when there are none.
pub fn section(definitions: &Definitions) -> Option<crate::prompt::RenderedSection> {
    if definitions.found.is_empty() {
        return None;
    }
    let lines: String = definitions
        .found
        .values()
        .map(|d| {
            let said: String = d
                .description
                .chars()
                .filter(|c| !c.is_control())
                .take(crate::skills::DESCRIPTION_MAX)
                .collect();
            format!(
                "\n- `{}`: {}",
                d.name,
                said.replace('<', "&lt;").replace('>', "&gt;")
            )
        })
        .collect();
    Some((
        SECTION.to_owned(),
        ORDER,
        format!(
            "# Named agents\nThese agents are defined for this project. To hand a task to one, call `subagent` with `agent` set to its name (in a workflow script, `agent(prompt, {{agent: NAME}})`): it runs with its own instructions, model and tools.\n\n<available_agents>{lines}\n</available_agents>"
        ),
    ))
}

/// The named agents section's name.
pub const SECTION: &str = "agent-definitions";
/// Its order (after the skills catalog).
pub const ORDER: i32 = 320;

/// Whether tool `name` is one of `patterns` (names, `*` matching any run).
pub fn tool_matches(patterns: &[String], name: &str) -> bool {
    patterns.iter().any(|p| glob(p.as_bytes(), name.as_bytes()))
}

/// `*` matches any run: the linear two-pointer match (a hostile pattern of
/// many stars costs its length times the name's, not an exponent).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == b'*' {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && pattern[p] == text[t] {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|c| *c == b'*')
}
