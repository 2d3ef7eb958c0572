//! Replays of the upstream harness's recorded sessions
//! (copied into `tests/fixtures/dsh-sessions`, MIT, with upstream's LICENSE)
//! through `dsh replay`.

use super::Bounded;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use dsh::kernel::scratch::fresh_dir;

fn recordings() -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dsh-sessions");
    assert!(
        dir.is_dir(),
        "the conformance recordings are missing at {}",
        dir.display()
    );
    dir
}

/// A fresh workspace with the files the scenarios read.
fn workspace() -> PathBuf {
    let dir = fresh_dir("dsh-conf").unwrap();
    std::fs::write(dir.join("greeting.txt"), "hello\n").unwrap();
    std::fs::write(dir.join("a.txt"), "alpha\n").unwrap();
    std::fs::write(dir.join("b.txt"), "beta\n").unwrap();
    dir
}

fn replay(log: &Path, cwd: &Path, out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .args([
            "replay",
            log.to_str().unwrap(),
            "--cwd",
            cwd.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .bounded_output()
        .expect("dsh runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The tool result texts and error flags of a written log.
fn results(log: &Path) -> Vec<(bool, String)> {
    let (_, events) =
        dsh::services::session::jsonl::parse(&std::fs::read_to_string(log).unwrap()).unwrap();
    events
        .iter()
        .filter_map(|e| match &e.data {
            dsh::services::session::EventData::ToolResult { message, error, .. } => {
                Some((error.is_some(), format!("{:?}", message.content)))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn every_supported_recording_replays_to_the_same_structure() {
    let _sweep = crate::suite::sweep();
    for scenario in [
        "text-turn",
        "tool-call-turn",
        "bash-tool-turn",
        "multi-turn",
        "parallel-tool-calls",
        "fs-read",
        "fs-write",
        "subagent-spawn-in-process",
        "cancel",
        // Ours (tests/fixtures/recordings): shapes upstream's ten lack.
        "max-tokens-continue",
        "cancel-tool-calls",
        "retry-after-throw",
        "fork-seeded",
        "continuable-child",
    ] {
        let cwd = workspace();
        let out = cwd.join("replayed.jsonl");
        let upstream = recordings().join(scenario);
        let dir = if upstream.is_dir() {
            upstream
        } else {
            recordings().join("../recordings").join(scenario)
        };
        let run = replay(&dir.join("session.jsonl"), &cwd, &out);
        assert!(run.status.success(), "{scenario}: {}", text(&run.stderr));
        assert!(
            text(&run.stdout).starts_with("replay agrees with the recording"),
            "{scenario}: {}",
            text(&run.stdout)
        );
        for (is_error, content) in results(&out) {
            // The client cancels those calls while they run.
            let cancelled = scenario == "cancel-tool-calls";
            assert_eq!(is_error, cancelled, "{scenario}: {content}");
            if cancelled {
                assert!(content.contains("cancelled"), "{content}");
            }
        }
        match scenario {
            "fs-write" => assert_eq!(
                std::fs::read_to_string(cwd.join("notes.txt"))
                    .unwrap()
                    .trim(),
                "hello world"
            ),
            "fs-read" => assert!(results(&out)[0].1.contains("1: hello")),
            "parallel-tool-calls" => {
                let r = results(&out);
                assert!(r[0].1.contains("alpha") && r[1].1.contains("beta"), "{r:?}");
            }
            "bash-tool-turn" => assert!(results(&out)[0].1.contains("TERMINAL_OK")),
            // The sidecar's throw was retried, and the retry answered.
            "retry-after-throw" => {
                let log = std::fs::read_to_string(&out).unwrap();
                assert!(
                    log.contains(r#""type":"llm/retry""#) && log.contains(r#""code":"OVERLOADED""#),
                    "{log}"
                );
            }
            "max-tokens-continue" => {
                let shape = dsh::services::session::compare::shape(
                    &dsh::services::session::jsonl::parse(&std::fs::read_to_string(&out).unwrap())
                        .unwrap()
                        .1,
                );
                let ends: Vec<&str> = shape.iter().map(|t| t.end.as_str()).collect();
                assert_eq!(ends, ["max-tokens", "completed"]);
            }
            // The forked child answered from its own turns, not from the
            // parent's history it inherited.
            "fork-seeded" => assert!(
                results(&out)[0].1.contains("FORK_OK"),
                "{:?}",
                results(&out)
            ),
            // The parent's `send_message` reached the live child (its id,
            // not the recorded one), which answered from its own log.
            "continuable-child" => {
                let r = results(&out);
                assert!(
                    r.iter().any(|(_, c)| c.contains("delivered to subagent")),
                    "{r:?}"
                );
            }
            "subagent-spawn-in-process" => {
                assert!(
                    results(&out)[0].1.contains("CHILD_OK"),
                    "{:?}",
                    results(&out)
                )
            }
            _ => {}
        }
    }
}

#[test]
fn a_diverging_recording_is_reported_with_the_first_difference() {
    let _sweep = crate::suite::sweep();
    let original =
        std::fs::read_to_string(recordings().join("tool-call-turn/session.jsonl")).unwrap();
    // Change the recorded `tool/call` only; the model output still asks for SNAPSHOT_OK.
    let edited: String = original
        .lines()
        .map(|l| {
            if l.contains(r#""type":"tool/call""#) {
                l.replace("echo SNAPSHOT_OK", "echo SOMETHING_ELSE")
            } else {
                l.to_owned()
            }
        })
        .map(|l| l + "\n")
        .collect();
    assert_ne!(original, edited);
    let cwd = workspace();
    let log = cwd.join("edited.jsonl");
    std::fs::write(&log, edited).unwrap();
    let run = replay(&log, &cwd, &cwd.join("out.jsonl"));
    assert_eq!(run.status.code(), Some(1));
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("first divergence: turn 1: tool call 1: recorded bash"),
        "{stderr}"
    );
    assert!(
        stderr.contains("SOMETHING_ELSE") && stderr.contains("SNAPSHOT_OK"),
        "{stderr}"
    );
}

#[test]
fn a_broken_recording_is_refused_with_its_line() {
    let _sweep = crate::suite::sweep();
    let cwd = workspace();
    let log = cwd.join("broken.jsonl");
    std::fs::write(&log, "{\"type\":\"session\",\"version\":0,\"id\":\"x\",\"createdAt\":1,\"delegationDepth\":0}\n{\"type\":\"turn/start\",\"data\":{}}\n").unwrap();
    let run = replay(&log, &cwd, &cwd.join("out.jsonl"));
    assert_eq!(run.status.code(), Some(2));
    assert!(
        text(&run.stderr).contains("line 2: `turn/start` event: missing field `turn`"),
        "{}",
        text(&run.stderr)
    );
}

#[test]
fn a_multi_agent_recording_without_its_child_log_diverges() {
    let _sweep = crate::suite::sweep();
    let cwd = workspace();
    let copy = cwd.join("recording");
    std::fs::create_dir_all(&copy).unwrap();
    std::fs::copy(
        recordings().join("subagent-spawn-in-process/session.jsonl"),
        copy.join("session.jsonl"),
    )
    .unwrap();
    let out = cwd.join("replayed.jsonl");
    let run = replay(&copy.join("session.jsonl"), &cwd, &out);
    assert!(!run.status.success());
    let err = text(&run.stderr);
    assert!(
        err.contains("0 child sessions") && err.contains("started 1"),
        "{err}"
    );
}

/// `dsh acp --replay` driven as upstream's harness drives its ACP server:
/// each scenario's `input.json` steps, over stdio, one response awaited at
/// a time; what it printed compared with `stdout.expected.jsonl` (after
/// `{{sessionId}}`, and with `agentInfo`, the implementation's name, and
/// `mcpCapabilities` set aside), and the session it persisted compared, turn by turn, with
/// the recording.
mod acp_scenarios {
    use std::io::{BufRead, BufReader, Write};
    use std::path::Path;
    use std::process::{Child, ChildStdin, Command, Stdio};
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use serde_json::{Value, json};

    use super::{recordings, workspace};

    const WAIT: Duration = Duration::from_secs(60);

    /// A running `dsh acp` and the lines it printed.
    struct Server {
        child: Child,
        stdin: Option<ChildStdin>,
        lines: mpsc::Receiver<String>,
        printed: Vec<Value>,
        next_id: u64,
        session: Option<String>,
        /// The prompt sent without waiting for its response.
        open: Option<u64>,
    }

    impl Server {
        fn start(recording: &Path, sessions: &Path) -> Server {
            let mut child = Command::new(env!("CARGO_BIN_EXE_dsh"))
                .env_remove("DSH_BASE_URL")
                .env_remove("DSH_MODEL")
                .args(["acp", "--replay"])
                .arg(recording)
                .arg("--sessions-dir")
                .arg(sessions)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit())
                .spawn()
                .expect("dsh acp starts");
            let stdout = child.stdout.take().unwrap();
            let (tx, lines) = mpsc::channel();
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            });
            Server {
                stdin: child.stdin.take(),
                child,
                lines,
                printed: Vec::new(),
                next_id: 1,
                session: None,
                open: None,
            }
        }

        fn send(&mut self, frame: Value) {
            let stdin = self.stdin.as_mut().unwrap();
            writeln!(stdin, "{frame}").unwrap();
            stdin.flush().unwrap();
        }

        fn request(&mut self, method: &str, params: Value) -> u64 {
            let id = self.next_id;
            self.next_id += 1;
            self.send(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
            id
        }

        /// Reads lines until one is a frame `wanted` takes (within
        /// [`WAIT`], else the test fails saying `what` it waited for);
        /// returns it.
        fn until(&mut self, what: &str, wanted: impl Fn(&Value) -> bool) -> Value {
            let deadline = Instant::now() + WAIT;
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                let line = self
                    .lines
                    .recv_timeout(left)
                    .unwrap_or_else(|_| panic!("no {what}: {:#?}", self.printed));
                let frame: Value = serde_json::from_str(&line)
                    .unwrap_or_else(|e| panic!("stdout carries a non-JSON line `{line}`: {e}"));
                self.printed.push(frame.clone());
                if wanted(&frame) {
                    return frame;
                }
            }
        }

        /// Reads lines until the response to `id`; returns it.
        fn response(&mut self, id: u64) -> Value {
            self.until(&format!("response to request {id}"), |frame| {
                frame["id"] == json!(id) && frame.get("method").is_none()
            })
        }

        fn prompt_params(&self, text: &str) -> Value {
            json!({"sessionId": self.session.clone().unwrap(), "prompt": [{"type": "text", "text": text}]})
        }

        fn step(&mut self, step: &Value, cwd: &Path) {
            match step["op"].as_str().unwrap() {
                "initialize" => {
                    let id = self.request(
                        "initialize",
                        json!({"protocolVersion": 1, "clientCapabilities": {}}),
                    );
                    self.response(id);
                }
                "newSession" => {
                    let id = self.request("session/new", json!({"cwd": cwd, "mcpServers": []}));
                    let r = self.response(id);
                    self.session = Some(r["result"]["sessionId"].as_str().unwrap().to_owned());
                }
                "prompt" => {
                    let params = self.prompt_params(step["text"].as_str().unwrap());
                    let id = self.request("session/prompt", params);
                    self.response(id);
                }
                "promptExpectError" => {
                    let params = self.prompt_params(step["text"].as_str().unwrap());
                    let id = self.request("session/prompt", params);
                    let r = self.response(id);
                    assert!(r.get("error").is_some(), "{r}");
                }
                "promptAndCancel" => {
                    let params = self.prompt_params(step["text"].as_str().unwrap());
                    let id = self.request("session/prompt", params);
                    self.open = Some(id);
                    if let Some(file) = step["waitForFile"]["path"].as_str() {
                        let path = cwd.join(file);
                        let what = format!("{} never appeared", path.display());
                        crate::suite::until_blocking(&what, || path.exists());
                    }
                    let session = self.session.clone().unwrap();
                    self.send(json!({"jsonrpc": "2.0", "method": "session/cancel", "params": {"sessionId": session}}));
                }
                "waitForTurnEnd" => {
                    let id = self.open.take().expect("a prompt is open");
                    self.response(id);
                }
                other => panic!("unknown step `{other}`"),
            }
        }

        /// Reads lines until an `agent_message_chunk` update saying `text`
        /// (unless one was read already).
        fn until_update(&mut self, text: &str) {
            let says = |frame: &Value| {
                let update = &frame["params"]["update"];
                update["sessionUpdate"] == "agent_message_chunk"
                    && update["content"]["text"] == text
            };
            if !self.printed.iter().any(says) {
                self.until(&format!("update saying {text:?}"), says);
            }
        }

        /// Closes stdin and waits for the exit; its status code.
        fn finish(mut self) -> (Option<i32>, Vec<Value>) {
            drop(self.stdin.take());
            let mut status = None;
            crate::suite::until_blocking("dsh acp did not exit after stdin closed", || {
                status = self.child.try_wait().unwrap();
                status.is_some()
            });
            let status = status.unwrap();
            // Whatever it printed after the last response.
            while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(5)) {
                self.printed.push(serde_json::from_str(&line).unwrap());
            }
            (status.code(), self.printed)
        }
    }

    /// A background child's notices and report wake the session's agent,
    /// mostly after its prompt has answered: those turns stream to the
    /// client too, and the session it keeps has the recording's four turns.
    #[test]
    fn turns_a_background_child_starts_stream_to_the_client() {
        let _sweep = crate::suite::sweep();
        let cwd = workspace();
        let sessions = cwd.join("sessions");
        let recording = recordings().join("../recordings/continuable-child/session.jsonl");
        let mut server = Server::start(&recording, &sessions);
        server.step(&json!({"op": "initialize"}), &cwd);
        server.step(&json!({"op": "newSession"}), &cwd);
        server.step(&json!({"op": "prompt", "text": "start"}), &cwd);
        // The turns the child's notice, report and second notice started.
        // The prompt answers when its wait sees the agent idle: mostly
        // after the first turn, so these come after the response (and
        // before this change never came); a wait that missed a moment's
        // idleness spans them.
        for text in ["Sent.", "Noted.", "Done."] {
            server.until_update(text);
        }
        let session = server.session.clone().unwrap();
        let (code, _) = server.finish();
        assert_eq!(code, Some(0));
        let log = sessions.join(&session).join("session.jsonl");
        let (_, events) =
            dsh::services::session::jsonl::parse(&std::fs::read_to_string(log).unwrap()).unwrap();
        let ends: Vec<String> = dsh::services::session::compare::shape(&events)
            .into_iter()
            .map(|t| t.final_text)
            .collect();
        assert_eq!(ends, ["Started.", "Sent.", "Noted.", "Done."]);
    }

    /// `frames` with `agentInfo` (the implementation's own name) and
    /// `mcpCapabilities` set aside: we take a session's MCP servers over
    /// HTTP too, which upstream's recording does not advertise.
    fn comparable(frames: &[Value]) -> Vec<Value> {
        frames
            .iter()
            .cloned()
            .map(|mut f| {
                if let Some(info) = f.pointer_mut("/result/agentInfo") {
                    *info = json!("<agentInfo>");
                }
                if let Some(caps) = f
                    .pointer_mut("/result/agentCapabilities")
                    .and_then(Value::as_object_mut)
                {
                    caps.remove("mcpCapabilities");
                }
                f
            })
            .collect()
    }

    fn scenario(name: &str) {
        let dir = recordings().join(name);
        let cwd = workspace();
        let sessions = cwd.join(".sessions");
        let input: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("input.json")).unwrap())
                .unwrap();
        let mut server = Server::start(&dir.join("session.jsonl"), &sessions);
        for step in input["steps"].as_array().unwrap() {
            server.step(step, &cwd);
        }
        let session = server.session.clone();
        let (code, printed) = server.finish();
        assert_eq!(code, Some(0), "{name}: the exit status");
        let expected: Vec<Value> = std::fs::read_to_string(dir.join("stdout.expected.jsonl"))
            .unwrap()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let l = l.replace("{{sessionId}}", session.as_deref().unwrap_or(""));
                serde_json::from_str(&l).unwrap()
            })
            .collect();
        assert_eq!(
            comparable(&printed),
            comparable(&expected),
            "{name}: stdout"
        );
        // The persisted session, under the ACP session id, has the
        // recording's structure.
        let Some(id) = session else { return };
        let log = sessions.join(&id).join("session.jsonl");
        let (header, replayed) = dsh::services::session::jsonl::parse(
            &std::fs::read_to_string(&log)
                .unwrap_or_else(|e| panic!("{name}: {}: {e}", log.display())),
        )
        .unwrap();
        assert_eq!(header.id, id, "{name}: the header id is the ACP session id");
        let (_, recorded) = dsh::services::session::jsonl::parse(
            &std::fs::read_to_string(dir.join("session.jsonl")).unwrap(),
        )
        .unwrap();
        use dsh::services::session::compare::{compare, shape};
        if let Err(d) = compare(&shape(&recorded), &shape(&replayed)) {
            panic!("{name}: the persisted log diverges: {d}");
        }
    }

    #[test]
    fn the_upstream_acp_scenarios_pass() {
        let _sweep = crate::suite::sweep();
        for name in [
            "handshake",
            "text-turn",
            "multi-turn",
            "tool-call-turn",
            "bash-tool-turn",
            "parallel-tool-calls",
            "fs-read",
            "fs-write",
            "subagent-spawn-in-process",
            "cancel",
        ] {
            scenario(name);
        }
    }
}

/// A large tool result is spilled to a file on replay as it was live: a
/// session recorded by `dsh run` (reading a 60,000-byte file) replays to
/// the same structure, and the replayed result carries the spill's note.
#[test]
fn a_large_result_is_spilled_on_replay_as_it_was_live() {
    let _sweep = crate::suite::sweep();
    let base = fresh_dir("dsh-spill-replay").unwrap();
    let ws = workspace();
    let big: String = (0..1500)
        .map(|i| format!("line {i:05}: {}\n", "a".repeat(28)))
        .collect();
    std::fs::write(ws.join("big.txt"), &big).unwrap();
    let script = base.join("script.json");
    let call = serde_json::json!({"tool_calls": [{"name": "read", "arguments": {"file_path": "big.txt"}}]});
    std::fs::write(
        &script,
        serde_json::json!({"steps": [call, {"text": "read it"}]}).to_string(),
    )
    .unwrap();
    let sessions = base.join("sessions");
    let live = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env("HOME", &base)
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .args(["run", "--approval", "never", "--script"])
        .arg(&script)
        .arg("--cwd")
        .arg(&ws)
        .arg("--sessions-dir")
        .arg(&sessions)
        .arg("read the big file")
        .bounded_output()
        .unwrap();
    assert!(live.status.success(), "{}", text(&live.stderr));
    let recorded = std::fs::read_dir(&sessions)
        .unwrap()
        .flatten()
        .map(|e| e.path().join("session.jsonl"))
        .find(|p| p.exists())
        .unwrap();
    let note = "bytes; the whole of it is in";
    let spilled = |log: &Path| results(log).iter().any(|(_, c)| c.contains(note));
    let sizes = |log: &Path| {
        results(log)
            .iter()
            .map(|(_, c)| c.len())
            .collect::<Vec<_>>()
    };
    assert!(spilled(&recorded), "live: {:?}", sizes(&recorded));
    let out = base.join("replayed.jsonl");
    let replayed = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env("HOME", &base)
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .args([
            "replay",
            recorded.to_str().unwrap(),
            "--cwd",
            ws.to_str().unwrap(),
            "--out",
        ])
        .arg(&out)
        .bounded_output()
        .unwrap();
    assert!(replayed.status.success(), "{}", text(&replayed.stderr));
    assert!(
        text(&replayed.stdout).starts_with("replay agrees with the recording"),
        "{}",
        text(&replayed.stdout)
    );
    assert!(spilled(&out), "replayed: {:?}", sizes(&out));
}

/// A continuable child messaged again, recorded by dsh and replayed: the
/// parent starts a background child; once its first turn settles, messages
/// it; the child reports, then answers; the parent lists it. Live, the
/// child's log holds one closed turn per message and `list_agents` sees it;
/// the two logs, laid out as upstream lays out a nested scenario, replay to
/// the same structure, the child's turns continuing its own script and the
/// parent's `send_message` naming the live child.
mod continuable {
    use std::sync::{Arc, OnceLock};
    use std::time::Duration;

    use dsh::actors::agent::Agent;
    use dsh::services::llm::{
        ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmRequest, Message, Role,
    };
    use dsh::services::session::{EventData, SessionEvent, jsonl};
    use futures::StreamExt as _;
    use serde_json::json;
    use tokio_util::sync::CancellationToken;

    use super::{replay, text, workspace};

    /// The parent's and the child's model. A child's call waits until the
    /// parent is between turns, and then until the log's millisecond clock
    /// has moved past the parent's last event (so the recorded times tell
    /// the parent's turn end from the child's answer): each notice and
    /// report then finds the parent idle, and the recording has one order.
    #[derive(Default)]
    struct Director {
        parent: OnceLock<Agent>,
    }

    fn call(name: &str, args: serde_json::Value) -> Vec<ContentBlock> {
        vec![ContentBlock::ToolCall {
            id: format!("call_{name}"),
            name: name.into(),
            arguments: args.to_string(),
        }]
    }

    fn said(blocks: Vec<ContentBlock>) -> ChunkStream {
        let finish = if blocks
            .iter()
            .any(|b| matches!(b, ContentBlock::ToolCall { .. }))
        {
            FinishReason::ToolCalls
        } else {
            FinishReason::Stop
        };
        let chunks =
            dsh::services::providers::scripted::chunks_for(&blocks, Default::default(), finish);
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }

    /// The name of the tool whose result `messages` ends with.
    fn answered(messages: &[Arc<Message>]) -> Option<String> {
        let last = messages.last()?;
        if !last
            .content
            .iter()
            .any(|b| matches!(b, ContentBlock::ToolResult { .. }))
        {
            return None;
        }
        messages.iter().rev().find_map(|m| {
            m.content.iter().find_map(|b| match b {
                ContentBlock::ToolCall { name, .. } => Some(name.clone()),
                _ => None,
            })
        })
    }

    fn child_answer(request: &LlmRequest) -> Vec<ContentBlock> {
        let last = request
            .messages
            .last()
            .map(|m| m.text())
            .unwrap_or_default();
        if answered(&request.messages).is_some() {
            vec![ContentBlock::text("TWO")]
        } else if last == "second task" {
            call("report", json!({"output": "TWO found"}))
        } else {
            vec![ContentBlock::text("ONE")]
        }
    }

    fn parent_answer(request: &LlmRequest) -> Vec<ContentBlock> {
        let messages = &request.messages;
        match answered(messages).as_deref() {
            Some("subagent") => return vec![ContentBlock::text("Started.")],
            Some("send_message") => return vec![ContentBlock::text("Sent.")],
            Some(_) => return vec![ContentBlock::text("Done.")],
            None => {}
        }
        let last = messages.last().expect("a message");
        let child = || -> String {
            messages
                .iter()
                .find_map(|m| {
                    m.text()
                        .strip_prefix("started subagent ")
                        .map(str::to_owned)
                })
                .or_else(|| {
                    messages.iter().find_map(|m| {
                        m.content.iter().find_map(|b| match b {
                            ContentBlock::ToolResult { content, .. } => {
                                content.iter().find_map(|c| match c {
                                    ContentBlock::Text { text } => {
                                        text.strip_prefix("started subagent ").map(str::to_owned)
                                    }
                                    _ => None,
                                })
                            }
                            _ => None,
                        })
                    })
                })
                .expect("the child's id")
        };
        match (&*last.source.kind, last.text()) {
            ("subagent-report", _) => vec![ContentBlock::text("Noted.")],
            ("subagent-settled", t) if t.ends_with("ONE") => call(
                "send_message",
                json!({"subagent_id": child(), "message": "second task"}),
            ),
            ("subagent-settled", _) => call("list_agents", json!({})),
            _ => call(
                "subagent",
                json!({"description": "counter", "prompt": "first task", "run_in_background": true}),
            ),
        }
    }

    impl LlmAdapter for Director {
        fn name(&self) -> &str {
            "director"
        }

        fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
            let is_child = request
                .messages
                .iter()
                .any(|m| m.role == Role::User && m.text() == "first task");
            if !is_child {
                return said(parent_answer(&request));
            }
            let blocks = child_answer(&request);
            let parent = self.parent.get().cloned().expect("the parent is known");
            Box::pin(
                futures::stream::once(async move {
                    let _ = parent.when_idle(Duration::from_secs(30)).await;
                    let last = parent.session().events().last().map_or(0, |e| e.time);
                    tokio::time::sleep_until(past_ms(last)).await;
                })
                .flat_map(move |()| said(blocks.clone())),
            )
        }
    }

    /// When the epoch clock's millisecond is past `ms` (the log's times
    /// are epoch milliseconds): a wait for the clock to tick, at most 1 ms.
    fn past_ms(ms: u64) -> tokio::time::Instant {
        let at = std::time::UNIX_EPOCH + Duration::from_millis(ms + 1);
        let left = at
            .duration_since(std::time::SystemTime::now())
            .unwrap_or_default();
        tokio::time::Instant::now() + left
    }

    fn turns_ended(events: &[impl AsRef<SessionEvent>]) -> usize {
        events
            .iter()
            .filter(|e| matches!(e.as_ref().data, EventData::TurnEnd { .. }))
            .count()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_continuable_child_messaged_again_is_recorded_and_replays_from_its_own_log() {
        let _sweep = crate::suite::sweep();
        let cwd = workspace();
        let sessions = cwd.join("sessions");
        let director = Arc::new(Director::default());
        let dsh = dsh::Dsh::builder()
            .model(dsh::Model::adapter(director.clone()))
            .workspace(&cwd)
            .sessions_dir(&sessions)
            .start()
            .await
            .unwrap();
        let handle = dsh.agent().spawn().await.unwrap();
        let parent = handle.agent().clone();
        director.parent.set(parent.clone()).ok().unwrap();
        handle.run("start").await.unwrap();
        // Until the parent has taken the child's two notices and report:
        // four turns ended.
        let (ended, mut ends) = tokio::sync::watch::channel(());
        let watcher = parent
            .session()
            .observe(Arc::new(move |e: &Arc<SessionEvent>| {
                if matches!(e.data, EventData::TurnEnd { .. }) {
                    ended.send_replace(());
                }
            }));
        // Observed first, then counted (the count reads the log itself).
        let four = ends.wait_for(|()| turns_ended(&parent.session().events()) >= 4);
        tokio::time::timeout(Duration::from_secs(60), four)
            .await
            .expect("the parent ended four turns within 60 s")
            .unwrap();
        parent.session().unobserve(watcher);
        let child_id = parent
            .session()
            .events()
            .iter()
            .find_map(|e| match &e.data {
                EventData::UserMessage(m) if m.source.kind == "subagent-settled" => {
                    m.source.field("senderSessionId").map(str::to_owned)
                }
                _ => None,
            })
            .expect("a settled notice names its child");
        let child = parent
            .reach()
            .get::<dsh::actors::agent::Agents>(dsh::actors::agent::Agents::SERVICE)
            .unwrap()
            .get(&child_id)
            .unwrap();
        child.when_idle(Duration::from_secs(30)).await.unwrap();
        parent.when_idle(Duration::from_secs(30)).await.unwrap();
        let parent_id = parent.id().to_owned();
        drop(handle);
        dsh.shutdown().await.unwrap();

        // Live: one closed turn per message in the child's own log; the
        // parent saw its report and listed it.
        let store = dsh::services::persistence::JsonlStore::new(&sessions);
        let read = |id: &str| std::fs::read_to_string(store.path(id).unwrap()).unwrap();
        let (_, child_events) = jsonl::parse(&read(&child_id)).unwrap();
        let child_shape = dsh::services::session::compare::shape(&child_events);
        let ends: Vec<(&str, &str)> = child_shape
            .iter()
            .map(|t| (t.final_text.as_str(), t.end.as_str()))
            .collect();
        assert_eq!(ends, [("ONE", "completed"), ("TWO", "completed")]);
        let (_, parent_events) = jsonl::parse(&read(&parent_id)).unwrap();
        let parent_shape = dsh::services::session::compare::shape(&parent_events);
        let finals: Vec<&str> = parent_shape.iter().map(|t| t.final_text.as_str()).collect();
        assert_eq!(finals, ["Started.", "Sent.", "Noted.", "Done."]);
        let listed = parent_events.iter().rev().find_map(|e| match &e.data {
            EventData::ToolResult { message, .. } => Some(format!("{:?}", message.content)),
            _ => None,
        });
        assert!(
            listed
                .as_deref()
                .is_some_and(|l| l.contains(&child_id) && l.contains("counter")),
            "{listed:?}"
        );

        // Replayed: the parent as `session.jsonl`, the child beside it.
        let scenario = cwd.join("continuable-child");
        std::fs::create_dir_all(&scenario).unwrap();
        std::fs::write(scenario.join("session.jsonl"), read(&parent_id)).unwrap();
        std::fs::write(scenario.join("session.1.jsonl"), read(&child_id)).unwrap();
        let artefacts = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join("artefacts")
            .join("continuable-child");
        std::fs::create_dir_all(&artefacts).unwrap();
        for f in ["session.jsonl", "session.1.jsonl"] {
            std::fs::copy(scenario.join(f), artefacts.join(f)).unwrap();
        }
        let out = cwd.join("replayed.jsonl");
        let run = tokio::task::spawn_blocking({
            let (scenario, cwd, out) = (scenario.clone(), cwd.clone(), out.clone());
            move || replay(&scenario.join("session.jsonl"), &cwd, &out)
        })
        .await
        .unwrap();
        assert!(run.status.success(), "{}", text(&run.stderr));
        assert!(
            text(&run.stdout).starts_with("replay agrees with the recording: 4 turns"),
            "{}",
            text(&run.stdout)
        );
    }
}
