//! The replay model: serves the recorded assistant output of a session log,
//! one recorded step per call, through the normal chunk protocol.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_util::sync::CancellationToken;

use crate::llm::scripted::chunks_for;
use crate::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmFailure, LlmRequest, TokenUsage, code,
};
use crate::session::{EventData, SessionEvent, TurnEndReason};

/// One recorded model answer.
#[derive(Clone, Debug, PartialEq)]
pub enum RecordedStep {
    /// The assembled assistant content of a step.
    Answer {
        /// Content blocks.
        blocks: Vec<ContentBlock>,
        /// Usage, when recorded.
        usage: Option<TokenUsage>,
    },
    /// The step's model call failed.
    Failed(LlmFailure),
}

/// Serves recorded steps in order.
pub struct ReplayModel {
    steps: Arc<[RecordedStep]>,
    cursor: AtomicUsize,
}

impl ReplayModel {
    /// The steps of `events`, in log order: each non-interrupted
    /// `assistant/message`, and each step that ended its turn with an error
    /// without one.
    pub fn from_events(events: &[impl AsRef<SessionEvent>]) -> ReplayModel {
        let mut steps = Vec::new();
        let mut answered = false;
        for e in events {
            match &e.as_ref().data {
                EventData::StepStart { .. } => answered = false,
                EventData::AssistantMessage {
                    message,
                    usage,
                    interrupted: false,
                    ..
                } => {
                    answered = true;
                    steps.push(RecordedStep::Answer {
                        blocks: message.content.clone(),
                        usage: *usage,
                    });
                }
                EventData::TurnEnd {
                    reason: TurnEndReason::Error { error },
                    ..
                } if !answered => steps.push(RecordedStep::Failed(error.as_ref().clone())),
                _ => {}
            }
        }
        ReplayModel {
            steps: steps.into(),
            cursor: AtomicUsize::new(0),
        }
    }

    /// Recorded steps.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Steps served so far.
    pub fn served(&self) -> usize {
        self.cursor.load(Ordering::Relaxed).min(self.steps.len())
    }
}

impl LlmAdapter for ReplayModel {
    fn name(&self) -> &str {
        "replay"
    }

    fn stream(&self, _request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
        let at = self.cursor.fetch_add(1, Ordering::Relaxed);
        let items: Vec<Result<_, LlmFailure>> = match self.steps.get(at) {
            None => vec![Err(LlmFailure::new(
                code::REPLAY_EXHAUSTED,
                format!(
                    "the recording has {} model steps and the replay asked for step {}",
                    self.steps.len(),
                    at + 1
                ),
            ))],
            Some(RecordedStep::Failed(f)) => vec![Err(f.clone())],
            Some(RecordedStep::Answer { blocks, usage }) => {
                let finish = if blocks
                    .iter()
                    .any(|b| matches!(b, ContentBlock::ToolCall { .. }))
                {
                    FinishReason::ToolCalls
                } else {
                    FinishReason::Stop
                };
                chunks_for(blocks, usage.unwrap_or_default(), finish)
                    .into_iter()
                    .map(Ok)
                    .collect()
            }
        };
        Box::pin(futures::stream::iter(items))
    }
}
