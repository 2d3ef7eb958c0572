//! Durable sessions as a user meets them: a `dsh run` killed mid-turn and
//! resumed, plus `dsh sessions`.

use super::Bounded;
use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use dsh::services::persistence::{Compression, JsonlStore, SessionPersistence, SqliteStore};
use dsh::services::session::{EventData, TurnEndReason};

use dsh::kernel::scratch::fresh_dir;

fn temp(name: &str) -> PathBuf {
    fresh_dir(&format!("dsh-persist-{name}")).unwrap()
}

fn dsh() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dsh"));
    c.env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL");
    c.current_dir(env!("CARGO_MANIFEST_DIR"));
    c
}

fn only_session(backend: &Backend) -> String {
    let out = dsh()
        .args(["sessions", "list", "--json"])
        .args(backend.args())
        .bounded_output()
        .unwrap();
    let line = String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()
        .unwrap()
        .to_owned();
    serde_json::from_str::<serde_json::Value>(&line).unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Where a process test stores sessions: the flag dsh takes, and the same
/// store opened by the test.
struct Backend {
    flag: &'static str,
    place: PathBuf,
    zstd: bool,
}

impl Backend {
    fn jsonl() -> Backend {
        Backend {
            flag: "--sessions-dir",
            place: temp("sessions"),
            zstd: false,
        }
    }

    fn zstd() -> Backend {
        Backend {
            flag: "--sessions-dir",
            place: temp("sessions-zstd"),
            zstd: true,
        }
    }

    fn sqlite() -> Backend {
        Backend {
            flag: "--sessions-db",
            place: temp("sessions-db").join("sessions.db"),
            zstd: false,
        }
    }

    fn at(flag: &'static str, place: PathBuf) -> Backend {
        Backend {
            flag,
            place,
            zstd: false,
        }
    }

    fn args(&self) -> Vec<&str> {
        let mut args = vec![self.flag, self.place.to_str().unwrap()];
        if self.zstd {
            args.push("--zstd");
        }
        args
    }

    /// The store, once dsh has created it.
    fn open(&self) -> Option<Box<dyn SessionPersistence>> {
        if !self.place.exists() {
            return None;
        }
        Some(if self.flag == "--sessions-db" {
            Box::new(SqliteStore::open(&self.place).ok()?)
        } else {
            Box::new(JsonlStore::new(&self.place).with_compression(if self.zstd {
                Compression::Zstd
            } else {
                Compression::None
            }))
        })
    }

    fn stored(&self, id: &str) -> Vec<serde_json::Value> {
        let store = self.open().unwrap();
        let events = store.read_from(id, 0).unwrap();
        events.iter().map(|e| e.to_json()).collect()
    }
}

#[test]
fn a_run_killed_mid_turn_resumes_with_the_turn_closed_as_interrupted() {
    let _sweep = crate::suite::sweep();
    killed_mid_turn_and_resumed(Backend::jsonl());
}

#[test]
fn a_run_killed_mid_turn_resumes_from_sqlite_too() {
    let _sweep = crate::suite::sweep();
    killed_mid_turn_and_resumed(Backend::sqlite());
}

#[test]
fn a_run_killed_mid_turn_resumes_from_zstd_frames_too() {
    let _sweep = crate::suite::sweep();
    killed_mid_turn_and_resumed(Backend::zstd());
}

fn killed_mid_turn_and_resumed(backend: Backend) {
    let work = temp("work");
    let fifo = work.join("started");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let script = work.join("script.json");
    std::fs::write(
        &script,
        r#"{"steps": [
            {"text": "Let me run it.", "tool_calls": [{"name": "bash", "arguments": {"command": "echo $$ > started; sleep 30", "description": "long job"}}]},
            {"text": "never reached"}
        ]}"#,
    )
    .unwrap();
    let mut child = dsh()
        .args([
            "run",
            "--approval",
            "never",
            "--script",
            script.to_str().unwrap(),
        ])
        .args(backend.args())
        .args(["--cwd", work.to_str().unwrap(), "run the long job"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The FIFO opens when the tool's shell writes to it: the tool is running.
    let mut pid = String::new();
    std::fs::File::open(&fifo)
        .unwrap()
        .read_to_string(&mut pid)
        .unwrap();
    let shell: i32 = pid.trim().parse().unwrap();
    // Wait (bounded) until the batching window has written the tool call.
    let deadline = Instant::now() + Duration::from_secs(20);
    let id = loop {
        let found = backend.open().and_then(|store| {
            let summary = store.list().ok()?.into_iter().next()?.ok()?;
            let events = store.read_from(&summary.id, 0).ok()?;
            events
                .iter()
                .any(|e| matches!(e.data, EventData::ToolCall { .. }))
                .then_some(summary.id)
        });
        if let Some(id) = found {
            break id;
        }
        assert!(
            Instant::now() < deadline,
            "the tool call never reached the disk"
        );
        std::thread::yield_now();
    };
    assert_eq!(only_session(&backend), id);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(shell),
        nix::sys::signal::Signal::SIGKILL,
    );
    let before = backend.stored(&id);

    // Resume with a new prompt: the orphan turn is closed, the agent goes on.
    let script2 = work.join("script2.json");
    std::fs::write(&script2, r#"{"steps": [{"text": "resumed and done"}]}"#).unwrap();
    let out = dsh()
        .args([
            "run",
            "--approval",
            "never",
            "--script",
            script2.to_str().unwrap(),
            "--resume",
            &id,
        ])
        .args(backend.args())
        .args(["--cwd", work.to_str().unwrap(), "carry on"])
        .bounded_output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("resumed and done"));
    assert!(stderr.contains("closed turn 1 as interrupted"), "{stderr}");
    assert!(stderr.contains("TOOL_OUTCOME_UNKNOWN"), "{stderr}");

    // No flushed event was lost: the old log is a prefix of the new one.
    let after = backend.stored(&id);
    assert_eq!(after[..before.len()], before[..]);
    let loaded = backend.open().unwrap().load(&id).unwrap();
    assert!(
        loaded.repairs.is_empty(),
        "the repair was written: {:?}",
        loaded.repairs
    );
    let events = &loaded.events;
    let ends: Vec<(u32, TurnEndReason)> = events
        .iter()
        .filter_map(|e| match &e.data {
            EventData::TurnEnd { turn, reason } => Some((*turn, (**reason).clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        ends,
        [
            (1, TurnEndReason::Interrupted),
            (2, TurnEndReason::Completed)
        ]
    );
    // Every tool/call has its tool/result.
    let calls: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.data {
            EventData::ToolCall { call, .. } => Some(call.call_id.to_string()),
            _ => None,
        })
        .collect();
    for call in calls {
        assert!(
            events.iter().any(|e| matches!(&e.data, EventData::ToolResult { message, .. }
                if message.content.iter().any(|b| matches!(b, dsh::services::llm::ContentBlock::ToolResult { tool_call_id, .. } if *tool_call_id == call)))),
            "call {call} has no result"
        );
    }
    assert!(events.iter().any(|e| matches!(e.data, EventData::EndSeed)));
}

#[test]
fn a_second_resume_of_a_live_session_is_refused_on_jsonl() {
    let _sweep = crate::suite::sweep();
    one_writer(Backend::jsonl());
}

#[test]
fn a_second_resume_of_a_live_session_is_refused_on_sqlite() {
    let _sweep = crate::suite::sweep();
    one_writer(Backend::sqlite());
}

/// Two `dsh run --resume ID` at once: the second is refused at once with
/// `SESSION_BUSY` naming the first's pid, runs nothing, and the log stays
/// one contiguous history; once the first has ended, a resume goes on.
fn one_writer(backend: Backend) {
    let work = temp("one-writer");
    let script = |name: &str, steps: serde_json::Value| {
        let path = work.join(name);
        std::fs::write(&path, serde_json::json!({ "steps": steps }).to_string()).unwrap();
        path
    };
    let resume = |script: &PathBuf, id: &str, prompt: &str| {
        let mut c = dsh();
        c.args(["run", "--approval", "never", "--script"])
            .arg(script)
            .args(["--resume", id])
            .args(backend.args())
            .args(["--cwd", work.to_str().unwrap(), prompt]);
        c
    };
    let hello = script("hello.json", serde_json::json!([{"text": "hello"}]));
    let out = dsh()
        .args(["run", "--approval", "never", "--script"])
        .arg(&hello)
        .args(backend.args())
        .args(["--cwd", work.to_str().unwrap(), "start"])
        .bounded_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let id = only_session(&backend);

    // The first resume is live: its tool waits for `go`.
    let fifo = work.join("started");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let waits = script(
        "waits.json",
        serde_json::json!([
            {"tool_calls": [{"name": "bash", "arguments": {
                "command": "echo up > started; while [ ! -e go ]; do sleep 0.05; done",
                "description": "wait for go"}}]},
            {"text": "first writer done"}
        ]),
    );
    let first = resume(&waits, &id, "first")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut up = String::new();
    std::fs::File::open(&fifo)
        .unwrap()
        .read_to_string(&mut up)
        .unwrap();
    let other = script(
        "other.json",
        serde_json::json!([{"text": "second writer ran"}]),
    );
    let second = resume(&other, &id, "second").bounded_output().unwrap();
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert_eq!(second.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("SESSION_BUSY"), "{stderr}");
    assert!(
        stderr.contains(&format!("process {}", first.id())),
        "the holder's pid: {stderr}"
    );
    assert!(!String::from_utf8_lossy(&second.stdout).contains("second writer ran"));

    std::fs::write(work.join("go"), "").unwrap();
    let first = super::output_bounded(first, super::DEADLINE, "the first resume");
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    assert!(String::from_utf8_lossy(&first.stdout).contains("first writer done"));

    // One history, every seq once, in order; the refused run left nothing.
    let loaded = backend.open().unwrap().load(&id).unwrap();
    assert!(loaded.repairs.is_empty(), "{:?}", loaded.repairs);
    for (i, e) in loaded.events.iter().enumerate() {
        assert_eq!(e.seq, i as u64);
    }
    let text = serde_json::to_string(&backend.stored(&id)).unwrap();
    assert!(text.contains("first writer done"));
    assert!(!text.contains("second writer ran"));
    // The lock went with the first writer.
    let third = resume(&other, &id, "third").bounded_output().unwrap();
    assert!(
        third.status.success(),
        "{}",
        String::from_utf8_lossy(&third.stderr)
    );
    assert!(String::from_utf8_lossy(&third.stdout).contains("second writer ran"));
}

/// A resume whose appends hit a full disk (a 256 KiB tmpfs, filled, in a
/// user and mount namespace of its own) says the log was not fully written,
/// exits 1, and leaves the earlier log byte for byte as it was.
#[test]
fn a_run_whose_log_cannot_be_written_exits_1_and_keeps_the_earlier_log() {
    let _sweep = crate::suite::sweep();
    let disk = temp("full-disk");
    let out = temp("full-disk-out");
    let work = temp("full-disk-work");
    let script = work.join("hello.json");
    std::fs::write(&script, r#"{"steps": [{"text": "hello"}]}"#).unwrap();
    let shell = r#"set -e
mount -t tmpfs -o size=256k tmpfs "$DISK"
"$DSH" run --approval never --script "$SCRIPT" --sessions-dir "$DISK/s" --cwd "$WORK" first > /dev/null
id=$(ls "$DISK/s" | grep -v '^locks$')
cp "$DISK/s/$id/session.jsonl" "$OUT/before.jsonl"
head -c 1048576 /dev/zero > "$DISK/fill" 2> /dev/null || true
set +e
"$DSH" run --approval never --script "$SCRIPT" --sessions-dir "$DISK/s" --resume "$id" --cwd "$WORK" second > "$OUT/stdout" 2> "$OUT/stderr"
echo $? > "$OUT/code"
cp "$DISK/s/$id/session.jsonl" "$OUT/after.jsonl"
"#;
    let ran = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", shell])
        .env("DSH", env!("CARGO_BIN_EXE_dsh"))
        .env("DISK", &disk)
        .env("OUT", &out)
        .env("WORK", &work)
        .env("SCRIPT", &script)
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_SESSIONS_DB")
        .bounded_output()
        .unwrap();
    assert!(
        ran.status.success(),
        "{}",
        String::from_utf8_lossy(&ran.stderr)
    );
    let read = |name: &str| std::fs::read_to_string(out.join(name)).unwrap();
    let stderr = read("stderr");
    assert_eq!(read("code").trim(), "1", "{stderr}");
    assert!(
        stderr.contains("the session log was not fully written"),
        "{stderr}"
    );
    assert!(stderr.contains("No space left on device"), "{stderr}");
    // The turn itself ran; only its log is short.
    assert!(read("stdout").contains("hello"));
    assert_eq!(read("after.jsonl"), read("before.jsonl"));
}

/// A log two writers appended to at once (dsh before its lock): reading
/// keeps the first writer's events and reports the rest instead of refusing
/// the log; a resume moves the rest, byte for byte, to a sibling file and
/// goes on from the kept events.
#[test]
fn a_log_with_a_second_writers_repeats_is_read_and_resumed_with_them_set_aside() {
    let _sweep = crate::suite::sweep();
    let backend = Backend::jsonl();
    let work = temp("repeats");
    let hello = work.join("hello.json");
    std::fs::write(&hello, r#"{"steps": [{"text": "hello"}]}"#).unwrap();
    let run = |extra: &[&str], prompt: &str| {
        dsh()
            .args(["run", "--approval", "never", "--script"])
            .arg(&hello)
            .args(backend.args())
            .args(extra)
            .args(["--cwd", work.to_str().unwrap(), prompt])
            .bounded_output()
            .unwrap()
    };
    assert!(run(&[], "first").status.success());
    let id = only_session(&backend);
    let path = backend.place.join(&id).join("session.jsonl");
    let good = std::fs::read_to_string(&path).unwrap();
    // The second writer repeats seqs 1.. of the first's; then the first
    // goes on where it was.
    let lines: Vec<&str> = good.lines().collect();
    let mut repeats = String::new();
    for line in &lines[2..] {
        repeats.push_str(line);
        repeats.push('\n');
    }
    std::fs::write(&path, format!("{good}{repeats}")).unwrap();

    let show = dsh()
        .args(["sessions", "show", &id])
        .args(backend.args())
        .bounded_output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&show.stdout),
        String::from_utf8_lossy(&show.stderr)
    );
    assert!(show.status.success(), "{said}");
    assert!(
        said.contains(&format!(
            "line {} on: a second writer repeated seqs",
            lines.len() + 1
        )),
        "{said}"
    );

    let resumed = run(&["--resume", &id], "second");
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let aside: Vec<_> = std::fs::read_dir(backend.place.join(&id))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.to_string_lossy().contains("session.jsonl.set-aside-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), repeats);
    let now = std::fs::read_to_string(&path).unwrap();
    assert!(now.starts_with(&good), "the first writer's lines are kept");
    let loaded = backend.open().unwrap().load(&id).unwrap();
    assert!(loaded.repairs.is_empty(), "{:?}", loaded.repairs);
    for (i, e) in loaded.events.iter().enumerate() {
        assert_eq!(e.seq, i as u64);
    }
    assert!(now.len() > good.len(), "the resumed turn is appended");
}

#[test]
fn a_torn_last_line_is_reported_and_the_good_lines_kept() {
    let _sweep = crate::suite::sweep();
    let sessions = temp("torn");
    let out = dsh()
        .args([
            "run",
            "--approval",
            "never",
            "--script",
            "demo/hello.json",
            "--sessions-dir",
            sessions.to_str().unwrap(),
            "go",
        ])
        .bounded_output()
        .unwrap();
    assert!(out.status.success());
    let id = only_session(&Backend::at("--sessions-dir", sessions.clone()));
    let file = JsonlStore::new(&sessions).path(&id).unwrap();
    let good = std::fs::read_to_string(&file).unwrap();
    let count = good.lines().count();
    std::fs::write(&file, format!("{good}{{\"type\":\"turn/start\",\"seq\":")).unwrap();
    let show = dsh()
        .args([
            "sessions",
            "show",
            &id,
            "--sessions-dir",
            sessions.to_str().unwrap(),
        ])
        .bounded_output()
        .unwrap();
    assert!(show.status.success());
    let text = String::from_utf8_lossy(&show.stdout);
    assert!(
        text.contains(&format!(
            "line {} is a torn write and was left out",
            count + 1
        )),
        "{text}"
    );
    assert!(text.contains("turn 1: 3 steps, ended completed"), "{text}");
    // Resuming cuts the torn bytes and keeps every good line.
    let out = dsh()
        .args([
            "run",
            "--approval",
            "never",
            "--script",
            "demo/hello.json",
            "--resume",
            &id,
        ])
        .args(["--sessions-dir", sessions.to_str().unwrap(), "again"])
        .bounded_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("torn write"));
    let after = std::fs::read_to_string(&file).unwrap();
    assert!(after.starts_with(&good));
    assert!(
        JsonlStore::new(&sessions)
            .load(&id)
            .unwrap()
            .torn_line
            .is_none()
    );
}

#[test]
fn sessions_fork_at_a_turn_boundary_with_lineage_and_refuse_bad_input() {
    let _sweep = crate::suite::sweep();
    fork_and_refusals(Backend::jsonl());
}

#[test]
fn sessions_fork_and_export_work_on_sqlite_too() {
    let _sweep = crate::suite::sweep();
    fork_and_refusals(Backend::sqlite());
}

fn fork_and_refusals(backend: Backend) {
    let args = backend.args();
    let (flag, dir) = (args[0], args[1]);
    assert!(
        dsh()
            .args([
                "run",
                "--approval",
                "never",
                "--script",
                "demo/hello.json",
                flag,
                dir,
                "go"
            ])
            .status()
            .unwrap()
            .success()
    );
    let id = only_session(&backend);
    let out = dsh()
        .args(["sessions", "fork", &id, flag, dir])
        .bounded_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let child = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let loaded = backend.open().unwrap().load(&child).unwrap();
    assert_eq!(loaded.header.parent_session.as_deref(), Some(id.as_str()));
    assert_eq!(loaded.header.seed_length, Some(loaded.events.len() as u64));
    // Inside a turn: refused with the reason.
    let inside = dsh()
        .args(["sessions", "fork", &id, "--at", "3", flag, dir])
        .bounded_output()
        .unwrap();
    assert_eq!(inside.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&inside.stderr).contains("turn 1 is still open there"));
    let missing = dsh()
        .args(["sessions", "show", "nope", flag, dir])
        .bounded_output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no session `nope`"));
    let export = dsh()
        .args(["sessions", "export", &child, flag, dir])
        .bounded_output()
        .unwrap();
    let (header, events) =
        dsh::services::session::jsonl::parse(&String::from_utf8_lossy(&export.stdout)).unwrap();
    assert_eq!(header.id, child);
    assert_eq!(events.len(), loaded.events.len());
}

#[test]
fn the_persist_bench_round_trips_what_it_appends() {
    let _sweep = crate::suite::sweep();
    // The bench itself refuses a load that does not give back every
    // appended event and message; a small run checks that path.
    let result = bench_result(&["bench", "persist", "--events", "503"]);
    assert_eq!(result["events"], 503);
    assert!(result["bytes"].as_u64().unwrap() > 503 * 20);
}

/// Runs a bench that must succeed; its `RESULT` line.
fn bench_result(args: &[&str]) -> serde_json::Value {
    let out = dsh()
        .args(args)
        .env_remove("DSH_AUTOAGENTS_DIR")
        .bounded_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .expect("a RESULT line");
    serde_json::from_str(line).unwrap()
}

#[test]
fn the_compare_bench_says_when_it_has_no_peer_and_reports_ours() {
    let _sweep = crate::suite::sweep();
    // No harness named here: our figures alone, marked so.
    let result = bench_result(&[
        "bench", "compare", "--quick", "--runs", "1", "--cells", "w1,w3",
    ]);
    assert_eq!(result["peer"], false);
    let cells = result["cells"].as_array().unwrap();
    let metrics: Vec<&str> = cells
        .iter()
        .map(|c| c["metric"].as_str().unwrap())
        .collect();
    assert_eq!(
        metrics,
        [
            "us_per_step",
            "peak_rss_kb",
            "bytes_per_agent",
            "us_per_agent"
        ]
    );
    assert!(
        cells
            .iter()
            .all(|c| c["dsh"].as_f64().unwrap() > 0.0 && c["ratio"].is_null())
    );
    // Each median comes with the least and greatest of its runs.
    assert!(cells.iter().all(|c| {
        let (lo, m, hi) = (
            c["dsh_min"].as_f64(),
            c["dsh"].as_f64(),
            c["dsh_max"].as_f64(),
        );
        lo <= m && m <= hi && lo.is_some()
    }));
}

#[test]
fn w1_measures_rounds_and_reports_their_spread() {
    let _sweep = crate::suite::sweep();
    // No time floor: the three rounds it always runs.
    let r = bench_result(&[
        "bench",
        "w1",
        "--turns",
        "3",
        "--steps",
        "2",
        "--min-seconds",
        "0",
    ]);
    assert_eq!(r["rounds"], 3);
    assert_eq!(r["model_calls"], 3 * 3 * 2);
    assert_eq!(r["echo_calls"], 3 * 3);
    let at = |k: &str| r[k].as_f64().unwrap();
    assert!(at("us_per_step_min") <= at("us_per_step_p10"));
    assert!(at("us_per_step_p10") <= at("us_per_step"));
    assert!(at("us_per_step") <= at("us_per_step_p90"));
    assert!(at("us_per_step_p90") <= at("us_per_step_max"));
    let refused = dsh()
        .args(["bench", "w1", "--min-seconds", "-1"])
        .bounded_output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
}

#[test]
fn the_compaction_bench_leaves_one_summary_of_its_history() {
    let _sweep = crate::suite::sweep();
    // The bench refuses a compaction that leaves more than the summary.
    let result = bench_result(&["bench", "compact", "--messages", "40"]);
    assert_eq!(result["messages"], 40);
    assert!(result["compact_ms"].as_f64().unwrap() > 0.0);
}

#[test]
fn a_session_store_plugin_in_cordis_yml_receives_the_runs_sessions() {
    let _sweep = crate::suite::sweep();
    let dir = temp("plugin-store");
    let db = dir.join("store/sessions.db");
    let config = dir.join("cordis.yml");
    let hello = std::fs::canonicalize("demo/hello.json").unwrap();
    std::fs::write(
        &config,
        format!(
            "plugins:\n  - id: services\n    name: agent-services\n    config: {{ approval: never }}\n  - id: demo\n    name: scripted\n    config: {{ script: {} }}\n  - id: store\n    name: session-store\n    config: {{ backend: sqlite, path: {} }}\n",
            hello.display(),
            db.display()
        ),
    )
    .unwrap();
    let out = dsh()
        .args(["run", "--config", config.to_str().unwrap(), "go"])
        .bounded_output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let backend = Backend::at("--sessions-db", db.clone());
    let id = only_session(&backend);
    let loaded = backend.open().unwrap().load(&id).unwrap();
    assert!(
        loaded
            .events
            .iter()
            .any(|e| matches!(e.data, EventData::TurnEnd { .. }))
    );
    // A store entry without its location is refused, naming the field.
    std::fs::write(
        &config,
        "plugins:\n  - id: store\n    name: session-store\n    config: { backend: sqlite }\n",
    )
    .unwrap();
    let out = dsh()
        .args(["check", config.to_str().unwrap()])
        .bounded_output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("path") && err.contains("cordis.yml:4"),
        "{err}"
    );
}
