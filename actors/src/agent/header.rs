//! What a step's request carries beyond its messages, as logged in
//! `request/header`: the call settings in force ([`CallConfig`]) and the
//! header value built from them, the spec, the system text and the tools.

use dsh_services::llm::{LlmRequest, ModelDefaults, ToolSchema};

use super::AgentSpec;

/// The call settings a step sends beyond its spec's route and sampling:
/// the reasoning effort and output cap in force, and which of them the
/// adapter supplied (`request/header` marks those as `adapterDefaults`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct CallConfig {
    /// The effort sent (`reasoning_effort`), if any.
    pub(super) reasoning_effort: Option<String>,
    /// The output cap sent (`max_tokens`), if any.
    pub(super) max_tokens: Option<u64>,
    /// The effort is the adapter's default.
    pub(super) effort_defaulted: bool,
    /// The output cap is the adapter's default.
    pub(super) max_tokens_defaulted: bool,
}

/// The request option naming a step's reasoning effort.
const EFFORT: &str = "reasoning_effort";

impl CallConfig {
    /// What `request` sends once the adapter's `defaults` fill what it
    /// leaves out.
    pub(super) fn of(request: &LlmRequest, defaults: ModelDefaults) -> CallConfig {
        let asked = request.options.get(EFFORT).and_then(|v| v.as_str());
        let (reasoning_effort, effort_defaulted) = match (asked, defaults.reasoning_effort) {
            (Some(e), _) => (Some(e.to_owned()), false),
            (None, Some(d)) => (Some(d.to_owned()), true),
            (None, None) => (None, false),
        };
        let max_tokens_defaulted = request.max_tokens.is_none() && defaults.max_tokens.is_some();
        CallConfig {
            reasoning_effort,
            max_tokens: request.max_tokens.or(defaults.max_tokens),
            effort_defaulted,
            max_tokens_defaulted,
        }
    }

    /// Writes the defaulted settings into `request`, so the wire request is
    /// a function of the logged header.
    pub(super) fn fill(&self, request: &mut LlmRequest) {
        if self.effort_defaulted
            && let Some(e) = &self.reasoning_effort
        {
            request.options.insert(EFFORT.into(), e.clone().into());
        }
        if self.max_tokens_defaulted {
            request.max_tokens = self.max_tokens;
        }
    }
}

/// The request envelope as logged in `request/header`.
pub(super) fn header_value(
    spec: &AgentSpec,
    system: Option<&str>,
    tools: &[ToolSchema],
    call: &CallConfig,
) -> serde_json::Value {
    let mut config = serde_json::Map::new();
    config.insert("provider".into(), spec.provider.clone().into());
    config.insert("model".into(), spec.model.clone().into());
    if let Some(e) = &call.reasoning_effort {
        config.insert("reasoningEffort".into(), e.clone().into());
    }
    if let Some(t) = spec.temperature {
        config.insert("temperature".into(), t.into());
    }
    if let Some(m) = call.max_tokens {
        config.insert("maxTokens".into(), m.into());
    }
    let mut header = serde_json::Map::new();
    header.insert("config".into(), serde_json::Value::Object(config));
    let mut defaulted = serde_json::Map::new();
    if call.effort_defaulted {
        defaulted.insert("reasoningEffort".into(), true.into());
    }
    if call.max_tokens_defaulted {
        defaulted.insert("maxTokens".into(), true.into());
    }
    if !defaulted.is_empty() {
        header.insert("adapterDefaults".into(), defaulted.into());
    }
    if let Some(s) = system.filter(|s| !s.is_empty()) {
        header.insert("system".into(), s.into());
    }
    if !tools.is_empty() {
        header.insert(
            "tools".into(),
            serde_json::to_value(tools).unwrap_or_default(),
        );
    }
    serde_json::Value::Object(header)
}
