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
use dsh_services::tools::{PipelineOutcome, Restriction, ToolCall, ToolRegistry, run_pipeline};
use dsh_supervisors::tree::now_ms;
use dsh_supervisors::{Context, Emit, Event, Scope, ScopeKey, Status, WorkerRef, WorkerSpec};
use futures::StreamExt;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::{oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::session::{SessionHandle, short};

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
    /// Resume or fork from these events (and header).
    pub seed: Option<(SessionHeader, Vec<SessionEvent>)>,
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

/// The `agents` service: every live agent by id.
#[derive(Default)]
pub struct Agents {
    live: Mutex<std::collections::BTreeMap<String, Agent>>,
}

impl Agents {
    /// The capability name.
    pub const SERVICE: &'static str = "agents";

    /// The agent with `id`.
    pub fn get(&self, id: &str) -> Option<Agent> {
        self.live.lock().ok()?.get(id).cloned()
    }

    /// Ids of live agents, sorted.
    pub fn ids(&self) -> Vec<String> {
        self.live
            .lock()
            .map(|l| l.keys().cloned().collect())
            .unwrap_or_default()
    }
}

#[derive(Default)]
struct Inbox {
    followups: VecDeque<Arc<Message>>,
    steer: VecDeque<Arc<Message>>,
    inject: VecDeque<Arc<Message>>,
    turn: u32,
    running: bool,
    cancel: Option<CancellationToken>,
    accepting: bool,
    last: Option<TurnSummary>,
    opened: bool,
    cancel_next: bool,
}

struct Inner {
    id: String,
    spec: AgentSpec,
    ctx: Context,
    scope: Scope,
    session: SessionHandle,
    llm: Arc<LlmRuntime>,
    tools: Arc<ToolRegistry>,
    approval: Option<Arc<Approval>>,
    inbox: Mutex<Inbox>,
    idle: watch::Sender<bool>,
    driver: std::sync::OnceLock<WorkerRef<DriverMsg>>,
    cwd: Arc<PathBuf>,
    resumed: bool,
    /// Tool schemas and request header, rebuilt only when the tool registry changes.
    envelope: Mutex<Option<Envelope>>,
    /// Set by a tool (a structured-output capture) to end the turn once the
    /// step's results are committed.
    conclude: std::sync::atomic::AtomicBool,
    /// Children started by this step's tool calls, disposed when the step's
    /// results are in (see [`Agent::adopt_for_step`]).
    step_children: Mutex<Vec<Agent>>,
    /// The step the running turn is in (0 between turns).
    step: std::sync::atomic::AtomicU32,
    /// Tokens spent (input + output), over the agent's life.
    tokens: std::sync::atomic::AtomicU64,
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

/// A handle to a live agent.
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

impl Agent {
    /// Creates an agent under `ctx` as one transaction: prepare (services),
    /// set up the private scope, enter the session, enter the driver,
    /// announce; any failure disposes what was built.
    pub async fn create(ctx: &Context, spec: AgentSpec) -> Result<Agent, AgentError> {
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
        let agents = ctx.get::<Agents>(Agents::SERVICE);
        let (header, seed) = match spec.seed.clone() {
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
        let id = header.id.clone();
        let resumed = seed.is_some();
        let log = match seed {
            Some(events) => SessionLog::from_seed(header, events, now_ms())?,
            None => SessionLog::new(header),
        };
        let session = SessionHandle::new(log);
        let label = spec
            .name
            .clone()
            .unwrap_or_else(|| format!("agent/{}", short(&id)));
        let key = ScopeKey::new(label.clone());
        if let Some(parent) = ctx.scope_key().filter(|_| !spec.flat_scope) {
            key.bind_parent(parent)
                .map_err(|e| AgentError::Kernel(e.to_string()))?;
        }
        let scope = ctx
            .scope(key)
            .await
            .map_err(|e| AgentError::Kernel(e.to_string()))?;
        // Boxed: the build's state lives on the heap only while it runs, not in
        // every future that awaits a creation.
        let agent = Box::pin(Self::build(
            scope, spec, id, session, llm, tools, approval, resumed,
        ))
        .await?;
        if let Some(agents) = agents {
            if let Ok(mut live) = agents.live.lock() {
                live.insert(agent.inner.id.clone(), agent.clone());
            }
            let registry = agents.clone();
            let gone = agent.inner.id.clone();
            let root = ctx.clone();
            let _ = agent
                .inner
                .scope
                .ctx()
                .effect("leave the agents registry", move || {
                    if let Ok(mut live) = registry.live.lock() {
                        live.remove(&gone);
                    }
                    root.emit(&AgentDisposed { id: gone });
                });
        }
        ctx.emit(&AgentCreated {
            id: agent.inner.id.clone(),
        });
        Ok(agent)
    }

    /// Builds the agent inside its fresh scope; on any failure the scope
    /// (and whatever was started in it) is disposed before returning.
    #[allow(clippy::too_many_arguments)]
    async fn build(
        scope: Scope,
        spec: AgentSpec,
        id: String,
        session: SessionHandle,
        llm: Arc<LlmRuntime>,
        tools: Arc<ToolRegistry>,
        approval: Option<Arc<Approval>>,
        resumed: bool,
    ) -> Result<Agent, AgentError> {
        let sctx = scope.ctx().clone();
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
            // A store of the spec's own, else the one provided in scope.
            let store = spec.store.clone().or_else(|| {
                sctx.get::<dyn dsh_services::persistence::SessionPersistence>(
                    dsh_services::persistence::PERSISTENCE_SERVICE,
                )
            });
            session
                .attach_after(&sctx, store, spec.durable)
                .await
                .map_err(|e| AgentError::Kernel(e.to_string()))
        };
        if let Err(e) = setup.await {
            scope.dispose().await;
            return Err(e);
        }
        let (idle, _) = watch::channel(true);
        let first_turn = turns_in(&session);
        let inner = Arc::new(Inner {
            id,
            cwd: Arc::new(spec.cwd.clone()),
            spec,
            ctx: sctx.clone(),
            scope,
            session,
            llm,
            tools,
            approval,
            inbox: Mutex::new(Inbox {
                accepting: true,
                // A resumed session numbers its turns after the seed's.
                turn: first_turn,
                ..Inbox::default()
            }),
            idle,
            driver: std::sync::OnceLock::new(),
            resumed,
            envelope: Mutex::new(None),
            conclude: std::sync::atomic::AtomicBool::new(false),
            step_children: Mutex::new(Vec::new()),
            step: std::sync::atomic::AtomicU32::new(0),
            tokens: std::sync::atomic::AtomicU64::new(0),
        });
        let name = format!("driver/{}", short(&inner.id));
        let weak = Arc::downgrade(&inner);
        let me = Arc::new(AgentSelf(Arc::downgrade(&inner)));
        let entered = async {
            sctx.provide(AGENT_SELF, me)
                .map_err(|e| AgentError::Kernel(e.to_string()))?;
            let driver = sctx
                .spawn(WorkerSpec::new("agent", name, Driver, inner.clone()))
                .await
                .map_err(|e| AgentError::Kernel(e.to_string()))?;
            let _ = inner.driver.set(driver);
            sctx.on_teardown("stop input and cancel the turn", move || async move {
                if let Some(inner) = weak.upgrade() {
                    Agent { inner }.close_and_cancel().await;
                }
            })
            .map_err(|e| AgentError::Kernel(e.to_string()))
        };
        if let Err(e) = entered.await {
            inner.scope.dispose().await;
            return Err(e);
        }
        Ok(Agent { inner })
    }

    /// The agent (session) id.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The agent's session.
    pub fn session(&self) -> &SessionHandle {
        &self.inner.session
    }

    /// The agent's scoped context.
    pub fn context(&self) -> &Context {
        &self.inner.ctx
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
        *self.inner.idle.borrow()
    }

    /// The spec the agent was built from.
    pub fn spec(&self) -> &AgentSpec {
        &self.inner.spec
    }

    /// Delegation depth, from the session header (0 for a top-level agent).
    pub fn depth(&self) -> u32 {
        self.inner
            .session
            .with_log(|log| log.header().delegation_depth)
            .max(self.inner.spec.depth)
    }

    /// Hands `child` (started by a tool call of the running step) to this
    /// agent: once every call of the step has answered, the step's children
    /// are disposed in reverse start order — so a cancelled step, like a
    /// teardown, stops its children one by one, last started first.
    pub fn adopt_for_step(&self, child: Agent) {
        self.inner
            .step_children
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(child);
    }

    /// Ends the running turn (`completed`) once the current step's tool
    /// results are committed: a structured-output capture concluding it.
    pub fn conclude_turn(&self) {
        self.inner
            .conclude
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// The kernel id of the agent's scope fiber.
    pub fn node_id(&self) -> u64 {
        self.inner.scope.fiber().id()
    }

    /// Kernel ids of the actors the agent's scope owns, in start order.
    pub fn child_nodes(&self) -> Vec<u64> {
        self.inner.scope.fiber().children()
    }

    fn inbox(&self) -> MutexGuard<'_, Inbox> {
        self.inner.inbox.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tells the driver there is work. `idle` was already cleared under the
    /// inbox lock by the caller, so a driver finishing concurrently cannot
    /// report idle over queued work.
    fn wake(&self) {
        if let Some(d) = self.inner.driver.get() {
            let _ = d.send(DriverMsg::Wake);
        }
    }

    fn accepting(&self) -> Result<(), AgentError> {
        if self.inbox().accepting {
            Ok(())
        } else {
            Err(AgentError::Closed(self.inner.id.clone()))
        }
    }

    /// Queues a prompt as a new turn (after the running one).
    pub fn followup(&self, message: Message) -> Result<(), AgentError> {
        {
            let mut inbox = self.inbox();
            if !inbox.accepting {
                return Err(AgentError::Closed(self.inner.id.clone()));
            }
            let start = inbox.followups.len();
            let message = Arc::new(message);
            self.splice(start, 0, std::slice::from_ref(&message));
            inbox.followups.push_back(message);
            self.inner.idle.send_replace(false);
        }
        self.wake();
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

    /// Adds a message to the running turn at its next step (a new turn when idle).
    pub fn steer(&self, message: Message) -> Result<(), AgentError> {
        self.accepting()?;
        {
            let mut inbox = self.inbox();
            if inbox.running {
                inbox.steer.push_back(Arc::new(message));
                return Ok(());
            }
            let start = inbox.followups.len();
            let message = Arc::new(message);
            self.splice(start, 0, std::slice::from_ref(&message));
            inbox.followups.push_back(message);
            self.inner.idle.send_replace(false);
        }
        self.wake();
        Ok(())
    }

    /// Adds injected context (a non-user source) to the next step.
    pub fn inject(&self, message: Message) -> Result<(), AgentError> {
        self.accepting()?;
        self.inbox().inject.push_back(Arc::new(message));
        Ok(())
    }

    /// Cancels the running turn (it ends `aborted`); queued prompts stay.
    pub fn cancel(&self) {
        let mut inbox = self.inbox();
        match &inbox.cancel {
            Some(token) => token.cancel(),
            // A prompt queued but not yet claimed: its turn starts cancelled
            // (and ends `aborted` at once), so a cancel is never lost in the
            // moment between `followup` and the driver picking it up.
            None if !inbox.followups.is_empty() => inbox.cancel_next = true,
            None => {}
        }
    }

    /// Waits until no turn runs and nothing is queued, up to `timeout`.
    pub async fn when_idle(&self, timeout: Duration) -> Result<(), AgentError> {
        let mut rx = self.inner.idle.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|idle| *idle))
            .await
            .map_err(|_| AgentError::Timeout {
                id: self.inner.id.clone(),
                after: timeout,
            })?
            .map(|_| ())
            .map_err(|_| AgentError::Closed(self.inner.id.clone()))
    }

    /// Runs one prompt as a turn and waits for it, up to `timeout`.
    pub async fn run(&self, prompt: &str, timeout: Duration) -> Result<TurnSummary, AgentError> {
        self.followup(Message::user_text(prompt))?;
        self.when_idle(timeout).await?;
        self.inbox()
            .last
            .clone()
            .ok_or_else(|| AgentError::Closed(self.inner.id.clone()))
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
        let inbox = self.inbox();
        Progress {
            turn: inbox.turn,
            step: if inbox.running {
                self.inner.step.load(std::sync::atomic::Ordering::Relaxed)
            } else {
                0
            },
            running: inbox.running,
            queued: inbox.followups.len(),
            tokens: self.inner.tokens.load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// The summary of the last finished turn.
    pub fn last_turn(&self) -> Option<TurnSummary> {
        self.inbox().last.clone()
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
        let mut rx = self.inner.idle.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(5), rx.wait_for(|idle| *idle)).await;
    }

    /// Ordered teardown of the agent and everything it owns.
    pub async fn dispose(&self) {
        self.inner.scope.dispose().await;
    }

    /// The agent scope's status.
    pub fn status(&self) -> Status {
        self.inner.scope.fiber().status()
    }
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
    type State = Arc<Inner>;
    type Arguments = Arc<Inner>;

    async fn pre_start(
        &self,
        _me: ActorRef<DriverMsg>,
        inner: Arc<Inner>,
    ) -> Result<Arc<Inner>, ActorProcessingErr> {
        Ok(inner)
    }

    async fn handle(
        &self,
        _me: ActorRef<DriverMsg>,
        DriverMsg::Wake: DriverMsg,
        inner: &mut Arc<Inner>,
    ) -> Result<(), ActorProcessingErr> {
        let agent = Agent {
            inner: inner.clone(),
        };
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
                    log_append(&agent, EventData::TurnStart { turn: inbox.turn }, None);
                    agent.splice(0, 1, &[]);
                    if !std::mem::replace(&mut inbox.opened, true) {
                        for data in agent.inner.spec.opening.iter().cloned() {
                            log_append(&agent, data, None);
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
            let summary = Box::pin(run_turn(&agent, prompt, turn, token)).await;
            {
                let mut inbox = agent.inbox();
                inbox.running = false;
                inbox.cancel = None;
                inbox.last = Some(summary.clone());
                // Steered in after the turn's last step: the next turn's prompt.
                let leftover: Vec<Arc<Message>> = inbox.steer.drain(..).collect();
                for message in leftover {
                    let start = inbox.followups.len();
                    agent.splice(start, 0, std::slice::from_ref(&message));
                    inbox.followups.push_back(message);
                }
            }
            if let Some(hook) = &agent.inner.spec.on_turn_end {
                let run = std::panic::AssertUnwindSafe(|| (hook.0)(&agent, &summary));
                if let Err(p) = std::panic::catch_unwind(run) {
                    tracing::error!(
                        agent = %agent.inner.id,
                        "a turn-end hook panicked: {}",
                        dsh_supervisors::events::panic_text(&p)
                    );
                }
            }
        }
        let inbox = agent.inbox();
        if inbox.followups.is_empty() || !inbox.accepting {
            // Under the inbox lock: see `Agent::wake`.
            agent.inner.idle.send_replace(true);
        }
        drop(inbox);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<DriverMsg>,
        inner: &mut Arc<Inner>,
    ) -> Result<(), ActorProcessingErr> {
        // However the driver ended (drained, killed, failed), no turn runs
        // any more: waiters on idle must not wait forever.
        let mut inbox = inner.inbox.lock().unwrap_or_else(|p| p.into_inner());
        inbox.running = false;
        inbox.accepting = false;
        inner.idle.send_replace(true);
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
    prompt: Arc<Message>,
    turn: u32,
    token: CancellationToken,
) -> TurnSummary {
    // A capture left over from an aborted turn must not end this one.
    agent
        .inner
        .conclude
        .store(false, std::sync::atomic::Ordering::Release);
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
        agent
            .inner
            .step
            .store(step, std::sync::atomic::Ordering::Relaxed);
        // Per step only while someone watches the tree; every turn end always.
        if agent.inner.ctx.runtime().tree().watched() {
            publish_progress(agent, turn, step);
        }
        log_append(agent, EventData::StepStart { turn, step }, None);
        let target = dsh_supervisors::Target::Scope(agent.inner.ctx.scope_key().cloned());
        agent.inner.ctx.events().emit(
            &target,
            &AgentPreStep {
                agent: agent.inner.id.clone(),
                turn,
                step,
            },
        );
        {
            let mut inbox = agent.inbox();
            entering.extend(inbox.steer.drain(..));
            entering.extend(inbox.inject.drain(..));
        }
        for m in entering.drain(..) {
            log_append(
                agent,
                EventData::UserMessage(m),
                Some(SurfaceIntent::append()),
            );
        }
        match run_step(agent, turn, step, &token).await {
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
                    agent: agent.inner.id.clone(),
                    turn,
                    text: text.clone(),
                };
                let target = dsh_supervisors::Target::Scope(agent.inner.ctx.scope_key().cloned());
                if !token.is_cancelled()
                    && let Some(more) = agent.inner.ctx.events().serial(&target, stopping).await
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
    publish_progress(agent, turn, 0);
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
fn envelope(inner: &Inner, system: Option<&str>) -> Envelope {
    let generation = inner.tools.generation();
    let mut cache = inner.envelope.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(e) = cache.as_ref()
        && e.generation == generation
        && e.system.as_deref() == system
    {
        return e.clone();
    }
    let schemas = inner.tools.schemas(inner.ctx.scope_key());
    let header = header_value(&inner.spec, system, &schemas);
    let (schemas, header) = shared_envelope(schemas, header);
    let fresh = Envelope {
        generation,
        system: system.map(str::to_owned),
        schemas,
        header,
    };
    *cache = Some(fresh.clone());
    fresh
}

/// Envelopes in use, shared between agents: agents with the same tools,
/// route and system text hold one schema list and one header value instead
/// of a copy each (a thousand subagents would otherwise carry a thousand).
static SHARED_ENVELOPES: Mutex<VecDeque<SharedEnvelope>> = Mutex::new(VecDeque::new());

/// One shared envelope: the tool schemas and the header that lists them.
type SharedEnvelope = (Arc<[ToolSchema]>, Arc<serde_json::Value>);

/// Envelopes remembered for sharing (most recently built first).
const SHARED_ENVELOPE_SLOTS: usize = 32;

fn shared_envelope(schemas: Vec<ToolSchema>, header: serde_json::Value) -> SharedEnvelope {
    let mut shared = SHARED_ENVELOPES.lock().unwrap_or_else(|p| p.into_inner());
    let known = shared.iter().position(|(_, h)| **h == header);
    if let Some(found) = known.and_then(|at| shared.remove(at)) {
        shared.push_front(found.clone());
        return found;
    }
    let made: SharedEnvelope = (schemas.into(), Arc::new(header));
    shared.push_front(made.clone());
    shared.truncate(SHARED_ENVELOPE_SLOTS);
    made
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

async fn run_step(agent: &Agent, turn: u32, step: u32, token: &CancellationToken) -> StepEnd {
    let inner = &agent.inner;
    let scope = inner.ctx.scope_key();
    let system: Option<Arc<str>> = match inner.ctx.get::<SystemPrompt>(SystemPrompt::SERVICE) {
        Some(prompt) => match prompt.assemble(&inner.ctx).await {
            Ok(text) if text.is_empty() => None,
            Ok(text) => Some(Arc::from(text)),
            Err(e) => return StepEnd::Failed(failure("SYSTEM_PROMPT", e)),
        },
        None => inner.spec.system.as_deref().map(Arc::from),
    };
    let envelope = envelope(inner, system.as_deref());
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
        agent: inner.id.clone(),
        request,
    };
    let request = match inner
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
        s = inner.llm.stream(&inner.ctx, request, call_token.clone()) => s,
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
        inner.tokens.fetch_add(
            u.input_tokens + u.output_tokens,
            std::sync::atomic::Ordering::Relaxed,
        );
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
        let safe = |c: &ToolCall| match inner.tools.resolve(scope, &c.name) {
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
            vec![execute(agent, calls[i].clone(), token).await]
        } else {
            // At most `max_parallel_tools` at once; results keep call order.
            let batch: Vec<_> = calls[i..j]
                .iter()
                .cloned()
                .map(|c| execute(agent, c, token))
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
    release_step_children(agent).await;
    if token.is_cancelled() {
        return StepEnd::Aborted;
    }
    if inner
        .conclude
        .swap(false, std::sync::atomic::Ordering::AcqRel)
    {
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
async fn execute(agent: &Agent, call: ToolCall, token: &CancellationToken) -> PipelineOutcome {
    let inner = &agent.inner;
    let (tx, rx) = oneshot::channel();
    let args = ToolRun {
        ctx: inner.ctx.clone(),
        tools: inner.tools.clone(),
        approval: inner.approval.clone(),
        call: call.clone(),
        cancel: token.child_token(),
        cwd: inner.cwd.clone(),
        reply: Some(tx),
    };
    let name = format!("tool/{}#{}", call.name, call.id);
    let spawned = Box::pin(
        inner
            .ctx
            .spawn(WorkerSpec::new("tool", name, ToolExec, args)),
    )
    .await;
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
async fn release_step_children(agent: &Agent) {
    let mut children = std::mem::take(
        &mut *agent
            .inner
            .step_children
            .lock()
            .unwrap_or_else(|p| p.into_inner()),
    );
    if children.is_empty() {
        return;
    }
    let order = agent.child_nodes();
    children.sort_by_key(|c| order.iter().position(|n| *n == c.node_id()));
    for child in children.into_iter().rev() {
        child.dispose().await;
    }
}

/// Publishes what the agent is doing as its scope node's summary in the tree
/// registry (the dashboard and `dsh tree` show it): turn, step (0 between
/// turns) and tokens spent.
fn publish_progress(agent: &Agent, turn: u32, step: u32) {
    let inner = &agent.inner;
    let summary = serde_json::json!({
        "agent": inner.id,
        "turn": turn,
        "step": step,
        "tokens": inner.tokens.load(std::sync::atomic::Ordering::Relaxed),
    });
    inner
        .ctx
        .runtime()
        .tree()
        .set_summary(inner.scope.fiber().id(), summary);
}
