//! `dsh acp` driven by real ACP clients: the protocol project's own SDK
//! (the `agent-client-protocol` crate's client side) and raw frames for
//! what an SDK hides (request ids, refusals).

use super::Bounded;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::place;
use agent_client_protocol::v1::ConnectionTo;
use agent_client_protocol::v1::schema::{
    ContentBlock, InitializeRequest, NewSessionRequest, PermissionOptionKind, PromptRequest,
    RequestPermissionOutcome, RequestPermissionRequest, RequestPermissionResponse,
    SelectedPermissionOutcome, SessionNotification, SessionUpdate, StopReason, TextContent,
};
use agent_client_protocol::{Agent, ByteStreams, Client};
use serde_json::{Value, json};
use tokio_util::compat::{TokioAsyncReadCompatExt, TokioAsyncWriteCompatExt};

const WAIT: Duration = Duration::from_secs(60);

/// A scripted model: each call in turn, then `done`.
fn script(p: &super::Place, calls: &[Value]) -> PathBuf {
    let mut steps: Vec<Value> = calls.iter().map(|c| json!({"tool_calls": [c]})).collect();
    steps.push(json!({"text": "done"}));
    let file = p.base.join("script.json");
    std::fs::write(&file, json!({"steps": steps}).to_string()).unwrap();
    file
}

fn dsh_acp(p: &super::Place, script: &Path) -> tokio::process::Command {
    let mut c = tokio::process::Command::new(env!("CARGO_BIN_EXE_dsh"));
    c.args(["acp", "--approval", "ask", "--script"])
        .arg(script)
        .arg("--sessions-dir")
        .arg(&p.sessions)
        .env_remove("DSH_APPROVAL")
        .env_remove("DSH_PERMISSION_MODE")
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    c
}

/// The SDK's client drives a turn whose two escalations it is asked about:
/// the one it allows runs, the one it rejects does not, the committed text
/// arrives as an update, the turn ends `end_turn`; closing its end of the
/// pipe ends the server with status 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_protocol_sdk_client_drives_a_session_and_answers_its_permission_requests() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let (approved, refused) = (p.outside.join("approved"), p.outside.join("refused"));
    let script = script(
        &p,
        &[
            super::escalated_touch(&approved),
            super::escalated_touch(&refused),
        ],
    );
    let mut child = dsh_acp(&p, &script).spawn().unwrap();
    let stdin = child.stdin.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let asked: Arc<Mutex<Vec<String>>> = Arc::default();
    let said: Arc<Mutex<Vec<String>>> = Arc::default();
    let (asks, says) = (asked.clone(), said.clone());
    let ws = p.ws.clone();
    let stop = Client
        .v1()
        .on_receive_request(
            async move |request: RequestPermissionRequest, responder, _cx| {
                let n = {
                    let mut asks = asks.lock().unwrap();
                    asks.push(serde_json::to_string(&request.tool_call).unwrap());
                    asks.len()
                };
                // The first ask is allowed once, the second rejected.
                let kind = if n == 1 {
                    PermissionOptionKind::AllowOnce
                } else {
                    PermissionOptionKind::RejectOnce
                };
                let option = request
                    .options
                    .iter()
                    .find(|o| o.kind == kind)
                    .expect("both choices are offered")
                    .option_id
                    .clone();
                responder.respond(RequestPermissionResponse::new(
                    RequestPermissionOutcome::Selected(SelectedPermissionOutcome::new(option)),
                ))
            },
            agent_client_protocol::on_receive_request!(),
        )
        .on_receive_notification(
            async move |n: SessionNotification, _cx| {
                if let SessionUpdate::AgentMessageChunk(chunk) = n.update
                    && let ContentBlock::Text(t) = chunk.content
                {
                    says.lock().unwrap().push(t.text);
                }
                Ok(())
            },
            agent_client_protocol::on_receive_notification!(),
        )
        .connect_with(
            ByteStreams::new(stdin.compat_write(), stdout.compat()),
            async move |cx: ConnectionTo<Agent>| {
                let init = cx
                    .send_request(InitializeRequest::new(
                        agent_client_protocol::schema::ProtocolVersion::V1,
                    ))
                    .block_task()
                    .await?;
                assert_eq!(init.agent_info.unwrap().name, "dsh");
                let session = cx
                    .send_request(NewSessionRequest::new(ws))
                    .block_task()
                    .await?;
                let done = cx
                    .send_request(PromptRequest::new(
                        session.session_id.clone(),
                        vec![ContentBlock::Text(TextContent::new("touch both"))],
                    ))
                    .block_task()
                    .await?;
                Ok(done.stop_reason)
            },
        );
    let stop = tokio::time::timeout(WAIT, stop)
        .await
        .expect("the turn ends")
        .expect("the client saw no protocol error");
    assert_eq!(stop, StopReason::EndTurn);
    assert!(approved.exists(), "the allowed call ran");
    assert!(!refused.exists(), "the rejected call did not");
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 2, "{asked:?}");
    assert!(
        asked[0].contains("bash") && asked[0].contains("approved"),
        "{}",
        asked[0]
    );
    assert_eq!(said.lock().unwrap().as_slice(), ["done"]);
    // The client is gone (its pipe closed): the server ends cleanly.
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .expect("the server exits")
        .unwrap();
    assert_eq!(status.code(), Some(0));
}

/// Raw frames: a client that never answers a permission request is denied
/// (our request ids start at 0), and bad requests get JSON-RPC errors that
/// say what was wrong; a session's log is filed under its ACP id.
#[test]
fn raw_frames_bad_requests_and_an_unanswered_ask() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let script = script(&p, &[super::escalated_touch(&p.outside.join("never"))]);
    let script = script.display().to_string();
    let mut raw = Raw::spawn(&p, &["--approval", "ask", "--script", &script], &[]);
    let mut stdin = raw.stdin.take().unwrap();
    let lines = &raw.lines;
    let mut send = move |v: Value| {
        // A string is sent as its text, so a broken frame can be sent.
        match v {
            Value::String(raw) => writeln!(stdin, "{raw}").unwrap(),
            v => writeln!(stdin, "{v}").unwrap(),
        }
        stdin.flush().unwrap();
    };
    let next = || lines.recv_timeout(WAIT).expect("a frame");
    send(
        json!({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"protocolVersion": 1}}),
    );
    assert_eq!(next()["result"]["protocolVersion"], 1);
    // A relative cwd, an unknown session, an unknown method, broken JSON.
    send(
        json!({"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": "rel", "mcpServers": []}}),
    );
    let e = next();
    assert_eq!(e["error"]["code"], -32602, "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("absolute"),
        "{e}"
    );
    send(
        json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": {"sessionId": "nope", "prompt": [{"type": "text", "text": "x"}]}}),
    );
    assert!(
        next()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no session `nope`")
    );
    send(json!({"jsonrpc": "2.0", "id": 4, "method": "session/fly", "params": {}}));
    assert_eq!(next()["error"]["code"], -32601);
    send(Value::String("{not json".into()));
    assert_eq!(next()["error"]["code"], -32700);
    send(Value::String("[1, 2]".into()));
    assert_eq!(next()["error"]["code"], -32600);
    // A real session; its one escalation is asked about with id 0, and
    // never answered.
    send(
        json!({"jsonrpc": "2.0", "id": 5, "method": "session/new", "params": {"cwd": p.ws, "mcpServers": []}}),
    );
    let sid = next()["result"]["sessionId"].as_str().unwrap().to_owned();
    send(
        json!({"jsonrpc": "2.0", "id": 6, "method": "session/prompt", "params": {"sessionId": sid, "prompt": [{"type": "text", "text": "go"}]}}),
    );
    let ask = next();
    assert_eq!(ask["method"], "session/request_permission", "{ask}");
    assert_eq!(ask["id"], 0);
    // A second prompt while the first runs is refused.
    send(
        json!({"jsonrpc": "2.0", "id": 7, "method": "session/prompt", "params": {"sessionId": sid, "prompt": [{"type": "text", "text": "again"}]}}),
    );
    let busy = next();
    assert_eq!(busy["id"], 7);
    assert!(
        busy["error"]["message"]
            .as_str()
            .unwrap()
            .contains("already answering"),
        "{busy}"
    );
    // The client answers with an error: no answer, so the call is denied
    // and the turn goes on to its end.
    send(json!({"jsonrpc": "2.0", "id": 0, "error": {"code": -32000, "message": "no UI"}}));
    let mut frames = Vec::new();
    let end = loop {
        let f = next();
        if f["id"] == 6 {
            break f;
        }
        frames.push(f);
    };
    assert_eq!(end["result"]["stopReason"], "end_turn", "{end}");
    assert!(!p.outside.join("never").exists());
    drop(send); // closes stdin
    assert_eq!(raw.exited().code(), Some(0));
    let log = std::fs::read_to_string(p.sessions.join(&sid).join("session.jsonl")).unwrap();
    assert!(log.contains("\"outcome\":\"unavailable\""), "{log}");
}

/// Bytes the client gets wrong: a line that is not UTF-8 is answered
/// `-32700` and a 200 MB line `-32600`, read past without being held (the
/// process's peak memory stays far below the line), and the connection
/// goes on to answer `initialize`.
#[test]
fn a_non_utf8_frame_and_a_huge_one_are_refused_and_the_connection_goes_on() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let mut raw = Raw::start(&p);
    let mut stdin = raw.stdin.take().unwrap();
    let next = |raw: &Raw| raw.lines.recv_timeout(WAIT).expect("a frame");
    stdin.write_all(b"\xff\n").unwrap();
    stdin.flush().unwrap();
    let e = next(&raw);
    assert_eq!(e["error"]["code"], -32700, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not UTF-8"),
        "{e}"
    );
    // The process's peak resident memory (VmHWM), in KiB.
    let pid = raw.child.id();
    let peak_kib = || -> u64 {
        std::fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap()
    };
    // `initialize` is answered (the connection is up and going on).
    let initialized = |stdin: &mut std::process::ChildStdin, id: u64| {
        writeln!(
            stdin,
            "{}",
            json!({"jsonrpc": "2.0", "id": id, "method": "initialize", "params": {"protocolVersion": 1}})
        )
        .unwrap();
        stdin.flush().unwrap();
        assert_eq!(next(&raw)["result"]["protocolVersion"], 1);
    };
    // Measured from a process that is up and answering (on a loaded
    // machine its start-up could otherwise still be growing it).
    initialized(&mut stdin, 0);
    let before = peak_kib();
    let huge = vec![b'x'; 1 << 20];
    for _ in 0..200 {
        stdin.write_all(&huge).unwrap();
    }
    stdin.write_all(b"\n").unwrap();
    stdin.flush().unwrap();
    let e = next(&raw);
    assert_eq!(e["error"]["code"], -32600, "{e}");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("209715200 bytes"),
        "{e}"
    );
    // The 16 MiB cap, reserved once (about 18 MiB measured here), and room
    // for what else the process does meanwhile: well under the line.
    let grew = peak_kib().saturating_sub(before);
    eprintln!("acp: the peak grew {grew} KiB for a 200 MB line");
    assert!(
        grew < 48 * 1024,
        "the peak grew {grew} KiB for a 200 MB line"
    );
    initialized(&mut stdin, 1);
    drop(stdin);
    assert_eq!(raw.exited().code(), Some(0));
}

/// Frames in, frames out, one `dsh acp --demo-model` per call of `talk`.
struct Raw {
    child: std::process::Child,
    stdin: Option<std::process::ChildStdin>,
    lines: std::sync::mpsc::Receiver<Value>,
}

impl Raw {
    /// `dsh acp --demo-model` keeping its sessions in `p`.
    fn start(p: &super::Place) -> Raw {
        Raw::spawn(p, &["--demo-model"], &[])
    }

    /// `dsh acp ARGS` keeping its sessions in `p`, with `env` set and no
    /// model or policy variables inherited.
    fn spawn(p: &super::Place, args: &[&str], env: &[(&str, &str)]) -> Raw {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_dsh"));
        command
            .arg("acp")
            .args(args)
            .arg("--sessions-dir")
            .arg(&p.sessions)
            .env_remove("DSH_BASE_URL")
            .env_remove("DSH_MODEL")
            .env_remove("DSH_APPROVAL")
            .env_remove("DSH_PERMISSION_MODE")
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().unwrap();
        let (tx, lines) = std::sync::mpsc::channel::<Value>();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let frame = serde_json::from_str(&line).expect("stdout carries only JSON frames");
                if tx.send(frame).is_err() {
                    break;
                }
            }
        });
        Raw {
            stdin: child.stdin.take(),
            child,
            lines,
        }
    }

    /// Sends a request; the frames up to and including its response.
    fn call(&mut self, id: u64, method: &str, params: Value) -> Vec<Value> {
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(
            stdin,
            "{}",
            json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params})
        )
        .unwrap();
        stdin.flush().unwrap();
        let mut frames = Vec::new();
        loop {
            let f = self.lines.recv_timeout(WAIT).expect("a frame");
            let done = f["id"] == id;
            frames.push(f);
            if done {
                return frames;
            }
        }
    }

    /// Closes stdin and waits for the server to exit with status 0.
    fn close(mut self) {
        drop(self.stdin.take());
        assert_eq!(self.exited().code(), Some(0));
    }

    /// Waits (bounded) for the server to exit; how it did.
    fn exited(&mut self) -> std::process::ExitStatus {
        let mut status = None;
        super::until_blocking("dsh acp outlived its stdin", || {
            status = self.child.try_wait().unwrap();
            status.is_some()
        });
        status.unwrap()
    }
}

/// The texts of the `session/update` frames, with their kinds.
fn updates(frames: &[Value]) -> Vec<(String, String)> {
    frames
        .iter()
        .filter(|f| f["method"] == "session/update")
        .map(|f| {
            let u = &f["params"]["update"];
            (
                u["sessionUpdate"].as_str().unwrap().to_owned(),
                u["content"]["text"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// A session kept by one connection is continued by the next: `loadSession`
/// is advertised, loading sends back the conversation, a new prompt
/// continues it in the same log; loading what is not stored says so.
#[test]
fn a_stored_session_is_loaded_and_continued_by_a_new_connection() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let mut first = Raw::start(&p);
    let init = first.call(1, "initialize", json!({"protocolVersion": 1}));
    assert_eq!(init[0]["result"]["agentCapabilities"]["loadSession"], true);
    // The demo model takes no images, so none are advertised or accepted.
    assert_eq!(
        init[0]["result"]["agentCapabilities"]["promptCapabilities"]["image"],
        false
    );
    let sid = first.call(2, "session/new", json!({"cwd": p.ws, "mcpServers": []}))[0]["result"]
        ["sessionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let refused = first.call(
        9,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "image", "mimeType": "image/png", "data": "AAAA"}]}),
    );
    assert!(
        refused[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("takes no images"),
        "{refused:?}"
    );
    let said = first.call(
        3,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "first words"}]}),
    );
    assert_eq!(
        updates(&said),
        [(
            "agent_message_chunk".to_owned(),
            "Done: first words".to_owned()
        )]
    );
    first.close();
    let mut second = Raw::start(&p);
    second.call(1, "initialize", json!({"protocolVersion": 1}));
    let missing = second.call(
        2,
        "session/load",
        json!({"sessionId": "not-stored", "cwd": p.ws, "mcpServers": []}),
    );
    assert_eq!(missing[0]["error"]["code"], -32602, "{missing:?}");
    assert!(
        missing[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not-stored")
    );
    let loaded = second.call(
        3,
        "session/load",
        json!({"sessionId": sid, "cwd": p.ws, "mcpServers": []}),
    );
    // No named agents here: no modes to offer.
    assert_eq!(loaded.last().unwrap()["result"], json!({}));
    assert_eq!(
        updates(&loaded),
        [
            ("user_message_chunk".to_owned(), "first words".to_owned()),
            (
                "agent_message_chunk".to_owned(),
                "Done: first words".to_owned()
            ),
        ]
    );
    let again = second.call(
        4,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "more words"}]}),
    );
    assert_eq!(again.last().unwrap()["result"]["stopReason"], "end_turn");
    second.close();
    let log = std::fs::read_to_string(p.sessions.join(&sid).join("session.jsonl")).unwrap();
    let turns = log.matches("\"type\":\"turn/end\"").count();
    assert_eq!(turns, 2, "{log}");
}

/// A model that takes images: `initialize` says so, an inline PNG is kept
/// in the attachment store and reaches the model as an `image_url` part
/// beside the text; bytes that are not what the block says are refused.
#[test]
fn an_image_prompt_reaches_a_model_that_takes_images() {
    let _sweep = crate::suite::sweep();
    use base64::Engine as _;
    let p = place("dsh-acp");
    let (url, server) = super::run::deepseek_mock(
        vec![vec![
            r#"{"choices":[{"delta":{"content":"a small square"}}]}"#,
            r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
        ]],
        1,
    );
    let home = p.base.display().to_string();
    let mut raw = Raw::spawn(
        &p,
        &[
            "--model",
            "deepseek-v4-flash-vision-exp",
            "--approval",
            "never",
        ],
        &[
            ("DEEPSEEK_API_KEY", "sk-test"),
            ("DEEPSEEK_BASE_URL", url.as_str()),
            ("HOME", home.as_str()),
        ],
    );
    let init = raw.call(1, "initialize", json!({"protocolVersion": 1}));
    assert_eq!(
        init[0]["result"]["agentCapabilities"]["promptCapabilities"]["image"],
        true
    );
    let sid = raw.call(2, "session/new", json!({"cwd": p.ws, "mcpServers": []}))[0]["result"]
        ["sessionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let mut png = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
    png.extend_from_slice(&[0, 0, 0, 8, 0, 0, 0, 8, 8, 6, 0, 0, 0, 0, 0, 0, 0]);
    let data = base64::engine::general_purpose::STANDARD.encode(&png);
    let wrong = raw.call(
        3,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "image", "mimeType": "image/jpeg", "data": data}]}),
    );
    assert!(
        wrong[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not image/jpeg"),
        "{wrong:?}"
    );
    let said = raw.call(
        4,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [
            {"type": "text", "text": "what is this?"},
            {"type": "image", "mimeType": "image/png", "data": data},
        ]}),
    );
    assert_eq!(
        said.last().unwrap()["result"]["stopReason"],
        "end_turn",
        "{said:?}"
    );
    assert_eq!(
        updates(&said),
        [(
            "agent_message_chunk".to_owned(),
            "a small square".to_owned()
        )]
    );
    raw.close();
    let requests = server.join().unwrap();
    let asked = requests
        .iter()
        .find(|r| !r.to_lowercase().contains("x-dsh-purpose: session-title"))
        .expect("the conversation request");
    let body = super::run::body_of(asked);
    let sent = body["messages"].to_string();
    assert!(sent.contains("what is this?"), "{sent}");
    assert!(
        sent.contains(&format!("data:image/png;base64,{data}")),
        "{sent}"
    );
    // The image was kept by its content address.
    assert!(p.base.join(".dsh/attachments/v1").is_dir());
}

/// The client goes away mid-turn (stdin closes while a command runs): the
/// prompt is answered `cancelled`, the command is killed, the turn is
/// logged as aborted, and the server exits 0.
#[test]
fn stdin_closing_mid_turn_cancels_it_and_the_server_exits_cleanly() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let token = "77.9753";
    let script = script(
        &p,
        &[
            json!({"name": "bash", "arguments": {"command": format!("sleep {token}"), "description": "wait"}}),
        ],
    );
    let script = script.display().to_string();
    let mut raw = Raw::spawn(&p, &["--approval", "never", "--script", &script], &[]);
    raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let sid = raw.call(2, "session/new", json!({"cwd": p.ws, "mcpServers": []}))[0]["result"]
        ["sessionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let stdin = raw.stdin.as_mut().unwrap();
    writeln!(
        stdin,
        "{}",
        json!({"jsonrpc": "2.0", "id": 3, "method": "session/prompt", "params": {"sessionId": sid, "prompt": [{"type": "text", "text": "wait"}]}})
    )
    .unwrap();
    stdin.flush().unwrap();
    super::until_blocking("the command never started", || super::running(token));
    drop(raw.stdin.take());
    let answer = raw
        .lines
        .recv_timeout(WAIT)
        .expect("the prompt is answered");
    assert_eq!(answer["id"], 3, "{answer}");
    assert_eq!(answer["result"]["stopReason"], "cancelled", "{answer}");
    assert_eq!(raw.exited().code(), Some(0));
    super::until_blocking("the command outlived the server", || !super::running(token));
    // Reaped before the server exited: no zombie is left to a PID 1.
    assert_eq!(super::zombie_children(), Vec::<String>::new());
    let log = std::fs::read_to_string(p.sessions.join(&sid).join("session.jsonl")).unwrap();
    assert!(log.contains("\"kind\":\"aborted\""), "{log}");
}

/// With `--progress` an editor sees the turn as it goes: each tool call and
/// its result, the task list as a plan, then the answer.
#[test]
fn with_progress_tool_calls_results_and_the_plan_are_sent() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let script = script(
        &p,
        &[
            json!({"name": "todo_write", "arguments": {"todos": [
                {"content": "look around", "status": "in_progress"},
                {"content": "report", "status": "pending"},
            ]}}),
            json!({"name": "bash", "arguments": {"command": "echo seen-it", "description": "look"}}),
        ],
    );
    let script = script.display().to_string();
    let mut raw = Raw::spawn(
        &p,
        &["--progress", "--approval", "never", "--script", &script],
        &[],
    );
    raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let sid = raw.call(2, "session/new", json!({"cwd": p.ws, "mcpServers": []}))[0]["result"]
        ["sessionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let frames = raw.call(
        3,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "go"}]}),
    );
    raw.close();
    let kinds: Vec<&str> = frames
        .iter()
        .filter_map(|f| f["params"]["update"]["sessionUpdate"].as_str())
        .collect();
    assert_eq!(
        kinds,
        [
            "tool_call",
            "plan",
            "tool_call_update",
            "tool_call",
            "tool_call_update",
            "agent_message_chunk"
        ],
        "{frames:#?}"
    );
    let u = |i: usize| frames[i]["params"]["update"].clone();
    assert_eq!(u(0)["title"], "todo_write");
    assert_eq!(
        u(1)["entries"][0],
        json!({"content": "look around", "priority": "medium", "status": "in_progress"})
    );
    assert_eq!(u(3)["kind"], "execute");
    assert_eq!(u(3)["rawInput"]["command"], "echo seen-it");
    assert_eq!(u(4)["toolCallId"], u(3)["toolCallId"]);
    assert_eq!(u(4)["status"], "completed");
    assert!(
        u(4)["content"][0]["content"]["text"]
            .as_str()
            .unwrap()
            .contains("seen-it")
    );
    assert_eq!(frames.last().unwrap()["result"]["stopReason"], "end_turn");
}

/// A runtime whose agents may delegate to `dsh acp CHILD_ARGS` children
/// (provider `acp`, asking their approvals of us), and
/// a parent agent in `p.ws`; every ask the parent's seam gets, answered
/// allowed once.
async fn delegating(
    p: &super::Place,
    child_args: &[String],
) -> (
    dsh::kernel::Runtime,
    dsh::actors::agent::Agent,
    Arc<dsh::actors::subagent::Subagents>,
    Arc<Mutex<Vec<String>>>,
) {
    let mut args: Vec<String> = vec!["acp".into()];
    args.extend(child_args.iter().cloned());
    args.extend(["--sessions-dir".into(), p.sessions.display().to_string()]);
    delegating_to(p, Path::new(env!("CARGO_BIN_EXE_dsh")), args).await
}

/// [`delegating`] to the ACP agent `command args…`.
async fn delegating_to(
    p: &super::Place,
    command: &Path,
    args: Vec<String>,
) -> (
    dsh::kernel::Runtime,
    dsh::actors::agent::Agent,
    Arc<dsh::actors::subagent::Subagents>,
    Arc<Mutex<Vec<String>>>,
) {
    use dsh::actors::agent::{Agent, AgentSpec, Agents};
    use dsh::actors::subagent::Subagents;
    use dsh::actors::subagent::acp::AcpProvider;
    use dsh::services::approval::{Approval, ApprovalAsk, ApprovalOutcome, ApprovalPolicy};
    use dsh::services::llm::LlmRuntime;
    use dsh::services::tools::ToolRegistry;
    let rt = dsh::kernel::Runtime::start(dsh::kernel::RuntimeSettings::default())
        .await
        .unwrap();
    let root = rt.root();
    let llm = Arc::new(LlmRuntime::new());
    root.provide(LlmRuntime::SERVICE, llm.clone()).unwrap();
    root.provide(ToolRegistry::SERVICE, Arc::new(ToolRegistry::new()))
        .unwrap();
    root.provide(
        Approval::SERVICE,
        Arc::new(Approval::new(ApprovalPolicy::Ask)),
    )
    .unwrap();
    let asked: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = asked.clone();
    root.on_waterfall(move |ask: ApprovalAsk, _next| {
        seen.lock().unwrap().push(ask.request.arguments.to_string());
        async { ApprovalOutcome::AllowedOnce }
    })
    .unwrap();
    let agents = Agents::start(&root, Default::default()).await.unwrap();
    root.provide(Agents::SERVICE, agents).unwrap();
    let subagents = Arc::new(Subagents::with_builtin());
    root.provide(Subagents::SERVICE, subagents.clone()).unwrap();
    subagents
        .register(
            &root,
            Arc::new(AcpProvider::new("acp", command, args, vec![])),
        )
        .unwrap();
    // Workspace-write: the child gets at most that, so its escalation asks.
    let spec = AgentSpec::new("unused", "unused", p.ws.clone());
    let parent = Agent::create(&root, spec).await.unwrap();
    (rt, parent, subagents, asked)
}

/// A `dsh acp` child does a delegated task: its approval ask reaches the
/// parent's approval seam (allowed, so its command runs), its committed
/// answer is the run's output, and disposing the run ends the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acp_child_completes_a_delegated_task_and_asks_the_parent() {
    let _sweep = crate::suite::sweep();
    use dsh::actors::subagent::{StartRequest, StopReason};
    let p = place("dsh-acp");
    let made = p.outside.join("made-by-child");
    let child_script = script(&p, &[super::escalated_touch(&made)]);
    let child_args = [
        "--approval",
        "ask",
        "--script",
        &child_script.display().to_string(),
    ]
    .map(String::from);
    let (rt, parent, subagents, asked) = delegating(&p, &child_args).await;
    let run = subagents
        .start(
            "acp",
            StartRequest::new(
                &parent,
                "make the file",
                tokio_util::sync::CancellationToken::new(),
            ),
        )
        .await
        .expect("the child starts");
    let result = tokio::time::timeout(WAIT, run.result()).await.unwrap();
    assert_eq!(result.stop_reason, StopReason::Completed, "{result:?}");
    assert_eq!(result.output, "done");
    assert!(made.exists(), "the allowed command ran in the child");
    let asked = asked.lock().unwrap().clone();
    assert_eq!(asked.len(), 1, "{asked:?}");
    assert!(asked[0].contains("made-by-child"), "{asked:?}");
    run.dispose().await;
    let script = child_script.display().to_string();
    super::until("the child process outlived its run", || {
        !super::running(&script)
    })
    .await;
    rt.shutdown().await;
}

/// An ACP child run (cancelled by `cancel`) replaying the recorded
/// `cancel` scenario, once its model stream is held open; the recording's
/// path (which the child's command line names).
async fn held_child(
    p: &super::Place,
    cancel: tokio_util::sync::CancellationToken,
) -> (
    dsh::kernel::Runtime,
    dsh::actors::subagent::SubagentRun,
    String,
) {
    let recording = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/dsh-sessions/cancel/session.jsonl")
        .display()
        .to_string();
    let child_args = ["--replay".to_owned(), recording.clone()];
    let (rt, parent, subagents, _) = delegating(p, &child_args).await;
    let run = subagents
        .start(
            "acp",
            dsh::actors::subagent::StartRequest::new(&parent, "start", cancel),
        )
        .await
        .expect("the child starts");
    // The held stream is ready: the replay says so in the shared cwd.
    let ready = p.ws.join(".dsh-snapshot-stream-ready");
    super::until("the child's turn never started", || ready.exists()).await;
    (rt, run, recording)
}

/// The child process killed mid-turn (its model stream held open: the
/// recorded `cancel` scenario replayed): the run fails instead of waiting,
/// and the child is reaped (no zombie left).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acp_child_killed_mid_turn_fails_the_run_and_leaves_nothing() {
    let _sweep = crate::suite::sweep();
    use dsh::actors::subagent::StopReason;
    let p = place("dsh-acp");
    let cancel = tokio_util::sync::CancellationToken::new();
    let (rt, run, recording) = held_child(&p, cancel).await;
    let pid = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .find_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmd)
                .contains(&recording)
                .then_some(pid)
        })
        .expect("the child process");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let result = tokio::time::timeout(WAIT, run.result())
        .await
        .expect("the run settles instead of waiting");
    assert_eq!(result.stop_reason, StopReason::Error, "{result:?}");
    assert!(
        result
            .diagnostic
            .as_deref()
            .unwrap_or("")
            .contains("SUBAGENT_EXITED"),
        "{result:?}"
    );
    run.dispose().await;
    // Reaped: no /proc entry, not even a zombie's.
    let entry = PathBuf::from(format!("/proc/{pid}"));
    super::until("the child was not reaped", || !entry.exists()).await;
    rt.shutdown().await;
}

/// Configured in `agent-services`, an ACP subagent is a tool of the parent
/// (`subagent_acp`): `dsh run` delegates to a `dsh acp` child and reads its
/// answer as the tool's result.
#[test]
fn a_configured_acp_subagent_is_a_tool_the_parent_calls() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let child = p.base.join("child.json");
    std::fs::write(&child, json!({"steps": [{"text": "CHILD_OK"}]}).to_string()).unwrap();
    let parent = p.base.join("parent.json");
    std::fs::write(
        &parent,
        json!({"steps": [
            {"tool_calls": [{"name": "subagent_acp", "arguments": {"description": "delegate", "prompt": "say it"}}]},
            {"text": "PARENT_DONE"},
        ]})
        .to_string(),
    )
    .unwrap();
    let config = p.base.join("cordis.yml");
    let bin = env!("CARGO_BIN_EXE_dsh");
    std::fs::write(
        &config,
        format!(
            "plugins:\n  - id: services\n    name: agent-services\n    config:\n      acp_subagents:\n        - command: {bin}\n          args: [acp, --script, {}, --approval, never, --sessions-dir, {}]\n  - id: model\n    name: scripted\n    config: {{ provider: scripted, script: {} }}\n",
            child.display(),
            p.sessions.display(),
            parent.display()
        ),
    )
    .unwrap();
    let out = std::process::Command::new(bin)
        .args(["run", "--config"])
        .arg(&config)
        .args(["--approval", "never", "--json", "--cwd"])
        .arg(&p.ws)
        .arg("--sessions-dir")
        .arg(&p.sessions)
        .arg("go")
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .bounded_output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("PARENT_DONE"), "{stdout}");
    let result = stdout
        .lines()
        .find(|l| l.contains("\"type\":\"tool/result\""))
        .expect("the tool's result");
    assert!(result.contains("CHILD_OK"), "{result}");
}

/// A third-party ACP agent as the child: the symposium-acp project's Eliza
/// (`elizacp`, from crates.io) answers a delegated prompt through the acp
/// provider, and its process is gone with the run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_party_acp_agent_answers_as_a_subagent() {
    let _sweep = crate::suite::sweep();
    use dsh::actors::subagent::{StartRequest, StopReason};
    let eliza = super::peers::peers().join("cargo/bin/elizacp");
    let p = place("dsh-acp");
    let args = ["--deterministic", "acp"].map(String::from).to_vec();
    let (rt, parent, subagents, _) = delegating_to(&p, &eliza, args).await;
    let run = subagents
        .start(
            "acp",
            StartRequest::new(
                &parent,
                "I feel sad today",
                tokio_util::sync::CancellationToken::new(),
            ),
        )
        .await
        .expect("eliza starts");
    let result = tokio::time::timeout(WAIT, run.result()).await.unwrap();
    assert_eq!(result.stop_reason, StopReason::Completed, "{result:?}");
    assert!(!result.output.trim().is_empty(), "{result:?}");
    run.dispose().await;
    super::until("eliza outlived its run", || !super::running("elizacp")).await;
    rt.shutdown().await;
}

/// One connection, two sessions in two workspaces: each prompt's update
/// names its own session, and each session has its own log.
#[test]
fn one_connection_holds_several_sessions() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let other = p.base.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let mut raw = Raw::start(&p);
    raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let new = |raw: &mut Raw, id: u64, cwd: &Path| {
        raw.call(id, "session/new", json!({"cwd": cwd, "mcpServers": []}))[0]["result"]["sessionId"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let a = new(&mut raw, 2, &p.ws);
    let b = new(&mut raw, 3, &other);
    assert_ne!(a, b);
    for (id, sid, text) in [(4, &a, "to a"), (5, &b, "to b"), (6, &a, "a again")] {
        let frames = raw.call(
            id,
            "session/prompt",
            json!({"sessionId": sid, "prompt": [{"type": "text", "text": text}]}),
        );
        let update = &frames[0];
        assert_eq!(update["params"]["sessionId"], sid.as_str(), "{frames:?}");
        assert_eq!(updates(&frames)[0].1, format!("Done: {text}"));
    }
    // A resource link becomes a bracketed reference in the user's words.
    let linked = raw.call(
        7,
        "session/prompt",
        json!({"sessionId": b, "prompt": [
            {"type": "text", "text": "see"},
            {"type": "resource_link", "name": "a.txt", "uri": "file:///a.txt"},
        ]}),
    );
    assert_eq!(
        updates(&linked)[0].1,
        "Done: see [resource_link name=a.txt uri=file:///a.txt]"
    );
    raw.close();
    let turns = |sid: &str| {
        std::fs::read_to_string(p.sessions.join(sid).join("session.jsonl"))
            .unwrap()
            .matches("\"type\":\"turn/end\"")
            .count()
    };
    assert_eq!((turns(&a), turns(&b)), (2, 2));
}

/// Cancelling the run mid-turn cancels the child's remote turn: the run
/// ends aborted, and disposing it ends the process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_an_acp_child_aborts_its_turn() {
    let _sweep = crate::suite::sweep();
    use dsh::actors::subagent::StopReason;
    let p = place("dsh-acp");
    let cancel = tokio_util::sync::CancellationToken::new();
    let (rt, run, recording) = held_child(&p, cancel.clone()).await;
    cancel.cancel();
    let result = tokio::time::timeout(WAIT, run.result()).await.unwrap();
    assert_eq!(result.stop_reason, StopReason::Aborted, "{result:?}");
    run.dispose().await;
    super::until("the child outlived its run", || !super::running(&recording)).await;
    rt.shutdown().await;
}

/// A session's `mcpServers` (stdio, here the MCP reference server) run in
/// the session's scope: the answer reports each server up with its tools,
/// the model's call reaches the server, the log holds the result, another
/// session does not see the tools, and bad entries are refused by index.
#[test]
fn a_session_s_mcp_servers_serve_its_agent_alone() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    // Each session's turn: the call, then `done` (the model serves the
    // steps in order, whichever session asks).
    let sum = json!({"tool_calls": [{"name": "mcp__everything__get-sum", "arguments": {"a": 20, "b": 22}}]});
    let steps = json!({"steps": [sum, {"text": "done"}, sum, {"text": "done"}]});
    let script = p.base.join("script.json");
    std::fs::write(&script, steps.to_string()).unwrap();
    let script = script.display().to_string();
    let mut raw = Raw::spawn(&p, &["--approval", "never", "--script", &script], &[]);
    let init = raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let caps = &init[0]["result"]["agentCapabilities"]["mcpCapabilities"];
    assert_eq!(caps["http"], true, "{caps}");
    assert_eq!(caps["sse"], false, "{caps}");
    let node = std::process::Command::new("sh")
        .args(["-c", "command -v node"])
        .bounded_output()
        .unwrap();
    let node = String::from_utf8(node.stdout).unwrap().trim().to_owned();
    let server = json!({
        "name": "everything", "command": node,
        "args": [super::mcp::everything(), "stdio"], "env": []
    });
    let opened = raw.call(
        2,
        "session/new",
        json!({"cwd": p.ws, "mcpServers": [server]}),
    );
    let result = &opened.last().unwrap()["result"];
    let sid = result["sessionId"].as_str().unwrap().to_owned();
    let states = &result["_meta"]["dsh"]["mcpServers"];
    assert_eq!(states[0]["name"], "everything", "{result}");
    assert_eq!(states[0]["state"], "up", "{result}");
    assert!(states[0]["tools"].as_u64().unwrap() > 5, "{result}");
    let done = raw.call(
        3,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "add"}]}),
    );
    assert_eq!(done.last().unwrap()["result"]["stopReason"], "end_turn");

    // Another session has no MCP servers: the tool is unknown there.
    let other = raw.call(4, "session/new", json!({"cwd": p.ws, "mcpServers": []}));
    let other = other.last().unwrap()["result"]["sessionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let done = raw.call(
        5,
        "session/prompt",
        json!({"sessionId": other, "prompt": [{"type": "text", "text": "add"}]}),
    );
    assert_eq!(
        done.last().unwrap()["result"]["stopReason"],
        "end_turn",
        "{done:?}"
    );

    for (bad, says) in [
        (
            json!({"name": "x", "command": "node", "args": [], "env": []}),
            "absolute path",
        ),
        (
            json!({"name": "bad name", "command": node, "args": [], "env": []}),
            "server_name",
        ),
        (
            json!({"type": "http", "name": "h", "url": "ftp://h/", "headers": []}),
            "http or https",
        ),
        (
            json!({"type": "sse", "name": "s", "url": "http://h/", "headers": []}),
            "SSE",
        ),
    ] {
        let e = raw.call(6, "session/new", json!({"cwd": p.ws, "mcpServers": [bad]}));
        let e = &e.last().unwrap()["error"];
        assert_eq!(e["code"], -32602, "{e}");
        let message = e["message"].as_str().unwrap();
        assert!(
            message.contains("mcpServers[0]") && message.contains(says),
            "{message}"
        );
    }
    let twice = raw.call(
        7,
        "session/new",
        json!({"cwd": p.ws, "mcpServers": [server.clone(), server]}),
    );
    let message = twice.last().unwrap()["error"]["message"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        message.contains("mcpServers[1]") && message.contains("twice"),
        "{message}"
    );
    drop(raw.stdin.take());
    assert!(super::wait_bounded(&mut raw.child, "dsh acp").success());
    let log =
        |id: &str| std::fs::read_to_string(p.sessions.join(id).join("session.jsonl")).unwrap();
    let first = log(&sid);
    assert!(first.contains("The sum of 20 and 22 is 42."), "{first}");
    let second = log(&other);
    assert!(
        second.contains("no tool named") || second.contains("UNKNOWN_TOOL"),
        "{second}"
    );
    assert!(!second.contains("is 42"), "{second}");
}

/// Starting a session's MCP servers does not hold the connection: while a
/// `session/new` waits on a server that accepts and says nothing, another
/// request is answered; when that server hangs up, the session opens and
/// its answer says the server is not up (it keeps trying).
#[test]
fn a_slow_mcp_server_does_not_hold_the_connection() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp");
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let (held_tx, held_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Holds the first connection open without a word.
        if let Ok((conn, _)) = silent.accept() {
            let _ = held_tx.send(conn);
        }
    });
    let mut raw = Raw::start(&p);
    raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let server = json!({"type": "http", "name": "silent", "url": format!("http://127.0.0.1:{port}/mcp"), "headers": []});
    let stdin = raw.stdin.as_mut().unwrap();
    writeln!(
        stdin,
        "{}",
        json!({"jsonrpc": "2.0", "id": 2, "method": "session/new", "params": {"cwd": p.ws, "mcpServers": [server]}})
    )
    .unwrap();
    stdin.flush().unwrap();
    let held = held_rx.recv_timeout(WAIT).expect("the client connects");
    // Answered while session 2 waits on its server.
    let other = raw.call(3, "session/new", json!({"cwd": p.ws, "mcpServers": []}));
    assert_eq!(other.len(), 1, "only the second answer so far: {other:?}");
    assert!(other[0]["result"]["sessionId"].is_string(), "{other:?}");
    drop(held);
    let first = raw.lines.recv_timeout(WAIT).expect("the first answer");
    assert_eq!(first["id"], 2, "{first}");
    let state = &first["result"]["_meta"]["dsh"]["mcpServers"][0];
    assert_eq!(state["name"], "silent", "{first}");
    assert_ne!(state["state"], "up", "{first}");
    drop(raw.stdin.take());
    assert!(super::wait_bounded(&mut raw.child, "dsh acp").success());
}

/// A session mode per named agent definition: `session/new` offers
/// `default` and each definition of its workspace; `session/set_mode`
/// between prompts makes the session go on as that agent (its system
/// prompt first in the next request, the same log), says so with a
/// `current_mode_update`, and an unknown mode is refused naming the modes.
#[test]
fn a_session_mode_per_named_agent_definition() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp-modes");
    std::fs::create_dir_all(p.ws.join(".dsh/agents")).unwrap();
    std::fs::write(
        p.ws.join(".dsh/agents/reviewer.md"),
        "---\nname: reviewer\ndescription: Reviews a change.\ntools: [read, grep]\n---\nYou review changes.\n",
    )
    .unwrap();
    let mut raw = Raw::start(&p);
    raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let new = raw.call(2, "session/new", json!({"cwd": p.ws, "mcpServers": []}));
    let result = &new[0]["result"];
    let sid = result["sessionId"].as_str().unwrap().to_owned();
    assert_eq!(result["modes"]["currentModeId"], "default", "{result}");
    let ids: Vec<&str> = result["modes"]["availableModes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["default", "reviewer"], "{result}");
    let first = raw.call(
        3,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "one"}]}),
    );
    assert_eq!(first.last().unwrap()["result"]["stopReason"], "end_turn");
    let set = raw.call(
        4,
        "session/set_mode",
        json!({"sessionId": sid, "modeId": "reviewer"}),
    );
    assert!(set.last().unwrap()["result"].is_object(), "{set:?}");
    assert!(
        set.iter().any(
            |f| f["params"]["update"]["sessionUpdate"] == "current_mode_update"
                && f["params"]["update"]["currentModeId"] == "reviewer"
        ),
        "{set:?}"
    );
    let second = raw.call(
        5,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "two"}]}),
    );
    assert_eq!(
        second.last().unwrap()["result"]["stopReason"],
        "end_turn",
        "{second:?}"
    );
    let bad = raw.call(
        6,
        "session/set_mode",
        json!({"sessionId": sid, "modeId": "nobody"}),
    );
    let message = bad[0]["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("no agent definition named `nobody` (found: reviewer)"),
        "{bad:?}"
    );
    raw.close();
    // One log: both turns, the second asked as the reviewer with its tools.
    let log = std::fs::read_to_string(p.sessions.join(&sid).join("session.jsonl")).unwrap();
    let headers: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["type"] == "request/header")
        .collect();
    assert_eq!(headers.len(), 2, "{log}");
    let system = |h: &Value| {
        h["data"]["header"]["system"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    assert!(!system(&headers[0]).starts_with("You review changes."));
    assert!(
        system(&headers[1]).starts_with("You review changes.\n"),
        "{}",
        system(&headers[1])
    );
    let mut tools: Vec<&str> = headers[1]["data"]["header"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    tools.sort();
    assert_eq!(tools, ["grep", "read"]);
}

/// `dsh acp --hooks`: each session runs the project hooks of its own
/// working directory, for its agent alone. A session whose project blocks
/// the prompt (a `UserPromptSubmit` hook) ends it `end_turn` with the
/// hook's reason as text and nothing sent to the model; a session in
/// another directory, opened on the same server, answers as usual.
#[test]
fn each_session_runs_the_hooks_of_its_own_workspace() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp-hooks");
    let guarded = p.base.join("guarded");
    std::fs::create_dir_all(guarded.join(".claude")).unwrap();
    let hook = json!({"hooks": {"UserPromptSubmit": [{"hooks": [
        {"type": "command", "command": "echo 'not in this project' >&2; exit 2"}
    ]}]}});
    std::fs::write(guarded.join(".claude/settings.json"), hook.to_string()).unwrap();
    let script = p.base.join("script.json");
    std::fs::write(
        &script,
        json!({"steps": [{"text": "answered"}]}).to_string(),
    )
    .unwrap();
    let home = p.base.display().to_string();
    let mut raw = Raw::spawn(
        &p,
        &[
            "--script",
            script.to_str().unwrap(),
            "--hooks",
            "--approval",
            "never",
        ],
        &[("HOME", home.as_str())],
    );
    raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let session = |raw: &mut Raw, id: u64, cwd: &Path| {
        raw.call(id, "session/new", json!({"cwd": cwd, "mcpServers": []}))
            .last()
            .unwrap()["result"]["sessionId"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let blocked = session(&mut raw, 2, &guarded);
    let open = session(&mut raw, 3, &p.ws);
    let prompt = |raw: &mut Raw, id: u64, sid: &str| {
        raw.call(
            id,
            "session/prompt",
            json!({"sessionId": sid, "prompt": [{"type": "text", "text": "hello"}]}),
        )
    };
    let frames = prompt(&mut raw, 4, &blocked);
    let said = serde_json::to_string(&frames).unwrap();
    assert_eq!(
        frames.last().unwrap()["result"]["stopReason"],
        "end_turn",
        "{said}"
    );
    assert!(said.contains("not in this project"), "{said}");
    assert!(!said.contains("answered"), "{said}");
    // The other session's agent is not held by that project's hooks; the
    // one scripted answer was still there for it.
    let frames = prompt(&mut raw, 5, &open);
    let said = serde_json::to_string(&frames).unwrap();
    assert_eq!(
        frames.last().unwrap()["result"]["stopReason"],
        "end_turn",
        "{said}"
    );
    assert!(said.contains("answered"), "{said}");
    raw.close();
}

/// A `Stop` hook that keeps the turn going (once): the next step's text
/// streams into the same prompt's updates, and the prompt ends after it.
#[test]
fn a_stop_hook_that_continues_streams_into_the_same_prompt() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-acp-stop");
    std::fs::create_dir_all(p.ws.join(".claude/hooks")).unwrap();
    let script_path = p.ws.join(".claude/hooks/again.py");
    std::fs::write(
        &script_path,
        "import json, sys\nd = json.load(sys.stdin)\nif not d.get('stop_hook_active'):\n    print(json.dumps({'decision': 'block', 'reason': 'one more line'}))\n",
    )
    .unwrap();
    let hook = json!({"hooks": {"Stop": [{"hooks": [
        {"type": "command", "command": format!("python3 {}", script_path.display())}
    ]}]}});
    std::fs::write(p.ws.join(".claude/settings.json"), hook.to_string()).unwrap();
    let script = p.base.join("script.json");
    std::fs::write(
        &script,
        json!({"steps": [{"text": "first line"}, {"text": "second line"}]}).to_string(),
    )
    .unwrap();
    let home = p.base.display().to_string();
    let mut raw = Raw::spawn(
        &p,
        &[
            "--script",
            script.to_str().unwrap(),
            "--hooks",
            "--approval",
            "never",
        ],
        &[("HOME", home.as_str())],
    );
    raw.call(1, "initialize", json!({"protocolVersion": 1}));
    let sid = raw
        .call(2, "session/new", json!({"cwd": p.ws, "mcpServers": []}))
        .last()
        .unwrap()["result"]["sessionId"]
        .as_str()
        .unwrap()
        .to_owned();
    let frames = raw.call(
        3,
        "session/prompt",
        json!({"sessionId": sid, "prompt": [{"type": "text", "text": "write"}]}),
    );
    let texts: Vec<&str> = frames
        .iter()
        .filter(|f| f["params"]["update"]["sessionUpdate"] == "agent_message_chunk")
        .filter_map(|f| f["params"]["update"]["content"]["text"].as_str())
        .collect();
    assert_eq!(texts, ["first line", "second line"], "{frames:?}");
    assert_eq!(frames.last().unwrap()["result"]["stopReason"], "end_turn");
    raw.close();
}
