//! Durable sessions in dsh's JSONL format: one directory per session under
//! a root (`<root>/<id>/session.jsonl`), crash repair on load, listing.
//!
//! Load never drops committed data silently: a torn last line (a crash in
//! the middle of a write) is reported with its line number and left out, the
//! good lines before it are kept; a turn left open by a crash is closed in
//! memory by synthetic events (`step/end`, an error `tool/result`
//! `TOOL_OUTCOME_UNKNOWN` for each call without one, `turn/end
//! {kind: interrupted}`), which a resume then writes after the good lines.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::llm::{ContentBlock, Message, MessageSource, Role};
use crate::session::jsonl::{self, LoadError};
use crate::session::{
    EventData, SessionEvent, SessionHeader, SurfaceOp, ToolErrorId, TurnEndReason,
};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No session with this id.
    #[error("no session `{0}` in {1}")]
    NotFound(String, String),
    /// A session with this id already exists (where it is).
    #[error("a session already exists at {0}")]
    Exists(String),
    /// The id cannot name a directory.
    #[error("`{0}` is not a usable session id")]
    BadId(String),
    /// The file is not a loadable log.
    #[error("{path}: {error}")]
    Load {
        /// The file.
        path: String,
        /// What is wrong.
        error: LoadError,
    },
    /// The filesystem refused.
    #[error("{path}: {error}")]
    Io {
        /// The file or directory.
        path: String,
        /// The OS error.
        error: std::io::Error,
    },
}

/// A loaded session: what is durable, and what load repaired in memory.
#[derive(Debug)]
pub struct Loaded {
    /// The header.
    pub header: SessionHeader,
    /// Every good event, then the synthetic closers of an interrupted turn.
    pub events: Vec<SessionEvent>,
    /// How many of `events` are on disk (the rest are repairs).
    pub durable: u64,
    /// The 1-based line of a torn last write that was left out, if any.
    pub torn_line: Option<usize>,
    /// Byte length of the good prefix of the file (where a resume appends).
    pub good_bytes: u64,
    /// What load repaired, for the user.
    pub repairs: Vec<String>,
}

/// One session in a listing.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct SessionSummary {
    /// Session id.
    pub id: String,
    /// Creation time, epoch ms.
    pub created_at: u64,
    /// Working directory.
    pub cwd: Option<String>,
    /// Parent session of a fork.
    pub parent_session: Option<String>,
    /// Events on disk.
    pub events: u64,
    /// Turns started.
    pub turns: u64,
    /// The first user prompt, shortened.
    pub title: String,
}

mod sqlite;
pub use sqlite::SqliteStore;

/// The service name a [`SessionPersistence`] is provided under.
pub const PERSISTENCE_SERVICE: &str = "persistence";

/// Where sessions are made durable: the seam between the session actor and a
/// storage backend. Every call blocks (file or database I/O); callers run it
/// off the async workers (`spawn_blocking`). Events reach a backend in seq
/// order and exactly once per successful call, so a backend never reorders
/// or deduplicates.
pub trait SessionPersistence: Send + Sync + std::fmt::Debug + 'static {
    /// The backend's name (`jsonl`, `sqlite`).
    fn backend(&self) -> &'static str;
    /// Where session `id` lives, for messages.
    fn locate(&self, id: &str) -> String;
    /// Writes a new session holding `header` and `events`; refuses an id
    /// that already exists. Either all of it is durable or none of it.
    fn create(
        &self,
        header: &SessionHeader,
        events: &[Arc<SessionEvent>],
    ) -> Result<(), StoreError>;
    /// Appends `events` (the next seqs of session `id`) durably.
    fn append(&self, id: &str, events: &[Arc<SessionEvent>]) -> Result<(), StoreError>;
    /// Reads session `id`, repairing an interrupted tail in memory.
    fn load(&self, id: &str) -> Result<Loaded, StoreError>;
    /// Events of session `id` from `seq` on, as stored (no repair).
    fn read_from(&self, id: &str, seq: u64) -> Result<Vec<SessionEvent>, StoreError>;
    /// Every session, newest first; unreadable ones as the error they give.
    fn list(&self) -> Result<Vec<Result<SessionSummary, StoreError>>, StoreError>;
    /// One session's summary.
    fn inspect(&self, id: &str) -> Result<SessionSummary, StoreError> {
        self.load(id).map(|l| summarize(&l))
    }
    /// Makes a loaded session appendable again: drops a torn tail that
    /// `load` reported (and kept out of `events`).
    fn prepare_resume(&self, id: &str, loaded: &Loaded) -> Result<(), StoreError>;
}

/// A directory of JSONL sessions.
#[derive(Clone, Debug)]
pub struct JsonlStore {
    root: PathBuf,
    /// Every id maps to this one file (`dsh run --session FILE`).
    single: Option<PathBuf>,
}

fn io(path: &Path, error: std::io::Error) -> StoreError {
    StoreError::Io {
        path: path.display().to_string(),
        error,
    }
}

/// Maps an id to one safe path component (injective: `%` escapes).
fn encode(id: &str) -> Result<String, StoreError> {
    if id.is_empty() || id == "." || id == ".." {
        return Err(StoreError::BadId(id.to_owned()));
    }
    let mut out = String::with_capacity(id.len());
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    Ok(out)
}

impl JsonlStore {
    /// A store rooted at `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> JsonlStore {
        JsonlStore {
            root: root.into(),
            single: None,
        }
    }

    /// A store of one session in the file `path`, whatever its id.
    pub fn file(path: impl Into<PathBuf>) -> JsonlStore {
        let path = path.into();
        JsonlStore {
            root: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            single: Some(path),
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where session `id` lives.
    pub fn path(&self, id: &str) -> Result<PathBuf, StoreError> {
        if let Some(file) = &self.single {
            return Ok(file.clone());
        }
        Ok(self.root.join(encode(id)?).join("session.jsonl"))
    }

    fn read(&self, id: &str) -> Result<(PathBuf, String), StoreError> {
        let path = self.path(id)?;
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound(
                    id.to_owned(),
                    self.root.display().to_string(),
                ));
            }
            Err(e) => return Err(io(&path, e)),
        };
        Ok((path, text))
    }
}

impl SessionPersistence for JsonlStore {
    fn backend(&self) -> &'static str {
        "jsonl"
    }

    fn locate(&self, id: &str) -> String {
        match self.path(id) {
            Ok(p) => p.display().to_string(),
            Err(e) => e.to_string(),
        }
    }

    fn load(&self, id: &str) -> Result<Loaded, StoreError> {
        let (path, text) = self.read(id)?;
        load_text(&text).map_err(|error| StoreError::Load {
            path: path.display().to_string(),
            error,
        })
    }

    fn read_from(&self, id: &str, seq: u64) -> Result<Vec<SessionEvent>, StoreError> {
        let (path, text) = self.read(id)?;
        let (_, events) = match jsonl::parse(&text) {
            Err(LoadError::TornTail { .. }) => {
                let cut = text.rfind('\n').map(|i| i + 1).unwrap_or(0);
                jsonl::parse(&text[..cut])
            }
            other => other,
        }
        .map_err(|error| StoreError::Load {
            path: path.display().to_string(),
            error,
        })?;
        Ok(events.into_iter().skip(seq as usize).collect())
    }

    fn prepare_resume(&self, id: &str, loaded: &Loaded) -> Result<(), StoreError> {
        if loaded.torn_line.is_none() {
            return Ok(());
        }
        let path = self.path(id)?;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        file.set_len(loaded.good_bytes).map_err(|e| io(&path, e))?;
        file.sync_data().map_err(|e| io(&path, e))
    }

    fn append(&self, id: &str, events: &[Arc<SessionEvent>]) -> Result<(), StoreError> {
        use std::io::Write;
        let path = self.path(id)?;
        let mut text = String::new();
        for e in events {
            text.push_str(&e.to_json().to_string());
            text.push('\n');
        }
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        file.write_all(text.as_bytes()).map_err(|e| io(&path, e))?;
        file.sync_data().map_err(|e| io(&path, e))
    }

    fn list(&self) -> Result<Vec<Result<SessionSummary, StoreError>>, StoreError> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&self.root, e)),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            let file = entry.path().join("session.jsonl");
            if !file.is_file() {
                continue;
            }
            let summary = std::fs::read_to_string(&file)
                .map_err(|e| io(&file, e))
                .and_then(|text| {
                    load_text(&text).map_err(|error| StoreError::Load {
                        path: file.display().to_string(),
                        error,
                    })
                })
                .map(|l| summarize(&l));
            out.push(summary);
        }
        out.sort_by_key(|s| {
            std::cmp::Reverse(s.as_ref().map(|s| s.created_at).unwrap_or(u64::MAX))
        });
        Ok(out)
    }

    fn create(
        &self,
        header: &SessionHeader,
        events: &[Arc<SessionEvent>],
    ) -> Result<(), StoreError> {
        let path = self.path(&header.id)?;
        if path.exists() {
            return Err(StoreError::Exists(self.locate(&header.id)));
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        // Written aside and renamed into place: a crash leaves either no
        // session or the whole first batch.
        let part = path.with_extension("jsonl.part");
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&part)?;
            std::io::Write::write_all(&mut file, jsonl::render(header, events).as_bytes())?;
            file.sync_data()?;
            std::fs::rename(&part, &path)
        };
        write().map_err(|e| io(&path, e))
    }
}

/// Loads a session stored as rows (a header line, then one event line per
/// row in seq order) with the same validation and repair as a JSONL file.
fn load_parts(header: &str, rows: &[String]) -> Result<Loaded, LoadError> {
    let mut text =
        String::with_capacity(header.len() + rows.iter().map(|r| r.len() + 1).sum::<usize>() + 1);
    for (i, row) in std::iter::once(header)
        .chain(rows.iter().map(String::as_str))
        .enumerate()
    {
        // One row is one event: a newline inside would smuggle in another.
        if row.contains('\n') {
            return Err(LoadError::Line {
                line: i + 1,
                reason: "a stored row holds a line break".into(),
            });
        }
        text.push_str(row);
        text.push('\n');
    }
    load_text(&text)
}

/// Parses a log, keeping the good prefix of a torn tail, and repairs an
/// interrupted last turn in memory.
pub fn load_text(text: &str) -> Result<Loaded, LoadError> {
    let (header, mut events, torn_line, good_bytes) = match jsonl::parse(text) {
        Ok((h, e)) => (h, e, None, text.len() as u64),
        Err(LoadError::TornTail { line, .. }) => {
            // Everything before the torn line is intact: parse that prefix.
            let cut = text.rfind('\n').map(|i| i + 1).unwrap_or(0);
            let (h, e) = jsonl::parse(&text[..cut])?;
            (h, e, Some(line), cut as u64)
        }
        Err(e) => return Err(e),
    };
    let durable = events.len() as u64;
    let repairs = repair(&mut events);
    Ok(Loaded {
        header,
        events,
        durable,
        torn_line,
        good_bytes,
        repairs,
    })
}

fn synthetic(
    seq: u64,
    time: u64,
    data: EventData,
    surface: bool,
    cites: Option<Vec<u64>>,
) -> SessionEvent {
    SessionEvent {
        seq,
        time,
        data,
        ignorable: false,
        surface_op: surface.then_some(SurfaceOp::Append),
        source_event_seqs: cites,
    }
}

/// Closes a turn left open at the end of `events`; returns what it did.
pub fn repair(events: &mut Vec<SessionEvent>) -> Vec<String> {
    let mut open_turn = None;
    let mut open_step = None;
    let mut calls: Vec<(u64, String, u32, u32)> = Vec::new();
    let mut answered: HashSet<String> = HashSet::new();
    for e in events.iter() {
        match &e.data {
            EventData::TurnStart { turn } => {
                open_turn = Some(*turn);
                open_step = None;
                calls.clear();
                answered.clear();
            }
            EventData::TurnEnd { .. } => open_turn = None,
            EventData::StepStart { turn, step } => open_step = Some((*turn, *step)),
            EventData::StepEnd { .. } => open_step = None,
            EventData::ToolCall {
                call_id,
                turn,
                step,
                ..
            } => calls.push((e.seq, call_id.clone(), *turn, *step)),
            EventData::ToolResult { message, .. } => {
                for b in &message.content {
                    if let ContentBlock::ToolResult { tool_call_id, .. } = b {
                        answered.insert(tool_call_id.clone());
                    }
                }
            }
            _ => {}
        }
    }
    let Some(turn) = open_turn else {
        return Vec::new();
    };
    let time = events.last().map(|e| e.time).unwrap_or(0);
    let mut done = Vec::new();
    for (seq, id, t, s) in calls
        .into_iter()
        .filter(|(_, id, ..)| !answered.contains(id))
    {
        let message = Message {
            id: Message::new_id(),
            role: Role::User,
            content: vec![ContentBlock::ToolResult {
                tool_call_id: id.clone(),
                content: vec![ContentBlock::text(
                    "Error [TOOL_OUTCOME_UNKNOWN]: the process stopped while this call ran; its effects are unknown. Retry only if it is read-only or idempotent.",
                )],
                is_error: Some(true),
            }],
            source: MessageSource::tool(&id),
        };
        let next = events.len() as u64;
        events.push(synthetic(
            next,
            time,
            EventData::ToolResult {
                turn: t,
                step: s,
                message: Arc::new(message),
                error: Some(ToolErrorId {
                    name: "Interrupted".into(),
                    code: "TOOL_OUTCOME_UNKNOWN".into(),
                }),
                meta: None,
            },
            true,
            Some(vec![seq]),
        ));
        done.push(format!(
            "call {id} had no result: recorded TOOL_OUTCOME_UNKNOWN"
        ));
    }
    if let Some((t, s)) = open_step {
        let next = events.len() as u64;
        events.push(synthetic(
            next,
            time,
            EventData::StepEnd { turn: t, step: s },
            false,
            None,
        ));
        done.push(format!("closed step {s} of turn {t}"));
    }
    let next = events.len() as u64;
    events.push(synthetic(
        next,
        time,
        EventData::TurnEnd {
            turn,
            reason: TurnEndReason::Interrupted,
        },
        false,
        None,
    ));
    done.push(format!("closed turn {turn} as interrupted"));
    done
}

fn summarize(l: &Loaded) -> SessionSummary {
    let title = l
        .events
        .iter()
        .find_map(|e| match &e.data {
            EventData::UserMessage(m) if m.source.kind == "user" => Some(m.text()),
            _ => None,
        })
        .unwrap_or_default();
    let title: String = title.chars().take(60).collect();
    SessionSummary {
        id: l.header.id.clone(),
        created_at: l.header.created_at,
        cwd: l.header.cwd.clone(),
        parent_session: l.header.parent_session.clone(),
        events: l.durable,
        turns: l
            .events
            .iter()
            .filter(|e| matches!(e.data, EventData::TurnStart { .. }))
            .count() as u64,
        title,
    }
}
