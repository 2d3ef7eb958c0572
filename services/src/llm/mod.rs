//! The LLM seam's vocabulary: messages, content blocks, the raw stream
//! protocol, token usage and finish reasons, in dsh's JSON shapes (the same
//! bytes a dsh `session.jsonl` holds).
//!
//! Messages are immutable once built and shared as `Arc<Message>`.

mod assembler;
mod runtime;
pub mod sse;

use std::borrow::Cow;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

pub use assembler::{BlockAssembler, UnclosedBlock};
pub use runtime::{
    ChunkStream, LlmAdapter, LlmRequest, LlmRuntime, LlmStream, ModelDefaults, Notify, Price,
    Retrying,
};

/// A tool call's identity as the model chose it (any format: `call_0`, `toolu_…`).
pub type CallId = String;

/// One typed piece of a message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum ContentBlock {
    /// Visible text.
    Text {
        /// The text.
        text: String,
    },
    /// Model thinking, distinct from visible text.
    Reasoning {
        /// The reasoning text.
        text: String,
    },
    /// An image attachment (kept verbatim; not interpreted by the core).
    Image {
        /// The attachment fields, as recorded.
        #[serde(flatten)]
        fields: serde_json::Map<String, serde_json::Value>,
    },
    /// A tool invocation requested by the model.
    ToolCall {
        /// Call identity.
        id: CallId,
        /// Tool name.
        name: String,
        /// Raw JSON arguments exactly as the model produced them.
        arguments: String,
    },
    /// A tool's result, in a user-role message.
    ToolResult {
        /// The call it answers.
        #[serde(rename = "toolCallId")]
        tool_call_id: CallId,
        /// Model-facing result blocks.
        content: Vec<ContentBlock>,
        /// Whether the call failed.
        #[serde(rename = "isError", default, skip_serializing_if = "Option::is_none")]
        is_error: Option<bool>,
    },
}

/// The text blocks of `blocks` (reasoning and everything else left out),
/// joined with `separator`.
pub fn joined_text(blocks: &[ContentBlock], separator: &str) -> String {
    blocks
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join(separator)
}

impl ContentBlock {
    /// The block's type name (`text`, `tool-call`, …).
    pub fn kind(&self) -> BlockType {
        match self {
            ContentBlock::Text { .. } => BlockType::Text,
            ContentBlock::Reasoning { .. } => BlockType::Reasoning,
            ContentBlock::Image { .. } => BlockType::Image,
            ContentBlock::ToolCall { .. } => BlockType::ToolCall,
            ContentBlock::ToolResult { .. } => BlockType::ToolResult,
        }
    }

    /// A text block.
    pub fn text(text: impl Into<String>) -> ContentBlock {
        ContentBlock::Text { text: text.into() }
    }
}

/// The closed set of block types.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BlockType {
    /// [`ContentBlock::Text`].
    Text,
    /// [`ContentBlock::Reasoning`].
    Reasoning,
    /// [`ContentBlock::Image`].
    Image,
    /// [`ContentBlock::ToolCall`].
    ToolCall,
    /// [`ContentBlock::ToolResult`].
    ToolResult,
}

/// Conversation role.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// System instructions.
    System,
    /// The user, injected context and tool results.
    User,
    /// The model.
    Assistant,
}

/// Where a message came from. Open: plugins add kinds; fields other than
/// the common ones are kept verbatim (see [`MessageSource::extra`]).
///
/// Every message carries one, so it is laid out small: the kind is usually
/// a constant, the strings are boxed slices, and the rarely used other
/// fields are boxed.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(from = "SourceWire")]
pub struct MessageSource {
    /// `user`, `plugin`, `model`, `tool`, or a plugin-defined kind.
    pub kind: Cow<'static, str>,
    /// Provider route of a model message.
    pub provider: Option<Box<str>>,
    /// Model id of a model message.
    pub model: Option<Box<str>>,
    /// The call a tool message answers.
    pub call_id: Option<Box<str>>,
    /// The plugin that produced a plugin message.
    pub plugin: Option<Box<str>>,
    /// Every other field, when there is one (never an empty box).
    extra: Option<Box<serde_json::Map<String, serde_json::Value>>>,
}

/// The stored form of a [`MessageSource`]: its fields side by side with
/// the other fields.
#[derive(Deserialize)]
struct SourceWire {
    kind: String,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default, rename = "callId")]
    call_id: Option<String>,
    #[serde(default)]
    plugin: Option<String>,
    #[serde(flatten)]
    extra: serde_json::Map<String, serde_json::Value>,
}

impl From<SourceWire> for MessageSource {
    fn from(w: SourceWire) -> MessageSource {
        let kind = match w.kind.as_str() {
            "user" => Cow::Borrowed("user"),
            "model" => Cow::Borrowed("model"),
            "tool" => Cow::Borrowed("tool"),
            "plugin" => Cow::Borrowed("plugin"),
            _ => Cow::Owned(w.kind),
        };
        MessageSource {
            kind,
            provider: w.provider.map(String::into_boxed_str),
            model: w.model.map(String::into_boxed_str),
            call_id: w.call_id.map(String::into_boxed_str),
            plugin: w.plugin.map(String::into_boxed_str),
            extra: (!w.extra.is_empty()).then(|| Box::new(w.extra)),
        }
    }
}

impl Serialize for MessageSource {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = s.serialize_map(None)?;
        map.serialize_entry("kind", &self.kind)?;
        let named = [
            ("provider", &self.provider),
            ("model", &self.model),
            ("callId", &self.call_id),
            ("plugin", &self.plugin),
        ];
        for (name, value) in named {
            if let Some(value) = value {
                map.serialize_entry(name, value)?;
            }
        }
        for (name, value) in self.extra() {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

impl MessageSource {
    /// A source of `kind` with no other fields.
    pub fn of(kind: impl Into<Cow<'static, str>>) -> MessageSource {
        MessageSource {
            kind: kind.into(),
            provider: None,
            model: None,
            call_id: None,
            plugin: None,
            extra: None,
        }
    }

    /// `{kind: "user"}`.
    pub fn user() -> MessageSource {
        MessageSource::of("user")
    }

    /// `{kind: "model", provider, model}`.
    pub fn model(provider: &str, model: &str) -> MessageSource {
        MessageSource {
            provider: Some(provider.into()),
            model: Some(model.into()),
            ..MessageSource::of("model")
        }
    }

    /// `{kind: "tool", callId}`.
    pub fn tool(call_id: &str) -> MessageSource {
        MessageSource {
            call_id: Some(call_id.into()),
            ..MessageSource::of("tool")
        }
    }

    /// `{kind: "plugin", plugin}`.
    pub fn plugin(plugin: &str) -> MessageSource {
        MessageSource {
            plugin: Some(plugin.into()),
            ..MessageSource::of("plugin")
        }
    }

    /// The fields other than the common ones (`form`, `sections`,
    /// `replayState`, …), in the order they were set.
    pub fn extra(&self) -> impl Iterator<Item = (&String, &serde_json::Value)> {
        self.extra.iter().flat_map(|m| m.iter())
    }

    /// Sets one of the other fields.
    pub fn set_extra(&mut self, name: impl Into<String>, value: serde_json::Value) {
        self.extra
            .get_or_insert_with(Default::default)
            .insert(name.into(), value);
    }

    /// A string field of the source (`provider`, `model`, `callId`, `plugin`, or an extra one).
    pub fn field(&self, name: &str) -> Option<&str> {
        match name {
            "provider" => self.provider.as_deref(),
            "model" => self.model.as_deref(),
            "callId" => self.call_id.as_deref(),
            "plugin" => self.plugin.as_deref(),
            other => self.extra.as_ref()?.get(other).and_then(|v| v.as_str()),
        }
    }
}

/// One identified, immutable message.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Stable identity.
    pub id: String,
    /// Role.
    pub role: Role,
    /// Exact model-facing blocks.
    pub content: Vec<ContentBlock>,
    /// Producer.
    pub source: MessageSource,
}

impl Message {
    /// A fresh message id in UUID v4 form.
    pub fn new_id() -> String {
        ids::next()
    }

    /// A user prompt with one text block.
    pub fn user_text(text: impl Into<String>) -> Message {
        Message {
            id: Message::new_id(),
            role: Role::User,
            content: vec![ContentBlock::text(text)],
            source: MessageSource::user(),
        }
    }

    /// All text blocks joined (reasoning excluded).
    pub fn text(&self) -> String {
        joined_text(&self.content, "")
    }

    /// The tool calls in this message, in order.
    pub fn tool_calls(&self) -> impl Iterator<Item = (&str, &str, &str)> {
        self.content.iter().filter_map(|b| match b {
            ContentBlock::ToolCall {
                id,
                name,
                arguments,
            } => Some((id.as_str(), name.as_str(), arguments.as_str())),
            _ => None,
        })
    }
}

/// A snapshot of derived history: shared messages in model-visible order.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct History(pub(crate) Arc<Vec<Arc<Message>>>);

impl std::ops::Deref for History {
    type Target = [Arc<Message>];
    fn deref(&self) -> &[Arc<Message>] {
        &self.0
    }
}

impl History {
    /// A history of exactly `messages` (an auxiliary request's).
    pub fn of(messages: Vec<Arc<Message>>) -> History {
        History(Arc::new(messages))
    }

    /// The messages as a vector (clones the `Arc`s, not the messages).
    pub fn to_vec(&self) -> Vec<Arc<Message>> {
        self.0.as_ref().clone()
    }
}

/// Message ids: UUID-v4-shaped, unique within the process and random
/// across processes, without a system call per id (the OS is asked for
/// randomness once per thread, then a SplitMix64 sequence is used).
mod ids {
    use std::cell::Cell;

    thread_local! {
        static STATE: Cell<u64> = Cell::new(seed());
    }

    fn seed() -> u64 {
        let u = uuid::Uuid::new_v4();
        let (hi, lo) = u.as_u64_pair();
        hi ^ lo.rotate_left(17)
    }

    fn splitmix(state: &Cell<u64>) -> u64 {
        let s = state.get().wrapping_add(0x9E37_79B9_7F4A_7C15);
        state.set(s);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(super) fn next() -> String {
        let (hi, lo) = STATE.with(|s| (splitmix(s), splitmix(s)));
        uuid::Builder::from_random_bytes(((u128::from(hi) << 64) | u128::from(lo)).to_be_bytes())
            .into_uuid()
            .to_string()
    }
}

/// A shared, immutable message.
pub type SharedMessage = Arc<Message>;

/// Token accounting for one model call. Counts are disjoint: `input_tokens`
/// is uncached input only.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenUsage {
    /// Uncached input tokens.
    pub input_tokens: u64,
    /// Output tokens (reasoning included).
    pub output_tokens: u64,
    /// Input served from cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_read_tokens: Option<u64>,
    /// Input written to cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_write_tokens: Option<u64>,
    /// Reasoning part of `output_tokens` (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_tokens: Option<u64>,
}

impl TokenUsage {
    /// Billed input: uncached + cache reads + cache writes.
    pub fn billed_input(&self) -> u64 {
        self.input_tokens
            + self.cache_read_tokens.unwrap_or(0)
            + self.cache_write_tokens.unwrap_or(0)
    }
}

/// A provider or transport failure, provider-neutral and serializable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LlmFailure {
    /// Human-readable description.
    pub message: String,
    /// Stable machine code (`RATE_LIMITED`, `AUTH`, `TIMEOUT`, …).
    pub code: String,
    /// HTTP status, when there was one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    /// Provider-requested retry delay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider_retry_after_ms: Option<u64>,
    /// Provider request id, for diagnostics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
}

impl LlmFailure {
    /// A failure with `code` (one of [`code`], or a provider's own) and a
    /// message; no status, retry hint or request id.
    pub fn new(code: &str, message: impl Into<String>) -> LlmFailure {
        LlmFailure {
            message: message.into(),
            code: code.to_owned(),
            status: None,
            provider_retry_after_ms: None,
            request_id: None,
        }
    }

    /// Whether another attempt may succeed (see [`code::retryable`]).
    pub fn retryable(&self) -> bool {
        code::retryable(&self.code)
    }
}

/// The failure codes dsh sets. The vocabulary is open: a provider may report
/// a code of its own (upper-cased from its error `code` or `type`), which is
/// never retried. Each says whether a caller may retry the same request.
pub mod code {
    /// The provider's rate limit (HTTP 429). Retryable, after the provider's
    /// `Retry-After` when it gave one.
    pub const RATE_LIMITED: &str = "RATE_LIMITED";
    /// The provider is overloaded. Retryable.
    pub const OVERLOADED: &str = "OVERLOADED";
    /// HTTP 5xx. Retryable.
    pub const SERVER_ERROR: &str = "SERVER_ERROR";
    /// No answer (or no next chunk) in time; HTTP 408. Retryable.
    pub const TIMEOUT: &str = "TIMEOUT";
    /// The request could not be sent (connect, TLS, DNS). Retryable.
    pub const CONNECTION: &str = "CONNECTION";
    /// The connection closed or broke mid-stream. Retryable before the
    /// first chunk; after it, the delivered chunks are already logged.
    pub const CONNECTION_LOST: &str = "CONNECTION_LOST";
    /// The model returned no content at all. Retryable.
    pub const EMPTY_RESPONSE: &str = "EMPTY_RESPONSE";
    /// The account has no quota, balance or credits left (HTTP 402, or a
    /// 429 that says so). Fatal until the account is topped up: retrying
    /// spends nothing but time.
    pub const QUOTA: &str = "QUOTA";
    /// HTTP 401/403: the key is missing, wrong or not allowed. Fatal.
    pub const AUTH: &str = "AUTH";
    /// HTTP 404: no such endpoint or model. Fatal.
    pub const NOT_FOUND: &str = "NOT_FOUND";
    /// HTTP 413, or a 400 that says the context is too long: the request
    /// is larger than the model takes. Fatal until the history shrinks.
    pub const CONTEXT_WINDOW_EXCEEDED: &str = "CONTEXT_WINDOW_EXCEEDED";
    /// Any other HTTP 4xx. Fatal.
    pub const BAD_REQUEST: &str = "BAD_REQUEST";
    /// A request named a reasoning effort the provider does not have.
    pub const UNSUPPORTED_REASONING_EFFORT: &str = "UNSUPPORTED_REASONING_EFFORT";
    /// An error inside the stream that names no code. Fatal.
    pub const PROVIDER_ERROR: &str = "PROVIDER_ERROR";
    /// A stream event that is not valid JSON of the expected shape. Fatal.
    pub const MALFORMED_CHUNK: &str = "MALFORMED_CHUNK";
    /// A response that is not an event stream. Fatal.
    pub const MALFORMED_RESPONSE: &str = "MALFORMED_RESPONSE";
    /// Chunks that do not assemble into a message (a tool call without a
    /// name, arguments that are not JSON). Fatal.
    pub const MALFORMED_STREAM: &str = "MALFORMED_STREAM";
    /// A finish reason the protocol does not know (`content_filter`, …). Fatal.
    pub const FINISH_REASON: &str = "FINISH_REASON";
    /// The call was cancelled. Not an error of the provider; never retried.
    pub const ABORTED: &str = "ABORTED";
    /// No adapter serves the request's provider route. Fatal.
    pub const UNKNOWN_PROVIDER: &str = "UNKNOWN_PROVIDER";
    /// A listener of the `llm/stream` or `agent/request` waterfall
    /// panicked. Fatal for the step.
    pub const LISTENER_PANICKED: &str = "LISTENER_PANICKED";
    /// The scripted model has no step left for this call. Fatal.
    pub const SCRIPT_EXHAUSTED: &str = "SCRIPT_EXHAUSTED";
    /// The replay model has no recorded step left for this call. Fatal.
    pub const REPLAY_EXHAUSTED: &str = "REPLAY_EXHAUSTED";
    /// A scripted step's `{{fromRequest:…}}` placeholder is malformed or
    /// matches nothing in the request. Fatal.
    pub const REPLAY_PLACEHOLDER: &str = "REPLAY_PLACEHOLDER";
    /// The turn used every step it may take (`AgentSpec::max_steps`). Fatal.
    pub const STEP_LIMIT: &str = "STEP_LIMIT";
    /// The agent (or an ancestor) spent its token budget, or took every
    /// turn it may take. Fatal.
    pub const BUDGET_EXHAUSTED: &str = "BUDGET_EXHAUSTED";
    /// The system prompt could not be assembled. Fatal.
    pub const SYSTEM_PROMPT: &str = "SYSTEM_PROMPT";

    /// Whether a failure with `code` is worth another attempt of the same
    /// request.
    pub fn retryable(code: &str) -> bool {
        matches!(
            code,
            RATE_LIMITED
                | OVERLOADED
                | SERVER_ERROR
                | TIMEOUT
                | CONNECTION
                | CONNECTION_LOST
                | EMPTY_RESPONSE
        )
    }
}

/// Why a model response stopped.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum FinishReason {
    /// The model finished its answer.
    Stop,
    /// The model asked for tool calls.
    ToolCalls,
    /// The output-token ceiling was hit (tool calls are dropped).
    MaxTokens,
    /// The call was cancelled.
    Aborted {
        /// Details.
        failure: Box<LlmFailure>,
    },
    /// The provider failed.
    Error {
        /// Details.
        failure: Box<LlmFailure>,
    },
}

/// Adapter-private replay state carried by a successful finish.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplayEnvelope {
    /// Response-level metadata.
    pub response: serde_json::Value,
    /// One entry per emitted block, in first-seen order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocks: Option<Vec<serde_json::Value>>,
}

/// The raw streaming protocol adapters emit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "kebab-case")]
pub enum StreamChunk {
    /// A block opens at `index`.
    BlockStart {
        /// Block index.
        index: u32,
        /// Its type.
        #[serde(rename = "blockType")]
        block_type: BlockType,
    },
    /// Text for block `index`.
    TextDelta {
        /// Block index.
        index: u32,
        /// The delta.
        text: String,
    },
    /// Reasoning for block `index`.
    ReasoningDelta {
        /// Block index.
        index: u32,
        /// The delta.
        text: String,
    },
    /// A piece of a tool call's arguments.
    ToolCallDelta {
        /// Block index.
        index: u32,
        /// Call id.
        id: CallId,
        /// Tool name (usually on the first delta only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// Raw JSON fragment.
        #[serde(rename = "argumentsDelta")]
        arguments_delta: String,
    },
    /// Block `index` is complete.
    BlockEnd {
        /// Block index.
        index: u32,
        /// The assembled block.
        block: ContentBlock,
    },
    /// Token accounting (before `finish`).
    Usage {
        /// The usage.
        usage: TokenUsage,
    },
    /// End of stream.
    Finish {
        /// Why.
        reason: FinishReason,
        /// Replay metadata of a successful response.
        #[serde(
            rename = "replayState",
            default,
            skip_serializing_if = "Option::is_none"
        )]
        replay_state: Option<Box<ReplayEnvelope>>,
    },
}

/// A tool as the model sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSchema {
    /// Tool name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// JSON Schema of its arguments.
    pub parameters: serde_json::Value,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every message carries a source, so it stays small; its stored form
    /// keeps every field, the other ones included, in order.
    #[test]
    fn a_source_is_small_and_keeps_every_field_it_was_stored_with() {
        assert!(
            size_of::<MessageSource>() <= 96,
            "MessageSource is {} bytes",
            size_of::<MessageSource>()
        );
        let stored =
            r#"{"kind":"plugin","plugin":"ctx","form":"snapshot","sections":[{"name":"a"}]}"#;
        let source: MessageSource = serde_json::from_str(stored).unwrap();
        assert_eq!(source.plugin.as_deref(), Some("ctx"));
        assert_eq!(source.field("form"), Some("snapshot"));
        assert_eq!(serde_json::to_string(&source).unwrap(), stored);
        let mut built = MessageSource::plugin("ctx");
        built.set_extra("form", serde_json::json!("snapshot"));
        built.set_extra("sections", serde_json::json!([{"name": "a"}]));
        assert_eq!(built, source);
        let plain: MessageSource =
            serde_json::from_str(r#"{"kind":"tool","callId":"c1"}"#).unwrap();
        assert_eq!(
            plain,
            MessageSource::tool("c1"),
            "no empty box of other fields"
        );
        assert_eq!(plain.extra().count(), 0);
    }

    #[test]
    fn blocks_and_chunks_use_dsh_json_shapes() {
        let call = ContentBlock::ToolCall {
            id: "call_1".into(),
            name: "bash".into(),
            arguments: "{\"command\":\"ls\"}".into(),
        };
        assert_eq!(
            serde_json::to_value(&call).unwrap(),
            serde_json::json!({"type": "tool-call", "id": "call_1", "name": "bash", "arguments": "{\"command\":\"ls\"}"})
        );
        let chunk: StreamChunk = serde_json::from_value(serde_json::json!(
            {"type": "tool-call-delta", "index": 1, "id": "c", "argumentsDelta": "{\""}
        ))
        .unwrap();
        assert_eq!(
            chunk,
            StreamChunk::ToolCallDelta {
                index: 1,
                id: "c".into(),
                name: None,
                arguments_delta: "{\"".into()
            }
        );
        let finish: StreamChunk =
            serde_json::from_str(r#"{"type":"finish","reason":{"kind":"tool-calls"}}"#).unwrap();
        assert_eq!(
            finish,
            StreamChunk::Finish {
                reason: FinishReason::ToolCalls,
                replay_state: None
            }
        );
        let usage: TokenUsage = serde_json::from_str(
            r#"{"inputTokens":3091,"outputTokens":23,"cacheReadTokens":0,"reasoningTokens":20}"#,
        )
        .unwrap();
        assert_eq!(usage.billed_input(), 3091);
        let source = MessageSource::model("deepseek-official", "deepseek-v4-flash");
        assert_eq!(
            serde_json::to_value(&source).unwrap(),
            serde_json::json!({"kind": "model", "provider": "deepseek-official", "model": "deepseek-v4-flash"})
        );
    }
}
