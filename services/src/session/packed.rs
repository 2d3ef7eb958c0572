//! Packed stream chunks. Once a step's `assistant/message` is committed,
//! the `assistant/chunk` events it was streamed in are kept as one run:
//! per chunk its kind, block index, time and where its text sits in one
//! buffer, with the block ends and usage pointing into the answer (the
//! event right after the run, which the log hands in). A run expands back
//! into the very events it replaced, seq and time included, so the log's
//! readers see no difference.
//!
//! A chunk whose shape has no compact form (a tool-call delta for a call
//! the answer does not hold, a failed finish or one with replay state, a
//! block end or usage the answer does not hold) is kept whole in the run.

use std::sync::Arc;

use super::event::{EventData, SessionEvent};
use crate::llm::{BlockType, ContentBlock, FinishReason, Message, StreamChunk, TokenUsage};

/// One step's chunks, packed.
#[derive(Clone, Debug)]
pub(super) struct ChunkRun {
    /// Seq of the first chunk.
    first: u64,
    /// Time of the first chunk; every item's time is an offset from it.
    time0: u64,
    items: Box<[Item]>,
    /// Every text and reasoning delta, one after another.
    text: Box<str>,
    /// The chunks kept whole.
    whole: Box<[StreamChunk]>,
}

/// What a run is packed against and expanded with: its step's answer.
pub(super) struct Answer<'a> {
    pub turn: u32,
    pub step: u32,
    pub message: &'a Message,
    pub usage: Option<&'a TokenUsage>,
}

impl<'a> Answer<'a> {
    /// The answer an `assistant/message` event holds.
    pub(super) fn of(event: &'a SessionEvent) -> Option<Answer<'a>> {
        match &event.data {
            EventData::AssistantMessage {
                turn,
                step,
                message,
                usage,
                ..
            } => Some(Answer {
                turn: *turn,
                step: *step,
                message,
                usage: usage.as_deref(),
            }),
            _ => None,
        }
    }
}

/// One packed chunk: 20 bytes where an event took about 200.
#[derive(Clone, Copy, Debug)]
struct Item {
    /// Milliseconds after `time0`.
    since: u32,
    index: u32,
    /// Text offset (deltas), block position (ends) or entry in `whole`.
    at: u32,
    /// Text length (deltas).
    len: u32,
    kind: Kind,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Start(BlockType),
    Text,
    Reasoning,
    /// A block end whose block is the answer's block at `at`.
    End,
    /// A tool-call delta for the answer's call at `block`: its arguments
    /// piece in the text, its name (when `named`) and id the call's.
    Call {
        block: u16,
        named: bool,
    },
    /// Usage equal to the answer's.
    Usage,
    /// A finish without replay state.
    Finish(Finished),
    Whole,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Finished {
    Stop,
    ToolCalls,
    MaxTokens,
}

impl ChunkRun {
    /// Packs `events` (contiguous chunks, right before their step's
    /// `answer`). `None` when one of them is not a plain chunk of that step,
    /// or a time or length does not fit.
    pub(super) fn pack<'a>(
        events: impl Iterator<Item = &'a Arc<SessionEvent>> + Clone,
        answer: &Answer<'_>,
    ) -> Option<ChunkRun> {
        let Answer {
            turn, step, usage, ..
        } = *answer;
        let message = answer.message;
        let first = events.clone().next()?;
        let time0 = first.time;
        let mut items = Vec::with_capacity(events.clone().count());
        let mut text = String::new();
        let mut whole = Vec::new();
        let mut next_block = 0usize;
        for (i, e) in events.clone().enumerate() {
            let EventData::AssistantChunk {
                turn: t,
                step: s,
                chunk,
            } = &e.data
            else {
                return None;
            };
            if (*t, *s) != (turn, step) || e.seq != first.seq + i as u64 || e.has_meta() {
                return None;
            }
            let since = u32::try_from(e.time.checked_sub(time0)?).ok()?;
            let item = Item {
                since,
                index: 0,
                at: 0,
                len: 0,
                kind: Kind::Whole,
            };
            let item = match &**chunk {
                StreamChunk::BlockStart { index, block_type } => Item {
                    index: *index,
                    kind: Kind::Start(*block_type),
                    ..item
                },
                StreamChunk::TextDelta { index, text: piece } => delta(
                    &mut text,
                    piece,
                    Item {
                        index: *index,
                        kind: Kind::Text,
                        ..item
                    },
                )?,
                StreamChunk::ReasoningDelta { index, text: piece } => delta(
                    &mut text,
                    piece,
                    Item {
                        index: *index,
                        kind: Kind::Reasoning,
                        ..item
                    },
                )?,
                StreamChunk::BlockEnd { index, block } => {
                    // Usually the next block of the answer; else any.
                    let found = if message.content.get(next_block) == Some(block) {
                        Some(next_block)
                    } else {
                        message.content.iter().position(|b| b == block)
                    };
                    match found {
                        Some(at) => {
                            next_block = at + 1;
                            Item {
                                index: *index,
                                at: u32::try_from(at).ok()?,
                                kind: Kind::End,
                                ..item
                            }
                        }
                        None => keep(&mut whole, chunk, item)?,
                    }
                }
                StreamChunk::ToolCallDelta {
                    index,
                    id,
                    name,
                    arguments_delta,
                } => match call_of(message, id, name.as_deref()) {
                    Some(kind) => delta(
                        &mut text,
                        arguments_delta,
                        Item {
                            index: *index,
                            kind,
                            ..item
                        },
                    )?,
                    None => keep(&mut whole, chunk, item)?,
                },
                StreamChunk::Finish {
                    reason,
                    replay_state: None,
                } => match finished(reason) {
                    Some(f) => Item {
                        kind: Kind::Finish(f),
                        ..item
                    },
                    None => keep(&mut whole, chunk, item)?,
                },
                StreamChunk::Usage { usage: u } if Some(u) == usage => Item {
                    kind: Kind::Usage,
                    ..item
                },
                _ => keep(&mut whole, chunk, item)?,
            };
            items.push(item);
        }
        let run = ChunkRun {
            first: first.seq,
            time0,
            items: items.into_boxed_slice(),
            text: text.into_boxed_str(),
            whole: whole.into_boxed_slice(),
        };
        debug_assert!(
            events
                .enumerate()
                .all(|(i, e)| run.expand(i, answer).as_ref() == Some(e.as_ref())),
            "a packed run expands to the events it replaced"
        );
        Some(run)
    }

    /// The seq of the run's first chunk.
    pub(super) fn first(&self) -> u64 {
        self.first
    }

    /// How many chunks the run holds.
    pub(super) fn len(&self) -> usize {
        self.items.len()
    }

    /// The run's `i`-th chunk as the event it was.
    pub(super) fn expand(&self, i: usize, answer: &Answer<'_>) -> Option<SessionEvent> {
        let item = self.items.get(i)?;
        let text = |item: &Item| {
            let at = item.at as usize;
            self.text.get(at..at + item.len as usize).map(str::to_owned)
        };
        let chunk = match item.kind {
            Kind::Start(block_type) => StreamChunk::BlockStart {
                index: item.index,
                block_type,
            },
            Kind::Text => StreamChunk::TextDelta {
                index: item.index,
                text: text(item)?,
            },
            Kind::Reasoning => StreamChunk::ReasoningDelta {
                index: item.index,
                text: text(item)?,
            },
            Kind::End => StreamChunk::BlockEnd {
                index: item.index,
                block: answer.message.content.get(item.at as usize)?.clone(),
            },
            Kind::Call { block, named } => {
                let ContentBlock::ToolCall { id, name, .. } =
                    answer.message.content.get(usize::from(block))?
                else {
                    return None;
                };
                StreamChunk::ToolCallDelta {
                    index: item.index,
                    id: id.clone(),
                    name: named.then(|| name.clone()),
                    arguments_delta: text(item)?,
                }
            }
            Kind::Usage => StreamChunk::Usage {
                usage: *answer.usage?,
            },
            Kind::Finish(f) => StreamChunk::Finish {
                reason: match f {
                    Finished::Stop => FinishReason::Stop,
                    Finished::ToolCalls => FinishReason::ToolCalls,
                    Finished::MaxTokens => FinishReason::MaxTokens,
                },
                replay_state: None,
            },
            Kind::Whole => self.whole.get(item.at as usize)?.clone(),
        };
        Some(SessionEvent::new(
            self.first + i as u64,
            self.time0 + u64::from(item.since),
            EventData::AssistantChunk {
                turn: answer.turn,
                step: answer.step,
                chunk: Box::new(chunk),
            },
        ))
    }
}

/// The compact kind of a tool-call delta for the answer's call `id`.
fn call_of(answer: &Message, id: &str, name: Option<&str>) -> Option<Kind> {
    let (block, called) = answer
        .content
        .iter()
        .enumerate()
        .find_map(|(i, b)| match b {
            ContentBlock::ToolCall { id: c, name, .. } if c == id => Some((i, name)),
            _ => None,
        })?;
    let named = match name {
        None => false,
        Some(n) if n == called => true,
        Some(_) => return None,
    };
    Some(Kind::Call {
        block: u16::try_from(block).ok()?,
        named,
    })
}

/// The compact form of a finish that carries no failure.
fn finished(reason: &FinishReason) -> Option<Finished> {
    match reason {
        FinishReason::Stop => Some(Finished::Stop),
        FinishReason::ToolCalls => Some(Finished::ToolCalls),
        FinishReason::MaxTokens => Some(Finished::MaxTokens),
        FinishReason::Aborted { .. } | FinishReason::Error { .. } => None,
    }
}

/// Appends a delta's `piece` to the run's text; `item` points at it.
fn delta(text: &mut String, piece: &str, item: Item) -> Option<Item> {
    let at = u32::try_from(text.len()).ok()?;
    let len = u32::try_from(piece.len()).ok()?;
    text.push_str(piece);
    Some(Item { at, len, ..item })
}

/// Keeps `chunk` whole in the run; `item` points at it.
fn keep(whole: &mut Vec<StreamChunk>, chunk: &StreamChunk, item: Item) -> Option<Item> {
    let at = u32::try_from(whole.len()).ok()?;
    whole.push(chunk.clone());
    Some(Item {
        at,
        kind: Kind::Whole,
        ..item
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_packed_chunk_takes_20_bytes_and_a_run_64() {
        assert_eq!(std::mem::size_of::<super::Item>(), 20);
        assert_eq!(std::mem::size_of::<super::ChunkRun>(), 64);
    }
}
