//! The default plugin catalogue: every plugin a `cordis.yml` may name, one
//! file per kind of thing provided — `models` (providers), `agent_services`
//! (what agents run on), `tool_servers` (MCP), `hooks`, `stores` (sessions),
//! `prompt` (prompt sections); the `web` plugin lives with the API. `tools`
//! lists every built-in tool's registration.

use std::sync::Arc;

use dsh_supervisors::{BoxError, Catalogue, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

mod agent_services;
mod hooks;
mod models;
mod prompt;
mod stores;
mod tool_servers;
mod tools;

pub use agent_services::{AgentServices, AgentServicesConfig, RetryConfig, WebFetchConfig};
pub use hooks::{HooksConfig, HooksPlugin, install_from as install_hooks};
pub use models::{
    DeepSeek, DeepSeekPluginConfig, ModelConfig, Models, OpenAi, OpenAiPluginConfig, Scripted,
    ScriptedPluginConfig,
};
pub use prompt::{PromptSectionConfig, PromptSectionPlugin};
pub use stores::{SessionStore, SessionStoreConfig};
pub use tool_servers::{Mcp, McpConfig};
pub use tools::AcpSubagentConfig;

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
