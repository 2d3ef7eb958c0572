//! The model-facing `workflow` tool: runs a script through the engine and
//! answers with its JSON return value.

use std::sync::Arc;

use dsh_services::llm::{ContentBlock, ToolSchema};
use dsh_services::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};
use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use super::{WorkflowEngine, WorkflowRequest, WorkflowStop};
use crate::agent::Agent;

/// The `workflow` tool over one engine.
pub struct WorkflowTool(pub Arc<WorkflowEngine>);

/// What a `workflow` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct WorkflowArgs {
    /// The script body.
    script: String,
    /// {name: kebab-case, description, whenToUse?, phases?: [{title, detail?}]}
    #[schemars(schema_with = "meta_schema")]
    meta: serde_json::Value,
    /// Input exposed to the script as `args`.
    #[serde(default)]
    args: serde_json::Value,
}

/// The meta block as the model sees it: its two required fields (the
/// engine validates the rest before the script runs).
fn meta_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "description": {"type": "string"}
        },
        "required": ["name", "description"]
    })
}

impl Tool for WorkflowTool {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "workflow".into(),
            description: "Run a JavaScript orchestration script that starts subagents. The body \
                          may use top-level await and must end with `return <json value>`. \
                          Globals: `args`; `agent(prompt, {label?, phase?, schema?, agent?})` (`agent`: a named agent definition) returns a \
                          promise of the child's final text (or its structured value when a \
                          JSON object schema is given; null when the child failed); \
                          `phase(title)`; `log(message)`. Fan out with Promise.all; the \
                          children run in parallel under a concurrency cap, each in the same \
                          workspace with at most your permissions, and the call returns the \
                          script's value once every child has finished. `meta` names the run \
                          (`name`, `description`) for the user watching it."
                .into(),
            parameters: parameters::<WorkflowArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Use `workflow` when the shape of the work is known in advance: the same task over many inputs (files, modules, questions), or fixed phases such as survey, change, verify. One script with `agent()` calls under Promise.all does in one step what many subagent calls would, and returns one combined value.",
        )
    }

    /// A cancelled call stops its run, waits for its children, and records the end.
    fn cancel_grace(&self) -> Option<std::time::Duration> {
        Some(std::time::Duration::from_secs(60))
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let parent = Agent::calling(&cx.ctx)
                .ok_or_else(|| ToolError::new("NO_AGENT", "workflow runs inside an agent"))?;
            let WorkflowArgs { script, meta, args } = cx.parse()?;
            let mut request = WorkflowRequest::new(&parent, script, meta);
            request.args = args;
            request.cancel = cx.cancel.clone();
            let run = self
                .0
                .start(request)
                .await
                .map_err(|e| ToolError::new("WORKFLOW_START", chain(&e).to_string()))?;
            parent.record(
                "tool-workflow/run-start",
                json!({"runId": run.id(), "name": run.meta().name, "callId": cx.call_id}),
            );
            let result = run.result().await;
            run.dispose().await;
            parent.record(
                "tool-workflow/run-end",
                json!({
                    "runId": run.id(),
                    "stopReason": result.stop_reason,
                    "agentsStarted": result.agents_started,
                }),
            );
            if result.stop_reason != WorkflowStop::Completed {
                return Err(ToolError::new(
                    "WORKFLOW_FAILED",
                    format!(
                        "workflow {} ended {:?}: {}",
                        run.meta().name,
                        result.stop_reason,
                        result.error.unwrap_or_default()
                    ),
                ));
            }
            Ok(ToolOutput {
                content: vec![ContentBlock::text(result.value.to_string())],
                meta: Some(json!({
                    "runId": run.id(),
                    "agentsStarted": result.agents_started,
                })),
            })
        }
        .boxed()
    }
}
