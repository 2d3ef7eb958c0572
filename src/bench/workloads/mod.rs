//! The W1/W2/W3 workloads (`docs/benchmarks.md` says what each does).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use dsh_actors::agent::{Agent, AgentSpec, Agents, Hibernation};
use dsh_actors::subagent::Subagents;
use dsh_services::llm::LlmRuntime;
use dsh_services::session::TurnEndReason;
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::{BoxError, Runtime, RuntimeSettings};
use futures::FutureExt;
use futures::future::BoxFuture;

mod models;
mod nodes;
mod stream;

use models::{Delegate, OrchestratorModel};
pub use models::{Echo, WorkerModel};
pub use nodes::w2_nodes;
pub use stream::stream;

/// Resident set figures from `/proc/self/status`, in KiB.
pub fn rss_kb(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

struct World {
    rt: Runtime,
    worker: Arc<WorkerModel>,
    echo: Arc<Echo>,
}

/// The bench runtime; agents hibernate above `max_awake` awake ones.
async fn world(steps: u32, max_awake: Option<usize>) -> Result<World, BoxError> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let (worker, echo) = provide(&rt, steps, max_awake).await?;
    Ok(World { rt, worker, echo })
}

/// What a bench node serves children with (`dsh node --bench-worker`):
/// the agents registry, the worker model on route `bench-worker`
/// (S = 5) and `echo`.
pub fn node_services(rt: &Runtime) -> BoxFuture<'_, Result<(), BoxError>> {
    provide(rt, 5, None).map(|r| r.map(|_| ())).boxed()
}

async fn provide(
    rt: &Runtime,
    steps: u32,
    max_awake: Option<usize>,
) -> Result<(Arc<WorkerModel>, Arc<Echo>), BoxError> {
    let root = rt.root();
    let llm = Arc::new(LlmRuntime::new());
    let tools = Arc::new(ToolRegistry::new());
    root.provide(LlmRuntime::SERVICE, llm.clone())?;
    root.provide(ToolRegistry::SERVICE, tools.clone())?;
    let policy = Hibernation {
        idle_ms: None,
        max_awake,
    };
    root.provide(Agents::SERVICE, Agents::start(&root, policy).await?)?;
    let worker = Arc::new(WorkerModel::new(steps));
    llm.register(&root, &["bench-worker"], worker.clone())?;
    let echo = Arc::new(Echo {
        calls: AtomicU64::new(0),
    });
    tools.register(&root, echo.clone())?;
    Ok((worker, echo))
}

fn spec(provider: &str) -> AgentSpec {
    let mut spec = AgentSpec::new(provider, "bench", std::env::temp_dir());
    spec.system = Some("You are a benchmark agent.".into());
    spec
}

const TURN_BUDGET: Duration = Duration::from_secs(60);

async fn turn(agent: &Agent, input: &str, steps: u32) -> Result<(), BoxError> {
    let summary = agent.run(input, TURN_BUDGET).await?;
    if summary.text != "done"
        || summary.steps != steps
        || summary.reason != TurnEndReason::Completed
    {
        return Err(format!(
            "turn `{input}` ended {summary:?}; expected `done` after {steps} steps"
        )
        .into());
    }
    Ok(())
}

/// W1: rounds of one fresh agent running `turns` sequential turns of
/// `steps` steps each, until at least `min_secs` of turns were measured
/// (three rounds at least): one 200-turn round takes a few milliseconds, so
/// a single one moves with every page fault. Creating and disposing each
/// round's agent is outside the timing. µs per step: the median round's,
/// with the spread of the rounds (fastest, 10th and 90th percentile,
/// slowest).
pub async fn w1(turns: u32, steps: u32, min_secs: f64) -> Result<serde_json::Value, BoxError> {
    /// However short the rounds, a run ends.
    const MAX_ROUNDS: usize = 100_000;
    let w = world(steps, None).await?;
    let warm = Agent::create(&w.rt.root(), spec("bench-worker")).await?;
    for t in 0..5 {
        turn(&warm, &format!("warmup-{t}"), steps).await?;
    }
    warm.dispose().await;
    let (calls0, echo0) = (w.worker.calls(), w.echo.calls.load(Ordering::Relaxed));
    let mut rounds: Vec<f64> = Vec::new();
    let mut wall = 0.0;
    let mut events = 0;
    while rounds.len() < 3 || (wall < min_secs && rounds.len() < MAX_ROUNDS) {
        let agent = Agent::create(&w.rt.root(), spec("bench-worker")).await?;
        let start = Instant::now();
        for t in 0..turns {
            turn(&agent, &format!("turn-{t}"), steps).await?;
        }
        let took = start.elapsed().as_secs_f64();
        events = agent.session().next_seq();
        agent.dispose().await;
        wall += took;
        rounds.push(took * 1e6 / f64::from(turns * steps));
    }
    let model_calls = w.worker.calls() - calls0;
    let echo_calls = w.echo.calls.load(Ordering::Relaxed) - echo0;
    let n = rounds.len() as u64;
    let (want_calls, want_echo) = (
        n * u64::from(turns * steps),
        n * u64::from(turns * (steps - 1)),
    );
    if model_calls != want_calls || echo_calls != want_echo {
        return Err(format!(
            "semantic mismatch: {model_calls} model calls (want {want_calls}), {echo_calls} echo calls (want {want_echo})"
        )
        .into());
    }
    w.rt.shutdown().await;
    rounds.sort_by(f64::total_cmp);
    let at = |q: f64| rounds[((rounds.len() - 1) as f64 * q).round() as usize];
    Ok(serde_json::json!({
        "workload": "w1",
        "wall_s": wall,
        "us_per_step": at(0.5),
        "us_per_step_min": at(0.0),
        "us_per_step_p10": at(0.1),
        "us_per_step_p90": at(0.9),
        "us_per_step_max": at(1.0),
        "rounds": rounds.len(),
        "peak_rss_kb": rss_kb("VmHWM:"),
        // At the end: the binary's and libraries' pages (code above all:
        // link/symbol-order.txt keeps what a step runs together) and the rest.
        "rss_file_kb": rss_kb("RssFile:"),
        "rss_anon_kb": rss_kb("RssAnon:"),
        "threads": threads(),
        "turns": turns,
        "steps": steps,
        "model_calls": model_calls,
        "echo_calls": echo_calls,
        "session_events": events,
        "persistence": "in-memory (session log in the agent, no file sink)",
    }))
}

/// One compaction of a history of `messages` messages, and the first
/// and a repeated `derive_messages` after it.
pub async fn compact(messages: u32) -> Result<serde_json::Value, BoxError> {
    let w = world(1, None).await?;
    let agent = Agent::create(&w.rt.root(), spec("bench-worker")).await?;
    for t in 0..messages / 2 {
        turn(
            &agent,
            &format!("turn {t}: a line of ordinary conversation"),
            1,
        )
        .await?;
    }
    let before = agent.session().derive_messages().len();
    let start = Instant::now();
    let compacted = agent.compact().await?;
    let compact_s = start.elapsed().as_secs_f64();
    if !compacted {
        return Err("nothing was compacted".into());
    }
    let start = Instant::now();
    let after = agent.session().derive_messages().len();
    let derive_first_us = start.elapsed().as_secs_f64() * 1e6;
    let start = Instant::now();
    let again = agent.session().derive_messages().len();
    let derive_again_us = start.elapsed().as_secs_f64() * 1e6;
    if after != 1 || again != 1 {
        return Err(format!("{after} messages after compaction (want 1)").into());
    }
    let events = agent.session().next_seq();
    w.rt.shutdown().await;
    println!(
        "compact: {before} messages -> 1 in {:.3} ms; derive_messages after it {derive_first_us:.1} us, then {derive_again_us:.1} us",
        compact_s * 1e3
    );
    Ok(serde_json::json!({
        "workload": "compact",
        "messages": before,
        "compact_ms": compact_s * 1e3,
        "derive_after_us": derive_first_us,
        "derive_again_us": derive_again_us,
        "session_events": events,
        "summary_model": "scripted (no network): the figure is dsh's own cost",
    }))
}

async fn fan_out(
    w: &World,
    delegate: &Delegate,
    orchestrator: &OrchestratorModel,
    k: u32,
) -> Result<(f64, f64, u64), BoxError> {
    let mut spec = spec("bench-orchestrator");
    spec.name = Some("orchestrator".into());
    // All K delegations in flight at once, as the workload defines.
    spec.max_parallel_tools = k as usize;
    let agent = Agent::create(&w.rt.root(), spec).await?;
    let before = (
        w.worker.calls(),
        w.echo.calls.load(Ordering::Relaxed),
        delegate.calls.load(Ordering::Relaxed),
        delegate.finals.load(Ordering::Relaxed),
        orchestrator.calls.load(Ordering::Relaxed),
    );
    let baseline = rss_kb("VmRSS:");
    let start = Instant::now();
    let summary = agent.run("fan-out", TURN_BUDGET).await?;
    let wall = start.elapsed().as_secs_f64();
    let k64 = u64::from(k);
    // Children on other nodes call their model and `echo` there.
    let here = if delegate.remote.load(Ordering::Relaxed) {
        0
    } else {
        1
    };
    let got = (
        w.worker.calls() - before.0,
        w.echo.calls.load(Ordering::Relaxed) - before.1,
        delegate.calls.load(Ordering::Relaxed) - before.2,
        delegate.finals.load(Ordering::Relaxed) - before.3,
        orchestrator.calls.load(Ordering::Relaxed) - before.4,
    );
    if summary.text != "done" || got != (5 * k64 * here, 4 * k64 * here, k64, k64, 2) {
        return Err(format!(
            "semantic mismatch: final `{}`, (worker calls, echo, delegate, child finals, \
             orchestrator calls) = {got:?}, want {:?}",
            summary.text,
            (5 * k64 * here, 4 * k64 * here, k64, k64, 2)
        )
        .into());
    }
    let t = Instant::now();
    agent.dispose().await;
    let teardown = t.elapsed().as_secs_f64();
    Ok((wall, teardown, baseline))
}

/// W2: an orchestrator whose first step fans out to `k` concurrent
/// sub-agents, each a 5-step worker turn.
pub async fn w2(k: u32) -> Result<serde_json::Value, BoxError> {
    let w = world(5, None).await?;
    let root = w.rt.root();
    let subagents = Arc::new(Subagents::with_builtin());
    root.provide(Subagents::SERVICE, subagents.clone())?;
    let delegate = Arc::new(Delegate {
        subagents,
        calls: AtomicU64::new(0),
        finals: AtomicU64::new(0),
        remote: std::sync::atomic::AtomicBool::new(false),
    });
    w.rt.root()
        .get::<ToolRegistry>(ToolRegistry::SERVICE)
        .ok_or("no tool registry")?
        .register(&root, delegate.clone())?;
    let orchestrator = Arc::new(OrchestratorModel {
        k: std::sync::atomic::AtomicU32::new(10),
        calls: AtomicU64::new(0),
    });
    let llm = root
        .get::<LlmRuntime>(LlmRuntime::SERVICE)
        .ok_or("no llm service")?;
    llm.register(&root, &["bench-orchestrator"], orchestrator.clone())?;
    fan_out(&w, &delegate, &orchestrator, 10).await?;
    orchestrator.k.store(k, Ordering::Relaxed);
    let (wall, teardown, baseline) = fan_out(&w, &delegate, &orchestrator, k).await?;
    let peak = rss_kb("VmHWM:");
    w.rt.shutdown().await;
    Ok(serde_json::json!({
        "workload": "w2",
        "k": k,
        "wall_s": wall,
        "baseline_rss_kb": baseline,
        "peak_rss_kb": peak,
        "peak_minus_baseline_kb": peak.saturating_sub(baseline),
        "teardown_ms": teardown * 1e3,
        "threads": threads(),
        "model_calls": 2 + 5 * u64::from(k),
        "echo_calls": 4 * u64::from(k),
        "delegate_calls": k,
        "persistence": "in-memory (session logs in the agents, no file sink)",
    }))
}

/// W3: `n` agents created one after another, each running one 1-step
/// turn and then kept resident (a later `followup` must work).
pub async fn w3(n: u32, max_awake: Option<usize>) -> Result<serde_json::Value, BoxError> {
    let w = world(1, max_awake).await?;
    let root = w.rt.root();
    let agents = root
        .get::<Agents>(Agents::SERVICE)
        .ok_or("no agents registry")?;
    let mut warm = Vec::new();
    for i in 0..10 {
        let agent = Agent::create(&root, spec("bench-worker")).await?;
        turn(&agent, &format!("warmup-{i}"), 1).await?;
        warm.push(agent);
    }
    let calls0 = w.worker.calls();
    let before = rss_kb("VmRSS:");
    let start = Instant::now();
    let mut resident = Vec::with_capacity(n as usize);
    let mut most_awake = 0;
    let (mut creating, mut turning) = (Duration::ZERO, Duration::ZERO);
    for i in 0..n {
        let t = Instant::now();
        let agent = Agent::create(&root, spec("bench-worker")).await?;
        let created = Instant::now();
        turn(&agent, &format!("task-{i}"), 1).await?;
        creating += created - t;
        turning += created.elapsed();
        resident.push(agent);
        most_awake = most_awake.max(agents.awake_count());
    }
    // Hibernations the keeper still has queued are part of the cost.
    agents.settled(Duration::from_secs(60)).await?;
    let wall = start.elapsed().as_secs_f64();
    let after = rss_kb("VmRSS:");
    let awake = agents.awake_count();
    let hibernated = resident.iter().filter(|a| a.is_hibernated()).count();
    let compact: Vec<usize> = resident
        .iter()
        .filter_map(|a| a.session().compact_len())
        .collect();
    let compact_mean = compact.iter().sum::<usize>() as f64 / compact.len().max(1) as f64;
    let model_calls = w.worker.calls() - calls0;
    if model_calls != u64::from(n) {
        return Err(format!("semantic mismatch: {model_calls} model calls, want {n}").into());
    }
    // Resident and resumable: a later followup works on a few of them,
    // with the conversation kept (two user prompts in its history).
    let picks = [0, n as usize / 2, n as usize - 1];
    for &k in picks.iter().filter(|k| **k < resident.len()) {
        let agent = &resident[k];
        turn(agent, &format!("again-{k}"), 1).await?;
        let prompts = agent
            .session()
            .derive_messages()
            .iter()
            .filter(|m| m.source.kind == "user")
            .count();
        if prompts != 2 {
            return Err(format!("agent {k} kept {prompts} prompts, want 2").into());
        }
    }
    let live = w.rt.tree().live_len();
    w.rt.shutdown().await;
    Ok(serde_json::json!({
        "workload": "w3",
        "n": n,
        "max_awake": max_awake,
        "awake_after": awake,
        "most_awake": most_awake,
        "hibernated_after": hibernated,
        "compact_log_bytes": compact_mean,
        "create_wall_s": wall,
        "baseline_rss_kb": before,
        "rss_after_kb": after,
        "bytes_per_agent": (after.saturating_sub(before) as f64 * 1024.0) / f64::from(n),
        "us_per_agent": wall * 1e6 / f64::from(n),
        // Where the per-agent time goes: creation and the turn as the
        // loop waits for them (hibernation runs beside them).
        "us_create": creating.as_secs_f64() * 1e6 / f64::from(n),
        "us_turn": turning.as_secs_f64() * 1e6 / f64::from(n),
        "threads": threads(),
        "model_calls": model_calls,
        "live_actors": live,
        "persistence": "in-memory; hibernated sessions compacted (zstd with a shared dictionary)",
    }))
}

/// Runs `agents` agents at once, each `turns` turns of `steps` steps;
/// returns the wall seconds.
async fn active(w: &World, agents: u32, turns: u32, steps: u32) -> Result<f64, BoxError> {
    let root = w.rt.root();
    let mut all = Vec::with_capacity(agents as usize);
    for _ in 0..agents {
        all.push(Agent::create(&root, spec("bench-worker")).await?);
    }
    let start = Instant::now();
    let runs = all.iter().enumerate().map(|(i, a)| async move {
        for t in 0..turns {
            turn(a, &format!("agent-{i}-turn-{t}"), steps).await?;
        }
        Ok::<(), BoxError>(())
    });
    for r in futures::future::join_all(runs).await {
        r?;
    }
    let wall = start.elapsed().as_secs_f64();
    for a in all.iter().rev() {
        a.dispose().await;
    }
    Ok(wall)
}

/// Worker threads of the runtime running the workload.
pub fn threads() -> usize {
    tokio::runtime::Handle::try_current()
        .map(|h| h.metrics().num_workers())
        .unwrap_or(1)
}
