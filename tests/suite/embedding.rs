//! The embedding example (`docs/embedding.md`), run as written.

use std::sync::Arc;

use dsh::kernel::{BoxError, Context, Runtime, RuntimeSettings, plugin_fn};

async fn embed() -> Result<(), BoxError> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    rt.root()
        .plugin(
            plugin_fn("db", &[], |ctx: Context| async move {
                ctx.provide("db", Arc::new(String::from("sqlite://app.db")))?;
                ctx.effect("close", || println!("db closed"))?; // runs once, on unload
                Ok(())
            }),
            (),
        )
        .await?;
    // A plugin that injects `db` stays pending until it exists, and restarts if it is replaced.
    rt.root()
        .plugin(
            plugin_fn("api", &["db"], |ctx: Context| async move {
                let db: Arc<String> = ctx.get("db").ok_or("no db")?;
                println!("api up on {db}");
                Ok(())
            }),
            (),
        )
        .await?;
    rt.shutdown().await; // api, then db: reverse start order, every budget honoured
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_embedding_example_runs() {
    let _sweep = crate::suite::sweep();
    embed().await.unwrap();
}

/// The embedding example as a real process: a request streams an agent's
/// events, SIGTERM drains every agent in order, and the process exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedding_example_streams_an_agent_and_drains_on_sigterm() {
    let _sweep = crate::suite::sweep();
    use futures::StreamExt;
    use tokio::io::AsyncBufReadExt;
    let wait = std::time::Duration::from_secs(60);
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dsh-examples"))
        .arg("embed")
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(wait, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let base = first.strip_prefix("listening on ").unwrap().to_owned();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder().timeout(wait).build().unwrap();
    for topic in ["actors", "teardown"] {
        let r = client
            .post(format!("{base}/ask"))
            .json(&serde_json::json!({"prompt": format!("Write one line about {topic}.")}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let mut body = r.bytes_stream();
        let mut text = String::new();
        while let Some(chunk) = tokio::time::timeout(wait, body.next()).await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
        assert!(text.contains("\"turn/end\""), "{text}");
        assert!(text.contains(&format!("{topic}:")), "{text}");
    }
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let last = tokio::time::timeout(wait, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(last, "shut down: 2 agents disposed");
    let status = tokio::time::timeout(wait, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

// ---- The front door (`dsh::Dsh`) ----

use std::time::Duration;

use dsh::kernel::scratch::fresh_dir;
use dsh::services::session::{EventData, TurnEndReason};
use dsh::{Dsh, Model};

/// A scripted model from its steps.
fn script(steps: serde_json::Value) -> Model {
    Model::scripted(&serde_json::json!({ "steps": steps }).to_string()).unwrap()
}

/// A runtime on `model` in a fresh workspace, its sessions kept in memory.
async fn front(model: Model) -> Dsh {
    Dsh::builder()
        .model(model)
        .workspace(fresh_dir("dsh-front").unwrap())
        .start()
        .await
        .unwrap()
}

/// The live nodes of a runtime's tree.
fn nodes(dsh: &Dsh) -> Vec<String> {
    let mut names: Vec<String> = dsh
        .runtime()
        .tree()
        .snapshot()
        .into_iter()
        .map(|n| format!("{}/{}", n.kind, n.name))
        .collect();
    names.sort();
    names
}

/// The crate docs' five lines, and the answer's parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_door_runs_one_agent_and_tears_down() {
    let dsh = front(Model::demo()).await;
    let baseline = nodes(&dsh);
    let answer = dsh
        .agent()
        .run("Write one line about teardown.")
        .await
        .unwrap();
    assert!(
        answer.text.starts_with("teardown: children stop"),
        "{answer:?}"
    );
    assert_eq!(answer.reason, TurnEndReason::Completed);
    assert_eq!(answer.steps, 1);
    // `run` disposed its agent: the tree is as it was.
    assert_eq!(nodes(&dsh), baseline);
    dsh.shutdown().await.unwrap();
}

/// Every wrong option is refused when the runtime starts, with a code and
/// what was wrong.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_options_are_refused_at_start_with_a_code_and_the_reason() {
    let e = Dsh::builder().start().await.err().unwrap();
    assert_eq!(e.code(), "CONFIG");
    assert!(e.message().contains("no model"), "{e}");
    let file = fresh_dir("dsh-front").unwrap().join("a-file");
    std::fs::write(&file, "x").unwrap();
    let e = Dsh::builder()
        .model(Model::demo())
        .workspace(&file)
        .start()
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), "CONFIG");
    assert!(e.message().contains("is not a directory"), "{e}");
    let e = Model::scripted("{\"steps\": [{\"txt\": 1}]}").unwrap_err();
    assert_eq!(e.code(), "CONFIG");
    assert!(e.message().contains("txt"), "{e}");
    let e = Dsh::builder()
        .model(Model::demo())
        .workspace(file.parent().unwrap())
        .sessions_db(file.join("sessions.db"))
        .start()
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), "STORE");
    assert!(e.message().contains("sessions.db"), "{e}");
    assert!(!e.is_retryable());
    let e = Dsh::builder()
        .model(Model::demo())
        .max_depth(17)
        .start()
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), "CONFIG");
}

/// A resident agent keeps its conversation from turn to turn, streams its
/// events, and its stream ends when it is disposed.
/// Two runs through one handle at once each get the answer to their own
/// prompt: the second waits for the first's turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runs_through_one_handle_take_turns() {
    let dsh = front(Model::demo()).await;
    let agent = dsh.agent().spawn().await.unwrap();
    let (a, b) = tokio::join!(
        agent.run("Write one line about apples."),
        agent.run("Write one line about rivers.")
    );
    let (a, b) = (a.unwrap().text, b.unwrap().text);
    assert!(a.starts_with("apples"), "{a}");
    assert!(b.starts_with("rivers"), "{b}");
    agent.dispose().await;
    dsh.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resident_agent_keeps_its_conversation_and_streams_its_events() {
    let dsh = front(script(serde_json::json!([
        {"text": "first"}, {"text": "second"}, {"text": "third"}, {"text": "fourth"}
    ])))
    .await;
    let baseline = nodes(&dsh);
    let agent = dsh.agent().label("resident").spawn().await.unwrap();
    let mut events = agent.events();
    assert_eq!(agent.run("one").await.unwrap().text, "first");
    let turn = events.until_turn_end().await;
    let kinds: Vec<&str> = turn.iter().map(|e| e.data.kind()).collect();
    assert!(kinds.contains(&"turn/start"), "{kinds:?}");
    assert!(kinds.contains(&"assistant/message"), "{kinds:?}");
    assert_eq!(kinds.last(), Some(&"turn/end"), "{kinds:?}");
    let second = agent.run("two").await.unwrap();
    assert_eq!(second.text, "second");
    assert_eq!(second.session, agent.id());
    events.until_turn_end().await;
    // `send` returns at once; the events say when the turn ends.
    agent.send("three").unwrap();
    let turn = events.until_turn_end().await;
    assert!(
        turn.iter()
            .any(|e| matches!(&e.data, EventData::AssistantMessage { .. })
                && e.to_json().to_string().contains("third")),
        "{turn:?}"
    );
    // Both prompts are in what the model is given next.
    let said: Vec<String> = agent
        .agent()
        .session()
        .events()
        .iter()
        .filter(|e| matches!(e.data, EventData::UserMessage(_)))
        .map(|e| e.to_json().to_string())
        .collect();
    for prompt in ["one", "two", "three"] {
        let quoted = format!("\"{prompt}\"");
        assert!(
            said.iter().any(|m| m.contains(&quoted)),
            "{prompt}: {said:?}"
        );
    }
    agent.dispose().await;
    let ended = tokio::time::timeout(Duration::from_secs(30), events.next()).await;
    assert!(matches!(ended, Ok(None)), "the stream outlived its agent");
    // A handle dropped (a request abandoned) disposes its agent; a
    // detached one stays.
    let dropped = dsh.agent().spawn().await.unwrap();
    let mut gone = dropped.events();
    drop(dropped);
    let ended = tokio::time::timeout(Duration::from_secs(30), gone.next()).await;
    assert!(matches!(ended, Ok(None)), "a dropped handle left its agent");
    crate::suite::until("the dropped handle's agent was disposed", || {
        nodes(&dsh) == baseline
    })
    .await;
    let kept = dsh.agent().spawn().await.unwrap().detach();
    let turn = kept.run("four", Duration::from_secs(30)).await.unwrap();
    assert_eq!(turn.text, "fourth");
    assert_ne!(nodes(&dsh), baseline);
    kept.dispose().await;
    assert_eq!(nodes(&dsh), baseline);
    dsh.shutdown().await.unwrap();
}

/// A model's failure comes back with its own code, and says whether to try
/// again; a turn past its bound is a retryable `TIMEOUT`, and the agent is
/// disposed all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failures_come_back_with_their_code_and_whether_to_retry() {
    let dsh = front(script(serde_json::json!([
        {"error": {"code": "AUTH", "message": "bad key", "status": 401}},
        {"tool_calls": [{"name": "bash", "arguments": {"command": "sleep 30", "description": "wait"}}]},
    ])))
    .await;
    let baseline = nodes(&dsh);
    let e = dsh.agent().run("hello").await.unwrap_err();
    assert_eq!(e.code(), "AUTH");
    assert!(e.message().contains("bad key"), "{e}");
    assert!(!e.is_retryable());
    let e = dsh
        .agent()
        .timeout(Duration::from_millis(300))
        .run("wait")
        .await
        .unwrap_err();
    assert_eq!(e.code(), "TIMEOUT", "{e}");
    assert!(e.is_retryable());
    // Past its turn budget, a turn ends before it reaches the model (the
    // first one finds the script spent).
    let capped = dsh.agent().max_turns(1).spawn().await.unwrap();
    let first = capped.run("the first turn").await.unwrap_err();
    assert_eq!(first.code(), "SCRIPT_EXHAUSTED", "{first}");
    let e = capped.run("one more").await.unwrap_err();
    assert_eq!(e.code(), "BUDGET_EXHAUSTED", "{e}");
    assert!(!e.is_retryable());
    capped.dispose().await;
    let e = dsh
        .agent()
        .definition("nobody")
        .spawn()
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), "CREATE");
    assert!(e.message().contains("no agent definition `nobody`"), "{e}");
    assert_eq!(nodes(&dsh), baseline, "an agent outlived its failed run");
    dsh.shutdown().await.unwrap();
}

/// The runtime's alive tasks when nothing runs: the most of 200 looks (a
/// timer task re-arming, or an actor between messages, dips the count for
/// an instant; a baseline taken in such an instant would be one short).
async fn steady_tasks(metrics: &tokio::runtime::RuntimeMetrics) -> usize {
    let mut most = 0;
    for _ in 0..200 {
        most = most.max(metrics.num_alive_tasks());
        tokio::task::yield_now().await;
    }
    most
}

/// Open file descriptors of this process.
fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

/// A hundred requests at once, each an agent: every one is disposed, and the
/// tree, the tasks and the open files come back to what they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_concurrent_agents_are_disposed_and_leave_nothing_behind() {
    let dsh = front(Model::demo()).await;
    // A first burst, so what is made once (the sandbox probe, the caches,
    // whatever a first burst of concurrency starts and keeps) is in the
    // baseline: a leak is then what a second burst leaves.
    let all = dsh.clone();
    let burst = move |tag: &'static str| {
        let dsh = all.clone();
        futures::future::join_all((0..100).map(move |i| {
            let dsh = dsh.clone();
            async move {
                dsh.agent()
                    .run(&format!("Write one line about {tag}{i}."))
                    .await
            }
        }))
    };
    for warm in burst("warm").await {
        warm.unwrap();
    }
    let metrics = tokio::runtime::Handle::current().metrics();
    let (nodes0, tasks0, fds0) = (nodes(&dsh), steady_tasks(&metrics).await, open_fds());
    let answers = burst("topic").await;
    for (i, a) in answers.into_iter().enumerate() {
        assert_eq!(a.unwrap().text, format!("topic{i}: noted."));
    }
    assert_eq!(nodes(&dsh), nodes0);
    // Tokio announces no task's end: looked at again until it holds.
    crate::suite::until("the agents' tasks did not end", || {
        metrics.num_alive_tasks() <= tasks0
    })
    .await;
    crate::suite::until("the agents' files were closed", || open_fds() <= fds0).await;
    dsh.shutdown().await.unwrap();
}

/// Shutdown with agents mid-turn: each turn is cancelled and ends in its
/// stored session, the commands they ran are gone, all within the budget.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_agents_mid_turn_within_its_budget() {
    let _sweep = crate::suite::sweep();
    let token = "31.4159";
    let call = serde_json::json!({"tool_calls": [{"name": "bash", "arguments": {
        "command": format!("sleep {token}"), "description": "wait"
    }}]});
    let sessions = fresh_dir("dsh-front-sessions").unwrap();
    let dsh = Dsh::builder()
        .model(script(serde_json::json!([
            call.clone(),
            call.clone(),
            call
        ])))
        .workspace(fresh_dir("dsh-front").unwrap())
        .sessions_dir(&sessions)
        .shutdown_budget(Duration::from_secs(20))
        .start()
        .await
        .unwrap();
    let (mut ids, mut held) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let agent = dsh.agent().spawn().await.unwrap();
        let mut events = agent.events();
        agent.send("wait a while").unwrap();
        while let Some(e) = tokio::time::timeout(Duration::from_secs(30), events.next())
            .await
            .unwrap()
        {
            if e.data.kind() == "tool/call" {
                break;
            }
        }
        ids.push(agent.id().to_owned());
        // Held: a dropped handle would dispose its agent before the shutdown.
        held.push(agent);
    }
    crate::suite::until("the commands started", || crate::suite::running(token)).await;
    dsh.shutdown().await.unwrap();
    drop(held);
    crate::suite::until("a command outlived the shutdown", || {
        !crate::suite::running(token)
    })
    .await;
    use dsh::services::persistence::SessionPersistence;
    let store = dsh::services::persistence::JsonlStore::new(sessions);
    for id in ids {
        let loaded = store.load(&id).unwrap();
        let ends: Vec<&TurnEndReason> = loaded
            .events
            .iter()
            .filter_map(|e| match &e.data {
                EventData::TurnEnd { reason, .. } => Some(&**reason),
                _ => None,
            })
            .collect();
        assert!(
            matches!(ends.as_slice(), [TurnEndReason::Aborted { .. }]),
            "{id}: {ends:?}"
        );
    }
}

/// A workflow and a Ralph loop from Rust: their results, their children
/// gone after, and requests the runtime refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_and_a_ralph_loop_run_from_rust() {
    let dsh = front(Model::demo()).await;
    let baseline = nodes(&dsh);
    let fan = "const lines = await Promise.all(args.topics.map(t => \
               agent('Write one line about ' + t + '.', {label: t}))); return {lines};";
    let out = dsh
        .workflow(fan)
        .name("fan")
        .args(serde_json::json!({"topics": ["actors", "teardown"]}))
        .max_parallel(2)
        .run()
        .await
        .unwrap();
    assert_eq!(out.agents_started, 2);
    let lines = out.value["lines"].as_array().unwrap();
    assert!(
        lines[0].as_str().unwrap().starts_with("actors: "),
        "{lines:?}"
    );
    assert!(
        lines[1].as_str().unwrap().starts_with("teardown: "),
        "{lines:?}"
    );
    assert_eq!(nodes(&dsh), baseline);
    let e = dsh.workflow("return (;").run().await.unwrap_err();
    assert!(["SCRIPT", "FAILED"].contains(&e.code()), "{e}");
    assert!(!e.message().is_empty());

    let looped = dsh
        .ralph("Ship the release")
        .max_rounds(5)
        .run()
        .await
        .unwrap();
    assert_eq!(looped.outcome, dsh::actors::ralph::RalphOutcome::Complete);
    assert_eq!(looped.rounds, 3);
    let e = dsh.ralph("x").max_rounds(0).run().await.unwrap_err();
    assert_eq!(e.code(), "SCRIPT");
    assert_eq!(nodes(&dsh), baseline);
    dsh.shutdown().await.unwrap();
}

/// An agent made from a definition in the workspace carries its name, its
/// prompt and its tools.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_is_made_from_a_definition_in_the_workspace() {
    let ws = fresh_dir("dsh-front").unwrap();
    std::fs::create_dir_all(ws.join(".dsh/agents")).unwrap();
    std::fs::write(
        ws.join(".dsh/agents/brief.md"),
        "---\nname: brief\ndescription: Answers briefly.\ntools: [read]\n---\nAnswer in one line.\n",
    )
    .unwrap();
    let dsh = Dsh::builder()
        .model(Model::demo())
        .workspace(&ws)
        .start()
        .await
        .unwrap();
    let agent = dsh.agent().definition("brief").spawn().await.unwrap();
    let spec = agent.agent().spec();
    assert_eq!(spec.definition.as_deref(), Some("brief"));
    assert_eq!(
        spec.system.as_deref().map(str::trim),
        Some("Answer in one line.")
    );
    let allowed = spec.restriction.as_ref().and_then(|r| r.allow.clone());
    assert_eq!(allowed, Some(vec!["read".to_owned()]));
    agent.dispose().await;
    let e = dsh
        .agent()
        .definition("verbose")
        .spawn()
        .await
        .err()
        .unwrap();
    assert!(e.message().contains("(found: brief)"), "{e}");
    dsh.shutdown().await.unwrap();
}

// ---- Tools written in Rust ----

use dsh::{CustomTool, Effect};
use std::sync::atomic::{AtomicUsize, Ordering};

/// What `lookup_order` takes.
#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Lookup {
    /// The order's id.
    order: String,
}

/// A tool with `effects` that counts its runs.
fn counted(name: &str, effects: Vec<Effect>, runs: &Arc<AtomicUsize>) -> CustomTool {
    let runs = runs.clone();
    CustomTool::builder(name, "Looks an order up by its id.")
        .effects(effects)
        .run(move |args: Lookup, call| {
            runs.fetch_add(1, Ordering::SeqCst);
            async move { Ok(format!("order {} shipped ({})", args.order, call.id)) }
        })
}

/// A script calling `tool` with `args`, then answering.
fn calling(tool: &str, args: serde_json::Value) -> Model {
    script(serde_json::json!([
        {"tool_calls": [{"name": tool, "arguments": args, "id": "c1"}]},
        {"text": "done"},
    ]))
}

/// The tool results of an agent's session, as JSON text.
fn results(agent: &dsh::AgentHandle) -> Vec<String> {
    agent
        .agent()
        .session()
        .events()
        .iter()
        .filter(|e| matches!(e.data, EventData::ToolResult { .. }))
        .map(|e| e.to_json().to_string())
        .collect()
}

/// A tool written in Rust is offered with its derived schema, called with
/// typed arguments, and its answer goes back to the model; arguments that
/// do not match the schema never reach it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_written_in_rust_is_offered_called_and_answered() {
    let runs = Arc::new(AtomicUsize::new(0));
    let dsh = Dsh::builder()
        .model(script(serde_json::json!([
            {"tool_calls": [{"name": "lookup_order", "arguments": {"order": "A-17"}, "id": "c1"}]},
            {"tool_calls": [{"name": "lookup_order", "arguments": {"order": 17}, "id": "c2"}]},
            {"text": "done"},
        ])))
        .workspace(fresh_dir("dsh-front").unwrap())
        .tool(counted("lookup_order", vec![Effect::Reads], &runs))
        .start()
        .await
        .unwrap();
    let registry = dsh
        .runtime()
        .root()
        .get::<dsh::services::tools::ToolRegistry>(dsh::services::tools::ToolRegistry::SERVICE)
        .unwrap();
    let schema = registry
        .visible(None)
        .iter()
        .find(|t| t.schema.name == "lookup_order")
        .map(|t| t.schema.parameters.clone())
        .unwrap();
    assert_eq!(schema["properties"]["order"]["type"], "string", "{schema}");
    assert_eq!(
        schema["properties"]["order"]["description"],
        "The order's id."
    );
    assert_eq!(schema["required"], serde_json::json!(["order"]));
    let agent = dsh.agent().spawn().await.unwrap();
    assert_eq!(agent.run("find A-17").await.unwrap().text, "done");
    let seen = results(&agent);
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(seen[0].contains("order A-17 shipped (c1)"), "{seen:?}");
    assert!(seen[1].contains("INVALID_ARGS"), "{seen:?}");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "bad arguments reached the body"
    );
    agent.dispose().await;
    let e = Dsh::builder()
        .model(Model::demo())
        .tool(counted("look up", vec![Effect::Reads], &runs))
        .start()
        .await
        .err()
        .unwrap();
    assert_eq!(e.code(), "CONFIG");
    assert!(e.message().contains("\"look up\""), "{e}");
    dsh.shutdown().await.unwrap();
}

/// Each effect is held to the calling agent's policy before the body runs:
/// a tool that declares none, or that starts processes, is asked about
/// (and, with no one to ask, refused); one that writes is refused under
/// read-only, one that reaches the network when it is off. Refused calls
/// never run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_denied_by_policy_never_runs() {
    use dsh::services::approval::ApprovalPolicy;
    use dsh::services::sandbox::PermissionMode;
    let cases: Vec<(Vec<Effect>, PermissionMode, bool, ApprovalPolicy, bool)> = vec![
        // effects, mode, network, approval, runs
        (
            vec![],
            PermissionMode::WorkspaceWrite,
            true,
            ApprovalPolicy::Never,
            false,
        ),
        (
            vec![],
            PermissionMode::WorkspaceWrite,
            true,
            ApprovalPolicy::Always,
            true,
        ),
        (
            vec![Effect::WritesWorkspace],
            PermissionMode::ReadOnly,
            true,
            ApprovalPolicy::Always,
            false,
        ),
        (
            vec![Effect::WritesWorkspace],
            PermissionMode::WorkspaceWrite,
            true,
            ApprovalPolicy::Never,
            true,
        ),
        (
            vec![Effect::Network],
            PermissionMode::WorkspaceWrite,
            false,
            ApprovalPolicy::Always,
            false,
        ),
        (
            vec![Effect::Network],
            PermissionMode::WorkspaceWrite,
            true,
            ApprovalPolicy::Never,
            true,
        ),
        (
            vec![Effect::RunsProcesses],
            PermissionMode::WorkspaceWrite,
            true,
            ApprovalPolicy::Never,
            false,
        ),
        (
            vec![Effect::RunsProcesses],
            PermissionMode::DangerFullAccess,
            true,
            ApprovalPolicy::Never,
            true,
        ),
        (
            vec![Effect::RunsProcesses],
            PermissionMode::WorkspaceWrite,
            true,
            ApprovalPolicy::Always,
            true,
        ),
        // Processes could change anything: never under read-only, asked or
        // not.
        (
            vec![Effect::Reads, Effect::RunsProcesses],
            PermissionMode::ReadOnly,
            true,
            ApprovalPolicy::Always,
            false,
        ),
        // A refusal wins over a question, whichever comes first.
        (
            vec![Effect::RunsProcesses, Effect::WritesWorkspace],
            PermissionMode::ReadOnly,
            true,
            ApprovalPolicy::Always,
            false,
        ),
        (
            vec![Effect::WritesWorkspace, Effect::RunsProcesses],
            PermissionMode::ReadOnly,
            true,
            ApprovalPolicy::Always,
            false,
        ),
        (
            vec![Effect::RunsProcesses, Effect::Network],
            PermissionMode::WorkspaceWrite,
            false,
            ApprovalPolicy::Always,
            false,
        ),
    ];
    for (effects, mode, network, approval, should_run) in cases {
        let what = format!("{effects:?} under {mode:?}, network {network}, approval {approval:?}");
        let runs = Arc::new(AtomicUsize::new(0));
        let dsh = Dsh::builder()
            .model(calling("lookup_order", serde_json::json!({"order": "B-2"})))
            .workspace(fresh_dir("dsh-front").unwrap())
            .permission_mode(mode)
            .network(network)
            .approval(approval)
            .tool(counted("lookup_order", effects, &runs))
            .start()
            .await
            .unwrap();
        let agent = dsh.agent().spawn().await.unwrap();
        agent.run("find B-2").await.unwrap();
        let seen = results(&agent);
        assert_eq!(
            runs.load(Ordering::SeqCst),
            usize::from(should_run),
            "{what}: {seen:?}"
        );
        if !should_run {
            assert!(seen[0].contains("DENIED"), "{what}: {seen:?}");
        }
        agent.dispose().await;
        dsh.shutdown().await.unwrap();
    }
}

/// A tool given to one agent is that agent's alone; a cancelled call's
/// body is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_own_tool_is_its_alone_and_a_cancelled_call_is_dropped() {
    let runs = Arc::new(AtomicUsize::new(0));
    let dsh = front(script(serde_json::json!([
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order": "C-3"}, "id": "c1"}]},
        {"text": "mine"},
        {"tool_calls": [{"name": "lookup_order", "arguments": {"order": "C-3"}, "id": "c2"}]},
        {"text": "theirs"},
        {"tool_calls": [{"name": "wait_forever", "arguments": {"order": "D-4"}, "id": "c3"}]},
    ])))
    .await;
    let mine = dsh
        .agent()
        .tool(counted("lookup_order", vec![Effect::Reads], &runs))
        .spawn()
        .await
        .unwrap();
    assert_eq!(mine.run("find C-3").await.unwrap().text, "mine");
    assert!(results(&mine)[0].contains("order C-3 shipped"));
    let theirs = dsh.agent().spawn().await.unwrap();
    assert_eq!(theirs.run("find C-3").await.unwrap().text, "theirs");
    assert!(
        results(&theirs)[0].contains("UNKNOWN_TOOL"),
        "{:?}",
        results(&theirs)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    // A body that never ends, and says when it is dropped.
    struct Dropped(tokio::sync::mpsc::UnboundedSender<()>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            let _ = self.0.send(());
        }
    }
    let (started_tx, mut started) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (dropped_tx, mut dropped) = tokio::sync::mpsc::unbounded_channel::<()>();
    let forever = CustomTool::builder("wait_forever", "Never answers.")
        .effects([Effect::Reads])
        .run(move |_: Lookup, _call| {
            let guard = Dropped(dropped_tx.clone());
            let _ = started_tx.send(());
            async move {
                let _guard = guard;
                std::future::pending::<()>().await;
                Ok(String::new())
            }
        });
    let waiting = dsh.agent().tool(forever).spawn().await.unwrap();
    waiting.send("wait").unwrap();
    tokio::time::timeout(Duration::from_secs(30), started.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(waiting.cancel());
    tokio::time::timeout(Duration::from_secs(30), dropped.recv())
        .await
        .expect("the cancelled body was dropped")
        .unwrap();
    waiting.idle().await.unwrap();
    dsh.shutdown().await.unwrap();
}

/// `examples/custom_tool.rs` and `examples/workflow.rs`, run as written.
#[test]
fn the_tool_and_workflow_examples_run() {
    let _sweep = crate::suite::sweep();
    let run = |name: &str| {
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_dsh-examples"))
            .arg(name)
            .env_remove("DSH_BASE_URL")
            .env_remove("DSH_MODEL")
            .current_dir(fresh_dir("dsh-example").unwrap())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let out = crate::suite::output_bounded(child, crate::suite::DEADLINE, name);
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{name}: {said}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        said
    };
    let said = run("custom_tool");
    assert!(
        said.contains("tool call: lookup_order {\"order\":\"A-17\"}"),
        "{said}"
    );
    assert!(
        said.contains("answer: Order A-17 shipped on 2 December."),
        "{said}"
    );
    let said = run("workflow");
    assert!(said.contains("workflow: 3 children"), "{said}");
    assert!(
        said.contains("  supervision: ownership is the tree"),
        "{said}"
    );
    assert!(said.contains("ralph: complete"), "{said}");
    assert!(said.contains("after 3 rounds"), "{said}");
}

/// The embedding example's own routes, in this process.
#[allow(dead_code, reason = "its main is the example binary's")]
#[path = "../../examples/embed.rs"]
mod example;

/// The example service under load: a hundred concurrent requests, each an
/// agent on a scripted model streaming its events back; every agent is
/// disposed, and the tree, the tasks and the open files return to their
/// baseline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_service_under_a_hundred_concurrent_requests_returns_to_its_baseline() {
    use futures::StreamExt;
    let steps: Vec<serde_json::Value> = (0..101)
        .map(|i| serde_json::json!({"text": format!("answer {i}")}))
        .collect();
    let dsh = front(script(serde_json::Value::Array(steps))).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone();
    let server = tokio::spawn(
        axum::serve(listener, example::app(dsh.clone()))
            .with_graceful_shutdown(async move { stopped.cancelled().await })
            .into_future(),
    );
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let ask = |prompt: String| {
        let client = client.clone();
        let url = format!("{base}/ask");
        async move {
            let r = client
                .post(url)
                .json(&serde_json::json!({ "prompt": prompt }))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let mut body = r.bytes_stream();
            let mut text = String::new();
            while let Some(chunk) = body.next().await {
                text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
            }
            text
        }
    };
    // One first: what is made once is in the baseline.
    assert!(ask("warm up".into()).await.contains("\"turn/end\""));
    let metrics = tokio::runtime::Handle::current().metrics();
    let (nodes0, tasks0, fds0) = (nodes(&dsh), steady_tasks(&metrics).await, open_fds());
    let streams = futures::future::join_all((0..100).map(|i| ask(format!("request {i}")))).await;
    let mut answers = std::collections::BTreeSet::new();
    for text in &streams {
        assert!(text.contains("\"turn/end\""), "{text}");
        // The scripted text, `answer N`, wherever the events carry it.
        let said = text
            .match_indices("answer ")
            .map(|(at, _)| &text[at..])
            .find(|t| t[7..].starts_with(|c: char| c.is_ascii_digit()))
            .unwrap();
        answers.insert(said.split('"').next().unwrap().to_owned());
    }
    assert_eq!(answers.len(), 100, "each request had its own answer");
    crate::suite::until("every request's agent was disposed", || {
        nodes(&dsh) == nodes0
    })
    .await;
    crate::suite::until("the agents' tasks ended", || {
        metrics.num_alive_tasks() <= tasks0
    })
    .await;
    crate::suite::until("the agents' files were closed", || open_fds() <= fds0).await;
    stop.cancel();
    server.await.unwrap().unwrap();
    dsh.shutdown().await.unwrap();
}
