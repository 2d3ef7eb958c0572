//! How an agent is built: [`AgentSpec`] (route, prompt, workspace, tool
//! restriction, limits, store, seed, lineage) and the turn-end hook.

use std::path::PathBuf;
use std::sync::Arc;

use dsh_services::approval::Approval;
use dsh_services::sandbox::Policy;
use dsh_services::session::{EventData, SessionEvent, SessionHeader};
use dsh_services::tools::Restriction;

use super::{Agent, TurnSummary};

/// How to build an agent.
#[derive(Clone, Debug)]
pub struct AgentSpec {
    /// Provider route of the model.
    pub provider: String,
    /// Model id.
    pub model: String,
    /// Base system prompt.
    pub system: Option<String>,
    /// System prompt sections of the agent's workspace — `(name, order,
    /// text)`: the project's instructions, its skills catalog — registered
    /// in its scope; a delegated child gets its parent's.
    pub sections: Vec<dsh_services::prompt::RenderedSection>,
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
    /// What the agent's tools may do without asking: its permission mode
    /// and network. `None`: the `sandbox` service's default (or
    /// `workspace-write` with the network on). A delegated child's is its
    /// parent's, or narrower.
    pub permission: Option<Policy>,
    /// What people call it (the tree's summary and the dashboard show it):
    /// a workflow child's label, else the head of its task.
    pub label: Option<String>,
    /// The group it belongs to among its siblings (a workflow child's
    /// phase): the dashboard shows the children of one group together.
    pub group: Option<String>,
    /// The named agent definition it was made from.
    pub definition: Option<String>,
    /// The reasoning effort its requests ask for (`None`: the route's).
    pub reasoning_effort: Option<String>,
    /// What it may spend in all (turns, tokens, wall time), counted with
    /// its ancestors' (see [`super::Limits`]).
    pub limits: Option<super::Limits>,
    /// Tools of its own: registered in its own scope each time it is built
    /// (created or woken; so not ad hoc registrations that keep it awake),
    /// where its tool filter does not hide them. Agents created in its
    /// scope without a flat scope of their own see them too.
    pub tools: OwnTools,
}

/// An agent's own tools (see [`AgentSpec::tools`]).
#[derive(Clone, Default)]
pub struct OwnTools(pub Vec<Arc<dyn dsh_services::tools::Tool>>);

impl std::fmt::Debug for OwnTools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|t| t.schema().name))
            .finish()
    }
}

impl OwnTools {
    /// Whether both hold the same tools (the same instances, in order).
    fn same(&self, other: &OwnTools) -> bool {
        self.0.len() == other.0.len() && self.0.iter().zip(&other.0).all(|(a, b)| Arc::ptr_eq(a, b))
    }
}

/// A callback run after each turn of an agent (with the agent and how the
/// turn ended); it must not block.
#[derive(Clone)]
pub struct TurnHook(pub(super) Arc<TurnHookFn>);

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
            sections: Vec::new(),
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
            permission: None,
            label: None,
            group: None,
            definition: None,
            reasoning_effort: None,
            limits: None,
            tools: OwnTools::default(),
        }
    }
}

/// Whether two kept specs (no seed, id or durable count) build the same agent.
pub(super) fn same_template(a: &AgentSpec, b: &AgentSpec) -> bool {
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
        && a.sections == b.sections
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
        && a.permission == b.permission
        && a.label == b.label
        && a.group == b.group
        && a.definition == b.definition
        && a.reasoning_effort == b.reasoning_effort
        && a.limits == b.limits
        && a.tools.same(&b.tools)
}
