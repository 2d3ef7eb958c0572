//! `acp`: a subagent that is another ACP agent process (`dsh acp` itself,
//! or any agent speaking the Agent Client Protocol).
//!
//! The child process is started for each run in the parent's `cwd`, told
//! the parent's permission mode (`DSH_PERMISSION_MODE`, and
//! `DSH_NO_NETWORK=1` when the parent's network is cut — a `dsh acp` child
//! takes them unless its configured arguments name a mode), and driven as an
//! ACP client: `initialize`, `session/new`, then one `session/prompt` per
//! turn. In this runtime the child is an ordinary agent whose model route
//! is that connection (and which offers no tools): each of its model calls
//! sends its latest user message as a prompt and answers with the text the
//! remote agent committed (`agent_message_chunk`). So the child is
//! supervised like any subagent — cancelling or disposing the parent
//! cascades to it — and its connection is registered under the child's
//! own context: disposing the child drops it, which kills the process
//! (and the runtime reaps it).
//!
//! The remote agent's `session/request_permission` asks go to the
//! parent's approval seam; only an allowed-once answer allows. The process
//! dying mid-turn fails the call (`SUBAGENT_EXITED`, never retried), so the
//! run ends with an error result instead of waiting.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_services::approval::{Approval, ApprovalOutcome, ApprovalRequest};
use dsh_services::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmFailure, LlmRequest, TokenUsage,
};
use dsh_services::providers::scripted::chunks_for;
use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, NoMessages};
use futures::future::BoxFuture;
use futures::{FutureExt as _, StreamExt as _};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::{Capabilities, SubagentError, SubagentProvider};
use crate::agent::{Agent, AgentSpec};

/// The failure code of a child process that ended mid-call.
pub const EXITED: &str = "SUBAGENT_EXITED";

/// How long the child may take to answer `initialize` and `session/new`.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// The `acp` provider: the command (and arguments) of the child agent.
pub struct AcpProvider {
    name: String,
    command: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl AcpProvider {
    /// A provider named `name` starting `command args…` per run, with `env`
    /// set in the child's environment.
    pub fn new(
        name: impl Into<String>,
        command: impl Into<PathBuf>,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> AcpProvider {
        AcpProvider {
            name: name.into(),
            command: command.into(),
            args,
            env,
        }
    }
}

impl SubagentProvider for AcpProvider {
    fn name(&self) -> &str {
        &self.name
    }
    /// None: depth, tools, persona and structured output of a remote agent
    /// are not ours to enforce.
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            output_schema: false,
            depth_limit: false,
            tool_filter: false,
            persona: false,
        }
    }
    fn inherits_parent_context(&self) -> bool {
        false
    }
    fn seed(
        &self,
        _parent: &Agent,
    ) -> Result<Option<Vec<dsh_services::session::SessionEvent>>, SubagentError> {
        Ok(None)
    }
    fn remote<'a>(
        &'a self,
        request: &'a super::StartRequest,
        spec: &'a AgentSpec,
    ) -> BoxFuture<'a, Result<Option<super::RemoteLink>, SubagentError>> {
        Box::pin(async move {
            let ctx = request.parent.context()?;
            let policy = spec.permission.unwrap_or_default();
            let mut env = self.env.clone();
            env.push(("DSH_PERMISSION_MODE".into(), policy.mode.to_string()));
            if !policy.network {
                env.push(("DSH_NO_NETWORK".into(), "1".into()));
            }
            let child = AcpChild::start(&self.command, &self.args, &env, &spec.cwd, ctx)
                .await
                .map_err(SubagentError::Start)?;
            Ok(Some(super::RemoteLink {
                adapter: Arc::new(child),
                close: None,
                place: None,
                placed: None,
                node: None,
            }))
        })
    }
}

/// One child process and its ACP session; an LLM adapter to the child
/// agent that stands for it.
pub struct AcpChild {
    inner: Arc<Inner>,
    session: String,
}

struct Inner {
    stdin: tokio::sync::Mutex<tokio::process::ChildStdin>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Result<Value, String>>>>,
    next_id: AtomicU64,
    /// Committed text per session, collected while a prompt runs.
    text: Mutex<String>,
    /// The process ended (stdout closed).
    gone: CancellationToken,
    /// Ends the reader (this value was dropped).
    stop: CancellationToken,
}

impl Drop for AcpChild {
    fn drop(&mut self) {
        // The reader kills and reaps the process.
        self.inner.stop.cancel();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl AcpChild {
    /// Starts the process in `cwd`, initializes it and opens a session;
    /// a failure leaves no process behind.
    async fn start(
        command: &std::path::Path,
        args: &[String],
        env: &[(String, String)],
        cwd: &std::path::Path,
        parent: Context,
    ) -> Result<AcpChild, String> {
        let mut cmd = tokio::process::Command::new(command);
        // The child is an agent with its own keys, never this process's
        // server tokens (it could answer its own approvals).
        for name in dsh_services::sandbox::env::server_tokens() {
            cmd.env_remove(name);
        }
        let mut child = cmd
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", command.display()))?;
        let stdin = child.stdin.take().ok_or("the child has no stdin")?;
        let stdout = child.stdout.take().ok_or("the child has no stdout")?;
        let inner = Arc::new(Inner {
            stdin: tokio::sync::Mutex::new(stdin),
            pending: Mutex::default(),
            next_id: AtomicU64::new(1),
            text: Mutex::default(),
            gone: CancellationToken::new(),
            stop: CancellationToken::new(),
        });
        // The reader is a worker under the parent's scope: supervised, and
        // gone with the parent whatever else happens.
        let reader = ReaderRun {
            inner: inner.clone(),
            child: Some((child, stdout)),
            parent: parent.clone(),
        };
        let name = format!(
            "acp-child/{}",
            crate::session::short(&dsh_services::llm::Message::new_id())
        );
        if let Err(e) = parent
            .spawn(dsh_supervisors::WorkerSpec::new(
                "acp-child",
                name,
                Reader,
                reader,
            ))
            .await
        {
            return Err(format!("cannot supervise the ACP child: {}", chain(&e)));
        }
        let started = async {
            inner
                .call(
                    "initialize",
                    json!({"protocolVersion": 1, "clientCapabilities": {}}),
                )
                .await?;
            let session = inner
                .call("session/new", json!({"cwd": cwd, "mcpServers": []}))
                .await?;
            session["sessionId"]
                .as_str()
                .map(str::to_owned)
                .ok_or_else(|| format!("session/new answered without a sessionId: {session}"))
        };
        let session = match tokio::time::timeout(START_TIMEOUT, started).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                inner.stop.cancel();
                return Err(format!("the ACP child did not start: {e}"));
            }
            Err(_) => {
                inner.stop.cancel();
                return Err("the ACP child did not answer within 60 s".into());
            }
        };
        Ok(AcpChild { inner, session })
    }
}

impl Inner {
    async fn send(&self, frame: Value) -> Result<(), String> {
        let mut line = frame.to_string();
        line.push('\n');
        let mut stdin = self.stdin.lock().await;
        stdin
            .write_all(line.as_bytes())
            .await
            .and(stdin.flush().await)
            .map_err(|e| format!("the child's stdin: {}", chain(&e)))
    }

    /// A request and its result (or error, or the process ending).
    async fn call(&self, method: &str, params: Value) -> Result<Value, String> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await?;
        tokio::select! {
            answer = rx => answer.unwrap_or_else(|_| Err("the child ended".into())),
            () = self.gone.cancelled() => Err("the child ended".into()),
        }
    }
}

/// Reads the child's frames until it ends or the adapter is dropped; then
/// kills and reaps it.
async fn read(
    inner: Arc<Inner>,
    mut child: tokio::process::Child,
    stdout: tokio::process::ChildStdout,
    parent: Context,
) {
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    // Permission asks being answered (each waits for the parent's seam).
    let mut asks = futures::stream::FuturesUnordered::new();
    loop {
        let line = tokio::select! {
            line = lines.next_line() => line,
            Some(()) = asks.next(), if !asks.is_empty() => continue,
            () = inner.stop.cancelled() => break,
        };
        let Ok(Some(line)) = line else { break };
        let Ok(frame) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        match (frame.get("method").and_then(Value::as_str), frame.get("id")) {
            (Some("session/update"), None) => {
                let update = &frame["params"]["update"];
                if update["sessionUpdate"] == "agent_message_chunk"
                    && let Some(text) = update["content"]["text"].as_str()
                {
                    lock(&inner.text).push_str(text);
                }
            }
            (Some("session/request_permission"), Some(id)) => {
                let (inner, parent, id) = (inner.clone(), parent.clone(), id.clone());
                let params = frame["params"].clone();
                asks.push(
                    async move {
                        let outcome = ask_parent(&parent, &params, &inner.stop).await;
                        let option = params["options"].as_array().and_then(|options| {
                            let kind = if outcome == ApprovalOutcome::AllowedOnce {
                                "allow_once"
                            } else {
                                "reject_once"
                            };
                            options
                                .iter()
                                .find(|o| o["kind"] == kind)
                                .map(|o| o["optionId"].clone())
                        });
                        let result = match option {
                            Some(id) => json!({"outcome": {"outcome": "selected", "optionId": id}}),
                            None => json!({"outcome": {"outcome": "cancelled"}}),
                        };
                        let _ = inner
                            .send(json!({"jsonrpc": "2.0", "id": id, "result": result}))
                            .await;
                    }
                    .boxed(),
                );
            }
            (Some(_), Some(id)) => {
                let id = id.clone();
                let _ = inner
                    .send(json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32601, "message": "not supported by this client"}}))
                    .await;
            }
            (None, Some(id)) => {
                let waiter = id.as_u64().and_then(|n| lock(&inner.pending).remove(&n));
                if let Some(waiter) = waiter {
                    let answer = match frame.get("error") {
                        Some(e) => Err(e["message"].as_str().unwrap_or("error").to_owned()),
                        None => Ok(frame.get("result").cloned().unwrap_or(Value::Null)),
                    };
                    let _ = waiter.send(answer);
                }
            }
            _ => {}
        }
    }
    inner.gone.cancel();
    lock(&inner.pending).clear();
    let _ = child.start_kill();
    let _ = tokio::time::timeout(Duration::from_secs(10), child.wait()).await;
}

/// The parent's approval seam's answer to the child's permission request.
async fn ask_parent(parent: &Context, params: &Value, stop: &CancellationToken) -> ApprovalOutcome {
    let Some(approval) = parent.get::<Approval>(Approval::SERVICE) else {
        return ApprovalOutcome::Unavailable;
    };
    let call = &params["toolCall"];
    let request = ApprovalRequest {
        tool: call["title"].as_str().unwrap_or("a remote tool").to_owned(),
        call_id: call["toolCallId"].as_str().map(str::to_owned),
        reason: "the ACP subagent asks to run it".into(),
        arguments: call.get("rawInput").cloned().unwrap_or(Value::Null),
    };
    approval.request(parent, request, stop).await
}

impl LlmAdapter for AcpChild {
    fn name(&self) -> &str {
        "acp-child"
    }

    /// Sends the request's latest user message as one prompt; answers with
    /// what the remote agent committed.
    fn stream(&self, request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
        let inner = self.inner.clone();
        let session = self.session.clone();
        let prompt = crate::subagent::relayed_prompt(&request);
        let answer = async move {
            lock(&inner.text).clear();
            let params =
                json!({"sessionId": session, "prompt": [{"type": "text", "text": prompt}]});
            let done = tokio::select! {
                r = inner.call("session/prompt", params) => r,
                () = cancel.cancelled() => {
                    let cancel = json!({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": session}});
                    let _ = inner.send(cancel).await;
                    return vec![Err(LlmFailure::new(dsh_services::llm::code::ABORTED, "cancelled"))];
                }
            };
            let result = match done {
                Ok(r) => r,
                Err(e) => return vec![Err(LlmFailure::new(EXITED, e))],
            };
            let text = std::mem::take(&mut *lock(&inner.text));
            let finish = match result["stopReason"].as_str() {
                Some("end_turn") | Some("refusal") => FinishReason::Stop,
                Some("max_tokens") => FinishReason::MaxTokens,
                Some("cancelled") => {
                    return vec![Err(LlmFailure::new(
                        dsh_services::llm::code::ABORTED,
                        "the remote turn was cancelled",
                    ))];
                }
                other => {
                    return vec![Err(LlmFailure::new(
                        "SUBAGENT_FAILED",
                        format!("the remote turn ended with {other:?}"),
                    ))];
                }
            };
            chunks_for(&[ContentBlock::text(text)], TokenUsage::default(), finish)
                .into_iter()
                .map(Ok)
                .collect()
        };
        Box::pin(futures::stream::once(answer).flat_map(futures::stream::iter))
    }
}

/// The reader worker.
struct Reader;

struct ReaderRun {
    inner: Arc<Inner>,
    child: Option<(tokio::process::Child, tokio::process::ChildStdout)>,
    parent: Context,
}

impl ractor::Actor for Reader {
    type Msg = NoMessages;
    type State = ReaderRun;
    type Arguments = ReaderRun;

    async fn pre_start(
        &self,
        _me: ractor::ActorRef<NoMessages>,
        run: ReaderRun,
    ) -> Result<ReaderRun, ractor::ActorProcessingErr> {
        Ok(run)
    }

    async fn post_start(
        &self,
        me: ractor::ActorRef<NoMessages>,
        run: &mut ReaderRun,
    ) -> Result<(), ractor::ActorProcessingErr> {
        if let Some((child, stdout)) = run.child.take() {
            read(run.inner.clone(), child, stdout, run.parent.clone()).await;
        }
        me.stop(None);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ractor::ActorRef<NoMessages>,
        run: &mut ReaderRun,
    ) -> Result<(), ractor::ActorProcessingErr> {
        // Stopped from outside first: the process dies with the dropped child.
        run.inner.stop.cancel();
        run.inner.gone.cancel();
        Ok(())
    }
}
