//! `dsh run "<prompt>"`: one agent, one turn, streamed to the terminal.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec};
use dsh_services::approval::{Approval, ApprovalAsk, ApprovalOutcome, ApprovalPolicy};
use dsh_services::llm::{ContentBlock, LlmRuntime, StreamChunk};
use dsh_services::session::{EventData, TurnEndReason};

use dsh_services::persistence::{JsonlStore, PERSISTENCE_SERVICE, SessionPersistence};

use crate::catalogue::{
    AgentServices, AgentServicesConfig, OpenAi, OpenAiPluginConfig, Scripted, ScriptedPluginConfig,
    default_catalogue,
};
use crate::sessions::open_store;
use dsh_supervisors::tree::render;
use dsh_supervisors::{Runtime, RuntimeSettings};

/// Everything `dsh run` takes.
#[derive(Clone, Debug)]
pub struct RunOptions {
    /// The prompt.
    pub prompt: String,
    /// Play this script (keyless scripted model) instead of calling an endpoint.
    pub script: Option<PathBuf>,
    /// OpenAI-compatible endpoint (`…/v1`).
    pub base_url: Option<String>,
    /// Model id.
    pub model: Option<String>,
    /// Environment variable holding the API key.
    pub api_key_env: String,
    /// Approval policy (overrides the config's).
    pub approval: Option<ApprovalPolicy>,
    /// Boot this `cordis.yml` for the services and providers.
    pub config: Option<PathBuf>,
    /// Patch layers of the config.
    pub patches: Vec<PathBuf>,
    /// Provider route to use (default: the only one registered).
    pub provider: Option<String>,
    /// Print the session events as JSON lines instead of text.
    pub json: bool,
    /// Print the actor tree at the end.
    pub tree: bool,
    /// Workspace root.
    pub cwd: PathBuf,
    /// Where to write the session log.
    pub session_out: Option<PathBuf>,
    /// System prompt.
    pub system: Option<String>,
    /// Step limit.
    pub max_steps: u32,
    /// Continue this stored session.
    pub resume: Option<String>,
    /// Where sessions are stored (see `sessions::open_store`).
    pub store: crate::sessions::StoreChoice,
}

/// How `run` ended, as an exit code and a message for stderr.
pub struct RunExit {
    /// Process exit code.
    pub code: u8,
    /// Printed on stderr when set.
    pub message: Option<String>,
}

impl RunExit {
    fn fail(code: u8, message: impl Into<String>) -> RunExit {
        RunExit {
            code,
            message: Some(message.into()),
        }
    }
}

const HOW_TO_CONFIGURE: &str = concat!(
    "no model endpoint is configured.\n",
    "  an OpenAI-compatible endpoint:  dsh run --base-url https://api.deepseek.com/v1 --model deepseek-chat \"…\"\n",
    "    (the API key is read from $DSH_API_KEY, or the variable named by --api-key-env;\n",
    "     DSH_BASE_URL and DSH_MODEL may stand in for the flags)\n",
    "  the keyless scripted model:     dsh run --script demo/hello.json \"…\"\n",
    "  a plugin tree:                  dsh run --config demo/cordis.yml \"…\"  (agent-services + openai or scripted entries)"
);

/// The endpoint `run` talks to when no config is given.
enum Endpoint {
    Scripted(PathBuf),
    OpenAi { base_url: String, model: String },
}

fn endpoint(opts: &RunOptions) -> Result<Endpoint, RunExit> {
    if let Some(path) = &opts.script {
        return Ok(Endpoint::Scripted(path.clone()));
    }
    let base_url = opts
        .base_url
        .clone()
        .or_else(|| std::env::var("DSH_BASE_URL").ok());
    let model = opts
        .model
        .clone()
        .or_else(|| std::env::var("DSH_MODEL").ok());
    match (base_url, model) {
        (Some(base_url), Some(model)) => Ok(Endpoint::OpenAi { base_url, model }),
        (Some(_), None) => Err(RunExit::fail(2, "--base-url needs --model (or DSH_MODEL)")),
        _ => Err(RunExit::fail(2, HOW_TO_CONFIGURE)),
    }
}

/// The default system prompt.
fn system_prompt(cwd: &std::path::Path) -> String {
    format!(
        "You are dsh, an agent working in the directory {}. Use the tools to inspect and change files \
         and to run commands; keep answers short and concrete.",
        cwd.display()
    )
}

/// Where the session is written, and what it continues: a resumed session
/// is loaded (repaired when a crash cut it) and appended to in place.
fn place_session(
    store: Arc<dyn SessionPersistence>,
    opts: &RunOptions,
    spec: &mut AgentSpec,
) -> Result<(), RunExit> {
    let Some(id) = &opts.resume else {
        let id = dsh_services::llm::Message::new_id();
        spec.store = Some(match &opts.session_out {
            Some(p) => Arc::new(JsonlStore::file(p)),
            None => store,
        });
        spec.id = Some(id);
        return Ok(());
    };
    let loaded = store
        .load(id)
        .map_err(|e| RunExit::fail(2, e.to_string()))?;
    if let Some(line) = loaded.torn_line {
        eprintln!(
            "dsh run: {}: line {line} was a torn write; it is dropped, the lines before it are kept",
            store.locate(id)
        );
    }
    store
        .prepare_resume(id, &loaded)
        .map_err(|e| RunExit::fail(1, e.to_string()))?;
    for r in &loaded.repairs {
        eprintln!("dsh run: resumed {id}: {r}");
    }
    spec.durable = Some(loaded.durable);
    spec.store = Some(store);
    spec.seed = Some(Box::new((loaded.header, loaded.events)));
    Ok(())
}

/// Asks on the terminal; anything but `y`/`yes` rejects.
fn install_terminal_answerer(rt: &Runtime) -> dsh_supervisors::Result<()> {
    rt.root()
        .on_waterfall(|ask: ApprovalAsk, _next| async move {
            let question = format!(
                "\napprove `{}` {} ({})? [y/N] ",
                ask.request.tool, ask.request.arguments, ask.request.reason
            );
            let answer = tokio::task::spawn_blocking(move || {
                eprint!("{question}");
                let _ = std::io::stderr().flush();
                let mut line = String::new();
                std::io::stdin().read_line(&mut line).map(|_| line)
            })
            .await;
            match answer {
                Ok(Ok(line)) if matches!(line.trim().to_lowercase().as_str(), "y" | "yes") => {
                    ApprovalOutcome::AllowedOnce
                }
                Ok(Ok(_)) => ApprovalOutcome::Rejected,
                _ => ApprovalOutcome::Unavailable,
            }
        })
        .map(|_| ())
}

/// What the spinner shows: nothing, the model thinking, tools running.
const IDLE: u8 = 0;
const THINKING: u8 = 1;
const TOOLS: u8 = 2;

/// A spinner on stderr (terminals only), ticking in its own supervised actor.
struct Spinner {
    phase: Arc<AtomicU8>,
}

enum Tick {
    Tick,
}

impl ractor::Actor for Spinner {
    type Msg = Tick;
    type State = (usize, bool);
    type Arguments = ();

    async fn pre_start(
        &self,
        me: ractor::ActorRef<Tick>,
        _: (),
    ) -> Result<(usize, bool), ractor::ActorProcessingErr> {
        // The interval task ends when the actor stops (its sends then fail).
        me.send_interval(Duration::from_millis(120), || Tick::Tick);
        Ok((0, false))
    }

    async fn handle(
        &self,
        _me: ractor::ActorRef<Tick>,
        Tick::Tick: Tick,
        (frame, shown): &mut (usize, bool),
    ) -> Result<(), ractor::ActorProcessingErr> {
        const FRAMES: [&str; 8] = ["⠋", "⠙", "⠹", "⠸", "⠼", "⠴", "⠦", "⠧"];
        let label = match self.phase.load(Ordering::Relaxed) {
            THINKING => "thinking",
            TOOLS => "running tools",
            _ => {
                *shown = false;
                return Ok(());
            }
        };
        *frame = (*frame + 1) % FRAMES.len();
        eprint!("\r\x1b[2K{} {label}", FRAMES[*frame]);
        *shown = true;
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ractor::ActorRef<Tick>,
        (_, shown): &mut (usize, bool),
    ) -> Result<(), ractor::ActorProcessingErr> {
        if *shown {
            eprint!("\r\x1b[2K");
        }
        Ok(())
    }
}

/// Sets the spinner's phase; leaving a shown phase clears its line first.
fn phase(spinner: &Option<Arc<AtomicU8>>, to: u8) {
    if let Some(p) = spinner
        && p.swap(to, Ordering::Relaxed) != IDLE
        && to == IDLE
    {
        eprint!("\r\x1b[2K");
    }
}

/// Prints what the agent does as it happens.
fn observe(agent: &Agent, json: bool, spinner: Option<Arc<AtomicU8>>) {
    agent.session().observe(Arc::new(move |e| {
        if json {
            println!("{}", e.to_line());
            return;
        }
        match &e.data {
            EventData::StepStart { .. } => phase(&spinner, THINKING),
            EventData::TurnEnd { .. } => phase(&spinner, IDLE),
            _ => {}
        }
        match &e.data {
            EventData::AssistantChunk {
                chunk: StreamChunk::TextDelta { text, .. },
                ..
            } => {
                phase(&spinner, IDLE);
                print!("{text}");
                let _ = std::io::stdout().flush();
            }
            EventData::AssistantMessage { .. } => {
                let _ = std::io::stdout().flush();
            }
            EventData::ToolCall {
                name, arguments, ..
            } => {
                phase(&spinner, IDLE);
                let args: String = arguments.chars().take(160).collect();
                eprintln!("\n▸ {name} {args}");
                phase(&spinner, TOOLS);
            }
            EventData::ToolResult { message, error, .. } => {
                phase(&spinner, IDLE);
                let text: String = message
                    .content
                    .iter()
                    .flat_map(|b| match b {
                        ContentBlock::ToolResult { content, .. } => content.clone(),
                        _ => Vec::new(),
                    })
                    .filter_map(|b| match b {
                        ContentBlock::Text { text } => Some(text),
                        _ => None,
                    })
                    .collect();
                match error {
                    Some(err) => {
                        eprintln!("  ✗ {}: {}", err.code, text.lines().next().unwrap_or(""))
                    }
                    None => eprintln!("  ✓ {} lines", text.lines().count()),
                }
            }
            _ => {}
        }
    }));
}

/// Runs the prompt; returns how the process should exit.
pub async fn run(opts: RunOptions) -> RunExit {
    let endpoint = match &opts.config {
        Some(_) => None,
        None => match endpoint(&opts) {
            Ok(e) => Some(e),
            Err(exit) => return exit,
        },
    };
    let cwd = match opts.cwd.canonicalize() {
        Ok(c) => c,
        Err(e) => {
            return RunExit::fail(
                2,
                format!(
                    "the workspace {} is not accessible: {e}",
                    opts.cwd.display()
                ),
            );
        }
    };
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => return RunExit::fail(1, format!("cannot start the runtime: {e}")),
    };
    let exit = drive(&rt, opts, endpoint, cwd).await;
    if tokio::time::timeout(Duration::from_secs(60), rt.shutdown())
        .await
        .is_err()
    {
        return RunExit::fail(1, "shutdown did not finish within 60 s");
    }
    exit
}

/// Loads the services and the provider: from `--config`, or from the flags.
async fn load(rt: &Runtime, opts: &RunOptions, endpoint: Option<Endpoint>) -> Result<(), RunExit> {
    let root = rt.root();
    if let Some(file) = &opts.config {
        let source = dsh_supervisors::Source {
            base: file.clone(),
            patches: opts.patches.clone(),
        };
        return match dsh_supervisors::Loader::boot(rt, default_catalogue(), source).await {
            Err(dsh_supervisors::BootError::Config(e)) => Err(RunExit::fail(2, e.to_string())),
            Err(e) => Err(RunExit::fail(1, e.to_string())),
            Ok((_, failures)) if !failures.is_empty() => {
                let list: Vec<String> = failures
                    .iter()
                    .map(|(id, why)| format!("entry `{id}`: {why}"))
                    .collect();
                Err(RunExit::fail(
                    1,
                    format!("the config did not start:\n{}", list.join("\n")),
                ))
            }
            Ok(_) => Ok(()),
        };
    }
    let services = AgentServicesConfig {
        approval: opts.approval,
        ..AgentServicesConfig::default()
    };
    let started = match endpoint {
        None => return Err(RunExit::fail(2, HOW_TO_CONFIGURE)),
        Some(Endpoint::Scripted(path)) => {
            root.plugin(AgentServices, services)
                .await
                .map_err(|e| RunExit::fail(1, e.to_string()))?;
            root.plugin(
                Scripted,
                ScriptedPluginConfig {
                    provider: "scripted".into(),
                    script: path,
                },
            )
            .await
        }
        Some(Endpoint::OpenAi { base_url, .. }) => {
            root.plugin(AgentServices, services)
                .await
                .map_err(|e| RunExit::fail(1, e.to_string()))?;
            root.plugin(
                OpenAi,
                OpenAiPluginConfig {
                    provider: "openai".into(),
                    base_url,
                    api_key_env: Some(opts.api_key_env.clone()),
                    idle_timeout_s: None,
                },
            )
            .await
        }
    };
    started.map(|_| ()).map_err(|e| match e {
        dsh_supervisors::Error::PluginFailed { reason, .. } => RunExit::fail(2, reason),
        other => RunExit::fail(1, other.to_string()),
    })
}

async fn drive(
    rt: &Runtime,
    opts: RunOptions,
    endpoint: Option<Endpoint>,
    cwd: PathBuf,
) -> RunExit {
    let default_model = match &endpoint {
        Some(Endpoint::OpenAi { model, .. }) => Some(model.clone()),
        _ => None,
    };
    if let Err(exit) = load(rt, &opts, endpoint).await {
        return exit;
    }
    let root = rt.root();
    let Some(llm) = root.get::<LlmRuntime>(LlmRuntime::SERVICE) else {
        return RunExit::fail(
            2,
            "the config provides no `llm` service; add an `agent-services` entry",
        );
    };
    let providers = llm.providers();
    let provider = match (&opts.provider, providers.as_slice()) {
        (Some(p), _) if providers.contains(p) => p.clone(),
        (Some(p), _) => {
            return RunExit::fail(
                2,
                format!(
                    "no provider `{p}` is registered (registered: {})",
                    providers.join(", ")
                ),
            );
        }
        (None, [only]) => only.clone(),
        (None, []) => return RunExit::fail(2, HOW_TO_CONFIGURE),
        (None, many) => {
            return RunExit::fail(
                2,
                format!(
                    "several providers are registered ({}); choose one with --provider",
                    many.join(", ")
                ),
            );
        }
    };
    let model = opts
        .model
        .clone()
        .or(default_model)
        .or_else(|| std::env::var("DSH_MODEL").ok())
        .unwrap_or_else(|| "default".into());
    if let (Some(policy), Some(approval)) = (opts.approval, root.get::<Approval>(Approval::SERVICE))
    {
        approval.set_policy(policy);
    }
    let policy = root.get::<Approval>(Approval::SERVICE).map(|a| a.policy());
    if policy == Some(ApprovalPolicy::Ask)
        && std::io::IsTerminal::is_terminal(&std::io::stdin())
        && let Err(e) = install_terminal_answerer(rt)
    {
        return RunExit::fail(1, e.to_string());
    }
    let mut spec = AgentSpec::new(&provider, &model, cwd.clone());
    spec.system = Some(opts.system.clone().unwrap_or_else(|| system_prompt(&cwd)));
    spec.max_steps = opts.max_steps;
    // A store named on the command line wins; else the config's
    // `session-store` plugin; else the default sessions directory.
    let provided = root.get::<dyn SessionPersistence>(PERSISTENCE_SERVICE);
    let store = match provided.filter(|_| !opts.store.named()) {
        Some(s) => s,
        None => match open_store(&opts.store) {
            Ok(s) => s,
            Err(exit) => return exit,
        },
    };
    if let Err(exit) = place_session(store, &opts, &mut spec) {
        return exit;
    }
    let agent = match Agent::create(&root, spec).await {
        Ok(a) => a,
        Err(e) => return RunExit::fail(1, format!("cannot create the agent: {e}")),
    };
    let spinner = if !opts.json && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        let state = Arc::new(AtomicU8::new(IDLE));
        let spec = dsh_supervisors::WorkerSpec::new(
            "ui",
            "ui/spinner",
            Spinner {
                phase: state.clone(),
            },
            (),
        );
        root.spawn(spec).await.ok().map(|_| state)
    } else {
        None
    };
    observe(&agent, opts.json, spinner);
    let outcome = tokio::select! {
        r = agent.run(&opts.prompt, Duration::from_secs(6 * 3600)) => r,
        _ = tokio::signal::ctrl_c() => {
            agent.cancel();
            let _ = agent.when_idle(Duration::from_secs(30)).await;
            agent.last_turn().ok_or_else(|| dsh_actors::agent::AgentError::Closed(agent.id().to_owned()))
        }
    };
    if !opts.json {
        println!();
    }
    if let Err(e) = agent.session().flush().await {
        eprintln!("dsh run: the session log was not fully written: {e}");
    }
    if opts.tree {
        eprint!("{}", render(&rt.tree().snapshot()));
    }
    match outcome {
        Err(e) => RunExit::fail(1, e.to_string()),
        Ok(summary) => match summary.reason {
            TurnEndReason::Completed | TurnEndReason::MaxTokens => RunExit {
                code: 0,
                message: None,
            },
            TurnEndReason::Aborted { .. } => RunExit::fail(130, "cancelled"),
            TurnEndReason::Error { error } => RunExit::fail(
                1,
                format!(
                    "the model call failed: {} ({}{})",
                    error.message,
                    error.code,
                    error
                        .status
                        .map(|s| format!(", HTTP {s}"))
                        .unwrap_or_default()
                ),
            ),
            other => RunExit::fail(1, format!("the turn ended {other:?}")),
        },
    }
}
