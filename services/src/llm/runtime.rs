//! The LLM service: provider routes to adapters, and the `llm/stream`
//! waterfall every model call goes through.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, Disposer, Event, Waterfall};
use futures::stream::BoxStream;
use tokio_util::sync::CancellationToken;

use super::History;
use super::{LlmFailure, StreamChunk, ToolSchema, code};
use dsh_supervisors::registry::RegisterError;

/// One model call, provider-neutral.
#[derive(Clone, Debug)]
pub struct LlmRequest {
    /// Provider route (selects the adapter).
    pub provider: String,
    /// Model id, passed to the adapter.
    pub model: String,
    /// Rendered system prompt.
    pub system: Option<Arc<str>>,
    /// The conversation (derived history), shared.
    pub messages: History,
    /// Tools the model may call.
    pub tools: Arc<[ToolSchema]>,
    /// Sampling temperature.
    pub temperature: Option<f64>,
    /// Output-token ceiling.
    pub max_tokens: Option<u64>,
    /// Provider-specific request fields (e.g. `tool_choice`), merged into the
    /// wire request by adapters that understand them; `llm/stream` listeners
    /// may set them.
    pub options: serde_json::Map<String, serde_json::Value>,
    /// The calling session (DeepSeek's adapter sends it as
    /// `x-deepseek-harness-session-id`; never in the body).
    pub session: Option<Arc<str>>,
    /// What a request that is not the conversation is for (`session-title`,
    /// `compaction`): sent as `x-dsh-purpose` so proxies, meters and mocks
    /// can tell it apart; `None` for the conversation.
    pub purpose: Option<&'static str>,
    /// Told what happens to the call before its answer comes (a retry and
    /// its wait), so the caller can record and show it.
    pub notify: Option<Notify>,
}

/// What happened to a call before its answer: a failed attempt that will
/// be tried again after `wait`.
#[derive(Clone, Debug, PartialEq)]
pub struct Retrying {
    /// The attempt that failed (1 for the first).
    pub attempt: u32,
    /// How many retries the policy allows after the first attempt.
    pub max_retries: u32,
    /// The failure's code (`RATE_LIMITED`, `NETWORK`, …).
    pub code: String,
    /// Its HTTP status, when there was one.
    pub status: Option<u16>,
    /// Its message.
    pub message: String,
    /// How long until the next attempt.
    pub wait: std::time::Duration,
}

/// The caller's ear for [`Retrying`] notices (see [`LlmRequest::notify`]).
#[derive(Clone)]
pub struct Notify(Arc<dyn Fn(&Retrying) + Send + Sync>);

impl Notify {
    /// A notify that calls `f`.
    pub fn new(f: impl Fn(&Retrying) + Send + Sync + 'static) -> Notify {
        Notify(Arc::new(f))
    }

    /// Tells the caller.
    pub fn tell(&self, notice: &Retrying) {
        (self.0)(notice)
    }
}

impl std::fmt::Debug for Notify {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Notify")
    }
}

/// The chunks of one call; a transport failure ends it with `Err`.
pub type ChunkStream = BoxStream<'static, Result<StreamChunk, LlmFailure>>;

/// A provider adapter: turns a request into a chunk stream.
///
/// Contract: `usage` before `finish`, nothing after `finish`; tool-call
/// arguments stay raw JSON strings; one call is one provider attempt (no
/// hidden retries); cancellation through `cancel` ends the stream promptly.
pub trait LlmAdapter: Send + Sync + 'static {
    /// Name for diagnostics (`openai-compatible`, `scripted`).
    fn name(&self) -> &str;
    /// Starts one call.
    fn stream(&self, request: LlmRequest, cancel: CancellationToken) -> ChunkStream;

    /// Whether agents on this route ask it for a session title (one
    /// auxiliary request per new session). Real endpoints may; scripted
    /// and replay models, whose calls are counted steps, do not.
    fn titles(&self) -> bool {
        false
    }

    /// What this adapter fills in for `model` when a request leaves it out
    /// (logged in `request/header` as adapter defaults), and the model's
    /// context window when the adapter knows it.
    fn defaults(&self, model: &str) -> ModelDefaults {
        let _ = model;
        ModelDefaults::default()
    }

    /// Whether `model` on this route takes image input (else images are
    /// described to it in text).
    fn accepts_images(&self, model: &str) -> bool {
        let _ = model;
        false
    }

    /// The model ids this route knows (its catalogue), for a person to
    /// choose from; empty when it has none (any id passes through).
    fn model_ids(&self) -> Vec<String> {
        Vec::new()
    }
}

/// The call settings an adapter supplies for a model (see
/// [`LlmAdapter::defaults`]); `None`: the adapter adds none.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ModelDefaults {
    /// The reasoning effort of a request that names none.
    pub reasoning_effort: Option<&'static str>,
    /// The output-token ceiling of a request that names none.
    pub max_tokens: Option<u64>,
    /// How many tokens the model reads at most (prompt and answer).
    pub context_window: Option<u64>,
    /// What its tokens cost, when the route's config says.
    pub price: Option<Price>,
}

/// What a model's tokens cost, per million, in millionths of the price's
/// currency (whole numbers, so that settings compare exactly): a config's
/// `price: {input: 0.27, cached_input: 0.07, output: 1.10}` is
/// `Price { input: 270_000, cached_input: 70_000, output: 1_100_000 }`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Price {
    /// Per million uncached input tokens.
    pub input: u64,
    /// Per million input tokens served from cache.
    pub cached_input: u64,
    /// Per million output tokens.
    pub output: u64,
}

impl Price {
    /// The cost of `usage`'s tokens, in millionths of the currency.
    pub fn cost(&self, input: u64, cached_input: u64, output: u64) -> u64 {
        let part = |tokens: u64, per_million: u64| {
            (u128::from(tokens) * u128::from(per_million) / 1_000_000) as u64
        };
        part(input, self.input) + part(cached_input, self.cached_input) + part(output, self.output)
    }
}

/// `llm/stream` (waterfall): wraps every model call. A listener may change
/// the request, short-circuit with its own stream or failure, or call
/// `next` again (retry). The built-in terminal looks up the adapter.
pub struct LlmStream {
    /// The request (mutable by listeners).
    pub request: LlmRequest,
    /// The caller's cancellation.
    pub cancel: CancellationToken,
}

impl Event for LlmStream {
    const NAME: &'static str = "llm/stream";
}

impl Waterfall for LlmStream {
    type Output = Result<ChunkStream, LlmFailure>;
}

/// Provider routes of one runtime (the `llm` service).
#[derive(Default)]
pub struct LlmRuntime {
    routes: RwLock<HashMap<String, Arc<dyn LlmAdapter>>>,
    /// The model id an agent on a route uses when it names none (the one
    /// the command line chose).
    preferred: RwLock<HashMap<String, String>>,
}

impl LlmRuntime {
    /// The capability name.
    pub const SERVICE: &'static str = "llm";

    /// An empty runtime.
    pub fn new() -> LlmRuntime {
        LlmRuntime::default()
    }

    /// Registers `adapter` for every provider route in `providers`, all or
    /// nothing: a route already taken refuses the whole registration. The
    /// routes are removed when `ctx`'s fiber unloads.
    pub fn register(
        self: &Arc<Self>,
        ctx: &Context,
        providers: &[&str],
        adapter: Arc<dyn LlmAdapter>,
    ) -> Result<Disposer, RegisterError> {
        {
            // A poisoned lock only means a registration panicked; the map is whole.
            let mut routes = self.routes.write().unwrap_or_else(|p| p.into_inner());
            if let Some(taken) = providers.iter().find(|p| routes.contains_key(**p)) {
                return Err(RegisterError::Taken {
                    what: "provider route",
                    name: (*taken).to_owned(),
                });
            }
            for p in providers {
                routes.insert((*p).to_owned(), adapter.clone());
            }
        }
        let me = self.clone();
        let owned: Vec<String> = providers.iter().map(|p| (*p).to_owned()).collect();
        let remove = move || {
            let mut routes = me.routes.write().unwrap_or_else(|p| p.into_inner());
            for p in &owned {
                routes.remove(p);
            }
        };
        let label = format!("llm routes {}", providers.join(","));
        Ok(ctx.effect_or_undo(&label, remove)?)
    }

    /// The adapter serving `provider`.
    pub fn adapter(&self, provider: &str) -> Option<Arc<dyn LlmAdapter>> {
        self.routes.read().ok()?.get(provider).cloned()
    }

    /// What the adapter serving `provider` fills in for `model` (nothing
    /// for a route that is not registered).
    pub fn defaults(&self, provider: &str, model: &str) -> ModelDefaults {
        let routes = self.routes.read().unwrap_or_else(|p| p.into_inner());
        routes
            .get(provider)
            .map(|a| a.defaults(model))
            .unwrap_or_default()
    }

    /// Whether `model` on `provider` takes image input (`false` for a route
    /// that is not registered).
    pub fn accepts_images(&self, provider: &str, model: &str) -> bool {
        let routes = self.routes.read().unwrap_or_else(|p| p.into_inner());
        routes
            .get(provider)
            .is_some_and(|a| a.accepts_images(model))
    }

    /// Makes `model` the id agents on `provider` use when they name none.
    pub fn prefer(&self, provider: &str, model: &str) {
        let mut preferred = self.preferred.write().unwrap_or_else(|p| p.into_inner());
        preferred.insert(provider.to_owned(), model.to_owned());
    }

    /// The model ids a person may choose on `provider`: the preferred one
    /// first, then the route's catalogue (none for a route that is not
    /// registered).
    pub fn model_ids(&self, provider: &str) -> Vec<String> {
        let Some(adapter) = self.adapter(provider) else {
            return Vec::new();
        };
        let preferred = self.preferred.read().unwrap_or_else(|p| p.into_inner());
        let mut ids: Vec<String> = preferred.get(provider).cloned().into_iter().collect();
        for id in adapter.model_ids() {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
        ids
    }

    /// Registered provider routes, sorted.
    pub fn providers(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .routes
            .read()
            .map(|r| r.keys().cloned().collect())
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Starts a call through the `llm/stream` waterfall (dispatched to the
    /// listeners visible from `ctx`).
    pub async fn stream(
        self: &Arc<Self>,
        ctx: &Context,
        request: LlmRequest,
        cancel: CancellationToken,
    ) -> Result<ChunkStream, LlmFailure> {
        let me = self.clone();
        let terminal = move |call: LlmStream| {
            let found = me.adapter(&call.request.provider);
            async move {
                match found {
                    Some(adapter) => Ok(adapter.stream(call.request, call.cancel)),
                    None => Err(LlmFailure::new(
                        code::UNKNOWN_PROVIDER,
                        format!("no adapter serves provider `{}`", call.request.provider),
                    )),
                }
            }
        };
        let target = dsh_supervisors::Target::Scope(ctx.scope_key().cloned());
        match ctx
            .events()
            .waterfall(&target, LlmStream { request, cancel }, terminal)
            .await
        {
            Ok(out) => out,
            Err(e) => Err(LlmFailure::new(
                code::LISTENER_PANICKED,
                chain(&e).to_string(),
            )),
        }
    }
}
