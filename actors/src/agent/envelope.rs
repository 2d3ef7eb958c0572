//! The request envelope: the tool schemas and the `request/header` value a
//! step sends, rebuilt only when the tool registry or the system text changed.

use dsh_services::llm::ToolSchema;

use super::template::unshared_envelope;
use super::{AgentSpec, Awake, Envelope, Inner, lock};

/// The tool schemas and header in force, rebuilt when the registry changed.
pub(super) fn envelope(inner: &Inner, me: &Awake, system: Option<&str>) -> Envelope {
    let generation = me.tools.generation();
    let mut cache = lock(&me.envelope);
    if let Some(e) = cache.as_ref()
        && e.generation == generation
        && e.system.as_deref() == system
    {
        return e.clone();
    }
    let tools = me.tools.visible(me.ctx.scope_key());
    let (schemas, header) = match &inner.agents {
        Some(agents) => agents.templates.envelope(&inner.spec, system, &tools),
        None => unshared_envelope(&inner.spec, system, &tools),
    };
    let fresh = Envelope {
        generation,
        system: system.map(str::to_owned),
        schemas,
        header,
    };
    *cache = Some(fresh.clone());
    fresh
}

/// The request envelope as logged in `request/header`.
pub(super) fn header_value(
    spec: &AgentSpec,
    system: Option<&str>,
    tools: &[ToolSchema],
) -> serde_json::Value {
    let mut config = serde_json::Map::new();
    config.insert("provider".into(), spec.provider.clone().into());
    config.insert("model".into(), spec.model.clone().into());
    if let Some(t) = spec.temperature {
        config.insert("temperature".into(), t.into());
    }
    if let Some(m) = spec.max_tokens {
        config.insert("maxTokens".into(), m.into());
    }
    let mut header = serde_json::Map::new();
    header.insert("config".into(), serde_json::Value::Object(config));
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
