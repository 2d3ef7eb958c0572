//! Hibernation: idle agents drop their actors and keep a compact session;
//! input wakes them under the same id with the same history and setup.

use std::sync::{Arc, Mutex};

use dsh_actors::agent::{
    Agent, AgentDisposed, AgentSpec, Agents, Cancelled, Hibernation, StaysAwake,
};
use dsh_services::llm::{ChunkStream, ContentBlock, LlmAdapter, LlmRequest, Message};
use dsh_services::prompt::SystemPrompt;
use dsh_services::tools::Restriction;
use dsh_supervisors::Status;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use super::harness::{Harness, Park, WAIT, answer, calls, kinds, text};

/// Answers `ok` to every request and keeps the requests.
#[derive(Default)]
struct Recorder {
    requests: Mutex<Vec<LlmRequest>>,
}

impl LlmAdapter for Recorder {
    fn name(&self) -> &str {
        "recorder"
    }
    fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
        self.requests.lock().unwrap().push(request);
        answer(vec![ContentBlock::text("ok")])
    }
}

impl Recorder {
    fn requests(&self) -> Vec<LlmRequest> {
        self.requests.lock().unwrap().clone()
    }
}

fn recorder(h: &Harness, provider: &str) -> Arc<Recorder> {
    let r = Arc::new(Recorder::default());
    h.adapter(provider, r.clone());
    r
}

/// A JSON value without `id` and `provider` fields (message ids are per
/// agent, and the two agents compared use two recording routes).
fn without_ids(mut v: Value) -> Value {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(map) => {
                map.remove("id");
                map.remove("provider");
                map.values_mut().for_each(strip);
            }
            Value::Array(items) => items.iter_mut().for_each(strip),
            _ => {}
        }
    }
    strip(&mut v);
    v
}

fn tool_names(request: &LlmRequest) -> Vec<String> {
    request.tools.iter().map(|t| t.name.clone()).collect()
}

fn agents(h: &Harness) -> Arc<Agents> {
    h.rt.root().get::<Agents>(Agents::SERVICE).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_woken_agent_sends_exactly_the_history_it_would_have_sent_awake() {
    let h = Harness::new().await;
    let (ra, rb) = (recorder(&h, "a"), recorder(&h, "b"));
    let sleeper = h.agent("a").await;
    let control = h.agent("b").await;
    sleeper.run("first", WAIT).await.unwrap();
    control.run("first", WAIT).await.unwrap();
    let history = sleeper.session().derive_messages();
    let node = sleeper.node_id();

    sleeper.hibernate().await.unwrap();
    assert!(sleeper.is_hibernated());
    assert_eq!(sleeper.status(), Status::Hibernated);
    assert!(sleeper.session().is_compact());
    assert!(sleeper.child_nodes().is_empty());
    // The tree keeps a parked node under the owner, and the scope is gone.
    let parked = h.rt.tree().get(sleeper.node_id()).unwrap();
    assert_eq!(parked.status, Status::Hibernated);
    assert_eq!(parked.parent, Some(h.rt.root().fiber().id()));
    assert_eq!(parked.summary["agent"], sleeper.id());
    assert!(h.rt.tree().get(node).is_none());
    // Reading the session does not wake it or restore the log in place.
    assert_eq!(sleeper.session().derive_messages(), history);
    assert!(sleeper.session().is_compact());

    let id = sleeper.id().to_owned();
    sleeper.run("second", WAIT).await.unwrap();
    control.run("second", WAIT).await.unwrap();
    assert_eq!(sleeper.id(), id);
    assert!(!sleeper.is_hibernated());
    assert_eq!(sleeper.status(), Status::Active);
    assert!(h.rt.tree().get(parked.id).is_none());

    let (asleep, awake) = (ra.requests(), rb.requests());
    assert_eq!((asleep.len(), awake.len()), (2, 2));
    let sent = &asleep[1].messages;
    // The very messages derived before it slept, then the new prompt.
    assert_eq!(sent.len(), history.len() + 1);
    assert!(sent.iter().zip(history.iter()).all(|(a, b)| a == b));
    assert_eq!(sent.last().unwrap().text(), "second");
    // And the same as an agent that never slept, but for message ids.
    let json = |r: &LlmRequest| {
        without_ids(json!({
            "messages": serde_json::to_value(&*r.messages).unwrap(),
            "system": r.system.as_deref(),
            "tools": serde_json::to_value(&*r.tools).unwrap(),
        }))
    };
    assert_eq!(json(&asleep[1]), json(&awake[1]));
    // Sleeping left no trace in the log: same events as the control.
    assert_eq!(kinds(&sleeper), kinds(&control));
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn persona_and_tool_restrictions_survive_a_hibernate_wake_cycle() {
    let h = Harness::new().await;
    h.rt.root()
        .provide(SystemPrompt::SERVICE, Arc::new(SystemPrompt::new()))
        .unwrap();
    let r = recorder(&h, "rec");
    let mut spec = AgentSpec::new("rec", "m", std::env::temp_dir());
    spec.system = Some("You are Ada, a careful reviewer.".into());
    spec.restriction = Some(Restriction {
        allow: None,
        deny: vec!["boom".into(), "hang".into()],
    });
    let agent = Agent::create(&h.rt.root(), spec).await.unwrap();
    agent.run("one", WAIT).await.unwrap();
    agent.hibernate().await.unwrap();
    // A steer to an idle, hibernated agent wakes it and starts a turn.
    agent.steer(Message::user_text("two")).unwrap();
    agent.when_idle(WAIT).await.unwrap();
    assert_eq!(agent.last_turn().unwrap().text, "ok");
    let requests = r.requests();
    assert_eq!(requests.len(), 2);
    let system = requests[0].system.as_deref().unwrap();
    assert!(system.contains("You are Ada"), "{system}");
    assert_eq!(requests[1].system, requests[0].system);
    let names = tool_names(&requests[0]);
    assert!(
        !names.iter().any(|n| n == "boom" || n == "hang"),
        "{names:?}"
    );
    assert!(names.iter().any(|n| n == "echo"), "{names:?}");
    assert_eq!(tool_names(&requests[1]), names);
    // The persona and the restriction are the woken scope's, not everyone's.
    let other = h.agent("rec").await;
    other.run("three", WAIT).await.unwrap();
    let third = &r.requests()[2];
    assert!(third.system.as_deref().is_none_or(|s| !s.contains("Ada")));
    assert!(tool_names(third).iter().any(|n| n == "boom"));
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_with_an_ad_hoc_registration_stays_awake_and_the_tree_says_why() {
    let h = Harness::new().await;
    recorder(&h, "rec");
    let agent = h.agent("rec").await;
    agent.run("one", WAIT).await.unwrap();
    assert!(agent.awake_reason().is_none());
    let scope = agent.context().unwrap();
    scope
        .provide("notes", Arc::new(String::from("kept in memory")))
        .unwrap();
    let why = agent.hibernate().await.unwrap_err();
    assert!(
        matches!(&why, StaysAwake::AdHoc(labels) if labels.iter().any(|l| l.contains("notes"))),
        "{why}"
    );
    assert!(why.to_string().starts_with("ad hoc registrations"), "{why}");
    assert!(!agent.is_hibernated());
    assert_eq!(
        agent.awake_reason().map(|w| w.to_string()),
        Some(why.to_string())
    );
    // The tree shows it once the next turn ends.
    agent.run("two", WAIT).await.unwrap();
    let node = h.rt.tree().get(agent.node_id()).unwrap();
    let pinned = node.summary["pinned"].as_str().unwrap_or_default();
    assert!(pinned.contains("notes"), "{}", node.summary);
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_awake_cap_hibernates_the_least_recently_used_idle_agents_never_a_working_one() {
    let h = Harness::hibernating(Hibernation {
        idle_ms: None,
        max_awake: Some(2),
    })
    .await;
    let registry = agents(&h);
    let (parked, mut count) = tokio::sync::watch::channel(0usize);
    h.tools
        .register(&h.rt.root(), Arc::new(Park { parked }))
        .unwrap();
    h.script(
        "parker",
        vec![calls(&[("park", json!({}))]), text("unparked")],
    );
    recorder(&h, "rec");
    let settle = || registry.settled(WAIT);

    let worker = h.agent("parker").await;
    worker.followup(Message::user_text("work")).unwrap();
    tokio::time::timeout(WAIT, count.wait_for(|n| *n == 1))
        .await
        .unwrap()
        .unwrap();
    let a = h.agent("rec").await;
    a.run("a", WAIT).await.unwrap();
    let b = h.agent("rec").await;
    b.run("b", WAIT).await.unwrap();
    settle().await.unwrap();
    // Three awake, cap two: the least recently used idle one sleeps.
    let asleep = |list: &[&Agent]| list.iter().map(|x| x.is_hibernated()).collect::<Vec<_>>();
    assert_eq!(asleep(&[&worker, &a, &b]), [false, true, false]);
    assert_eq!(registry.awake_count(), 2);

    let c = h.agent("rec").await;
    c.run("c", WAIT).await.unwrap();
    settle().await.unwrap();
    assert_eq!(asleep(&[&worker, &a, &b, &c]), [false, true, true, false]);
    // Using `a` again wakes it; now `c` is the least recently used.
    a.run("a again", WAIT).await.unwrap();
    settle().await.unwrap();
    assert_eq!(asleep(&[&worker, &a, &b, &c]), [false, false, true, true]);
    assert_eq!(worker.status(), Status::Active);
    assert!(worker.progress().running);

    // The worker finishes: two awake, within the cap, nobody sleeps.
    worker.cancel();
    worker.when_idle(WAIT).await.unwrap();
    settle().await.unwrap();
    assert_eq!(registry.awake_count(), 2);
    assert!(!worker.is_hibernated());
    // A new agent: `a` was used before the worker's turn ended, so it goes.
    let d = h.agent("rec").await;
    d.run("d", WAIT).await.unwrap();
    settle().await.unwrap();
    assert_eq!(asleep(&[&worker, &a, &d]), [false, true, false]);
    assert_eq!(registry.count(), 5);
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disposing_the_owner_disposes_hibernated_children_without_waking_them() {
    let h = Harness::new().await;
    recorder(&h, "rec");
    let disposed: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = disposed.clone();
    h.rt.root()
        .on(move |e: &AgentDisposed| seen.lock().unwrap().push(e.id.clone()))
        .unwrap();
    let parent = h.agent("rec").await;
    let home = parent.context().unwrap();
    let child = Agent::create(&home, AgentSpec::new("rec", "m", std::env::temp_dir()))
        .await
        .unwrap();
    child.run("work", WAIT).await.unwrap();
    child.hibernate().await.unwrap();
    let node = child.node_id();
    // A parent with a hibernated child keeps it: the child's way out lives
    // in the parent's scope.
    let why = parent.hibernate().await.unwrap_err();
    assert!(matches!(why, StaysAwake::AdHoc(_)), "{why}");
    // Cancelling a hibernated agent is a no-op that says so.
    assert_eq!(child.cancel(), Cancelled::Hibernated);
    assert!(child.is_hibernated());

    parent.dispose().await;
    assert_eq!(child.status(), Status::Disposed);
    // It never woke: the session is still at rest.
    assert!(child.session().is_compact());
    assert!(h.rt.tree().get(node).is_none());
    let record = h.rt.tree().get_stopped(node).unwrap();
    assert_eq!(
        record.stop_reason.as_deref(),
        Some("disposed while hibernated")
    );
    assert!(agents(&h).get(child.id()).is_none());
    assert_eq!(
        *disposed.lock().unwrap(),
        [child.id().to_owned(), parent.id().to_owned()]
    );
    assert!(child.followup(Message::user_text("late")).is_err());
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inject_wakes_a_hibernated_agent_and_an_idle_timeout_puts_it_back_to_sleep() {
    let h = Harness::hibernating(Hibernation {
        idle_ms: Some(0),
        max_awake: None,
    })
    .await;
    let r = recorder(&h, "rec");
    let agent = h.agent("rec").await;
    agent.run("one", WAIT).await.unwrap();
    let mut status = h.rt.tree().subscribe();
    // Idle for zero ms: the next keeper tick hibernates it.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !agent.is_hibernated() {
        assert!(tokio::time::Instant::now() < deadline, "never hibernated");
        let _ = tokio::time::timeout_at(deadline, status.recv()).await;
    }
    agent
        .inject(Message::user_text("context for later"))
        .unwrap();
    agents(&h).settled(WAIT).await.unwrap();
    // Woken (or asleep again already, after another tick): the injected
    // message is waiting for the next step either way.
    agent.run("two", WAIT).await.unwrap();
    let last = r.requests().pop().unwrap();
    let texts: Vec<String> = last.messages.iter().map(|m| m.text()).collect();
    assert_eq!(texts[texts.len() - 2..], ["two", "context for later"]);
    h.rt.shutdown().await;
}

/// Another writer (another process resuming the session) appends while the
/// agent sleeps: the wake refuses to write over it, and the log stays whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_written_by_another_writer_while_asleep_is_not_written_over() {
    use dsh_services::persistence::{JsonlStore, SessionPersistence};
    let dir = dsh_supervisors::scratch::fresh_dir("dsh-hibernate-stale").unwrap();
    let store = JsonlStore::new(&dir);
    let h = Harness::new().await;
    recorder(&h, "rec");
    let mut spec = AgentSpec::new("rec", "m", std::env::temp_dir());
    spec.store = Some(Arc::new(store.clone()) as Arc<dyn SessionPersistence>);
    let agent = Agent::create(&h.rt.root(), spec).await.unwrap();
    agent.run("first", WAIT).await.unwrap();
    agent.hibernate().await.unwrap();
    let mut theirs = (*agent.session().events().last().unwrap().clone()).clone();
    theirs.seq = agent.session().next_seq();
    {
        let _writer = store.lock_writer(agent.id()).unwrap();
        store
            .append(agent.id(), &[Arc::new(theirs.clone())])
            .unwrap();
    }
    let err = agent.run("second", WAIT).await.unwrap_err().to_string();
    assert!(err.contains("SESSION_BUSY"), "{err}");
    let stored = store.load(agent.id()).unwrap();
    assert!(stored.repairs.is_empty(), "{:?}", stored.repairs);
    assert_eq!(stored.events.last().unwrap().to_json(), theirs.to_json());
    h.rt.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The parts of `error` from the outside in: its text, its source's, ….
fn causes(error: &dyn std::error::Error) -> Vec<String> {
    std::iter::successors(Some(error), |e| e.source())
        .map(|e| e.to_string())
        .collect()
}

/// An agent whose session store cannot take its writer lock (the `locks`
/// folder is a file) fails with every cause: which file, and what the OS
/// said, each once; a log that does not load says which file and which
/// line, each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failure_reaches_the_caller_with_each_cause_once() {
    use dsh_services::persistence::{JsonlStore, SessionPersistence, StoreError};
    use dsh_supervisors::error::chain;
    let dir = dsh_supervisors::scratch::fresh_dir("dsh-error-chain").unwrap();
    std::fs::write(dir.join("locks"), "a file where the lock folder goes").unwrap();
    let store = JsonlStore::new(&dir);
    let h = Harness::new().await;
    recorder(&h, "rec");
    let mut spec = AgentSpec::new("rec", "m", std::env::temp_dir());
    spec.store = Some(Arc::new(store.clone()) as Arc<dyn SessionPersistence>);
    let Err(err) = Agent::create(&h.rt.root(), spec).await else {
        panic!("an agent was created without its writer lock");
    };
    let parts = causes(&err);
    assert_eq!(parts.len(), 2, "{parts:?}");
    assert!(
        parts[0].contains("locks") && parts[0].ends_with(".lock"),
        "{parts:?}"
    );
    let os = std::io::Error::from_raw_os_error(match std::fs::create_dir_all(dir.join("locks")) {
        Err(e) => e.raw_os_error().unwrap(),
        Ok(()) => panic!("a file became a folder"),
    });
    assert_eq!(parts[1], os.to_string());
    for pair in parts.windows(2) {
        assert!(
            !pair[0].contains(&pair[1]),
            "a cause is said twice: {parts:?}"
        );
    }
    let shown = chain(&err).to_string();
    assert_eq!(shown, parts.join(": "));
    assert_eq!(shown.matches(&parts[1]).count(), 1, "{shown}");
    h.rt.shutdown().await;

    // A log damaged on its second line: the file, then the line.
    let id = "damaged";
    store
        .create(&dsh_services::session::SessionHeader::new(id, None), &[])
        .unwrap();
    let log = dir.join(id).join("session.jsonl");
    let header = std::fs::read_to_string(&log).unwrap();
    std::fs::write(&log, format!("{header}{{not json\n{{}}\n")).unwrap();
    let err = store.load(id).unwrap_err();
    assert!(matches!(err, StoreError::Load { .. }), "{err:?}");
    let parts = causes(&err);
    assert!(parts.len() >= 2, "{parts:?}");
    assert!(parts[0].contains("session.jsonl"), "{parts:?}");
    assert!(parts[1].starts_with("line "), "{parts:?}");
    for pair in parts.windows(2) {
        assert!(
            !pair[0].contains(&pair[1]),
            "a cause is said twice: {parts:?}"
        );
    }
    assert_eq!(chain(&err).to_string(), parts.join(": "));
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_session_is_written_once_across_sleeps_without_gaps_or_repeats() {
    use dsh_services::persistence::{JsonlStore, SessionPersistence};
    let dir = dsh_supervisors::scratch::fresh_dir("dsh-hibernate").unwrap();
    let store = JsonlStore::new(&dir);
    let h = Harness::new().await;
    recorder(&h, "rec");
    let mut spec = AgentSpec::new("rec", "m", std::env::temp_dir());
    spec.store = Some(Arc::new(store.clone()) as Arc<dyn SessionPersistence>);
    let agent = Agent::create(&h.rt.root(), spec).await.unwrap();
    let busy = |store: &JsonlStore| match store.lock_writer(agent.id()) {
        Err(dsh_services::persistence::StoreError::Busy { pid, .. }) => {
            assert_eq!(pid, Some(std::process::id()));
            true
        }
        Ok(lock) => {
            assert!(lock.is_some(), "a JSONL store locks");
            false
        }
        Err(e) => panic!("{e}"),
    };
    for round in 0..3 {
        agent.run(&format!("round {round}"), WAIT).await.unwrap();
        // The live agent is the session's one writer.
        assert!(busy(&store), "round {round}: awake and unlocked");
        // Hibernating writes what is pending first, and lets go.
        agent.hibernate().await.unwrap();
        assert!(!busy(&store), "round {round}: asleep and still locked");
        let stored = store.load(agent.id()).unwrap();
        assert_eq!(stored.events.len() as u64, agent.session().next_seq());
    }
    // Every event once, in order, as the agent has it.
    let stored: Vec<Value> = store
        .load(agent.id())
        .unwrap()
        .events
        .iter()
        .map(|e| e.to_json())
        .collect();
    let kept: Vec<Value> = agent
        .session()
        .events()
        .iter()
        .map(|e| e.to_json())
        .collect();
    assert_eq!(stored, kept);
    assert_eq!(agent.progress().turn, 3);
    // Appended while asleep, then disposed asleep: still written.
    agent.record("ralph/round", json!({"asleep": true}));
    assert!(agent.is_hibernated());
    agent.dispose().await;
    let last = store
        .load(agent.id())
        .unwrap()
        .events
        .last()
        .unwrap()
        .to_json();
    assert_eq!(last["type"], "ralph/round");
    assert_eq!(
        store.load(agent.id()).unwrap().events.len() as u64,
        agent.session().next_seq()
    );
    h.rt.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_of_one_template_share_one_envelope_and_a_scoped_tool_stays_its_agents() {
    let h = Harness::new().await;
    let rec = recorder(&h, "rec");
    let with_tool = h.agent("rec").await;
    let (parked, _count) = tokio::sync::watch::channel(0usize);
    h.tools
        .register(&with_tool.context().unwrap(), Arc::new(Park { parked }))
        .unwrap();
    with_tool.run("one", WAIT).await.unwrap();
    let (b, c) = (h.agent("rec").await, h.agent("rec").await);
    b.run("one", WAIT).await.unwrap();
    c.run("one", WAIT).await.unwrap();
    let sent = rec.requests();
    let park = String::from("park");
    assert!(tool_names(&sent[0]).contains(&park));
    assert!(!tool_names(&sent[1]).contains(&park));
    assert_eq!(tool_names(&sent[1]), tool_names(&sent[2]));
    // One schema list for the two agents built alike, not a copy each.
    assert!(Arc::ptr_eq(&sent[1].tools, &sent[2].tools));
    assert!(!Arc::ptr_eq(&sent[0].tools, &sent[1].tools));
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleeps_wakes_and_disposal_of_one_agent_take_turns() {
    let h = Harness::hibernating(Hibernation {
        idle_ms: None,
        max_awake: None,
    })
    .await;
    let rec = recorder(&h, "rec");
    let agent = h.agent("rec").await;
    agent.run("one", WAIT).await.unwrap();
    for _ in 0..20 {
        let (slept, woke, slept_again, woke_again) = tokio::join!(
            agent.hibernate(),
            agent.wake(),
            agent.hibernate(),
            agent.wake()
        );
        assert!(
            slept.is_ok() && slept_again.is_ok(),
            "{slept:?} {slept_again:?}"
        );
        assert!(woke.is_ok() && woke_again.is_ok());
        assert_eq!(agent.is_hibernated(), agent.status() == Status::Hibernated);
    }
    agent.run("two", WAIT).await.unwrap();
    // The second request carries the whole history: no cycle lost any of it.
    let sent = rec.requests();
    assert_eq!(sent.len(), 2);
    assert_eq!(sent[1].messages.len(), 3);
    let (_, ()) = tokio::join!(agent.hibernate(), agent.dispose());
    assert_eq!(agent.status(), Status::Disposed);
    let left = h.rt.tree().snapshot();
    assert!(
        left.iter().all(|n| n.status != Status::Hibernated),
        "a parked node outlived its agent"
    );
    h.rt.shutdown().await;
}
