//! The built-in keyless demo model: a pure function of the conversation, so
//! concurrent children get deterministic answers with no script cursor.
//!
//! - A worker with a `report` tool (a Ralph round) reports a handoff:
//!   `continue` until round 3 (or the cap, if lower), then `complete`.
//! - After its tool result it answers `Handoff reported.`
//! - Any other prompt gets one line about its subject.

use crate::llm::{ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmRequest, TokenUsage};
use crate::providers::scripted::chunks_for;
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// The demo model.
pub struct DemoModel;

fn number_after(text: &str, key: &str) -> Option<u32> {
    let at = text.find(key)? + key.len();
    text[at..]
        .split(|c: char| !c.is_ascii_digit())
        .find(|s| !s.is_empty())?
        .parse()
        .ok()
}

/// What the demo says about a subject.
fn line_about(subject: &str) -> String {
    let s = subject.trim().trim_end_matches('.');
    match s {
        "actors" => "actors: every agent, tool call and workflow run is a supervised actor.".into(),
        "supervision" => {
            "supervision: ownership is the tree; a failing child is reported, never silently lost."
                .into()
        }
        "teardown" => {
            "teardown: children stop in reverse start order before their parent's effects.".into()
        }
        other => format!("{other}: noted."),
    }
}

impl LlmAdapter for DemoModel {
    fn name(&self) -> &str {
        "demo"
    }

    fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
        let prompt = request
            .messages
            .iter()
            .rev()
            .find(|m| m.source.kind == "user")
            .map(|m| m.text())
            .unwrap_or_default();
        let answered = request
            .messages
            .last()
            .is_some_and(|m| m.source.kind == "tool");
        let reports = request.tools.iter().any(|t| t.name == "report");
        let (blocks, finish) = if reports && !answered {
            let round = number_after(&prompt, "Ralph round ").unwrap_or(1);
            let cap = number_after(&prompt, " of ").unwrap_or(3);
            let handoff = if round >= cap.min(3) {
                json!({
                    "status": "complete",
                    "summary": format!("Round {round}: the notes are written and reviewed."),
                    "evidence": ["NOTES.md lists every change of the release"],
                    "next_steps": []
                })
            } else {
                json!({
                    "status": "continue",
                    "summary": format!("Round {round}: drafted part {round} of the notes."),
                    "evidence": [format!("part {round} is in NOTES.md")],
                    "next_steps": [format!("draft part {}", round + 1)]
                })
            };
            let call = ContentBlock::ToolCall {
                id: format!("call_report_{round}"),
                name: "report".into(),
                arguments: handoff.to_string(),
            };
            (vec![call], FinishReason::ToolCalls)
        } else if answered {
            (
                vec![ContentBlock::text("Handoff reported.")],
                FinishReason::Stop,
            )
        } else {
            let first = prompt.lines().next().unwrap_or_default();
            let text = match first.strip_prefix("Write one line about ") {
                Some(subject) => line_about(subject),
                None => format!("Done: {first}"),
            };
            (vec![ContentBlock::text(text)], FinishReason::Stop)
        };
        let usage = TokenUsage {
            input_tokens: request.messages.len() as u64 * 8,
            output_tokens: 12,
            ..TokenUsage::default()
        };
        Box::pin(futures::stream::iter(
            chunks_for(&blocks, usage, finish).into_iter().map(Ok),
        ))
    }
}
