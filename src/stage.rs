//! What every command that creates agents boots before its first agent: the
//! agent services with the approval policy, and the model, from the flags
//! ([`AgentArgs`]) or from a `--config` plugin tree; then the provider route
//! and model id its agents use, and the terminal answerer when it may ask.

use std::io::Write as _;
use std::sync::Arc;

use dsh_services::approval::{Approval, ApprovalAsk, ApprovalOutcome, ApprovalPolicy};
use dsh_services::llm::LlmRuntime;
use dsh_services::sandbox::Sandbox;
use dsh_supervisors::{Error, Loader, Runtime, Source};

use dsh_services::persistence::{PERSISTENCE_SERVICE, SessionPersistence};

use crate::args::{AgentArgs, HOW_TO_CONFIGURE, ModelChoice, StoreArgs};
use crate::catalogue::{
    AgentServices, AgentServicesConfig, DeepSeek, DeepSeekPluginConfig, OpenAi, OpenAiPluginConfig,
    Scripted, ScriptedPluginConfig, default_catalogue,
};
use crate::exit::{self, Exit};
use crate::sessions::open_store;
use dsh_services::providers::demo::DemoModel;

/// The provider route and model id a command's agents use.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Provider route (`openai`, `scripted`, `demo`, or a config's).
    pub provider: String,
    /// Model id on that route.
    pub model: String,
}

/// Who boots: a command that runs agents itself, or a server that creates
/// them on request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Purpose {
    /// `run`, `workflow`, `ralph`: a route is required, and approval asks
    /// are answered on the terminal (with the `ask` policy and stdin a
    /// terminal).
    Run,
    /// `serve`: the API serves the tree with or without a model; a config
    /// may hold no agent services or several routes (a request names one).
    Serve,
    /// `acp`: a route is required; asks go to the protocol's client, never
    /// to the terminal (stdin is the protocol's).
    Protocol,
    /// `chat`: a route is required; the chat puts asks to the user itself.
    Chat,
}

/// For a command that runs agents itself: boots the agent services and the
/// model into `rt` and returns the route agents use; no model configured is
/// an error saying how to configure one.
pub async fn route(
    rt: &Runtime,
    args: &AgentArgs,
    workspace: Option<&std::path::Path>,
) -> exit::Result<Route> {
    boot(rt, args, Purpose::Run, workspace)
        .await?
        .ok_or_else(|| Exit::usage(HOW_TO_CONFIGURE))
}

/// Boots the agent services and the model into `rt`; returns the route
/// agents use (`None`: none is configured, or, serving, none is implied).
/// With `--hooks`, the project hook files are found in `workspace` (the
/// current directory when `None`).
pub async fn boot(
    rt: &Runtime,
    args: &AgentArgs,
    purpose: Purpose,
    workspace: Option<&std::path::Path>,
) -> exit::Result<Option<Route>> {
    let root = rt.root();
    let choice = args.model.choice(args.config.config.is_some())?;
    let approval = args.policy.approval()?;
    match &args.config.config {
        Some(file) => boot_config(rt, file, &args.config.patches).await?,
        None => {
            let services = AgentServicesConfig {
                approval,
                ..AgentServicesConfig::default()
            };
            root.plugin(AgentServices, services).await.map_err(failed)?;
            if let Some(choice) = &choice {
                register(rt, choice).await?;
            }
        }
    }
    // An ACP server installs them per session, from its working directory.
    if args.config.hooks && purpose != Purpose::Protocol {
        let config = crate::catalogue::HooksConfig {
            workspace: workspace.map(std::path::Path::to_path_buf),
            ..Default::default()
        };
        root.plugin(crate::catalogue::HooksPlugin, config)
            .await
            .map_err(failed)?;
    }
    if let (Some(policy), Some(seam)) = (approval, root.get::<Approval>(Approval::SERVICE)) {
        seam.set_policy(policy);
    }
    if let Some(sandbox) = root.get::<Sandbox>(Sandbox::SERVICE) {
        sandbox.set(args.policy.sandbox_over(sandbox.settings())?);
    }
    depth(rt, args);
    if purpose == Purpose::Serve {
        // Each request names its route (or takes the only one); the model
        // the command line chose is what a request naming none gets.
        if let (Some(choice), Some(llm)) = (&choice, root.get::<LlmRuntime>(LlmRuntime::SERVICE))
            && let Ok(Some(provider)) =
                pick_provider(&llm.providers(), args.model.provider.as_deref())
            && (*choice != ModelChoice::Config || args.model.model.is_some())
        {
            llm.prefer(&provider, &args.model.model_id(Some(choice)));
        }
        return Ok(None);
    }
    if purpose == Purpose::Run {
        answer_on_terminal(rt)?;
    }
    let Some(llm) = root.get::<LlmRuntime>(LlmRuntime::SERVICE) else {
        return Err(Exit::usage(
            "the config provides no `llm` service; add an `agent-services` entry",
        ));
    };
    let Some(provider) = pick_provider(&llm.providers(), args.model.provider.as_deref())? else {
        return Ok(None);
    };
    Ok(Some(Route {
        provider,
        model: args.model.model_id(choice.as_ref()),
    }))
}

/// Where sessions go: a store named on the command line wins; else the one a
/// `--config` file's `session-store` entry provides; else the default
/// sessions directory.
///
/// The store opened here is provided to the runtime as well (unless one
/// is already): the API and the dashboard then read the sessions this
/// process writes — its children's too — after their agents are gone.
pub fn store(rt: &Runtime, args: &StoreArgs) -> exit::Result<Arc<dyn SessionPersistence>> {
    let root = rt.root();
    let provided = root.get::<dyn SessionPersistence>(PERSISTENCE_SERVICE);
    let has_one = provided.is_some();
    match provided.filter(|_| !args.named()) {
        Some(s) => Ok(s),
        None => {
            let store = open_store(args)?;
            if !has_one {
                root.provide(PERSISTENCE_SERVICE, store.clone())
                    .map_err(|e| {
                        Exit::failed(format!(
                            "cannot provide the session store: {}",
                            dsh_supervisors::error::chain(&e)
                        ))
                    })?;
            }
            Ok(store)
        }
    }
}

/// Boots a `cordis.yml` (and its patches); every entry must start.
async fn boot_config(
    rt: &Runtime,
    file: &std::path::Path,
    patches: &[std::path::PathBuf],
) -> exit::Result<()> {
    let source = Source {
        base: file.to_path_buf(),
        patches: patches.to_vec(),
    };
    let (_, failures) = Loader::boot(rt, default_catalogue(), source).await?;
    if failures.is_empty() {
        return Ok(());
    }
    let list: Vec<String> = failures
        .iter()
        .map(|(id, why)| format!("entry `{id}`: {why}"))
        .collect();
    Err(Exit::failed(format!(
        "the config did not start:\n{}",
        list.join("\n")
    )))
}

/// Registers the chosen model's provider route (`demo`, `scripted` or
/// `openai`).
async fn register(rt: &Runtime, choice: &ModelChoice) -> exit::Result<()> {
    let root = rt.root();
    let started = match choice {
        ModelChoice::Config => return Ok(()),
        ModelChoice::Demo => {
            let llm = root
                .get::<LlmRuntime>(LlmRuntime::SERVICE)
                .ok_or_else(|| Exit::failed("no llm service"))?;
            llm.register(&root, &["demo"], Arc::new(DemoModel))
                .map_err(failed)?;
            return Ok(());
        }
        ModelChoice::Script(path) => {
            let config = ScriptedPluginConfig {
                provider: "scripted".into(),
                script: path.clone(),
            };
            root.plugin(Scripted, config).await
        }
        ModelChoice::DeepSeek {
            effort,
            request_timeout,
            ..
        } => {
            let config = DeepSeekPluginConfig {
                reasoning_effort: *effort,
                request_timeout_s: *request_timeout,
                ..DeepSeekPluginConfig::default()
            };
            root.plugin(DeepSeek, config).await
        }
        ModelChoice::OpenAi {
            base_url,
            api_key_env,
            request_timeout,
            ..
        } => {
            let config = OpenAiPluginConfig {
                request_timeout_s: *request_timeout,
                ..OpenAiPluginConfig::endpoint("openai", base_url, api_key_env)
            };
            root.plugin(OpenAi, config).await
        }
    };
    started.map(|_| ()).map_err(|e| match e {
        // A provider that refuses its settings (an unreadable script, a
        // missing key) is bad input.
        Error::PluginFailed { reason, .. } => Exit::usage(reason),
        other => failed(other),
    })
}

/// The route agents use: `asked` when it is registered, else the only one.
fn pick_provider(registered: &[String], asked: Option<&str>) -> exit::Result<Option<String>> {
    match (asked, registered) {
        (Some(p), _) if registered.iter().any(|r| r == p) => Ok(Some(p.to_owned())),
        (Some(p), _) => Err(Exit::usage(format!(
            "no provider `{p}` is registered (registered: {})",
            registered.join(", ")
        ))),
        (None, [only]) => Ok(Some(only.clone())),
        (None, []) => Ok(None),
        (None, many) => Err(Exit::usage(format!(
            "several providers are registered ({}); choose one with --provider",
            many.join(", ")
        ))),
    }
}

/// With the `ask` policy and a controlling terminal, the terminal answers
/// (whatever stdin and stdout are): the request and its reason are shown on
/// it, and anything but `y`/`yes` rejects. One question at a time.
fn answer_on_terminal(rt: &Runtime) -> exit::Result<()> {
    let root = rt.root();
    let asks = root
        .get::<Approval>(Approval::SERVICE)
        .is_some_and(|a| a.policy() == ApprovalPolicy::Ask);
    if !asks || open_tty().is_err() {
        return Ok(());
    }
    let one_at_a_time = Arc::new(std::sync::Mutex::new(()));
    root.on_waterfall(move |ask: ApprovalAsk, _next| {
        let one_at_a_time = one_at_a_time.clone();
        async move {
            let question = question(&ask);
            // A blocking read of the terminal, on the blocking pool; a
            // withdrawn ask drops this future (its answer is discarded).
            let answer = tokio::task::spawn_blocking(move || {
                let _turn = one_at_a_time.lock();
                let mut tty = open_tty()?;
                tty.write_all(question.as_bytes())?;
                tty.flush()?;
                let mut line = String::new();
                std::io::BufRead::read_line(&mut std::io::BufReader::new(tty), &mut line)?;
                Ok::<_, std::io::Error>(line)
            })
            .await;
            match answer {
                Ok(Ok(line)) if matches!(line.trim().to_lowercase().as_str(), "y" | "yes") => {
                    ApprovalOutcome::AllowedOnce
                }
                Ok(Ok(_)) => ApprovalOutcome::Rejected,
                _ => ApprovalOutcome::Unavailable,
            }
        }
    })
    .map(|_| ())
    .map_err(failed)
}

/// The controlling terminal, for reading and writing.
fn open_tty() -> std::io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/tty")
}

/// What the terminal shows for `ask` (arguments cut to a screenful).
fn question(ask: &ApprovalAsk) -> String {
    let mut args = ask.request.arguments.to_string();
    if args.len() > 2000 {
        let cut = (0..=2000)
            .rev()
            .find(|i| args.is_char_boundary(*i))
            .unwrap_or(0);
        args.truncate(cut);
        args.push('…');
    }
    format!(
        "\n── approval needed ──\ntool: {}\narguments: {args}\nreason: {}\nallow this once? [y/N] ",
        ask.request.tool, ask.request.reason
    )
}

/// The persona of the agents the CLI starts: who the agent is and where it
/// works. The `agent-services` plugin adds the rest of the system prompt as
/// sections after it: guidance for each tool the agent can see, then how
/// the sandbox and escalation work. Nothing in it changes with the
/// permission mode or the approval policy (the runtime-context message
/// states those), so its cached prefix survives a change.
pub fn system_prompt(cwd: &std::path::Path, model: &str) -> String {
    let identity = "You are dsh, a coding agent. You work in a workspace with the tools you are given: inspect before you change, make the change the task asks for and no more, and answer briefly and concretely. When the task is unclear, say what you would do and ask. When another agent delegated the task to you, you cannot ask: do it and report what you did and found.";
    format!(
        "{identity}\n\n# Environment\nWorking directory (the workspace): {}\nModel: {model}\nPaths in tool arguments are relative to the workspace unless absolute.",
        cwd.display()
    )
}

/// Applies `--max-depth` to the runtime's `subagents` service, if any.
pub fn depth(rt: &Runtime, args: &AgentArgs) {
    if let (Some(max), Some(subagents)) = (
        args.max_depth,
        rt.root()
            .get::<dsh_actors::subagent::Subagents>(dsh_actors::subagent::Subagents::SERVICE),
    ) {
        subagents.set_max_depth(max);
    }
}

/// The named agent definitions for `cwd` (its project's nearest first,
/// then the user's `~/.dsh/agents`), read off the async workers and made
/// the ones the runtime's children may be made from; each file refused is
/// said on stderr with why.
pub async fn definitions(
    rt: &Runtime,
    cwd: &std::path::Path,
) -> Arc<dsh_services::definitions::Definitions> {
    let (cwd, home) = (cwd.to_path_buf(), crate::home::dir());
    let found =
        tokio::task::spawn_blocking(move || dsh_services::definitions::discover(&cwd, Some(&home)))
            .await
            .unwrap_or_default();
    for e in &found.errors {
        crate::errln!(
            "dsh: agent definition refused: {}",
            crate::lines::inert_line(&e.to_string())
        );
    }
    // What a Claude Code file holds that is not read here.
    for d in found.found.values() {
        for w in &d.warnings {
            crate::errln!(
                "dsh: agent definition {}: {}",
                crate::lines::inert_line(&d.path.display().to_string()),
                crate::lines::inert_line(w)
            );
        }
    }
    if let Some(subagents) = rt
        .root()
        .get::<dsh_actors::subagent::Subagents>(dsh_actors::subagent::Subagents::SERVICE)
    {
        subagents.set_definitions(found.clone());
    }
    Arc::new(found)
}

/// The workspace's system prompt sections for an agent in `cwd`: its
/// `AGENTS.md` files (and the user's `~/.dsh/AGENTS.md`), then its skills
/// catalog; read off the async workers.
pub async fn workspace_sections(
    cwd: &std::path::Path,
) -> Vec<dsh_services::prompt::RenderedSection> {
    crate::home::workspace_sections(cwd).await
}

fn failed(e: impl std::error::Error) -> Exit {
    Exit::failed(dsh_supervisors::error::chain(&e).to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_only_route_serves_unless_one_is_named() {
        let one = ["openai".to_owned()];
        assert_eq!(
            pick_provider(&one, None).ok().flatten().as_deref(),
            Some("openai")
        );
        let two = ["a".to_owned(), "b".to_owned()];
        assert!(matches!(pick_provider(&two, None), Err(e) if e.code == exit::USAGE));
        assert_eq!(
            pick_provider(&two, Some("b")).ok().flatten().as_deref(),
            Some("b")
        );
        assert!(matches!(pick_provider(&two, Some("c")), Err(e) if e.code == exit::USAGE));
        assert!(matches!(pick_provider(&[], None), Ok(None)));
    }
}
