//! The contract every [`SessionPersistence`] backend meets, run against
//! each backend on a real file or database.

use dsh_supervisors::error::chain;
use std::sync::Arc;

use dsh_services::llm::Message;
use dsh_services::persistence::{
    Compression, JsonlStore, SessionPersistence, SqliteStore, StoreError,
};
use dsh_services::session::{
    EventData, SessionEvent, SessionHeader, SessionLog, SurfaceIntent, TurnEndReason,
};

use dsh_supervisors::scratch::fresh_dir;

fn temp(name: &str) -> std::path::PathBuf {
    fresh_dir(&format!("dsh-contract-{name}")).unwrap()
}

/// A session of `turns` complete turns; with `open`, one more turn left
/// open after a tool call without its result (a crash mid-turn).
fn session(
    id: &str,
    created_at: u64,
    turns: u32,
    open: bool,
) -> (SessionHeader, Vec<Arc<SessionEvent>>) {
    let mut header = SessionHeader::new(id, Some("/work".into()));
    header.created_at = created_at;
    let mut log = SessionLog::new(header.clone());
    let mut at = created_at;
    let mut push = |log: &mut SessionLog, data: EventData, intent: Option<SurfaceIntent>| {
        at += 1;
        log.append(data, intent, at).unwrap();
    };
    for turn in 1..=turns + u32::from(open) {
        push(&mut log, EventData::TurnStart { turn }, None);
        push(&mut log, EventData::StepStart { turn, step: 1 }, None);
        let prompt = format!("prompt {turn} of {id}");
        push(
            &mut log,
            EventData::UserMessage(Arc::new(Message::user_text(prompt))),
            Some(SurfaceIntent::append()),
        );
        push(
            &mut log,
            EventData::tool_call(
                turn,
                1,
                &format!("call-{turn}"),
                "echo",
                "{\"text\":\"hi\"}",
            ),
            None,
        );
        if turn > turns {
            break;
        }
        push(&mut log, EventData::StepEnd { turn, step: 1 }, None);
        push(
            &mut log,
            EventData::TurnEnd {
                turn,
                reason: Box::new(TurnEndReason::Completed),
            },
            None,
        );
    }
    (header, log.iter().collect())
}

fn json(events: &[impl AsRef<SessionEvent>]) -> Vec<serde_json::Value> {
    events.iter().map(|e| e.as_ref().to_json()).collect()
}

/// The shared contract.
fn contract(store: &dyn SessionPersistence) {
    let backend = store.backend();
    // Create, then append in batches: load gives back exactly what was written.
    let (header, events) = session("first", 1_000, 3, false);
    store.create(&header, &events[..4]).unwrap();
    store.append("first", &events[4..9]).unwrap();
    store.append("first", &events[9..]).unwrap();
    let loaded = store.load("first").unwrap();
    assert_eq!(loaded.header, header, "{backend}: header");
    assert_eq!(json(&loaded.events), json(&events), "{backend}: events");
    assert_eq!(loaded.durable, events.len() as u64);
    assert!(loaded.repairs.is_empty() && loaded.torn_line.is_none());

    // Read from a seq without the events before it.
    let tail = store.read_from("first", 10).unwrap();
    assert_eq!(json(&tail), json(&events[10..]), "{backend}: read_from");
    assert!(store.read_from("first", 1_000).unwrap().is_empty());

    // An existing id is refused, and the stored session is untouched.
    match store.create(&header, &events[..1]) {
        Err(StoreError::Exists(_)) => {}
        other => panic!("{backend}: create over an existing session gave {other:?}"),
    }
    assert_eq!(store.load("first").unwrap().events.len(), events.len());

    // Unknown ids are typed errors.
    match store.load("missing") {
        Err(StoreError::NotFound(id, _)) => assert_eq!(id, "missing"),
        other => panic!("{backend}: load of a missing session gave {other:?}"),
    }

    // A session cut mid-turn loads repaired in memory; what is stored is
    // unchanged (the repair is written by whoever resumes it).
    let (h2, cut) = session("cut/with odd:chars ü", 2_000, 1, true);
    store.create(&h2, &cut).unwrap();
    let loaded = store.load(&h2.id).unwrap();
    assert_eq!(loaded.durable, cut.len() as u64);
    assert_eq!(
        loaded.repairs,
        vec![
            "call call-2 had no result: recorded TOOL_OUTCOME_UNKNOWN".to_owned(),
            "closed step 1 of turn 2".to_owned(),
            "closed turn 2 as interrupted".to_owned(),
        ],
        "{backend}: repairs"
    );
    match &loaded.events.last().unwrap().data {
        EventData::TurnEnd { turn: 2, reason } => assert_eq!(**reason, TurnEndReason::Interrupted),
        other => panic!("{backend}: last event {other:?}"),
    }
    assert_eq!(store.read_from(&h2.id, 0).unwrap().len(), cut.len());
    // Resuming writes the repairs after the stored events.
    store.prepare_resume(&h2.id, &loaded).unwrap();
    let repairs: Vec<_> = loaded.events[cut.len()..]
        .iter()
        .cloned()
        .map(Arc::new)
        .collect();
    store.append(&h2.id, &repairs).unwrap();
    let again = store.load(&h2.id).unwrap();
    assert!(again.repairs.is_empty(), "{backend}: {:?}", again.repairs);
    assert_eq!(again.durable, loaded.events.len() as u64);

    // Listing: newest first, with what a user picks a session by.
    let all: Vec<_> = store
        .list()
        .unwrap()
        .into_iter()
        .map(Result::unwrap)
        .collect();
    let ids: Vec<_> = all.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, vec![h2.id.as_str(), "first"], "{backend}: list order");
    assert_eq!(all[1].turns, 3);
    assert_eq!(all[1].events, events.len() as u64);
    assert_eq!(all[1].title, "prompt 1 of first");
    assert_eq!(store.inspect("first").unwrap(), all[1]);

    // A session is named by its id or by the start of one, when only one
    // id starts so (at least 4 characters).
    for id in ["abcd1234-aaaa", "abcd9999-bbbb", "ffff0000-cccc"] {
        let (h, e) = session(id, 3_000, 1, false);
        store.create(&h, &e).unwrap();
    }
    let resolved = |given: &str| dsh_services::persistence::resolve(store, given);
    assert_eq!(resolved("ffff0000-cccc").unwrap(), "ffff0000-cccc");
    assert_eq!(resolved("ffff").unwrap(), "ffff0000-cccc", "{backend}");
    assert_eq!(resolved("first").unwrap(), "first");
    match resolved("abcd") {
        Err(StoreError::Ambiguous { matches, .. }) => {
            assert_eq!(matches, ["abcd1234-aaaa", "abcd9999-bbbb"], "{backend}")
        }
        other => panic!("{backend}: an ambiguous start gave {other:?}"),
    }
    assert!(
        matches!(resolved("fff"), Err(StoreError::NotFound(..))),
        "{backend}: three characters name nothing"
    );
    assert!(matches!(resolved("zzzz"), Err(StoreError::NotFound(..))));
}

#[test]
fn the_jsonl_backend_meets_the_persistence_contract() {
    let dir = temp("jsonl");
    contract(&JsonlStore::new(&dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_zstd_jsonl_backend_meets_the_persistence_contract() {
    let dir = temp("zstd");
    contract(&JsonlStore::new(&dir).with_compression(Compression::Zstd));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A zstd session written as a header frame and three batch frames; returns
/// the store, the file, the events and the byte length after each frame.
fn framed(
    dir: &std::path::Path,
) -> (
    JsonlStore,
    std::path::PathBuf,
    Vec<Arc<SessionEvent>>,
    Vec<u64>,
) {
    let store = JsonlStore::new(dir).with_compression(Compression::Zstd);
    let (h, events) = session("z", 1, 3, false);
    store.create(&h, &[]).unwrap();
    let file = store.path("z").unwrap();
    let mut ends = vec![std::fs::metadata(&file).unwrap().len()];
    for batch in [&events[..5], &events[5..12], &events[12..]] {
        store.append("z", batch).unwrap();
        ends.push(std::fs::metadata(&file).unwrap().len());
    }
    (store, file, events, ends)
}

#[test]
fn a_zstd_log_cut_inside_its_last_frame_keeps_every_complete_frame() {
    let dir = temp("zstd-torn");
    let (store, file, events, ends) = framed(&dir);
    assert!(file.to_string_lossy().ends_with("session.jsonl.zstd"));
    let whole = std::fs::read(&file).unwrap();
    let durable_after = [0u64, 5, 12, events.len() as u64];
    // Every cut inside the last frame: the first two batches survive.
    for cut in ends[2] + 1..ends[3] {
        std::fs::write(&file, &whole[..cut as usize]).unwrap();
        let loaded = store.load("z").unwrap();
        assert_eq!(loaded.durable, durable_after[2], "cut at {cut}");
        assert_eq!(loaded.good_bytes, ends[2]);
        assert_eq!(loaded.torn_line, Some(13 + 1), "cut at {cut}");
    }
    // Resuming cuts the torn frame; appends go on after it.
    let loaded = store.load("z").unwrap();
    store.prepare_resume("z", &loaded).unwrap();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), ends[2]);
    store.append("z", &events[12..]).unwrap();
    let again = store.load("z").unwrap();
    assert!(again.torn_line.is_none() && again.repairs.is_empty());
    assert_eq!(json(&again.events), json(&events));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_complete_zstd_frame_is_refused_not_dropped() {
    let dir = temp("zstd-damage");
    let (store, file, _, ends) = framed(&dir);
    let mut bytes = std::fs::read(&file).unwrap();
    // A byte inside the second batch frame's compressed content.
    let at = ((ends[1] + ends[2]) / 2) as usize;
    bytes[at] ^= 0x55;
    std::fs::write(&file, &bytes).unwrap();
    let err = chain(&store.load("z").unwrap_err()).to_string();
    assert!(err.contains("is damaged"), "{err}");
    // A root holds one encoding: the uncompressed store names the file.
    let plain = JsonlStore::new(&dir);
    let err = chain(&plain.load("z").unwrap_err()).to_string();
    assert!(
        err.contains("session.jsonl.zstd is a zstd session log"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn jsonl_create_is_all_or_nothing_and_ids_stay_inside_the_root() {
    let dir = temp("jsonl-ids");
    let store = JsonlStore::new(dir.join("sessions"));
    for bad in ["", ".", ".."] {
        assert!(
            matches!(store.path(bad), Err(StoreError::BadId(_))),
            "{bad:?}"
        );
    }
    // Ids that differ only in characters a path cannot hold stay apart.
    let (a, ea) = session("a/b", 1, 1, false);
    let (b, eb) = session("a%2Fb", 2, 2, false);
    store.create(&a, &ea).unwrap();
    store.create(&b, &eb).unwrap();
    assert_eq!(store.load("a/b").unwrap().events.len(), ea.len());
    assert_eq!(store.load("a%2Fb").unwrap().events.len(), eb.len());
    for p in [store.path("a/b").unwrap(), store.path("a%2Fb").unwrap()] {
        assert!(p.starts_with(dir.join("sessions")), "{}", p.display());
        // No half-written file is left beside the log.
        assert!(!p.with_extension("jsonl.part").exists());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_sqlite_backend_meets_the_persistence_contract() {
    let dir = temp("sqlite");
    let db = dir.join("sessions.db");
    contract(&SqliteStore::open(&db).unwrap());
    // Reopened, everything is still there.
    let store = SqliteStore::open(&db).unwrap();
    assert_eq!(store.list().unwrap().len(), 5);
    assert_eq!(store.load("first").unwrap().events.len(), 18);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sqlite_refuses_gaps_duplicates_and_foreign_files_with_the_reason() {
    let dir = temp("sqlite-refusals");
    let db = dir.join("sessions.db");
    let store = SqliteStore::open(&db).unwrap();
    let (h, events) = session("s", 1, 2, false);
    store.create(&h, &events[..3]).unwrap();
    // A gap or a repeated seq is refused and changes nothing.
    let gap = chain(&store.append("s", &events[4..]).unwrap_err()).to_string();
    assert!(
        gap.contains("starts at seq 4 where 3 was expected"),
        "{gap}"
    );
    store.append("s", &events[3..5]).unwrap();
    let again = chain(&store.append("s", &events[3..5]).unwrap_err()).to_string();
    assert!(
        again.contains("starts at seq 3 where 5 was expected"),
        "{again}"
    );
    assert_eq!(store.load("s").unwrap().events.len(), 5 + 2); // repaired in memory
    assert_eq!(store.read_from("s", 0).unwrap().len(), 5);
    assert!(matches!(
        store.append("nope", &events[..1]),
        Err(StoreError::NotFound(..))
    ));
    drop(store);
    // A file that is not a database is refused at open, naming it.
    let junk = dir.join("junk.db");
    std::fs::write(
        &junk,
        b"this is not sqlite, just text that is long enough to have a header page",
    )
    .unwrap();
    let err = chain(&SqliteStore::open(&junk).unwrap_err()).to_string();
    assert!(
        err.contains("junk.db") && err.contains("not a database"),
        "{err}"
    );
    // A schema written by a newer dsh is refused with the direction.
    {
        let conn = rusqlite::Connection::open(dir.join("newer.db")).unwrap();
        conn.execute_batch("PRAGMA user_version = 99").unwrap();
    }
    let err = chain(&SqliteStore::open(dir.join("newer.db")).unwrap_err()).to_string();
    assert!(
        err.contains("schema version 99 was written by a newer dsh"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

mod sqlite_props {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

        /// Arbitrary bytes as the database file: open or load gives a typed
        /// error or a valid session, never a panic.
        #[test]
        fn arbitrary_database_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..8192)) {
            let dir = temp("sqlite-bytes");
            let db = dir.join("s.db");
            std::fs::write(&db, &bytes).unwrap();
            if let Ok(store) = SqliteStore::open(&db)
                && let Ok(all) = store.list()
            {
                for s in all.into_iter().flatten() {
                    let _ = store.load(&s.id);
                }
            }
            let _ = std::fs::remove_dir_all(&dir);
        }

        /// Arbitrary bytes as a zstd transcript: a typed error or a valid
        /// (possibly repaired) session, never a panic.
        #[test]
        fn arbitrary_zstd_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let dir = temp("zstd-bytes");
            let store = JsonlStore::new(&dir).with_compression(Compression::Zstd);
            let file = store.path("z").unwrap();
            std::fs::create_dir_all(file.parent().unwrap()).unwrap();
            std::fs::write(&file, &bytes).unwrap();
            let _ = store.load("z");
            let _ = store.list();
            let _ = std::fs::remove_dir_all(&dir);
        }

        /// A real database with bytes overwritten anywhere (disk damage):
        /// a typed error or a valid session, never a panic.
        #[test]
        fn damaged_database_files_never_panic(
            hits in proptest::collection::vec((any::<proptest::sample::Index>(), any::<u8>()), 1..24)
        ) {
            let dir = temp("sqlite-damage");
            let db = dir.join("s.db");
            let store = SqliteStore::open(&db).unwrap();
            let (h, events) = session("s", 1, 3, true);
            store.create(&h, &events).unwrap();
            drop(store);
            let mut bytes = std::fs::read(&db).unwrap();
            for (at, value) in &hits {
                let i = at.index(bytes.len());
                bytes[i] = *value;
            }
            std::fs::write(&db, &bytes).unwrap();
            if let Ok(store) = SqliteStore::open(&db) {
                if let Ok(loaded) = store.load("s") {
                    prop_assert!(loaded.durable <= events.len() as u64);
                }
                let _ = store.list();
            }
            let _ = std::fs::remove_dir_all(&dir);
        }

        /// Arbitrary text in a stored event row (a damaged or hand-edited
        /// database): load and read_from give a typed error or a valid
        /// session, never a panic, and never more events than rows.
        #[test]
        fn arbitrary_event_rows_never_panic(row in any::<String>(), at in 0usize..6) {
            let dir = temp("sqlite-rows");
            let db = dir.join("s.db");
            let store = SqliteStore::open(&db).unwrap();
            let (h, events) = session("s", 1, 1, false);
            store.create(&h, &events).unwrap();
            drop(store);
            {
                let conn = rusqlite::Connection::open(&db).unwrap();
                conn.execute(
                    "UPDATE events SET event = ?1 WHERE session = 's' AND seq = ?2",
                    rusqlite::params![row, at as i64],
                ).unwrap();
            }
            let store = SqliteStore::open(&db).unwrap();
            if let Ok(loaded) = store.load("s") {
                prop_assert!(loaded.durable <= events.len() as u64);
            }
            if let Ok(tail) = store.read_from("s", 0) {
                prop_assert!(tail.len() <= events.len());
            }
            drop(store);
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

/// A log cut at every byte (a crash in any write), then resumed: load
/// keeps the whole lines before the cut, an append after the resume lands
/// on its own line, and the log loads again with exactly those events. A
/// last line without its newline is torn even when it is whole JSON (the
/// case that glued the next append onto it).
#[test]
fn a_log_cut_at_every_byte_resumes_and_loads_again() {
    let (header, events) = session("cut", 1_000, 2, false);
    let whole = dsh_services::session::jsonl::render(&header, &events);
    let bytes = whole.as_bytes();
    let dir = temp("cut");
    let header_end = whole.find('\n').unwrap() + 1;
    for cut in 0..=bytes.len() {
        let store = JsonlStore::new(dir.join(cut.to_string()));
        let file = store.path("cut").unwrap();
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        std::fs::write(&file, &bytes[..cut]).unwrap();
        let loaded = match store.load("cut") {
            Ok(l) => l,
            Err(e) => {
                // Only a cut inside the header line leaves nothing to load.
                assert!(cut < header_end, "cut at {cut}: {e}");
                continue;
            }
        };
        let whole_lines = bytes[..cut].iter().filter(|b| **b == b'\n').count();
        assert_eq!(
            loaded.durable as usize,
            whole_lines - 1,
            "cut at {cut}: the whole lines after the header"
        );
        assert_eq!(
            loaded.torn_line.is_some(),
            cut > 0 && bytes[cut - 1] != b'\n',
            "cut at {cut}"
        );
        store.prepare_resume("cut", &loaded).unwrap();
        let mut next = (*events[0]).clone();
        next.seq = loaded.durable;
        store.append("cut", &[Arc::new(next)]).unwrap();
        let again = store
            .load("cut")
            .unwrap_or_else(|e| panic!("cut at {cut}: {e}"));
        assert_eq!(again.durable, loaded.durable + 1, "cut at {cut}");
        assert_eq!(again.torn_line, None, "cut at {cut}");
        assert_eq!(
            json(&again.events[..loaded.durable as usize]),
            json(&events[..loaded.durable as usize]),
            "cut at {cut}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A byte that is not UTF-8 inside one event's text keeps the session (the
/// byte is read as U+FFFD, the line named); one in the JSON structure names
/// its line.
#[test]
fn a_bad_byte_is_named_by_its_line_and_spares_the_rest() {
    let (header, events) = session("bytes", 1_000, 1, false);
    let whole = dsh_services::session::jsonl::render(&header, &events);
    let dir = temp("bytes");
    let store = JsonlStore::new(&dir);
    let file = store.path("bytes").unwrap();
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let line = whole
        .lines()
        .position(|l| l.contains("prompt 1 of bytes"))
        .unwrap();
    let mut bytes = whole.clone().into_bytes();
    let at = whole.find("prompt 1 of bytes").unwrap();
    bytes[at] = 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let loaded = store.load("bytes").unwrap();
    assert_eq!(loaded.durable as usize, events.len());
    let note = format!("line {}: bytes that are not UTF-8", line + 1);
    assert!(
        loaded.repairs.iter().any(|r| r.starts_with(&note)),
        "{:?}",
        loaded.repairs
    );
    // In the structure: refused, with the line.
    let mut bytes = whole.clone().into_bytes();
    let structure = whole.find("\n{\"type\"").unwrap() + 1;
    bytes[structure] = 0xff;
    std::fs::write(&file, &bytes).unwrap();
    let err = chain(&store.load("bytes").unwrap_err()).to_string();
    assert!(err.contains("line 2"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A session's folder appears with its file or not at all: what a crash
/// mid-creation leaves (a staging folder) is never listed, and a folder an
/// older version left empty does not block the id.
#[test]
fn a_session_folder_appears_whole_or_not_at_all() {
    let dir = temp("whole");
    let store = JsonlStore::new(&dir);
    let (header, events) = session("whole", 1_000, 1, false);
    store.create(&header, &events).unwrap();
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["whole"]);
    // A crash between the folder and its file, as staging leaves it.
    let staged = dir.join("+crashed+1+0");
    std::fs::create_dir(&staged).unwrap();
    std::fs::write(staged.join("session.jsonl"), "{\"type\":\"session\"").unwrap();
    let listed: Vec<String> = store
        .list()
        .unwrap()
        .into_iter()
        .map(|s| s.unwrap().id)
        .collect();
    assert_eq!(listed, ["whole"]);
    // An empty folder under the id (an older version's crash) is replaced.
    std::fs::create_dir(dir.join("left-empty")).unwrap();
    let (header, events) = session("left-empty", 2_000, 1, false);
    store.create(&header, &events).unwrap();
    assert_eq!(
        store.load("left-empty").unwrap().durable as usize,
        events.len()
    );
    assert!(matches!(
        store.create(&header, &events),
        Err(StoreError::Exists(_))
    ));
    let _ = std::fs::remove_dir_all(&dir);
}
