//! `dsh demo`, `dsh workflow` and `dsh ralph` as a user runs them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT: AtomicU64 = AtomicU64::new(0);

fn workdir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "dsh-multi-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(dir.join("sessions")).unwrap();
    dir
}

fn dsh(args: &[&str], dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(args)
        .arg("--sessions-dir")
        .arg(dir.join("sessions"))
        .current_dir(dir)
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_SESSIONS_DB")
        .output()
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

#[test]
fn the_demo_runs_a_fan_out_and_a_ralph_loop_and_says_where_the_logs_are() {
    let dir = workdir();
    let run = dsh(&["demo", "--cwd", "."], &dir);
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    assert!(out.contains("workflow result (3 subagents)"), "{out}");
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

#[test]
fn a_ralph_loop_cut_after_a_round_resumes_from_its_handoff() {
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
