//! Model-free pruning, the first answer to a filling context window: every
//! tool result on the surface whose text runs past [`THRESHOLD`] code
//! points is replaced by its first [`HEAD`] and last [`TAIL`] code points
//! around [`MARKER`], with no model call. Only if that is not enough does
//! compaction summarise.
//!
//! Each replacement is logged as upstream's harness logs it: a
//! `compaction/prune` naming the shadowed node and its estimated tokens,
//! then a `tool/result` with the original's turn, step, call, error and
//! meta, only the content changed, replacing the original on the surface.
//! The original stays in the log. A pruned result is within the threshold,
//! so a second pass replaces nothing.

use std::sync::Arc;

use dsh_services::llm::{ContentBlock, Message};
use dsh_services::session::{EventData, SurfaceIntent, SurfaceOp};
use serde_json::json;

use super::Agent;
use super::budget::price;
use super::log_append;

/// A tool result is pruned past this many code points of text.
pub const THRESHOLD: usize = 8192;

/// Leading code points a pruned result keeps.
pub const HEAD: usize = 4096;

/// Trailing code points a pruned result keeps.
pub const TAIL: usize = 1024;

/// What stands where the middle was.
pub const MARKER: &str = "\n\n[... tool result middle pruned ...]\n\n";

/// Prunes every over-long tool result on the surface; how many it replaced.
pub(super) fn prune_surface(agent: &Agent) -> usize {
    // One snapshot of the surface: (seq, the event's parts, pruned content).
    let over: Vec<_> = agent.inner.session.with_log(|log| {
        log.surface()
            .nodes
            .iter()
            .filter_map(|seq| log.get(*seq))
            .filter_map(|e| match &e.data {
                EventData::ToolResult {
                    turn,
                    step,
                    message,
                    error,
                    meta,
                } => {
                    let pruned = pruned_message(message)?;
                    Some((
                        e.seq,
                        *turn,
                        *step,
                        message.clone(),
                        pruned,
                        error.clone(),
                        meta.clone(),
                    ))
                }
                _ => None,
            })
            .collect()
    });
    let mut replaced = 0;
    for (seq, turn, step, original, pruned, error, meta) in over {
        log_append(
            agent,
            EventData::Other {
                kind: "compaction/prune".into(),
                data: Arc::new(json!({
                    "shadowedRange": {"start": seq, "end": seq},
                    "shadowedSeqs": [seq],
                    "shadowedTokenCount": price(&original),
                })),
            },
            None,
        );
        let appended = log_append(
            agent,
            EventData::ToolResult {
                turn,
                step,
                message: Arc::new(pruned),
                error,
                meta,
            },
            Some(SurfaceIntent {
                surface_op: SurfaceOp::Replace {
                    start: seq,
                    end: seq,
                },
                source_event_seqs: Some(vec![seq]),
            }),
        );
        replaced += usize::from(appended.is_some());
    }
    replaced
}

/// `message` with each over-long tool-result block pruned, or `None` when
/// none is.
fn pruned_message(message: &Message) -> Option<Message> {
    let mut changed = false;
    let content = message
        .content
        .iter()
        .map(|block| match block {
            ContentBlock::ToolResult {
                tool_call_id,
                content,
                is_error,
            } => match prune_blocks(content) {
                Some(content) => {
                    changed = true;
                    ContentBlock::ToolResult {
                        tool_call_id: tool_call_id.clone(),
                        content,
                        is_error: *is_error,
                    }
                }
                None => block.clone(),
            },
            other => other.clone(),
        })
        .collect();
    changed.then(|| Message {
        content,
        ..message.clone()
    })
}

/// `blocks` with their text cut to [`HEAD`] + [`MARKER`] + [`TAIL`] code
/// points, other blocks kept where they were; `None` within
/// [`THRESHOLD`].
pub fn prune_blocks(blocks: &[ContentBlock]) -> Option<Vec<ContentBlock>> {
    let text_of = |b: &ContentBlock| match b {
        ContentBlock::Text { text } => Some(text.chars().count()),
        _ => None,
    };
    let total: usize = blocks.iter().filter_map(text_of).sum();
    if total <= THRESHOLD {
        return None;
    }
    let tail_from = total - TAIL;
    let mut at = 0;
    let mut out = Vec::with_capacity(blocks.len() + 1);
    for block in blocks {
        let ContentBlock::Text { text } = block else {
            out.push(block.clone());
            continue;
        };
        let len = text.chars().count();
        let mut kept = String::new();
        for (i, c) in text.chars().enumerate() {
            let global = at + i;
            if global == HEAD {
                kept.push_str(MARKER);
            }
            if global < HEAD || global >= tail_from {
                kept.push(c);
            }
        }
        at += len;
        if !kept.is_empty() {
            out.push(ContentBlock::Text { text: kept });
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image() -> ContentBlock {
        ContentBlock::Image {
            fields: serde_json::Map::new(),
        }
    }

    /// The text of several blocks is cut as one text, on code points (a
    /// multi-byte character is never split); other blocks keep their place.
    #[test]
    fn text_across_blocks_is_cut_on_code_points_around_other_blocks() {
        let blocks = vec![
            ContentBlock::text("é".repeat(3000)),
            image(),
            ContentBlock::text("ü".repeat(6000)),
        ];
        let out = prune_blocks(&blocks).expect("9,000 code points is over");
        assert!(matches!(out[1], ContentBlock::Image { .. }));
        let ContentBlock::Text { text: head } = &out[0] else {
            panic!("{out:?}")
        };
        assert_eq!(head, &"é".repeat(3000));
        let ContentBlock::Text { text: rest } = &out[2] else {
            panic!("{out:?}")
        };
        let expected = format!("{}{MARKER}{}", "ü".repeat(HEAD - 3000), "ü".repeat(TAIL));
        assert_eq!(rest, &expected);
        // Within the threshold now: a second pass leaves it.
        assert!(prune_blocks(&out).is_none());
        assert!(prune_blocks(&[ContentBlock::text("a".repeat(THRESHOLD))]).is_none());
    }
}
