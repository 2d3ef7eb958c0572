//! `dsh demo`, `dsh workflow` and `dsh ralph` as a user runs them.

use super::Bounded;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::Ordering;

use dsh::kernel::scratch::fresh_dir;

fn workdir() -> PathBuf {
    let dir = fresh_dir("dsh-multi").unwrap();
    std::fs::create_dir_all(dir.join("sessions")).unwrap();
    dir
}

fn dsh(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .args(args)
        .arg("--sessions-dir")
        .arg(dir.join("sessions"))
        .current_dir(dir)
        .env_remove("DSH_SESSIONS_DB")
        .bounded_output()
        .expect("the dsh binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Session ids under the store, with their headers.
fn headers(dir: &Path) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir.join("sessions")).unwrap() {
        let log = entry.unwrap().path().join("session.jsonl");
        if let Ok(t) = std::fs::read_to_string(&log) {
            out.push(serde_json::from_str(t.lines().next().unwrap()).unwrap());
        }
    }
    out
}

/// A child's label, its log lines and its failure carry terminal escapes
/// (from a model, through the script): each line prints them inert, with
/// the failure's code.
#[test]
fn a_workflows_lines_print_hostile_text_inert() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(
        dir.join("fan.js"),
        "log('note \\u001b]0;title\\u0007 here');\nconst r = await agent('x', {label: 'w\\u001b[2J\\u001b]52;c;Zm9v\\u0007one'});\nreturn {r};\n",
    )
    .unwrap();
    let refusal = serde_json::json!({"error": {"code": "INVALID_REQUEST", "message": "no \u{1b}]8;;http://evil.example/\u{1b}\\link\u{1b}]8;;\u{1b}\\ here", "status": 400}});
    std::fs::write(
        dir.join("fails.json"),
        serde_json::json!({"steps": [refusal]}).to_string(),
    )
    .unwrap();
    let run = dsh(&["workflow", "fan.js", "--script", "fails.json"], &dir);
    let err = text(&run.stderr);
    assert_eq!(run.status.code(), Some(4), "{err}");
    assert!(
        !err.chars().any(|c| c.is_control() && c != '\n'),
        "a control character reached stderr: {err:?}"
    );
    assert!(err.contains("[fan] note  here"), "{err}");
    assert!(err.contains("started: wone (session "), "{err}");
    assert!(err.contains("agent #1 wone failed after "), "{err}");
    assert!(err.contains(": INVALID_REQUEST: no link here"), "{err}");
}

/// What a terminal shows after `raw` (a carriage return goes back to the
/// line's start, `ESC [2K` clears it): the lines as they stand at the end.
fn screen(raw: &str) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    let mut rest = raw;
    while let Some(c) = rest.chars().next() {
        if let Some(after) = rest.strip_prefix("\u{1b}[2K") {
            line.clear();
            rest = after;
            continue;
        }
        match c {
            '\n' => lines.push(std::mem::take(&mut line)),
            '\r' => {}
            c => line.push(c),
        }
        rest = &rest[c.len_utf8()..];
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// On a terminal, a workflow of five children keeps one progress line
/// (running, done, failed, time, tokens) redrawn in place under its lines,
/// and ends with the summary table; the capture is kept as an artefact
/// (`workflow-progress.pty.txt` and what the screen shows).
#[test]
fn on_a_terminal_a_workflow_shows_its_progress_line_and_ends_with_the_table() {
    use std::io::Read;
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(
        dir.join("five.js"),
        "const r = await Promise.all([1, 2, 3, 4, 5].map(n => agent('line ' + n, {label: 'w' + n})));\nreturn {r};\n",
    )
    .unwrap();
    let pty = nix::pty::openpty(None, None).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_SESSIONS_DB")
        .args(["workflow", "five.js", "--demo-model", "--sessions-dir"])
        .arg(dir.join("sessions"))
        .current_dir(&dir)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::from(pty.slave))
        .spawn()
        .unwrap();
    // Read the terminal on a thread: it ends when dsh has closed it (EIO).
    let mut master = std::fs::File::from(pty.master);
    let reader = std::thread::spawn(move || {
        let mut all = Vec::new();
        let mut buf = [0u8; 4096];
        while let Ok(n) = master.read(&mut buf) {
            if n == 0 {
                break;
            }
            all.extend_from_slice(&buf[..n]);
        }
        all
    });
    let out = super::output_bounded(child, super::DEADLINE, "dsh workflow on a pty");
    assert!(out.status.success(), "{}", text(&out.stdout));
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done.send(reader.join());
    });
    let raw = finished
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the terminal closed")
        .unwrap();
    let raw = String::from_utf8_lossy(&raw).into_owned();
    let shown = screen(&raw);
    let artefacts = Path::new(env!("CARGO_TARGET_TMPDIR")).join("artefacts");
    std::fs::create_dir_all(&artefacts).unwrap();
    std::fs::write(artefacts.join("workflow-progress.pty.txt"), &raw).unwrap();
    std::fs::write(
        artefacts.join("workflow-progress.screen.txt"),
        shown.join("\n"),
    )
    .unwrap();
    // The progress line was drawn in place, again after each line, and
    // counted the children as they went.
    let drawn: Vec<&str> = raw
        .split("\r\u{1b}[2K")
        .filter(|p| p.starts_with("[five] ") && p.contains(" running · "))
        .collect();
    assert!(drawn.len() >= 10, "{raw:?}");
    // Each child's end was counted as it came (whether two ran at once is
    // the scheduler's business: a demo child can end before the next starts).
    for n in 1..=5 {
        let done = format!(" running · {n} done · ");
        assert!(drawn.iter().any(|p| p.contains(&done)), "{n}: {drawn:?}");
    }
    assert!(
        drawn.iter().any(|p| p.starts_with("[five] 1 running")),
        "{drawn:?}"
    );
    assert!(
        drawn
            .iter()
            .any(|p| p.starts_with("[five] 0 running · 5 done · 0 failed · ")),
        "{drawn:?}"
    );
    // What stays on the screen: the lines, then the table; no progress line.
    assert!(
        !shown.iter().any(|l| l.contains(" running · ")),
        "{shown:#?}"
    );
    let table = shown
        .iter()
        .position(|l| l.starts_with("children: 5 started · 5 completed · 0 failed · "))
        .unwrap_or_else(|| panic!("no table: {shown:#?}"));
    let rows: Vec<&String> = shown[table + 2..].iter().take(5).collect();
    assert!(rows.iter().all(|r| r.contains(" completed ")), "{shown:#?}");
    // The result on stdout holds no terminal control.
    assert!(!text(&out.stdout).contains('\u{1b}'));
}

/// `--tree` ends a workflow and a Ralph loop with the run's record: every
/// node of its tree under its parent, with how it ended and how long it ran.
#[test]
fn tree_ends_a_run_with_its_record_of_every_node_and_its_end() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/fan.js");
    for (argv, children) in [
        (
            vec![
                "workflow",
                script.to_str().unwrap(),
                "--demo-model",
                "--tree",
            ],
            3,
        ),
        (
            vec![
                "ralph",
                "Write NOTES.md",
                "--max-rounds",
                "2",
                "--demo-model",
                "--tree",
            ],
            2,
        ),
    ] {
        let run = dsh(&argv, &dir);
        let err = text(&run.stderr);
        assert!(run.status.success(), "{err}");
        let record: Vec<&str> = err
            .lines()
            .skip_while(|l| *l != "the run's tree:")
            .skip(1)
            .take_while(|l| !l.is_empty())
            .collect();
        assert!(record[0].starts_with("root [root] active "), "{err}");
        // Each child's agent, stopped, indented under its scope, timed.
        let drivers: Vec<&&str> = record
            .iter()
            .filter(|l| l.trim_start().starts_with("driver/") && l.contains(" disposed "))
            .collect();
        assert_eq!(drivers.len(), children, "{err}");
        for d in drivers {
            let depth = d.len() - d.trim_start().len();
            assert!(depth >= 6, "{d}");
            assert!(d.contains(" ms") || d.contains(" s"), "{d}");
        }
    }
}

/// A child whose model call is refused with 429 says so as it waits, on
/// the workflow's own lines; with a priced route, its line and the table
/// give its cost.
#[test]
fn a_childs_retries_and_cost_are_on_the_workflows_lines() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let (url, server) = super::run::deepseek_mock(
        vec![
            vec![super::run::RATE_LIMITED],
            vec![
                r#"{"choices":[{"delta":{"content":"done"}}]}"#,
                r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
                r#"{"choices":[],"usage":{"prompt_tokens":1000,"completion_tokens":500}}"#,
            ],
        ],
        0,
    );
    std::fs::write(
        dir.join("one.js"),
        "const r = await agent('go', {label: 'solo'});\nreturn {r};\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("cordis.yml"),
        format!(
            "plugins:\n  - {{ id: services, name: agent-services, config: {{ approval: never }} }}\n  - {{ id: ep, name: openai, config: {{ base_url: \"{url}\", price: {{ input: 2.0, output: 8.0 }} }} }}\n"
        ),
    )
    .unwrap();
    let run = dsh(
        &[
            "workflow",
            "one.js",
            "--config",
            "cordis.yml",
            "--model",
            "m",
        ],
        &dir,
    );
    let err = text(&run.stderr);
    assert!(run.status.success(), "{err}");
    let _ = server.join();
    assert!(
        err.lines()
            .any(|l| l.starts_with("[one] agent #1 retrying in ")
                && l.contains("(HTTP 429 RATE_LIMITED")),
        "{err}"
    );
    assert!(
        err.lines()
            .any(|l| l.starts_with("[one] agent #1 solo completed in ")
                && l.ends_with(" · cost 0.0060")),
        "{err}"
    );
    assert!(err.contains("  tokens (cost)  "), "{err}");
    assert!(err.contains("1.5k (0.0060)"), "{err}");
}

/// The README's tour runs `demo/fan.js` from the repository: three children
/// by default, one per topic given with `--args`.
#[test]
fn the_tours_workflow_script_fans_out_to_its_topics() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("demo/fan.js");
    let script = script.to_str().unwrap();
    for (args, topics) in [(None, 3), (Some(r#"{"topics":["a","b"]}"#), 2)] {
        let mut argv = vec!["workflow", script, "--demo-model", "--cwd", "."];
        argv.extend(args.map(|a| ["--args", a]).into_iter().flatten());
        let run = dsh(&argv, &dir);
        let (out, err) = (text(&run.stdout), text(&run.stderr));
        assert!(run.status.success(), "{out}\n{err}");
        let result: serde_json::Value = serde_json::from_str(&out).unwrap();
        let lines = result["lines"].as_array().unwrap();
        assert_eq!(lines.len(), topics, "{out}");
        assert_eq!(err.matches("child session:").count(), topics, "{err}");
    }
}

#[test]
fn the_demo_runs_a_fan_out_and_a_ralph_loop_and_says_where_the_logs_are() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let run = dsh(&["demo", "--cwd", "."], &dir);
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    assert!(out.contains("workflow result (3 subagents)"), "{out}");
    // Each part ends with its table: the fan-out's children, the rounds.
    assert!(
        err.contains("children: 3 started · 3 completed · 0 failed"),
        "{err}"
    );
    assert!(
        err.contains("rounds: 3 started · 3 completed · 0 failed"),
        "{err}"
    );
    assert!(out.contains(" bytes)"), "the handoff's size: {out}");
    assert!(out.contains("supervised actor"), "{out}");
    assert!(out.contains("round 3: complete"), "{out}");
    assert!(out.contains("the worker's claim"), "{out}");
    assert!(
        err.contains("live actor tree") && err.contains("[workflow]"),
        "{err}"
    );
    let hs = headers(&dir);
    assert_eq!(
        hs.len(),
        1 + 3 + 3,
        "coordinator, three fan-out children, three rounds"
    );
    let coordinator = hs
        .iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    let children = hs
        .iter()
        .filter(|h| h["parentSession"] == coordinator["id"] && h["origin"] == "subagent")
        .count();
    assert_eq!(children, 6);
    for h in &hs {
        let path = dir
            .join("sessions")
            .join(h["id"].as_str().unwrap())
            .join("session.jsonl");
        assert!(
            out.contains(&path.display().to_string()),
            "{} not listed",
            path.display()
        );
    }
}

#[test]
fn a_workflow_script_returns_its_value_or_its_error_line() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(
        dir.join("fan.js"),
        "const r = await Promise.all(args.topics.map(t => agent('Write one line about ' + t + '.')));\nreturn {r};\n",
    )
    .unwrap();
    let run = dsh(
        &[
            "workflow",
            "fan.js",
            "--demo-model",
            "--args",
            r#"{"topics": ["actors", "teardown"]}"#,
        ],
        &dir,
    );
    assert!(run.status.success(), "{}", text(&run.stderr));
    let value: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(value["r"].as_array().unwrap().len(), 2);
    assert!(value["r"][0].as_str().unwrap().starts_with("actors:"));

    std::fs::write(dir.join("bad.js"), "const a = 1;\na.b.c();\nreturn 1;\n").unwrap();
    let run = dsh(&["workflow", "bad.js", "--demo-model"], &dir);
    assert_eq!(run.status.code(), Some(1));
    let err = text(&run.stderr);
    assert!(err.contains("TypeError") && err.contains("line 2"), "{err}");

    let run = dsh(
        &["workflow", "fan.js", "--demo-model", "--args", "{nope"],
        &dir,
    );
    assert_eq!(run.status.code(), Some(2));
    assert!(text(&run.stderr).contains("--args is not valid JSON"));

    let run = dsh(&["workflow", "fan.js"], &dir);
    assert_eq!(run.status.code(), Some(2));
    assert!(
        text(&run.stderr).contains("--demo-model"),
        "{}",
        text(&run.stderr)
    );
}

/// A workflow whose children all fail still prints what the script
/// returned, lists each failure with its cause on stderr and exits 4;
/// `--allow-failures` lists them and exits 0.
#[test]
fn a_workflow_whose_children_fail_exits_4_and_lists_them() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(
        dir.join("fan.js"),
        "const r = await Promise.all(['a', 'b'].map(t => agent('about ' + t, {label: 'topic ' + t})));\nreturn {r};\n",
    )
    .unwrap();
    let refusal = serde_json::json!({"error": {"code": "INVALID_REQUEST", "message": "the model refused the request", "status": 400}});
    std::fs::write(
        dir.join("fails.json"),
        serde_json::json!({"steps": [refusal, refusal, refusal, refusal]}).to_string(),
    )
    .unwrap();
    let run = dsh(&["workflow", "fan.js", "--script", "fails.json"], &dir);
    let err = text(&run.stderr);
    assert_eq!(run.status.code(), Some(4), "{err}");
    let value: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(value["r"], serde_json::json!([null, null]));
    assert!(err.contains("2 of 2 children failed"), "{err}");
    for label in ["topic a", "topic b"] {
        // As it ends, and again in the list at the end: the code and the
        // message the session log holds.
        let said: Vec<&str> = err
            .lines()
            .filter(|l| l.contains(label) && l.contains(" failed after "))
            .collect();
        assert_eq!(said.len(), 2, "{label}: {err}");
        for line in said {
            assert!(
                line.contains(": INVALID_REQUEST: the model refused the request"),
                "{line}"
            );
        }
    }

    let run = dsh(
        &[
            "workflow",
            "fan.js",
            "--script",
            "fails.json",
            "--allow-failures",
        ],
        &dir,
    );
    let err = text(&run.stderr);
    assert_eq!(run.status.code(), Some(0), "{err}");
    assert!(err.contains("2 of 2 children failed (allowed)"), "{err}");
}

/// A Ralph loop's exit code follows how it ended: a worker that reports
/// a blocker ends it `3`, a round whose model fails ends it `1`.
#[test]
fn a_ralph_loop_exits_3_when_blocked_and_1_when_a_round_fails() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let blocked = serde_json::json!({"tool_calls": [{"name": "report", "arguments": {
        "status": "blocked", "summary": "tried", "blocker": "the API key is missing"
    }}]});
    std::fs::write(
        dir.join("blocked.json"),
        serde_json::json!({"steps": [blocked, {"text": "blocked"}]}).to_string(),
    )
    .unwrap();
    let run = dsh(&["ralph", "Ship it", "--script", "blocked.json"], &dir);
    let said = format!("{}{}", text(&run.stdout), text(&run.stderr));
    assert_eq!(run.status.code(), Some(3), "{said}");
    assert!(said.contains("the API key is missing"), "{said}");

    let refusal = serde_json::json!({"error": {"code": "INVALID_REQUEST", "message": "the model refused the request", "status": 400}});
    std::fs::write(
        dir.join("fails.json"),
        serde_json::json!({"steps": [refusal, refusal]}).to_string(),
    )
    .unwrap();
    let run = dsh(&["ralph", "Ship it", "--script", "fails.json"], &dir);
    let said = format!("{}{}", text(&run.stdout), text(&run.stderr));
    assert_eq!(run.status.code(), Some(1), "{said}");
    // The failed round says its code as it ends, and the table lists it.
    let err = text(&run.stderr);
    assert!(
        err.lines()
            .any(|l| l.starts_with("[ralph] round 1 failed after ")
                && l.ends_with(": INVALID_REQUEST: the model refused the request")),
        "{err}"
    );
    assert!(
        err.contains("rounds: 1 started · 0 completed · 1 failed"),
        "{err}"
    );
    assert!(
        err.lines().any(
            |l| l.split_whitespace().collect::<Vec<_>>()[..].starts_with(&[
                "1",
                "round",
                "1",
                "-",
                "failed",
                "(INVALID_REQUEST)"
            ])
        ),
        "{err}"
    );
}

#[test]
fn a_ralph_loop_cut_after_a_round_resumes_from_its_handoff() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let run = dsh(
        &[
            "ralph",
            "Write NOTES.md",
            "--max-rounds",
            "5",
            "--demo-model",
        ],
        &dir,
    );
    let out = text(&run.stdout);
    assert!(run.status.success(), "{out}\n{}", text(&run.stderr));
    assert!(out.contains("round 3: complete"), "{out}");
    let coordinator = headers(&dir)
        .into_iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    let id = coordinator["id"].as_str().unwrap().to_owned();
    // Cut the coordinator's log where a kill during round 3 leaves it: the
    // records of rounds 1 and 2, nothing after.
    let log = dir.join("sessions").join(&id).join("session.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect();
    let cut = lines
        .iter()
        .position(|l| l.contains("\"ralph/round\"") && l.contains("\"round\":3"))
        .unwrap();
    std::fs::write(&log, lines[..cut].join("\n") + "\n").unwrap();
    let run = dsh(&["ralph", "--resume", &id, "--demo-model"], &dir);
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    assert!(err.contains("after round 2 of 5"), "{err}");
    assert!(out.contains("round 3: complete"), "{out}");
    assert!(
        !out.contains("round 1:") && !out.contains("round 2:"),
        "{out}"
    );
    // A finished loop is not resumed again.
    let run = dsh(&["ralph", "--resume", &id, "--demo-model"], &dir);
    assert_eq!(run.status.code(), Some(2));
    assert!(
        text(&run.stderr).contains("already ended"),
        "{}",
        text(&run.stderr)
    );
}

/// A minimal OpenAI-compatible endpoint for Ralph workers: each round's
/// worker reports `continue`, round 3 `complete`; after the report the
/// worker answers `ok`. A request for the round named in `stall` gets no
/// answer (the connection is held) and is announced on `stalled`.
struct Endpoint {
    url: String,
    stalled: std::sync::mpsc::Receiver<()>,
    stall: std::sync::Arc<std::sync::atomic::AtomicU32>,
}

fn endpoint() -> Endpoint {
    use std::io::{BufRead, BufReader, Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let (tx, stalled) = std::sync::mpsc::channel();
    let stall = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    let stall_at = stall.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let mut reader = BufReader::new(conn.try_clone().unwrap());
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                let lower = line.to_ascii_lowercase();
                if let Some(v) = lower.strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
            }
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).is_err() {
                continue;
            }
            let request: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            let messages = request["messages"].as_array().cloned().unwrap_or_default();
            let prompt = messages
                .iter()
                .find(|m| m["role"] == "user")
                .map(|m| m["content"].to_string())
                .unwrap_or_default();
            let round: u32 = prompt
                .split("Ralph round ")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if round == stall_at.load(std::sync::atomic::Ordering::SeqCst) {
                held.push(conn);
                let _ = tx.send(());
                continue;
            }
            let answered = messages.last().is_some_and(|m| m["role"] == "tool");
            let delta = if answered {
                serde_json::json!({"content": "ok"})
            } else {
                let status = if round >= 3 { "complete" } else { "continue" };
                let handoff = serde_json::json!({
                    "status": status,
                    "summary": format!("round {round} work"),
                    "next_steps": [format!("round {}", round + 1)]
                });
                serde_json::json!({"tool_calls": [{
                    "index": 0, "id": format!("call_{round}"), "type": "function",
                    "function": {"name": "report", "arguments": handoff.to_string()}
                }]})
            };
            let finish = if answered { "stop" } else { "tool_calls" };
            let chunk = |delta: serde_json::Value, finish: Option<&str>| {
                serde_json::json!({
                    "id": "x", "object": "chat.completion.chunk", "model": "m",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
                })
            };
            let sse = format!(
                "data: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
                chunk(delta, None),
                chunk(serde_json::json!({}), Some(finish))
            );
            let _ = write!(
                conn,
                "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{sse}",
                sse.len()
            );
        }
    });
    Endpoint {
        url,
        stalled,
        stall,
    }
}

#[test]
fn a_killed_ralph_loop_resumes_after_its_last_completed_round() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let server = endpoint();
    server.stall.store(2, Ordering::SeqCst);
    let mut child = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .args([
            "ralph",
            "Write NOTES.md",
            "--max-rounds",
            "5",
            "--model",
            "m",
            "--base-url",
        ])
        .arg(&server.url)
        .arg("--sessions-dir")
        .arg(dir.join("sessions"))
        .current_dir(&dir)
        .env("DSH_API_KEY", "test-key")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Round 2's worker is waiting on the model: round 1 is on disk.
    server
        .stalled
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("round 2 reaches the model");
    child.kill().unwrap();
    child.wait().unwrap();
    let coordinator = headers(&dir)
        .into_iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    let id = coordinator["id"].as_str().unwrap().to_owned();
    server.stall.store(0, Ordering::SeqCst);
    let run = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .args(["ralph", "--resume", &id, "--model", "m", "--base-url"])
        .arg(&server.url)
        .arg("--sessions-dir")
        .arg(dir.join("sessions"))
        .current_dir(&dir)
        .env("DSH_API_KEY", "test-key")
        .bounded_output()
        .unwrap();
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    assert!(err.contains("after round 1 of 5"), "{err}");
    assert!(
        out.contains("round 2: continue") && out.contains("round 3: complete"),
        "{out}"
    );
    assert!(!out.contains("round 1:"), "{out}");
}

/// A reviewer defined once in the workspace's `.dsh/agents`.
const REVIEWER: &str = "---\nname: reviewer\ndescription: Reviews one file for bugs.\ntools: [read, grep]\npermission_mode: read-only\nmax_steps: 4\n---\nYou review one file and name its bugs.\n";

/// `agent(prompt, {agent: "reviewer"})` five times in parallel: five
/// children, each made from the definition (its body first in the system
/// prompt, its tools only, its mode, its name as the label); `dsh agents
/// list|show` say what was found and from where, and an unknown name is
/// refused naming what exists.
#[test]
fn a_workflow_fans_out_to_a_named_agent_five_times() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::create_dir_all(dir.join(".dsh/agents")).unwrap();
    std::fs::write(dir.join(".dsh/agents/reviewer.md"), REVIEWER).unwrap();
    std::fs::write(
        dir.join("five.js"),
        "return await Promise.all([1, 2, 3, 4, 5].map(i => agent('Review file ' + i + '.', {agent: 'reviewer'})));\n",
    )
    .unwrap();
    let run = dsh(&["workflow", "five.js", "--demo-model"], &dir);
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    let children: Vec<serde_json::Value> = headers(&dir)
        .into_iter()
        .filter(|h| h.get("parentSession").is_some())
        .collect();
    assert_eq!(children.len(), 5, "{err}");
    for child in &children {
        let id = child["id"].as_str().unwrap();
        let log = log_of(&dir, id);
        let events: Vec<serde_json::Value> = log
            .lines()
            .skip(1)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let of = |kind: &str| {
            events
                .iter()
                .find(|e| e["type"] == kind)
                .unwrap_or_else(|| panic!("{kind}: {log}"))
        };
        let header = &of("request/header")["data"]["header"];
        let system = header["system"].as_str().unwrap();
        assert!(
            system.starts_with("You review one file and name its bugs.\n"),
            "{system}"
        );
        let mut tools: Vec<&str> = header["tools"]
            .as_array()
            .unwrap_or_else(|| panic!("{header}"))
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        tools.sort();
        assert_eq!(tools, ["grep", "read"], "{header}");
        assert_eq!(of("sandbox/mode")["data"]["mode"], "read-only");
        assert_eq!(of("subagent/descriptor")["data"]["label"], "reviewer");
    }
    let agents = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_dsh"))
            .arg("agents")
            .args(args)
            .current_dir(&dir)
            .bounded_output()
            .expect("the dsh binary runs")
    };
    let list = agents(&["list"]);
    let listed = text(&list.stdout);
    assert!(list.status.success(), "{listed}");
    assert!(
        listed.starts_with("reviewer  Reviews one file for bugs."),
        "{listed}"
    );
    assert!(listed.contains(".dsh/agents/reviewer.md (dsh)"), "{listed}");
    let show = agents(&["show", "reviewer"]);
    let shown = text(&show.stdout);
    assert!(
        shown.contains("tools: read, grep") && shown.contains("permission mode: read-only"),
        "{shown}"
    );
    std::fs::write(
        dir.join("bad.js"),
        "return await agent('x', {agent: 'nobody'});\n",
    )
    .unwrap();
    // `dsh run --agent`: the top-level agent is the definition too.
    let before: Vec<String> = headers(&dir)
        .iter()
        .map(|h| h["id"].as_str().unwrap().to_owned())
        .collect();
    let ran = dsh(
        &[
            "run",
            "--agent",
            "reviewer",
            "--demo-model",
            "Review main.rs.",
        ],
        &dir,
    );
    assert!(ran.status.success(), "{}", text(&ran.stderr));
    let top = headers(&dir)
        .into_iter()
        .find(|h| !before.contains(&h["id"].as_str().unwrap().to_owned()))
        .unwrap();
    let log = log_of(&dir, top["id"].as_str().unwrap());
    assert!(
        log.contains(r#""system":"You review one file and name its bugs.\n"#),
        "{log}"
    );
    let nobody = dsh(&["run", "--agent", "nobody", "--demo-model", "x"], &dir);
    assert_eq!(nobody.status.code(), Some(2));
    assert!(text(&nobody.stderr).contains("no agent definition named `nobody`"));
    let bad = dsh(&["workflow", "bad.js", "--demo-model"], &dir);
    let said = text(&bad.stderr);
    assert!(!bad.status.success(), "{said}");
    assert!(
        said.contains("no agent definition named `nobody` (found: reviewer)"),
        "{said}"
    );
}

/// `--max-depth 0`: the agent may not delegate at all; its `subagent` call
/// is refused with the limit and the flag that sets it.
#[test]
fn max_depth_zero_refuses_any_child() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(
        dir.join("s.json"),
        r#"{"steps": [{"tool_calls": [{"name": "subagent", "arguments": {"description": "try", "prompt": "x"}}]}, {"text": "done"}]}"#,
    )
    .unwrap();
    let run = dsh(
        &["run", "--script", "s.json", "--max-depth", "0", "go"],
        &dir,
    );
    assert!(run.status.success(), "{}", text(&run.stderr));
    let id = headers(&dir)[0]["id"].as_str().unwrap().to_owned();
    let log = log_of(&dir, &id);
    assert!(log.contains("DEPTH_EXCEEDED"), "{log}");
    assert!(
        log.contains(
            "delegation depth 1 exceeds the limit of 0 (the depth cap is set with `--max-depth N`)"
        ),
        "{log}"
    );
    let bad = dsh(
        &["run", "--script", "s.json", "--max-depth", "99", "go"],
        &dir,
    );
    assert_eq!(bad.status.code(), Some(2), "{}", text(&bad.stderr));
}

/// `dsh ralph --agent reviewer`: each round's worker is the definition (its
/// body first in its system prompt, its tools and the handoff's `report`
/// only), still labelled by its round; an unknown name is refused first.
#[test]
fn a_ralph_loop_runs_its_rounds_as_a_named_agent() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::create_dir_all(dir.join(".dsh/agents")).unwrap();
    std::fs::write(dir.join(".dsh/agents/reviewer.md"), REVIEWER).unwrap();
    let run = dsh(
        &[
            "ralph",
            "Write NOTES.md",
            "--max-rounds",
            "5",
            "--agent",
            "reviewer",
            "--demo-model",
            "--tree",
        ],
        &dir,
    );
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    assert!(out.contains("round 3: complete"), "{out}");
    // `--tree` names each worker's definition.
    assert!(
        format!("{out}{err}").contains("«ralph round 2» as reviewer"),
        "{out}\n{err}"
    );
    let rounds: Vec<serde_json::Value> = headers(&dir)
        .into_iter()
        .filter(|h| h.get("parentSession").is_some())
        .collect();
    assert_eq!(rounds.len(), 3, "{err}");
    for round in &rounds {
        let log = log_of(&dir, round["id"].as_str().unwrap());
        assert!(
            log.contains(r#""system":"You review one file and name its bugs.\n"#),
            "{log}"
        );
        assert!(log.contains(r#""label":"ralph round "#), "{log}");
        assert!(!log.contains(r#""name":"bash""#), "{log}");
    }
    let bad = dsh(&["ralph", "x", "--agent", "nobody", "--demo-model"], &dir);
    assert_eq!(bad.status.code(), Some(2));
    assert!(text(&bad.stderr).contains("no agent definition named `nobody` (found: reviewer)"));
}

/// The log of session `id` in the store under `dir`, as written.
fn log_of(dir: &Path, id: &str) -> String {
    std::fs::read_to_string(dir.join("sessions").join(id).join("session.jsonl")).unwrap()
}

/// The events of session `id` in the store under `dir`.
fn events_of(dir: &Path, id: &str) -> Vec<serde_json::Value> {
    log_of(dir, id)
        .lines()
        .skip(1)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// The fan-out limits as flags: `--max-parallel 1` runs the children one
/// after another; `--max-agents 2` stops a script's third `agent()` call,
/// naming the limit and the flag.
#[test]
fn the_fan_out_limits_are_flags() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(
        dir.join("five.js"),
        "return await Promise.all([1, 2, 3, 4, 5].map(i => agent('Write line ' + i + '.')));\n",
    )
    .unwrap();
    let run = dsh(
        &["workflow", "five.js", "--demo-model", "--max-parallel", "1"],
        &dir,
    );
    assert!(run.status.success(), "{}", text(&run.stderr));
    let mut spans: Vec<(u64, u64)> = headers(&dir)
        .into_iter()
        .filter(|h| h.get("parentSession").is_some())
        .map(|h| {
            let events = events_of(&dir, h["id"].as_str().unwrap());
            let time = |kind: &str| {
                events
                    .iter()
                    .find(|e| e["type"] == kind)
                    .and_then(|e| e["time"].as_u64())
                    .unwrap()
            };
            (time("turn/start"), time("turn/end"))
        })
        .collect();
    assert_eq!(spans.len(), 5);
    spans.sort();
    for pair in spans.windows(2) {
        assert!(pair[1].0 >= pair[0].1, "overlapping children: {spans:?}");
    }
    let capped = dsh(
        &["workflow", "five.js", "--demo-model", "--max-agents", "2"],
        &dir,
    );
    let said = text(&capped.stderr);
    assert!(!capped.status.success(), "{said}");
    assert!(
        said.contains("AGENT_CAP: the workflow may start at most 2 agents (`dsh workflow --max-agents N` sets it"),
        "{said}"
    );
    let wide = dsh(
        &["workflow", "five.js", "--demo-model", "--max-parallel", "0"],
        &dir,
    );
    assert_eq!(wide.status.code(), Some(2));
}

/// A definition naming a route sends its children's calls there: two
/// scripted routes, the coordinator on `a`, the reviewer on `b`.
#[test]
fn a_definition_s_model_route_reaches_that_endpoint() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(dir.join("a.json"), r#"{"steps": [{"text": "from a"}]}"#).unwrap();
    std::fs::write(
        dir.join("b.json"),
        r#"{"steps": [{"text": "from b"}, {"text": "from b again"}]}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("two.yml"),
        format!(
            "plugins:\n  - {{ id: services, name: agent-services }}\n  \
             - {{ id: a, name: scripted, config: {{ provider: a, script: {a} }} }}\n  \
             - {{ id: b, name: scripted, config: {{ provider: b, script: {b} }} }}\n",
            a = dir.join("a.json").display(),
            b = dir.join("b.json").display()
        ),
    )
    .unwrap();
    std::fs::create_dir_all(dir.join(".dsh/agents")).unwrap();
    std::fs::write(
        dir.join(".dsh/agents/reviewer.md"),
        "---\nname: reviewer\ndescription: Reviews.\nmodel: b\n---\nYou review.\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("two.js"),
        "return await Promise.all([1, 2].map(i => agent('Review ' + i, {agent: 'reviewer'})));\n",
    )
    .unwrap();
    let run = dsh(
        &[
            "workflow",
            "two.js",
            "--config",
            "two.yml",
            "--provider",
            "a",
        ],
        &dir,
    );
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    assert!(
        out.contains("from b") && out.contains("from b again"),
        "{out}"
    );
    let children: Vec<serde_json::Value> = headers(&dir)
        .into_iter()
        .filter(|h| h.get("parentSession").is_some())
        .collect();
    assert_eq!(children.len(), 2);
    for child in children {
        let events = events_of(&dir, child["id"].as_str().unwrap());
        let context = events
            .iter()
            .find(|e| e["type"] == "request/context")
            .unwrap();
        assert_eq!(context["data"]["provider"], "b", "{context}");
    }
}

/// A hostile definition beside a good one: refused with its file and field
/// on stderr and in `dsh agents list`, and the run goes on with the rest.
#[test]
fn a_hostile_definition_is_refused_and_the_run_goes_on() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    let agents = dir.join(".dsh/agents");
    std::fs::create_dir_all(&agents).unwrap();
    std::fs::write(agents.join("reviewer.md"), REVIEWER).unwrap();
    std::fs::write(
        agents.join("evil.md"),
        "---\nname: evil\ndescription: x\nmodel: \"http://127.0.0.1:9/v1\"\n---\nx\n",
    )
    .unwrap();
    std::fs::write(agents.join("huge.md"), "x".repeat(1 << 20)).unwrap();
    // Claude Code's own file: read, what is not ours said.
    std::fs::create_dir_all(dir.join(".claude/agents")).unwrap();
    std::fs::write(
        dir.join(".claude/agents/explorer.md"),
        "---\nname: explorer\ndescription: Finds code.\ntools: Read, Grep\nhooks:\n  Stop: []\n---\nExplore.\n",
    )
    .unwrap();
    std::os::unix::fs::symlink("/etc/passwd", agents.join("link.md")).unwrap();
    std::fs::write(
        dir.join("one.js"),
        "return await agent('Review a.rs', {agent: 'reviewer'});\n",
    )
    .unwrap();
    let run = dsh(&["workflow", "one.js", "--demo-model"], &dir);
    let err = text(&run.stderr);
    assert!(run.status.success(), "{err}");
    for said in [
        "evil.md: `model`: `http://127.0.0.1:9/v1` is not a route or a model id",
        "huge.md: 1048576 bytes; a definition is at most 65536",
        "link.md: a symbolic link; not followed",
    ] {
        assert!(
            err.contains(&format!(
                "dsh: agent definition refused: {}",
                agents.join(said.split(':').next().unwrap()).display()
            )),
            "{said}: {err}"
        );
        assert!(
            err.contains(said.split_once(": ").unwrap().1),
            "{said}: {err}"
        );
    }
    assert!(
        err.contains("explorer.md: `hooks` are Claude Code's; they never run here"),
        "{err}"
    );
    let list = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(["agents", "list"])
        .current_dir(&dir)
        .bounded_output()
        .unwrap();
    let listed = text(&list.stdout);
    assert!(listed.starts_with("explorer  Finds code."), "{listed}");
    assert!(listed.contains("\nreviewer  "), "{listed}");
    assert_eq!(listed.matches("refused: ").count(), 3, "{listed}");
}

/// The depth cap from a config (`agent-services`' `max_depth`), and a
/// config asking for more than 16 refused naming the field.
#[test]
fn a_config_sets_the_depth_cap() {
    let _sweep = crate::suite::sweep();
    let dir = workdir();
    std::fs::write(
        dir.join("s.json"),
        r#"{"steps": [{"tool_calls": [{"name": "subagent", "arguments": {"description": "try", "prompt": "x"}}]}, {"text": "done"}]}"#,
    )
    .unwrap();
    let config = |depth: u32| {
        format!(
            "plugins:\n  - {{ id: services, name: agent-services, config: {{ max_depth: {depth} }} }}\n  \
             - {{ id: s, name: scripted, config: {{ provider: scripted, script: {} }} }}\n",
            dir.join("s.json").display()
        )
    };
    std::fs::write(dir.join("zero.yml"), config(0)).unwrap();
    std::fs::write(dir.join("deep.yml"), config(17)).unwrap();
    let run = dsh(&["run", "--config", "zero.yml", "go"], &dir);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let id = headers(&dir)[0]["id"].as_str().unwrap().to_owned();
    let log = log_of(&dir, &id);
    assert!(
        log.contains("delegation depth 1 exceeds the limit of 0"),
        "{log}"
    );
    let deep = dsh(&["run", "--config", "deep.yml", "go"], &dir);
    let said = text(&deep.stderr);
    assert!(!deep.status.success(), "{said}");
    assert!(said.contains("`max_depth`: 17 is deeper than 16"), "{said}");
}
