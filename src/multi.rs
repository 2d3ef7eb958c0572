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
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec};
use dsh_actors::cluster::Cluster;
use dsh_actors::multi_agent::{MultiAgentConfig, install};
use dsh_actors::ralph::{self, RalphOutcome, RalphRequest};
use dsh_actors::subagent::{SubagentEnd, SubagentStart, Subagents};
use dsh_actors::workflow::{WorkflowEngine, WorkflowRequest, WorkflowStop, WorkflowUpdate};
use dsh_services::persistence::SessionPersistence;
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::error::chain;
use dsh_supervisors::tree::{RecvError, render};
use dsh_supervisors::{Runtime, RuntimeSettings};
use serde_json::{Value, json};

use crate::args::{
    AgentArgs, ClusterArgs, ConfigArgs, DashboardArgs, MODEL_PRECEDENCE, ModelArgs, PolicyArgs,
    StoreArgs, WorkspaceArgs,
};
use crate::board::{Board, Row};
use crate::exit::{self, BLOCKED, CANCELLED, Exit};
use crate::lines::{self, inert_line};
use crate::stage::{Route, route, store};

/// A booted runtime with a coordinator agent.
struct Stage {
    rt: Runtime,
    coordinator: Agent,
    subagents: Arc<Subagents>,
    store: Arc<dyn SessionPersistence>,
    /// The cluster children run in (`--nodes`), if any.
    cluster: Option<Arc<Cluster>>,
}

/// How long a printed tree waits for the subtrees of children on other
/// nodes to arrive.
const MIRROR_WAIT: Duration = Duration::from_secs(5);

/// The live tree, printed on stderr once it is due: at once when children
/// run here; with children on other nodes, from the run's own flow once
/// their subtrees are shown here ([`Cluster::mirrored`], at most
/// [`MIRROR_WAIT`] later).
struct TreePrint {
    rt: Runtime,
    cluster: Option<Arc<Cluster>>,
    due: tokio::sync::Notify,
    /// The run's lines, which the tree is printed among.
    board: Arc<Board>,
}

impl TreePrint {
    fn new(stage: &Stage, board: Arc<Board>) -> Arc<TreePrint> {
        Arc::new(TreePrint {
            rt: stage.rt.clone(),
            cluster: stage.cluster.clone(),
            due: tokio::sync::Notify::new(),
            board,
        })
    }

    fn show(&self, nodes: &[dsh_supervisors::tree::NodeSnapshot]) {
        self.board
            .say(&format!("live actor tree:\n{}", render(nodes)));
    }

    /// The tree is due (called from a listener, which cannot wait).
    fn due(&self) {
        match &self.cluster {
            None => self.print(),
            Some(_) => self.due.notify_one(),
        }
    }

    fn print(&self) {
        self.show(&self.rt.tree().snapshot());
    }

    /// Prints the tree when it is due and the mirrors are in; never ends
    /// (raced against the run).
    async fn printing(&self) -> std::convert::Infallible {
        if let Some(cluster) = &self.cluster {
            self.due.notified().await;
            let deadline = tokio::time::Instant::now() + MIRROR_WAIT;
            let tree = self.rt.tree();
            // Children placed while the mirrors came in (siblings start
            // at once) show their subtree too, within the wait: a mirrored
            // node arriving is a change of the tree.
            let mut changes = tree.subscribe();
            cluster.mirrored(MIRROR_WAIT).await;
            let nodes = loop {
                let nodes = tree.snapshot();
                let next = tokio::time::timeout_at(deadline, changes.recv());
                if every_part_rooted(&nodes)
                    || matches!(next.await, Err(_) | Ok(Err(RecvError::Closed)))
                {
                    break nodes;
                }
            };
            self.show(&nodes);
        }
        std::future::pending().await
    }
}

/// Prints the run's record on stderr: every node, how it ended, how long.
fn show_record(rt: &Runtime) {
    let (entries, more) = crate::record::of(rt, crate::record::BOUND);
    crate::errln!("the run's tree:\n{}", crate::record::render(&entries, more));
}

/// Whether every remote child's part in `nodes` shows the subtree mirrored
/// from its node.
fn every_part_rooted(nodes: &[dsh_supervisors::tree::NodeSnapshot]) -> bool {
    nodes
        .iter()
        .filter(|n| n.kind == "remote-child")
        .all(|part| nodes.iter().any(|n| n.parent == Some(part.id)))
}

async fn stage(
    agents: &AgentArgs,
    store_args: &StoreArgs,
    workspace: &WorkspaceArgs,
    cluster: &ClusterArgs,
    resume: Option<&str>,
    name: &str,
) -> exit::Result<Stage> {
    let cwd = workspace.resolve()?;
    let rt = Runtime::start(RuntimeSettings::default())
        .await
        .map_err(|e| Exit::failed(format!("cannot start the runtime: {}", chain(&e))))?;
    let staged = async {
        let (coordinator, subagents, store) =
            coordinate(&rt, agents, store_args, cwd, resume, name).await?;
        let cluster = cluster.join(&rt, &subagents).await?;
        Ok::<_, Exit>((coordinator, subagents, store, cluster))
    }
    .await;
    if staged.is_err() {
        let _ = tokio::time::timeout(Duration::from_secs(60), rt.shutdown()).await;
    }
    let (coordinator, subagents, store, cluster) = staged?;
    Ok(Stage {
        rt,
        coordinator,
        subagents,
        store,
        cluster,
    })
}

/// The services, the model, and the coordinator agent (a stored session,
/// the parent of every child; resumed from the store with `resume`).
async fn coordinate(
    rt: &Runtime,
    agents: &AgentArgs,
    store_args: &StoreArgs,
    cwd: PathBuf,
    resume: Option<&str>,
    name: &str,
) -> exit::Result<(Agent, Arc<Subagents>, Arc<dyn SessionPersistence>)> {
    let Route { provider, model } = route(rt, agents, Some(&cwd)).await?;
    // After the boot: a `--config` file's `session-store` may provide it.
    let store = store(rt, store_args)?;
    let root = rt.root();
    let tools = root
        .get::<ToolRegistry>(ToolRegistry::SERVICE)
        .ok_or_else(|| Exit::failed("no tool registry"))?;
    let subagents = match root.get::<Subagents>(Subagents::SERVICE) {
        Some(s) => s,
        None => {
            let installed = install(&root, &tools, &MultiAgentConfig::default())
                .map_err(|e| Exit::failed(chain(&e).to_string()))?;
            crate::stage::depth(rt, agents);
            installed
        }
    };
    let mut spec = AgentSpec::new(&provider, &model, cwd.clone());
    spec.name = Some(name.to_owned());
    spec.label = Some(format!("{name} coordinator"));
    spec.system = Some(crate::stage::system_prompt(&cwd, &model));
    spec.sections = crate::stage::workspace_sections(&cwd).await;
    let definitions = crate::stage::definitions(rt, &cwd).await;
    spec.sections
        .extend(dsh_services::definitions::section(&definitions));
    spec.store = Some(store.clone());
    spec.origin = Some(format!("cli/{name}"));
    if let Some(id) = resume {
        let loaded = store
            .load(id)
            .map_err(|e| Exit::from(e).context(&format!("cannot resume {id}")))?;
        store
            .prepare_resume(id, &loaded)
            .map_err(|e| Exit::failed(chain(&e).to_string()))?;
        spec.durable = Some(loaded.durable);
        spec.seed = Some(Box::new((loaded.header, loaded.events)));
    }
    let coordinator = Agent::create(&root, spec)
        .await
        .map_err(|e| Exit::failed(format!("cannot create the coordinator: {}", chain(&e))))?;
    Ok((coordinator, subagents, store))
}

async fn finish(stage: Stage) -> Option<String> {
    let flushed = stage.coordinator.session().flush().await.err();
    let _ = tokio::time::timeout(Duration::from_secs(60), stage.rt.shutdown()).await;
    flushed.map(|e| format!("the coordinator's log was not fully written: {}", chain(&e)))
}

/// `exit`, and a log that was not fully written (`unwritten`): that fails
/// an otherwise good run (exit 1), and is told beside any other failure.
fn settle(exit: Exit, unwritten: Option<String>, command: &str) -> Exit {
    match unwritten {
        Some(m) if exit.is_ok() => Exit::failed(m),
        Some(m) => {
            crate::errln!("dsh {command}: {m}");
            exit
        }
        None => exit,
    }
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

/// `dsh workflow`: the options.
#[derive(clap::Args, Debug)]
#[command(after_help = MODEL_PRECEDENCE)]
pub struct WorkflowArgs {
    /// The script file.
    #[arg(value_name = "SCRIPT")]
    pub file: PathBuf,
    /// The `args` global, as JSON.
    #[arg(long)]
    pub args: Option<String>,
    /// The meta block, as JSON (default: named after the file).
    #[arg(long)]
    pub meta: Option<String>,
    /// Children running at once; later `agent()` calls wait their turn
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=256))]
    pub max_parallel: u16,
    /// Most `agent()` calls the script may make
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=256))]
    pub max_agents: u32,
    /// Print the live actor tree once the first child is in flight, and
    /// the run's record (every node, its end and time) when it ends.
    #[arg(long)]
    pub tree: bool,
    /// Exit 0 when the script ends even if some children failed (they are
    /// still listed on stderr); without it such a run exits 4.
    #[arg(long)]
    pub allow_failures: bool,
    /// The model, policy and plugin tree.
    #[command(flatten)]
    pub agents: AgentArgs,
    /// The workspace tools work in.
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
    /// Where sessions are stored.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Which nodes run the children.
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// The live dashboard beside the run.
    #[command(flatten)]
    pub dashboard: DashboardArgs,
}

fn parse_json(what: &str, text: &str) -> exit::Result<Value> {
    serde_json::from_str(text)
        .map_err(|e| Exit::usage(format!("{what} is not valid JSON: {}", chain(&e))))
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
pub async fn workflow(opts: WorkflowArgs) -> Exit {
    let prepared = (|| {
        let script = std::fs::read_to_string(&opts.file)
            .map_err(|e| Exit::usage(format!("cannot read {}: {e}", opts.file.display())))?;
        let args = match &opts.args {
            Some(a) => parse_json("--args", a)?,
            None => Value::Null,
        };
        let meta = match &opts.meta {
            Some(m) => parse_json("--meta", m)?,
            None => json!({
                "name": kebab(&opts.file),
                "description": format!("workflow from {}", opts.file.display()),
            }),
        };
        Ok::<_, Exit>((script, args, meta))
    })();
    let (script, args, meta) = match prepared {
        Ok(p) => p,
        Err(e) => return e,
    };
    let stage = match stage(
        &opts.agents,
        &opts.store,
        &opts.workspace,
        &opts.cluster,
        None,
        "workflow",
    )
    .await
    {
        Ok(s) => s,
        Err(e) => return e,
    };
    if let Err(e) = crate::serve::dashboard(&stage.rt, &opts.dashboard).await {
        let _ = finish(stage).await;
        return e;
    }
    let exit = match run_workflow(
        &stage,
        script,
        meta,
        args,
        opts.tree,
        0,
        (Some(usize::from(opts.max_parallel)), Some(opts.max_agents)),
    )
    .await
    {
        Ok(ran) => {
            crate::outln!(
                "{}",
                serde_json::to_string_pretty(&ran.value).unwrap_or_default()
            );
            ran.exit(opts.allow_failures)
        }
        Err(e) => e,
    };
    if opts.tree {
        show_record(&stage.rt);
    }
    report_logs(&stage, "workflow");
    crate::serve::hold(&opts.dashboard).await;
    settle(exit, finish(stage).await, "workflow")
}

/// A workflow that ran to its end.
struct Ran {
    /// What the script returned.
    value: Value,
    /// Children started.
    started: u32,
    /// One line per child that did not complete.
    failures: Vec<String>,
}

impl Ran {
    /// 0, or [`exit::CHILD_FAILED`] with the failures listed; `allowed`
    /// (`--allow-failures`): 0, the failures still said on stderr.
    fn exit(&self, allowed: bool) -> Exit {
        if self.failures.is_empty() {
            return Exit::ok();
        }
        let said = if allowed {
            "allowed"
        } else {
            "--allow-failures exits 0"
        };
        let listed = format!(
            "{} of {} children failed ({said}):\n  {}",
            self.failures.len(),
            self.started,
            self.failures.join("\n  ")
        );
        if allowed {
            crate::errln!("dsh workflow: {listed}");
            return Exit::ok();
        }
        Exit::with(exit::CHILD_FAILED, Some(listed))
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
    limits: (Option<usize>, Option<u32>),
) -> exit::Result<Ran> {
    let root = stage.rt.root();
    let Some(engine) = root.get::<WorkflowEngine>(WorkflowEngine::SERVICE) else {
        return Err(Exit::failed("no workflow engine is provided"));
    };
    let board = Arc::new(Board::new(meta["name"].as_str().unwrap_or("workflow")));
    let printer = TreePrint::new(stage, board.clone());
    let shown = printer.clone();
    let show_at = if tree { tree_at.max(1) } else { tree_at };
    let said = board.clone();
    let text = |v: &Value| inert_line(v.as_str().unwrap_or_default());
    let listener = root.on(move |u: &WorkflowUpdate| {
        let name = inert_line(&u.name);
        match u.kind {
            "workflow/phase" => said.say(&format!("[{name}] phase: {}", text(&u.data["title"]))),
            "workflow/log" => said.say(&format!("[{name}] {}", text(&u.data["message"]))),
            "workflow/agent-retry" => said.say(&format!(
                "[{name}] agent #{} {}",
                u.data["seq"],
                lines::retrying(&u.data)
            )),
            "workflow/agent-start" => {
                let n = said.started(Row {
                    seq: u.data["seq"].as_u64().unwrap_or_default(),
                    label: match u.data["label"].as_str() {
                        Some(l) => inert_line(l),
                        None => "-".to_owned(),
                    },
                    node: u.data["node"].as_str().map(str::to_owned),
                    provider: u.data["provider"].as_str().map(str::to_owned),
                    session: text(&u.data["child"]),
                    ending: None,
                    since: None,
                });
                if show_at > 0 && n == show_at as usize {
                    shown.due();
                }
            }
            "workflow/agent-end" => said.ended(
                u.data["seq"].as_u64().unwrap_or_default(),
                lines::Ending::from_update(&u.data),
            ),
            _ => {}
        }
    });
    let mut request = WorkflowRequest::new(&stage.coordinator, script, meta);
    request.args = args;
    (request.max_concurrency, request.max_total_agents) = limits;
    if stage.cluster.is_some() {
        request.provider = Some("remote".into());
    }
    let cancel = request.cancel.clone();
    let run = engine
        .start(request)
        .await
        .map_err(|e| Exit::usage(chain(&e).to_string()))?;
    let mut stopped = None;
    // One result future: it takes the run's answer when first polled, so a
    // stop must go on awaiting the same one.
    let settled = run.result();
    tokio::pin!(settled);
    let result = tokio::select! {
        r = &mut settled => r,
        never = printer.printing() => match never {},
        never = ticking(&board) => match never {},
        stop = crate::exit::stop_signal() => {
            stopped = Some(stop);
            cancel.cancel();
            settled.await
        }
    };
    run.dispose().await;
    if let Ok(l) = listener {
        l.dispose().await;
    }
    board.finish();
    let failures = board.failures();
    match result.stop_reason {
        WorkflowStop::Completed => Ok(Ran {
            value: result.value,
            started: result.agents_started,
            failures,
        }),
        WorkflowStop::Cancelled => Err(match stopped {
            Some(stop) => stop.exit("the workflow was cancelled"),
            None => Exit::cancelled("the workflow was cancelled"),
        }),
        WorkflowStop::Error => Err(Exit::failed(format!(
            "the workflow failed: {}",
            result.error.unwrap_or_default()
        ))),
    }
}

/// Redraws the progress line every second; never ends (raced against the
/// run).
async fn ticking(board: &Board) -> std::convert::Infallible {
    let mut every = tokio::time::interval(Duration::from_secs(1));
    loop {
        every.tick().await;
        board.tick();
    }
}

fn report_logs(stage: &Stage, what: &str) {
    let id = stage.coordinator.id();
    crate::errln!("{what} session: {}", stage.store.locate(id));
    for child in children_of(&*stage.store, id) {
        crate::errln!("  child session: {}", stage.store.locate(&child));
    }
}

/// `dsh ralph`: the options.
#[derive(clap::Args, Debug)]
#[command(after_help = MODEL_PRECEDENCE)]
pub struct RalphArgs {
    /// The objective (omit with --resume).
    #[arg(required_unless_present = "resume")]
    pub objective: Option<String>,
    /// Round cap (1..=256).
    #[arg(long, default_value_t = 20)]
    pub max_rounds: u32,
    /// Every round's worker is this named agent definition (`dsh agents list`)
    #[arg(long, value_name = "NAME")]
    pub agent: Option<String>,
    /// Print the run's record (every node of its tree, its end and time)
    /// when it ends.
    #[arg(long)]
    pub tree: bool,
    /// Continue the loop recorded in this coordinator session.
    #[arg(long, value_name = "ID", conflicts_with = "objective")]
    pub resume: Option<String>,
    /// The model, policy and plugin tree.
    #[command(flatten)]
    pub agents: AgentArgs,
    /// The workspace tools work in.
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
    /// Where sessions are stored.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Which nodes run the children.
    #[command(flatten)]
    pub cluster: ClusterArgs,
    /// The live dashboard beside the run.
    #[command(flatten)]
    pub dashboard: DashboardArgs,
}

/// `dsh ralph "<objective>" --max-rounds N` / `dsh ralph --resume ID`.
pub async fn ralph(opts: RalphArgs) -> Exit {
    if opts.max_rounds == 0 || opts.max_rounds > ralph::MAX_ROUNDS {
        return Exit::usage(format!(
            "--max-rounds must be between 1 and {}",
            ralph::MAX_ROUNDS
        ));
    }
    let resume_id = opts.resume.as_deref();
    let stage = match stage(
        &opts.agents,
        &opts.store,
        &opts.workspace,
        &opts.cluster,
        resume_id,
        "ralph",
    )
    .await
    {
        Ok(s) => s,
        Err(e) => return e,
    };
    let resume = match resume_id {
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
                    crate::errln!(
                        "resuming Ralph loop {} after round {} of {}",
                        r.run_id,
                        r.rounds.last().map_or(0, |(n, _)| *n),
                        r.max_rounds
                    );
                    Some(r)
                }
                None => {
                    let _ = finish(stage).await;
                    return Exit::usage(format!("session {id} holds no Ralph loop"));
                }
            }
        }
    };
    let objective = opts.objective.clone().unwrap_or_default();
    if resume.is_none() && objective.trim().is_empty() {
        let _ = finish(stage).await;
        return Exit::usage("give the objective, or --resume ID");
    }
    if let Err(e) = crate::serve::dashboard(&stage.rt, &opts.dashboard).await {
        let _ = finish(stage).await;
        return e;
    }
    if let Some(name) = &opts.agent
        && let Err(e) = stage.subagents.definitions().require(name)
    {
        let _ = finish(stage).await;
        return Exit::usage(crate::lines::inert_line(&e.to_string()));
    }
    let exit = run_ralph(
        &stage,
        &objective,
        opts.max_rounds,
        resume,
        None,
        opts.agent.as_deref(),
    )
    .await;
    if opts.tree {
        show_record(&stage.rt);
    }
    report_logs(&stage, "ralph");
    crate::serve::hold(&opts.dashboard).await;
    if exit.is_ok() {
        crate::errln!(
            "resume a cut loop with: dsh ralph --resume {}",
            stage.coordinator.id()
        );
    }
    settle(exit, finish(stage).await, "ralph")
}

async fn run_ralph(
    stage: &Stage,
    objective: &str,
    max_rounds: u32,
    resume: Option<ralph::Resume>,
    tree_at_round: Option<u32>,
    agent: Option<&str>,
) -> Exit {
    let board = Arc::new(Board::new("ralph").rounds(max_rounds));
    let printer = TreePrint::new(stage, board.clone());
    let shown = printer.clone();
    let round_of = |label: &Option<String>| {
        label
            .as_deref()
            .and_then(|l| l.strip_prefix("ralph round "))
            .and_then(|n| n.parse::<u64>().ok())
    };
    let said = board.clone();
    let started = stage.rt.root().on(move |s: &SubagentStart| {
        let Some(round) = round_of(&s.info.label) else {
            return;
        };
        said.started(Row {
            seq: round,
            label: format!("round {round}"),
            node: s.info.node.clone(),
            provider: None,
            session: s.info.child.clone(),
            ending: None,
            since: Some(std::time::Instant::now()),
        });
        if tree_at_round.is_some_and(|n| u64::from(n) == round) {
            shown.due();
        }
    });
    let said = board.clone();
    let ended = stage.rt.root().on(move |e: &SubagentEnd| {
        let Some(round) = round_of(&e.info.label) else {
            return;
        };
        said.ended(
            round,
            lines::Ending {
                outcome: e.stop_reason.as_str().to_owned(),
                diagnostic: e.diagnostic.clone(),
                elapsed: None,
                steps: e.steps.map(u64::from),
                tokens: Some(e.tokens),
                cost: None,
            },
        );
    });
    let mut request = RalphRequest::new(&stage.coordinator, objective);
    if stage.cluster.is_some() {
        request.provider = "remote".into();
    }
    request.max_rounds = Some(max_rounds);
    request.agent = agent.map(str::to_owned);
    let cancel = request.cancel.clone();
    let run = ralph::run(&stage.subagents, request, resume);
    tokio::pin!(run);
    let mut stopped = None;
    let result = tokio::select! {
        r = &mut run => r,
        never = printer.printing() => match never {},
        never = ticking(&board) => match never {},
        stop = crate::exit::stop_signal() => {
            stopped = Some(stop);
            cancel.cancel();
            run.await
        }
    };
    for l in [started, ended].into_iter().flatten() {
        l.dispose().await;
    }
    board.finish();
    let result = match result {
        Ok(r) => r,
        Err(e) => return Exit::usage(chain(&e).to_string()),
    };
    for r in &result.completed {
        crate::outln!(
            "round {}: {} — {} (handoff {} bytes)",
            r.round,
            serde_json::to_value(r.handoff.status)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            inert_line(&r.handoff.summary),
            serde_json::to_vec(&r.handoff).map_or(0, |v| v.len())
        );
    }
    crate::outln!(
        "Ralph loop {}: {} ({} rounds)",
        result.run_id,
        inert_line(&result.outcome.describe()),
        result.rounds
    );
    if let Some(last) = &result.last {
        crate::outln!(
            "last handoff (the worker's report):\n{}",
            serde_json::to_string_pretty(last).unwrap_or_default()
        );
    }
    match result.outcome {
        RalphOutcome::Complete | RalphOutcome::BudgetLimited => Exit::ok(),
        RalphOutcome::Blocked => Exit::with(BLOCKED, Some("the worker reported a blocker")),
        RalphOutcome::CircuitOpen => Exit::with(BLOCKED, Some("the loop made no progress")),
        RalphOutcome::Failed { .. } => Exit::failed(inert_line(&result.outcome.describe())),
        RalphOutcome::Cancelled { .. } => match stopped {
            Some(stop) => stop.exit("cancelled"),
            None => Exit::with(CANCELLED, Some("cancelled")),
        },
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

/// `dsh demo`: the options.
#[derive(clap::Args, Debug)]
pub struct DemoArgs {
    /// The workspace tools work in.
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
    /// Where sessions are stored.
    #[command(flatten)]
    pub store: StoreArgs,
}

/// `dsh demo`: keyless, on the built-in demo model.
pub async fn demo(opts: DemoArgs) -> Exit {
    let agents = AgentArgs {
        model: ModelArgs {
            demo_model: true,
            ..ModelArgs::default()
        },
        policy: PolicyArgs {
            approval: Some(dsh_services::approval::ApprovalPolicy::Never),
            ..PolicyArgs::default()
        },
        config: ConfigArgs::default(),
        max_depth: None,
    };
    let stage = match stage(
        &agents,
        &opts.store,
        &opts.workspace,
        &ClusterArgs::default(),
        None,
        "demo",
    )
    .await
    {
        Ok(s) => s,
        Err(e) => return e,
    };
    crate::outln!(
        "dsh demo — the built-in keyless model; every agent below is a supervised actor.\n"
    );
    crate::outln!("1. A workflow script fans out to three subagents:");
    let meta = json!({"name": "demo-fan-out", "description": "three subagents in parallel"});
    let args = json!({"topics": ["actors", "supervision", "teardown"]});
    let mut code = 0;
    match run_workflow(
        &stage,
        DEMO_SCRIPT.into(),
        meta,
        args,
        true,
        3,
        (None, None),
    )
    .await
    {
        Ok(ran) => {
            crate::outln!("   workflow result ({} subagents):", ran.started);
            crate::outln!(
                "{}",
                serde_json::to_string_pretty(&ran.value).unwrap_or_default()
            );
            let failed = ran.exit(false);
            if !failed.is_ok() {
                crate::errln!("dsh demo: {}", failed.message.unwrap_or_default());
                code = failed.code;
            }
        }
        Err(e) => {
            crate::errln!("dsh demo: {}", e.message.unwrap_or_default());
            code = e.code;
        }
    }
    crate::outln!("\n2. A three-round Ralph loop (a fresh worker per round):");
    let exit = run_ralph(
        &stage,
        "Write the release notes for dsh 0.1 in NOTES.md",
        3,
        None,
        Some(2),
        None,
    )
    .await;
    if exit.code != 0 {
        crate::errln!("dsh demo: {}", exit.message.unwrap_or_default());
        code = code.max(exit.code);
    }
    crate::outln!("\nLogs:");
    let id = stage.coordinator.id().to_owned();
    crate::outln!("   coordinator: {}", stage.store.locate(&id));
    for child in children_of(&*stage.store, &id) {
        crate::outln!("   child:       {}", stage.store.locate(&child));
    }
    crate::outln!("Inspect them with `dsh sessions list` / `dsh sessions show <id>`.");
    match finish(stage).await {
        Some(m) => Exit::failed(m),
        None if code == 0 => Exit::ok(),
        None => Exit::with(code, Some("the demo did not finish cleanly")),
    }
}
