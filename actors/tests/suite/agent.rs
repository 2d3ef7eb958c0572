//! The agent loop end to end on the scripted model.

use std::sync::{Arc, Mutex};

use dsh_actors::agent::{Agent, AgentSpec};
use dsh_services::approval::{ApprovalAsk, ApprovalOutcome, ApprovalPolicy};
use dsh_services::llm::{
    BlockType, ChunkStream, LlmAdapter, LlmFailure, LlmRequest, Role, StreamChunk,
};
use dsh_services::providers::scripted::ScriptStep;
use dsh_services::session::{EventData, TurnEndReason};
use dsh_services::tools::{
    Decision, PostExecute, PreExecute, Restriction, ToolExecute, ToolGuard, ToolResultEvent,
};
use dsh_supervisors::Status;
use dsh_supervisors::registry::RegisterError;
use dsh_supervisors::tree::Form;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::harness::{Harness, WAIT, calls, kinds, results, text};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_text_turn_records_the_full_event_sequence() {
    let h = Harness::new().await;
    h.script("scripted", vec![text("hello there")]);
    let agent = h.agent("scripted").await;
    let summary = agent.run("hi", WAIT).await.unwrap();
    assert_eq!(summary.text, "hello there");
    assert_eq!(summary.reason, TurnEndReason::Completed);
    assert_eq!(summary.steps, 1);
    assert_eq!(
        kinds(&agent),
        [
            "agent/inbox/spliced",
            "turn/start",
            "agent/inbox/spliced",
            "step/start",
            "user/message",
            "session/title",
            "request/header",
            "request/context",
            "assistant/chunk",
            "assistant/chunk",
            "assistant/chunk",
            "assistant/chunk",
            "assistant/chunk",
            "assistant/message",
            "step/end",
            "turn/end"
        ]
    );
    let events = agent.session().events();
    assert_eq!(
        events[13].source_event_seqs(),
        Some(&[8, 9, 10, 11, 12][..])
    );
    // A new session's fallback title: the prompt's first words, citing it.
    assert_eq!(
        events[5].to_json()["data"],
        json!({"title": "hi", "messageSeqs": [4], "source": {"kind": "fallback"}})
    );
    // The prompt entered the inbox, then was claimed when the turn opened.
    let EventData::InboxSpliced(queued) = &events[0].data else {
        panic!()
    };
    assert_eq!(
        (queued.start, queued.inserted[0].text().as_str()),
        (0, "hi")
    );
    let EventData::InboxSpliced(claimed) = &events[2].data else {
        panic!()
    };
    assert_eq!(claimed.removed_count, Some(1));
    let EventData::RequestHeader { header, reason } = &events[6].data else {
        panic!()
    };
    assert_eq!(reason, "initial");
    assert_eq!(header["config"]["provider"], "scripted");
    assert_eq!(header["tools"].as_array().unwrap().len(), 5);
    // A second turn reuses the header: no new request/header.
    h.script("scripted-2", vec![]);
    let again = agent.run("more?", WAIT).await.unwrap();
    assert!(
        matches!(again.reason, TurnEndReason::Error { .. }),
        "the script is exhausted: {again:?}"
    );
    let headers = agent
        .session()
        .events()
        .iter()
        .filter(|e| e.kind() == "request/header")
        .count();
    assert_eq!(headers, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_calls_run_and_their_results_enter_the_history() {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![calls(&[("echo", json!({"i": 7}))]), text("done")],
    );
    let agent = h.agent("scripted").await;
    let mut feed = h.rt.tree().subscribe();
    let summary = agent.run("go", WAIT).await.unwrap();
    assert_eq!((summary.text.as_str(), summary.steps), ("done", 2));
    assert_eq!(
        results(&agent),
        [("call_echo_0".to_owned(), None, "7".to_owned())]
    );
    let history = agent.session().derive_messages();
    let roles: Vec<Role> = history.iter().map(|m| m.role).collect();
    assert_eq!(
        roles,
        [Role::User, Role::Assistant, Role::User, Role::Assistant]
    );
    // tool/call precedes its result, which cites it.
    let events = agent.session().events();
    let call = events.iter().find(|e| e.kind() == "tool/call").unwrap();
    let result = events.iter().find(|e| e.kind() == "tool/result").unwrap();
    assert_eq!(result.source_event_seqs(), Some(&[call.seq][..]));
    // The call ran as a child actor of the agent's scope.
    let tool_node = std::iter::from_fn(|| feed.try_recv().ok())
        .find_map(|c| match c {
            dsh_supervisors::TreeChange::Spawned { node }
                if &*node.info.name == "tool/echo#call_echo_0" =>
            {
                Some(node)
            }
            _ => None,
        })
        .unwrap();
    assert_eq!(tool_node.info.parent, Some(agent.node_id()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_calls_become_error_results_and_the_turn_goes_on() {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![
            calls(&[
                ("nope", json!({})),
                ("echo", json!({"i": "x"})),
                ("boom", json!({})),
            ]),
            text("recovered"),
        ],
    );
    let agent = h.agent("scripted").await;
    let summary = agent.run("go", WAIT).await.unwrap();
    assert_eq!(summary.text, "recovered");
    let r = results(&agent);
    assert_eq!(r[0].1.as_deref(), Some("UNKNOWN_TOOL"));
    assert_eq!(r[1].1.as_deref(), Some("INVALID_ARGS"));
    assert!(
        r[1].2.contains("the arguments do not match the schema"),
        "{}",
        r[1].2
    );
    assert_eq!(r[2].1.as_deref(), Some("PANICKED"));
    assert!(r[2].2.contains("the boom tool exploded"), "{}", r[2].2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn safe_calls_run_in_parallel_and_exclusive_calls_alone() {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![
            calls(&[
                ("meet", json!({})),
                ("meet", json!({})),
                ("record", json!({"tag": "a"})),
                ("record", json!({"tag": "b"})),
            ]),
            text("ok"),
        ],
    );
    let agent = h.agent("scripted").await;
    // The two `meet` calls only finish if they run at the same time.
    let summary = agent.run("go", WAIT).await.unwrap();
    assert_eq!(summary.text, "ok");
    assert_eq!(h.lines(), ["start a", "end a", "start b", "end b"]);
    let ids: Vec<String> = results(&agent).into_iter().map(|r| r.0).collect();
    assert_eq!(
        ids,
        [
            "call_meet_0",
            "call_meet_1",
            "call_record_2",
            "call_record_3"
        ],
        "results in call order"
    );
}

/// An agent whose turn waits in a `hang` call (returned once the call's
/// node exists).
async fn hanging_on_a_call() -> (Harness, Agent) {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![calls(&[("hang", json!({}))]), text("never")],
    );
    let agent = h.agent("scripted").await;
    let mut feed = h.rt.tree().subscribe();
    agent
        .followup(dsh_services::llm::Message::user_text("go"))
        .unwrap();
    loop {
        if let Ok(dsh_supervisors::TreeChange::Spawned { node }) = feed.recv().await
            && &*node.info.name == "tool/hang#call_hang_0"
        {
            break;
        }
    }
    (h, agent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_tool_aborts_the_turn_and_records_the_call_as_aborted() {
    let (h, agent) = hanging_on_a_call().await;
    // The agent is one actor, its scope; the store-less session is a part,
    // the driver and the call in flight are task children.
    let tree = h.rt.tree();
    assert_eq!(tree.get(agent.node_id()).unwrap().form, Form::Fiber);
    // The agent's children as the tree has them: the call's node names its
    // parent from the moment it is announced (the agent's own list of
    // children catches up a moment later).
    let scope = agent.node_id();
    let parts: Vec<(String, Form)> = tree
        .snapshot()
        .into_iter()
        .filter(|n| n.parent == Some(scope))
        .map(|n| (n.kind, n.form))
        .collect();
    assert_eq!(
        parts,
        [
            ("session".to_owned(), Form::Part),
            ("agent".to_owned(), Form::Task),
            ("tool".to_owned(), Form::Task),
        ]
    );
    agent.cancel();
    agent.when_idle(WAIT).await.unwrap();
    let last = agent.last_turn().unwrap();
    assert!(
        matches!(last.reason, TurnEndReason::Aborted { .. }),
        "{last:?}"
    );
    assert_eq!(results(&agent)[0].1.as_deref(), Some("ABORTED"));
    assert_eq!(kinds(&agent).last().unwrap(), "turn/end");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_driver_stopped_mid_tool_call_cancels_its_turn_and_the_call() {
    let (h, agent) = hanging_on_a_call().await;
    let tree = h.rt.tree();
    let driver = agent
        .child_nodes()
        .into_iter()
        .find(|id| tree.get(*id).is_some_and(|n| n.kind == "agent"))
        .expect("the driver");
    // The dashboard's stop, on the driver alone: the call is cancelled and
    // answered, the turn ends aborted and is logged to its end.
    let stopped = tokio::time::timeout(WAIT, h.rt.stop_node(driver))
        .await
        .expect("the driver stops within its budget");
    assert_eq!(stopped, Some(vec![driver]));
    assert_eq!(results(&agent)[0].1.as_deref(), Some("ABORTED"));
    assert_eq!(kinds(&agent).last().unwrap(), "turn/end");
    let last = agent.last_turn().unwrap();
    assert!(
        matches!(last.reason, TurnEndReason::Aborted { .. }),
        "{last:?}"
    );
}

/// Streams "partial" and then waits until cancelled.
struct Stall;

impl LlmAdapter for Stall {
    fn name(&self) -> &str {
        "stall"
    }
    fn stream(&self, _request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
        let head = futures::stream::iter(vec![
            Ok(StreamChunk::BlockStart {
                index: 0,
                block_type: BlockType::Text,
            }),
            Ok(StreamChunk::TextDelta {
                index: 0,
                text: "partial".into(),
            }),
        ]);
        let tail = futures::stream::once(async move {
            cancel.cancelled().await;
            Err(LlmFailure {
                message: "cancelled".into(),
                code: "ABORTED".into(),
                status: None,
                provider_retry_after_ms: None,
                request_id: None,
            })
        });
        Box::pin(futures::StreamExt::chain(head, tail))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_stream_keeps_the_delivered_prefix_as_interrupted() {
    let h = Harness::new().await;
    h.adapter("stall", Arc::new(Stall));
    let agent = h.agent("stall").await;
    let seen = Arc::new(tokio::sync::Notify::new());
    let s = seen.clone();
    agent.session().observe(Arc::new(move |e| {
        if let EventData::AssistantChunk { chunk, .. } = &e.data
            && matches!(**chunk, StreamChunk::TextDelta { .. })
        {
            s.notify_one();
        }
    }));
    agent
        .followup(dsh_services::llm::Message::user_text("go"))
        .unwrap();
    seen.notified().await;
    agent.cancel();
    agent.when_idle(WAIT).await.unwrap();
    let events = agent.session().events();
    let interrupted = events
        .iter()
        .find_map(|e| match &e.data {
            EventData::AssistantMessage {
                message,
                interrupted: true,
                ..
            } => Some(message.text()),
            _ => None,
        })
        .unwrap();
    assert_eq!(interrupted, "partial");
    assert!(matches!(
        agent.last_turn().unwrap().reason,
        TurnEndReason::Aborted { .. }
    ));
    // The interrupted prefix is part of the derived history.
    assert_eq!(
        agent.session().derive_messages().last().unwrap().text(),
        "partial"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restricted_tools_are_absent_from_the_prompt_and_refuse_execution() {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![
            calls(&[("boom", json!({})), ("echo", json!({"i": 1}))]),
            text("ok"),
        ],
    );
    let mut spec = AgentSpec::new("scripted", "m", std::env::temp_dir());
    spec.restriction = Some(Restriction {
        allow: Some(vec!["echo".into(), "boom".into()]),
        deny: vec!["boom".into()],
    });
    let agent = Agent::create(&h.rt.root(), spec).await.unwrap();
    agent.run("go", WAIT).await.unwrap();
    let header = agent
        .session()
        .events()
        .iter()
        .find_map(|e| match &e.data {
            EventData::RequestHeader { header, .. } => Some(header.clone()),
            _ => None,
        })
        .unwrap();
    let names: Vec<&str> = header["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["echo"]);
    let r = results(&agent);
    assert_eq!(r[0].1.as_deref(), Some("UNKNOWN_TOOL"));
    assert!(r[0].2.contains("not available to this agent"));
    assert_eq!(r[1].1, None);
    // Another agent without the restriction still sees every tool.
    let other = h.agent("scripted").await;
    assert_eq!(
        h.tools.schemas(other.context().unwrap().scope_key()).len(),
        5
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_registered_in_the_agent_scope_shadows_the_global_one() {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![calls(&[("echo", json!({"i": 3}))]), text("ok")],
    );
    let agent = h.agent("scripted").await;
    struct Loud;
    impl dsh_services::tools::Tool for Loud {
        fn schema(&self) -> dsh_services::llm::ToolSchema {
            dsh_services::llm::ToolSchema {
                name: "echo".into(),
                description: "shouts".into(),
                parameters: json!({"type": "object"}),
            }
        }
        fn execute(
            self: Arc<Self>,
            _cx: dsh_services::tools::ToolContext,
        ) -> futures::future::BoxFuture<
            'static,
            Result<dsh_services::tools::ToolOutput, dsh_services::tools::ToolError>,
        > {
            Box::pin(async { Ok(dsh_services::tools::ToolOutput::text("LOUD")) })
        }
    }
    h.tools
        .register(&agent.context().unwrap(), Arc::new(Loud))
        .unwrap();
    agent.run("go", WAIT).await.unwrap();
    assert_eq!(results(&agent)[0].2, "LOUD");
    // Disposing the agent revokes its registration; the global one is back.
    agent.dispose().await;
    let other = h.agent("scripted").await;
    let echo = h
        .tools
        .visible(other.context().unwrap().scope_key())
        .into_iter()
        .find(|t| t.schema.name == "echo")
        .unwrap();
    assert_eq!(echo.schema.description, "test tool echo");
}

/// A tool whose own policy asks, under a hook that asks too: one question
/// with both reasons. A tool whose own policy refuses, under a hook that
/// asks: refused, nobody asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hook_and_a_tool_that_both_ask_put_one_question() {
    let h = Harness::new().await;
    /// `echo` under another name, deciding as `decision` says.
    struct Decides(&'static str, Decision);
    impl dsh_services::tools::Tool for Decides {
        fn schema(&self) -> dsh_services::llm::ToolSchema {
            dsh_services::llm::ToolSchema {
                name: self.0.into(),
                description: "decides".into(),
                parameters: json!({"type": "object"}),
            }
        }
        fn decide(
            &self,
            _policy: &dsh_services::sandbox::Policy,
            _args: &serde_json::Value,
        ) -> Decision {
            self.1.clone()
        }
        fn execute(
            self: Arc<Self>,
            _cx: dsh_services::tools::ToolContext,
        ) -> futures::future::BoxFuture<
            'static,
            Result<dsh_services::tools::ToolOutput, dsh_services::tools::ToolError>,
        > {
            Box::pin(async { Ok(dsh_services::tools::ToolOutput::text("ran")) })
        }
    }
    let root = h.rt.root();
    h.tools
        .register(
            &root,
            Arc::new(Decides("asks", Decision::Ask("the tool asks".into()))),
        )
        .unwrap();
    h.tools
        .register(
            &root,
            Arc::new(Decides(
                "refuses",
                Decision::Deny("the tool refuses".into()),
            )),
        )
        .unwrap();
    root.on_waterfall(|p: PreExecute, _next| async move {
        (Decision::Ask("the hook asks".into()), p.args)
    })
    .unwrap();
    let asked: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = asked.clone();
    root.on_waterfall(move |a: ApprovalAsk, _next| {
        seen.lock().unwrap().push(a.request.reason.clone());
        async { ApprovalOutcome::AllowedOnce }
    })
    .unwrap();
    h.script(
        "scripted",
        vec![
            calls(&[("asks", json!({}))]),
            calls(&[("refuses", json!({}))]),
            text("ok"),
        ],
    );
    let agent = h.agent("scripted").await;
    agent.run("go", WAIT).await.unwrap();
    assert_eq!(
        *asked.lock().unwrap(),
        ["the hook asks; the tool asks"],
        "one question for the first call, none for the refused one"
    );
    let r = results(&agent);
    assert_eq!((r[0].1.as_deref(), r[0].2.as_str()), (None, "ran"));
    assert_eq!(r[1].1.as_deref(), Some("DENIED"));
    assert!(r[1].2.contains("the tool refuses"), "{}", r[1].2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pipeline_runs_in_order_and_approval_fails_closed() {
    let h = Harness::new().await;
    let order: Arc<Mutex<Vec<String>>> = Arc::default();
    let root = h.rt.root();
    let o = order.clone();
    root.on_waterfall(move |p: PreExecute, next| {
        let o = o.clone();
        async move {
            o.lock().unwrap().push("pre".into());
            if p.args.get("tag").and_then(|v| v.as_str()) == Some("ask") {
                return (Decision::Ask("tag is ask".into()), p.args);
            }
            next.run(p).await
        }
    })
    .unwrap();
    let o = order.clone();
    root.on_bail(move |_: &ToolGuard| -> Option<String> {
        o.lock().unwrap().push("guard".into());
        None
    })
    .unwrap();
    let o = order.clone();
    root.on_waterfall(move |e: ToolExecute, next| {
        let o = o.clone();
        async move {
            o.lock().unwrap().push("execute".into());
            next.run(e).await
        }
    })
    .unwrap();
    let o = order.clone();
    root.on_waterfall(move |p: PostExecute, next| {
        let o = o.clone();
        async move {
            o.lock().unwrap().push("post".into());
            next.run(p).await
        }
    })
    .unwrap();
    let o = order.clone();
    root.on(move |_: &ToolResultEvent| o.lock().unwrap().push("result".into()))
        .unwrap();

    // Exclusive calls, so the two pipelines do not interleave.
    h.script(
        "scripted",
        vec![
            calls(&[
                ("record", json!({"tag": "a"})),
                ("record", json!({"tag": "ask"})),
            ]),
            text("ok"),
        ],
    );
    let agent = h.agent("scripted").await;
    agent.run("go", WAIT).await.unwrap();
    let log = order.lock().unwrap().clone();
    assert_eq!(
        log,
        [
            "pre", "guard", "execute", "post", "result", "pre", "post", "result"
        ]
    );
    let r = results(&agent);
    assert_eq!(r[0].1, None);
    assert_eq!(r[1].1.as_deref(), Some("DENIED"));
    assert!(
        r[1].2.contains("the answer was unavailable"),
        "no answerer: fail closed: {}",
        r[1].2
    );

    // An answerer allows; the `never` policy rejects without asking.
    root.on_waterfall(|_: ApprovalAsk, _next| async { ApprovalOutcome::AllowedOnce })
        .unwrap();
    h.script(
        "scripted-2",
        vec![calls(&[("record", json!({"tag": "ask"}))]), text("ok")],
    );
    let allowed = h.agent("scripted-2").await;
    allowed.run("go", WAIT).await.unwrap();
    assert_eq!(results(&allowed)[0].1, None);
    h.approval.set_policy(ApprovalPolicy::Never);
    h.script(
        "scripted-3",
        vec![calls(&[("record", json!({"tag": "ask"}))]), text("ok")],
    );
    let never = h.agent("scripted-3").await;
    never.run("go", WAIT).await.unwrap();
    assert!(results(&never)[0].2.contains("the answer was rejected"));
    // The question and its outcome are audited in the agent's log.
    let audit: Vec<(String, serde_json::Value)> = never
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::Other { kind, data } if kind.starts_with("approval/") => {
                Some((kind.to_string(), (**data).clone()))
            }
            _ => None,
        })
        .collect();
    assert_eq!(audit.len(), 2, "{audit:?}");
    assert_eq!(audit[0].0, "approval/asked");
    assert_eq!(audit[0].1["toolName"], "record");
    assert_eq!(audit[1].0, "approval/decided");
    assert_eq!(audit[1].1["outcome"], "rejected");
    assert_eq!(audit[0].1["id"], audit[1].1["id"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creation_without_its_services_fails_and_leaves_nothing_behind() {
    let rt = dsh_supervisors::Runtime::start(dsh_supervisors::RuntimeSettings::default())
        .await
        .unwrap();
    let err = Agent::create(&rt.root(), AgentSpec::new("x", "m", std::env::temp_dir()))
        .await
        .err()
        .unwrap();
    assert_eq!(
        err.to_string(),
        "the `llm` service is not provided; load its plugin first"
    );
    assert_eq!(rt.tree().live_len(), 1, "only the root");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disposing_mid_turn_drains_the_subtree_and_writes_the_turn_end() {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![calls(&[("hang", json!({}))]), text("never")],
    );
    let agent = h.agent("scripted").await;
    let mut feed = h.rt.tree().subscribe();
    agent
        .followup(dsh_services::llm::Message::user_text("go"))
        .unwrap();
    loop {
        if let Ok(dsh_supervisors::TreeChange::Spawned { node }) = feed.recv().await
            && node.info.name.starts_with("tool/hang")
        {
            break;
        }
    }
    tokio::time::timeout(WAIT, agent.dispose()).await.unwrap();
    assert_eq!(agent.status(), Status::Disposed);
    assert!(matches!(
        &agent.session().events().last().unwrap().data,
        EventData::TurnEnd { reason, .. } if matches!(**reason, TurnEndReason::Aborted { .. })
    ));
    assert!(
        agent
            .followup(dsh_services::llm::Message::user_text("late"))
            .is_err()
    );
    let live: Vec<String> = h.rt.tree().snapshot().into_iter().map(|n| n.name).collect();
    assert!(
        !live
            .iter()
            .any(|n| n.contains("tool/") || n.starts_with("driver/") || n.starts_with("session/")),
        "{live:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_failure_ends_the_turn_with_the_structured_error() {
    let h = Harness::new().await;
    h.script(
        "scripted",
        vec![ScriptStep {
            error: Some(dsh_services::providers::scripted::ScriptedError {
                code: "RATE_LIMITED".into(),
                message: "slow down".into(),
                status: Some(429),
            }),
            ..ScriptStep::default()
        }],
    );
    let agent = h.agent("scripted").await;
    let summary = agent.run("go", WAIT).await.unwrap();
    let TurnEndReason::Error { error } = summary.reason else {
        panic!("{summary:?}")
    };
    assert_eq!(
        (error.code.as_str(), error.status),
        ("RATE_LIMITED", Some(429))
    );
    assert!(!kinds(&agent).contains(&"assistant/message".to_owned()));
}

/// Waits until the test opens the gate.
struct Gate(Arc<tokio::sync::Notify>);

impl dsh_services::tools::Tool for Gate {
    fn schema(&self) -> dsh_services::llm::ToolSchema {
        dsh_services::llm::ToolSchema {
            name: "gate".into(),
            description: "waits for the test".into(),
            parameters: json!({"type": "object"}),
        }
    }
    fn execute(
        self: Arc<Self>,
        _cx: dsh_services::tools::ToolContext,
    ) -> futures::future::BoxFuture<
        'static,
        Result<dsh_services::tools::ToolOutput, dsh_services::tools::ToolError>,
    > {
        Box::pin(async move {
            self.0.notified().await;
            Ok(dsh_services::tools::ToolOutput::text("opened"))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steer_and_inject_enter_the_running_turn_at_its_next_step() {
    let h = Harness::new().await;
    let gate = Arc::new(tokio::sync::Notify::new());
    h.tools
        .register(&h.rt.root(), Arc::new(Gate(gate.clone())))
        .unwrap();
    h.script(
        "scripted",
        vec![calls(&[("gate", json!({}))]), text("done")],
    );
    let agent = h.agent("scripted").await;
    let mut feed = h.rt.tree().subscribe();
    agent
        .followup(dsh_services::llm::Message::user_text("go"))
        .unwrap();
    loop {
        if let Ok(dsh_supervisors::TreeChange::Spawned { node }) = feed.recv().await
            && node.info.name.starts_with("tool/gate")
        {
            break;
        }
    }
    agent
        .steer(dsh_services::llm::Message::user_text("also this"))
        .unwrap();
    let mut notice = dsh_services::llm::Message::user_text("a file changed");
    notice.source = dsh_services::llm::MessageSource::plugin("watcher");
    agent.inject(notice).unwrap();
    gate.notify_one();
    agent.when_idle(WAIT).await.unwrap();
    let summary = agent.last_turn().unwrap();
    assert_eq!(
        (summary.turn, summary.steps, summary.text.as_str()),
        (1, 2, "done"),
        "one turn, steered"
    );
    let kinds_texts: Vec<(String, String)> = agent
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::StepStart { step, .. } => Some(("step".into(), step.to_string())),
            EventData::UserMessage(m) => Some((m.source.kind.to_string(), m.text())),
            _ => None,
        })
        .collect();
    assert_eq!(
        kinds_texts,
        [
            ("step".to_owned(), "1".to_owned()),
            ("user".to_owned(), "go".to_owned()),
            ("step".to_owned(), "2".to_owned()),
            ("user".to_owned(), "also this".to_owned()),
            ("plugin".to_owned(), "a file changed".to_owned()),
        ]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_observer_is_isolated_and_routes_register_all_or_nothing() {
    let h = Harness::new().await;
    h.script("scripted", vec![text("ok")]);
    let agent = h.agent("scripted").await;
    let seen = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    agent
        .session()
        .observe(Arc::new(|_| panic!("observer down")));
    let s = seen.clone();
    // An observer sees an event only once it is committed: it is in the
    // log at its seq when the observer runs.
    let uncommitted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (u, session) = (uncommitted.clone(), agent.session().clone());
    agent.session().observe(Arc::new(move |e| {
        s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let logged = session.events_from(e.seq).first().cloned();
        if logged.is_none_or(|l| !Arc::ptr_eq(&l, e)) {
            u.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }));
    agent.run("go", WAIT).await.unwrap();
    assert_eq!(
        seen.load(std::sync::atomic::Ordering::SeqCst) as u64,
        agent.session().next_seq()
    );
    assert_eq!(uncommitted.load(std::sync::atomic::Ordering::SeqCst), 0);
    // Provider routes: a registration naming a taken route changes nothing.
    let err = h
        .llm
        .register(
            &h.rt.root(),
            &["fresh", "scripted"],
            Arc::new(dsh_services::providers::scripted::ScriptedModel::new(
                vec![],
            )),
        )
        .err()
        .unwrap();
    assert!(
        matches!(&err, RegisterError::Taken { what: "provider route", name } if name == "scripted"),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "provider route `scripted` is already registered in this scope"
    );
    assert!(!h.llm.providers().contains(&"fresh".to_owned()));
}

/// Waits for the gate to open, tracking how many calls are inside at once.
struct Gated {
    inside: tokio::sync::watch::Sender<(usize, usize)>,
    open: tokio::sync::watch::Receiver<bool>,
}

impl dsh_services::tools::Tool for Gated {
    fn schema(&self) -> dsh_services::llm::ToolSchema {
        dsh_services::llm::ToolSchema {
            name: "gated".into(),
            description: "Waits for the test's gate.".into(),
            parameters: json!({"type": "object", "properties": {}}),
        }
    }
    fn is_concurrency_safe(&self) -> bool {
        true
    }
    fn execute(
        self: Arc<Self>,
        _cx: dsh_services::tools::ToolContext,
    ) -> futures::future::BoxFuture<
        'static,
        Result<dsh_services::tools::ToolOutput, dsh_services::tools::ToolError>,
    > {
        Box::pin(async move {
            self.inside.send_modify(|(now, most)| {
                *now += 1;
                *most = (*most).max(*now);
            });
            let mut open = self.open.clone();
            let _ = open.wait_for(|o| *o).await;
            self.inside.send_modify(|(now, _)| *now -= 1);
            Ok(dsh_services::tools::ToolOutput::text("passed"))
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_runs_at_most_max_parallel_tools_calls_at_once() {
    let h = Harness::new().await;
    let (inside, mut watch_inside) = tokio::sync::watch::channel((0usize, 0usize));
    let (gate, open) = tokio::sync::watch::channel(false);
    h.tools
        .register(&h.rt.root(), Arc::new(Gated { inside, open }))
        .unwrap();
    let five: Vec<(&str, serde_json::Value)> = (0..5).map(|_| ("gated", json!({}))).collect();
    h.script("s", vec![calls(&five), text("all passed")]);
    let mut spec = AgentSpec::new("s", "m", std::env::temp_dir());
    spec.max_parallel_tools = 2;
    let agent = Agent::create(&h.rt.root(), spec).await.unwrap();
    agent
        .followup(dsh_services::llm::Message::user_text("go"))
        .unwrap();
    watch_inside.wait_for(|(now, _)| *now == 2).await.unwrap();
    gate.send_replace(true);
    agent.when_idle(WAIT).await.unwrap();
    let (now, most) = *watch_inside.borrow();
    assert_eq!((now, most), (0, 2), "at most two calls ran at once");
    assert_eq!(results(&agent).len(), 5);
    assert_eq!(agent.last_turn().unwrap().text, "all passed");
    h.rt.shutdown().await;
}

/// Always asks for the `hang` tool.
struct AlwaysHang;

impl dsh_services::llm::LlmAdapter for AlwaysHang {
    fn name(&self) -> &str {
        "always-hang"
    }
    fn stream(
        &self,
        _request: dsh_services::llm::LlmRequest,
        _cancel: CancellationToken,
    ) -> dsh_services::llm::ChunkStream {
        super::harness::answer(vec![dsh_services::llm::ContentBlock::ToolCall {
            id: "call_hang".into(),
            name: "hang".into(),
            arguments: "{}".into(),
        }])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_right_after_a_followup_is_not_lost() {
    let h = Harness::new().await;
    h.adapter("hang", Arc::new(AlwaysHang));
    for _ in 0..20 {
        let agent = h.agent("hang").await;
        agent
            .followup(dsh_services::llm::Message::user_text("go"))
            .unwrap();
        // Whether or not the driver has claimed the prompt yet.
        agent.cancel();
        agent.when_idle(WAIT).await.unwrap();
        assert!(
            matches!(
                agent.last_turn().unwrap().reason,
                TurnEndReason::Aborted { .. }
            ),
            "{:?}",
            agent.last_turn()
        );
        agent.dispose().await;
    }
    h.rt.shutdown().await;
}
