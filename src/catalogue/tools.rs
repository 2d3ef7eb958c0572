//! Every built-in tool, in one place: each crate registers its own in one
//! `install` function (`dsh_services::tools::builtin::install`,
//! `dsh_actors::multi_agent::install`), and this file makes those calls
//! for the `agent-services` plugin, with what its config turns on. The
//! subagent relays (an ACP agent process, a child on another node) are
//! providers of the subagent seam and stay with it; the `subagent_<name>`
//! tool of each configured ACP agent is registered here.

use std::sync::Arc;

use dsh_services::tools::ToolRegistry;
use dsh_services::tools::builtin::{Builtins, WebFetchSettings};
use dsh_supervisors::{BoxError, Context};
use schemars::JsonSchema;
use serde::Deserialize;

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

/// Which tools to register.
pub(super) struct Choice<'a> {
    /// The built-ins every agent gets (and `skill`, `web_fetch`).
    pub builtin: bool,
    /// The multi-agent tools (subagents, workflows, Ralph).
    pub multi_agent: bool,
    /// Their depth cap (the default when `None`).
    pub max_depth: Option<u32>,
    /// How `web_fetch` fetches.
    pub web_fetch: WebFetchSettings,
    /// The ACP agents offered as `subagent_<name>` tools.
    pub acp: &'a [AcpSubagentConfig],
}

/// Registers the tools `choice` turns on through `ctx`.
pub(super) fn install(
    ctx: &Context,
    tools: &Arc<ToolRegistry>,
    choice: Choice<'_>,
) -> Result<(), BoxError> {
    if choice.builtin {
        let extra = Builtins {
            skills: Some(Some(crate::home::dir())),
            web_fetch: Some(choice.web_fetch),
        };
        dsh_services::tools::builtin::install(ctx, tools, extra)?;
    }
    if choice.multi_agent {
        let mut config = dsh_actors::multi_agent::MultiAgentConfig::default();
        if let Some(max) = choice.max_depth {
            config.max_depth = max;
        }
        let subagents = dsh_actors::multi_agent::install(ctx, tools, &config)?;
        for acp in choice.acp {
            use dsh_actors::subagent::tools::{SubagentTool, SubagentToolConfig};
            let provider = dsh_actors::subagent::acp::AcpProvider::new(
                acp.name.clone(),
                acp.command.clone(),
                acp.args.clone(),
                acp.env.clone().into_iter().collect(),
            );
            subagents.register(ctx, Arc::new(provider))?;
            let mut tool = SubagentToolConfig::new(&acp.name, &format!("subagent_{}", acp.name));
            // A remote child lives in its process: no resident children.
            tool.background = false;
            tools.register(ctx, Arc::new(SubagentTool::new(subagents.clone(), tool)?))?;
        }
    }
    Ok(())
}
