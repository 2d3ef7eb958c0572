//! `dsh chat` driven through stdin as a script drives it: each line is
//! written only after the line it waits for was read, each read with a
//! deadline.

use std::io::{BufRead, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use super::place;
use serde_json::{Value, json};

/// How long one expected line may take to come.
const WAIT: Duration = Duration::from_secs(60);

/// A scripted model's steps, written to `name` under the test's base.
fn script(p: &super::Place, name: &str, steps: &[Value]) -> PathBuf {
    let file = p.base.join(name);
    std::fs::write(&file, json!({ "steps": steps }).to_string()).unwrap();
    file
}

fn call(command: &str) -> Value {
    json!({"tool_calls": [{"name": "bash", "arguments": {"command": command, "description": "run"}}]})
}

/// A step of the script: [`escalated_touch`] of `path`.
fn escalated_touch(path: &Path) -> Value {
    json!({"tool_calls": [super::escalated_touch(path)]})
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
    fn start(p: &super::Place, script: &Path, extra: &[&str]) -> Session {
        std::fs::create_dir_all(p.base.join("home")).unwrap();
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

    /// Ends the input; the chat must exit 0. Every stdout line, and stderr.
    fn finish_ok(self) -> (Vec<String>, String) {
        let (status, lines, stderr) = self.finish();
        assert!(
            status.success(),
            "{status:?}\n{}\n{stderr}",
            lines.join("\n")
        );
        (lines, stderr)
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

/// The id a chat's closing line names (on stderr, or on the screen).
fn session_id(stderr: &str) -> String {
    let line = stderr
        .lines()
        .find(|l| l.starts_with("session "))
        .unwrap_or_else(|| panic!("no closing line in:\n{stderr}"));
    line.split(['(', ')']).nth(1).unwrap().to_owned()
}

/// The events of stored session `id`, parsed (its header first).
fn events(p: &super::Place, id: &str) -> Vec<Value> {
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
    let p = place("dsh-chat");
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
    let (lines, stderr) = chat.finish_ok();
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
    let p = place("dsh-chat");
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
    let (lines, _) = chat.finish_ok();
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
    let p = place("dsh-chat");
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
    let (lines, _) = chat.finish_ok();
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
    let p = place("dsh-chat");
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
    let (_, stderr) = chat.finish_ok();
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
    chat.finish_ok();
    assert_eq!(count(&events(&p, &original), "turn/start"), 3);
}

/// `/permission` narrows the next turns' mode and refuses more than the
/// flags allow; `/skill` sends a skill the model may not load; `/tree` shows
/// the agent's nodes; `/dashboard` serves the page; `/cancel` ends the
/// running turn.
#[test]
fn permission_skill_tree_dashboard_and_cancel() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-chat");
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
    let (_, stderr) = chat.finish_ok();
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

/// The page's pending questions once it lists `n` of them (within
/// [`WAIT`]).
fn pending(url: &str, n: usize) -> Vec<Value> {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let (status, listed) = http(url, "GET", "/api/approvals", None);
        assert_eq!(status, 200, "{listed}");
        let asks = listed["approvals"].as_array().cloned().unwrap_or_default();
        if asks.len() == n {
            return asks;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never {n} questions: {listed}"
        );
    }
}

/// With the dashboard up, a question is put to both the chat and the page:
/// the page's answer is taken and the chat's question withdrawn; the chat's
/// answer is taken and the page's question withdrawn. A turn the page
/// starts shows in the chat.
#[test]
fn the_first_answer_wins_between_the_chat_and_the_dashboard() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-chat");
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
    // The page is asked as the chat shows the question (it may list it a
    // moment later).
    let listed = pending(&url, 1);
    let id = listed[0]["id"].as_str().unwrap().to_owned();
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
    pending(&url, 1);
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
    chat.finish_ok();
    assert!(by_page.exists());
    assert!(!refused.exists());
}

/// A command is not an answer: `/cancel` while a question waits cancels the
/// turn, and the question is withdrawn (its call never runs); `!` alone
/// sends nothing.
#[test]
fn a_cancelled_turn_withdraws_its_question() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-chat");
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
    let (lines, _) = chat.finish_ok();
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

/// `dsh chat` on a pseudo-terminal, its screen read through a vt100
/// parser. The reader thread answers the editor's cursor-position queries
/// (`ESC [6n`) as a terminal would.
struct Terminal {
    child: Child,
    master: std::fs::File,
    seen: std::sync::Arc<(std::sync::Mutex<Received>, std::sync::Condvar)>,
}

/// What the terminal received: as shown, and as sent; whether dsh has
/// closed it.
type Received = (vt100::Parser, Vec<u8>, bool);

impl Terminal {
    fn start(p: &super::Place, script: &Path, extra: &[&str]) -> Terminal {
        let mut args: Vec<std::ffi::OsString> =
            vec!["chat".into(), "--script".into(), script.into()];
        args.push("--sessions-dir".into());
        args.push(p.sessions.clone().into());
        args.extend(extra.iter().map(Into::into));
        Terminal::run(p, &args)
    }

    /// `dsh ARGS` on a fresh pseudo-terminal, in the test's workspace.
    fn run(p: &super::Place, args: &[std::ffi::OsString]) -> Terminal {
        let size = nix::pty::Winsize {
            ws_row: 40,
            ws_col: 110,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        let pty = nix::pty::openpty(Some(&size), None).unwrap();
        std::fs::create_dir_all(p.base.join("home")).unwrap();
        let slave = std::fs::File::from(pty.slave);
        let child = Command::new(env!("CARGO_BIN_EXE_dsh"))
            .args(args)
            .current_dir(&p.ws)
            .env("HOME", p.base.join("home"))
            .env("TERM", "xterm-256color")
            .env_remove("DEEPSEEK_API_KEY")
            .env_remove("DSH_APPROVAL")
            .env_remove("DSH_PERMISSION_MODE")
            .env_remove("DSH_BASE_URL")
            .env_remove("DSH_MODEL")
            .stdin(slave.try_clone().unwrap())
            .stdout(slave.try_clone().unwrap())
            .stderr(slave)
            .spawn()
            .unwrap();
        let master = std::fs::File::from(pty.master);
        let seen = std::sync::Arc::new((
            std::sync::Mutex::new((
                vt100::Parser::new(40.try_into().unwrap(), 110.try_into().unwrap(), 0),
                Vec::new(),
                false,
            )),
            std::sync::Condvar::new(),
        ));
        let (mut reader, mut answer, shared) = (
            master.try_clone().unwrap(),
            master.try_clone().unwrap(),
            seen.clone(),
        );
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Ends when dsh has closed the terminal (EIO).
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let (lock, changed) = &*shared;
                let mut state = lock.lock().unwrap();
                state.0.process(&buf[..n]);
                state.1.extend_from_slice(&buf[..n]);
                if buf[..n].windows(4).any(|w| w == b"\x1b[6n") {
                    let (row, col) = state.0.screen().cursor_position();
                    let _ = write!(answer, "\x1b[{};{}R", row + 1, col + 1);
                }
                changed.notify_all();
            }
            let (lock, changed) = &*shared;
            lock.lock().unwrap().2 = true;
            changed.notify_all();
        });
        Terminal {
            child,
            master,
            seen,
        }
    }

    /// Waits until the screen shows `needle`; fails with the screen.
    fn expect(&self, needle: &str) {
        let (lock, changed) = &*self.seen;
        let deadline = std::time::Instant::now() + WAIT;
        let mut state = lock.lock().unwrap();
        while !state.0.screen().contents().contains(needle) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            assert!(
                !left.is_zero(),
                "the screen never showed `{needle}`:\n{}",
                state.0.screen().contents()
            );
            state = changed.wait_timeout(state, left).unwrap().0;
        }
    }

    /// Waits (at most [`WAIT`]) until `done` holds of what the terminal
    /// received and whether dsh closed it; returns both.
    fn wait(&self, done: impl Fn(&str, bool) -> bool) -> (String, bool) {
        let (lock, changed) = &*self.seen;
        let state = lock.lock().unwrap();
        let (state, _) = changed
            .wait_timeout_while(state, WAIT, |s| !done(&String::from_utf8_lossy(&s.1), s.2))
            .unwrap();
        (String::from_utf8_lossy(&state.1).into_owned(), state.2)
    }

    /// Waits until the editor has the terminal raw (reading a line: Ctrl-C
    /// is then a key, not a character the line discipline swallows).
    fn until_raw(&self) {
        super::until_blocking("the editor never read again", || {
            nix::sys::termios::tcgetattr(&self.master).is_ok_and(|t| {
                !t.local_flags
                    .contains(nix::sys::termios::LocalFlags::ICANON)
            })
        });
    }

    /// Types `keys` once the editor reads (typed earlier, the line
    /// discipline may hold or drop them).
    fn keys(&mut self, keys: &str) {
        self.until_raw();
        self.master.write_all(keys.as_bytes()).unwrap();
        self.master.flush().unwrap();
    }

    /// Keeps what the terminal received and what it shows as artefacts.
    fn keep(&self, name: &str) -> String {
        let artefacts = Path::new(env!("CARGO_TARGET_TMPDIR")).join("artefacts");
        std::fs::create_dir_all(&artefacts).unwrap();
        let state = self.seen.0.lock().unwrap();
        std::fs::write(artefacts.join(format!("{name}.pty.txt")), &state.1).unwrap();
        let shown = state.0.screen().contents();
        std::fs::write(artefacts.join(format!("{name}.screen.txt")), &shown).unwrap();
        shown
    }
}

/// At a terminal: a typed prompt streams its answer as rendered Markdown
/// with the tool lines and a status line; Ctrl-C mid-turn cancels the turn
/// and the prompt comes back; Ctrl-D leaves with exit 0 and the session
/// saved. The screen is kept as an artefact (`chat-terminal.screen.txt`).
#[test]
fn at_a_terminal_a_turn_streams_ctrl_c_cancels_and_ctrl_d_leaves() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-chat");
    let script = script(
        &p,
        "script.json",
        &[
            call("echo hi"),
            json!({
                "reasoning": "Let me think about\nthe answer carefully",
                "text": "Here is a **bold** answer\n- one item\n- `code` item"
            }),
            call(HOLD),
            json!({"text": "never shown"}),
        ],
    );
    let mut term = Terminal::start(&p, &script, &["--approval", "never"]);
    term.expect("workspace-write");
    term.expect("› ");
    term.keys("hello\r");
    term.expect("▸ bash echo hi");
    // The reasoning is folded to one line, before the answer.
    term.expect("· thought: Let me think about the answer carefully (7 words)");
    term.expect("Here is a bold answer");
    term.expect("• code item");
    term.expect("── turn 1 completed");
    term.expect("in / ");
    term.keys("wait for it\r");
    term.expect("▸ bash echo holding");
    term.keys("\x03");
    term.expect("── turn 2 aborted");
    term.expect("cancelling the turn");
    term.keys("\x04");
    let status = super::wait_bounded(&mut term.child, "dsh chat at a terminal");
    let shown = term.keep("chat-terminal");
    assert!(status.success(), "{status:?}\n{shown}");
    assert!(
        shown.contains("continue with: dsh chat --resume"),
        "{shown}"
    );
    // Nothing the model wrote as markup is left on the screen.
    assert!(!shown.contains("**bold**"), "{shown}");
    let id = session_id(&shown);
    assert_eq!(count(&events(&p, &id), "turn/start"), 2);
    assert!(
        p.base.join("home/.dsh/history").exists(),
        "no history was kept"
    );
}

/// At a terminal: Alt-Enter puts a new line in the message; an approval is
/// answered inline; two Ctrl-C in a row with nothing running leave (exit
/// 0, the session saved).
#[test]
fn at_a_terminal_a_message_spans_lines_approvals_are_inline_and_ctrl_c_twice_leaves() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-chat");
    let touched = p.outside.join("touched");
    let script = script(
        &p,
        "script.json",
        &[escalated_touch(&touched), json!({"text": "touched it"})],
    );
    let mut term = Terminal::start(&p, &script, &["--approval", "ask"]);
    term.expect("› ");
    term.keys("first line\x1b\rsecond line\r");
    term.expect("approval 1:");
    term.keys("y\r");
    term.expect("approval 1: allowed once");
    term.expect("── turn 1 completed");
    // Each Ctrl-C once the editor reads again: the first of a pair says
    // so, the second leaves (a loaded machine may let 2 s pass between
    // two: then the next one is the second).
    let mut status = None;
    for said in 1..=5 {
        term.until_raw();
        term.keys("\x03");
        let hint = "Ctrl-C again within 2 s";
        if term
            .wait(|raw, closed| closed || raw.matches(hint).count() >= said)
            .1
        {
            status = Some(super::wait_bounded(
                &mut term.child,
                "dsh chat at a terminal",
            ));
            break;
        }
        term.until_raw();
        term.keys("\x03");
        if term
            .wait(|raw, closed| closed || raw.matches(hint).count() > said)
            .1
        {
            status = Some(super::wait_bounded(
                &mut term.child,
                "dsh chat at a terminal",
            ));
            break;
        }
    }
    let shown = term.keep("chat-terminal-approval");
    let status = status.unwrap_or_else(|| panic!("Ctrl-C twice did not leave:\n{shown}"));
    assert!(status.success(), "{status:?}\n{shown}");
    assert!(touched.exists(), "{shown}");
    let id = session_id(&shown);
    let prompt = events(&p, &id)
        .into_iter()
        .find(|e| e["type"] == "user/message" && e["data"]["source"]["kind"] == "user")
        .unwrap();
    assert_eq!(
        prompt["data"]["content"][0]["text"], "first line\nsecond line",
        "{prompt}"
    );
}

/// A question left unanswered past `--approval-timeout` is refused, and
/// its call does not run.
#[test]
fn an_unanswered_question_is_refused_when_it_times_out() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-chat");
    let never = p.outside.join("never");
    let script = script(
        &p,
        "script.json",
        &[escalated_touch(&never), json!({"text": "went on"})],
    );
    let mut chat = Session::start(
        &p,
        &script,
        &["--approval", "ask", "--approval-timeout", "1"],
    );
    chat.send("go");
    chat.expect("approval 1:");
    chat.expect("approval 1 unanswered after 1.0 s: refused");
    chat.expect("── turn 1 completed");
    chat.finish_ok();
    assert!(!never.exists());
}

/// `dsh` alone on a terminal opens a chat (here it says no model is
/// configured, as `dsh chat` does); elsewhere it prints the help and exits 2.
#[test]
fn dsh_alone_opens_a_chat_on_a_terminal_and_prints_the_help_elsewhere() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-chat");
    let mut term = Terminal::run(&p, &[]);
    term.expect("dsh chat: no model is configured");
    let status = super::wait_bounded(&mut term.child, "dsh alone");
    assert_eq!(status.code(), Some(2));
    let out = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .current_dir(&p.ws)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = super::output_bounded(out, super::DEADLINE, "dsh alone, no terminal");
    assert_eq!(out.status.code(), Some(2));
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("Usage: dsh"), "{help}");
    assert!(help.contains("chat"), "{help}");
}
