//! The session benchmarks: `derive_messages` as history grows, and
//! persistence throughput.

use std::sync::Arc;
use std::time::Instant;

use dsh_supervisors::{BoxError, Runtime, RuntimeSettings};

/// `derive_messages` cost as history grows: the time to append one message
/// and derive the history again, at several history sizes. Incremental
/// derivation keeps it flat per new node.
pub fn derive_costs(sizes: &[usize]) -> serde_json::Value {
    use dsh_services::llm::Message;
    use dsh_services::session::{EventData, SessionHeader, SessionLog, SurfaceIntent};
    let mut log = SessionLog::new(SessionHeader::new("bench-derive", None));
    let prompt = Arc::new(Message::user_text("x"));
    let mut out = serde_json::Map::new();
    let mut at = 0usize;
    for &size in sizes {
        while at < size {
            let _ = log.append(
                EventData::UserMessage(prompt.clone()),
                Some(SurfaceIntent::append()),
                0,
            );
            at += 1;
        }
        let _ = log.derive_messages();
        // Measure: one append + one derive, repeated.
        let rounds = 2_000usize;
        let t = Instant::now();
        for _ in 0..rounds {
            let _ = log.append(
                EventData::UserMessage(prompt.clone()),
                Some(SurfaceIntent::append()),
                0,
            );
            std::hint::black_box(log.derive_messages());
        }
        at += rounds;
        let ns = t.elapsed().as_secs_f64() * 1e9 / rounds as f64;
        dsh::outln!(
            "history of {size:>7} messages: append + derive_messages {ns:.0} ns per new message"
        );
        out.insert(size.to_string(), ns.into());
    }
    let result = serde_json::json!({"workload": "derive", "ns_per_new_message_at_size": out});
    dsh::outln!("RESULT {result}");
    result
}

/// `dsh bench persist`: append throughput to a JSONL session (batched by the
/// session actor, timed until flushed) and load + derive time of the result.
pub async fn persist(events: u64, backend: &str) -> Result<serde_json::Value, BoxError> {
    use dsh_actors::session::SessionHandle;
    use dsh_services::llm::{Message, StreamChunk};
    use dsh_services::persistence::{Compression, JsonlStore, SessionPersistence, SqliteStore};
    use dsh_services::session::{EventData, SessionHeader, SessionLog, SurfaceIntent};

    let root = dsh_supervisors::scratch::fresh_dir("dsh-bench-persist")?;
    let store: Arc<dyn SessionPersistence> = match backend {
        "jsonl" => Arc::new(JsonlStore::new(&root)),
        "jsonl-zstd" => Arc::new(JsonlStore::new(&root).with_compression(Compression::Zstd)),
        "sqlite" => Arc::new(SqliteStore::open(root.join("sessions.db"))?),
        other => {
            return Err(format!("unknown backend `{other}` (jsonl, jsonl-zstd or sqlite)").into());
        }
    };
    let id = Message::new_id();
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let session = SessionHandle::new(SessionLog::new(SessionHeader::new(id.clone(), None)));
    session.attach(&rt.root(), Some(store.clone())).await?;
    let prompt = Arc::new(Message::user_text(
        "a prompt of a realistic length, about one line of text",
    ));
    let t = Instant::now();
    for i in 0..events {
        if i % 5 == 0 {
            session.append(
                EventData::UserMessage(prompt.clone()),
                Some(SurfaceIntent::append()),
            )?;
        } else {
            let chunk = StreamChunk::TextDelta {
                index: 0,
                text: "token ".into(),
            };
            session.append(
                EventData::AssistantChunk {
                    turn: 1,
                    step: 1,
                    chunk: Box::new(chunk),
                },
                None,
            )?;
        }
    }
    session.flush().await?;
    let append_s = t.elapsed().as_secs_f64();
    rt.shutdown().await;
    let bytes = disk_usage(&root)?;
    // Five loads; the median is reported (the first one also pays for
    // reading the file into the page cache).
    let mut load_ms = Vec::new();
    let (mut count, mut messages) = (0, 0);
    for _ in 0..5 {
        let t = Instant::now();
        let loaded = store.load(&id)?;
        count = loaded.events.len();
        let mut log = SessionLog::from_seed(loaded.header, loaded.events, 0)?;
        messages = log.derive_messages().len();
        load_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    load_ms.sort_by(f64::total_cmp);
    let (load_min, load_ms) = (load_ms[0], load_ms[2]);
    let _ = std::fs::remove_dir_all(&root);
    if count as u64 != events || messages as u64 != events.div_ceil(5) {
        return Err(format!(
            "loaded {count} events and {messages} messages from {events} appended"
        )
        .into());
    }
    let per_s = events as f64 / append_s;
    dsh::outln!(
        "{backend} append: {events} events in {:.1} ms = {per_s:.0} events/s flushed ({bytes} bytes; aim >= 200000/s)",
        append_s * 1e3
    );
    dsh::outln!(
        "{backend} load + derive of {events} events: median {load_ms:.1} ms, min {load_min:.1} ms of 5 (aim < 300 ms)"
    );
    Ok(serde_json::json!({
        "workload": "persist",
        "backend": backend,
        "events": events,
        "append_events_per_s": per_s,
        "bytes": bytes,
        "load_derive_ms": load_ms,
        "load_derive_min_ms": load_min,
    }))
}

/// Bytes of every file under `dir`.
fn disk_usage(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            disk_usage(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}
