//! `read_image`: an image file of the workspace handed to the model as an
//! image (kept in the attachment store; the session log holds only its
//! reference). A model that takes no images reads a description instead.

use std::sync::Arc;

use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;

use super::workspace::Place;
use crate::attachments::{Attachments, MAX_BYTES};
use crate::llm::{ContentBlock, ToolSchema};
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};

/// The `read_image` tool.
pub struct ReadImage;

/// What a `read_image` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct ImageArgs {
    /// Path of the image, relative to the workspace.
    file_path: String,
}

impl Tool for ReadImage {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "read_image".into(),
            description: "Look at an image file in the workspace (PNG, JPEG, GIF or WebP, at most 20 MiB and 8192 pixels a side): it is shown to you as an image when your model takes images, else described by its type and size. Use it for screenshots, diagrams and rendered output the task is about.".into(),
            parameters: parameters::<ImageArgs>(),
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
            let args: ImageArgs = cx.parse()?;
            let store = cx
                .ctx
                .get::<Attachments>(Attachments::SERVICE)
                .ok_or_else(|| {
                    ToolError::new(
                        "NO_ATTACHMENTS",
                        "images cannot be kept here (no attachment store)",
                    )
                })?;
            let place = Place::of(&cx, &args.file_path)?;
            let shown = place.shown();
            let bytes = place
                .read_bytes(&args.file_path, MAX_BYTES as u64)
                .await?
                .ok_or_else(|| {
                    ToolError::new(
                        "NOT_FOUND",
                        format!("cannot read \"{}\": not found", shown.display()),
                    )
                })?;
            let name = shown.file_name().map(|n| n.to_string_lossy().into_owned());
            let fields = tokio::task::spawn_blocking(move || store.put(&bytes, name.as_deref()))
                .await
                .map_err(|e| {
                    ToolError::failed(format!("the image could not be kept: {}", chain(&e)))
                })?
                .map_err(|e| ToolError::new("NOT_AN_IMAGE", format!("{}: {e}", shown.display())))?;
            let said = format!(
                "{}: {}, {}x{}",
                shown.display(),
                fields["mediaType"].as_str().unwrap_or("image"),
                fields["width"],
                fields["height"]
            );
            let meta = serde_json::json!({"image": fields.clone()});
            Ok(ToolOutput {
                content: vec![ContentBlock::text(said), ContentBlock::Image { fields }],
                meta: Some(meta),
            })
        }
        .boxed()
    }
}
