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

use dsh_supervisors::error::chain;

use crate::llm::{ContentBlock, Message, MessageSource, Role};
use crate::session::jsonl::{self, LoadError};
use crate::session::{
    EventData, EventMeta, SessionEvent, SessionHeader, SurfaceOp, ToolErrorId, TurnEndReason,
};

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// No session with this id. Fatal for this id.
    #[error("no session `{0}` in {1}")]
    NotFound(String, String),
    /// A session with this id already exists (where it is). Fatal: pick
    /// another id.
    #[error("a session already exists at {0}")]
    Exists(String),
    /// The session is stored in the other JSONL encoding. Fatal: open the
    /// store with the matching compression.
    #[error(
        "{path} is a {found} session log; this store reads {wanted} logs (choose the matching compression or another root)"
    )]
    Encoding {
        /// The file found.
        path: String,
        /// Its encoding.
        found: &'static str,
        /// The store's encoding.
        wanted: &'static str,
    },
    /// The id cannot name a directory. Fatal.
    #[error("`{0}` is not a usable session id")]
    BadId(String),
    /// The file is not a loadable log (its line says where). Fatal until
    /// the file is repaired; nothing was changed.
    #[error("cannot load {path}")]
    Load {
        /// The file.
        path: String,
        /// What is wrong.
        #[source]
        error: LoadError,
    },
    /// The filesystem refused (a full disk, permissions). Retryable once the
    /// cause is fixed: a failed append left the file as it was.
    #[error("{path}")]
    Io {
        /// The file or directory.
        path: String,
        /// The OS error.
        #[source]
        error: std::io::Error,
    },
    /// The database refused (a locked or damaged file, a full disk).
    /// Retryable once the cause is fixed: a failed write is rolled back.
    #[error("the session database {path}")]
    Database {
        /// The database file.
        path: String,
        /// What SQLite said.
        #[source]
        error: rusqlite::Error,
    },
    /// The session grew since it was read (another process wrote it in
    /// between): writing on would repeat seqs. Retryable: read it again.
    #[error(
        "SESSION_BUSY: session {id} was written by another process since it was read ({read} events then, more now); resume it again"
    )]
    Stale {
        /// The session.
        id: String,
        /// Events it held when read.
        read: u64,
    },
    /// A short id is the start of several sessions' ids. Fatal: give more
    /// of it.
    #[error("`{given}` is the start of {} session ids ({}); give more of it", .matches.len(), .matches.join(", "))]
    Ambiguous {
        /// What was given.
        given: String,
        /// The ids it starts (at most a few).
        matches: Vec<String>,
    },
    /// Another writer holds the session (`SESSION_BUSY`). Retryable once
    /// that process ends; reading the session needs no lock.
    #[error("SESSION_BUSY: session {id} is being written by {} (lock {path}); wait for it to end, or read it with `dsh sessions show`", match .pid { Some(p) => format!("process {p}"), None => "another process".to_owned() })]
    Busy {
        /// The session.
        id: String,
        /// The holder, as its lock file tells.
        pid: Option<u32>,
        /// The lock file.
        path: String,
    },
}

/// The session `given` names in `store`: its id, or the one id it is the
/// start of (the 8-character ids the tree and the lines show). None: not
/// found; several: [`StoreError::Ambiguous`].
pub fn resolve(store: &dyn SessionPersistence, given: &str) -> Result<String, StoreError> {
    let ids = store.ids()?;
    if ids.iter().any(|id| id == given) {
        return Ok(given.to_owned());
    }
    let mut matches: Vec<String> = if given.len() >= 4 {
        ids.into_iter().filter(|id| id.starts_with(given)).collect()
    } else {
        Vec::new()
    };
    matches.sort();
    match matches.len() {
        // Not a start of any id: what loading it says (not found, a bad id).
        0 => store.load(given).map(|_| given.to_owned()),
        1 => Ok(matches.remove(0)),
        _ => {
            matches.truncate(5);
            Err(StoreError::Ambiguous {
                given: given.to_owned(),
                matches,
            })
        }
    }
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
    /// The first line a second writer repeated seqs from, if any: it and
    /// every line after it were left out (a resume moves them to a sibling
    /// file).
    pub set_aside_from: Option<usize>,
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
    /// The last event's time, epoch ms (the creation time before any).
    pub updated_at: u64,
    /// Tokens its model calls spent: input (cached included) and output.
    pub tokens: u64,
    /// How its last turn ended (`completed`, `error`, `aborted`, …);
    /// `open` when that turn has no end (running, or cut by a crash),
    /// `new` before any turn.
    pub status: String,
}

mod lock;
mod sqlite;
pub use lock::WriterLock;
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
    /// Whether the store holds exactly one session (a single file), so that
    /// other sessions (a subagent's) cannot be stored beside it.
    fn holds_one_session(&self) -> bool {
        false
    }
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
    /// Every session's id, in no order (nothing is loaded where the store
    /// can say without).
    fn ids(&self) -> Result<Vec<String>, StoreError> {
        Ok(self
            .list()?
            .into_iter()
            .filter_map(|s| s.ok().map(|s| s.id))
            .collect())
    }
    /// One session's summary.
    fn inspect(&self, id: &str) -> Result<SessionSummary, StoreError> {
        self.load(id).map(|l| summarize(&l))
    }
    /// Makes a loaded session appendable again: drops a torn tail that
    /// `load` reported (and kept out of `events`).
    fn prepare_resume(&self, id: &str, loaded: &Loaded) -> Result<(), StoreError>;
    /// Whether session `id` holds more than its first `n` events: another
    /// writer appended since they were read.
    fn holds_more_than(&self, id: &str, n: u64) -> Result<bool, StoreError> {
        self.read_from(id, n).map(|rest| !rest.is_empty())
    }
    /// Takes the one-writer lock of session `id` (see [`WriterLock`]):
    /// `Busy` when another writer holds it. `None`: this store needs none
    /// (it lives in one process's memory).
    fn lock_writer(&self, id: &str) -> Result<Option<WriterLock>, StoreError> {
        let _ = id;
        Ok(None)
    }
}

/// How a JSONL store encodes its transcripts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// Newline-delimited UTF-8 text (`session.jsonl`).
    None,
    /// Concatenated checksummed Zstandard frames (`session.jsonl.zstd`): one
    /// for the header, then one per durable batch.
    Zstd,
}

impl Compression {
    fn file_name(self) -> &'static str {
        match self {
            Compression::None => "session.jsonl",
            Compression::Zstd => "session.jsonl.zstd",
        }
    }

    fn other(self) -> Compression {
        match self {
            Compression::None => Compression::Zstd,
            Compression::Zstd => Compression::None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Compression::None => "uncompressed",
            Compression::Zstd => "zstd",
        }
    }
}

/// A directory of JSONL sessions.
#[derive(Clone, Debug)]
pub struct JsonlStore {
    root: PathBuf,
    /// Every id maps to this one file (`dsh run --session FILE`).
    single: Option<PathBuf>,
    compression: Compression,
}

/// `bytes` as text: bytes that are not UTF-8 become U+FFFD (a bad byte
/// inside a string keeps its event; one in the JSON structure fails that
/// line, named by number), with the 1-based lines where that happened.
fn utf8_text(bytes: Vec<u8>) -> (String, Vec<usize>) {
    match String::from_utf8(bytes) {
        Ok(text) => (text, Vec::new()),
        Err(e) => {
            let bytes = e.into_bytes();
            let mut replaced = Vec::new();
            for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
                if std::str::from_utf8(line).is_err() {
                    replaced.push(i + 1);
                }
            }
            (String::from_utf8_lossy(&bytes).into_owned(), replaced)
        }
    }
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

/// A transcript read back: its logical text and, for a compressed file cut
/// inside its last frame, where the good frames end.
struct Transcript {
    path: PathBuf,
    text: String,
    torn_frame_at: Option<u64>,
    /// Plain files: the byte length up to the last newline (where a torn
    /// tail is cut; `text` may be longer where bytes were replaced).
    raw_good: Option<u64>,
    /// Plain files: the lines whose bytes were not UTF-8 (replaced).
    replaced: Vec<usize>,
}

/// One Zstandard frame holding `text`, with a content checksum.
fn zstd_frame(text: &[u8]) -> std::io::Result<Vec<u8>> {
    use std::io::Write;
    let mut encoder = zstd::stream::Encoder::new(Vec::new(), zstd::DEFAULT_COMPRESSION_LEVEL)?;
    encoder.include_checksum(true)?;
    encoder.write_all(text)?;
    encoder.finish()
}

/// Decodes concatenated frames. A last frame cut short (a crash during its
/// write) ends the text at the frame before it, and its offset is returned;
/// a damaged complete frame is an error naming its byte offset.
fn decode_frames(bytes: &[u8]) -> Result<(String, Option<u64>), LoadError> {
    let mut text = String::new();
    let mut at = 0;
    while at < bytes.len() {
        let rest = &bytes[at..];
        let size = match zstd::zstd_safe::find_frame_compressed_size(rest) {
            Ok(n) if n <= rest.len() => n,
            Ok(_) => return Ok((text, Some(at as u64))),
            Err(code) => {
                let reason = zstd::zstd_safe::get_error_name(code);
                // Only a frame whose bytes stop early is a torn write.
                if reason.contains("Src size is incorrect") || rest.len() < 18 {
                    return Ok((text, Some(at as u64)));
                }
                return Err(LoadError::Frame {
                    offset: at as u64,
                    reason: reason.to_owned(),
                });
            }
        };
        let frame = zstd::stream::decode_all(&rest[..size]).map_err(|e| LoadError::Frame {
            offset: at as u64,
            reason: chain(&e).to_string(),
        })?;
        let frame = String::from_utf8(frame).map_err(|e| LoadError::Frame {
            offset: at as u64,
            reason: format!("not UTF-8: {}", chain(&e)),
        })?;
        if !frame.is_empty() && !frame.ends_with('\n') {
            return Err(LoadError::Frame {
                offset: at as u64,
                reason: "a frame does not end at a line boundary".into(),
            });
        }
        text.push_str(&frame);
        at += size;
    }
    Ok((text, None))
}

impl JsonlStore {
    /// An uncompressed store rooted at `root` (created on first write).
    pub fn new(root: impl Into<PathBuf>) -> JsonlStore {
        JsonlStore {
            root: root.into(),
            single: None,
            compression: Compression::None,
        }
    }

    /// A store of one uncompressed session in the file `path`, whatever its id.
    pub fn file(path: impl Into<PathBuf>) -> JsonlStore {
        let path = path.into();
        JsonlStore {
            root: path.parent().map(Path::to_path_buf).unwrap_or_default(),
            single: Some(path),
            compression: Compression::None,
        }
    }

    /// The same store with transcripts encoded as `compression`.
    pub fn with_compression(mut self, compression: Compression) -> JsonlStore {
        self.compression = compression;
        self
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
        Ok(self
            .root
            .join(encode(id)?)
            .join(self.compression.file_name()))
    }

    fn read(&self, id: &str) -> Result<Transcript, StoreError> {
        let path = self.path(id)?;
        self.read_file(id, path)
    }

    fn read_file(&self, id: &str, path: PathBuf) -> Result<Transcript, StoreError> {
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let other = path.with_file_name(self.compression.other().file_name());
                if self.single.is_none() && other.exists() {
                    return Err(StoreError::Encoding {
                        path: other.display().to_string(),
                        found: self.compression.other().name(),
                        wanted: self.compression.name(),
                    });
                }
                return Err(StoreError::NotFound(
                    id.to_owned(),
                    self.root.display().to_string(),
                ));
            }
            Err(e) => return Err(io(&path, e)),
        };
        let load = |error| StoreError::Load {
            path: path.display().to_string(),
            error,
        };
        let (text, torn_frame_at, raw_good, replaced) = match self.compression {
            Compression::None => {
                let good = bytes.iter().rposition(|b| *b == b'\n').map_or(0, |i| i + 1);
                let (text, replaced) = utf8_text(bytes);
                (text, None, Some(good as u64), replaced)
            }
            Compression::Zstd => {
                let (text, torn) = decode_frames(&bytes).map_err(load)?;
                (text, torn, None, Vec::new())
            }
        };
        Ok(Transcript {
            path,
            text,
            torn_frame_at,
            raw_good,
            replaced,
        })
    }

    fn load_transcript(t: &Transcript) -> Result<Loaded, StoreError> {
        let mut loaded = load_text(&t.text).map_err(|error| StoreError::Load {
            path: t.path.display().to_string(),
            error,
        })?;
        if let Some(at) = t.torn_frame_at {
            loaded.torn_line = Some(t.text.lines().count() + 1);
            loaded.good_bytes = at;
        }
        if t.raw_good.is_none() && t.torn_frame_at.is_none() && loaded.torn_line.is_some() {
            // Whole frames that end mid-line: no byte offset of the file
            // cuts that line off; refuse rather than cut at a wrong place.
            return Err(StoreError::Load {
                path: t.path.display().to_string(),
                error: LoadError::Line {
                    line: loaded.torn_line.unwrap_or_default(),
                    reason: "a complete frame ends in the middle of a line".into(),
                },
            });
        }
        if let (Some(good), Some(_)) = (t.raw_good, loaded.torn_line) {
            // Where the file itself is cut (replaced bytes change lengths).
            loaded.good_bytes = good;
        }
        if let Some(line) = loaded.set_aside_from
            && (t.raw_good.is_none() || !t.replaced.is_empty())
        {
            // Only a plain UTF-8 file is cut where its text is: refuse
            // rather than cut at a wrong place.
            return Err(StoreError::Load {
                path: t.path.display().to_string(),
                error: LoadError::Line {
                    line,
                    reason: "a second writer repeated seqs from here, and this file cannot be cut at that line (compressed frames or bytes that are not UTF-8); set the lines aside by hand".into(),
                },
            });
        }
        for line in &t.replaced {
            loaded.repairs.push(format!(
                "line {line}: bytes that are not UTF-8 were read as U+FFFD"
            ));
        }
        Ok(loaded)
    }

    /// Appends `bytes` to `path` durably; on failure the file is cut back to
    /// its length before, so a later retry does not follow a partial write.
    fn append_bytes(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
        use std::io::Write;
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .map_err(|e| io(path, e))?;
        let before = file.metadata().map_err(|e| io(path, e))?.len();
        let written = file.write_all(bytes).and_then(|()| file.sync_data());
        if let Err(e) = written {
            let _ = file.set_len(before);
            return Err(io(path, e));
        }
        Ok(())
    }
}

impl JsonlStore {
    /// Creates session `id`'s folder with its file in one step: both are
    /// made under a staging name (`+…`, which no encoded id contains, and
    /// `list` skips), then the folder is renamed into place without
    /// replacing anything. A crash leaves the whole session or none of it
    /// (a staging folder at most); a racing creator of the same id fails.
    fn publish_folder(&self, id: &str, bytes: &[u8]) -> Result<(), StoreError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let name = encode(id)?;
        let root = &self.root;
        std::fs::create_dir_all(root).map_err(|e| io(root, e))?;
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let staging_name = format!("+{name}+{}+{n}", std::process::id());
        let staging = root.join(&staging_name);
        let stage = || -> std::io::Result<()> {
            std::fs::create_dir(&staging)?;
            let mut file = std::fs::File::create(staging.join(self.compression.file_name()))?;
            std::io::Write::write_all(&mut file, bytes)?;
            file.sync_data()
        };
        if let Err(e) = stage() {
            let _ = std::fs::remove_dir_all(&staging);
            return Err(io(&staging, e));
        }
        let published = publish(root, &staging_name, &name);
        if published.is_err() {
            let _ = std::fs::remove_dir_all(&staging);
        }
        match published {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(StoreError::Exists(self.locate(id)))
            }
            Err(e) => Err(io(&root.join(&name), e)),
        }
    }
}

/// Renames `root/from` to `root/to` unless `to` exists; an empty `to` (a
/// folder an older version left behind when it crashed mid-creation) is
/// removed first.
fn publish(root: &Path, from: &str, to: &str) -> std::io::Result<()> {
    use nix::errno::Errno;
    use nix::fcntl::{RenameFlags, renameat2};
    let dir = std::fs::File::open(root)?;
    let attempt = || renameat2(&dir, from, &dir, to, RenameFlags::RENAME_NOREPLACE);
    let mut result = attempt();
    if result == Err(Errno::EEXIST) && std::fs::remove_dir(root.join(to)).is_ok() {
        result = attempt();
    }
    match result {
        Ok(()) => dir.sync_all(),
        Err(Errno::EEXIST) | Err(Errno::ENOTEMPTY) => Err(std::io::ErrorKind::AlreadyExists.into()),
        Err(e) => Err(std::io::Error::from(e)),
    }
}

impl SessionPersistence for JsonlStore {
    fn backend(&self) -> &'static str {
        match self.compression {
            Compression::None => "jsonl",
            Compression::Zstd => "jsonl-zstd",
        }
    }

    fn holds_one_session(&self) -> bool {
        self.single.is_some()
    }

    fn holds_more_than(&self, id: &str, n: u64) -> Result<bool, StoreError> {
        // Asked at every wake: the last line's seq, from the file's tail,
        // when it tells; else the whole log.
        if self.compression == Compression::None {
            let path = self.path(id)?;
            if let Some(last) = last_line_seq(&path).map_err(|e| io(&path, e))? {
                return Ok(last + 1 > n);
            }
        }
        self.read_from(id, n).map(|rest| !rest.is_empty())
    }

    fn lock_writer(&self, id: &str) -> Result<Option<WriterLock>, StoreError> {
        let path = match &self.single {
            Some(file) => {
                let mut name = file.file_name().unwrap_or_default().to_owned();
                name.push(".lock");
                file.with_file_name(name)
            }
            None => lock::lock_path(&self.root.join("locks"), id)?,
        };
        WriterLock::take(path, id).map(Some)
    }

    fn locate(&self, id: &str) -> String {
        match self.path(id) {
            Ok(p) => p.display().to_string(),
            Err(e) => chain(&e).to_string(),
        }
    }

    fn load(&self, id: &str) -> Result<Loaded, StoreError> {
        Self::load_transcript(&self.read(id)?)
    }

    fn read_from(&self, id: &str, seq: u64) -> Result<Vec<SessionEvent>, StoreError> {
        let t = self.read(id)?;
        let (_, events, _) = parse_good_prefix(&t.text).map_err(|error| StoreError::Load {
            path: t.path.display().to_string(),
            error,
        })?;
        Ok(events.into_iter().skip(seq as usize).collect())
    }

    fn prepare_resume(&self, id: &str, loaded: &Loaded) -> Result<(), StoreError> {
        if loaded.torn_line.is_none() && loaded.set_aside_from.is_none() {
            return Ok(());
        }
        // A live writer's half-written line is not a torn tail: cut it only
        // when nobody writes.
        let _writer = self.lock_writer(id)?;
        let path = self.path(id)?;
        if loaded.set_aside_from.is_some() {
            // Kept, beside the log, before the log is cut.
            let bytes = std::fs::read(&path).map_err(|e| io(&path, e))?;
            let rest = bytes.get(loaded.good_bytes as usize..).unwrap_or_default();
            let mut name = path.file_name().unwrap_or_default().to_owned();
            name.push(format!(".set-aside-{}", dsh_supervisors::tree::now_ms()));
            let aside = path.with_file_name(name);
            std::fs::write(&aside, rest)
                .and_then(|()| std::fs::File::open(&aside)?.sync_all())
                .map_err(|e| io(&aside, e))?;
        }
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| io(&path, e))?;
        file.set_len(loaded.good_bytes).map_err(|e| io(&path, e))?;
        file.sync_data().map_err(|e| io(&path, e))
    }

    fn append(&self, id: &str, events: &[Arc<SessionEvent>]) -> Result<(), StoreError> {
        let path = self.path(id)?;
        let mut text = Vec::new();
        jsonl::write_lines(events, &mut text);
        match self.compression {
            Compression::None => Self::append_bytes(&path, &text),
            Compression::Zstd => {
                let frame = zstd_frame(&text).map_err(|e| io(&path, e))?;
                Self::append_bytes(&path, &frame)
            }
        }
    }

    fn ids(&self) -> Result<Vec<String>, StoreError> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&self.root, e)),
        };
        Ok(entries
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|name| !name.starts_with('+') && name != "locks")
            .collect())
    }

    fn list(&self) -> Result<Vec<Result<SessionSummary, StoreError>>, StoreError> {
        let entries = match std::fs::read_dir(&self.root) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(io(&self.root, e)),
        };
        let mut out = Vec::new();
        for entry in entries.flatten() {
            // A session being created (or one a crash left half made).
            if entry.file_name().to_string_lossy().starts_with('+') {
                continue;
            }
            let file = entry.path().join(self.compression.file_name());
            let other = entry.path().join(self.compression.other().file_name());
            if other.is_file() {
                // A root holds one encoding; the other is named, not hidden.
                out.push(Err(StoreError::Encoding {
                    path: other.display().to_string(),
                    found: self.compression.other().name(),
                    wanted: self.compression.name(),
                }));
            }
            if !file.is_file() {
                continue;
            }
            let id = entry.file_name().to_string_lossy().into_owned();
            let summary = self
                .read_file(&id, file)
                .and_then(|t| Self::load_transcript(&t))
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
        let bytes = match self.compression {
            Compression::None => jsonl::render(header, events).into_bytes(),
            Compression::Zstd => {
                let head = jsonl::render(header, &[] as &[Arc<SessionEvent>]);
                let body = jsonl::render(header, events);
                let mut bytes = zstd_frame(head.as_bytes()).map_err(|e| io(&path, e))?;
                if !events.is_empty() {
                    let rest = &body[head.len()..];
                    bytes.extend(zstd_frame(rest.as_bytes()).map_err(|e| io(&path, e))?);
                }
                bytes
            }
        };
        if self.single.is_none() {
            return self.publish_folder(&header.id, &bytes);
        }
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        }
        // Written aside, then published with a hard link, which never
        // replaces an existing file: a crash leaves no session or the whole
        // first batch, and a racing creator of the same id fails.
        let mut part = path.clone().into_os_string();
        part.push(format!(".{}.part", std::process::id()));
        let part = PathBuf::from(part);
        let write = || -> std::io::Result<()> {
            let mut file = std::fs::File::create(&part)?;
            std::io::Write::write_all(&mut file, &bytes)?;
            file.sync_data()?;
            std::fs::hard_link(&part, &path)
        };
        let result = write();
        let _ = std::fs::remove_file(&part);
        match result {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Err(StoreError::Exists(self.locate(&header.id)))
            }
            Err(e) => Err(io(&path, e)),
        }
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

/// Where a log read as stored stops being good.
#[derive(Clone, Copy, Debug)]
struct Cut {
    /// The first line left out (1-based).
    line: usize,
    /// The byte length of the good prefix.
    at: u64,
    /// From there a second writer repeated seqs (else: a torn last line).
    repeated: Option<u64>,
}

/// Parses a log as stored; a torn last line, or a second writer's repeats
/// and everything after them, are left out and reported.
fn parse_good_prefix(
    text: &str,
) -> Result<(SessionHeader, Vec<SessionEvent>, Option<Cut>), LoadError> {
    let (line, at, repeated) = match jsonl::parse(text) {
        Ok((h, e)) => return Ok((h, e, None)),
        Err(LoadError::TornTail { line, .. }) => {
            (line, text.rfind('\n').map(|i| i + 1).unwrap_or(0), None)
        }
        Err(LoadError::Repeated { line, seq, .. }) => {
            // Line `line` starts after the (line - 1)th newline.
            let at = text
                .match_indices('\n')
                .nth(line - 2)
                .map(|(i, _)| i + 1)
                .unwrap_or(0);
            (line, at, Some(seq))
        }
        Err(e) => return Err(e),
    };
    // Everything before the cut is intact: parse that prefix.
    let (h, e) = jsonl::parse(&text[..at])?;
    let cut = Cut {
        line,
        at: at as u64,
        repeated,
    };
    Ok((h, e, Some(cut)))
}

/// Parses a log, keeping the good prefix of a torn tail, and repairs an
/// interrupted last turn in memory.
pub fn load_text(text: &str) -> Result<Loaded, LoadError> {
    let (header, mut events, cut) = parse_good_prefix(text)?;
    let (mut torn_line, mut set_aside_from) = (None, None);
    let good_bytes = match cut {
        Some(cut) => {
            match cut.repeated {
                Some(_) => set_aside_from = Some(cut.line),
                None => torn_line = Some(cut.line),
            }
            cut.at
        }
        None => text.len() as u64,
    };
    let durable = events.len() as u64;
    let mut repairs = Vec::new();
    if let Some(Cut {
        line,
        repeated: Some(seq),
        ..
    }) = cut
    {
        repairs.push(format!(
            "line {line} on: a second writer repeated seqs from seq {seq} (two processes wrote at once); the first {durable} events are kept, the rest is left out (a resume moves it to a sibling `.set-aside` file)"
        ));
    }
    repairs.extend(repair(&mut events));
    Ok(Loaded {
        header,
        events,
        durable,
        torn_line,
        set_aside_from,
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
    SessionEvent::new(seq, time, data).with_meta(EventMeta {
        ignorable: false,
        surface_op: surface.then_some(SurfaceOp::Append),
        source_event_seqs: cites.map(Vec::into_boxed_slice),
    })
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
            EventData::ToolCall { call, turn, step } => {
                calls.push((e.seq, call.call_id.to_string(), *turn, *step));
            }
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
                error: Some(Box::new(ToolErrorId {
                    name: "Interrupted".into(),
                    code: "TOOL_OUTCOME_UNKNOWN".into(),
                })),
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
            reason: Box::new(TurnEndReason::Interrupted),
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
        updated_at: l.events.last().map_or(l.header.created_at, |e| e.time),
        tokens: l
            .events
            .iter()
            .map(|e| match &e.data {
                EventData::AssistantMessage { usage: Some(u), .. } => {
                    u.input_tokens + u.cache_read_tokens.unwrap_or(0) + u.output_tokens
                }
                _ => 0,
            })
            .sum(),
        status: l
            .events
            .iter()
            .rev()
            .find_map(|e| match &e.data {
                EventData::TurnEnd { reason, .. } => {
                    Some(crate::session::compare::end_kind(reason))
                }
                EventData::TurnStart { .. } => Some("open"),
                _ => None,
            })
            .unwrap_or("new")
            .to_owned(),
    }
}

/// The `seq` of a plain log's last line, read from the file's last 64 KiB
/// alone; `None` where the tail does not say (a torn last line, a packed
/// chunk row, the header alone, a line longer than the tail).
fn last_line_seq(path: &Path) -> std::io::Result<Option<u64>> {
    use std::io::{Read, Seek, SeekFrom};
    const TAIL: u64 = 64 * 1024;
    #[derive(serde::Deserialize)]
    struct Last {
        #[serde(rename = "type")]
        kind: String,
        seq: Option<u64>,
    }
    let mut file = std::fs::File::open(path)?;
    let start = file.metadata()?.len().saturating_sub(TAIL);
    file.seek(SeekFrom::Start(start))?;
    let mut tail = Vec::new();
    file.read_to_end(&mut tail)?;
    let Some(body) = tail.strip_suffix(b"\n") else {
        return Ok(None);
    };
    let line = match memchr::memrchr(b'\n', body) {
        Some(i) => &body[i + 1..],
        None if start == 0 => body,
        None => return Ok(None),
    };
    Ok(match serde_json::from_slice::<Last>(line) {
        Ok(last) if !last.kind.ends_with("-chunks") => last.seq,
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::last_line_seq;

    #[test]
    fn the_last_seq_comes_from_the_tail_or_not_at_all() {
        let dir = dsh_supervisors::scratch::fresh_dir("dsh-tail").unwrap();
        let file = dir.join("session.jsonl");
        let cases: [(&str, Option<u64>); 5] = [
            ("{\"type\":\"session\",\"version\":0}\n", None),
            (
                "{\"type\":\"session\"}\n{\"type\":\"turn/start\",\"seq\":0}\n{\"type\":\"turn/end\",\"seq\":1}\n",
                Some(1),
            ),
            (
                "{\"type\":\"session\"}\n{\"type\":\"turn/start\",\"seq\":0}\n{\"type\":\"turn/e",
                None,
            ),
            (
                "{\"type\":\"session\"}\n{\"type\":\"text-chunks\",\"data\":{\"seq0\":0}}\n",
                None,
            ),
            ("{\"type\":\"session\"}\nnot json\n", None),
        ];
        for (text, seq) in cases {
            std::fs::write(&file, text).unwrap();
            assert_eq!(last_line_seq(&file).unwrap(), seq, "{text}");
        }
        let long = format!(
            "{{\"type\":\"x\",\"seq\":7,\"pad\":\"{}\"}}\n",
            "a".repeat(70_000)
        );
        std::fs::write(&file, format!("{{\"type\":\"session\"}}\n{long}")).unwrap();
        assert_eq!(
            last_line_seq(&file).unwrap(),
            None,
            "a line longer than the tail"
        );
    }
}
