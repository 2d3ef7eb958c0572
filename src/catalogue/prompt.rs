//! The `prompt-section` plugin: a fixed section of the system prompt.

use std::sync::Arc;

use dsh_services::prompt::{PromptSection, SystemPrompt, Text};
use dsh_supervisors::{BoxError, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

/// Config of the `prompt-section` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct PromptSectionConfig {
    /// Section name (a scoped section of the same name shadows it).
    pub name: String,
    /// Ascending order (-100 identity, 0 persona, 100–199 tool guidance).
    #[serde(default)]
    pub order: i32,
    /// The text; may use `{{variables}}`.
    pub text: String,
}

/// Adds a global system prompt section.
pub struct PromptSectionPlugin;

impl Plugin for PromptSectionPlugin {
    type Config = PromptSectionConfig;

    fn name(&self) -> &str {
        "prompt-section"
    }

    fn inject(&self) -> &[&'static str] {
        &[SystemPrompt::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<PromptSectionConfig>) -> Result<(), BoxError> {
        let prompt = ctx
            .get::<SystemPrompt>(SystemPrompt::SERVICE)
            .ok_or("the `systemPrompt` service is gone")?;
        prompt.section(
            &ctx,
            PromptSection {
                name: config.name.clone(),
                order: config.order,
                text: Text::Static(config.text.clone()),
                complete: false,
            },
        )?;
        Ok(())
    }
}
