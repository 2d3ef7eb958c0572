//! The front door for a service that embeds dsh.
//!
//! [`Dsh::builder`] boots a runtime with the agent services and one model
//! ([`Model`]); the [`Dsh`] it hands back runs agents ([`Dsh::agent`]),
//! workflow scripts ([`Dsh::workflow`]) and Ralph loops ([`Dsh::ralph`])
//! under that runtime's supervision tree, and [`Dsh::shutdown`] tears the
//! whole tree down in order. Each operation fails with an error of its own
//! ([`StartError`], [`RunError`], [`FlowError`], [`ShutdownError`]) that a
//! service can match: a stable [`code`](RunError::code) and whether trying
//! again may help ([`is_retryable`](RunError::is_retryable)).
//!
//! The crate root's docs open with the five-line program.
//!
//! Defaults are for a service: nothing asks a person (a call that needs
//! approval is refused), commands run sandboxed with workspace writes, the
//! workspace is the current directory, and sessions live in memory unless
//! [`DshBuilder::sessions_dir`] or [`DshBuilder::sessions_db`] names a
//! store.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec, TurnSummary};
use dsh_actors::ralph::{self, RalphOutcome, RalphRequest, RalphResult};
use dsh_actors::session::SessionHandle;
use dsh_actors::subagent::Subagents;
use dsh_actors::workflow::{WorkflowEngine, WorkflowRequest, WorkflowStop};
use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::{LlmRuntime, Message};
use dsh_services::persistence::{JsonlStore, PERSISTENCE_SERVICE, SessionPersistence, SqliteStore};
use dsh_services::providers::demo::DemoModel;
use dsh_services::providers::scripted::ScriptedModel;
use dsh_services::sandbox::{BackendChoice, PermissionMode};
use dsh_services::session::{EventData, SessionEvent, TurnEndReason};
use dsh_supervisors::error::chain;
use dsh_supervisors::{Runtime, RuntimeSettings};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::catalogue::{
    AgentServices, AgentServicesConfig, DeepSeek, DeepSeekPluginConfig, OpenAi, OpenAiPluginConfig,
};
use crate::tool::{CustomTool, valid_name};
use dsh_services::tools::ToolRegistry;

/// Declares one facade error type: a stable code, a message, whether a
/// retry may help.
macro_rules! facade_error {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Debug, PartialEq, Eq)]
        pub struct $name {
            code: std::borrow::Cow<'static, str>,
            message: String,
            retryable: bool,
        }

        impl $name {
            fn new(code: impl Into<std::borrow::Cow<'static, str>>, message: impl Into<String>) -> $name {
                $name { code: code.into(), message: message.into(), retryable: false }
            }

            #[allow(dead_code, reason = "not every operation has a failure worth retrying")]
            fn retryable(mut self) -> $name {
                self.retryable = true;
                self
            }

            /// The stable machine code (`CONFIG`, `TIMEOUT`, …; see the
            /// operation's documentation).
            pub fn code(&self) -> &str {
                &self.code
            }

            /// Whether the same call may succeed if tried again (a timeout,
            /// a rate limit, a session another writer holds).
            pub fn is_retryable(&self) -> bool {
                self.retryable
            }

            /// What went wrong, for a person.
            pub fn message(&self) -> &str {
                &self.message
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "{}: {}", self.code, self.message)
            }
        }

        impl std::error::Error for $name {}
    };
}

facade_error!(
    /// Why [`DshBuilder::start`] failed: `CONFIG` (an option is wrong: no
    /// model, a workspace that is not a directory, a script that does not
    /// parse, a key that is not set), `STORE` (the session store does not
    /// open) or `BOOT` (the runtime or a plugin did not start).
    StartError
);

facade_error!(
    /// Why an agent operation failed: `CREATE` (the agent could not be
    /// made: an unknown definition, a store that refuses it), `CLOSED`
    /// (it takes no more input, or the runtime shuts down), `BUSY` (its
    /// session's store refused it a writer; retryable), `TIMEOUT` (the
    /// turn outlived its bound and was cancelled; retryable), `CANCELLED`, `BLOCKED` (a policy stopped the turn),
    /// `INTERRUPTED`, or the model's own failure code (`RATE_LIMITED`,
    /// `AUTH`, `BUDGET_EXHAUSTED`, …; retryable when the model says so).
    RunError
);

facade_error!(
    /// Why a workflow or a Ralph loop failed: `SCRIPT` (the request is
    /// refused: a script or meta block that does not parse, a bad limit),
    /// `CREATE` (its coordinator could not be made), `FAILED`, `CANCELLED`.
    FlowError
);

facade_error!(
    /// Why [`Dsh::shutdown`] failed: `TIMEOUT` (the teardown had not ended
    /// 5 s past its budget: the kernel kills what outlives the budget, so
    /// even that stalled).
    ShutdownError
);

/// Which model the runtime's agents use.
#[derive(Clone)]
pub struct Model(ModelKind);

#[derive(Clone)]
enum ModelKind {
    Demo,
    Scripted(Arc<ScriptedModel>),
    OpenAi {
        base_url: String,
        model: String,
        api_key_env: String,
    },
    DeepSeek {
        model: String,
    },
    Adapter(Arc<dyn dsh_services::llm::LlmAdapter>),
}

impl Model {
    /// The built-in keyless demo model: answers one line about its prompt's
    /// subject, reports Ralph handoffs. For trying things and for tests.
    pub fn demo() -> Model {
        Model(ModelKind::Demo)
    }

    /// A scripted model playing `script` (the JSON of a `--script` file:
    /// `{"steps": [{"text": …} | {"tool_calls": […]} | {"error": …}]}`),
    /// step after step across every agent. For tests.
    pub fn scripted(script: &str) -> Result<Model, StartError> {
        ScriptedModel::from_json(script)
            .map(|m| Model(ModelKind::Scripted(Arc::new(m))))
            .map_err(|e| StartError::new("CONFIG", format!("the script: {}", chain(&e))))
    }

    /// An OpenAI-compatible endpoint (`…/v1`) and the model id to ask for;
    /// the key is read from `$DSH_API_KEY` unless
    /// [`api_key_env`](Model::api_key_env) names another variable.
    pub fn openai_compatible(base_url: impl Into<String>, model: impl Into<String>) -> Model {
        Model(ModelKind::OpenAi {
            base_url: base_url.into(),
            model: model.into(),
            api_key_env: "DSH_API_KEY".into(),
        })
    }

    /// The environment variable an OpenAI-compatible endpoint's key is
    /// read from (no effect on other models).
    pub fn api_key_env(mut self, name: impl Into<String>) -> Model {
        if let ModelKind::OpenAi { api_key_env, .. } = &mut self.0 {
            *api_key_env = name.into();
        }
        self
    }

    /// DeepSeek's API with the key in `$DEEPSEEK_API_KEY` (and the
    /// endpoint in `$DEEPSEEK_BASE_URL`, else the official one);
    /// `deepseek-chat` unless `$DSH_MODEL` names another model.
    pub fn deepseek_from_env() -> Result<Model, StartError> {
        if std::env::var_os("DEEPSEEK_API_KEY").is_none_or(|k| k.is_empty()) {
            return Err(StartError::new(
                "CONFIG",
                "DEEPSEEK_API_KEY is not set; DeepSeek needs its key there",
            ));
        }
        let model = std::env::var("DSH_MODEL")
            .ok()
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| "deepseek-chat".into());
        Ok(Model(ModelKind::DeepSeek { model }))
    }

    /// Your own adapter (a provider dsh has none for, or a test double):
    /// every agent's requests go to it, on the route `custom`, with its
    /// name as the model id.
    pub fn adapter(adapter: Arc<dyn dsh_services::llm::LlmAdapter>) -> Model {
        Model(ModelKind::Adapter(adapter))
    }

    /// Registers the model in `rt`; its provider route and model id.
    async fn register(&self, rt: &Runtime) -> Result<(String, String), StartError> {
        let root = rt.root();
        let boot = |e: &dyn std::error::Error| {
            StartError::new("BOOT", format!("cannot register the model: {}", chain(e)))
        };
        let llm = || {
            root.get::<LlmRuntime>(LlmRuntime::SERVICE)
                .ok_or_else(|| StartError::new("BOOT", "the agent services provide no llm"))
        };
        match &self.0 {
            ModelKind::Demo => {
                llm()?
                    .register(&root, &["demo"], Arc::new(DemoModel))
                    .map_err(|e| boot(&e))?;
                Ok(("demo".into(), "demo".into()))
            }
            ModelKind::Scripted(model) => {
                llm()?
                    .register(&root, &["scripted"], model.clone())
                    .map_err(|e| boot(&e))?;
                Ok(("scripted".into(), "scripted".into()))
            }
            ModelKind::OpenAi {
                base_url,
                model,
                api_key_env,
            } => {
                let config = OpenAiPluginConfig::endpoint("openai", base_url, api_key_env);
                root.plugin(OpenAi, config).await.map_err(|e| {
                    StartError::new("CONFIG", format!("the endpoint {base_url}: {}", chain(&e)))
                })?;
                Ok(("openai".into(), model.clone()))
            }
            ModelKind::Adapter(adapter) => {
                llm()?
                    .register(&root, &["custom"], adapter.clone())
                    .map_err(|e| boot(&e))?;
                Ok(("custom".into(), adapter.name().to_owned()))
            }
            ModelKind::DeepSeek { model } => {
                root.plugin(DeepSeek, DeepSeekPluginConfig::default())
                    .await
                    .map_err(|e| StartError::new("CONFIG", format!("DeepSeek: {}", chain(&e))))?;
                Ok(("deepseek".into(), model.clone()))
            }
        }
    }
}

impl std::fmt::Debug for Model {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            ModelKind::Demo => f.write_str("Model::demo()"),
            ModelKind::Scripted(_) => f.write_str("Model::scripted(..)"),
            ModelKind::OpenAi {
                base_url, model, ..
            } => {
                write!(f, "Model::openai_compatible({base_url:?}, {model:?})")
            }
            ModelKind::DeepSeek { model } => write!(f, "Model::deepseek_from_env() ({model})"),
            ModelKind::Adapter(a) => write!(f, "Model::adapter({:?})", a.name()),
        }
    }
}

/// Where sessions are kept.
#[derive(Clone, Debug, Default)]
enum Sessions {
    #[default]
    Memory,
    Dir(PathBuf),
    Db(PathBuf),
}

/// Options of a [`Dsh`]; [`start`](DshBuilder::start) boots it.
#[derive(Debug)]
pub struct DshBuilder {
    model: Option<Model>,
    workspace: Option<PathBuf>,
    permission_mode: PermissionMode,
    network: bool,
    sandbox: BackendChoice,
    approval: ApprovalPolicy,
    sessions: Sessions,
    max_depth: Option<u32>,
    turn_timeout: Duration,
    shutdown_budget: Duration,
    tools: Vec<CustomTool>,
}

impl Default for DshBuilder {
    fn default() -> Self {
        DshBuilder {
            model: None,
            workspace: None,
            permission_mode: PermissionMode::default(),
            network: true,
            sandbox: BackendChoice::default(),
            approval: ApprovalPolicy::Never,
            sessions: Sessions::Memory,
            max_depth: None,
            turn_timeout: Duration::from_secs(600),
            shutdown_budget: Duration::from_secs(30),
            tools: Vec::new(),
        }
    }
}

impl DshBuilder {
    /// The model every agent uses unless it names another (required).
    pub fn model(mut self, model: Model) -> Self {
        self.model = Some(model);
        self
    }

    /// The directory agents work in (default: the current directory); it
    /// must exist.
    pub fn workspace(mut self, dir: impl Into<PathBuf>) -> Self {
        self.workspace = Some(dir.into());
        self
    }

    /// What agents' tools may change without approval (default
    /// `workspace-write`).
    pub fn permission_mode(mut self, mode: PermissionMode) -> Self {
        self.permission_mode = mode;
        self
    }

    /// Whether agents' commands reach the network (default true).
    pub fn network(mut self, on: bool) -> Self {
        self.network = on;
        self
    }

    /// What confines commands (default: bwrap where it works, else
    /// Landlock).
    pub fn sandbox(mut self, backend: BackendChoice) -> Self {
        self.sandbox = backend;
        self
    }

    /// What a call that needs approval gets (default `Never`: refused;
    /// there is no person to ask).
    pub fn approval(mut self, policy: ApprovalPolicy) -> Self {
        self.approval = policy;
        self
    }

    /// Keep each session as a JSONL file in `dir` (created when missing).
    pub fn sessions_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.sessions = Sessions::Dir(dir.into());
        self
    }

    /// Keep sessions in the SQLite database at `file`.
    pub fn sessions_db(mut self, file: impl Into<PathBuf>) -> Self {
        self.sessions = Sessions::Db(file.into());
        self
    }

    /// How deep delegation may go (default 3; 0 forbids subagents).
    pub fn max_depth(mut self, depth: u32) -> Self {
        self.max_depth = Some(depth);
        self
    }

    /// The longest one turn may take before [`AgentBuilder::run`] or
    /// [`AgentHandle::run`] gives up with `TIMEOUT` (default 10 minutes).
    pub fn turn_timeout(mut self, timeout: Duration) -> Self {
        self.turn_timeout = timeout;
        self
    }

    /// How long [`Dsh::shutdown`] lets the tree drain before it kills what
    /// is left (default 30 s).
    pub fn shutdown_budget(mut self, budget: Duration) -> Self {
        self.shutdown_budget = budget;
        self
    }

    /// A tool written in Rust ([`CustomTool`]) every agent may call.
    pub fn tool(mut self, tool: CustomTool) -> Self {
        self.tools.push(tool);
        self
    }

    /// Boots the runtime: the agent services, the model, the session
    /// store. Must be called inside a tokio runtime.
    pub async fn start(self) -> Result<Dsh, StartError> {
        let model = self.model.clone().ok_or_else(|| {
            StartError::new(
                "CONFIG",
                "no model: call .model(Model::demo()), Model::openai_compatible(url, id) or Model::deepseek_from_env()",
            )
        })?;
        let workspace = match &self.workspace {
            Some(dir) => dir.clone(),
            None => std::env::current_dir().map_err(|e| {
                StartError::new("CONFIG", format!("no current directory: {}", chain(&e)))
            })?,
        };
        let workspace = std::fs::canonicalize(&workspace)
            .ok()
            .filter(|p| p.is_dir())
            .ok_or_else(|| {
                StartError::new(
                    "CONFIG",
                    format!("the workspace {} is not a directory", workspace.display()),
                )
            })?;
        if self.max_depth.is_some_and(|d| d > 16) {
            return Err(StartError::new("CONFIG", "max_depth is at most 16"));
        }
        if let Some(bad) = self.tools.iter().find(|t| !valid_name(t.name())) {
            return Err(StartError::new("CONFIG", bad_name(bad.name())));
        }
        let settings = RuntimeSettings {
            shutdown_budget: self.shutdown_budget,
            ..RuntimeSettings::default()
        };
        let rt = Runtime::start(settings)
            .await
            .map_err(|e| StartError::new("BOOT", format!("the runtime: {}", chain(&e))))?;
        match self.boot(&rt, &model, workspace).await {
            Ok(dsh) => Ok(dsh),
            Err(e) => {
                rt.shutdown().await;
                Err(e)
            }
        }
    }

    async fn boot(
        &self,
        rt: &Runtime,
        model: &Model,
        workspace: PathBuf,
    ) -> Result<Dsh, StartError> {
        let root = rt.root();
        let store = self.store()?;
        if let Some(store) = &store {
            root.provide(PERSISTENCE_SERVICE, store.clone())
                .map_err(|e| StartError::new("BOOT", format!("the store: {}", chain(&e))))?;
        }
        let services = AgentServicesConfig {
            approval: Some(self.approval),
            max_depth: self.max_depth,
            permission_mode: Some(self.permission_mode),
            network: Some(self.network),
            sandbox: Some(self.sandbox),
            ..AgentServicesConfig::default()
        };
        root.plugin(AgentServices, services)
            .await
            .map_err(|e| StartError::new("BOOT", format!("the agent services: {}", chain(&e))))?;
        if let Some(seam) = root.get::<Approval>(Approval::SERVICE) {
            seam.set_policy(self.approval);
        }
        let (provider, model) = model.register(rt).await?;
        if !self.tools.is_empty() {
            let registry = root
                .get::<ToolRegistry>(ToolRegistry::SERVICE)
                .ok_or_else(|| StartError::new("BOOT", "the agent services provide no tools"))?;
            for tool in &self.tools {
                registry.register(&root, tool.tool()).map_err(|e| {
                    StartError::new(
                        "CONFIG",
                        format!("the tool `{}`: {}", tool.name(), chain(&e)),
                    )
                })?;
            }
        }
        let subagents = root
            .get::<Subagents>(Subagents::SERVICE)
            .ok_or_else(|| StartError::new("BOOT", "the agent services provide no subagents"))?;
        let definitions = {
            let (cwd, home) = (workspace.clone(), crate::home::dir());
            tokio::task::spawn_blocking(move || {
                dsh_services::definitions::discover(&cwd, Some(&home))
            })
            .await
            .unwrap_or_default()
        };
        subagents.set_definitions(definitions.clone());
        let definitions = Arc::new(definitions);
        Ok(Dsh(Arc::new(Inner {
            rt: rt.clone(),
            provider,
            model,
            workspace,
            store,
            subagents,
            definitions,
            turn_timeout: self.turn_timeout,
            shutdown_budget: self.shutdown_budget,
        })))
    }

    fn store(&self) -> Result<Option<Arc<dyn SessionPersistence>>, StartError> {
        let refused = |what: &Path, e: &dyn std::error::Error| {
            StartError::new(
                "STORE",
                format!("the session store {}: {}", what.display(), chain(e)),
            )
        };
        Ok(match &self.sessions {
            Sessions::Memory => None,
            Sessions::Dir(dir) => {
                std::fs::create_dir_all(dir).map_err(|e| refused(dir, &e))?;
                Some(Arc::new(JsonlStore::new(dir.clone())))
            }
            Sessions::Db(file) => Some(Arc::new(
                SqliteStore::open(file).map_err(|e| refused(file, &e))?,
            )),
        })
    }
}

struct Inner {
    rt: Runtime,
    provider: String,
    model: String,
    workspace: PathBuf,
    store: Option<Arc<dyn SessionPersistence>>,
    subagents: Arc<Subagents>,
    definitions: Arc<dsh_services::definitions::Definitions>,
    turn_timeout: Duration,
    shutdown_budget: Duration,
}

/// A booted runtime (cheap to clone; every clone is the same runtime).
#[derive(Clone)]
pub struct Dsh(Arc<Inner>);

impl std::fmt::Debug for Dsh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dsh")
            .field(
                "route",
                &format_args!("{}/{}", self.0.provider, self.0.model),
            )
            .field("workspace", &self.0.workspace)
            .finish_non_exhaustive()
    }
}

impl Dsh {
    /// The options, to [`start`](DshBuilder::start) a runtime with.
    pub fn builder() -> DshBuilder {
        DshBuilder::default()
    }

    /// An agent to configure, then [`run`](AgentBuilder::run) once or
    /// [`spawn`](AgentBuilder::spawn) as a resident.
    pub fn agent(&self) -> AgentBuilder {
        AgentBuilder {
            dsh: self.clone(),
            system: None,
            tools: None,
            definition: None,
            model: None,
            timeout: self.0.turn_timeout,
            label: None,
            own_tools: Vec::new(),
            max_turns: None,
            max_tokens: None,
        }
    }

    /// A workflow run of `script` (JavaScript: `agent()`, `phase()`,
    /// `log()`, `args`) to configure, then [`run`](WorkflowBuilder::run).
    pub fn workflow(&self, script: impl Into<String>) -> WorkflowBuilder {
        WorkflowBuilder {
            dsh: self.clone(),
            script: script.into(),
            meta: serde_json::json!({
                "name": "workflow",
                "description": "a workflow run from Rust",
            }),
            args: Value::Null,
            max_parallel: None,
            max_agents: None,
        }
    }

    /// A Ralph loop on `objective` (a fresh worker per round, a structured
    /// handoff between rounds) to configure, then [`run`](RalphBuilder::run).
    pub fn ralph(&self, objective: impl Into<String>) -> RalphBuilder {
        RalphBuilder {
            dsh: self.clone(),
            objective: objective.into(),
            max_rounds: None,
            definition: None,
        }
    }

    /// The runtime underneath, for what the front door does not cover
    /// (plugins, the tree, the dashboard's [`Web`](crate::web::Web)).
    pub fn runtime(&self) -> &Runtime {
        &self.0.rt
    }

    /// The workspace agents work in.
    pub fn workspace(&self) -> &Path {
        &self.0.workspace
    }

    /// Disposes the whole tree in order (agents mid-turn are cancelled and
    /// their sessions flushed), within the builder's
    /// [`shutdown_budget`](DshBuilder::shutdown_budget); what is still up
    /// then is killed and the error says so.
    pub async fn shutdown(&self) -> Result<(), ShutdownError> {
        let budget = self.0.shutdown_budget;
        // The kernel kills what outlives its budget; the margin covers that.
        match tokio::time::timeout(budget + Duration::from_secs(5), self.0.rt.shutdown()).await {
            Ok(()) => Ok(()),
            Err(_) => Err(ShutdownError::new(
                "TIMEOUT",
                format!("the tree was not down within {} s", budget.as_secs()),
            )),
        }
    }

    /// A spec on this runtime's route, workspace and store.
    fn spec(&self) -> AgentSpec {
        let inner = &self.0;
        let mut spec = AgentSpec::new(&inner.provider, &inner.model, inner.workspace.clone());
        spec.store = inner.store.clone();
        spec.origin = Some("embed".into());
        spec
    }

    /// A coordinator for a workflow or a loop: the parent of its children.
    /// Held as a handle: a caller that stops waiting (its future dropped)
    /// disposes it, and every child with it.
    async fn coordinator(&self, label: &str) -> Result<AgentHandle, FlowError> {
        let mut spec = self.spec();
        spec.label = Some(label.into());
        let agent = Agent::create(&self.0.rt.root(), spec)
            .await
            .map_err(|e| FlowError::new("CREATE", format!("the coordinator: {}", chain(&e))))?;
        Ok(AgentHandle::new(agent, self.0.turn_timeout))
    }
}

/// What one turn answered.
#[derive(Clone, Debug, PartialEq)]
pub struct Answer {
    /// The final assistant text.
    pub text: String,
    /// Model calls the turn took.
    pub steps: u32,
    /// Why it ended: `Completed`, or `MaxTokens` (the text was cut at the
    /// output ceiling); the other ends are errors.
    pub reason: TurnEndReason,
    /// The agent's session id (in the store, when there is one).
    pub session: String,
}

impl Answer {
    fn of(turn: TurnSummary, session: &str) -> Result<Answer, RunError> {
        let failed = match &turn.reason {
            TurnEndReason::Completed | TurnEndReason::MaxTokens => None,
            TurnEndReason::Aborted { reason } => Some(RunError::new(
                "CANCELLED",
                format!("the turn was cancelled ({reason})"),
            )),
            TurnEndReason::Blocked => Some(RunError::new("BLOCKED", "a policy blocked the turn")),
            TurnEndReason::Interrupted => {
                Some(RunError::new("INTERRUPTED", "the turn was interrupted"))
            }
            TurnEndReason::Error { error } => {
                let e = RunError::new(error.code.clone(), error.message.clone());
                Some(if error.retryable() { e.retryable() } else { e })
            }
        };
        match failed {
            Some(e) => Err(e),
            None => Ok(Answer {
                text: turn.text,
                steps: turn.steps,
                reason: turn.reason,
                session: session.to_owned(),
            }),
        }
    }
}

/// The error of an agent call that did not reach the model.
fn agent_error(e: &dsh_actors::agent::AgentError) -> RunError {
    use dsh_actors::agent::AgentError as E;
    match e {
        E::Timeout { .. } => RunError::new("TIMEOUT", chain(e).to_string()).retryable(),
        E::Closed(_) | E::Abandoned { .. } => RunError::new("CLOSED", chain(e).to_string()),
        E::Store(_) => RunError::new("BUSY", chain(e).to_string()).retryable(),
        // The owner is unloading: the runtime shuts down.
        E::Kernel(_) => RunError::new("CLOSED", chain(e).to_string()),
        _ => RunError::new("CREATE", chain(e).to_string()),
    }
}

/// One agent's options; [`run`](AgentBuilder::run) or
/// [`spawn`](AgentBuilder::spawn) makes it.
pub struct AgentBuilder {
    dsh: Dsh,
    system: Option<String>,
    tools: Option<Vec<String>>,
    definition: Option<String>,
    model: Option<String>,
    timeout: Duration,
    label: Option<String>,
    own_tools: Vec<CustomTool>,
    max_turns: Option<u32>,
    max_tokens: Option<u64>,
}

impl AgentBuilder {
    /// Its system prompt (default: a short one for a coding agent in the
    /// workspace).
    pub fn system(mut self, prompt: impl Into<String>) -> Self {
        self.system = Some(prompt.into());
        self
    }

    /// The only tools it may call, by name (default: every registered
    /// tool the policy allows).
    pub fn tools<S: Into<String>>(mut self, names: impl IntoIterator<Item = S>) -> Self {
        self.tools = Some(names.into_iter().map(Into::into).collect());
        self
    }

    /// Made from the named agent definition (`.dsh/agents/NAME.md` in the
    /// workspace, or `~/.dsh/agents`): its prompt, tools, model and limits.
    pub fn definition(mut self, name: impl Into<String>) -> Self {
        self.definition = Some(name.into());
        self
    }

    /// Another model id on the runtime's route.
    pub fn model(mut self, id: impl Into<String>) -> Self {
        self.model = Some(id.into());
        self
    }

    /// How long one turn may take (default: the builder's
    /// [`turn_timeout`](DshBuilder::turn_timeout)).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// A tool written in Rust ([`CustomTool`]) this agent alone may call
    /// (it shadows a global tool of the same name). With
    /// [`tools`](AgentBuilder::tools), name it there too.
    pub fn tool(mut self, tool: CustomTool) -> Self {
        self.own_tools.push(tool);
        self
    }

    /// At most `n` turns over its life; the next ends `BUDGET_EXHAUSTED`
    /// before it calls the model.
    pub fn max_turns(mut self, n: u32) -> Self {
        self.max_turns = Some(n);
        self
    }

    /// At most `n` tokens (input and output), its own children's
    /// included; checked before every model call, past it the turn ends
    /// `BUDGET_EXHAUSTED`.
    pub fn max_tokens(mut self, n: u64) -> Self {
        self.max_tokens = Some(n);
        self
    }

    /// Its name in the tree and the dashboard.
    pub fn label(mut self, label: impl Into<String>) -> Self {
        self.label = Some(label.into());
        self
    }

    /// Makes the agent, runs `prompt` as one turn, disposes the agent, and
    /// returns the answer. The agent is disposed however the turn ends.
    pub async fn run(self, prompt: &str) -> Result<Answer, RunError> {
        let agent = self.spawn().await?;
        let answer = agent.run(prompt).await;
        agent.dispose().await;
        answer
    }

    /// Makes a resident agent: it stays, with its conversation, until
    /// [`AgentHandle::dispose`] or [`Dsh::shutdown`].
    pub async fn spawn(self) -> Result<AgentHandle, RunError> {
        let inner = &self.dsh.0;
        let root = inner.rt.root();
        let mut spec = self.dsh.spec();
        if let Some(model) = &self.model {
            spec.model = model.clone();
        }
        spec.system = Some(match &self.system {
            Some(s) => s.clone(),
            None => default_system(&inner.workspace, &spec.model),
        });
        spec.label = self.label.clone();
        if let Some(name) = &self.definition {
            let Some(definition) = inner.definitions.found.get(name.as_str()) else {
                let mut known: Vec<&str> =
                    inner.definitions.found.keys().map(|k| k.as_str()).collect();
                known.sort_unstable();
                return Err(RunError::new(
                    "CREATE",
                    format!(
                        "no agent definition `{name}` (found: {})",
                        if known.is_empty() {
                            "none".into()
                        } else {
                            known.join(", ")
                        }
                    ),
                ));
            };
            dsh_actors::subagent::define_top_level(&root, &mut spec, definition);
            // What the builder says wins over the definition.
            if let Some(system) = &self.system {
                spec.system = Some(system.clone());
            }
            if let Some(model) = &self.model {
                spec.model = model.clone();
            }
            if self.label.is_some() {
                spec.label = self.label.clone();
            }
        }
        if let Some(names) = &self.tools {
            spec.restriction = Some(dsh_services::tools::Restriction {
                allow: Some(names.clone()),
                deny: Vec::new(),
            });
        }
        if let Some(bad) = self.own_tools.iter().find(|t| !valid_name(t.name())) {
            return Err(RunError::new("CREATE", bad_name(bad.name())));
        }
        if self.max_turns.is_some() || self.max_tokens.is_some() {
            // Within a definition's limits, when it has them.
            spec.limits = Some(dsh_actors::agent::Limits::new(
                "the agent's limits",
                spec.limits.as_ref(),
                self.max_turns,
                self.max_tokens,
                None,
            ));
        }
        // Its own tools are registered each time it is built, so they
        // outlive a hibernation.
        spec.tools =
            dsh_actors::agent::OwnTools(self.own_tools.iter().map(CustomTool::tool).collect());
        let agent = Agent::create(&root, spec)
            .await
            .map_err(|e| agent_error(&e))?;
        Ok(AgentHandle::new(agent, self.timeout))
    }
}

/// What a tool name that a model could not call is told.
fn bad_name(name: &str) -> String {
    format!(
        "the tool name {name:?} is not 1 to 64 letters, digits, `_` or `-` (what a model may call)"
    )
}

/// The system prompt an agent gets when none is given.
fn default_system(cwd: &Path, model: &str) -> String {
    format!(
        "You are an agent in a service built on dsh. You work in a workspace with the tools you are given: inspect before you change, do what the task asks and no more, and answer briefly and concretely.\n\n# Environment\nWorking directory (the workspace): {}\nModel: {model}",
        cwd.display()
    )
}

/// A resident agent. Dropping the handle disposes the agent (in a task
/// child of the runtime, so a dropped stream or an abandoned request never
/// leaves one behind); [`dispose`](AgentHandle::dispose) does it and waits,
/// [`detach`](AgentHandle::detach) keeps it resident without a handle.
pub struct AgentHandle {
    agent: Agent,
    timeout: Duration,
    /// Whether dropping the handle disposes the agent.
    owned: bool,
    /// The session observers of its live [`Events`] streams, removed when
    /// the agent is disposed (which ends the streams).
    streams: Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
    /// Held by a [`run`](AgentHandle::run) while it waits: runs through
    /// one handle take turns.
    running: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for AgentHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentHandle")
            .field("id", &self.agent.id())
            .field("owned", &self.owned)
            .finish_non_exhaustive()
    }
}

impl AgentHandle {
    /// A handle owning `agent`, whose turns may take `timeout`.
    fn new(agent: Agent, timeout: Duration) -> AgentHandle {
        let streams: Arc<std::sync::Mutex<std::collections::HashSet<u64>>> = Arc::default();
        // Disposed: every live stream's observer (and the sender it holds)
        // goes, so the streams end. One hook per agent, however many
        // streams come and go.
        let (session, live) = (agent.session().clone(), streams.clone());
        agent.on_disposed(move || {
            let ids = std::mem::take(&mut *live.lock().unwrap_or_else(|p| p.into_inner()));
            for id in ids {
                session.unobserve(id);
            }
        });
        AgentHandle {
            agent,
            timeout,
            owned: true,
            streams,
            running: tokio::sync::Mutex::new(()),
        }
    }

    /// Its id (its session's id too).
    pub fn id(&self) -> &str {
        self.agent.id()
    }

    /// Runs `prompt` as its next turn (after any queued) and waits for the
    /// answer, up to the agent's timeout.
    ///
    /// A turn that outlives the timeout is cancelled (it ends `aborted`)
    /// and the call fails `TIMEOUT`: trying again starts afresh. Runs
    /// through one handle take turns (a second waits for the first's
    /// answer, then sends its prompt), so each gets its own answer; the
    /// answer is the agent's last turn once it is idle, so what
    /// [`send`](AgentHandle::send) queues meanwhile may take its place.
    pub async fn run(&self, prompt: &str) -> Result<Answer, RunError> {
        let _turn = self.running.lock().await;
        let turn = match self.agent.run(prompt, self.timeout).await {
            Ok(turn) => turn,
            Err(e) => {
                if matches!(e, dsh_actors::agent::AgentError::Timeout { .. }) {
                    self.agent.cancel();
                }
                return Err(agent_error(&e));
            }
        };
        Answer::of(turn, self.agent.id())
    }

    /// Queues `prompt` as a turn of its own and returns at once; follow it
    /// with [`events`](AgentHandle::events).
    pub fn send(&self, prompt: &str) -> Result<(), RunError> {
        self.agent
            .followup(Message::user_text(prompt))
            .map_err(|e| agent_error(&e))
    }

    /// Adds `text` to the running turn (its next model call reads it), or
    /// starts a turn when none runs.
    pub fn steer(&self, text: &str) -> Result<(), RunError> {
        self.agent
            .steer(Message::user_text(text))
            .map_err(|e| agent_error(&e))
    }

    /// Cancels the running turn (it ends `aborted`), or the queued one;
    /// whether there was one to cancel.
    pub fn cancel(&self) -> bool {
        matches!(
            self.agent.cancel(),
            dsh_actors::agent::Cancelled::Running | dsh_actors::agent::Cancelled::Queued
        )
    }

    /// Waits until no turn runs and nothing is queued, up to the agent's
    /// timeout.
    pub async fn idle(&self) -> Result<(), RunError> {
        self.agent
            .when_idle(self.timeout)
            .await
            .map_err(|e| agent_error(&e))
    }

    /// Its session's events from now on, as they are appended; the stream
    /// ends when the agent is disposed. Dropping the stream stops it.
    pub fn events(&self) -> Events {
        let (tx, rx) = mpsc::unbounded_channel();
        let session = self.agent.session().clone();
        let id = session.observe(Arc::new(move |e: &Arc<SessionEvent>| {
            let _ = tx.send(e.clone());
        }));
        let streams = self.streams.clone();
        streams.lock().unwrap_or_else(|p| p.into_inner()).insert(id);
        // Already gone: nothing will end the stream but its own observer's
        // removal.
        if self.agent.status() == dsh_supervisors::tree::Status::Disposed {
            session.unobserve(id);
        }
        Events {
            rx,
            session,
            id,
            streams,
        }
    }

    /// The agent underneath, for what the front door does not cover.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Ordered teardown of the agent and everything it owns; its session
    /// is flushed first.
    pub async fn dispose(mut self) {
        let _ = self.agent.session().flush().await;
        self.agent.dispose().await;
        // Only now: a dispose dropped part-way leaves the rest to `Drop`
        // (concurrent disposals share one teardown).
        self.owned = false;
    }

    /// Lets the handle go and keeps the agent resident (until
    /// [`Dsh::shutdown`], or its own `dispose`).
    pub fn detach(mut self) -> Agent {
        self.owned = false;
        self.agent.clone()
    }
}

impl Drop for AgentHandle {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        if tokio::runtime::Handle::try_current().is_err() {
            // No runtime to dispose it on: it stays until the shutdown.
            tracing::warn!(
                agent = %self.agent.id(),
                "an AgentHandle was dropped outside a tokio runtime; its agent stays until Dsh::shutdown"
            );
            return;
        }
        let agent = self.agent.clone();
        let spec = dsh_supervisors::TaskSpec::new("embed", format!("dispose/{}", agent.id()));
        // Refused only while the runtime shuts down, which disposes it.
        let _ = self
            .agent
            .owner()
            .spawn_task(spec, move |_| async move { agent.dispose().await });
    }
}

/// An agent's session events, as a [`futures::Stream`].
pub struct Events {
    rx: mpsc::UnboundedReceiver<Arc<SessionEvent>>,
    session: SessionHandle,
    id: u64,
    streams: Arc<std::sync::Mutex<std::collections::HashSet<u64>>>,
}

impl Events {
    /// The next event; `None` once the agent is disposed.
    pub async fn next(&mut self) -> Option<Arc<SessionEvent>> {
        self.rx.recv().await
    }

    /// Events until the end of the current turn (its `turn_end`
    /// included).
    pub async fn until_turn_end(&mut self) -> Vec<Arc<SessionEvent>> {
        let mut out = Vec::new();
        while let Some(e) = self.rx.recv().await {
            let end = matches!(e.data, EventData::TurnEnd { .. });
            out.push(e);
            if end {
                break;
            }
        }
        out
    }
}

impl futures::Stream for Events {
    type Item = Arc<SessionEvent>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.streams
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
        self.session.unobserve(self.id);
    }
}

/// A workflow run's options; [`run`](WorkflowBuilder::run) runs it.
pub struct WorkflowBuilder {
    dsh: Dsh,
    script: String,
    meta: Value,
    args: Value,
    max_parallel: Option<usize>,
    max_agents: Option<u32>,
}

/// What a workflow returned.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkflowOutput {
    /// The script's return value (`null` for none).
    pub value: Value,
    /// `agent()` calls the run accepted.
    pub agents_started: u32,
    /// The coordinator's session id (its children's sessions name it as
    /// their parent).
    pub session: String,
}

impl WorkflowBuilder {
    /// The script's `args` global.
    pub fn args(mut self, args: Value) -> Self {
        self.args = args;
        self
    }

    /// Its name (the meta block's `name`, short kebab-case; default
    /// `workflow`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        if let Some(meta) = self.meta.as_object_mut() {
            meta.insert("name".into(), Value::String(name.into()));
        }
        self
    }

    /// What it does, in one line (the meta block's `description`).
    pub fn description(mut self, text: impl Into<String>) -> Self {
        if let Some(meta) = self.meta.as_object_mut() {
            meta.insert("description".into(), Value::String(text.into()));
        }
        self
    }

    /// The whole meta block (`name`, `description`, `when_to_use`,
    /// `phases`), instead of [`name`](WorkflowBuilder::name) and
    /// [`description`](WorkflowBuilder::description).
    pub fn meta(mut self, meta: Value) -> Self {
        self.meta = meta;
        self
    }

    /// Children running at once, at most.
    pub fn max_parallel(mut self, n: usize) -> Self {
        self.max_parallel = Some(n);
        self
    }

    /// Children over the whole run, at most.
    pub fn max_agents(mut self, n: u32) -> Self {
        self.max_agents = Some(n);
        self
    }

    /// Runs the script under a coordinator agent of its own (disposed
    /// after, with every child).
    pub async fn run(self) -> Result<WorkflowOutput, FlowError> {
        let root = self.dsh.0.rt.root();
        let engine = root
            .get::<WorkflowEngine>(WorkflowEngine::SERVICE)
            .ok_or_else(|| FlowError::new("CREATE", "no workflow engine is provided"))?;
        let Some(meta) = self.meta.as_object().map(|_| self.meta.clone()) else {
            return Err(FlowError::new(
                "SCRIPT",
                "the meta block must be a JSON object (`name`, `description`, …)",
            ));
        };
        let coordinator = self.dsh.coordinator("workflow coordinator").await?;
        let mut request = WorkflowRequest::new(coordinator.agent(), self.script, meta);
        request.args = self.args;
        request.max_concurrency = self.max_parallel;
        request.max_total_agents = self.max_agents;
        let result = match engine.start(request).await {
            Ok(run) => {
                let result = run.result().await;
                run.dispose().await;
                Ok(result)
            }
            Err(e) => Err(FlowError::new("SCRIPT", chain(&e).to_string())),
        };
        let session = coordinator.id().to_owned();
        coordinator.dispose().await;
        let result = result?;
        match result.stop_reason {
            WorkflowStop::Completed => Ok(WorkflowOutput {
                value: result.value,
                agents_started: result.agents_started,
                session,
            }),
            WorkflowStop::Cancelled => {
                Err(FlowError::new("CANCELLED", "the workflow was cancelled"))
            }
            WorkflowStop::Error => Err(FlowError::new(
                "FAILED",
                result.error.unwrap_or_else(|| "the workflow failed".into()),
            )),
        }
    }
}

/// A Ralph loop's options; [`run`](RalphBuilder::run) runs it.
pub struct RalphBuilder {
    dsh: Dsh,
    objective: String,
    max_rounds: Option<u32>,
    definition: Option<String>,
}

impl RalphBuilder {
    /// Rounds at most (default 20, at most 256).
    pub fn max_rounds(mut self, n: u32) -> Self {
        self.max_rounds = Some(n);
        self
    }

    /// Every round's worker made from this named agent definition.
    pub fn definition(mut self, name: impl Into<String>) -> Self {
        self.definition = Some(name.into());
        self
    }

    /// Runs the loop under a coordinator of its own (disposed after). A
    /// loop that ends complete, at its round cap, blocked or without
    /// progress is `Ok` (its [`RalphResult::outcome`] says which); one that
    /// failed or was cancelled is an error.
    pub async fn run(self) -> Result<RalphResult, FlowError> {
        if let Some(n) = self.max_rounds
            && (n == 0 || n > ralph::MAX_ROUNDS)
        {
            return Err(FlowError::new(
                "SCRIPT",
                format!("max_rounds must be 1..={}", ralph::MAX_ROUNDS),
            ));
        }
        let coordinator = self.dsh.coordinator("ralph").await?;
        let mut request = RalphRequest::new(coordinator.agent(), self.objective);
        request.max_rounds = self.max_rounds;
        request.agent = self.definition;
        let result = ralph::run(&self.dsh.0.subagents, request, None).await;
        coordinator.dispose().await;
        let result = result.map_err(|e| FlowError::new("SCRIPT", chain(&e).to_string()))?;
        match &result.outcome {
            RalphOutcome::Failed { .. } => Err(FlowError::new("FAILED", result.outcome.describe())),
            RalphOutcome::Cancelled { .. } => {
                Err(FlowError::new("CANCELLED", result.outcome.describe()))
            }
            _ => Ok(result),
        }
    }
}
