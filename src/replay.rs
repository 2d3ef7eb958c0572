//! `dsh replay <session.jsonl>`: re-run a recorded session and compare.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec, Agents};
use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::LlmRuntime;
use dsh_services::providers::replay::{Aliases, CancelPoint, Gate, Override, ReplayModel};
use dsh_services::session::compare::{TurnShape, compare, prompts, shape};
use dsh_services::session::jsonl;
use dsh_services::session::{EventData, SessionEvent, SessionHeader};
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
    let recording = Recording::load(&opts.log)?;
    let recorded = shape(&recording.events);
    let inputs = prompts(&recording.events);
    if inputs.is_empty() {
        return Err(Exit::usage(format!(
            "{}: the recording has no user prompt to replay",
            opts.log.display()
        )));
    }
    let model = with_sidecar(&opts.log, ReplayModel::from_events(&recording.events))?;
    let cwd = opts.workspace.resolve()?;
    let rt = Runtime::start(RuntimeSettings::default())
        .await
        .map_err(|e| Exit::failed(format!("cannot start the runtime: {}", chain(&e))))?;
    let outcome = drive(&rt, model, &recording, cwd, opts.out.clone(), &inputs).await;
    let _ = tokio::time::timeout(Duration::from_secs(60), rt.shutdown()).await;
    let (replayed, replayed_children, aliases) = outcome.map_err(Exit::failed)?;
    // Read back in the recording's session ids (a `send_message` names the
    // live child).
    let in_recorded_ids = |shapes: Vec<TurnShape>| -> Vec<TurnShape> {
        shapes
            .into_iter()
            .map(|mut t| {
                t.final_text = aliases.to_recorded(&t.final_text);
                for (_, args) in &mut t.calls {
                    let text = aliases.to_recorded(&args.to_string());
                    if let Ok(v) = serde_json::from_str(&text) {
                        *args = v;
                    }
                }
                t
            })
            .collect()
    };
    let children = &recording.children;
    let mut verdict =
        compare(&recorded, &in_recorded_ids(shape(&replayed))).map_err(|d| d.to_string());
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
            if let Err(d) = compare(&shape(own), &in_recorded_ids(shape(replayed))) {
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

/// A recorded session and the child sessions recorded beside it, as
/// `dsh replay` and `dsh acp --replay` serve them.
pub(crate) struct Recording {
    /// The recorded session's id (its header's).
    pub(crate) id: String,
    /// Whether every session's events carry times on one clock (dsh's
    /// own logs do; upstream's fixtures count from zero in each log).
    clocked: bool,
    /// Its events.
    pub(crate) events: Vec<SessionEvent>,
    /// Its children's recordings, in creation order.
    pub(crate) children: Vec<Child>,
}

/// One child's recording: its id, its events, and how many of them it
/// inherited from its parent (a forked child's seed).
pub(crate) struct Child {
    /// Its header's id.
    pub(crate) id: String,
    /// Its header's creation time.
    created_at: u64,
    /// The events, the seed's included.
    pub(crate) events: Vec<SessionEvent>,
    /// The inherited events at its head (its header's `seedLength`).
    pub(crate) seed: usize,
}

impl Recording {
    /// `log` and the child logs beside it (`session.1.jsonl`,
    /// `session.2.jsonl`, ... for `session.jsonl`), in child creation order.
    pub(crate) fn load(log: &std::path::Path) -> exit::Result<Recording> {
        let read =
            |path: &std::path::Path| -> exit::Result<Option<(SessionHeader, Vec<SessionEvent>)>> {
                let text = match std::fs::read_to_string(path) {
                    Ok(t) => t,
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
                    Err(e) => {
                        return Err(Exit::usage(format!("cannot read {}: {e}", path.display())));
                    }
                };
                jsonl::parse(&text)
                    .map(Some)
                    .map_err(|e| Exit::usage(format!("{}: {e}", path.display())))
            };
        let Some((header, events)) = read(log)? else {
            return Err(Exit::usage(format!(
                "cannot read {}: no such file",
                log.display()
            )));
        };
        let mut children = Vec::new();
        if let (Some(dir), Some(stem)) = (log.parent(), log.file_stem()) {
            let stem = stem.to_string_lossy();
            for n in 1.. {
                let Some((header, events)) = read(&dir.join(format!("{stem}.{n}.jsonl")))? else {
                    break;
                };
                let seed = header
                    .seed_length
                    .map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX))
                    .min(events.len());
                children.push(Child {
                    id: header.id,
                    created_at: header.created_at,
                    events,
                    seed,
                });
            }
        }
        // On the epoch clock: no turn ended or answer came before its
        // session was created.
        let on_clock = |created_at: u64, events: &[SessionEvent]| {
            created_at > 0
                && events
                    .iter()
                    .filter(|e| {
                        is_mark(&e.data) || matches!(e.data, EventData::AssistantMessage { .. })
                    })
                    .all(|e| e.time >= created_at)
        };
        let clocked = on_clock(header.created_at, &events)
            && children
                .iter()
                .all(|c| on_clock(c.created_at, &c.events[c.seed..]));
        Ok(Recording {
            id: header.id,
            clocked,
            events,
            children,
        })
    }

    /// The sessions' events: the recorded one's, then each child's.
    fn sessions(&self) -> impl Iterator<Item = (&str, &[SessionEvent])> {
        std::iter::once((self.id.as_str(), self.events.as_slice())).chain(
            self.children
                .iter()
                .map(|c| (c.id.as_str(), c.events.as_slice())),
        )
    }
}

/// Whether `e` ends a turn: what the order of sessions is kept by. Only
/// turn ends: a recording's event without a time of its own has its
/// predecessor's, and a turn's end still comes after its last answer,
/// which came after everything the turn waited on (a step's end may not:
/// it would stand before the child its tool call ran).
fn is_mark(e: &EventData) -> bool {
    matches!(e, EventData::TurnEnd { .. })
}

/// How many turns `agent` has ended, what it inherited aside.
fn own_marks(agent: &Agent) -> usize {
    let session = agent.session();
    let seed = session.header().seed_length.unwrap_or(0);
    let seed = usize::try_from(seed).unwrap_or(usize::MAX);
    session
        .events()
        .iter()
        .skip(seed)
        .filter(|e| is_mark(&e.data))
        .count()
}

/// The order a replay of several sessions keeps: a model call waits until
/// every other session has ended as many turns as it had ended when the
/// call's answer was recorded. A session's step can only depend
/// on what another had done before, so the waits never form a cycle; a wait
/// still gives up after [`Ledger::PATIENCE`] (a replay that diverged may
/// never get there), and the comparison says what differs.
pub(crate) struct Ledger {
    /// Per session (the recorded one, then its children in creation
    /// order): when its turn ends were recorded, ascending.
    recorded: Vec<Vec<u64>>,
    /// The live agents standing for them.
    live: Created,
    changed: tokio::sync::Notify,
    /// Whether the recorded times can be compared across sessions.
    clocked: bool,
}

impl Ledger {
    const PATIENCE: Duration = Duration::from_secs(10);

    fn new(recording: &Recording, live: Created) -> Ledger {
        // A forked child's own (what it inherited is its parent's).
        let own = std::iter::once(recording.events.as_slice())
            .chain(recording.children.iter().map(|c| &c.events[c.seed..]));
        let recorded = own
            .map(|events| {
                let mut marks: Vec<u64> = events
                    .iter()
                    .filter(|e| is_mark(&e.data))
                    .map(|e| e.time)
                    .collect();
                marks.sort_unstable();
                marks
            })
            .collect();
        Ledger {
            recorded,
            live,
            changed: tokio::sync::Notify::new(),
            clocked: recording.clocked,
        }
    }

    /// Whether every session but `session` has ended the turns it had
    /// ended before `time` in the recording.
    fn due(&self, session: usize, time: u64) -> bool {
        let live = self.live.lock().unwrap_or_else(|p| p.into_inner()).clone();
        self.recorded
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != session)
            .all(|(j, marks)| {
                let need = marks.partition_point(|m| *m < time);
                need == 0 || live.get(j).is_some_and(|a| own_marks(a) >= need)
            })
    }

    async fn wait(self: Arc<Self>, session: usize, time: u64) {
        let deadline = tokio::time::Instant::now() + Ledger::PATIENCE;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.due(session, time) {
                return;
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                tracing::warn!(
                    session,
                    "the other sessions did not get where the recording had them; serving the call anyway"
                );
                return;
            }
        }
    }

    /// Tells waiting calls when `agent` ends a turn.
    fn watch(self: &Arc<Self>, agent: &Agent) {
        let ledger = Arc::downgrade(self);
        agent
            .session()
            .observe(Arc::new(move |e: &Arc<SessionEvent>| {
                if let (true, Some(l)) = (is_mark(&e.data), ledger.upgrade()) {
                    l.changed.notify_waiters();
                }
            }));
        self.changed.notify_waiters();
    }

    /// `model` waiting on the gate of session `session`, when the
    /// recording's sessions share a clock (else in first-call order alone).
    fn gated(self: &Arc<Self>, model: ReplayModel, session: usize) -> ReplayModel {
        if self.clocked {
            model.with_gate(self.gate(session))
        } else {
            model
        }
    }

    /// The gate of session `session`'s model.
    fn gate(self: &Arc<Self>, session: usize) -> Gate {
        // Weak: the models outlive the replay in the runtime's registry.
        let ledger = Arc::downgrade(self);
        Arc::new(move |time| {
            let ledger = ledger.upgrade();
            Box::pin(async move {
                if let Some(ledger) = ledger {
                    ledger.wait(session, time).await;
                }
            })
        })
    }
}

/// What [`install`] set up: the recorded session's model, the agents
/// standing for the recording's sessions, and their ids against the
/// recorded ones.
pub(crate) struct Installed {
    pub(crate) model: Arc<ReplayModel>,
    pub(crate) created: Created,
    pub(crate) aliases: Aliases,
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
    model: ReplayModel,
    recording: &Recording,
) -> Result<Installed, String> {
    let created: Created = Arc::default();
    let ledger = Arc::new(Ledger::new(recording, created.clone()));
    let aliases = Aliases::default();
    let model = Arc::new(ledger.gated(model, 0).with_aliases(aliases.clone()));
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
    for (i, child) in recording.children.iter().enumerate() {
        let route = format!("replay-{}", i + 1);
        // A forked child answers from its own turns, not the parent's
        // history it inherited; each child's turns continue its own script.
        let served = ledger
            .gated(ReplayModel::from_events(&child.events[child.seed..]), i + 1)
            .with_aliases(aliases.clone());
        llm.register(root, &[route.as_str()], Arc::new(served))
            .map_err(|e| chain(&e).to_string())?;
    }
    let agents = root
        .get::<Agents>(Agents::SERVICE)
        .ok_or("no agents registry")?;
    let (seen, registry, named, watcher) = (
        created.clone(),
        agents.clone(),
        aliases.clone(),
        ledger.clone(),
    );
    let recorded_ids: Vec<String> = recording.sessions().map(|(id, _)| id.to_owned()).collect();
    root.on(move |e: &dsh_actors::agent::AgentCreated| {
        let Some(agent) = registry.get(&e.id) else {
            return;
        };
        let index = {
            let mut list = seen.lock().unwrap_or_else(|p| p.into_inner());
            // A child resumed from its log stands for the same session.
            match list.iter().position(|a| a.id() == agent.id()) {
                Some(i) => {
                    list[i] = agent.clone();
                    i
                }
                None => {
                    list.push(agent.clone());
                    list.len() - 1
                }
            }
        };
        // Ids matter only where there are several sessions.
        if let Some(recorded) = recorded_ids.get(index).filter(|_| recorded_ids.len() > 1) {
            named.add(recorded.clone(), agent.id());
        }
        watcher.watch(&agent);
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
    Ok(Installed {
        model,
        created,
        aliases,
    })
}

async fn drive(
    rt: &Runtime,
    model: ReplayModel,
    recording: &Recording,
    cwd: PathBuf,
    out: Option<PathBuf>,
    inputs: &[String],
) -> Result<(Events, Vec<Events>, Aliases), String> {
    let root = rt.root();
    let Installed {
        model,
        created,
        aliases,
    } = install(&root, model, recording).await?;
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
        until_idle(&agent, &model, &calls).await?;
        // What the turn set going (a background child, whose notices and
        // reports give the parent turns of its own) ends before the next
        // prompt, as the recording's client waited.
        settle(&agent, &model, &calls, &created).await?;
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
    Ok((agent.session().events(), children, aliases))
}

/// Waits until `agent` is idle, cancelling where the recorded client
/// cancelled (a cancel point of `model`'s; `calls`: the tool calls the agent
/// has made).
async fn until_idle(
    agent: &Agent,
    model: &ReplayModel,
    calls: &tokio::sync::watch::Receiver<usize>,
) -> Result<(), String> {
    loop {
        tokio::select! {
            point = model.cancel_point() => {
                if let CancelPoint::ToolsStarted { calls: n } = point {
                    let mut calls = calls.clone();
                    // The turn may end first (a tool that fails at once);
                    // then there is nothing left to cancel.
                    tokio::select! {
                        _ = calls.wait_for(|made| *made >= n) => {}
                        idle = agent.when_idle(Duration::from_secs(600)) => {
                            return idle.map_err(|e| chain(&e).to_string());
                        }
                    }
                }
                agent.cancel();
            }
            idle = agent.when_idle(Duration::from_secs(600)) => {
                return idle.map_err(|e| chain(&e).to_string());
            }
        }
    }
}

/// Waits until every agent of the replay is idle, and still is after a
/// look at each: a child's notice or report wakes `agent` (the recorded
/// session's), whose turn may message the child again, and may be cancelled
/// as the recording's was.
async fn settle(
    agent: &Agent,
    model: &ReplayModel,
    calls: &tokio::sync::watch::Receiver<usize>,
    created: &Created,
) -> Result<(), String> {
    let snapshot = || created.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let written = |agents: &[Agent]| -> u64 { agents.iter().map(|a| a.session().next_seq()).sum() };
    loop {
        let agents = snapshot();
        let before = written(&agents);
        for a in &agents {
            if a.id() == agent.id() {
                until_idle(agent, model, calls).await?;
            } else {
                a.when_idle(Duration::from_secs(600))
                    .await
                    .map_err(|e| chain(&e).to_string())?;
            }
        }
        let now = snapshot();
        if now.len() == agents.len() && written(&now) == before && now.iter().all(Agent::is_idle) {
            return Ok(());
        }
    }
}
