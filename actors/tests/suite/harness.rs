//! A runtime with the llm, tools, approval and agents services, test tools,
//! and helpers to read a session back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec, Agents, Hibernation};
use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::{LlmAdapter, LlmRuntime, ToolSchema};
use dsh_services::providers::scripted::{ScriptStep, ScriptedCall, ScriptedModel};
use dsh_services::session::EventData;
use dsh_services::tools::{Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};
use dsh_supervisors::{Runtime, RuntimeSettings};
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Barrier;

pub struct Harness {
    pub rt: Runtime,
    pub llm: Arc<LlmRuntime>,
    pub tools: Arc<ToolRegistry>,
    pub approval: Arc<Approval>,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Harness {
    pub async fn new() -> Harness {
        Harness::hibernating(Hibernation::default()).await
    }

    /// A harness whose agents hibernate as `policy` says.
    pub async fn hibernating(policy: Hibernation) -> Harness {
        let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
        let root = rt.root();
        let llm = Arc::new(LlmRuntime::new());
        let tools = Arc::new(ToolRegistry::new());
        let approval = Arc::new(Approval::new(ApprovalPolicy::Ask));
        root.provide(LlmRuntime::SERVICE, llm.clone()).unwrap();
        root.provide(ToolRegistry::SERVICE, tools.clone()).unwrap();
        root.provide(Approval::SERVICE, approval.clone()).unwrap();
        let agents = Agents::start(&root, policy).await.unwrap();
        root.provide(Agents::SERVICE, agents).unwrap();
        let log: Arc<Mutex<Vec<String>>> = Arc::default();
        let barrier = Arc::new(Barrier::new(2));
        tools.register(&root, Arc::new(Echo)).unwrap();
        tools.register(&root, Arc::new(Meet { barrier })).unwrap();
        tools
            .register(&root, Arc::new(Record { log: log.clone() }))
            .unwrap();
        tools.register(&root, Arc::new(Hang)).unwrap();
        tools.register(&root, Arc::new(Boom)).unwrap();
        Harness {
            rt,
            llm,
            tools,
            approval,
            log,
        }
    }

    pub fn script(&self, provider: &str, steps: Vec<ScriptStep>) {
        self.adapter(provider, Arc::new(ScriptedModel::new(steps)));
    }

    pub fn adapter(&self, provider: &str, adapter: Arc<dyn LlmAdapter>) {
        self.llm
            .register(&self.rt.root(), &[provider], adapter)
            .unwrap();
    }

    pub async fn agent(&self, provider: &str) -> Agent {
        Agent::create(
            &self.rt.root(),
            AgentSpec::new(provider, "test-model", std::env::temp_dir()),
        )
        .await
        .unwrap()
    }

    pub fn lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

pub fn text(t: &str) -> ScriptStep {
    ScriptStep {
        text: Some(t.into()),
        ..ScriptStep::default()
    }
}

pub fn calls(list: &[(&str, serde_json::Value)]) -> ScriptStep {
    ScriptStep {
        tool_calls: list
            .iter()
            .enumerate()
            .map(|(i, (name, args))| ScriptedCall {
                name: (*name).into(),
                arguments: args.clone(),
                id: Some(format!("call_{name}_{i}")),
            })
            .collect(),
        ..ScriptStep::default()
    }
}

/// The event types of a session, in order.
pub fn kinds(agent: &Agent) -> Vec<String> {
    agent
        .session()
        .events()
        .iter()
        .map(|e| e.kind().to_owned())
        .collect()
}

/// The tool results of a session: (call id, is_error, text).
pub fn results(agent: &Agent) -> Vec<(String, Option<String>, String)> {
    agent
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::ToolResult { message, error, .. } => {
                let (id, text) = match &message.content[0] {
                    dsh_services::llm::ContentBlock::ToolResult {
                        tool_call_id,
                        content,
                        ..
                    } => (
                        tool_call_id.clone(),
                        content
                            .iter()
                            .filter_map(|b| match b {
                                dsh_services::llm::ContentBlock::Text { text } => {
                                    Some(text.as_str())
                                }
                                _ => None,
                            })
                            .collect::<String>(),
                    ),
                    _ => panic!("not a tool result"),
                };
                Some((id, error.as_ref().map(|e| e.code.clone()), text))
            }
            _ => None,
        })
        .collect()
}

pub const WAIT: Duration = Duration::from_secs(20);

fn schema(name: &str, props: serde_json::Value, required: &[&str]) -> ToolSchema {
    ToolSchema {
        name: name.into(),
        description: format!("test tool {name}"),
        parameters: serde_json::json!({"type": "object", "properties": props, "required": required, "additionalProperties": false}),
    }
}

/// `echo(i)` → "<i>"; concurrency-safe.
pub struct Echo;
impl Tool for Echo {
    fn schema(&self) -> ToolSchema {
        schema(
            "echo",
            serde_json::json!({"i": {"type": "integer"}}),
            &["i"],
        )
    }
    fn is_concurrency_safe(&self) -> bool {
        true
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move { Ok(ToolOutput::text(cx.args["i"].to_string())) }.boxed()
    }
}

/// Completes only when two calls run at the same time.
pub struct Meet {
    barrier: Arc<Barrier>,
}
impl Tool for Meet {
    fn schema(&self) -> ToolSchema {
        schema("meet", serde_json::json!({}), &[])
    }
    fn is_concurrency_safe(&self) -> bool {
        true
    }
    fn execute(
        self: Arc<Self>,
        _cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            self.barrier.wait().await;
            Ok(ToolOutput::text("met"))
        }
        .boxed()
    }
}

/// Exclusive: logs its start and end.
pub struct Record {
    log: Arc<Mutex<Vec<String>>>,
}
impl Tool for Record {
    fn schema(&self) -> ToolSchema {
        schema(
            "record",
            serde_json::json!({"tag": {"type": "string"}}),
            &["tag"],
        )
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let tag = cx.args["tag"].as_str().unwrap_or("").to_owned();
            self.log.lock().unwrap().push(format!("start {tag}"));
            tokio::task::yield_now().await;
            self.log.lock().unwrap().push(format!("end {tag}"));
            Ok(ToolOutput::text(tag))
        }
        .boxed()
    }
}

/// Waits until cancelled.
pub struct Hang;
impl Tool for Hang {
    fn schema(&self) -> ToolSchema {
        schema("hang", serde_json::json!({}), &[])
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            cx.cancel.cancelled().await;
            Err(ToolError::new("ABORTED", "hang was cancelled"))
        }
        .boxed()
    }
}

/// Panics.
pub struct Boom;
impl Tool for Boom {
    fn schema(&self) -> ToolSchema {
        schema("boom", serde_json::json!({}), &[])
    }
    fn execute(
        self: Arc<Self>,
        _cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move { panic!("the boom tool exploded") }.boxed()
    }
}

/// Parks until cancelled, counting parked calls in a watch channel.
pub struct Park {
    pub parked: tokio::sync::watch::Sender<usize>,
}

impl Tool for Park {
    fn schema(&self) -> ToolSchema {
        schema("park", serde_json::json!({}), &[])
    }
    fn is_concurrency_safe(&self) -> bool {
        true
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            self.parked.send_modify(|n| *n += 1);
            cx.cancel.cancelled().await;
            Err(ToolError::new("ABORTED", "park was cancelled"))
        }
        .boxed()
    }
}

/// The prompt of the turn a request belongs to: the last user-sourced message.
pub fn prompt_of(request: &dsh_services::llm::LlmRequest) -> String {
    request
        .messages
        .iter()
        .rev()
        .find(|m| m.source.kind == "user")
        .map(|m| m.text())
        .unwrap_or_default()
}

/// A stream answering `blocks` (tool calls finish as `tool-calls`).
pub fn answer(blocks: Vec<dsh_services::llm::ContentBlock>) -> dsh_services::llm::ChunkStream {
    let finish = if blocks
        .iter()
        .any(|b| matches!(b, dsh_services::llm::ContentBlock::ToolCall { .. }))
    {
        dsh_services::llm::FinishReason::ToolCalls
    } else {
        dsh_services::llm::FinishReason::Stop
    };
    let chunks = dsh_services::providers::scripted::chunks_for(&blocks, Default::default(), finish);
    Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
}
