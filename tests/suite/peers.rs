//! Third-party peers no one here wrote: llama.cpp's OpenAI-compatible server
//! on a real (tiny) model, and the aimock fault-injecting mock. Installed by
//! `tests/peers/install.sh` (run by `.ci/run`, and here when missing).

use super::Bounded;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dsh::actors::agent::{Agent, AgentSpec, Agents};
use dsh::kernel::{Runtime, RuntimeSettings};
use dsh::services::approval::{Approval, ApprovalPolicy};
use dsh::services::llm::{LlmRuntime, LlmStream, Message, ToolSchema};
use dsh::services::providers::openai::{OpenAiCompatible, OpenAiConfig, RetryListener};
use dsh::services::session::{EventData, SessionHeader, SessionLog, SurfaceIntent, TurnEndReason};
use dsh::services::tools::{Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Installs the peers if needed; returns their directory.
pub(crate) fn peers() -> PathBuf {
    let out = Command::new("bash")
        .arg(repo().join("tests/peers/install.sh"))
        .bounded_output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "installing the test peers failed (see tests/peers/install.sh):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A peer process, killed when dropped.
struct Peer(Child);

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` and waits (bounded) for a stdout line containing `ready`.
fn start(mut cmd: Command, ready: &str) -> Peer {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the peer starts");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let ready = ready.to_owned();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.contains(&ready) {
                let _ = tx.send(());
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("the peer never said it was ready");
    Peer(child)
}

/// Polls `GET /health` until the model is loaded (the port opens first).
async fn healthy(port: u16) {
    let url = format!("http://127.0.0.1:{port}/health");
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    for _ in 0..600 {
        tick.tick().await;
        if let Ok(body) = http_get(&url).await
            && body.contains("\"ok\"")
        {
            return;
        }
    }
    panic!("llama.cpp never reported healthy");
}

async fn http_get(url: &str) -> Result<String, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let rest = url.trim_start_matches("http://");
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    let mut s = tokio::net::TcpStream::connect(host)
        .await
        .map_err(|e| e.to_string())?;
    s.write_all(format!("GET /{path} HTTP/1.0\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out)
        .await
        .map_err(|e| e.to_string())?;
    Ok(out)
}

async fn runtime(base_url: &str, tools: Vec<Arc<dyn Tool>>, retry: bool) -> Runtime {
    runtime_with(base_url, tools, retry, None).await
}

/// [`runtime`] with the models' context window and a jobs service.
async fn runtime_with(
    base_url: &str,
    tools: Vec<Arc<dyn Tool>>,
    retry: bool,
    context_window: Option<u64>,
) -> Runtime {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let root = rt.root();
    let llm = Arc::new(LlmRuntime::new());
    let registry = Arc::new(ToolRegistry::new());
    root.provide(LlmRuntime::SERVICE, llm.clone()).unwrap();
    root.provide(ToolRegistry::SERVICE, registry.clone())
        .unwrap();
    root.provide(
        Approval::SERVICE,
        Arc::new(Approval::new(ApprovalPolicy::Never)),
    )
    .unwrap();
    let agents = Agents::start(&root, Default::default()).await.unwrap();
    root.provide(Agents::SERVICE, agents).unwrap();
    dsh::services::tools::builtin::install(&root, &registry, Default::default()).unwrap();
    for t in tools {
        registry.register(&root, t).unwrap();
    }
    let adapter = OpenAiCompatible::new(OpenAiConfig {
        base_url: base_url.into(),
        api_key: None,
        idle_timeout: Duration::from_secs(120),
        first_byte_timeout: Duration::from_secs(120),
        total_timeout: Duration::from_secs(600),
        dialect: Default::default(),
        user_id: None,
        images: false,
        attachments: None,
        context_window,
        models: Vec::new(),
        price: None,
    })
    .unwrap();
    llm.register(&root, &["peer"], Arc::new(adapter)).unwrap();
    let jobs = Arc::new(dsh::services::jobs::Jobs::new(Default::default()));
    root.provide(dsh::services::jobs::Jobs::SERVICE, jobs)
        .unwrap();
    if retry {
        RetryListener {
            max_retries: 2,
            initial: Duration::from_millis(20),
            max: Duration::from_millis(100),
        }
        .install(&root)
        .unwrap();
    }
    rt
}

struct Weather;

impl Tool for Weather {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "get_weather".into(),
            description: "Get current weather for a city".into(),
            parameters: serde_json::json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
        }
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> futures::future::BoxFuture<'static, Result<ToolOutput, ToolError>> {
        Box::pin(async move {
            let city = cx.args["city"].as_str().unwrap_or_default().to_lowercase();
            Ok(ToolOutput::text(if city.contains("paris") {
                "18C"
            } else {
                "unknown"
            }))
        })
    }
}

/// Two finished few-shot turns: the model saw two weather questions
/// answered.
fn few_shot() -> Vec<dsh::services::session::SessionEvent> {
    let example = |city: &str, temperature: &str| Example {
        prompt: format!("What is the weather in {city}?"),
        tool: "get_weather",
        arguments: format!("{{\"city\": \"{city}\"}}"),
        result: temperature.to_owned(),
        answer: format!("It is {temperature} in {city}."),
    };
    worked(&[example("London", "11C"), example("Berlin", "14C")])
}

/// One worked example: a prompt, the call it gets, its result, the answer.
struct Example {
    prompt: String,
    tool: &'static str,
    arguments: String,
    result: String,
    answer: String,
}

/// A finished turn per example: a pattern a tiny model follows.
fn worked(examples: &[Example]) -> Vec<dsh::services::session::SessionEvent> {
    use dsh::services::llm::{ContentBlock, MessageSource, Role};
    let mut log = SessionLog::new(SessionHeader::new("few-shot", None));
    let assistant = |content| {
        Arc::new(Message {
            id: Message::new_id(),
            role: Role::Assistant,
            content,
            source: MessageSource::model("peer", "smollm2-135m"),
        })
    };
    // Two worked examples: one is too weak a pattern for a 135M model
    // once every built-in tool's schema is in the prompt.
    let mut events = Vec::new();
    for (turn, ex) in (1..).zip(examples) {
        let id = format!("c{turn}");
        let arguments = ex.arguments.clone();
        let call = ContentBlock::ToolCall {
            id: id.clone(),
            name: ex.tool.into(),
            arguments: arguments.clone(),
        };
        events.extend([
            (EventData::TurnStart { turn }, None),
            (EventData::StepStart { turn, step: 1 }, None),
            (
                EventData::UserMessage(Arc::new(Message::user_text(ex.prompt.clone()))),
                Some(SurfaceIntent::append()),
            ),
            (
                EventData::AssistantMessage {
                    turn,
                    step: 1,
                    message: assistant(vec![call]),
                    usage: None,
                    interrupted: false,
                },
                Some(SurfaceIntent::append()),
            ),
            (
                EventData::tool_call(turn, 1, &id, ex.tool, &arguments),
                None,
            ),
            (
                EventData::ToolResult {
                    turn,
                    step: 1,
                    message: Arc::new(Message {
                        id: Message::new_id(),
                        role: Role::User,
                        content: vec![ContentBlock::ToolResult {
                            tool_call_id: id.clone(),
                            content: vec![ContentBlock::text(ex.result.clone())],
                            is_error: Some(false),
                        }],
                        source: MessageSource::tool(&id),
                    }),
                    error: None,
                    meta: None,
                },
                Some(SurfaceIntent::append()),
            ),
            (EventData::StepEnd { turn, step: 1 }, None),
            (EventData::StepStart { turn, step: 2 }, None),
            (
                EventData::AssistantMessage {
                    turn,
                    step: 2,
                    message: assistant(vec![ContentBlock::text(ex.answer.clone())]),
                    usage: None,
                    interrupted: false,
                },
                Some(SurfaceIntent::append()),
            ),
            (EventData::StepEnd { turn, step: 2 }, None),
            (
                EventData::TurnEnd {
                    turn,
                    reason: Box::new(TurnEndReason::Completed),
                },
                None,
            ),
        ]);
    }
    for (data, intent) in events {
        log.append(data, intent, 0).unwrap();
    }
    log.iter().map(|e| e.as_ref().clone()).collect()
}

/// llama.cpp's server on SmolLM2, healthy; its port.
async fn llama() -> (Peer, u16) {
    let dir = peers();
    let port = free_port();
    let mut cmd = Command::new(dir.join("venv/bin/python"));
    cmd.arg(repo().join("tests/peers/serve_llama.py"))
        .args(["--port", &port.to_string(), "--template"])
        .arg(repo().join("tests/peers/chatml_tools.jinja"));
    let server = start(cmd, "READY");
    healthy(port).await;
    (server, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_llama_server_drives_a_tool_calling_turn() {
    let _sweep = crate::suite::sweep();
    let (_server, port) = llama().await;
    // With the retry listener, as `agent-services` configures it: a pooled
    // connection the server already closed is retried, not fatal.
    let rt = runtime(
        &format!("http://127.0.0.1:{port}/v1"),
        vec![Arc::new(Weather)],
        true,
    )
    .await;
    // A tiny model needs to be told when to call a tool: `required` while the
    // last message is the user's question, `none` once the result is in.
    rt.root()
        .on_waterfall(|mut call: LlmStream, next| async move {
            let after_tool = call.request.messages.last().is_some_and(|m| {
                m.content
                    .iter()
                    .any(|b| matches!(b, dsh::services::llm::ContentBlock::ToolResult { .. }))
            });
            let choice = if after_tool { "none" } else { "required" };
            call.request
                .options
                .insert("tool_choice".into(), choice.into());
            next.run(call).await
        })
        .unwrap();
    let mut spec = AgentSpec::new("peer", "smollm2-135m", std::env::temp_dir());
    spec.temperature = Some(0.0);
    spec.max_tokens = Some(64);
    spec.max_steps = 4;
    spec.seed = Some(Box::new((
        SessionHeader::new(Message::new_id(), None),
        few_shot(),
    )));
    let agent = Agent::create(&rt.root(), spec).await.unwrap();
    let summary = agent
        .run("What is the weather in Paris?", Duration::from_secs(300))
        .await
        .unwrap();
    assert_eq!(summary.reason, TurnEndReason::Completed, "{summary:?}");
    let events = agent.session().events();
    let (name, args) = events
        .iter()
        .rev()
        .find_map(|e| match &e.data {
            EventData::ToolCall { call, .. } => {
                Some((call.name.to_string(), call.arguments.to_string()))
            }
            _ => None,
        })
        .expect("the model called a tool");
    assert_eq!(name, "get_weather");
    let args: serde_json::Value = serde_json::from_str(&args).unwrap();
    assert!(
        args["city"]
            .as_str()
            .unwrap()
            .to_lowercase()
            .contains("paris"),
        "{args}"
    );
    assert!(!summary.text.trim().is_empty());
    assert_eq!(summary.steps, 2);
    rt.shutdown().await;
}

/// The real model, a context window far too small for the seeded history:
/// the turn starts a background job through the real `bash` tool, the
/// history before it is summarised by the model itself (a `compaction`
/// request), the next request carries that summary, and the job runs on
/// until its agent is disposed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_llama_server_runs_a_turn_with_a_background_job_and_a_compaction() {
    let _sweep = crate::suite::sweep();
    use dsh::services::llm::ContentBlock;
    let (_server, port) = llama().await;
    let rt = runtime_with(
        &format!("http://127.0.0.1:{port}/v1"),
        vec![],
        true,
        // Past the seeded history's ~100 tokens, short of the first
        // answer's reported prompt (the bash schema alone is ~500): the
        // first step runs on the worked examples, the second compacts.
        Some(400),
    )
    .await;
    // A 135M model is steered, not scripted: two worked examples, only
    // `bash` offered while the prompt is last, text once the result is in;
    // a summary is kept short.
    let bash = dsh::services::tools::builtin::Bash.schema();
    // Each request's purpose and first message.
    type Seen = Vec<(Option<&'static str>, String)>;
    let seen: Arc<std::sync::Mutex<Seen>> = Arc::default();
    let log = seen.clone();
    rt.root()
        .on_waterfall(move |mut call: LlmStream, next| {
            let log = log.clone();
            let bash = bash.clone();
            async move {
                let r = &mut call.request;
                let first = r
                    .messages
                    .iter()
                    .next()
                    .map(|m| m.text())
                    .unwrap_or_default();
                log.lock().unwrap().push((r.purpose, first));
                if r.purpose == Some("compaction") {
                    r.max_tokens = Some(48);
                    return next.run(call).await;
                }
                let after_tool = r.messages.last().is_some_and(|m| {
                    m.content
                        .iter()
                        .any(|b| matches!(b, ContentBlock::ToolResult { .. }))
                });
                if after_tool {
                    r.options.insert("tool_choice".into(), "none".into());
                } else {
                    r.tools = Arc::from([bash.clone()]);
                    r.options.insert("tool_choice".into(), "required".into());
                }
                next.run(call).await
            }
        })
        .unwrap();
    let workspace = dsh::kernel::scratch::fresh_dir("dsh-llama-jobs").unwrap();
    let mut spec = AgentSpec::new("peer", "smollm2-135m", workspace);
    spec.temperature = Some(0.0);
    spec.max_tokens = Some(48);
    spec.max_steps = 4;
    let example = |turn: u32, command: &str| {
        Example {
        prompt: format!("Run `{command}` in the background."),
        tool: "bash",
        arguments: serde_json::json!({"command": command, "description": "wait", "run_in_background": true})
            .to_string(),
        result: format!("started background job bash-{turn}: {command}"),
        answer: "Started.".into(),
    }
    };
    spec.seed = Some(Box::new((
        SessionHeader::new(Message::new_id(), None),
        worked(&[example(1, "sleep 11.5"), example(2, "sleep 23.25")]),
    )));
    let agent = Agent::create(&rt.root(), spec).await.unwrap();
    let summary = agent
        .run(
            "Run `sleep 84.2468` in the background.",
            Duration::from_secs(300),
        )
        .await
        .unwrap();
    assert_eq!(summary.reason, TurnEndReason::Completed, "{summary:?}");
    // The background job, started by the real tool, runs.
    let jobs = rt
        .root()
        .get::<dsh::services::jobs::Jobs>(dsh::services::jobs::Jobs::SERVICE)
        .unwrap();
    let listed = jobs.list(Some(agent.id()));
    let told: Vec<String> = agent
        .session()
        .events()
        .iter()
        .filter(|e| matches!(e.kind(), "tool/call" | "tool/result" | "assistant/message"))
        .map(|e| e.to_json().to_string())
        .collect();
    assert_eq!(listed.len(), 1, "{told:#?}");
    assert!(super::running("84.2468"), "the job's command runs");
    let events = agent.session().events();
    let started = events.iter().any(|e| match &e.data {
        EventData::ToolResult { message, .. } => {
            message.text().contains("started background job bash-1")
                || serde_json::to_string(&message.content)
                    .unwrap()
                    .contains("started background job bash-1")
        }
        _ => false,
    });
    assert!(started, "the tool result names the job");
    // The compaction: logged start → summary → replacing message → end,
    // with no error, and the request after it opens with the summary.
    let kinds: Vec<&str> = events
        .iter()
        .map(|e| e.kind())
        .filter(|k| k.starts_with("compaction/"))
        .collect();
    assert_eq!(
        &kinds[..3],
        ["compaction/start", "compaction/summary", "compaction/end"],
        "{kinds:?}"
    );
    let end = events
        .iter()
        .find(|e| e.kind() == "compaction/end")
        .unwrap()
        .to_json();
    assert!(end["data"].get("error").is_none(), "{end}");
    let seen = seen.lock().unwrap().clone();
    let at = seen
        .iter()
        .position(|(p, _)| *p == Some("compaction"))
        .expect("a compaction request");
    assert!(seen[0].1.contains("sleep 11.5"), "{seen:?}");
    let (purpose, first) = &seen[at + 1];
    assert_eq!(*purpose, None);
    assert!(first.starts_with("Summary of the conversation"), "{first}");
    // Disposing the agent ends its job.
    agent.dispose().await;
    super::until("the job outlived its agent", || !super::running("84.2468")).await;
    rt.shutdown().await;
}

async fn aimock() -> (Peer, String) {
    let dir = peers();
    let port = free_port();
    let mut cmd = Command::new("node");
    cmd.arg(dir.join("npm/node_modules/@copilotkit/aimock/dist/cli.js"))
        .args(["-p", &port.to_string(), "--strict", "-f"])
        .arg(repo().join("tests/peers/aimock/faults.json"));
    let peer = start(cmd, "listening on");
    (peer, format!("http://127.0.0.1:{port}/v1"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aimock_tool_turns_and_faults_end_or_retry_the_turn_as_the_contract_says() {
    let _sweep = crate::suite::sweep();
    let (_mock, url) = aimock().await;
    let rt = runtime(&url, vec![], true).await;
    let workspace = dsh::kernel::scratch::fresh_dir("dsh-aimock").unwrap();
    std::fs::write(workspace.join("note.txt"), "the note says hi\n").unwrap();
    let agent = |rt: Runtime, ws: PathBuf| async move {
        Agent::create(&rt.root(), AgentSpec::new("peer", "mock", ws))
            .await
            .unwrap()
    };

    // A full tool-calling turn against the mock.
    let a = agent(rt.clone(), workspace.clone()).await;
    let s = a
        .run("read the note", Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(
        (s.reason.clone(), s.text.as_str(), s.steps),
        (TurnEndReason::Completed, "The note says hi.", 2)
    );

    // 429 then success: retried by the llm/stream listener, the turn completes.
    let a = agent(rt.clone(), workspace.clone()).await;
    let s = a.run("fault-429", Duration::from_secs(60)).await.unwrap();
    assert_eq!(
        (s.reason.clone(), s.text.as_str()),
        (TurnEndReason::Completed, "recovered after a rate limit")
    );

    // A dropped connection, every time: retried, then the turn ends with the error.
    let a = agent(rt.clone(), workspace.clone()).await;
    let s = a
        .run("fault-disconnect", Duration::from_secs(60))
        .await
        .unwrap();
    let TurnEndReason::Error { error } = s.reason else {
        panic!("{s:?}")
    };
    assert!(error.code.starts_with("CONNECTION"), "{error:?}");

    // A malformed body is not retried and ends the turn with its code.
    let a = agent(rt.clone(), workspace.clone()).await;
    let s = a
        .run("fault-malformed", Duration::from_secs(60))
        .await
        .unwrap();
    let TurnEndReason::Error { error } = s.reason else {
        panic!("{s:?}")
    };
    assert_eq!(error.code, "MALFORMED_RESPONSE", "{error:?}");
    rt.shutdown().await;
}
