//! `dsh run "<prompt>"`: one agent, one turn, streamed to the terminal.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec, Agents};
use dsh_services::approval::{Approval, ApprovalAsk, ApprovalOutcome, ApprovalPolicy};
use dsh_services::llm::openai::{OpenAiCompatible, OpenAiConfig, RetryListener};
use dsh_services::llm::scripted::ScriptedModel;
use dsh_services::llm::{ContentBlock, LlmAdapter, LlmRuntime, StreamChunk};
use dsh_services::session::{EventData, TurnEndReason};
use dsh_services::tools::ToolRegistry;
use dsh_services::tools::builtin::register_builtin;
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
    /// Approval policy.
    pub approval: ApprovalPolicy,
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

const HOW_TO_CONFIGURE: &str = "no model endpoint is configured.\n\
  Use an OpenAI-compatible endpoint:  dsh run --base-url https://api.deepseek.com/v1 --model deepseek-chat \"…\"\n\
    (the API key is read from $DSH_API_KEY, or the variable named by --api-key-env;\n\
     DSH_BASE_URL and DSH_MODEL may stand in for the flags)\n\
  or the keyless scripted model:      dsh run --script demo/hello.json \"…\"";

/// The endpoint `run` talks to.
enum Endpoint {
    Scripted(ScriptedModel),
    OpenAi { config: OpenAiConfig, model: String },
}

fn endpoint(opts: &RunOptions) -> Result<Endpoint, RunExit> {
    if let Some(path) = &opts.script {
        let text = std::fs::read_to_string(path).map_err(|e| {
            RunExit::fail(2, format!("cannot read the script {}: {e}", path.display()))
        })?;
        let model = ScriptedModel::from_json(&text)
            .map_err(|e| RunExit::fail(2, format!("{}: {e}", path.display())))?;
        return Ok(Endpoint::Scripted(model));
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
        (Some(base_url), Some(model)) => {
            let api_key = std::env::var(&opts.api_key_env)
                .ok()
                .filter(|k| !k.is_empty());
            Ok(Endpoint::OpenAi {
                config: OpenAiConfig {
                    base_url,
                    api_key,
                    idle_timeout: Duration::from_secs(300),
                },
                model,
            })
        }
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

/// Prints what the agent does as it happens.
fn observe(agent: &Agent, json: bool) {
    agent.session().observe(Arc::new(move |e| {
        if json {
            println!("{}", e.to_json());
            return;
        }
        match &e.data {
            EventData::AssistantChunk {
                chunk: StreamChunk::TextDelta { text, .. },
                ..
            } => {
                print!("{text}");
                let _ = std::io::stdout().flush();
            }
            EventData::AssistantMessage { .. } => {
                let _ = std::io::stdout().flush();
            }
            EventData::ToolCall {
                name, arguments, ..
            } => {
                let args: String = arguments.chars().take(160).collect();
                eprintln!("\n▸ {name} {args}");
            }
            EventData::ToolResult { message, error, .. } => {
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
    let endpoint = match endpoint(&opts) {
        Ok(e) => e,
        Err(exit) => return exit,
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

async fn drive(rt: &Runtime, opts: RunOptions, endpoint: Endpoint, cwd: PathBuf) -> RunExit {
    let root = rt.root();
    let llm = Arc::new(LlmRuntime::new());
    let tools = Arc::new(ToolRegistry::new());
    let approval = Arc::new(Approval::new(opts.approval));
    let setup = (|| -> Result<(), String> {
        root.provide(LlmRuntime::SERVICE, llm.clone())
            .map_err(|e| e.to_string())?;
        root.provide(ToolRegistry::SERVICE, tools.clone())
            .map_err(|e| e.to_string())?;
        root.provide(Approval::SERVICE, approval.clone())
            .map_err(|e| e.to_string())?;
        root.provide(Agents::SERVICE, Arc::new(Agents::default()))
            .map_err(|e| e.to_string())?;
        register_builtin(&root, &tools)?;
        Ok(())
    })();
    if let Err(e) = setup {
        return RunExit::fail(1, format!("cannot set up the runtime: {e}"));
    }
    let (provider, model, adapter): (&str, String, Arc<dyn LlmAdapter>) = match endpoint {
        Endpoint::Scripted(m) => ("scripted", "script".into(), Arc::new(m)),
        Endpoint::OpenAi { config, model } => match OpenAiCompatible::new(config) {
            Ok(a) => {
                if let Err(e) = RetryListener::default().install(&root) {
                    return RunExit::fail(1, e.to_string());
                }
                ("openai", model, Arc::new(a))
            }
            Err(e) => return RunExit::fail(1, e),
        },
    };
    if let Err(e) = llm.register(&root, &[provider], adapter) {
        return RunExit::fail(1, e);
    }
    if opts.approval == ApprovalPolicy::Ask
        && std::io::IsTerminal::is_terminal(&std::io::stdin())
        && let Err(e) = install_terminal_answerer(rt)
    {
        return RunExit::fail(1, e.to_string());
    }
    let mut spec = AgentSpec::new(provider, &model, cwd.clone());
    spec.system = Some(opts.system.clone().unwrap_or_else(|| system_prompt(&cwd)));
    spec.session_path = opts.session_out.clone();
    spec.max_steps = opts.max_steps;
    let agent = match Agent::create(&root, spec).await {
        Ok(a) => a,
        Err(e) => return RunExit::fail(1, format!("cannot create the agent: {e}")),
    };
    observe(&agent, opts.json);
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
