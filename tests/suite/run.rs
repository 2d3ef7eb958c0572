//! `dsh run` as a user runs it.

use super::Bounded;
use std::path::PathBuf;
use std::process::{Command, Output};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn dsh(args: &[&str]) -> Output {
    dsh_with(args, &[])
}

/// Runs `dsh` with `env` set (and no model or approval variables of the
/// caller's), sessions in a fresh directory.
fn dsh_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let sessions = dsh::kernel::scratch::fresh_dir("dsh-run-sessions").unwrap();
    let home = dsh::kernel::scratch::fresh_dir("dsh-run-home").unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_dsh"));
    c.args(args)
        .current_dir(repo())
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .env_remove("DEEPSEEK_API_KEY")
        .env_remove("DEEPSEEK_BASE_URL")
        .env("DSH_SESSIONS_DIR", &sessions)
        .env("HOME", &home);
    for (k, v) in env {
        c.env(k, v);
    }
    c.bounded_output().expect("the dsh binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn the_keyless_demo_runs_tools_and_answers() {
    let _sweep = crate::suite::sweep();
    let out = dsh(&[
        "run",
        "--script",
        "demo/hello.json",
        "--approval",
        "never",
        "What is in this workspace?",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("This workspace holds dsh"), "{stdout}");
    let stderr = text(&out.stderr);
    for tool in ["▸ glob", "▸ todo_write", "▸ read", "▸ bash"] {
        assert!(stderr.contains(tool), "{tool} missing from: {stderr}");
    }
    assert!(!stderr.contains('✗'), "no tool failed: {stderr}");
}

#[test]
fn json_mode_prints_the_session_event_stream() {
    let _sweep = crate::suite::sweep();
    let out = dsh(&[
        "run",
        "--script",
        "demo/hello.json",
        "--json",
        "--approval",
        "never",
        "go",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let events: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(kinds[..2], ["agent/inbox/spliced", "turn/start"]);
    assert_eq!(kinds.last(), Some(&"turn/end"));
    assert_eq!(kinds.iter().filter(|k| **k == "tool/call").count(), 4);
    assert_eq!(kinds.iter().filter(|k| **k == "tool/result").count(), 4);
    assert!(kinds.contains(&"todo/write"));
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["seq"], i as u64, "contiguous seqs");
    }
}

#[test]
fn without_an_endpoint_it_says_how_to_configure_one() {
    let _sweep = crate::suite::sweep();
    let out = dsh(&["run", "hello"]);
    assert_eq!(out.status.code(), Some(2));
    let stderr = text(&out.stderr);
    assert!(stderr.contains("no model is configured"), "{stderr}");
    assert!(stderr.contains("--base-url"), "{stderr}");
    let bad = dsh(&["run", "--script", "Cargo.toml", "x"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(
        text(&bad.stderr).contains("invalid script"),
        "{}",
        text(&bad.stderr)
    );
}

/// The model and policy options are one set, parsed and resolved the same
/// way by every command that creates agents.
#[test]
fn a_model_or_policy_flag_means_the_same_in_every_command() {
    let _sweep = crate::suite::sweep();
    // The keyless demo model serves `run` as it serves `workflow`.
    let out = dsh(&["run", "--demo-model", "--approval", "never", "actors"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("Done: actors"),
        "{}",
        text(&out.stdout)
    );
    // A bad policy in the environment is refused, naming the variable, by
    // each command alike, before anything starts.
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-flow").unwrap();
    let flow = dir.join("flow.js");
    std::fs::write(&flow, "return 1;").unwrap();
    let flow = flow.to_str().unwrap();
    for args in [
        &["run", "--demo-model", "x"][..],
        &["workflow", flow, "--demo-model"][..],
        &["ralph", "x", "--demo-model"][..],
        &["serve", "--bind", "127.0.0.1:0"][..],
    ] {
        let out = dsh_with(args, &[("DSH_APPROVAL", "sometimes")]);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let stderr = text(&out.stderr);
        assert!(
            stderr.contains("$DSH_APPROVAL: unknown approval policy `sometimes`"),
            "{args:?}: {stderr}"
        );
    }
    // The flag wins over the variable.
    let out = dsh_with(
        &["run", "--demo-model", "--approval", "never", "x"],
        &[("DSH_APPROVAL", "sometimes")],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    // A plugin tree serves the providers alone.
    let out = dsh(&["run", "--config", "demo/cordis.yml", "--demo-model", "x"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("--config serves the providers from its file"),
        "{}",
        text(&out.stderr)
    );
    // `--base-url` from the environment needs a model from somewhere.
    let out = dsh_with(
        &["ralph", "x"],
        &[("DSH_BASE_URL", "http://127.0.0.1:9/v1")],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("--base-url needs --model"));
}

/// A `--config` file's `session-store` serves `workflow` as it serves
/// `run`; a store named by a flag or a variable wins over it.
#[test]
fn a_configured_session_store_serves_every_command_unless_one_is_named() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-store").unwrap();
    let configured = dir.join("configured");
    let config = dir.join("cordis.yml");
    std::fs::write(
        &config,
        format!(
            "plugins:\n  - {{ id: services, name: agent-services, config: {{ approval: never }} }}\n  \
             - {{ id: model, name: scripted, config: {{ script: {} }} }}\n  \
             - {{ id: store, name: session-store, config: {{ backend: jsonl, path: {} }} }}\n",
            repo().join("demo/hello.json").display(),
            configured.display()
        ),
    )
    .unwrap();
    let flow = dir.join("flow.js");
    std::fs::write(&flow, "return 1;").unwrap();
    let bare = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dsh"))
            .args(args)
            .current_dir(repo())
            .env_remove("DSH_BASE_URL")
            .env_remove("DSH_MODEL")
            .env_remove("DSH_APPROVAL")
            .env_remove("DSH_SESSIONS_DIR")
            .env_remove("DSH_SESSIONS_DB")
            .bounded_output()
            .unwrap()
    };
    let config = config.to_str().unwrap();
    let out = bare(&["run", "--config", config, "hi"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = bare(&["workflow", flow.to_str().unwrap(), "--config", config]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    // Sessions, beside the writers' lock files.
    let sessions = |dir: &std::path::Path| {
        std::fs::read_dir(dir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name() != "locks")
            .count()
    };
    assert_eq!(
        sessions(&configured),
        2,
        "the run's session and the workflow coordinator's"
    );
    // A store named by its variable wins over the configured one.
    let named = dir.join("named");
    let out = dsh_with(
        &["workflow", flow.to_str().unwrap(), "--config", config],
        &[("DSH_SESSIONS_DIR", named.to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(sessions(&named), 1);
    assert_eq!(sessions(&configured), 2);
}

#[test]
fn a_provider_failure_exits_non_zero_with_the_cause() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run").unwrap();
    let script = dir.join("fail.json");
    std::fs::write(&script, r#"{"steps": [{"error": {"code": "INSUFFICIENT_QUOTA", "message": "quota exhausted", "status": 402}}]}"#).unwrap();
    let out = dsh(&["run", "--script", script.to_str().unwrap(), "x"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr)
            .contains("the model call failed: quota exhausted (INSUFFICIENT_QUOTA, HTTP 402)"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn the_session_log_is_written_and_loads_back() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-log").unwrap();
    let log = dir.join("session.jsonl");
    let out = dsh(&[
        "run",
        "--script",
        "demo/hello.json",
        "--approval",
        "never",
        "--session",
        log.to_str().unwrap(),
        "go",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let written = std::fs::read_to_string(&log).unwrap();
    let (header, events) = dsh::services::session::jsonl::parse(&written).unwrap();
    assert_eq!(header.delegation_depth, 0);
    assert_eq!(events.last().unwrap().kind(), "turn/end");
    let mut session = dsh::services::session::SessionLog::from_seed(header, events, 0).unwrap();
    assert_eq!(
        session.derive_messages().last().unwrap().role,
        dsh::services::llm::Role::Assistant
    );
}

#[test]
fn a_config_supplies_the_services_the_provider_and_prompt_sections() {
    let _sweep = crate::suite::sweep();
    let out = dsh(&["run", "--config", "demo/cordis.yml", "--json", "go"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let header = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|e| e["type"] == "request/header")
        .unwrap();
    let system = header["data"]["header"]["system"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        system.ends_with("Answer in one short paragraph."),
        "{system}"
    );
    assert_eq!(header["data"]["header"]["config"]["provider"], "scripted");

    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-cfg").unwrap();
    let two = dir.join("two.yml");
    std::fs::write(
        &two,
        "plugins:\n  - id: s\n    name: agent-services\n  - id: a\n    name: scripted\n    config: { provider: a, script: demo/hello.json }\n  - id: b\n    name: scripted\n    config: { provider: b, script: demo/hello.json }\n",
    )
    .unwrap();
    let out = dsh(&["run", "--config", two.to_str().unwrap(), "go"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr)
            .contains("several providers are registered (a, b); choose one with --provider"),
        "{}",
        text(&out.stderr)
    );
    let out = dsh(&[
        "run",
        "--config",
        two.to_str().unwrap(),
        "--provider",
        "b",
        "--approval",
        "never",
        "go",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let bad = dir.join("bad.yml");
    std::fs::write(
        &bad,
        "plugins:\n  - id: s\n    name: agent-services\n    config: { approval: sometimes }\n",
    )
    .unwrap();
    let out = dsh(&["run", "--config", bad.to_str().unwrap(), "go"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("entry `s`, field `config.approval`"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn an_answer_cut_at_the_token_limit_exits_1() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-cut").unwrap();
    let script = dir.join("cut.json");
    std::fs::write(
        &script,
        r#"{"steps": [{"text": "half an ans", "cut": true}]}"#,
    )
    .unwrap();
    let out = dsh(&[
        "run",
        "--script",
        script.to_str().unwrap(),
        "--approval",
        "never",
        "x",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("half an ans"));
    assert!(
        text(&out.stderr).contains("max-tokens"),
        "{}",
        text(&out.stderr)
    );
}

/// A reply of [`deepseek_mock`] that refuses with HTTP 429 (`Retry-After: 0`).
pub(crate) const RATE_LIMITED: &str = "HTTP 429";

/// Serves `replies` (SSE `data:` payloads per conversation request, or
/// [`RATE_LIMITED`]) on loopback from a thread, and answers each `x-dsh-purpose: session-title`
/// request with a title, until `replies` are used and `titles` titles were
/// asked (or a minute passed); every request (head and body), in order.
pub(crate) fn deepseek_mock(
    replies: Vec<Vec<&'static str>>,
    titles: usize,
) -> (String, std::thread::JoinHandle<Vec<String>>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let mut seen = Vec::new();
        let mut replies = std::collections::VecDeque::from(replies);
        let mut titled = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while (!replies.is_empty() || titled < titles) && std::time::Instant::now() < deadline {
            let mut sock = match listener.accept() {
                Ok((sock, _)) => sock,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // Until the next connection (or the deadline).
                    super::readable(&listener, deadline);
                    continue;
                }
                Err(e) => panic!("{e}"),
            };
            sock.set_nonblocking(false).unwrap();
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            loop {
                let n = sock.read(&mut chunk).unwrap();
                buf.extend_from_slice(&chunk[..n]);
                let text = String::from_utf8_lossy(&buf).to_string();
                if let Some(end) = text.find("\r\n\r\n") {
                    let len = text[..end]
                        .lines()
                        .find_map(|l| {
                            l.to_lowercase()
                                .strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap())
                        })
                        .unwrap_or(0);
                    if buf.len() >= end + 4 + len || n == 0 {
                        break;
                    }
                }
            }
            let request = String::from_utf8_lossy(&buf).to_string();
            let events = if request
                .to_lowercase()
                .contains("x-dsh-purpose: session-title")
            {
                titled += 1;
                vec![
                    r#"{"choices":[{"delta":{"content":"\"Docs in the workspace.\""}}]}"#,
                    r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
                ]
            } else {
                replies.pop_front().unwrap_or_default()
            };
            seen.push(request);
            if events == [RATE_LIMITED] {
                let body = r#"{"error":{"message":"slow down, please\u001b[2J"}}"#;
                let refusal = format!(
                    "HTTP/1.1 429 Too Many Requests\r\nretry-after: 0\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                sock.write_all(refusal.as_bytes()).unwrap();
                continue;
            }
            let mut out = String::from(
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
            );
            for e in events {
                out.push_str(&format!("data: {e}\n\n"));
            }
            out.push_str("data: [DONE]\n\n");
            sock.write_all(out.as_bytes()).unwrap();
        }
        seen
    });
    (url, handle)
}

/// An endpoint that refuses twice with 429 before it answers: the run says
/// each retry as it waits, records it in the session log, and completes.
#[test]
fn a_rate_limited_call_is_retried_and_each_retry_shown_and_recorded() {
    let _sweep = crate::suite::sweep();
    let (url, server) = deepseek_mock(
        vec![
            vec![RATE_LIMITED],
            vec![RATE_LIMITED],
            vec![
                r#"{"choices":[{"delta":{"content":"after the wait"}}]}"#,
                r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
            ],
        ],
        0,
    );
    let sessions = dsh::kernel::scratch::fresh_dir("dsh-run-retry").unwrap();
    let out = dsh(&[
        "run",
        "--base-url",
        &url,
        "--model",
        "m",
        "--approval",
        "never",
        "--sessions-dir",
        sessions.to_str().unwrap(),
        "hi",
    ]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(text(&out.stdout).contains("after the wait"));
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("retrying in "))
        .collect();
    assert_eq!(said.len(), 2, "{stderr}");
    assert!(said[0].contains("(HTTP 429 RATE_LIMITED"), "{}", said[0]);
    assert!(said[0].contains("attempt 1 of "), "{}", said[0]);
    assert!(said[1].contains("attempt 2 of "), "{}", said[1]);
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");
    let _ = server.join();
    let log = std::fs::read_dir(&sessions)
        .unwrap()
        .flatten()
        .find_map(|d| std::fs::read_to_string(d.path().join("session.jsonl")).ok())
        .expect("the session log");
    let retries: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| l.contains("\"llm/retry\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(retries.len(), 2, "{log}");
    assert_eq!(retries[0]["data"]["status"], 429);
    assert_eq!(retries[1]["data"]["attempt"], 2);
}

/// A route whose config gives a price shows the run's cost on its closing
/// line; one without shows none; a price that is no price is refused with
/// its field.
#[test]
fn a_priced_route_shows_the_runs_cost_and_an_unpriced_one_none() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-price").unwrap();
    let answer = vec![
        r#"{"choices":[{"delta":{"content":"priced"}}]}"#,
        r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
        r#"{"choices":[],"usage":{"prompt_tokens":1000,"completion_tokens":500}}"#,
    ];
    for (price, says) in [
        ("price: { input: 2.0, output: 8.0 }", Some(" · cost 0.0060")),
        ("images: false", None),
    ] {
        let (url, server) = deepseek_mock(vec![answer.clone()], 0);
        let config = dir.join("cordis.yml");
        std::fs::write(
            &config,
            format!(
                "plugins:\n  - {{ id: services, name: agent-services, config: {{ approval: never }} }}\n  - {{ id: ep, name: openai, config: {{ base_url: \"{url}\", {price} }} }}\n"
            ),
        )
        .unwrap();
        let out = dsh(&[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--model",
            "m",
            "hi",
        ]);
        let stderr = text(&out.stderr);
        assert!(out.status.success(), "{stderr}");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(last.contains(" · 1.0k in / 500 out tokens"), "{last}");
        match says {
            Some(cost) => assert!(last.ends_with(cost), "{last}"),
            None => assert!(!last.contains("cost"), "{last}"),
        }
        let _ = server.join();
    }
    let config = dir.join("bad.yml");
    std::fs::write(
        &config,
        "plugins:\n  - { id: ep, name: openai, config: { base_url: \"http://127.0.0.1:9\", price: { input: -1, output: 8 } } }\n",
    )
    .unwrap();
    let out = dsh(&["check", config.to_str().unwrap()]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("price.input: -1"), "{stderr}");
}

pub(crate) fn body_of(request: &str) -> serde_json::Value {
    serde_json::from_str(&request[request.find("\r\n\r\n").unwrap() + 4..]).unwrap()
}

/// With only the DeepSeek variables set, `dsh run` talks to DeepSeek: its
/// key, its default model, thinking on at the default effort; a thinking
/// tool-call turn's reasoning goes back with the tool result.
#[test]
fn deepseek_variables_alone_choose_deepseek_and_reasoning_is_passed_back() {
    let _sweep = crate::suite::sweep();
    let home = dsh::kernel::scratch::fresh_dir("dsh-run-deepseek-home").unwrap();
    let home = home.to_str().unwrap();
    let (url, server) = deepseek_mock(
        vec![
            vec![
                r#"{"choices":[{"delta":{"role":"assistant","reasoning_content":""}}]}"#,
                r#"{"choices":[{"delta":{"reasoning_content":"list the files first"}}]}"#,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_1","type":"function","function":{"name":"glob","arguments":"{\"pattern\":\"*.md\"}"}}]}}]}"#,
                r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#,
            ],
            vec![
                r#"{"choices":[{"delta":{"content":"Two files."}}]}"#,
                r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
            ],
        ],
        1,
    );
    let out = dsh_with(
        &[
            "run",
            "--approval",
            "never",
            "--cwd",
            ".",
            "what docs are there?",
        ],
        &[
            ("DEEPSEEK_API_KEY", "sk-deepseek-test"),
            ("DEEPSEEK_BASE_URL", url.as_str()),
            ("HOME", home),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("Two files."));
    let all = server.join().unwrap();
    // One title request, thinking off, with the first prompt; the rest is
    // the conversation.
    let (titles, requests): (Vec<String>, Vec<String>) = all
        .into_iter()
        .partition(|r| r.to_lowercase().contains("x-dsh-purpose: session-title"));
    assert_eq!(titles.len(), 1, "{titles:?}");
    let title = body_of(&titles[0]);
    assert_eq!(title["thinking"]["type"], "disabled");
    assert!(title.get("tools").is_none());
    assert!(
        title.to_string().contains("what docs are there?"),
        "{title}"
    );
    let first = &requests[0];
    assert!(first.starts_with("POST /chat/completions"), "{first}");
    let lower = first.to_lowercase();
    assert!(
        lower.contains("authorization: bearer sk-deepseek-test"),
        "{first}"
    );
    assert!(lower.contains("user-agent: dsh/"), "{first}");
    assert!(lower.contains("x-deepseek-harness-session-id: "), "{first}");
    // The anonymous installation id: a UUID kept in ~/.dsh, the same on
    // every request of every run.
    let user_id = header(first, "x-deepseek-harness-user-id").expect("a user id header");
    assert!(uuid_like(&user_id), "{user_id}");
    assert_eq!(
        std::fs::read_to_string(format!("{home}/.dsh/user-id"))
            .unwrap()
            .trim(),
        user_id
    );
    assert_eq!(
        header(&titles[0], "x-deepseek-harness-user-id").as_deref(),
        Some(user_id.as_str())
    );
    assert!(!lower.contains("x-dsh-purpose"), "{first}");
    let body = body_of(first);
    assert_eq!(body["model"], "deepseek-v4-flash");
    assert_eq!(body["thinking"]["type"], "enabled");
    assert_eq!(body["reasoning_effort"], "high");
    assert_eq!(body["max_tokens"], 256_000);
    let second = body_of(&requests[1]);
    let turn = second["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "assistant")
        .unwrap()
        .clone();
    assert_eq!(turn["reasoning_content"], "list the files first");
    assert_eq!(turn["content"], "");
    // The effort flag reaches the wire; `off` turns thinking off.
    let (url, server) = deepseek_mock(
        vec![vec![
            r#"{"choices":[{"delta":{"content":"ok"}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
        ]],
        1,
    );
    let out = dsh_with(
        &[
            "run",
            "--approval",
            "never",
            "--reasoning-effort",
            "off",
            "hi",
        ],
        &[
            ("DEEPSEEK_API_KEY", "k"),
            ("DEEPSEEK_BASE_URL", url.as_str()),
            ("HOME", home),
        ],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let conversation: Vec<String> = server
        .join()
        .unwrap()
        .into_iter()
        .filter(|r| !r.to_lowercase().contains("x-dsh-purpose"))
        .collect();
    let body = body_of(&conversation[0]);
    assert_eq!(body["thinking"]["type"], "disabled");
    assert!(body.get("reasoning_effort").is_none());
    assert_eq!(
        header(&conversation[0], "x-deepseek-harness-user-id").as_deref(),
        Some(user_id.as_str()),
        "the next run sends the same id"
    );
}

/// The value of header `name` in a raw HTTP request.
fn header(request: &str, name: &str) -> Option<String> {
    request[..request.find("\r\n\r\n")?].lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
    })
}

fn uuid_like(s: &str) -> bool {
    s.len() == 36
        && s.char_indices().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

/// A model that writes terminal escapes (a title, a hyperlink, the
/// clipboard, colours, a screen wipe) in its answer, its reasoning and its
/// tool calls, and a tool error that echoes them: nothing reaches the
/// terminal but the text. The run ends with its one closing line.
#[test]
fn escapes_from_the_model_and_its_tools_print_inert_and_the_run_ends_with_its_line() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-escapes").unwrap();
    let script = dir.join("hostile.json");
    let e = "\u{1b}";
    let steps = serde_json::json!({"steps": [
        {
            "reasoning": format!("thinking{e}]0;pwned\u{7} hard"),
            "tool_calls": [{"name": "read", "arguments": {"file_path": format!("gone{e}]52;c;cm0gLXJm\u{7}{e}[2J.txt")}}]
        },
        {"text": format!("see {e}]8;;http://evil.example/{e}\\the link{e}]8;;{e}\\, {e}[31mred{e}[0m,\u{9b}1A done")}
    ]});
    std::fs::write(&script, steps.to_string()).unwrap();
    let script = script.to_str().unwrap();
    let out = dsh(&["run", "--script", script, "--approval", "never", "x"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    for (name, stream) in [("stdout", &stdout), ("stderr", &stderr)] {
        assert!(
            !stream
                .chars()
                .any(|c| c.is_control() && c != '\n' && c != '\t'),
            "{name} holds a control character: {stream:?}"
        );
    }
    assert!(stdout.contains("see the link, red, done"), "{stdout:?}");
    assert!(stderr.contains("thinking hard"), "{stderr:?}");
    assert!(stderr.contains("▸ read"), "{stderr:?}");
    // The tool's error echoes the name it was given, escapes and all.
    assert!(
        stderr
            .lines()
            .any(|l| l.starts_with("  ✗ ") && l.contains("gone.txt")),
        "{stderr:?}"
    );
    // The closing line: the session (short and full), how the turn ended,
    // its time, steps, tool calls and tokens.
    let last = stderr.lines().last().unwrap_or_default();
    let id = last
        .split(['(', ')'])
        .nth(1)
        .unwrap_or_else(|| panic!("no session id in {last:?}"));
    assert_eq!(id.len(), 36, "{last}");
    assert!(
        last.starts_with(&format!("session {} ({id}) completed in ", &id[..8])),
        "{last}"
    );
    assert!(last.contains(" · 2 steps · 1 tool call · "), "{last}");
    assert!(last.ends_with(" out tokens"), "{last}");
    // --quiet drops it.
    let quiet = dsh(&[
        "run",
        "--script",
        script,
        "--approval",
        "never",
        "--quiet",
        "x",
    ]);
    assert!(
        !text(&quiet.stderr).contains(" completed in "),
        "{}",
        text(&quiet.stderr)
    );
}

/// The 8 characters the closing line shows are enough to resume the
/// session; the start of several ids is refused, naming them.
#[test]
fn a_session_is_resumed_by_the_short_id_its_run_printed() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-short").unwrap();
    let sessions = dir.join("sessions");
    let script = dir.join("ok.json");
    std::fs::write(&script, r#"{"steps": [{"text": "ok"}]}"#).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run",
            "--script",
            script.to_str().unwrap(),
            "--approval",
            "never",
            "--sessions-dir",
            sessions.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        args.push("go on");
        dsh(&args)
    };
    let first = run(&[]);
    let said = text(&first.stderr);
    assert!(first.status.success(), "{said}");
    let last = said.lines().last().unwrap_or_default().to_owned();
    let short = last.split(' ').nth(1).unwrap().to_owned();
    let full = last.split(['(', ')']).nth(1).unwrap().to_owned();
    assert_eq!(short.len(), 8, "{last}");
    let again = run(&["--resume", &short]);
    let said = text(&again.stderr);
    assert!(again.status.success(), "{said}");
    assert!(said.contains(&format!("({full})")), "{said}");
    // Two turns in one session now.
    let log = std::fs::read_to_string(sessions.join(&full).join("session.jsonl")).unwrap();
    assert_eq!(log.matches("\"turn/end\"").count(), 2, "{log}");
    // A start shared by two ids names both.
    let twin = format!("{}-twin", &full[..8]);
    std::fs::create_dir_all(sessions.join(&twin)).unwrap();
    std::fs::copy(
        sessions.join(&full).join("session.jsonl"),
        sessions.join(&twin).join("session.jsonl"),
    )
    .unwrap();
    let both = run(&["--resume", &short]);
    let said = text(&both.stderr);
    assert_eq!(both.status.code(), Some(2), "{said}");
    assert!(
        said.contains("is the start of 2 session ids") && said.contains(&twin),
        "{said}"
    );
}

#[test]
fn reasoning_goes_to_stderr_unless_quiet() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-reasoning").unwrap();
    let script = dir.join("think.json");
    std::fs::write(
        &script,
        r#"{"steps": [{"reasoning": "pondering the question", "text": "the answer"}]}"#,
    )
    .unwrap();
    let script = script.to_str().unwrap();
    let out = dsh(&["run", "--script", script, "--approval", "never", "x"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("pondering the question"),
        "{}",
        text(&out.stderr)
    );
    assert!(
        !text(&out.stdout).contains("pondering"),
        "{}",
        text(&out.stdout)
    );
    assert!(text(&out.stdout).contains("the answer"));
    let out = dsh(&[
        "run",
        "--script",
        script,
        "--approval",
        "never",
        "--quiet",
        "x",
    ]);
    assert!(out.status.success());
    assert!(
        !text(&out.stderr).contains("pondering"),
        "{}",
        text(&out.stderr)
    );
}

/// The system prompt `dsh run` sends, as its `request/header` records it:
/// who the agent is, where it works, how to use each tool, and the sandbox
/// — the same text under every mode (the runtime context states the mode).
#[test]
fn the_system_prompt_has_its_sections_and_no_mode() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-prompt").unwrap();
    let script = dir.join("s.json");
    std::fs::write(&script, r#"{"steps": [{"text": "ok"}]}"#).unwrap();
    let prompt_under = |mode: &str| {
        let out = dsh(&[
            "run",
            "--script",
            script.to_str().unwrap(),
            "--approval",
            "never",
            "--permission-mode",
            mode,
            "--json",
            "x",
        ]);
        system_sent(&out)
    };
    let system = prompt_under("workspace-write");
    for part in [
        "You are dsh",
        "# Environment",
        "Working directory",
        "# Tools",
        "- Read a file before you edit",
        "[exit code: N]",
        "`subagent`",
        "# Sandbox",
        "`sandbox_permissions` naming the mode",
    ] {
        assert!(system.contains(part), "no `{part}` in:\n{system}");
    }
    // Persona, then the tools' guidance, then the sandbox.
    let at = |part: &str| system.find(part).unwrap();
    assert!(at("You are dsh") < at("# Tools") && at("# Tools") < at("# Sandbox"));
    assert_eq!(
        prompt_under("read-only"),
        system,
        "the prompt does not change with the mode"
    );
}

/// The anonymous id survives runs, replaces a file that holds no UUID, and
/// a home that cannot be written still gives an id (for that run only).
#[test]
fn the_anonymous_id_is_stable_and_a_bad_file_is_replaced() {
    let _sweep = crate::suite::sweep();
    let home = dsh::kernel::scratch::fresh_dir("dsh-home-id").unwrap();
    let first = dsh::home::user_id_in(&home);
    assert!(uuid_like(&first), "{first}");
    assert_eq!(dsh::home::user_id_in(&home), first);
    std::fs::write(home.join("user-id"), "not an id; rm -rf /").unwrap();
    let replaced = dsh::home::user_id_in(&home);
    assert!(uuid_like(&replaced) && replaced != first, "{replaced}");
    assert_eq!(dsh::home::user_id_in(&home), replaced);
    // A home that is a file: nothing can be kept, the run goes on.
    let blocked = home.join("user-id");
    let once = dsh::home::user_id_in(&blocked);
    assert!(uuid_like(&once), "{once}");
}

/// A project's `AGENTS.md` reaches the model after the sandbox section,
/// saying where it came from, and its skills catalog after that.
#[test]
fn project_instructions_and_skills_follow_the_sandbox_section() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-run-agents-md").unwrap();
    std::fs::create_dir_all(dir.join(".git")).unwrap();
    std::fs::write(
        dir.join("AGENTS.md"),
        "Run `make check` before you finish.\n",
    )
    .unwrap();
    std::fs::create_dir_all(dir.join(".dsh/skills/deploy")).unwrap();
    std::fs::write(
        dir.join(".dsh/skills/deploy/SKILL.md"),
        "---\ndescription: Ship a release\n---\nRun the ship script.\n",
    )
    .unwrap();
    let script = dir.join("s.json");
    std::fs::write(&script, r#"{"steps": [{"text": "ok"}]}"#).unwrap();
    let out = dsh(&[
        "run",
        "--script",
        script.to_str().unwrap(),
        "--approval",
        "never",
        "--cwd",
        dir.to_str().unwrap(),
        "--json",
        "x",
    ]);
    let system = system_sent(&out);
    let at = |part: &str| {
        system
            .find(part)
            .unwrap_or_else(|| panic!("no `{part}` in:\n{system}"))
    };
    assert!(at("# Sandbox") < at("# Project instructions"));
    assert!(at("## From ") < at("Run `make check` before you finish."));
    assert!(system.contains("AGENTS.md"), "{system}");
    // Then the skills catalog: names and descriptions, never the body.
    assert!(at("# Project instructions") < at("# Skills"));
    assert!(system.contains("- `deploy`: Ship a release"), "{system}");
    assert!(!system.contains("Run the ship script"), "{system}");
}

/// The system prompt a `dsh run --json` sent, from its `request/header`.
fn system_sent(out: &Output) -> String {
    assert!(out.status.success(), "{}", text(&out.stderr));
    let header = text(&out.stdout)
        .lines()
        .find(|l| l.contains("\"type\":\"request/header\""))
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .unwrap();
    header["data"]["header"]["system"]
        .as_str()
        .unwrap_or_default()
        .to_owned()
}
