//! Subagents: publication, results, failures, and the cancellation cascade
//! through a three-level tree.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentCreated, AgentSpec, Agents};
use dsh_actors::subagent::tools::{SubagentTool, SubagentToolConfig};
use dsh_actors::subagent::{StartRequest, StopReason, SubagentError, Subagents};
use dsh_services::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmRequest, TokenUsage,
};
use dsh_services::providers::scripted::{ScriptStep, ScriptedError};
use dsh_services::session::{EventData, TurnEndReason};
use dsh_supervisors::registry::RegisterError;
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::harness::{Harness, Park, answer, calls, prompt_of, results, text};

fn subagents(h: &Harness) -> Arc<Subagents> {
    let root = h.rt.root();
    let s = Arc::new(Subagents::with_builtin());
    root.provide(Subagents::SERVICE, s.clone()).unwrap();
    let mut config = SubagentToolConfig::new("spawn", "subagent");
    config.max_depth = Some(8);
    h.tools
        .register(
            &root,
            Arc::new(SubagentTool::new(s.clone(), config).unwrap()),
        )
        .unwrap();
    s
}

fn results_after_prompt(request: &LlmRequest) -> usize {
    request
        .messages
        .iter()
        .rev()
        .take_while(|m| m.source.kind != "user")
        .flat_map(|m| m.content.iter())
        .filter(|b| matches!(b, ContentBlock::ToolResult { .. }))
        .count()
}

/// `level N` with N < 3 delegates to five `level N+1` children; `level 3`
/// parks; once results are in, it answers `done N`.
struct TreeModel;

impl LlmAdapter for TreeModel {
    fn name(&self) -> &str {
        "tree"
    }

    fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
        let prompt = prompt_of(&request);
        let level: u32 = prompt
            .strip_prefix("level ")
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0);
        let blocks = if results_after_prompt(&request) > 0 {
            vec![ContentBlock::text(format!("done {level}"))]
        } else if level < 3 {
            (0..5)
                .map(|j| ContentBlock::ToolCall {
                    id: format!("call_{j}"),
                    name: "subagent".into(),
                    arguments: json!({"description": format!("branch {j}"), "prompt": format!("level {}", level + 1)}).to_string(),
                })
                .collect()
        } else {
            vec![ContentBlock::ToolCall {
                id: "call_park".into(),
                name: "park".into(),
                arguments: "{}".into(),
            }]
        };
        answer(blocks)
    }
}

fn last_turn_end(agent: &Agent) -> Option<TurnEndReason> {
    agent
        .session()
        .events()
        .iter()
        .rev()
        .find_map(|e| match &e.data {
            EventData::TurnEnd { reason, .. } => Some((**reason).clone()),
            _ => None,
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_the_root_aborts_three_levels_and_tears_down_in_reverse_order() {
    cascade(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disposing_the_root_aborts_three_levels_and_tears_down_in_reverse_order() {
    cascade(true).await;
}

/// Three levels × fan-out 5 under one root; then the root is cancelled (its
/// turn) or disposed (the whole agent).
async fn cascade(dispose: bool) {
    let h = Harness::new().await;
    subagents(&h);
    h.adapter("tree", Arc::new(TreeModel));
    let (parked, mut watch_parked) = watch::channel(0usize);
    h.tools
        .register(&h.rt.root(), Arc::new(Park { parked }))
        .unwrap();
    let agents = h.rt.root().get::<Agents>(Agents::SERVICE).unwrap();
    let created: Arc<Mutex<Vec<Agent>>> = Arc::default();
    let seen = created.clone();
    h.rt.root()
        .on(move |e: &AgentCreated| {
            if let Some(a) = agents.get(&e.id) {
                seen.lock().unwrap().push(a);
            }
        })
        .unwrap();
    let baseline = h.rt.tree().live_len();
    let root = h.agent("tree").await;
    root.followup(dsh_services::llm::Message::user_text("level 0"))
        .unwrap();
    tokio::time::timeout(
        Duration::from_secs(60),
        watch_parked.wait_for(|n| *n == 125),
    )
    .await
    .expect("all 125 leaves park")
    .unwrap();
    let everyone: Vec<Agent> = created.lock().unwrap().clone();
    assert_eq!(everyone.len(), 1 + 5 + 25 + 125);
    // Start order of each agent's children, before the teardown.
    let children: Vec<(Agent, Vec<u64>)> = everyone
        .iter()
        .map(|a| (a.clone(), a.child_nodes()))
        .collect();
    if dispose {
        root.dispose().await;
    } else {
        root.cancel();
        root.when_idle(Duration::from_secs(60)).await.unwrap();
    }
    for a in &everyone {
        match last_turn_end(a) {
            Some(TurnEndReason::Aborted { .. }) => {}
            other => panic!("agent {} ended {other:?}, not aborted", a.id()),
        }
    }
    let depths: Vec<u32> = everyone.iter().map(|a| a.depth()).collect();
    assert_eq!(depths.iter().filter(|d| **d == 3).count(), 125);
    let tree = h.rt.tree();
    let scope_ids: std::collections::HashSet<u64> = everyone
        .iter()
        .filter(|a| a.id() != root.id())
        .map(|a| a.node_id())
        .collect();
    for (agent, kids) in &children {
        let stops: Vec<u64> = kids
            .iter()
            .filter(|k| scope_ids.contains(k))
            .map(|k| {
                tree.get_stopped(*k)
                    .and_then(|n| n.stop_seq)
                    .unwrap_or_else(|| panic!("child {k} of {} is not stopped", agent.id()))
            })
            .collect();
        let mut reversed = stops.clone();
        reversed.sort_by(|a, b| b.cmp(a));
        assert_eq!(
            stops,
            reversed,
            "the children of {} stopped out of reverse start order",
            agent.id()
        );
    }
    // Disposed: the whole tree is gone. Cancelled: the root's scope, session
    // and driver stay; every descendant is gone (a tool-call task of the
    // root may still be finishing its own stop).
    if dispose {
        assert_eq!(tree.live_len(), baseline, "every actor of the tree stopped");
    } else {
        let own: Vec<String> = root
            .child_nodes()
            .into_iter()
            .filter_map(|n| tree.get(n))
            .filter(|n| n.kind != "tool")
            .map(|n| n.kind)
            .collect();
        assert_eq!(own, vec!["session".to_owned(), "agent".to_owned()]);
        for a in everyone.iter().filter(|a| a.id() != root.id()) {
            assert!(a.status().is_terminal(), "{} is still live", a.id());
        }
    }
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_failing_after_publication_is_an_error_result_and_the_parent_goes_on() {
    let h = Harness::new().await;
    subagents(&h);
    h.script(
        "s",
        vec![
            calls(&[("subagent", json!({"description": "d", "prompt": "work"}))]),
            ScriptStep {
                error: Some(ScriptedError {
                    code: "OVERLOADED".into(),
                    message: "the model is overloaded".into(),
                    status: Some(529),
                }),
                ..ScriptStep::default()
            },
            text("parent done"),
        ],
    );
    let parent = h.agent("s").await;
    let summary = parent.run("go", Duration::from_secs(30)).await.unwrap();
    assert_eq!(summary.text, "parent done");
    assert_eq!(summary.reason, TurnEndReason::Completed);
    let r = results(&parent);
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].1.as_deref(), Some("SUBAGENT_FAILED"));
    assert!(r[0].2.contains("the subagent stopped: error"), "{}", r[0].2);
    assert!(r[0].2.contains("OVERLOADED"), "{}", r[0].2);
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_failing_during_start_rejects_and_leaves_nothing() {
    let h = Harness::new().await;
    let s = subagents(&h);
    h.script("s", vec![text("unused")]);
    let parent = h.agent("s").await;
    let agents = h.rt.root().get::<Agents>(Agents::SERVICE).unwrap();
    let live = h.rt.tree().live_len();
    let mut request = StartRequest::new(&parent, "work", CancellationToken::new());
    // Not a valid JSON Schema: the capture tool cannot be registered.
    request.output_schema = Some(json!({"type": "object", "properties": {"a": {"type": 7}}}));
    let err = match s.start("spawn", request).await {
        Err(e) => e,
        Ok(_) => panic!("the start should fail"),
    };
    assert!(
        matches!(
            err,
            SubagentError::Register(RegisterError::Invalid { what: "tool", .. })
        ),
        "{err:?}"
    );
    assert_eq!(err.code(), "START_FAILED");
    assert_eq!(h.rt.tree().live_len(), live, "the half-built child is gone");
    assert_eq!(agents.ids(), vec![parent.id().to_owned()]);
    // Depth: a child beyond the cap is refused before anything exists.
    let mut request = StartRequest::new(&parent, "work", CancellationToken::new());
    request.max_depth = Some(0);
    assert!(matches!(
        s.start("spawn", request).await.err(),
        Some(SubagentError::DepthExceeded { depth: 1, max: 0 })
    ));
    // A cancelled signal rejects before publication.
    let cancel = CancellationToken::new();
    cancel.cancel();
    let request = StartRequest::new(&parent, "work", cancel);
    assert!(matches!(
        s.start("spawn", request).await.err(),
        Some(SubagentError::Cancelled)
    ));
    assert!(matches!(
        s.start(
            "nope",
            StartRequest::new(&parent, "w", CancellationToken::new())
        )
        .await
        .err(),
        Some(SubagentError::UnknownProvider(name)) if name == "nope"
    ));
    assert_eq!(h.rt.tree().live_len(), live);
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_output_concludes_the_child_turn_and_the_child_log_names_its_parent() {
    let h = Harness::new().await;
    let s = subagents(&h);
    h.script(
        "s",
        vec![
            calls(&[("report", json!({"answer": 42}))]),
            text("never asked: the report concluded the turn"),
        ],
    );
    let parent = h.agent("s").await;
    let mut request = StartRequest::new(&parent, "compute", CancellationToken::new());
    request.label = Some("the answer".into());
    request.output_schema = Some(json!({
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"]
    }));
    let run = s.start("spawn", request).await.unwrap();
    let child = run.agent().clone();
    let result = run.result().await;
    run.dispose().await;
    assert_eq!(result.stop_reason, StopReason::Completed);
    assert_eq!(result.structured, Some(json!({"answer": 42})));
    let header = child.session().with_log(|l| l.header().clone());
    assert_eq!(header.parent_session.as_deref(), Some(parent.id()));
    assert_eq!(header.origin, Some(json!("subagent")));
    assert_eq!(header.delegation_depth, 1);
    let kinds: Vec<String> = child
        .session()
        .events()
        .iter()
        .map(|e| e.kind().to_owned())
        .collect();
    let at = |k: &str| kinds.iter().position(|x| x == k).unwrap();
    assert!(at("turn/start") < at("subagent/descriptor"));
    assert!(at("subagent/descriptor") < at("step/start"));
    assert_eq!(kinds.iter().filter(|k| *k == "step/start").count(), 1);
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn continuable_children_take_messages_report_back_and_can_be_interrupted() {
    let h = Harness::new().await;
    let s = subagents(&h);
    let counter = Arc::new(AtomicUsize::new(0));
    struct Replies(Arc<AtomicUsize>);
    impl LlmAdapter for Replies {
        fn name(&self) -> &str {
            "replies"
        }
        fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
            self.0.fetch_add(1, Ordering::Relaxed);
            let last = request
                .messages
                .last()
                .map(|m| m.text())
                .unwrap_or_default();
            let blocks = vec![ContentBlock::text(format!("echo: {last}"))];
            let chunks = dsh_services::providers::scripted::chunks_for(
                &blocks,
                TokenUsage::default(),
                FinishReason::Stop,
            );
            Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
        }
    }
    h.adapter("r", Arc::new(Replies(counter.clone())));
    let parent = Agent::create(&h.rt.root(), AgentSpec::new("r", "m", std::env::temp_dir()))
        .await
        .unwrap();
    let request = StartRequest::new(&parent, "first", CancellationToken::new());
    let id = s
        .start_continuable("spawn", "helper", request)
        .await
        .unwrap();
    // The settled notice wakes the parent with a turn of its own.
    let child_list = s.children(&parent).await;
    assert_eq!(child_list.len(), 1);
    assert_eq!(child_list[0].label, "helper");
    // The child's driver delivers the notice before it reports idle; the
    // notice then wakes the parent.
    let agents = h.rt.root().get::<Agents>(Agents::SERVICE).unwrap();
    let child = agents.get(&id).unwrap();
    child.when_idle(Duration::from_secs(30)).await.unwrap();
    parent.when_idle(Duration::from_secs(30)).await.unwrap();
    let notices: Vec<String> = parent
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::UserMessage(m) if m.source.kind == "subagent-settled" => Some(m.text()),
            _ => None,
        })
        .collect();
    assert_eq!(notices.len(), 1, "{notices:?}");
    assert!(notices[0].contains("echo: first"), "{}", notices[0]);
    // A stranger may not message or interrupt the child.
    let stranger = h.agent("r").await;
    assert!(matches!(
        s.send(&stranger, &id, "hi").await,
        Err(SubagentError::Unauthorized { .. })
    ));
    assert!(s.interrupt(&stranger, &id).is_err());
    // A hibernated child stays resident, and a message wakes it.
    child.hibernate().await.unwrap();
    assert_eq!(s.children(&parent).await.len(), 1);
    s.send(&parent, &id, "second").await.unwrap();
    child.when_idle(Duration::from_secs(30)).await.unwrap();
    parent.when_idle(Duration::from_secs(30)).await.unwrap();
    assert!(!child.is_hibernated());
    assert_eq!(child.last_turn().unwrap().text, "echo: second");
    child.hibernate().await.unwrap();
    // Interrupting an idle or unknown child is a no-op.
    s.interrupt(&parent, &id).unwrap();
    s.interrupt(&parent, "no-such-child").unwrap();
    // Disposing the parent disposes the resident (hibernated) child, without
    // waking it.
    parent.dispose().await;
    assert!(s.children(&parent).await.is_empty());
    assert!(child.status().is_terminal());
    assert!(child.session().is_compact());
    h.rt.shutdown().await;
}

/// A continuable child's `report` reaches its live direct parent, steered
/// in as a `subagent-report` message naming the child; the tool is the
/// child's alone, outlives a hibernation and a tool filter without it; an
/// agent that is no continuable child cannot report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuable_child_reports_to_its_parent_alone() {
    let h = Harness::new().await;
    let s = subagents(&h);
    /// A child (its messages start `task`) reports `found: <task>`, then
    /// answers `done`; anyone else answers `ok`. Keeps each request's
    /// latest message and tool names.
    #[derive(Default)]
    struct Reporter(Mutex<Vec<(String, Vec<String>)>>);
    impl LlmAdapter for Reporter {
        fn name(&self) -> &str {
            "reporter"
        }
        fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
            let last = request
                .messages
                .last()
                .map(|m| m.text())
                .unwrap_or_default();
            let tools = request.tools.iter().map(|t| t.name.clone()).collect();
            let child = request
                .messages
                .iter()
                .any(|m| m.text().starts_with("task"));
            self.0.lock().unwrap().push((child.to_string(), tools));
            let answered = request.messages.last().is_some_and(|m| {
                m.content
                    .iter()
                    .any(|b| matches!(b, ContentBlock::ToolResult { .. }))
            });
            if answered {
                answer(vec![ContentBlock::text("done")])
            } else if last.starts_with("task") {
                answer(vec![ContentBlock::ToolCall {
                    id: "call_report".into(),
                    name: "report".into(),
                    arguments: json!({"output": format!("found: {last}")}).to_string(),
                }])
            } else {
                answer(vec![ContentBlock::text("ok")])
            }
        }
    }
    let model = Arc::new(Reporter::default());
    h.adapter("rep", model.clone());
    let parent = h.agent("rep").await;
    let mut request = StartRequest::new(&parent, "task one", CancellationToken::new());
    // A filter that names only `echo` still leaves the child its `report`.
    request.tool_filter = Some(dsh_services::tools::Restriction {
        allow: Some(vec!["echo".into()]),
        deny: Vec::new(),
    });
    let id = s
        .start_continuable("spawn", "reporter", request)
        .await
        .unwrap();
    let agents = h.rt.root().get::<Agents>(Agents::SERVICE).unwrap();
    let child = agents.get(&id).unwrap();
    let reports = |parent: &Agent| -> Vec<(String, Option<String>, Option<String>)> {
        parent
            .session()
            .events()
            .iter()
            .filter_map(|e| match &e.data {
                EventData::UserMessage(m) if m.source.kind == "subagent-report" => Some((
                    m.text(),
                    m.source.field("senderSessionId").map(str::to_owned),
                    m.source.field("form").map(str::to_owned),
                )),
                _ => None,
            })
            .collect()
    };
    child.when_idle(Duration::from_secs(30)).await.unwrap();
    parent.when_idle(Duration::from_secs(30)).await.unwrap();
    assert_eq!(
        reports(&parent),
        vec![(
            "found: task one".to_owned(),
            Some(id.clone()),
            Some("relay".to_owned())
        )]
    );
    // Woken again after a hibernation, it still has the tool.
    child.hibernate().await.unwrap();
    s.send(&parent, &id, "task two").await.unwrap();
    child.when_idle(Duration::from_secs(30)).await.unwrap();
    parent.when_idle(Duration::from_secs(30)).await.unwrap();
    assert_eq!(reports(&parent).len(), 2, "{:?}", reports(&parent));
    assert_eq!(reports(&parent)[1].0, "found: task two");
    let seen = model.0.lock().unwrap().clone();
    for (child, tools) in &seen {
        let is_child = child == "true";
        assert_eq!(tools.contains(&"report".to_owned()), is_child, "{tools:?}");
        if is_child {
            assert_eq!(
                tools.len(),
                2,
                "the filter's and the child's own: {tools:?}"
            );
        }
    }
    // Two turns of two steps each (the report, then `done`).
    assert_eq!(seen.iter().filter(|(c, _)| c == "true").count(), 4);
    // Only a live continuable child reports; the parent is none.
    let refused = s.report_from(&parent, "not mine").unwrap_err();
    assert_eq!(refused.code(), "REPORT_UNDELIVERED");
    assert!(
        refused.to_string().contains("not a live continuable child"),
        "{refused}"
    );
    parent.dispose().await;
    h.rt.shutdown().await;
}

/// Records every request (system text, tool names, message texts); answers `ok`.
#[derive(Default)]
struct Capture {
    seen: Mutex<Vec<Seen>>,
}

/// What one request carried: system text, tool names, message texts.
type Seen = (Option<String>, Vec<String>, Vec<String>);

impl LlmAdapter for Capture {
    fn name(&self) -> &str {
        "capture"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        self.seen.lock().unwrap().push((
            request.system.as_deref().map(str::to_owned),
            request.tools.iter().map(|t| t.name.clone()).collect(),
            request.messages.iter().map(|m| m.text()).collect(),
        ));
        answer(vec![ContentBlock::text("ok")])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_seeds_the_completed_turns_and_filters_personas_and_policy_shape_the_child() {
    let h = Harness::new().await;
    let s = subagents(&h);
    let capture = Arc::new(Capture::default());
    h.adapter("cap", capture.clone());
    let parent = h.agent("cap").await;
    parent
        .run("first question", Duration::from_secs(30))
        .await
        .unwrap();
    let mut request = StartRequest::new(&parent, "child task", CancellationToken::new());
    request.persona = Some("You are a careful reviewer.".into());
    request.tool_filter = Some(dsh_services::tools::Restriction {
        allow: None,
        deny: vec!["echo".into()],
    });
    let run = s.start("fork", request).await.unwrap();
    let child = run.agent().clone();
    assert_eq!(run.result().await.stop_reason, StopReason::Completed);
    run.dispose().await;
    let (system, tools, texts) = capture.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(system.as_deref(), Some("You are a careful reviewer."));
    assert!(!tools.contains(&"echo".to_owned()), "{tools:?}");
    assert!(tools.contains(&"hang".to_owned()), "{tools:?}");
    assert_eq!(texts.first().map(String::as_str), Some("first question"));
    assert_eq!(texts.last().map(String::as_str), Some("child task"));
    let header = child.session().with_log(|l| l.header().clone());
    assert!(header.seed_length.unwrap() > 0);
    assert_eq!(header.parent_session.as_deref(), Some(parent.id()));
    // The child cannot ask the human (the harness's policy is `ask`).
    let policy = child.session().events().iter().find_map(|e| match &e.data {
        EventData::Other { kind, data } if &**kind == "approval/policy" => Some((**data).clone()),
        _ => None,
    });
    assert_eq!(
        policy,
        Some(json!({"policy": "never", "source": "delegation"}))
    );

    // `spawn` starts fresh: the child sees only its own prompt.
    let run = s
        .start(
            "spawn",
            StartRequest::new(&parent, "fresh task", CancellationToken::new()),
        )
        .await
        .unwrap();
    run.result().await;
    run.dispose().await;
    let (_, tools, texts) = capture.seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(texts, vec!["fresh task".to_owned()]);
    assert!(tools.contains(&"echo".to_owned()));
    h.rt.shutdown().await;
}

/// `list_agents` with scope `descendants`: the whole tree below the caller
/// in pre-order, each entry with its direct parent and depth; the caller
/// may interrupt any of them, a stranger none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn descendants_are_listed_in_pre_order_and_may_be_interrupted_from_above() {
    let h = Harness::new().await;
    let s = subagents(&h);
    h.adapter("c", Arc::new(Capture::default()));
    let parent = Agent::create(&h.rt.root(), AgentSpec::new("c", "m", std::env::temp_dir()))
        .await
        .unwrap();
    let agents = h.rt.root().get::<Agents>(Agents::SERVICE).unwrap();
    let start = |above: &Agent, label: &str| {
        let request = StartRequest::new(above, "work", CancellationToken::new());
        let (s, label) = (s.clone(), label.to_owned());
        async move { s.start_continuable("spawn", &label, request).await.unwrap() }
    };
    let a = start(&parent, "a").await;
    let a_agent = agents.get(&a).unwrap();
    let a1 = start(&a_agent, "a1").await;
    let b = start(&parent, "b").await;
    for id in [&a, &a1, &b] {
        agents
            .get(id)
            .unwrap()
            .when_idle(Duration::from_secs(30))
            .await
            .unwrap();
    }
    let tree: Vec<(String, Option<String>, Option<u32>)> = s
        .descendants(&parent)
        .await
        .into_iter()
        .map(|e| (e.label, e.parent, e.depth))
        .collect();
    let mut expected = vec![
        ("a".to_owned(), Some(parent.id().to_owned()), Some(1)),
        ("a1".to_owned(), Some(a.clone()), Some(2)),
        ("b".to_owned(), Some(parent.id().to_owned()), Some(1)),
    ];
    // Siblings come in the registry's order; each child precedes its own.
    if tree.first().map(|t| t.0.as_str()) == Some("b") {
        expected.rotate_left(2);
    }
    assert_eq!(tree, expected);
    let direct: Vec<String> = s
        .children(&parent)
        .await
        .into_iter()
        .map(|e| e.label)
        .collect();
    assert_eq!(direct.len(), 2, "{direct:?}");
    assert!(
        s.interrupt(&parent, &a1).is_ok(),
        "a grandchild is the parent's to stop"
    );
    let stranger = h.agent("c").await;
    assert!(matches!(
        s.interrupt(&stranger, &a1),
        Err(SubagentError::Unauthorized { .. })
    ));
    parent.dispose().await;
    h.rt.shutdown().await;
}

/// The text of the first tool result a request carries.
fn first_result(request: &LlmRequest) -> Option<String> {
    request
        .messages
        .iter()
        .flat_map(|m| m.content.iter())
        .find_map(|b| match b {
            ContentBlock::ToolResult { content, .. } => Some(
                content
                    .iter()
                    .filter_map(|c| match c {
                        ContentBlock::Text { text } => Some(text.clone()),
                        _ => None,
                    })
                    .collect::<String>(),
            ),
            _ => None,
        })
}

/// Records what each request offered, and asks for `record` (a tool its
/// definition leaves out) until it sees a tool result, which it repeats.
#[derive(Default)]
struct Defiant {
    seen: Mutex<Vec<Asked>>,
}

/// What one request asked with: system text, tool names, model.
type Asked = (Option<String>, Vec<String>, String);

impl LlmAdapter for Defiant {
    fn name(&self) -> &str {
        "defiant"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        self.seen.lock().unwrap().push((
            request.system.as_deref().map(str::to_owned),
            request.tools.iter().map(|t| t.name.clone()).collect(),
            request.model.clone(),
        ));
        let refused = first_result(&request);
        match refused {
            Some(text) => answer(vec![ContentBlock::text(format!("told: {text}"))]),
            None => answer(vec![ContentBlock::ToolCall {
                id: "call_escape".into(),
                name: "record".into(),
                arguments: json!({"tag": "escaped"}).to_string(),
            }]),
        }
    }
}

/// A definition named in a `subagent` call makes the child: its body is the
/// system prompt, its model route is the one it names, its tools are only
/// the parent's that its globs match (asking for another anyway is refused
/// and runs nothing), its mode is narrowed; the tool's schema lists it; an
/// unknown name is refused with what exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_definition_shapes_the_child_and_cannot_widen_its_tools() {
    use dsh_services::definitions::{Definition, Definitions, Dialect};
    let h = Harness::new().await;
    let s = subagents(&h);
    let defiant = Arc::new(Defiant::default());
    h.adapter("other", defiant.clone());
    let mut reviewer = Definition::new(
        "reviewer",
        "Reviews a change for bugs.",
        "You review.",
        std::path::Path::new("/nowhere/reviewer.md"),
        Dialect::Dsh,
    );
    reviewer.model = Some("other".into());
    reviewer.reasoning_effort = Some("high".into());
    reviewer.tools = Some(vec!["ech*".into()]);
    reviewer.permission_mode = Some(dsh_services::sandbox::PermissionMode::ReadOnly);
    reviewer.max_steps = Some(5);
    let mut found = Definitions::default();
    found.found.insert("reviewer".into(), reviewer);
    s.set_definitions(found);
    let schema = h
        .tools
        .schemas(None)
        .into_iter()
        .find(|t| t.name == "subagent")
        .unwrap();
    assert!(schema.parameters["properties"]["agent"].is_object());
    // The names are told to the model in a prompt section.
    let (_, _, listed) = dsh_services::definitions::section(&s.definitions()).unwrap();
    assert!(
        listed.contains("- `reviewer`: Reviews a change for bugs."),
        "{listed}"
    );
    h.script(
        "main",
        vec![
            calls(&[(
                "subagent",
                json!({"description": "review", "prompt": "Review main.rs", "agent": "reviewer"}),
            )]),
            calls(&[(
                "subagent",
                json!({"description": "nobody", "prompt": "x", "agent": "nobody"}),
            )]),
            text("parent done"),
        ],
    );
    let parent = h.agent("main").await;
    parent.run("go", Duration::from_secs(30)).await.unwrap();
    // The escape ran nothing.
    assert!(h.lines().is_empty(), "{:?}", h.lines());
    let seen = defiant.seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    for (system, tools, model) in &seen {
        assert_eq!(system.as_deref(), Some("You review."));
        assert_eq!(tools, &["echo".to_owned()], "{tools:?}");
        assert_eq!(model, "default");
    }
    let got = results(&parent);
    assert_eq!(got.len(), 2, "{got:?}");
    // The child was told the tool is not its own, and said so.
    assert_eq!(got[0].1, None, "{got:?}");
    assert!(
        got[0].2.contains("told:") && got[0].2.contains("record"),
        "{got:?}"
    );
    // An unknown name: refused, naming what exists.
    assert_eq!(got[1].1.as_deref(), Some("BAD_DEFINITION"), "{got:?}");
    assert!(got[1].2.contains("found: reviewer"), "{got:?}");
    // The mode is the definition's, within the parent's.
    let mut request = StartRequest::new(&parent, "again", CancellationToken::new());
    s.define(&mut request, "reviewer").unwrap();
    let run = s.start("spawn", request).await.unwrap();
    assert_eq!(
        run.agent().policy().mode,
        dsh_services::sandbox::PermissionMode::ReadOnly
    );
    assert_eq!(run.agent().spec().max_steps, 5);
    assert_eq!(run.agent().spec().definition.as_deref(), Some("reviewer"));
    run.result().await;
    run.dispose().await;
    h.rt.shutdown().await;
}

/// `go K` delegates `go K+1` (until 9), then repeats what came back; a
/// refusal comes back as its text.
struct Deep;

impl LlmAdapter for Deep {
    fn name(&self) -> &str {
        "deep"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let back = first_result(&request);
        if let Some(text) = back {
            return answer(vec![ContentBlock::text(text)]);
        }
        let k: u32 = prompt_of(&request)
            .trim_start_matches("go ")
            .trim()
            .parse()
            .unwrap_or(0);
        answer(vec![ContentBlock::ToolCall {
            id: format!("call_go_{k}"),
            name: "subagent".into(),
            arguments: json!({"description": "deeper", "prompt": format!("go {}", k + 1)})
                .to_string(),
        }])
    }
}

/// The depth cap set on the service (`--max-depth`) holds for every level:
/// at 1 a child may not start a grandchild; at 4 the chain reaches depth 4
/// and the fifth level is refused, naming the limit and how to raise it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_depth_cap_set_on_the_service_refuses_one_level_past_it() {
    let h = Harness::new().await;
    let root = h.rt.root();
    let s = Arc::new(Subagents::with_builtin());
    root.provide(Subagents::SERVICE, s.clone()).unwrap();
    h.tools
        .register(
            &root,
            Arc::new(
                SubagentTool::new(s.clone(), SubagentToolConfig::new("spawn", "subagent")).unwrap(),
            ),
        )
        .unwrap();
    h.adapter("deep", Arc::new(Deep));
    for (max, refused) in [(1, 2), (4, 5)] {
        s.set_max_depth(max);
        let top = h.agent("deep").await;
        let summary = top.run("go 0", Duration::from_secs(30)).await.unwrap();
        assert!(
            summary.text.contains(&format!(
                "delegation depth {refused} exceeds the limit of {max}"
            )) && summary.text.contains("--max-depth"),
            "{}",
            summary.text
        );
        top.dispose().await;
    }
    assert_eq!(Subagents::with_builtin().max_depth(), 3);
    h.rt.shutdown().await;
}

/// Spends 20 tokens a call and never finishes: it calls `echo` again and
/// again, or `hang` when its task says so.
struct Spender;

impl LlmAdapter for Spender {
    fn name(&self) -> &str {
        "spender"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let tool = if prompt_of(&request).contains("hang") {
            ("hang", json!({}))
        } else {
            ("echo", json!({"i": 1}))
        };
        let blocks = [ContentBlock::ToolCall {
            id: format!("call_{}", request.messages.len()),
            name: tool.0.into(),
            arguments: tool.1.to_string(),
        }];
        let usage = TokenUsage {
            input_tokens: 15,
            output_tokens: 5,
            ..Default::default()
        };
        let chunks =
            dsh_services::providers::scripted::chunks_for(&blocks, usage, FinishReason::ToolCalls);
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

fn limited(name: &str) -> dsh_services::definitions::Definition {
    dsh_services::definitions::Definition::new(
        name,
        "Spends.",
        "Spend.",
        std::path::Path::new("/nowhere/limited.md"),
        dsh_services::definitions::Dialect::Dsh,
    )
}

/// The error a child's run ended with, as its parent is told.
async fn ended_with(s: &Subagents, parent: &Agent, task: &str, name: &str) -> String {
    let mut request = StartRequest::new(parent, task, CancellationToken::new());
    s.define(&mut request, name).unwrap();
    let run = s.start("spawn", request).await.unwrap();
    let result = run.result().await;
    run.dispose().await;
    assert_eq!(result.stop_reason, StopReason::Error, "{result:?}");
    result.diagnostic.unwrap_or_default()
}

/// Each budget of a definition ends its child with its own code, told to
/// the parent: tokens (`BUDGET_EXHAUSTED`, checked before every step),
/// wall time (`TIMEOUT`, a step running past it stopped), turns
/// (`BUDGET_EXHAUSTED` on the turn past the cap); and children running in
/// parallel draw on their parent's one counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_budget_ends_a_child_with_its_code_and_parallel_children_share_the_parents() {
    let h = Harness::new().await;
    let s = subagents(&h);
    h.adapter("spender", Arc::new(Spender));
    let mut tokens = limited("tokens");
    tokens.max_tokens = Some(30);
    let mut slow = limited("slow");
    slow.timeout = Some(Duration::from_millis(300));
    let mut found = dsh_services::definitions::Definitions::default();
    found.found.insert("tokens".into(), tokens);
    found.found.insert("slow".into(), slow);
    s.set_definitions(found);
    let parent = h.agent("spender").await;

    // 20 tokens a step: the third step is refused (40 of 30).
    let said = ended_with(&s, &parent, "spend", "tokens").await;
    assert!(
        said.starts_with("BUDGET_EXHAUSTED: the token budget of agent definition `tokens` is spent: 40 of 30 tokens"),
        "{said}"
    );
    // A tool that never returns: stopped at 300 ms.
    let said = ended_with(&s, &parent, "hang", "slow").await;
    assert!(
        said.starts_with(
            "TIMEOUT: the wall-time budget of agent definition `slow` ran out (0.3 s)"
        ),
        "{said}"
    );

    // Turns: the second turn of an agent allowed one is refused before it
    // takes a step, and its log says so.
    let mut spec = AgentSpec::new("spender", "m", std::env::temp_dir());
    spec.max_steps = 1;
    spec.limits = Some(dsh_actors::agent::Limits::new(
        "the one-turn agent",
        None,
        Some(1),
        None,
        None,
    ));
    let once = Agent::create(&h.rt.root(), spec).await.unwrap();
    let first = once.run("spend", Duration::from_secs(20)).await.unwrap();
    assert!(
        matches!(&first.reason, TurnEndReason::Error { error } if error.code == "STEP_LIMIT"),
        "{first:?}"
    );
    let second = once.run("spend", Duration::from_secs(20)).await.unwrap();
    match &second.reason {
        TurnEndReason::Error { error } => {
            assert_eq!(error.code, "BUDGET_EXHAUSTED");
            assert_eq!(
                error.message,
                "the one-turn agent may take 1 turn; this is its turn 2"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(second.steps, 0);
    once.dispose().await;

    // A parent with 50 tokens: two children spending in parallel stop on
    // its one counter, whoever spent them.
    let mut spec = AgentSpec::new("spender", "m", std::env::temp_dir());
    let shared = dsh_actors::agent::Limits::new("the coordinator", None, None, Some(50), None);
    spec.limits = Some(shared.clone());
    let coordinator = Agent::create(&h.rt.root(), spec).await.unwrap();
    let runs = futures::future::join_all((0..2).map(|_| {
        let request = StartRequest::new(&coordinator, "spend", CancellationToken::new());
        s.start("spawn", request)
    }))
    .await;
    let mut said = Vec::new();
    for run in runs {
        let run = run.unwrap();
        let result = run.result().await;
        run.dispose().await;
        said.push(result.diagnostic.unwrap_or_default());
    }
    for d in &said {
        assert!(
            d.starts_with("BUDGET_EXHAUSTED: the token budget of the coordinator is spent"),
            "{said:?}"
        );
    }
    // At most one step more per child past the cap.
    assert!((50..=90).contains(&shared.spent()), "{}", shared.spent());
    coordinator.dispose().await;
    h.rt.shutdown().await;
}

/// A restricted parent's children are held to its list too (their scope
/// is not under its own): a child it starts, named or not, sees no tool the
/// parent may not use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restricted_parent_s_children_get_no_tool_it_lacks() {
    let h = Harness::new().await;
    let s = subagents(&h);
    let capture = Arc::new(Capture::default());
    h.adapter("cap", capture.clone());
    let mut spec = AgentSpec::new("cap", "m", std::env::temp_dir());
    spec.restriction = Some(dsh_services::tools::Restriction {
        allow: Some(vec!["echo".into(), "subagent".into()]),
        deny: Vec::new(),
    });
    let parent = Agent::create(&h.rt.root(), spec).await.unwrap();
    let run = s
        .start(
            "spawn",
            StartRequest::new(&parent, "child task", CancellationToken::new()),
        )
        .await
        .unwrap();
    run.result().await;
    run.dispose().await;
    let (_, mut tools, _) = capture.seen.lock().unwrap().last().cloned().unwrap();
    tools.sort();
    assert_eq!(tools, ["echo", "subagent"], "{tools:?}");
    parent.dispose().await;
    h.rt.shutdown().await;
}
