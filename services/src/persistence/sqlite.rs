//! Sessions in one SQLite database: a `sessions` table (header line per id)
//! and an `events` table keyed by `(session, seq)`, so reading from a seq is
//! an index range, not a scan. WAL mode with `synchronous = FULL`: a
//! committed append survives a process kill and a power cut.
//!
//! The connection lives on one dedicated thread; callers (already off the
//! async workers) send it jobs and wait for the answer with a timeout. The
//! thread ends when the store is dropped.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::time::Duration;

use dsh_supervisors::error::chain;
use rusqlite::{Connection, OptionalExtension, params};

use super::{Loaded, SessionPersistence, SessionSummary, StoreError, load_parts, summarize};
use crate::session::jsonl::{self, LoadError};
use crate::session::{SessionEvent, SessionHeader};

/// The schema this build writes (`PRAGMA user_version`).
const SCHEMA_VERSION: i64 = 1;

/// How long a caller waits for the database thread.
const JOB_TIMEOUT: Duration = Duration::from_secs(60);

type Job = Box<dyn FnOnce(&mut Connection) + Send>;

/// A SQLite file of sessions.
pub struct SqliteStore {
    path: PathBuf,
    /// `None` only while dropping.
    jobs: Option<SyncSender<Job>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for SqliteStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteStore")
            .field("path", &self.path)
            .finish()
    }
}

/// What SQLite refused, at `path`.
fn db_error(path: &Path, error: rusqlite::Error) -> StoreError {
    StoreError::Database {
        path: path.display().to_string(),
        error,
    }
}

/// A failure of the store itself at `path` (its thread, its directory).
fn store_error(
    path: &Path,
    error: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> StoreError {
    StoreError::Io {
        path: path.display().to_string(),
        error: std::io::Error::other(error),
    }
}

fn open(path: &Path) -> Result<Connection, StoreError> {
    let db = |e| db_error(path, e);
    let conn = Connection::open(path).map_err(db)?;
    conn.busy_timeout(Duration::from_secs(10)).map_err(db)?;
    let mode: String = conn
        .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
        .map_err(db)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(store_error(
            path,
            format!("cannot switch to WAL mode (got `{mode}`)"),
        ));
    }
    conn.execute_batch("PRAGMA synchronous = FULL; PRAGMA foreign_keys = ON;")
        .map_err(db)?;
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(db)?;
    match version {
        0 => conn
            .execute_batch(&format!(
                "BEGIN;
                 CREATE TABLE IF NOT EXISTS sessions (
                     id TEXT PRIMARY KEY,
                     created_at INTEGER NOT NULL,
                     header TEXT NOT NULL
                 );
                 CREATE TABLE IF NOT EXISTS events (
                     session TEXT NOT NULL REFERENCES sessions(id),
                     seq INTEGER NOT NULL,
                     event TEXT NOT NULL,
                     PRIMARY KEY (session, seq)
                 ) WITHOUT ROWID;
                 PRAGMA user_version = {SCHEMA_VERSION};
                 COMMIT;"
            ))
            .map_err(db),
        SCHEMA_VERSION => Ok(()),
        found => Err(store_error(
            path,
            format!(
                "schema version {found} was written by {} dsh; this build reads version {SCHEMA_VERSION}",
                if found > SCHEMA_VERSION {
                    "a newer"
                } else {
                    "an older"
                }
            ),
        )),
    }?;
    Ok(conn)
}

impl SqliteStore {
    /// Opens (or creates) the database at `path` on its own thread.
    pub fn open(path: impl Into<PathBuf>) -> Result<SqliteStore, StoreError> {
        let path = path.into();
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|error| StoreError::Io {
                path: dir.display().to_string(),
                error,
            })?;
        }
        let (jobs, inbox): (SyncSender<Job>, Receiver<Job>) = sync_channel(64);
        let (ready_tx, ready) = sync_channel(1);
        let db = path.clone();
        let thread = std::thread::Builder::new()
            .name("dsh-sqlite".into())
            .spawn(move || {
                let mut conn = match open(&db) {
                    Ok(c) => {
                        let _ = ready_tx.send(Ok(()));
                        c
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // Ends when every sender is gone (the store was dropped).
                while let Ok(job) = inbox.recv() {
                    job(&mut conn);
                }
            })
            .map_err(|error| StoreError::Io {
                path: path.display().to_string(),
                error,
            })?;
        match ready.recv_timeout(JOB_TIMEOUT) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(e);
            }
            Err(e) => {
                return Err(store_error(
                    &path,
                    format!("database thread: {}", chain(&e)),
                ));
            }
        }
        Ok(SqliteStore {
            path,
            jobs: Some(jobs),
            thread: Some(thread),
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the database thread and waits for its answer.
    fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = sync_channel(1);
        let job: Job = Box::new(move |conn| {
            let _ = tx.send(f(conn));
        });
        let sender = self
            .jobs
            .as_ref()
            .ok_or_else(|| store_error(&self.path, "the store is closed"))?;
        sender
            .send(job)
            .map_err(|_| store_error(&self.path, "the database thread has stopped"))?;
        rx.recv_timeout(JOB_TIMEOUT).map_err(|e| {
            store_error(
                &self.path,
                format!(
                    "no answer from the database thread within {JOB_TIMEOUT:?}: {}",
                    chain(&e)
                ),
            )
        })?
    }

    /// The session ids `sql` selects.
    fn query_ids(&self, sql: &'static str) -> Result<Vec<String>, StoreError> {
        let path = self.path.clone();
        self.run(move |conn| {
            let mut stmt = conn.prepare(sql).map_err(|e| db_error(&path, e))?;
            stmt.query_map([], |r| r.get::<_, String>(0))
                .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
                .map_err(|e| db_error(&path, e))
        })
    }

    fn where_(&self, id: &str) -> String {
        format!("{}#{id}", self.path.display())
    }

    /// Header line and event lines of `id` from `seq` on.
    fn rows(&self, id: &str, seq: u64) -> Result<(String, Vec<String>), StoreError> {
        let path = self.path.clone();
        let root = self.path.display().to_string();
        let id = id.to_owned();
        self.run(move |conn| {
            let header: Option<String> = conn
                .query_row("SELECT header FROM sessions WHERE id = ?1", [&id], |r| {
                    r.get(0)
                })
                .optional()
                .map_err(|e| db_error(&path, e))?;
            let Some(header) = header else {
                return Err(StoreError::NotFound(id, root));
            };
            let mut stmt = conn
                .prepare_cached(
                    "SELECT event FROM events WHERE session = ?1 AND seq >= ?2 ORDER BY seq",
                )
                .map_err(|e| db_error(&path, e))?;
            let events = stmt
                .query_map(params![id, seq as i64], |r| r.get::<_, String>(0))
                .and_then(|rows| rows.collect::<Result<Vec<_>, _>>())
                .map_err(|e| db_error(&path, e))?;
            Ok((header, events))
        })
    }
}

impl Drop for SqliteStore {
    fn drop(&mut self) {
        // Closing the channel ends the thread after the jobs already sent.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lines(events: &[Arc<SessionEvent>]) -> Vec<(i64, String)> {
    events.iter().map(|e| (e.seq as i64, e.to_line())).collect()
}

fn insert(
    tx: &rusqlite::Transaction<'_>,
    id: &str,
    rows: &[(i64, String)],
) -> rusqlite::Result<()> {
    let mut stmt =
        tx.prepare_cached("INSERT INTO events (session, seq, event) VALUES (?1, ?2, ?3)")?;
    for (seq, line) in rows {
        stmt.execute(params![id, seq, line])?;
    }
    Ok(())
}

impl SessionPersistence for SqliteStore {
    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn locate(&self, id: &str) -> String {
        self.where_(id)
    }

    fn create(
        &self,
        header: &SessionHeader,
        events: &[Arc<SessionEvent>],
    ) -> Result<(), StoreError> {
        let id = header.id.clone();
        let created_at = header.created_at as i64;
        let head = jsonl::render_header(header);
        let rows = lines(events);
        let path = self.path.clone();
        let at = self.where_(&id);
        self.run(move |conn| {
            let tx = conn.transaction().map_err(|e| db_error(&path, e))?;
            let exists: bool = tx
                .query_row("SELECT 1 FROM sessions WHERE id = ?1", [&id], |_| Ok(true))
                .optional()
                .map_err(|e| db_error(&path, e))?
                .unwrap_or(false);
            if exists {
                return Err(StoreError::Exists(at));
            }
            tx.execute(
                "INSERT INTO sessions (id, created_at, header) VALUES (?1, ?2, ?3)",
                params![id, created_at, head],
            )
            .map_err(|e| db_error(&path, e))?;
            insert(&tx, &id, &rows).map_err(|e| db_error(&path, e))?;
            tx.commit().map_err(|e| db_error(&path, e))
        })
    }

    fn append(&self, id: &str, events: &[Arc<SessionEvent>]) -> Result<(), StoreError> {
        let rows = lines(events);
        let id = id.to_owned();
        let path = self.path.clone();
        let root = self.path.display().to_string();
        self.run(move |conn| {
            let tx = conn.transaction().map_err(|e| db_error(&path, e))?;
            let next: Option<i64> = tx
                .query_row(
                    "SELECT (SELECT COALESCE(MAX(seq) + 1, 0) FROM events WHERE session = ?1)
                     FROM sessions WHERE id = ?1",
                    [&id],
                    |r| r.get(0),
                )
                .optional()
                .map_err(|e| db_error(&path, e))?;
            let Some(next) = next else {
                return Err(StoreError::NotFound(id, root));
            };
            if let Some((first, _)) = rows.first()
                && *first != next
            {
                return Err(store_error(
                    &path,
                    format!("append to `{id}` starts at seq {first} where {next} was expected"),
                ));
            }
            insert(&tx, &id, &rows).map_err(|e| db_error(&path, e))?;
            tx.commit().map_err(|e| db_error(&path, e))
        })
    }

    fn load(&self, id: &str) -> Result<Loaded, StoreError> {
        let (header, events) = self.rows(id, 0)?;
        load_parts(&header, &events).map_err(|error| StoreError::Load {
            path: self.where_(id),
            error,
        })
    }

    fn read_from(&self, id: &str, seq: u64) -> Result<Vec<SessionEvent>, StoreError> {
        let (_, rows) = self.rows(id, seq)?;
        let mut out = Vec::with_capacity(rows.len());
        let mut prev_time = 0;
        for (i, row) in rows.iter().enumerate() {
            let expected = seq + i as u64;
            let event = jsonl::parse_event(row, expected, prev_time).map_err(|reason| {
                StoreError::Load {
                    path: self.where_(id),
                    error: LoadError::Line {
                        line: expected as usize + 2,
                        reason: format!("event {expected}: {}", chain(&reason)),
                    },
                }
            })?;
            prev_time = event.time;
            out.push(event);
        }
        Ok(out)
    }

    fn ids(&self) -> Result<Vec<String>, StoreError> {
        self.query_ids("SELECT id FROM sessions")
    }

    fn list(&self) -> Result<Vec<Result<SessionSummary, StoreError>>, StoreError> {
        let ids = self.query_ids("SELECT id FROM sessions ORDER BY created_at DESC, id")?;
        Ok(ids
            .iter()
            .map(|id| self.load(id).map(|l| summarize(&l)))
            .collect())
    }

    fn prepare_resume(&self, _id: &str, _loaded: &Loaded) -> Result<(), StoreError> {
        // Transactions leave no torn rows to cut.
        Ok(())
    }

    fn lock_writer(&self, id: &str) -> Result<Option<super::WriterLock>, StoreError> {
        let dir = self.path.parent().unwrap_or(Path::new(".")).join("locks");
        super::WriterLock::take(super::lock::lock_path(&dir, id)?, id).map(Some)
    }
}
