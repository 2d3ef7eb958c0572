//! The model-facing delegation tools over the `subagents` service:
//! `subagent` (one per provider instance), `send_message`,
//! `interrupt_agent` and `list_agents`.

use std::sync::Arc;

use dsh_services::llm::ToolSchema;
use dsh_services::tools::{Restriction, Tool, ToolContext, ToolError, ToolOutput, parameters};
use dsh_supervisors::error::chain;
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
    /// Absolute delegation-depth cap (0 forbids delegation; `None`: the
    /// `subagents` service's, 3 unless set).
    pub max_depth: Option<u32>,
    /// Per-child persona.
    pub persona: Option<String>,
    /// Per-child tool filter.
    pub tool_filter: Option<Restriction>,
    /// Model route and id for children (the parent's when `None`).
    pub route: Option<(String, String)>,
    /// Children run on other nodes (their workspace is the node's).
    pub remote: bool,
}

impl SubagentToolConfig {
    /// The default instance: `subagent` over `spawn`, depth cap 3.
    pub fn new(provider: &str, tool_name: &str) -> SubagentToolConfig {
        SubagentToolConfig {
            provider: provider.into(),
            tool_name: tool_name.into(),
            background: true,
            max_depth: None,
            persona: None,
            tool_filter: None,
            route: None,
            remote: false,
        }
    }
}

/// The `subagent` tool.
pub struct SubagentTool {
    config: SubagentToolConfig,
    subagents: Arc<Subagents>,
    inherits: bool,
    /// The provider enforces a depth cap (a remote one does not: it is
    /// still capped here, one level down).
    depth_limit: bool,
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
            depth_limit: provider.capabilities().depth_limit,
            config,
            subagents,
        })
    }
}

/// What a `subagent` (or `subagent_fork`) call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct SubagentArgs {
    /// A short (3-5 word) description of the delegated task, for display.
    description: String,
    /// The complete task for the subagent.
    prompt: String,
    /// Start a continuable subagent and return its id at once; you are told
    /// when it finishes and can send it more work with send_message.
    /// Defaults to false (wait for the result).
    #[serde(default)]
    run_in_background: Option<bool>,
    /// A named agent to run the task (one of the "Named agents" your
    /// instructions list, when they list any): its instructions, model and
    /// tools.
    #[serde(default)]
    agent: Option<String>,
}

/// What a `send_message` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct SendArgs {
    /// The subagent id.
    subagent_id: String,
    /// The message to deliver.
    message: String,
}

/// What an `interrupt_agent` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct InterruptArgs {
    /// The agent id to interrupt.
    agent_id: String,
}

/// What a `list_agents` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct ListArgs {
    /// `children` (the default) lists your direct children; `descendants`
    /// walks the whole tree below you.
    #[serde(default)]
    scope: Option<ListScope>,
}

/// How far `list_agents` looks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
enum ListScope {
    /// Direct children.
    Children,
    /// Everything below, in pre-order.
    Descendants,
}

fn caller(cx: &ToolContext) -> Result<Agent, ToolError> {
    Agent::calling(&cx.ctx)
        .ok_or_else(|| ToolError::new("NO_AGENT", "this tool runs only inside an agent"))
}

fn refused(e: SubagentError) -> ToolError {
    ToolError::new(e.code(), chain(&e).to_string())
}

impl Tool for SubagentTool {
    fn schema(&self) -> ToolSchema {
        let context = if self.inherits {
            "The subagent starts from this conversation's completed turns."
        } else {
            "Give it a complete, standalone prompt: it does not see this conversation."
        };
        let mut parameters = parameters::<SubagentArgs>();
        if !self.config.background
            && let Some(properties) = parameters["properties"].as_object_mut()
        {
            properties.remove("run_in_background");
        }
        ToolSchema {
            name: self.config.tool_name.clone(),
            description: format!(
                "Delegate a self-contained task to a subagent: a separate agent with its own \
                 context, {place} with at most your permissions. It \
                 returns its final result, not its intermediate steps, so ask it for what you \
                 need back (findings, paths, a diff summary). {context} Several calls in one \
                 step run in parallel.{background}",
                place = if self.config.remote {
                    "running on another machine of the cluster, in that machine's workspace"
                } else {
                    "working in the same workspace"
                },
                background = if self.config.background {
                    " With `run_in_background` it starts and you get its id at once; you are \
                     told when it finishes, and send_message gives it more work."
                } else {
                    ""
                }
            ),
            parameters,
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(if self.config.background {
            "Hand a separate question or a self-contained part of the work to `subagent` when its result is all you need: it sees none of this conversation, so its prompt must carry every fact it needs. Start several at once for independent parts; with `run_in_background` they run while you work, `list_agents` recalls them, `send_message` continues one and `interrupt_agent` stops one's turn."
        } else {
            "A forked subagent starts from a copy of this conversation: use it to try something on the side without filling your own context with the details."
        })
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
            let args: SubagentArgs = cx.parse()?;
            let (label, prompt) = (args.description, args.prompt);
            let background = args.run_in_background.unwrap_or(false);
            if background && !self.config.background {
                return Err(ToolError::new(
                    "UNSUPPORTED",
                    "this subagent tool runs in the foreground only",
                ));
            }
            let mut request = StartRequest::new(&parent, prompt, cx.cancel.clone());
            request.label = Some(label.clone());
            request.max_depth = self.config.max_depth.filter(|_| self.depth_limit);
            request.persona = self.config.persona.clone();
            request.tool_filter = self.config.tool_filter.clone();
            request.route = self.config.route.clone();
            if let Some(name) = &args.agent {
                self.subagents.define(&mut request, name).map_err(refused)?;
            }
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
                let mut message = format!("the subagent stopped: {}", result.stop_reason.as_str());
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
            description: "Send a message to a background subagent you started, by its id, \
                          continuing the same conversation: the message becomes its next \
                          turn, after the one it is working on, so it cannot redirect work \
                          already under way (interrupt_agent does). Returns only that the \
                          message was delivered, no answer; a failure means it was not. A \
                          stored (ready) subagent is resumed for it."
                .into(),
            parameters: parameters::<SendArgs>(),
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
            let SendArgs {
                subagent_id: id,
                message,
            } = cx.parse()?;
            self.0.send(&parent, &id, &message).await.map_err(refused)?;
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
            description: "Cancel the current turn of a background subagent you started, or \
                          of any agent below it, by its id. Messages queued for it stay \
                          queued; interrupting an agent between turns does nothing. Use it \
                          when a subagent works on something that is no longer needed or \
                          has gone wrong; send it a corrected task with send_message after."
                .into(),
            parameters: parameters::<InterruptArgs>(),
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
            let InterruptArgs { agent_id: id } = cx.parse()?;
            self.0.interrupt(&parent, &id).map_err(refused)?;
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
            description: "List your continuable background subagents by id and label, to \
                          recall which you started (you are told when one finishes: do not \
                          poll). Status: running (working now), idle (loaded, between turns, \
                          perhaps waiting on agents it started) or ready (stored only: \
                          resumable, and send_message starts its next turn). The list is a \
                          snapshot; send_message makes the real check. With scope \
                          `descendants` the whole tree below you is listed, each entry with \
                          its direct parent's id and its depth; send_message reaches depth-1 \
                          entries only, interrupt_agent any of them."
                .into(),
            parameters: parameters::<ListArgs>(),
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
            let ListArgs { scope } = cx.parse()?;
            let parent = caller(&cx)?;
            let children = match scope.unwrap_or(ListScope::Children) {
                ListScope::Children => self.0.children(&parent).await,
                ListScope::Descendants => self.0.descendants(&parent).await,
            };
            let value: Value = serde_json::to_value(&children).unwrap_or_default();
            Ok(ToolOutput {
                content: vec![dsh_services::llm::ContentBlock::text(value.to_string())],
                meta: Some(json!({"agents": value})),
            })
        }
        .boxed()
    }
}
