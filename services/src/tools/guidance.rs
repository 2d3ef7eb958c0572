//! The `tool-guidance` system prompt section: what each tool an agent can
//! see says about using it well ([`Tool::guidance`](super::Tool::guidance)),
//! so the prompt names only tools the agent has.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use dsh_supervisors::ScopeKey;

use super::ToolRegistry;
use crate::prompt::{PromptSection, Text};

/// The section's name.
pub const SECTION: &str = "tool-guidance";

/// Its order: after the persona (0), in the tool-guidance band (100–199).
pub const ORDER: i32 = 100;

/// Each scope's rendered text (by scope id; `None`: the root) with the
/// registry generation it was rendered at.
type Rendered = HashMap<Option<u64>, (u64, Arc<str>)>;

/// Rendered texts kept per scope before the cache starts over.
const CACHED_SCOPES: usize = 256;

/// The section over `tools`: a `# Tools` heading and one bullet per visible
/// tool that has guidance, in name order; empty when none has any. Each
/// scope's text is rendered once per registry generation.
pub fn section(tools: Arc<ToolRegistry>) -> PromptSection {
    let cache: Mutex<Rendered> = Mutex::default();
    let text = move |scope: Option<&ScopeKey>| -> String {
        let generation = tools.generation();
        let key = scope.map(ScopeKey::id);
        let mut cache = cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((g, text)) = cache.get(&key)
            && *g == generation
        {
            return text.to_string();
        }
        let text: Arc<str> = render(&tools, scope).into();
        if cache.len() >= CACHED_SCOPES {
            cache.clear();
        }
        cache.insert(key, (generation, text.clone()));
        text.to_string()
    };
    PromptSection {
        name: SECTION.into(),
        order: ORDER,
        text: Text::Dynamic(Arc::new(text)),
        complete: false,
    }
}

fn render(tools: &ToolRegistry, scope: Option<&ScopeKey>) -> String {
    let lines: Vec<String> = tools
        .visible(scope)
        .iter()
        .filter_map(|t| t.tool.guidance())
        .map(|g| format!("- {g}"))
        .collect();
    if lines.is_empty() {
        return String::new();
    }
    format!("# Tools\n{}", lines.join("\n"))
}
