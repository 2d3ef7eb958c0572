//! The workflow engine: one supervised run per model-written script.
//!
//! A run is a scope under its parent agent's scope holding one host actor;
//! every child the script starts with `agent()` goes through the subagent
//! seam into that scope, so disposing the run (or the parent) tears the
//! children down in reverse start order.
//!
//! The script runs in QuickJS on a thread of its own (QuickJS values never
//! leave it). The script body is wrapped in an async function, so top-level
//! `await` and a final `return <json>` work. Globals: `args` (the request's
//! JSON input), `agent(prompt, opts?)` → a promise of the child's final text
//! (or its structured value when `opts.schema` is given; `null` when the
//! child did not complete), `phase(title)`, `log(message)`. The JS thread
//! and the host actor talk over channels; the host owns every child.
//!
//! Result arbitration and cleanup are separate: the first terminal outcome
//! (the script's return value, a script error or a fatal hook error, the
//! time limit, cancellation) settles the result once; afterwards the JS
//! thread is stopped (interrupt handler) and the children are cancelled and
//! disposed, whatever the outcome was.

mod js;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_supervisors::error::chain;
use dsh_supervisors::{Emit, Event, NoMessages, Scope, ScopeKey, WorkerSpec};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use dsh_services::session::{EventData, SessionEvent};

use crate::agent::Agent;
use crate::session::short;
use crate::subagent::{StartRequest, StopReason, Subagents};

pub mod tool;

/// The identity block of a workflow, validated before the script runs.
#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct WorkflowMeta {
    /// Short kebab-case name.
    pub name: String,
    /// One-line description.
    pub description: String,
    /// When the workflow applies.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when_to_use: Option<String>,
    /// Phase titles `phase()` calls refer to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phases: Option<Vec<WorkflowPhase>>,
}

/// One declared phase.
#[derive(Clone, Debug, Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct WorkflowPhase {
    /// The title `phase()` is called with.
    pub title: String,
    /// What happens in it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl WorkflowMeta {
    /// Validates `value` as a meta block, naming the offending field.
    pub fn parse(value: &Value) -> Result<WorkflowMeta, WorkflowError> {
        let meta: WorkflowMeta = serde_path_to_error::deserialize(value)
            .map_err(|e| WorkflowError::MetaInvalid(format!("at `{}`: {}", e.path(), e.inner())))?;
        let kebab = !meta.name.is_empty()
            && meta
                .name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !meta.name.starts_with('-')
            && !meta.name.ends_with('-');
        if !kebab {
            return Err(WorkflowError::MetaInvalid(format!(
                "at `name`: `{}` is not a kebab-case name (lowercase letters, digits, dashes)",
                meta.name
            )));
        }
        if meta.description.trim().is_empty() {
            return Err(WorkflowError::MetaInvalid(
                "at `description`: must not be empty".into(),
            ));
        }
        Ok(meta)
    }
}

/// Why a run could not start. Fatal for the request as it is: the meta
/// block, the limits or the provider must change (nothing was started).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum WorkflowError {
    /// The meta block is malformed.
    #[error("META_INVALID: {0}")]
    MetaInvalid(String),
    /// A per-run limit is out of range or the provider is unknown.
    #[error("INVALID_REQUEST: {0}")]
    InvalidRequest(String),
    /// The run could not be set up.
    #[error("START_FAILED: {0}")]
    Start(String),
}

/// Why a run settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkflowStop {
    /// The script returned.
    Completed,
    /// The run was cancelled.
    Cancelled,
    /// The script failed, a hook was misused, or a limit was hit.
    Error,
}

/// The outcome of a run.
#[derive(Clone, Debug, PartialEq)]
pub struct WorkflowResult {
    /// The script's return value (`null` for none); meaningful when completed.
    pub value: Value,
    /// Why it settled.
    pub stop_reason: WorkflowStop,
    /// The failure, when not completed.
    pub error: Option<String>,
    /// `agent()` calls the run accepted.
    pub agents_started: u32,
}

/// Engine-wide limits (a request may lower `max_total_agents`).
#[derive(Clone, Debug)]
pub struct WorkflowLimits {
    /// Ceiling on `agent()` calls per run.
    pub max_total_agents: u32,
    /// QuickJS heap limit, bytes.
    pub memory_bytes: usize,
    /// Wall-clock budget of a run.
    pub time: Duration,
    /// Children running at once; later `agent()` calls wait their turn.
    pub max_concurrency: usize,
}

impl Default for WorkflowLimits {
    fn default() -> Self {
        WorkflowLimits {
            max_total_agents: 256,
            memory_bytes: 64 << 20,
            time: Duration::from_secs(30 * 60),
            max_concurrency: 16,
        }
    }
}

/// What a caller asks for.
#[derive(Clone)]
pub struct WorkflowRequest {
    /// The script body.
    pub script: String,
    /// The meta block (JSON data).
    pub meta: Value,
    /// The `args` global.
    pub args: Value,
    /// The agent every child is attributed to.
    pub parent: Agent,
    /// Cancels the run.
    pub cancel: CancellationToken,
    /// Subagent provider of every child (the engine's default when `None`).
    pub provider: Option<String>,
    /// Lowers the engine's `max_total_agents` for this run.
    pub max_total_agents: Option<u32>,
    /// Children running at once for this run (the engine's when `None`).
    pub max_concurrency: Option<usize>,
    /// Model route and id of the children (the parent's when `None`).
    pub route: Option<(String, String)>,
    /// A time limit lower than the engine's.
    pub time: Option<Duration>,
}

impl WorkflowRequest {
    /// A request with defaults.
    pub fn new(parent: &Agent, script: impl Into<String>, meta: Value) -> WorkflowRequest {
        WorkflowRequest {
            script: script.into(),
            meta,
            args: Value::Null,
            parent: parent.clone(),
            cancel: CancellationToken::new(),
            provider: None,
            max_total_agents: None,
            max_concurrency: None,
            route: None,
            time: None,
        }
    }
}

/// Progress of a run (mode: emit): `workflow/start`, `workflow/phase`,
/// `workflow/log`, `workflow/agent-start`, `workflow/agent-end` and
/// `workflow/end`, carried as `kind` with a JSON snapshot.
#[derive(Clone, Debug)]
pub struct WorkflowUpdate {
    /// Run id.
    pub run: String,
    /// The workflow's name.
    pub name: String,
    /// What happened.
    pub kind: &'static str,
    /// Its data.
    pub data: Value,
}
impl Event for WorkflowUpdate {
    const NAME: &'static str = "workflow/update";
}
impl Emit for WorkflowUpdate {}

/// The `workflow-engine` service.
pub struct WorkflowEngine {
    subagents: Arc<Subagents>,
    limits: WorkflowLimits,
    provider: String,
}

impl WorkflowEngine {
    /// The capability name.
    pub const SERVICE: &'static str = "workflow-engine";

    /// An engine starting children on `provider` within `limits`.
    pub fn new(subagents: Arc<Subagents>, provider: &str, limits: WorkflowLimits) -> Self {
        WorkflowEngine {
            subagents,
            limits,
            provider: provider.into(),
        }
    }

    /// Validates the request and starts the run; the script begins at once.
    pub async fn start(&self, request: WorkflowRequest) -> Result<WorkflowRun, WorkflowError> {
        let meta = WorkflowMeta::parse(&request.meta)?;
        let provider = request.provider.clone().unwrap_or(self.provider.clone());
        if self.subagents.provider(&provider).is_none() {
            return Err(WorkflowError::InvalidRequest(format!(
                "no subagent provider named `{provider}`"
            )));
        }
        let max_agents = match request.max_total_agents {
            Some(n) if n > self.limits.max_total_agents => {
                return Err(WorkflowError::InvalidRequest(format!(
                    "maxTotalAgents {n} is above the engine's ceiling of {}",
                    self.limits.max_total_agents
                )));
            }
            Some(n) => n,
            None => self.limits.max_total_agents,
        };
        let time = request
            .time
            .map_or(self.limits.time, |t| t.min(self.limits.time));
        let id = dsh_services::llm::Message::new_id();
        let scope = request
            .parent
            .awake_context()
            .await
            .map_err(|e| WorkflowError::Start(chain(&e).to_string()))?
            .scope(ScopeKey::new(format!("workflow/{}", meta.name)))
            .await
            .map_err(|e| WorkflowError::Start(chain(&e).to_string()))?;
        let cancel = request.cancel.child_token();
        let (tx, rx) = oneshot::channel();
        let host = Host {
            id: id.clone(),
            meta: meta.clone(),
            script: request.script.clone(),
            args: request.args.clone(),
            parent: request.parent.clone(),
            scope_ctx: scope.ctx().clone(),
            subagents: self.subagents.clone(),
            provider,
            route: request.route.clone(),
            max_agents,
            memory: self.limits.memory_bytes,
            time,
            concurrency: request
                .max_concurrency
                .unwrap_or(self.limits.max_concurrency)
                .max(1),
            cancel: cancel.clone(),
            reply: Some(tx),
        };
        let spawned = scope
            .ctx()
            .spawn(WorkerSpec::new(
                "workflow",
                format!("workflow/{}#{}", meta.name, short(&id)),
                HostActor,
                host,
            ))
            .await;
        if let Err(e) = spawned {
            scope.dispose().await;
            return Err(WorkflowError::Start(chain(&e).to_string()));
        }
        Ok(WorkflowRun {
            id,
            meta,
            scope,
            cancel,
            result: Mutex::new(Some(rx)),
            settled: tokio::sync::OnceCell::new(),
        })
    }
}

/// A live run. Await [`result`](WorkflowRun::result) (it never fails), then
/// always [`dispose`](WorkflowRun::dispose).
pub struct WorkflowRun {
    id: String,
    meta: WorkflowMeta,
    scope: Scope,
    cancel: CancellationToken,
    result: Mutex<Option<oneshot::Receiver<WorkflowResult>>>,
    settled: tokio::sync::OnceCell<WorkflowResult>,
}

impl WorkflowRun {
    /// Run id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The validated meta block.
    pub fn meta(&self) -> &WorkflowMeta {
        &self.meta
    }

    /// The kernel id of the run's scope.
    pub fn node_id(&self) -> u64 {
        self.scope.fiber().id()
    }

    /// The outcome, once settled.
    pub async fn result(&self) -> WorkflowResult {
        self.settled
            .get_or_init(|| async {
                let rx = self.result.lock().ok().and_then(|mut r| r.take());
                match rx {
                    Some(rx) => rx.await.unwrap_or_else(|_| WorkflowResult {
                        value: Value::Null,
                        stop_reason: WorkflowStop::Cancelled,
                        error: Some("the run was stopped before it settled".into()),
                        agents_started: 0,
                    }),
                    None => WorkflowResult {
                        value: Value::Null,
                        stop_reason: WorkflowStop::Error,
                        error: Some("the result was already taken".into()),
                        agents_started: 0,
                    },
                }
            })
            .await
            .clone()
    }

    /// Cancels the run and its children.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Cancels what still runs, then tears the run's subtree down.
    pub async fn dispose(&self) {
        self.cancel.cancel();
        self.scope.dispose().await;
    }
}

struct Host {
    id: String,
    meta: WorkflowMeta,
    script: String,
    args: Value,
    parent: Agent,
    scope_ctx: dsh_supervisors::Context,
    subagents: Arc<Subagents>,
    provider: String,
    route: Option<(String, String)>,
    max_agents: u32,
    memory: usize,
    time: Duration,
    concurrency: usize,
    cancel: CancellationToken,
    reply: Option<oneshot::Sender<WorkflowResult>>,
}

struct HostActor;

impl Actor for HostActor {
    type Msg = NoMessages;
    type State = Host;
    type Arguments = Host;

    async fn pre_start(
        &self,
        _me: ActorRef<NoMessages>,
        host: Host,
    ) -> Result<Host, ActorProcessingErr> {
        Ok(host)
    }

    async fn post_start(
        &self,
        me: ActorRef<NoMessages>,
        host: &mut Host,
    ) -> Result<(), ActorProcessingErr> {
        let result = drive(host).await;
        update(
            host,
            "workflow/end",
            json!({
                "stopReason": result.stop_reason,
                "error": result.error,
                "agentsStarted": result.agents_started,
            }),
        );
        if let Some(reply) = host.reply.take() {
            let _ = reply.send(result);
        }
        me.stop(None);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<NoMessages>,
        host: &mut Host,
    ) -> Result<(), ActorProcessingErr> {
        host.cancel.cancel();
        Ok(())
    }
}

fn update(host: &Host, kind: &'static str, data: Value) {
    host.parent.reach().emit(&WorkflowUpdate {
        run: host.id.clone(),
        name: host.meta.name.clone(),
        kind,
        data,
    });
}

/// Options of one `agent()` call, as the script gave them.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct AgentOptions {
    pub label: Option<String>,
    pub phase: Option<String>,
    pub schema: Option<Value>,
    /// A named agent definition the child is made from.
    pub agent: Option<String>,
}

/// Runs the script to its first terminal outcome, then cleans up.
async fn drive(host: &mut Host) -> WorkflowResult {
    update(host, "workflow/start", json!({"meta": host.meta}));
    let (to_host, mut from_js) = mpsc::unbounded_channel();
    let js = js::spawn(js::Setup {
        script: host.script.clone(),
        args: host.args.clone(),
        max_agents: host.max_agents,
        memory: host.memory,
        time: host.time,
        to_host,
    });
    let js = match js {
        Ok(j) => j,
        Err(e) => {
            return WorkflowResult {
                value: Value::Null,
                stop_reason: WorkflowStop::Error,
                error: Some(format!("the script engine could not start: {}", chain(&e))),
                agents_started: 0,
            };
        }
    };
    let mut children = FuturesUnordered::new();
    // `agent()` calls beyond the concurrency limit wait here, in call order.
    let mut queued = std::collections::VecDeque::new();
    let mut started = 0u32;
    let deadline = tokio::time::sleep(host.time + Duration::from_secs(1));
    tokio::pin!(deadline);
    let outcome = loop {
        tokio::select! {
            () = host.cancel.cancelled() => break Err((WorkflowStop::Cancelled, "the workflow was cancelled".to_owned())),
            () = &mut deadline => break Err((WorkflowStop::Error, format!("TIME_LIMIT: the workflow ran past its {:?} limit", host.time))),
            Some((seq, answer)) = children.next(), if !children.is_empty() => {
                js.answer(seq, answer);
                if let Some((seq, prompt, options)) = queued.pop_front() {
                    children.push(child(host, seq, prompt, options));
                }
            }
            msg = from_js.recv() => match msg {
                None => break Err((WorkflowStop::Error, "the script engine stopped unexpectedly".to_owned())),
                Some(js::ToHost::Phase(title)) => update(host, "workflow/phase", json!({"title": title})),
                Some(js::ToHost::Log(message)) => update(host, "workflow/log", json!({"message": message})),
                Some(js::ToHost::Agent { seq, prompt, options }) => {
                    started += 1;
                    if children.len() < host.concurrency {
                        children.push(child(host, seq, prompt, options));
                    } else {
                        queued.push_back((seq, prompt, options));
                    }
                }
                Some(js::ToHost::Done(Ok(value))) => break Ok(value),
                Some(js::ToHost::Done(Err(error))) => break Err((WorkflowStop::Error, error)),
            }
        }
    };
    // Cleanup, whatever settled the result: stop the script, cancel the
    // children still running (their runs settle aborted), and let them end.
    js.stop();
    host.cancel.cancel();
    queued.clear();
    while let Some((seq, answer)) = children.next().await {
        js.answer(seq, answer);
    }
    js.join().await;
    match outcome {
        Ok(value) => WorkflowResult {
            value,
            stop_reason: WorkflowStop::Completed,
            error: None,
            agents_started: started,
        },
        Err((stop_reason, error)) => WorkflowResult {
            value: Value::Null,
            stop_reason,
            error: Some(error),
            agents_started: started,
        },
    }
}

/// What `agent`'s turns cost, in millionths of its route's currency, when
/// the route's config gives a price.
fn cost_of(agent: &Agent) -> Option<u64> {
    let ctx = agent.context().ok()?;
    let llm = ctx.get::<dsh_services::llm::LlmRuntime>(dsh_services::llm::LlmRuntime::SERVICE)?;
    let spec = agent.spec();
    let price = llm.defaults(&spec.provider, &spec.model).price?;
    let (mut input, mut cached, mut output) = (0, 0, 0);
    for e in agent.session().events() {
        if let EventData::AssistantMessage { usage: Some(u), .. } = &e.data {
            input += u.input_tokens;
            cached += u.cache_read_tokens.unwrap_or(0);
            output += u.output_tokens;
        }
    }
    Some(price.cost(input, cached, output))
}

/// One `agent()` call: a child through the seam, owned by the run's scope.
fn child(
    host: &Host,
    seq: u64,
    prompt: String,
    options: AgentOptions,
) -> futures::future::BoxFuture<'static, (u64, js::Answer)> {
    let mut request = StartRequest::new(&host.parent, prompt, host.cancel.child_token());
    request.owner = Some(host.scope_ctx.clone());
    request.label = options.label.clone();
    request.group = options.phase.clone();
    request.output_schema = options.schema.clone();
    request.route = host.route.clone();
    let subagents = host.subagents.clone();
    let provider = host.provider.clone();
    let parent = host.parent.clone();
    let (run_id, name) = (host.id.clone(), host.meta.name.clone());
    // A child's retries are told to observers as they happen (its own log
    // records them; the parent's does not).
    let told = {
        let (parent, run_id, name) = (parent.clone(), run_id.clone(), name.clone());
        move |data: Value| {
            parent.reach().emit(&WorkflowUpdate {
                run: run_id.clone(),
                name: name.clone(),
                kind: "workflow/agent-retry",
                data,
            })
        }
    };
    // Observers get the update; the parent's log gets the member record
    // (`tool-workflow/agent-start|end`), so each child is found again from
    // its parent after a restart.
    let emit = move |kind: &'static str, data: Value| {
        let record_kind = match kind {
            "workflow/agent-start" => "tool-workflow/agent-start",
            _ => "tool-workflow/agent-end",
        };
        let mut recorded = data.clone();
        recorded["runId"] = Value::String(run_id.clone());
        parent.record(record_kind, recorded);
        parent.reach().emit(&WorkflowUpdate {
            run: run_id.clone(),
            name: name.clone(),
            kind,
            data,
        })
    };
    let defined = match &options.agent {
        Some(name) => subagents.define(&mut request, name),
        None => Ok(()),
    };
    Box::pin(async move {
        if let Err(e) = defined {
            return (
                seq,
                js::Answer::Fatal(format!("AGENT_START: {}", chain(&e))),
            );
        }
        let run = match subagents.start(&provider, request).await {
            Ok(run) => run,
            Err(e) => {
                return (
                    seq,
                    js::Answer::Fatal(format!("AGENT_START: {}", chain(&e))),
                );
            }
        };
        let mut start = json!({"seq": seq, "label": run.info().label, "phase": options.phase,
            "child": run.id()});
        if let Some(agent) = &options.agent {
            start["agent"] = Value::String(agent.clone());
        }
        if let Some(node) = &run.info().node {
            start["node"] = Value::String(node.clone());
        }
        // A provider other than the usual ones (an ACP agent, say) is said.
        if !matches!(run.info().provider.as_str(), "spawn" | "remote") {
            start["provider"] = Value::String(run.info().provider.clone());
        }
        let began = std::time::Instant::now();
        emit("workflow/agent-start", start);
        // Each retry told once, whether the child made it before the
        // observer was in place (read from its log) or after.
        let said_seqs = Mutex::new(HashSet::new());
        let tell = Arc::new(move |e: &Arc<SessionEvent>| {
            if let EventData::Other { kind, data } = &e.data
                && &**kind == "llm/retry"
                && said_seqs.lock().is_ok_and(|mut s| s.insert(e.seq))
            {
                let mut said = (**data).clone();
                said["seq"] = json!(seq);
                told(said);
            }
        });
        let watching = run.agent().session().observe(tell.clone());
        let earlier: Vec<Arc<SessionEvent>> = run.agent().session().read(|log| {
            log.without_chunks()
                .filter(|e| e.kind() == "llm/retry")
                .cloned()
                .collect()
        });
        for e in earlier {
            tell(&e);
        }
        let result = run.result().await;
        run.agent().session().unobserve(watching);
        let mut end = json!({
            "seq": seq,
            "child": run.id(),
            "outcome": result.stop_reason.as_str(),
            "ms": began.elapsed().as_millis() as u64,
            "tokens": run.agent().progress().tokens,
        });
        // A child on another node is one relayed step here: its own steps
        // are not known.
        if run.info().node.is_none() {
            end["steps"] = json!(run.agent().last_turn().map_or(0, |t| t.steps));
        }
        if let Some(why) = &result.diagnostic {
            end["diagnostic"] = Value::String(why.clone());
        }
        if let Some(cost) = cost_of(run.agent()) {
            end["cost"] = json!(cost);
        }
        emit("workflow/agent-end", end);
        let answer = match (result.stop_reason, result.structured) {
            (StopReason::Completed, Some(v)) => js::Answer::Value(v),
            (StopReason::Completed, None) => js::Answer::Value(Value::String(result.output)),
            _ => js::Answer::Value(Value::Null),
        };
        // Answered: the child leaves the tree now, not with the whole run.
        run.dispose().await;
        (seq, answer)
    })
}
