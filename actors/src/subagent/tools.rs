//! The model-facing delegation tools over the `subagents` service:
//! `subagent` (one per provider instance), `send_message`,
//! `interrupt_agent` and `list_agents`.

use std::sync::Arc;

use dsh_services::llm::ToolSchema;
use dsh_services::tools::{Restriction, Tool, ToolContext, ToolError, ToolOutput};
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};

use super::{StartRequest, StopReason, SubagentError, Subagents, result_content};
use crate::agent::Agent;

/// How one `subagent` tool instance delegates.
#[derive(Clone, Debug)]
pub struct SubagentToolConfig {
    /// The provider every call uses.
    pub provider: String,
    /// The model-facing name (`subagent`, `subagent_fork`, ...).
    pub tool_name: String,
    /// Whether `run_in_background` is offered (continuable children).
    pub background: bool,
    /// Absolute delegation-depth cap (default 3; 0 forbids delegation).
    pub max_depth: u32,
    /// Per-child persona.
    pub persona: Option<String>,
    /// Per-child tool filter.
    pub tool_filter: Option<Restriction>,
    /// Model route and id for children (the parent's when `None`).
    pub route: Option<(String, String)>,
}

impl SubagentToolConfig {
    /// The default instance: `subagent` over `spawn`, depth cap 3.
    pub fn new(provider: &str, tool_name: &str) -> SubagentToolConfig {
        SubagentToolConfig {
            provider: provider.into(),
            tool_name: tool_name.into(),
            background: true,
            max_depth: 3,
            persona: None,
            tool_filter: None,
            route: None,
        }
    }
}

/// The `subagent` tool.
pub struct SubagentTool {
    config: SubagentToolConfig,
    subagents: Arc<Subagents>,
    inherits: bool,
}

impl SubagentTool {
    /// A tool instance; fails when the provider is not registered.
    pub fn new(
        subagents: Arc<Subagents>,
        config: SubagentToolConfig,
    ) -> Result<Self, SubagentError> {
        let provider = subagents
            .provider(&config.provider)
            .ok_or_else(|| SubagentError::UnknownProvider(config.provider.clone()))?;
        Ok(SubagentTool {
            inherits: provider.inherits_parent_context(),
            config,
            subagents,
        })
    }
}

fn caller(cx: &ToolContext) -> Result<Agent, ToolError> {
    Agent::calling(&cx.ctx)
        .ok_or_else(|| ToolError::new("NO_AGENT", "this tool runs only inside an agent"))
}

fn refused(e: SubagentError) -> ToolError {
    ToolError::new(e.code(), e.to_string())
}

impl Tool for SubagentTool {
    fn schema(&self) -> ToolSchema {
        let context = if self.inherits {
            "The subagent starts from this conversation's completed turns."
        } else {
            "Give it a complete, standalone prompt: it does not see this conversation."
        };
        let mut properties = json!({
            "description": {
                "type": "string",
                "description": "A short (3-5 word) description of the delegated task, for display."
            },
            "prompt": {
                "type": "string",
                "description": "The complete task for the subagent."
            }
        });
        if self.config.background {
            properties["run_in_background"] = json!({
                "type": "boolean",
                "description": "Start a continuable subagent and return its id at once; \
                                you are told when it finishes and can send it more work \
                                with send_message. Defaults to false (wait for the result)."
            });
        }
        ToolSchema {
            name: self.config.tool_name.clone(),
            description: format!(
                "Delegate a self-contained task to a subagent (a separate agent working in its \
                 own context). It returns its final result, not its intermediate steps. {context}"
            ),
            parameters: json!({
                "type": "object",
                "properties": properties,
                "required": ["description", "prompt"]
            }),
        }
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    /// A cancelled call cancels its child and waits for its turn to end.
    fn cancel_grace(&self) -> Option<std::time::Duration> {
        Some(std::time::Duration::from_secs(60))
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let parent = caller(&cx)?;
            let label = cx.args["description"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            let prompt = cx.args["prompt"].as_str().unwrap_or_default().to_owned();
            let background = cx.args["run_in_background"].as_bool().unwrap_or(false);
            if background && !self.config.background {
                return Err(ToolError::new(
                    "UNSUPPORTED",
                    "this subagent tool runs in the foreground only",
                ));
            }
            let mut request = StartRequest::new(&parent, prompt, cx.cancel.clone());
            request.label = Some(label.clone());
            request.max_depth = Some(self.config.max_depth);
            request.persona = self.config.persona.clone();
            request.tool_filter = self.config.tool_filter.clone();
            request.route = self.config.route.clone();
            if background {
                let id = self
                    .subagents
                    .start_continuable(&self.config.provider, &label, request)
                    .await
                    .map_err(refused)?;
                return Ok(ToolOutput {
                    content: vec![dsh_services::llm::ContentBlock::text(format!(
                        "started subagent {id}"
                    ))],
                    meta: Some(json!({"kind": "continuable", "subagentId": id})),
                });
            }
            let run = self
                .subagents
                .start(&self.config.provider, request)
                .await
                .map_err(refused)?;
            // The parent's step disposes the child once all of the step's
            // calls have answered, last started first.
            parent.adopt_for_step(run.agent().clone());
            let result = run.result().await;
            if result.stop_reason != StopReason::Completed {
                let mut message = format!("Error: {}", result.stop_reason.as_str());
                if let Some(d) = &result.diagnostic {
                    message.push_str(&format!("\n{d}"));
                }
                if !result.output.is_empty() {
                    message.push_str(&format!("\n{}", result.output));
                }
                return Err(ToolError::new("SUBAGENT_FAILED", message));
            }
            Ok(ToolOutput {
                content: result_content(&result),
                meta: Some(json!({"kind": "foreground", "runId": run.id()})),
            })
        }
        .boxed()
    }
}

/// `send_message`: the next turn of a continuable child.
pub struct SendMessage(pub Arc<Subagents>);

impl Tool for SendMessage {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "send_message".into(),
            description: "Send a message to a background subagent by its id, continuing its \
                          conversation as its next turn. Returns only a delivery confirmation; \
                          a failure means the message was not delivered."
                .into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "subagent_id": {"type": "string", "description": "The subagent id."},
                    "message": {"type": "string", "description": "The message to deliver."}
                },
                "required": ["subagent_id", "message"]
            }),
        }
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let parent = caller(&cx)?;
            let id = cx.args["subagent_id"].as_str().unwrap_or_default();
            let text = cx.args["message"].as_str().unwrap_or_default();
            self.0.send(&parent, id, text).await.map_err(refused)?;
            Ok(ToolOutput::text(format!("delivered to subagent {id}")))
        }
        .boxed()
    }
}

/// `interrupt_agent`: cancels a continuable child's current turn.
pub struct InterruptAgent(pub Arc<Subagents>);

impl Tool for InterruptAgent {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "interrupt_agent".into(),
            description: "Cancel a background subagent's current turn by its id. Queued \
                          messages stay; interrupting a finished agent is a no-op."
                .into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "agent_id": {"type": "string", "description": "The agent id to interrupt."}
                },
                "required": ["agent_id"]
            }),
        }
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let parent = caller(&cx)?;
            let id = cx.args["agent_id"].as_str().unwrap_or_default();
            self.0.interrupt(&parent, id).map_err(refused)?;
            Ok(ToolOutput::text(format!("interrupt requested for {id}")))
        }
        .boxed()
    }
}

/// `list_agents`: the caller's continuable children.
pub struct ListAgents(pub Arc<Subagents>);

impl Tool for ListAgents {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "list_agents".into(),
            description: "List your continuable background subagents by id and label. running: \
                          working now; idle: loaded, between turns; ready: on disk only, \
                          resumable with send_message."
                .into(),
            parameters: json!({"type": "object", "properties": {}}),
        }
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let parent = caller(&cx)?;
            let children = self.0.children(&parent).await;
            let value: Value = serde_json::to_value(&children).unwrap_or_default();
            Ok(ToolOutput {
                content: vec![dsh_services::llm::ContentBlock::text(value.to_string())],
                meta: Some(json!({"agents": value})),
            })
        }
        .boxed()
    }
}
