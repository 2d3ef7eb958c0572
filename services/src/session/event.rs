//! Session events: the envelope and the typed core vocabulary.
//!
//! Core event types are parsed into [`EventData`] variants once, at the
//! boundary (append or load). Types contributed by plugins, and core types
//! the runtime only carries (`agent/inbox/spliced`, `session/title`, …), are
//! kept as [`EventData::Other`] with their JSON payload verbatim.

use std::borrow::Cow;
use std::sync::Arc;

use dsh_supervisors::error::chain;
use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::llm::{LlmFailure, Message, Role, StreamChunk, TokenUsage};

/// How a surface event joined the ordered surface.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SurfaceOp {
    /// Added at the tail.
    Append,
    /// Replaces surface nodes `start..=end` (by seq).
    Replace {
        /// First replaced node.
        start: u64,
        /// Last replaced node.
        end: u64,
    },
}

impl Serialize for SurfaceOp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            SurfaceOp::Append => s.serialize_str("append"),
            SurfaceOp::Replace { start, end } => {
                serde_json::json!({"op": "replace", "start": start, "end": end}).serialize(s)
            }
        }
    }
}

impl<'de> Deserialize<'de> for SurfaceOp {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Replace {
            op: String,
            start: u64,
            end: u64,
        }
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Name(String),
            Replace(Replace),
        }
        match Raw::deserialize(d)? {
            Raw::Name(n) if n == "append" => Ok(SurfaceOp::Append),
            Raw::Name(n) => Err(serde::de::Error::custom(format!(
                "unknown surfaceOp `{n}` (expected \"append\" or a replace object)"
            ))),
            Raw::Replace(r) if r.op == "replace" => Ok(SurfaceOp::Replace {
                start: r.start,
                end: r.end,
            }),
            Raw::Replace(r) => Err(serde::de::Error::custom(format!(
                "unknown surfaceOp op `{}`",
                r.op
            ))),
        }
    }
}

/// Why a turn ended.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum TurnEndReason {
    /// The model finished.
    Completed,
    /// Cancelled; `reason` is the cancel cause (`{kind: "user"}`, …).
    Aborted {
        /// Who cancelled.
        #[serde(default = "legacy_cause")]
        reason: Value,
    },
    /// Blocked by a policy.
    Blocked,
    /// The turn failed.
    Error {
        /// The structured failure.
        error: Box<LlmFailure>,
    },
    /// A step hit the output-token ceiling.
    MaxTokens,
    /// Closed by crash recovery on reload.
    Interrupted,
}

fn legacy_cause() -> Value {
    serde_json::json!({"kind": "legacy"})
}

/// One entry of a `todo/write` snapshot.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TodoItem {
    /// The task line.
    pub content: String,
    /// `pending`, `in_progress` or `completed`.
    pub status: TodoStatus,
}

/// Lifecycle of a todo item.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TodoStatus {
    /// Not started.
    Pending,
    /// Being worked on.
    InProgress,
    /// Done.
    Completed,
}

/// Internal failure identity of a tool result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolErrorId {
    /// Error class name.
    pub name: String,
    /// Stable code (`INVALID_ARGS`, `UNKNOWN_TOOL`, `TIMEOUT`, …).
    pub code: String,
}

/// Route metadata of a request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestContext {
    /// Provider route.
    pub provider: String,
    /// Model id.
    pub model: String,
    /// Context window, when advertised.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_window: Option<u64>,
}

/// One normalized mutation of an agent's pending-message list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InboxSplice {
    /// Which list (`next-turn`, …).
    pub target: String,
    /// Position of the change.
    pub start: u64,
    /// Entries removed at `start`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub removed_count: Option<u64>,
    /// Messages inserted at `start`.
    pub inserted: Vec<Arc<Message>>,
    /// Set when the removal cancelled queued input.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<String>,
}

/// What a `tool/call` event records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCallEvent {
    /// Call id.
    pub call_id: Box<str>,
    /// Tool name.
    pub name: Box<str>,
    /// Raw JSON arguments.
    pub arguments: Box<str>,
}

/// The payload of one event.
#[derive(Clone, Debug, PartialEq)]
pub enum EventData {
    /// `turn/start`.
    TurnStart {
        /// Turn number (1-based).
        turn: u32,
    },
    /// `turn/end`.
    TurnEnd {
        /// Turn number.
        turn: u32,
        /// Why it ended.
        reason: Box<TurnEndReason>,
    },
    /// `step/start`.
    StepStart {
        /// Turn number.
        turn: u32,
        /// Step number (1-based within the turn).
        step: u32,
    },
    /// `step/end`.
    StepEnd {
        /// Turn number.
        turn: u32,
        /// Step number.
        step: u32,
    },
    /// `user/message` (surface): a prompt or injected context.
    UserMessage(Arc<Message>),
    /// `assistant/chunk`: one raw stream chunk.
    AssistantChunk {
        /// Turn number.
        turn: u32,
        /// Step number.
        step: u32,
        /// The chunk.
        chunk: Box<StreamChunk>,
    },
    /// `assistant/message` (surface): the assembled answer of one step.
    AssistantMessage {
        /// Turn number.
        turn: u32,
        /// Step number.
        step: u32,
        /// The message.
        message: Arc<Message>,
        /// Token accounting of the step.
        usage: Option<Box<TokenUsage>>,
        /// The delivered prefix of a cancelled stream.
        interrupted: bool,
    },
    /// `tool/call`: one requested invocation, arguments unparsed.
    ToolCall {
        /// Turn number.
        turn: u32,
        /// Step number.
        step: u32,
        /// The call (boxed: its three strings would make every event of a
        /// log larger).
        call: Box<ToolCallEvent>,
    },
    /// `tool/result` (surface).
    ToolResult {
        /// Turn number.
        turn: u32,
        /// Step number.
        step: u32,
        /// The user-role message with one `tool-result` block.
        message: Arc<Message>,
        /// Failure identity, for failed calls.
        error: Option<Box<ToolErrorId>>,
        /// Tool-private presentation data.
        meta: Option<Box<Value>>,
    },
    /// `todo/write`: whole-list snapshot.
    TodoWrite {
        /// The list.
        todos: Vec<TodoItem>,
    },
    /// `request/header`: the full request envelope for the next request.
    RequestHeader {
        /// The header (`config`, `system`, `tools`, …) as JSON.
        header: Arc<Value>,
        /// `initial`, `resume` or `change`.
        reason: String,
    },
    /// `request/context`: route metadata.
    RequestContext(Box<RequestContext>),
    /// `session/end-seed`: the end of a constructor seed.
    EndSeed,
    /// `agent/inbox/spliced`: one mutation of the agent's pending prompts.
    InboxSpliced(Box<InboxSplice>),
    /// Any other type, payload verbatim.
    Other {
        /// The event type.
        kind: Arc<str>,
        /// The payload (shared: a spec's opening events and the log that
        /// records them hold one copy).
        data: Arc<Value>,
    },
}

/// Event types whose events produce model messages.
pub fn is_surface_type(kind: &str) -> bool {
    matches!(kind, "user/message" | "assistant/message" | "tool/result")
}

/// Core types that are carried as [`EventData::Other`] but are known (not
/// "unknown" for the load-time refusal rule).
pub const CARRIED_TYPES: &[&str] = &[
    "session/title",
    "session/title-llm-request",
    "llm/retry",
    "llm/retry-started",
    "approval/asked",
    "approval/decided",
    "approval/policy",
    "sandbox/mode",
    "permission/preset",
    "plan/mode",
    "goal/change",
    "hook/invoked",
    "hook/result",
    "command/run",
    "command/done",
    "compaction/start",
    "compaction/end",
    "compaction/prune",
    "compaction/summary",
    "feedback/record",
    "schedule/change",
    "subagent/descriptor",
    "agent-preset/selected",
    "team/member",
    "team/task",
    "team/message/queued",
    "team/message/delivered",
    "tool/code-dispatch",
    "tool/code-dispatch-start",
    "tool-workflow/run-start",
    "tool-workflow/run-end",
    "tool-workflow/agent-start",
    "tool-workflow/agent-end",
    "web/deepseek-search-llm-request",
    "ralph/start",
    "ralph/round",
    "ralph/end",
    "llm/retry",
];

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Turn {
    turn: u32,
}

// The payload types below borrow what they write and own what they read.

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct TurnEnd<'a> {
    turn: u32,
    reason: Cow<'a, TurnEndReason>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Step {
    turn: u32,
    step: u32,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Chunk<'a> {
    turn: u32,
    step: u32,
    chunk: Cow<'a, StreamChunk>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Assistant<'a> {
    turn: u32,
    step: u32,
    message: Cow<'a, Message>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    usage: Option<TokenUsage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    interrupted: Option<bool>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct Call<'a> {
    turn: u32,
    step: u32,
    call_id: Cow<'a, str>,
    name: Cow<'a, str>,
    arguments: Cow<'a, str>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResultData<'a> {
    turn: u32,
    step: u32,
    message: Cow<'a, Message>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<Cow<'a, ToolErrorId>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    meta: Option<Cow<'a, Value>>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Todos<'a> {
    todos: Cow<'a, [TodoItem]>,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Header<'a> {
    header: Cow<'a, Value>,
    reason: Cow<'a, str>,
}

/// Why a payload is not a valid event of its type. Fatal for that event: a
/// log holding it is refused at its line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// The payload does not have its type's JSON shape (serde's message,
    /// which names the field).
    #[error("{0}")]
    Shape(String),
    /// A message event carries a message of another role.
    #[error("`{kind}` carries a {found:?} message; expected role {want:?}")]
    Role {
        /// The event type.
        kind: String,
        /// The role found.
        found: Role,
        /// The role the type requires.
        want: Role,
    },
}

/// An event payload as parsed JSON or as raw text still to parse.
trait Payload {
    fn parse<T: serde::de::DeserializeOwned>(self) -> Result<T, EventError>;
    fn into_value(self) -> Result<Value, EventError>;
}

impl Payload for Value {
    fn parse<T: serde::de::DeserializeOwned>(self) -> Result<T, EventError> {
        serde_json::from_value(self).map_err(|e| EventError::Shape(chain(&e).to_string()))
    }
    fn into_value(self) -> Result<Value, EventError> {
        Ok(self)
    }
}

impl Payload for &serde_json::value::RawValue {
    fn parse<T: serde::de::DeserializeOwned>(self) -> Result<T, EventError> {
        serde_json::from_str(self.get()).map_err(|e| EventError::Shape(chain(&e).to_string()))
    }
    fn into_value(self) -> Result<Value, EventError> {
        serde_json::from_str(self.get()).map_err(|e| EventError::Shape(chain(&e).to_string()))
    }
}

fn parse<T: serde::de::DeserializeOwned>(data: impl Payload) -> Result<T, EventError> {
    data.parse()
}

fn role_check(message: &Message, want: Role, kind: &str) -> Result<(), EventError> {
    if message.role != want {
        return Err(EventError::Role {
            kind: kind.to_owned(),
            found: message.role,
            want,
        });
    }
    Ok(())
}

impl EventData {
    /// A `tool/call` of `turn`/`step`.
    pub fn tool_call(
        turn: u32,
        step: u32,
        call_id: &str,
        name: &str,
        arguments: &str,
    ) -> EventData {
        EventData::ToolCall {
            turn,
            step,
            call: Box::new(ToolCallEvent {
                call_id: call_id.into(),
                name: name.into(),
                arguments: arguments.into(),
            }),
        }
    }

    /// The event type name, e.g. `tool/call`.
    pub fn kind(&self) -> &str {
        match self {
            EventData::TurnStart { .. } => "turn/start",
            EventData::TurnEnd { .. } => "turn/end",
            EventData::StepStart { .. } => "step/start",
            EventData::StepEnd { .. } => "step/end",
            EventData::UserMessage(_) => "user/message",
            EventData::AssistantChunk { .. } => "assistant/chunk",
            EventData::AssistantMessage { .. } => "assistant/message",
            EventData::ToolCall { .. } => "tool/call",
            EventData::ToolResult { .. } => "tool/result",
            EventData::TodoWrite { .. } => "todo/write",
            EventData::RequestHeader { .. } => "request/header",
            EventData::RequestContext(_) => "request/context",
            EventData::EndSeed => "session/end-seed",
            EventData::InboxSpliced(_) => "agent/inbox/spliced",
            EventData::Other { kind, .. } => kind,
        }
    }

    /// Whether this event produces a model message.
    pub fn is_surface(&self) -> bool {
        is_surface_type(self.kind())
    }

    /// The message a surface event projects, if any.
    pub fn message(&self) -> Option<&Arc<Message>> {
        match self {
            EventData::UserMessage(m) => Some(m),
            EventData::AssistantMessage { message, .. } | EventData::ToolResult { message, .. } => {
                Some(message)
            }
            _ => None,
        }
    }

    /// Parses a payload of type `kind`. Unknown types become
    /// [`EventData::Other`]; the caller decides whether that is allowed.
    pub fn from_parts(kind: &str, data: Value) -> Result<EventData, EventError> {
        Self::from_payload(kind, data)
    }

    /// [`EventData::from_parts`] from unparsed JSON text (one parse, no
    /// intermediate `Value` for the core types).
    pub fn from_raw(
        kind: &str,
        data: &serde_json::value::RawValue,
    ) -> Result<EventData, EventError> {
        Self::from_payload(kind, data)
    }

    fn from_payload(kind: &str, data: impl Payload) -> Result<EventData, EventError> {
        Ok(match kind {
            "turn/start" => EventData::TurnStart {
                turn: parse::<Turn>(data)?.turn,
            },
            "turn/end" => {
                let t: TurnEnd = parse(data)?;
                EventData::TurnEnd {
                    turn: t.turn,
                    reason: Box::new(t.reason.into_owned()),
                }
            }
            "step/start" | "step/end" => {
                let s: Step = parse(data)?;
                if kind == "step/start" {
                    EventData::StepStart {
                        turn: s.turn,
                        step: s.step,
                    }
                } else {
                    EventData::StepEnd {
                        turn: s.turn,
                        step: s.step,
                    }
                }
            }
            "user/message" => {
                let m: Message = parse(data)?;
                role_check(&m, Role::User, kind)?;
                EventData::UserMessage(Arc::new(m))
            }
            "assistant/chunk" => {
                let c: Chunk = parse(data)?;
                EventData::AssistantChunk {
                    turn: c.turn,
                    step: c.step,
                    chunk: Box::new(c.chunk.into_owned()),
                }
            }
            "assistant/message" => {
                let a: Assistant = parse(data)?;
                role_check(&a.message, Role::Assistant, kind)?;
                if a.message.source.kind == "model"
                    && (a.message.source.field("provider").is_none()
                        || a.message.source.field("model").is_none())
                {
                    return Err(EventError::Shape(
                        "`assistant/message` from a model must name its provider and model".into(),
                    ));
                }
                EventData::AssistantMessage {
                    turn: a.turn,
                    step: a.step,
                    message: Arc::new(a.message.into_owned()),
                    usage: a.usage.map(Box::new),
                    interrupted: a.interrupted.unwrap_or(false),
                }
            }
            "tool/call" => {
                let c: Call = parse(data)?;
                EventData::tool_call(c.turn, c.step, &c.call_id, &c.name, &c.arguments)
            }
            "tool/result" => {
                let r: ResultData = parse(data)?;
                role_check(&r.message, Role::User, kind)?;
                EventData::ToolResult {
                    turn: r.turn,
                    step: r.step,
                    message: Arc::new(r.message.into_owned()),
                    error: r.error.map(|e| Box::new(e.into_owned())),
                    meta: r.meta.map(|m| Box::new(m.into_owned())),
                }
            }
            "todo/write" => EventData::TodoWrite {
                todos: parse::<Todos>(data)?.todos.into_owned(),
            },
            "request/header" => {
                let h: Header = parse(data)?;
                if !h.header.is_object() || h.header.get("config").is_none() {
                    return Err(EventError::Shape(
                        "`request/header` needs a `header` object with `config`".into(),
                    ));
                }
                EventData::RequestHeader {
                    header: Arc::new(h.header.into_owned()),
                    reason: h.reason.into_owned(),
                }
            }
            "request/context" => EventData::RequestContext(parse(data)?),
            "session/end-seed" => EventData::EndSeed,
            "agent/inbox/spliced" => EventData::InboxSpliced(parse(data)?),
            other => EventData::Other {
                kind: Arc::from(other),
                data: Arc::new(data.into_value()?),
            },
        })
    }

    /// The JSON payload (`data`) of this event.
    pub fn to_value(&self) -> Value {
        // Every payload type serializes infallibly (plain data).
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// The payload (`data`), written straight from the event without copies.
impl Serialize for EventData {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            EventData::TurnStart { turn } => Turn { turn: *turn }.serialize(s),
            EventData::TurnEnd { turn, reason } => TurnEnd {
                turn: *turn,
                reason: Cow::Borrowed(reason),
            }
            .serialize(s),
            EventData::StepStart { turn, step } | EventData::StepEnd { turn, step } => Step {
                turn: *turn,
                step: *step,
            }
            .serialize(s),
            EventData::UserMessage(m) => m.serialize(s),
            EventData::AssistantChunk { turn, step, chunk } => Chunk {
                turn: *turn,
                step: *step,
                chunk: Cow::Borrowed(chunk),
            }
            .serialize(s),
            EventData::AssistantMessage {
                turn,
                step,
                message,
                usage,
                interrupted,
            } => Assistant {
                turn: *turn,
                step: *step,
                message: Cow::Borrowed(message),
                usage: usage.as_deref().copied(),
                interrupted: interrupted.then_some(true),
            }
            .serialize(s),
            EventData::ToolCall { turn, step, call } => Call {
                turn: *turn,
                step: *step,
                call_id: Cow::Borrowed(&call.call_id),
                name: Cow::Borrowed(&call.name),
                arguments: Cow::Borrowed(&call.arguments),
            }
            .serialize(s),
            EventData::ToolResult {
                turn,
                step,
                message,
                error,
                meta,
            } => ResultData {
                turn: *turn,
                step: *step,
                message: Cow::Borrowed(message),
                error: error.as_deref().map(Cow::Borrowed),
                meta: meta.as_deref().map(Cow::Borrowed),
            }
            .serialize(s),
            EventData::TodoWrite { todos } => Todos {
                todos: Cow::Borrowed(todos),
            }
            .serialize(s),
            EventData::RequestHeader { header, reason } => Header {
                header: Cow::Borrowed(header),
                reason: Cow::Borrowed(reason),
            }
            .serialize(s),
            EventData::RequestContext(c) => c.serialize(s),
            EventData::EndSeed => s.serialize_map(Some(0))?.end(),
            EventData::InboxSpliced(splice) => splice.serialize(s),
            EventData::Other { data, .. } => data.serialize(s),
        }
    }
}

/// One immutable entry of the log.
#[derive(Clone, Debug, PartialEq)]
pub struct SessionEvent {
    /// Position in the log (`seq` = log length before the append).
    pub seq: u64,
    /// Epoch milliseconds.
    pub time: u64,
    /// The payload.
    pub data: EventData,
    /// Surface metadata and the ignorable mark, on the few events that
    /// carry any (boxed: the others, most of a log, stay small). Never a
    /// box of nothing, so equal events compare equal.
    meta: Option<Box<EventMeta>>,
}

/// What some events carry besides their payload.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EventMeta {
    /// A reader that does not know the type may skip it.
    pub ignorable: bool,
    /// How a surface event joined the surface.
    pub surface_op: Option<SurfaceOp>,
    /// Earlier events this one cites.
    pub source_event_seqs: Option<Box<[u64]>>,
}

/// The metadata of an event that carries none.
static NO_META: EventMeta = EventMeta {
    ignorable: false,
    surface_op: None,
    source_event_seqs: None,
};

impl SessionEvent {
    /// An event with no surface metadata, not ignorable.
    pub fn new(seq: u64, time: u64, data: EventData) -> SessionEvent {
        SessionEvent {
            seq,
            time,
            data,
            meta: None,
        }
    }

    /// The same event carrying `meta`.
    pub fn with_meta(mut self, meta: EventMeta) -> SessionEvent {
        self.meta = (meta != NO_META).then(|| Box::new(meta));
        self
    }

    /// Its metadata (all unset on most events).
    pub fn meta(&self) -> &EventMeta {
        self.meta.as_deref().unwrap_or(&NO_META)
    }

    /// Whether the event carries surface metadata or the ignorable mark.
    pub(crate) fn has_meta(&self) -> bool {
        self.meta.is_some()
    }

    /// A reader that does not know the type may skip it.
    pub fn ignorable(&self) -> bool {
        self.meta().ignorable
    }

    /// How a surface event joined the surface.
    pub fn surface_op(&self) -> Option<SurfaceOp> {
        self.meta().surface_op
    }

    /// Earlier events this one cites.
    pub fn source_event_seqs(&self) -> Option<&[u64]> {
        self.meta().source_event_seqs.as_deref()
    }

    /// The event type.
    pub fn kind(&self) -> &str {
        self.data.kind()
    }

    /// The event as one JSON object, as stored in a `session.jsonl` line.
    pub fn to_json(&self) -> Value {
        // Plain data: serializing cannot fail.
        serde_json::to_value(self).unwrap_or(Value::Null)
    }

    /// The event as its `session.jsonl` line (without the newline).
    pub fn to_line(&self) -> String {
        let mut out = Vec::with_capacity(256);
        self.write_line(&mut out);
        // serde_json writes UTF-8 only.
        String::from_utf8(out).unwrap_or_default()
    }

    /// Appends the event's `session.jsonl` line (without the newline) to `out`.
    pub fn write_line(&self, out: &mut Vec<u8>) {
        let start = out.len();
        // Plain data into memory: this does not fail; were it to, no
        // partial line is left behind.
        if serde_json::to_writer(&mut *out, self).is_err() {
            out.truncate(start);
            out.extend_from_slice(b"null");
        }
    }
}

/// The stored envelope: `type`, `seq`, `time`, `data`, then the optional
/// fields when set.
impl Serialize for SessionEvent {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("type", self.kind())?;
        map.serialize_entry("seq", &self.seq)?;
        map.serialize_entry("time", &self.time)?;
        map.serialize_entry("data", &self.data)?;
        let meta = self.meta();
        if meta.ignorable {
            map.serialize_entry("ignorable", &true)?;
        }
        if let Some(op) = &meta.surface_op {
            map.serialize_entry("surfaceOp", op)?;
        }
        if let Some(seqs) = &meta.source_event_seqs {
            map.serialize_entry("sourceEventSeqs", seqs)?;
        }
        map.end()
    }
}

impl AsRef<SessionEvent> for SessionEvent {
    fn as_ref(&self) -> &SessionEvent {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::{EventData, SessionEvent};

    /// An agent keeps every event of its log in memory (~10 per step), so
    /// the common event stays small: rare or large payloads are boxed, and
    /// so is the metadata only message-producing events carry.
    #[test]
    fn an_event_fits_in_64_bytes() {
        assert!(
            size_of::<EventData>() <= 40,
            "EventData is {} bytes",
            size_of::<EventData>()
        );
        assert!(
            size_of::<SessionEvent>() <= 64,
            "SessionEvent is {} bytes",
            size_of::<SessionEvent>()
        );
    }
}
