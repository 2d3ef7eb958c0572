//! The built-in tools: `bash`, `read`, `write`, `edit`, `glob`, `grep`,
//! `todo_write`, `web_fetch`, and the background-job controls `job_list`,
//! `job_output`, `job_kill`.

mod bash;
mod fs;
mod image;
mod jobs;
mod search;
mod skill;
mod todo;
mod web;
mod workspace;

use std::sync::Arc;

use dsh_supervisors::Context;

pub use bash::Bash;
pub use fs::{Edit, Read, Write, file_tools};
pub use image::ReadImage;
pub use jobs::{JobKill, JobList, JobOutput};
pub use search::{Glob, Grep};
pub use skill::SkillTool;
pub use todo::TodoWrite;
pub use web::{WebFetch, WebFetchSettings, public};
pub use workspace::confine;

use super::ToolRegistry;

/// Which of the optional built-ins to register, and what they need.
#[derive(Clone, Debug, Default)]
pub struct Builtins {
    /// `skill`, reading skills under this user home (`Some(None)`: the
    /// project's only); `None` leaves the tool out.
    pub skills: Option<Option<std::path::PathBuf>>,
    /// `web_fetch` with these settings; `None` leaves it out.
    pub web_fetch: Option<WebFetchSettings>,
}

/// Registers the built-in tools through `ctx` (removed with its fiber): the
/// ones every agent gets, and the optional ones `extra` names. The one place
/// this crate's tools are registered.
pub fn install(
    ctx: &Context,
    registry: &Arc<ToolRegistry>,
    extra: Builtins,
) -> Result<(), dsh_supervisors::registry::RegisterError> {
    if let Some(home) = extra.skills {
        registry.register(ctx, Arc::new(SkillTool::new(home)))?;
    }
    if let Some(settings) = extra.web_fetch {
        registry.register(ctx, Arc::new(WebFetch::new(settings)))?;
    }
    let (read, write, edit) = file_tools();
    registry.register(ctx, Arc::new(Bash))?;
    registry.register(ctx, Arc::new(read))?;
    registry.register(ctx, Arc::new(write))?;
    registry.register(ctx, Arc::new(edit))?;
    registry.register(ctx, Arc::new(Glob))?;
    registry.register(ctx, Arc::new(Grep))?;
    registry.register(ctx, Arc::new(TodoWrite))?;
    registry.register(ctx, Arc::new(ReadImage))?;
    registry.register(ctx, Arc::new(JobList))?;
    registry.register(ctx, Arc::new(JobOutput))?;
    registry.register(ctx, Arc::new(JobKill))?;
    Ok(())
}
