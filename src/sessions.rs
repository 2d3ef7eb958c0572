//! `dsh sessions list|show|fork|export` and where sessions live.

use std::path::PathBuf;

use std::sync::Arc;

use dsh_services::persistence::{
    Compression, JsonlStore, SessionPersistence, SqliteStore, resolve,
};
use dsh_services::session::compare::shape;
use dsh_services::session::{SessionHeader, SessionLog, jsonl};
use dsh_supervisors::error::chain;

use crate::args::StoreArgs;
use crate::exit::{self, Exit};

/// `dsh sessions`: the options.
#[derive(clap::Args, Debug)]
pub struct SessionsArgs {
    #[command(subcommand)]
    what: SessionsCommand,
    #[command(flatten)]
    store: StoreArgs,
}

#[derive(clap::Subcommand, Debug)]
enum SessionsCommand {
    /// Every stored session, newest first.
    List {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// A session's header, repairs and turns.
    Show {
        /// Session id.
        id: String,
    },
    /// A new session seeded with the events through `--at` (a turn boundary).
    Fork {
        /// Session id.
        id: String,
        /// Last seq to include (default: the whole log).
        #[arg(long)]
        at: Option<u64>,
    },
    /// The session log (repaired) as JSONL on stdout.
    Export {
        /// Session id.
        id: String,
    },
}

/// Runs a `dsh sessions` subcommand.
pub fn sessions(args: SessionsArgs) -> Exit {
    let store = match open_store(&args.store) {
        Ok(s) => s,
        Err(e) => return e,
    };
    let store = &*store;
    Exit::from(match args.what {
        SessionsCommand::List { json } => list(store, json),
        SessionsCommand::Show { id } => show(store, &id),
        SessionsCommand::Fork { id, at } => fork(store, &id, at),
        SessionsCommand::Export { id } => export(store, &id),
    })
}

/// The sessions directory: `--sessions-dir`, else `$DSH_SESSIONS_DIR`, else
/// `$HOME/.dsh/sessions`.
pub fn sessions_dir(given: Option<PathBuf>) -> PathBuf {
    given
        .or_else(|| std::env::var_os("DSH_SESSIONS_DIR").map(PathBuf::from))
        .unwrap_or_else(|| crate::home::dir().join("sessions"))
}

/// The session store: the SQLite database `--sessions-db` (else
/// `$DSH_SESSIONS_DB` when no JSONL flag is given), else the JSONL
/// directory of [`sessions_dir`].
pub fn open_store(choice: &StoreArgs) -> exit::Result<Arc<dyn SessionPersistence>> {
    let db = choice.db.clone().or_else(|| {
        (choice.dir.is_none() && !choice.zstd)
            .then(|| std::env::var_os("DSH_SESSIONS_DB").map(PathBuf::from))
            .flatten()
    });
    match db {
        Some(db) => match SqliteStore::open(&db) {
            Ok(s) => Ok(Arc::new(s)),
            Err(e) => Err(Exit::usage(format!(
                "cannot open the sessions database: {}",
                chain(&e)
            ))),
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

/// `dsh sessions list`.
fn list(store: &dyn SessionPersistence, json: bool) -> exit::Result<()> {
    let all = store.list()?;
    for entry in all {
        match entry {
            Ok(s) if json => crate::outln!("{}", serde_json::to_string(&s).unwrap_or_default()),
            Ok(s) => crate::outln!(
                "{}  turns={:<3} events={:<6} {}{}",
                s.id,
                s.turns,
                s.events,
                s.parent_session
                    .map(|p| format!("(fork of {p}) "))
                    .unwrap_or_default(),
                s.title
            ),
            Err(e) => crate::errln!("unreadable: {}", chain(&e)),
        }
    }
    Ok(())
}

/// `dsh sessions show <id>`: header, repairs, and each turn's shape.
fn show(store: &dyn SessionPersistence, id: &str) -> exit::Result<()> {
    let id = &resolve(store, id)?;
    let loaded = store.load(id)?;
    let h = &loaded.header;
    crate::outln!(
        "session {}  created_at={}  cwd={}",
        h.id,
        h.created_at,
        h.cwd.as_deref().unwrap_or("-")
    );
    if let Some(p) = &h.parent_session {
        crate::outln!(
            "forked from {p} after {} events",
            h.seed_length.unwrap_or(0)
        );
    }
    if let Some(line) = loaded.torn_line {
        crate::outln!("line {line} is a torn write and was left out");
    }
    for r in &loaded.repairs {
        crate::outln!("repair: {r}");
    }
    for t in shape(&loaded.events) {
        let calls: Vec<String> = t.calls.iter().map(|(n, _)| n.clone()).collect();
        let text: String = t.final_text.chars().take(80).collect();
        crate::outln!(
            "turn {}: {} steps, ended {}, tools [{}]: {}",
            t.turn,
            t.steps,
            t.end,
            calls.join(", "),
            text
        );
    }
    Ok(())
}

/// `dsh sessions export <id>`: the log (repaired) as JSONL on stdout.
fn export(store: &dyn SessionPersistence, id: &str) -> exit::Result<()> {
    let id = &resolve(store, id)?;
    let l = store.load(id)?;
    crate::out!("{}", jsonl::render(&l.header, &l.events));
    Ok(())
}

/// `dsh sessions fork <id> [--at SEQ]`: a new session seeded with the
/// events through `at` (default: all), which must end outside a turn.
fn fork(store: &dyn SessionPersistence, id: &str, at: Option<u64>) -> exit::Result<()> {
    crate::outln!("{}", fork_session(store, id, at)?);
    Ok(())
}

/// Copies session `id` (its id, or the start of it) through event seq `at`
/// (default: all) into a new session whose parent it is; returns the new
/// id.
pub fn fork_session(
    store: &dyn SessionPersistence,
    id: &str,
    at: Option<u64>,
) -> exit::Result<String> {
    let id = &resolve(store, id)?;
    let loaded = store.load(id)?;
    let last = loaded.events.len() as u64;
    let log = SessionLog::from_seed(loaded.header.clone(), loaded.events, 0)
        .map_err(|e| Exit::usage(format!("{id}: {}", chain(&e))))?;
    let boundary = at.unwrap_or(last.saturating_sub(1));
    let prefix = log
        .fork_prefix(Some(boundary))
        .map_err(|e| Exit::usage(chain(&e).to_string()))?;
    let mut header = SessionHeader::new(
        dsh_services::llm::Message::new_id(),
        loaded.header.cwd.clone(),
    );
    header.parent_session = Some(id.to_owned());
    header.seed_length = Some(prefix.len() as u64);
    header.delegation_depth = loaded.header.delegation_depth;
    let prefix: Vec<_> = prefix.into_iter().map(std::sync::Arc::new).collect();
    store.create(&header, &prefix)?;
    Ok(header.id)
}
