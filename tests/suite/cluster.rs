//! Several real `dsh node` processes on loopback, and the commands that
//! place children on them (`--nodes`).

use super::Bounded;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use dsh::kernel::scratch::fresh_dir;
use serde_json::Value;

pub(super) const COOKIE_VAR: &str = "DSH_TEST_CLUSTER_COOKIE";
pub(super) const COOKIE: &str = "loopback-only-secret";

/// A `dsh node` process, killed when dropped.
pub(super) struct Node {
    child: Child,
    addr: String,
    name: String,
    pub(super) dir: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Node {
    /// Starts `dsh node --name NAME` with `model` flags in a fresh
    /// workspace; returns once it says where it listens.
    pub(super) fn start(name: &str, model: &[&str]) -> Node {
        let dir = fresh_dir("dsh-node").unwrap();
        std::fs::create_dir_all(dir.join("sessions")).unwrap();
        Node::start_in(name, model, dir)
    }

    /// A node whose children all run `sleep SECS` ([`hanging_script`]).
    fn hanging(name: &str, secs: &str) -> Node {
        let dir = fresh_dir("dsh-node").unwrap();
        std::fs::create_dir_all(dir.join("sessions")).unwrap();
        let script = hanging_script(&dir, secs);
        Node::start_in(name, &["--script", script.to_str().unwrap()], dir)
    }

    fn start_in(name: &str, model: &[&str], dir: PathBuf) -> Node {
        let mut child = Command::new(env!("CARGO_BIN_EXE_dsh"))
            .args(["node", "--name", name, "--cookie-env", COOKIE_VAR])
            .args(model)
            .arg("--sessions-dir")
            .arg(dir.join("sessions"))
            .env(COOKIE_VAR, COOKIE)
            .env_remove("DSH_BASE_URL")
            .env_remove("DSH_MODEL")
            .env_remove("DSH_SESSIONS_DB")
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("dsh node starts");
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        // Drains the node's stderr for its whole life (a full pipe would
        // stall it); the first line that says where it listens is sent.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.split(" listening on ").nth(1) {
                    let _ = tx.send(addr.trim().to_owned());
                }
            }
        });
        let addr = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the node says where it listens");
        Node {
            child,
            addr,
            name: name.into(),
            dir,
        }
    }

    pub(super) fn peer(&self) -> String {
        format!("{}@{}", self.name, self.addr)
    }

    /// The headers of the sessions stored on this node.
    pub(super) fn headers(&self) -> Vec<Value> {
        headers(&self.dir.join("sessions"))
    }
}

fn headers(store: &Path) -> Vec<Value> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(store).unwrap() {
        let log = entry.unwrap().path().join("session.jsonl");
        // A log being written may not have its header yet.
        let header = std::fs::read_to_string(&log)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| serde_json::from_str(l).ok()));
        out.extend(header);
    }
    out
}

pub(super) fn log_of(store: &Path, id: &str) -> String {
    std::fs::read_to_string(store.join(id).join("session.jsonl")).unwrap_or_default()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A workspace for the parent, with `fan.js`: one `agent()` per topic,
/// settled one by one (a failed child answers `null`).
fn parent_dir() -> PathBuf {
    let dir = fresh_dir("dsh-cluster-parent").unwrap();
    std::fs::create_dir_all(dir.join("sessions")).unwrap();
    std::fs::write(
        dir.join("fan.js"),
        "const r = await Promise.all(args.topics.map(t => agent('Write one line about ' + t + '.')));\nreturn {r};\n",
    )
    .unwrap();
    dir
}

/// `dsh ARGS…` as the parent: in its workspace, with its store there and
/// `cookie` in the cookie variable.
fn parent(dir: &Path, args: &[&str], cookie: &str) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dsh"));
    c.args(args)
        .arg("--sessions-dir")
        .arg(dir.join("sessions"))
        .env(COOKIE_VAR, cookie)
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_SESSIONS_DB")
        .current_dir(dir);
    c
}

/// `dsh run PROMPT --script SCRIPT` delegating to `node`.
fn run_on(dir: &Path, prompt: &str, script: &str, node: &Node) -> Output {
    let peer = node.peer();
    let args = ["run", prompt, "--script", script, "--nodes", &peer];
    parent(dir, &args, COOKIE)
        .args(["--cookie-env", COOKIE_VAR])
        .bounded_output()
        .unwrap()
}

/// A script in `dir/name` that starts `n` background children through
/// `subagent_remote`, one a step (so their start order is known), and ends
/// its turn.
fn background(dir: &Path, name: &str, n: usize) {
    let start = r#"{"tool_calls": [{"name": "subagent_remote", "arguments": {"description": "wait", "prompt": "Wait.", "run_in_background": true}}]}"#;
    let mut steps = vec![start; n];
    steps.push(r#"{"text": "started"}"#);
    let script = format!(r#"{{"steps": [{}]}}"#, steps.join(", "));
    std::fs::write(dir.join(name), script).unwrap();
}

/// `fan.js` over `topics`, with `cluster` options.
fn fan(dir: &Path, topics: &[String], cluster: &[&str], cookie: &str) -> Command {
    let args = serde_json::json!({ "topics": topics }).to_string();
    let mut all = vec!["workflow", "fan.js", "--demo-model", "--args", &args];
    all.extend_from_slice(cluster);
    parent(dir, &all, cookie)
}

fn workflow(dir: &Path, topics: &[String], cluster: &[&str], cookie: &str) -> Output {
    fan(dir, topics, cluster, cookie)
        .bounded_output()
        .expect("dsh workflow runs")
}

fn topics(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("topic{i}")).collect()
}

#[test]
fn a_workflow_fans_out_to_twenty_children_on_two_nodes_and_a_wrong_cookie_is_refused() {
    let _sweep = crate::suite::sweep();
    let b = Node::start("b", &["--demo-model"]);
    let c = Node::start("c", &["--demo-model"]);
    let dir = parent_dir();
    let nodes = format!("{},{}", b.peer(), c.peer());
    let cluster = ["--nodes", &nodes, "--cookie-env", COOKIE_VAR];
    let asked = topics(20);
    let traced = [&cluster[..], &["--tree"]].concat();
    let run = workflow(&dir, &asked, &traced, COOKIE);
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    // The parent's tree follows the nodes its children went to (what it
    // shows of them: see the cancel test, whose children stay).
    let tree = err.split("live actor tree:").nth(1).unwrap_or_default();
    assert!(
        tree.contains("mirror/b [mirror]") || tree.contains("mirror/c [mirror]"),
        "{err}"
    );
    let value: Value = serde_json::from_str(&out).unwrap();
    let answers = value["r"].as_array().unwrap();
    assert_eq!(answers.len(), 20);
    for (topic, answer) in asked.iter().zip(answers) {
        // The demo model answers from the prompt: the child on the other
        // node saw the parent's prompt (not the proxy's runtime context).
        let a = answer.as_str().unwrap_or_default();
        assert!(a.starts_with(&format!("{topic}:")), "{topic}: {answer}");
    }

    // The coordinator is the parent of every child, and the children ran
    // (and are stored) on the nodes: ten each, round-robin.
    let local = headers(&dir.join("sessions"));
    let coordinator = local
        .iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    let mut on_nodes = 0;
    for node in [&b, &c] {
        let hs = node.headers();
        assert_eq!(hs.len(), 10, "node {} holds {hs:?}", node.name);
        for h in &hs {
            assert_eq!(h["parentSession"], coordinator["id"]);
            assert_eq!(h["origin"], "subagent");
            assert_eq!(h["delegationDepth"], 1);
            let log = log_of(&node.dir.join("sessions"), h["id"].as_str().unwrap());
            assert!(log.contains(r#""mode":"remote""#), "{log}");
            assert!(log.contains(&format!(r#""node":"{}""#, node.name)), "{log}");
            // The child worked in its node's workspace.
            assert!(log.contains(&node.dir.display().to_string()), "{log}");
            on_nodes += 1;
        }
    }
    assert_eq!(on_nodes, 20);

    // A wrong cookie is refused before anything runs.
    let refused = workflow(&dir, &topics(1), &cluster, "not-the-cookie");
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    let err = text(&refused.stderr);
    assert!(
        err.contains("cannot join b@") && err.contains("wrong cookie"),
        "{err}"
    );
    assert_eq!(b.headers().len(), 10, "nothing ran on b");

    // No cookie at all: refused as a usage error, naming the variable.
    let unset = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(["workflow", "fan.js", "--demo-model", "--nodes", &nodes])
        .args(["--cookie-env", "DSH_TEST_NO_SUCH_COOKIE"])
        .current_dir(&dir)
        .bounded_output()
        .unwrap();
    assert_eq!(unset.status.code(), Some(2));
    assert!(text(&unset.stderr).contains("$DSH_TEST_NO_SUCH_COOKIE is not set"));
}

/// A script whose every step runs `sleep SECS`: a child on that node is
/// mid-turn until it is cancelled or its node dies. Each test sleeps its
/// own number of seconds, so [`sleeping`] counts only its children.
fn hanging_script(dir: &Path, secs: &str) -> PathBuf {
    let step = format!(
        r#"{{"tool_calls": [{{"name": "bash", "arguments": {{"command": "sleep {secs}", "description": "wait"}}}}]}}"#
    );
    let steps = vec![step; 16].join(",");
    let path = dir.join("hang.json");
    std::fs::write(&path, format!(r#"{{"steps": [{steps}]}}"#)).unwrap();
    path
}

/// Live `sleep SECS` processes (each a child's running command).
fn sleeping(secs: &str) -> usize {
    let want = format!("sleep\0{secs}\0");
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|p| {
            let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
            let zombie = stat
                .rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z'));
            !zombie && std::fs::read(p.path().join("cmdline")).is_ok_and(|c| c == want.as_bytes())
        })
        .count()
}

#[test]
fn a_node_killed_mid_turn_fails_its_children_with_node_down_and_the_rest_go_on() {
    let _sweep = crate::suite::sweep();
    let mut b = Node::hanging("b", "29.2");
    let bdir = b.dir.clone();
    let c = Node::start("c", &["--demo-model"]);
    let dir = parent_dir();
    let nodes = format!("{},{}", b.peer(), c.peer());
    let mut parent = fan(
        &dir,
        &topics(4),
        &["--nodes", &nodes, "--cookie-env", COOKIE_VAR],
        COOKIE,
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Once c's two children ended and b's two are running, kill b.
    let stderr = parent.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            all.push_str(&line);
            all.push('\n');
            let _ = tx.send(line);
        }
        all
    });
    let (mut started, mut completed) = (0, 0);
    while started < 4 || completed < 2 {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the workflow reports its children");
        started += usize::from(line.contains("started:"));
        completed += usize::from(line.contains(" completed in "));
    }
    // b's children are mid-turn (their command sleeps): kill -9 the node.
    super::until_blocking("b's children never ran their command", || {
        sleeping("29.2") == 2
    });
    b.child.kill().unwrap();
    let _ = b.child.wait();

    let out = super::output_bounded(parent, super::DEADLINE, "the parent run");
    let err = reader.join().unwrap();
    // The run ended; two of its children failed, and it says so.
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("2 of 4 children failed"), "{err}");
    // Each child says where it ran, and each lost one why, as it ends
    // and in the list at the end.
    for node in ["b", "c"] {
        let on = format!(" on {node} (session ");
        let started = err
            .lines()
            .filter(|l| l.contains("started:") && l.contains(&on));
        assert_eq!(started.count(), 2, "{node}: {err}");
        let ended = format!(" on {node} ");
        let ended = err
            .lines()
            .filter(|l| l.starts_with("[fan]") && !l.contains("started:") && l.contains(&ended));
        assert_eq!(ended.count(), 2, "{node}: {err}");
    }
    let lost: Vec<&str> = err
        .lines()
        .filter(|l| l.contains(" failed after ") && l.contains("NODE_DOWN"))
        .collect();
    assert_eq!(lost.len(), 4, "{err}");
    // The summary table: every child with its node and status.
    let table: Vec<Vec<&str>> = err
        .lines()
        .skip_while(|l| !l.starts_with("children: 4 started · 2 completed · 2 failed"))
        .skip(2)
        .take(4)
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(table.len(), 4, "{err}");
    for row in &table {
        match row[2] {
            "b" => assert_eq!(row[3..5], ["failed", "(NODE_DOWN)"], "{err}"),
            "c" => assert_eq!(row[3], "completed", "{err}"),
            other => panic!("node {other}: {err}"),
        }
    }
    assert_eq!(
        lost.iter()
            .filter(|l| l.contains(" on b (session "))
            .count(),
        2,
        "the list at the end says where: {lost:?}"
    );
    let value: Value = serde_json::from_slice(&out.stdout).unwrap();
    let answers = value["r"].as_array().unwrap();
    let answered = answers.iter().filter(|a| a.is_string()).count();
    let failed = answers.iter().filter(|a| a.is_null()).count();
    assert_eq!((answered, failed), (2, 2), "{value}");
    assert_eq!(err.matches(" completed in ").count(), 2, "{err}");
    // Each failed child's proxy recorded why: its node is down.
    let store = dir.join("sessions");
    let downs = headers(&store)
        .iter()
        .filter(|h| h["origin"] == "subagent")
        .filter(|h| log_of(&store, h["id"].as_str().unwrap()).contains("NODE_DOWN"))
        .count();
    assert_eq!(downs, 2, "{err}");

    // b comes back (same store, a new process); the same run works again.
    drop(b);
    let b = Node::start_in("b", &["--demo-model"], bdir);
    let nodes = format!("{},{}", b.peer(), c.peer());
    let again = workflow(
        &dir,
        &topics(4),
        &["--nodes", &nodes, "--cookie-env", COOKIE_VAR],
        COOKIE,
    );
    assert!(again.status.success(), "{}", text(&again.stderr));
    let value: Value = serde_json::from_slice(&again.stdout).unwrap();
    assert!(
        value["r"].as_array().unwrap().iter().all(Value::is_string),
        "{value}"
    );
}

#[test]
fn cancelling_a_workflow_cancels_and_closes_its_children_on_another_node() {
    let _sweep = crate::suite::sweep();
    let b = Node::hanging("b", "29.1");
    let dir = parent_dir();
    let mut parent = fan(
        &dir,
        &topics(3),
        &[
            "--nodes",
            &b.peer(),
            "--cookie-env",
            COOKIE_VAR,
            "--placement",
            "b",
            "--tree",
        ],
        COOKIE,
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    let stderr = parent.stderr.take().unwrap();
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    let (mut started, mut tree, mut in_tree, mut printed) = (0, Vec::new(), false, false);
    for line in lines.by_ref() {
        if in_tree {
            in_tree = !line.is_empty();
            printed = line.is_empty();
            tree.push(line);
        } else {
            in_tree = line.starts_with("live actor tree:");
            started += usize::from(line.contains("started:"));
        }
        if started == 3 && printed {
            break;
        }
    }
    assert_eq!(started, 3);
    // The parent's tree shows each child's subtree on b under the part
    // that stands for it: the child's scope there, its driver in it, each
    // marked with the node it runs on.
    let parts: Vec<usize> = (0..tree.len())
        .filter(|i| tree[*i].contains("[remote-child]"))
        .collect();
    assert!(!parts.is_empty(), "{tree:#?}");
    for i in parts {
        let line = &tree[i];
        let depth = line.len() - line.trim_start().len();
        let name = line.trim_start().split(' ').next().unwrap_or_default();
        let short = name
            .strip_prefix("b/subagent/")
            .unwrap_or_else(|| panic!("{line}"));
        let below = &tree[i + 1];
        assert!(
            below.len() - below.trim_start().len() > depth
                && below
                    .trim_start()
                    .starts_with(&format!("scope/subagent/{short} [scope] active"))
                && below.ends_with("fiber on b"),
            "{tree:#?}"
        );
        let driver = format!("driver/{short} [agent] active");
        assert!(
            tree[i + 2..]
                .iter()
                .any(|l| l.contains(&driver) && l.ends_with("task on b")),
            "{tree:#?}"
        );
    }
    super::until_blocking("b's children never ran their command", || {
        sleeping("29.1") == 3
    });
    // A running cluster's tree: b holds a scope for the parent, with its
    // three children in it, mid-turn.
    let tree = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(["tree", "--nodes", &b.peer(), "--cookie-env", COOKIE_VAR])
        .env(COOKIE_VAR, COOKIE)
        .bounded_output()
        .unwrap();
    let shown = text(&tree.stdout);
    assert!(tree.status.success(), "{}", text(&tree.stderr));
    assert!(shown.starts_with("node b@"), "{shown}");
    assert!(shown.contains("(holds 3 of 64 children)"), "{shown}");
    assert!(shown.contains("host/b [node-host]"), "{shown}");
    assert!(shown.contains("parent/client-"), "{shown}");
    assert_eq!(shown.matches("driver/").count(), 3, "{shown}");
    assert_eq!(shown.matches("[remote-turn]").count(), 3, "{shown}");
    // SIGTERM: the workflow is cancelled, each child's turn with it.
    let pid = parent.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let rest: Vec<String> = lines.collect();
    let status = super::wait_bounded(&mut parent, "the parent run");
    // Cancelled by SIGTERM: 128 + 15, after the cancelled run wound down.
    assert_eq!(status.code(), Some(143), "{rest:?}");
    assert!(
        rest.iter()
            .any(|l| l.contains("the workflow was cancelled (SIGTERM)")),
        "{rest:?}"
    );

    // The parent ended only once b had closed its children (the close is
    // awaited): each log on b is complete, its turn aborted, its command
    // gone.
    assert_eq!(sleeping("29.1"), 0);
    let store = b.dir.join("sessions");
    let hs = b.headers();
    assert_eq!(hs.len(), 3, "{hs:?}");
    for h in &hs {
        let log = log_of(&store, h["id"].as_str().unwrap());
        let kinds: Vec<String> = log
            .lines()
            .skip(1)
            .map(|l| {
                serde_json::from_str::<Value>(l).unwrap()["type"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        let end = log
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .find(|e| e["type"] == "turn/end")
            .unwrap_or_else(|| panic!("no turn/end in {log}"));
        assert_eq!(end["data"]["reason"]["kind"], "aborted", "{log}");
        // The log is whole: the running command was cancelled and
        // answered, and the turn's end is the last entry.
        assert!(kinds.iter().any(|k| k == "tool/result"), "{kinds:?}");
        assert_eq!(
            kinds.last().map(String::as_str),
            Some("turn/end"),
            "{kinds:?}"
        );
    }
}

#[test]
fn a_ralph_loop_runs_its_rounds_on_another_node_and_gets_their_handoffs() {
    let _sweep = crate::suite::sweep();
    let b = Node::start("b", &["--demo-model"]);
    let dir = parent_dir();
    let peer = b.peer();
    let args = [
        "ralph",
        "Write the notes.",
        "--max-rounds",
        "5",
        "--demo-model",
        "--nodes",
        &peer,
        "--cookie-env",
        COOKIE_VAR,
    ];
    let run = parent(&dir, &args, COOKIE).bounded_output().unwrap();
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    // The structured handoffs came back over the wire: the loop saw
    // `continue` twice, then the worker's claim of completion.
    assert!(out.contains("round 3: complete"), "{out}");
    let rounds = b.headers();
    assert_eq!(
        rounds.len(),
        3,
        "one worker per round, all on b: {rounds:?}"
    );
    let coordinator = headers(&dir.join("sessions"))
        .into_iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    for h in &rounds {
        assert_eq!(h["parentSession"], coordinator["id"]);
        let log = log_of(&b.dir.join("sessions"), h["id"].as_str().unwrap());
        assert!(log.contains(r#""name":"report""#), "{log}");
    }
}

#[test]
fn a_run_delegates_to_another_node_through_its_subagent_remote_tool() {
    let _sweep = crate::suite::sweep();
    let b = Node::start("b", &["--demo-model"]);
    let dir = parent_dir();
    std::fs::write(
        dir.join("delegate.json"),
        r#"{"steps": [
            {"tool_calls": [{"name": "subagent_remote", "arguments": {"description": "one line", "prompt": "Write one line about actors."}}]},
            {"text": "The node answered."}
        ]}"#,
    )
    .unwrap();
    let run = run_on(&dir, "Ask a node.", "delegate.json", &b);
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    assert!(out.contains("The node answered."), "{out}");
    let session = headers(&dir.join("sessions"))
        .into_iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    // The tool's result is the answer of the child on b.
    let log = log_of(&dir.join("sessions"), session["id"].as_str().unwrap());
    let result = log
        .lines()
        .find(|l| l.contains(r#""type":"tool/result""#))
        .unwrap_or_default();
    assert!(result.contains("actors:"), "{log}");
    let children = b.headers();
    assert_eq!(children.len(), 1, "{children:?}");
    assert_eq!(children[0]["parentSession"], session["id"]);
    // What the child spent on b is the proxy's spend here: the demo model
    // reports 12 output tokens for its one step.
    let store = dir.join("sessions");
    let proxy = headers(&store)
        .into_iter()
        .find(|h| h["parentSession"] == session["id"])
        .unwrap();
    let message = log_of(&store, proxy["id"].as_str().unwrap())
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e["type"] == "assistant/message")
        .unwrap();
    let usage = &message["data"]["usage"];
    assert_eq!(usage["outputTokens"], 12, "{message}");
    assert!(usage["inputTokens"].as_u64().unwrap() > 0, "{message}");
}

#[test]
fn the_fan_out_bench_places_its_children_on_local_nodes_and_reports_their_cost() {
    let _sweep = crate::suite::sweep();
    let run = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(["bench", "w2", "--k", "6", "--local-nodes", "2"])
        .bounded_output()
        .unwrap();
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    let line = out.lines().find_map(|l| l.strip_prefix("RESULT ")).unwrap();
    let r: Value = serde_json::from_str(line).unwrap();
    // The workload checks its own semantics (every child answered `done`
    // from its node); here: both nodes ran, and the figures are there.
    assert_eq!(r["workload"], "w2-nodes");
    assert_eq!(r["delegate_calls"], 6);
    let peaks = r["node_peak_rss_kb"].as_array().unwrap();
    assert_eq!(peaks.len(), 2);
    assert!(peaks.iter().all(|p| p.as_u64().unwrap() > 0), "{r}");
    assert!(r["remote_us_per_child"].as_f64().unwrap() > 0.0, "{r}");
}

#[test]
fn a_parent_node_that_dies_has_its_children_disposed_on_the_serving_node() {
    let _sweep = crate::suite::sweep();
    let b = Node::hanging("b", "29.3");
    let dir = parent_dir();
    let mut parent = fan(
        &dir,
        &topics(2),
        &["--nodes", &b.peer(), "--cookie-env", COOKIE_VAR],
        COOKIE,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    super::until_blocking("the children never ran their command", || {
        sleeping("29.3") == 2
    });
    // The parent's process dies without a word: its session closes, and b
    // disposes what it held for it (each child's turn ends aborted, its
    // command killed).
    parent.kill().unwrap();
    let _ = parent.wait();
    super::until_blocking("b kept the children of a node that left", || {
        sleeping("29.3") == 0
    });
    let store = b.dir.join("sessions");
    super::until_blocking("the children's logs were not completed", || {
        let hs = b.headers();
        hs.len() == 2
            && hs.iter().all(|h| {
                log_of(&store, h["id"].as_str().unwrap())
                    .lines()
                    .last()
                    .is_some_and(|l| l.contains(r#""type":"turn/end""#))
            })
    });
}

#[test]
fn a_parent_torn_down_stops_its_children_on_the_node_in_reverse_start_order() {
    let _sweep = crate::suite::sweep();
    let b = Node::hanging("b", "29.4");
    let dir = parent_dir();
    // Three background children, one a step (so their start order is
    // known), each left running its command on b; then the run ends and
    // its agent is torn down with them.
    background(&dir, "three.json", 3);
    let run = run_on(&dir, "Start three.", "three.json", &b);
    let peer = b.peer();
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(sleeping("29.4"), 0, "b still runs the children's commands");
    // b's own record of the stops: its child scopes, by start (their ids
    // grow) against the global stop sequence.
    let tree = Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args([
            "tree",
            "--nodes",
            &peer,
            "--cookie-env",
            COOKIE_VAR,
            "--json",
        ])
        .env(COOKIE_VAR, COOKIE)
        .bounded_output()
        .unwrap();
    assert!(tree.status.success(), "{}", text(&tree.stderr));
    let view: Value = serde_json::from_slice(&tree.stdout).unwrap();
    let mut children: Vec<(u64, u64)> = view["b"]["stopped"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| n["kind"] == "scope" && n["name"].as_str().unwrap_or("").contains("subagent/"))
        .map(|n| (n["id"].as_u64().unwrap(), n["stop_seq"].as_u64().unwrap()))
        .collect();
    children.sort();
    assert_eq!(children.len(), 3, "{view}");
    let seqs: Vec<u64> = children.iter().map(|c| c.1).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] > w[1]),
        "started {children:?}: not stopped last-first"
    );
}

/// A self-signed certificate for 127.0.0.1 and its key, made by openssl in
/// `dir`.
fn certificate(dir: &Path, name: &str) -> (String, String) {
    let cert = dir.join(format!("{name}.pem"));
    let key = dir.join(format!("{name}.key"));
    let made = Command::new("openssl")
        .args(["req", "-x509", "-newkey", "ec", "-pkeyopt"])
        .args(["ec_paramgen_curve:P-256", "-nodes", "-days", "1"])
        .args(["-subj", &format!("/CN={name}")])
        .args(["-addext", "subjectAltName=IP:127.0.0.1"])
        .args(["-addext", "basicConstraints=critical,CA:FALSE", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .bounded_output()
        .expect("openssl runs");
    assert!(made.status.success(), "{}", text(&made.stderr));
    let path = |p: PathBuf| p.to_str().unwrap().to_owned();
    (path(cert), path(key))
}

#[test]
fn a_tls_node_takes_only_peers_that_trust_its_certificate_and_a_silent_peer_stalls_nobody() {
    let _sweep = crate::suite::sweep();
    let dir = parent_dir();
    let (cert, key) = certificate(&dir, "b");
    let (stranger, _) = certificate(&dir, "stranger");
    let b = Node::start(
        "b",
        &["--demo-model", "--tls-cert", &cert, "--tls-key", &key],
    );
    // Peers that connect and never finish a handshake (one silent, one
    // sending junk) hold no one else up.
    let _silent = std::net::TcpStream::connect(&b.addr).unwrap();
    let mut junk = std::net::TcpStream::connect(&b.addr).unwrap();
    std::io::Write::write_all(&mut junk, b"\x16\x03\x01\xff\xffnot a hello").unwrap();
    let peer = b.peer();
    let cluster = ["--nodes", &peer, "--cookie-env", COOKIE_VAR];
    let trusted = [&cluster[..], &["--tls-ca", &cert]].concat();
    let run = workflow(&dir, &topics(2), &trusted, COOKIE);
    let (out, err) = (text(&run.stdout), text(&run.stderr));
    assert!(run.status.success(), "{out}\n{err}");
    let value: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        value["r"][1].as_str().map(|a| a.starts_with("topic1:")),
        Some(true)
    );
    assert_eq!(b.headers().len(), 2, "both children ran on b");

    // In plain TCP, the node does not answer the cookie challenge.
    let plain = workflow(&dir, &topics(1), &cluster, COOKIE);
    assert_eq!(plain.status.code(), Some(1), "{}", text(&plain.stdout));
    let err = text(&plain.stderr);
    assert!(
        err.contains("cannot join b@") && err.contains("TLS only"),
        "{err}"
    );
    // A client that trusts another certificate refuses the node.
    let doubting = [&cluster[..], &["--tls-ca", &stranger]].concat();
    let refused = workflow(&dir, &topics(1), &doubting, COOKIE);
    assert_eq!(refused.status.code(), Some(1));
    let err = text(&refused.stderr);
    assert!(
        err.contains("cannot join b@") && err.contains("certificate"),
        "{err}"
    );
    // A file that is no certificate is a usage error naming it.
    let junk_ca = dir.join("fan.js");
    let bad = [&cluster[..], &["--tls-ca", junk_ca.to_str().unwrap()]].concat();
    let usage = workflow(&dir, &topics(1), &bad, COOKIE);
    assert_eq!(usage.status.code(), Some(2));
    assert!(text(&usage.stderr).contains("fan.js: holds no CERTIFICATE block"));
    assert_eq!(b.headers().len(), 2, "nothing else ran on b");
}

#[test]
fn a_node_that_leaves_cleanly_ends_its_childrens_turns_before_it_goes() {
    let _sweep = crate::suite::sweep();
    let mut b = Node::hanging("b", "29.5");
    let dir = parent_dir();
    let peer = b.peer();
    let parent = fan(
        &dir,
        &topics(2),
        &["--nodes", &peer, "--cookie-env", COOKIE_VAR],
        COOKIE,
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    super::until_blocking("b's children never ran their command", || {
        sleeping("29.5") == 2
    });
    // SIGTERM: b drains its children, then leaves.
    let pid = b.child.id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = super::wait_bounded(&mut b.child, "node b");
    assert!(status.code().is_some(), "b ended by itself: {status:?}");
    // Before it went, each child's command was stopped and its log ended
    // with its turn, aborted.
    assert_eq!(sleeping("29.5"), 0);
    let store = b.dir.join("sessions");
    let hs = b.headers();
    assert_eq!(hs.len(), 2, "{hs:?}");
    for h in &hs {
        let log = log_of(&store, h["id"].as_str().unwrap());
        let last: Value = serde_json::from_str(log.lines().last().unwrap()).unwrap();
        assert_eq!(last["type"], "turn/end", "{log}");
        assert_eq!(last["data"]["reason"]["kind"], "aborted", "{log}");
    }
    // The parent did not hang on the node that left: both children failed
    // and the workflow answered (exit 4: children failed).
    let out = super::output_bounded(parent, super::DEADLINE, "the parent run");
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("2 of 2 children failed"), "{err}");
    let value: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(
        value["r"].as_array().unwrap().iter().all(Value::is_null),
        "{value}\n{err}"
    );
}

#[test]
fn a_prompt_too_large_for_the_wire_fails_its_child_and_the_node_serves_on() {
    let _sweep = crate::suite::sweep();
    let b = Node::start("b", &["--demo-model"]);
    let dir = parent_dir();
    let huge = "x".repeat(4_300_000);
    let call = |prompt: &str| serde_json::json!({"tool_calls": [{"name": "subagent_remote", "arguments": {"description": "d", "prompt": prompt}}]});
    let script = serde_json::json!({"steps": [call(&huge), call("Write one line about actors."), {"text": "done"}]});
    std::fs::write(dir.join("huge.json"), script.to_string()).unwrap();
    let run = run_on(&dir, "Delegate twice.", "huge.json", &b);
    assert!(run.status.success(), "{}", text(&run.stderr));
    let session = headers(&dir.join("sessions"))
        .into_iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    let log = log_of(&dir.join("sessions"), session["id"].as_str().unwrap());
    let results: Vec<Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["type"] == "tool/result")
        .collect();
    assert_eq!(results.len(), 2, "{results:?}");
    // Refused before it was sent, saying why; the next child is answered.
    let first = results[0].to_string();
    assert!(
        first.contains("BAD_REQUEST") && first.contains("at most 4194304"),
        "{first}"
    );
    assert_eq!(results[0]["data"]["message"]["content"][0]["isError"], true);
    let second = results[1].to_string();
    assert!(
        results[1]["data"]["message"]["content"][0]["isError"] == false
            && second.contains("actors: "),
        "{second}"
    );
    // Nothing that large reached b: its first child never ran a turn.
    let store = b.dir.join("sessions");
    let sizes: Vec<usize> = b
        .headers()
        .iter()
        .map(|h| log_of(&store, h["id"].as_str().unwrap()).len())
        .collect();
    assert_eq!(sizes.len(), 2, "{sizes:?}");
    assert!(sizes.iter().all(|s| *s < 1 << 20), "{sizes:?}");
}

#[test]
fn a_full_node_leaves_the_room_group_and_round_robin_passes_it_by() {
    let _sweep = crate::suite::sweep();
    let dir = parent_dir();
    let bdir = fresh_dir("dsh-node").unwrap();
    std::fs::create_dir_all(bdir.join("sessions")).unwrap();
    let script = hanging_script(&bdir, "29.6");
    let script = script.to_str().unwrap();
    let b = Node::start_in(
        "b",
        &["--script", script, "--max-agents", "1"],
        bdir.clone(),
    );
    let c = Node::hanging("c", "29.6");
    // Three background children, one a step: b takes the first and is
    // full; the third would be b's turn, and goes to c.
    background(&dir, "three.json", 3);
    let nodes = format!("{},{}", b.peer(), c.peer());
    let args = [
        "run",
        "Start three.",
        "--script",
        "three.json",
        "--nodes",
        &nodes,
    ];
    let run = parent(&dir, &args, COOKIE)
        .args(["--cookie-env", COOKIE_VAR])
        .bounded_output()
        .unwrap();
    assert!(run.status.success(), "{}", text(&run.stderr));
    let session = headers(&dir.join("sessions"))
        .into_iter()
        .find(|h| h.get("parentSession").is_none())
        .unwrap();
    let log = log_of(&dir.join("sessions"), session["id"].as_str().unwrap());
    let errors = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|e| e["type"] == "tool/result")
        .filter(|e| e["data"]["message"]["content"][0]["isError"] == true)
        .count();
    assert_eq!(errors, 0, "{log}");
    assert_eq!(b.headers().len(), 1, "b holds one child at most");
    assert_eq!(c.headers().len(), 2);
}

#[test]
fn least_loaded_placement_goes_to_the_node_holding_the_fewest_children() {
    let _sweep = crate::suite::sweep();
    let b = Node::hanging("b", "29.7");
    let c = Node::hanging("c", "29.7");
    // Another parent holds two children on b.
    let dir = parent_dir();
    let mut holder = fan(
        &dir,
        &topics(2),
        &[
            "--nodes",
            &b.peer(),
            "--cookie-env",
            COOKIE_VAR,
            "--placement",
            "b",
        ],
        COOKIE,
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    super::until_blocking("the holder's children never ran", || sleeping("29.7") == 2);
    // Two more children, least-loaded: both go to c (0, then 1, against 2).
    let other = parent_dir();
    background(&other, "two.json", 2);
    let nodes = format!("{},{}", b.peer(), c.peer());
    let args = [
        "run",
        "Start two.",
        "--script",
        "two.json",
        "--nodes",
        &nodes,
    ];
    let run = parent(&other, &args, COOKIE)
        .args(["--cookie-env", COOKIE_VAR, "--placement", "least-loaded"])
        .bounded_output()
        .unwrap();
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert_eq!(c.headers().len(), 2, "both went to c");
    // (b's logs are stored once its writer's batch window passed.)
    super::until_blocking("b never stored the holder's children", || {
        b.headers().len() >= 2
    });
    assert_eq!(b.headers().len(), 2, "b holds only the holder's");
    let _ = holder.kill();
    let _ = holder.wait();
}
