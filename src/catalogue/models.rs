//! The model provider plugins: `openai` (any OpenAI-compatible endpoint),
//! `deepseek`, `scripted`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_services::llm::LlmRuntime;
use dsh_services::providers::openai::{
    Dialect, ModelEntry, OpenAiCompatible, OpenAiConfig, ReasoningEffort,
};
use dsh_services::providers::scripted::ScriptedModel;
use dsh_supervisors::{BoxError, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

/// Config of the `openai` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OpenAiPluginConfig {
    /// Provider route agents name (default `openai`).
    #[serde(default = "default_openai_route")]
    pub provider: String,
    /// Endpoint up to the API version, e.g. `https://api.deepseek.com/v1`.
    pub base_url: String,
    /// Environment variable holding the API key (default `DSH_API_KEY`); the
    /// key itself never appears in a config file or a log.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Longest silence between stream events, in seconds (default 300).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// Longest wait for the first byte of an answer (headers and first
    /// event), in seconds (default 600: reasoning models think first).
    #[serde(default)]
    pub request_timeout_s: Option<u64>,
    /// Longest a whole model call may take, in seconds (default 3600).
    #[serde(default)]
    pub total_timeout_s: Option<u64>,
    /// The endpoint's models take image input (sent as `image_url` parts;
    /// otherwise images are described in text).
    #[serde(default)]
    pub images: bool,
    /// The models' context window in tokens; agents compact their history
    /// before a request would pass it (unset: never). A `models` entry's
    /// own wins for its model.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Known models and what differs for each (context window, output cap,
    /// images); other model ids pass through with the entry's settings.
    #[serde(default)]
    pub models: Models,
    /// What the endpoint's tokens cost, per million; a run shows its cost
    /// only when this (or its model's) is set. There is no built-in table.
    #[serde(default)]
    pub price: Option<PriceConfig>,
}

impl OpenAiPluginConfig {
    /// The route `provider` to the endpoint `base_url`, its key in the
    /// variable `api_key_env`; every other setting its default.
    pub fn endpoint(provider: &str, base_url: &str, api_key_env: &str) -> OpenAiPluginConfig {
        OpenAiPluginConfig {
            provider: provider.to_owned(),
            base_url: base_url.to_owned(),
            api_key_env: Some(api_key_env.to_owned()),
            idle_timeout_s: None,
            request_timeout_s: None,
            total_timeout_s: None,
            images: false,
            context_window: None,
            models: Default::default(),
            price: None,
        }
    }
}

/// Prices per million tokens, in one currency (the one you bill in).
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(try_from = "PriceFields")]
#[schemars(with = "PriceFields")]
pub struct PriceConfig(pub dsh_services::llm::Price);

/// A price as written: three non-negative numbers.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PriceFields {
    /// Per million uncached input tokens.
    pub input: f64,
    /// Per million input tokens served from cache (default: `input`).
    #[serde(default)]
    pub cached_input: Option<f64>,
    /// Per million output tokens.
    pub output: f64,
}

impl TryFrom<PriceFields> for PriceConfig {
    type Error = String;

    fn try_from(p: PriceFields) -> Result<PriceConfig, String> {
        let micro = |field: &str, v: f64| {
            if v.is_finite() && (0.0..=1e6).contains(&v) {
                Ok((v * 1e6).round() as u64)
            } else {
                Err(format!(
                    "price.{field}: {v} is not a price per million tokens (0 to 1000000)"
                ))
            }
        };
        Ok(PriceConfig(dsh_services::llm::Price {
            input: micro("input", p.input)?,
            cached_input: micro("cached_input", p.cached_input.unwrap_or(p.input))?,
            output: micro("output", p.output)?,
        }))
    }
}

/// A checked `models` list: non-empty ids, each listed once, positive
/// sizes (refused where the config is read, with the entry named).
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(try_from = "Vec<ModelConfig>")]
#[schemars(with = "Vec<ModelConfig>")]
pub struct Models(pub Vec<ModelEntry>);

impl TryFrom<Vec<ModelConfig>> for Models {
    type Error = String;

    fn try_from(list: Vec<ModelConfig>) -> Result<Models, String> {
        model_catalogue(&list).map(Models)
    }
}

/// One model of a provider entry's `models` list.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The wire `model` id.
    pub id: String,
    /// A display name (default: the id).
    #[serde(default)]
    pub name: Option<String>,
    /// Its context window in tokens.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Its output cap of requests that name none.
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Whether it takes image input (default: the entry's `images`).
    #[serde(default)]
    pub images: Option<bool>,
    /// What its tokens cost, per million (default: the entry's `price`).
    #[serde(default)]
    pub price: Option<PriceConfig>,
}

/// The adapter's catalogue from a `models` list, each entry checked: a
/// non-empty id listed once, positive sizes.
fn model_catalogue(list: &[ModelConfig]) -> Result<Vec<ModelEntry>, String> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("models[{i}]");
        let id = m.id.trim();
        if id.is_empty() {
            return Err(format!("{at}: `id` is empty"));
        }
        if !seen.insert(id) {
            return Err(format!("{at}: model `{id}` is listed twice"));
        }
        for (field, value) in [
            ("context_window", m.context_window),
            ("max_tokens", m.max_tokens),
        ] {
            if value == Some(0) {
                return Err(format!("{at} (`{id}`): `{field}` must be at least 1"));
            }
        }
        out.push(ModelEntry {
            id: id.to_owned(),
            name: m.name.clone(),
            context_window: m.context_window,
            max_tokens: m.max_tokens,
            images: m.images,
            price: m.price.map(|p| p.0),
        });
    }
    Ok(out)
}

fn default_openai_route() -> String {
    "openai".into()
}

/// A provider entry's settings beyond its URL and key: timeouts in seconds
/// (`None`: the default), images, the context window.
struct EndpointSettings {
    /// The models take image input.
    images: bool,
    /// Where image bytes are.
    attachments: Option<Arc<dsh_services::attachments::Attachments>>,
    /// The models' context window, in tokens.
    context_window: Option<u64>,
    /// The model catalogue.
    models: Vec<ModelEntry>,
    /// What the endpoint's tokens cost.
    price: Option<dsh_services::llm::Price>,
    request_s: Option<u64>,
    idle_s: Option<u64>,
    total_s: Option<u64>,
}

/// The adapter of an OpenAI-compatible endpoint whose key is in `key_env`
/// (withheld from tool processes from now on).
fn endpoint(
    base_url: &str,
    key_env: &str,
    t: EndpointSettings,
    dialect: Dialect,
) -> Result<OpenAiCompatible, BoxError> {
    dsh_services::sandbox::env::register_secret(key_env);
    let secs =
        |s: Option<u64>, default: Duration| s.map_or(default, |s| Duration::from_secs(s.max(1)));
    Ok(OpenAiCompatible::new(OpenAiConfig {
        base_url: base_url.to_owned(),
        api_key: std::env::var(key_env).ok().filter(|k| !k.is_empty()),
        idle_timeout: secs(t.idle_s, OpenAiConfig::IDLE),
        first_byte_timeout: secs(t.request_s, OpenAiConfig::FIRST_BYTE),
        total_timeout: secs(t.total_s, OpenAiConfig::TOTAL),
        dialect,
        user_id: matches!(dialect, Dialect::DeepSeek { .. }).then(crate::home::user_id),
        images: t.images,
        attachments: t.attachments,
        context_window: t.context_window,
        models: t.models,
        price: t.price,
    })?)
}

/// Registers an OpenAI-compatible streaming adapter under a provider route.
pub struct OpenAi;

impl Plugin for OpenAi {
    type Config = OpenAiPluginConfig;

    fn name(&self) -> &str {
        "openai"
    }

    fn inject(&self) -> &[&'static str] {
        &[LlmRuntime::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<OpenAiPluginConfig>) -> Result<(), BoxError> {
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or("the `llm` service is gone")?;
        let settings = EndpointSettings {
            request_s: config.request_timeout_s,
            idle_s: config.idle_timeout_s,
            total_s: config.total_timeout_s,
            images: config.images,
            attachments: ctx.get(dsh_services::attachments::Attachments::SERVICE),
            context_window: config.context_window,
            models: config.models.0.clone(),
            price: config.price.map(|p| p.0),
        };
        let key_env = config.api_key_env.as_deref().unwrap_or("DSH_API_KEY");
        let adapter = endpoint(&config.base_url, key_env, settings, Dialect::OpenAi)?;
        llm.register(&ctx, &[config.provider.as_str()], Arc::new(adapter))?;
        Ok(())
    }
}

/// Config of the `deepseek` plugin.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeepSeekPluginConfig {
    /// Provider route agents name (default `deepseek`).
    #[serde(default)]
    pub provider: Option<String>,
    /// Endpoint (default `$DEEPSEEK_BASE_URL`, else the official API).
    #[serde(default)]
    pub base_url: Option<String>,
    /// Environment variable holding the key (default `DEEPSEEK_API_KEY`).
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Thinking effort of requests that name none: `off`, `low`, `high`
    /// (default) or `max`.
    #[serde(default)]
    pub reasoning_effort: Option<ReasoningEffort>,
    /// `max_tokens` of requests that name none (default 256000).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// Longest wait for the first byte, in seconds (default 600).
    #[serde(default)]
    pub request_timeout_s: Option<u64>,
    /// Longest silence between stream events, in seconds (default 300).
    #[serde(default)]
    pub idle_timeout_s: Option<u64>,
    /// Longest a whole call may take, in seconds (default 3600).
    #[serde(default)]
    pub total_timeout_s: Option<u64>,
    /// The context window in tokens (default 1,000,000); agents compact
    /// their history before a request would pass it. A `models` entry's
    /// own wins for its model.
    #[serde(default)]
    pub context_window: Option<u64>,
    /// Known models (default: V4 Flash, V4 Pro, V4 Flash Vision; a list
    /// replaces them); other model ids pass through.
    #[serde(default)]
    pub models: Option<Models>,
    /// What the route's tokens cost, per million (see the `openai` entry).
    #[serde(default)]
    pub price: Option<PriceConfig>,
}

/// Registers DeepSeek's chat-completions API (the OpenAI-compatible adapter
/// in DeepSeek's dialect: thinking and effort, reasoning passed back).
pub struct DeepSeek;

impl Plugin for DeepSeek {
    type Config = DeepSeekPluginConfig;

    fn name(&self) -> &str {
        "deepseek"
    }

    fn inject(&self) -> &[&'static str] {
        &[LlmRuntime::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<DeepSeekPluginConfig>) -> Result<(), BoxError> {
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or("the `llm` service is gone")?;
        let base_url = config
            .base_url
            .clone()
            .or_else(|| {
                std::env::var("DEEPSEEK_BASE_URL")
                    .ok()
                    .filter(|u| !u.is_empty())
            })
            .unwrap_or_else(|| dsh_services::providers::openai::DEEPSEEK_BASE_URL.into());
        let settings = EndpointSettings {
            request_s: config.request_timeout_s,
            idle_s: config.idle_timeout_s,
            total_s: config.total_timeout_s,
            images: false,
            attachments: ctx.get(dsh_services::attachments::Attachments::SERVICE),
            context_window: config.context_window,
            models: match &config.models {
                Some(list) => list.0.clone(),
                None => dsh_services::providers::openai::deepseek_models(),
            },
            price: config.price.map(|p| p.0),
        };
        let dialect = Dialect::DeepSeek {
            effort: config.reasoning_effort.unwrap_or_default(),
            max_tokens: config.max_tokens.unwrap_or(256_000).max(1),
        };
        let key_env = config.api_key_env.as_deref().unwrap_or("DEEPSEEK_API_KEY");
        let adapter = endpoint(&base_url, key_env, settings, dialect)?;
        let route = config.provider.clone().unwrap_or_else(|| "deepseek".into());
        llm.register(&ctx, &[route.as_str()], Arc::new(adapter))?;
        Ok(())
    }
}

/// Config of the `scripted` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScriptedPluginConfig {
    /// Provider route agents name (default `scripted`).
    #[serde(default = "default_scripted_route")]
    pub provider: String,
    /// The script file (`{"steps": [...]}`).
    pub script: PathBuf,
}

fn default_scripted_route() -> String {
    "scripted".into()
}

/// Registers the keyless scripted model under a provider route.
pub struct Scripted;

impl Plugin for Scripted {
    type Config = ScriptedPluginConfig;

    fn name(&self) -> &str {
        "scripted"
    }

    fn inject(&self) -> &[&'static str] {
        &[LlmRuntime::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<ScriptedPluginConfig>) -> Result<(), BoxError> {
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or("the `llm` service is gone")?;
        let path = config.script.clone();
        let text = tokio::fs::read_to_string(&path)
            .await
            .map_err(|e| format!("cannot read the script {}: {e}", path.display()))?;
        let model =
            ScriptedModel::from_json(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        llm.register(&ctx, &[config.provider.as_str()], Arc::new(model))?;
        Ok(())
    }
}
