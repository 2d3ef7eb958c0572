//! Installs the multi-agent capabilities in one call: the `subagents`
//! service (`spawn`, `fork`), the delegation tools, the workflow engine with
//! its `workflow` tool, and the `ralph` tool.

use std::sync::Arc;

use dsh_services::tools::ToolRegistry;
use dsh_supervisors::Context;
use dsh_supervisors::error::chain;
use dsh_supervisors::registry::RegisterError;

use crate::ralph::tool::RalphTool;
use crate::subagent::Subagents;
use crate::subagent::tools::{
    InterruptAgent, ListAgents, SendMessage, SubagentTool, SubagentToolConfig,
};
use crate::workflow::tool::WorkflowTool;
use crate::workflow::{WorkflowEngine, WorkflowLimits};

/// What [`install`] sets up.
#[derive(Clone, Debug)]
pub struct MultiAgentConfig {
    /// Delegation depth cap of the `subagent` tools.
    pub max_depth: u32,
    /// Workflow engine limits.
    pub workflow: WorkflowLimits,
    /// Default and ceiling of a `ralph` call's rounds.
    pub ralph_rounds: u32,
}

impl Default for MultiAgentConfig {
    fn default() -> Self {
        MultiAgentConfig {
            max_depth: 3,
            workflow: WorkflowLimits::default(),
            ralph_rounds: crate::ralph::DEFAULT_ROUNDS,
        }
    }
}

/// Provides `subagents` and `workflow-engine` under `ctx` and registers
/// `subagent`, `subagent_fork`, `send_message`, `interrupt_agent`,
/// `list_agents`, `workflow` and `ralph`.
pub fn install(
    ctx: &Context,
    tools: &Arc<ToolRegistry>,
    config: &MultiAgentConfig,
) -> Result<Arc<Subagents>, RegisterError> {
    let subagents = Arc::new(Subagents::with_builtin());
    ctx.provide(Subagents::SERVICE, subagents.clone())?;
    subagents.set_max_depth(config.max_depth);
    let spawn = SubagentToolConfig::new("spawn", "subagent");
    let mut fork = SubagentToolConfig::new("fork", "subagent_fork");
    fork.background = false;
    for c in [spawn, fork] {
        let name = c.tool_name.clone();
        let tool = SubagentTool::new(subagents.clone(), c).map_err(|e| RegisterError::Invalid {
            what: "tool",
            name,
            reason: chain(&e).to_string(),
        })?;
        tools.register(ctx, Arc::new(tool))?;
    }
    tools.register(ctx, Arc::new(SendMessage(subagents.clone())))?;
    tools.register(ctx, Arc::new(InterruptAgent(subagents.clone())))?;
    tools.register(ctx, Arc::new(ListAgents(subagents.clone())))?;
    let engine = Arc::new(WorkflowEngine::new(
        subagents.clone(),
        "spawn",
        config.workflow.clone(),
    ));
    ctx.provide(WorkflowEngine::SERVICE, engine.clone())?;
    tools.register(ctx, Arc::new(WorkflowTool(engine)))?;
    let mut ralph = RalphTool::new(subagents.clone());
    ralph.max_rounds = config.ralph_rounds;
    tools.register(ctx, Arc::new(ralph))?;
    Ok(subagents)
}
