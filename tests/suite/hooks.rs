//! Hooks from Claude Code and Codex settings files, run by `dsh run` on a
//! config with a `hooks` entry: real hook scripts (shell and Python), one
//! test per decision kind (block a prompt, deny a call, ask, add context,
//! feed back after a call, keep a turn going) in both formats, and hooks
//! that are broken, slow or try to leave the sandbox.

use super::Bounded;
use std::path::PathBuf;

use dsh::kernel::scratch::fresh_dir;
use serde_json::{Value, json};

/// Which settings format a case writes.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Format {
    Claude,
    Codex,
}

impl Format {
    const BOTH: [Format; 2] = [Format::Claude, Format::Codex];

    fn key(self) -> &'static str {
        match self {
            Format::Claude => "claude_code",
            Format::Codex => "codex",
        }
    }

    fn plugin(self) -> &'static str {
        match self {
            Format::Claude => "hooks-claude-code",
            Format::Codex => "hooks-codex",
        }
    }
}

/// One run's place: its directory, the workspace the agent works in.
struct Case {
    dir: PathBuf,
    ws: PathBuf,
}

/// What a run left: its exit code, output, and its session log.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    log: Vec<Value>,
}

impl Ran {
    fn of(&self, kind: &str) -> Vec<&Value> {
        self.log.iter().filter(|e| e["type"] == kind).collect()
    }

    fn text(&self) -> String {
        self.log
            .iter()
            .map(Value::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Case {
    fn new() -> Case {
        let dir = fresh_dir("dsh-hooks").unwrap().canonicalize().unwrap();
        let ws = dir.join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        Case { dir, ws }
    }

    /// A Python hook script where projects keep theirs (the sandbox shows
    /// a hook the workspace, not the rest of a private `/tmp`); its command.
    fn python(&self, name: &str, body: &str) -> String {
        let dir = self.ws.join(".claude/hooks");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        format!("python3 {}", path.display())
    }

    /// Runs `dsh run PROMPT` on a config whose hooks entry reads `hooks`
    /// (a settings file of `format`), on a scripted model taking `steps`.
    fn run(&self, format: Format, hooks: Value, steps: Value, approval: &str) -> Ran {
        let settings = self.dir.join(format!("{}.json", format.key()));
        std::fs::write(&settings, json!({ "hooks": hooks }).to_string()).unwrap();
        self.run_with(format, &[settings], steps, approval)
    }

    fn run_with(&self, format: Format, files: &[PathBuf], steps: Value, approval: &str) -> Ran {
        let script = self.dir.join("script.json");
        std::fs::write(&script, json!({ "steps": steps }).to_string()).unwrap();
        let listed: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        let config = self.dir.join("cordis.yml");
        std::fs::write(
            &config,
            format!(
                "plugins:\n  - id: services\n    name: agent-services\n    config: {{ approval: {approval} }}\n  - id: model\n    name: scripted\n    config: {{ script: {} }}\n  - id: hooks\n    name: hooks\n    config: {{ {}: {} }}\n",
                script.display(),
                format.key(),
                json!(listed)
            ),
        )
        .unwrap();
        let sessions = self.dir.join("sessions");
        let _ = std::fs::remove_dir_all(&sessions);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_dsh"))
            .current_dir(&self.ws)
            .env_remove("DSH_PERMISSION_MODE")
            .env_remove("DSH_APPROVAL")
            .args(["run", "--config"])
            .arg(&config)
            .arg("--sessions-dir")
            .arg(&sessions)
            .arg("please help")
            .bounded_output()
            .unwrap();
        let log = std::fs::read_dir(&sessions)
            .map(|d| {
                d.flatten()
                    .filter_map(|e| std::fs::read_to_string(e.path().join("session.jsonl")).ok())
                    .flat_map(|t| {
                        t.lines()
                            .skip(1)
                            .map(|l| serde_json::from_str::<Value>(l).unwrap())
                            .collect::<Vec<_>>()
                    })
                    .collect()
            })
            .unwrap_or_default();
        Ran {
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            log,
        }
    }
}

fn group(matcher: Option<&str>, command: &str) -> Value {
    let mut g = json!({"hooks": [{"type": "command", "command": command}]});
    if let Some(m) = matcher {
        g["matcher"] = json!(m);
    }
    g
}

fn bash(command: &str) -> Value {
    json!({"tool_calls": [{"name": "bash", "arguments": {"command": command, "description": "run"}}]})
}

fn answer(text: &str) -> Value {
    json!({"text": text})
}

/// A `UserPromptSubmit` hook blocks the prompt: no step runs, no request
/// is sent, the turn ends `blocked` with the hook's reason, and `dsh run`
/// says so and fails. Claude Code: a shell hook exiting 2; Codex: a Python
/// hook answering `decision: block`.
#[test]
fn a_prompt_hook_blocks_the_prompt_in_both_formats() {
    let _sweep = crate::suite::sweep();
    for format in Format::BOTH {
        let case = Case::new();
        let command = match format {
            Format::Claude => "echo 'no prompts on fridays' >&2; exit 2".to_owned(),
            Format::Codex => case.python(
                "block.py",
                "import json, sys\nd = json.load(sys.stdin)\nassert d['hook_event_name'] == 'UserPromptSubmit'\nprint(json.dumps({'decision': 'block', 'reason': 'no prompts on fridays: ' + d['prompt']}))\n",
            ),
        };
        let ran = case.run(
            format,
            json!({"UserPromptSubmit": [group(None, &command)]}),
            json!([answer("never said")]),
            "never",
        );
        assert_eq!(ran.code, Some(1), "{format:?}: {}", ran.stderr);
        assert!(
            ran.stderr.contains("no prompts on fridays"),
            "{format:?}: {}",
            ran.stderr
        );
        assert!(!ran.stdout.contains("never said"), "{format:?}");
        assert!(ran.of("step/start").is_empty(), "{format:?}: no step ran");
        let end = ran.of("turn/end");
        assert_eq!(
            end[0]["data"]["reason"]["kind"],
            "blocked",
            "{format:?}: {}",
            ran.text()
        );
        let result = ran.of("hook/result");
        assert_eq!(result[0]["data"]["decision"], "block", "{format:?}");
        assert_eq!(result[0]["data"]["point"], "UserPromptSubmit");
        let invoked = ran.of("hook/invoked");
        assert_eq!(
            invoked[0]["data"]["dialect"],
            format!("{format:?}").to_lowercase()
        );
    }
}

/// A `PreToolUse` hook denies a call: the command never runs and the model
/// reads the hook's reason; a group whose matcher names another tool does
/// not run. Claude Code: a Python hook's `permissionDecision: deny`; Codex:
/// a shell hook exiting 2.
#[test]
fn a_tool_hook_denies_a_call_in_both_formats() {
    let _sweep = crate::suite::sweep();
    for format in Format::BOTH {
        let case = Case::new();
        let deny = match format {
            // Claude Code's hooks know our bash as `Bash`.
            Format::Claude => case.python(
                "deny.py",
                "import json, sys\nd = json.load(sys.stdin)\nassert d['tool_name'] == 'Bash', d\nreason = 'no touching: ' + d['tool_input']['command']\nprint(json.dumps({'hookSpecificOutput': {'hookEventName': 'PreToolUse', 'permissionDecision': 'deny', 'permissionDecisionReason': reason}}))\n",
            ),
            Format::Codex => {
                "python3 -c 'import json,sys; print(\"no touching: \" + json.load(sys.stdin)[\"tool_input\"][\"command\"], file=sys.stderr)'; exit 2".to_owned()
            }
        };
        let ran = case.run(
            format,
            json!({"PreToolUse": [
                group(Some("^read$"), "touch wrong-hook"),
                group(Some(if format == Format::Claude { "Bash" } else { "bash" }), &deny),
            ]}),
            json!([bash("touch ran"), answer("ok")]),
            "never",
        );
        assert_eq!(ran.code, Some(0), "{format:?}: {}", ran.stderr);
        assert!(
            !case.ws.join("ran").exists(),
            "{format:?}: the call was denied"
        );
        assert!(
            !case.ws.join("wrong-hook").exists(),
            "{format:?}: the matcher held"
        );
        let result = &ran.of("tool/result")[0]["data"]["message"]["content"][0];
        assert_eq!(result["isError"], true);
        assert_eq!(
            result["content"][0]["text"], "Error: no touching: touch ran",
            "{format:?}"
        );
        assert_eq!(
            ran.of("hook/invoked").len(),
            1,
            "{format:?}: one group matched"
        );
        assert_eq!(ran.of("hook/result")[0]["data"]["decision"], "deny");
    }
}

/// A Claude Code `PreToolUse` hook that asks sends the call to the
/// approval seam: refused under `approval: never`, run under `always`.
/// Codex has no ask: the same answer leaves the call to the policy.
#[test]
fn a_tool_hook_that_asks_goes_to_the_approval_seam() {
    let _sweep = crate::suite::sweep();
    let ask = "{\"hookSpecificOutput\": {\"hookEventName\": \"PreToolUse\", \"permissionDecision\": \"ask\", \"permissionDecisionReason\": \"touching files\"}}";
    let command = format!("echo '{ask}'");
    for (format, approval, runs) in [
        (Format::Claude, "never", false),
        (Format::Claude, "always", true),
        (Format::Codex, "never", true),
    ] {
        let case = Case::new();
        let ran = case.run(
            format,
            json!({"PreToolUse": [group(Some("bash"), &command)]}),
            json!([bash("touch ran"), answer("ok")]),
            approval,
        );
        assert_eq!(ran.code, Some(0), "{format:?}: {}", ran.stderr);
        assert_eq!(
            case.ws.join("ran").exists(),
            runs,
            "{format:?} under {approval}: {}",
            ran.text()
        );
        let decision = &ran.of("hook/result")[0]["data"]["decision"];
        if format == Format::Claude {
            assert_eq!(decision, "ask");
            let asked = ran.of("approval/asked");
            assert_eq!(
                asked[0]["data"]["reason"],
                "touching files",
                "{}",
                ran.text()
            );
        } else {
            assert_eq!(decision, "pass", "Codex reads no ask");
        }
    }
}

/// Hooks add context: a prompt hook's context enters the step after the
/// prompt, sourced to its dialect (Claude Code: JSON `additionalContext`;
/// Codex: plain stdout); a post-call hook's context and its blocking
/// feedback are appended to the result the model reads.
#[test]
fn hooks_add_context_and_feedback_in_both_formats() {
    let _sweep = crate::suite::sweep();
    for format in Format::BOTH {
        let case = Case::new();
        let prompt = match format {
            Format::Claude => case.python(
                "context.py",
                "import json, sys\njson.load(sys.stdin)\nprint(json.dumps({'hookSpecificOutput': {'hookEventName': 'UserPromptSubmit', 'additionalContext': 'the build is green'}}))\n",
            ),
            Format::Codex => "echo 'the build is green'".to_owned(),
        };
        let post_context = "{\"hookSpecificOutput\": {\"hookEventName\": \"PostToolUse\", \"additionalContext\": \"lint is clean\"}}";
        let post_block = case.python(
            "feedback.py",
            "import json, sys\nd = json.load(sys.stdin)\nprint(json.dumps({'decision': 'block', 'reason': 'you printed ' + d['tool_response'].strip()}))\n",
        );
        let ran = case.run(
            format,
            json!({
                "UserPromptSubmit": [group(None, &prompt)],
                "PostToolUse": [group(Some("bash"), &format!("echo '{post_context}'")), group(None, &post_block)],
            }),
            json!([bash("echo hello"), answer("ok")]),
            "never",
        );
        assert_eq!(ran.code, Some(0), "{format:?}: {}", ran.stderr);
        let users = ran.of("user/message");
        assert_eq!(users[0]["data"]["source"]["kind"], "user");
        let added: Vec<&&Value> = users
            .iter()
            .filter(|m| m["data"]["source"]["plugin"] == format.plugin())
            .collect();
        assert_eq!(added.len(), 1, "{format:?}: {}", ran.text());
        assert_eq!(added[0]["data"]["content"][0]["text"], "the build is green");
        let result = &ran.of("tool/result")[0]["data"]["message"]["content"][0]["content"];
        let texts: Vec<&str> = result
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|b| b["text"].as_str())
            .collect();
        assert!(texts[0].contains("hello"), "{texts:?}");
        assert_eq!(
            texts.last().unwrap(),
            &"you printed hello\n\nlint is clean",
            "{format:?}: {texts:?}"
        );
    }
}

/// A `Stop` hook keeps the turn going with its reason; the next time it is
/// asked it is told (`stop_hook_active`) and lets the turn end. Claude
/// Code: a Python hook; Codex: a shell hook exiting 2 once.
#[test]
fn a_stop_hook_keeps_the_turn_going_in_both_formats() {
    let _sweep = crate::suite::sweep();
    for format in Format::BOTH {
        let case = Case::new();
        let seen = case.ws.join("stops.jsonl");
        let command = match format {
            Format::Claude => case.python(
                "stop.py",
                &format!(
                    "import json, sys\nd = json.load(sys.stdin)\nopen({:?}, 'a').write(json.dumps(d) + '\\n')\nif not d['stop_hook_active']:\n    print(json.dumps({{'decision': 'block', 'reason': 'run the tests first'}}))\n",
                    seen.display().to_string()
                ),
            ),
            Format::Codex => format!(
                "cat >> {}; echo >> {}; [ -f once ] && exit 0; touch once; echo 'run the tests first' >&2; exit 2",
                seen.display(),
                seen.display()
            ),
        };
        let ran = case.run(
            format,
            json!({"Stop": [group(None, &command)]}),
            json!([answer("done early"), answer("tests pass")]),
            "never",
        );
        assert_eq!(ran.code, Some(0), "{format:?}: {}", ran.stderr);
        assert!(ran.stdout.contains("done early") && ran.stdout.contains("tests pass"));
        let continued: Vec<&Value> = ran
            .of("user/message")
            .into_iter()
            .filter(|m| m["data"]["source"]["plugin"] == "agent/turn-stopping")
            .collect();
        assert_eq!(continued.len(), 1, "{format:?}: {}", ran.text());
        assert_eq!(
            continued[0]["data"]["content"][0]["text"],
            "run the tests first"
        );
        let payloads: Vec<Value> = std::fs::read_to_string(&seen)
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(payloads.len(), 2, "{format:?}: asked twice");
        assert_eq!(payloads[0]["last_assistant_message"], "done early");
        assert_eq!(payloads[1]["stop_hook_active"], true);
        assert_eq!(payloads[0]["stop_hook_active"], false);
        if format == Format::Codex {
            assert!(payloads[0]["turn_id"].is_string() && payloads[0]["model"].is_string());
        }
        let decisions: Vec<&Value> = ran
            .of("hook/result")
            .iter()
            .map(|r| &r["data"]["decision"])
            .collect();
        assert_eq!(decisions, [&json!("block"), &json!("pass")]);
    }
}

/// Broken hooks never break the turn: a file with an invalid matcher is
/// reported (file, event, pattern) and runs nothing; a hook past its
/// timeout is killed and recorded; one exiting 1 is a non-blocking error;
/// a hook runs sandboxed like bash, so it cannot write outside the
/// workspace.
#[test]
fn broken_slow_and_escaping_hooks_never_break_the_turn() {
    let _sweep = crate::suite::sweep();
    let case = Case::new();
    let outside = super::mcp::outside_dir();
    let marker = format!("slow-{}", uuid::Uuid::new_v4());
    let invalid = case.dir.join("invalid.json");
    std::fs::write(
        &invalid,
        json!({"hooks": {"PreToolUse": [group(Some("ba(sh"), "touch invalid-ran")]}}).to_string(),
    )
    .unwrap();
    let good = case.dir.join("good.json");
    let mut slow = group(Some("bash"), &format!("sleep 30 # {marker}"));
    slow["hooks"][0]["timeout"] = json!(0.3);
    std::fs::write(
        &good,
        json!({"hooks": {"PreToolUse": [
            slow,
            group(Some("bash"), "echo failing >&2; exit 1"),
            group(Some("bash"), &format!("touch {}/escaped; touch inside", outside.display())),
        ]}})
        .to_string(),
    )
    .unwrap();
    let ran = case.run_with(
        Format::Claude,
        &[invalid.clone(), good],
        json!([bash("touch ran"), answer("ok")]),
        "never",
    );
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(
        ran.stderr.contains(&format!(
            "{}: hooks.PreToolUse[0].matcher \"ba(sh\" is not a valid regular expression",
            invalid.display()
        )),
        "{}",
        ran.stderr
    );
    assert!(case.ws.join("ran").exists(), "the call ran");
    assert!(!case.ws.join("invalid-ran").exists());
    assert!(!super::running(&marker), "the slow hook was killed");
    assert!(
        case.ws.join("inside").exists(),
        "a hook writes in the workspace"
    );
    assert!(!outside.join("escaped").exists(), "but not outside it");
    let _ = std::fs::remove_dir_all(&outside);
    let results = ran.of("hook/result");
    assert_eq!(results.len(), 3);
    let summary = results[0]["data"]["stderrSummary"].as_str().unwrap();
    assert!(summary.contains("timed out"), "{summary}");
    assert!(results[0]["data"].get("exitCode").is_none());
    assert_eq!(results[1]["data"]["exitCode"], 1);
    assert_eq!(results[1]["data"]["decision"], "pass");
    assert_eq!(results[1]["data"]["stderrSummary"], "failing");
}

/// A hook runs as a supervised node of the agent's tree (`hook/PreToolUse`,
/// kind `hook`); cancelling the turn it holds up kills its process and
/// ends the turn `aborted`, and the node is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_hook_is_a_tree_node_and_dies_with_its_cancelled_turn() {
    let _sweep = crate::suite::sweep();
    use dsh::actors::agent::{Agent, AgentSpec};
    use dsh::catalogue::{
        AgentServices, AgentServicesConfig, HooksConfig, HooksPlugin, Scripted,
        ScriptedPluginConfig,
    };
    use dsh::kernel::{Runtime, RuntimeSettings};
    use dsh::services::approval::ApprovalPolicy;
    use dsh::services::session::TurnEndReason;

    let case = Case::new();
    let marker = format!("hook-{}", uuid::Uuid::new_v4());
    let settings = case.dir.join("settings.json");
    let hooks =
        json!({"hooks": {"PreToolUse": [group(Some("bash"), &format!("sleep 600 # {marker}"))]}});
    std::fs::write(&settings, hooks.to_string()).unwrap();
    let script = case.dir.join("script.json");
    let steps = json!({"steps": [bash("echo never"), answer("ok")]});
    std::fs::write(&script, steps.to_string()).unwrap();

    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let root = rt.root();
    let services = AgentServicesConfig {
        approval: Some(ApprovalPolicy::Never),
        ..AgentServicesConfig::default()
    };
    root.plugin(AgentServices, services).await.unwrap();
    let model = ScriptedPluginConfig {
        provider: "scripted".into(),
        script,
    };
    root.plugin(Scripted, model).await.unwrap();
    let config = HooksConfig {
        claude_code: Some(vec![settings]),
        codex: Some(Vec::new()),
        ..HooksConfig::default()
    };
    root.plugin(HooksPlugin, config).await.unwrap();
    let agent = Agent::create(&root, AgentSpec::new("scripted", "m", case.ws.clone()))
        .await
        .unwrap();
    agent
        .followup(dsh::services::llm::Message::user_text("go"))
        .unwrap();
    let hook_nodes = || {
        rt.tree()
            .snapshot()
            .into_iter()
            .filter(|n| n.kind == "hook" && n.name == "hook/PreToolUse")
            .count()
    };
    super::until("the hook never ran as a node of the tree", || {
        hook_nodes() == 1 && super::running(&marker)
    })
    .await;
    agent.cancel();
    agent
        .when_idle(std::time::Duration::from_secs(60))
        .await
        .unwrap();
    let reason = agent.last_turn().unwrap().reason;
    assert!(
        matches!(reason, TurnEndReason::Aborted { .. }),
        "{reason:?}"
    );
    super::until("the hook outlived its cancelled turn", || {
        !super::running(&marker) && hook_nodes() == 0
    })
    .await;
    rt.shutdown().await;
}

/// `dsh run --hooks --cwd WS`, started elsewhere, finds the project's hook
/// settings in WS (`WS/.claude/settings.json`), not in the directory it was
/// started from.
#[test]
fn project_hooks_are_found_in_the_workspace_given_with_cwd() {
    let _sweep = crate::suite::sweep();
    let case = Case::new();
    std::fs::create_dir_all(case.ws.join(".claude")).unwrap();
    let block = json!({"hooks": {"UserPromptSubmit": [group(None, "echo 'blocked by the workspace hook' >&2; exit 2")]}});
    std::fs::write(case.ws.join(".claude/settings.json"), block.to_string()).unwrap();
    let script = case.dir.join("script.json");
    std::fs::write(
        &script,
        json!({"steps": [answer("never said")]}).to_string(),
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_dsh"))
        .current_dir(&case.dir)
        .env("HOME", &case.dir)
        .env_remove("DSH_PERMISSION_MODE")
        .env_remove("DSH_APPROVAL")
        .args(["run", "--hooks", "--approval", "never", "--script"])
        .arg(&script)
        .arg("--cwd")
        .arg(&case.ws)
        .arg("--sessions-dir")
        .arg(case.dir.join("sessions"))
        .arg("please help")
        .bounded_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("blocked by the workspace hook"), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("never said"));
}
