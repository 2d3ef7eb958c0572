//! `dsh run "<prompt>"`: one agent, one turn, streamed to the terminal.

use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentError, AgentSpec, TurnSummary};
use dsh_services::llm::{LlmRuntime, Price, StreamChunk};
use dsh_services::persistence::{JsonlStore, SessionPersistence};
use dsh_services::session::{EventData, TurnEndReason};
use dsh_supervisors::Runtime;
use dsh_supervisors::error::chain;

use crate::args::{AgentArgs, MODEL_PRECEDENCE, StoreArgs, WorkspaceArgs};
use crate::exit::{self, Exit};
use crate::lines::{self, inert, inert_line};
use crate::stage::{Route, route, store};

/// `dsh run`: the options.
#[derive(clap::Args, Debug)]
#[command(after_help = MODEL_PRECEDENCE)]
pub struct RunArgs {
    /// The prompt.
    pub prompt: String,
    /// Print the session events as JSON lines on stdout.
    #[arg(long)]
    pub json: bool,
    /// Print the actor tree on stderr at the end.
    #[arg(long)]
    pub tree: bool,
    /// Do not show the model's reasoning (shown dimmed on stderr otherwise),
    /// nor the closing line (session, end, steps, tool calls, tokens, time).
    #[arg(long, short)]
    pub quiet: bool,
    /// Write the session log (JSONL) to this file instead of the store.
    #[arg(long, value_name = "FILE", conflicts_with = "resume")]
    pub session: Option<PathBuf>,
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Run as the named agent definition (`dsh agents list`): its system
    /// prompt, model, tools, permission mode and effort
    #[arg(long, value_name = "NAME", conflicts_with = "system")]
    pub agent: Option<String>,
    /// Steps allowed in the turn.
    #[arg(long, default_value_t = 64)]
    pub max_steps: u32,
    /// Continue a stored session (its id, as `dsh sessions list` shows).
    #[arg(long, value_name = "ID")]
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
    /// Nodes the agent may delegate to (its `subagent_remote` tool).
    #[command(flatten)]
    pub cluster: crate::args::ClusterArgs,
    /// The live dashboard beside the run.
    #[command(flatten)]
    pub dashboard: crate::args::DashboardArgs,
}

/// Where the session is written, and what it continues: a resumed session
/// is loaded (repaired when a crash cut it) and appended to in place.
fn place_session(
    store: Arc<dyn SessionPersistence>,
    args: &RunArgs,
    spec: &mut AgentSpec,
) -> exit::Result<()> {
    let Some(given) = &args.resume else {
        spec.store = Some(match &args.session {
            Some(p) => Arc::new(JsonlStore::file(p)),
            None => store,
        });
        spec.id = Some(dsh_services::llm::Message::new_id());
        return Ok(());
    };
    // The id, or the start of one (the 8 characters the lines show).
    let id = &dsh_services::persistence::resolve(&*store, given)?;
    for note in resume(store, id, spec)? {
        crate::errln!("dsh run: {note}");
    }
    Ok(())
}

/// Points `spec` at stored session `id` to continue it: loaded, repaired
/// when a crash cut it, appended to in place. Returns what was repaired.
pub fn resume(
    store: Arc<dyn SessionPersistence>,
    id: &str,
    spec: &mut AgentSpec,
) -> exit::Result<Vec<String>> {
    let loaded = store.load(id)?;
    let mut notes = Vec::new();
    if let Some(line) = loaded.torn_line {
        notes.push(format!(
            "{}: line {line} was a torn write; it is dropped, the lines before it are kept",
            store.locate(id)
        ));
    }
    store
        .prepare_resume(id, &loaded)
        .map_err(|e| Exit::failed(chain(&e).to_string()))?;
    notes.extend(loaded.repairs.iter().map(|r| format!("resumed {id}: {r}")));
    spec.durable = Some(loaded.durable);
    spec.store = Some(store);
    spec.seed = Some(Box::new((loaded.header, loaded.events)));
    Ok(notes)
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

impl ractor::Message for Tick {}

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
        crate::err!("\r\x1b[2K{} {label}", FRAMES[*frame]);
        *shown = true;
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ractor::ActorRef<Tick>,
        (_, shown): &mut (usize, bool),
    ) -> Result<(), ractor::ActorProcessingErr> {
        if *shown {
            crate::err!("\r\x1b[2K");
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
        crate::err!("\r\x1b[2K");
    }
}

/// What a turn spent, counted from its events as they come.
#[derive(Default)]
struct Tally {
    /// Uncached input tokens.
    input: AtomicU64,
    /// Input tokens served from cache.
    cached: AtomicU64,
    output: AtomicU64,
    tool_calls: AtomicU64,
}

impl Tally {
    fn count(&self, data: &EventData) {
        match data {
            EventData::AssistantMessage { usage: Some(u), .. } => {
                self.input.fetch_add(u.input_tokens, Ordering::Relaxed);
                self.cached
                    .fetch_add(u.cache_read_tokens.unwrap_or(0), Ordering::Relaxed);
                self.output.fetch_add(u.output_tokens, Ordering::Relaxed);
            }
            EventData::ToolCall { .. } => {
                self.tool_calls.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    /// The closing line: `session 3e17803d (<full id>) completed in 4.2 s
    /// · 3 steps · 2 tool calls · 1.2k in / 310 out tokens`, and `· cost
    /// 0.0123` when the route's config gives a price.
    fn line(
        &self,
        id: &str,
        summary: Option<&TurnSummary>,
        elapsed: Duration,
        price: Option<Price>,
    ) -> String {
        let short: String = id.chars().take(8).collect();
        let how = match summary.map(|s| &s.reason) {
            Some(TurnEndReason::Completed) => "completed in",
            Some(TurnEndReason::MaxTokens) => "stopped at the output limit after",
            Some(TurnEndReason::Aborted { .. } | TurnEndReason::Interrupted) => "aborted after",
            Some(TurnEndReason::Blocked) => "blocked after",
            Some(TurnEndReason::Error { .. }) | None => "failed after",
        };
        let steps = summary.map_or(0, |s| s.steps);
        let calls = self.tool_calls.load(Ordering::Relaxed);
        let (input, cached, output) = (
            self.input.load(Ordering::Relaxed),
            self.cached.load(Ordering::Relaxed),
            self.output.load(Ordering::Relaxed),
        );
        let mut line = format!(
            "session {short} ({id}) {how} {} · {steps} step{} · {calls} tool call{} · {} in / {} out tokens",
            lines::duration(elapsed),
            if steps == 1 { "" } else { "s" },
            if calls == 1 { "" } else { "s" },
            lines::tokens(input + cached),
            lines::tokens(output),
        );
        if let Some(price) = price {
            line.push_str(&format!(
                " · cost {}",
                lines::cost(price.cost(input, cached, output))
            ));
        }
        line
    }
}

/// Prints what the agent does as it happens; model and tool text is made
/// inert first (no escape sequence reaches the terminal).
fn observe(
    agent: &Agent,
    json: bool,
    quiet: bool,
    spinner: Option<Arc<AtomicU8>>,
    tally: Arc<Tally>,
) {
    // Dimmed on a terminal; plain text when stderr is a file or a pipe.
    let dim = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let reasoning = std::sync::atomic::AtomicBool::new(false);
    agent.session().observe(Arc::new(move |e| {
        tally.count(&e.data);
        if json {
            crate::outln!("{}", e.to_line());
            return;
        }
        match &e.data {
            EventData::StepStart { .. } => phase(&spinner, THINKING),
            EventData::TurnEnd { .. } => phase(&spinner, IDLE),
            // The question goes to the terminal: no spinner over it.
            EventData::Other { kind, .. } if &**kind == "approval/asked" => phase(&spinner, IDLE),
            EventData::Other { kind, .. } if &**kind == "approval/decided" => {
                phase(&spinner, TOOLS)
            }
            EventData::Other { kind, data } if &**kind == "llm/retry" => {
                phase(&spinner, IDLE);
                crate::errln!("{}", lines::retrying(data));
                phase(&spinner, THINKING);
            }
            _ => {}
        }
        let chunk = match &e.data {
            EventData::AssistantChunk { chunk, .. } => Some(&**chunk),
            _ => None,
        };
        let in_reasoning = matches!(chunk, Some(StreamChunk::ReasoningDelta { .. }));
        let was_reasoning = if in_reasoning {
            reasoning.load(Ordering::Relaxed)
        } else {
            reasoning.swap(false, Ordering::Relaxed)
        };
        if was_reasoning && !in_reasoning {
            // The reasoning is over: its own line ends.
            crate::errln!("{}", if dim { "\x1b[0m" } else { "" });
        }
        match chunk {
            Some(StreamChunk::ReasoningDelta { text, .. }) if !quiet => {
                phase(&spinner, IDLE);
                if !reasoning.swap(true, Ordering::Relaxed) && dim {
                    crate::err!("\x1b[2m");
                }
                crate::err!("{}", inert(text));
            }
            Some(StreamChunk::TextDelta { text, .. }) => {
                phase(&spinner, IDLE);
                crate::out!("{}", inert(text));
                let _ = std::io::stdout().flush();
            }
            _ => {}
        }
        match &e.data {
            EventData::AssistantMessage { .. } => {
                let _ = std::io::stdout().flush();
            }
            EventData::ToolCall { call, .. } => {
                let (name, arguments) = (&call.name, &call.arguments);
                phase(&spinner, IDLE);
                let args: String = arguments.chars().take(160).collect();
                crate::errln!("\n▸ {} {}", inert_line(name), inert_line(&args));
                phase(&spinner, TOOLS);
            }
            EventData::ToolResult { message, error, .. } => {
                phase(&spinner, IDLE);
                let text = lines::result_text(message);
                match error {
                    Some(err) => crate::errln!(
                        "  ✗ {}: {}",
                        inert_line(&err.code),
                        inert_line(text.lines().next().unwrap_or(""))
                    ),
                    None => crate::errln!("  ✓ {} lines", text.lines().count()),
                }
            }
            _ => {}
        }
    }));
}

/// Runs the prompt; returns how the process should exit.
pub async fn run(args: RunArgs) -> Exit {
    let args = &args;
    crate::serve::in_runtime(&args.workspace, &args.dashboard, |rt, cwd| async move {
        drive(&rt, args, cwd).await
    })
    .await
}

async fn drive(rt: &Runtime, args: &RunArgs, cwd: PathBuf) -> exit::Result<()> {
    let Route { provider, model } = route(rt, &args.agents, Some(&cwd)).await?;
    let root = rt.root();
    let mut spec = AgentSpec::new(&provider, &model, cwd.clone());
    spec.system = Some(
        args.system
            .clone()
            .unwrap_or_else(|| crate::stage::system_prompt(&cwd, &model)),
    );
    spec.sections = crate::stage::workspace_sections(&cwd).await;
    spec.max_steps = args.max_steps;
    let definitions = crate::stage::definitions(rt, &cwd).await;
    spec.sections
        .extend(dsh_services::definitions::section(&definitions));
    if let Some(name) = &args.agent {
        let definition = definitions
            .require(name)
            .map_err(|e| Exit::usage(crate::lines::inert_line(&e.to_string())))?;
        dsh_actors::subagent::define_top_level(&rt.root(), &mut spec, definition);
    }
    place_session(store(rt, &args.store)?, args, &mut spec)?;
    if !args.cluster.nodes.is_empty() {
        crate::node::offer_remote(rt, &args.cluster).await?;
    }
    crate::serve::dashboard(rt, &args.dashboard).await?;
    let agent = Agent::create(&root, spec)
        .await
        .map_err(|e| Exit::failed(format!("cannot create the agent: {}", chain(&e))))?;
    let spinner = if !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
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
    let tally = Arc::new(Tally::default());
    observe(&agent, args.json, args.quiet, spinner, tally.clone());
    let began = std::time::Instant::now();
    let mut stopped = None;
    let outcome = tokio::select! {
        r = agent.run(&args.prompt, Duration::from_secs(6 * 3600)) => r,
        stop = crate::exit::stop_signal() => {
            stopped = Some(stop);
            agent.cancel();
            let _ = agent.when_idle(Duration::from_secs(30)).await;
            agent.last_turn().ok_or_else(|| AgentError::Closed(agent.id().to_owned()))
        }
    };
    if !args.json {
        crate::outln!();
    }
    let unwritten = agent
        .session()
        .flush()
        .await
        .err()
        .map(|e| format!("the session log was not fully written: {}", chain(&e)));
    if args.tree {
        let (entries, more) = crate::record::of(rt, crate::record::BOUND);
        crate::err!("{}", crate::record::render(&entries, more));
    }
    if !args.quiet {
        let summary = outcome.as_ref().ok();
        let price = rt
            .root()
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .and_then(|llm| llm.defaults(&provider, &model).price);
        crate::errln!(
            "{}",
            tally.line(agent.id(), summary, began.elapsed(), price)
        );
    }
    // A turn that went well but is not all on disk is not done: exit 1.
    match (ended(outcome, stopped), unwritten) {
        (Ok(()), Some(unwritten)) => Err(Exit::failed(unwritten)),
        (ended, Some(unwritten)) => {
            crate::errln!("dsh run: {unwritten}");
            ended
        }
        (ended, None) => ended,
    }
}

/// How the turn ended, as the process's exit.
fn ended(
    outcome: Result<dsh_actors::agent::TurnSummary, AgentError>,
    stopped: Option<crate::exit::Stop>,
) -> exit::Result<()> {
    let summary = outcome.map_err(|e| Exit::failed(chain(&e).to_string()))?;
    match summary.reason {
        TurnEndReason::Completed => Ok(()),
        // As upstream: an answer cut at the output-token limit is not done.
        TurnEndReason::MaxTokens => Err(Exit::failed(
            "the answer was cut off at the model's output-token limit (the turn ended max-tokens)",
        )),
        TurnEndReason::Aborted { .. } => Err(match stopped {
            Some(stop) => stop.exit("cancelled"),
            None => Exit::cancelled("cancelled"),
        }),
        TurnEndReason::Error { error } => Err(Exit::failed(format!(
            "the model call failed: {} ({}{})",
            error.message,
            error.code,
            error
                .status
                .map(|s| format!(", HTTP {s}"))
                .unwrap_or_default()
        ))),
        TurnEndReason::Blocked => Err(Exit::failed(format!(
            "the turn was blocked before its step ran: {}",
            summary.text
        ))),
        other => Err(Exit::failed(format!("the turn ended {other:?}"))),
    }
}
