//! The default plugin catalogue: every plugin a `cordis.yml` may name.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agents, Hibernation};
use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::LlmRuntime;
use dsh_services::llm::openai::{
    Dialect, ModelEntry, OpenAiCompatible, OpenAiConfig, ReasoningEffort, RetryListener,
};
use dsh_services::llm::scripted::ScriptedModel;
use dsh_services::prompt::{PromptSection, SystemPrompt, Text};
use dsh_services::sandbox::{BackendChoice, PermissionMode, Policy, Sandbox, Settings};
use dsh_services::tools::ToolRegistry;
use dsh_services::tools::builtin::register_builtin;
use dsh_supervisors::{BoxError, Catalogue, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

/// Config of the `value` plugin.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ValueConfig {
    /// The capability name to provide (e.g. `settings`).
    pub service: String,
    /// The JSON value consumers get.
    #[serde(default)]
    pub value: serde_json::Value,
}

/// Provides a constant JSON value as a service: shared settings that other
/// plugins inject by name.
pub struct Value;

impl Plugin for Value {
    type Config = ValueConfig;

    fn name(&self) -> &str {
        "value"
    }

    async fn apply(&self, ctx: Context, config: Arc<ValueConfig>) -> Result<(), BoxError> {
        if config.service.trim().is_empty() {
            return Err("`service` must name a capability".into());
        }
        ctx.provide(&config.service, Arc::new(config.value.clone()))?;
        Ok(())
    }
}

/// The catalogue `dsh` boots `cordis.yml` against.
pub fn default_catalogue() -> Catalogue {
    let mut c = Catalogue::new();
    c.register("value", || Value);
    c.register("agent-services", || AgentServices);
    c.register("openai", || OpenAi);
    c.register("deepseek", || DeepSeek);
    c.register("scripted", || Scripted);
    c.register("prompt-section", || PromptSectionPlugin);
    c.register("session-store", || SessionStore);
    c.register("web", || crate::web::Web);
    c.register("mcp", || Mcp);
    c.register("hooks", || HooksPlugin);
    c
}

/// Config of the `hooks` plugin: which settings files to read.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HooksConfig {
    /// Claude Code settings files (or `hooks.json` files) with a `hooks`
    /// key, in order (default: `.claude/settings.json`,
    /// `.claude/settings.local.json`, `~/.claude/settings.json`).
    #[serde(default)]
    pub claude_code: Option<Vec<PathBuf>>,
    /// Codex `hooks.json` files, in order (default: `.codex/hooks.json`,
    /// `~/.codex/hooks.json`).
    #[serde(default)]
    pub codex: Option<Vec<PathBuf>>,
    /// A hook's timeout when it names none, in milliseconds (default 600000).
    #[serde(default)]
    pub default_timeout_ms: Option<u64>,
    /// The most of a hook's stderr a `hook/result` record keeps, in
    /// characters (default 500).
    #[serde(default)]
    pub stderr_summary_max_chars: Option<usize>,
}

/// Runs the hooks of users' Claude Code and Codex settings at prompt
/// submit, around tool calls and at stop. A file that cannot be read or
/// parsed is reported on stderr and contributes no hooks.
pub struct HooksPlugin;

impl Plugin for HooksPlugin {
    type Config = HooksConfig;

    fn name(&self) -> &str {
        "hooks"
    }

    async fn apply(&self, ctx: Context, config: Arc<HooksConfig>) -> Result<(), BoxError> {
        use dsh_actors::hooks::{Dialect, Hooks, HooksSettings, default_paths, install, load};
        let mut files = Vec::new();
        for (dialect, listed) in [
            (Dialect::Claude, &config.claude_code),
            (Dialect::Codex, &config.codex),
        ] {
            let paths = listed.clone().unwrap_or_else(|| default_paths(dialect));
            files.extend(paths.into_iter().map(|p| (dialect, p)));
        }
        let (sets, problems) = load(&files).await;
        for p in &problems {
            tracing::warn!("hooks: {p}");
            crate::errln!("dsh: hooks: {p}; that file's hooks are not run");
        }
        if sets.is_empty() {
            return Ok(());
        }
        let mut settings = HooksSettings::default();
        if let Some(ms) = config.default_timeout_ms.filter(|ms| *ms > 0) {
            settings.default_timeout = Duration::from_millis(ms);
        }
        if let Some(n) = config.stderr_summary_max_chars {
            settings.stderr_summary_max_chars = n;
        }
        install(&ctx, Arc::new(Hooks::new(sets, settings)))?;
        Ok(())
    }
}

/// Config of the `mcp` plugin: one MCP server, checked where it is read
/// (a field of the wrong transport, a bad name, URL or header is refused
/// with the entry and line named).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(try_from = "dsh_services::mcp::ServerConfig")]
#[schemars(with = "dsh_services::mcp::ServerConfig")]
pub struct McpConfig(pub dsh_services::mcp::ServerConfig);

impl TryFrom<dsh_services::mcp::ServerConfig> for McpConfig {
    type Error = String;

    fn try_from(c: dsh_services::mcp::ServerConfig) -> Result<McpConfig, String> {
        c.spec(Policy::default()).map_err(|e| e.to_string())?;
        Ok(McpConfig(c))
    }
}

/// One MCP server: a supervised actor whose tools are registered, for every
/// agent, as `mcp__<server>__<tool>` while it is up.
pub struct Mcp;

impl Plugin for Mcp {
    type Config = McpConfig;

    fn name(&self) -> &str {
        "mcp"
    }

    fn inject(&self) -> &[&'static str] {
        &[ToolRegistry::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<McpConfig>) -> Result<(), BoxError> {
        let defaults = ctx
            .get::<Sandbox>(Sandbox::SERVICE)
            .unwrap_or_else(Sandbox::host)
            .defaults();
        let spec = config.0.spec(defaults)?;
        let server = dsh_services::mcp::start(&ctx, spec).await?;
        let status = server.status();
        if status.connections == 0 {
            crate::errln!(
                "dsh: MCP server {} did not connect ({}); it keeps trying",
                status.name,
                status.error.as_deref().unwrap_or("no answer yet")
            );
        }
        // Its status leaves `dsh mcp list` with the entry.
        ctx.effect("mcp server status", move || drop(server))?;
        Ok(())
    }
}

/// Config of the `session-store` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionStoreConfig {
    /// `jsonl` (one directory per session) or `sqlite` (one database).
    pub backend: BackendName,
    /// The sessions directory (jsonl) or the database file (sqlite).
    /// Required: a default would follow the process's working directory.
    pub path: PathBuf,
    /// JSONL only: `none` (default) or `zstd`.
    #[serde(default)]
    pub compression: Option<CompressionName>,
}

/// A session store backend.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendName {
    /// JSONL files.
    Jsonl,
    /// One SQLite database.
    Sqlite,
}

/// Encoding of JSONL transcripts.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CompressionName {
    /// Plain newline-delimited text.
    None,
    /// Zstandard frames.
    Zstd,
}

/// Provides the session store (`persistence`): agents created in its scope
/// without a store of their own write their sessions there.
pub struct SessionStore;

impl Plugin for SessionStore {
    type Config = SessionStoreConfig;

    fn name(&self) -> &str {
        "session-store"
    }

    async fn apply(&self, ctx: Context, config: Arc<SessionStoreConfig>) -> Result<(), BoxError> {
        use dsh_services::persistence::{
            Compression, JsonlStore, PERSISTENCE_SERVICE, SessionPersistence, SqliteStore,
        };
        let store: Arc<dyn SessionPersistence> = match (config.backend, config.compression) {
            (BackendName::Jsonl, compression) => Arc::new(
                JsonlStore::new(&config.path).with_compression(match compression {
                    Some(CompressionName::Zstd) => Compression::Zstd,
                    _ => Compression::None,
                }),
            ),
            (BackendName::Sqlite, Some(CompressionName::Zstd)) => {
                return Err("`compression: zstd` applies to the jsonl backend only".into());
            }
            (BackendName::Sqlite, _) => {
                let path = config.path.clone();
                // Opening creates the schema: file I/O, off the workers.
                Arc::new(tokio::task::spawn_blocking(move || SqliteStore::open(path)).await??)
            }
        };
        ctx.provide(PERSISTENCE_SERVICE, store)?;
        Ok(())
    }
}

/// Config of the `agent-services` plugin.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AgentServicesConfig {
    /// Policy for actions that ask for approval (default `ask`; with no
    /// answerer, asks fail closed).
    #[serde(default)]
    pub approval: Option<ApprovalPolicy>,
    /// Register the built-in tools (default true).
    #[serde(default)]
    pub builtin_tools: Option<bool>,
    /// Retry of model requests refused before the first chunk.
    #[serde(default)]
    pub retry: Option<RetryConfig>,
    /// Provide subagents, workflows and Ralph loops with their tools
    /// (default true).
    #[serde(default)]
    pub multi_agent: Option<bool>,
    /// Subagents that are other ACP agent processes (`dsh acp`, or any ACP
    /// agent), each a provider with its own `subagent_<name>` tool.
    #[serde(default)]
    pub acp_subagents: Vec<AcpSubagentConfig>,
    /// When idle agents hibernate (default: after 5 minutes idle, no cap on
    /// awake agents).
    #[serde(default)]
    pub hibernate: Option<Hibernation>,
    /// What agents' tools may change without asking: `read-only`,
    /// `workspace-write` (default) or `danger-full-access`.
    #[serde(default)]
    pub permission_mode: Option<PermissionMode>,
    /// Whether agents' commands reach the network (default true).
    #[serde(default)]
    pub network: Option<bool>,
    /// What confines commands: `auto` (default: bwrap, else Landlock),
    /// `bwrap` or `landlock`.
    #[serde(default)]
    pub sandbox: Option<BackendChoice>,
    /// Variables tool processes see although they hold secrets.
    #[serde(default)]
    pub pass_env: Vec<String>,
    /// Background jobs one agent may have running at once (default 8).
    #[serde(default)]
    pub max_jobs: Option<usize>,
    /// What `web_fetch` may reach.
    #[serde(default)]
    pub web_fetch: Option<WebFetchConfig>,
    /// A plain-text tool result longer than this many bytes is kept whole
    /// under `~/.dsh/spill` and the model reads its head and tail with the
    /// file's path (default 40000; 0 keeps every result inline).
    #[serde(default)]
    pub spill_max_inline_bytes: Option<usize>,
}

/// One `acp_subagents` entry of `agent-services`.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct AcpSubagentConfig {
    /// The provider's name (default `acp`); its tool is `subagent_<name>`.
    #[serde(default = "default_acp_name")]
    pub name: String,
    /// The agent's executable, started for each run in the parent's cwd.
    pub command: std::path::PathBuf,
    /// Its arguments (for dsh: `["acp", ...]` with a model).
    #[serde(default)]
    pub args: Vec<String>,
    /// Variables set for it (beside the parent's permission mode).
    #[serde(default)]
    pub env: std::collections::BTreeMap<String, String>,
}

fn default_acp_name() -> String {
    "acp".into()
}

/// The `web_fetch` entry of `agent-services`.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WebFetchConfig {
    /// Hosts on this machine or a private network that may be fetched
    /// anyway (as written in URLs: `127.0.0.1`, `wiki.internal`).
    #[serde(default)]
    pub allow_private_hosts: Vec<String>,
    /// The longest a fetch may take, in seconds (default 30).
    #[serde(default)]
    pub timeout_s: Option<u64>,
    /// The largest body fetched, in bytes (default 5 MiB).
    #[serde(default)]
    pub max_bytes: Option<usize>,
}

impl AgentServicesConfig {
    /// What this entry lets `web_fetch` do.
    pub fn web_fetch_settings(&self) -> dsh_services::tools::builtin::WebFetchSettings {
        let defaults = dsh_services::tools::builtin::WebFetchSettings::default();
        let Some(c) = &self.web_fetch else {
            return defaults;
        };
        dsh_services::tools::builtin::WebFetchSettings {
            allow_private_hosts: c.allow_private_hosts.clone(),
            timeout: c
                .timeout_s
                .map_or(defaults.timeout, |s| Duration::from_secs(s.max(1))),
            max_bytes: c.max_bytes.unwrap_or(defaults.max_bytes).max(1),
            ..defaults
        }
    }

    /// The background-job limits this entry gives.
    pub fn job_limits(&self) -> dsh_services::jobs::JobLimits {
        let defaults = dsh_services::jobs::JobLimits::default();
        dsh_services::jobs::JobLimits {
            max_running: self.max_jobs.unwrap_or(defaults.max_running).max(1),
            ..defaults
        }
    }

    /// The sandbox settings this entry gives.
    pub fn sandbox_settings(&self) -> Settings {
        Settings {
            defaults: Policy {
                mode: self.permission_mode.unwrap_or_default(),
                network: self.network.unwrap_or(true),
            },
            backend: self.sandbox.unwrap_or_default(),
            pass_env: self.pass_env.clone(),
            bwrap: None,
        }
    }
}

/// Idle time after which an agent hibernates unless configured otherwise.
pub const DEFAULT_IDLE_MS: u64 = 300_000;

/// Backoff of the `llm/stream` retry listener.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryConfig {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// First backoff, in milliseconds.
    #[serde(default = "default_initial_ms")]
    pub initial_ms: u64,
    /// Backoff ceiling, in milliseconds.
    #[serde(default = "default_max_ms")]
    pub max_ms: u64,
}

fn default_initial_ms() -> u64 {
    500
}

fn default_max_ms() -> u64 {
    20_000
}

/// Provides what agents need: `llm`, `tools` (with the built-in tools),
/// `approval`, `sandbox`, `agents` and `systemPrompt`, and the retry
/// listener; and,
/// unless `multi_agent: false`, `subagents` and `workflow-engine` with the
/// `subagent`, `subagent_fork`, `send_message`, `interrupt_agent`,
/// `list_agents`, `workflow` and `ralph` tools.
pub struct AgentServices;

impl Plugin for AgentServices {
    type Config = AgentServicesConfig;

    fn name(&self) -> &str {
        "agent-services"
    }

    async fn apply(&self, ctx: Context, config: Arc<AgentServicesConfig>) -> Result<(), BoxError> {
        let tools = Arc::new(ToolRegistry::new());
        ctx.provide(LlmRuntime::SERVICE, Arc::new(LlmRuntime::new()))?;
        ctx.provide(ToolRegistry::SERVICE, tools.clone())?;
        ctx.provide(
            dsh_services::mcp::McpServers::SERVICE,
            Arc::new(dsh_services::mcp::McpServers::new()),
        )?;
        ctx.provide(
            Approval::SERVICE,
            Arc::new(Approval::new(
                config.approval.unwrap_or(ApprovalPolicy::Ask),
            )),
        )?;
        let hibernation = config.hibernate.clone().unwrap_or(Hibernation {
            idle_ms: Some(DEFAULT_IDLE_MS),
            max_awake: None,
        });
        let agents = Agents::start(&ctx, hibernation).await?;
        ctx.provide(Agents::SERVICE, agents.clone())?;
        let prompt = Arc::new(SystemPrompt::new());
        ctx.provide(SystemPrompt::SERVICE, prompt.clone())?;
        // What the tools an agent sees say about using them, and what the
        // sandbox means for the model: sections after the persona.
        prompt.section(&ctx, dsh_services::tools::guidance::section(tools.clone()))?;
        prompt.section(
            &ctx,
            PromptSection {
                name: "sandbox".into(),
                order: 150,
                text: Text::Static(format!(
                    "# Sandbox\n{}",
                    dsh_services::sandbox::PROMPT_GUIDANCE
                )),
                complete: false,
            },
        )?;
        ctx.provide(
            Sandbox::SERVICE,
            Arc::new(Sandbox::new(config.sandbox_settings())),
        )?;
        ctx.provide(
            dsh_services::attachments::Attachments::SERVICE,
            Arc::new(dsh_services::attachments::Attachments::new(
                crate::home::dir().join("attachments"),
            )),
        )?;
        ctx.provide(
            dsh_services::jobs::Jobs::SERVICE,
            Arc::new(dsh_services::jobs::Jobs::new(config.job_limits())),
        )?;
        let spill = config
            .spill_max_inline_bytes
            .unwrap_or(dsh_services::tools::SpillStore::DEFAULT_MAX_INLINE);
        if spill > 0 {
            ctx.provide(
                dsh_services::tools::SpillStore::SERVICE,
                Arc::new(dsh_services::tools::SpillStore::new(
                    crate::home::dir().join("spill"),
                    spill,
                )),
            )?;
        }
        if config.builtin_tools.unwrap_or(true) {
            register_builtin(&ctx, &tools)?;
            tools.register(
                &ctx,
                Arc::new(dsh_services::tools::builtin::SkillTool::new(Some(
                    crate::home::dir(),
                ))),
            )?;
            tools.register(
                &ctx,
                Arc::new(dsh_services::tools::builtin::WebFetch::new(
                    config.web_fetch_settings(),
                )),
            )?;
        }
        if config.multi_agent.unwrap_or(true) {
            let subagents = dsh_actors::multi_agent::install(
                &ctx,
                &tools,
                &dsh_actors::multi_agent::MultiAgentConfig::default(),
            )?;
            for acp in &config.acp_subagents {
                use dsh_actors::subagent::tools::{SubagentTool, SubagentToolConfig};
                let provider = dsh_actors::subagent::acp::AcpProvider::new(
                    acp.name.clone(),
                    acp.command.clone(),
                    acp.args.clone(),
                    acp.env.clone().into_iter().collect(),
                );
                subagents.register(&ctx, Arc::new(provider))?;
                let mut tool =
                    SubagentToolConfig::new(&acp.name, &format!("subagent_{}", acp.name));
                // A remote child lives in its process: no resident children.
                tool.background = false;
                tools.register(&ctx, Arc::new(SubagentTool::new(subagents.clone(), tool)?))?;
            }
        }
        let retry = match &config.retry {
            Some(r) => RetryListener {
                max_retries: r.max_retries,
                initial: Duration::from_millis(r.initial_ms),
                max: Duration::from_millis(r.max_ms.max(r.initial_ms)),
            },
            None => RetryListener::default(),
        };
        retry.install(&ctx)?;
        // Stopped (or reloaded), the plugin takes its agents with it, last
        // created first, before its services go: an agent without them
        // could only fail.
        ctx.on_teardown("dispose the agents", move || async move {
            for agent in agents.in_creation_order().into_iter().rev() {
                agent.dispose().await;
            }
        })?;
        Ok(())
    }
}

/// Config of the `openai` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OpenAiPluginConfig {
    /// Provider route agents name (default `openai`).
    #[serde(default = "default_openai_route")]
    pub provider: String,
    /// Endpoint up to the API version, e.g. `https://api.deepseek.com/v1`.
    pub base_url: String,
    /// Environment variable holding the API key (default `DSH_API_KEY`); the
    /// key itself never appears in a config file or a log.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Longest silence between stream events, in seconds (default 300).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// Longest wait for the first byte of an answer (headers and first
    /// event), in seconds (default 600: reasoning models think first).
    #[serde(default)]
    pub request_timeout_s: Option<u64>,
    /// Longest a whole model call may take, in seconds (default 3600).
    #[serde(default)]
    pub total_timeout_s: Option<u64>,
    /// The endpoint's models take image input (sent as `image_url` parts;
    /// otherwise images are described in text).
    #[serde(default)]
    pub images: bool,
    /// The models' context window in tokens; agents compact their history
    /// before a request would pass it (unset: never). A `models` entry's
    /// own wins for its model.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Known models and what differs for each (context window, output cap,
    /// images); other model ids pass through with the entry's settings.
    #[serde(default)]
    pub models: Models,
}

/// A checked `models` list: non-empty ids, each listed once, positive
/// sizes (refused where the config is read, with the entry named).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(try_from = "Vec<ModelConfig>")]
#[schemars(with = "Vec<ModelConfig>")]
pub struct Models(pub Vec<ModelEntry>);

impl TryFrom<Vec<ModelConfig>> for Models {
    type Error = String;

    fn try_from(list: Vec<ModelConfig>) -> Result<Models, String> {
        model_catalogue(&list).map(Models)
    }
}

/// One model of a provider entry's `models` list.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The wire `model` id.
    pub id: String,
    /// A display name (default: the id).
    #[serde(default)]
    pub name: Option<String>,
    /// Its context window in tokens.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Its output cap of requests that name none.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Whether it takes image input (default: the entry's `images`).
    #[serde(default)]
    pub images: Option<bool>,
}

/// The adapter's catalogue from a `models` list, each entry checked: a
/// non-empty id listed once, positive sizes.
fn model_catalogue(list: &[ModelConfig]) -> Result<Vec<ModelEntry>, String> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("models[{i}]");
        let id = m.id.trim();
        if id.is_empty() {
            return Err(format!("{at}: `id` is empty"));
        }
        if !seen.insert(id) {
            return Err(format!("{at}: model `{id}` is listed twice"));
        }
        for (field, value) in [
            ("context_window", m.context_window),
            ("max_tokens", m.max_tokens),
        ] {
            if value == Some(0) {
                return Err(format!("{at} (`{id}`): `{field}` must be at least 1"));
            }
        }
        out.push(ModelEntry {
            id: id.to_owned(),
            name: m.name.clone(),
            context_window: m.context_window,
            max_tokens: m.max_tokens,
            images: m.images,
        });
    }
    Ok(out)
}

fn default_openai_route() -> String {
    "openai".into()
}

/// A provider entry's settings beyond its URL and key: timeouts in seconds
/// (`None`: the default), images, the context window.
struct EndpointSettings {
    /// The models take image input.
    images: bool,
    /// Where image bytes are.
    attachments: Option<Arc<dsh_services::attachments::Attachments>>,
    /// The models' context window, in tokens.
    context_window: Option<u64>,
    /// The model catalogue.
    models: Vec<ModelEntry>,
    request_s: Option<u64>,
    idle_s: Option<u64>,
    total_s: Option<u64>,
}

/// The adapter of an OpenAI-compatible endpoint whose key is in `key_env`
/// (withheld from tool processes from now on).
fn endpoint(
    base_url: &str,
    key_env: &str,
    t: EndpointSettings,
    dialect: Dialect,
) -> Result<OpenAiCompatible, BoxError> {
    dsh_services::sandbox::env::register_secret(key_env);
    let secs =
        |s: Option<u64>, default: Duration| s.map_or(default, |s| Duration::from_secs(s.max(1)));
    Ok(OpenAiCompatible::new(OpenAiConfig {
        base_url: base_url.to_owned(),
        api_key: std::env::var(key_env).ok().filter(|k| !k.is_empty()),
        idle_timeout: secs(t.idle_s, OpenAiConfig::IDLE),
        first_byte_timeout: secs(t.request_s, OpenAiConfig::FIRST_BYTE),
        total_timeout: secs(t.total_s, OpenAiConfig::TOTAL),
        dialect,
        user_id: matches!(dialect, Dialect::DeepSeek { .. }).then(crate::home::user_id),
        images: t.images,
        attachments: t.attachments,
        context_window: t.context_window,
        models: t.models,
    })?)
}

/// Registers an OpenAI-compatible streaming adapter under a provider route.
pub struct OpenAi;

impl Plugin for OpenAi {
    type Config = OpenAiPluginConfig;

    fn name(&self) -> &str {
        "openai"
    }

    fn inject(&self) -> &[&'static str] {
        &[LlmRuntime::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<OpenAiPluginConfig>) -> Result<(), BoxError> {
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or("the `llm` service is gone")?;
        let settings = EndpointSettings {
            request_s: config.request_timeout_s,
            idle_s: config.idle_timeout_s,
            total_s: config.total_timeout_s,
            images: config.images,
            attachments: ctx.get(dsh_services::attachments::Attachments::SERVICE),
            context_window: config.context_window,
            models: config.models.0.clone(),
        };
        let key_env = config.api_key_env.as_deref().unwrap_or("DSH_API_KEY");
        let adapter = endpoint(&config.base_url, key_env, settings, Dialect::OpenAi)?;
        llm.register(&ctx, &[config.provider.as_str()], Arc::new(adapter))?;
        Ok(())
    }
}

/// Config of the `deepseek` plugin.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeepSeekPluginConfig {
    /// Provider route agents name (default `deepseek`).
    #[serde(default)]
    pub provider: Option<String>,
    /// Endpoint (default `$DEEPSEEK_BASE_URL`, else the official API).
    #[serde(default)]
    pub base_url: Option<String>,
    /// Environment variable holding the key (default `DEEPSEEK_API_KEY`).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Thinking effort of requests that name none: `off`, `low`, `high`
    /// (default) or `max`.
    #[serde(default)]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// `max_tokens` of requests that name none (default 256000).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Longest wait for the first byte, in seconds (default 600).
    #[serde(default)]
    pub request_timeout_s: Option<u64>,
    /// Longest silence between stream events, in seconds (default 300).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// Longest a whole call may take, in seconds (default 3600).
    #[serde(default)]
    pub total_timeout_s: Option<u64>,
    /// The context window in tokens (default 1,000,000); agents compact
    /// their history before a request would pass it. A `models` entry's
    /// own wins for its model.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Known models (default: V4 Flash, V4 Pro, V4 Flash Vision; a list
    /// replaces them); other model ids pass through.
    #[serde(default)]
    pub models: Option<Models>,
}

/// Registers DeepSeek's chat-completions API (the OpenAI-compatible adapter
/// in DeepSeek's dialect: thinking and effort, reasoning passed back).
pub struct DeepSeek;

impl Plugin for DeepSeek {
    type Config = DeepSeekPluginConfig;

    fn name(&self) -> &str {
        "deepseek"
    }

    fn inject(&self) -> &[&'static str] {
        &[LlmRuntime::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<DeepSeekPluginConfig>) -> Result<(), BoxError> {
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or("the `llm` service is gone")?;
        let base_url = config
            .base_url
            .clone()
            .or_else(|| {
                std::env::var("DEEPSEEK_BASE_URL")
                    .ok()
                    .filter(|u| !u.is_empty())
            })
            .unwrap_or_else(|| dsh_services::llm::openai::DEEPSEEK_BASE_URL.into());
        let settings = EndpointSettings {
            request_s: config.request_timeout_s,
            idle_s: config.idle_timeout_s,
            total_s: config.total_timeout_s,
            images: false,
            attachments: ctx.get(dsh_services::attachments::Attachments::SERVICE),
            context_window: config.context_window,
            models: match &config.models {
                Some(list) => list.0.clone(),
                None => dsh_services::llm::openai::deepseek_models(),
            },
        };
        let dialect = Dialect::DeepSeek {
            effort: config.reasoning_effort.unwrap_or_default(),
            max_tokens: config.max_tokens.unwrap_or(256_000).max(1),
        };
        let key_env = config.api_key_env.as_deref().unwrap_or("DEEPSEEK_API_KEY");
        let adapter = endpoint(&base_url, key_env, settings, dialect)?;
        let route = config.provider.clone().unwrap_or_else(|| "deepseek".into());
        llm.register(&ctx, &[route.as_str()], Arc::new(adapter))?;
        Ok(())
    }
}

/// Config of the `scripted` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScriptedPluginConfig {
    /// Provider route agents name (default `scripted`).
    #[serde(default = "default_scripted_route")]
    pub provider: String,
    /// The script file (`{"steps": [...]}`).
    pub script: PathBuf,
}

fn default_scripted_route() -> String {
    "scripted".into()
}

/// Registers the keyless scripted model under a provider route.
pub struct Scripted;

impl Plugin for Scripted {
    type Config = ScriptedPluginConfig;

    fn name(&self) -> &str {
        "scripted"
    }

    fn inject(&self) -> &[&'static str] {
        &[LlmRuntime::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<ScriptedPluginConfig>) -> Result<(), BoxError> {
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or("the `llm` service is gone")?;
        let path = config.script.clone();
        let text = tokio::fs::read_to_string(&path)
            .await
            .map_err(|e| format!("cannot read the script {}: {e}", path.display()))?;
        let model =
            ScriptedModel::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        llm.register(&ctx, &[config.provider.as_str()], Arc::new(model))?;
        Ok(())
    }
}

/// Config of the `prompt-section` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptSectionConfig {
    /// Section name (a scoped section of the same name shadows it).
    pub name: String,
    /// Ascending order (-100 identity, 0 persona, 100–199 tool guidance).
    #[serde(default)]
    pub order: i32,
    /// The text; may use `{{variables}}`.
    pub text: String,
}

/// Adds a global system prompt section.
pub struct PromptSectionPlugin;

impl Plugin for PromptSectionPlugin {
    type Config = PromptSectionConfig;

    fn name(&self) -> &str {
        "prompt-section"
    }

    fn inject(&self) -> &[&'static str] {
        &[SystemPrompt::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<PromptSectionConfig>) -> Result<(), BoxError> {
        let prompt = ctx
            .get::<SystemPrompt>(SystemPrompt::SERVICE)
            .ok_or("the `systemPrompt` service is gone")?;
        prompt.section(
            &ctx,
            PromptSection {
                name: config.name.clone(),
                order: config.order,
                text: Text::Static(config.text.clone()),
                complete: false,
            },
        )?;
        Ok(())
    }
}
