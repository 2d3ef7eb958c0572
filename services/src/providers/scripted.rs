//! The scripted model: keyless and deterministic. Each call answers with the
//! next step of a script, streamed through the normal chunk protocol.
//!
//! Script (JSON):
//! ```json
//! {"steps": [
//!   {"reasoning": "optional", "text": "a final answer"},
//!   {"tool_calls": [{"name": "read", "arguments": {"path": "README.md"}}]},
//!   {"error": {"code": "RATE_LIMITED", "message": "slow down", "status": 429}},
//!   {"text": "an answer cut at the output-token limit", "cut": true}
//! ]}
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use futures::StreamExt as _;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::llm::{ChunkStream, LlmAdapter, LlmRequest};
use crate::llm::{ContentBlock, FinishReason, LlmFailure, StreamChunk, TokenUsage, code};

/// One scripted tool call.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScriptedCall {
    /// Tool name.
    pub name: String,
    /// Arguments (sent to the tool as JSON text).
    #[serde(default)]
    pub arguments: serde_json::Value,
    /// Call id; `call_<n>` when omitted.
    #[serde(default)]
    pub id: Option<String>,
}

/// One scripted answer.
#[derive(Clone, Debug, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields)]
pub struct ScriptStep {
    /// Reasoning block.
    #[serde(default)]
    pub reasoning: Option<String>,
    /// Visible text.
    #[serde(default)]
    pub text: Option<String>,
    /// Tool calls.
    #[serde(default)]
    pub tool_calls: Vec<ScriptedCall>,
    /// Fail this call instead.
    #[serde(default)]
    pub error: Option<ScriptedError>,
    /// `true`: the answer stops at the output-token limit (`finish_reason:
    /// length`; the turn ends `max-tokens`).
    #[serde(default)]
    pub cut: bool,
}

/// A scripted provider failure.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ScriptedError {
    /// Machine code.
    pub code: String,
    /// Text.
    pub message: String,
    /// HTTP status to report.
    #[serde(default)]
    pub status: Option<u16>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptFile {
    steps: Vec<ScriptStep>,
}

/// A model that plays a script, one step per call.
pub struct ScriptedModel {
    steps: Arc<[ScriptStep]>,
    cursor: AtomicUsize,
    calls: AtomicUsize,
}

/// Why a script cannot be played. Fatal: the file must change.
#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    /// Not JSON of the script's shape (the message names the line, column
    /// and field).
    #[error("invalid script")]
    Json(#[from] serde_json::Error),
    /// `steps` is an empty list.
    #[error("invalid script: `steps` is empty")]
    Empty,
}

impl ScriptedModel {
    /// A model playing `steps` in order.
    pub fn new(steps: Vec<ScriptStep>) -> ScriptedModel {
        ScriptedModel {
            steps: steps.into(),
            cursor: AtomicUsize::new(0),
            calls: AtomicUsize::new(0),
        }
    }

    /// Parses a script (`{"steps": [...]}`), naming the failing field.
    pub fn from_json(text: &str) -> Result<ScriptedModel, ScriptError> {
        let file: ScriptFile = serde_json::from_str(text)?;
        if file.steps.is_empty() {
            return Err(ScriptError::Empty);
        }
        Ok(ScriptedModel::new(file.steps))
    }

    /// Calls answered so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::Relaxed)
    }
}

/// Estimated tokens of a request (4 characters a token), for usage figures.
fn estimate_tokens(request: &LlmRequest) -> u64 {
    let mut chars = request.system.as_ref().map(|s| s.len()).unwrap_or(0);
    for m in request.messages.iter() {
        for b in &m.content {
            chars += match b {
                ContentBlock::Text { text } | ContentBlock::Reasoning { text } => text.len(),
                ContentBlock::ToolCall { arguments, .. } => arguments.len(),
                ContentBlock::ToolResult { content, .. } => content.len() * 16,
                ContentBlock::Image { .. } => 256,
            };
        }
    }
    (chars / 4) as u64
}

/// The chunks that stream `blocks` the way an adapter would: per block a
/// start, one delta, an end; then usage and finish.
pub fn chunks_for(
    blocks: &[ContentBlock],
    usage: TokenUsage,
    finish: FinishReason,
) -> Vec<StreamChunk> {
    let mut out = Vec::with_capacity(blocks.len() * 3 + 2);
    for (i, block) in blocks.iter().enumerate() {
        let index = i as u32;
        out.push(StreamChunk::BlockStart {
            index,
            block_type: block.kind(),
        });
        match block {
            ContentBlock::Text { text } => out.push(StreamChunk::TextDelta {
                index,
                text: text.clone(),
            }),
            ContentBlock::Reasoning { text } => out.push(StreamChunk::ReasoningDelta {
                index,
                text: text.clone(),
            }),
            ContentBlock::ToolCall {
                id,
                name,
                arguments,
            } => out.push(StreamChunk::ToolCallDelta {
                index,
                id: id.clone(),
                name: Some(name.clone()),
                arguments_delta: arguments.clone(),
            }),
            _ => {}
        }
        out.push(StreamChunk::BlockEnd {
            index,
            block: block.clone(),
        });
    }
    out.push(StreamChunk::Usage { usage });
    out.push(StreamChunk::Finish {
        reason: finish,
        replay_state: None,
    });
    out
}

impl LlmAdapter for ScriptedModel {
    fn name(&self) -> &str {
        "scripted"
    }

    fn stream(&self, request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        let at = self.cursor.fetch_add(1, Ordering::Relaxed);
        let result: Vec<Result<StreamChunk, LlmFailure>> = match self.steps.get(at) {
            None => vec![Err(LlmFailure::new(
                code::SCRIPT_EXHAUSTED,
                format!(
                    "the script has {} steps and call {} asked for another",
                    self.steps.len(),
                    at + 1
                ),
            ))],
            Some(ScriptStep { error: Some(e), .. }) => vec![Err(LlmFailure {
                status: e.status,
                ..LlmFailure::new(&e.code, e.message.clone())
            })],
            Some(step) => {
                let mut blocks = Vec::new();
                if let Some(r) = &step.reasoning {
                    blocks.push(ContentBlock::Reasoning { text: r.clone() });
                }
                if let Some(t) = &step.text {
                    blocks.push(ContentBlock::text(t.clone()));
                }
                for (i, call) in step.tool_calls.iter().enumerate() {
                    blocks.push(ContentBlock::ToolCall {
                        id: call.id.clone().unwrap_or_else(|| format!("call_{n}_{i}")),
                        name: call.name.clone(),
                        arguments: call.arguments.to_string(),
                    });
                }
                let finish = if step.cut {
                    FinishReason::MaxTokens
                } else if step.tool_calls.is_empty() {
                    FinishReason::Stop
                } else {
                    FinishReason::ToolCalls
                };
                let output: usize = blocks
                    .iter()
                    .map(|b| match b {
                        ContentBlock::Text { text } | ContentBlock::Reasoning { text } => {
                            text.len()
                        }
                        ContentBlock::ToolCall { arguments, .. } => arguments.len(),
                        _ => 0,
                    })
                    .sum();
                let usage = TokenUsage {
                    input_tokens: estimate_tokens(&request),
                    output_tokens: (output / 4) as u64 + 1,
                    ..TokenUsage::default()
                };
                chunks_for(&blocks, usage, finish)
                    .into_iter()
                    .map(Ok)
                    .collect()
            }
        };
        Box::pin(futures::stream::iter(result).take_until(cancel.cancelled_owned()))
    }
}
