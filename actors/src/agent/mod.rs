//! The agent: an inbox, a turn/step driver, and its supervised subtree.
//!
//! Each agent owns a scope (a kernel fiber) holding, in start order, its
//! session (a writer actor with a store, else a passive part), its driver
//! (a task child) and one task child per tool call. The driver runs one
//! turn at a time; `cancel` reaches the running turn through a cancellation
//! token, so it interrupts a stream or a tool mid-flight.
//!
//! A turn: `turn/start` → steps until the model answers without tool calls.
//! A step: `step/start` → entering `user/message`s → the runtime-context
//! snapshot (when the policies changed) → `request/header` (when it changed) → the `llm/stream` call, every chunk logged as
//! `assistant/chunk` → `assistant/message` → `tool/call`s → the calls (runs of
//! concurrency-safe calls in parallel, others alone) → `tool/result`s in call
//! order → `step/end`. The turn ends `completed`, `max-tokens`, `aborted` or
//! `error` with `turn/end`.
//!
//! Teardown (the scope's prelude, then its children in reverse order): stop
//! accepting input → cancel the running turn and wait for the driver to write
//! its `turn/end` → tool calls → driver → session (its actor flushes) → the
//! agent leaves the registry (`agent/disposed`) → the scope's registrations.
//!
//! ## Where things live
//! - this file: the [`Agent`] handle and what it reads (id, session,
//!   progress, status, waiting for idle), the errors, and the shared state
//!   below;
//! - `spec`: [`AgentSpec`], how an agent is built;
//! - [`events`]: what an agent emits and the waterfalls it runs;
//! - `inbox`: input (`followup`, `steer`, `inject`, `cancel`);
//! - `lifecycle`: create, hibernate, wake, dispose;
//! - `driver`: the driver task and the turn loop;
//! - `step`: one step (request, stream, tool calls);
//! - `context`: the runtime-context snapshot (file and approval policy);
//! - `tool_exec`: one task child per tool call;
//! - `envelope`, `template`: the request envelope, and what agents of one
//!   template share;
//! - `summary`: what the tree shows for an agent;
//! - `keeper`: the [`Agents`] registry and its keeper actor.
//!
//! ## Shared state and what guards it
//! An [`Agent`] handle is an `Arc<Inner>` (what lives as long as the agent,
//! awake or hibernated); `Awake` exists only while its actors run.
//!
//! | field | written by | guarded by |
//! |---|---|---|
//! | `Inner::inbox`: queues, `turn`, `running`, `cancel`, `accepting`, `last`, `opened`, `cancel_next`, `fresh` | input (`followup`, `steer`, `inject`, `cancel`); the driver claiming and settling a turn; teardown (`close_and_cancel`, `finish`, `abandon`) | the inbox mutex; a splice is logged while it is held, so the logged positions are the queue's |
//! | `Inner::idle` | cleared by input and set by the driver, under the inbox lock; set by `finish` after input is closed | a `SeqCst` flag and a `Notify`; a waiter registers before it checks, so no wake-up is lost |
//! | `Inner::life` (`Awake`, `Asleep`, `Gone`) | `set_awake` (in `create`, before anyone else holds the agent; in `wake`), `hibernate`, `finish` (at disposal, from `dispose` or the owner's teardown) | the life mutex; sleep, wake and disposal also take turns (`transitioning`) |
//! | `Inner::transitioning` | `transition()` (compare-exchange), its guard's drop | `AcqRel` atomic; one sleep, wake or disposal at a time; waiters wait on `idle.changed` |
//! | `Inner::ending`: owner hook; boxed and rare: disposal callbacks, why a wake failed | `create` (the hook), `on_disposed`, `abandon` (the reason), `finish` (takes the hook and callbacks; the reason stays for callers still waiting) | the ending mutex; `on_disposed` checks `Gone` under it, so a callback is run or found, never lost; `closed` takes it holding no other lock |
//! | `Inner::durable` | `hibernate` (what the session actor wrote), `write_tail` | `Release`/`Acquire`; only transitions write it |
//! | `Inner::store` | the first build that has a store | `OnceLock` |
//! | `Inner::tokens`, `used`, `used_ms` | the step that got usage; `touch` on input and idle | `Relaxed`: figures and the keeper's LRU order, which tolerate a stale read |
//! | `Awake::sleeping` | `hibernate`, under the inbox lock (cleared when the flush fails) | `Release`/`Acquire`; input that sees it asks the keeper to wake the agent instead of telling the driver |
//! | `Awake::wake` | input (`kick`, `wake`) notifies; the driver waits on it | a `Notify` (one stored permit) |
//! | `Awake::settled` | the build, once | `OnceLock` |
//! | `Awake::conclude` | a structured-output tool sets it; the driver clears it at turn start and takes it after the step's results | `Release` store, `AcqRel` swap |
//! | `Awake::step_children` | `adopt_for_step` (tool bodies); the step takes them once its results are in | mutex |
//! | `Awake::envelope` | the step, when the registry's generation or the system text changed | mutex |
//! | `Awake::context` | the step, when it appends a runtime-context snapshot | mutex (taken alone; the session's lock inside it) |
//! | `Awake::titled` | the first step of an awake spell | `AcqRel` swap |
//! | `Awake::step`, `published_ms` | the driver | `Relaxed` (read for display) |
//!
//! Locks nest only in this order: `ending` → `life` → `inbox` →
//! `step_children` and the scope fiber's own lock (`may_sleep` counts its
//! effects and children). Under the inbox lock a splice or a turn's opening
//! is appended to the session, so the session's locks and its observers run
//! there too: an observer must not call the same agent's input or progress
//! methods (it would wait on the inbox lock its own append holds).

mod budget;
mod compaction;
mod context;
mod driver;
mod envelope;
pub mod events;
mod header;
mod inbox;
mod keeper;
mod lifecycle;
mod limits;
mod prune;
mod spec;
mod step;
mod summary;
mod template;
mod tool_exec;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dsh_services::approval::Approval;
use dsh_services::llm::{LlmRuntime, Message, ToolSchema};
use dsh_services::sandbox::Policy;
use dsh_services::session::compact::CompactError;
use dsh_services::session::{EventData, SessionError, SessionEvent, SurfaceIntent, TurnEndReason};
use dsh_services::tools::{Bounds, ToolRegistry};
use dsh_supervisors::error::chain;
use dsh_supervisors::registry::RegisterError;
use dsh_supervisors::{Context, Disposer, Scope, Status};
use tokio_util::sync::CancellationToken;

use crate::session::{FlushError, SessionHandle};

pub use events::{
    AgentCreated, AgentDisposed, AgentPreStep, AgentRequest, AgentTurnStopping, PreStepDecision,
};
pub use keeper::{Agents, Hibernation, KeeperUnanswered};
pub use limits::Limits;
pub use spec::{AgentSpec, OwnTools, TurnHook};

/// A handle to an agent: it stays valid while the agent hibernates and
/// wakes (under the same id), until the agent is disposed.
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

/// A handle that does not keep its agent alive.
#[derive(Clone)]
pub struct WeakAgent(std::sync::Weak<Inner>);

impl WeakAgent {
    /// The agent, while it is alive.
    pub fn upgrade(&self) -> Option<Agent> {
        self.0.upgrade().map(|inner| Agent { inner })
    }
}

impl Agent {
    /// The agent (session) id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The agent's session (readable while the agent hibernates).
    pub fn session(&self) -> &SessionHandle {
        &self.inner.session
    }

    /// The agent's scoped context (registrations made through it are ad hoc:
    /// they keep the agent awake). A hibernated agent has none; wake it first.
    pub fn context(&self) -> Result<Context, AgentError> {
        match &*self.life() {
            Life::Awake(a) => Ok(a.ctx.clone()),
            Life::Asleep { .. } => Err(AgentError::Hibernated(self.inner.id.to_string())),
            Life::Gone { .. } => Err(AgentError::Closed(self.inner.id.to_string())),
        }
    }

    /// Wakes the agent if it hibernates and returns its scoped context.
    pub async fn awake_context(&self) -> Result<Context, AgentError> {
        if self.is_hibernated() {
            self.wake().await?;
        }
        self.context()
    }

    /// The context to emit through and look services up from: the scope's
    /// while awake; while hibernated, the owner's. Both reach the same
    /// listeners and services, since what an agent's spec registers in its
    /// scope is neither, and anything registered there ad hoc keeps it awake.
    pub fn reach(&self) -> Context {
        match &*self.life() {
            Life::Awake(a) => a.ctx.clone(),
            _ => self.inner.owner.clone(),
        }
    }

    /// The context the agent's scope is created under (its owner).
    pub fn owner(&self) -> &Context {
        &self.inner.owner
    }

    /// The agent whose scope `ctx` is (a tool body's calling agent).
    pub fn calling(ctx: &Context) -> Option<Agent> {
        let me = ctx.get::<AgentSelf>(AGENT_SELF)?;
        me.0.upgrade().map(|inner| Agent { inner })
    }

    /// A handle that does not keep the agent alive.
    pub fn downgrade(&self) -> WeakAgent {
        WeakAgent(Arc::downgrade(&self.inner))
    }

    /// Whether no turn runs and nothing is queued.
    pub fn is_idle(&self) -> bool {
        self.inner.idle.get()
    }

    /// Whether the agent is hibernated.
    pub fn is_hibernated(&self) -> bool {
        matches!(&*self.life(), Life::Asleep { .. })
    }

    /// The agent's status: its scope's while awake, `hibernated` while it
    /// sleeps, `disposed` once gone.
    pub fn status(&self) -> Status {
        match &*self.life() {
            Life::Awake(me) => me.scope.fiber().status(),
            Life::Asleep { .. } => Status::Hibernated,
            Life::Gone { .. } => Status::Disposed,
        }
    }

    /// The spec the agent is built from (and rebuilt from when it wakes):
    /// without its seed, id and durable count, which belong to the session.
    pub fn spec(&self) -> &AgentSpec {
        &self.inner.spec
    }

    /// What the agent's tools may do without asking (resolved when it was
    /// created: its spec's, else the deployment's default).
    pub fn policy(&self) -> Policy {
        self.inner.spec.permission.unwrap_or_default()
    }

    /// Delegation depth, from the session header (0 for a top-level agent).
    pub fn depth(&self) -> u32 {
        self.inner
            .session
            .read(|log| log.header().delegation_depth)
            .max(self.inner.spec.depth)
    }

    /// The kernel id of the agent's tree node: its scope fiber while awake,
    /// its parked node while hibernated.
    pub fn node_id(&self) -> u64 {
        self.life().node()
    }

    /// Kernel ids of the children the agent's scope owns (its session, its
    /// driver, running tool calls, hooks, jobs and title requests, child
    /// agents), in start order (none while it hibernates).
    pub fn child_nodes(&self) -> Vec<u64> {
        self.awake()
            .map(|me| me.scope.fiber().children())
            .unwrap_or_default()
    }

    /// What the agent is doing now.
    pub fn progress(&self) -> Progress {
        let (step, hibernated) = match &*self.life() {
            Life::Awake(me) => (me.step.load(Ordering::Relaxed), false),
            Life::Asleep { .. } => (0, true),
            Life::Gone { .. } => (0, false),
        };
        let inbox = self.inbox();
        Progress {
            turn: inbox.turn,
            step: if inbox.running { step } else { 0 },
            running: inbox.running,
            queued: inbox.followups.len(),
            tokens: self.inner.tokens.load(Ordering::Relaxed),
            hibernated,
        }
    }

    /// The summary of the last finished turn.
    pub fn last_turn(&self) -> Option<TurnSummary> {
        self.inbox().last.as_deref().cloned()
    }

    /// Appends a plugin-defined record (`kind`, payload) to the agent's log;
    /// a refusal is logged, not returned (records are observations).
    pub fn record(&self, kind: &str, data: serde_json::Value) {
        let event = EventData::Other {
            kind: Arc::from(kind),
            data: Arc::new(data),
        };
        if let Err(e) = self.inner.session.append(event, None) {
            tracing::warn!(agent = %self.inner.id, "cannot record {kind}: {}", chain(&e));
        }
    }

    /// Waits until no turn runs and nothing is queued, up to `timeout`.
    pub async fn when_idle(&self, timeout: Duration) -> Result<(), AgentError> {
        tokio::time::timeout(timeout, self.inner.idle.wait())
            .await
            .map_err(|_| AgentError::Timeout {
                id: self.inner.id.to_string(),
                after: timeout,
            })
    }

    /// Runs one prompt as a turn and waits for it, up to `timeout`.
    pub async fn run(&self, prompt: &str, timeout: Duration) -> Result<TurnSummary, AgentError> {
        let before = self.inbox().turn;
        self.followup(Message::user_text(prompt))?;
        self.when_idle(timeout).await?;
        let inbox = self.inbox();
        let ended = match &inbox.last {
            Some(last) if inbox.turn > before => Some(TurnSummary::clone(last)),
            _ => None,
        };
        drop(inbox);
        ended.ok_or_else(|| self.closed())
    }

    /// Runs `f` once when the agent is disposed for good (not when it
    /// hibernates); at once if it is already gone.
    pub fn on_disposed(&self, f: impl FnOnce() + Send + 'static) {
        // Decided under the lock `finish` takes last: either it finds the
        // callback, or the agent is seen gone here and the callback runs now.
        let mut ending = lock(&self.inner.ending);
        let gone = matches!(&*self.life(), Life::Gone { .. });
        if gone && !self.inbox().accepting {
            drop(ending);
            f();
            return;
        }
        ending
            .rare
            .get_or_insert_with(Box::default)
            .on_disposed
            .push(Box::new(f));
    }

    /// Hands `child` (started by a tool call of the running step) to this
    /// agent: once every call of the step has answered, the step's children
    /// are disposed in reverse start order — so a cancelled step, like a
    /// teardown, stops its children one by one, last started first.
    pub fn adopt_for_step(&self, child: Agent) {
        match self.awake() {
            Some(me) => lock(&me.step_children).push(child),
            None => {
                tracing::warn!(agent = %self.inner.id, "a step child was handed to an agent that is not awake")
            }
        }
    }

    /// Ends the running turn (`completed`) once the current step's tool
    /// results are committed: a structured-output capture concluding it.
    pub fn conclude_turn(&self) {
        if let Some(me) = self.awake() {
            me.conclude.store(true, Ordering::Release);
        }
    }

    /// Why the agent cannot hibernate now (`None`: it can).
    pub fn awake_reason(&self) -> Option<StaysAwake> {
        let me = self.awake()?;
        self.may_sleep(&me, &self.inbox()).err()
    }
}

/// Why an agent could not be created, refused input, or could not wake.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// A service the agent needs is not provided. Fatal until its plugin
    /// is loaded.
    #[error("the `{0}` service is not provided; load its plugin first")]
    MissingService(&'static str),
    /// The seed could not become a session. Fatal: the stored log must change.
    #[error("cannot seed the session")]
    Seed(#[from] SessionError),
    /// The session's store refused it a writer: another process writes it
    /// (`SESSION_BUSY`), or its lock cannot be taken. Retryable once that
    /// writer ends.
    #[error(transparent)]
    Store(#[from] dsh_services::persistence::StoreError),
    /// The kernel refused (the owner is unloading, a scope cycle). Fatal
    /// for this owner.
    #[error(transparent)]
    Kernel(#[from] dsh_supervisors::Error),
    /// What the spec registers in the agent's scope was refused (its tool
    /// restriction, its persona section). Fatal: the spec must change.
    #[error(transparent)]
    Register(#[from] RegisterError),
    /// A hibernated agent's compact session did not restore (a codec bug).
    /// Fatal for this agent: its input is dropped and it is disposed.
    #[error("the session does not restore")]
    Restore(#[from] CompactError),
    /// The agent no longer takes input (it is being disposed). Fatal.
    #[error("agent {0} is closed and takes no more input")]
    Closed(String),
    /// The agent could not wake (its session is written by another
    /// process, say) and was disposed. Fatal.
    #[error("agent {id} could not wake and takes no more input: {why}")]
    Abandoned {
        /// Agent id.
        id: String,
        /// What the wake said.
        why: Arc<str>,
    },
    /// The agent is hibernated and has no scope now. Retry after
    /// [`Agent::wake`].
    #[error("agent {0} is hibernated; wake it first")]
    Hibernated(String),
    /// A turn is running; compaction waits for it. Retryable.
    #[error("agent {0} is running a turn; compact it when it is idle")]
    Busy(String),
    /// The summary could not be made (the model call failed). Retryable;
    /// nothing was replaced.
    #[error("the conversation was not compacted: {0}")]
    Compaction(String),
    /// A wait ran out. Retryable: the agent may still become idle.
    #[error("agent {id} did not become idle within {after:?}")]
    Timeout {
        /// Agent id.
        id: String,
        /// The budget.
        after: Duration,
    },
}

/// Why an agent does not hibernate now ([`Agent::hibernate`],
/// [`Agent::awake_reason`]). All but [`Unwritten`](Self::Unwritten) and
/// [`NoKeeper`](Self::NoKeeper) pass: retry when the agent is idle again.
#[derive(Debug, thiserror::Error)]
pub enum StaysAwake {
    /// No agents keeper runs, so nothing could wake it again.
    #[error("no agents keeper runs to wake it again")]
    NoKeeper,
    /// It is disposed.
    #[error("it is disposed")]
    Disposed,
    /// It takes no more input (it is being disposed).
    #[error("it takes no more input")]
    Closed,
    /// A turn is running.
    #[error("a turn is running")]
    Running,
    /// Input waits for a turn.
    #[error("input is queued")]
    Queued,
    /// It is going to sleep already.
    #[error("it is going to sleep")]
    Sleeping,
    /// A child it started (a tool call, a subagent) is still live.
    #[error("it has live children")]
    Children,
    /// Something was registered in its scope after it was built; the spec
    /// cannot make it again, so sleeping would lose it.
    #[error("ad hoc registrations in its scope: {}", .0.join(", "))]
    AdHoc(Vec<String>),
    /// Its session could not be written (the session actor keeps retrying;
    /// it stays awake until the store takes the events).
    #[error(transparent)]
    Unwritten(#[from] FlushError),
}

/// How a turn ended, for callers of [`Agent::run`].
#[derive(Clone, Debug, PartialEq)]
pub struct TurnSummary {
    /// Turn number.
    pub turn: u32,
    /// Steps it took.
    pub steps: u32,
    /// Why it ended.
    pub reason: TurnEndReason,
    /// The final assistant text.
    pub text: String,
}

/// What an agent is doing, for observers (the API, the dashboard).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Progress {
    /// The last turn started (0 before the first).
    pub turn: u32,
    /// The step of the running turn (0 when none runs).
    pub step: u32,
    /// Whether a turn is running.
    pub running: bool,
    /// Prompts waiting for their turn.
    pub queued: usize,
    /// Tokens spent (input + output), over the agent's life.
    pub tokens: u64,
    /// Whether the agent is hibernated.
    pub hibernated: bool,
}

/// What a cancel did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cancelled {
    /// The running turn was cancelled (it ends `aborted`).
    Running,
    /// No turn ran; the queued prompt's turn starts cancelled.
    Queued,
    /// Nothing ran or waited.
    Idle,
    /// The agent is hibernated: nothing runs, so nothing was cancelled (and
    /// it was not woken).
    Hibernated,
}

/// The agent a scoped context belongs to, provided in every agent scope as
/// [`AGENT_SELF`] (weak: the scope must not keep its agent alive).
pub struct AgentSelf(std::sync::Weak<Inner>);

/// The service name under which an agent's scope provides [`AgentSelf`].
pub const AGENT_SELF: &str = "agent/self";

#[derive(Default)]
struct Inbox {
    followups: VecDeque<Arc<Message>>,
    steer: Vec<Arc<Message>>,
    inject: Vec<Arc<Message>>,
    turn: u32,
    running: bool,
    cancel: Option<CancellationToken>,
    accepting: bool,
    last: Option<Box<TurnSummary>>,
    opened: bool,
    cancel_next: bool,
    /// Created and not yet given a prompt: the awake cap does not evict it
    /// (its creator is still setting it up).
    fresh: bool,
}

/// What an agent keeps for its whole life, awake or hibernated.
struct Inner {
    /// The session id, shared with the session handle.
    id: Arc<str>,
    /// The spec as kept: without seed, id and durable count (the session's),
    /// and shared with every agent made from the same template.
    spec: Arc<AgentSpec>,
    /// The context the agent's scope is created under: its owner.
    owner: Context,
    session: SessionHandle,
    inbox: Mutex<Inbox>,
    idle: Idle,
    resumed: bool,
    /// Set while the agent goes to sleep, wakes or is disposed (one at a
    /// time; see [`Agent::transition`]).
    transitioning: AtomicBool,
    /// Tokens spent (input + output), over the agent's life.
    tokens: Arc<AtomicU64>,
    life: Mutex<Life>,
    /// The registry (and its keeper, which wakes and hibernates agents).
    agents: Option<Arc<Agents>>,
    /// Logical time of the last use (least recently used goes first).
    used: AtomicU64,
    /// Wall time of the last use, ms (for the idle timeout).
    used_ms: AtomicU64,
    /// Events of the session already in its store (`None`: not created there).
    durable: AtomicU64,
    /// The store the session went to when last awake.
    store: std::sync::OnceLock<Arc<dyn dsh_services::persistence::SessionPersistence>>,
    /// What runs when the agent goes for good.
    ending: Mutex<Ending>,
}

/// What an agent's end undoes or runs (one lock for both: this record is
/// what every resident agent costs, and each lock adds to it).
#[derive(Default)]
struct Ending {
    /// The owner's effect that disposes the agent should the owner unload
    /// while the agent sleeps (an awake agent's scope stops with the owner).
    owner_hook: Option<Disposer>,
    /// What few agents need, boxed (the record of every resident agent
    /// stays in its size class).
    rare: Option<Box<Rare>>,
}

#[derive(Default)]
struct Rare {
    /// Run once when the agent is disposed for good (not when it
    /// hibernates).
    on_disposed: Vec<DisposedFn>,
    /// Why a wake failed, the agent taking no more input (kept past
    /// disposal: a caller waiting on a turn is told).
    abandoned: Option<Arc<str>>,
}

/// Whether the agent is idle (no turn runs, nothing queued), and a way to
/// wait for it (lighter than a watch channel, which allocates per agent).
struct Idle {
    flag: AtomicBool,
    changed: tokio::sync::Notify,
}

impl Default for Idle {
    fn default() -> Idle {
        Idle {
            flag: AtomicBool::new(true),
            changed: tokio::sync::Notify::new(),
        }
    }
}

impl Idle {
    fn set(&self, idle: bool) {
        self.flag.store(idle, Ordering::SeqCst);
        if idle {
            self.changed.notify_waiters();
        }
    }

    fn get(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Resolves once idle (registered before the check, so no wakeup is lost).
    async fn wait(&self) {
        loop {
            let notified = self.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self.get() {
                return;
            }
            notified.await;
        }
    }
}

/// A callback run when an agent is disposed for good.
type DisposedFn = Box<dyn FnOnce() + Send>;

/// `Inner::durable` when the session is not in a store yet.
const NOT_STORED: u64 = u64::MAX;

/// Whether the agent runs now.
enum Life {
    /// Its scope, session and driver run.
    Awake(Arc<Awake>),
    /// Hibernated: the actors stopped, the session is at rest, `node` is
    /// its parked tree node.
    Asleep { node: u64 },
    /// Disposed (or not built yet); `node` is the last tree node it had.
    Gone { node: u64 },
}

impl Life {
    /// The tree node standing for the agent: its scope, its parked node, or
    /// the last it had.
    fn node(&self) -> u64 {
        match self {
            Life::Awake(me) => me.scope.fiber().id(),
            Life::Asleep { node } | Life::Gone { node } => *node,
        }
    }
}

/// The part of an agent that exists only while it is awake.
struct Awake {
    ctx: Context,
    scope: Scope,
    llm: Arc<LlmRuntime>,
    tools: Arc<ToolRegistry>,
    approval: Option<Arc<Approval>>,
    /// The workspace and the standing policy every tool call starts from.
    bounds: Bounds,
    /// Wakes the driver: there is input (a stored permit if it is busy).
    wake: tokio::sync::Notify,
    /// Tool schemas and request header, rebuilt only when the tool registry changes.
    envelope: Mutex<Option<Envelope>>,
    /// What the last runtime-context snapshot stated (`None` until the
    /// first request of this awake spell).
    context: Mutex<Option<context::Facts>>,
    /// Whether snapshots are sent: a `sandbox` service is provided where
    /// the agent was built (the composition that defines the policies).
    snapshots: bool,
    /// Whether this awake spell has looked for the session's title.
    titled: AtomicBool,
    /// Set by a tool (a structured-output capture) to end the turn once the
    /// step's results are committed.
    conclude: AtomicBool,
    /// Children started by this step's tool calls, disposed when the step's
    /// results are in (see [`Agent::adopt_for_step`]).
    step_children: Mutex<Vec<Agent>>,
    /// The step the running turn is in (0 between turns).
    step: AtomicU32,
    /// When the summary last went to the tree feed (ms).
    published_ms: AtomicU64,
    /// Effects and children the build left in the scope: anything beyond
    /// them is an ad hoc registration or running work, and keeps it awake.
    settled: std::sync::OnceLock<(usize, usize)>,
    /// The session is made durable in a store.
    stored: bool,
    /// Going to sleep: the teardown leaves input open and the registry alone.
    sleeping: AtomicBool,
}

#[derive(Clone)]
struct Envelope {
    generation: u64,
    system: Option<String>,
    call: header::CallConfig,
    schemas: Arc<[ToolSchema]>,
    header: Arc<serde_json::Value>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Appends to the agent's log, logging (not propagating) refusals: the
/// agent's own events are well-formed by construction, so a refusal is a
/// bug worth a loud log.
pub(super) fn log_append(
    agent: &Agent,
    data: EventData,
    intent: Option<SurfaceIntent>,
) -> Option<Arc<SessionEvent>> {
    match agent.inner.session.append(data, intent) {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::error!(agent = %agent.inner.id, "session refused an append: {}", chain(&e));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    /// The resident record is what every hibernated agent costs: with its
    /// `Arc` counts it must stay within mimalloc's 384-byte size class.
    #[test]
    fn the_resident_record_fits_its_size_class() {
        let with_counts = std::mem::size_of::<super::Inner>() + 16;
        assert!(
            with_counts <= 384,
            "Inner is {with_counts} bytes with its counts"
        );
    }
}
