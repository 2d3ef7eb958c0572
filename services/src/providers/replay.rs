//! The replay model: serves the recorded assistant output of a session log,
//! one recorded step per call, through the normal chunk protocol.
//!
//! A step the client cancelled mid-stream (an interrupted
//! `assistant/message` in a turn that ended `aborted`) is served as its
//! delivered prefix, then the stream waits: [`ReplayModel::cancel_point`]
//! tells the replaying client that the recording's cancel is due, and the
//! stream ends `ABORTED` once the call is cancelled.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio_util::sync::CancellationToken;

use crate::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmFailure, LlmRequest, StreamChunk,
    TokenUsage, code,
};
use crate::providers::scripted::chunks_for;
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
        /// The output-token ceiling cut the answer (its recorded `finish`
        /// chunk says `max-tokens`).
        cut: bool,
        /// The client cancelled the turn while this step's tool calls ran:
        /// the number of tool calls the session had made by then.
        cancelled_in_tools: Option<usize>,
    },
    /// The step's model call failed.
    Failed(LlmFailure),
    /// The client cancelled the call after these blocks were delivered.
    Interrupted {
        /// The delivered prefix.
        blocks: Vec<ContentBlock>,
    },
}

/// When the recorded client cancelled (see [`ReplayModel::cancel_point`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelPoint {
    /// Now: the interrupted step has delivered its prefix.
    Streaming,
    /// Once the session has made this many tool calls in all (the step's
    /// calls are running).
    ToolsStarted {
        /// Tool calls of the session, this step's included.
        calls: usize,
    },
}

/// Serves recorded steps in order.
pub struct ReplayModel {
    steps: Arc<[RecordedStep]>,
    cursor: AtomicUsize,
    /// Signalled when a recorded cancel is due, with when.
    cancel_due: Arc<tokio::sync::Notify>,
    due: Arc<std::sync::Mutex<Option<CancelPoint>>>,
}

impl ReplayModel {
    /// The steps of `events`, in log order: each non-interrupted
    /// `assistant/message`, and each step that ended its turn with an error
    /// without one.
    pub fn from_events(events: &[impl AsRef<SessionEvent>]) -> ReplayModel {
        let mut steps = Vec::new();
        let mut answered = false;
        let mut cut = false;
        let mut calls = 0usize;
        for e in events {
            match &e.as_ref().data {
                EventData::TurnEnd { reason, .. }
                    if answered && matches!(**reason, TurnEndReason::Aborted { .. }) =>
                {
                    // Aborted after a whole answer: the cancel came while
                    // its tool calls ran.
                    if let Some(RecordedStep::Answer {
                        blocks,
                        cancelled_in_tools,
                        ..
                    }) = steps.last_mut()
                        && blocks
                            .iter()
                            .any(|b| matches!(b, ContentBlock::ToolCall { .. }))
                    {
                        *cancelled_in_tools = Some(calls);
                    }
                }
                EventData::StepStart { .. } => (answered, cut) = (false, false),
                EventData::AssistantChunk { chunk, .. } => {
                    if let StreamChunk::Finish { reason, .. } = &**chunk {
                        cut = *reason == FinishReason::MaxTokens;
                    }
                }
                EventData::AssistantMessage {
                    message,
                    interrupted: true,
                    ..
                } => {
                    answered = true;
                    steps.push(RecordedStep::Interrupted {
                        blocks: message.content.clone(),
                    });
                }
                EventData::AssistantMessage {
                    message,
                    usage,
                    interrupted: false,
                    ..
                } => {
                    answered = true;
                    calls += message.tool_calls().count();
                    steps.push(RecordedStep::Answer {
                        blocks: message.content.clone(),
                        usage: usage.as_deref().copied(),
                        cut,
                        cancelled_in_tools: None,
                    });
                }
                EventData::TurnEnd { reason, .. } if !answered => {
                    if let TurnEndReason::Error { error } = &**reason {
                        steps.push(RecordedStep::Failed(error.as_ref().clone()));
                    }
                }
                _ => {}
            }
        }
        ReplayModel {
            steps: steps.into(),
            cursor: AtomicUsize::new(0),
            cancel_due: Arc::default(),
            due: Arc::default(),
        }
    }

    /// Resolves when a recorded client cancel is due: an interrupted step
    /// has delivered its prefix and its consumer asked for more (cancel
    /// now), or a step whose tool calls the client cancelled was served
    /// (cancel once they run).
    pub async fn cancel_point(&self) -> CancelPoint {
        loop {
            self.cancel_due.notified().await;
            let due = self.due.lock().unwrap_or_else(|p| p.into_inner()).take();
            if let Some(point) = due {
                return point;
            }
        }
    }

    fn cancel_at(&self, point: CancelPoint) {
        *self.due.lock().unwrap_or_else(|p| p.into_inner()) = Some(point);
        self.cancel_due.notify_one();
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

    fn stream(&self, _request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
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
            Some(RecordedStep::Interrupted { blocks }) => {
                // The prefix as it streamed (no block ends, usage or finish),
                // then a wait the recorded cancel ends.
                let prefix: Vec<Result<_, LlmFailure>> =
                    chunks_for(blocks, TokenUsage::default(), FinishReason::Stop)
                        .into_iter()
                        .filter(|c| {
                            !matches!(
                                c,
                                StreamChunk::BlockEnd { .. }
                                    | StreamChunk::Usage { .. }
                                    | StreamChunk::Finish { .. }
                            )
                        })
                        .map(Ok)
                        .collect();
                let (notify, due) = (self.cancel_due.clone(), self.due.clone());
                let wait = futures::stream::once(async move {
                    // Asked for more: what came before is consumed.
                    *due.lock().unwrap_or_else(|p| p.into_inner()) = Some(CancelPoint::Streaming);
                    notify.notify_one();
                    cancel.cancelled().await;
                    Err(LlmFailure::new(
                        code::ABORTED,
                        "the recorded client cancelled the call",
                    ))
                });
                return Box::pin(futures::StreamExt::chain(
                    futures::stream::iter(prefix),
                    wait,
                ));
            }
            Some(RecordedStep::Answer {
                blocks,
                usage,
                cut,
                cancelled_in_tools,
            }) => {
                if let Some(calls) = *cancelled_in_tools {
                    self.cancel_at(CancelPoint::ToolsStarted { calls });
                }
                let finish = if *cut {
                    FinishReason::MaxTokens
                } else if blocks
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
