//! The session actor and the handle appends go through.
//!
//! The log itself ([`SessionLog`]) sits behind a short mutex in the handle,
//! so an append is a validation and a push, never a mailbox round trip on
//! the agent's hot path. After the commit point the handle notifies the
//! observers (each behind a panic boundary) and casts the committed event
//! to the session's actor, which owns durability: it buffers JSONL lines and
//! writes them off the async workers, and drains its buffer before it stops.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use dsh_services::llm::History;
use dsh_services::persistence::{SessionPersistence, StoreError, WriterLock};
use dsh_services::session::compact::{CompactError, CompactLog};
use dsh_services::session::{
    EventData, SessionError, SessionEvent, SessionHeader, SessionLog, SurfaceIntent,
};
use dsh_supervisors::error::chain;
use dsh_supervisors::events::panic_text;
use dsh_supervisors::tree::now_ms;
use dsh_supervisors::{Context, WorkerRef, WorkerSpec};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};

/// Why committed events are not durable yet.
#[derive(Debug, thiserror::Error)]
pub enum FlushError {
    /// The store refused the write (a full disk, a locked database).
    /// Retryable: the events stay pending, in order, and are written by the
    /// next attempt.
    #[error("cannot write the session log")]
    Store(#[from] StoreError),
    /// The writer task panicked (a bug in the store backend). The events
    /// stay in the in-memory log only.
    #[error("the session writer task failed: {0}")]
    Writer(String),
    /// The session actor did not answer within its 30 s budget, or is gone.
    #[error("the session actor did not answer: {0}")]
    Unanswered(String),
}

/// A callback run after each committed append.
pub type Observer = Arc<dyn Fn(&Arc<SessionEvent>) + Send + Sync>;

/// Messages of the session actor.
pub enum SessionMsg {
    /// An event was committed.
    Committed(Arc<SessionEvent>),
    /// Write everything buffered, then reply.
    Flush(RpcReplyPort<Result<(), FlushError>>),
    /// The batching window closed: write what is pending.
    Tick,
}

// Local only: a session writer is never reached from another node.
impl ractor::Message for SessionMsg {}

/// The log, in memory or at rest (a hibernated agent's).
enum Slot {
    Live(Box<SessionLog>),
    Compact(CompactLog),
}

impl Slot {
    /// The live log, restoring a compact one in place.
    fn live(&mut self) -> &mut SessionLog {
        if let Slot::Compact(c) = self {
            *self = Slot::Live(Box::new(restore(c)));
        }
        match self {
            Slot::Live(log) => log,
            Slot::Compact(_) => unreachable!("restored above"),
        }
    }
}

/// A compact log was made by [`CompactLog::of`] in this process from a
/// valid log; failing to restore it is a codec bug, and carrying on with
/// anything else would lose committed events.
fn restore(c: &CompactLog) -> SessionLog {
    match c.restore() {
        Ok(log) => log,
        Err(e) => panic!("a compact session log does not restore: {}", chain(&e)),
    }
}

/// Shared state of one session.
struct Core {
    log: Mutex<Slot>,
    observers: RwLock<Vec<(u64, Observer)>>,
    next_observer: AtomicU64,
    actor: Mutex<Option<WorkerRef<SessionMsg>>>,
    /// Events its actor has made durable (0 without a store).
    written: Arc<AtomicU64>,
}

/// The handle every writer and reader of a session uses.
#[derive(Clone)]
pub struct SessionHandle {
    core: Arc<Core>,
    id: Arc<str>,
}

impl SessionHandle {
    /// A handle over `log` with no actor yet.
    pub fn new(log: SessionLog) -> SessionHandle {
        let id: Arc<str> = Arc::from(log.header().id.as_str());
        SessionHandle {
            core: Arc::new(Core {
                log: Mutex::new(Slot::Live(Box::new(log))),
                observers: RwLock::new(Vec::new()),
                next_observer: AtomicU64::new(0),
                actor: Mutex::new(None),
                written: Arc::new(AtomicU64::new(0)),
            }),
            id,
        }
    }

    /// The session id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The session id, shared (no copy).
    pub fn shared_id(&self) -> Arc<str> {
        self.id.clone()
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        // Poisoning means a panic while appending; the log itself is only
        // changed after validation, so it stays consistent.
        self.core.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the log without restoring a compact one in place (a read of a
    /// hibernated agent's session decodes a temporary copy).
    pub fn read<T>(&self, f: impl FnOnce(&mut SessionLog) -> T) -> T {
        let mut slot = self.slot();
        match &mut *slot {
            Slot::Live(log) => f(log),
            Slot::Compact(c) => {
                let mut log = restore(c);
                drop(slot);
                f(&mut log)
            }
        }
    }

    /// Puts the log at rest: compressed, request headers shared. Any later
    /// write (or [`SessionHandle::with_log`]) restores it first.
    pub fn compact(&self) -> Result<usize, CompactError> {
        let mut slot = self.slot();
        if let Slot::Live(log) = &*slot {
            let compact = CompactLog::of(log)?;
            *slot = Slot::Compact(compact);
        }
        match &*slot {
            Slot::Compact(c) => Ok(c.len()),
            Slot::Live(_) => unreachable!("compacted above"),
        }
    }

    /// Whether the log is at rest.
    pub fn is_compact(&self) -> bool {
        matches!(&*self.slot(), Slot::Compact(_))
    }

    /// The compressed size of a compact log (`None` while it is live).
    pub fn compact_len(&self) -> Option<usize> {
        match &*self.slot() {
            Slot::Compact(c) => Some(c.len()),
            Slot::Live(_) => None,
        }
    }

    /// Brings a compact log back into memory.
    pub fn thaw(&self) -> Result<(), CompactError> {
        let mut slot = self.slot();
        if let Slot::Compact(c) = &*slot {
            *slot = Slot::Live(Box::new(c.restore()?));
        }
        Ok(())
    }

    /// How many events are durable in the store (by the session's actor):
    /// what a later [`SessionHandle::attach_after`] must not write again.
    pub fn written(&self) -> u64 {
        self.core.written.load(Ordering::Acquire)
    }

    /// Appends one event; returns it once committed.
    pub fn append(
        &self,
        data: EventData,
        intent: Option<SurfaceIntent>,
    ) -> Result<Arc<SessionEvent>, SessionError> {
        let event = self.slot().live().append(data, intent, now_ms())?;
        self.publish(&event);
        Ok(event)
    }

    fn publish(&self, event: &Arc<SessionEvent>) {
        if let Ok(observers) = self.core.observers.read() {
            for (_, observe) in observers.iter() {
                if let Err(p) =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| observe(event)))
                {
                    tracing::error!(session = %self.id, seq = event.seq, "session observer panicked: {}", panic_text(&p));
                }
            }
        }
        if let Ok(actor) = self.core.actor.lock()
            && let Some(actor) = actor.as_ref()
        {
            // A refused send means the actor is stopping; its drain has
            // written everything committed before.
            let _ = actor.send(SessionMsg::Committed(event.clone()));
        }
    }

    /// Adds an observer; returns its id for [`SessionHandle::unobserve`].
    pub fn observe(&self, observer: Observer) -> u64 {
        let id = self.core.next_observer.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut o) = self.core.observers.write() {
            o.push((id, observer));
        }
        id
    }

    /// Removes an observer.
    pub fn unobserve(&self, id: u64) {
        if let Ok(mut o) = self.core.observers.write() {
            o.retain(|(i, _)| *i != id);
        }
    }

    /// The derived model history (shared messages).
    pub fn derive_messages(&self) -> History {
        self.read(|log| log.derive_messages())
    }

    /// A copy of the event list (shared events).
    pub fn events(&self) -> Vec<Arc<SessionEvent>> {
        self.read(|log| log.iter().collect())
    }

    /// Events from `seq` on.
    pub fn events_from(&self, seq: u64) -> Vec<Arc<SessionEvent>> {
        self.read(|log| log.iter_from(seq).collect())
    }

    /// The next seq.
    pub fn next_seq(&self) -> u64 {
        match &*self.slot() {
            Slot::Live(log) => log.next_seq(),
            Slot::Compact(c) => c.next_seq(),
        }
    }

    /// The header.
    pub fn header(&self) -> SessionHeader {
        self.read(|log| log.header().clone())
    }

    /// The latest request header.
    pub fn request_header(&self) -> Option<Arc<serde_json::Value>> {
        self.read(|log| log.request_header().cloned())
    }

    /// Runs `f` with the log locked (for folds that need several reads);
    /// a compact log is restored in place first.
    pub fn with_log<T>(&self, f: impl FnOnce(&mut SessionLog) -> T) -> T {
        f(self.slot().live())
    }

    /// Starts the session's actor under `ctx` (a child of the owner's
    /// fiber): with `store`, committed events are made durable there, the
    /// session being created by the first write. Without one, the session
    /// is only a passive part of the owner in the tree (no actor), which
    /// lives as long as the owner's scope: call this once per scope.
    pub async fn attach(
        &self,
        ctx: &Context,
        store: Option<Arc<dyn SessionPersistence>>,
    ) -> dsh_supervisors::Result<()> {
        self.attach_after(ctx, store, None, None).await
    }

    /// Like [`SessionHandle::attach`]; with `stored: Some(n)` the session
    /// already exists in `store` holding its first `n` events (a resumed
    /// session), and only later events are appended. The actor holds
    /// `writer`, the session's one-writer lock, until it stops.
    pub async fn attach_after(
        &self,
        ctx: &Context,
        store: Option<Arc<dyn SessionPersistence>>,
        stored: Option<u64>,
        writer: Option<WriterLock>,
    ) -> dsh_supervisors::Result<()> {
        let name = format!("session/{}", short(&self.id));
        let Some(store) = store else {
            // Without a store there is nothing to write: the session is a
            // passive part of its owner in the tree, with no actor behind it
            // (committed events are not forwarded anywhere).
            ctx.part("session", name)?;
            return Ok(());
        };
        let from = stored.unwrap_or(0);
        let (header, backlog) = self.with_log(|log| {
            let backlog = log.iter_from(from).collect();
            (log.header().clone(), backlog)
        });
        let spec = WorkerSpec::new(
            "session",
            name,
            SessionActor,
            SessionArgs {
                header,
                backlog,
                store,
                stored,
                written: self.core.written.clone(),
                writer,
            },
        );
        let actor = ctx.spawn(spec).await?;
        if let Ok(mut slot) = self.core.actor.lock() {
            *slot = Some(actor);
        }
        Ok(())
    }

    /// Forgets the session's actor (it stopped with its agent's scope, having
    /// written everything); a later [`SessionHandle::attach_after`] starts a
    /// new one.
    pub fn detach(&self) {
        if let Ok(mut slot) = self.core.actor.lock() {
            *slot = None;
        }
    }

    /// Writes everything committed so far to durable storage.
    pub async fn flush(&self) -> Result<(), FlushError> {
        let actor = self.core.actor.lock().ok().and_then(|a| a.clone());
        match actor {
            None => Ok(()),
            Some(a) => a
                .call(SessionMsg::Flush, std::time::Duration::from_secs(30))
                .await
                .map_err(|e| FlushError::Unanswered(chain(&e).to_string()))?,
        }
    }
}

/// The first 8 characters of an id, for readable actor names.
pub fn short(id: &str) -> &str {
    id.get(..8).unwrap_or(id)
}

/// Startup arguments of the session actor.
pub struct SessionArgs {
    header: SessionHeader,
    backlog: Vec<Arc<SessionEvent>>,
    store: Arc<dyn SessionPersistence>,
    /// Events already stored (`None`: the session is not created yet).
    stored: Option<u64>,
    /// Where the actor counts the events it has written.
    written: Arc<AtomicU64>,
    /// The session's one-writer lock, if its store has them.
    writer: Option<WriterLock>,
}

/// Owns durability of one session.
pub struct SessionActor;

/// Its state: committed events not yet durable, and where they go.
pub struct SessionState {
    store: Arc<dyn SessionPersistence>,
    pending: Vec<Arc<SessionEvent>>,
    /// Events durable in the store (shared with the handle).
    written: Arc<AtomicU64>,
    created: bool,
    header: Arc<SessionHeader>,
    /// A write is scheduled at the end of the batching window.
    scheduled: bool,
    /// Held until the actor stops: no other process writes the session.
    writer: Option<WriterLock>,
}

impl SessionState {
    /// Writes the pending events (creating the session first if needed).
    /// A failed write keeps them, in order, for the next attempt.
    async fn write_pending(&mut self) -> Result<(), FlushError> {
        let store = self.store.clone();
        if self.pending.is_empty() && self.created {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.pending);
        let create = !self.created;
        let header = self.header.clone();
        let written = tokio::task::spawn_blocking(move || {
            let result = if create {
                store.create(&header, &batch)
            } else {
                store.append(&header.id, &batch)
            };
            (batch, result)
        })
        .await;
        match written {
            Ok((batch, Ok(()))) => {
                self.created = true;
                if let Some(last) = batch.last() {
                    self.written.store(last.seq + 1, Ordering::Release);
                }
                Ok(())
            }
            Ok((batch, Err(e))) => {
                self.pending = batch;
                Err(FlushError::Store(e))
            }
            // The batch went down with the panicking task; this is a bug in
            // the backend, and the events stay in the in-memory log.
            Err(e) => Err(FlushError::Writer(chain(&e).to_string())),
        }
    }
}

/// Events buffered before a write is forced.
const FLUSH_EVENTS: usize = 512;
/// How long the first pending event waits for others before a write.
const BATCH_WINDOW: std::time::Duration = std::time::Duration::from_millis(200);

impl Actor for SessionActor {
    type Msg = SessionMsg;
    type State = SessionState;
    type Arguments = SessionArgs;

    async fn pre_start(
        &self,
        _me: ActorRef<SessionMsg>,
        args: SessionArgs,
    ) -> Result<SessionState, ActorProcessingErr> {
        let on_disk = args.stored.unwrap_or(0);
        let pending = args
            .backlog
            .into_iter()
            .filter(|e| e.seq >= on_disk)
            .collect();
        args.written.store(on_disk, Ordering::Release);
        Ok(SessionState {
            written: args.written,
            created: args.stored.is_some(),
            store: args.store,
            pending,
            header: Arc::new(args.header),
            scheduled: false,
            writer: args.writer,
        })
    }

    async fn handle(
        &self,
        me: ActorRef<SessionMsg>,
        msg: SessionMsg,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            SessionMsg::Committed(event) => {
                state.pending.push(event);
                if state.pending.len() >= FLUSH_EVENTS {
                    if let Err(e) = state.write_pending().await {
                        tracing::error!("{}; keeping the events for the next write", chain(&e));
                    }
                } else if !state.scheduled {
                    // The batching window: the first pending event
                    // schedules one write; later ones join it.
                    state.scheduled = true;
                    me.send_after(BATCH_WINDOW, || SessionMsg::Tick);
                }
            }
            SessionMsg::Tick => {
                state.scheduled = false;
                if let Err(e) = state.write_pending().await {
                    tracing::error!("{}; keeping the events for the next write", chain(&e));
                    // A failed write keeps its events; try again later.
                    state.scheduled = true;
                    me.send_after(BATCH_WINDOW, || SessionMsg::Tick);
                }
            }
            SessionMsg::Flush(reply) => {
                let _ = reply.send(state.write_pending().await);
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<SessionMsg>,
        state: &mut SessionState,
    ) -> Result<(), ActorProcessingErr> {
        if let Err(e) = state.write_pending().await {
            tracing::error!("session log not fully written at shutdown: {}", chain(&e));
        }
        // Released before the actor counts as stopped: a wake that follows
        // takes it again.
        state.writer.take();
        Ok(())
    }
}

impl dsh_services::session::SessionWriter for SessionHandle {
    fn append_log_only(&self, data: EventData) -> Result<u64, SessionError> {
        self.append(data, None).map(|e| e.seq)
    }
    fn session_id(&self) -> Arc<str> {
        self.shared_id()
    }
}
