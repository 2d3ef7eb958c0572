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
    /// A sidecar's entry: these chunks as they are, then its end.
    Scripted {
        /// The stream, as the log's `assistant/chunk` rows carry chunks.
        chunks: Vec<StreamChunk>,
        /// What follows them.
        then: Then,
    },
}

/// How a sidecar entry's stream ends after its chunks.
#[derive(Clone, Debug, PartialEq)]
pub enum Then {
    /// Nothing: its chunks end in a `finish` (a `chunks` entry).
    Finished,
    /// The provider call fails (a `throw` entry).
    Throw(LlmFailure),
    /// The stream waits until the call is cancelled (a `hang` entry); the
    /// ready file, if named, is created (by the replaying client) once the
    /// chunks reached the loop.
    Hang {
        /// A relative path.
        ready_file: Option<String>,
    },
}

/// When the recorded client cancelled (see [`ReplayModel::cancel_point`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CancelPoint {
    /// Now: the interrupted (or hanging) step has delivered its prefix;
    /// a sidecar's `hang` may name the file to create then.
    Streaming {
        /// The `hang` entry's `readyFile`.
        ready_file: Option<String>,
    },
    /// Once the session has made this many tool calls in all (the step's
    /// calls are running).
    ToolsStarted {
        /// Tool calls of the session, this step's included.
        calls: usize,
    },
}

/// `blocks` as they streamed before a cancel: their chunks without block
/// ends, usage or finish.
fn prefix_of(blocks: &[ContentBlock]) -> Vec<StreamChunk> {
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
        .collect()
}

/// What a placeholder resolved against the live request starts with.
const PLACEHOLDER: &str = "{{fromRequest:";

/// Every string leaf of `messages`, one per line: what a placeholder's
/// pattern is matched against.
fn corpus_of(messages: &[Arc<crate::llm::Message>]) -> String {
    fn leaves(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::String(s) => out.push(s.clone()),
            serde_json::Value::Array(a) => a.iter().for_each(|v| leaves(v, out)),
            serde_json::Value::Object(o) => o.values().for_each(|v| leaves(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for m in messages {
        if let Ok(v) = serde_json::to_value(&**m) {
            leaves(&v, &mut out);
        }
    }
    out.join("\n")
}

/// `text` with each `{{fromRequest:PATTERN}}` replaced by the pattern's last
/// match in `corpus` (its first group, or the whole match without one). The
/// last two braces of a run of `}` close a placeholder, so a pattern may end
/// in a quantifier (`[0-9a-f]{4}`). A pattern that does not compile, matches
/// nothing, or is not closed is an error saying which.
fn resolve(text: &str, corpus: &str) -> Result<String, String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(PLACEHOLDER) {
        out.push_str(&rest[..at]);
        let body = &rest[at + PLACEHOLDER.len()..];
        // The first run of two or more `}`; its last two close it.
        let mut close = None;
        let bytes = body.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'}' {
                let run = bytes[i..].iter().take_while(|b| **b == b'}').count();
                if run >= 2 {
                    close = Some(i + run - 2);
                    break;
                }
                i += run;
            } else {
                i += 1;
            }
        }
        let Some(end) = close else {
            return Err(format!(
                "a `{PLACEHOLDER}` placeholder is not closed with `}}}}`"
            ));
        };
        let pattern = &body[..end];
        let re = regex::Regex::new(pattern)
            .map_err(|e| format!("the placeholder pattern `{pattern}` does not compile: {e}"))?;
        let found = re.captures_iter(corpus).last().ok_or_else(|| {
            format!("the placeholder pattern `{pattern}` matches nothing in the request")
        })?;
        let value = found
            .get(1)
            .or_else(|| found.get(0))
            .map_or("", |m| m.as_str());
        out.push_str(value);
        rest = &body[end + 2..];
    }
    out.push_str(rest);
    Ok(out)
}

/// The string of `chunk` that [`map_chunk`] maps, if it has one.
fn chunk_text(chunk: &StreamChunk) -> Option<&str> {
    Some(match chunk {
        StreamChunk::TextDelta { text, .. } | StreamChunk::ReasoningDelta { text, .. } => text,
        StreamChunk::ToolCallDelta {
            arguments_delta, ..
        } => arguments_delta,
        StreamChunk::BlockEnd { block, .. } => match block {
            ContentBlock::Text { text } | ContentBlock::Reasoning { text } => text,
            ContentBlock::ToolCall { arguments, .. } => arguments,
            _ => return None,
        },
        _ => return None,
    })
}

/// Whether a string of `chunk` that [`resolve_chunk`] resolves holds a
/// placeholder (the common case, none, costs a substring search).
fn holds_placeholder(chunk: &StreamChunk) -> bool {
    chunk_text(chunk).is_some_and(|t| t.contains(PLACEHOLDER))
}

/// `chunk` with its placeholders resolved (text, reasoning, tool-call
/// arguments, and a finished block's content).
fn resolve_chunk(chunk: StreamChunk, corpus: &str) -> Result<StreamChunk, String> {
    map_chunk(chunk, |t| resolve(t, corpus))
}

/// `chunk` with `f` applied to its strings (text, reasoning, tool-call
/// arguments, and a finished block's content).
fn map_chunk(
    chunk: StreamChunk,
    f: impl Fn(&str) -> Result<String, String>,
) -> Result<StreamChunk, String> {
    let block = |b: ContentBlock| -> Result<ContentBlock, String> {
        Ok(match b {
            ContentBlock::Text { text } => ContentBlock::Text { text: f(&text)? },
            ContentBlock::Reasoning { text } => ContentBlock::Reasoning { text: f(&text)? },
            ContentBlock::ToolCall {
                id,
                name,
                arguments,
            } => ContentBlock::ToolCall {
                id,
                name,
                arguments: f(&arguments)?,
            },
            other => other,
        })
    };
    Ok(match chunk {
        StreamChunk::TextDelta { index, text } => StreamChunk::TextDelta {
            index,
            text: f(&text)?,
        },
        StreamChunk::ReasoningDelta { index, text } => StreamChunk::ReasoningDelta {
            index,
            text: f(&text)?,
        },
        StreamChunk::ToolCallDelta {
            index,
            id,
            name,
            arguments_delta,
        } => StreamChunk::ToolCallDelta {
            index,
            id,
            name,
            arguments_delta: f(&arguments_delta)?,
        },
        StreamChunk::BlockEnd { index, block: b } => StreamChunk::BlockEnd {
            index,
            block: block(b)?,
        },
        other => other,
    })
}

/// The session ids a recording had and the ones its replay has in their
/// place, (recorded, live) pairs, filled as the replay's sessions are
/// created: what a replayed model says about a recorded session (a
/// `send_message` to a child) names the live one, and what the replay wrote
/// reads back in the recording's ids for the comparison.
#[derive(Clone, Debug, Default)]
pub struct Aliases(Arc<std::sync::RwLock<Vec<(String, String)>>>);

impl Aliases {
    /// `live` stands for `recorded` from now on.
    pub fn add(&self, recorded: impl Into<String>, live: impl Into<String>) {
        let (recorded, live) = (recorded.into(), live.into());
        if recorded.is_empty() || recorded == live {
            return;
        }
        let mut pairs = self.0.write().unwrap_or_else(|p| p.into_inner());
        pairs.retain(|(r, _)| *r != recorded);
        pairs.push((recorded, live));
    }

    fn pairs(&self) -> std::sync::RwLockReadGuard<'_, Vec<(String, String)>> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    /// `text` with every recorded id replaced by its live one.
    pub fn to_live(&self, text: &str) -> String {
        self.swap(text, true)
    }

    /// `text` with every live id replaced by the recorded one.
    pub fn to_recorded(&self, text: &str) -> String {
        self.swap(text, false)
    }

    /// One pass over `text`, the longest id matching at each place
    /// replaced (so a replacement is never replaced again).
    fn swap(&self, text: &str, to_live: bool) -> String {
        let pairs = self.pairs();
        let mut keys: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(r, l)| {
                if to_live {
                    (r.as_str(), l.as_str())
                } else {
                    (l.as_str(), r.as_str())
                }
            })
            .filter(|(k, _)| !k.is_empty())
            .collect();
        keys.sort_by_key(|(k, _)| std::cmp::Reverse(k.len()));
        let mut out = String::with_capacity(text.len());
        let mut rest = text;
        'next: while let Some(c) = rest.chars().next() {
            for (from, to) in &keys {
                if let Some(after) = rest.strip_prefix(from) {
                    out.push_str(to);
                    rest = after;
                    continue 'next;
                }
            }
            out.push(c);
            rest = &rest[c.len_utf8()..];
        }
        out
    }

    /// Whether `text` names a recorded id.
    fn names_recorded(&self, text: &str) -> bool {
        self.pairs()
            .iter()
            .any(|(recorded, _)| text.contains(recorded.as_str()))
    }
}

/// What a replayed call waits for before it is served, given the time its
/// answer was recorded at (epoch ms): a replay of several sessions keeps
/// the order in which the recording's sessions went.
pub type Gate = Arc<dyn Fn(u64) -> futures::future::BoxFuture<'static, ()> + Send + Sync>;

/// The `purpose` of an agent's request for a compaction summary.
const COMPACTION_PURPOSE: &str = "compaction";

/// The `purpose` of an agent's request for its session's title.
const TITLE_PURPOSE: &str = "session-title";

/// Serves recorded steps in order.
pub struct ReplayModel {
    steps: Arc<[RecordedStep]>,
    /// When each step's answer was recorded (a sidecar's steps have none).
    times: Arc<[Option<u64>]>,
    /// What a call waits for before its step is served.
    gate: Option<Gate>,
    /// Recorded session ids a step's strings name, and their live ones.
    aliases: Aliases,
    /// The title a provider gave the recorded session: a title request is
    /// answered with it (not a step of the script).
    title: Option<Arc<str>>,
    /// Whether the recorded requests carried images (the recorded model
    /// took them, so the replayed one does).
    images: bool,
    /// The recorded compaction summaries that were local model calls
    /// (`llmStreamCall`), in order: each compaction request is answered
    /// with the next (not a step of the script).
    summaries: Arc<[(String, Option<TokenUsage>)]>,
    summarised: AtomicUsize,
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
        let mut times = Vec::new();
        let mut title = None;
        let mut images = false;
        let mut summaries = Vec::new();
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
                    times.push(Some(e.as_ref().time));
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
                    times.push(Some(e.as_ref().time));
                }
                EventData::TurnEnd { reason, .. } if !answered => {
                    if let TurnEndReason::Error { error } = &**reason {
                        steps.push(RecordedStep::Failed(error.as_ref().clone()));
                        times.push(Some(e.as_ref().time));
                    }
                }
                EventData::UserMessage(message) => {
                    images |= message
                        .content
                        .iter()
                        .any(|b| matches!(b, ContentBlock::Image { .. }));
                }
                EventData::Other { kind, data }
                    if &**kind == "compaction/summary" && data["llmStreamCall"] == true =>
                {
                    if let Some(raw) = data["rawOutput"].as_str() {
                        let usage = serde_json::from_value(data["usage"].clone()).ok();
                        summaries.push((raw.to_owned(), usage));
                    }
                }
                EventData::Other { kind, data }
                    if &**kind == "session/title" && data["source"]["kind"] == "provider" =>
                {
                    title = data["title"].as_str().map(Arc::from);
                }
                _ => {}
            }
        }
        ReplayModel {
            title,
            images,
            summaries: summaries.into(),
            times: times.into(),
            ..ReplayModel::serving(steps)
        }
    }

    /// A model serving `steps`, with nothing else recorded.
    fn serving(steps: Vec<RecordedStep>) -> ReplayModel {
        ReplayModel {
            steps: steps.into(),
            title: None,
            images: false,
            summaries: Arc::from([]),
            summarised: AtomicUsize::new(0),
            cursor: AtomicUsize::new(0),
            cancel_due: Arc::default(),
            due: Arc::default(),
            times: Arc::from([]),
            gate: None,
            aliases: Aliases::default(),
        }
    }

    /// This model with each call waiting on `gate` (given the time the
    /// call's answer was recorded) before it is served.
    pub fn with_gate(self, gate: Gate) -> ReplayModel {
        ReplayModel {
            gate: Some(gate),
            ..self
        }
    }

    /// This model naming live sessions where its steps name recorded ones.
    pub fn with_aliases(self, aliases: Aliases) -> ReplayModel {
        ReplayModel { aliases, ..self }
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

    /// `prefix`, then a wait the call's cancel ends (`ABORTED`); once the
    /// prefix is consumed, the cancel point is due (with `ready_file`).
    fn hang(
        &self,
        prefix: Vec<StreamChunk>,
        ready_file: Option<String>,
        cancel: CancellationToken,
    ) -> ChunkStream {
        let (notify, due) = (self.cancel_due.clone(), self.due.clone());
        let wait = futures::stream::once(async move {
            // Asked for more: what came before is consumed.
            *due.lock().unwrap_or_else(|p| p.into_inner()) =
                Some(CancelPoint::Streaming { ready_file });
            notify.notify_one();
            cancel.cancelled().await;
            Err(LlmFailure::new(
                code::ABORTED,
                "the recorded client cancelled the call",
            ))
        });
        Box::pin(futures::StreamExt::chain(
            futures::stream::iter(prefix.into_iter().map(Ok)),
            wait,
        ))
    }

    /// This model with a `replay.override.json` sidecar applied: a bare
    /// list of entries replaces the derived steps, `{patches}` swaps the
    /// steps it names (an index equal to the count appends one). A `hang`
    /// without chunks in place of an interrupted step streams that step's
    /// recorded prefix first.
    pub fn with_override(self, sidecar: Override) -> Result<ReplayModel, OverrideError> {
        let derived: Vec<RecordedStep> = self.steps.to_vec();
        let interrupted = |at: usize| match derived.get(at) {
            Some(RecordedStep::Interrupted { blocks }) => prefix_of(blocks),
            _ => Vec::new(),
        };
        let step = |at: usize, entry: Entry| -> RecordedStep {
            let Entry { mut chunks, then } = entry;
            if chunks.is_empty() && matches!(then, Then::Hang { .. }) {
                chunks = interrupted(at);
            }
            RecordedStep::Scripted { chunks, then }
        };
        let steps = match sidecar {
            Override::Replace(entries) => entries
                .into_iter()
                .enumerate()
                .map(|(at, e)| step(at, e))
                .collect(),
            Override::Patch(mut patches) => {
                patches.sort_by_key(|(at, _)| *at);
                let mut steps = derived.clone();
                for (at, entry) in patches {
                    if at < steps.len() {
                        steps[at] = step(at, entry);
                    } else if at == steps.len() {
                        steps.push(step(at, entry));
                    } else {
                        return Err(OverrideError(format!(
                            "patch `at: {at}` is past the {} derived calls (at most {} appends one)",
                            derived.len(),
                            steps.len()
                        )));
                    }
                }
                steps
            }
        };
        // A sidecar's step was never recorded: it has no time to keep.
        let times: Vec<Option<u64>> = (0..steps.len())
            .map(|at| match &steps[at] {
                RecordedStep::Scripted { .. } => None,
                _ => self.times.get(at).copied().flatten(),
            })
            .collect();
        Ok(ReplayModel {
            steps: steps.into(),
            times: times.into(),
            ..self
        })
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

    fn titles(&self) -> bool {
        self.title.is_some()
    }

    fn accepts_images(&self, _model: &str) -> bool {
        self.images
    }

    fn stream(&self, request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
        // `{{fromRequest:…}}` in any scripted string, resolved against this
        // request; only read when a chunk holds one.
        let corpus = std::sync::OnceLock::new();
        let messages = request.messages.clone();
        let aliases = self.aliases.clone();
        let resolve = move |chunk: Result<StreamChunk, LlmFailure>| {
            let mut chunk = chunk?;
            if chunk_text(&chunk).is_some_and(|t| aliases.names_recorded(t)) {
                chunk = map_chunk(chunk, |t| Ok(aliases.to_live(t)))
                    .map_err(|why| LlmFailure::new(code::REPLAY_PLACEHOLDER, why))?;
            }
            if !holds_placeholder(&chunk) {
                return Ok(chunk);
            }
            let corpus = corpus.get_or_init(|| corpus_of(&messages));
            resolve_chunk(chunk, corpus)
                .map_err(|why| LlmFailure::new(code::REPLAY_PLACEHOLDER, why))
        };
        Box::pin(futures::StreamExt::map(
            self.serve(request, cancel),
            resolve,
        ))
    }
}

impl ReplayModel {
    /// The call's chunks as scripted, placeholders unresolved.
    fn serve(&self, request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
        if request.purpose == Some(TITLE_PURPOSE) {
            // The recorded title, beside the script: not one of its calls.
            return text_or(self.title.as_deref().map(|t| (t.to_owned(), None)), || {
                "the recording holds no title from a provider".into()
            });
        }
        if request.purpose == Some(COMPACTION_PURPOSE) {
            // The next recorded summary, as one canonical stream.
            let at = self.summarised.fetch_add(1, Ordering::Relaxed);
            return text_or(self.summaries.get(at).cloned(), || {
                format!(
                    "the recording has {} compaction summaries from a model call and the replay asked for number {}",
                    self.summaries.len(),
                    at + 1
                )
            });
        }
        let at = self.cursor.fetch_add(1, Ordering::Relaxed);
        let step = self.step(at, cancel);
        // A cancel the recorded client made while this step's tool calls
        // ran is due once the step is served (after its gate, if any).
        let due = match self.steps.get(at) {
            Some(RecordedStep::Answer {
                cancelled_in_tools: Some(calls),
                ..
            }) => Some(CancelPoint::ToolsStarted { calls: *calls }),
            _ => None,
        };
        match (&self.gate, self.times.get(at).copied().flatten()) {
            (Some(gate), Some(time)) => {
                let (notify, slot) = (self.cancel_due.clone(), self.due.clone());
                let gated = futures::FutureExt::map(gate(time), move |()| {
                    if let Some(point) = due {
                        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(point);
                        notify.notify_one();
                    }
                    step
                });
                Box::pin(futures::StreamExt::flatten(futures::stream::once(gated)))
            }
            _ => {
                if let Some(point) = due {
                    self.cancel_at(point);
                }
                step
            }
        }
    }

    /// Step `at` as it streams.
    fn step(&self, at: usize, cancel: CancellationToken) -> ChunkStream {
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
                return self.hang(prefix_of(blocks), None, cancel);
            }
            Some(RecordedStep::Scripted { chunks, then }) => match then {
                Then::Finished => chunks.iter().cloned().map(Ok).collect(),
                Then::Throw(failure) => chunks
                    .iter()
                    .cloned()
                    .map(Ok)
                    .chain([Err(failure.clone())])
                    .collect(),
                Then::Hang { ready_file } => {
                    return self.hang(chunks.clone(), ready_file.clone(), cancel);
                }
            },
            Some(RecordedStep::Answer {
                blocks, usage, cut, ..
            }) => {
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

/// A recorded text answered beside the script (a title, a compaction
/// summary) as one stream; without one, `REPLAY_EXHAUSTED` saying `why`.
fn text_or(
    recorded: Option<(String, Option<TokenUsage>)>,
    why: impl FnOnce() -> String,
) -> ChunkStream {
    let items: Vec<Result<_, LlmFailure>> = match recorded {
        Some((text, usage)) => chunks_for(
            &[ContentBlock::Text { text }],
            usage.unwrap_or_default(),
            FinishReason::Stop,
        )
        .into_iter()
        .map(Ok)
        .collect(),
        None => vec![Err(LlmFailure::new(code::REPLAY_EXHAUSTED, why()))],
    };
    Box::pin(futures::stream::iter(items))
}

/// A `replay.override.json` sidecar.
#[derive(Clone, Debug, PartialEq)]
pub enum Override {
    /// A bare list: the script, in place of the derived one.
    Replace(Vec<Entry>),
    /// `{patches: [{at, entry}]}`: the derived script with these calls
    /// swapped (0-based; the count itself appends).
    Patch(Vec<(usize, Entry)>),
}

/// One scripted model call of a sidecar.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// Chunks streamed first.
    pub chunks: Vec<StreamChunk>,
    /// What follows them.
    pub then: Then,
}

/// Why a sidecar was refused: where, and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OverrideError(String);

/// An entry as written.
#[derive(serde::Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case", deny_unknown_fields)]
enum EntryDoc {
    Chunks {
        chunks: Vec<StreamChunk>,
    },
    Throw {
        #[serde(default)]
        chunks: Vec<StreamChunk>,
        message: String,
        code: String,
    },
    Hang {
        #[serde(default)]
        chunks: Vec<StreamChunk>,
        #[serde(default, rename = "readyFile")]
        ready_file: Option<String>,
    },
}

/// A patch as written.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchDoc {
    at: usize,
    entry: serde_json::Value,
}

/// The patch form as written.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchesDoc {
    patches: Vec<PatchDoc>,
}

impl Override {
    /// Parses and validates a sidecar: the document's form, each patch and
    /// entry (its kind and fields), every chunk's type; a `chunks` entry
    /// ends in a `finish` and only there; a `readyFile` is a relative path
    /// inside the session's directory; patch indexes are unique.
    pub fn parse(text: &str) -> Result<Override, OverrideError> {
        let doc: serde_json::Value =
            serde_json::from_str(text).map_err(|e| OverrideError(format!("not JSON: {e}")))?;
        match doc {
            serde_json::Value::Array(entries) => entries
                .into_iter()
                .enumerate()
                .map(|(i, e)| entry(e).map_err(|why| OverrideError(format!("entry {i}: {why}"))))
                .collect::<Result<_, _>>()
                .map(Override::Replace),
            serde_json::Value::Object(_) => {
                let doc: PatchesDoc = serde_json::from_value(doc).map_err(|e| {
                    OverrideError(format!(
                        "neither a list of entries nor `{{patches: [{{at, entry}}]}}`: {e}"
                    ))
                })?;
                let mut seen = std::collections::BTreeSet::new();
                let mut out = Vec::new();
                for (i, p) in doc.patches.into_iter().enumerate() {
                    if !seen.insert(p.at) {
                        return Err(OverrideError(format!(
                            "patch {i}: `at: {}` is patched twice",
                            p.at
                        )));
                    }
                    let e = entry(p.entry)
                        .map_err(|why| OverrideError(format!("patch {i} (at {}): {why}", p.at)))?;
                    out.push((p.at, e));
                }
                Ok(Override::Patch(out))
            }
            _ => Err(OverrideError(
                "neither a list of entries nor `{patches: [{at, entry}]}`".into(),
            )),
        }
    }
}

/// One entry, validated.
fn entry(value: serde_json::Value) -> Result<Entry, String> {
    let doc: EntryDoc = serde_json::from_value(value).map_err(|e| e.to_string())?;
    let finished = |chunks: &[StreamChunk]| {
        chunks
            .iter()
            .position(|c| matches!(c, StreamChunk::Finish { .. }))
    };
    match doc {
        EntryDoc::Chunks { chunks } => match finished(&chunks) {
            Some(at) if at + 1 == chunks.len() => Ok(Entry {
                chunks,
                then: Then::Finished,
            }),
            Some(at) => Err(format!(
                "chunk {at} is a `finish`, and chunks follow it (it must be the last)"
            )),
            None => Err("a `chunks` entry must end with a `finish` chunk (a stream that fails is a `throw`)".into()),
        },
        EntryDoc::Throw {
            chunks,
            message,
            code,
        } => {
            if let Some(at) = finished(&chunks) {
                return Err(format!("chunk {at} is a `finish` in a `throw` (the call fails instead)"));
            }
            if code.is_empty() {
                return Err("`code` is empty".into());
            }
            Ok(Entry {
                chunks,
                then: Then::Throw(LlmFailure::new(&code, message)),
            })
        }
        EntryDoc::Hang { chunks, ready_file } => {
            if let Some(at) = finished(&chunks) {
                return Err(format!("chunk {at} is a `finish` in a `hang` (it waits instead)"));
            }
            if let Some(f) = &ready_file {
                let path = std::path::Path::new(f);
                let inside = !f.is_empty()
                    && path.is_relative()
                    && path
                        .components()
                        .all(|c| matches!(c, std::path::Component::Normal(_)));
                if !inside {
                    return Err(format!(
                        "`readyFile: {f:?}` must be a relative path inside the session's directory"
                    ));
                }
            }
            Ok(Entry {
                chunks,
                then: Then::Hang { ready_file },
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    /// Each place takes the longest id that matches there, and what it
    /// becomes is not looked at again (a live id may equal another
    /// recorded one).
    #[test]
    fn aliases_swap_each_id_once_the_longest_first() {
        let a = Aliases::default();
        a.add("abc", "x");
        a.add("abcdef", "abc");
        a.add("", "ignored");
        assert_eq!(a.to_live("abcdef abc-abc"), "abc x-x");
        assert_eq!(a.to_recorded("abc x"), "abcdef abc");
        assert_eq!(a.to_live("é abc"), "é x");
    }

    const FINISHED: &str = r#"{"kind": "chunks", "chunks": [
        {"type": "block-start", "index": 0, "blockType": "text"},
        {"type": "text-delta", "index": 0, "text": "hi"},
        {"type": "finish", "reason": {"kind": "stop"}}]}"#;

    /// Every way a sidecar can be wrong is refused, saying where and what.
    #[test]
    fn a_sidecar_is_validated_when_it_loads() {
        let refused = |text: &str| Override::parse(text).unwrap_err().to_string();
        assert!(refused("{").contains("not JSON"));
        assert!(refused("7").contains("neither a list"));
        assert!(refused(r#"[{"kind": "sing"}]"#).starts_with("entry 0: unknown variant `sing`"));
        assert!(refused(r#"[{"readyFile": "x"}]"#).contains("missing field `kind`"));
        assert!(
            refused(r#"[{"kind": "hang", "readyFile": "x", "extra": 1}]"#)
                .contains("unknown field `extra`")
        );
        assert!(
            refused(r#"[{"kind": "chunks", "chunks": [{"type": "text-delta", "index": 0, "text": "a"}]}]"#)
                .contains("must end with a `finish`")
        );
        assert!(
            refused(r#"[{"kind": "chunks", "chunks": [{"type": "finish", "reason": {"kind": "stop"}}, {"type": "text-delta", "index": 0, "text": "a"}]}]"#)
                .contains("chunks follow it")
        );
        assert!(
            refused(r#"[{"kind": "chunks", "chunks": [{"type": "teleport"}]}]"#)
                .contains("unknown variant `teleport`")
        );
        assert!(
            refused(r#"[{"kind": "throw", "message": "m", "code": ""}]"#)
                .contains("`code` is empty")
        );
        for path in ["/tmp/ready", "../ready", "a/../../b", ""] {
            let doc = format!(r#"[{{"kind": "hang", "readyFile": {path:?}}}]"#);
            assert!(refused(&doc).contains("relative path inside"), "{path}");
        }
        let twice = format!(
            r#"{{"patches": [{{"at": 0, "entry": {FINISHED}}}, {{"at": 0, "entry": {FINISHED}}}]}}"#
        );
        assert!(refused(&twice).contains("patch 1: `at: 0` is patched twice"));
        assert!(refused(r#"{"patches": [], "more": 1}"#).contains("unknown field `more`"));
    }

    fn request(purpose: Option<&'static str>) -> LlmRequest {
        LlmRequest {
            provider: "replay".into(),
            model: "recorded".into(),
            system: None,
            messages: Default::default(),
            tools: Arc::from([]),
            temperature: None,
            max_tokens: None,
            options: Default::default(),
            session: None,
            purpose,
            notify: None,
        }
    }

    async fn items(model: &ReplayModel) -> Vec<Result<StreamChunk, String>> {
        model
            .stream(request(None), CancellationToken::new())
            .map(|r| r.map_err(|f| f.code))
            .collect()
            .await
    }

    /// A bare list replaces the derived script; `chunks` streams as
    /// written, `throw` streams its chunks then fails with its code;
    /// patches swap a derived call and append one at the end.
    #[tokio::test]
    async fn entries_replace_or_patch_the_derived_script() {
        let replaced = ReplayModel::from_events(&Vec::<Arc<SessionEvent>>::new())
            .with_override(
                Override::parse(&format!(
                    r#"[{FINISHED}, {{"kind": "throw", "code": "RATE_LIMITED", "message": "slow down",
                        "chunks": [{{"type": "block-start", "index": 0, "blockType": "text"}}]}}]"#
                ))
                .unwrap(),
            )
            .unwrap();
        assert_eq!(replaced.len(), 2);
        let first = items(&replaced).await;
        assert_eq!(first.len(), 3);
        assert!(matches!(first[1], Ok(StreamChunk::TextDelta { ref text, .. }) if text == "hi"));
        assert!(matches!(first[2], Ok(StreamChunk::Finish { .. })));
        let second = items(&replaced).await;
        assert!(matches!(second[0], Ok(StreamChunk::BlockStart { .. })));
        assert_eq!(second[1], Err("RATE_LIMITED".to_owned()));
        assert_eq!(items(&replaced).await, [Err("REPLAY_EXHAUSTED".to_owned())]);

        // One derived step (a failure), patched at 0 and appended at 1.
        let derived =
            ReplayModel::serving(vec![RecordedStep::Failed(LlmFailure::new("AUTH", "no"))]);
        let doc = format!(
            r#"{{"patches": [{{"at": 1, "entry": {FINISHED}}},
                {{"at": 0, "entry": {{"kind": "throw", "code": "OVERLOADED", "message": "busy"}}}}]}}"#
        );
        let patched = derived
            .with_override(Override::parse(&doc).unwrap())
            .unwrap();
        assert_eq!(items(&patched).await, [Err("OVERLOADED".to_owned())]);
        assert_eq!(items(&patched).await.len(), 3);
        let past = format!(r#"{{"patches": [{{"at": 2, "entry": {FINISHED}}}]}}"#);
        let one = ReplayModel::serving(vec![RecordedStep::Failed(LlmFailure::new("AUTH", "no"))]);
        let e = one
            .with_override(Override::parse(&past).unwrap())
            .err()
            .unwrap();
        assert!(
            e.to_string()
                .contains("`at: 2` is past the 1 derived calls"),
            "{e}"
        );
    }

    /// A `hang` streams its chunks, says the cancel is due with its ready
    /// file, and ends `ABORTED` when the call is cancelled.
    #[tokio::test]
    async fn a_hang_waits_for_the_cancel_and_names_its_ready_file() {
        let model = Arc::new(
            ReplayModel::from_events(&Vec::<Arc<SessionEvent>>::new())
                .with_override(
                    Override::parse(
                        r#"[{"kind": "hang", "readyFile": "ready", "chunks": [
                            {"type": "block-start", "index": 0, "blockType": "text"},
                            {"type": "text-delta", "index": 0, "text": "part"}]}]"#,
                    )
                    .unwrap(),
                )
                .unwrap(),
        );
        let cancel = CancellationToken::new();
        let mut stream = model.stream(request(None), cancel.clone());
        assert!(matches!(
            stream.next().await,
            Some(Ok(StreamChunk::BlockStart { .. }))
        ));
        assert!(matches!(
            stream.next().await,
            Some(Ok(StreamChunk::TextDelta { .. }))
        ));
        let waiting = tokio::spawn(async move { stream.next().await });
        let point = tokio::time::timeout(std::time::Duration::from_secs(10), model.cancel_point())
            .await
            .unwrap();
        assert_eq!(
            point,
            CancelPoint::Streaming {
                ready_file: Some("ready".into())
            }
        );
        cancel.cancel();
        let ended = tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
            .await
            .unwrap()
            .unwrap();
        assert!(matches!(ended, Some(Err(ref f)) if f.code == code::ABORTED));
    }

    /// A title a provider gave the recorded session answers the replay's
    /// title request, beside the script: no step is used for it.
    #[tokio::test]
    async fn a_recorded_title_answers_a_title_request_without_a_step() {
        let log = concat!(
            r#"{"type":"session","version":0,"id":"s1","createdAt":1000,"cwd":"/w","delegationDepth":0}"#,
            "\n",
            r#"{"type":"session/title","data":{"title":"Counting sheep","messageSeqs":[1],"source":{"kind":"provider","provider":"dsh/title"}}}"#,
            "\n",
        );
        let (_, events) = crate::session::jsonl::parse(log).unwrap();
        let model = ReplayModel::from_events(&events);
        assert!(model.titles());
        let said: Vec<_> = model
            .stream(request(Some(TITLE_PURPOSE)), CancellationToken::new())
            .collect()
            .await;
        assert!(
            said.iter().any(
                |c| matches!(c, Ok(StreamChunk::TextDelta { text, .. }) if text == "Counting sheep")
            ),
            "{said:?}"
        );
        assert_eq!(model.served(), 0);
        // A fallback title is not a provider's: nothing to answer with.
        let fallback = log.replace(
            r#""kind":"provider","provider":"dsh/title""#,
            r#""kind":"fallback""#,
        );
        let (_, events) = crate::session::jsonl::parse(&fallback).unwrap();
        assert!(!ReplayModel::from_events(&events).titles());
    }

    /// A recording whose prompts carried images replays on a model that
    /// takes them; one without, on a model that does not.
    #[test]
    fn a_recording_with_images_takes_images() {
        let log = |content: &str| {
            format!(
                "{}\n{{\"type\":\"user/message\",\"data\":{{\"content\":[{content}],\"source\":{{\"kind\":\"user\"}},\"role\":\"user\",\"id\":\"m1\"}}}}\n",
                r#"{"type":"session","version":0,"id":"s1","createdAt":1000,"cwd":"/w","delegationDepth":0}"#
            )
        };
        let with = log(
            r#"{"type":"text","text":"what is this?"},{"type":"image","mimeType":"image/png","path":"a.png"}"#,
        );
        let (_, events) = crate::session::jsonl::parse(&with).unwrap();
        assert!(ReplayModel::from_events(&events).accepts_images("recorded"));
        let without = log(r#"{"type":"text","text":"what is this?"}"#);
        let (_, events) = crate::session::jsonl::parse(&without).unwrap();
        assert!(!ReplayModel::from_events(&events).accepts_images("recorded"));
    }

    /// A placeholder takes the last match of its pattern in the request
    /// (its first group, or all of it); a quantifier's brace may end it;
    /// one that does not compile, matches nothing or is not closed fails.
    #[test]
    fn placeholders_resolve_against_the_request() {
        let corpus = "goal g-1111 set\nthen goal g-2222 set";
        assert_eq!(
            resolve("done: {{fromRequest:goal (g-[0-9]+)}}!", corpus).unwrap(),
            "done: g-2222!"
        );
        assert_eq!(
            resolve("{{fromRequest:g-[0-9]{4}}}", corpus).unwrap(),
            "g-2222"
        );
        assert_eq!(resolve("no placeholder", corpus).unwrap(), "no placeholder");
        assert!(
            resolve("{{fromRequest:(}}", corpus)
                .unwrap_err()
                .contains("does not compile")
        );
        assert!(
            resolve("{{fromRequest:zzz}}", corpus)
                .unwrap_err()
                .contains("matches nothing")
        );
        assert!(
            resolve("{{fromRequest:abc", corpus)
                .unwrap_err()
                .contains("not closed")
        );
    }

    /// A scripted step's placeholder is filled from the live request's
    /// messages; one that matches nothing fails the call loud.
    #[tokio::test]
    async fn a_scripted_step_echoes_what_the_request_holds() {
        let model = ReplayModel::from_events(&Vec::<Arc<SessionEvent>>::new())
            .with_override(
                Override::parse(
                    r#"[{"kind": "chunks", "chunks": [
                        {"type": "block-start", "index": 0, "blockType": "text"},
                        {"type": "text-delta", "index": 0, "text": "goal {{fromRequest:goal id ([a-z0-9-]+)}}"},
                        {"type": "finish", "reason": {"kind": "stop"}}]},
                       {"kind": "chunks", "chunks": [
                        {"type": "text-delta", "index": 0, "text": "{{fromRequest:nowhere}}"},
                        {"type": "finish", "reason": {"kind": "stop"}}]}]"#,
                )
                .unwrap(),
            )
            .unwrap();
        let mut asked = request(None);
        asked.messages = crate::llm::History::of(vec![Arc::new(crate::llm::Message::user_text(
            "the goal id g-7f3a is new",
        ))]);
        let said: Vec<_> = model
            .stream(asked.clone(), CancellationToken::new())
            .collect()
            .await;
        assert!(
            said.iter().any(
                |c| matches!(c, Ok(StreamChunk::TextDelta { text, .. }) if text == "goal g-7f3a")
            ),
            "{said:?}"
        );
        let failed: Vec<_> = model
            .stream(asked, CancellationToken::new())
            .collect()
            .await;
        assert!(
            failed
                .iter()
                .any(|c| matches!(c, Err(f) if f.code == code::REPLAY_PLACEHOLDER)),
            "{failed:?}"
        );
    }

    /// A compaction summary recorded as a local model call answers the
    /// replay's compaction request, beside the script; one recorded without
    /// the marker (a template, a remote summarizer) does not.
    #[tokio::test]
    async fn a_recorded_summary_answers_a_compaction_request_without_a_step() {
        let log = |marked: bool| {
            format!(
                "{}\n{}\n",
                r#"{"type":"session","version":0,"id":"s1","createdAt":1000,"cwd":"/w","delegationDepth":0}"#,
                serde_json::json!({"type": "compaction/summary", "data": {
                    "summary": "we read the files", "rawOutput": "we read the files",
                    "llmStreamCall": marked, "usage": {"inputTokens": 10, "outputTokens": 4}}})
            )
        };
        let (_, events) = crate::session::jsonl::parse(&log(true)).unwrap();
        let model = ReplayModel::from_events(&events);
        let said: Vec<_> = model
            .stream(request(Some(COMPACTION_PURPOSE)), CancellationToken::new())
            .collect()
            .await;
        assert!(
            said.iter().any(|c| matches!(c, Ok(StreamChunk::TextDelta { text, .. }) if text == "we read the files")),
            "{said:?}"
        );
        assert_eq!(model.served(), 0);
        let again: Vec<_> = model
            .stream(request(Some(COMPACTION_PURPOSE)), CancellationToken::new())
            .collect()
            .await;
        assert!(
            matches!(&again[..], [Err(f)] if f.code == code::REPLAY_EXHAUSTED),
            "{again:?}"
        );
        let (_, events) = crate::session::jsonl::parse(&log(false)).unwrap();
        let unmarked: Vec<_> = ReplayModel::from_events(&events)
            .stream(request(Some(COMPACTION_PURPOSE)), CancellationToken::new())
            .collect()
            .await;
        assert!(matches!(&unmarked[..], [Err(_)]), "{unmarked:?}");
    }
}
