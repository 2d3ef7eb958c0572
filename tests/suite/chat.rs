//! `dsh chat` driven through stdin as a script drives it: each line is
//! written only after the line it waits for was read, each read with a
//! deadline.

use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use dsh::kernel::scratch::fresh_dir;
use serde_json::{Value, json};

/// How long one expected line may take to come.
const WAIT: Duration = Duration::from_secs(60);

/// A test's directories: the workspace, a directory outside it, the
/// sessions store, a home.
struct Place {
    base: PathBuf,
    ws: PathBuf,
    outside: PathBuf,
    sessions: PathBuf,
}

fn place() -> Place {
    let base = fresh_dir("dsh-chat").unwrap().canonicalize().unwrap();
    let p = Place {
        ws: base.join("ws"),
        outside: base.join("outside"),
        sessions: base.join("sessions"),
        base,
    };
    std::fs::create_dir_all(&p.ws).unwrap();
    std::fs::create_dir_all(&p.outside).unwrap();
    std::fs::create_dir_all(p.base.join("home")).unwrap();
    p
}

/// A scripted model's steps, written to `name` under the test's base.
fn script(p: &Place, name: &str, steps: &[Value]) -> PathBuf {
    let file = p.base.join(name);
    std::fs::write(&file, json!({ "steps": steps }).to_string()).unwrap();
    file
}

fn call(command: &str) -> Value {
    json!({"tool_calls": [{"name": "bash", "arguments": {"command": command, "description": "run"}}]})
}

fn escalated_touch(path: &Path) -> Value {
    json!({"tool_calls": [{"name": "bash", "arguments": {
        "command": format!("touch {}", path.display()), "description": "touch",
        "sandbox_permissions": "danger-full-access", "justification": "the test asks for it"
    }}]})
}

/// A command that waits until the test creates `go` in the workspace.
const HOLD: &str = "echo holding; while [ ! -e go ]; do sleep 0.02; done; echo released";

/// A running `dsh chat`, its stdout read line by line.
struct Session {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    seen: Vec<String>,
    stderr: mpsc::Receiver<String>,
}

impl Session {
    fn start(p: &Place, script: &Path, extra: &[&str]) -> Session {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dsh"))
            .args(["chat", "--script"])
            .arg(script)
            .arg("--sessions-dir")
            .arg(&p.sessions)
            .args(extra)
            .current_dir(&p.ws)
            .env("HOME", p.base.join("home"))
            .env_remove("DSH_APPROVAL")
            .env_remove("DSH_PERMISSION_MODE")
            .env_remove("DSH_BASE_URL")
            .env_remove("DSH_MODEL")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = std::io::BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let (tx, stderr) = mpsc::channel();
        let mut err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut all = String::new();
            let _ = err.read_to_string(&mut all);
            let _ = tx.send(all);
        });
        Session {
            stdin: child.stdin.take(),
            child,
            lines,
            seen: Vec::new(),
            stderr,
        }
    }

    fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin is open");
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
    }

    /// Reads lines until one contains `needle`; returns it.
    fn expect(&mut self, needle: &str) -> String {
        loop {
            match self.lines.recv_timeout(WAIT) {
                Ok(line) => {
                    self.seen.push(line.clone());
                    if line.contains(needle) {
                        return line;
                    }
                }
                Err(_) => panic!(
                    "no line with `{needle}` within {WAIT:?}; stdout so far:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    /// Ends the input; returns the exit status, every stdout line, stderr.
    fn finish(mut self) -> (ExitStatus, Vec<String>, String) {
        drop(self.stdin.take());
        let status = super::wait_bounded(&mut self.child, "dsh chat");
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(10)) {
            self.seen.push(line);
        }
        let stderr = self.stderr.recv_timeout(WAIT).unwrap_or_default();
        (status, self.seen, stderr)
    }
}

/// The id a chat's closing line on stderr names.
fn session_id(stderr: &str) -> String {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("session "))
        .unwrap_or_else(|| panic!("no closing line in:\n{stderr}"));
    line.split(['(', ')']).nth(1).unwrap().to_owned()
}

/// The events of stored session `id`, parsed (its header first).
fn events(p: &Place, id: &str) -> Vec<Value> {
    let text = std::fs::read_to_string(p.sessions.join(id).join("session.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn count(events: &[Value], kind: &str) -> usize {
    events.iter().filter(|e| e["type"] == kind).count()
}

/// Two turns with tool calls; a `!` line steers the running turn (the model
/// reads it at its next step, no new turn) and a plain line during the turn
/// is queued as the next turn; the end of the input lets the turns finish,
/// the session is stored, and the chat exits 0.
#[test]
fn turns_with_tools_a_steer_and_a_queued_followup() {
    let _sweep = crate::suite::sweep();
    let p = place();
    let script = script(
        &p,
        "script.json",
        &[
            call(HOLD),
            // Escape sequences from the model never reach the terminal.
            json!({"text": "\u{1b}]0;pwned\u{7}\u{1b}[2Jfirst answer"}),
            call("echo two; exit 3"),
            json!({"text": "second answer"}),
        ],
    );
    let mut chat = Session::start(&p, &script, &["--approval", "never"]);
    chat.send("hello");
    chat.expect("> hello");
    chat.expect("▸ bash echo holding");
    chat.send("!look at the README too");
    chat.expect("steered");
    chat.send("and then this");
    chat.expect("queued");
    std::fs::write(p.ws.join("go"), "").unwrap();
    chat.expect("  ✓ bash · 2 lines");
    chat.expect("first answer");
    chat.expect("── turn 1 completed");
    chat.expect("▸ bash echo two; exit 3");
    chat.expect("  ✗ bash · exit 3 · 1 line ·");
    chat.expect("second answer");
    let (status, lines, stderr) = chat.finish();
    assert!(
        status.success(),
        "{status:?}\n{}\n{stderr}",
        lines.join("\n")
    );
    assert!(
        lines.iter().any(|l| l.starts_with("── turn 2 completed")),
        "{}",
        lines.join("\n")
    );
    assert!(
        lines.iter().all(|l| !l.contains(['\u{1b}', '\u{7}'])),
        "an escape sequence reached the output: {lines:?}"
    );
    let log = events(&p, &session_id(&stderr));
    assert_eq!(count(&log, "turn/start"), 2, "{log:#?}");
    // The steer is a message of turn 1, before its end; the followup the
    // first of turn 2.
    let at = |needle: &str| {
        log.iter()
            .position(|e| e["type"] == "user/message" && e.to_string().contains(needle))
            .unwrap_or_else(|| panic!("`{needle}` is not in the log"))
    };
    let first_end = log.iter().position(|e| e["type"] == "turn/end").unwrap();
    assert!(at("look at the README too") < first_end);
    assert!(at("and then this") > first_end);
}

/// An approval question is answered by the next line (`y`: once); one left
/// unanswered when the input ends is refused (fail closed), and its call
/// does not run.
#[test]
fn an_approval_answered_and_one_left_unanswered_at_the_end_of_input() {
    let _sweep = crate::suite::sweep();
    let p = place();
    let (allowed, refused) = (p.outside.join("allowed"), p.outside.join("refused"));
    let script = script(
        &p,
        "script.json",
        &[
            escalated_touch(&allowed),
            escalated_touch(&refused),
            json!({"text": "done"}),
        ],
    );
    let mut chat = Session::start(&p, &script, &["--approval", "ask"]);
    chat.send("go");
    let asked = chat.expect("approval 1:");
    assert!(asked.contains("bash touch"), "{asked}");
    assert!(asked.contains("[y once / a always / n]"), "{asked}");
    chat.send("y");
    chat.expect("approval 1: allowed once");
    chat.expect("  ✓ bash");
    chat.expect("approval 2:");
    let (status, lines, stderr) = chat.finish();
    assert!(
        status.success(),
        "{status:?}\n{}\n{stderr}",
        lines.join("\n")
    );
    let all = lines.join("\n");
    assert!(
        all.contains("no more input: 1 approval question refused"),
        "{all}"
    );
    assert!(all.contains("── turn 1 completed"), "{all}");
    assert!(allowed.exists(), "{all}");
    assert!(!refused.exists(), "a refused call ran:\n{all}");
}

/// `a` allows the tool for the rest of the chat: its next call is not asked
/// about.
#[test]
fn an_approval_answered_always_is_not_asked_again() {
    let _sweep = crate::suite::sweep();
    let p = place();
    let (one, two) = (p.outside.join("one"), p.outside.join("two"));
    let script = script(
        &p,
        "script.json",
        &[
            escalated_touch(&one),
            escalated_touch(&two),
            json!({"text": "done"}),
        ],
    );
    let mut chat = Session::start(&p, &script, &["--approval", "ask"]);
    chat.send("go");
    chat.expect("approval 1:");
    chat.send("a");
    chat.expect("approval 1: allowed, and from now on without asking");
    chat.expect("allowed bash (always");
    chat.expect("── turn 1 completed");
    let (status, lines, stderr) = chat.finish();
    assert!(status.success(), "{status:?}\n{stderr}");
    assert!(
        !lines.iter().any(|l| l.starts_with("approval 2")),
        "{}",
        lines.join("\n")
    );
    assert!(one.exists() && two.exists());
}

/// The commands: `/help`, an unknown one (told the closest), `/model`,
/// `/export`, `/fork` (the chat goes on in the fork), `/sessions`,
/// `/resume` by a short id; then `dsh chat --resume` shows the earlier
/// turns and goes on with the next turn number.
#[test]
fn commands_and_a_resumed_chat() {
    let _sweep = crate::suite::sweep();
    let p = place();
    let first = script(
        &p,
        "script.json",
        &[
            json!({"text": "the first answer"}),
            json!({"text": "an answer on the fork"}),
            json!({"text": "back on the original"}),
        ],
    );
    let mut chat = Session::start(&p, &first, &["--approval", "never"]);
    chat.send("/help");
    chat.expect("/fork [AT]");
    chat.expect("/exit");
    chat.send("/frok");
    let unknown = chat.expect("is not a command");
    assert!(unknown.contains("did you mean /fork?"), "{unknown}");
    chat.send("hello there");
    chat.expect("── turn 1 completed");
    chat.send("/model other-model");
    chat.expect("model scripted/other-model from the next turn");
    chat.send("/model");
    chat.expect("model scripted/other-model");
    // A directory that is not there: said, nothing written.
    chat.send("/export missing/chat.md");
    let refused = chat.expect("error: cannot write");
    assert!(refused.contains("missing/chat.md"), "{refused}");
    assert!(!p.ws.join("missing").exists());
    // A link planted at the name is replaced, not written through.
    let target = p.outside.join("target");
    std::fs::write(&target, "keep").unwrap();
    std::os::unix::fs::symlink(&target, p.ws.join("chat.md")).unwrap();
    chat.send("/export chat.md");
    chat.expect("exported to");
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    assert!(
        !std::fs::symlink_metadata(p.ws.join("chat.md"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    let md = std::fs::read_to_string(p.ws.join("chat.md")).unwrap();
    assert!(md.contains("## User\n\nhello there"), "{md}");
    assert!(md.contains("## Assistant\n\nthe first answer"), "{md}");
    chat.send("/fork");
    let forked = chat.expect("you are on the fork");
    let original = forked.split_whitespace().nth(1).unwrap().to_owned();
    let fork = forked
        .split_whitespace()
        .nth(3)
        .unwrap()
        .trim_end_matches(';')
        .to_owned();
    chat.send("on the fork");
    chat.expect("an answer on the fork");
    chat.send("/sessions");
    chat.expect(&format!("* {}", &fork[..8]));
    chat.send(&format!("/resume {}", &original[..8]));
    chat.expect("resumed session");
    chat.send("back again");
    chat.expect("back on the original");
    chat.expect("── turn 2 completed");
    let (status, lines, stderr) = chat.finish();
    assert!(
        status.success(),
        "{status:?}\n{}\n{stderr}",
        lines.join("\n")
    );
    assert_eq!(session_id(&stderr), original, "{stderr}");
    let log = events(&p, &original);
    assert_eq!(count(&log, "turn/start"), 2, "{log:#?}");
    // The fork's turn asked the model /model named.
    let on_fork = events(&p, &fork);
    assert!(
        on_fork
            .iter()
            .any(|e| e["type"] == "request/context" && e["data"]["model"] == "other-model"),
        "{on_fork:#?}"
    );

    // A later chat goes on with the same session, its turns shown first.
    let again = script(&p, "again.json", &[json!({"text": "the third answer"})]);
    let mut chat = Session::start(
        &p,
        &again,
        &["--approval", "never", "--resume", &original[..8]],
    );
    chat.expect("> hello there");
    chat.expect("< the first answer");
    chat.expect("> back again");
    chat.expect("resumed session");
    chat.send("once more");
    chat.expect("── turn 3 completed");
    let (status, _, stderr) = chat.finish();
    assert!(status.success(), "{stderr}");
    assert_eq!(count(&events(&p, &original), "turn/start"), 3);
}

/// `/permission` narrows the next turns' mode and refuses more than the
/// flags allow; `/skill` sends a skill the model may not load; `/tree` shows
/// the agent's nodes; `/dashboard` serves the page; `/cancel` ends the
/// running turn.
#[test]
fn permission_skill_tree_dashboard_and_cancel() {
    let _sweep = crate::suite::sweep();
    let p = place();
    let skills = p.ws.join(".dsh/skills");
    std::fs::create_dir_all(&skills).unwrap();
    std::fs::write(
        skills.join("helper.md"),
        "---\ndescription: helps\ndisable-model-invocation: true\n---\nCount the files, then stop.\n",
    )
    .unwrap();
    let script = script(
        &p,
        "script.json",
        &[
            call("touch made-here"),
            json!({"text": "after the touch"}),
            json!({"text": "after the skill"}),
            call(HOLD),
            json!({"text": "never said"}),
        ],
    );
    let mut chat = Session::start(
        &p,
        &script,
        &[
            "--approval",
            "never",
            "--permission-mode",
            "workspace-write",
        ],
    );
    let session = chat
        .expect("chat on session ")
        .split_whitespace()
        .nth(3)
        .unwrap()
        .to_owned();
    chat.send("/permission danger-full-access");
    let refused = chat.expect("error: /permission danger-full-access");
    assert!(refused.contains("at most workspace-write"), "{refused}");
    chat.send("/permission read-only");
    chat.expect("permission mode read-only from the next turn");
    chat.send("touch it");
    chat.expect("  ✗ bash · exit 1");
    chat.expect("── turn 1 completed");
    assert!(!p.ws.join("made-here").exists(), "read-only wrote");
    chat.send("/skill helper in the workspace");
    chat.expect("skill helper");
    chat.expect("── turn 2 completed");
    chat.send("/tree");
    chat.expect(&format!("driver/{}", &session[..8]));
    chat.send("/dashboard");
    let at = chat.expect("dashboard at http://127.0.0.1:");
    let addr = at
        .trim_start_matches("dashboard at http://")
        .split(['/', '#'])
        .next()
        .unwrap()
        .to_owned();
    assert!(std::net::TcpStream::connect(&addr).is_ok(), "{at}");
    chat.send("wait for go");
    chat.expect("▸ bash echo holding");
    chat.send("/cancel");
    chat.expect("cancelling the turn");
    chat.expect("── turn 3 aborted");
    let (status, lines, stderr) = chat.finish();
    assert!(
        status.success(),
        "{status:?}\n{}\n{stderr}",
        lines.join("\n")
    );
    let log = events(&p, &session_id(&stderr))
        .iter()
        .map(|e| e.to_string())
        .collect::<String>();
    assert!(
        log.contains("Count the files, then stop."),
        "the skill was not sent"
    );
    assert!(
        log.contains("in the workspace"),
        "its arguments were not sent"
    );
}

/// One HTTP/1.1 request to the chat's dashboard (`Connection: close`):
/// the status code and the body as JSON.
fn http(url: &str, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let (base, token) = url.split_once("/#token=").expect("a URL with its token");
    let addr = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.set_read_timeout(Some(WAIT)).unwrap();
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.split(' ').nth(1).unwrap().parse().unwrap();
    let json = response
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null);
    (status, json)
}

/// With the dashboard up, a question is put to both the chat and the page:
/// the page's answer is taken and the chat's question withdrawn; the chat's
/// answer is taken and the page's question withdrawn. A turn the page
/// starts shows in the chat.
#[test]
fn the_first_answer_wins_between_the_chat_and_the_dashboard() {
    let _sweep = crate::suite::sweep();
    let p = place();
    let (by_page, refused) = (p.outside.join("by-page"), p.outside.join("refused"));
    let script = script(
        &p,
        "script.json",
        &[
            escalated_touch(&by_page),
            escalated_touch(&refused),
            json!({"text": "done"}),
            json!({"text": "answered the page"}),
        ],
    );
    let mut chat = Session::start(&p, &script, &["--approval", "ask", "--dashboard"]);
    let session = chat
        .expect("chat on session ")
        .split_whitespace()
        .nth(3)
        .unwrap()
        .to_owned();
    let url = chat
        .expect("dashboard at http://")
        .trim_start_matches("dashboard at ")
        .to_owned();
    chat.send("go");
    chat.expect("approval 1:");
    let (status, listed) = http(&url, "GET", "/api/approvals", None);
    assert_eq!(status, 200, "{listed}");
    let asks = listed["approvals"].as_array().unwrap();
    assert_eq!(asks.len(), 1, "{listed}");
    let id = asks[0]["id"].as_str().unwrap();
    let (status, answer) = http(
        &url,
        "POST",
        &format!("/api/approvals/{id}"),
        Some(json!({"outcome": "allowed-once"})),
    );
    assert_eq!(status, 200, "{answer}");
    chat.expect("approval 1 answered on the dashboard: allowed-once");
    chat.expect("  ✓ bash");
    chat.expect("approval 2:");
    assert_eq!(
        http(&url, "GET", "/api/approvals", None).1["approvals"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    chat.send("n");
    chat.expect("approval 2: refused");
    chat.expect("── turn 1 completed");
    let (_, listed) = http(&url, "GET", "/api/approvals", None);
    assert_eq!(
        listed["approvals"],
        json!([]),
        "the page's question was not withdrawn"
    );
    // A chat line answered nothing twice: the answered question is gone.
    let (status, _) = http(
        &url,
        "POST",
        &format!("/api/approvals/{id}"),
        Some(json!({"outcome": "allowed-once"})),
    );
    assert_eq!(status, 404);
    // A turn started from the page is shown in the chat.
    let (status, started) = http(
        &url,
        "POST",
        &format!("/api/agents/{session}/followup"),
        Some(json!({"text": "from the page"})),
    );
    assert_eq!(status, 200, "{started}");
    chat.expect("answered the page");
    chat.expect("── turn 2 completed");
    let (status, lines, stderr) = chat.finish();
    assert!(
        status.success(),
        "{status:?}\n{}\n{stderr}",
        lines.join("\n")
    );
    assert!(by_page.exists());
    assert!(!refused.exists());
}

/// A command is not an answer: `/cancel` while a question waits cancels the
/// turn, and the question is withdrawn (its call never runs); `!` alone
/// sends nothing.
#[test]
fn a_cancelled_turn_withdraws_its_question() {
    let _sweep = crate::suite::sweep();
    let p = place();
    let never = p.outside.join("never");
    let script = script(
        &p,
        "script.json",
        &[escalated_touch(&never), json!({"text": "not reached"})],
    );
    let mut chat = Session::start(&p, &script, &["--approval", "ask"]);
    chat.send("!");
    chat.send("go");
    chat.expect("> go");
    chat.expect("approval 1:");
    chat.send("/cancel");
    // The note and the turn's items come in either order.
    chat.expect("approval 1 withdrawn");
    chat.expect("── turn 1 aborted");
    let (status, lines, stderr) = chat.finish();
    assert!(
        status.success(),
        "{status:?}\n{}\n{stderr}",
        lines.join("\n")
    );
    assert!(!never.exists());
    assert!(
        lines.iter().any(|l| l == "cancelling the turn"),
        "{}",
        lines.join("\n")
    );
    assert_eq!(
        lines.iter().filter(|l| l.starts_with("> ")).count(),
        1,
        "{}",
        lines.join("\n")
    );
}
