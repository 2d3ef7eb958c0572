//! The dashboard in headless Chromium (Debian `chromium`, driven by npm
//! `playwright-core`): while a workflow runs, the page's tree grows; a click
//! on an agent shows its events; cancelling the coordinator from the page
//! drains its subtree, and the teardown view shows the stop order.

use std::sync::Arc;
use std::time::Duration;

use dsh::actors::agent::{Agent, AgentSpec};
use dsh::kernel::{Runtime, RuntimeSettings, Status};
use dsh::services::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmRequest, LlmRuntime, ToolSchema,
};
use dsh::services::tools::{Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};
use dsh::web::{Web, WebConfig, WebServer};
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::io::AsyncBufReadExt;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

/// The coordinator starts a workflow of three parked children.
struct Board;

impl LlmAdapter for Board {
    fn name(&self) -> &str {
        "board"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let prompt = request
            .messages
            .iter()
            .find(|m| m.source.kind == "user")
            .map(|m| m.text())
            .unwrap_or_default();
        let answered = request
            .messages
            .last()
            .is_some_and(|m| m.source.kind == "tool");
        let call = |name: &str, args: serde_json::Value| ContentBlock::ToolCall {
            id: format!("call_{name}"),
            name: name.into(),
            arguments: args.to_string(),
        };
        let (blocks, finish) = if answered {
            (vec![ContentBlock::text("done")], FinishReason::Stop)
        } else if prompt.starts_with("park") {
            (
                vec![call("park", serde_json::json!({}))],
                FinishReason::ToolCalls,
            )
        } else {
            let script = "return await Promise.all([1, 2, 3].map(i => agent('park ' + i, {label: 'worker ' + i})));";
            let meta =
                serde_json::json!({"name": "watched", "description": "three parked workers"});
            (
                vec![call(
                    "workflow",
                    serde_json::json!({"script": script, "meta": meta}),
                )],
                FinishReason::ToolCalls,
            )
        };
        let chunks =
            dsh::services::providers::scripted::chunks_for(&blocks, Default::default(), finish);
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

struct Park;

impl Tool for Park {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "park".into(),
            description: "Waits until cancelled.".into(),
            parameters: serde_json::json!({"type": "object", "properties": {}}),
        }
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            cx.cancel.cancelled().await;
            Err(ToolError::new("ABORTED", "park was cancelled"))
        }
        .boxed()
    }
}

/// The agent services with `model` on `route`, and the web plugin (with
/// mutations) on a free loopback port; the runtime and the page's URL
/// (with the token the server made, in its fragment).
async fn serve_page(route: &str, model: Arc<dyn LlmAdapter>) -> (Runtime, String) {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let root = rt.root();
    root.plugin(dsh::catalogue::AgentServices, Default::default())
        .await
        .unwrap();
    let llm = root.get::<LlmRuntime>(LlmRuntime::SERVICE).unwrap();
    llm.register(&root, &[route], model).unwrap();
    let config = WebConfig {
        bind: "127.0.0.1:0".into(),
        token_env: None,
        mutations: true,
    };
    root.plugin(Web, config).await.unwrap();
    let url = root
        .get::<WebServer>(WebServer::SERVICE)
        .unwrap()
        .page_url();
    assert!(url.contains("/#token="), "{url}");
    (rt, url)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_the_tree_growing_events_and_a_cancel_draining_in_order() {
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let (rt, base) = serve_page("board", Arc::new(Board)).await;
    let root = rt.root();
    let tools = root.get::<ToolRegistry>(ToolRegistry::SERVICE).unwrap();
    tools.register(&root, Arc::new(Park)).unwrap();
    let mut spec = AgentSpec::new("board", "m", std::env::temp_dir());
    spec.name = Some("coordinator".into());
    let coordinator = Agent::create(&root, spec).await.unwrap();

    let script =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/browser/dashboard.cjs");
    let mut node = tokio::process::Command::new("node")
        .arg(&script)
        .arg(&base)
        .arg(coordinator.node_id().to_string())
        .env(
            "PLAYWRIGHT_CORE",
            peers.join("npm/node_modules/playwright-core"),
        )
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("node runs");
    let mut lines = tokio::io::BufReader::new(node.stdout.take().unwrap()).lines();
    let ready = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("the page loads")
        .unwrap();
    assert_eq!(ready.as_deref(), Some("READY"));
    // Now the workflow starts, and the page watches its tree grow.
    coordinator
        .followup(dsh::services::llm::Message::user_text("start the workflow"))
        .unwrap();
    let report = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .expect("the browser test finishes")
        .unwrap()
        .expect("a report line");
    let status = tokio::time::timeout(WAIT, node.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "the browser script failed: {report}");
    let seen: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(seen["before"], 0);
    assert!(seen["grown"].as_u64().unwrap() >= 3, "{seen}");
    // Readable names: each child by its workflow label; the search finds one.
    assert_eq!(
        seen["labels"],
        serde_json::json!(["«worker 1»", "«worker 2»", "«worker 3»"]),
        "{seen}"
    );
    assert_eq!(seen["found"], serde_json::json!(["«worker 2»"]), "{seen}");
    // The coordinator's conversation names its children's sessions as
    // links; one opens that child's conversation.
    assert!(seen["links"].as_u64().unwrap() >= 1, "{seen}");
    assert!(seen["linked"].as_str().unwrap().contains("park "), "{seen}");
    assert!(seen["events"].as_u64().unwrap() >= 3, "{seen}");
    let order: Vec<u64> = seen["order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["seq"].as_u64().unwrap())
        .collect();
    assert!(order.len() >= 3, "{seen}");
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "stop order: {order:?}"
    );
    // Nothing forgotten: the stopped children stay in the tree, and one's
    // final state shows when selected.
    assert!(seen["kept"].as_u64().unwrap() >= 3, "{seen}");
    let last = seen["final"].as_str().unwrap();
    assert!(
        last.contains("scope/subagent/") && (last.contains("disposed") || last.contains("stopped")),
        "{last}"
    );
    // The page's cancel reached the coordinator: its turn ended aborted.
    coordinator.when_idle(WAIT).await.unwrap();
    assert!(matches!(
        coordinator.last_turn().unwrap().reason,
        dsh::services::session::TurnEndReason::Aborted { .. }
    ));
    rt.shutdown().await;
}

/// Asks once to run outside the sandbox, then answers with what it got.
struct Asker;

impl LlmAdapter for Asker {
    fn name(&self) -> &str {
        "asker"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let result = request.messages.last().filter(|m| m.source.kind == "tool");
        let (blocks, finish) = match result {
            Some(_) => (vec![ContentBlock::text("done")], FinishReason::Stop),
            None => (
                vec![ContentBlock::ToolCall {
                    id: "call_bash".into(),
                    name: "bash".into(),
                    arguments: serde_json::json!({
                        "command": "echo approved-from-the-page",
                        "description": "probe",
                        "sandbox_permissions": "danger-full-access",
                        "justification": "shown in the dashboard"
                    })
                    .to_string(),
                }],
                FinishReason::ToolCalls,
            ),
        };
        let chunks =
            dsh::services::providers::scripted::chunks_for(&blocks, Default::default(), finish);
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_a_pending_approval_and_answers_it() {
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let (rt, base) = serve_page("asker", Arc::new(Asker)).await;
    let root = rt.root();
    let agent = Agent::create(&root, AgentSpec::new("asker", "m", std::env::temp_dir()))
        .await
        .unwrap();
    agent
        .followup(dsh::services::llm::Message::user_text("go"))
        .unwrap();
    let seen = browser_report(&peers, "approvals.cjs", &base).await;
    let shown = seen["shown"].as_str().unwrap();
    assert!(
        shown.contains("bash") && shown.contains("shown in the dashboard"),
        "{shown}"
    );
    let answered = seen["answered"].as_str().unwrap();
    assert!(
        answered.contains("approval asked · bash") && answered.ends_with("→ allowed-once"),
        "{answered}"
    );
    agent.when_idle(WAIT).await.unwrap();
    let ran =
        agent.session().events().iter().any(|e| {
            e.kind() == "tool/result" && e.to_line().contains("approved-from-the-page\\n")
        });
    assert!(ran, "the approved call ran");
    rt.shutdown().await;
}

/// Nodes of another machine, as a parent's tree mirrors them: the page
/// names their node, marks a lost one, and shows a hostile kind as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_shows_mirrored_nodes_with_their_node_and_a_hostile_kind_as_text() {
    let _sweep = crate::suite::sweep();
    use dsh::kernel::tree::{Form, Mirrored};
    let peers = super::peers::peers();
    let (rt, base) = serve_page("board", Arc::new(Board)).await;
    let tree = rt.tree();
    let part = tree.park(
        "remote-child",
        "b/subagent/m1".into(),
        Some(rt.root().fiber().id()),
        Arc::new(|| serde_json::Value::Null),
    );
    let mirrored = |kind: &str, name: &str, form| Mirrored {
        node: "b".into(),
        form,
        kind: kind.into(),
        name: name.into(),
        status: Status::Active,
        started_ms: 0,
        summary: serde_json::json!({"agent": "m1"}),
    };
    let hostile = "<img src=x onerror=\"window.pwned=1\">";
    let scope = tree.mirror(part, mirrored(hostile, "scope/subagent/m1", Form::Fiber));
    let driver = tree.mirror(scope, mirrored("agent", "driver/m1", Form::Task));
    assert!(tree.lose(driver));
    let seen = browser_report(&peers, "mirror.cjs", &base).await;
    let scope_row = seen["scope"].as_str().unwrap();
    assert!(scope_row.contains(hostile), "shown as text: {scope_row}");
    assert!(scope_row.contains("fiber on b"), "{scope_row}");
    let driver_row = seen["driver"].as_str().unwrap();
    assert!(
        driver_row.contains("lost") && driver_row.contains("task on b"),
        "{driver_row}"
    );
    assert_eq!(seen["injected"], 0, "the hostile kind ran");
    rt.shutdown().await;
}

/// Runs `tests/browser/SCRIPT` against the page at `base` in headless
/// Chromium, and reads the one JSON line it prints.
async fn browser_report(peers: &std::path::Path, script: &str, base: &str) -> serde_json::Value {
    browser_report_with(peers, script, base, &[]).await
}

/// [`browser_report`] with more arguments for the script after the URL.
async fn browser_report_with(
    peers: &std::path::Path,
    script: &str,
    base: &str,
    more: &[&str],
) -> serde_json::Value {
    let script = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/browser")
        .join(script);
    let run = tokio::process::Command::new("node")
        .arg(&script)
        .arg(base)
        .args(more)
        .env(
            "PLAYWRIGHT_CORE",
            peers.join("npm/node_modules/playwright-core"),
        )
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(WAIT, run)
        .await
        .expect("the browser test finishes")
        .expect("node runs");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the browser script failed: {report} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(report.trim()).unwrap()
}

/// Answers every request with one text: what the test gives it.
struct Says(String);

impl LlmAdapter for Says {
    fn name(&self) -> &str {
        "says"
    }
    fn stream(&self, _request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let blocks = [ContentBlock::text(self.0.clone())];
        let chunks = dsh::services::providers::scripted::chunks_for(
            &blocks,
            Default::default(),
            FinishReason::Stop,
        );
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

/// Attack: a model answers with an `<img onerror>`, a `<script>` and a
/// Markdown image pointing at a local server; the page shows it all as text,
/// runs nothing and fetches nothing (the server sees no connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_answer_shown_on_the_page_runs_nothing_and_fetches_nothing() {
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let sink = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = sink.local_addr().unwrap().port();
    let fetched = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = fetched.clone();
    let listening = tokio::spawn(async move {
        while let Ok((_conn, _)) = sink.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let answer = format!(
        "<img src=x onerror=\"window.pwned=1\"> <script>window.pwned=2</script> ![](http://127.0.0.1:{port}/x) <img src=\"http://127.0.0.1:{port}/y\">"
    );
    let (rt, base) = serve_page("says", Arc::new(Says(answer))).await;
    let cwd = dsh::kernel::scratch::fresh_dir("dsh-hostile").unwrap();
    let agent = Agent::create(&rt.root(), AgentSpec::new("says", "m", cwd))
        .await
        .unwrap();
    agent.run("hello", WAIT).await.unwrap();
    let seen = browser_report_with(&peers, "hostile.cjs", &base, &[&port.to_string()]).await;
    let shown = seen["shown"].as_str().unwrap();
    // The conversation shows the answer as text, the image named only.
    assert!(
        shown.contains("<img src=x onerror=\"window.pwned=1\">"),
        "shown as text: {shown}"
    );
    assert!(shown.contains("<script>window.pwned=2</script>"), "{shown}");
    assert!(
        shown.contains(&format!("[image: http://127.0.0.1:{port}/x]")),
        "{shown}"
    );
    assert_eq!(seen["pwned"], serde_json::Value::Null, "{seen}");
    assert_eq!(seen["images"], 0, "{seen}");
    assert_eq!(seen["scripts"], 1, "only the page's own script: {seen}");
    assert_eq!(seen["requests"], serde_json::json!([]), "{seen}");
    assert_eq!(fetched.load(std::sync::atomic::Ordering::SeqCst), 0);
    listening.abort();
    rt.shutdown().await;
}

/// Calls `lookup` once, then answers in Markdown.
struct Looks;

impl LlmAdapter for Looks {
    fn name(&self) -> &str {
        "looks"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let answered = request
            .messages
            .last()
            .is_some_and(|m| m.source.kind == "tool");
        let (blocks, finish) = if answered {
            (
                vec![ContentBlock::text(
                    "**Found** it:\n- one\n- `two`\n\n```\nlet x = 1;\n```",
                )],
                FinishReason::Stop,
            )
        } else {
            (
                vec![ContentBlock::ToolCall {
                    id: "call_lookup".into(),
                    name: "lookup".into(),
                    arguments: serde_json::json!({"query": "supervision trees"}).to_string(),
                }],
                FinishReason::ToolCalls,
            )
        };
        let chunks =
            dsh::services::providers::scripted::chunks_for(&blocks, Default::default(), finish);
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

struct Lookup;

impl Tool for Lookup {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "lookup".into(),
            description: "Looks something up.".into(),
            parameters: serde_json::json!({"type": "object", "properties": {"query": {"type": "string"}}}),
        }
    }
    fn execute(
        self: Arc<Self>,
        _cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move { Ok(ToolOutput::text("first finding\nsecond finding")) }.boxed()
    }
}

/// An agent's session reads as a conversation: the user's message, the
/// tool call with what it asked and its result, the answer rendered as
/// Markdown (strong, list, code), the turn's end. The screenshot is kept
/// (`dashboard-conversation.png`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_session_reads_as_a_conversation() {
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let (rt, base) = serve_page("looks", Arc::new(Looks)).await;
    let root = rt.root();
    let tools = root.get::<ToolRegistry>(ToolRegistry::SERVICE).unwrap();
    tools.register(&root, Arc::new(Lookup)).unwrap();
    let cwd = dsh::kernel::scratch::fresh_dir("dsh-conversation").unwrap();
    let agent = Agent::create(&root, AgentSpec::new("looks", "m", cwd))
        .await
        .unwrap();
    agent.run("Find what supervises what.", WAIT).await.unwrap();
    // A hook's decision, as the hook bridge records it.
    agent.record(
        "hook/result",
        serde_json::json!({"turn": 1, "point": "PreToolUse", "handlerId": "guard",
            "decision": "block", "durationMs": 12, "exitCode": 2, "stderrSummary": "not there"}),
    );
    // The call's node read what it did: its tool and its telling argument.
    let call = rt
        .tree()
        .stopped_nodes()
        .into_iter()
        .find(|n| n.kind == "tool")
        .expect("the call's node is remembered");
    assert_eq!(
        call.summary,
        serde_json::json!({"tool": "lookup", "call": "supervision trees"})
    );
    let artefacts = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("artefacts");
    std::fs::create_dir_all(&artefacts).unwrap();
    let png = artefacts.join("dashboard-conversation.png");
    let seen =
        browser_report_with(&peers, "conversation.cjs", &base, &[png.to_str().unwrap()]).await;
    let messages = seen["messages"].as_array().unwrap();
    let of = |class: &str| -> Vec<&serde_json::Value> {
        messages
            .iter()
            .filter(|m| m["class"].as_str().unwrap().split(' ').any(|c| c == class))
            .collect()
    };
    let user = of("user");
    assert_eq!(user.len(), 1, "{seen:#}");
    assert!(
        user[0]["text"]
            .as_str()
            .unwrap()
            .contains("Find what supervises what.")
    );
    let tool = of("tool");
    assert_eq!(tool.len(), 1, "{seen:#}");
    let call = tool[0]["text"].as_str().unwrap();
    assert!(
        call.contains("lookup") && call.contains("supervision trees"),
        "{call}"
    );
    assert!(
        call.contains("result · 2 lines") && call.contains("second finding"),
        "{call}"
    );
    let answer = of("assistant");
    let last = answer.last().unwrap();
    assert_eq!(last["strong"], serde_json::json!(["Found"]), "{last}");
    assert!(last["text"].as_str().unwrap().contains("• one"), "{last}");
    assert!(
        last["code"]
            .as_array()
            .unwrap()
            .contains(&serde_json::json!("two")),
        "{last}"
    );
    assert!(
        last["text"].as_str().unwrap().contains("let x = 1;"),
        "{last}"
    );
    assert!(
        of("note").iter().any(|n| n["text"] == "turn 1 completed"),
        "{seen:#}"
    );
    let hook = of("hook");
    assert_eq!(hook.len(), 1, "{seen:#}");
    assert!(
        hook[0]["text"]
            .as_str()
            .unwrap()
            .starts_with("hook PreToolUse · guard · block · exit 2 · 12 ms"),
        "{seen:#}"
    );
    assert!(std::fs::metadata(&png).unwrap().len() > 0);
    rt.shutdown().await;
}

/// Runs `tests/browser/held.cjs` on the held dashboard of `dsh ARGS…
/// --dashboard --hold` (with `files` in its workspace), whose run started
/// `children` children; the screenshot goes to the artefacts as `png`.
/// The report, and the run's record as `/api/record` serves it.
async fn held_page(
    args: &[&str],
    files: &[(&str, &str)],
    children: usize,
    png: &str,
) -> (serde_json::Value, serde_json::Value) {
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let mut argv = args.to_vec();
    argv.extend(["--demo-model", "--dashboard"]);
    let (child, url) = super::web::held(&argv, files, &[]).await;
    let artefacts = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("artefacts");
    std::fs::create_dir_all(&artefacts).unwrap();
    let png = artefacts.join(png);
    let count = children.to_string();
    let mut seen =
        browser_report_with(&peers, "held.cjs", &url, &[&count, png.to_str().unwrap()]).await;
    let (base, c) = super::web::endpoint(&url);
    let record = super::web::get_json(&c, format!("{base}/api/record")).await;
    let names = timeline_matches_the_logs(&seen, &url).await;
    seen["laneNames"] = serde_json::json!(names);
    assert!(super::web::terminate(child).await.success());
    (seen, record)
}

/// The record's entries for the children a run started (`scope/subagent/…`).
fn children_of(record: &serde_json::Value) -> Vec<&serde_json::Value> {
    record["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| {
            e["name"]
                .as_str()
                .is_some_and(|n| n.starts_with("scope/subagent/"))
        })
        .collect()
}

/// The timeline the page drew (`seen["lanes"]`) against the sessions' own
/// logs, read through the API at `url`: one lane per agent, as many model
/// bars as the log has steps and tool bars as it has calls, each lane's
/// tokens the sum of its messages' usage, and the total said above the
/// lanes their sum. Returns the lanes' names.
async fn timeline_matches_the_logs(seen: &serde_json::Value, url: &str) -> Vec<String> {
    let (base, c) = super::web::endpoint(url);
    let lanes = seen["lanes"].as_array().unwrap();
    let mut total = 0;
    for lane in lanes {
        let agent = lane["agent"].as_str().unwrap();
        let log =
            super::web::get_json(&c, format!("{base}/api/sessions/{agent}/events?limit=5000"))
                .await;
        let events = log["events"].as_array().unwrap();
        let count = |kind: &str| events.iter().filter(|e| e["type"] == kind).count();
        let bars: Vec<&str> = lane["bars"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_str().unwrap())
            .collect();
        let of = |kind: &str| bars.iter().filter(|b| b.starts_with(kind)).count();
        assert_eq!(of("model:"), count("step/start"), "{lane}");
        assert_eq!(of("tool:"), count("tool/call"), "{lane}");
        assert!(bars.iter().all(|b| b.ends_with(":ok")), "{lane}");
        let spent: u64 = events
            .iter()
            .filter(|e| e["type"] == "assistant/message")
            .map(|e| {
                let u = &e["data"]["usage"];
                u["inputTokens"].as_u64().unwrap_or(0) + u["outputTokens"].as_u64().unwrap_or(0)
            })
            .sum();
        assert_eq!(lane["tokens"].as_u64().unwrap(), spent, "{lane}");
        total += spent;
    }
    let said = seen["spent"].as_str().unwrap();
    let numbers: Vec<u64> = said
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect();
    // `tokens input I · output O · cached C`
    assert_eq!(numbers[0] + numbers[1], total, "{said}");
    lanes
        .iter()
        .map(|l| l["name"].as_str().unwrap().to_owned())
        .collect()
}

/// After `dsh workflow … --dashboard --hold`, the page still shows every
/// child the run started: under its phase, by its label, stopped, with how
/// long it ran and its tokens; the coordinator (by its label) reads as the
/// run: its phases, each child's line with a link to its session and how
/// it ended. A stopped child shows its final state with its conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_workflow_shows_its_children_by_phase_with_labels_ends_and_durations() {
    let flow = "phase('survey');\n\
        const a = await Promise.all(['a', 'b'].map(t => agent('List the files about ' + t + '.', {label: 'survey ' + t, phase: 'survey'})));\n\
        phase('verify');\n\
        const v = await agent('Check the results.', {label: 'verifier', phase: 'verify'});\n\
        return {a, v};\n";
    let (seen, record) = held_page(
        &["workflow", "flow.js"],
        &[("flow.js", flow)],
        3,
        "dashboard-held-workflow.png",
    )
    .await;
    let rows = seen["rows"].as_array().unwrap();
    let labels: Vec<&str> = rows.iter().map(|r| r["label"].as_str().unwrap()).collect();
    // In start order, under their phases.
    assert_eq!(
        labels,
        ["«survey a»", "«survey b»", "«verifier»"],
        "{seen:#}"
    );
    assert_eq!(
        seen["groups"],
        serde_json::json!(["phase survey", "phase verify"])
    );
    for r in rows {
        assert_eq!(r["status"], "disposed", "{r}");
        let took = r["took"]
            .as_str()
            .unwrap_or_else(|| panic!("no duration: {r}"));
        assert!(took.ends_with(" ms") || took.ends_with(" s"), "{r}");
        assert!(r["text"].as_str().unwrap().contains("tokens="), "{r}");
    }
    assert!(
        seen["coordinatorRow"]
            .as_str()
            .unwrap()
            .contains("«workflow coordinator»"),
        "{seen:#}"
    );
    // The coordinator spent nothing itself; its children did.
    assert!(
        seen["detail"]
            .as_str()
            .unwrap()
            .contains("with its children"),
        "{seen:#}"
    );
    assert_eq!(
        seen["phases"],
        serde_json::json!(["phase survey", "phase verify"])
    );
    let lines = seen["lines"].as_array().unwrap();
    assert_eq!(lines.len(), 3, "{seen:#}");
    for l in lines {
        assert_eq!(l["outcome"], "completed", "{l}");
        assert_eq!(l["link"], true, "{l}");
        assert!(l["text"].as_str().unwrap().contains(" tokens"), "{l}");
    }
    let final_state = seen["final"].as_str().unwrap();
    assert!(final_state.contains("ran "), "{final_state}");
    assert!(
        final_state.contains("List the files about a."),
        "{final_state}"
    );
    // The timeline: the coordinator's lane, then its children's (the
    // verifier, started last, last), under the two phases' bands; a point
    // on the tokens chart for each model call.
    let names: Vec<&str> = seen["laneNames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 4, "{seen:#}");
    assert_eq!(names[0], "«workflow coordinator»");
    let mut survey = names[1..3].to_vec();
    survey.sort();
    assert_eq!(survey, ["«survey a»", "«survey b»"], "{seen:#}");
    assert_eq!(names[3], "«verifier»");
    assert_eq!(
        seen["bands"],
        serde_json::json!(["phase survey", "phase verify"])
    );
    assert_eq!(seen["chartCalls"], 3, "{seen:#}");
    // The record says the same: each child ended, with a time and tokens.
    let children = children_of(&record);
    assert_eq!(children.len(), 3, "{record:#}");
    for c in children {
        assert_eq!(c["status"], "disposed", "{c}");
        assert!(c["tokens"].as_u64().unwrap() > 0, "{c}");
    }
}

/// After `dsh ralph … --dashboard --hold`, the page shows the loop's three
/// rounds by their labels, and the coordinator's conversation reads as the
/// loop: its objective, each round's handoff in full (status, summary,
/// evidence, next steps, a link to the round's worker) and how it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_ralph_loop_shows_its_rounds_and_their_handoffs_in_full() {
    let (seen, record) = held_page(
        &["ralph", "Write NOTES.md", "--max-rounds", "5"],
        &[],
        3,
        "dashboard-held-ralph.png",
    )
    .await;
    let labels: Vec<&str> = seen["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["label"].as_str().unwrap())
        .collect();
    assert_eq!(
        labels,
        ["«ralph round 1»", "«ralph round 2»", "«ralph round 3»"],
        "{seen:#}"
    );
    let handoffs = seen["handoffs"].as_array().unwrap();
    let rounds: Vec<u64> = handoffs
        .iter()
        .map(|h| h["round"].as_u64().unwrap())
        .collect();
    assert_eq!(rounds, [1, 2, 3], "{seen:#}");
    for h in handoffs {
        assert_eq!(h["link"], true, "{h}");
    }
    let first = handoffs[0]["text"].as_str().unwrap();
    for part in [
        "continue",
        "Round 1: drafted part 1 of the notes.",
        "evidence",
        "next steps",
    ] {
        assert!(first.contains(part), "{part}: {first}");
    }
    assert!(
        handoffs[2]["class"].as_str().unwrap().contains("complete"),
        "{seen:#}"
    );
    let notes = seen["notes"].to_string();
    assert!(notes.contains("objective: Write NOTES.md"), "{notes}");
    assert!(notes.contains("ended complete after 3 rounds"), "{notes}");
    assert_eq!(children_of(&record).len(), 3, "{record:#}");
    // The timeline: a lane per round in order, each with its model call and
    // its `report` call, under the rounds' bands.
    assert_eq!(
        seen["laneNames"],
        serde_json::json!([
            "«ralph coordinator»",
            "«ralph round 1»",
            "«ralph round 2»",
            "«ralph round 3»"
        ]),
        "{seen:#}"
    );
    for lane in &seen["lanes"].as_array().unwrap()[1..] {
        assert!(lane["bars"].to_string().contains("tool:ok"), "{lane}");
    }
    assert_eq!(
        seen["bands"],
        serde_json::json!(["round 1", "round 2", "round 3"])
    );
}

/// `dsh serve --demo-model --mutations`: the page's form offers the route
/// and the modes at most the server's, starts an agent that answers (with
/// the mode chosen), and a follow-up typed in its conversation view reaches
/// it and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_from_the_page_answers_and_takes_a_follow_up() {
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-start-page").unwrap();
    let args = ["--demo-model", "--mutations", "--bind", "127.0.0.1:0"].map(String::from);
    let sessions = dir.join("sessions");
    let env = [("DSH_SESSIONS_DIR", sessions.to_str().unwrap())];
    let (child, url) = super::web::dsh_serve_url(&dir, &args, &env).await;
    let artefacts = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("artefacts");
    std::fs::create_dir_all(&artefacts).unwrap();
    let png = artefacts.join("dashboard-start.png");
    let seen = browser_report_with(&peers, "start.cjs", &url, &[png.to_str().unwrap()]).await;
    assert_eq!(
        seen["routes"],
        serde_json::json!(["demo · demo"]),
        "{seen:#}"
    );
    assert_eq!(
        seen["modes"],
        serde_json::json!(["read-only", "workspace-write"]),
        "{seen:#}"
    );
    assert_eq!(seen["standing"], "workspace-write");
    let users = seen["users"].to_string();
    assert!(
        users.contains("Write one line about supervision."),
        "{users}"
    );
    assert!(users.contains("Now one line about teardown."), "{users}");
    let answers = seen["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 2, "{seen:#}");
    // The agent runs with the mode the form chose, as its log says.
    let (base, c) = super::web::endpoint(&url);
    let id = seen["agent"].as_str().unwrap();
    let events = super::web::get_json(&c, format!("{base}/api/sessions/{id}/events")).await;
    let mode = events["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["type"] == "sandbox/mode")
        .unwrap_or_else(|| panic!("{events:#}"));
    assert_eq!(mode["data"]["mode"], "read-only", "{mode}");
    assert!(super::web::terminate(child).await.success());
}

/// Answers once, spending 100 input and 20 output tokens (40 of the input
/// from cache), at 1, 0.5 (cached) and 2 per million.
struct Spends;

impl LlmAdapter for Spends {
    fn name(&self) -> &str {
        "spends"
    }
    fn defaults(&self, _model: &str) -> dsh::services::llm::ModelDefaults {
        dsh::services::llm::ModelDefaults {
            price: Some(dsh::services::llm::Price {
                input: 1_000_000,
                cached_input: 500_000,
                output: 2_000_000,
            }),
            ..Default::default()
        }
    }
    fn stream(&self, _request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let usage = dsh::services::llm::TokenUsage {
            input_tokens: 100,
            output_tokens: 20,
            cache_read_tokens: Some(40),
            ..Default::default()
        };
        let chunks = dsh::services::providers::scripted::chunks_for(
            &[ContentBlock::text("spent")],
            usage,
            FinishReason::Stop,
        );
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

/// A thousand agents: the page keeps every one in its row list, yet the DOM
/// holds only the rows in view plus an overscan, at the top and scrolled to
/// the end; the search brings a far agent into view; sorted by tokens, the
/// two that spent come first. The page's own render time is printed (a
/// figure for docs/dashboard.md, not asserted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_agents_keep_the_dom_to_the_rows_in_view() {
    const AGENTS: usize = 1000;
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let (rt, url) = serve_page("spends", Arc::new(Spends)).await;
    let root = rt.root();
    let cwd = dsh::kernel::scratch::fresh_dir("dsh-thousand").unwrap();
    let mut agents = Vec::with_capacity(AGENTS);
    for _ in 0..AGENTS {
        let agent = Agent::create(&root, AgentSpec::new("spends", "m", cwd.clone()))
            .await
            .unwrap();
        agents.push(agent);
    }
    let name = |a: &Agent| format!("scope/agent/{}", &a.id()[..8]);
    for i in [10, 500] {
        agents[i].run("Spend.", WAIT).await.unwrap();
    }
    let artefacts = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("artefacts");
    std::fs::create_dir_all(&artefacts).unwrap();
    let png = artefacts.join("dashboard-thousand.png");
    // Each agent is three rows (its scope, session and driver).
    let least = (AGENTS * 3).to_string();
    let last = name(&agents[AGENTS - 1]);
    let sought = name(&agents[777]);
    let seen = browser_report_with(
        &peers,
        "thousand.cjs",
        &url,
        &[&least, &last, &sought, png.to_str().unwrap()],
    )
    .await;
    for at in ["top", "bottom", "searched"] {
        let look = &seen[at];
        let rows = look["rows"].as_u64().unwrap();
        assert!(rows >= AGENTS as u64 * 3, "{at}: {look}");
        // In view: the view's height in 20 px rows (and one cut in half);
        // around it, 15 rows each side.
        let in_view = look["view"].as_u64().unwrap().div_ceil(20) + 1;
        let dom = look["dom"].as_u64().unwrap();
        assert!(
            dom <= in_view + 2 * 15,
            "{at}: {dom} rows in the DOM: {look}"
        );
        assert!(dom >= in_view.min(rows) - 1, "{at}: {look}");
    }
    let spenders: Vec<&str> = seen["spenders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    let mut first_two = spenders[..2].to_vec();
    first_two.sort();
    let mut expected = vec![name(&agents[10]), name(&agents[500])];
    expected.sort();
    assert_eq!(first_two, expected, "{seen:#}");
    // The timeline of one spender: its tokens and their cost at the route's
    // price (100 × 1 + 40 × 0.5 + 20 × 2 millionths); of the whole root:
    // 200 lanes, and how many more there were.
    let (base, c) = super::web::endpoint(&url);
    let one =
        super::web::get_json(&c, format!("{base}/api/timeline/{}", agents[10].node_id())).await;
    assert_eq!(
        one["tokens"],
        serde_json::json!({"input": 100, "output": 20, "cached": 40, "cost": 160}),
        "{one:#}"
    );
    let all = super::web::get_json(&c, format!("{base}/api/timeline/1")).await;
    assert_eq!(all["lanes"].as_array().unwrap().len(), 200);
    assert_eq!(all["more"], AGENTS - 200, "{}", all["more"]);
    eprintln!(
        "dashboard: {AGENTS} agents, {} rows: render {} ms",
        seen["top"]["rows"], seen["renders"]
    );
    rt.shutdown().await;
}

/// The page mounted in a service under `/ops/dsh/`, behind the service's
/// cookie: it shows the embedding runtime's agents and asks for nothing
/// outside its own path (`dashboard-mounted.png`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_mounted_under_a_prefix_reads_its_api_there() {
    let _sweep = crate::suite::sweep();
    let peers = super::peers::peers();
    let dsh = dsh::Dsh::builder()
        .model(dsh::Model::demo())
        .workspace(dsh::kernel::scratch::fresh_dir("dsh-mounted").unwrap())
        .start()
        .await
        .unwrap();
    let agent = dsh.agent().label("mounted-agent").spawn().await.unwrap();
    agent.run("Write one line about actors.").await.unwrap();
    let options = dsh::web::MountOptions::new().token("t0ken");
    let app = axum::Router::new()
        .nest_service("/ops/dsh", dsh::web::mount(dsh.runtime(), options).unwrap())
        .layer(axum::middleware::from_fn(super::web::service_auth));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!(
        "http://{}/ops/dsh/#token=t0ken",
        listener.local_addr().unwrap()
    );
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stopped.cancelled().await })
            .await
    });
    let artefacts = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("artefacts");
    std::fs::create_dir_all(&artefacts).unwrap();
    let png = artefacts.join("dashboard-mounted.png");
    let seen = browser_report_with(
        &peers,
        "mounted.cjs",
        &url,
        &["mounted-agent", png.to_str().unwrap()],
    )
    .await;
    assert!(
        seen["row"].as_str().unwrap().contains("mounted-agent"),
        "{seen}"
    );
    assert_eq!(seen["outside"], serde_json::json!([]), "{seen}");
    assert!(std::fs::metadata(&png).unwrap().len() > 0);
    agent.dispose().await;
    stop.cancel();
    server.await.unwrap().unwrap();
    dsh.shutdown().await.unwrap();
}
