//! `dsh acp`: an Agent Client Protocol agent over stdio.
//!
//! Newline-delimited JSON-RPC 2.0 on stdin and stdout; stdout carries only
//! protocol frames (diagnostics go to stderr). The message shapes are the
//! protocol's own (`agent-client-protocol-schema`); the connection is ours,
//! so that every task it runs is owned here and ends with it, and so that
//! the requests we send are numbered from 0, as upstream's agent numbers
//! them.
//!
//! One connection (a scope under the runtime root), several sessions; each
//! session is one agent under the connection's scope, created by
//! `session/new` with an absolute `cwd`, created
//! with the ACP session id as its session id (its log, when a store keeps
//! sessions, is filed under that id). A `session/prompt` is the interval
//! from the prompt entering the agent's inbox to the agent being idle: every
//! committed assistant message of it reaches the client as one
//! `agent_message_chunk` per non-empty text block, then the response's
//! stop reason (`cancelled` after `session/cancel`, else `end_turn`; a model
//! error is the request's error). `session/load` continues a stored
//! session (advertised as `loadSession` where sessions are kept and run on
//! a model): its user and assistant text is sent back as updates, then it
//! takes prompts, appending to the same log. The approval seam's asks for the
//! session's agent become `session/request_permission` requests; no answer
//! (the connection closing, the ask withdrawn) denies.
//!
//! With `--progress` a turn's progress goes out too, as an editor shows it:
//! reasoning (`agent_thought_chunk`), each tool call (`tool_call`) and its
//! result (`tool_call_update`), the task list (`plan`).
//!
//! With `--replay SESSION.jsonl` the agents run on the recording's model
//! output (what `dsh replay` does), child recordings beside it
//! (`SESSION.N.jsonl`) serve the children, and `replay.override.json`'s
//! `hang` entries name the file (relative to the session's `cwd`) created
//! when a held stream is ready to be cancelled.
//!
//! Stdin closing ends the connection: prompts in flight are cancelled, the
//! sessions' agents disposed (last created first), and the process exits 0.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agent_client_protocol_schema::v1 as acp;
use dsh_actors::agent::{Agent, AgentSpec};
use dsh_services::approval::{ApprovalAsk, ApprovalOutcome};
use dsh_services::attachments::Attachments;
use dsh_services::llm::{ContentBlock, Message};
use dsh_services::mcp::{McpServer, ServerSpec, Transport};
use dsh_services::persistence::SessionPersistence;
use dsh_services::providers::replay::{CancelPoint, ReplayModel};
use dsh_services::sandbox::{Policy, Sandbox};
use dsh_services::session::{EventData, TurnEndReason};
use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, Runtime, RuntimeSettings};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::args::{AgentArgs, StoreArgs};
use crate::exit::{self, Exit};
use crate::lines::inert_line;
use crate::stage::{Purpose, Route};

/// `dsh acp`: the options.
#[derive(clap::Args, Debug)]
pub struct AcpArgs {
    /// The model, policy and plugin tree sessions run on.
    #[command(flatten)]
    pub agents: AgentArgs,
    /// Where the sessions are kept.
    #[command(flatten)]
    pub store: StoreArgs,
    /// Serve a recorded session's model output instead of a model.
    #[arg(long, value_name = "SESSION.jsonl")]
    pub replay: Option<PathBuf>,
    /// Also send what an editor shows while a turn runs: the model's
    /// thinking (`agent_thought_chunk`), each tool call and its result
    /// (`tool_call`, `tool_call_update`) and the task list (`plan`).
    #[arg(long)]
    pub progress: bool,
    /// The largest frame (one line) taken from the client; a longer one is
    /// answered `-32600` and skipped without being held.
    #[arg(long, value_name = "BYTES", default_value_t = DEFAULT_MAX_FRAME)]
    pub max_frame: usize,
}

/// The default `--max-frame`: 16 MiB.
pub const DEFAULT_MAX_FRAME: usize = 16 << 20;

/// The protocol version spoken.
const PROTOCOL_VERSION: u16 = 1;

/// How long a permission request waits for the client's answer.
const ASK_TIMEOUT: Duration = Duration::from_secs(600);

/// How long a prompt may run.
const PROMPT_LIMIT: Duration = Duration::from_secs(24 * 3600);

/// JSON-RPC error codes.
const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;
const INTERNAL_ERROR: i64 = -32603;

/// Serves ACP on stdin and stdout until stdin closes.
pub async fn acp(args: AcpArgs) -> Exit {
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => return Exit::failed(format!("cannot start the runtime: {}", chain(&e))),
    };
    let exit = Exit::from(serve(&rt, &args).await);
    if tokio::time::timeout(Duration::from_secs(60), rt.shutdown())
        .await
        .is_err()
    {
        return Exit::failed("shutdown did not finish within 60 s");
    }
    exit
}

/// What the sessions run on: a model route, or a recording.
enum Models {
    Route(Route),
    Replay { model: Arc<ReplayModel> },
}

async fn serve(rt: &Runtime, args: &AcpArgs) -> exit::Result<()> {
    let root = rt.root();
    let models = match &args.replay {
        Some(log) => replay_models(&root, log).await?,
        None => {
            let route = crate::stage::boot(rt, &args.agents, Purpose::Protocol, None)
                .await?
                .ok_or_else(|| Exit::usage(crate::args::HOW_TO_CONFIGURE))?;
            Models::Route(route)
        }
    };
    let store = if args.replay.is_none() || args.store.named() {
        Some(crate::stage::store(rt, &args.store)?)
    } else {
        None
    };
    // The connection is a scope under the root: its sessions' agents are
    // its children, and it goes with them.
    let scope = root
        .scope(dsh_supervisors::ScopeKey::new("acp-connection"))
        .await
        .map_err(|e| Exit::failed(format!("cannot open the connection's scope: {}", chain(&e))))?;
    let (out, lines) = mpsc::unbounded_channel::<String>();
    let conn = Arc::new(Connection {
        root: scope.ctx().clone(),
        out,
        models,
        store,
        progress: args.progress,
        hooks: args.agents.config.hooks,
        sessions: Mutex::default(),
        opening: Mutex::default(),
        order: Mutex::default(),
        pending: Mutex::default(),
        next_id: AtomicU64::new(0),
        closed: CancellationToken::new(),
    });
    let mut tasks = JoinSet::new();
    tasks.spawn(write_lines(lines));
    read_until_closed(&conn, &mut tasks, args.max_frame).await;
    conn.close().await;
    scope.dispose().await;
    // Prompts settle (cancelled); then the writer drains what they sent.
    let drain = async {
        while let Some(done) = tasks.join_next().await {
            if let Err(e) = done
                && e.is_panic()
            {
                crate::errln!("dsh acp: a connection task panicked: {}", chain(&e));
            }
        }
    };
    drop(conn);
    if tokio::time::timeout(Duration::from_secs(30), drain)
        .await
        .is_err()
    {
        tasks.abort_all();
        return Err(Exit::failed(
            "the connection's tasks did not end within 30 s",
        ));
    }
    Ok(())
}

/// The replay models of `log`, installed under `root`.
async fn replay_models(root: &Context, log: &std::path::Path) -> exit::Result<Models> {
    let recording = crate::replay::Recording::load(log)?;
    let model = crate::replay::with_sidecar(log, ReplayModel::from_events(&recording.events))?;
    let model = crate::replay::install(root, model, &recording)
        .await
        .map_err(Exit::failed)?
        .model;
    Ok(Models::Replay { model })
}

/// Writes each line to stdout as it comes, until every sender is gone.
async fn write_lines(mut lines: mpsc::UnboundedReceiver<String>) {
    let mut stdout = tokio::io::stdout();
    while let Some(mut line) = lines.recv().await {
        line.push('\n');
        if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
            return;
        }
    }
}

/// Reads frames until stdin closes (or a stop signal arrives). A frame
/// that is not UTF-8, or longer than `max_frame`, is answered with an error
/// and the connection goes on.
async fn read_until_closed(conn: &Arc<Connection>, tasks: &mut JoinSet<()>, max_frame: usize) {
    let mut stdin = tokio::io::BufReader::new(tokio::io::stdin());
    let mut buf = Vec::new();
    loop {
        let frame = tokio::select! {
            frame = next_frame(&mut stdin, &mut buf, max_frame) => frame,
            _ = crate::exit::stop_signal() => return,
        };
        match frame {
            Ok(Some(Frame::Line)) => match std::str::from_utf8(&buf) {
                Ok(line) if line.trim().is_empty() => {}
                Ok(line) => conn.clone().frame(line, tasks).await,
                Err(e) => conn.respond(
                    &Value::Null,
                    Err(RpcError(
                        PARSE_ERROR,
                        format!("the frame is not UTF-8 (byte {})", e.valid_up_to()),
                    )),
                ),
            },
            Ok(Some(Frame::TooLong(bytes))) => conn.respond(
                &Value::Null,
                Err(RpcError(
                    INVALID_REQUEST,
                    format!(
                        "a frame of {bytes} bytes is over the {max_frame}-byte limit (--max-frame); it was skipped"
                    ),
                )),
            ),
            Ok(None) => return,
            Err(e) => {
                crate::errln!("dsh acp: cannot read stdin: {}", chain(&e));
                return;
            }
        }
    }
}

/// Past this many bytes, a line's buffer is reserved up to the frame cap.
const LONG_LINE: usize = 64 << 10;

/// What [`next_frame`] read.
#[derive(Debug, PartialEq)]
enum Frame {
    /// A line, in the buffer (without its newline).
    Line,
    /// A line longer than the limit, skipped: its length.
    TooLong(u64),
}

/// Reads the next line of `reader` into `buf`, holding at most `max` bytes
/// of it: a longer line is read to its end and dropped. `None` at the end
/// of input.
async fn next_frame<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
) -> std::io::Result<Option<Frame>> {
    buf.clear();
    let (mut len, mut over) = (0u64, false);
    loop {
        let available = reader.fill_buf().await?;
        if available.is_empty() {
            return Ok(match (len, over) {
                (0, _) => None,
                (_, true) => Some(Frame::TooLong(len)),
                (_, false) => Some(Frame::Line),
            });
        }
        let newline = memchr::memchr(b'\n', available);
        let chunk = &available[..newline.unwrap_or(available.len())];
        len += chunk.len() as u64;
        if !over && buf.len() + chunk.len() > max {
            over = true;
            *buf = Vec::new();
        }
        if !over {
            // A long line gets one reservation up to the cap rather than a
            // chain of doublings, each copy resident while the next is made
            // (the pages are touched only as bytes arrive).
            let need = buf.len() + chunk.len();
            if need > buf.capacity() && need > LONG_LINE {
                buf.reserve_exact(max - buf.len());
            }
            buf.extend_from_slice(chunk);
        }
        let used = newline.map_or(available.len(), |i| i + 1);
        reader.consume(used);
        if newline.is_some() {
            return Ok(Some(if over {
                Frame::TooLong(len)
            } else {
                Frame::Line
            }));
        }
    }
}

/// One ACP session.
struct Session {
    id: String,
    agent: Agent,
    /// The session's MCP servers (their status leaves with the session).
    _mcp: Vec<McpServer>,
    /// What started them (a new mode starts them again for its agent).
    servers: Vec<ServerSpec>,
    cwd: PathBuf,
    /// Its mode: `default`, or the named agent definition it runs as.
    mode: String,
    /// A prompt is in flight.
    busy: AtomicBool,
    /// `session/cancel` arrived for the prompt in flight.
    cancelled: AtomicBool,
}

/// One client connection.
struct Connection {
    root: Context,
    out: mpsc::UnboundedSender<String>,
    models: Models,
    store: Option<Arc<dyn SessionPersistence>>,
    /// Send the turn's progress too (`--progress`).
    progress: bool,
    /// Run the hooks of the Claude Code and Codex settings of each
    /// session's working directory (`--hooks`).
    hooks: bool,
    sessions: Mutex<HashMap<String, Arc<Session>>>,
    /// Ids of sessions being loaded (not yet in `sessions`).
    opening: Mutex<std::collections::HashSet<String>>,
    /// Session ids in creation order.
    order: Mutex<Vec<String>>,
    /// Our requests awaiting the client's response.
    pending: Mutex<HashMap<u64, oneshot::Sender<Result<Value, Value>>>>,
    next_id: AtomicU64,
    closed: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// An error for the client: a JSON-RPC code and a message.
struct RpcError(i64, String);

impl RpcError {
    fn params(message: impl Into<String>) -> RpcError {
        RpcError(INVALID_PARAMS, message.into())
    }
}

impl Connection {
    fn send(&self, frame: Value) {
        let _ = self.out.send(frame.to_string());
    }

    fn respond(&self, id: &Value, result: Result<Value, RpcError>) {
        let frame = match result {
            Ok(result) => json!({"jsonrpc": "2.0", "id": id, "result": result}),
            Err(RpcError(code, message)) => {
                json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
            }
        };
        self.send(frame);
    }

    /// Handles one line from the client.
    async fn frame(self: Arc<Self>, line: &str, tasks: &mut JoinSet<()>) {
        let frame: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                self.respond(
                    &Value::Null,
                    Err(RpcError(PARSE_ERROR, format!("not JSON: {}", chain(&e)))),
                );
                return;
            }
        };
        let id = frame.get("id").cloned();
        let method = frame.get("method").and_then(Value::as_str);
        let params = frame.get("params").cloned().unwrap_or(Value::Null);
        match (method, id) {
            (Some(method), Some(id)) => self.request(method, id, params, tasks).await,
            (Some(method), None) => self.notification(method, params),
            (None, Some(id)) => self.response(&id, &frame),
            (None, None) => self.respond(
                &Value::Null,
                Err(RpcError(
                    INVALID_REQUEST,
                    "a frame needs a `method` or an `id`".into(),
                )),
            ),
        }
    }

    async fn request(
        self: Arc<Self>,
        method: &str,
        id: Value,
        params: Value,
        tasks: &mut JoinSet<()>,
    ) {
        let result = match method {
            "initialize" => initialize(params, self.loads(), self.images()),
            "authenticate" => Ok(json!({})),
            // Starting a session's MCP servers can take their connect
            // timeout: off the frame loop, so cancels, answers and other
            // sessions go on meanwhile.
            "session/new" | "session/load" if has_mcp_servers(&params) => {
                let (conn, method) = (self.clone(), method.to_owned());
                tasks.spawn(async move {
                    let result = if method == "session/new" {
                        conn.new_session(params).await
                    } else {
                        conn.load_session(params).await
                    };
                    conn.respond(&id, result);
                });
                return;
            }
            "session/new" => self.new_session(params).await,
            "session/load" => self.load_session(params).await,
            "session/set_mode" => self.set_mode(params).await,
            "session/prompt" => match self.admit(params).await {
                Ok((session, message)) => {
                    let conn = self.clone();
                    tasks.spawn(async move {
                        let result = conn.prompt(&session, message).await;
                        session.busy.store(false, Ordering::Release);
                        conn.respond(&id, result);
                    });
                    return;
                }
                Err(e) => Err(e),
            },
            other => Err(RpcError(
                METHOD_NOT_FOUND,
                format!("`{other}` is not supported"),
            )),
        };
        self.respond(&id, result);
    }

    fn notification(&self, method: &str, params: Value) {
        if method == "session/cancel" {
            let Ok(cancel) = serde_json::from_value::<acp::CancelNotification>(params) else {
                return;
            };
            let session = lock(&self.sessions)
                .get(&cancel.session_id.to_string())
                .cloned();
            if let Some(session) = session {
                if session.busy.load(Ordering::Acquire) {
                    session.cancelled.store(true, Ordering::Release);
                }
                session.agent.cancel();
            }
        }
        // Other notifications are not for us; ignoring them is the protocol's rule.
    }

    /// A response to one of our requests.
    fn response(&self, id: &Value, frame: &Value) {
        let Some(n) = id.as_u64() else { return };
        let Some(waiter) = lock(&self.pending).remove(&n) else {
            return;
        };
        let answer = match frame.get("error") {
            Some(e) => Err(e.clone()),
            None => Ok(frame.get("result").cloned().unwrap_or(Value::Null)),
        };
        let _ = waiter.send(answer);
    }

    /// Sends a request to the client and waits for its answer (`None`: no
    /// answer — the connection closed, `cancel` fired, or time ran out).
    async fn ask(&self, method: &str, params: Value, cancel: &CancellationToken) -> Option<Value> {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(n, tx);
        self.send(json!({"jsonrpc": "2.0", "id": n, "method": method, "params": params}));
        let answer = tokio::time::timeout(ASK_TIMEOUT, async {
            tokio::select! {
                a = rx => a.ok().and_then(Result::ok),
                () = cancel.cancelled() => None,
                () = self.closed.cancelled() => None,
            }
        })
        .await
        .ok()
        .flatten();
        lock(&self.pending).remove(&n);
        answer
    }

    async fn new_session(self: &Arc<Self>, params: Value) -> Result<Value, RpcError> {
        let request: acp::NewSessionRequest = serde_json::from_value(params)
            .map_err(|e| RpcError::params(format!("session/new: {}", chain(&e))))?;
        let cwd = request.cwd;
        if !cwd.is_absolute() || !cwd.is_dir() {
            return Err(RpcError::params(format!(
                "session/new: `cwd` must be the absolute path of a directory (got {})",
                cwd.display()
            )));
        }
        let servers = mcp_specs("session/new", request.mcp_servers, &cwd, self.defaults())?;
        if !request.additional_directories.is_empty() {
            return Err(RpcError::params(
                "session/new: `additionalDirectories` are not supported; send an empty list",
            ));
        }
        let id = uuid::Uuid::new_v4().to_string();
        let mut spec = self.spec(&cwd).await;
        spec.id = Some(id.clone());
        let modes = modes(&cwd, DEFAULT_MODE).await;
        let mcp = self.open(&id, spec, cwd, servers).await?;
        let mut answer = json!({"sessionId": id});
        if let Some(modes) = modes {
            answer["modes"] = modes;
        }
        if let Some(meta) = mcp {
            answer["_meta"] = meta;
        }
        Ok(answer)
    }

    /// `session/set_mode`: between prompts, the session goes on as the
    /// named agent definition the mode is (or as itself, `default`): its
    /// agent is flushed and replaced by one made from the definition on the
    /// same log, its MCP servers started again for it.
    async fn set_mode(self: &Arc<Self>, params: Value) -> Result<Value, RpcError> {
        let request: acp::SetSessionModeRequest = serde_json::from_value(params)
            .map_err(|e| RpcError::params(format!("session/set_mode: {}", chain(&e))))?;
        let id = request.session_id.to_string();
        let mode = request.mode_id.to_string();
        let Some(store) = self.store.clone().filter(|_| self.loads()) else {
            return Err(RpcError(
                METHOD_NOT_FOUND,
                "session/set_mode: this server keeps no sessions it can continue in another mode"
                    .into(),
            ));
        };
        let session = lock(&self.sessions).get(&id).cloned().ok_or_else(|| {
            RpcError::params(format!(
                "session/set_mode: no session `{id}` on this connection"
            ))
        })?;
        if session.busy.load(Ordering::Acquire) {
            return Err(RpcError::params(
                "session/set_mode: a prompt is running; set the mode when it has ended",
            ));
        }
        let definitions = definitions_of(&session.cwd).await;
        let definition = match mode.as_str() {
            DEFAULT_MODE => None,
            name => Some(definitions.require(name).cloned().map_err(|e| {
                RpcError::params(format!("session/set_mode: {}", inert_line(&e.to_string())))
            })?),
        };
        if mode == session.mode {
            return Ok(json!({}));
        }
        // The log whole in the store first, the session still serving.
        if let Err(e) = session.agent.session().flush().await {
            return Err(RpcError(
                INTERNAL_ERROR,
                format!(
                    "session/set_mode: the session log was not written: {}",
                    chain(&e)
                ),
            ));
        }
        let old = match session.mode.as_str() {
            DEFAULT_MODE => None,
            name => definitions.get(name).cloned(),
        };
        let spec = self
            .mode_spec(&store, &id, &session.cwd, definition.as_ref())
            .await?;
        lock(&self.sessions).remove(&id);
        session.agent.dispose().await;
        let (cwd, servers) = (session.cwd.clone(), session.servers.clone());
        if let Err(e) = self.open(&id, spec, cwd.clone(), servers.clone()).await {
            // The session goes on in the mode it had.
            let back = match self.mode_spec(&store, &id, &cwd, old.as_ref()).await {
                Ok(spec) => self.open(&id, spec, cwd, servers).await.err(),
                Err(again) => Some(again),
            };
            return Err(match back {
                None => e,
                Some(again) => RpcError(
                    INTERNAL_ERROR,
                    format!("{}; reopening the session failed too: {}", e.1, again.1),
                ),
            });
        }
        self.send(
            json!({"jsonrpc": "2.0", "method": "session/update", "params": {
                "sessionId": id,
                "update": {"sessionUpdate": "current_mode_update", "currentModeId": mode},
            }}),
        );
        Ok(json!({}))
    }

    /// Whether `session/load` works here: sessions are kept, and they run
    /// on a model (a recording has nothing to continue with).
    fn loads(&self) -> bool {
        self.store.is_some() && matches!(self.models, Models::Route(_))
    }

    /// A stored session, continued: its conversation is sent to the client
    /// as `user_message_chunk` and `agent_message_chunk` updates, then the
    /// session takes prompts.
    async fn load_session(self: &Arc<Self>, params: Value) -> Result<Value, RpcError> {
        let request: acp::LoadSessionRequest = serde_json::from_value(params)
            .map_err(|e| RpcError::params(format!("session/load: {}", chain(&e))))?;
        let (Some(store), true) = (self.store.clone(), self.loads()) else {
            return Err(RpcError(
                METHOD_NOT_FOUND,
                "session/load: this server keeps no sessions it can continue".into(),
            ));
        };
        let cwd = request.cwd;
        if !cwd.is_absolute() || !cwd.is_dir() {
            return Err(RpcError::params(format!(
                "session/load: `cwd` must be the absolute path of a directory (got {})",
                cwd.display()
            )));
        }
        let servers = mcp_specs("session/load", request.mcp_servers, &cwd, self.defaults())?;
        let id = request.session_id.to_string();
        {
            let sessions = lock(&self.sessions);
            let mut opening = lock(&self.opening);
            if sessions.contains_key(&id) || !opening.insert(id.clone()) {
                return Err(RpcError::params(format!(
                    "session/load: session `{id}` is already open on this connection"
                )));
            }
        }
        let _opening = Opening {
            set: &self.opening,
            id: id.clone(),
        };
        let loaded = store
            .load(&id)
            .map_err(|e| RpcError::params(format!("session/load: {}", chain(&e))))?;
        store
            .prepare_resume(&id, &loaded)
            .map_err(|e| RpcError(INTERNAL_ERROR, format!("session/load: {}", chain(&e))))?;
        for event in &loaded.events {
            self.history_update(&id, event);
        }
        let mut spec = self.spec(&cwd).await;
        spec.durable = Some(loaded.durable);
        spec.seed = Some(Box::new((loaded.header, loaded.events)));
        let modes = modes(&cwd, DEFAULT_MODE).await;
        let mcp = self.open(&id, spec, cwd, servers).await?;
        let mut answer = json!({});
        if let Some(modes) = modes {
            answer["modes"] = modes;
        }
        if let Some(meta) = mcp {
            answer["_meta"] = meta;
        }
        Ok(answer)
    }

    /// The client's view of one stored event: the user's words and the
    /// assistant's committed text.
    fn history_update(&self, session: &str, event: &dsh_services::session::SessionEvent) {
        let (kind, message) = match &event.data {
            EventData::UserMessage(m) if m.source.kind == "user" => ("user_message_chunk", m),
            EventData::AssistantMessage { message, .. } => ("agent_message_chunk", message),
            _ => return,
        };
        for block in &message.content {
            if let ContentBlock::Text { text } = block
                && !text.is_empty()
            {
                self.send(update(session, kind, text));
            }
        }
    }

    /// The spec of session `id`'s agent as `definition` (none: itself) on
    /// its stored log.
    async fn mode_spec(
        &self,
        store: &Arc<dyn SessionPersistence>,
        id: &str,
        cwd: &std::path::Path,
        definition: Option<&dsh_services::definitions::Definition>,
    ) -> Result<AgentSpec, RpcError> {
        let loaded = store
            .load(id)
            .map_err(|e| RpcError(INTERNAL_ERROR, format!("session/set_mode: {}", chain(&e))))?;
        let mut spec = self.spec(cwd).await;
        if let Some(d) = definition {
            dsh_actors::subagent::define_top_level(&self.root, &mut spec, d);
        }
        spec.durable = Some(loaded.durable);
        spec.seed = Some(Box::new((loaded.header, loaded.events)));
        Ok(spec)
    }

    /// The agent spec of a session in `cwd` on this server's models.
    async fn spec(&self, cwd: &std::path::Path) -> AgentSpec {
        let mut spec = match &self.models {
            Models::Route(route) => {
                let mut spec = AgentSpec::new(&route.provider, &route.model, cwd.to_path_buf());
                spec.system = Some(crate::stage::system_prompt(cwd, &route.model));
                spec.sections = crate::stage::workspace_sections(cwd).await;
                spec
            }
            Models::Replay { .. } => AgentSpec::new("replay", "recorded", cwd.to_path_buf()),
        };
        spec.store = self.store.clone();
        spec
    }

    /// The policy this server's agents (and their MCP servers) get.
    fn defaults(&self) -> Policy {
        self.root
            .get::<Sandbox>(Sandbox::SERVICE)
            .unwrap_or_else(Sandbox::host)
            .defaults()
    }

    /// Creates the session's agent from `spec`, starts the session's MCP
    /// servers in the agent's scope (only its agent sees their tools; they
    /// stop with it), and opens the session. Returns the servers' states
    /// for the answer's `_meta` when there are any: a server that did not
    /// connect does not fail the session, it keeps trying, and the client
    /// is told.
    async fn open(
        self: &Arc<Self>,
        id: &str,
        spec: AgentSpec,
        cwd: PathBuf,
        servers: Vec<ServerSpec>,
    ) -> Result<Option<Value>, RpcError> {
        let mode = spec
            .definition
            .clone()
            .unwrap_or_else(|| DEFAULT_MODE.into());
        let kept = servers.clone();
        let agent = Agent::create(&self.root, spec).await.map_err(|e| {
            RpcError(
                INTERNAL_ERROR,
                format!("cannot create the agent: {}", chain(&e)),
            )
        })?;
        self.answer_permissions(&agent, id)
            .map_err(|e| RpcError(INTERNAL_ERROR, format!("cannot route permissions: {e}")))?;
        if self.hooks {
            // The session's own project hooks, for its agent alone.
            let config = crate::catalogue::HooksConfig {
                workspace: Some(cwd.clone()),
                ..Default::default()
            };
            let installed = match agent.context() {
                Ok(ctx) => crate::catalogue::install_hooks(&ctx, &config)
                    .await
                    .map_err(|e| e.to_string()),
                Err(e) => Err(chain(&e).to_string()),
            };
            if let Err(e) = installed {
                agent.dispose().await;
                return Err(RpcError(
                    INTERNAL_ERROR,
                    format!("cannot install the hooks: {e}"),
                ));
            }
        }
        let mut mcp = Vec::new();
        if !servers.is_empty() {
            let ctx = agent.context().map_err(|e| {
                RpcError(
                    INTERNAL_ERROR,
                    format!("the agent is not up: {}", chain(&e)),
                )
            })?;
            // Together: the answer waits for the slowest, not for the sum.
            let starts = servers
                .into_iter()
                .map(|server| dsh_services::mcp::start(&ctx, server));
            for started in futures::future::join_all(starts).await {
                match started {
                    Ok(s) => mcp.push(s),
                    Err(e) => {
                        agent.dispose().await;
                        return Err(RpcError(INTERNAL_ERROR, chain(&e).to_string()));
                    }
                }
            }
        }
        let meta = (!mcp.is_empty()).then(|| {
            let states: Vec<Value> = mcp
                .iter()
                .map(|s| {
                    let s = s.status();
                    json!({"name": s.name, "state": s.state, "tools": s.tools.len(), "error": s.error})
                })
                .collect();
            json!({"dsh": {"mcpServers": states}})
        });
        // Every turn of the session streams its updates, also one no prompt
        // started (a background child's notice or report wakes the agent).
        // Weak: the writer ends when the connection does.
        let (out, sid, progress) = (self.out.downgrade(), id.to_owned(), self.progress);
        agent.session().observe(Arc::new(move |e| {
            if let Some(out) = out.upgrade() {
                for frame in frames_of(&sid, &e.data, progress) {
                    let _ = out.send(frame.to_string());
                }
            }
        }));
        let session = Arc::new(Session {
            id: id.to_owned(),
            agent,
            _mcp: mcp,
            servers: kept,
            cwd,
            mode,
            busy: AtomicBool::new(false),
            cancelled: AtomicBool::new(false),
        });
        lock(&self.sessions).insert(id.to_owned(), session);
        lock(&self.order).push(id.to_owned());
        Ok(meta)
    }

    /// Routes the agent's approval asks to the client as
    /// `session/request_permission`.
    fn answer_permissions(self: &Arc<Self>, agent: &Agent, session: &str) -> Result<(), String> {
        let ctx = agent.context().map_err(|e| chain(&e).to_string())?;
        let conn = Arc::downgrade(self);
        let session = session.to_owned();
        ctx.on_waterfall(move |ask: ApprovalAsk, _next| {
            let (conn, session) = (conn.clone(), session.clone());
            async move {
                let Some(conn) = conn.upgrade() else {
                    return ApprovalOutcome::Unavailable;
                };
                conn.permission(&session, &ask).await
            }
        })
        .map(|_| ())
        .map_err(|e| chain(&e).to_string())
    }

    async fn permission(&self, session: &str, ask: &ApprovalAsk) -> ApprovalOutcome {
        let call = ask
            .request
            .call_id
            .clone()
            .unwrap_or_else(|| ask.id.clone());
        let params = json!({
            "sessionId": session,
            "toolCall": {
                "toolCallId": call,
                "title": format!("{}: {}", ask.request.tool, ask.request.reason),
                "rawInput": ask.request.arguments,
            },
            "options": [
                {"optionId": "allow-once", "name": "Allow once", "kind": "allow_once"},
                {"optionId": "reject-once", "name": "Reject", "kind": "reject_once"},
            ],
        });
        let Some(answer) = self
            .ask("session/request_permission", params, &ask.cancel)
            .await
        else {
            return if ask.cancel.is_cancelled() {
                ApprovalOutcome::Cancelled
            } else {
                ApprovalOutcome::Unavailable
            };
        };
        match serde_json::from_value::<acp::RequestPermissionResponse>(answer) {
            Ok(r) => match r.outcome {
                acp::RequestPermissionOutcome::Selected(s)
                    if s.option_id.to_string() == "allow-once" =>
                {
                    ApprovalOutcome::AllowedOnce
                }
                acp::RequestPermissionOutcome::Selected(_) => ApprovalOutcome::Rejected,
                acp::RequestPermissionOutcome::Cancelled => ApprovalOutcome::Cancelled,
                _ => ApprovalOutcome::Unavailable,
            },
            // An answer we cannot read is no answer.
            Err(_) => ApprovalOutcome::Unavailable,
        }
    }

    /// Whether prompts may carry images: an attachment store keeps them
    /// and the sessions' model takes them.
    fn images(&self) -> bool {
        let (provider, model) = match &self.models {
            Models::Route(route) => (route.provider.as_str(), route.model.as_str()),
            // A recording whose requests carried images.
            Models::Replay { .. } => ("replay", "recorded"),
        };
        let llm = self
            .root
            .get::<dsh_services::llm::LlmRuntime>(dsh_services::llm::LlmRuntime::SERVICE);
        self.root.get::<Attachments>(Attachments::SERVICE).is_some()
            && llm.is_some_and(|l| l.accepts_images(provider, model))
    }

    /// Checks a `session/prompt` and claims the session's prompt slot.
    async fn admit(&self, params: Value) -> Result<(Arc<Session>, Message), RpcError> {
        let request: acp::PromptRequest = serde_json::from_value(params)
            .map_err(|e| RpcError::params(format!("session/prompt: {}", chain(&e))))?;
        let sid = request.session_id.to_string();
        let session = lock(&self.sessions)
            .get(&sid)
            .cloned()
            .ok_or_else(|| RpcError::params(format!("session/prompt: no session `{sid}`")))?;
        let store = self
            .images()
            .then(|| self.root.get::<Attachments>(Attachments::SERVICE))
            .flatten();
        let message = prompt_message(request.prompt, store).await?;
        if session.busy.swap(true, Ordering::AcqRel) {
            return Err(RpcError::params(format!(
                "session/prompt: session `{sid}` is already answering a prompt"
            )));
        }
        session.cancelled.store(false, Ordering::Release);
        Ok((session, message))
    }

    /// Runs one prompt to the agent's idle; its stop reason.
    async fn prompt(&self, session: &Session, message: Message) -> Result<Value, RpcError> {
        // Its updates stream from the session's observer (see `open`).
        let agent = &session.agent;
        let before = agent.last_turn().map(|t| t.turn);
        let outcome = match agent.followup(message) {
            Ok(()) => self.until_idle(session).await,
            Err(e) => Err(RpcError(INTERNAL_ERROR, chain(&e).to_string())),
        };
        // Cancelled, or the connection closing under it (the agent may be
        // disposed before it went idle): cancelled, whatever the wait said.
        if session.cancelled.swap(false, Ordering::AcqRel) || self.closed.is_cancelled() {
            return Ok(json!({"stopReason": "cancelled"}));
        }
        outcome?;
        match agent.last_turn().filter(|t| Some(t.turn) != before) {
            Some(t) => match t.reason {
                TurnEndReason::Error { error } => Err(RpcError(
                    INTERNAL_ERROR,
                    format!("{}: {}", error.code, error.message),
                )),
                TurnEndReason::Aborted { .. } | TurnEndReason::Interrupted => {
                    Ok(json!({"stopReason": "cancelled"}))
                }
                // A hook (or another policy) refused the prompt: no
                // request was sent. The reason reaches the user as text.
                // The prompt ends as a turn does (upstream's behaviour), the
                // reason shown as the agent's text.
                TurnEndReason::Blocked => {
                    self.send(update(&session.id, "agent_message_chunk", &t.text));
                    Ok(json!({"stopReason": "end_turn"}))
                }
                _ => Ok(json!({"stopReason": "end_turn"})),
            },
            // The prompt never became a turn of its own (it was discarded).
            None => Ok(json!({"stopReason": "cancelled"})),
        }
    }

    /// Waits for the agent to be idle; under a replay, creates the ready
    /// file when a held stream is due to be cancelled.
    async fn until_idle(&self, session: &Session) -> Result<(), RpcError> {
        let idle = session.agent.when_idle(PROMPT_LIMIT);
        let Models::Replay { model } = &self.models else {
            return idle
                .await
                .map_err(|e| RpcError(INTERNAL_ERROR, chain(&e).to_string()));
        };
        tokio::pin!(idle);
        loop {
            tokio::select! {
                done = &mut idle => return done.map_err(|e| RpcError(INTERNAL_ERROR, chain(&e).to_string())),
                point = model.cancel_point() => {
                    if let CancelPoint::Streaming { ready_file: Some(file) } = point {
                        let _ = tokio::fs::write(session.cwd.join(file), b"").await;
                    }
                }
            }
        }
    }

    /// Ends the connection: new work refused, prompts cancelled, the
    /// sessions' agents disposed, last created first.
    async fn close(&self) {
        self.closed.cancel();
        let order = std::mem::take(&mut *lock(&self.order));
        let mut sessions = std::mem::take(&mut *lock(&self.sessions));
        for id in order.iter().rev() {
            if let Some(session) = sessions.remove(id) {
                session.agent.cancel();
                session.agent.dispose().await;
            }
        }
        lock(&self.pending).clear();
    }
}

/// The `session/update` frames one logged event makes: the committed
/// assistant text always; with `progress`, its reasoning, tool calls and
/// their results, and the task list.
fn frames_of(session: &str, data: &EventData, progress: bool) -> Vec<Value> {
    let notify = |update: Value| {
        json!({"jsonrpc": "2.0", "method": "session/update",
               "params": {"sessionId": session, "update": update}})
    };
    match data {
        EventData::AssistantMessage { message, .. } => message
            .content
            .iter()
            .filter_map(|block| match block {
                ContentBlock::Text { text } if !text.is_empty() => {
                    Some(update(session, "agent_message_chunk", text))
                }
                ContentBlock::Reasoning { text } if progress && !text.is_empty() => {
                    Some(update(session, "agent_thought_chunk", text))
                }
                _ => None,
            })
            .collect(),
        EventData::ToolCall { call, .. } if progress => {
            let (call_id, name, arguments) = (&call.call_id, &call.name, &call.arguments);
            let input: Value = serde_json::from_str(arguments)
                .unwrap_or_else(|_| Value::String(arguments.to_string()));
            vec![notify(json!({
                "sessionUpdate": "tool_call",
                "toolCallId": call_id,
                "title": name,
                "kind": tool_kind(name),
                "status": "in_progress",
                "rawInput": input,
            }))]
        }
        EventData::ToolResult { message, error, .. } if progress => message
            .content
            .iter()
            .filter_map(|block| match block {
                ContentBlock::ToolResult {
                    tool_call_id,
                    content,
                    ..
                } => {
                    let text: String = content
                        .iter()
                        .filter_map(|c| match c {
                            ContentBlock::Text { text } => Some(text.as_str()),
                            _ => None,
                        })
                        .collect();
                    Some(notify(json!({
                        "sessionUpdate": "tool_call_update",
                        "toolCallId": tool_call_id,
                        "status": if error.is_some() { "failed" } else { "completed" },
                        "content": [{"type": "content", "content": {"type": "text", "text": text}}],
                    })))
                }
                _ => None,
            })
            .collect(),
        EventData::TodoWrite { todos } if progress => {
            let entries: Vec<Value> = todos
                .iter()
                .map(|t| json!({"content": t.content, "priority": "medium", "status": t.status}))
                .collect();
            vec![notify(json!({"sessionUpdate": "plan", "entries": entries}))]
        }
        _ => Vec::new(),
    }
}

/// The ACP kind of one of our tools, for an editor's icon.
fn tool_kind(name: &str) -> &'static str {
    match name {
        "read" | "read_image" | "job_output" | "job_list" | "skill" => "read",
        "write" | "edit" => "edit",
        "bash" | "job_kill" => "execute",
        "glob" | "grep" => "search",
        "web_fetch" => "fetch",
        "todo_write" => "think",
        _ => "other",
    }
}

/// A `session/update` notification carrying one text chunk.
fn update(session: &str, kind: &str, text: &str) -> Value {
    json!({
        "jsonrpc": "2.0",
        "method": "session/update",
        "params": {"sessionId": session, "update": {
            "sessionUpdate": kind,
            "content": {"type": "text", "text": text},
        }},
    })
}

/// Whether a `session/new` or `session/load` lists MCP servers.
fn has_mcp_servers(params: &Value) -> bool {
    params["mcpServers"]
        .as_array()
        .is_some_and(|a| !a.is_empty())
}

/// A session id being loaded, released however the load ends.
struct Opening<'a> {
    set: &'a Mutex<std::collections::HashSet<String>>,
    id: String,
}

impl Drop for Opening<'_> {
    fn drop(&mut self) {
        lock(self.set).remove(&self.id);
    }
}

/// A session's `mcpServers`, checked: stdio (an absolute command) and
/// HTTP servers with valid names, URLs and headers, each name once; SSE is
/// refused (not advertised). Stdio servers run in the session's `cwd`
/// under `policy`.
fn mcp_specs(
    method: &str,
    servers: Vec<acp::McpServer>,
    cwd: &std::path::Path,
    policy: Policy,
) -> Result<Vec<ServerSpec>, RpcError> {
    let mut specs: Vec<ServerSpec> = Vec::new();
    for (i, server) in servers.into_iter().enumerate() {
        let at = |why: String| RpcError::params(format!("{method}: mcpServers[{i}]: {why}"));
        let (name, transport) = match server {
            acp::McpServer::Stdio(s) => {
                if !s.command.is_absolute() {
                    return Err(at(format!(
                        "`command` must be an absolute path (got {})",
                        s.command.display()
                    )));
                }
                let transport = Transport::Stdio {
                    command: s.command.to_string_lossy().into_owned(),
                    args: s.args,
                    env: s.env.into_iter().map(|v| (v.name, v.value)).collect(),
                    cwd: cwd.to_path_buf(),
                };
                (s.name, transport)
            }
            acp::McpServer::Http(h) => {
                dsh_services::mcp::check_url(&h.url).map_err(|e| at(chain(&e).to_string()))?;
                let headers: Vec<(String, String)> =
                    h.headers.into_iter().map(|v| (v.name, v.value)).collect();
                dsh_services::mcp::check_headers(&headers)
                    .map_err(|e| at(chain(&e).to_string()))?;
                (
                    h.name,
                    Transport::Http {
                        url: h.url,
                        headers,
                    },
                )
            }
            acp::McpServer::Sse(s) => {
                return Err(at(format!(
                    "server {:?} uses SSE, which this agent does not take (mcpCapabilities.sse is false); use http",
                    s.name
                )));
            }
            _ => return Err(at("an unknown transport".into())),
        };
        dsh_services::mcp::check_name(&name).map_err(|e| at(chain(&e).to_string()))?;
        if specs.iter().any(|s| s.name == name) {
            return Err(at(format!("the name {name:?} is used twice")));
        }
        specs.push(ServerSpec::new(name, transport, policy));
    }
    Ok(specs)
}

/// The `initialize` result: the version both speak, and what we take
/// (`loadSession` only where stored sessions can be continued; MCP
/// servers over stdio and HTTP, not SSE).
/// The mode a session starts in: itself, as no definition.
const DEFAULT_MODE: &str = "default";

/// The named agent definitions for `cwd`, read off the async workers.
async fn definitions_of(cwd: &std::path::Path) -> dsh_services::definitions::Definitions {
    let (cwd, home) = (cwd.to_path_buf(), crate::home::dir());
    tokio::task::spawn_blocking(move || dsh_services::definitions::discover(&cwd, Some(&home)))
        .await
        .unwrap_or_default()
}

/// A session's modes: `default`, then one per named agent definition found
/// for `cwd` (its name, its description); `None` when there is none to
/// choose (the answer then carries no `modes`, as upstream's does).
async fn modes(cwd: &std::path::Path, current: &str) -> Option<Value> {
    let definitions = definitions_of(cwd).await;
    if definitions.found.is_empty() {
        return None;
    }
    let mut available = vec![json!({
        "id": DEFAULT_MODE,
        "name": "dsh",
        "description": "The coding agent, with every tool this server gives it.",
    })];
    available.extend(
        definitions.found.values().map(
            |d| json!({"id": d.name, "name": d.name, "description": inert_line(&d.description)}),
        ),
    );
    Some(json!({"currentModeId": current, "availableModes": available}))
}

fn initialize(params: Value, loads: bool, images: bool) -> Result<Value, RpcError> {
    let request: acp::InitializeRequest = serde_json::from_value(params)
        .map_err(|e| RpcError::params(format!("initialize: {}", chain(&e))))?;
    let asked: u16 = serde_json::to_value(request.protocol_version)
        .ok()
        .and_then(|v| v.as_u64())
        .and_then(|v| u16::try_from(v).ok())
        .unwrap_or(PROTOCOL_VERSION);
    let mut capabilities = json!({
        "promptCapabilities": {"image": images, "audio": false, "embeddedContext": false},
        "mcpCapabilities": {"http": true, "sse": false},
    });
    if loads {
        capabilities["loadSession"] = json!(true);
    }
    Ok(json!({
        "protocolVersion": asked.min(PROTOCOL_VERSION),
        "agentInfo": {"name": "dsh", "version": env!("CARGO_PKG_VERSION")},
        "agentCapabilities": capabilities,
        "authMethods": [],
    }))
}

/// The user message of a prompt: text, resource links (as bracketed
/// references) and, with a `store`, inline images (each checked and kept
/// before the message exists; the message holds the reference), in order;
/// anything else is refused.
async fn prompt_message(
    blocks: Vec<acp::ContentBlock>,
    store: Option<Arc<Attachments>>,
) -> Result<Message, RpcError> {
    use base64::Engine as _;
    /// One prompt block, checked.
    enum Part {
        Text(String),
        /// A resource link, as its bracketed reference.
        Link(String),
        /// An image's bytes (of the type its block said).
        Image(Vec<u8>),
    }
    // Decoded and checked, all of them, before any is kept.
    let mut parts: Vec<Part> = Vec::new();
    for (i, block) in blocks.into_iter().enumerate() {
        match block {
            acp::ContentBlock::Text(t) => parts.push(Part::Text(t.text)),
            acp::ContentBlock::ResourceLink(link) => parts.push(Part::Link(format!(
                "[resource_link name={} uri={}]",
                link.name, link.uri
            ))),
            acp::ContentBlock::Image(image) if store.is_some() => {
                let bytes = base64::engine::general_purpose::STANDARD
                    .decode(image.data.as_bytes())
                    .map_err(|e| {
                        RpcError::params(format!(
                            "session/prompt: block {i}: bad base64: {}",
                            chain(&e)
                        ))
                    })?;
                let info = dsh_services::attachments::sniff(&bytes).ok_or_else(|| {
                    RpcError::params(format!(
                        "session/prompt: block {i}: not a PNG, JPEG, GIF or WebP image"
                    ))
                })?;
                if info.media_type != image.mime_type {
                    return Err(RpcError::params(format!(
                        "session/prompt: block {i}: the bytes are {}, not {}",
                        info.media_type, image.mime_type
                    )));
                }
                parts.push(Part::Image(bytes));
            }
            acp::ContentBlock::Image(_) => {
                return Err(RpcError::params(
                    "session/prompt: image blocks are not accepted (this model takes no images)",
                ));
            }
            _ => {
                return Err(RpcError::params(
                    "session/prompt: only text, resource_link and image blocks are accepted",
                ));
            }
        }
    }
    let mut content: Vec<ContentBlock> = Vec::new();
    for part in parts {
        let (text, link) = match part {
            Part::Text(text) => (text, false),
            Part::Link(text) => (text, true),
            Part::Image(bytes) => {
                // Images are admitted only with a store (checked above).
                let Some(store) = store.clone() else { continue };
                let fields = tokio::task::spawn_blocking(move || store.put(&bytes, None))
                    .await
                    .map_err(|e| {
                        RpcError(
                            INTERNAL_ERROR,
                            format!("the image was not kept: {}", chain(&e)),
                        )
                    })?
                    .map_err(|e| RpcError::params(format!("session/prompt: {}", chain(&e))))?;
                content.push(ContentBlock::Image { fields });
                continue;
            }
        };
        // Adjacent text joins one block; a link is set off by a space.
        match content.last_mut() {
            Some(ContentBlock::Text { text: last }) => {
                if link && !last.is_empty() && !last.ends_with(char::is_whitespace) {
                    last.push(' ');
                }
                last.push_str(&text);
            }
            _ => content.push(ContentBlock::text(text)),
        }
    }
    let has_text = content
        .iter()
        .any(|b| matches!(b, ContentBlock::Text { text } if !text.trim().is_empty()));
    if !has_text
        && !content
            .iter()
            .any(|b| matches!(b, ContentBlock::Image { .. }))
    {
        return Err(RpcError::params("session/prompt: the prompt is empty"));
    }
    Ok(Message {
        content,
        ..Message::user_text("")
    })
}

#[cfg(test)]
mod tests {
    use super::{Frame, next_frame};

    /// Every frame of `input` read through a 4-byte buffer with a 6-byte
    /// limit: its kind and, for a line, its bytes.
    async fn frames(input: &[u8]) -> Vec<(Frame, Vec<u8>)> {
        let mut reader = tokio::io::BufReader::with_capacity(4, input);
        let mut buf = Vec::new();
        let mut out = Vec::new();
        while let Some(frame) = next_frame(&mut reader, &mut buf, 6).await.unwrap() {
            assert!(buf.capacity() <= 16, "a long line is never held");
            out.push((frame, buf.clone()));
        }
        out
    }

    #[tokio::test]
    async fn lines_over_the_limit_are_skipped_whole_and_the_next_one_is_read() {
        let got = frames(b"ab\n0123456789abcdef\n\xffx\nlast").await;
        assert_eq!(
            got,
            [
                (Frame::Line, b"ab".to_vec()),
                (Frame::TooLong(16), Vec::new()),
                (Frame::Line, b"\xffx".to_vec()),
                (Frame::Line, b"last".to_vec()),
            ]
        );
        assert_eq!(frames(b"").await, []);
        assert_eq!(frames(b"0123456").await, [(Frame::TooLong(7), Vec::new())]);
    }
}
