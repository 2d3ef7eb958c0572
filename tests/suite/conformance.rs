//! Replays of the upstream harness's recorded sessions
//! (copied into `tests/fixtures/dsh-sessions`, MIT, with upstream's LICENSE)
//! through `dsh replay`.

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
        .output()
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
            "max-tokens-continue" => {
                let shape = dsh::services::session::compare::shape(
                    &dsh::services::session::jsonl::parse(&std::fs::read_to_string(&out).unwrap())
                        .unwrap()
                        .1,
                );
                let ends: Vec<&str> = shape.iter().map(|t| t.end.as_str()).collect();
                assert_eq!(ends, ["max-tokens", "completed"]);
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
