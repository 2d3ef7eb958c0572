//! The options every command that creates agents shares, declared once and
//! flattened into each (`run`, `workflow`, `ralph`, `serve`), so a flag means
//! the same everywhere. Precedence for each setting: the flag, then its
//! environment variable, then the `--config` file's entries, then the
//! default.

use std::path::PathBuf;

use dsh_services::approval::ApprovalPolicy;
use dsh_services::providers::openai::ReasoningEffort;
use dsh_services::sandbox::{BackendChoice, PermissionMode, Settings};
use dsh_supervisors::error::chain;

use dsh_actors::cluster::{Peer, Placement};

use crate::exit::{self, Exit};

/// How each model setting is chosen, shown under `--help`.
pub const MODEL_PRECEDENCE: &str = "\
Model: --demo-model (keyless, built in), --script FILE (keyless, scripted), or an
OpenAI-compatible endpoint: --base-url (else $DSH_BASE_URL) with --model (else
$DSH_MODEL); the key is read from the variable --api-key-env names. With --config
FILE the file's provider entries serve instead of an endpoint. Each setting: flag,
then environment variable, then the config entry, then the default.";

/// Which model agents use.
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "Model")]
pub struct ModelArgs {
    /// OpenAI-compatible endpoint up to its API version, e.g.
    /// `https://api.deepseek.com/v1` [env: DSH_BASE_URL]
    #[arg(long, value_name = "URL", conflicts_with_all = ["demo_model", "script"])]
    pub base_url: Option<String>,
    /// Model id the endpoint serves [env: DSH_MODEL]
    #[arg(long, value_name = "ID")]
    pub model: Option<String>,
    /// Environment variable holding the API key (the key itself is never a flag)
    #[arg(long, value_name = "VAR", default_value = "DSH_API_KEY")]
    pub api_key_env: String,
    /// Use the built-in keyless demo model (a pure function of the conversation)
    #[arg(long, conflicts_with_all = ["script", "model"])]
    pub demo_model: bool,
    /// Play this script with the keyless scripted model (`{"steps": [...]}`)
    #[arg(long, value_name = "FILE", conflicts_with = "model")]
    pub script: Option<PathBuf>,
    /// Provider route agents use (default: the only one registered)
    #[arg(long, value_name = "ROUTE")]
    pub provider: Option<String>,
    /// Seconds to wait for an endpoint's first byte (headers and first
    /// event) before the call fails with a retryable TIMEOUT
    /// [env: DSH_REQUEST_TIMEOUT] [default: 600]
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub request_timeout: Option<u64>,
    /// DeepSeek's thinking effort: off, low, high or max
    /// [env: DSH_REASONING_EFFORT] [default: high]
    #[arg(long, value_name = "EFFORT")]
    pub reasoning_effort: Option<ReasoningEffort>,
}

/// The model a command runs its agents on, as the flags and environment
/// chose it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelChoice {
    /// The built-in keyless demo model.
    Demo,
    /// The keyless scripted model playing a script file.
    Script(PathBuf),
    /// An OpenAI-compatible endpoint.
    OpenAi {
        /// `…/v1` base URL.
        base_url: String,
        /// Model id.
        model: String,
        /// Environment variable holding the key.
        api_key_env: String,
        /// Seconds to the first byte (`None`: the default).
        request_timeout: Option<u64>,
    },
    /// DeepSeek's API (`$DEEPSEEK_API_KEY` is set and nothing else is
    /// chosen); the endpoint is `$DEEPSEEK_BASE_URL` or the official one.
    DeepSeek {
        /// Model id.
        model: String,
        /// Thinking effort (`None`: the provider's default).
        effort: Option<ReasoningEffort>,
        /// Seconds to the first byte (`None`: the default).
        request_timeout: Option<u64>,
    },
    /// The `--config` file's provider entries.
    Config,
}

/// What to say when no model is configured.
pub const HOW_TO_CONFIGURE: &str = concat!(
    "no model is configured.\n",
    "  DeepSeek:                       set DEEPSEEK_API_KEY (and DEEPSEEK_BASE_URL for another endpoint)\n",
    "  an OpenAI-compatible endpoint:  --base-url https://api.deepseek.com/v1 --model deepseek-chat\n",
    "    (the API key is read from $DSH_API_KEY, or the variable named by --api-key-env;\n",
    "     DSH_BASE_URL and DSH_MODEL may stand in for the flags)\n",
    "  the built-in keyless model:     --demo-model\n",
    "  a keyless script:               --script demo/hello.json\n",
    "  a plugin tree:                  --config demo/cordis.yml  (agent-services + openai or scripted entries)"
);

impl ModelArgs {
    /// The model chosen (`None`: nothing is configured). `config` says
    /// whether a `--config` file serves the providers; naming a model
    /// source beside it is refused, since only one can serve.
    pub fn choice(&self, config: bool) -> exit::Result<Option<ModelChoice>> {
        self.choice_in(config, &|name| std::env::var(name).ok())
    }

    /// [`ModelArgs::choice`] with `env` standing for the environment.
    fn choice_in(
        &self,
        config: bool,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> exit::Result<Option<ModelChoice>> {
        let named = self.demo_model
            || self.script.is_some()
            || self.base_url.is_some()
            || self.request_timeout.is_some()
            || self.reasoning_effort.is_some();
        if config && named {
            return Err(Exit::usage(
                "--config serves the providers from its file (set `request_timeout_s` and `reasoning_effort` there); drop --demo-model, --script, --base-url, --request-timeout or --reasoning-effort",
            ));
        }
        if config {
            return Ok(Some(ModelChoice::Config));
        }
        if self.demo_model {
            return Ok(Some(ModelChoice::Demo));
        }
        if let Some(script) = &self.script {
            return Ok(Some(ModelChoice::Script(script.clone())));
        }
        let base_url = self.base_url.clone().or_else(|| env("DSH_BASE_URL"));
        let model = self.model.clone().or_else(|| env("DSH_MODEL"));
        let request_timeout = match (self.request_timeout, env("DSH_REQUEST_TIMEOUT")) {
            (Some(s), _) => Some(s),
            (None, None) => None,
            (None, Some(v)) => match v.trim().parse::<u64>() {
                Ok(s) if s > 0 => Some(s),
                _ => {
                    return Err(Exit::usage(format!(
                        "$DSH_REQUEST_TIMEOUT: `{v}` is not a number of seconds (1 or more)"
                    )));
                }
            },
        };
        let effort = match (self.reasoning_effort, env("DSH_REASONING_EFFORT")) {
            (Some(e), _) => Some(e),
            (None, None) => None,
            (None, Some(v)) => Some(
                v.trim()
                    .parse()
                    .map_err(|e| Exit::usage(format!("$DSH_REASONING_EFFORT: {}", chain(&e))))?,
            ),
        };
        let deepseek_key = env("DEEPSEEK_API_KEY").is_some_and(|k| !k.is_empty());
        if base_url.is_none() && deepseek_key {
            return Ok(Some(ModelChoice::DeepSeek {
                model: model
                    .unwrap_or_else(|| dsh_services::providers::openai::DEEPSEEK_MODEL.into()),
                effort,
                request_timeout,
            }));
        }
        if self.reasoning_effort.is_some() {
            return Err(Exit::usage(
                "--reasoning-effort applies to DeepSeek (set DEEPSEEK_API_KEY, or a `deepseek` config entry)",
            ));
        }
        match (base_url, model) {
            (Some(base_url), Some(model)) => Ok(Some(ModelChoice::OpenAi {
                base_url,
                model,
                api_key_env: self.api_key_env.clone(),
                request_timeout,
            })),
            (Some(_), None) => Err(Exit::usage("--base-url needs --model (or $DSH_MODEL)")),
            (None, _) => Ok(None),
        }
    }

    /// The model id agents ask for on `provider`'s route: `demo` for the
    /// demo model; else `--model`, else `$DSH_MODEL`, else what the choice
    /// names, else `default`.
    pub fn model_id(&self, choice: Option<&ModelChoice>) -> String {
        if choice == Some(&ModelChoice::Demo) {
            return "demo".into();
        }
        if let Some(m) = self
            .model
            .clone()
            .or_else(|| std::env::var("DSH_MODEL").ok())
        {
            return m;
        }
        match choice {
            Some(ModelChoice::OpenAi { model, .. } | ModelChoice::DeepSeek { model, .. }) => {
                model.clone()
            }
            Some(ModelChoice::Demo) => "demo".into(),
            _ => "default".into(),
        }
    }
}

/// What agents may do without asking, and who answers when they ask.
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "Policy")]
pub struct PolicyArgs {
    /// Approval policy for actions that ask: never, ask or always; with `ask`
    /// the controlling terminal answers (no terminal: asks fail closed)
    /// [env: DSH_APPROVAL] [default: ask, or the config's `agent-services` entry]
    #[arg(long, value_name = "POLICY")]
    pub approval: Option<ApprovalPolicy>,
    /// What agents' tools may change: read-only, workspace-write (the
    /// workspace and a private temp dir) or danger-full-access (anything);
    /// delegated agents get at most their parent's [env: DSH_PERMISSION_MODE]
    /// [default: workspace-write, or the config's]
    #[arg(long, value_name = "MODE")]
    pub permission_mode: Option<PermissionMode>,
    /// Cut agents' commands off the network (enforced by bwrap; refused
    /// where only Landlock confines) [env: DSH_NO_NETWORK=1]
    #[arg(long)]
    pub no_network: bool,
    /// Let tool processes see this variable although it holds a secret
    /// (repeatable) [env: DSH_PASS_ENV, comma-separated]
    #[arg(long = "pass-env", value_name = "NAME")]
    pub pass_env: Vec<String>,
    /// What confines commands: auto (bwrap, else Landlock), bwrap or
    /// landlock [env: DSH_SANDBOX] [default: auto, or the config's]
    #[arg(long, value_name = "BACKEND")]
    pub sandbox: Option<BackendChoice>,
}

impl PolicyArgs {
    /// The approval policy the flag or `$DSH_APPROVAL` sets (`None`: the
    /// config's or the default); a bad value in the variable is refused.
    pub fn approval(&self) -> exit::Result<Option<ApprovalPolicy>> {
        self.approval_in(&|name| std::env::var(name).ok())
    }

    fn approval_in(
        &self,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> exit::Result<Option<ApprovalPolicy>> {
        if let Some(p) = self.approval {
            return Ok(Some(p));
        }
        match env("DSH_APPROVAL") {
            None => Ok(None),
            Some(v) => v
                .parse()
                .map(Some)
                .map_err(|e| Exit::usage(format!("$DSH_APPROVAL: {}", chain(&e)))),
        }
    }

    /// `settings` (the config's, or the defaults) with what the flags and
    /// their variables set applied over them; a bad variable is refused.
    pub fn sandbox_over(&self, settings: Settings) -> exit::Result<Settings> {
        self.sandbox_in(settings, &|name| std::env::var(name).ok())
    }

    fn sandbox_in(
        &self,
        mut settings: Settings,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> exit::Result<Settings> {
        let var = |name: &str| env(name).filter(|v| !v.is_empty());
        if let Some(mode) = self.permission_mode {
            settings.defaults.mode = mode;
        } else if let Some(v) = var("DSH_PERMISSION_MODE") {
            settings.defaults.mode = v
                .parse()
                .map_err(|e| Exit::usage(format!("$DSH_PERMISSION_MODE: {}", chain(&e))))?;
        }
        if self.no_network {
            settings.defaults.network = false;
        } else if let Some(v) = var("DSH_NO_NETWORK") {
            settings.defaults.network = match v.as_str() {
                "1" | "true" | "yes" => false,
                "0" | "false" | "no" => true,
                other => {
                    return Err(Exit::usage(format!(
                        "$DSH_NO_NETWORK: `{other}` is not a yes/no value (1, true, yes, 0, false, no)"
                    )));
                }
            };
        }
        if let Some(b) = self.sandbox {
            settings.backend = b;
        } else if let Some(v) = var("DSH_SANDBOX") {
            settings.backend = v
                .parse()
                .map_err(|e| Exit::usage(format!("$DSH_SANDBOX: {}", chain(&e))))?;
        }
        let listed = var("DSH_PASS_ENV").unwrap_or_default();
        let passed = listed
            .split(',')
            .map(str::trim)
            .filter(|n| !n.is_empty())
            .map(str::to_owned);
        for name in self.pass_env.iter().cloned().chain(passed) {
            if !settings.pass_env.contains(&name) {
                settings.pass_env.push(name);
            }
        }
        Ok(settings)
    }
}

/// How a command places children on other nodes.
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "Cluster")]
pub struct ClusterArgs {
    /// Run children on these nodes, NAME@HOST:PORT (comma-separated); this
    /// process joins them as a client
    #[arg(long, value_name = "NAME@ADDR,…", value_delimiter = ',')]
    pub nodes: Vec<Peer>,
    /// The variable holding the cluster's cookie [required with --nodes]
    #[arg(long = "cookie-env", value_name = "VAR", requires = "nodes")]
    pub cookie_env: Option<String>,
    /// Where children go: round-robin, least-loaded or a node's name
    /// [default: round-robin]
    #[arg(long, value_name = "PLACEMENT", requires = "nodes")]
    pub placement: Option<Placement>,
    /// Dial the nodes over TLS, trusting the certificates this PEM file
    /// vouches for (the nodes run with --tls-cert)
    #[arg(long, value_name = "FILE", requires = "nodes")]
    pub tls_ca: Option<std::path::PathBuf>,
}

/// The live dashboard beside a run (`--dashboard[=ADDR]`, `--hold`).
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "Dashboard")]
pub struct DashboardArgs {
    /// Serve the live dashboard of this run: alone, on a free loopback
    /// port; `--dashboard=ADDR` picks the address (off loopback it needs
    /// --dashboard-token-env)
    #[arg(long, value_name = "ADDR", num_args = 0..=1, require_equals = true,
          default_missing_value = "127.0.0.1:0")]
    pub dashboard: Option<String>,
    /// The variable holding the dashboard's bearer token (without it, a
    /// random one is made; the printed URL carries it)
    #[arg(long, value_name = "VAR", requires = "dashboard")]
    pub dashboard_token_env: Option<String>,
    /// Keep the process, and the page, up after the run ends, until Ctrl-C
    #[arg(long, requires = "dashboard")]
    pub hold: bool,
}

/// Everything a command that creates agents takes to boot them: the model,
/// the policy, and optionally a plugin tree serving both.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct AgentArgs {
    /// The model agents use.
    #[command(flatten)]
    pub model: ModelArgs,
    /// What agents may do without asking.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// A plugin tree for the services and providers.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// How deep delegation may go: 1 lets the agent start children but
    /// not grandchildren (default 3; 0 forbids delegation)
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(0..=16))]
    pub max_depth: Option<u32>,
}

/// A plugin tree to boot the services and providers from.
#[derive(clap::Args, Clone, Debug, Default)]
#[command(next_help_heading = "Plugin tree")]
pub struct ConfigArgs {
    /// Boot this cordis.yml for the agent services and model providers
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Patch layers of --config, applied by entry id, in order
    #[arg(long = "patch", value_name = "FILE", requires = "config")]
    pub patches: Vec<PathBuf>,
    /// Run the hooks of your Claude Code and Codex settings
    /// (.claude/settings.json, .claude/settings.local.json,
    /// ~/.claude/settings.json, .codex/hooks.json, ~/.codex/hooks.json)
    /// sandboxed like bash; a config can add a `hooks` entry instead
    #[arg(long)]
    pub hooks: bool,
}

/// The workspace tools are confined to.
#[derive(clap::Args, Clone, Debug)]
#[command(next_help_heading = "Workspace")]
pub struct WorkspaceArgs {
    /// Workspace root the tools work in (default: the current directory)
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub cwd: PathBuf,
}

impl WorkspaceArgs {
    /// The workspace as an absolute path without symlinks.
    pub fn resolve(&self) -> exit::Result<PathBuf> {
        self.cwd.canonicalize().map_err(|e| {
            Exit::usage(format!(
                "the workspace {} is not accessible: {e}",
                self.cwd.display()
            ))
        })
    }
}

/// Where sessions are stored (every command that reads or writes them).
#[derive(Clone, Debug, Default, clap::Args)]
#[command(next_help_heading = "Sessions")]
pub struct StoreArgs {
    /// Where sessions are stored [env: DSH_SESSIONS_DIR] [default: ~/.dsh/sessions]
    #[arg(long = "sessions-dir", value_name = "DIR", global = true)]
    pub dir: Option<PathBuf>,
    /// Sessions in this SQLite database instead [env: DSH_SESSIONS_DB]
    #[arg(
        long = "sessions-db",
        value_name = "FILE",
        global = true,
        conflicts_with = "dir"
    )]
    pub db: Option<PathBuf>,
    /// JSONL sessions stored as Zstandard frames (`session.jsonl.zstd`)
    #[arg(long, global = true, conflicts_with = "db")]
    pub zstd: bool,
}

impl StoreArgs {
    /// Whether a flag or a variable (`$DSH_SESSIONS_DIR`, `$DSH_SESSIONS_DB`)
    /// names a store, which then wins over a config's `session-store`.
    pub fn named(&self) -> bool {
        self.dir.is_some()
            || self.db.is_some()
            || self.zstd
            || std::env::var_os("DSH_SESSIONS_DIR").is_some()
            || std::env::var_os("DSH_SESSIONS_DB").is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn a_flag_wins_over_its_variable_and_a_variable_stands_in_for_a_missing_flag() {
        let flags = ModelArgs {
            base_url: Some("http://flag/v1".into()),
            api_key_env: "DSH_API_KEY".into(),
            ..ModelArgs::default()
        };
        let vars = [
            ("DSH_BASE_URL", "http://env/v1"),
            ("DSH_MODEL", "env-model"),
        ];
        let chosen = flags.choice_in(false, &env(&vars)).ok().flatten();
        assert_eq!(
            chosen,
            Some(ModelChoice::OpenAi {
                base_url: "http://flag/v1".into(),
                model: "env-model".into(),
                api_key_env: "DSH_API_KEY".into(),
                request_timeout: None,
            })
        );
        let none = ModelArgs::default().choice_in(false, &env(&[]));
        assert!(matches!(none, Ok(None)));
        let half = ModelArgs::default().choice_in(false, &env(&[("DSH_BASE_URL", "http://x/v1")]));
        assert!(matches!(half, Err(e) if e.code == exit::USAGE));
    }

    #[test]
    fn a_config_serves_alone_and_a_named_model_beside_it_is_refused() {
        let demo = ModelArgs {
            demo_model: true,
            ..ModelArgs::default()
        };
        assert!(matches!(demo.choice_in(true, &env(&[])), Err(e) if e.code == exit::USAGE));
        assert_eq!(
            ModelArgs::default()
                .choice_in(true, &env(&[("DSH_BASE_URL", "http://env/v1")]))
                .ok()
                .flatten(),
            Some(ModelChoice::Config)
        );
        assert_eq!(
            demo.choice_in(false, &env(&[])).ok().flatten(),
            Some(ModelChoice::Demo)
        );
        // The demo model's id is its own, whatever `$DSH_MODEL` says.
        assert_eq!(demo.model_id(Some(&ModelChoice::Demo)), "demo");
    }

    #[test]
    fn the_approval_flag_wins_and_a_bad_variable_says_which() {
        let flag = PolicyArgs {
            approval: Some(ApprovalPolicy::Never),
            ..PolicyArgs::default()
        };
        let vars = [("DSH_APPROVAL", "always")];
        assert_eq!(
            flag.approval_in(&env(&vars)).ok().flatten(),
            Some(ApprovalPolicy::Never)
        );
        assert_eq!(
            PolicyArgs::default()
                .approval_in(&env(&vars))
                .ok()
                .flatten(),
            Some(ApprovalPolicy::Always)
        );
        let bad = PolicyArgs::default().approval_in(&env(&[("DSH_APPROVAL", "sometimes")]));
        let message = bad.err().and_then(|e| e.message).unwrap_or_default();
        assert!(message.starts_with("$DSH_APPROVAL: unknown approval policy `sometimes`"));
    }

    #[test]
    fn sandbox_flags_win_over_variables_which_win_over_the_config() {
        let config = Settings {
            backend: BackendChoice::Bwrap,
            pass_env: vec!["A_API_KEY".into()],
            ..Settings::default()
        };
        let vars = [
            ("DSH_PERMISSION_MODE", "danger-full-access"),
            ("DSH_NO_NETWORK", "1"),
            ("DSH_PASS_ENV", "B_TOKEN, A_API_KEY"),
        ];
        let flags = PolicyArgs {
            permission_mode: Some(PermissionMode::ReadOnly),
            ..PolicyArgs::default()
        };
        let got = flags.sandbox_in(config.clone(), &env(&vars)).ok();
        let got = got.unwrap_or_default();
        assert_eq!(got.defaults.mode, PermissionMode::ReadOnly);
        assert!(!got.defaults.network);
        assert_eq!(got.backend, BackendChoice::Bwrap);
        assert_eq!(got.pass_env, ["A_API_KEY", "B_TOKEN"]);
        let from_env = PolicyArgs::default().sandbox_in(config.clone(), &env(&vars));
        assert_eq!(
            from_env.ok().map(|s| s.defaults.mode),
            Some(PermissionMode::DangerFullAccess)
        );
        let bad = PolicyArgs::default().sandbox_in(config, &env(&[("DSH_PERMISSION_MODE", "all")]));
        let message = bad.err().and_then(|e| e.message).unwrap_or_default();
        assert!(
            message.starts_with("$DSH_PERMISSION_MODE: unknown permission mode `all`"),
            "{message}"
        );
    }
}
