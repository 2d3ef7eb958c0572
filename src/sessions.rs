//! `dsh sessions list|show|fork|export` and where sessions live.

use std::path::PathBuf;

use std::sync::Arc;

use dsh_services::persistence::{
    Compression, JsonlStore, SessionPersistence, SqliteStore, StoreError,
};
use dsh_services::session::compare::shape;
use dsh_services::session::{SessionHeader, SessionLog, jsonl};

use crate::run::RunExit;

/// The sessions directory: `--sessions-dir`, else `$DSH_SESSIONS_DIR`, else
/// `$HOME/.dsh/sessions`.
pub fn sessions_dir(given: Option<PathBuf>) -> PathBuf {
    given
        .or_else(|| std::env::var_os("DSH_SESSIONS_DIR").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".dsh/sessions")))
        .unwrap_or_else(|| PathBuf::from(".dsh/sessions"))
}

/// Where sessions are stored, as `dsh run` and `dsh sessions` take it.
#[derive(Clone, Debug, Default, clap::Args)]
pub struct StoreChoice {
    /// Where sessions are stored (default $DSH_SESSIONS_DIR or ~/.dsh/sessions).
    #[arg(long = "sessions-dir", value_name = "DIR", global = true)]
    pub dir: Option<PathBuf>,
    /// Sessions in this SQLite database instead (default $DSH_SESSIONS_DB).
    #[arg(
        long = "sessions-db",
        value_name = "FILE",
        global = true,
        conflicts_with = "dir"
    )]
    pub db: Option<PathBuf>,
    /// JSONL sessions stored as Zstandard frames (`session.jsonl.zstd`).
    #[arg(long, global = true, conflicts_with = "db")]
    pub zstd: bool,
}

impl StoreChoice {
    /// Whether any flag named a store.
    pub fn named(&self) -> bool {
        self.dir.is_some() || self.db.is_some() || self.zstd
    }
}

/// The session store: the SQLite database `--sessions-db` (else
/// `$DSH_SESSIONS_DB` when no JSONL flag is given), else the JSONL
/// directory of [`sessions_dir`].
pub fn open_store(choice: &StoreChoice) -> Result<Arc<dyn SessionPersistence>, RunExit> {
    let db = choice.db.clone().or_else(|| {
        (choice.dir.is_none() && !choice.zstd)
            .then(|| std::env::var_os("DSH_SESSIONS_DB").map(PathBuf::from))
            .flatten()
    });
    match db {
        Some(db) => match SqliteStore::open(&db) {
            Ok(s) => Ok(Arc::new(s)),
            Err(e) => Err(RunExit {
                code: 2,
                message: Some(format!("cannot open the sessions database: {e}")),
            }),
        },
        None => Ok(Arc::new(
            JsonlStore::new(sessions_dir(choice.dir.clone())).with_compression(if choice.zstd {
                Compression::Zstd
            } else {
                Compression::None
            }),
        )),
    }
}

fn fail(e: StoreError) -> RunExit {
    let code = match e {
        StoreError::NotFound(..)
        | StoreError::BadId(_)
        | StoreError::Exists(_)
        | StoreError::Encoding { .. }
        | StoreError::Load { .. } => 2,
        StoreError::Io { .. } => 1,
    };
    RunExit {
        code,
        message: Some(e.to_string()),
    }
}

/// `dsh sessions list`.
pub fn list(store: &dyn SessionPersistence, json: bool) -> RunExit {
    let all = match store.list() {
        Ok(v) => v,
        Err(e) => return fail(e),
    };
    for entry in all {
        match entry {
            Ok(s) if json => println!("{}", serde_json::to_string(&s).unwrap_or_default()),
            Ok(s) => println!(
                "{}  turns={:<3} events={:<6} {}{}",
                s.id,
                s.turns,
                s.events,
                s.parent_session
                    .map(|p| format!("(fork of {p}) "))
                    .unwrap_or_default(),
                s.title
            ),
            Err(e) => eprintln!("unreadable: {e}"),
        }
    }
    RunExit {
        code: 0,
        message: None,
    }
}

/// `dsh sessions show <id>`: header, repairs, and each turn's shape.
pub fn show(store: &dyn SessionPersistence, id: &str) -> RunExit {
    let loaded = match store.load(id) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let h = &loaded.header;
    println!(
        "session {}  created_at={}  cwd={}",
        h.id,
        h.created_at,
        h.cwd.as_deref().unwrap_or("-")
    );
    if let Some(p) = &h.parent_session {
        println!(
            "forked from {p} after {} events",
            h.seed_length.unwrap_or(0)
        );
    }
    if let Some(line) = loaded.torn_line {
        println!("line {line} is a torn write and was left out");
    }
    for r in &loaded.repairs {
        println!("repair: {r}");
    }
    for t in shape(&loaded.events) {
        let calls: Vec<String> = t.calls.iter().map(|(n, _)| n.clone()).collect();
        let text: String = t.final_text.chars().take(80).collect();
        println!(
            "turn {}: {} steps, ended {}, tools [{}]: {}",
            t.turn,
            t.steps,
            t.end,
            calls.join(", "),
            text
        );
    }
    RunExit {
        code: 0,
        message: None,
    }
}

/// `dsh sessions export <id>`: the log (repaired) as JSONL on stdout.
pub fn export(store: &dyn SessionPersistence, id: &str) -> RunExit {
    match store.load(id) {
        Ok(l) => {
            print!("{}", jsonl::render(&l.header, &l.events));
            RunExit {
                code: 0,
                message: None,
            }
        }
        Err(e) => fail(e),
    }
}

/// `dsh sessions fork <id> [--at SEQ]`: a new session seeded with the
/// events through `at` (default: all), which must end outside a turn.
pub fn fork(store: &dyn SessionPersistence, id: &str, at: Option<u64>) -> RunExit {
    let loaded = match store.load(id) {
        Ok(l) => l,
        Err(e) => return fail(e),
    };
    let last = loaded.events.len() as u64;
    let log = match SessionLog::from_seed(loaded.header.clone(), loaded.events, 0) {
        Ok(l) => l,
        Err(e) => {
            return RunExit {
                code: 2,
                message: Some(format!("{id}: {e}")),
            };
        }
    };
    let boundary = at.unwrap_or(last.saturating_sub(1));
    let prefix = match log.fork_prefix(Some(boundary)) {
        Ok(p) => p,
        Err(e) => {
            return RunExit {
                code: 2,
                message: Some(e.to_string()),
            };
        }
    };
    let mut header = SessionHeader::new(
        dsh_services::llm::Message::new_id(),
        loaded.header.cwd.clone(),
    );
    header.parent_session = Some(id.to_owned());
    header.seed_length = Some(prefix.len() as u64);
    header.delegation_depth = loaded.header.delegation_depth;
    let prefix: Vec<_> = prefix.into_iter().map(std::sync::Arc::new).collect();
    match store.create(&header, &prefix) {
        Ok(_) => {
            println!("{}", header.id);
            RunExit {
                code: 0,
                message: None,
            }
        }
        Err(e) => fail(e),
    }
}
