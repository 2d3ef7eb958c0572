//! Subagents: named providers that start child agents for a parent.
//!
//! A child is an ordinary agent created under the delegating context (the
//! parent's scope unless the request names another owner, such as a
//! workflow run), so it is a child actor of that scope: cancelling or
//! disposing the parent cascades to it, and to everything it started.
//!
//! - One-shot ([`Subagents::start`]): `start` resolves only once the child is
//!   published (created, its prompt accepted); [`SubagentRun::result`]
//!   settles the outcome, [`SubagentRun::dispose`] awaits quiescence.
//! - Continuable ([`Subagents::start_continuable`]): the child stays resident
//!   in the parent's scope and takes later messages ([`Subagents::send`]);
//!   each settled turn is reported back to the parent as a notice; a child
//!   that is only on disk is resumed by the next message.
//! - Providers ([`SubagentProvider`]) differ only in what the child starts
//!   from: `spawn` starts fresh, `fork` from the parent's completed turns.
//!
//! The child's header records `parentSession`, `origin: "subagent"` and its
//! delegation depth; its first turn opens with a `subagent/descriptor`.

pub mod acp;
pub mod tools;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::{ContentBlock, LlmRuntime, Message, MessageSource, ToolSchema};
use dsh_services::persistence::{PERSISTENCE_SERVICE, SessionPersistence, StoreError};
use dsh_services::session::{EventData, SessionError, SessionEvent, SessionHeader, TurnEndReason};
use dsh_services::tools::{Restriction, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};
use dsh_supervisors::error::chain;
use dsh_supervisors::registry::RegisterError;
use dsh_supervisors::{Context, Disposer, Emit, Event};
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::agent::{Agent, AgentError, AgentSpec, TurnHook, TurnSummary};

/// Which start-time features a provider supports; a request needing one
/// the provider lacks is refused before anything is created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Structured output through a `report` capture tool.
    pub output_schema: bool,
    /// An absolute delegation-depth cap.
    pub depth_limit: bool,
    /// A tool allow/deny filter for the child.
    pub tool_filter: bool,
    /// A per-child persona.
    pub persona: bool,
}

impl Capabilities {
    /// Every feature.
    pub const ALL: Capabilities = Capabilities {
        output_schema: true,
        depth_limit: true,
        tool_filter: true,
        persona: true,
    };
}

/// A named child-agent transport.
pub trait SubagentProvider: Send + Sync + 'static {
    /// Registry name (`spawn`, `fork`, ...).
    fn name(&self) -> &str;
    /// Start-time features.
    fn capabilities(&self) -> Capabilities;
    /// Whether the child sees the parent's completed turns.
    fn inherits_parent_context(&self) -> bool;
    /// The events the child's session starts from (`None`: a fresh session).
    fn seed(&self, parent: &Agent) -> Result<Option<Vec<SessionEvent>>, SubagentError>;
    /// For a child that runs elsewhere (another process, another node):
    /// starts it, for `request` and a child of `spec`, and returns the model
    /// route its in-process agent relays through. `None` (the default): an
    /// in-process child.
    fn remote<'a>(
        &'a self,
        request: &'a StartRequest,
        spec: &'a AgentSpec,
    ) -> BoxFuture<'a, Result<Option<RemoteLink>, SubagentError>> {
        let _ = (request, spec);
        Box::pin(async { Ok(None) })
    }
}

/// A child that runs elsewhere, as its in-process agent reaches it.
pub struct RemoteLink {
    /// The model route the agent here relays through.
    pub adapter: Arc<dyn dsh_services::llm::LlmAdapter>,
    /// Awaited when the agent here is disposed (after its driver stopped):
    /// ends the child over there, within its own bound.
    pub close: Option<BoxFuture<'static, ()>>,
    /// Where the child runs, shown as a part of the agent here in the tree
    /// (`b/subagent/3496f7ef`: its node, its name there).
    pub place: Option<String>,
    /// Told the id of that part once it is in the tree (the child's
    /// subtree over there is shown under it).
    pub placed: Option<Box<dyn FnOnce(u64) + Send>>,
    /// The node it runs on, when that is another `dsh node`.
    pub node: Option<String>,
}

/// `spawn`: a fresh child with an empty conversation.
pub struct Spawn;

impl SubagentProvider for Spawn {
    fn name(&self) -> &str {
        "spawn"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }
    fn inherits_parent_context(&self) -> bool {
        false
    }
    fn seed(&self, _parent: &Agent) -> Result<Option<Vec<SessionEvent>>, SubagentError> {
        Ok(None)
    }
}

/// `fork`: a child seeded with the parent's log up to its last completed
/// turn (the turn in flight is left out, so the seed is balanced).
pub struct Fork;

impl SubagentProvider for Fork {
    fn name(&self) -> &str {
        "fork"
    }
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }
    fn inherits_parent_context(&self) -> bool {
        true
    }
    fn seed(&self, parent: &Agent) -> Result<Option<Vec<SessionEvent>>, SubagentError> {
        parent.session().with_log(|log| {
            let last_end = log
                .without_chunks()
                .rfind(|e| matches!(e.data, EventData::TurnEnd { .. }))
                .map(|e| e.seq);
            match last_end {
                None => Ok(None),
                Some(at) => log
                    .fork_prefix(Some(at))
                    .map(Some)
                    .map_err(SubagentError::from),
            }
        })
    }
}

/// Why a start or a control operation was refused. Only `Cancelled` and a
/// `Store` failure of the filesystem may go differently on a retry; the
/// others are fatal for the request as it is (nothing was left behind).
#[derive(Debug, thiserror::Error)]
pub enum SubagentError {
    /// No provider of that name is registered.
    #[error("no subagent provider named `{0}` is registered")]
    UnknownProvider(String),
    /// The provider lacks a requested feature.
    #[error("provider `{provider}` does not support {feature}")]
    Unsupported {
        /// Provider name.
        provider: String,
        /// The missing feature.
        feature: &'static str,
    },
    /// The child would be deeper than allowed.
    #[error(
        "delegation depth {depth} exceeds the limit of {max} (the depth cap is set with `--max-depth N`)"
    )]
    DepthExceeded {
        /// The child's depth.
        depth: u32,
        /// The cap.
        max: u32,
    },
    /// The cancel signal fired before the child was published.
    #[error("cancelled before the subagent was published")]
    Cancelled,
    /// The child could not be created (nothing was left behind).
    #[error("the subagent could not start: {0}")]
    Start(String),
    /// The child agent could not be created or refused its prompt (nothing
    /// was left behind).
    #[error("the subagent could not start")]
    Agent(#[from] AgentError),
    /// The parent's log could not be forked at its last completed turn.
    #[error("the subagent could not start")]
    Fork(#[from] SessionError),
    /// The child's `report` tool was refused.
    #[error("the subagent could not start")]
    Register(#[from] RegisterError),
    /// A stored child could not be read back.
    #[error("the subagent's session could not be loaded")]
    Store(#[from] StoreError),
    /// A named definition cannot apply (unknown, or naming a model the
    /// runtime has no route for).
    #[error("{0}")]
    Definition(String),
    /// The caller is not the child's direct parent.
    #[error("agent {caller} is not the parent of subagent {child}")]
    Unauthorized {
        /// The caller.
        caller: String,
        /// The target.
        child: String,
    },
    /// No live or stored child has that id.
    #[error("no subagent with id `{0}`")]
    NotFound(String),
    /// A `report` that cannot be delivered (the caller is no live
    /// continuable child, or its parent is gone).
    #[error("the report was not delivered: {0}")]
    Report(String),
}

impl SubagentError {
    /// A stable code for tool results.
    pub fn code(&self) -> &'static str {
        match self {
            SubagentError::UnknownProvider(_) => "UNKNOWN_PROVIDER",
            SubagentError::Unsupported { .. } => "UNSUPPORTED_CAPABILITY",
            SubagentError::DepthExceeded { .. } => "DEPTH_EXCEEDED",
            SubagentError::Cancelled => "CANCELLED",
            SubagentError::Start(_)
            | SubagentError::Agent(_)
            | SubagentError::Fork(_)
            | SubagentError::Register(_) => "START_FAILED",
            SubagentError::Store(_) => "STORE",
            SubagentError::Definition(_) => "BAD_DEFINITION",
            SubagentError::Unauthorized { .. } => "UNAUTHORIZED",
            SubagentError::NotFound(_) => "NOT_FOUND",
            SubagentError::Report(_) => "REPORT_UNDELIVERED",
        }
    }
}

/// What a caller asks for when starting a child.
#[derive(Clone)]
pub struct StartRequest {
    /// Short display label, persisted in the descriptor.
    pub label: Option<String>,
    /// The group it belongs to among its siblings (a workflow phase).
    pub group: Option<String>,
    /// The child's prompt.
    pub prompt: String,
    /// The delegating agent: cwd, lineage and depth come from it.
    pub parent: Agent,
    /// Cancels the start before publication and the run after it.
    pub cancel: CancellationToken,
    /// Where the child lives in the tree (the parent's scope when `None`).
    pub owner: Option<Context>,
    /// Object-rooted JSON Schema of a structured result.
    pub output_schema: Option<Value>,
    /// Absolute cap on the child's delegation depth.
    pub max_depth: Option<u32>,
    /// Tool filter for the child.
    pub tool_filter: Option<Restriction>,
    /// Persona (system text) replacing the parent's for this child.
    pub persona: Option<String>,
    /// Model route and id overriding the parent's.
    pub route: Option<(String, String)>,
    /// A narrower policy than the parent's for the child (a wider one is
    /// narrowed to the parent's).
    pub permission: Option<dsh_services::sandbox::Policy>,
    /// The named definition it was made from (see [`StartRequest::define`]).
    pub definition: Option<String>,
    /// The reasoning effort its requests ask for.
    pub reasoning_effort: Option<String>,
    /// Most model calls in one of its turns (at most the parent's).
    pub max_steps: Option<u32>,
    /// Most turns it may take.
    pub max_turns: Option<u32>,
    /// Most tokens it (and its own children) may spend.
    pub max_tokens: Option<u64>,
    /// Its wall-time budget, from its start.
    pub timeout: Option<std::time::Duration>,
}

impl StartRequest {
    /// A request with defaults for everything but the prompt and parent.
    pub fn new(parent: &Agent, prompt: impl Into<String>, cancel: CancellationToken) -> Self {
        StartRequest {
            label: None,
            group: None,
            prompt: prompt.into(),
            parent: parent.clone(),
            cancel,
            owner: None,
            output_schema: None,
            max_depth: None,
            tool_filter: None,
            persona: None,
            route: None,
            permission: None,
            definition: None,
            reasoning_effort: None,
            max_steps: None,
            max_turns: None,
            max_tokens: None,
            timeout: None,
        }
    }

    /// Makes the child what `definition` says, never more than its parent
    /// has: its body as the system prompt; its model (a configured route,
    /// taking the route's first model id, or a model id on the parent's
    /// route); its tools, the parent's that its names and globs match; its
    /// permission mode, narrowed to the parent's at the start; its effort
    /// and its step cap (at most the parent's); its turn, token and
    /// wall-time budgets, counted with its parent's.
    pub fn define(
        &mut self,
        definition: &dsh_services::definitions::Definition,
    ) -> Result<(), SubagentError> {
        let ctx = self
            .parent
            .context()
            .map_err(|e| SubagentError::Start(chain(&e).to_string()))?;
        let bad = |why: String| {
            SubagentError::Definition(format!(
                "agent definition `{}` ({}): {why}",
                definition.name,
                definition.path.display()
            ))
        };
        if let Some(model) = &definition.model {
            let llm = ctx
                .get::<LlmRuntime>(LlmRuntime::SERVICE)
                .ok_or_else(|| bad("no `llm` service to find its model on".into()))?;
            self.route = Some(definition_route(&llm, &self.parent.spec().provider, model));
        }
        if let Some(patterns) = &definition.tools {
            let registry = ctx
                .get::<ToolRegistry>(ToolRegistry::SERVICE)
                .ok_or_else(|| bad("no tool registry".into()))?;
            // The parent's tools (its restriction applied) that it names.
            let allow = definition_tools(&registry, ctx.scope_key(), patterns);
            let deny = self
                .tool_filter
                .as_ref()
                .map(|f| f.deny.clone())
                .unwrap_or_default();
            let allow = match self.tool_filter.as_ref().and_then(|f| f.allow.as_ref()) {
                Some(earlier) => allow.into_iter().filter(|n| earlier.contains(n)).collect(),
                None => allow,
            };
            self.tool_filter = Some(Restriction {
                allow: Some(allow),
                deny,
            });
        }
        if let Some(mode) = definition.permission_mode {
            let network = self.parent.policy().network;
            self.permission = Some(dsh_services::sandbox::Policy { mode, network });
        }
        self.persona = Some(definition.prompt.clone());
        self.reasoning_effort = definition.reasoning_effort.clone();
        self.max_steps = definition.max_steps;
        self.max_turns = definition.max_turns;
        self.max_tokens = definition.max_tokens;
        self.timeout = definition.timeout;
        self.definition = Some(definition.name.clone());
        if self.label.is_none() {
            self.label = Some(definition.name.clone());
        }
        Ok(())
    }
}

/// A child's tool restriction `own` within its parent's (`parent`): never
/// a tool the parent may not use (its scope is not under the parent's, so
/// the parent's restriction is carried over here).
fn within(own: Option<Restriction>, parent: Option<&Restriction>) -> Option<Restriction> {
    let Some(parent) = parent else {
        return own;
    };
    let mut r = own.unwrap_or(Restriction {
        allow: None,
        deny: Vec::new(),
    });
    r.deny.extend(parent.deny.iter().cloned());
    if let Some(theirs) = &parent.allow {
        r.allow = Some(match r.allow.take() {
            Some(mine) => mine.into_iter().filter(|n| theirs.contains(n)).collect(),
            None => theirs.clone(),
        });
    }
    Some(r)
}

/// The route and model id a definition's `model` names: a configured
/// route (with its first model id), else a model id on `fallback`'s route.
pub fn definition_route(llm: &LlmRuntime, fallback: &str, model: &str) -> (String, String) {
    if llm.providers().iter().any(|p| p == model) {
        let id = llm.model_ids(model).into_iter().next();
        (model.to_owned(), id.unwrap_or_else(|| "default".into()))
    } else {
        (fallback.to_owned(), model.to_owned())
    }
}

/// The tools visible in `scope` (restrictions applied) that a definition's
/// names and globs (`patterns`) match.
pub fn definition_tools(
    registry: &ToolRegistry,
    scope: Option<&dsh_supervisors::ScopeKey>,
    patterns: &[String],
) -> Vec<String> {
    registry
        .visible(scope)
        .iter()
        .map(|t| t.schema.name.clone())
        .filter(|n| dsh_services::definitions::tool_matches(patterns, n))
        .collect()
}

/// Makes a top-level agent's `spec` what `definition` says, within what
/// this runtime allows: its body as the system prompt; its model (a
/// configured route, or a model id on the spec's route); the global tools
/// its names and globs match; its permission mode narrowed to the
/// sandbox's standing one; its effort; its step cap (at most the spec's).
pub fn define_top_level(
    root: &Context,
    spec: &mut AgentSpec,
    definition: &dsh_services::definitions::Definition,
) {
    spec.system = Some(definition.prompt.clone());
    if let (Some(model), Some(llm)) = (
        &definition.model,
        root.get::<LlmRuntime>(LlmRuntime::SERVICE),
    ) {
        (spec.provider, spec.model) = definition_route(&llm, &spec.provider, model);
    }
    if let (Some(patterns), Some(registry)) = (
        &definition.tools,
        root.get::<ToolRegistry>(ToolRegistry::SERVICE),
    ) {
        spec.restriction = Some(Restriction {
            allow: Some(definition_tools(&registry, None, patterns)),
            deny: Vec::new(),
        });
    }
    if let Some(mode) = definition.permission_mode {
        let standing = root
            .get::<dsh_services::sandbox::Sandbox>(dsh_services::sandbox::Sandbox::SERVICE)
            .map(|s| s.defaults())
            .unwrap_or_default();
        spec.permission = Some(standing.narrowed(Some(dsh_services::sandbox::Policy {
            mode,
            network: standing.network,
        })));
    }
    spec.reasoning_effort = definition.reasoning_effort.clone();
    if let Some(cap) = definition.max_steps {
        spec.max_steps = spec.max_steps.min(cap);
    }
    spec.label = Some(definition.name.clone());
    spec.definition = Some(definition.name.clone());
    if definition.max_turns.is_some()
        || definition.max_tokens.is_some()
        || definition.timeout.is_some()
    {
        spec.limits = Some(crate::agent::Limits::new(
            format!("agent definition `{}`", definition.name),
            None,
            definition.max_turns,
            definition.max_tokens,
            definition.timeout,
        ));
    }
}

/// Why a run ended (the turn-end vocabulary).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum StopReason {
    /// The child finished its turn.
    Completed,
    /// Cancelled through the signal or disposal.
    Aborted,
    /// Model or transport failure.
    Error,
    /// The child hit its token ceiling.
    MaxTokens,
}

impl StopReason {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Completed => "completed",
            StopReason::Aborted => "aborted",
            StopReason::Error => "error",
            StopReason::MaxTokens => "max-tokens",
        }
    }
}

/// The terminal outcome of a one-shot run.
#[derive(Clone, Debug, PartialEq)]
pub struct SubagentResult {
    /// The child's final assistant text.
    pub output: String,
    /// The captured structured result, when a schema was requested and met.
    pub structured: Option<Value>,
    /// Failure detail (never assistant text), at most 4096 bytes.
    pub diagnostic: Option<String>,
    /// Why it ended.
    pub stop_reason: StopReason,
}

/// A published one-shot child. Await [`result`](SubagentRun::result), then
/// always [`dispose`](SubagentRun::dispose).
pub struct SubagentRun {
    id: String,
    agent: Agent,
    cancel: CancellationToken,
    capture: Option<Arc<Mutex<Option<Value>>>>,
    settled: tokio::sync::OnceCell<SubagentResult>,
    info: RunInfo,
}

impl SubagentRun {
    /// The child's session id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Who started it, for whom, and where it runs.
    pub fn info(&self) -> &RunInfo {
        &self.info
    }

    /// The child agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Waits for the child's turn and maps how it ended; the request's
    /// cancel signal (or [`cancel`](SubagentRun::cancel)) aborts it.
    pub async fn result(&self) -> SubagentResult {
        self.settled
            .get_or_init(|| async {
                let r = settle(&self.agent, &self.cancel, self.capture.as_ref()).await;
                self.agent.reach().emit(&SubagentEnd {
                    info: self.info.clone(),
                    stop_reason: r.stop_reason,
                    diagnostic: r.diagnostic.clone(),
                    // A child on another node is one relayed step here.
                    steps: match self.info.node {
                        None => self.agent.last_turn().map(|t| t.steps),
                        Some(_) => None,
                    },
                    tokens: self.agent.progress().tokens,
                });
                r
            })
            .await
            .clone()
    }

    /// Cancels the child's remaining work.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Cancels remaining work and disposes the child (ordered teardown of
    /// its whole subtree). Idempotent.
    pub async fn dispose(&self) {
        self.cancel.cancel();
        self.agent.dispose().await;
    }
}

async fn settle(
    agent: &Agent,
    cancel: &CancellationToken,
    capture: Option<&Arc<Mutex<Option<Value>>>>,
) -> SubagentResult {
    let waited = tokio::select! {
        r = agent.when_idle(Duration::MAX) => r,
        () = cancel.cancelled() => {
            agent.cancel();
            agent.when_idle(Duration::from_secs(30)).await
        }
    };
    let summary = match (waited, agent.last_turn()) {
        (Ok(()), Some(s)) => s,
        (Err(e), _) => return failed(StopReason::Aborted, chain(&e).to_string()),
        (Ok(()), None) => return failed(StopReason::Aborted, "the child ran no turn".into()),
    };
    outcome(&summary, capture)
}

fn failed(stop_reason: StopReason, diagnostic: String) -> SubagentResult {
    SubagentResult {
        output: String::new(),
        structured: None,
        diagnostic: Some(bounded(diagnostic)),
        stop_reason,
    }
}

fn bounded(mut s: String) -> String {
    if s.len() > 4096 {
        let mut cut = 4093;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

fn outcome(summary: &TurnSummary, capture: Option<&Arc<Mutex<Option<Value>>>>) -> SubagentResult {
    let (stop_reason, diagnostic) = match &summary.reason {
        TurnEndReason::Completed => (StopReason::Completed, None),
        TurnEndReason::MaxTokens => (StopReason::MaxTokens, None),
        TurnEndReason::Aborted { .. } | TurnEndReason::Interrupted => (StopReason::Aborted, None),
        TurnEndReason::Blocked => (
            StopReason::Error,
            Some("the turn was blocked by a policy".to_owned()),
        ),
        TurnEndReason::Error { error } => (
            StopReason::Error,
            Some(format!("{}: {}", error.code, error.message)),
        ),
    };
    let mut result = SubagentResult {
        output: summary.text.clone(),
        structured: None,
        diagnostic: diagnostic.map(bounded),
        stop_reason,
    };
    if let Some(slot) = capture {
        let value = slot.lock().ok().and_then(|mut s| s.take());
        match (value, stop_reason) {
            (Some(v), StopReason::Completed) => result.structured = Some(v),
            (None, StopReason::Completed) => {
                result.stop_reason = StopReason::Error;
                result.diagnostic =
                    Some("the child finished without calling `report` with a valid result".into());
            }
            _ => {}
        }
    }
    result
}

/// The identity of a run, as the lifecycle events carry it.
#[derive(Clone, Debug)]
pub struct RunInfo {
    /// The provider that started it.
    pub provider: String,
    /// The child's session id.
    pub child: String,
    /// The delegating parent's session id.
    pub parent: String,
    /// The display label.
    pub label: Option<String>,
    /// The node it runs on, when that is another `dsh node`.
    pub node: Option<String>,
}

/// A provider published a child (mode: emit).
#[derive(Clone, Debug)]
pub struct SubagentStart {
    /// The run.
    pub info: RunInfo,
}
impl Event for SubagentStart {
    const NAME: &'static str = "subagent/start";
}
impl Emit for SubagentStart {}

/// A published child settled (mode: emit).
#[derive(Clone, Debug)]
pub struct SubagentEnd {
    /// The run.
    pub info: RunInfo,
    /// How it ended.
    pub stop_reason: StopReason,
    /// Why it failed (`CODE: message`), when it did.
    pub diagnostic: Option<String>,
    /// Steps its turn took, when known (not for a child on another node).
    pub steps: Option<u32>,
    /// Tokens it spent.
    pub tokens: u64,
}
impl Event for SubagentEnd {
    const NAME: &'static str = "subagent/end";
}
impl Emit for SubagentEnd {}

/// A resident continuable child.
#[derive(Clone)]
struct Resident {
    agent: Agent,
    parent: String,
    label: String,
}

/// One entry of [`Subagents::children`].
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ChildEntry {
    /// The child's session id.
    pub id: String,
    /// Its label.
    pub label: String,
    /// `running`, `idle` (resident between turns) or `ready` (on disk only).
    pub status: &'static str,
    /// Its direct parent's session id (listed with descendants only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
    /// 1 for a direct child, 2 for its child, … (descendants only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub depth: Option<u32>,
}

/// The `subagents` service: the provider registry and the continuable
/// children of every live parent.
#[derive(Default)]
pub struct Subagents {
    providers: Mutex<Vec<Arc<dyn SubagentProvider>>>,
    /// The named agent definitions children may be made from.
    definitions: std::sync::RwLock<Arc<dsh_services::definitions::Definitions>>,
    /// The depth cap of a start that names none (0: [`DEFAULT_MAX_DEPTH`]).
    max_depth: std::sync::atomic::AtomicU32,
    resident: Mutex<BTreeMap<String, Resident>>,
    resuming: tokio::sync::Mutex<()>,
}

/// How a continuable child's settled turn reaches its parent: a message
/// with this source kind (`form: notice`, the child's id as its sender).
pub const SETTLED_SOURCE: &str = "subagent-settled";

/// How a continuable child's own `report` reaches its parent: a message
/// with this source kind (`form: relay`, the child's id as its sender), so
/// a transcript tells the child's words from the runtime's notice.
pub const REPORT_SOURCE: &str = "subagent-report";

impl Subagents {
    /// The capability name.
    pub const SERVICE: &'static str = "subagents";

    /// Caps the depth of every child whose start names no cap of its own
    /// (a workflow's, a loop's, a tool's that defers to it).
    pub fn set_max_depth(&self, max: u32) {
        self.max_depth
            .store(max.saturating_add(1), std::sync::atomic::Ordering::Relaxed);
    }

    /// The depth cap of a start that names none.
    pub fn max_depth(&self) -> u32 {
        match self.max_depth.load(std::sync::atomic::Ordering::Relaxed) {
            0 => DEFAULT_MAX_DEPTH,
            n => n - 1,
        }
    }

    /// Makes `definitions` the named agents children may be made from.
    pub fn set_definitions(&self, definitions: dsh_services::definitions::Definitions) {
        let mut held = self.definitions.write().unwrap_or_else(|p| p.into_inner());
        *held = Arc::new(definitions);
    }

    /// The named agent definitions children may be made from.
    pub fn definitions(&self) -> Arc<dsh_services::definitions::Definitions> {
        self.definitions
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// `request` made from the definition named `name`.
    pub fn define(&self, request: &mut StartRequest, name: &str) -> Result<(), SubagentError> {
        let definitions = self.definitions();
        let definition = definitions
            .require(name)
            .map_err(|e| SubagentError::Definition(chain(&e).to_string()))?;
        request.define(definition)
    }

    /// A registry holding `spawn` and `fork`.
    pub fn with_builtin() -> Subagents {
        let s = Subagents::default();
        if let Ok(mut p) = s.providers.lock() {
            p.push(Arc::new(Spawn));
            p.push(Arc::new(Fork));
        }
        s
    }

    /// Registers `provider` for the lifetime of `ctx`'s fiber.
    pub fn register(
        self: &Arc<Self>,
        ctx: &Context,
        provider: Arc<dyn SubagentProvider>,
    ) -> Result<Disposer, RegisterError> {
        let name = provider.name().to_owned();
        {
            let mut p = self.providers.lock().unwrap_or_else(|p| p.into_inner());
            if p.iter().any(|q| q.name() == name) {
                return Err(RegisterError::Taken {
                    what: "subagent provider",
                    name,
                });
            }
            p.push(provider);
        }
        let me = self.clone();
        let remove = move || {
            let mut p = me.providers.lock().unwrap_or_else(|p| p.into_inner());
            p.retain(|q| q.name() != name);
        };
        Ok(ctx.effect_or_undo("remove a subagent provider", remove)?)
    }

    /// The provider named `name`.
    pub fn provider(&self, name: &str) -> Option<Arc<dyn SubagentProvider>> {
        self.providers
            .lock()
            .ok()?
            .iter()
            .find(|p| p.name() == name)
            .cloned()
    }

    /// Registered provider names, in registration order.
    pub fn names(&self) -> Vec<String> {
        self.providers
            .lock()
            .map(|p| p.iter().map(|q| q.name().to_owned()).collect())
            .unwrap_or_default()
    }

    /// Starts a one-shot child; resolves once it is published. A failure
    /// before that leaves nothing behind.
    pub async fn start(
        &self,
        provider: &str,
        request: StartRequest,
    ) -> Result<SubagentRun, SubagentError> {
        let p = self
            .provider(provider)
            .ok_or_else(|| SubagentError::UnknownProvider(provider.into()))?;
        let capture = request
            .output_schema
            .as_ref()
            .map(|_| Arc::new(Mutex::new(None)));
        let descriptor = json!({
            "version": 2,
            "mode": "one-shot",
            "provider": p.name(),
            "label": request.label,
        });
        let (agent, node) = Box::pin(compose(
            &*p,
            &request,
            self.max_depth(),
            descriptor,
            None,
            capture.clone(),
        ))
        .await?;
        let info = RunInfo {
            provider: p.name().to_owned(),
            child: agent.id().to_owned(),
            parent: request.parent.id().to_owned(),
            label: request.label.clone(),
            node,
        };
        if let Err(e) = agent.followup(prompt_message(&request)) {
            agent.dispose().await;
            return Err(e.into());
        }
        request
            .parent
            .reach()
            .emit(&SubagentStart { info: info.clone() });
        Ok(SubagentRun {
            id: agent.id().to_owned(),
            agent,
            cancel: request.cancel.child_token(),
            capture,
            settled: tokio::sync::OnceCell::new(),
            info,
        })
    }

    /// Starts a continuable child that stays resident in the parent's
    /// scope; resolves with its id once its first prompt is accepted. Each
    /// turn it settles is reported to the parent (a [`SETTLED_SOURCE`]
    /// message, steered in).
    pub async fn start_continuable(
        self: &Arc<Self>,
        provider: &str,
        label: &str,
        request: StartRequest,
    ) -> Result<String, SubagentError> {
        let p = self
            .provider(provider)
            .ok_or_else(|| SubagentError::UnknownProvider(provider.into()))?;
        // What a cold resume needs to compose the same child again.
        let descriptor = json!({
            "version": 2,
            "mode": "continuable",
            "provider": p.name(),
            "label": label,
            "persona": request.persona,
            "toolFilter": request.tool_filter.as_ref().map(|r| json!({"allow": r.allow, "deny": r.deny})),
            "agentOptions": request.route.as_ref().map(|(provider, model)| json!({"provider": provider, "model": model})),
        });
        if request.output_schema.is_some() {
            return Err(SubagentError::Start(
                "a continuable child has no structured result; omit the output schema".into(),
            ));
        }
        let hook = settled_hook(&request.parent);
        let (agent, _) = Box::pin(compose(
            &*p,
            &request,
            self.max_depth(),
            descriptor,
            Some(hook),
            None,
        ))
        .await?;
        if let Err(e) = self.admit(&agent, request.parent.id(), label) {
            agent.dispose().await;
            return Err(e);
        }
        if let Err(e) = agent.followup(prompt_message(&request)) {
            agent.dispose().await;
            return Err(e.into());
        }
        Ok(agent.id().to_owned())
    }

    fn admit(
        self: &Arc<Self>,
        agent: &Agent,
        parent: &str,
        label: &str,
    ) -> Result<(), SubagentError> {
        let id = agent.id().to_owned();
        let me = self.clone();
        let gone = id.clone();
        if agent.status().is_terminal() {
            return Err(SubagentError::Start(format!("{id} is already disposed")));
        }
        // Not a scope effect: a resident child stays resident while it
        // hibernates, and leaves only when disposed (at once if it already is).
        let leave = move || {
            if let Ok(mut r) = me.resident.lock() {
                r.remove(&gone);
            }
        };
        if let Ok(mut r) = self.resident.lock() {
            r.insert(
                id,
                Resident {
                    agent: agent.clone(),
                    parent: parent.to_owned(),
                    label: label.to_owned(),
                },
            );
        }
        agent.on_disposed(leave);
        Ok(())
    }

    /// Delivers `text` to a continuable child of `parent` as its next turn;
    /// a child that is only on disk is resumed first (into `parent`'s scope).
    pub async fn send(
        self: &Arc<Self>,
        parent: &Agent,
        child: &str,
        text: &str,
    ) -> Result<(), SubagentError> {
        let live = self
            .resident
            .lock()
            .ok()
            .and_then(|r| r.get(child).cloned());
        let agent = match live {
            Some(r) if r.parent != parent.id() => {
                return Err(SubagentError::Unauthorized {
                    caller: parent.id().into(),
                    child: child.into(),
                });
            }
            Some(r) => r.agent,
            None => {
                // One resume at a time: two messages for a child on disk
                // must not bring it back twice.
                let _one = self.resuming.lock().await;
                let again = self
                    .resident
                    .lock()
                    .ok()
                    .and_then(|r| r.get(child).cloned());
                match again {
                    Some(r) if r.parent == parent.id() => r.agent,
                    Some(_) => {
                        return Err(SubagentError::Unauthorized {
                            caller: parent.id().into(),
                            child: child.into(),
                        });
                    }
                    None => self.resume(parent, child).await?,
                }
            }
        };
        let mut message = Message::user_text(text);
        message.source = MessageSource::of("coordinator");
        Ok(agent.followup(message)?)
    }

    async fn resume(self: &Arc<Self>, parent: &Agent, child: &str) -> Result<Agent, SubagentError> {
        let live = parent
            .reach()
            .get::<crate::agent::Agents>(crate::agent::Agents::SERVICE)
            .is_some_and(|a| a.get(child).is_some());
        if live {
            return Err(SubagentError::Start(format!(
                "{child} is running and is not a continuable child; it takes no messages"
            )));
        }
        let store = store_of(parent).ok_or_else(|| SubagentError::NotFound(child.into()))?;
        let (id, from) = (child.to_owned(), store.clone());
        let loaded = tokio::task::spawn_blocking(move || {
            let loaded = from.load(&id)?;
            from.prepare_resume(&id, &loaded).map(|()| loaded)
        })
        .await
        .map_err(|e| SubagentError::Start(chain(&e).to_string()))?
        .map_err(|e| match e {
            dsh_services::persistence::StoreError::NotFound(..) => {
                SubagentError::NotFound(child.into())
            }
            other => SubagentError::Store(other),
        })?;
        if loaded.header.parent_session.as_deref() != Some(parent.id()) {
            return Err(SubagentError::Unauthorized {
                caller: parent.id().into(),
                child: child.into(),
            });
        }
        let Some(found) = descriptor(&loaded.events).cloned() else {
            return Err(SubagentError::NotFound(child.into()));
        };
        if found["mode"] != "continuable" {
            return Err(SubagentError::Start(format!(
                "{child} was a one-shot child; only continuable children take messages"
            )));
        }
        let label = found["label"].as_str().unwrap_or_default().to_owned();
        let mut spec = child_spec(parent, None, loaded.header.delegation_depth);
        if let Some(persona) = found["persona"].as_str() {
            spec.system = Some(persona.to_owned());
        }
        if let Some(filter) = found.get("toolFilter").filter(|f| f.is_object()) {
            let names = |v: &Value| -> Vec<String> {
                v.as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|n| n.as_str().map(str::to_owned))
                            .collect()
                    })
                    .unwrap_or_default()
            };
            spec.restriction = Some(Restriction {
                allow: filter["allow"].is_array().then(|| names(&filter["allow"])),
                deny: names(&filter["deny"]),
            });
        }
        if let (Some(provider), Some(model)) = (
            found["agentOptions"]["provider"].as_str(),
            found["agentOptions"]["model"].as_str(),
        ) {
            spec.provider = provider.to_owned();
            spec.model = model.to_owned();
        }
        spec.approval = Some(delegated_approval(parent));
        spec.id = Some(child.to_owned());
        spec.durable = Some(loaded.durable);
        spec.store = Some(store);
        spec.seed = Some(Box::new((loaded.header, loaded.events)));
        spec.on_turn_end = Some(settled_hook(parent));
        spec.tools.0.push(parent_report());
        let home = parent.context()?;
        let agent = Agent::create(&home, spec).await?;
        if let Err(e) = self.admit(&agent, parent.id(), &label) {
            agent.dispose().await;
            return Err(e);
        }
        Ok(agent)
    }

    /// Cancels the running turn of a continuable child of `parent`; queued
    /// messages stay. An absent (finished, unknown) child is a no-op.
    pub fn interrupt(&self, parent: &Agent, child: &str) -> Result<(), SubagentError> {
        let live = self
            .resident
            .lock()
            .ok()
            .and_then(|r| r.get(child).cloned());
        match live {
            None => Ok(()),
            Some(r) if !self.descends_from(&r.parent, parent.id()) => {
                Err(SubagentError::Unauthorized {
                    caller: parent.id().into(),
                    child: child.into(),
                })
            }
            Some(r) => {
                r.agent.cancel();
                Ok(())
            }
        }
    }

    /// Delivers `text` from the live continuable `child` to its live
    /// direct parent (the one it was started or resumed under; nobody else
    /// may be named) as a [`REPORT_SOURCE`] message steered in at the
    /// parent's next step, waking it when idle. Returns the message's id.
    /// The child's turn goes on. `child` must be the calling agent (the
    /// `report` tool passes its caller): whoever holds an [`Agent`] speaks
    /// for it.
    pub fn report_from(&self, child: &Agent, text: &str) -> Result<String, SubagentError> {
        let resident = self
            .resident
            .lock()
            .ok()
            .and_then(|r| r.get(child.id()).cloned());
        let Some(resident) = resident else {
            return Err(SubagentError::Report(format!(
                "{} is not a live continuable child",
                child.id()
            )));
        };
        let parent = child
            .reach()
            .get::<crate::agent::Agents>(crate::agent::Agents::SERVICE)
            .and_then(|a| a.get(&resident.parent))
            .filter(|p| !p.status().is_terminal())
            .ok_or_else(|| {
                SubagentError::Report(format!("its parent {} is gone", resident.parent))
            })?;
        let mut message = Message::user_text(text);
        message.source = MessageSource::of(REPORT_SOURCE);
        message.source.set_extra("form", json!("relay"));
        message
            .source
            .set_extra("senderSessionId", json!(child.id()));
        let id = message.id.clone();
        parent
            .steer(message)
            .map_err(|e| SubagentError::Report(format!("its parent refused it: {}", chain(&e))))?;
        Ok(id)
    }

    /// Whether the resident child whose parent is `parent` is `ancestor`'s
    /// child or deeper descendant (followed through resident children).
    fn descends_from(&self, parent: &str, ancestor: &str) -> bool {
        let Ok(resident) = self.resident.lock() else {
            return false;
        };
        let mut at = parent.to_owned();
        // A chain longer than any delegation depth is no descent.
        for _ in 0..64 {
            if at == ancestor {
                return true;
            }
            match resident.get(&at) {
                Some(r) => at = r.parent.clone(),
                None => return false,
            }
        }
        false
    }

    /// The continuable children of `parent`: resident ones, then those only
    /// on disk (found by their header's `parentSession`).
    pub async fn children(&self, parent: &Agent) -> Vec<ChildEntry> {
        self.children_of(parent.id(), store_of(parent)).await
    }

    /// Every continuable descendant of `parent`, in pre-order (each child
    /// followed by its own descendants), each with its direct parent and
    /// depth.
    pub async fn descendants(&self, parent: &Agent) -> Vec<ChildEntry> {
        let store = store_of(parent);
        let mut out = Vec::new();
        // (parent id, depth, its children still to visit, reversed)
        let mut first = self.children_of(parent.id(), store.clone()).await;
        first.reverse();
        let mut stack = vec![(parent.id().to_owned(), 1u32, first)];
        let mut seen = std::collections::HashSet::new();
        while let Some((above, depth, mut pending)) = stack.pop() {
            let Some(mut child) = pending.pop() else {
                continue;
            };
            stack.push((above.clone(), depth, pending));
            if !seen.insert(child.id.clone()) || depth > 64 {
                continue;
            }
            child.parent = Some(above);
            child.depth = Some(depth);
            let id = child.id.clone();
            out.push(child);
            let mut below = self.children_of(&id, store.clone()).await;
            below.reverse();
            stack.push((id, depth + 1, below));
        }
        out
    }

    async fn children_of(
        &self,
        parent: &str,
        store: Option<Arc<dyn SessionPersistence>>,
    ) -> Vec<ChildEntry> {
        let mut out: Vec<ChildEntry> = self
            .resident
            .lock()
            .map(|r| {
                r.iter()
                    .filter(|(_, c)| c.parent == parent)
                    .map(|(id, c)| ChildEntry {
                        id: id.clone(),
                        label: c.label.clone(),
                        status: if c.agent.is_idle() { "idle" } else { "running" },
                        parent: None,
                        depth: None,
                    })
                    .collect()
            })
            .unwrap_or_default();
        let Some(store) = store else {
            return out;
        };
        let resident: Vec<String> = out.iter().map(|c| c.id.clone()).collect();
        let parent_id = parent.to_owned();
        // Store reads block: off the async workers.
        let stored = tokio::task::spawn_blocking(move || {
            let mut found = Vec::new();
            let Ok(list) = store.list() else {
                return found;
            };
            for s in list.into_iter().flatten() {
                if s.parent_session.as_deref() != Some(parent_id.as_str())
                    || resident.contains(&s.id)
                {
                    continue;
                }
                let Ok(loaded) = store.load(&s.id) else {
                    continue;
                };
                if descriptor_mode(&loaded.events).as_deref() == Some("continuable") {
                    found.push(ChildEntry {
                        id: s.id,
                        label: descriptor_label(&loaded.events).unwrap_or_default(),
                        status: "ready",
                        parent: None,
                        depth: None,
                    });
                }
            }
            found
        })
        .await
        .unwrap_or_default();
        out.extend(stored);
        out
    }
}

fn descriptor(events: &[SessionEvent]) -> Option<&Value> {
    events.iter().rev().find_map(|e| match &e.data {
        EventData::Other { kind, data } if &**kind == "subagent/descriptor" => Some(&**data),
        _ => None,
    })
}

fn descriptor_label(events: &[SessionEvent]) -> Option<String> {
    descriptor(events)?["label"].as_str().map(str::to_owned)
}

fn descriptor_mode(events: &[SessionEvent]) -> Option<String> {
    descriptor(events)?["mode"].as_str().map(str::to_owned)
}

fn store_of(agent: &Agent) -> Option<Arc<dyn SessionPersistence>> {
    let own = agent.spec().store.clone();
    own.filter(|s| !s.holds_one_session()).or_else(|| {
        agent
            .reach()
            .get::<dyn SessionPersistence>(PERSISTENCE_SERVICE)
    })
}

fn prompt_message(request: &StartRequest) -> Message {
    let mut text = request.prompt.clone();
    if request.output_schema.is_some() {
        text.push_str(
            "\n\nWhen you are done, call the `report` tool once with your result; \
             its arguments must match its schema. That call ends your work.",
        );
    }
    Message::user_text(text)
}

/// The notice a continuable child's settled turn sends its parent.
fn settled_hook(parent: &Agent) -> TurnHook {
    let weak = parent.downgrade();
    TurnHook::new(move |child: &Agent, summary: &TurnSummary| {
        let Some(parent) = weak.upgrade() else {
            return;
        };
        let how = match &summary.reason {
            TurnEndReason::Completed => "completed".to_owned(),
            TurnEndReason::MaxTokens => "stopped at its token limit".to_owned(),
            TurnEndReason::Aborted { .. } | TurnEndReason::Interrupted => {
                "was interrupted".to_owned()
            }
            TurnEndReason::Blocked => "was blocked by a policy".to_owned(),
            TurnEndReason::Error { error } => format!("failed ({})", error.code),
        };
        let mut message = Message::user_text(format!(
            "Subagent {} {how}. Its final message:\n{}",
            child.id(),
            summary.text
        ));
        message.source = MessageSource::of(SETTLED_SOURCE);
        message.source.set_extra("form", json!("notice"));
        message
            .source
            .set_extra("senderSessionId", json!(child.id()));
        if parent.steer(message).is_err() {
            tracing::debug!(child = child.id(), "the parent no longer takes notices");
        }
    })
}

/// The delegation depth cap of a start that names none.
pub const DEFAULT_MAX_DEPTH: u32 = 3;

/// A delegated child's `approval/policy` and `sandbox/mode` records, one
/// copy shared by every child started with the same policy and mode (a
/// fan-out of a thousand children holds one; the combinations are few).
fn delegation_records(
    policy: dsh_services::approval::ApprovalPolicy,
    mode: dsh_services::sandbox::Policy,
) -> [Arc<Value>; 2] {
    type Records = Vec<(
        dsh_services::approval::ApprovalPolicy,
        dsh_services::sandbox::Policy,
        [Arc<Value>; 2],
    )>;
    static SHARED: Mutex<Records> = Mutex::new(Vec::new());
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some((_, _, records)) = shared.iter().find(|(p, m, _)| (*p, *m) == (policy, mode)) {
        return records.clone();
    }
    let records = [
        Arc::new(json!({"policy": policy, "source": "delegation"})),
        Arc::new(json!({"mode": mode.mode, "network": mode.network, "source": "delegation"})),
    ];
    shared.push((policy, mode, records.clone()));
    records
}

/// A child's approval seam: it cannot ask the human, so what needs approval
/// is refused — unless the parent's policy already allows everything.
fn delegated_approval(parent: &Agent) -> Arc<Approval> {
    let parent_policy = parent
        .reach()
        .get::<Approval>(Approval::SERVICE)
        .map(|a| a.policy());
    let policy = match parent_policy {
        Some(ApprovalPolicy::Always) => ApprovalPolicy::Always,
        _ => ApprovalPolicy::Never,
    };
    Arc::new(Approval::new(policy))
}

/// The spec of a child of `parent` at `depth`.
fn child_spec(parent: &Agent, request: Option<&StartRequest>, depth: u32) -> AgentSpec {
    let p = parent.spec();
    let (provider, model) = request
        .and_then(|r| r.route.clone())
        .unwrap_or_else(|| (p.provider.clone(), p.model.clone()));
    let mut spec = AgentSpec::new(&provider, &model, p.cwd.clone());
    spec.system = request
        .and_then(|r| r.persona.clone())
        .or_else(|| p.system.clone());
    // The same workspace, the same project instructions and skills.
    spec.sections = p.sections.clone();
    spec.max_steps = match request.and_then(|r| r.max_steps) {
        Some(cap) => cap.min(p.max_steps),
        None => p.max_steps,
    };
    spec.reasoning_effort = request
        .and_then(|r| r.reasoning_effort.clone())
        .or_else(|| p.reasoning_effort.clone());
    spec.definition = request.and_then(|r| r.definition.clone());
    // Its own budgets, under its parent's (a child of a limited parent is
    // counted there even with none of its own).
    let own = request.map_or((None, None, None), |r| {
        (r.max_turns, r.max_tokens, r.timeout)
    });
    if p.limits.is_some() || own != (None, None, None) {
        let whose = match &spec.definition {
            Some(d) => format!("agent definition `{d}`"),
            None => "this subagent".to_owned(),
        };
        spec.limits = Some(crate::agent::Limits::new(
            whose,
            p.limits.as_ref(),
            own.0,
            own.1,
            own.2,
        ));
    }
    spec.max_parallel_tools = p.max_parallel_tools;
    spec.temperature = p.temperature;
    spec.max_tokens = p.max_tokens;
    // A single-file store holds the parent's log only; the child then uses
    // the store provided in scope, if any.
    spec.store = p.store.clone().filter(|s| !s.holds_one_session());
    spec.depth = depth;
    // Never more than the parent may do.
    spec.permission = Some(parent.policy().narrowed(request.and_then(|r| r.permission)));
    spec.parent_session = Some(parent.id().to_owned());
    spec.origin = Some("subagent".into());
    spec.flat_scope = true;
    spec
}

/// Builds and publishes nothing yet: validates, creates the child agent
/// (with its capture tool), and returns it idle.
async fn compose(
    provider: &dyn SubagentProvider,
    request: &StartRequest,
    max_depth: u32,
    descriptor: Value,
    continuable: Option<TurnHook>,
    capture: Option<Arc<Mutex<Option<Value>>>>,
) -> Result<(Agent, Option<String>), SubagentError> {
    let caps = provider.capabilities();
    let missing = [
        (
            request.output_schema.is_some() && !caps.output_schema,
            "outputSchema",
        ),
        (
            request.max_depth.is_some() && !caps.depth_limit,
            "depthLimit",
        ),
        (
            request.tool_filter.is_some() && !caps.tool_filter,
            "toolFilter",
        ),
        (request.persona.is_some() && !caps.persona, "persona"),
    ];
    if let Some((_, feature)) = missing.iter().find(|(m, _)| *m) {
        return Err(SubagentError::Unsupported {
            provider: provider.name().into(),
            feature,
        });
    }
    // Every start is capped, whoever asks (a tool, a workflow, a loop).
    let depth = request.parent.depth().saturating_add(1);
    let max = request.max_depth.unwrap_or(max_depth);
    if depth > max {
        return Err(SubagentError::DepthExceeded { depth, max });
    }
    let schema = match &request.output_schema {
        Some(s) if s.get("type").and_then(Value::as_str) != Some("object") => {
            return Err(SubagentError::Start(
                "an output schema must be an object schema (`\"type\": \"object\"`)".into(),
            ));
        }
        Some(s) => Some(s.clone()),
        None => None,
    };
    if request.cancel.is_cancelled() {
        return Err(SubagentError::Cancelled);
    }
    let mut spec = child_spec(&request.parent, Some(request), depth);
    spec.restriction = within(
        request.tool_filter.clone(),
        request.parent.spec().restriction.as_ref(),
    )
    .map(|mut r| {
        if let (Some(allow), true) = (r.allow.as_mut(), schema.is_some()) {
            allow.push(REPORT.into());
        }
        r
    });
    let continuable = continuable.map(|hook| {
        spec.on_turn_end = Some(hook);
    });
    // A child cannot ask the human: what needs approval is refused, unless
    // the parent's policy already allows everything.
    let approval = delegated_approval(&request.parent);
    let policy = approval.policy();
    spec.approval = Some(approval);
    let mode = spec.permission.unwrap_or_default();
    let [policy, mode] = delegation_records(policy, mode);
    spec.opening = vec![
        EventData::Other {
            kind: Arc::from("approval/policy"),
            data: policy,
        },
        EventData::Other {
            kind: Arc::from("sandbox/mode"),
            data: mode,
        },
        EventData::Other {
            kind: Arc::from("subagent/descriptor"),
            data: Arc::new(descriptor),
        },
    ];
    if let Some(seed) = provider.seed(&request.parent)? {
        let id = Message::new_id();
        let mut header = SessionHeader::new(id.clone(), Some(spec.cwd.display().to_string()));
        header.parent_session = Some(request.parent.id().to_owned());
        header.origin = Some(Value::String("subagent".into()));
        header.delegation_depth = depth;
        header.seed_length = Some(seed.len() as u64);
        spec.id = Some(id);
        spec.seed = Some(Box::new((header, seed)));
    }
    let id = spec.id.get_or_insert_with(Message::new_id).clone();
    spec.name = Some(format!("subagent/{}", crate::session::short(&id)));
    spec.group = request.group.clone();
    spec.label = request
        .label
        .clone()
        .filter(|l| !l.trim().is_empty())
        .or_else(|| {
            let head: String = request
                .prompt
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" ");
            (!head.is_empty()).then(|| match head.char_indices().nth(48) {
                Some((at, _)) => format!("{}…", &head[..at]),
                None => head,
            })
        });
    let owner = match &request.owner {
        Some(owner) => owner.clone(),
        None => request.parent.context()?,
    };
    // A remote child: its agent here relays to it, offering no tools.
    let remote = provider.remote(request, &spec).await?;
    let route = format!("remote/{id}");
    if remote.is_some() {
        spec.provider = route.clone();
        spec.model = "remote".into();
        // No tools but the capture: a structured result arrives as a
        // `report` call, validated here too.
        let allow = match schema {
            Some(_) => vec![REPORT.to_owned()],
            None => Vec::new(),
        };
        spec.restriction = Some(Restriction {
            allow: Some(allow),
            deny: Vec::new(),
        });
    }
    if continuable.is_some() && remote.is_none() {
        spec.tools.0.push(parent_report());
    }
    let agent = Agent::create(&owner, spec).await?;
    let mut node = None;
    if let Some(RemoteLink {
        adapter,
        close,
        place,
        placed,
        node: there,
    }) = remote
    {
        node = there;
        // Registered for the child's lifetime: disposing it ends the process.
        let registered = agent
            .context()
            .map_err(SubagentError::from)
            .and_then(|ctx| {
                let llm = ctx
                    .get::<dsh_services::llm::LlmRuntime>(dsh_services::llm::LlmRuntime::SERVICE)
                    .ok_or_else(|| SubagentError::Start("no `llm` service".into()))?;
                llm.register(&ctx, &[route.as_str()], adapter)
                    .map_err(SubagentError::from)?;
                if let Some(place) = place {
                    let part = ctx
                        .part("remote-child", place)
                        .map_err(|e| SubagentError::Start(chain(&e).to_string()))?;
                    if let Some(placed) = placed {
                        placed(part);
                    }
                }
                match close {
                    Some(close) => ctx
                        .effect_async("close the remote child", move || close)
                        .map(|_| ())
                        .map_err(|e| SubagentError::Start(chain(&e).to_string())),
                    None => Ok(()),
                }
            });
        if let Err(e) = registered {
            agent.dispose().await;
            return Err(e);
        }
    }
    if let (Some(schema), Some(slot)) = (schema, capture) {
        // An ad hoc registration: it keeps the child awake until disposed.
        let registered = agent
            .context()
            .map_err(SubagentError::from)
            .and_then(|ctx| {
                let tools = ctx
                    .get::<ToolRegistry>(ToolRegistry::SERVICE)
                    .ok_or(AgentError::MissingService(ToolRegistry::SERVICE))?;
                tools
                    .register(&ctx, Arc::new(Report { schema, slot }))
                    .map_err(SubagentError::from)
            });
        if let Err(e) = registered {
            agent.dispose().await;
            return Err(e);
        }
    }
    if request.cancel.is_cancelled() {
        agent.dispose().await;
        return Err(SubagentError::Cancelled);
    }
    Ok((agent, node))
}

/// The name of the structured-output capture tool.
pub const REPORT: &str = "report";

/// What a relaying child (one that runs elsewhere) is asked: the latest
/// user message of its proxy's request that the proxy's own runtime did not
/// add (its runtime context is a `plugin` message): the prompt, or a
/// continuable child's later message.
pub(crate) fn relayed_prompt(request: &dsh_services::llm::LlmRequest) -> String {
    request
        .messages
        .iter()
        .rev()
        .find(|m| m.role == dsh_services::llm::Role::User && m.source.kind != "plugin")
        .map(|m| m.text())
        .unwrap_or_default()
}

/// A `report` capture tool filling `slot` (for a child made elsewhere, such
/// as a node's host).
pub(crate) fn report_tool(schema: Value, slot: Arc<Mutex<Option<Value>>>) -> Arc<dyn Tool> {
    Arc::new(Report { schema, slot })
}

/// The child-scoped capture tool: its validated arguments are the child's
/// structured result, and its committed result concludes the turn.
struct Report {
    schema: Value,
    slot: Arc<Mutex<Option<Value>>>,
}

impl Tool for Report {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: REPORT.into(),
            description: "Report your final structured result. Call it once, when you are done; \
                          the call ends your work."
                .into(),
            parameters: self.schema.clone(),
        }
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            if let Ok(mut slot) = self.slot.lock() {
                *slot = Some(cx.args.clone());
            }
            if let Some(agent) = Agent::calling(&cx.ctx) {
                agent.conclude_turn();
            }
            Ok(ToolOutput::text("Result recorded."))
        }
        .boxed()
    }
}

/// A continuable child's `report`: what it chooses to tell its direct
/// parent before it is done (see [`Subagents::report_from`]).
fn parent_report() -> Arc<dyn Tool> {
    Arc::new(ParentReport)
}

struct ParentReport;

impl Tool for ParentReport {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: REPORT.into(),
            description: "Send your parent (the agent that started you) something it should act \
                          on: a finding or progress that changes its next move, and once, before \
                          you finish, your self-contained result. It sees none of your transcript, \
                          tool output or reasoning, only what you report, so name the files you \
                          changed in the shared workspace. Reporting does not end your turn. A \
                          failed call may have arrived anyway; do not repeat it blindly."
                .into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "output": {
                        "type": "string",
                        "description": "What your parent should know: conclusions and the paths they concern."
                    }
                },
                "required": ["output"],
                "additionalProperties": false
            }),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Another agent started you and reads only what you `report`: report what changes \
             its next move as you find it, and your result once before you finish.",
        )
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let output = cx.args["output"].as_str().unwrap_or_default();
            if output.trim().is_empty() {
                return Err(ToolError::new(
                    "INVALID_ARGS",
                    "`output` is empty; report what your parent should know",
                ));
            }
            let child = Agent::calling(&cx.ctx)
                .ok_or_else(|| ToolError::failed("`report` is called by an agent"))?;
            let subagents = cx
                .ctx
                .get::<Subagents>(Subagents::SERVICE)
                .ok_or_else(|| ToolError::failed("no `subagents` service"))?;
            let id = subagents
                .report_from(&child, output)
                .map_err(|e| ToolError::new(e.code(), chain(&e).to_string()))?;
            Ok(ToolOutput::text(format!(
                "Delivered to your parent (message {id}). Your turn goes on."
            )))
        }
        .boxed()
    }
}

/// Content of a result, for a tool answer.
pub fn result_content(result: &SubagentResult) -> Vec<ContentBlock> {
    match &result.structured {
        Some(v) => vec![ContentBlock::text(v.to_string())],
        None => vec![ContentBlock::text(result.output.clone())],
    }
}
