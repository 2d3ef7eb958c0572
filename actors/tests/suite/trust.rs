//! Trust at the agent level: the policy an agent is created with, what a
//! delegated child gets, and escalation through the approval seam.

use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec};
use dsh_actors::subagent::StartRequest;
use dsh_services::approval::{ApprovalAsk, ApprovalOutcome, ApprovalPolicy};
use dsh_services::llm::ToolSchema;
use dsh_services::sandbox::{PermissionMode, Policy, Sandbox, Settings};
use dsh_services::tools::{Escalation, Tool, ToolContext, ToolError, ToolOutput, parameters};
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::harness::{Harness, calls, kinds, results, text};

const WAIT: Duration = Duration::from_secs(30);

const READ_ONLY_OFFLINE: Policy = Policy {
    mode: PermissionMode::ReadOnly,
    network: false,
};

/// Says which mode the call ran under.
struct Mode;

#[derive(serde::Deserialize, schemars::JsonSchema)]
struct ModeArgs {
    #[allow(dead_code)]
    #[serde(flatten)]
    escalation: Escalation,
}

impl Tool for Mode {
    fn escalates(&self) -> bool {
        true
    }
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "mode".into(),
            description: "Says the mode the call runs under.".into(),
            parameters: parameters::<ModeArgs>(),
        }
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let offline = if cx.policy.network { "" } else { " offline" };
            Ok(ToolOutput::text(format!("{}{offline}", cx.policy.mode)))
        }
        .boxed()
    }
}

fn escalate(justification: &str) -> serde_json::Value {
    json!({"sandbox_permissions": "danger-full-access", "justification": justification})
}

/// Runs one turn of `steps` on a fresh agent of `spec`'s policy; the tool
/// results' texts (a failure's led by its code).
async fn turn(
    h: &Harness,
    provider: &str,
    steps: Vec<dsh_services::providers::scripted::ScriptStep>,
    policy: Option<Policy>,
) -> (Agent, Vec<String>) {
    h.script(provider, steps);
    let mut spec = AgentSpec::new(provider, "m", std::env::temp_dir());
    spec.permission = policy;
    let agent = Agent::create(&h.rt.root(), spec).await.unwrap();
    agent.run("go", WAIT).await.unwrap();
    // A failed call's text, led by its code (the code rides the result).
    let texts = results(&agent)
        .into_iter()
        .map(|(_, code, t)| code.map_or(t.clone(), |c| format!("{c}: {t}")))
        .collect();
    (agent, texts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_takes_the_deployment_policy_and_a_child_never_more_than_its_parent() {
    let h = Harness::new().await;
    let root = h.rt.root();
    root.provide(
        Sandbox::SERVICE,
        Arc::new(Sandbox::new(Settings {
            defaults: READ_ONLY_OFFLINE,
            ..Settings::default()
        })),
    )
    .unwrap();
    let subagents = Arc::new(dsh_actors::subagent::Subagents::with_builtin());
    root.provide(dsh_actors::subagent::Subagents::SERVICE, subagents.clone())
        .unwrap();
    h.script("p", vec![text("parent")]);
    let parent = h.agent("p").await;
    assert_eq!(parent.policy(), READ_ONLY_OFFLINE);
    // The child asks for everything and gets the parent's.
    h.script("c", vec![text("child")]);
    let mut request = StartRequest::new(&parent, "work", CancellationToken::new());
    request.route = Some(("c".into(), "m".into()));
    request.permission = Some(Policy::escalated());
    let run = subagents.start("spawn", request).await.unwrap();
    let child = run.agent().clone();
    assert_eq!(child.policy(), READ_ONLY_OFFLINE);
    run.result().await;
    let logged = child
        .session()
        .events()
        .into_iter()
        .find_map(|e| (e.kind() == "sandbox/mode").then(|| e.to_json()["data"].clone()));
    assert_eq!(
        logged,
        Some(json!({"mode": "read-only", "network": false, "source": "delegation"}))
    );
    run.dispose().await;
    // A wider parent's child may ask for less.
    let mut spec = AgentSpec::new("p", "m", std::env::temp_dir());
    spec.permission = Some(Policy::default());
    let wide = Agent::create(&root, spec).await.unwrap();
    let mut request = StartRequest::new(&wide, "work", CancellationToken::new());
    request.route = Some(("c".into(), "m".into()));
    request.permission = Some(READ_ONLY_OFFLINE);
    let run = subagents.start("spawn", request).await.unwrap();
    assert_eq!(run.agent().policy(), READ_ONLY_OFFLINE);
    run.result().await;
    run.dispose().await;
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_an_approved_escalation_runs_unconfined_and_every_ask_is_logged() {
    let h = Harness::new().await;
    h.tools.register(&h.rt.root(), Arc::new(Mode)).unwrap();
    let steps = || {
        vec![
            calls(&[("mode", json!({}))]),
            calls(&[("mode", escalate("to reach the build cache"))]),
            calls(&[("mode", json!({"sandbox_permissions": "danger-full-access"}))]),
            text("done"),
        ]
    };
    // `ask` with nobody to answer: unavailable, fail closed.
    let (agent, texts) = turn(&h, "a", steps(), None).await;
    assert_eq!(texts[0], "workspace-write");
    assert!(
        texts[1].contains("DENIED") && texts[1].contains("unavailable"),
        "{}",
        texts[1]
    );
    assert!(
        texts[2].contains("INVALID_ARGS") && texts[2].contains("justification"),
        "{}",
        texts[2]
    );
    let k = kinds(&agent);
    assert_eq!(k.iter().filter(|k| *k == "approval/asked").count(), 1);
    assert_eq!(k.iter().filter(|k| *k == "approval/decided").count(), 1);
    // `never`: refused without asking anyone.
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = asked.clone();
    let answerer =
        h.rt.root()
            .on_waterfall(move |_ask: ApprovalAsk, _next| {
                counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                async { ApprovalOutcome::AllowedOnce }
            })
            .unwrap();
    h.approval.set_policy(ApprovalPolicy::Never);
    let (_, texts) = turn(&h, "n", steps(), None).await;
    assert!(texts[1].contains("rejected"), "{}", texts[1]);
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 0);
    // `ask` with an answerer that allows: that one call runs unconfined.
    h.approval.set_policy(ApprovalPolicy::Ask);
    let (agent, texts) = turn(&h, "y", steps(), None).await;
    assert_eq!(texts[1], "danger-full-access");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    let decided: Vec<_> = agent
        .session()
        .events()
        .into_iter()
        .filter(|e| e.kind() == "approval/decided")
        .map(|e| e.to_json()["data"]["outcome"].clone())
        .collect();
    assert_eq!(decided, [json!("allowed-once")]);
    answerer.dispose().await;
    // A read-only agent's escalation asks too; refused, it stays read-only.
    let (_, texts) = turn(&h, "r", steps(), Some(READ_ONLY_OFFLINE)).await;
    assert_eq!(texts[0], "read-only offline");
    assert!(texts[1].contains("read-only"), "{}", texts[1]);
    h.rt.shutdown().await;
}

/// `sandbox_permissions` names the mode one call needs: a read-only agent
/// asking for `workspace-write` gets that and no more (its network stays
/// cut); `danger-full-access` brings everything; a mode no wider than the
/// agent's asks nobody; a name outside the two is refused by the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_escalation_widens_to_the_mode_it_names_and_no_further() {
    let h = Harness::new().await;
    h.tools.register(&h.rt.root(), Arc::new(Mode)).unwrap();
    let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = asked.clone();
    h.rt.root()
        .on_waterfall(move |_ask: ApprovalAsk, _next| {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { ApprovalOutcome::AllowedOnce }
        })
        .unwrap();
    let wider = |mode: &str| json!({"sandbox_permissions": mode, "justification": "needed"});
    let steps = vec![
        calls(&[("mode", wider("workspace-write"))]),
        calls(&[("mode", wider("danger-full-access"))]),
        calls(&[("mode", wider("read-only"))]),
        calls(&[("mode", json!({}))]),
        text("done"),
    ];
    let (_, texts) = turn(&h, "ro", steps, Some(READ_ONLY_OFFLINE)).await;
    assert_eq!(texts[0], "workspace-write offline");
    assert_eq!(texts[1], "danger-full-access");
    assert!(texts[2].starts_with("INVALID_ARGS"), "{}", texts[2]);
    assert_eq!(texts[3], "read-only offline", "the grant was for one call");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2);
    // Already workspace-write: asking for it asks nobody.
    let steps = vec![calls(&[("mode", wider("workspace-write"))]), text("done")];
    let (_, texts) = turn(&h, "ww", steps, None).await;
    assert_eq!(texts[0], "workspace-write");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 2);
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_turn_withdraws_its_question() {
    let h = Harness::new().await;
    h.tools.register(&h.rt.root(), Arc::new(Mode)).unwrap();
    let (asked_tx, asked_rx) = tokio::sync::oneshot::channel::<()>();
    let asked_tx = std::sync::Mutex::new(Some(asked_tx));
    // An answerer that waits for a person who never comes.
    h.rt.root()
        .on_waterfall(move |ask: ApprovalAsk, _next| {
            if let Some(tx) = asked_tx.lock().unwrap().take() {
                let _ = tx.send(());
            }
            async move {
                ask.cancel.cancelled().await;
                ApprovalOutcome::Cancelled
            }
        })
        .unwrap();
    h.script(
        "w",
        vec![calls(&[("mode", escalate("wait"))]), text("never")],
    );
    let agent = h.agent("w").await;
    agent
        .followup(dsh_services::llm::Message::user_text("go"))
        .unwrap();
    tokio::time::timeout(WAIT, asked_rx).await.unwrap().unwrap();
    agent.cancel();
    agent.when_idle(WAIT).await.unwrap();
    let events = agent.session().events();
    let decided: Vec<_> = events
        .iter()
        .filter(|e| e.kind() == "approval/decided")
        .map(|e| e.to_json()["data"]["outcome"].clone())
        .collect();
    assert_eq!(decided, [json!("cancelled")]);
    let end = events
        .iter()
        .rev()
        .find(|e| e.kind() == "turn/end")
        .unwrap();
    assert_eq!(
        end.to_json()["data"]["reason"]["kind"],
        "aborted",
        "{}",
        end.to_json()
    );
    h.rt.shutdown().await;
}

/// Records each request's messages (source kind, text) and answers "ok".
struct Recorder(std::sync::Mutex<Vec<Vec<(String, String)>>>);

impl dsh_services::llm::LlmAdapter for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    fn stream(
        &self,
        request: dsh_services::llm::LlmRequest,
        _cancel: CancellationToken,
    ) -> dsh_services::llm::ChunkStream {
        let seen = request
            .messages
            .iter()
            .map(|m| (m.source.kind.to_string(), m.text()))
            .collect();
        self.0.lock().unwrap().push(seen);
        super::harness::answer(vec![dsh_services::llm::ContentBlock::text("ok")])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_model_is_told_the_policies_once_and_again_when_they_change() {
    let h = Harness::new().await;
    let root = h.rt.root();
    root.provide(
        Sandbox::SERVICE,
        Arc::new(Sandbox::new(Settings::default())),
    )
    .unwrap();
    let recorder = Arc::new(Recorder(Default::default()));
    h.adapter("rec", recorder.clone());
    let ws = dsh_supervisors::scratch::fresh_dir("dsh-context").unwrap();
    let agent = Agent::create(&root, AgentSpec::new("rec", "m", &ws))
        .await
        .unwrap();
    agent.run("first", WAIT).await.unwrap();
    agent.run("second", WAIT).await.unwrap();
    h.approval.set_policy(ApprovalPolicy::Never);
    agent.run("third", WAIT).await.unwrap();
    let requests = recorder.0.lock().unwrap().clone();
    let snapshots = |r: &Vec<(String, String)>| -> Vec<String> {
        r.iter()
            .filter(|(kind, text)| kind == "plugin" && text.starts_with("Runtime context"))
            .map(|(_, t)| t.clone())
            .collect()
    };
    // First request: the prompt, then the snapshot stating both policies.
    let first = &requests[0];
    assert_eq!(first[0], ("user".into(), "first".into()));
    let stated = &first[1].1;
    assert!(stated.contains("File policy: workspace-write"), "{stated}");
    assert!(stated.contains(&ws.display().to_string()), "{stated}");
    assert!(stated.contains("Approval policy: ask"), "{stated}");
    // Unchanged: not sent again; changed: a new one after the history.
    assert_eq!(snapshots(&requests[1]).len(), 1);
    let third = snapshots(&requests[2]);
    assert_eq!(third.len(), 2);
    assert!(third[1].contains("Approval policy: never"), "{}", third[1]);
    assert_eq!(
        requests[2].last().map(|(_, t)| t.as_str()),
        Some(third[1].as_str())
    );
    // A resumed session that already says the same is not told again.
    h.approval.set_policy(ApprovalPolicy::Never);
    let header = agent.session().with_log(|l| l.header().clone());
    let events = agent
        .session()
        .events()
        .iter()
        .map(|e| (**e).clone())
        .collect();
    let mut spec = AgentSpec::new("rec", "m", &ws);
    spec.seed = Some(Box::new((header, events)));
    let resumed = Agent::create(&root, spec).await.unwrap();
    resumed.run("fourth", WAIT).await.unwrap();
    let last = recorder.0.lock().unwrap().last().cloned().unwrap();
    assert_eq!(snapshots(&last).len(), 2, "{last:?}");
    h.rt.shutdown().await;
}

/// Answers a title request with a title, anything else with "ok"; asks to
/// title sessions.
struct Titler(std::sync::Mutex<Vec<Option<&'static str>>>);

impl dsh_services::llm::LlmAdapter for Titler {
    fn name(&self) -> &str {
        "titler"
    }
    fn titles(&self) -> bool {
        true
    }
    fn stream(
        &self,
        request: dsh_services::llm::LlmRequest,
        _cancel: CancellationToken,
    ) -> dsh_services::llm::ChunkStream {
        self.0.lock().unwrap().push(request.purpose);
        let text = match request.purpose {
            Some("session-title") => "\"Counting the stars.\"",
            _ => "ok",
        };
        super::harness::answer(vec![dsh_services::llm::ContentBlock::text(text)])
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_titles_sessions_is_asked_once_beside_the_conversation() {
    let h = Harness::new().await;
    let titler = Arc::new(Titler(Default::default()));
    h.adapter("titler", titler.clone());
    let agent = h.agent("titler").await;
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = std::sync::Mutex::new(Some(tx));
    agent.session().observe(Arc::new(move |e| {
        let json = e.to_json();
        if e.kind() == "session/title"
            && json["data"]["source"]["kind"] == "provider"
            && let Some(tx) = tx.lock().unwrap().take()
        {
            let _ = tx.send(json["data"].clone());
        }
    }));
    agent.run("how many stars are there?", WAIT).await.unwrap();
    let titled = tokio::time::timeout(WAIT, rx).await.unwrap().unwrap();
    assert_eq!(titled["title"], "Counting the stars");
    assert_eq!(titled["source"]["model"]["provider"], "titler");
    agent.run("and planets?", WAIT).await.unwrap();
    let purposes = titler.0.lock().unwrap().clone();
    assert_eq!(
        purposes
            .iter()
            .filter(|p| **p == Some("session-title"))
            .count(),
        1,
        "{purposes:?}"
    );
    // The fallback came first, the provider's after it.
    let titles: Vec<String> = agent
        .session()
        .events()
        .iter()
        .filter(|e| e.kind() == "session/title")
        .map(|e| {
            e.to_json()["data"]["source"]["kind"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        })
        .collect();
    assert_eq!(titles, ["fallback", "provider"]);
    h.rt.shutdown().await;
}

/// A loopback server answering every request with `hello from the web`.
async fn web_server() -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let body = "hello from the web";
            let _ = s
                .write_all(
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                    .as_bytes(),
                )
                .await;
        }
    });
    format!("http://{addr}/page")
}

/// The tools the model reads with (`read_image`, `skill`, `web_fetch`) and
/// background jobs, through the scripted pipeline under each permission
/// mode: reads work everywhere, `web_fetch` only with the network on, and
/// a background command's writes are confined like any bash call's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reading_tools_and_jobs_under_every_mode() {
    use dsh_services::tools::builtin::{
        Bash, JobOutput, ReadImage, SkillTool, WebFetch, WebFetchSettings,
    };
    let base = dsh_supervisors::scratch::fresh_dir("dsh-trust-tools")
        .unwrap()
        .canonicalize()
        .unwrap();
    let url = web_server().await;
    let modes = [
        (PermissionMode::ReadOnly, true),
        (PermissionMode::WorkspaceWrite, true),
        (PermissionMode::DangerFullAccess, true),
        (PermissionMode::ReadOnly, false),
    ];
    for (i, (mode, network)) in modes.into_iter().enumerate() {
        // A runtime per mode: job ids count per jobs service.
        let h = Harness::new().await;
        let root = h.rt.root();
        root.provide(
            dsh_services::attachments::Attachments::SERVICE,
            Arc::new(dsh_services::attachments::Attachments::new(
                base.join("store"),
            )),
        )
        .unwrap();
        let jobs = Arc::new(dsh_services::jobs::Jobs::new(Default::default()));
        root.provide(dsh_services::jobs::Jobs::SERVICE, jobs)
            .unwrap();
        let web = WebFetch::new(WebFetchSettings {
            allow_private_hosts: vec!["127.0.0.1".into()],
            ..WebFetchSettings::default()
        });
        let tools: [Arc<dyn Tool>; 5] = [
            Arc::new(ReadImage),
            Arc::new(SkillTool::new(None)),
            Arc::new(web),
            Arc::new(Bash),
            Arc::new(JobOutput),
        ];
        for tool in tools {
            h.tools.register(&root, tool).unwrap();
        }
        let ws = base.join(format!("ws{i}"));
        std::fs::create_dir_all(ws.join(".dsh/skills/check")).unwrap();
        let mut png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
        png.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 4, 8, 6, 0, 0, 0, 0, 0, 0, 0]);
        std::fs::write(ws.join("shot.png"), png).unwrap();
        std::fs::write(
            ws.join(".dsh/skills/check/SKILL.md"),
            "---\ndescription: how to check\n---\nRun the checks.\n",
        )
        .unwrap();
        let provider = format!("modes{i}");
        h.script(
            &provider,
            vec![
                calls(&[("read_image", json!({"file_path": "shot.png"}))]),
                calls(&[("skill", json!({"name": "check"}))]),
                calls(&[("web_fetch", json!({"url": url}))]),
                calls(&[(
                    "bash",
                    json!({"command": "echo made > made.txt", "description": "write", "run_in_background": true}),
                )]),
                calls(&[("job_output", json!({"job_id": "bash-1", "wait": true}))]),
                text("done"),
            ],
        );
        let mut spec = AgentSpec::new(&provider, "m", ws.clone());
        spec.permission = Some(Policy { mode, network });
        let agent = Agent::create(&root, spec).await.unwrap();
        agent.run("go", WAIT).await.unwrap();
        let seen = results(&agent);
        let case = format!("{mode}{}", if network { "" } else { " offline" });
        assert_eq!(seen[0].1, None, "{case}: read_image {}", seen[0].2);
        assert!(
            seen[0].2.contains("image/png, 4x4"),
            "{case}: {}",
            seen[0].2
        );
        assert_eq!(seen[1].1, None, "{case}: skill {}", seen[1].2);
        assert!(
            seen[1].2.contains("Run the checks."),
            "{case}: {}",
            seen[1].2
        );
        if network {
            assert_eq!(seen[2].1, None, "{case}: web_fetch {}", seen[2].2);
            assert!(seen[2].2.contains("hello from the web"), "{case}");
        } else {
            assert_eq!(seen[2].1.as_deref(), Some("NETWORK_OFF"), "{case}");
        }
        assert_eq!(seen[3].1, None, "{case}: the job starts {}", seen[3].2);
        let wrote = ws.join("made.txt").exists();
        assert_eq!(
            wrote,
            mode != PermissionMode::ReadOnly,
            "{case}: {}",
            seen[4].2
        );
        let status = if wrote {
            "[status: completed]"
        } else {
            "[status: failed (exit code: 1)]"
        };
        assert!(seen[4].2.contains(status), "{case}: {}", seen[4].2);
        agent.dispose().await;
        h.rt.shutdown().await;
    }
}
