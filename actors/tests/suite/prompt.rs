//! System prompt assembly inside the agent loop, and the agent's events.

use std::sync::{Arc, Mutex};

use dsh_actors::agent::{Agent, AgentRequest, AgentSpec, AgentTurnStopping};
use dsh_services::prompt::{
    PromptAssembly, PromptError, PromptSection, SystemPrompt, SystemPromptAssemble, Text, render,
};
use dsh_services::session::EventData;
use dsh_supervisors::registry::RegisterError;

use super::harness::{Harness, WAIT, text};

fn section(name: &str, order: i32, body: &str) -> PromptSection {
    PromptSection {
        name: name.into(),
        order,
        text: Text::Static(body.into()),
        complete: false,
    }
}

fn headers(agent: &Agent) -> Vec<(String, String)> {
    agent
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::RequestHeader { header, reason } => Some((
                reason.clone(),
                header["system"].as_str().unwrap_or("").to_owned(),
            )),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sections_and_variables_assemble_with_scoped_shadowing() {
    let h = Harness::new().await;
    let root = h.rt.root();
    let prompt = Arc::new(SystemPrompt::new());
    root.provide(SystemPrompt::SERVICE, prompt.clone()).unwrap();
    prompt
        .section(&root, section("identity", -100, "You are dsh."))
        .unwrap();
    prompt
        .section(&root, section("tools", 100, "Work in {{workspace}}."))
        .unwrap();
    prompt
        .variable(&root, "workspace", Text::Static("/srv/app".into()))
        .unwrap();
    assert!(
        prompt
            .variable(&root, "Bad-Name", Text::Static(String::new()))
            .is_err()
    );
    assert!(matches!(
        prompt.section(&root, section("identity", 1, "again")),
        Err(RegisterError::Taken {
            what: "prompt section",
            ..
        })
    ));

    h.script("scripted", vec![text("one"), text("two")]);
    let mut spec = AgentSpec::new("scripted", "m", std::env::temp_dir());
    spec.system = Some("Be terse.".into());
    let agent = Agent::create(&root, spec).await.unwrap();
    agent.run("a", WAIT).await.unwrap();
    // The agent's persona (order 0) sits between identity and tools.
    assert_eq!(
        headers(&agent),
        [(
            "initial".to_owned(),
            "You are dsh.\n\nBe terse.\n\nWork in /srv/app.".to_owned()
        )]
    );

    // A scoped variable shadows the global one for this agent only: the
    // header is logged again with reason `change`.
    prompt
        .variable(
            &agent.context().unwrap(),
            "workspace",
            Text::Static("/tmp/agent".into()),
        )
        .unwrap();
    agent.run("b", WAIT).await.unwrap();
    let h2 = headers(&agent);
    assert_eq!(h2.len(), 2);
    assert_eq!(
        h2[1],
        (
            "change".to_owned(),
            "You are dsh.\n\nBe terse.\n\nWork in /tmp/agent.".to_owned()
        )
    );
    let other = Agent::create(&root, AgentSpec::new("scripted", "m", std::env::temp_dir()))
        .await
        .unwrap();
    assert_eq!(
        prompt.assemble(&other.context().unwrap()).await.unwrap(),
        "You are dsh.\n\nWork in /srv/app."
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_assemble_waterfall_and_a_complete_section_decide_the_prompt() {
    let h = Harness::new().await;
    let root = h.rt.root();
    let prompt = Arc::new(SystemPrompt::new());
    root.provide(SystemPrompt::SERVICE, prompt.clone()).unwrap();
    prompt.section(&root, section("a", 0, "alpha")).unwrap();
    root.on_waterfall(|mut e: SystemPromptAssemble, next| async move {
        e.assembly
            .sections
            .push(("added".into(), 50, "added by a listener".into()));
        next.run(e).await
    })
    .unwrap();
    assert_eq!(
        prompt.assemble(&root).await.unwrap(),
        "alpha\n\nadded by a listener"
    );
    let scope = root
        .scope(dsh_supervisors::ScopeKey::new("s"))
        .await
        .unwrap();
    prompt
        .section(
            scope.ctx(),
            PromptSection {
                name: "all".into(),
                order: 0,
                text: Text::Static("the whole prompt".into()),
                complete: true,
            },
        )
        .unwrap();
    assert_eq!(
        prompt.assemble(scope.ctx()).await.unwrap(),
        "the whole prompt"
    );
    let missing = PromptAssembly {
        sections: vec![("x".into(), 0, "uses {{nope}}".into())],
        variables: Default::default(),
    };
    let err = render(&missing).unwrap_err();
    assert!(
        matches!(&err, PromptError::UnknownVariable { section, variable } if section == "x" && variable == "nope")
    );
    assert_eq!(
        err.to_string(),
        "prompt section `x` references {{nope}}, which no variable provides"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turn_stopping_can_continue_a_turn_and_agent_request_can_rewrite_it() {
    let h = Harness::new().await;
    let root = h.rt.root();
    let continued = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let c = continued.clone();
    root.on_serial(move |e: Arc<AgentTurnStopping>| {
        let c = c.clone();
        async move {
            (e.text == "first" && !c.swap(true, std::sync::atomic::Ordering::SeqCst))
                .then(|| "keep going".to_owned())
        }
    })
    .unwrap();
    root.on_waterfall(|mut r: AgentRequest, next| async move {
        r.request.temperature = Some(0.25);
        next.run(r).await
    })
    .unwrap();
    let seen_temperature = Arc::new(std::sync::Mutex::new(Vec::new()));
    let st = seen_temperature.clone();
    root.on_waterfall(move |call: dsh_services::llm::LlmStream, next| {
        st.lock().unwrap().push(call.request.temperature);
        next.run(call)
    })
    .unwrap();
    h.script("scripted", vec![text("first"), text("second")]);
    let agent = h.agent("scripted").await;
    let summary = agent.run("go", WAIT).await.unwrap();
    assert_eq!((summary.text.as_str(), summary.steps), ("second", 2));
    let continuation = agent
        .session()
        .events()
        .iter()
        .find_map(|e| match &e.data {
            EventData::UserMessage(m) if m.source.kind == "plugin" => Some(m.text()),
            _ => None,
        })
        .unwrap();
    assert_eq!(continuation, "keep going");
    assert_eq!(*seen_temperature.lock().unwrap(), [Some(0.25), Some(0.25)]);
}

/// A route that supplies defaults (DeepSeek's effort and output cap) and
/// records what it is sent.
struct Defaulting {
    sent: Mutex<Vec<(Option<u64>, Option<serde_json::Value>)>>,
    steps: Mutex<Vec<dsh_services::llm::ContentBlock>>,
}

impl dsh_services::llm::LlmAdapter for Defaulting {
    fn name(&self) -> &str {
        "defaulting"
    }
    fn defaults(&self, _model: &str) -> dsh_services::llm::ModelDefaults {
        dsh_services::llm::ModelDefaults {
            reasoning_effort: Some("high"),
            max_tokens: Some(4096),
            context_window: Some(64_000),
            ..Default::default()
        }
    }
    fn stream(
        &self,
        request: dsh_services::llm::LlmRequest,
        _cancel: tokio_util::sync::CancellationToken,
    ) -> dsh_services::llm::ChunkStream {
        self.sent.lock().unwrap().push((
            request.max_tokens,
            request.options.get("reasoning_effort").cloned(),
        ));
        let next = self.steps.lock().unwrap().remove(0);
        super::harness::answer(vec![next])
    }
}

/// The effort and output cap a request carries are logged in
/// `request/header`: the route's defaults marked `adapterDefaults` (and
/// written into the request itself), a step's own effort from
/// `agent/request` as a `change`; the route's context window goes to
/// `request/context`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_effective_effort_and_cap_are_logged_in_the_request_header() {
    let h = Harness::new().await;
    let adapter = Arc::new(Defaulting {
        sent: Mutex::default(),
        steps: Mutex::new(vec![
            dsh_services::llm::ContentBlock::ToolCall {
                id: "c1".into(),
                name: "echo".into(),
                arguments: r#"{"text":"x"}"#.into(),
            },
            dsh_services::llm::ContentBlock::text("done"),
        ]),
    });
    h.adapter("deep", adapter.clone());
    // The second step thinks harder.
    let steps = Arc::new(std::sync::atomic::AtomicU32::new(0));
    h.rt.root()
        .on_waterfall(move |mut r: AgentRequest, next| {
            if steps.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1 {
                r.request
                    .options
                    .insert("reasoning_effort".into(), serde_json::json!("max"));
            }
            next.run(r)
        })
        .unwrap();
    let agent = h.agent("deep").await;
    let summary = agent.run("go", WAIT).await.unwrap();
    assert_eq!(summary.text, "done");
    assert_eq!(
        *adapter.sent.lock().unwrap(),
        [
            (Some(4096), Some(serde_json::json!("high"))),
            (Some(4096), Some(serde_json::json!("max"))),
        ]
    );
    let events = agent.session().events();
    let headers: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.data {
            EventData::RequestHeader { header, reason } => Some((header.clone(), reason.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(headers.len(), 2, "{headers:?}");
    let (first, reason) = &headers[0];
    assert_eq!(reason, "initial");
    assert_eq!(first["config"]["reasoningEffort"], "high");
    assert_eq!(first["config"]["maxTokens"], 4096);
    assert_eq!(
        first["adapterDefaults"],
        serde_json::json!({"reasoningEffort": true, "maxTokens": true})
    );
    let (second, reason) = &headers[1];
    assert_eq!(reason, "change");
    assert_eq!(second["config"]["reasoningEffort"], "max");
    assert_eq!(
        second["adapterDefaults"],
        serde_json::json!({"maxTokens": true})
    );
    let window = events.iter().find_map(|e| match &e.data {
        EventData::RequestContext(c) => Some(c.context_window),
        _ => None,
    });
    assert_eq!(window, Some(Some(64_000)));
}

/// A route with a small context window whose answers report large usage;
/// it answers a compaction request with a summary (or fails it).
struct Crowded {
    sent: Mutex<Vec<dsh_services::llm::LlmRequest>>,
    fail_summary: bool,
}

impl dsh_services::llm::LlmAdapter for Crowded {
    fn name(&self) -> &str {
        "crowded"
    }
    fn defaults(&self, _model: &str) -> dsh_services::llm::ModelDefaults {
        dsh_services::llm::ModelDefaults {
            context_window: Some(1000),
            ..Default::default()
        }
    }
    fn stream(
        &self,
        request: dsh_services::llm::LlmRequest,
        _cancel: tokio_util::sync::CancellationToken,
    ) -> dsh_services::llm::ChunkStream {
        let compaction = request.purpose == Some("compaction");
        self.sent.lock().unwrap().push(request);
        if compaction && self.fail_summary {
            return Box::pin(futures::stream::iter([Err(
                dsh_services::llm::LlmFailure::new("SERVER_ERROR", "no summary today"),
            )]));
        }
        let text = if compaction {
            "SUMMARY: the user said first"
        } else {
            "answered"
        };
        let usage = dsh_services::llm::TokenUsage {
            input_tokens: 900,
            output_tokens: 10,
            ..Default::default()
        };
        let chunks = dsh_services::providers::scripted::chunks_for(
            &[dsh_services::llm::ContentBlock::text(text)],
            usage,
            dsh_services::llm::FinishReason::Stop,
        );
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

/// Near the context window, the turns before the running one become one
/// summary (a `compaction` request), logged start → summary → replacing
/// user message → end; the next request carries the summary, not the old
/// turns. A failed summary is logged and replaces nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn history_is_compacted_before_the_window_fills() {
    for fail_summary in [false, true] {
        let h = Harness::new().await;
        let adapter = Arc::new(Crowded {
            sent: Mutex::default(),
            fail_summary,
        });
        h.adapter("c", adapter.clone());
        let agent = h.agent("c").await;
        agent.run("first", WAIT).await.unwrap();
        // The meter: the answer's reported 910 tokens, nothing since.
        assert_eq!(agent.context_tokens(), Some(910));
        let second = agent.run("second", WAIT).await.unwrap();
        assert_eq!(second.text, "answered");
        let sent = adapter.sent.lock().unwrap().clone();
        let purposes: Vec<_> = sent.iter().map(|r| r.purpose).collect();
        assert_eq!(purposes, [None, Some("compaction"), None], "{fail_summary}");
        let texts = |r: &dsh_services::llm::LlmRequest| -> Vec<String> {
            r.messages.iter().map(|m| m.text()).collect()
        };
        // The summary request reads the earlier turn and an instruction.
        let asked = texts(&sent[1]);
        assert_eq!(asked[0], "first");
        assert!(
            asked
                .last()
                .unwrap()
                .starts_with("Summarise the conversation")
        );
        let kinds: Vec<String> = agent
            .session()
            .events()
            .iter()
            .map(|e| e.kind().to_owned())
            .filter(|k| k.starts_with("compaction/") || k == "user/message")
            .collect();
        let last = texts(&sent[2]);
        if fail_summary {
            assert_eq!(
                kinds,
                [
                    "user/message",
                    "user/message",
                    "compaction/start",
                    "compaction/end"
                ]
            );
            assert_eq!(last, ["first", "answered", "second"]);
            let end = agent
                .session()
                .events()
                .into_iter()
                .find(|e| e.kind() == "compaction/end")
                .unwrap();
            assert!(
                end.to_json()["data"]["error"]
                    .as_str()
                    .unwrap()
                    .contains("no summary today")
            );
        } else {
            assert_eq!(
                kinds,
                [
                    "user/message",
                    "user/message",
                    "compaction/start",
                    "compaction/summary",
                    "user/message",
                    "compaction/end"
                ]
            );
            assert_eq!(last.len(), 2, "{last:?}");
            assert!(last[0].contains("SUMMARY: the user said first"), "{last:?}");
            assert_eq!(last[1], "second");
        }
        h.rt.shutdown().await;
    }
}

/// A route with a 4,000-token window whose answers report what they read
/// (a quarter token per character): a prompt `fill N` makes it call
/// `big {n: N}`; a tool result or another prompt makes it answer; a
/// compaction request gets a summary.
struct Metered {
    sent: Mutex<Vec<dsh_services::llm::LlmRequest>>,
}

fn text_of(blocks: &[dsh_services::llm::ContentBlock]) -> String {
    use dsh_services::llm::ContentBlock;
    blocks
        .iter()
        .map(|b| match b {
            ContentBlock::Text { text } => text.clone(),
            ContentBlock::ToolCall { arguments, .. } => arguments.clone(),
            ContentBlock::ToolResult { content, .. } => text_of(content),
            _ => String::new(),
        })
        .collect()
}

/// The tool results a request carries, as text.
fn results_sent(r: &dsh_services::llm::LlmRequest) -> String {
    r.messages
        .iter()
        .filter(|m| {
            m.content
                .iter()
                .any(|b| matches!(b, dsh_services::llm::ContentBlock::ToolResult { .. }))
        })
        .map(|m| text_of(&m.content))
        .collect()
}

impl dsh_services::llm::LlmAdapter for Metered {
    fn name(&self) -> &str {
        "metered"
    }
    fn defaults(&self, _model: &str) -> dsh_services::llm::ModelDefaults {
        dsh_services::llm::ModelDefaults {
            context_window: Some(4000),
            ..Default::default()
        }
    }
    fn stream(
        &self,
        request: dsh_services::llm::LlmRequest,
        _cancel: tokio_util::sync::CancellationToken,
    ) -> dsh_services::llm::ChunkStream {
        use dsh_services::llm::{ContentBlock, FinishReason, Role, TokenUsage};
        let read: usize = request
            .messages
            .iter()
            .map(|m| text_of(&m.content).len())
            .sum();
        let usage = TokenUsage {
            input_tokens: read.div_ceil(4) as u64,
            output_tokens: 10,
            ..Default::default()
        };
        let fill = request
            .messages
            .iter()
            .last()
            .filter(|m| m.role == Role::User)
            .and_then(|m| m.text().strip_prefix("fill ").map(str::to_owned));
        let (blocks, finish) = match fill {
            _ if request.purpose == Some("compaction") => {
                (vec![ContentBlock::text("SUMMARY")], FinishReason::Stop)
            }
            Some(n) => {
                let call = ContentBlock::ToolCall {
                    id: format!("call-{}", self.sent.lock().unwrap().len()),
                    name: "big".into(),
                    arguments: format!("{{\"n\": {n}}}"),
                };
                (vec![call], FinishReason::ToolCalls)
            }
            None => (vec![ContentBlock::text("answered")], FinishReason::Stop),
        };
        self.sent.lock().unwrap().push(request);
        let chunks = dsh_services::providers::scripted::chunks_for(&blocks, usage, finish);
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

/// `big {n}` → n characters: `BEGIN`, x…, `END`.
struct Big;
impl dsh_services::tools::Tool for Big {
    fn schema(&self) -> dsh_services::llm::ToolSchema {
        dsh_services::llm::ToolSchema {
            name: "big".into(),
            description: "a long result".into(),
            parameters: serde_json::json!({"type": "object", "properties": {"n": {"type": "integer"}}}),
        }
    }
    fn execute(
        self: Arc<Self>,
        cx: dsh_services::tools::ToolContext,
    ) -> futures::future::BoxFuture<
        'static,
        Result<dsh_services::tools::ToolOutput, dsh_services::tools::ToolError>,
    > {
        use futures::FutureExt;
        let n = cx.args["n"].as_u64().unwrap_or(0) as usize;
        let body = format!("BEGIN{}END", "x".repeat(n - 8));
        async move { Ok(dsh_services::tools::ToolOutput::text(body)) }.boxed()
    }
}

const PRUNED: &str = "\n\n[... tool result middle pruned ...]\n\n";

fn kinds(agent: &Agent) -> Vec<String> {
    agent
        .session()
        .events()
        .iter()
        .map(|e| e.kind().to_owned())
        .collect()
}

/// Near the window, an over-long tool result is cut to its head and tail
/// first (`compaction/prune`, then a replacing `tool/result`; the original
/// stays in the log), and when that is enough no summary is asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_over_long_tool_result_is_pruned_instead_of_summarised() {
    let h = Harness::new().await;
    h.tools.register(&h.rt.root(), Arc::new(Big)).unwrap();
    let adapter = Arc::new(Metered {
        sent: Mutex::default(),
    });
    h.adapter("m", adapter.clone());
    let agent = h.agent("m").await;
    let first = agent.run("fill 40000", WAIT).await.unwrap();
    assert_eq!(first.text, "answered");
    let sent = adapter.sent.lock().unwrap().clone();
    assert_eq!(sent.len(), 2, "no summary request");
    let carried = results_sent(&sent[1]);
    assert!(carried.starts_with("BEGIN") && carried.ends_with("END"));
    assert!(carried.contains(PRUNED));
    assert_eq!(carried.chars().count(), 4096 + PRUNED.len() + 1024);
    let kinds = kinds(&agent);
    let at = kinds.iter().position(|k| k == "compaction/prune").unwrap();
    assert_eq!(kinds[at + 1], "tool/result");
    assert!(!kinds.iter().any(|k| k == "compaction/start"), "{kinds:?}");
    // The original, whole, is still in the log; the replacement keeps its
    // call, turn and step.
    let events = agent.session().events();
    let results: Vec<_> = events
        .iter()
        .filter_map(|e| match &e.data {
            EventData::ToolResult {
                turn,
                step,
                message,
                ..
            } => Some((*turn, *step, message.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(results.len(), 2);
    assert_eq!(text_of(&results[0].2.content).len(), 40_000);
    assert_eq!((results[0].0, results[0].1), (results[1].0, results[1].1));
    assert_eq!(results[0].2.source.call_id, results[1].2.source.call_id);
    let prune = events
        .iter()
        .find(|e| e.kind() == "compaction/prune")
        .unwrap()
        .to_json();
    assert_eq!(prune["data"]["shadowedTokenCount"], 10_000);
    h.rt.shutdown().await;
}

/// A result that fit when it came is pruned when the window fills later,
/// and the meter counts what that saved (no summary follows); when
/// pruning cannot help (a long prompt), the summary reads the pruned
/// result, and nothing is pruned twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pruning_comes_first_and_a_summary_reads_the_pruned_results() {
    let h = Harness::new().await;
    h.tools.register(&h.rt.root(), Arc::new(Big)).unwrap();
    let adapter = Arc::new(Metered {
        sent: Mutex::default(),
    });
    h.adapter("m", adapter.clone());
    let agent = h.agent("m").await;
    agent.run("fill 9000", WAIT).await.unwrap();
    assert!(!kinds(&agent).iter().any(|k| k.starts_with("compaction/")));
    // 2,260 reported + 1,100 new: past 80 % of 4,000, and the old result
    // is the prunable bulk.
    agent.run(&"z".repeat(4400), WAIT).await.unwrap();
    let sent = adapter.sent.lock().unwrap().clone();
    let purposes: Vec<_> = sent.iter().map(|r| r.purpose).collect();
    assert_eq!(purposes, [None, None, None], "pruning sufficed");
    assert!(results_sent(&sent[2]).contains(PRUNED));
    let meter = agent.context_tokens().unwrap();
    assert!(meter < 3200, "{meter}");
    agent.run(&"y".repeat(14_000), WAIT).await.unwrap();
    let sent = adapter.sent.lock().unwrap().clone();
    let purposes: Vec<_> = sent.iter().map(|r| r.purpose).collect();
    assert_eq!(purposes, [None, None, None, Some("compaction"), None]);
    let summarised = results_sent(&sent[3]);
    assert!(summarised.contains(PRUNED) && summarised.len() < 6000);
    let prunes = kinds(&agent)
        .iter()
        .filter(|k| *k == "compaction/prune")
        .count();
    assert_eq!(prunes, 1);
    h.rt.shutdown().await;
}
