//! The model-facing `workflow` tool: runs a script through the engine and
//! answers with its JSON return value.

use std::sync::Arc;

use dsh_services::llm::{ContentBlock, ToolSchema};
use dsh_services::tools::{Tool, ToolContext, ToolError, ToolOutput};
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use super::{WorkflowEngine, WorkflowRequest, WorkflowStop};
use crate::agent::Agent;

/// The `workflow` tool over one engine.
pub struct WorkflowTool(pub Arc<WorkflowEngine>);

impl Tool for WorkflowTool {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "workflow".into(),
            description: "Run a JavaScript orchestration script that starts subagents. The body \
                          may use top-level await and must end with `return <json value>`. \
                          Globals: `args`; `agent(prompt, {label?, phase?, schema?})` returns a \
                          promise of the child's final text (or its structured value when a \
                          JSON object schema is given; null when the child failed); \
                          `phase(title)`; `log(message)`. Fan out with Promise.all."
                .into(),
            parameters: json!({
                "type": "object",
                "properties": {
                    "script": {"type": "string", "description": "The script body."},
                    "meta": {
                        "type": "object",
                        "description": "{name: kebab-case, description, whenToUse?, phases?: [{title, detail?}]}",
                        "properties": {
                            "name": {"type": "string"},
                            "description": {"type": "string"}
                        },
                        "required": ["name", "description"]
                    },
                    "args": {"description": "Input exposed to the script as `args`."}
                },
                "required": ["script", "meta"]
            }),
        }
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
            let script = cx.args["script"].as_str().unwrap_or_default().to_owned();
            let mut request = WorkflowRequest::new(&parent, script, cx.args["meta"].clone());
            request.args = cx.args.get("args").cloned().unwrap_or_default();
            request.cancel = cx.cancel.clone();
            let run = self
                .0
                .start(request)
                .await
                .map_err(|e| ToolError::new("WORKFLOW_START", e.to_string()))?;
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
