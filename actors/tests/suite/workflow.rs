//! The workflow engine: fan-out, script errors with their line, limits,
//! cancellation, and the run's subtree.

use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::Agent;
use dsh_actors::subagent::Subagents;
use dsh_actors::workflow::{
    WorkflowEngine, WorkflowError, WorkflowLimits, WorkflowRequest, WorkflowStop, WorkflowUpdate,
};
use dsh_services::llm::{ChunkStream, ContentBlock, LlmAdapter, LlmRequest};
use dsh_services::session::{EventData, TurnEndReason};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::harness::{Harness, Park, answer, prompt_of};

/// Answers `done: <prompt>`; a prompt containing `park` parks first, and
/// one containing `report` reports `{"n": <prompt length>}`.
struct Children;

impl LlmAdapter for Children {
    fn name(&self) -> &str {
        "children"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let prompt = prompt_of(&request);
        let answered = request
            .messages
            .last()
            .is_some_and(|m| m.source.kind == "tool");
        let call = |name: &str, args: serde_json::Value| ContentBlock::ToolCall {
            id: format!("call_{name}"),
            name: name.into(),
            arguments: args.to_string(),
        };
        let blocks = if prompt.contains("park") && !answered {
            vec![call("park", json!({}))]
        } else if prompt.starts_with("report") && !answered {
            vec![call(
                "report",
                json!({"n": prompt.lines().next().unwrap_or_default().len()}),
            )]
        } else {
            let first_line = prompt.lines().next().unwrap_or_default();
            vec![ContentBlock::text(format!("done: {first_line}"))]
        };
        answer(blocks)
    }
}

struct World {
    h: Harness,
    engine: WorkflowEngine,
    parent: Agent,
    parked: watch::Receiver<usize>,
}

async fn world() -> World {
    let h = Harness::new().await;
    let root = h.rt.root();
    let subagents = Arc::new(Subagents::with_builtin());
    root.provide(Subagents::SERVICE, subagents.clone()).unwrap();
    h.adapter("children", Arc::new(Children));
    let (tx, parked) = watch::channel(0);
    h.tools
        .register(&root, Arc::new(Park { parked: tx }))
        .unwrap();
    let limits = WorkflowLimits {
        max_total_agents: 16,
        ..WorkflowLimits::default()
    };
    let engine = WorkflowEngine::new(subagents, "spawn", limits);
    let parent = h.agent("children").await;
    World {
        h,
        engine,
        parent,
        parked,
    }
}

/// Starts a run, waits for its result, disposes it.
async fn settle(
    engine: &WorkflowEngine,
    request: WorkflowRequest,
) -> dsh_actors::workflow::WorkflowResult {
    let run = engine.start(request).await.unwrap();
    let result = run.result().await;
    run.dispose().await;
    result
}

fn meta() -> serde_json::Value {
    json!({"name": "test-flow", "description": "a test workflow"})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_fans_out_and_returns_json() {
    let w = world().await;
    let updates = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = updates.clone();
    w.h.rt
        .root()
        .on(move |u: &WorkflowUpdate| seen.lock().unwrap().push(u.kind))
        .unwrap();
    let script = r#"
phase("fan-out");
log("starting " + args.items.length);
const results = await Promise.all(args.items.map(i => agent("task " + i, {label: "t" + i})));
const structured = await agent("report this", {schema: {type: "object", properties: {n: {type: "integer"}}, required: ["n"]}});
return {results, structured, total: results.length};
"#;
    let mut request = WorkflowRequest::new(&w.parent, script, meta());
    request.args = json!({"items": [1, 2, 3]});
    let run = w.engine.start(request).await.unwrap();
    let result = run.result().await;
    run.dispose().await;
    assert_eq!(result.stop_reason, WorkflowStop::Completed, "{result:?}");
    assert_eq!(
        result.value,
        json!({
            "results": ["done: task 1", "done: task 2", "done: task 3"],
            "structured": {"n": 11},
            "total": 3
        })
    );
    assert_eq!(result.agents_started, 4);
    let kinds = updates.lock().unwrap().clone();
    assert_eq!(kinds.first(), Some(&"workflow/start"));
    assert_eq!(kinds.last(), Some(&"workflow/end"));
    assert!(kinds.contains(&"workflow/phase") && kinds.contains(&"workflow/log"));
    assert_eq!(
        kinds
            .iter()
            .filter(|k| **k == "workflow/agent-start")
            .count(),
        4
    );
    assert_eq!(
        kinds.iter().filter(|k| **k == "workflow/agent-end").count(),
        4
    );
    // The parent's log names every child, paired start and end.
    let members: Vec<(String, String)> = w
        .parent
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::Other { kind, data } if kind.starts_with("tool-workflow/agent-") => Some((
                kind.to_string(),
                data["child"].as_str().unwrap_or_default().to_owned(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(members.len(), 8, "{members:?}");
    for (_, child) in &members {
        assert!(!child.is_empty());
    }
    w.h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_limit_stops_a_script_that_hoards() {
    let h = Harness::new().await;
    let subagents = Arc::new(Subagents::with_builtin());
    h.adapter("children", Arc::new(Children));
    let limits = WorkflowLimits {
        memory_bytes: 8 << 20,
        ..WorkflowLimits::default()
    };
    let engine = WorkflowEngine::new(subagents, "spawn", limits);
    let parent = h.agent("children").await;
    let script = "const hoard = [];\nwhile (true) { hoard.push(new Array(100000).fill(1)); }";
    let r = settle(&engine, WorkflowRequest::new(&parent, script, meta())).await;
    assert_eq!(r.stop_reason, WorkflowStop::Error);
    assert!(
        r.error.as_deref().unwrap().contains("out of memory"),
        "{r:?}"
    );
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn script_errors_name_their_line_and_column() {
    let w = world().await;
    let runtime_error = "const a = 1;\nconst b = a + 1;\nnull.boom;\nreturn b;";
    let r = settle(
        &w.engine,
        WorkflowRequest::new(&w.parent, runtime_error, meta()),
    )
    .await;
    assert_eq!(r.stop_reason, WorkflowStop::Error);
    let e = r.error.unwrap();
    assert!(e.contains("TypeError") && e.contains("line 3"), "{e}");

    let syntax_error = "const x = 1;\nconst = 2;\nreturn x;";
    let r = settle(
        &w.engine,
        WorkflowRequest::new(&w.parent, syntax_error, meta()),
    )
    .await;
    let e = r.error.unwrap();
    assert!(e.contains("SyntaxError") && e.contains("line 2"), "{e}");

    let thrown = "await agent('one');\nthrow new Error('nope');";
    let r = settle(&w.engine, WorkflowRequest::new(&w.parent, thrown, meta())).await;
    let e = r.error.unwrap();
    assert!(e.contains("nope") && e.contains("line 2"), "{e}");
    assert_eq!(r.agents_started, 1);
    w.h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn misuse_and_caps_are_fatal_even_when_caught() {
    let w = world().await;
    let bad_option = "try { await agent('x', {model: 'big'}); } catch (e) {}\nreturn 1;";
    let r = settle(
        &w.engine,
        WorkflowRequest::new(&w.parent, bad_option, meta()),
    )
    .await;
    assert_eq!(r.stop_reason, WorkflowStop::Error);
    assert!(
        r.error
            .as_deref()
            .unwrap()
            .starts_with("UNSUPPORTED_OPTION"),
        "{r:?}"
    );

    let too_many = "await Promise.all([1, 2, 3].map(i => agent('t' + i)));\nreturn 1;";
    let mut request = WorkflowRequest::new(&w.parent, too_many, meta());
    request.max_total_agents = Some(2);
    let r = settle(&w.engine, request).await;
    assert!(
        r.error.as_deref().unwrap().starts_with("AGENT_CAP"),
        "{r:?}"
    );

    // Refused before anything runs: a bad meta block, a limit above the ceiling.
    let err = w
        .engine
        .start(WorkflowRequest::new(
            &w.parent,
            "return 1",
            json!({"name": "Bad Name", "description": "x"}),
        ))
        .await
        .err()
        .unwrap();
    assert!(
        matches!(err, WorkflowError::MetaInvalid(ref m) if m.contains("name")),
        "{err}"
    );
    let err = w
        .engine
        .start(WorkflowRequest::new(
            &w.parent,
            "return 1",
            json!({"name": "a", "description": "x", "extra": 1}),
        ))
        .await
        .err()
        .unwrap();
    assert!(matches!(err, WorkflowError::MetaInvalid(_)), "{err}");
    let mut request = WorkflowRequest::new(&w.parent, "return 1", meta());
    request.max_total_agents = Some(17);
    assert!(matches!(
        w.engine.start(request).await.err(),
        Some(WorkflowError::InvalidRequest(_))
    ));
    w.h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_time_limit_kills_a_spinning_or_stuck_script() {
    let w = world().await;
    for script in ["while (true) {}", "await agent('park forever');"] {
        let mut request = WorkflowRequest::new(&w.parent, script, meta());
        request.time = Some(Duration::from_millis(300));
        let r = settle(&w.engine, request).await;
        assert_eq!(r.stop_reason, WorkflowStop::Error, "{script}: {r:?}");
        assert!(
            r.error.as_deref().unwrap().starts_with("TIME_LIMIT"),
            "{script}: {r:?}"
        );
    }
    // Awaiting what nothing can settle fails at once, not at the deadline.
    let r = settle(
        &w.engine,
        WorkflowRequest::new(&w.parent, "await new Promise(() => {});", meta()),
    )
    .await;
    assert!(
        r.error.as_deref().unwrap().starts_with("SCRIPT_STUCK"),
        "{r:?}"
    );
    let r = settle(
        &w.engine,
        WorkflowRequest::new(&w.parent, "while (true) { log('x'); }", meta()),
    )
    .await;
    assert!(r.error.as_deref().unwrap().starts_with("LOG_CAP"), "{r:?}");
    w.h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_mid_run_aborts_the_children_and_frees_the_subtree() {
    let mut w = world().await;
    let live = w.h.rt.tree().live_len();
    let script = "const r = await Promise.all([agent('park 1'), agent('park 2')]);\nreturn r;";
    let cancel = CancellationToken::new();
    let mut request = WorkflowRequest::new(&w.parent, script, meta());
    request.cancel = cancel.clone();
    let run = w.engine.start(request).await.unwrap();
    tokio::time::timeout(Duration::from_secs(30), w.parked.wait_for(|n| *n == 2))
        .await
        .unwrap()
        .unwrap();
    let children: Vec<Agent> = {
        let agents =
            w.h.rt
                .root()
                .get::<dsh_actors::agent::Agents>(dsh_actors::agent::Agents::SERVICE)
                .unwrap();
        agents
            .ids()
            .into_iter()
            .filter(|id| id != w.parent.id())
            .filter_map(|id| agents.get(&id))
            .collect()
    };
    assert_eq!(children.len(), 2);
    cancel.cancel();
    let r = run.result().await;
    assert_eq!(r.stop_reason, WorkflowStop::Cancelled);
    run.dispose().await;
    for c in &children {
        let end = c
            .session()
            .events()
            .iter()
            .rev()
            .find_map(|e| match &e.data {
                EventData::TurnEnd { reason, .. } => Some((**reason).clone()),
                _ => None,
            });
        assert!(
            matches!(end, Some(TurnEndReason::Aborted { .. })),
            "{end:?}"
        );
        assert!(c.status().is_terminal());
        assert_eq!(
            c.session().with_log(|l| l.header().parent_session.clone()),
            Some(w.parent.id().to_owned())
        );
    }
    assert_eq!(w.h.rt.tree().live_len(), live, "the run's subtree is gone");
    w.h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_calls_beyond_the_concurrency_limit_wait_their_turn() {
    let h = Harness::new().await;
    let subagents = Arc::new(Subagents::with_builtin());
    h.adapter("children", Arc::new(Children));
    let limits = WorkflowLimits {
        max_concurrency: 2,
        ..WorkflowLimits::default()
    };
    let engine = WorkflowEngine::new(subagents, "spawn", limits);
    let parent = h.agent("children").await;
    let in_flight = Arc::new(std::sync::Mutex::new((0i32, 0i32)));
    let seen = in_flight.clone();
    h.rt.root()
        .on(move |u: &WorkflowUpdate| {
            let mut s = seen.lock().unwrap();
            match u.kind {
                "workflow/agent-start" => s.0 += 1,
                "workflow/agent-end" => s.0 -= 1,
                _ => {}
            }
            s.1 = s.1.max(s.0);
        })
        .unwrap();
    let script = "return await Promise.all([1, 2, 3, 4, 5, 6].map(i => agent('task ' + i)));";
    let r = settle(&engine, WorkflowRequest::new(&parent, script, meta())).await;
    assert_eq!(r.stop_reason, WorkflowStop::Completed, "{r:?}");
    assert_eq!(r.value.as_array().unwrap().len(), 6);
    assert_eq!(r.value[5], json!("done: task 6"), "results keep call order");
    let (now, most) = *in_flight.lock().unwrap();
    assert_eq!(now, 0);
    assert!(most <= 2, "{most} children ran at once");
    h.rt.shutdown().await;
}
