//! Hooks from the settings users already have: Claude Code's (`hooks` in
//! `.claude/settings.json`, `~/.claude/settings.json`, or a `hooks.json`)
//! and Codex's (`.codex/hooks.json`, `~/.codex/hooks.json`).
//!
//! - here: the two dialects' shared protocol — the file shape (event →
//!   matcher groups → command hooks), matchers, the exit-code and JSON
//!   output a hook answers with, and how the answers of several hooks fold
//!   into one (deny > ask > allow; blocks and context accumulate).
//! - `run`: one hook as a child process under the calling agent's sandbox
//!   and policy, its JSON payload on stdin, bounded in time and output,
//!   killed when the turn or the call it serves is cancelled.
//! - `bridge`: the points it runs at — `UserPromptSubmit` on
//!   `agent/pre-step`, `PreToolUse` on `tools/pre-execute`, `PostToolUse`
//!   on `tools/post-execute`, `Stop` on `agent/turn-stopping` — with each
//!   dialect's payload, and the `hook/invoked` / `hook/result` records.
//!
//! A file that cannot be read or parsed (an invalid matcher included)
//! contributes no hooks and is reported; it never fails a turn.

mod bridge;
mod run;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use dsh_supervisors::error::chain;
use serde_json::Value;

pub use bridge::{Hooks, HooksSettings, install};

/// Which tool's settings a file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Dialect {
    /// Claude Code: literal-or-regex matchers, full tool input, `ask`.
    Claude,
    /// Codex: regex matchers, `tool_input: {command}`, block only.
    Codex,
}

impl Dialect {
    /// `claude` or `codex`, as `hook/invoked` records it.
    pub fn as_str(self) -> &'static str {
        match self {
            Dialect::Claude => "claude",
            Dialect::Codex => "codex",
        }
    }

    /// What the dialect calls one of our tools, where the names differ:
    /// Claude Code's `Bash`, `Read`, `Write`, `Edit`, … (their arguments
    /// have the same names). Codex's hooks see our names.
    pub fn tool_name(self, ours: &str) -> Option<&'static str> {
        if self != Dialect::Claude {
            return None;
        }
        Some(match ours {
            "bash" => "Bash",
            "read" => "Read",
            "write" => "Write",
            "edit" => "Edit",
            "glob" => "Glob",
            "grep" => "Grep",
            "web_fetch" => "WebFetch",
            "todo_write" => "TodoWrite",
            "subagent" => "Task",
            _ => return None,
        })
    }

    /// The source name of the context its hooks add.
    pub fn plugin(self) -> &'static str {
        match self {
            Dialect::Claude => "hooks-claude-code",
            Dialect::Codex => "hooks-codex",
        }
    }
}

/// The points hooks run at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Point {
    /// A user's prompt, before it enters a step.
    UserPromptSubmit,
    /// A tool call, before it runs.
    PreToolUse,
    /// A tool call, after it ran.
    PostToolUse,
    /// The answer that would end the turn.
    Stop,
}

impl Point {
    const ALL: [Point; 4] = [
        Point::UserPromptSubmit,
        Point::PreToolUse,
        Point::PostToolUse,
        Point::Stop,
    ];

    /// The event name in settings files and payloads.
    pub fn as_str(self) -> &'static str {
        match self {
            Point::UserPromptSubmit => "UserPromptSubmit",
            Point::PreToolUse => "PreToolUse",
            Point::PostToolUse => "PostToolUse",
            Point::Stop => "Stop",
        }
    }

    /// Whether the point has a matcher subject (the tool name).
    fn matches_tools(self) -> bool {
        matches!(self, Point::PreToolUse | Point::PostToolUse)
    }

    /// What the model is told when a hook blocks without a reason.
    pub fn fallback(self) -> &'static str {
        match self {
            Point::UserPromptSubmit => "blocked by UserPromptSubmit hook",
            Point::PreToolUse => "blocked by PreToolUse hook",
            Point::PostToolUse => "blocked by PostToolUse hook",
            Point::Stop => "continue: blocked by Stop hook",
        }
    }
}

/// Which subjects a group applies to.
#[derive(Clone, Debug)]
pub enum Matcher {
    /// Every subject (no matcher, `""` or `*`).
    Any,
    /// Exactly one of these names (Claude Code's `Edit|Write` form).
    Literal(Vec<String>),
    /// A regular expression found anywhere in the subject.
    Regex(regex::Regex),
}

impl Matcher {
    /// The matcher `pattern` is in `dialect`, or why it is invalid.
    pub fn parse(pattern: Option<&str>, dialect: Dialect) -> Result<Matcher, regex::Error> {
        let Some(p) = pattern.filter(|p| !p.is_empty() && *p != "*") else {
            return Ok(Matcher::Any);
        };
        let literal = p
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'|');
        if dialect == Dialect::Claude && literal {
            return Ok(Matcher::Literal(p.split('|').map(str::to_owned).collect()));
        }
        regex::Regex::new(p).map(Matcher::Regex)
    }

    /// Whether `subject` (or, for Claude Code, its name for the tool) is
    /// selected.
    pub fn admits_tool(&self, dialect: Dialect, tool: &str) -> bool {
        self.admits(tool)
            || dialect
                .tool_name(tool)
                .is_some_and(|alias| self.admits(alias))
    }

    /// Whether `subject` is selected.
    pub fn admits(&self, subject: &str) -> bool {
        match self {
            Matcher::Any => true,
            Matcher::Literal(names) => names.iter().any(|n| n == subject),
            Matcher::Regex(r) => r.is_match(subject),
        }
    }
}

/// The longest timeout a hook may name.
const MAX_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// One command hook.
#[derive(Clone, Debug)]
pub struct Command {
    /// The shell command.
    pub command: String,
    /// Its own timeout (else the settings' default).
    pub timeout: Option<Duration>,
    /// A stable id (`file#Point[group][hook]`) pairing its records.
    pub id: String,
}

/// Command hooks behind one matcher.
#[derive(Clone, Debug)]
pub struct Group {
    /// The pattern as written (`None`: match-all).
    pub pattern: Option<String>,
    /// The parsed matcher.
    pub matcher: Matcher,
    /// Its command hooks, in order.
    pub commands: Vec<Command>,
}

/// A settings file that configures no hooks because it is malformed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct HookFileError {
    /// The file.
    pub file: PathBuf,
    /// What is wrong and where (the file, then the JSON path).
    pub message: String,
}

/// The hooks of one settings file.
#[derive(Clone, Debug)]
pub struct HookSet {
    /// Its dialect.
    pub dialect: Dialect,
    /// The file.
    pub source: PathBuf,
    /// Groups per point, in file order.
    pub points: BTreeMap<Point, Vec<Group>>,
    /// What was read but not run (other events, other hook types).
    pub skipped: Vec<String>,
    /// The project a project file (`PROJECT/.claude/…`, `PROJECT/.codex/…`)
    /// belongs to: `$CLAUDE_PROJECT_DIR` for its hooks (else the agent's
    /// working directory).
    pub project: Option<PathBuf>,
}

impl HookSet {
    /// The hooks `text` (the content of `source`) configures in `dialect`.
    /// A file without a `hooks` key configures none; anything malformed
    /// (an invalid matcher included) fails the whole file, said with the
    /// place it is at.
    pub fn parse(dialect: Dialect, source: &Path, text: &str) -> Result<HookSet, HookFileError> {
        HookSet::read(dialect, source, text).map_err(|message| HookFileError {
            file: source.to_owned(),
            message,
        })
    }

    fn read(dialect: Dialect, source: &Path, text: &str) -> Result<HookSet, String> {
        let at = source.display();
        let root: Value =
            serde_json::from_str(text).map_err(|e| format!("{at}: not JSON: {}", chain(&e)))?;
        let project = source
            .parent()
            .filter(|dir| {
                matches!(
                    dir.file_name().and_then(|n| n.to_str()),
                    Some(".claude" | ".codex")
                )
            })
            .and_then(Path::parent)
            .and_then(|p| p.canonicalize().ok());
        let mut set = HookSet {
            dialect,
            source: source.to_owned(),
            points: BTreeMap::new(),
            skipped: Vec::new(),
            project,
        };
        let Some(hooks) = root.get("hooks") else {
            return Ok(set);
        };
        let hooks = hooks
            .as_object()
            .ok_or_else(|| format!("{at}: `hooks` must be an object of events"))?;
        for (event, groups) in hooks {
            let Some(point) = Point::ALL.into_iter().find(|p| p.as_str() == event) else {
                set.skipped
                    .push(format!("event {event} (not supported here)"));
                continue;
            };
            let groups = groups
                .as_array()
                .ok_or_else(|| format!("{at}: hooks.{event} must be a list of matcher groups"))?;
            let mut parsed = Vec::new();
            for (g, group) in groups.iter().enumerate() {
                let place = format!("{at}: hooks.{event}[{g}]");
                parsed.push(set.group(point, &place, group)?);
            }
            set.points.insert(point, parsed);
        }
        Ok(set)
    }

    fn group(&mut self, point: Point, place: &str, group: &Value) -> Result<Group, String> {
        let pattern = match group.get("matcher") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(other) => return Err(format!("{place}.matcher must be a string, not {other}")),
        };
        // Points without a subject ignore their matcher, as the tools do.
        let pattern = pattern.filter(|_| point.matches_tools());
        let matcher = Matcher::parse(pattern.as_deref(), self.dialect).map_err(|why| {
            // The regex error draws a caret over lines; its last line says what.
            let why = why.to_string();
            let what = why
                .lines()
                .last()
                .unwrap_or_default()
                .trim_start_matches("error: ");
            let p = pattern.clone().unwrap_or_default();
            format!("{place}.matcher {p:?} is not a valid regular expression: {what}")
        })?;
        let hooks = group
            .get("hooks")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("{place}.hooks must be a list of hooks"))?;
        let mut commands = Vec::new();
        for (h, hook) in hooks.iter().enumerate() {
            let here = format!("{place}.hooks[{h}]");
            let kind = hook
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("command");
            if kind != "command" {
                self.skipped
                    .push(format!("{here}: type {kind} (only command hooks run)"));
                continue;
            }
            if hook.get("async").and_then(Value::as_bool) == Some(true) {
                self.skipped
                    .push(format!("{here}: async (only synchronous hooks run)"));
                continue;
            }
            let command = hook
                .get("command")
                .and_then(Value::as_str)
                .filter(|c| !c.trim().is_empty())
                .ok_or_else(|| format!("{here}.command must be a non-empty string"))?;
            let timeout = match hook.get("timeout").or_else(|| hook.get("timeoutSec")) {
                None | Some(Value::Null) => None,
                Some(v) => match v.as_f64().and_then(|s| Duration::try_from_secs_f64(s).ok()) {
                    Some(d) if !d.is_zero() && d <= MAX_TIMEOUT => Some(d),
                    _ => {
                        return Err(format!(
                            "{here}.timeout must be a positive number of seconds, at most a day"
                        ));
                    }
                },
            };
            commands.push(Command {
                command: command.to_owned(),
                timeout,
                id: format!("{}#{here}", self.dialect.as_str()),
            });
        }
        Ok(Group {
            pattern,
            matcher,
            commands,
        })
    }
}

/// Where each dialect's settings are looked for by default: the project's
/// (relative to the working directory) and the user's (`~`).
pub fn default_paths(dialect: Dialect) -> Vec<PathBuf> {
    let list: &[&str] = match dialect {
        Dialect::Claude => &[
            ".claude/settings.json",
            ".claude/settings.local.json",
            "~/.claude/settings.json",
        ],
        Dialect::Codex => &[".codex/hooks.json", "~/.codex/hooks.json"],
    };
    list.iter().map(PathBuf::from).collect()
}

/// `path` with a leading `~/` read as the home directory.
fn expand(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_owned(),
    }
}

/// Loads the hook files of each dialect, in order. A missing file adds
/// nothing; one that cannot be read or parsed adds nothing and is named in
/// the problems returned (with what was wrong and where).
pub async fn load(files: &[(Dialect, PathBuf)]) -> (Vec<HookSet>, Vec<String>) {
    let mut sets = Vec::new();
    let mut problems = Vec::new();
    for (dialect, path) in files {
        let path = expand(path);
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                problems.push(format!("{}: cannot read it: {e}", path.display()));
                continue;
            }
        };
        match HookSet::parse(*dialect, &path, &text) {
            Ok(set) if set.points.is_empty() => {}
            Ok(set) => sets.push(set),
            Err(e) => problems.push(chain(&e).to_string()),
        }
    }
    (sets, problems)
}

/// A permission answer, least to most restrictive.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Permission {
    /// Go ahead (not a pre-approval: the policy still applies).
    Allow,
    /// Ask the approval seam, saying why.
    Ask(String),
    /// Refuse, saying why.
    Deny(String),
}

/// What one hook process did.
#[derive(Clone, Debug, Default)]
pub struct Ran {
    /// Its exit status (`None`: it did not exit by itself).
    pub exit: Option<i32>,
    /// Its stdout (bounded).
    pub stdout: String,
    /// Its stderr (bounded).
    pub stderr: String,
    /// Why it did not run to an exit (could not start, timed out,
    /// cancelled).
    pub failure: Option<String>,
    /// How long it ran.
    pub duration: Duration,
}

/// What the hooks of one point said, folded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The most restrictive permission answer.
    pub permission: Option<Permission>,
    /// Block reasons (exit 2, `decision: block`), joined.
    pub block: Option<String>,
    /// Context to add, with the dialect that added it.
    pub context: Vec<(Dialect, String)>,
    /// `continue: false` (its `stopReason`).
    pub halt: Option<String>,
}

impl Outcome {
    /// `deny`, `ask`, `allow`, `block`, `stop` or `pass`, as `hook/result`
    /// records it.
    pub fn decision(&self) -> &'static str {
        match (&self.halt, &self.permission, &self.block) {
            (Some(_), _, _) => "stop",
            (_, Some(Permission::Deny(_)), _) => "deny",
            (_, _, Some(_)) => "block",
            (_, Some(Permission::Ask(_)), _) => "ask",
            (_, Some(Permission::Allow), _) => "allow",
            _ => "pass",
        }
    }

    /// Folds `other` into `self`: the stricter permission, blocks joined
    /// with a blank line, context in order, the first halt.
    pub fn merge(&mut self, other: Outcome) {
        if other.permission > self.permission {
            self.permission = other.permission;
        }
        self.block = match (self.block.take(), other.block) {
            (Some(a), Some(b)) if !a.is_empty() && !b.is_empty() => Some(format!("{a}\n\n{b}")),
            (Some(a), Some(b)) => Some(if a.is_empty() { b } else { a }),
            (a, b) => a.or(b),
        };
        self.context.extend(other.context);
        if self.halt.is_none() {
            self.halt = other.halt;
        }
    }

    /// The reason a point is refused for, if it is: a halt, a denial or a
    /// block, the first non-empty of them, else the point's fallback.
    pub fn refusal(&self, point: Point) -> Option<String> {
        let denied = match &self.permission {
            Some(Permission::Deny(r)) => Some(r.clone()),
            _ => None,
        };
        let said = [self.halt.clone(), denied, self.block.clone()];
        if said.iter().all(Option::is_none) {
            return None;
        }
        let reason = said.into_iter().flatten().find(|r| !r.trim().is_empty());
        Some(reason.unwrap_or_else(|| point.fallback().to_owned()))
    }
}

/// Reads what a hook of `dialect` at `point` answered. Exit 2 blocks with
/// its stderr; exit 0 may carry JSON (`continue`, `stopReason`, `decision`,
/// `reason`, and `hookSpecificOutput` for this very point:
/// `permissionDecision` and its reason, `additionalContext`) or, for a
/// prompt, plain context; any other end is a non-blocking error.
pub fn decode(point: Point, dialect: Dialect, ran: &Ran) -> Outcome {
    let mut out = Outcome::default();
    match ran.exit {
        Some(2) => {
            let reason = ran.stderr.trim().to_owned();
            if point == Point::PreToolUse {
                out.permission = Some(Permission::Deny(reason));
            } else {
                out.block = Some(reason);
            }
            return out;
        }
        Some(0) => {}
        _ => return out,
    }
    let said = ran.stdout.trim();
    let json = said
        .starts_with('{')
        .then(|| serde_json::from_str::<serde_json::Map<String, Value>>(said).ok())
        .flatten();
    let Some(json) = json else {
        if point == Point::UserPromptSubmit && !said.is_empty() {
            out.context.push((dialect, said.to_owned()));
        }
        return out;
    };
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or("").to_owned();
    if json.get("continue").and_then(Value::as_bool) == Some(false) {
        out.halt = Some(text(json.get("stopReason")));
    }
    let reason = text(json.get("reason"));
    match json.get("decision").and_then(Value::as_str) {
        Some("block") if point == Point::PreToolUse => {
            out.permission = Some(Permission::Deny(reason.clone()));
        }
        Some("block") => out.block = Some(reason.clone()),
        Some("approve") if point == Point::PreToolUse && dialect == Dialect::Claude => {
            out.permission = Some(Permission::Allow);
        }
        _ => {}
    }
    let specific = json
        .get("hookSpecificOutput")
        .and_then(Value::as_object)
        .filter(|s| s.get("hookEventName").and_then(Value::as_str) == Some(point.as_str()));
    if let Some(s) = specific {
        let why = text(s.get("permissionDecisionReason"));
        let permission = match s.get("permissionDecision").and_then(Value::as_str) {
            Some("deny") => Some(Permission::Deny(why)),
            Some("ask") if dialect == Dialect::Claude => Some(Permission::Ask(why)),
            Some("allow") if dialect == Dialect::Claude => Some(Permission::Allow),
            _ => None,
        };
        // The point's own answer overrides the legacy top-level one.
        if point == Point::PreToolUse && permission.is_some() {
            out.permission = permission;
        }
        let context = text(s.get("additionalContext"));
        if !context.trim().is_empty()
            && matches!(point, Point::UserPromptSubmit | Point::PostToolUse)
        {
            out.context.push((dialect, context));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ran(exit: i32, stdout: &str, stderr: &str) -> Ran {
        Ran {
            exit: Some(exit),
            stdout: stdout.into(),
            stderr: stderr.into(),
            ..Ran::default()
        }
    }

    #[test]
    fn matchers_follow_each_dialect() {
        let m = Matcher::parse(Some("Edit|Write"), Dialect::Claude).unwrap();
        assert!(m.admits("Edit") && m.admits("Write") && !m.admits("EditX"));
        let m = Matcher::parse(Some("mcp__.*"), Dialect::Claude).unwrap();
        assert!(m.admits("mcp__fs__read"));
        // Claude Code's own tool names select ours.
        let m = Matcher::parse(Some("Bash|Edit"), Dialect::Claude).unwrap();
        assert!(m.admits_tool(Dialect::Claude, "bash") && m.admits_tool(Dialect::Claude, "edit"));
        assert!(!m.admits_tool(Dialect::Codex, "bash") && !m.admits_tool(Dialect::Claude, "read"));
        // Codex reads every matcher as a regex: `bash` is found in `xbash`.
        let m = Matcher::parse(Some("bash"), Dialect::Codex).unwrap();
        assert!(m.admits("xbash"));
        for any in [None, Some(""), Some("*")] {
            assert!(
                Matcher::parse(any, Dialect::Codex)
                    .unwrap()
                    .admits("anything")
            );
        }
        assert!(Matcher::parse(Some("(unclosed"), Dialect::Claude).is_err());
    }

    #[test]
    fn a_file_with_an_invalid_matcher_is_refused_with_its_place() {
        let text = r#"{"hooks": {"PreToolUse": [{"matcher": "ba(sh", "hooks": [{"type": "command", "command": "true"}]}]}}"#;
        let e = HookSet::parse(Dialect::Claude, Path::new("s.json"), text)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("s.json: hooks.PreToolUse[0].matcher \"ba(sh\""),
            "{e}"
        );
        // A prompt point ignores its matcher, as the tools do.
        let text = r#"{"hooks": {"Stop": [{"matcher": "ba(sh", "hooks": [{"command": "true"}]}],
            "Notification": [], "PostToolUse": [{"hooks": [{"type": "http", "url": "x"}]}]}}"#;
        let set = HookSet::parse(Dialect::Claude, Path::new("s.json"), text).unwrap();
        assert_eq!(set.points[&Point::Stop][0].commands.len(), 1);
        assert_eq!(set.skipped.len(), 2, "{:?}", set.skipped);
        assert!(
            HookSet::parse(Dialect::Codex, Path::new("h"), "{}")
                .unwrap()
                .points
                .is_empty()
        );
        let huge = r#"{"hooks": {"Stop": [{"hooks": [{"command": "x", "timeout": 1e300}]}]}}"#;
        let e = HookSet::parse(Dialect::Codex, Path::new("h"), huge).unwrap_err();
        assert!(e.message.contains("at most a day"), "{}", chain(&e));
        let bad = r#"{"hooks": {"Stop": [{"hooks": [{"command": "x", "timeout": -1}]}]}}"#;
        let e = HookSet::parse(Dialect::Codex, Path::new("h"), bad).unwrap_err();
        assert!(e.message.contains("timeout"), "{}", chain(&e));
    }

    #[test]
    fn outputs_decode_to_decisions() {
        let pre = Point::PreToolUse;
        let deny = decode(pre, Dialect::Claude, &ran(2, "", "no rm\n"));
        assert_eq!(deny.permission, Some(Permission::Deny("no rm".into())));
        let ask = r#"{"hookSpecificOutput": {"hookEventName": "PreToolUse", "permissionDecision": "ask", "permissionDecisionReason": "sure?"}}"#;
        assert_eq!(
            decode(pre, Dialect::Claude, &ran(0, ask, "")).permission,
            Some(Permission::Ask("sure?".into()))
        );
        // Codex has no ask; a mismatched event name is ignored.
        assert_eq!(
            decode(pre, Dialect::Codex, &ran(0, ask, "")).permission,
            None
        );
        let other = ask.replace("\"PreToolUse\"", "\"PostToolUse\"");
        assert_eq!(
            decode(pre, Dialect::Claude, &ran(0, &other, "")).permission,
            None
        );
        let plain = decode(
            Point::UserPromptSubmit,
            Dialect::Codex,
            &ran(0, "it is Tuesday\n", ""),
        );
        assert_eq!(
            plain.context,
            vec![(Dialect::Codex, "it is Tuesday".to_owned())]
        );
        let stop = decode(
            Point::Stop,
            Dialect::Claude,
            &ran(0, r#"{"decision": "block", "reason": "tests fail"}"#, ""),
        );
        assert_eq!(stop.block.as_deref(), Some("tests fail"));
        let halt = decode(
            Point::PostToolUse,
            Dialect::Claude,
            &ran(0, r#"{"continue": false, "stopReason": "enough"}"#, ""),
        );
        assert_eq!(halt.decision(), "stop");
        // Exit 1 is a non-blocking error.
        assert_eq!(
            decode(pre, Dialect::Claude, &ran(1, "", "oops")),
            Outcome::default()
        );
    }

    #[test]
    fn several_answers_fold_most_restrictively() {
        let mut all = Outcome {
            permission: Some(Permission::Allow),
            ..Outcome::default()
        };
        all.merge(Outcome {
            permission: Some(Permission::Ask("a".into())),
            block: Some("first".into()),
            ..Outcome::default()
        });
        all.merge(Outcome {
            permission: Some(Permission::Allow),
            block: Some("second".into()),
            context: vec![(Dialect::Claude, "c".into())],
            ..Outcome::default()
        });
        assert_eq!(all.permission, Some(Permission::Ask("a".into())));
        assert_eq!(all.block.as_deref(), Some("first\n\nsecond"));
        assert_eq!(all.context.len(), 1);
        let empty = Outcome {
            block: Some(String::new()),
            ..Outcome::default()
        };
        assert_eq!(
            empty.refusal(Point::PostToolUse).unwrap(),
            "blocked by PostToolUse hook"
        );
    }
}
