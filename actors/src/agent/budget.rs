//! What a conversation costs in the model's context: the estimates
//! compaction and pruning both price messages with.

use dsh_services::llm::{ContentBlock, Message};

/// The estimated tokens of one message: a quarter token per character.
pub(super) fn price(m: &Message) -> u64 {
    (chars_of(m) as u64).div_ceil(4)
}

/// The characters a message puts in the context (a non-text block counts
/// as 256).
pub(super) fn chars_of(m: &Message) -> usize {
    m.content
        .iter()
        .map(|b| match b {
            ContentBlock::Text { text } | ContentBlock::Reasoning { text } => text.len(),
            ContentBlock::ToolCall { arguments, .. } => arguments.len(),
            ContentBlock::ToolResult { content, .. } => content
                .iter()
                .map(|c| match c {
                    ContentBlock::Text { text } => text.len(),
                    _ => 256,
                })
                .sum(),
            _ => 256,
        })
        .sum()
}
