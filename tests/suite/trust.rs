//! Trust, probed with the real binary as a hostile model would: a scripted
//! model tries to write outside the workspace with bash, `write` and a
//! dangling symlink, and to escalate; under each mode and approval policy
//! nothing lands outside unless a person said yes on the terminal (driven
//! through a pty with util-linux `script`). Child processes never see the
//! keys dsh holds.

use super::Bounded;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::place;
use serde_json::{Value, json};

/// A script file of `steps`, then a final answer.
fn script(p: &super::Place, name: &str, calls: Vec<Value>) -> PathBuf {
    let mut steps: Vec<Value> = calls
        .into_iter()
        .map(|c| json!({"tool_calls": [c]}))
        .collect();
    steps.push(json!({"text": "done"}));
    let file = p.base.join(format!("{name}.json"));
    std::fs::write(&file, json!({"steps": steps}).to_string()).unwrap();
    file
}

fn bash(command: &str) -> Value {
    json!({"name": "bash", "arguments": {"command": command, "description": "probe"}})
}

fn escalated_bash(command: &str) -> Value {
    json!({"name": "bash", "arguments": {
        "command": command, "description": "probe",
        "sandbox_permissions": "danger-full-access", "justification": "the probe needs it"
    }})
}

/// Every way out the model tries, and the files that prove one worked.
fn probes(p: &super::Place) -> (Vec<Value>, Vec<PathBuf>) {
    let o = &p.outside;
    std::os::unix::fs::symlink(o.join("via-dangle"), p.ws.join("dangle")).unwrap();
    let calls = vec![
        bash(&format!("touch {}/by-bash", o.display())),
        bash("echo inside > inside.txt"),
        json!({"name": "write", "arguments": {"file_path": o.join("by-write").display().to_string(), "content": "x"}}),
        json!({"name": "write", "arguments": {"file_path": "dangle", "content": "x"}}),
        escalated_bash(&format!("touch {}/escalated", o.display())),
    ];
    let markers = ["by-bash", "by-write", "via-dangle", "escalated"]
        .iter()
        .map(|m| o.join(m))
        .collect();
    (calls, markers)
}

/// `dsh run` in a new session without a controlling terminal (so nobody
/// can answer on one), with `args` and `env`.
fn run(p: &super::Place, script: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new("setsid");
    c.arg("-w")
        .arg(env!("CARGO_BIN_EXE_dsh"))
        .args(["run", "--script"])
        .arg(script)
        .arg("--cwd")
        .arg(&p.ws)
        .arg("--sessions-dir")
        .arg(&p.sessions)
        .args(args)
        .arg("probe")
        .env_remove("DSH_APPROVAL")
        .env_remove("DSH_PERMISSION_MODE")
        .env_remove("DSH_SANDBOX")
        .stdin(Stdio::null());
    for (k, v) in env {
        c.env(k, v);
    }
    c.bounded_output().expect("dsh runs")
}

/// The one session's events.
fn events(p: &super::Place) -> Vec<Value> {
    let dir = std::fs::read_dir(&p.sessions)
        .unwrap()
        .flatten()
        .find(|e| e.file_name() != "locks")
        .unwrap();
    let text = std::fs::read_to_string(dir.path().join("session.jsonl")).unwrap();
    text.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn outcomes(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == "approval/decided")
        .map(|e| e["data"]["outcome"].as_str().unwrap_or("").to_owned())
        .collect()
}

fn results(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .filter(|e| e["type"] == "tool/result")
        .map(|e| {
            let text = e["data"]["message"]["content"][0]["content"][0]["text"].to_string();
            format!(
                "{} {text}",
                e["data"]["error"]["code"].as_str().unwrap_or("")
            )
        })
        .collect()
}

#[test]
fn under_never_and_read_only_a_scripted_model_cannot_leave_the_workspace() {
    let _sweep = crate::suite::sweep();
    for (args, env, inside_ok) in [
        (vec!["--approval", "never"], vec![], true),
        (
            vec!["--approval", "never", "--sandbox", "landlock"],
            vec![],
            true,
        ),
        (vec![], vec![("DSH_PERMISSION_MODE", "read-only")], false),
        (
            vec!["--permission-mode", "read-only", "--approval", "ask"],
            vec![("DSH_SANDBOX", "landlock")],
            false,
        ),
    ] {
        let p = place("dsh-trust");
        let (calls, markers) = probes(&p);
        let file = script(&p, "probe", calls);
        let out = run(&p, &file, &args, &env);
        let say = format!("{args:?} {env:?}: {}", String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{say}");
        for m in &markers {
            assert!(!m.exists(), "{say}: {} was written", m.display());
        }
        assert_eq!(p.ws.join("inside.txt").exists(), inside_ok, "{say}");
        let events = events(&p);
        // The escalation was asked and refused: `rejected` under never,
        // `unavailable` when nobody can answer.
        let expected = if args.contains(&"never") {
            "rejected"
        } else {
            "unavailable"
        };
        assert_eq!(outcomes(&events), [expected], "{say}");
        // The model was told the mode and the approval policy.
        let told = events
            .iter()
            .find(|e| {
                e["type"] == "user/message"
                    && e["data"]["source"]["plugin"] == "dsh/runtime-context"
            })
            .map(|e| {
                e["data"]["content"][0]["text"]
                    .as_str()
                    .unwrap_or("")
                    .to_owned()
            })
            .unwrap_or_else(|| panic!("{say}: no runtime context"));
        let mode = if inside_ok {
            "workspace-write"
        } else {
            "read-only"
        };
        assert!(
            told.contains(&format!("File policy: {mode}")),
            "{say}: {told}"
        );
        let approval = if args.contains(&"never") {
            "never"
        } else {
            "ask"
        };
        assert!(
            told.contains(&format!("Approval policy: {approval}")),
            "{say}: {told}"
        );
        let results = results(&events);
        assert!(
            results[2].contains("OUTSIDE_WORKSPACE") || results[2].contains("DENIED"),
            "{say}: {}",
            results[2]
        );
        assert!(
            results[3].contains("OUTSIDE_WORKSPACE") || results[3].contains("DENIED"),
            "{say}: {}",
            results[3]
        );
    }
}

#[test]
fn a_config_sets_the_mode_and_a_flag_overrides_it() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-trust");
    let config = p.base.join("cordis.yml");
    std::fs::write(
        &config,
        format!(
            "plugins:\n  - id: services\n    name: agent-services\n    config:\n      permission_mode: read-only\n      approval: never\n  - id: model\n    name: scripted\n    config:\n      script: {}\n",
            script(&p, "inside", vec![bash("echo inside > inside.txt")]).display()
        ),
    )
    .unwrap();
    let run_with = |extra: &[&str]| {
        Command::new("setsid")
            .arg("-w")
            .arg(env!("CARGO_BIN_EXE_dsh"))
            .args(["run", "--config"])
            .arg(&config)
            .arg("--cwd")
            .arg(&p.ws)
            .arg("--sessions-dir")
            .arg(&p.sessions)
            .args(extra)
            .arg("probe")
            .env_remove("DSH_PERMISSION_MODE")
            .stdin(Stdio::null())
            .bounded_output()
            .unwrap()
    };
    let out = run_with(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!p.ws.join("inside.txt").exists());
    let out = run_with(&["--permission-mode", "workspace-write"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(p.ws.join("inside.txt").exists());
    // A bad mode says where it came from.
    let out = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(["run", "--demo-model", "x"])
        .env("DSH_PERMISSION_MODE", "everything")
        .bounded_output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("$DSH_PERMISSION_MODE: unknown permission mode `everything`"),
        "{err}"
    );
}

/// Runs `dsh run` on a pty (util-linux `script`), answering the approval
/// question with `answer` once it is shown; the transcript.
fn on_a_terminal(p: &super::Place, file: &Path, answer: &str) -> String {
    let command = format!(
        "{} run --script {} --cwd {} --sessions-dir {} probe",
        env!("CARGO_BIN_EXE_dsh"),
        file.display(),
        p.ws.display(),
        p.sessions.display()
    );
    let mut child = Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .env_remove("DSH_APPROVAL")
        .env_remove("DSH_PERMISSION_MODE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("util-linux script runs");
    let mut stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
    let reader = std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut stdin = child.stdin.take();
    // Kept open once answered: `script` ends when the command does.
    let mut answered = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(chunk) => seen.extend(chunk),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                panic!("no end in time: {}", String::from_utf8_lossy(&seen));
            }
        }
        let text = String::from_utf8_lossy(&seen);
        if answered.is_none() && text.contains("allow this once? [y/N]") {
            let mut s = stdin.take().unwrap();
            s.write_all(format!("{answer}\n").as_bytes()).unwrap();
            answered = Some(s);
        }
    }
    let _ = reader.join();
    drop(answered);
    assert!(super::wait_bounded(&mut child, "script").success());
    String::from_utf8_lossy(&seen).into_owned()
}

#[test]
fn the_terminal_is_asked_and_only_its_yes_lets_one_call_out() {
    let _sweep = crate::suite::sweep();
    for (answer, allowed) in [("y", true), ("n", false)] {
        let p = place("dsh-trust");
        let marker = p.outside.join("escalated");
        let file = script(
            &p,
            "escalate",
            vec![escalated_bash(&format!("touch {}", marker.display()))],
        );
        let transcript = on_a_terminal(&p, &file, answer);
        assert!(
            transcript.contains("reason: run under danger-full-access"),
            "{transcript}"
        );
        assert!(transcript.contains("the probe needs it"), "{transcript}");
        assert_eq!(marker.exists(), allowed, "answered {answer}: {transcript}");
        let expected = if allowed { "allowed-once" } else { "rejected" };
        assert_eq!(outcomes(&events(&p)), [expected]);
    }
}

#[test]
fn tools_never_see_the_keys_unless_passed_through() {
    let _sweep = crate::suite::sweep();
    let p = place("dsh-trust");
    let file = script(&p, "env", vec![bash("env > env.txt")]);
    let keys = [
        ("DSH_API_KEY", "dsh-secret"),
        ("OPENAI_API_KEY", "openai-secret"),
        ("DSH_TOKEN", "token-secret"),
        ("DSH_HARMLESS", "visible"),
    ];
    let out = run(&p, &file, &["--approval", "never"], &keys);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let env = std::fs::read_to_string(p.ws.join("env.txt")).unwrap();
    assert!(env.contains("DSH_HARMLESS=visible"), "{env}");
    for secret in ["dsh-secret", "openai-secret", "token-secret"] {
        assert!(!env.contains(secret), "{secret} leaked: {env}");
    }
    let out = run(
        &p,
        &file,
        &["--approval", "never", "--pass-env", "OPENAI_API_KEY"],
        &keys,
    );
    assert!(out.status.success());
    let env = std::fs::read_to_string(p.ws.join("env.txt")).unwrap();
    assert!(env.contains("OPENAI_API_KEY=openai-secret"), "{env}");
    assert!(!env.contains("dsh-secret"));
}
