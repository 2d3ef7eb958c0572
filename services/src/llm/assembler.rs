//! `BlockAssembler`: folds a `StreamChunk` stream back into content blocks,
//! usage, finish reason and replay state. The one shared implementation; the
//! agent loop logs raw chunks and feeds the same chunks here.

use super::{
    BlockType, ContentBlock, FinishReason, Message, MessageSource, ReplayEnvelope, Role,
    StreamChunk, TokenUsage,
};

/// A block that deltas alone cannot rebuild (an image, a tool result) and
/// whose `block-end` never came. The stream is malformed; not retryable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "block {index} of type {kind:?} was never closed by block-end and cannot be assembled from deltas"
)]
pub struct UnclosedBlock {
    /// The block's index.
    pub index: u32,
    /// Its type.
    pub kind: BlockType,
}

#[derive(Debug)]
struct Slot {
    index: u32,
    kind: Option<BlockType>,
    text: String,
    call_id: String,
    name: String,
    closed: Option<ContentBlock>,
}

impl Slot {
    fn assemble(&self) -> Result<ContentBlock, UnclosedBlock> {
        if let Some(b) = &self.closed {
            return Ok(b.clone());
        }
        match self.kind {
            Some(BlockType::Text) | None => Ok(ContentBlock::Text {
                text: self.text.clone(),
            }),
            Some(BlockType::Reasoning) => Ok(ContentBlock::Reasoning {
                text: self.text.clone(),
            }),
            Some(BlockType::ToolCall) => Ok(ContentBlock::ToolCall {
                id: self.call_id.clone(),
                name: self.name.clone(),
                arguments: self.text.clone(),
            }),
            Some(kind) => Err(UnclosedBlock {
                index: self.index,
                kind,
            }),
        }
    }
}

/// Incrementally assembles raw chunks into blocks and a final message.
#[derive(Debug, Default)]
pub struct BlockAssembler {
    slots: Vec<Slot>,
    usage: Option<TokenUsage>,
    finish: Option<FinishReason>,
    replay: Option<ReplayEnvelope>,
}

impl BlockAssembler {
    /// An empty assembler.
    pub fn new() -> BlockAssembler {
        BlockAssembler::default()
    }

    fn slot(&mut self, index: u32) -> &mut Slot {
        let pos = match self.slots.iter().position(|s| s.index == index) {
            Some(p) => p,
            None => {
                self.slots.push(Slot {
                    index,
                    kind: None,
                    text: String::new(),
                    call_id: String::new(),
                    name: String::new(),
                    closed: None,
                });
                self.slots.len() - 1
            }
        };
        &mut self.slots[pos]
    }

    /// Feeds one chunk, in stream order. Deltas for a block already closed
    /// by `block-end` are ignored (a malformed stream cannot grow a block).
    pub fn push(&mut self, chunk: &StreamChunk) {
        match chunk {
            StreamChunk::BlockStart { index, block_type } => {
                let slot = self.slot(*index);
                if slot.closed.is_none() {
                    slot.kind = Some(*block_type);
                }
            }
            StreamChunk::TextDelta { index, text }
            | StreamChunk::ReasoningDelta { index, text } => {
                let kind = if matches!(chunk, StreamChunk::TextDelta { .. }) {
                    BlockType::Text
                } else {
                    BlockType::Reasoning
                };
                let slot = self.slot(*index);
                if slot.closed.is_none() {
                    slot.kind.get_or_insert(kind);
                    slot.text.push_str(text);
                }
            }
            StreamChunk::ToolCallDelta {
                index,
                id,
                name,
                arguments_delta,
            } => {
                let slot = self.slot(*index);
                if slot.closed.is_none() {
                    slot.kind.get_or_insert(BlockType::ToolCall);
                    if slot.call_id.is_empty() {
                        slot.call_id.clone_from(id);
                    }
                    if let Some(n) = name
                        && slot.name.is_empty()
                    {
                        slot.name.clone_from(n);
                    }
                    slot.text.push_str(arguments_delta);
                }
            }
            StreamChunk::BlockEnd { index, block } => {
                let slot = self.slot(*index);
                if slot.closed.is_none() {
                    slot.kind = Some(block.kind());
                    slot.closed = Some(block.clone());
                    slot.text = String::new();
                }
            }
            StreamChunk::Usage { usage } => self.usage = Some(*usage),
            StreamChunk::Finish {
                reason,
                replay_state,
            } => {
                self.finish = Some(reason.clone());
                self.replay = replay_state.as_deref().cloned();
            }
        }
    }

    fn drops_tool_calls(&self) -> bool {
        matches!(self.finish, Some(FinishReason::MaxTokens))
    }

    /// All blocks seen so far, in first-seen order; a `max-tokens` finish
    /// drops every tool call (a truncated call is unsafe to run).
    pub fn blocks(&self) -> Result<Vec<ContentBlock>, UnclosedBlock> {
        let drop_calls = self.drops_tool_calls();
        let mut out = Vec::with_capacity(self.slots.len());
        for slot in &self.slots {
            let block = slot.assemble()?;
            if drop_calls && block.kind() == BlockType::ToolCall {
                continue;
            }
            out.push(block);
        }
        Ok(out)
    }

    /// The prefix a cancelled stream can keep: text and reasoning blocks
    /// (closed or open) with non-whitespace content. Tool calls are left out.
    pub fn interrupted_blocks(&self) -> Vec<ContentBlock> {
        self.slots
            .iter()
            .filter_map(|s| s.assemble().ok())
            .filter(|b| match b {
                ContentBlock::Text { text } | ContentBlock::Reasoning { text } => {
                    !text.trim().is_empty()
                }
                _ => false,
            })
            .collect()
    }

    /// Usage, once a `usage` chunk arrived.
    pub fn usage(&self) -> Option<TokenUsage> {
        self.usage
    }

    /// The finish reason; `stop` when the stream ended without one.
    pub fn finish(&self) -> FinishReason {
        self.finish.clone().unwrap_or(FinishReason::Stop)
    }

    /// Whether a `finish` chunk arrived.
    pub fn finished(&self) -> bool {
        self.finish.is_some()
    }

    /// Replay metadata with per-block entries pruned in step with
    /// [`BlockAssembler::blocks`]; `None` when the entries do not align.
    pub fn replay_state(&self) -> Option<ReplayEnvelope> {
        let env = self.replay.as_ref()?;
        let Some(entries) = &env.blocks else {
            return Some(env.clone());
        };
        if entries.len() != self.slots.len() {
            return None;
        }
        let drop_calls = self.drops_tool_calls();
        let kept = self
            .slots
            .iter()
            .zip(entries)
            .filter(|(s, _)| !(drop_calls && s.kind == Some(BlockType::ToolCall)))
            .map(|(_, e)| e.clone())
            .collect();
        Some(ReplayEnvelope {
            response: env.response.clone(),
            blocks: Some(kept),
        })
    }

    /// The assembled assistant message.
    pub fn message(&self, source: MessageSource) -> Result<Message, UnclosedBlock> {
        Ok(Message {
            id: Message::new_id(),
            role: Role::Assistant,
            content: self.blocks()?,
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(chunks: &[StreamChunk]) -> BlockAssembler {
        let mut a = BlockAssembler::new();
        for c in chunks {
            a.push(c);
        }
        a
    }

    #[test]
    fn assembles_interleaved_blocks_and_split_arguments() {
        let a = feed(&[
            StreamChunk::BlockStart {
                index: 0,
                block_type: BlockType::Reasoning,
            },
            StreamChunk::ReasoningDelta {
                index: 0,
                text: "think".into(),
            },
            StreamChunk::ToolCallDelta {
                index: 1,
                id: "c1".into(),
                name: Some("bash".into()),
                arguments_delta: "{\"com".into(),
            },
            StreamChunk::TextDelta {
                index: 2,
                text: "hi".into(),
            },
            StreamChunk::ToolCallDelta {
                index: 1,
                id: "c1".into(),
                name: None,
                arguments_delta: "mand\":\"ls\"}".into(),
            },
            StreamChunk::Usage {
                usage: TokenUsage {
                    input_tokens: 5,
                    output_tokens: 7,
                    ..TokenUsage::default()
                },
            },
            StreamChunk::Finish {
                reason: FinishReason::ToolCalls,
                replay_state: None,
            },
        ]);
        assert_eq!(
            a.blocks().unwrap(),
            vec![
                ContentBlock::Reasoning {
                    text: "think".into()
                },
                ContentBlock::ToolCall {
                    id: "c1".into(),
                    name: "bash".into(),
                    arguments: "{\"command\":\"ls\"}".into()
                },
                ContentBlock::Text { text: "hi".into() },
            ]
        );
        assert_eq!(a.usage().unwrap().output_tokens, 7);
        assert_eq!(a.finish(), FinishReason::ToolCalls);
    }

    #[test]
    fn block_end_wins_and_later_deltas_are_ignored() {
        let a = feed(&[
            StreamChunk::TextDelta {
                index: 0,
                text: "par".into(),
            },
            StreamChunk::BlockEnd {
                index: 0,
                block: ContentBlock::text("partial!"),
            },
            StreamChunk::TextDelta {
                index: 0,
                text: "garbage".into(),
            },
        ]);
        assert_eq!(a.blocks().unwrap(), vec![ContentBlock::text("partial!")]);
        assert_eq!(a.finish(), FinishReason::Stop);
        assert!(!a.finished());
    }

    #[test]
    fn max_tokens_drops_tool_calls_and_prunes_replay_entries() {
        let a = feed(&[
            StreamChunk::TextDelta {
                index: 0,
                text: "a".into(),
            },
            StreamChunk::ToolCallDelta {
                index: 1,
                id: "c".into(),
                name: Some("x".into()),
                arguments_delta: "{\"tru".into(),
            },
            StreamChunk::Finish {
                reason: FinishReason::MaxTokens,
                replay_state: Some(Box::new(ReplayEnvelope {
                    response: serde_json::json!({"id": "r"}),
                    blocks: Some(vec![serde_json::json!("t"), serde_json::json!("c")]),
                })),
            },
        ]);
        assert_eq!(a.blocks().unwrap(), vec![ContentBlock::text("a")]);
        assert_eq!(
            a.replay_state().unwrap().blocks.unwrap(),
            vec![serde_json::json!("t")]
        );
    }

    #[test]
    fn an_interrupted_stream_keeps_only_visible_prefix() {
        let a = feed(&[
            StreamChunk::ReasoningDelta {
                index: 0,
                text: "  ".into(),
            },
            StreamChunk::TextDelta {
                index: 1,
                text: "Hello, wor".into(),
            },
            StreamChunk::ToolCallDelta {
                index: 2,
                id: "c".into(),
                name: Some("x".into()),
                arguments_delta: "{".into(),
            },
        ]);
        assert_eq!(
            a.interrupted_blocks(),
            vec![ContentBlock::text("Hello, wor")]
        );
    }

    #[test]
    fn an_unclosed_unknown_block_is_an_error() {
        let a = feed(&[StreamChunk::BlockStart {
            index: 0,
            block_type: BlockType::Image,
        }]);
        let err = a.blocks().unwrap_err();
        assert_eq!(
            err,
            UnclosedBlock {
                index: 0,
                kind: BlockType::Image
            }
        );
        assert!(err.to_string().contains("never closed"), "{err}");
    }
}
