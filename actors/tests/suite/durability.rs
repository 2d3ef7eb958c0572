//! The session actor's flush checkpoint against a real JSONL store: a
//! failed write keeps its events and is retried, and disposal drains.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

use dsh_actors::session::{FlushError, SessionHandle};
use dsh_services::llm::Message;
use dsh_services::persistence::{
    JsonlStore, Loaded, SessionPersistence, SessionSummary, StoreError,
};
use dsh_services::session::{EventData, SessionEvent, SessionHeader, SessionLog, SurfaceIntent};
use dsh_supervisors::error::chain;
use dsh_supervisors::{Runtime, RuntimeSettings};

/// A JSONL store whose writes fail, as on a full disk, while `broken`.
#[derive(Debug)]
struct Flaky {
    inner: JsonlStore,
    broken: AtomicBool,
    failed: AtomicU32,
}

impl Flaky {
    fn gate(&self) -> Result<(), StoreError> {
        if !self.broken.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.failed.fetch_add(1, Ordering::SeqCst);
        Err(StoreError::Io {
            path: "flaky".into(),
            error: std::io::Error::other("no space left on device (injected)"),
        })
    }
}

impl SessionPersistence for Flaky {
    fn backend(&self) -> &'static str {
        "flaky-jsonl"
    }
    fn locate(&self, id: &str) -> String {
        self.inner.locate(id)
    }
    fn create(&self, h: &SessionHeader, e: &[Arc<SessionEvent>]) -> Result<(), StoreError> {
        self.gate()?;
        self.inner.create(h, e)
    }
    fn append(&self, id: &str, e: &[Arc<SessionEvent>]) -> Result<(), StoreError> {
        self.gate()?;
        self.inner.append(id, e)
    }
    fn load(&self, id: &str) -> Result<Loaded, StoreError> {
        self.inner.load(id)
    }
    fn read_from(&self, id: &str, seq: u64) -> Result<Vec<SessionEvent>, StoreError> {
        self.inner.read_from(id, seq)
    }
    fn list(&self) -> Result<Vec<Result<SessionSummary, StoreError>>, StoreError> {
        self.inner.list()
    }
    fn prepare_resume(&self, id: &str, l: &Loaded) -> Result<(), StoreError> {
        self.inner.prepare_resume(id, l)
    }
}

fn user(n: u32) -> EventData {
    EventData::UserMessage(Arc::new(Message::user_text(format!("message {n}"))))
}

fn texts(store: &JsonlStore, id: &str) -> Vec<String> {
    store
        .load(id)
        .unwrap()
        .events
        .iter()
        .map(|e| match &e.data {
            EventData::UserMessage(m) => m.text(),
            other => panic!("unexpected {other:?}"),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_keeps_its_events_and_disposal_drains_the_rest() {
    let dir = dsh_supervisors::scratch::fresh_dir("dsh-durability").unwrap();
    let inner = JsonlStore::new(&dir);
    let store = Arc::new(Flaky {
        inner: inner.clone(),
        broken: AtomicBool::new(true),
        failed: AtomicU32::new(0),
    });
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let session = SessionHandle::new(SessionLog::new(SessionHeader::new("s-flaky", None)));
    session
        .attach(
            &rt.root(),
            Some(store.clone() as Arc<dyn SessionPersistence>),
        )
        .await
        .unwrap();
    for n in 0..3 {
        session
            .append(user(n), Some(SurfaceIntent::append()))
            .unwrap();
    }
    // While the disk is full, writes (the first one creating the session)
    // fail; nothing is half-written and nothing is dropped.
    let first = session.flush().await.unwrap_err();
    assert!(matches!(first, FlushError::Store(_)), "{first}");
    assert!(
        chain(&first)
            .to_string()
            .contains("no space left on device"),
        "{first}"
    );
    assert!(inner.load("s-flaky").is_err());
    session
        .append(user(3), Some(SurfaceIntent::append()))
        .unwrap();
    session.flush().await.unwrap_err();
    assert!(inner.load("s-flaky").is_err());
    store.broken.store(false, Ordering::SeqCst);
    session.flush().await.unwrap();
    assert_eq!(
        texts(&inner, "s-flaky"),
        ["message 0", "message 1", "message 2", "message 3"]
    );
    // Later events are appended once each; stopping the tree drains them
    // without an explicit flush.
    for n in 4..7 {
        session
            .append(user(n), Some(SurfaceIntent::append()))
            .unwrap();
    }
    rt.shutdown().await;
    let all = texts(&inner, "s-flaky");
    assert_eq!(all.len(), 7);
    assert_eq!(all.last().unwrap(), "message 6");
    assert!(store.failed.load(Ordering::SeqCst) >= 2);
    let _ = std::fs::remove_dir_all(&dir);
}
