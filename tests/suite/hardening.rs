//! Hardening, tried as an unlucky user would with the real binary: a reader
//! that has gone (`| head -1`), signals other than Ctrl-C.

use super::Bounded;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use dsh::kernel::scratch::fresh_dir;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs dsh with a stdout whose reader closed before dsh started: every
/// write to it fails with EPIPE.
fn with_stdout_gone(args: &[&str], sessions: &Path) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(args)
        .current_dir(repo())
        .env("DSH_SESSIONS_DIR", sessions)
        .env_remove("DSH_APPROVAL")
        .stdin(Stdio::null())
        .stdout(writer)
        .bounded_output()
        .unwrap()
}

#[test]
fn a_closed_stdout_ends_no_command_early() {
    let _sweep = crate::suite::sweep();
    let base = fresh_dir("dsh-epipe").unwrap();
    let sessions = base.join("sessions");
    let script = base.join("script.json");
    std::fs::write(&script, r#"{"steps": [{"text": "one\ntwo\nthree\n"}]}"#).unwrap();
    let script = script.display().to_string();
    let out = with_stdout_gone(
        &["run", "--script", &script, "--approval", "never", "hi"],
        &sessions,
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    // The turn ended and the session was written.
    let dir = std::fs::read_dir(&sessions)
        .unwrap()
        .flatten()
        .find(|e| e.file_name() != "locks")
        .unwrap();
    let log = std::fs::read_to_string(dir.path().join("session.jsonl")).unwrap();
    assert!(log.contains("\"type\":\"turn/end\""), "{log}");
    let id = dir.file_name().to_string_lossy().into_owned();
    for args in [
        vec!["check", "cordis.yml"],
        vec!["tree", "cordis.yml"],
        vec!["sessions", "list"],
        vec!["sessions", "show", id.as_str()],
        vec![
            "run",
            "--script",
            &script,
            "--json",
            "--approval",
            "never",
            "hi",
        ],
        vec!["--help"],
    ] {
        let out = with_stdout_gone(&args, &sessions);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// Whether any process's command line contains `token`.
fn running(token: &str) -> bool {
    !carrying(token).is_empty()
}

/// The processes whose command line carries `token`.
fn carrying(token: &str) -> Vec<i32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|p| {
            std::fs::read(p.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(token))
        })
        .filter_map(|p| p.file_name().to_str()?.parse().ok())
        .collect()
}

/// Where no PID namespace holds a command (Landlock; no sandbox at all), it
/// still dies with dsh: it outlives the thread that started it (a command
/// that sleeps first still finishes its turn), but not `kill -9` of dsh,
/// whose guard takes its whole process group down (here a `sleep` that
/// `bash` forked).
#[test]
fn a_command_outlives_its_spawning_thread_but_not_a_killed_dsh() {
    let _sweep = crate::suite::sweep();
    use std::io::BufRead;
    for (args, token) in [
        (["--sandbox", "landlock"], "71.4411"),
        (["--permission-mode", "danger-full-access"], "72.4411"),
    ] {
        let base = fresh_dir("dsh-guard").unwrap();
        let run = |command: &str, stderr: Stdio| {
            let script = base.join("script.json");
            let call = serde_json::json!({"tool_calls": [{"name": "bash", "arguments": {
                "command": command, "description": "run"
            }}]});
            std::fs::write(
                &script,
                serde_json::json!({"steps": [call, {"text": "over"}]}).to_string(),
            )
            .unwrap();
            Command::new(env!("CARGO_BIN_EXE_dsh"))
                .args(["run", "--approval", "never", "--script"])
                .arg(&script)
                .args(args)
                .arg("--sessions-dir")
                .arg(base.join("sessions"))
                .arg("go")
                .current_dir(&base)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(stderr)
                .spawn()
                .unwrap()
        };
        let finished = run("sleep 0.5 && echo survived", Stdio::piped());
        let out = super::output_bounded(finished, super::DEADLINE, "dsh run");
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{args:?}: {said}");
        assert!(said.contains("survived"), "{args:?}: {said}");

        let mut child = run(
            &format!("echo started; sleep {token}; true"),
            Stdio::piped(),
        );
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        while !line.contains("▸ bash") {
            line.clear();
            assert!(stderr.read_line(&mut line).unwrap() > 0, "dsh ended early");
        }
        // The `sleep` itself (its own argument is the token), not a
        // process on the way to it.
        let sleeping = || {
            std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
                std::fs::read(p.path().join("cmdline"))
                    .is_ok_and(|c| c.split(|b| *b == 0).any(|a| a == token.as_bytes()))
            })
        };
        super::until_blocking("the command never started", sleeping);
        child.kill().unwrap(); // SIGKILL: no code of dsh runs
        super::wait_bounded(&mut child, "dsh");
        // Each process that carries the token, waited on itself.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        for pid in carrying(token) {
            assert!(
                super::ends(pid, deadline),
                "{args:?}: the command outlived a killed dsh; still running:\n{}",
                super::survivors()
            );
        }
        assert!(!running(token), "{args:?}: {}", super::survivors());
    }
}

/// SIGTERM and SIGHUP end `dsh run` as Ctrl-C does: the running tool's
/// process is killed, the turn ends `aborted`, the session is written, and
/// the exit code is 128 + the signal.
#[test]
fn sigterm_and_sighup_cancel_a_run_like_ctrl_c() {
    let _sweep = crate::suite::sweep();
    use nix::sys::signal::Signal;
    use std::io::BufRead;
    for (signal, code, token) in [
        (Signal::SIGTERM, 143, "61.2345"),
        (Signal::SIGHUP, 129, "62.2345"),
        (Signal::SIGINT, 130, "63.2345"),
    ] {
        let base = fresh_dir("dsh-signal").unwrap();
        let sessions = base.join("sessions");
        let script = base.join("script.json");
        let call = serde_json::json!({"tool_calls": [{"name": "bash", "arguments": {
            "command": format!("echo started; sleep {token}"), "description": "wait"
        }}]});
        std::fs::write(
            &script,
            serde_json::json!({"steps": [call, {"text": "never"}]}).to_string(),
        )
        .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_dsh"))
            .args(["run", "--approval", "never", "--script"])
            .arg(&script)
            .arg("--sessions-dir")
            .arg(&sessions)
            .arg("wait")
            .current_dir(&base)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The tool call is shown before it runs; the sleep then starts.
        let mut stderr = std::io::BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        while !line.contains("▸ bash") {
            line.clear();
            assert!(stderr.read_line(&mut line).unwrap() > 0, "dsh ended early");
        }
        super::until_blocking("the command never started", || running(token));
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, signal).unwrap();
        let mut rest = String::new();
        let _ = std::io::Read::read_to_string(&mut stderr, &mut rest);
        let status = super::wait_bounded(&mut child, "dsh");
        assert_eq!(status.code(), Some(code), "{signal}: {rest}");
        // Killed, the sandbox's processes may take a moment to be reaped;
        // one that lives on (its sleep is a minute) fails the deadline.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for pid in carrying(token) {
            assert!(
                super::ends(pid, deadline),
                "{signal}: the tool's process outlived dsh"
            );
        }
        // dsh reaped what it started before it exited: nothing of it is
        // left for a PID 1 to reap (this test's process is the subreaper
        // its orphans would come to).
        assert_eq!(super::zombie_children(), Vec::<String>::new(), "{signal}");
        let dir = std::fs::read_dir(&sessions)
            .unwrap()
            .flatten()
            .find(|e| e.file_name() != "locks")
            .unwrap();
        let log = std::fs::read_to_string(dir.path().join("session.jsonl")).unwrap();
        let end = log
            .lines()
            .rev()
            .find(|l| l.contains("\"type\":\"turn/end\""))
            .unwrap_or_else(|| panic!("{signal}: no turn/end in {log}"));
        assert!(end.contains("aborted"), "{signal}: {end}");
    }
}
