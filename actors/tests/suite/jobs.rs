//! Background jobs run for real: `bash` with `run_in_background`, read,
//! listed and killed by the owner only, told to the owner when they end,
//! capped per agent, spilled past their read cap, and ended with their
//! agent.

use std::sync::Arc;

use dsh_actors::agent::Agent;
use dsh_services::jobs::{JobLimits, Jobs};
use dsh_services::session::EventData;
use dsh_services::tools::builtin::{Bash, JobKill, JobList, JobOutput};
use serde_json::json;

use super::harness::{Harness, WAIT, calls, results, text};

fn with_jobs(h: &Harness, max_running: usize) -> Arc<Jobs> {
    let root = h.rt.root();
    let jobs = Arc::new(Jobs::new(JobLimits {
        max_running,
        ..JobLimits::default()
    }));
    root.provide(Jobs::SERVICE, jobs.clone()).unwrap();
    h.tools.register(&root, Arc::new(Bash)).unwrap();
    h.tools.register(&root, Arc::new(JobList)).unwrap();
    h.tools.register(&root, Arc::new(JobOutput)).unwrap();
    h.tools.register(&root, Arc::new(JobKill)).unwrap();
    jobs
}

fn background(command: &str) -> serde_json::Value {
    json!({"command": command, "description": "background", "run_in_background": true})
}

/// Whether a process whose command line holds `token` runs.
fn running(token: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
        std::fs::read(p.path().join("cmdline"))
            .map(|c| String::from_utf8_lossy(&c).contains(token))
            .unwrap_or(false)
    })
}

async fn gone(token: &str) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while running(token) {
        assert!(tokio::time::Instant::now() < deadline, "{token} lives on");
        tokio::task::yield_now().await;
    }
}

/// Start, list, wait for the output, kill: the texts the model reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_command_is_listed_read_and_killed() {
    let h = Harness::new().await;
    with_jobs(&h, 8);
    h.script(
        "j",
        vec![
            calls(&[("bash", background("echo first; echo oops >&2; exit 3"))]),
            calls(&[("job_output", json!({"job_id": "bash-1", "wait": true}))]),
            calls(&[("bash", background("sleep 81.5151"))]),
            calls(&[("job_list", json!({}))]),
            calls(&[(
                "job_kill",
                json!({"job_id": "bash-2", "reason": "not needed"}),
            )]),
            calls(&[("job_output", json!({"job_id": "bash-2", "wait": true}))]),
            calls(&[("job_kill", json!({"job_id": "bash-1"}))]),
            text("done"),
        ],
    );
    let agent = h.agent("j").await;
    let summary = agent.run("go", WAIT).await.unwrap();
    assert_eq!(summary.text, "done");
    let texts: Vec<String> = results(&agent).into_iter().map(|(_, _, t)| t).collect();
    assert!(
        texts[0].starts_with("started background job bash-1: echo first"),
        "{}",
        texts[0]
    );
    assert!(
        texts[1].contains("first") && texts[1].contains("oops"),
        "{}",
        texts[1]
    );
    assert!(
        texts[1].ends_with("[status: failed (exit code: 3)]"),
        "{}",
        texts[1]
    );
    assert!(
        texts[2].starts_with("started background job bash-2"),
        "{}",
        texts[2]
    );
    assert!(
        texts[3].contains("bash-1 [bash] failed (exit code: 3) — echo first"),
        "{}",
        texts[3]
    );
    assert!(
        texts[3].contains("bash-2 [bash] running — sleep 81.5151"),
        "{}",
        texts[3]
    );
    assert!(
        texts[4].starts_with("requested the end of job bash-2"),
        "{}",
        texts[4]
    );
    assert!(
        texts[5].ends_with("[status: killed (not needed)]"),
        "{}",
        texts[5]
    );
    assert!(
        texts[6].starts_with("job bash-1 had already ended"),
        "{}",
        texts[6]
    );
    gone("81.5151").await;
    // Killed: no notice (bash-1 may have ended before it was read, and
    // then its owner was told).
    let said = notices(&agent);
    assert!(said.iter().all(|n| !n.contains("bash-2")), "{said:?}");
    h.rt.shutdown().await;
}

fn notices(agent: &Agent) -> Vec<String> {
    agent
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::UserMessage(m) if m.source.kind == "job-settled" => Some(m.text()),
            _ => None,
        })
        .collect()
}

/// A job that ends while its owner is idle wakes it with a notice turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ended_job_tells_its_owner() {
    let h = Harness::new().await;
    with_jobs(&h, 8);
    h.script(
        "n",
        vec![
            calls(&[("bash", background("echo built"))]),
            text("started it"),
            text("noted"),
        ],
    );
    let agent = h.agent("n").await;
    let (seen_tx, mut seen) = tokio::sync::watch::channel(false);
    agent.session().observe(Arc::new(move |e| {
        if matches!(&e.data, EventData::TurnEnd { turn: 2, .. }) {
            seen_tx.send_replace(true);
        }
    }));
    agent.run("go", WAIT).await.unwrap();
    tokio::time::timeout(WAIT, seen.wait_for(|s| *s))
        .await
        .expect("the notice opens a turn")
        .unwrap();
    let said = notices(&agent);
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(
        said[0]
            .starts_with("Background job bash-1 (bash: echo built) finished [status: completed]"),
        "{}",
        said[0]
    );
    h.rt.shutdown().await;
}

/// Another agent cannot read or kill a job, the cap refuses one job too
/// many, and the owner's disposal kills what still runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_are_the_owners_capped_and_end_with_it() {
    let h = Harness::new().await;
    let jobs = with_jobs(&h, 1);
    h.script(
        "o",
        vec![
            calls(&[("bash", background("sleep 82.5151"))]),
            calls(&[("bash", background("sleep 83.5151"))]),
            text("ok"),
        ],
    );
    let owner = h.agent("o").await;
    owner.run("go", WAIT).await.unwrap();
    let (_, code, said) = results(&owner).remove(1);
    assert_eq!(code.as_deref(), Some("TOO_MANY_JOBS"), "{said}");
    assert!(!running("83.5151"));
    // A running job keeps its agent awake.
    assert!(owner.hibernate().await.is_err());
    h.script(
        "s",
        vec![
            calls(&[("job_output", json!({"job_id": "bash-1"}))]),
            calls(&[("job_kill", json!({"job_id": "bash-1"}))]),
            calls(&[("job_list", json!({}))]),
            text("ok"),
        ],
    );
    let stranger = h.agent("s").await;
    stranger.run("go", WAIT).await.unwrap();
    let seen = results(&stranger);
    assert_eq!(seen[0].1.as_deref(), Some("UNKNOWN_JOB"));
    assert_eq!(seen[1].1.as_deref(), Some("UNKNOWN_JOB"));
    assert_eq!(seen[2].2, "(no background jobs)");
    assert!(running("82.5151"), "the stranger stopped nothing");
    owner.dispose().await;
    gone("82.5151").await;
    assert!(jobs.list(Some(owner.id())).is_empty());
    h.rt.shutdown().await;
}

/// Past the read cap a read returns the tail and names the spill file,
/// which holds every byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_output_is_spilled_to_a_file() {
    let h = Harness::new().await;
    let jobs = with_jobs(&h, 8);
    h.script(
        "l",
        vec![
            calls(&[("bash", background("seq 1 20000"))]),
            calls(&[("job_output", json!({"job_id": "bash-1", "wait": true}))]),
            calls(&[("job_output", json!({"job_id": "bash-1"}))]),
            text("ok"),
        ],
    );
    let agent = h.agent("l").await;
    agent.run("go", WAIT).await.unwrap();
    let texts: Vec<String> = results(&agent).into_iter().map(|(_, _, t)| t).collect();
    let spill = jobs.spill_dir().join("bash-1.log");
    assert!(
        texts[1].starts_with("(") && texts[1].contains(&spill.display().to_string()),
        "{}",
        &texts[1][..200.min(texts[1].len())]
    );
    assert!(
        texts[1].contains("\n20000\n[status: completed]"),
        "the tail is shown"
    );
    assert!(texts[1].len() < 31_000, "{}", texts[1].len());
    assert_eq!(texts[2], "(no new output)\n[status: completed]");
    let whole = std::fs::read_to_string(&spill).unwrap();
    let expected: String = (1..=20000).map(|n| format!("{n}\n")).collect();
    assert_eq!(whole, expected);
    h.rt.shutdown().await;
}

/// A background command is confined like any bash call: under
/// workspace-write it cannot write beside the workspace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_command_stays_in_the_sandbox() {
    let h = Harness::new().await;
    with_jobs(&h, 8);
    let base = dsh_supervisors::scratch::fresh_dir("dsh-job-sandbox")
        .unwrap()
        .canonicalize()
        .unwrap();
    let (ws, outside) = (base.join("ws"), base.join("outside"));
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    let escape = outside.join("escaped");
    let inside = ws.join("made");
    let command = format!("touch {} ; touch {}", escape.display(), inside.display());
    h.script(
        "b",
        vec![
            calls(&[("bash", background(&command))]),
            calls(&[("job_output", json!({"job_id": "bash-1", "wait": true}))]),
            text("ok"),
        ],
    );
    let agent = Agent::create(
        &h.rt.root(),
        dsh_actors::agent::AgentSpec::new("b", "m", ws.clone()),
    )
    .await
    .unwrap();
    agent.run("go", WAIT).await.unwrap();
    let said = results(&agent).remove(1).2;
    assert!(said.contains("[status: "), "{said}");
    assert!(inside.exists(), "the workspace is writable: {said}");
    assert!(
        !escape.exists(),
        "the job wrote outside the workspace: {said}"
    );
    h.rt.shutdown().await;
}

/// Notices wake an idle owner at most three times since the user last
/// spoke (a woken turn may start the job that wakes it again); the fourth
/// waits, and the next turn the user opens carries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notices_stop_waking_an_owner_after_three() {
    let h = Harness::new().await;
    with_jobs(&h, 8);
    let dir = dsh_supervisors::scratch::fresh_dir("dsh-job-wakes").unwrap();
    let gate = |n: u32| {
        format!(
            "while [ ! -e {} ]; do sleep 0.01; done",
            dir.join(format!("go-{n}")).display()
        )
    };
    let mut steps = Vec::new();
    for n in 1..=4 {
        steps.push(calls(&[("bash", background(&gate(n)))]));
        steps.push(text(&format!("turn {n}")));
    }
    steps.push(text("turn 5"));
    h.script("w", steps);
    let agent = h.agent("w").await;
    let (ended_tx, ended) = tokio::sync::watch::channel(0u32);
    agent.session().observe(Arc::new(move |e| {
        if let EventData::TurnEnd { turn, .. } = &e.data {
            ended_tx.send_replace(*turn);
        }
    }));
    let (done_tx, done) = tokio::sync::watch::channel(0usize);
    h.rt.root()
        .on(move |_: &dsh_services::jobs::JobDone| {
            done_tx.send_modify(|n| *n += 1);
        })
        .unwrap();
    agent
        .followup(dsh_services::llm::Message::user_text("go"))
        .unwrap();
    for n in 1..=4u32 {
        // Turn n has ended: its job's end finds the owner idle.
        let mut ended = ended.clone();
        tokio::time::timeout(WAIT, ended.wait_for(|t| *t >= n))
            .await
            .unwrap()
            .unwrap();
        agent.when_idle(WAIT).await.unwrap();
        std::fs::write(dir.join(format!("go-{n}")), "").unwrap();
        let mut done = done.clone();
        tokio::time::timeout(WAIT, done.wait_for(|d| *d >= n as usize))
            .await
            .unwrap()
            .unwrap();
    }
    // The fourth notice did not wake it.
    assert!(agent.is_idle());
    assert_eq!(*ended.borrow(), 4);
    assert_eq!(notices(&agent).len(), 3);
    let summary = agent.run("and now?", WAIT).await.unwrap();
    assert_eq!((summary.turn, summary.text.as_str()), (5, "turn 5"));
    let said = notices(&agent);
    assert_eq!(said.len(), 4, "{said:?}");
    assert!(said[3].contains("bash-4"), "{}", said[3]);
    h.rt.shutdown().await;
}

/// A foreground command whose output is cut to its tail names the file
/// that holds all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_foreground_output_is_spilled_too() {
    let h = Harness::new().await;
    let jobs = with_jobs(&h, 8);
    h.script(
        "f",
        vec![
            calls(&[(
                "bash",
                json!({"command": "seq 1 20000", "description": "count"}),
            )]),
            text("ok"),
        ],
    );
    let agent = h.agent("f").await;
    agent.run("go", WAIT).await.unwrap();
    let said = results(&agent).remove(0).2;
    assert!(said.starts_with("[output truncated"), "{}", &said[..80]);
    let (_, pointer) = said
        .rsplit_once("[the whole output is in ")
        .expect("a pointer");
    let path = std::path::PathBuf::from(pointer.trim_end_matches(']'));
    assert!(path.starts_with(jobs.spill_dir()), "{}", path.display());
    let expected: String = (1..=20000).map(|n| format!("{n}\n")).collect();
    assert_eq!(std::fs::read_to_string(&path).unwrap(), expected);
    h.rt.shutdown().await;
}

/// A command that prints without end cannot grow dsh without end: each
/// stream keeps its last 4 MiB, and the result says how much was let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_output_is_kept_to_its_end() {
    let h = Harness::new().await;
    with_jobs(&h, 8);
    let flood = "head -c 20971520 /dev/zero | tr '\\0' 'a'; echo; echo last-line";
    h.script(
        "z",
        vec![
            calls(&[("bash", json!({"command": flood, "description": "flood"}))]),
            text("ok"),
        ],
    );
    let agent = h.agent("z").await;
    agent.run("go", WAIT).await.unwrap();
    let said = results(&agent).remove(0).2;
    assert!(said.contains("last-line"), "the end is kept");
    let (_, note) = said
        .rsplit_once("[the last 4 MiB of each stream are in ")
        .expect("a note");
    let (path, rest) = note.split_once("; ").unwrap();
    let dropped: u64 = rest.split_whitespace().next().unwrap().parse().unwrap();
    assert!(dropped >= 20971520 - 2 * 4 * 1024 * 1024, "{rest}");
    let kept = std::fs::metadata(path).unwrap().len();
    assert!(kept <= 2 * 4 * 1024 * 1024 + 16, "{kept} bytes kept");
    h.rt.shutdown().await;
}
