//! `dsh workflow`, `dsh ralph` and `dsh demo`: multi-agent runs from the CLI.
//!
//! Each command boots the agent services with the multi-agent capabilities,
//! creates a coordinator agent (a stored session that is the parent of every
//! child), and runs the workflow script or the Ralph loop under it. Every
//! session — the coordinator's and each child's — is written to the sessions
//! store, so the runs can be inspected with `dsh sessions` and a Ralph loop
//! cut by a crash continues with `dsh ralph --resume <coordinator id>`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec};
use dsh_actors::multi_agent::{MultiAgentConfig, install};
use dsh_actors::ralph::{self, RalphOutcome, RalphRequest};
use dsh_actors::subagent::{SubagentStart, Subagents};
use dsh_actors::workflow::{WorkflowEngine, WorkflowRequest, WorkflowStop, WorkflowUpdate};
use dsh_services::llm::LlmRuntime;
use dsh_services::persistence::SessionPersistence;
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::tree::render;
use dsh_supervisors::{Runtime, RuntimeSettings};
use serde_json::{Value, json};

use crate::catalogue::{AgentServices, AgentServicesConfig, OpenAi, OpenAiPluginConfig};
use crate::demo::DemoModel;
use crate::run::RunExit;
use crate::sessions::{StoreChoice, open_store};

/// The model the workers use.
#[derive(Clone, Debug)]
pub enum ModelChoice {
    /// The built-in keyless demo model.
    Demo,
    /// An OpenAI-compatible endpoint.
    OpenAi {
        /// `…/v1` base URL.
        base_url: String,
        /// Model id.
        model: String,
        /// Environment variable holding the key.
        api_key_env: String,
    },
}

impl ModelChoice {
    /// From the flags (or $DSH_BASE_URL / $DSH_MODEL); the demo model when
    /// `demo` is set; an error naming the choices otherwise.
    pub fn pick(
        demo: bool,
        base_url: Option<String>,
        model: Option<String>,
        api_key_env: String,
    ) -> Result<ModelChoice, RunExit> {
        if demo {
            return Ok(ModelChoice::Demo);
        }
        let base_url = base_url.or_else(|| std::env::var("DSH_BASE_URL").ok());
        let model = model.or_else(|| std::env::var("DSH_MODEL").ok());
        match (base_url, model) {
            (Some(base_url), Some(model)) => Ok(ModelChoice::OpenAi {
                base_url,
                model,
                api_key_env,
            }),
            (Some(_), None) => Err(fail(2, "--base-url needs --model (or DSH_MODEL)")),
            _ => Err(fail(
                2,
                "no model endpoint is configured: pass --base-url URL --model ID (an \
                 OpenAI-compatible endpoint; key in $DSH_API_KEY), or --demo-model for the \
                 built-in keyless demo model",
            )),
        }
    }
}

fn fail(code: u8, message: impl Into<String>) -> RunExit {
    RunExit {
        code,
        message: Some(message.into()),
    }
}

fn ok() -> RunExit {
    RunExit {
        code: 0,
        message: None,
    }
}

/// A booted runtime with a coordinator agent.
struct Stage {
    rt: Runtime,
    coordinator: Agent,
    subagents: Arc<Subagents>,
    store: Arc<dyn SessionPersistence>,
}

async fn stage(
    model: &ModelChoice,
    store: &StoreChoice,
    cwd: &Path,
    resume: Option<&str>,
    name: &str,
) -> Result<Stage, RunExit> {
    let cwd = cwd.canonicalize().map_err(|e| {
        fail(
            2,
            format!("the workspace {} is not accessible: {e}", cwd.display()),
        )
    })?;
    let store = open_store(store)?;
    let rt = Runtime::start(RuntimeSettings::default())
        .await
        .map_err(|e| fail(1, format!("cannot start the runtime: {e}")))?;
    let root = rt.root();
    let services = AgentServicesConfig {
        approval: Some(dsh_services::approval::ApprovalPolicy::Never),
        ..AgentServicesConfig::default()
    };
    root.plugin(AgentServices, services)
        .await
        .map_err(|e| fail(1, e.to_string()))?;
    let (provider, model_id) = match model {
        ModelChoice::Demo => {
            let llm = root
                .get::<LlmRuntime>(LlmRuntime::SERVICE)
                .ok_or_else(|| fail(1, "no llm service"))?;
            llm.register(&root, &["demo"], Arc::new(DemoModel))
                .map_err(|e| fail(1, e.to_string()))?;
            ("demo".to_owned(), "demo".to_owned())
        }
        ModelChoice::OpenAi {
            base_url,
            model,
            api_key_env,
        } => {
            root.plugin(
                OpenAi,
                OpenAiPluginConfig {
                    provider: "openai".into(),
                    base_url: base_url.clone(),
                    api_key_env: Some(api_key_env.clone()),
                    idle_timeout_s: None,
                },
            )
            .await
            .map_err(|e| fail(2, e.to_string()))?;
            ("openai".to_owned(), model.clone())
        }
    };
    let tools = root
        .get::<ToolRegistry>(ToolRegistry::SERVICE)
        .ok_or_else(|| fail(1, "no tool registry"))?;
    let subagents = match root.get::<Subagents>(Subagents::SERVICE) {
        Some(s) => s,
        None => install(&root, &tools, &MultiAgentConfig::default())
            .map_err(|e| fail(1, e.to_string()))?,
    };
    let mut spec = AgentSpec::new(&provider, &model_id, cwd.clone());
    spec.name = Some(name.to_owned());
    spec.system = Some(format!(
        "You are a dsh worker in the directory {}. Do the task you are given and answer briefly.",
        cwd.display()
    ));
    spec.store = Some(store.clone());
    spec.origin = Some(format!("cli/{name}"));
    if let Some(id) = resume {
        let loaded = store
            .load(id)
            .map_err(|e| fail(1, format!("cannot resume {id}: {e}")))?;
        store
            .prepare_resume(id, &loaded)
            .map_err(|e| fail(1, e.to_string()))?;
        spec.durable = Some(loaded.durable);
        spec.seed = Some(Box::new((loaded.header, loaded.events)));
    }
    let coordinator = Agent::create(&root, spec)
        .await
        .map_err(|e| fail(1, format!("cannot create the coordinator: {e}")))?;
    Ok(Stage {
        rt,
        coordinator,
        subagents,
        store,
    })
}

async fn finish(stage: Stage) -> Option<String> {
    let flushed = stage.coordinator.session().flush().await.err();
    let _ = tokio::time::timeout(Duration::from_secs(60), stage.rt.shutdown()).await;
    flushed.map(|e| format!("the coordinator's log was not fully written: {e}"))
}

/// The children a coordinator's session has, from the store.
fn children_of(store: &dyn SessionPersistence, parent: &str) -> Vec<String> {
    let mut out: Vec<(u64, String)> = store
        .list()
        .map(|l| {
            l.into_iter()
                .flatten()
                .filter(|s| s.parent_session.as_deref() == Some(parent))
                .map(|s| (s.created_at, s.id))
                .collect()
        })
        .unwrap_or_default();
    out.sort();
    out.into_iter().map(|(_, id)| id).collect()
}

/// Options of `dsh workflow`.
#[derive(Clone, Debug)]
pub struct WorkflowOptions {
    /// The script file.
    pub script: PathBuf,
    /// The `args` global (JSON).
    pub args: Option<String>,
    /// The meta block (JSON); derived from the file name when absent.
    pub meta: Option<String>,
    /// Print the live tree when the children are in flight.
    pub tree: bool,
    /// The model.
    pub model: ModelChoice,
    /// Workspace.
    pub cwd: PathBuf,
    /// Sessions store.
    pub store: StoreChoice,
}

fn parse_json(what: &str, text: &str) -> Result<Value, RunExit> {
    serde_json::from_str(text).map_err(|e| fail(2, format!("{what} is not valid JSON: {e}")))
}

/// A kebab-case name from a file stem.
fn kebab(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().to_lowercase())
        .unwrap_or_default();
    let name: String = stem
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let name = name.trim_matches('-').to_owned();
    if name.is_empty() {
        "workflow".into()
    } else {
        name
    }
}

/// `dsh workflow <script.js>`.
pub async fn workflow(opts: WorkflowOptions) -> RunExit {
    let script = match std::fs::read_to_string(&opts.script) {
        Ok(s) => s,
        Err(e) => return fail(2, format!("cannot read {}: {e}", opts.script.display())),
    };
    let args = match &opts.args {
        Some(a) => match parse_json("--args", a) {
            Ok(v) => v,
            Err(e) => return e,
        },
        None => Value::Null,
    };
    let meta = match &opts.meta {
        Some(m) => match parse_json("--meta", m) {
            Ok(v) => v,
            Err(e) => return e,
        },
        None => json!({
            "name": kebab(&opts.script),
            "description": format!("workflow from {}", opts.script.display()),
        }),
    };
    let stage = match stage(&opts.model, &opts.store, &opts.cwd, None, "workflow").await {
        Ok(s) => s,
        Err(e) => return e,
    };
    let exit = run_workflow(&stage, script, meta, args, opts.tree, 0).await;
    let exit = match exit {
        Ok((value, _)) => {
            println!(
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            );
            ok()
        }
        Err(e) => e,
    };
    report_logs(&stage, "workflow");
    match finish(stage).await {
        Some(m) if exit.code == 0 => fail(1, m),
        _ => exit,
    }
}

/// Runs one script under the coordinator, narrating on stderr; prints the
/// tree once `tree_at` children are in flight (0: never).
async fn run_workflow(
    stage: &Stage,
    script: String,
    meta: Value,
    args: Value,
    tree: bool,
    tree_at: u32,
) -> Result<(Value, u32), RunExit> {
    let root = stage.rt.root();
    let Some(engine) = root.get::<WorkflowEngine>(WorkflowEngine::SERVICE) else {
        return Err(fail(1, "no workflow engine is provided"));
    };
    let started = Arc::new(AtomicU32::new(0));
    let rt = stage.rt.clone();
    let count = started.clone();
    let show_at = if tree { tree_at.max(1) } else { tree_at };
    let listener = root.on(move |u: &WorkflowUpdate| match u.kind {
        "workflow/phase" => eprintln!(
            "[{}] phase: {}",
            u.name,
            u.data["title"].as_str().unwrap_or_default()
        ),
        "workflow/log" => eprintln!(
            "[{}] {}",
            u.name,
            u.data["message"].as_str().unwrap_or_default()
        ),
        "workflow/agent-start" => {
            let n = count.fetch_add(1, Ordering::Relaxed) + 1;
            eprintln!(
                "[{}] agent #{} started: {} (session {})",
                u.name,
                u.data["seq"],
                u.data["label"].as_str().unwrap_or("-"),
                u.data["child"].as_str().unwrap_or_default()
            );
            if show_at > 0 && n == show_at {
                eprintln!("live actor tree:\n{}", render(&rt.tree().snapshot()));
            }
        }
        "workflow/agent-end" => eprintln!(
            "[{}] agent #{} {}",
            u.name,
            u.data["seq"],
            u.data["outcome"].as_str().unwrap_or_default()
        ),
        _ => {}
    });
    let mut request = WorkflowRequest::new(&stage.coordinator, script, meta);
    request.args = args;
    let cancel = request.cancel.clone();
    let run = engine
        .start(request)
        .await
        .map_err(|e| fail(2, e.to_string()))?;
    let result = tokio::select! {
        r = run.result() => r,
        _ = tokio::signal::ctrl_c() => {
            cancel.cancel();
            run.result().await
        }
    };
    run.dispose().await;
    if let Ok(l) = listener {
        l.dispose().await;
    }
    match result.stop_reason {
        WorkflowStop::Completed => Ok((result.value, result.agents_started)),
        WorkflowStop::Cancelled => Err(fail(130, "the workflow was cancelled")),
        WorkflowStop::Error => Err(fail(
            1,
            format!("the workflow failed: {}", result.error.unwrap_or_default()),
        )),
    }
}

fn report_logs(stage: &Stage, what: &str) {
    let id = stage.coordinator.id();
    eprintln!("{what} session: {}", stage.store.locate(id));
    for child in children_of(&*stage.store, id) {
        eprintln!("  child session: {}", stage.store.locate(&child));
    }
}

/// Options of `dsh ralph`.
#[derive(Clone, Debug)]
pub struct RalphOptions {
    /// The objective (absent with `resume`).
    pub objective: Option<String>,
    /// Round cap.
    pub max_rounds: u32,
    /// Continue the loop recorded in this coordinator session.
    pub resume: Option<String>,
    /// The model.
    pub model: ModelChoice,
    /// Workspace.
    pub cwd: PathBuf,
    /// Sessions store.
    pub store: StoreChoice,
}

/// `dsh ralph "<objective>" --max-rounds N` / `dsh ralph --resume ID`.
pub async fn ralph(opts: RalphOptions) -> RunExit {
    if opts.max_rounds == 0 || opts.max_rounds > ralph::MAX_ROUNDS {
        return fail(
            2,
            format!("--max-rounds must be between 1 and {}", ralph::MAX_ROUNDS),
        );
    }
    let stage = match stage(
        &opts.model,
        &opts.store,
        &opts.cwd,
        opts.resume.as_deref(),
        "ralph",
    )
    .await
    {
        Ok(s) => s,
        Err(e) => return e,
    };
    let resume = match &opts.resume {
        None => None,
        Some(id) => {
            let events: Vec<_> = stage
                .coordinator
                .session()
                .events()
                .iter()
                .map(|e| e.as_ref().clone())
                .collect();
            match ralph::last_loop(&events) {
                Some(r) => {
                    eprintln!(
                        "resuming Ralph loop {} after round {} of {}",
                        r.run_id,
                        r.rounds.last().map_or(0, |(n, _)| *n),
                        r.max_rounds
                    );
                    Some(r)
                }
                None => {
                    let _ = finish(stage).await;
                    return fail(2, format!("session {id} holds no Ralph loop"));
                }
            }
        }
    };
    let objective = opts.objective.clone().unwrap_or_default();
    if resume.is_none() && objective.trim().is_empty() {
        let _ = finish(stage).await;
        return fail(2, "give the objective, or --resume ID");
    }
    let exit = run_ralph(&stage, &objective, opts.max_rounds, resume, None).await;
    report_logs(&stage, "ralph");
    if exit.code == 0 {
        eprintln!(
            "resume a cut loop with: dsh ralph --resume {}",
            stage.coordinator.id()
        );
    }
    match finish(stage).await {
        Some(m) if exit.code == 0 => fail(1, m),
        _ => exit,
    }
}

async fn run_ralph(
    stage: &Stage,
    objective: &str,
    max_rounds: u32,
    resume: Option<ralph::Resume>,
    tree_at_round: Option<u32>,
) -> RunExit {
    let rt = stage.rt.clone();
    let listener = stage.rt.root().on(move |s: &SubagentStart| {
        let label = s.info.label.clone().unwrap_or_default();
        if !label.starts_with("ralph round") {
            return;
        }
        eprintln!("{label}: worker session {}", s.info.child);
        if tree_at_round.is_some_and(|n| label == format!("ralph round {n}")) {
            eprintln!("live actor tree:\n{}", render(&rt.tree().snapshot()));
        }
    });
    let mut request = RalphRequest::new(&stage.coordinator, objective);
    request.max_rounds = Some(max_rounds);
    let cancel = request.cancel.clone();
    let run = ralph::run(&stage.subagents, request, resume);
    tokio::pin!(run);
    let result = tokio::select! {
        r = &mut run => r,
        _ = tokio::signal::ctrl_c() => {
            cancel.cancel();
            run.await
        }
    };
    if let Ok(l) = listener {
        l.dispose().await;
    }
    let result = match result {
        Ok(r) => r,
        Err(e) => return fail(2, e.to_string()),
    };
    for r in &result.completed {
        println!(
            "round {}: {} — {}",
            r.round,
            serde_json::to_value(r.handoff.status)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            r.handoff.summary
        );
    }
    println!(
        "Ralph loop {}: {} ({} rounds)",
        result.run_id,
        result.outcome.describe(),
        result.rounds
    );
    if let Some(last) = &result.last {
        println!(
            "last handoff (the worker's report):\n{}",
            serde_json::to_string_pretty(last).unwrap_or_default()
        );
    }
    match result.outcome {
        RalphOutcome::Complete | RalphOutcome::BudgetLimited => ok(),
        RalphOutcome::Blocked => fail(3, "the worker reported a blocker"),
        RalphOutcome::CircuitOpen => fail(3, "the loop made no progress"),
        RalphOutcome::Failed { .. } => fail(1, result.outcome.describe()),
        RalphOutcome::Cancelled { .. } => fail(130, "cancelled"),
    }
}

/// The demo's workflow: a fan-out to three subagents, then a summary.
pub const DEMO_SCRIPT: &str = r#"phase("research");
log("fanning out to " + args.topics.length + " subagents");
const notes = await Promise.all(
  args.topics.map((topic) => agent("Write one line about " + topic + ".", { label: topic, phase: "research" }))
);
phase("summary");
return { topics: args.topics, notes };
"#;

/// `dsh demo`: keyless, on the built-in demo model.
pub async fn demo(store: StoreChoice, cwd: PathBuf) -> RunExit {
    let stage = match stage(&ModelChoice::Demo, &store, &cwd, None, "demo").await {
        Ok(s) => s,
        Err(e) => return e,
    };
    println!("dsh demo — the built-in keyless model; every agent below is a supervised actor.\n");
    println!("1. A workflow script fans out to three subagents:");
    let meta = json!({"name": "demo-fan-out", "description": "three subagents in parallel"});
    let args = json!({"topics": ["actors", "supervision", "teardown"]});
    let mut code = 0;
    match run_workflow(&stage, DEMO_SCRIPT.into(), meta, args, true, 3).await {
        Ok((value, agents)) => {
            println!("   workflow result ({agents} subagents):");
            println!(
                "{}",
                serde_json::to_string_pretty(&value).unwrap_or_default()
            );
        }
        Err(e) => {
            eprintln!("dsh demo: {}", e.message.unwrap_or_default());
            code = e.code;
        }
    }
    println!("\n2. A three-round Ralph loop (a fresh worker per round):");
    let exit = run_ralph(
        &stage,
        "Write the release notes for dsh 0.1 in NOTES.md",
        3,
        None,
        Some(2),
    )
    .await;
    if exit.code != 0 {
        eprintln!("dsh demo: {}", exit.message.unwrap_or_default());
        code = code.max(exit.code);
    }
    println!("\nLogs:");
    let id = stage.coordinator.id().to_owned();
    println!("   coordinator: {}", stage.store.locate(&id));
    for child in children_of(&*stage.store, &id) {
        println!("   child:       {}", stage.store.locate(&child));
    }
    println!("Inspect them with `dsh sessions list` / `dsh sessions show <id>`.");
    match finish(stage).await {
        Some(m) => fail(1, m),
        None if code == 0 => ok(),
        None => fail(code, "the demo did not finish cleanly"),
    }
}
