//! `dsh replay <session.jsonl>`: re-run a recorded session and compare.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec, Agents};
use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::LlmRuntime;
use dsh_services::providers::replay::{CancelPoint, Override, ReplayModel};
use dsh_services::session::compare::{compare, prompts, shape};
use dsh_services::session::jsonl;
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::error::chain;
use dsh_supervisors::{Runtime, RuntimeSettings};

use crate::args::WorkspaceArgs;
use crate::exit::{self, Exit};

/// `dsh replay`: the options.
#[derive(clap::Args, Debug)]
pub struct ReplayArgs {
    /// The recorded `session.jsonl`.
    pub log: PathBuf,
    /// Write the new session log here.
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// Print the verdict as JSON.
    #[arg(long)]
    pub json: bool,
    /// The workspace tools work in.
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
}

/// Replays `args.log`; exit 0 when the runs agree, 1 with the first
/// divergence, 2 when the recording cannot be read.
pub async fn replay(args: ReplayArgs) -> Exit {
    Exit::from(replay_in(args).await)
}

/// `model` with the `replay.override.json` beside `log` applied, if there
/// is one (see [`Override::parse`]); a sidecar that does not parse or
/// apply is refused, naming the file.
pub(crate) fn with_sidecar(log: &std::path::Path, model: ReplayModel) -> exit::Result<ReplayModel> {
    let sidecar = log.with_file_name("replay.override.json");
    let text = match std::fs::read_to_string(&sidecar) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(model),
        Err(e) => {
            return Err(Exit::usage(format!(
                "cannot read {}: {e}",
                sidecar.display()
            )));
        }
    };
    Override::parse(&text)
        .and_then(|o| model.with_override(o))
        .map_err(|e| Exit::usage(format!("{}: {e}", sidecar.display())))
}

async fn replay_in(opts: ReplayArgs) -> exit::Result<()> {
    let text = std::fs::read_to_string(&opts.log)
        .map_err(|e| Exit::usage(format!("cannot read {}: {e}", opts.log.display())))?;
    let (_header, events) =
        jsonl::parse(&text).map_err(|e| Exit::usage(format!("{}: {e}", opts.log.display())))?;
    let recorded = shape(&events);
    let inputs = prompts(&events);
    if inputs.is_empty() {
        return Err(Exit::usage(format!(
            "{}: the recording has no user prompt to replay",
            opts.log.display()
        )));
    }
    let model = Arc::new(with_sidecar(&opts.log, ReplayModel::from_events(&events))?);
    let children = child_recordings(&opts.log)?;
    let cwd = opts.workspace.resolve()?;
    let rt = Runtime::start(RuntimeSettings::default())
        .await
        .map_err(|e| Exit::failed(format!("cannot start the runtime: {}", chain(&e))))?;
    let outcome = drive(&rt, model, &children, cwd, opts.out.clone(), &inputs).await;
    let _ = tokio::time::timeout(Duration::from_secs(60), rt.shutdown()).await;
    let (replayed, replayed_children) = outcome.map_err(Exit::failed)?;
    let mut verdict = compare(&recorded, &shape(&replayed)).map_err(|d| d.to_string());
    if verdict.is_ok() {
        if replayed_children.len() != children.len() {
            verdict = Err(format!(
                "the recording has {} child sessions; the replay started {}",
                children.len(),
                replayed_children.len()
            ));
        }
        for (i, (recorded, replayed)) in children.iter().zip(&replayed_children).enumerate() {
            // A forked child's own turns (what it inherited is its parent's).
            let own = &recorded.events[recorded.seed..];
            if let Err(d) = compare(&shape(own), &shape(replayed)) {
                verdict = Err(format!("child session {}: {d}", i + 1));
                break;
            }
        }
    }
    if opts.json {
        let v = match &verdict {
            Ok(turns) => serde_json::json!({"agree": true, "turns": turns}),
            Err(d) => serde_json::json!({"agree": false, "divergence": d}),
        };
        crate::outln!("{v}");
    }
    let turns = verdict.map_err(|d| Exit::failed(format!("first divergence: {d}")))?;
    if !opts.json {
        crate::outln!(
            "replay agrees with the recording: {turns} turns, {} model steps",
            model_steps(&recorded)
        );
    }
    Ok(())
}

fn model_steps(shapes: &[dsh_services::session::compare::TurnShape]) -> u32 {
    shapes.iter().map(|t| t.steps).sum()
}

type Events = Vec<Arc<dsh_services::session::SessionEvent>>;

/// The child logs recorded beside `log` (`session.1.jsonl`, `session.2.jsonl`,
/// ... for `session.jsonl`), in child creation order.
/// One child's recording: its events, and how many of them it inherited
/// from its parent (a forked child's seed).
pub(crate) struct Child {
    /// The events, the seed's included.
    pub(crate) events: Vec<dsh_services::session::SessionEvent>,
    /// The inherited events at its head (its header's `seedLength`).
    pub(crate) seed: usize,
}

pub(crate) fn child_recordings(log: &std::path::Path) -> exit::Result<Vec<Child>> {
    let (Some(dir), Some(stem)) = (log.parent(), log.file_stem()) else {
        return Ok(Vec::new());
    };
    let stem = stem.to_string_lossy();
    let mut out = Vec::new();
    for n in 1.. {
        let path = dir.join(format!("{stem}.{n}.jsonl"));
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
            Err(e) => return Err(Exit::usage(format!("cannot read {}: {e}", path.display()))),
        };
        let (header, events) =
            jsonl::parse(&text).map_err(|e| Exit::usage(format!("{}: {e}", path.display())))?;
        let seed = header
            .seed_length
            .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX))
            .min(events.len());
        out.push(Child { events, seed });
    }
    Ok(out)
}

/// The agents a replay created, in creation order (the first is the
/// recorded session's; the others its children).
pub(crate) type Created = Arc<std::sync::Mutex<Vec<Agent>>>;

/// Provides what a replay runs on under `root`: the recorded tools (the
/// built-ins and the multi-agent ones), no approval, and the models — the
/// route `replay` serving `model`, and `replay-<n>` serving the n-th child
/// recording to the n-th agent created after the first.
pub(crate) async fn install(
    root: &dsh_supervisors::Context,
    model: Arc<ReplayModel>,
    children: &[Child],
) -> Result<Created, String> {
    let llm = Arc::new(LlmRuntime::new());
    let tools = Arc::new(ToolRegistry::new());
    root.provide(LlmRuntime::SERVICE, llm.clone())
        .map_err(|e| chain(&e).to_string())?;
    root.provide(ToolRegistry::SERVICE, tools.clone())
        .map_err(|e| chain(&e).to_string())?;
    root.provide(
        Approval::SERVICE,
        Arc::new(Approval::new(ApprovalPolicy::Never)),
    )
    .map_err(|e| chain(&e).to_string())?;
    let agents = Agents::start(root, Default::default())
        .await
        .map_err(|e| chain(&e).to_string())?;
    root.provide(Agents::SERVICE, agents)
        .map_err(|e| chain(&e).to_string())?;
    root.provide(
        dsh_services::jobs::Jobs::SERVICE,
        Arc::new(dsh_services::jobs::Jobs::new(Default::default())),
    )
    .map_err(|e| chain(&e).to_string())?;
    // As live runs have them: a large tool result is spilled to a file,
    // an image a prompt carries is kept.
    root.provide(
        dsh_services::tools::SpillStore::SERVICE,
        Arc::new(dsh_services::tools::SpillStore::new(
            crate::home::dir().join("spill"),
            dsh_services::tools::SpillStore::DEFAULT_MAX_INLINE,
        )),
    )
    .map_err(|e| chain(&e).to_string())?;
    root.provide(
        dsh_services::attachments::Attachments::SERVICE,
        Arc::new(dsh_services::attachments::Attachments::new(
            crate::home::dir().join("attachments"),
        )),
    )
    .map_err(|e| chain(&e).to_string())?;
    dsh_services::tools::builtin::install(root, &tools, Default::default())
        .map_err(|e| chain(&e).to_string())?;
    llm.register(root, &["replay"], model.clone())
        .map_err(|e| chain(&e).to_string())?;
    // A transient failure a sidecar puts in is retried as a live run
    // retries it (its retry is the sidecar's next entry), without the
    // live backoff's wait.
    dsh_services::providers::openai::RetryListener {
        initial: Duration::from_millis(1),
        max: Duration::from_millis(1),
        ..Default::default()
    }
    .install(root)
    .map_err(|e| chain(&e).to_string())?;
    // Children: the recorded tool names, each child served its own recorded
    // model output (`replay-<n>`, in creation order).
    dsh_actors::multi_agent::install(
        root,
        &tools,
        &dsh_actors::multi_agent::MultiAgentConfig::default(),
    )
    .map_err(|e| chain(&e).to_string())?;
    for (i, child) in children.iter().enumerate() {
        let route = format!("replay-{}", i + 1);
        // A forked child answers from its own turns, not the parent's
        // history it inherited.
        llm.register(
            root,
            &[route.as_str()],
            Arc::new(ReplayModel::from_events(&child.events[child.seed..])),
        )
        .map_err(|e| chain(&e).to_string())?;
    }
    let agents = root
        .get::<Agents>(Agents::SERVICE)
        .ok_or("no agents registry")?;
    let created: Arc<std::sync::Mutex<Vec<Agent>>> = Arc::default();
    let seen = created.clone();
    let registry = agents.clone();
    root.on(move |e: &dsh_actors::agent::AgentCreated| {
        if let (Some(a), Ok(mut list)) = (registry.get(&e.id), seen.lock()) {
            list.push(a);
        }
    })
    .map_err(|e| chain(&e).to_string())?;
    let order = created.clone();
    root.on_waterfall(move |mut r: dsh_actors::agent::AgentRequest, next| {
        let index = order
            .lock()
            .ok()
            .and_then(|l| l.iter().position(|a| a.id() == r.agent));
        if let Some(i) = index.filter(|i| *i > 0) {
            r.request.provider = format!("replay-{i}");
        }
        async move { next.run(r).await }
    })
    .map_err(|e| chain(&e).to_string())?;
    Ok(created)
}

async fn drive(
    rt: &Runtime,
    model: Arc<ReplayModel>,
    children: &[Child],
    cwd: PathBuf,
    out: Option<PathBuf>,
    inputs: &[String],
) -> Result<(Events, Vec<Events>), String> {
    let root = rt.root();
    let created = install(&root, model.clone(), children).await?;
    let mut spec = AgentSpec::new("replay", "recorded", cwd);
    spec.store = out.map(|p| {
        Arc::new(dsh_services::persistence::JsonlStore::file(p))
            as Arc<dyn dsh_services::persistence::SessionPersistence>
    });
    let agent = Agent::create(&root, spec)
        .await
        .map_err(|e| chain(&e).to_string())?;
    // Tool calls the agent has made, for a cancel due while they run.
    let (calls_tx, calls) = tokio::sync::watch::channel(0usize);
    let watcher = agent.session().observe(Arc::new(move |e| {
        if matches!(e.data, dsh_services::session::EventData::ToolCall { .. }) {
            calls_tx.send_modify(|n| *n += 1);
        }
    }));
    for prompt in inputs {
        agent
            .followup(dsh_services::llm::Message::user_text(prompt.clone()))
            .map_err(|e| chain(&e).to_string())?;
        // The recorded client's cancels, where the recording has them.
        loop {
            tokio::select! {
                point = model.cancel_point() => {
                    if let CancelPoint::ToolsStarted { calls: n } = point {
                        let mut calls = calls.clone();
                        // The turn may end first (a tool that fails at
                        // once); then there is nothing left to cancel.
                        tokio::select! {
                            _ = calls.wait_for(|made| *made >= n) => {}
                            idle = agent.when_idle(Duration::from_secs(600)) => {
                                idle.map_err(|e| chain(&e).to_string())?;
                                break;
                            }
                        }
                    }
                    agent.cancel();
                }
                idle = agent.when_idle(Duration::from_secs(600)) => {
                    idle.map_err(|e| chain(&e).to_string())?;
                    break;
                }
            }
        }
    }
    agent.session().unobserve(watcher);
    agent
        .session()
        .flush()
        .await
        .map_err(|e| chain(&e).to_string())?;
    let children: Vec<Events> = created
        .lock()
        .map(|l| l.iter().skip(1).map(|a| a.session().events()).collect())
        .unwrap_or_default();
    Ok((agent.session().events(), children))
}
