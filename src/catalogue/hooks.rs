//! The `hooks` plugin: Claude Code and Codex hooks, run sandboxed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::{BoxError, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

/// Config of the `hooks` plugin: which settings files to read.
#[derive(Debug, Clone, Default, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HooksConfig {
    /// Claude Code settings files (or `hooks.json` files) with a `hooks`
    /// key, in order (default: `.claude/settings.json`,
    /// `.claude/settings.local.json`, `~/.claude/settings.json`).
    #[serde(default)]
    pub claude_code: Option<Vec<PathBuf>>,
    /// Codex `hooks.json` files, in order (default: `.codex/hooks.json`,
    /// `~/.codex/hooks.json`).
    #[serde(default)]
    pub codex: Option<Vec<PathBuf>>,
    /// A hook's timeout when it names none, in milliseconds (default 600000).
    #[serde(default)]
    pub default_timeout_ms: Option<u64>,
    /// The most of a hook's stderr a `hook/result` record keeps, in
    /// characters (default 500).
    #[serde(default)]
    pub stderr_summary_max_chars: Option<usize>,
    /// Where relative files (the project's `.claude/settings.json`, …)
    /// are found: the command's workspace (`--cwd`), else the current
    /// directory. Set by the command, not by a config file.
    #[serde(skip)]
    #[schemars(skip)]
    pub workspace: Option<PathBuf>,
}

/// Runs the hooks of users' Claude Code and Codex settings at prompt
/// submit, around tool calls and at stop. A file that cannot be read or
/// parsed is reported on stderr and contributes no hooks.
pub struct HooksPlugin;

impl Plugin for HooksPlugin {
    type Config = HooksConfig;

    fn name(&self) -> &str {
        "hooks"
    }

    async fn apply(&self, ctx: Context, config: Arc<HooksConfig>) -> Result<(), BoxError> {
        install_from(&ctx, &config).await
    }
}

/// Reads the hook files `config` names and installs their hooks on `ctx`:
/// the runtime's root (the plugin), or one agent's scope, where they see
/// only that agent's prompts, calls and stops (and its children's) — an
/// ACP session's, found in its own working directory.
pub async fn install_from(ctx: &Context, config: &HooksConfig) -> Result<(), BoxError> {
    {
        use dsh_actors::hooks::{Dialect, Hooks, HooksSettings, default_paths, install, load};
        let mut files = Vec::new();
        for (dialect, listed) in [
            (Dialect::Claude, &config.claude_code),
            (Dialect::Codex, &config.codex),
        ] {
            let paths = listed.clone().unwrap_or_else(|| default_paths(dialect));
            let within = |p: PathBuf| match &config.workspace {
                Some(ws) if p.is_relative() && !p.starts_with("~") => ws.join(p),
                _ => p,
            };
            files.extend(paths.into_iter().map(|p| (dialect, within(p))));
        }
        let (sets, problems) = load(&files).await;
        for p in &problems {
            tracing::warn!("hooks: {p}");
            crate::errln!("dsh: hooks: {p}; that file's hooks are not run");
        }
        if sets.is_empty() {
            return Ok(());
        }
        let mut settings = HooksSettings::default();
        if let Some(ms) = config.default_timeout_ms.filter(|ms| *ms > 0) {
            settings.default_timeout = Duration::from_millis(ms);
        }
        if let Some(n) = config.stderr_summary_max_chars {
            settings.stderr_summary_max_chars = n;
        }
        install(ctx, Arc::new(Hooks::new(sets, settings)))?;
        Ok(())
    }
}
