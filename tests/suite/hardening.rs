//! Hardening, tried as an unlucky user would with the real binary: a reader
//! that has gone (`| head -1`), signals other than Ctrl-C.

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
        .output()
        .unwrap()
}

#[test]
fn a_closed_stdout_ends_no_command_early() {
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
        .next()
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
