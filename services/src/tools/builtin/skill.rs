//! `skill`: loads one skill's full instructions by name (see
//! [`crate::skills`]), found fresh from the calling agent's workspace.

use std::path::PathBuf;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;

use crate::llm::ToolSchema;
use crate::skills::{find, render, valid_name};
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};

/// The `skill` tool; `home` holds the user's `skills` directory.
pub struct SkillTool {
    home: Option<PathBuf>,
}

impl SkillTool {
    /// A loader that also looks under `home/skills`.
    pub fn new(home: Option<PathBuf>) -> SkillTool {
        SkillTool { home }
    }
}

/// What a `skill` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct SkillArgs {
    /// The exact skill name from the list of available skills.
    name: String,
}

impl Tool for SkillTool {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "skill".into(),
            description: "Load a skill by its exact name from the list of available skills and return its full instructions (and where its resource files are). Load every skill that applies before you act on the task, then follow it.".into(),
            parameters: parameters::<SkillArgs>(),
        }
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let SkillArgs { name } = cx.parse()?;
            if !valid_name(&name) {
                return Err(ToolError::new(
                    "INVALID_ARGS",
                    format!("`{name}` is not a skill name (lowercase letters, digits and dashes)"),
                ));
            }
            let (cwd, home, wanted) = (cx.cwd.as_ref().clone(), self.home.clone(), name.clone());
            let skill = tokio::task::spawn_blocking(move || find(&cwd, home.as_deref(), &wanted))
                .await
                .ok()
                .flatten()
                .ok_or_else(|| {
                    ToolError::new(
                        "UNKNOWN_SKILL",
                        format!("no skill `{name}` is available (it may have been removed)"),
                    )
                })?;
            if !skill.model_invocable {
                return Err(ToolError::new(
                    "NOT_MODEL_INVOCABLE",
                    format!("skill `{name}` is for the user to invoke, not the model"),
                ));
            }
            Ok(ToolOutput::text(render(&skill)))
        }
        .boxed()
    }
}
