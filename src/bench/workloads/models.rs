//! The scripted models and tools the workloads run on: the worker model
//! and `echo` (W1, W3, the worker of W2), the orchestrator and `delegate`
//! (W2).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dsh_actors::agent::Agent;
use dsh_actors::subagent::{StartRequest, StopReason, Subagents};
use dsh_services::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmRequest, TokenUsage, ToolSchema,
};
use dsh_services::providers::scripted::chunks_for;
use dsh_services::tools::{Tool, ToolContext, ToolError, ToolOutput};
use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

/// The worker model: a pure function of the conversation. With `n` tool
/// results after the last user prompt, it calls `echo(n+1)` while
/// `n < S-1`, then answers `done`.
pub struct WorkerModel {
    steps: u32,
    calls: AtomicU64,
}

impl WorkerModel {
    /// A worker model for `steps` steps per turn.
    pub fn new(steps: u32) -> WorkerModel {
        WorkerModel {
            steps,
            calls: AtomicU64::new(0),
        }
    }

    /// Model calls answered.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}

/// Streams `blocks` as a fake model's answer to `request`.
fn reply(request: &LlmRequest, blocks: &[ContentBlock], finish: FinishReason) -> ChunkStream {
    let usage = TokenUsage {
        input_tokens: request.messages.len() as u64,
        output_tokens: 1,
        ..TokenUsage::default()
    };
    Box::pin(futures::stream::iter(
        chunks_for(blocks, usage, finish).into_iter().map(Ok),
    ))
}

/// Tool results after the last prompt (a user message from the user).
fn results_since_prompt(request: &LlmRequest) -> u32 {
    let mut n = 0;
    for m in request.messages.iter().rev() {
        if m.source.kind == "user" {
            break;
        }
        n += m
            .content
            .iter()
            .filter(|b| matches!(b, ContentBlock::ToolResult { .. }))
            .count() as u32;
    }
    n
}

impl LlmAdapter for WorkerModel {
    fn name(&self) -> &str {
        "bench-worker"
    }

    fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let n = results_since_prompt(&request);
        let (blocks, finish) = if n < self.steps.saturating_sub(1) {
            let call = ContentBlock::ToolCall {
                id: format!("call_{}", n + 1),
                name: "echo".into(),
                arguments: format!("{{\"i\":{}}}", n + 1),
            };
            (vec![call], FinishReason::ToolCalls)
        } else {
            (vec![ContentBlock::text("done")], FinishReason::Stop)
        };
        reply(&request, &blocks, finish)
    }
}

/// `echo(i: integer) -> "<i>"`.
pub struct Echo {
    pub(super) calls: AtomicU64,
}

impl Tool for Echo {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "echo".into(),
            description: "Returns its argument.".into(),
            parameters: dsh_services::tools::parameters::<EchoArgs>(),
        }
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        async move {
            let args: EchoArgs = cx.parse()?;
            Ok(ToolOutput::text(args.i.to_string()))
        }
        .boxed()
    }
}

// `echo`'s arguments (undescribed, as the workloads define them).
#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct EchoArgs {
    i: i64,
}

// `delegate`'s arguments.
#[derive(serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct DelegateArgs {
    input: String,
}

/// The orchestrator model: with no tool result after the prompt, `K`
/// `delegate` calls (`call_d<j>`, input `task-<j>`); then `done`.
pub struct OrchestratorModel {
    pub(super) k: std::sync::atomic::AtomicU32,
    pub(super) calls: AtomicU64,
}

impl LlmAdapter for OrchestratorModel {
    fn name(&self) -> &str {
        "bench-orchestrator"
    }

    fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let (blocks, finish) = if results_since_prompt(&request) == 0 {
            let calls = (0..self.k.load(Ordering::Relaxed))
                .map(|j| ContentBlock::ToolCall {
                    id: format!("call_d{j}"),
                    name: "delegate".into(),
                    arguments: format!("{{\"input\":\"task-{j}\"}}"),
                })
                .collect();
            (calls, FinishReason::ToolCalls)
        } else {
            (vec![ContentBlock::text("done")], FinishReason::Stop)
        };
        reply(&request, &blocks, finish)
    }
}

/// `delegate(input)`: a fresh child agent through the subagent seam (a
/// child actor of the orchestrator) runs one worker turn on `input`;
/// its final text is the result. The child stays in the orchestrator's
/// tree until the orchestrator is torn down.
pub struct Delegate {
    pub(super) subagents: Arc<Subagents>,
    pub(super) calls: AtomicU64,
    pub(super) finals: AtomicU64,
    /// Children go to other nodes (the `remote` provider).
    pub(super) remote: std::sync::atomic::AtomicBool,
}

impl Tool for Delegate {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "delegate".into(),
            description: "Runs a task on a fresh sub-agent.".into(),
            parameters: dsh_services::tools::parameters::<DelegateArgs>(),
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
            self.calls.fetch_add(1, Ordering::Relaxed);
            let parent = Agent::calling(&cx.ctx)
                .ok_or_else(|| ToolError::failed("delegate runs inside an agent"))?;
            let DelegateArgs { input } = cx.parse()?;
            let mut request = StartRequest::new(&parent, input, cx.cancel.clone());
            request.route = Some(("bench-worker".into(), "bench".into()));
            request.persona = Some("You are a benchmark agent.".into());
            let provider = if self.remote.load(Ordering::Relaxed) {
                "remote"
            } else {
                "spawn"
            };
            let run = self
                .subagents
                .start(provider, request)
                .await
                .map_err(|e| ToolError::new(e.code(), chain(&e).to_string()))?;
            let result = run.result().await;
            if result.stop_reason != StopReason::Completed {
                return Err(ToolError::failed(format!(
                    "sub-agent ended {}",
                    result.stop_reason.as_str()
                )));
            }
            if result.output == "done" {
                self.finals.fetch_add(1, Ordering::Relaxed);
            }
            Ok(ToolOutput::text(result.output))
        }
        .boxed()
    }
}
