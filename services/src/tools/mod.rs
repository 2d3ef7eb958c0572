//! Tools: definitions, the scoped registry, and the guarded pipeline.
//!
//! A call goes, in this exact order: resolve (`UNKNOWN_TOOL` when absent or
//! filtered) → parse and validate arguments against the tool's JSON Schema
//! (`INVALID_ARGS`) → `tools/pre-execute` waterfall (allow / deny / ask;
//! ask goes to the approval seam, which fails closed) → guards (`tools/guard`,
//! bail: the first denial wins) → `tools/execute` waterfall around the body
//! (timeout, cancellation, a panic becoming an error) → `tools/post-execute`
//! waterfall → the definition's `finalize_content` → `tools/result` (emit).
//! Every failure along the way is an `is_error` result; the turn goes on.

pub mod builtin;
mod pipeline;
mod registry;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::Context;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::llm::{ContentBlock, ToolSchema};

pub use pipeline::{
    Decision, PipelineOutcome, PostExecute, PreExecute, ToolExecute, ToolGuard, ToolResultEvent,
    run_pipeline,
};
pub use registry::{RegisteredTool, Resolution, Restriction, ToolRegistry};

/// One requested invocation, as the model produced it.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// Call id.
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Raw JSON arguments.
    pub arguments: String,
}

/// What a tool body receives.
#[derive(Clone)]
pub struct ToolContext {
    /// The call id.
    pub call_id: String,
    /// Validated arguments.
    pub args: Value,
    /// Fires when the call is cancelled (turn cancelled, agent disposed, timeout).
    pub cancel: CancellationToken,
    /// The calling agent's scoped context.
    pub ctx: Context,
    /// The workspace root the tool works in.
    pub cwd: Arc<PathBuf>,
}

/// A tool body's result.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolOutput {
    /// Model-facing content.
    pub content: Vec<ContentBlock>,
    /// Tool-private presentation data (JSON).
    pub meta: Option<Value>,
}

impl ToolOutput {
    /// A single text block.
    pub fn text(text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            content: vec![ContentBlock::text(text)],
            meta: None,
        }
    }
}

/// A failed call: a stable code and a message for the model.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ToolError {
    /// `UNKNOWN_TOOL`, `INVALID_ARGS`, `DENIED`, `TIMEOUT`, `ABORTED`,
    /// `PANICKED`, `FAILED`, or a tool-specific code.
    pub code: String,
    /// What happened, for the model.
    pub message: String,
}

impl ToolError {
    /// A failure with `code`.
    pub fn new(code: &str, message: impl Into<String>) -> ToolError {
        ToolError {
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// A generic execution failure.
    pub fn failed(message: impl Into<String>) -> ToolError {
        ToolError::new("FAILED", message)
    }
}

/// A tool definition.
pub trait Tool: Send + Sync + 'static {
    /// The model-facing schema (name, description, JSON Schema of arguments).
    fn schema(&self) -> ToolSchema;

    /// Whether calls may run in parallel with other calls of the same step.
    /// Only an exact `true` allows it.
    fn is_concurrency_safe(&self) -> bool {
        false
    }

    /// Longest a call may run before it is cancelled with `TIMEOUT`.
    fn timeout(&self) -> Option<Duration> {
        None
    }

    /// How long a cancelled call may take to clean up. `None` (the default):
    /// the body is dropped the moment the call is cancelled. `Some(grace)`:
    /// the body sees `cx.cancel`, stops what it started (children, runs,
    /// records) and returns; it is dropped only if it takes longer than
    /// `grace`. The call's result is `ABORTED` either way.
    fn cancel_grace(&self) -> Option<Duration> {
        None
    }

    /// The body.
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>>;

    /// Last content-only transform of a successful result.
    fn finalize_content(&self, output: ToolOutput) -> ToolOutput {
        output
    }
}
