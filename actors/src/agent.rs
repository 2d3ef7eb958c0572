//! The agent: an inbox, a turn/step driver, and its supervised subtree.
//!
//! Each agent owns a scope (a kernel fiber) holding, in start order, its
//! session actor, its driver actor and one short-lived actor per tool call.
//! The driver runs one turn at a time inside its handler; `cancel` reaches
//! the running turn through a cancellation token, not the mailbox, so it
//! interrupts a stream or a tool mid-flight.
//!
//! A turn: `turn/start` → steps until the model answers without tool calls.
//! A step: `step/start` → entering `user/message`s → `request/header` (when
//! it changed) → the `llm/stream` call, every chunk logged as
//! `assistant/chunk` → `assistant/message` → `tool/call`s → the calls (runs of
//! concurrency-safe calls in parallel, others alone) → `tool/result`s in call
//! order → `step/end`. The turn ends `completed`, `max-tokens`, `aborted` or
//! `error` with `turn/end`.
//!
//! Teardown (the scope's prelude, then its children in reverse order): stop
//! accepting input → cancel the running turn and wait for the driver to write
//! its `turn/end` → tool calls → driver → session actor (flushes) → the
//! agent leaves the registry (`agent/disposed`) → the scope's registrations.

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dsh_services::approval::Approval;
use dsh_services::llm::{
    BlockAssembler, ContentBlock, FinishReason, LlmFailure, LlmRequest, LlmRuntime, Message,
    MessageSource, Role, StreamChunk, ToolSchema,
};
use dsh_services::prompt::{PromptSection, SystemPrompt, Text};
use dsh_services::session::{
    EventData, RequestContext, SessionError, SessionEvent, SessionHeader, SessionLog,
    SurfaceIntent, TurnEndReason,
};
use dsh_services::tools::{
    PipelineOutcome, RegisteredTool, Restriction, ToolCall, ToolRegistry, run_pipeline,
};
use dsh_supervisors::tree::now_ms;
use dsh_supervisors::{
    Context, Disposer, Emit, Event, Scope, ScopeKey, Status, WorkerRef, WorkerSpec,
};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::session::{SessionHandle, short};

mod keeper;

/// How to build an agent.
#[derive(Clone, Debug)]
pub struct AgentSpec {
    /// Provider route of the model.
    pub provider: String,
    /// Model id.
    pub model: String,
    /// Base system prompt.
    pub system: Option<String>,
    /// Workspace root for tools.
    pub cwd: PathBuf,
    /// Tool allow/deny list for this agent.
    pub restriction: Option<Restriction>,
    /// Steps allowed per turn before the turn ends with `STEP_LIMIT`.
    pub max_steps: u32,
    /// Concurrency-safe calls of one step that run at once (the rest wait
    /// their turn); bounds a step's fan-out to subagents too.
    pub max_parallel_tools: usize,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Output-token ceiling per call.
    pub max_tokens: Option<u64>,
    /// Where the session is made durable; in memory only when `None`.
    pub store: Option<Arc<dyn dsh_services::persistence::SessionPersistence>>,
    /// Resume or fork from these events (and header); boxed, so a spec
    /// kept for the agent's life stays small.
    pub seed: Option<Box<(SessionHeader, Vec<SessionEvent>)>>,
    /// Readable name for the tree.
    pub name: Option<String>,
    /// Delegation depth (0 for a top-level agent).
    pub depth: u32,
    /// How many seed events are already in `store` (`Some` for a resumed
    /// session, which appends after them; `None` creates the session).
    pub durable: Option<u64>,
    /// Session id of a new session (a fresh one when `None`).
    pub id: Option<String>,
    /// The delegating parent's session id (a subagent's header `parentSession`).
    pub parent_session: Option<String>,
    /// Who created the session (`subagent` for a delegated child).
    pub origin: Option<String>,
    /// Events appended inside the first turn, right after its prompt is
    /// claimed and before its first step (a subagent's descriptor).
    pub opening: Vec<EventData>,
    /// A flat scope: registrations of the creating context's scope are not
    /// inherited (a subagent sees only global registrations and its own).
    pub flat_scope: bool,
    /// Called by the driver after each turn ends.
    pub on_turn_end: Option<TurnHook>,
    /// The approval seam of this agent (the one provided in scope when `None`).
    pub approval: Option<Arc<Approval>>,
}

/// A callback run after each turn of an agent (with the agent and how the
/// turn ended); it must not block.
#[derive(Clone)]
pub struct TurnHook(Arc<TurnHookFn>);

type TurnHookFn = dyn Fn(&Agent, &TurnSummary) + Send + Sync;

impl TurnHook {
    /// Wraps `f`.
    pub fn new(f: impl Fn(&Agent, &TurnSummary) + Send + Sync + 'static) -> TurnHook {
        TurnHook(Arc::new(f))
    }
}

impl std::fmt::Debug for TurnHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TurnHook")
    }
}

impl AgentSpec {
    /// A spec for `provider`/`model` working in `cwd`, defaults elsewhere.
    pub fn new(provider: &str, model: &str, cwd: impl Into<PathBuf>) -> AgentSpec {
        AgentSpec {
            provider: provider.into(),
            model: model.into(),
            system: None,
            cwd: cwd.into(),
            restriction: None,
            max_steps: 64,
            max_parallel_tools: 64,
            temperature: None,
            max_tokens: None,
            store: None,
            seed: None,
            name: None,
            depth: 0,
            durable: None,
            id: None,
            parent_session: None,
            origin: None,
            opening: Vec::new(),
            flat_scope: false,
            on_turn_end: None,
            approval: None,
        }
    }
}

/// Why an agent could not be created or refused input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AgentError {
    /// A service the agent needs is not provided.
    #[error("the `{0}` service is not provided; load its plugin first")]
    MissingService(&'static str),
    /// The seed could not become a session.
    #[error("cannot seed the session: {0}")]
    Seed(#[from] SessionError),
    /// The kernel refused (the owner is shutting down, …).
    #[error("{0}")]
    Kernel(String),
    /// The agent no longer takes input (it is being disposed).
    #[error("agent {0} is closed and takes no more input")]
    Closed(String),
    /// The agent is hibernated and has no scope now (wake it first).
    #[error("agent {0} is hibernated; wake it first")]
    Hibernated(String),
    /// A wait ran out.
    #[error("agent {id} did not become idle within {after:?}")]
    Timeout {
        /// Agent id.
        id: String,
        /// The budget.
        after: Duration,
    },
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

/// Emitted when an agent is created (mode: emit).
#[derive(Clone, Debug)]
pub struct AgentCreated {
    /// Agent id.
    pub id: String,
}
impl Event for AgentCreated {
    const NAME: &'static str = "agent/created";
}
impl Emit for AgentCreated {}

/// Emitted when an agent is disposed (mode: emit).
#[derive(Clone, Debug)]
pub struct AgentDisposed {
    /// Agent id.
    pub id: String,
}
impl Event for AgentDisposed {
    const NAME: &'static str = "agent/disposed";
}
impl Emit for AgentDisposed {}

/// Before each step (mode: emit).
#[derive(Clone, Debug)]
pub struct AgentPreStep {
    /// Agent id.
    pub agent: String,
    /// Turn number.
    pub turn: u32,
    /// Step number.
    pub step: u32,
}
impl Event for AgentPreStep {
    const NAME: &'static str = "agent/pre-step";
}
impl Emit for AgentPreStep {}

/// The request of a step, before `llm/stream` (mode: waterfall); listeners
/// may rewrite it.
pub struct AgentRequest {
    /// Agent id.
    pub agent: String,
    /// The request.
    pub request: LlmRequest,
}
impl Event for AgentRequest {
    const NAME: &'static str = "agent/request";
}
impl dsh_supervisors::Waterfall for AgentRequest {
    type Output = LlmRequest;
}

/// The model answered without tool calls and the turn is about to end
/// (mode: serial). A listener returning `Some(text)` continues the turn with
/// that text as a new user-role message (a goal or loop continuation).
pub struct AgentTurnStopping {
    /// Agent id.
    pub agent: String,
    /// Turn number.
    pub turn: u32,
    /// The answer that would end the turn.
    pub text: String,
}
impl Event for AgentTurnStopping {
    const NAME: &'static str = "agent/turn-stopping";
}
impl dsh_supervisors::Serial for AgentTurnStopping {
    type Output = String;
}

pub use keeper::{Agents, Hibernation};

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
    tokens: AtomicU64,
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
    /// Run once when the agent is disposed for good (not when it hibernates).
    /// Boxed: most agents never register one.
    #[allow(clippy::box_collection)]
    on_disposed: Option<Box<Vec<DisposedFn>>>,
}

/// Held while an agent goes to sleep, wakes or is disposed.
struct Transition<'a>(&'a Inner);

impl Drop for Transition<'_> {
    fn drop(&mut self) {
        self.0.transitioning.store(false, Ordering::Release);
        // Transition waiters wait on the idle notifier (and check again).
        self.0.idle.changed.notify_waiters();
    }
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

/// Whether the agent has actors now.
enum Life {
    /// Its scope, session actor and driver run.
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
    cwd: Arc<PathBuf>,
    driver: std::sync::OnceLock<WorkerRef<DriverMsg>>,
    /// Tool schemas and request header, rebuilt only when the tool registry changes.
    envelope: Mutex<Option<Envelope>>,
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

#[derive(Clone)]
struct Envelope {
    generation: u64,
    system: Option<String>,
    schemas: Arc<[ToolSchema]>,
    header: Arc<serde_json::Value>,
}

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

enum DriverMsg {
    Wake,
}

/// The driver's state: the agent and its awake part.
struct Driving {
    agent: Agent,
    me: Arc<Awake>,
}

impl Agent {
    /// Creates an agent under `ctx` as one transaction: prepare (services),
    /// set up the private scope, enter the session, enter the driver,
    /// announce; any failure disposes what was built.
    pub async fn create(ctx: &Context, mut spec: AgentSpec) -> Result<Agent, AgentError> {
        let agents = ctx.get::<Agents>(Agents::SERVICE);
        if let Some(agents) = &agents {
            agents.admit_one_more().await;
        }
        let (header, seed) = match spec.seed.take().map(|b| *b) {
            Some((h, events)) => (h, Some(events)),
            None => {
                let mut h = SessionHeader::new(
                    spec.id.clone().unwrap_or_else(Message::new_id),
                    Some(spec.cwd.display().to_string()),
                );
                h.delegation_depth = spec.depth;
                h.parent_session = spec.parent_session.clone();
                h.origin = spec.origin.clone().map(serde_json::Value::String);
                (h, None)
            }
        };
        let resumed = seed.is_some();
        let log = match seed {
            Some(events) => SessionLog::from_seed(header, events, now_ms())?,
            None => SessionLog::new(header),
        };
        let session = SessionHandle::new(log);
        let id = session.shared_id();
        let first_turn = turns_in(&session);
        let durable = spec.durable.take();
        spec.id = None;
        let inner = Arc::new(Inner {
            id,
            spec: shared_spec(spec),
            owner: ctx.clone(),
            session,
            inbox: Mutex::new(Inbox {
                accepting: true,
                fresh: true,
                // A resumed session numbers its turns after the seed's.
                turn: first_turn,
                ..Inbox::default()
            }),
            idle: Idle::default(),
            resumed,
            tokens: AtomicU64::new(0),
            life: Mutex::new(Life::Gone { node: 0 }),
            transitioning: AtomicBool::new(false),
            agents,
            used: AtomicU64::new(0),
            used_ms: AtomicU64::new(0),
            durable: AtomicU64::new(durable.unwrap_or(NOT_STORED)),
            store: std::sync::OnceLock::new(),
            ending: Mutex::new(Ending::default()),
        });
        let agent = Agent { inner };
        // Boxed: the build's state lives on the heap only while it runs, not in
        // every future that awaits a creation.
        let awake = Box::pin(agent.build()).await?;
        let weak = agent.downgrade();
        let hook = ctx.effect_async("dispose a hibernated agent", move || async move {
            if let Some(agent) = weak.upgrade() {
                agent.dispose().await;
            }
        });
        match hook {
            Ok(hook) => lock(&agent.inner.ending).owner_hook = Some(hook),
            Err(e) => {
                awake.scope.dispose().await;
                return Err(AgentError::Kernel(e.to_string()));
            }
        }
        if let Some(agents) = &agent.inner.agents {
            agents.admit(&agent);
        }
        agent.set_awake(awake);
        ctx.emit(&AgentCreated {
            id: agent.inner.id.to_string(),
        });
        Ok(agent)
    }

    /// Builds the agent's awake part in a fresh scope under its owner,
    /// applying what its spec registers there; on any failure the scope
    /// (and whatever was started in it) is disposed before returning.
    async fn build(&self) -> Result<Arc<Awake>, AgentError> {
        let inner = &self.inner;
        let spec = &inner.spec;
        let ctx = &inner.owner;
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or(AgentError::MissingService(LlmRuntime::SERVICE))?;
        let tools = ctx
            .get::<ToolRegistry>(ToolRegistry::SERVICE)
            .ok_or(AgentError::MissingService(ToolRegistry::SERVICE))?;
        let approval = spec
            .approval
            .clone()
            .or_else(|| ctx.get::<Approval>(Approval::SERVICE));
        let key = ScopeKey::new(self.label());
        if let Some(parent) = ctx.scope_key().filter(|_| !spec.flat_scope) {
            key.bind_parent(parent)
                .map_err(|e| AgentError::Kernel(e.to_string()))?;
        }
        let scope = ctx
            .scope(key)
            .await
            .map_err(|e| AgentError::Kernel(e.to_string()))?;
        let sctx = scope.ctx().clone();
        let session = &inner.session;
        // A store of the spec's own, else the one provided in scope.
        let store = spec.store.clone().or_else(|| {
            sctx.get::<dyn dsh_services::persistence::SessionPersistence>(
                dsh_services::persistence::PERSISTENCE_SERVICE,
            )
        });
        let stored = store.is_some();
        if let Some(s) = &store {
            let _ = inner.store.set(s.clone());
        }
        let durable = Some(inner.durable.load(Ordering::Acquire)).filter(|n| *n != NOT_STORED);
        let setup = async {
            if let Some(r) = spec.restriction.clone() {
                tools.restrict(&sctx, r).map_err(AgentError::Kernel)?;
            }
            if let (Some(text), Some(prompt)) = (
                spec.system.clone(),
                sctx.get::<SystemPrompt>(SystemPrompt::SERVICE),
            ) {
                let persona = PromptSection {
                    name: "persona".into(),
                    order: 0,
                    text: Text::Static(text),
                    complete: false,
                };
                prompt.section(&sctx, persona).map_err(AgentError::Kernel)?;
            }
            let writer: Arc<dyn dsh_services::session::SessionWriter> = Arc::new(session.clone());
            sctx.provide(dsh_services::session::SESSION_SERVICE, writer)
                .map_err(|e| AgentError::Kernel(e.to_string()))?;
            session
                .attach_after(&sctx, store, durable)
                .await
                .map_err(|e| AgentError::Kernel(e.to_string()))
        };
        if let Err(e) = setup.await {
            scope.dispose().await;
            return Err(e);
        }
        let awake = Arc::new(Awake {
            ctx: sctx.clone(),
            scope,
            llm,
            tools,
            approval,
            cwd: Arc::new(spec.cwd.clone()),
            driver: std::sync::OnceLock::new(),
            envelope: Mutex::new(None),
            conclude: AtomicBool::new(false),
            step_children: Mutex::new(Vec::new()),
            step: AtomicU32::new(0),
            published_ms: AtomicU64::new(0),
            settled: std::sync::OnceLock::new(),
            stored,
            sleeping: AtomicBool::new(false),
        });
        let name = format!("driver/{}", short(&inner.id));
        let me = Arc::new(AgentSelf(Arc::downgrade(inner)));
        let entered = async {
            sctx.provide(AGENT_SELF, me)
                .map_err(|e| AgentError::Kernel(e.to_string()))?;
            let driving = Driving {
                agent: self.clone(),
                me: awake.clone(),
            };
            let driver = sctx
                .spawn(WorkerSpec::new("agent", name, Driver, driving))
                .await
                .map_err(|e| AgentError::Kernel(e.to_string()))?;
            let _ = awake.driver.set(driver);
            let (weak, part) = (self.downgrade(), Arc::downgrade(&awake));
            sctx.on_teardown("stop input and cancel the turn", move || async move {
                let sleeping = part
                    .upgrade()
                    .is_some_and(|p| p.sleeping.load(Ordering::Acquire));
                if let Some(agent) = weak.upgrade().filter(|_| !sleeping) {
                    agent.close_and_cancel().await;
                }
            })
            .map_err(|e| AgentError::Kernel(e.to_string()))?;
            let (weak, part) = (self.downgrade(), Arc::downgrade(&awake));
            sctx.effect("leave the agents registry", move || {
                let sleeping = part
                    .upgrade()
                    .is_some_and(|p| p.sleeping.load(Ordering::Acquire));
                if let Some(agent) = weak.upgrade().filter(|_| !sleeping) {
                    agent.finish();
                }
            })
            .map_err(|e| AgentError::Kernel(e.to_string()))
        };
        if let Err(e) = entered.await {
            awake.scope.dispose().await;
            return Err(e);
        }
        let fiber = awake.scope.fiber();
        let _ = awake
            .settled
            .set((fiber.effect_count(), fiber.child_count()));
        sctx.runtime()
            .tree()
            .set_summary_fn(fiber.id(), self.summary_fn());
        Ok(awake)
    }

    /// The readable name of the agent's scope (and of its parked node).
    fn label(&self) -> String {
        self.inner
            .spec
            .name
            .clone()
            .unwrap_or_else(|| format!("agent/{}", short(&self.inner.id)))
    }

    fn life(&self) -> MutexGuard<'_, Life> {
        lock(&self.inner.life)
    }

    /// The awake part, while the agent is awake.
    fn awake(&self) -> Option<Arc<Awake>> {
        match &*self.life() {
            Life::Awake(a) => Some(a.clone()),
            _ => None,
        }
    }

    fn set_awake(&self, awake: Arc<Awake>) {
        // The owner may have torn the new scope down already (its registry
        // effect then ended the agent): do not bring it back.
        let status = awake.scope.fiber().status();
        if status.is_terminal() || status == Status::Unloading {
            return;
        }
        *self.life() = Life::Awake(awake);
        self.touch();
        if let Some(agents) = &self.inner.agents {
            agents.woke(self);
        }
    }

    /// Marks a use (for the awake cap's least-recently-used order and the
    /// idle timeout).
    fn touch(&self) {
        if let Some(agents) = &self.inner.agents {
            self.inner.used.store(agents.tick(), Ordering::Relaxed);
        }
        self.inner.used_ms.store(now_ms(), Ordering::Relaxed);
    }

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

    /// The spec the agent is built from (and rebuilt from when it wakes):
    /// without its seed, id and durable count, which belong to the session.
    pub fn spec(&self) -> &AgentSpec {
        &self.inner.spec
    }

    /// Delegation depth, from the session header (0 for a top-level agent).
    pub fn depth(&self) -> u32 {
        self.inner
            .session
            .read(|log| log.header().delegation_depth)
            .max(self.inner.spec.depth)
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
            .on_disposed
            .get_or_insert_with(Box::default)
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

    /// The kernel id of the agent's tree node: its scope fiber while awake,
    /// its parked node while hibernated.
    pub fn node_id(&self) -> u64 {
        self.life().node()
    }

    /// Waits until no other transition (sleep, wake, disposal) runs and
    /// starts one; it ends when the guard drops.
    async fn transition(&self) -> Transition<'_> {
        loop {
            // Registered before the check, so the end of the running
            // transition cannot be missed.
            let notified = self.inner.idle.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self
                .inner
                .transitioning
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Transition(&self.inner);
            }
            notified.await;
        }
    }

    /// The agent's key among the keeper's awake agents (its record's
    /// address: unique while the keeper holds a weak handle to it).
    fn key(&self) -> u64 {
        Arc::as_ptr(&self.inner) as usize as u64
    }

    /// Kernel ids of the actors the agent's scope owns, in start order
    /// (none while it hibernates).
    pub fn child_nodes(&self) -> Vec<u64> {
        self.awake()
            .map(|me| me.scope.fiber().children())
            .unwrap_or_default()
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        lock(&self.inner.inbox)
    }

    /// Tells the driver there is work (waking the agent first if it sleeps).
    /// `idle` was already cleared under the inbox lock by the caller, so a
    /// driver finishing concurrently cannot report idle over queued work.
    fn kick(&self) {
        self.touch();
        match &*self.life() {
            Life::Awake(me) if !me.sleeping.load(Ordering::Acquire) => {
                if let Some(d) = me.driver.get() {
                    let _ = d.send(DriverMsg::Wake);
                }
                return;
            }
            Life::Gone { .. } => return,
            _ => {}
        }
        // Asleep, or going to sleep: the keeper wakes it (after the
        // hibernation finishes) and then tells the new driver.
        let asked = self
            .inner
            .agents
            .as_ref()
            .is_some_and(|a| a.ask_wake(self.clone()));
        if !asked {
            self.abandon("no keeper runs to wake it");
        }
    }

    /// A wake failed: queued input is dropped and the agent takes no more.
    fn abandon(&self, why: &str) {
        tracing::error!(agent = %self.inner.id, "cannot wake the agent: {why}");
        let mut inbox = self.inbox();
        inbox.accepting = false;
        inbox.followups.clear();
        inbox.steer.clear();
        inbox.inject.clear();
        self.inner.idle.set(true);
    }

    fn accepting(&self) -> Result<(), AgentError> {
        if self.inbox().accepting {
            Ok(())
        } else {
            Err(AgentError::Closed(self.inner.id.to_string()))
        }
    }

    /// Queues a prompt as a new turn (after the running one); wakes a
    /// hibernated agent.
    pub fn followup(&self, message: Message) -> Result<(), AgentError> {
        {
            let mut inbox = self.inbox();
            if !inbox.accepting {
                return Err(AgentError::Closed(self.inner.id.to_string()));
            }
            inbox.fresh = false;
            let start = inbox.followups.len();
            let message = Arc::new(message);
            self.splice(start, 0, std::slice::from_ref(&message));
            inbox.followups.push_back(message);
            self.inner.idle.set(false);
        }
        self.kick();
        Ok(())
    }

    /// Records one mutation of the pending prompts (`agent/inbox/spliced`),
    /// under the inbox lock so positions match the queue.
    fn splice(&self, start: usize, removed: usize, inserted: &[Arc<Message>]) {
        let splice = dsh_services::session::InboxSplice {
            target: "next-turn".into(),
            start: start as u64,
            removed_count: (removed > 0).then_some(removed as u64),
            inserted: inserted.to_vec(),
            outcome: None,
        };
        log_append(self, EventData::InboxSpliced(splice), None);
    }

    /// Adds a message to the running turn at its next step (a new turn when
    /// idle); wakes a hibernated agent.
    pub fn steer(&self, message: Message) -> Result<(), AgentError> {
        self.accepting()?;
        {
            let mut inbox = self.inbox();
            if inbox.running {
                inbox.steer.push(Arc::new(message));
                return Ok(());
            }
            inbox.fresh = false;
            let start = inbox.followups.len();
            let message = Arc::new(message);
            self.splice(start, 0, std::slice::from_ref(&message));
            inbox.followups.push_back(message);
            self.inner.idle.set(false);
        }
        self.kick();
        Ok(())
    }

    /// Adds injected context (a non-user source) to the next step; wakes a
    /// hibernated agent (which then waits, awake, for that step).
    pub fn inject(&self, message: Message) -> Result<(), AgentError> {
        self.accepting()?;
        self.inbox().inject.push(Arc::new(message));
        let awake =
            matches!(&*self.life(), Life::Awake(me) if !me.sleeping.load(Ordering::Acquire));
        if !awake {
            self.kick();
        }
        Ok(())
    }

    /// Cancels the running turn (it ends `aborted`); queued prompts stay.
    /// A hibernated agent runs nothing: the cancel is a no-op, and says so.
    pub fn cancel(&self) -> Cancelled {
        let asleep = self.is_hibernated();
        let mut inbox = self.inbox();
        match &inbox.cancel {
            Some(token) => {
                token.cancel();
                Cancelled::Running
            }
            // A prompt queued but not yet claimed: its turn starts cancelled
            // (and ends `aborted` at once), so a cancel is never lost in the
            // moment between `followup` and the driver picking it up.
            None if !inbox.followups.is_empty() => {
                inbox.cancel_next = true;
                Cancelled::Queued
            }
            None if asleep => Cancelled::Hibernated,
            None => Cancelled::Idle,
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
        match &inbox.last {
            Some(last) if inbox.turn > before => Ok(TurnSummary::clone(last)),
            _ => Err(AgentError::Closed(self.inner.id.to_string())),
        }
    }

    /// Appends a plugin-defined record (`kind`, payload) to the agent's log;
    /// a refusal is logged, not returned (records are observations).
    pub fn record(&self, kind: &str, data: serde_json::Value) {
        let event = EventData::Other {
            kind: Arc::from(kind),
            data,
        };
        if let Err(e) = self.inner.session.append(event, None) {
            tracing::warn!(agent = %self.inner.id, "cannot record {kind}: {e}");
        }
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

    async fn close_and_cancel(&self) {
        {
            let mut inbox = self.inbox();
            inbox.accepting = false;
            inbox.followups.clear();
            if let Some(t) = &inbox.cancel {
                t.cancel();
            }
        }
        // The driver writes the turn's end; bounded so a stuck body cannot
        // hold the teardown (the kernel kills it after its budget anyway).
        let _ = tokio::time::timeout(Duration::from_secs(5), self.inner.idle.wait()).await;
    }

    /// Ordered teardown of the agent and everything it owns. A hibernated
    /// agent is disposed without waking: its parked node and compact session
    /// go, and it leaves the registry.
    pub async fn dispose(&self) {
        let _transition = self.transition().await;
        let awake = match &*self.life() {
            Life::Awake(me) => Some(me.clone()),
            Life::Asleep { .. } => None,
            Life::Gone { .. } => return,
        };
        match awake {
            // Its teardown ends with `finish` (the registry effect).
            Some(me) => me.scope.dispose().await,
            None => {
                self.inbox().accepting = false;
                self.write_tail().await;
                self.finish();
            }
        }
    }

    /// Writes what was appended while the agent slept (a record, the splice
    /// of input whose wake failed) to its store, which its next wake would
    /// have done: an agent disposed asleep loses nothing committed.
    async fn write_tail(&self) {
        let Some(store) = self.inner.store.get().cloned() else {
            return;
        };
        let from = self.inner.durable.load(Ordering::Acquire);
        let session = &self.inner.session;
        if from == NOT_STORED || session.next_seq() <= from {
            return;
        }
        let events = session.events_from(from);
        let id = self.inner.id.to_string();
        let written = tokio::task::spawn_blocking(move || store.append(&id, &events)).await;
        match written {
            Ok(Ok(())) => self
                .inner
                .durable
                .store(session.next_seq(), Ordering::Release),
            Ok(Err(e)) => {
                tracing::error!(agent = %self.inner.id, "the session's last events were not written: {e}")
            }
            Err(e) => tracing::error!(agent = %self.inner.id, "the session writer failed: {e}"),
        }
    }

    /// The end of the agent: it leaves the registry and the tree, its
    /// disposal callbacks run, `agent/disposed` is emitted.
    fn finish(&self) {
        let was = {
            let mut life = self.life();
            let node = life.node();
            std::mem::replace(&mut *life, Life::Gone { node })
        };
        {
            let mut inbox = self.inbox();
            inbox.accepting = false;
            inbox.followups.clear();
        }
        self.inner.idle.set(true);
        if let Life::Asleep { node } = was {
            self.inner.owner.runtime().tree().unpark(
                node,
                Status::Disposed,
                "disposed while hibernated",
            );
        }
        let ending = std::mem::take(&mut *lock(&self.inner.ending));
        if let Some(hook) = ending.owner_hook {
            hook.cancel();
        }
        if let Some(agents) = &self.inner.agents {
            agents.leave(self);
        }
        let callbacks = ending.on_disposed.map_or_else(Vec::new, |b| *b);
        for f in callbacks {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                tracing::error!(
                    agent = %self.inner.id,
                    "a disposal callback panicked: {}",
                    dsh_supervisors::events::panic_text(&p)
                );
            }
        }
        self.inner.owner.emit(&AgentDisposed {
            id: self.inner.id.to_string(),
        });
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

    /// What the tree shows for the agent, computed when read (not kept as
    /// JSON per agent): turn, step (0 between turns), tokens spent, whether
    /// it hibernates, and between turns what keeps it from hibernating
    /// (`pinned`: registrations made in its scope after it was built).
    fn summary_fn(&self) -> Arc<dsh_supervisors::tree::SummaryFn> {
        let weak = self.downgrade();
        Arc::new(move || match weak.upgrade() {
            Some(agent) => agent.summary(),
            None => serde_json::Value::Null,
        })
    }

    fn summary(&self) -> serde_json::Value {
        let progress = self.progress();
        let mut summary = serde_json::json!({
            "agent": self.inner.id,
            "turn": progress.turn,
            "step": progress.step,
            "tokens": progress.tokens,
        });
        if progress.hibernated {
            summary["hibernated"] = true.into();
        }
        if let Some(me) = self.awake().filter(|_| !progress.running) {
            let fiber = me.scope.fiber();
            let settled = me.settled.get().map_or(0, |s| s.0);
            if fiber.effect_count() > settled {
                let mut labels = fiber.effects();
                let ad_hoc = labels.split_off(settled.min(labels.len()));
                summary["pinned"] = format!("ad hoc registrations: {}", ad_hoc.join(", ")).into();
            }
        }
        summary
    }

    /// Why the agent cannot hibernate now (`None`: it can).
    pub fn awake_reason(&self) -> Option<String> {
        let me = self.awake()?;
        self.may_sleep(&me, &self.inbox()).err()
    }

    /// Whether the agent may hibernate, given its inbox (locked by the caller).
    fn may_sleep(&self, me: &Awake, inbox: &Inbox) -> Result<(), String> {
        {
            if !inbox.accepting {
                return Err("it takes no more input".into());
            }
            if inbox.running {
                return Err("a turn is running".into());
            }
            if !inbox.followups.is_empty() || !inbox.steer.is_empty() || !inbox.inject.is_empty() {
                return Err("input is queued".into());
            }
        }
        if me.sleeping.load(Ordering::Acquire) {
            return Err("it is going to sleep".into());
        }
        let fiber = me.scope.fiber();
        let (effects, children) = me.settled.get().copied().unwrap_or((0, 0));
        if fiber.child_count() > children || !lock(&me.step_children).is_empty() {
            return Err("it has live children".into());
        }
        if fiber.effect_count() > effects {
            let ad_hoc = fiber
                .effects()
                .split_off(effects.min(fiber.effects().len()));
            return Err(format!(
                "ad hoc registrations in its scope: {}",
                ad_hoc.join(", ")
            ));
        }
        Ok(())
    }

    /// Puts an idle agent to sleep: its actors stop in the normal ordered
    /// way (scope, driver, session actor, which writes what is pending),
    /// its session is compacted, and a parked node stands for it in the
    /// tree. Refused (with the reason) while it works, has queued input,
    /// live children or ad hoc registrations, or when no keeper runs to
    /// wake it again.
    pub async fn hibernate(&self) -> Result<(), String> {
        if !self.inner.agents.as_ref().is_some_and(|a| a.has_keeper()) {
            return Err("no agents keeper runs to wake it again".into());
        }
        let _transition = self.transition().await;
        let me = match &*self.life() {
            Life::Awake(me) => me.clone(),
            Life::Asleep { .. } => return Ok(()),
            Life::Gone { .. } => return Err("it is disposed".into()),
        };
        {
            // Under the inbox lock: input arriving from now on sees
            // `sleeping` and asks the keeper to wake the agent.
            let mut inbox = self.inbox();
            self.may_sleep(&me, &inbox)?;
            me.sleeping.store(true, Ordering::Release);
            // Empty, but sized for the last burst: sized for idle instead.
            inbox.followups.shrink_to_fit();
            inbox.steer.shrink_to_fit();
            inbox.inject.shrink_to_fit();
        }
        // Durable first: an agent whose log cannot be written stays awake
        // (its session actor keeps retrying).
        if let Err(e) = self.inner.session.flush().await {
            me.sleeping.store(false, Ordering::Release);
            return Err(e);
        }
        me.scope.dispose().await;
        let session = &self.inner.session;
        session.detach();
        if me.stored {
            // What the actor wrote, not what the log holds: an event
            // appended while it drained (a splice of input arriving now) is
            // written on wake.
            self.inner
                .durable
                .store(session.written(), Ordering::Release);
        }
        if let Err(e) = session.compact() {
            tracing::warn!(agent = %self.inner.id, "the session stays uncompressed: {e}");
        }
        let summary = self.summary_fn();
        let owner = &self.inner.owner;
        // Named by the agent's own name, else its id (shared, not copied).
        let name = match &self.inner.spec.name {
            Some(n) => Arc::from(n.as_str()),
            None => self.inner.session.shared_id(),
        };
        let parent = Some(owner.fiber().id());
        let node = owner.runtime().tree().park("agent", name, parent, summary);
        *self.life() = Life::Asleep { node };
        if let Some(agents) = &self.inner.agents {
            agents.slept(self);
        }
        Ok(())
    }

    /// Wakes a hibernated agent under the same id: a new scope with what its
    /// spec registers, the session restored, a new driver; then any queued
    /// input runs. Awake already: only the driver is told.
    pub async fn wake(&self) -> Result<(), AgentError> {
        let _transition = self.transition().await;
        let node = match &*self.life() {
            Life::Awake(me) => {
                if let Some(d) = me.driver.get() {
                    let _ = d.send(DriverMsg::Wake);
                }
                return Ok(());
            }
            Life::Asleep { node } => *node,
            Life::Gone { .. } => return Err(AgentError::Closed(self.inner.id.to_string())),
        };
        self.inner
            .session
            .thaw()
            .map_err(|e| AgentError::Kernel(format!("the session does not restore: {e}")))?;
        let awake = Box::pin(self.build()).await?;
        self.inner
            .owner
            .runtime()
            .tree()
            .unpark(node, Status::Hibernated, "woke");
        let driver = awake.driver.get().cloned();
        self.set_awake(awake);
        if let Some(d) = driver {
            let _ = d.send(DriverMsg::Wake);
        }
        Ok(())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The last turn number a session's log holds.
fn turns_in(session: &SessionHandle) -> u32 {
    session.with_log(|log| {
        log.events()
            .iter()
            .filter_map(|e| match e.data {
                EventData::TurnStart { turn } => Some(turn),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    })
}

/// The driver actor: runs queued turns one at a time.
struct Driver;

impl Actor for Driver {
    type Msg = DriverMsg;
    type State = Driving;
    type Arguments = Driving;

    async fn pre_start(
        &self,
        _me: ActorRef<DriverMsg>,
        driving: Driving,
    ) -> Result<Driving, ActorProcessingErr> {
        Ok(driving)
    }

    async fn handle(
        &self,
        _me: ActorRef<DriverMsg>,
        DriverMsg::Wake: DriverMsg,
        state: &mut Driving,
    ) -> Result<(), ActorProcessingErr> {
        let Driving { agent, me } = &*state;
        loop {
            let next = {
                let mut inbox = agent.inbox();
                if !inbox.accepting {
                    None
                } else if let Some(prompt) = inbox.followups.pop_front() {
                    inbox.running = true;
                    inbox.turn += 1;
                    // Under the inbox lock: the claim is logged at the
                    // position the queue had, right after the turn opens.
                    log_append(agent, EventData::TurnStart { turn: inbox.turn }, None);
                    agent.splice(0, 1, &[]);
                    if !std::mem::replace(&mut inbox.opened, true) {
                        for data in agent.inner.spec.opening.iter().cloned() {
                            log_append(agent, data, None);
                        }
                    }
                    let token = CancellationToken::new();
                    if std::mem::take(&mut inbox.cancel_next) {
                        token.cancel();
                    }
                    inbox.cancel = Some(token.clone());
                    Some((prompt, inbox.turn, token))
                } else {
                    None
                }
            };
            let Some((prompt, turn, token)) = next else {
                break;
            };
            // Boxed: an idle driver's task does not carry a turn's state.
            let summary = Box::pin(run_turn(agent, me, prompt, turn, token)).await;
            {
                let mut inbox = agent.inbox();
                inbox.running = false;
                inbox.cancel = None;
                inbox.last = Some(Box::new(summary.clone()));
                // Steered in after the turn's last step: the next turn's prompt.
                let leftover: Vec<Arc<Message>> = inbox.steer.drain(..).collect();
                for message in leftover {
                    let start = inbox.followups.len();
                    agent.splice(start, 0, std::slice::from_ref(&message));
                    inbox.followups.push_back(message);
                }
            }
            if let Some(hook) = &agent.inner.spec.on_turn_end {
                let run = std::panic::AssertUnwindSafe(|| (hook.0)(agent, &summary));
                if let Err(p) = std::panic::catch_unwind(run) {
                    tracing::error!(
                        agent = %agent.inner.id,
                        "a turn-end hook panicked: {}",
                        dsh_supervisors::events::panic_text(&p)
                    );
                }
            }
        }
        // Before idle is announced: whoever waits for it finds the keeper
        // already asked to apply the awake cap.
        agent.touch();
        if let Some(agents) = &agent.inner.agents {
            agents.idled();
        }
        let inbox = agent.inbox();
        if inbox.followups.is_empty() || !inbox.accepting {
            // Under the inbox lock: see `Agent::kick`.
            agent.inner.idle.set(true);
        }
        drop(inbox);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<DriverMsg>,
        state: &mut Driving,
    ) -> Result<(), ActorProcessingErr> {
        // However the driver ended (drained, killed, failed), no turn runs
        // any more: waiters on idle must not wait forever. Going to sleep,
        // the agent still takes input (which wakes it).
        let mut inbox = state.agent.inbox();
        inbox.running = false;
        if !state.me.sleeping.load(Ordering::Acquire) {
            inbox.accepting = false;
        }
        if inbox.followups.is_empty() || !inbox.accepting {
            state.agent.inner.idle.set(true);
        }
        Ok(())
    }
}

/// Appends, logging (not propagating) refusals: the driver's own events are
/// well-formed by construction, so a refusal is a bug worth a loud log.
fn log_append(
    agent: &Agent,
    data: EventData,
    intent: Option<SurfaceIntent>,
) -> Option<Arc<SessionEvent>> {
    match agent.inner.session.append(data, intent) {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::error!(agent = %agent.inner.id, "session refused an append: {e}");
            None
        }
    }
}

fn failure(code: &str, message: impl Into<String>) -> LlmFailure {
    LlmFailure {
        message: message.into(),
        code: code.into(),
        status: None,
        provider_retry_after_ms: None,
        request_id: None,
    }
}

/// Runs one turn; its `turn/start` was logged when the driver claimed the prompt.
async fn run_turn(
    agent: &Agent,
    me: &Awake,
    prompt: Arc<Message>,
    turn: u32,
    token: CancellationToken,
) -> TurnSummary {
    // A capture left over from an aborted turn must not end this one.
    me.conclude.store(false, Ordering::Release);
    let mut entering = vec![prompt];
    let mut steps = 0u32;
    let mut max_tokens_hit = false;
    let mut text = String::new();
    let reason = loop {
        if token.is_cancelled() {
            break aborted();
        }
        if steps >= agent.inner.spec.max_steps {
            break TurnEndReason::Error {
                error: Box::new(failure(
                    "STEP_LIMIT",
                    format!(
                        "the turn used all {} steps it may take",
                        agent.inner.spec.max_steps
                    ),
                )),
            };
        }
        steps += 1;
        let step = steps;
        me.step.store(step, Ordering::Relaxed);
        publish_step(me);
        log_append(agent, EventData::StepStart { turn, step }, None);
        let target = dsh_supervisors::Target::Scope(me.ctx.scope_key().cloned());
        me.ctx.events().emit(
            &target,
            &AgentPreStep {
                agent: agent.inner.id.to_string(),
                turn,
                step,
            },
        );
        {
            let mut inbox = agent.inbox();
            entering.append(&mut inbox.steer);
            entering.append(&mut inbox.inject);
        }
        for m in entering.drain(..) {
            log_append(
                agent,
                EventData::UserMessage(m),
                Some(SurfaceIntent::append()),
            );
        }
        match run_step(agent, me, turn, step, &token).await {
            StepEnd::Answer {
                text: t,
                max_tokens,
            } => {
                text = t;
                max_tokens_hit |= max_tokens;
                log_append(agent, EventData::StepEnd { turn, step }, None);
                let steered = !agent.inbox().steer.is_empty();
                if steered && !token.is_cancelled() {
                    continue;
                }
                let stopping = AgentTurnStopping {
                    agent: agent.inner.id.to_string(),
                    turn,
                    text: text.clone(),
                };
                let target = dsh_supervisors::Target::Scope(me.ctx.scope_key().cloned());
                if !token.is_cancelled()
                    && let Some(more) = me.ctx.events().serial(&target, stopping).await
                {
                    let mut continuation = Message::user_text(more);
                    continuation.source = MessageSource::plugin("agent/turn-stopping");
                    entering.push(Arc::new(continuation));
                    continue;
                }
                break if max_tokens_hit {
                    TurnEndReason::MaxTokens
                } else {
                    TurnEndReason::Completed
                };
            }
            StepEnd::ToolsDone { max_tokens } => {
                max_tokens_hit |= max_tokens;
                log_append(agent, EventData::StepEnd { turn, step }, None);
            }
            StepEnd::Concluded { max_tokens } => {
                log_append(agent, EventData::StepEnd { turn, step }, None);
                break if max_tokens_hit || max_tokens {
                    TurnEndReason::MaxTokens
                } else {
                    TurnEndReason::Completed
                };
            }
            StepEnd::Aborted => {
                log_append(agent, EventData::StepEnd { turn, step }, None);
                break aborted();
            }
            StepEnd::Failed(f) => {
                log_append(agent, EventData::StepEnd { turn, step }, None);
                break TurnEndReason::Error { error: Box::new(f) };
            }
        }
    };
    log_append(
        agent,
        EventData::TurnEnd {
            turn,
            reason: reason.clone(),
        },
        None,
    );
    publish_progress(me);
    TurnSummary {
        turn,
        steps,
        reason,
        text,
    }
}

fn aborted() -> TurnEndReason {
    TurnEndReason::Aborted {
        reason: serde_json::json!({"kind": "user"}),
    }
}

enum StepEnd {
    Answer {
        text: String,
        max_tokens: bool,
    },
    /// A capture tool concluded the turn: no continuation.
    Concluded {
        max_tokens: bool,
    },
    ToolsDone {
        max_tokens: bool,
    },
    Aborted,
    Failed(LlmFailure),
}

/// The tool schemas and header in force, rebuilt when the registry changed.
fn envelope(inner: &Inner, me: &Awake, system: Option<&str>) -> Envelope {
    let generation = me.tools.generation();
    let mut cache = lock(&me.envelope);
    if let Some(e) = cache.as_ref()
        && e.generation == generation
        && e.system.as_deref() == system
    {
        return e.clone();
    }
    let tools = me.tools.visible(me.ctx.scope_key());
    let (schemas, header) = shared_envelope(&inner.spec, system, &tools);
    let fresh = Envelope {
        generation,
        system: system.map(str::to_owned),
        schemas,
        header,
    };
    *cache = Some(fresh.clone());
    fresh
}

/// Specs in use, shared between agents: agents made from one template (same
/// route, prompt, tools, limits and hooks) hold one spec, not a copy each.
static SHARED_SPECS: Mutex<VecDeque<std::sync::Weak<AgentSpec>>> = Mutex::new(VecDeque::new());

/// Specs remembered for sharing (most recently made first).
const SHARED_SPEC_SLOTS: usize = 32;

fn shared_spec(spec: AgentSpec) -> Arc<AgentSpec> {
    let mut shared = lock(&SHARED_SPECS);
    shared.retain(|w| w.strong_count() > 0);
    let found = shared
        .iter()
        .position(|w| w.upgrade().is_some_and(|s| same_template(&s, &spec)));
    if let Some(at) = found
        && let Some(known) = shared.remove(at).and_then(|w| w.upgrade())
    {
        shared.push_front(Arc::downgrade(&known));
        return known;
    }
    let made = Arc::new(spec);
    shared.push_front(Arc::downgrade(&made));
    shared.truncate(SHARED_SPEC_SLOTS);
    made
}

/// Whether two kept specs (no seed, id or durable count) build the same agent.
fn same_template(a: &AgentSpec, b: &AgentSpec) -> bool {
    fn same_arc<T: ?Sized>(a: Option<&Arc<T>>, b: Option<&Arc<T>>) -> bool {
        match (a, b) {
            (None, None) => true,
            (Some(x), Some(y)) => Arc::ptr_eq(x, y),
            _ => false,
        }
    }
    let hooks = same_arc(
        a.on_turn_end.as_ref().map(|h| &h.0),
        b.on_turn_end.as_ref().map(|h| &h.0),
    );
    a.seed.is_none()
        && b.seed.is_none()
        && a.opening.is_empty()
        && b.opening.is_empty()
        && hooks
        && a.provider == b.provider
        && a.model == b.model
        && a.system == b.system
        && a.cwd == b.cwd
        && a.restriction == b.restriction
        && a.max_steps == b.max_steps
        && a.max_parallel_tools == b.max_parallel_tools
        && a.temperature == b.temperature
        && a.max_tokens == b.max_tokens
        && same_arc(a.store.as_ref(), b.store.as_ref())
        && a.name == b.name
        && a.depth == b.depth
        && a.id == b.id
        && a.durable == b.durable
        && a.parent_session == b.parent_session
        && a.origin == b.origin
        && a.flat_scope == b.flat_scope
        && same_arc(a.approval.as_ref(), b.approval.as_ref())
}

/// Envelopes in use, shared between agents: agents with the same tools,
/// route and system text hold one schema list and one header value instead
/// of a copy each (a thousand subagents would otherwise carry a thousand).
static SHARED_ENVELOPES: Mutex<VecDeque<SharedEnvelope>> = Mutex::new(VecDeque::new());

/// One shared envelope: what it was built from (weak references: they keep
/// no spec or tool alive, and their addresses cannot be reused while held)
/// and the schema list and header built.
struct SharedEnvelope {
    spec: std::sync::Weak<AgentSpec>,
    system: Option<String>,
    tools: Box<[std::sync::Weak<RegisteredTool>]>,
    schemas: Arc<[ToolSchema]>,
    header: Arc<serde_json::Value>,
}

impl SharedEnvelope {
    /// Built from this very spec, system text and tool list.
    fn built_from(
        &self,
        spec: &Arc<AgentSpec>,
        system: Option<&str>,
        tools: &[Arc<RegisteredTool>],
    ) -> bool {
        std::ptr::eq(self.spec.as_ptr(), Arc::as_ptr(spec))
            && self.system.as_deref() == system
            && self.tools.len() == tools.len()
            && self
                .tools
                .iter()
                .zip(tools)
                .all(|(w, t)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(t)))
    }
}

/// Envelopes remembered for sharing (most recently built first).
const SHARED_ENVELOPE_SLOTS: usize = 32;

/// The schema list and header for `spec`, `system` and `tools`: one built
/// from the same inputs before, else one equal to what they build, else a
/// new one.
fn shared_envelope(
    spec: &Arc<AgentSpec>,
    system: Option<&str>,
    tools: &[Arc<RegisteredTool>],
) -> (Arc<[ToolSchema]>, Arc<serde_json::Value>) {
    let mut shared = SHARED_ENVELOPES.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(at) = shared
        .iter()
        .position(|e| e.built_from(spec, system, tools))
        && let Some(hit) = shared.remove(at)
    {
        let found = (hit.schemas.clone(), hit.header.clone());
        shared.push_front(hit);
        return found;
    }
    let schemas: Vec<ToolSchema> = tools.iter().map(|t| t.schema.clone()).collect();
    let header = header_value(spec, system, &schemas);
    let (schemas, header) = match shared.iter().find(|e| *e.header == header) {
        Some(equal) => (equal.schemas.clone(), equal.header.clone()),
        None => (schemas.into(), Arc::new(header)),
    };
    shared.push_front(SharedEnvelope {
        spec: Arc::downgrade(spec),
        system: system.map(str::to_owned),
        tools: tools.iter().map(Arc::downgrade).collect(),
        schemas: schemas.clone(),
        header: header.clone(),
    });
    shared.truncate(SHARED_ENVELOPE_SLOTS);
    (schemas, header)
}

/// The request envelope as logged in `request/header`.
fn header_value(spec: &AgentSpec, system: Option<&str>, tools: &[ToolSchema]) -> serde_json::Value {
    let mut config = serde_json::Map::new();
    config.insert("provider".into(), spec.provider.clone().into());
    config.insert("model".into(), spec.model.clone().into());
    if let Some(t) = spec.temperature {
        config.insert("temperature".into(), t.into());
    }
    if let Some(m) = spec.max_tokens {
        config.insert("maxTokens".into(), m.into());
    }
    let mut header = serde_json::Map::new();
    header.insert("config".into(), serde_json::Value::Object(config));
    if let Some(s) = system.filter(|s| !s.is_empty()) {
        header.insert("system".into(), s.into());
    }
    if !tools.is_empty() {
        header.insert(
            "tools".into(),
            serde_json::to_value(tools).unwrap_or_default(),
        );
    }
    serde_json::Value::Object(header)
}

async fn run_step(
    agent: &Agent,
    me: &Awake,
    turn: u32,
    step: u32,
    token: &CancellationToken,
) -> StepEnd {
    let inner = &agent.inner;
    let scope = me.ctx.scope_key();
    let system: Option<Arc<str>> = match me.ctx.get::<SystemPrompt>(SystemPrompt::SERVICE) {
        Some(prompt) => match prompt.assemble(&me.ctx).await {
            Ok(text) if text.is_empty() => None,
            Ok(text) => Some(Arc::from(text)),
            Err(e) => return StepEnd::Failed(failure("SYSTEM_PROMPT", e)),
        },
        None => inner.spec.system.as_deref().map(Arc::from),
    };
    let envelope = envelope(inner, me, system.as_deref());
    // The request envelope is logged state: a full snapshot at the first
    // request of this agent instance, then whenever it changes.
    let (first, changed) = inner.session.with_log(|log| {
        let logged = log.request_header();
        let first_here = logged.is_none()
            || !log
                .events()
                .iter()
                .skip(log.first_live_seq() as usize)
                .any(|e| matches!(e.data, EventData::RequestHeader { .. }));
        let same = logged.is_some_and(|h| {
            Arc::ptr_eq(h, &envelope.header) || h.as_ref() == envelope.header.as_ref()
        });
        (first_here, !same)
    });
    if first || changed {
        let reason = if !first {
            "change"
        } else if inner.resumed {
            "resume"
        } else {
            "initial"
        };
        log_append(
            agent,
            EventData::RequestHeader {
                header: envelope.header.clone(),
                reason: reason.into(),
            },
            None,
        );
        let route = RequestContext {
            provider: inner.spec.provider.clone(),
            model: inner.spec.model.clone(),
            context_window: None,
        };
        let differs = inner
            .session
            .with_log(|log| log.request_context() != Some(&route));
        if differs {
            log_append(agent, EventData::RequestContext(route), None);
        }
    }
    let schemas = envelope.schemas.clone();
    let request = LlmRequest {
        provider: inner.spec.provider.clone(),
        model: inner.spec.model.clone(),
        system,
        messages: inner.session.derive_messages(),
        tools: schemas,
        temperature: inner.spec.temperature,
        max_tokens: inner.spec.max_tokens,
        options: Default::default(),
    };
    let target = dsh_supervisors::Target::Scope(scope.cloned());
    let wrapped = AgentRequest {
        agent: inner.id.to_string(),
        request,
    };
    let request = match me
        .ctx
        .events()
        .waterfall(&target, wrapped, |r: AgentRequest| async move { r.request })
        .await
    {
        Ok(r) => r,
        Err(e) => return StepEnd::Failed(failure("LISTENER_PANICKED", e.to_string())),
    };
    let call_token = token.child_token();
    let stream = tokio::select! {
        s = me.llm.stream(&me.ctx, request, call_token.clone()) => s,
        () = token.cancelled() => return StepEnd::Aborted,
    };
    let mut stream = match stream {
        Ok(s) => s,
        Err(f) => return StepEnd::Failed(f),
    };
    let mut assembler = BlockAssembler::new();
    let mut chunk_seqs = Vec::new();
    loop {
        // Cancellation first: a stream ended by the cancel itself is a cancel.
        let next = tokio::select! {
            biased;
            () = token.cancelled() => None,
            c = stream.next() => Some(c),
        };
        match next {
            None => {
                call_token.cancel();
                keep_interrupted(agent, turn, step, &assembler, chunk_seqs);
                return StepEnd::Aborted;
            }
            Some(Some(Err(_))) if token.is_cancelled() => {
                keep_interrupted(agent, turn, step, &assembler, chunk_seqs);
                return StepEnd::Aborted;
            }
            Some(None) => break,
            Some(Some(Err(f))) => return StepEnd::Failed(f),
            Some(Some(Ok(chunk))) => {
                assembler.push(&chunk);
                let done = matches!(chunk, StreamChunk::Finish { .. });
                if let Some(e) =
                    log_append(agent, EventData::AssistantChunk { turn, step, chunk }, None)
                {
                    chunk_seqs.push(e.seq);
                }
                if done {
                    break;
                }
            }
        }
    }
    let finish = assembler.finish();
    if let FinishReason::Error { failure } | FinishReason::Aborted { failure } = finish {
        return StepEnd::Failed(*failure);
    }
    let max_tokens = finish == FinishReason::MaxTokens;
    if let Some(u) = assembler.usage() {
        inner
            .tokens
            .fetch_add(u.input_tokens + u.output_tokens, Ordering::Relaxed);
    }
    let message = match assembler.message(MessageSource::model(
        &inner.spec.provider,
        &inner.spec.model,
    )) {
        Ok(m) => Arc::new(m),
        Err(e) => return StepEnd::Failed(failure("MALFORMED_STREAM", e)),
    };
    log_append(
        agent,
        EventData::AssistantMessage {
            turn,
            step,
            message: message.clone(),
            usage: assembler.usage(),
            interrupted: false,
        },
        Some(SurfaceIntent::append_citing(chunk_seqs)),
    );
    let calls: Vec<ToolCall> = message
        .tool_calls()
        .map(|(id, name, arguments)| ToolCall {
            id: id.to_owned(),
            name: name.to_owned(),
            arguments: arguments.to_owned(),
        })
        .collect();
    if calls.is_empty() {
        return StepEnd::Answer {
            text: message.text(),
            max_tokens,
        };
    }
    let mut call_seqs = Vec::with_capacity(calls.len());
    for c in &calls {
        let seq = log_append(
            agent,
            EventData::ToolCall {
                turn,
                step,
                call_id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            },
            None,
        )
        .map(|e| e.seq);
        call_seqs.push(seq);
    }
    // Runs of concurrency-safe calls go in parallel; any other call alone.
    let mut i = 0;
    while i < calls.len() {
        let safe = |c: &ToolCall| match me.tools.resolve(scope, &c.name) {
            dsh_services::tools::Resolution::Found(t) => t.tool.is_concurrency_safe(),
            _ => true,
        };
        let mut j = i + 1;
        if safe(&calls[i]) {
            while j < calls.len() && safe(&calls[j]) {
                j += 1;
            }
        }
        // A lone call is awaited in place (no batch of large futures to move).
        let outcomes = if j == i + 1 {
            vec![execute(me, calls[i].clone(), token).await]
        } else {
            // At most `max_parallel_tools` at once; results keep call order.
            let batch: Vec<_> = calls[i..j]
                .iter()
                .cloned()
                .map(|c| execute(me, c, token))
                .collect();
            futures::stream::iter(batch)
                .buffered(inner.spec.max_parallel_tools.max(1))
                .collect::<Vec<_>>()
                .await
        };
        for (k, outcome) in outcomes.into_iter().enumerate() {
            let call = &calls[i + k];
            let message = Message {
                id: Message::new_id(),
                role: Role::User,
                content: vec![ContentBlock::ToolResult {
                    tool_call_id: call.id.clone(),
                    content: outcome.content,
                    is_error: Some(outcome.error.is_some()),
                }],
                source: MessageSource::tool(&call.id),
            };
            let cited = call_seqs[i + k].map(|s| vec![s]);
            log_append(
                agent,
                EventData::ToolResult {
                    turn,
                    step,
                    message: Arc::new(message),
                    error: outcome.error.map(|e| dsh_services::session::ToolErrorId {
                        name: "ToolError".into(),
                        code: e.code,
                    }),
                    meta: outcome.meta,
                },
                Some(SurfaceIntent {
                    surface_op: dsh_services::session::SurfaceOp::Append,
                    source_event_seqs: cited,
                }),
            );
        }
        i = j;
    }
    release_step_children(me).await;
    if token.is_cancelled() {
        return StepEnd::Aborted;
    }
    if me.conclude.swap(false, Ordering::AcqRel) {
        return StepEnd::Concluded { max_tokens };
    }
    StepEnd::ToolsDone { max_tokens }
}

/// Commits the visible prefix of a cancelled stream as an interrupted
/// assistant message (nothing when no text or reasoning arrived).
fn keep_interrupted(
    agent: &Agent,
    turn: u32,
    step: u32,
    assembler: &BlockAssembler,
    chunk_seqs: Vec<u64>,
) {
    let kept = assembler.interrupted_blocks();
    if kept.is_empty() {
        return;
    }
    let spec = &agent.inner.spec;
    let message = Message {
        id: Message::new_id(),
        role: Role::Assistant,
        content: kept,
        source: MessageSource::model(&spec.provider, &spec.model),
    };
    log_append(
        agent,
        EventData::AssistantMessage {
            turn,
            step,
            message: Arc::new(message),
            usage: assembler.usage(),
            interrupted: true,
        },
        Some(SurfaceIntent::append_citing(chunk_seqs)),
    );
}

/// Runs one call as a supervised child actor of the agent's scope.
async fn execute(me: &Awake, call: ToolCall, token: &CancellationToken) -> PipelineOutcome {
    let (tx, rx) = oneshot::channel();
    let args = ToolRun {
        ctx: me.ctx.clone(),
        tools: me.tools.clone(),
        approval: me.approval.clone(),
        call: call.clone(),
        cancel: token.child_token(),
        cwd: me.cwd.clone(),
        reply: Some(tx),
    };
    let name = format!("tool/{}#{}", call.name, call.id);
    let spawned = Box::pin(me.ctx.spawn(WorkerSpec::new("tool", name, ToolExec, args))).await;
    if let Err(e) = spawned {
        return PipelineOutcome {
            content: vec![ContentBlock::text(format!(
                "Error [ABORTED]: the call could not start: {e}"
            ))],
            error: Some(dsh_services::tools::ToolError::new(
                "ABORTED",
                e.to_string(),
            )),
            meta: None,
        };
    }
    rx.await.unwrap_or_else(|_| PipelineOutcome {
        content: vec![ContentBlock::text(
            "Error [ABORTED]: the call was stopped before it finished",
        )],
        error: Some(dsh_services::tools::ToolError::new(
            "ABORTED",
            "the call was stopped before it finished",
        )),
        meta: None,
    })
}

/// One tool call's actor: runs the pipeline once, replies, stops.
struct ToolExec;

struct ToolRun {
    ctx: Context,
    tools: Arc<ToolRegistry>,
    approval: Option<Arc<Approval>>,
    call: ToolCall,
    cancel: CancellationToken,
    cwd: Arc<PathBuf>,
    reply: Option<oneshot::Sender<PipelineOutcome>>,
}

impl Actor for ToolExec {
    type Msg = ();
    type State = ToolRun;
    type Arguments = ToolRun;

    async fn pre_start(
        &self,
        _me: ActorRef<()>,
        args: ToolRun,
    ) -> Result<ToolRun, ActorProcessingErr> {
        Ok(args)
    }

    async fn post_start(
        &self,
        me: ActorRef<()>,
        run: &mut ToolRun,
    ) -> Result<(), ActorProcessingErr> {
        let outcome = Box::pin(run_pipeline(
            &run.ctx,
            &run.tools,
            run.approval.as_deref(),
            run.call.clone(),
            run.cancel.clone(),
            run.cwd.clone(),
        ))
        .await;
        if let Some(reply) = run.reply.take() {
            let _ = reply.send(outcome);
        }
        me.stop(None);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<()>,
        run: &mut ToolRun,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped before finishing (drained by a teardown): cancel the body.
        run.cancel.cancel();
        Ok(())
    }
}

/// Disposes the children the step's calls handed over, in reverse start
/// order (their position among the agent's own children).
async fn release_step_children(me: &Awake) {
    let mut children = std::mem::take(&mut *lock(&me.step_children));
    if children.is_empty() {
        return;
    }
    let order = me.scope.fiber().children();
    children.sort_by_key(|c| order.iter().position(|n| *n == c.node_id()));
    for child in children.into_iter().rev() {
        child.dispose().await;
    }
}

/// Tells the tree the agent's summary changed (sent to the feed only while
/// someone watches it; the summary itself is computed when read).
fn publish_progress(me: &Awake) {
    me.published_ms.store(now_ms(), Ordering::Relaxed);
    me.ctx
        .runtime()
        .tree()
        .summary_changed(me.scope.fiber().id());
}

/// The least time between two per-step summaries of one agent on the tree
/// feed (turn ends always go out; snapshots are always current): a viewer
/// cannot follow faster.
const STEP_SUMMARY_EVERY_MS: u64 = 100;

/// [`publish_progress`] at a step, at most every [`STEP_SUMMARY_EVERY_MS`].
fn publish_step(me: &Awake) {
    if !me.ctx.runtime().tree().watched() {
        return;
    }
    let now = now_ms();
    if now.saturating_sub(me.published_ms.load(Ordering::Relaxed)) >= STEP_SUMMARY_EVERY_MS {
        publish_progress(me);
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
