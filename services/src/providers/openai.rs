//! The OpenAI-compatible streaming adapter (DeepSeek, OpenAI, vLLM,
//! llama.cpp server, Ollama): `POST {base_url}/chat/completions` with
//! `stream: true`, parsed as server-sent events.
//!
//! It maps text, DeepSeek's `reasoning_content`, tool-call deltas (any id
//! format, arguments split anywhere), usage (`stream_options.include_usage`)
//! and finish reasons onto the chunk protocol; an `{"error": …}` event inside
//! a 200 stream, an HTTP error status and a dropped connection become typed
//! failures. One call is one attempt: retries belong to [`RetryListener`].

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, Disposer, ListenOptions};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::llm::{
    BlockType, ContentBlock, FinishReason, LlmFailure, Message, Role, StreamChunk, TokenUsage, code,
};
use crate::llm::{ChunkStream, LlmAdapter, LlmRequest, LlmStream, ModelDefaults, Price, Retrying};

/// Where and how to reach an endpoint.
#[derive(Clone)]
pub struct OpenAiConfig {
    /// Base URL up to the API version, e.g. `https://api.deepseek.com/v1`.
    pub base_url: String,
    /// Bearer token; never logged.
    pub api_key: Option<String>,
    /// Longest silence between two stream events.
    pub idle_timeout: Duration,
    /// Longest wait from sending the request to its first stream event
    /// (headers included): a reasoning model may think for minutes first.
    pub first_byte_timeout: Duration,
    /// Longest a whole call may take, however the stream trickles.
    pub total_timeout: Duration,
    /// What the endpoint speaks beyond plain chat completions.
    pub dialect: Dialect,
    /// The stable anonymous id of this installation, sent to DeepSeek as
    /// `x-deepseek-harness-user-id` (never in a body or to another dialect).
    pub user_id: Option<String>,
    /// The endpoint's models take image input (DeepSeek: its `vision`
    /// models, whatever this says).
    pub images: bool,
    /// Where image blocks' bytes are (`None`: images are described).
    pub attachments: Option<Arc<crate::attachments::Attachments>>,
    /// The models' context window in tokens (DeepSeek: 1,000,000 unless
    /// set); agents compact their history before a request would pass it.
    /// A [`ModelEntry`]'s own wins for its model.
    pub context_window: Option<u64>,
    /// What is known of particular models (an exact id match wins over
    /// the endpoint-wide settings); any other model id passes through.
    pub models: Vec<ModelEntry>,
    /// What the endpoint's tokens cost, when known (no built-in table).
    pub price: Option<Price>,
}

/// One model of an endpoint's catalogue: its id and what differs from the
/// endpoint-wide settings.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelEntry {
    /// The wire `model` id.
    pub id: String,
    /// A display name (default: the id).
    pub name: Option<String>,
    /// Its context window in tokens.
    pub context_window: Option<u64>,
    /// Its output cap of requests that name none.
    pub max_tokens: Option<u64>,
    /// Whether it takes image input.
    pub images: Option<bool>,
    /// What its tokens cost (default: the endpoint's price).
    pub price: Option<Price>,
}

impl ModelEntry {
    /// An entry for `id` with nothing of its own.
    pub fn new(id: impl Into<String>) -> ModelEntry {
        ModelEntry {
            id: id.into(),
            ..ModelEntry::default()
        }
    }
}

/// The models a DeepSeek route lists unless configured: V4 Flash, V4 Pro,
/// and the image-taking V4 Flash Vision (each 1,000,000 tokens, the
/// route's window).
pub fn deepseek_models() -> Vec<ModelEntry> {
    vec![
        ModelEntry::new("deepseek-v4-flash"),
        ModelEntry::new("deepseek-v4-pro"),
        ModelEntry {
            images: Some(true),
            ..ModelEntry::new("deepseek-v4-flash-vision-exp")
        },
    ]
}

/// DeepSeek's official API when `$DEEPSEEK_BASE_URL` names none.
pub const DEEPSEEK_BASE_URL: &str = "https://api.deepseek.com";

/// The model a DeepSeek route serves unless one is named.
pub const DEEPSEEK_MODEL: &str = "deepseek-v4-flash";

/// The context window of DeepSeek's models, in tokens.
pub const DEEPSEEK_CONTEXT_WINDOW: u64 = 1_000_000;

/// How an endpoint's wire format differs from plain OpenAI chat completions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Dialect {
    /// Plain chat completions (vLLM, llama.cpp, Ollama, OpenAI).
    #[default]
    OpenAi,
    /// DeepSeek's: `thinking` on or off with a `reasoning_effort`, every
    /// assistant turn's reasoning passed back as `reasoning_content` (its
    /// thinking mode requires it on tool-call turns), `content: ""` beside
    /// tool calls, and a default `max_tokens`.
    DeepSeek {
        /// The effort of a request that names none (`off`: thinking off).
        effort: ReasoningEffort,
        /// `max_tokens` of a request that names none.
        max_tokens: u64,
    },
}

/// How hard a DeepSeek model thinks before it answers.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningEffort {
    /// No thinking (`thinking: {type: disabled}`).
    Off,
    /// Brief thinking.
    Low,
    /// The default.
    #[default]
    High,
    /// As much as the model does.
    Max,
}

impl ReasoningEffort {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasoningEffort::Off => "off",
            ReasoningEffort::Low => "low",
            ReasoningEffort::High => "high",
            ReasoningEffort::Max => "max",
        }
    }
}

/// An effort name that is none of `off`, `low`, `high`, `max`. Fatal: the
/// name must change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown reasoning effort `{0}` (expected off, low, high or max)")]
pub struct UnknownEffort(pub String);

impl std::str::FromStr for ReasoningEffort {
    type Err = UnknownEffort;
    fn from_str(s: &str) -> Result<Self, UnknownEffort> {
        [
            ReasoningEffort::Off,
            ReasoningEffort::Low,
            ReasoningEffort::High,
            ReasoningEffort::Max,
        ]
        .into_iter()
        .find(|e| e.as_str() == s)
        .ok_or_else(|| UnknownEffort(s.to_owned()))
    }
}

impl OpenAiConfig {
    /// Default time to the first byte: 10 minutes.
    pub const FIRST_BYTE: Duration = Duration::from_secs(600);
    /// Default ceiling of a whole call: 60 minutes.
    pub const TOTAL: Duration = Duration::from_secs(3600);
    /// Default longest silence between events: 5 minutes.
    pub const IDLE: Duration = Duration::from_secs(300);

    /// `base_url` with `api_key` and the default timeouts.
    pub fn new(base_url: impl Into<String>, api_key: Option<String>) -> OpenAiConfig {
        OpenAiConfig {
            base_url: base_url.into(),
            api_key,
            idle_timeout: Self::IDLE,
            first_byte_timeout: Self::FIRST_BYTE,
            total_timeout: Self::TOTAL,
            dialect: Dialect::OpenAi,
            user_id: None,
            images: false,
            attachments: None,
            context_window: None,
            models: Vec::new(),
            price: None,
        }
    }

    /// The catalogue entry of `model`, if it has one.
    pub fn model(&self, model: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.id == model)
    }
}

impl std::fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("idle_timeout", &self.idle_timeout)
            .field("first_byte_timeout", &self.first_byte_timeout)
            .field("total_timeout", &self.total_timeout)
            .field("dialect", &self.dialect)
            .field("user_id", &self.user_id)
            .field("images", &self.images)
            .field("context_window", &self.context_window)
            .field("models", &self.models)
            .finish()
    }
}

/// The adapter (a clone shares its HTTP client).
#[derive(Clone)]
pub struct OpenAiCompatible {
    config: OpenAiConfig,
    http: reqwest::Client,
}

impl OpenAiCompatible {
    /// An adapter for `config`; fails only when the HTTP client cannot be
    /// built (no TLS roots), which no retry fixes.
    pub fn new(config: OpenAiConfig) -> Result<OpenAiCompatible, reqwest::Error> {
        // One process-wide TLS provider; a second install is a no-op error.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let http = reqwest::Client::builder()
            .user_agent(concat!("dsh/", env!("CARGO_PKG_VERSION")))
            .connect_timeout(Duration::from_secs(30))
            .build()?;
        Ok(OpenAiCompatible { config, http })
    }
}

/// How image blocks go on the wire.
#[derive(Clone, Debug, Default)]
pub enum Images {
    /// The model takes no images: each is described in text.
    #[default]
    Described,
    /// Sent as `image_url` parts: each attachment id's `data:` URL (an id
    /// missing here could not be read back and is described instead).
    Sent(std::collections::HashMap<String, String>),
}

impl Images {
    /// The wire part for an image block.
    fn part(&self, fields: &serde_json::Map<String, Value>) -> Value {
        let id = fields
            .get("attachmentId")
            .and_then(Value::as_str)
            .unwrap_or("");
        match self {
            Images::Sent(urls) => match urls.get(id) {
                Some(url) => json!({"type": "image_url", "image_url": {"url": url}}),
                None => {
                    json!({"type": "text", "text": crate::attachments::placeholder(fields, "its bytes could not be read back")})
                }
            },
            Images::Described => {
                json!({"type": "text", "text": crate::attachments::placeholder(fields, "this model does not take images")})
            }
        }
    }
}

/// The request body for `request` in `dialect`, images described in text;
/// a DeepSeek request naming an effort that does not exist fails before
/// anything is sent.
pub fn request_body(request: &LlmRequest, dialect: Dialect) -> Result<Value, LlmFailure> {
    request_body_with(request, dialect, &Images::Described)
}

/// [`request_body`] with image blocks put on the wire as `images` says.
pub fn request_body_with(
    request: &LlmRequest,
    dialect: Dialect,
    images: &Images,
) -> Result<Value, LlmFailure> {
    let deepseek = matches!(dialect, Dialect::DeepSeek { .. });
    let mut messages = Vec::new();
    if let Some(system) = &request.system {
        messages.push(json!({"role": "system", "content": system.as_ref()}));
    }
    for m in request.messages.iter() {
        wire_messages(m, deepseek, images, &mut messages);
    }
    let mut body = json!({
        "model": request.model,
        "messages": messages,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !request.tools.is_empty() {
        body["tools"] = request
            .tools
            .iter()
            .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}))
            .collect();
    }
    if let Some(t) = request.temperature {
        body["temperature"] = json!(t);
    }
    if let Some(m) = request.max_tokens {
        body["max_tokens"] = json!(m);
    }
    for (k, v) in &request.options {
        body[k] = v.clone();
    }
    if let Dialect::DeepSeek { effort, max_tokens } = dialect {
        // A title has no use for thinking: its output budget is the text.
        let effort = match request.purpose {
            Some("session-title") => {
                if let Some(map) = body.as_object_mut() {
                    map.remove("reasoning_effort");
                }
                ReasoningEffort::Off
            }
            _ => effort,
        };
        deepseek_options(&mut body, effort, max_tokens)?;
    }
    Ok(body)
}

/// DeepSeek's thinking switch: the request's `reasoning_effort` option (an
/// `agent/request` listener may set one per step) or the default; `off`
/// turns thinking off and is not sent as an effort.
fn deepseek_options(
    body: &mut Value,
    default: ReasoningEffort,
    max_tokens: u64,
) -> Result<(), LlmFailure> {
    let effort = match body.get("reasoning_effort") {
        None | Some(Value::Null) => default,
        Some(Value::String(s)) => s.parse().map_err(|e: UnknownEffort| {
            LlmFailure::new(code::UNSUPPORTED_REASONING_EFFORT, chain(&e).to_string())
        })?,
        Some(other) => {
            return Err(LlmFailure::new(
                code::UNSUPPORTED_REASONING_EFFORT,
                format!("reasoning_effort must be a name, not {other}"),
            ));
        }
    };
    let Some(map) = body.as_object_mut() else {
        return Ok(());
    };
    map.remove("reasoning_effort");
    if effort == ReasoningEffort::Off {
        map.insert("thinking".into(), json!({"type": "disabled"}));
    } else {
        map.insert("thinking".into(), json!({"type": "enabled"}));
        map.insert("reasoning_effort".into(), json!(effort.as_str()));
    }
    map.entry("max_tokens").or_insert_with(|| json!(max_tokens));
    Ok(())
}

/// A user message's content: a plain string, or text and image parts.
fn user_content(
    text: &str,
    pictures: &[&serde_json::Map<String, Value>],
    images: &Images,
) -> Value {
    if pictures.is_empty() {
        return Value::String(text.to_owned());
    }
    let mut parts = Vec::new();
    if !text.is_empty() {
        parts.push(json!({"type": "text", "text": text}));
    }
    parts.extend(pictures.iter().map(|f| images.part(f)));
    Value::Array(parts)
}

fn image_fields(blocks: &[ContentBlock]) -> Vec<&serde_json::Map<String, Value>> {
    blocks
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Image { fields } => Some(fields),
            _ => None,
        })
        .collect()
}

fn wire_messages(m: &Message, deepseek: bool, images: &Images, out: &mut Vec<Value>) {
    let text = crate::llm::joined_text(&m.content, "\n");
    match m.role {
        Role::System => out.push(json!({"role": "system", "content": text})),
        Role::User => {
            for b in &m.content {
                if let ContentBlock::ToolResult {
                    tool_call_id,
                    content,
                    ..
                } = b
                {
                    let result: String = content
                        .iter()
                        .filter_map(|c| match c {
                            ContentBlock::Text { text } => Some(text.as_str()),
                            _ => None,
                        })
                        .collect::<Vec<_>>()
                        .join("\n");
                    out.push(
                        json!({"role": "tool", "tool_call_id": tool_call_id, "content": result}),
                    );
                    // A tool message holds text only: its images follow as
                    // the user's, saying whose they are.
                    let pictures = image_fields(content);
                    if !pictures.is_empty() {
                        let said = format!("The images the {tool_call_id} tool call returned:");
                        out.push(json!({"role": "user", "content": user_content(&said, &pictures, images)}));
                    }
                }
            }
            let pictures = image_fields(&m.content);
            if !text.is_empty() || !pictures.is_empty() {
                out.push(
                    json!({"role": "user", "content": user_content(&text, &pictures, images)}),
                );
            }
        }
        Role::Assistant => {
            let calls: Vec<Value> = m
                .tool_calls()
                .map(|(id, name, arguments)| json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}))
                .collect();
            let content = match (text.is_empty(), deepseek) {
                (false, _) => Value::String(text),
                (true, true) => Value::String(String::new()),
                (true, false) => Value::Null,
            };
            let mut msg = json!({"role": "assistant", "content": content});
            if !calls.is_empty() {
                msg["tool_calls"] = Value::Array(calls);
            }
            if deepseek {
                let reasoning: String = m
                    .content
                    .iter()
                    .filter_map(|b| match b {
                        ContentBlock::Reasoning { text } => Some(text.as_str()),
                        _ => None,
                    })
                    .collect();
                if !reasoning.is_empty() {
                    msg["reasoning_content"] = Value::String(reasoning);
                }
            }
            out.push(msg);
        }
    }
}

#[derive(Deserialize)]
struct WireChunk {
    #[serde(default)]
    choices: Vec<WireChoice>,
    #[serde(default)]
    usage: Option<WireUsage>,
    #[serde(default)]
    error: Option<Value>,
}

#[derive(Deserialize)]
struct WireChoice {
    #[serde(default)]
    delta: Option<WireDelta>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct WireDelta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireToolDelta>,
}

#[derive(Deserialize)]
struct WireToolDelta {
    #[serde(default)]
    index: Option<u32>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    function: Option<WireFunction>,
}

#[derive(Deserialize)]
struct WireFunction {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct WireUsage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    prompt_cache_hit_tokens: Option<u64>,
    #[serde(default)]
    prompt_tokens_details: Option<Value>,
    #[serde(default)]
    completion_tokens_details: Option<Value>,
}

/// Turns provider deltas into well-formed chunks.
#[derive(Default)]
pub struct Translator {
    blocks: Vec<Open>,
    reasoning: Option<usize>,
    text: Option<usize>,
    calls: BTreeMap<u32, usize>,
    usage: Option<TokenUsage>,
    finish: Option<FinishReason>,
    /// Whether an event has come (the first-byte wait is over).
    started: bool,
}

struct Open {
    kind: BlockType,
    text: String,
    id: String,
    name: String,
}

impl Translator {
    fn open(&mut self, kind: BlockType, out: &mut Vec<StreamChunk>) -> usize {
        let index = self.blocks.len();
        self.blocks.push(Open {
            kind,
            text: String::new(),
            id: String::new(),
            name: String::new(),
        });
        out.push(StreamChunk::BlockStart {
            index: index as u32,
            block_type: kind,
        });
        index
    }

    /// Chunks for one decoded SSE `data` payload.
    pub fn feed(&mut self, data: &str) -> Result<Vec<StreamChunk>, LlmFailure> {
        let chunk: WireChunk = serde_json::from_str(data).map_err(|e| {
            LlmFailure::new(
                code::MALFORMED_CHUNK,
                format!(
                    "the provider sent an unreadable stream event: {}",
                    chain(&e)
                ),
            )
        })?;
        if let Some(err) = chunk.error {
            let message = err["message"]
                .as_str()
                .unwrap_or("the provider reported an error")
                .to_owned();
            let code = err["code"]
                .as_str()
                .or_else(|| err["type"].as_str())
                .map(|c| c.to_uppercase())
                .unwrap_or_else(|| code::PROVIDER_ERROR.into());
            return Err(LlmFailure::new(&code, message));
        }
        let mut out = Vec::new();
        for choice in chunk.choices {
            if let Some(delta) = choice.delta {
                if let Some(r) = delta.reasoning_content.filter(|r| !r.is_empty()) {
                    let i = match self.reasoning {
                        Some(i) => i,
                        None => {
                            let i = self.open(BlockType::Reasoning, &mut out);
                            self.reasoning = Some(i);
                            i
                        }
                    };
                    self.blocks[i].text.push_str(&r);
                    out.push(StreamChunk::ReasoningDelta {
                        index: i as u32,
                        text: r,
                    });
                }
                if let Some(t) = delta.content.filter(|t| !t.is_empty()) {
                    let i = match self.text {
                        Some(i) => i,
                        None => {
                            let i = self.open(BlockType::Text, &mut out);
                            self.text = Some(i);
                            i
                        }
                    };
                    self.blocks[i].text.push_str(&t);
                    out.push(StreamChunk::TextDelta {
                        index: i as u32,
                        text: t,
                    });
                }
                for (n, call) in delta.tool_calls.into_iter().enumerate() {
                    let key = call.index.unwrap_or(n as u32);
                    let i = match self.calls.get(&key) {
                        Some(i) => *i,
                        None => {
                            let i = self.open(BlockType::ToolCall, &mut out);
                            self.calls.insert(key, i);
                            i
                        }
                    };
                    let block = &mut self.blocks[i];
                    if let Some(id) = call.id.filter(|id| !id.is_empty())
                        && block.id.is_empty()
                    {
                        block.id = id;
                    }
                    let (name, args) = match call.function {
                        Some(f) => (f.name, f.arguments.unwrap_or_default()),
                        None => (None, String::new()),
                    };
                    if let Some(n) = &name
                        && block.name.is_empty()
                    {
                        block.name.clone_from(n);
                    }
                    block.text.push_str(&args);
                    out.push(StreamChunk::ToolCallDelta {
                        index: i as u32,
                        id: block.id.clone(),
                        name,
                        arguments_delta: args,
                    });
                }
            }
            if let Some(reason) = choice.finish_reason {
                self.finish = Some(match reason.as_str() {
                    "stop" => FinishReason::Stop,
                    "tool_calls" | "function_call" => FinishReason::ToolCalls,
                    "length" => FinishReason::MaxTokens,
                    other => FinishReason::Error {
                        failure: Box::new(LlmFailure::new(
                            code::FINISH_REASON,
                            format!("the provider stopped with `{other}`"),
                        )),
                    },
                });
            }
        }
        if let Some(u) = chunk.usage {
            let cached = u
                .prompt_cache_hit_tokens
                .or_else(|| {
                    u.prompt_tokens_details
                        .as_ref()
                        .and_then(|d| d["cached_tokens"].as_u64())
                })
                .unwrap_or(0);
            self.usage = Some(TokenUsage {
                input_tokens: u.prompt_tokens.saturating_sub(cached),
                output_tokens: u.completion_tokens,
                cache_read_tokens: Some(cached),
                cache_write_tokens: None,
                reasoning_tokens: u
                    .completion_tokens_details
                    .as_ref()
                    .and_then(|d| d["reasoning_tokens"].as_u64()),
            });
        }
        Ok(out)
    }

    /// The closing chunks: every block's end, usage, finish. A stream that
    /// ended without a finish reason and without content is an empty
    /// response (retryable).
    pub fn finish(&mut self) -> Vec<StreamChunk> {
        let mut out = Vec::new();
        for (i, b) in self.blocks.iter().enumerate() {
            let block = match b.kind {
                BlockType::Reasoning => ContentBlock::Reasoning {
                    text: b.text.clone(),
                },
                BlockType::ToolCall => ContentBlock::ToolCall {
                    id: if b.id.is_empty() {
                        format!("call_{i}")
                    } else {
                        b.id.clone()
                    },
                    name: b.name.clone(),
                    arguments: b.text.clone(),
                },
                _ => ContentBlock::Text {
                    text: b.text.clone(),
                },
            };
            out.push(StreamChunk::BlockEnd {
                index: i as u32,
                block,
            });
        }
        if let Some(u) = self.usage {
            out.push(StreamChunk::Usage { usage: u });
        }
        let reason = match self.finish.take() {
            Some(FinishReason::Stop) if self.blocks.is_empty() => FinishReason::Error {
                failure: Box::new(LlmFailure::new(
                    code::EMPTY_RESPONSE,
                    "the model returned no content",
                )),
            },
            Some(r) => r,
            None if self.blocks.is_empty() => FinishReason::Error {
                failure: Box::new(LlmFailure::new(
                    code::EMPTY_RESPONSE,
                    "the stream ended without any content or finish reason",
                )),
            },
            None => FinishReason::Stop,
        };
        out.push(StreamChunk::Finish {
            reason,
            replay_state: None,
        });
        out
    }
}

/// A `Retry-After` value as a wait in milliseconds: delay seconds or an
/// HTTP date, measured from `now`. Zero, a date already past and anything
/// unreadable give `None` (the listener's own backoff applies).
pub fn retry_after_ms(value: &str, now: std::time::SystemTime) -> Option<u64> {
    let value = value.trim();
    let wait = match value.parse::<u64>() {
        Ok(secs) => Duration::from_secs(secs),
        Err(_) => httpdate::parse_http_date(value)
            .ok()?
            .duration_since(now)
            .ok()?,
    };
    let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    (ms > 0).then_some(ms)
}

/// Classifies an HTTP error status.
fn status_failure(
    status: reqwest::StatusCode,
    retry_after: Option<u64>,
    request_id: Option<String>,
    body: &str,
) -> LlmFailure {
    let parsed = serde_json::from_str::<Value>(body).ok();
    let error = parsed.as_ref().map(|v| &v["error"]);
    let detail = error
        .and_then(|e| e["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.chars().take(300).collect());
    // What the provider calls it: its error code, type and message.
    let said = [
        error.and_then(|e| e["code"].as_str()),
        error.and_then(|e| e["type"].as_str()),
        Some(detail.as_str()),
    ]
    .iter()
    .flatten()
    .map(|s| s.to_lowercase())
    .collect::<Vec<_>>()
    .join(" ");
    let quota = ["quota", "balance", "credit"]
        .iter()
        .any(|w| said.contains(w));
    let context = [
        "context length",
        "context_length",
        "maximum context",
        "too many tokens",
        "context window",
    ]
    .iter()
    .any(|w| said.contains(w));
    let kind = match status.as_u16() {
        401 | 403 => code::AUTH,
        402 => code::QUOTA,
        404 => code::NOT_FOUND,
        408 => code::TIMEOUT,
        413 => code::CONTEXT_WINDOW_EXCEEDED,
        429 if quota => code::QUOTA,
        429 => code::RATE_LIMITED,
        400 if context => code::CONTEXT_WINDOW_EXCEEDED,
        500..=599 => code::SERVER_ERROR,
        _ => code::BAD_REQUEST,
    };
    LlmFailure {
        status: Some(status.as_u16()),
        provider_retry_after_ms: retry_after,
        request_id,
        ..LlmFailure::new(kind, format!("HTTP {status}: {detail}"))
    }
}

impl LlmAdapter for OpenAiCompatible {
    fn name(&self) -> &str {
        "openai-compatible"
    }

    /// DeepSeek's harness titles its sessions; a generic endpoint is left
    /// to the fallback title.
    fn titles(&self) -> bool {
        matches!(self.config.dialect, Dialect::DeepSeek { .. })
    }

    /// The model's catalogue entry first, then the endpoint's settings;
    /// DeepSeek's: the configured effort and output cap, and upstream's
    /// context window for its models (1,000,000 tokens).
    fn defaults(&self, model: &str) -> ModelDefaults {
        let entry = self.config.model(model);
        let window = entry
            .and_then(|m| m.context_window)
            .or(self.config.context_window);
        let max_tokens = entry.and_then(|m| m.max_tokens);
        let price = entry.and_then(|m| m.price).or(self.config.price);
        match self.config.dialect {
            Dialect::OpenAi => ModelDefaults {
                context_window: window,
                max_tokens,
                price,
                ..ModelDefaults::default()
            },
            Dialect::DeepSeek {
                effort,
                max_tokens: route_max,
            } => ModelDefaults {
                reasoning_effort: Some(effort.as_str()),
                max_tokens: Some(max_tokens.unwrap_or(route_max)),
                context_window: Some(window.unwrap_or(DEEPSEEK_CONTEXT_WINDOW)),
                price,
            },
        }
    }

    /// Whether `model` on this endpoint takes image input: as its
    /// catalogue entry says, else DeepSeek's vision models, or any model of
    /// an endpoint configured to.
    fn accepts_images(&self, model: &str) -> bool {
        if let Some(images) = self.config.model(model).and_then(|m| m.images) {
            return images;
        }
        match self.config.dialect {
            Dialect::DeepSeek { .. } => model.contains("vision"),
            Dialect::OpenAi => self.config.images,
        }
    }

    fn stream(&self, request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
        let now = tokio::time::Instant::now();
        let limits = Limits {
            idle: self.config.idle_timeout,
            first_byte: now + self.config.first_byte_timeout,
            total: now + self.config.total_timeout,
        };
        if !has_images(&request) || !self.accepts_images(&request.model) {
            return self.send(&request, &Images::Described, limits, cancel);
        }
        // The images' bytes are read off the async workers first.
        let (store, me) = (self.config.attachments.clone(), self.clone());
        let start = async move {
            let images = read_images(store, &request).await;
            me.send(&request, &images, limits, cancel)
        };
        Box::pin(futures::stream::once(start).flatten())
    }

    fn model_ids(&self) -> Vec<String> {
        self.config.models.iter().map(|m| m.id.clone()).collect()
    }
}

/// Whether any message of `request` carries an image (a tool result's too).
fn has_images(request: &LlmRequest) -> bool {
    request.messages.iter().any(|m| {
        m.content.iter().any(|b| match b {
            ContentBlock::Image { .. } => true,
            ContentBlock::ToolResult { content, .. } => content
                .iter()
                .any(|c| matches!(c, ContentBlock::Image { .. })),
            _ => false,
        })
    })
}

/// Each image's `data:` URL, read from `store`; one that cannot be read is
/// left out (and described in text).
async fn read_images(
    store: Option<Arc<crate::attachments::Attachments>>,
    request: &LlmRequest,
) -> Images {
    let Some(store) = store else {
        return Images::Sent(Default::default());
    };
    let mut ids: Vec<String> = Vec::new();
    for m in request.messages.iter() {
        for b in &m.content {
            let blocks: &[ContentBlock] = match b {
                ContentBlock::ToolResult { content, .. } => content,
                other => std::slice::from_ref(other),
            };
            for block in blocks {
                if let ContentBlock::Image { fields } = block
                    && let Some(id) = fields.get("attachmentId").and_then(Value::as_str)
                    && !ids.iter().any(|i| i == id)
                {
                    ids.push(id.to_owned());
                }
            }
        }
    }
    let urls = tokio::task::spawn_blocking(move || {
        use base64::Engine;
        ids.into_iter()
            .filter_map(|id| {
                let bytes = store.get(&id).ok()?;
                let kind = crate::attachments::sniff(&bytes)?.media_type;
                let data = base64::engine::general_purpose::STANDARD.encode(&bytes);
                Some((id, format!("data:{kind};base64,{data}")))
            })
            .collect()
    })
    .await
    .unwrap_or_default();
    Images::Sent(urls)
}

impl OpenAiCompatible {
    /// The endpoint's model catalogue.
    pub fn models(&self) -> &[ModelEntry] {
        &self.config.models
    }

    /// Sends `request` with its images as `images` says.
    fn send(
        &self,
        request: &LlmRequest,
        images: &Images,
        limits: Limits,
        cancel: CancellationToken,
    ) -> ChunkStream {
        let url = format!(
            "{}/chat/completions",
            self.config.base_url.trim_end_matches('/')
        );
        let body = match request_body_with(request, self.config.dialect, images) {
            Ok(b) => b,
            Err(f) => return Box::pin(futures::stream::iter([Err(f)])),
        };
        let mut builder = self.http.post(url).json(&body);
        if let Some(key) = &self.config.api_key {
            builder = builder.bearer_auth(key);
        }
        if let Some(purpose) = request.purpose {
            builder = builder.header("x-dsh-purpose", purpose);
        }
        if let Dialect::DeepSeek { .. } = self.config.dialect {
            if let Some(user) = &self.config.user_id {
                builder = builder.header("x-deepseek-harness-user-id", user);
            }
            if let Some(session) = &request.session {
                builder = builder.header("x-deepseek-harness-session-id", session.as_ref());
            }
        }
        Box::pin(async_stream(builder, limits, cancel))
    }
}

/// How long one call may wait, and for what.
#[derive(Clone, Copy)]
struct Limits {
    /// Between two events, once the first came.
    idle: Duration,
    /// For the headers and the first event.
    first_byte: tokio::time::Instant,
    /// For the whole call.
    total: tokio::time::Instant,
}

impl Limits {
    /// The next wait's deadline, and what running into it means.
    fn next(&self, started: bool) -> (tokio::time::Instant, String) {
        let (at, what) = if started {
            (
                tokio::time::Instant::now() + self.idle,
                format!("the stream was silent for {} s", self.idle.as_secs()),
            )
        } else {
            (
                self.first_byte,
                "no response within the time to the first byte (--request-timeout)".to_owned(),
            )
        };
        if self.total < at {
            (self.total, "the call ran past its total ceiling".to_owned())
        } else {
            (at, what)
        }
    }
}

fn async_stream(
    builder: reqwest::RequestBuilder,
    limits: Limits,
    cancel: CancellationToken,
) -> impl futures::Stream<Item = Result<StreamChunk, LlmFailure>> + Send + 'static {
    enum State {
        Start(Box<reqwest::RequestBuilder>),
        Body(
            std::pin::Pin<
                Box<dyn futures::Stream<Item = Result<String, crate::llm::sse::SseError>> + Send>,
            >,
            Box<Translator>,
        ),
        Done,
    }
    let pending: std::collections::VecDeque<Result<StreamChunk, LlmFailure>> = Default::default();
    futures::stream::unfold(
        (State::Start(Box::new(builder)), pending, cancel),
        move |(mut state, mut queue, cancel)| async move {
            loop {
                if let Some(item) = queue.pop_front() {
                    return Some((item, (state, queue, cancel)));
                }
                match state {
                    State::Done => return None,
                    State::Start(builder) => {
                        let (deadline, late) = limits.next(false);
                        let sent = tokio::select! {
                            r = tokio::time::timeout_at(deadline, (*builder).send()) => r,
                            () = cancel.cancelled() => return Some((Err(LlmFailure::new(code::ABORTED, "the call was cancelled")), (State::Done, queue, cancel))),
                        };
                        let response = match sent {
                            Err(_) => {
                                let f = LlmFailure::new(code::TIMEOUT, late);
                                return Some((Err(f), (State::Done, queue, cancel)));
                            }
                            Ok(Ok(r)) => r,
                            Ok(Err(e)) => {
                                return Some((
                                    Err(LlmFailure::new(
                                        code::CONNECTION,
                                        format!("cannot reach the endpoint: {}", chain(&e)),
                                    )),
                                    (State::Done, queue, cancel),
                                ));
                            }
                        };
                        let status = response.status();
                        if !status.is_success() {
                            let retry_after = response
                                .headers()
                                .get("retry-after")
                                .and_then(|v| v.to_str().ok())
                                .and_then(|v| retry_after_ms(v, std::time::SystemTime::now()));
                            let request_id = ["x-request-id", "x-deepseek-request-id"]
                                .iter()
                                .find_map(|h| response.headers().get(*h))
                                .and_then(|v| v.to_str().ok())
                                .map(str::to_owned);
                            let body = response.text().await.unwrap_or_default();
                            return Some((
                                Err(status_failure(status, retry_after, request_id, &body)),
                                (State::Done, queue, cancel),
                            ));
                        }
                        let streaming = response
                            .headers()
                            .get("content-type")
                            .and_then(|v| v.to_str().ok())
                            .is_none_or(|v| v.starts_with("text/event-stream"));
                        if !streaming {
                            let body = response.text().await.unwrap_or_default();
                            let snippet: String = body.chars().take(200).collect();
                            let f = LlmFailure::new(
                                code::MALFORMED_RESPONSE,
                                format!("expected an event stream, got: {snippet}"),
                            );
                            return Some((Err(f), (State::Done, queue, cancel)));
                        }
                        let events = crate::llm::sse::events(
                            response.bytes_stream(),
                            crate::llm::sse::MAX_EVENT,
                        );
                        state = State::Body(Box::pin(events), Box::default());
                    }
                    State::Body(mut events, mut tr) => {
                        let (deadline, late) = limits.next(tr.started);
                        let next = tokio::select! {
                            n = tokio::time::timeout_at(deadline, events.next()) => n,
                            () = cancel.cancelled() => return Some((Err(LlmFailure::new(code::ABORTED, "the call was cancelled")), (State::Done, queue, cancel))),
                        };
                        match next {
                            Err(_) => {
                                let f = LlmFailure::new(code::TIMEOUT, late);
                                return Some((Err(f), (State::Done, queue, cancel)));
                            }
                            Ok(None) => {
                                // The connection closed without `[DONE]`.
                                let f = if tr.finish.is_some() {
                                    queue.extend(tr.finish().into_iter().map(Ok));
                                    state = State::Done;
                                    continue;
                                } else {
                                    LlmFailure::new(
                                        code::CONNECTION_LOST,
                                        "the connection closed mid-stream",
                                    )
                                };
                                return Some((Err(f), (State::Done, queue, cancel)));
                            }
                            Ok(Some(Err(e))) => {
                                let f = match e {
                                    crate::llm::sse::SseError::TooLarge { .. } => LlmFailure::new(
                                        code::MALFORMED_RESPONSE,
                                        format!(
                                            "the endpoint sent {}; refusing to buffer more",
                                            chain(&e)
                                        ),
                                    ),
                                    crate::llm::sse::SseError::Transport(e) => LlmFailure::new(
                                        code::CONNECTION_LOST,
                                        format!("the stream broke: {e}"),
                                    ),
                                };
                                return Some((Err(f), (State::Done, queue, cancel)));
                            }
                            Ok(Some(Ok(data))) => {
                                tr.started = true;
                                if data.trim() == "[DONE]" {
                                    queue.extend(tr.finish().into_iter().map(Ok));
                                    state = State::Done;
                                    continue;
                                }
                                match tr.feed(&data) {
                                    Ok(chunks) => queue.extend(chunks.into_iter().map(Ok)),
                                    Err(f) => return Some((Err(f), (State::Done, queue, cancel))),
                                }
                                state = State::Body(events, tr);
                            }
                        }
                    }
                }
            }
        },
    )
}

/// Retry with exponential backoff for failures before the first chunk
/// (a refused or failed request): an `llm/stream` listener. A failure after
/// chunks were delivered is never retried here (those chunks are logged).
#[derive(Clone, Copy, Debug)]
pub struct RetryListener {
    /// Retries after the first attempt.
    pub max_retries: u32,
    /// First backoff.
    pub initial: Duration,
    /// Backoff ceiling.
    pub max: Duration,
}

impl Default for RetryListener {
    fn default() -> Self {
        RetryListener {
            max_retries: 5,
            initial: Duration::from_millis(500),
            max: Duration::from_secs(20),
        }
    }
}

impl RetryListener {
    /// Registers the listener through `ctx` (removed with its fiber).
    pub fn install(self, ctx: &Context) -> dsh_supervisors::Result<Disposer> {
        let policy = Arc::new(self);
        ctx.on_waterfall_with(ListenOptions::default(), move |call: LlmStream, next| {
            let policy = policy.clone();
            async move {
                let mut attempt = 0u32;
                let mut delay = policy.initial;
                loop {
                    let cancel = call.cancel.clone();
                    let result = next
                        .run(LlmStream {
                            request: call.request.clone(),
                            cancel: cancel.clone(),
                        })
                        .await;
                    // A failed request (refused, or failing at its first
                    // item) is tried again while the policy allows.
                    let (failed, rest) = match result {
                        Ok(mut stream) => match stream.next().await {
                            Some(Err(f)) => (f, Some(stream)),
                            Some(first) => {
                                let head = futures::stream::iter([first]);
                                return Ok(Box::pin(head.chain(stream)) as ChunkStream);
                            }
                            None => return Ok(Box::pin(futures::stream::empty()) as ChunkStream),
                        },
                        Err(f) => (f, None),
                    };
                    if attempt >= policy.max_retries || !failed.retryable() {
                        // As it came: a refused request, or a stream that
                        // fails at its first item.
                        return match rest {
                            Some(rest) => {
                                let head = futures::stream::iter([Err(failed)]);
                                Ok(Box::pin(head.chain(rest)) as ChunkStream)
                            }
                            None => Err(failed),
                        };
                    }
                    attempt += 1;
                    let wait = failed
                        .provider_retry_after_ms
                        .map(Duration::from_millis)
                        .unwrap_or(delay);
                    tracing::warn!(code = %failed.code, attempt, "model request failed; retrying");
                    if let Some(notify) = &call.request.notify {
                        notify.tell(&Retrying {
                            attempt,
                            max_retries: policy.max_retries,
                            code: failed.code.clone(),
                            status: failed.status,
                            message: failed.message.clone(),
                            wait,
                        });
                    }
                    if !backoff(&cancel, wait).await {
                        return Err(failed);
                    }
                    delay = (delay * 2).min(policy.max);
                }
            }
        })
    }
}
/// Waits `d` unless cancelled first; false when cancelled.
async fn backoff(cancel: &CancellationToken, d: Duration) -> bool {
    tokio::select! {
        () = tokio::time::sleep(d) => true,
        () = cancel.cancelled() => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_become_well_formed_chunks() {
        let mut t = Translator::default();
        let mut all = Vec::new();
        for data in [
            r#"{"choices":[{"delta":{"reasoning_content":"hm"}}]}"#,
            r#"{"choices":[{"delta":{"content":"Hi"}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"toolu_9","function":{"name":"read","arguments":"{\"file"}}]}}]}"#,
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"_path\":\"a\"}"}}]}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":100,"completion_tokens":9,"prompt_cache_hit_tokens":60}}"#,
        ] {
            all.extend(t.feed(data).unwrap());
        }
        all.extend(t.finish());
        let mut a = crate::llm::BlockAssembler::new();
        for c in &all {
            a.push(c);
        }
        assert_eq!(
            a.blocks().unwrap(),
            vec![
                ContentBlock::Reasoning { text: "hm".into() },
                ContentBlock::text("Hi"),
                ContentBlock::ToolCall {
                    id: "toolu_9".into(),
                    name: "read".into(),
                    arguments: "{\"file_path\":\"a\"}".into()
                },
            ]
        );
        assert_eq!(a.finish(), FinishReason::ToolCalls);
        let usage = a.usage().unwrap();
        assert_eq!(
            (usage.input_tokens, usage.cache_read_tokens),
            (40, Some(60))
        );
        assert!(matches!(all.last(), Some(StreamChunk::Finish { .. })));
    }

    #[test]
    fn length_drops_tool_calls_and_errors_in_stream_are_failures() {
        let mut t = Translator::default();
        t.feed(r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"x","arguments":"{"}}]},"finish_reason":"length"}]}"#).unwrap();
        let mut a = crate::llm::BlockAssembler::new();
        for c in t.finish() {
            a.push(&c);
        }
        assert_eq!(a.finish(), FinishReason::MaxTokens);
        assert!(a.blocks().unwrap().is_empty());
        let err = Translator::default()
            .feed(r#"{"error":{"message":"quota","type":"insufficient_quota"}}"#)
            .unwrap_err();
        assert_eq!(
            (err.code.as_str(), err.message.as_str()),
            ("INSUFFICIENT_QUOTA", "quota")
        );
        assert_eq!(
            Translator::default().feed("{oops").unwrap_err().code,
            "MALFORMED_CHUNK"
        );
    }
}
