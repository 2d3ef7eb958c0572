//! The `agent-services` plugin: what every agent runs on (tools, sandbox,
//! approval, prompt, agents registry, multi-agent services).

use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agents, Hibernation};
use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::LlmRuntime;
use dsh_services::prompt::{PromptSection, SystemPrompt, Text};
use dsh_services::providers::openai::RetryListener;
use dsh_services::sandbox::{BackendChoice, PermissionMode, Policy, Sandbox, Settings};
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::{BoxError, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

use super::tools::AcpSubagentConfig;

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
    /// How deep delegation may go (default 3; 0 forbids it; at most 16);
    /// `--max-depth` on the command line wins.
    #[serde(default)]
    #[schemars(range(max = 16))]
    pub max_depth: Option<u32>,
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
        if let Some(max) = config.max_depth.filter(|m| *m > 16) {
            return Err(format!("`max_depth`: {max} is deeper than 16, the most allowed").into());
        }
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
        let choice = super::tools::Choice {
            builtin: config.builtin_tools.unwrap_or(true),
            multi_agent: config.multi_agent.unwrap_or(true),
            max_depth: config.max_depth,
            web_fetch: config.web_fetch_settings(),
            acp: &config.acp_subagents,
        };
        super::tools::install(&ctx, &tools, choice)?;
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
