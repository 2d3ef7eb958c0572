//! `dsh bench kernel`: the kernel's own costs, measured through its public API.
//!
//! - start + ordered teardown of a 1,010-actor tree (10 fibers × 10 fibers ×
//!   9 workers; 3 levels under the root),
//! - per-dispatch and per-listener cost of each event mode (5 listeners),
//! - supervised spawn (`Context::spawn`: registry node, child record, linked
//!   actor) against a bare `ractor` spawn measured in the same run.
//!
//! Every figure is the median of several rounds; the last line is
//! `RESULT {json}`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dsh_supervisors::{
    Bail, BoxError, Context, Emit, Event, NoMessages, Parallel, Plugin, PluginOptions, Runtime,
    RuntimeSettings, Serial, Waterfall, WorkerSpec,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::exit::Exit;

/// `dsh bench`: the options.
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(subcommand)]
    which: Bench,
}

impl BenchArgs {
    /// The tokio worker threads this benchmark asks for (`None`: one per core).
    pub fn threads(&self) -> Option<usize> {
        match &self.which {
            Bench::W1 {
                threads: Some(n), ..
            } => Some((*n).max(1)),
            _ => None,
        }
    }
}

#[derive(clap::Subcommand, Debug)]
enum Bench {
    /// Kernel costs: tree start + ordered teardown, event dispatch per mode,
    /// supervised vs bare spawn.
    Kernel {
        /// Measured rounds (the median is reported).
        #[arg(long, default_value_t = 5)]
        rounds: usize,
    },
    /// `derive_messages` cost per new message as the history grows.
    Derive,
    /// Session persistence: JSONL append throughput and load + derive time.
    Persist {
        /// Events to append and load back.
        #[arg(long, default_value_t = 100_000)]
        events: u64,
        /// `jsonl`, `jsonl-zstd` or `sqlite`.
        #[arg(long, default_value = "jsonl", value_parser = ["jsonl", "jsonl-zstd", "sqlite"])]
        backend: String,
    },
    /// W1: one agent, sequential turns of S steps (scripted worker model, `echo` tool).
    W1 {
        /// Turns R.
        #[arg(long, default_value_t = 200)]
        turns: u32,
        /// Steps S per turn.
        #[arg(long, default_value_t = 5)]
        steps: u32,
        /// Run in this many fresh processes (after one warm-up process) and
        /// report the median, min and max.
        #[arg(long, default_value_t = 1)]
        processes: u32,
        /// Tokio worker threads (default: one per core).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// W3: N agents created one by one, each running a 1-step turn, then
    /// kept resident; reports memory per agent and time per agent.
    W3 {
        /// Agents N.
        #[arg(long, default_value_t = 10_000)]
        n: u32,
        /// Run in this many fresh processes (after one warm-up process) and
        /// report the median, min and max.
        #[arg(long, default_value_t = 1)]
        processes: u32,
        /// Awake agents at most: above it the least recently used idle ones
        /// hibernate (0: no hibernation, every agent stays awake).
        #[arg(long, default_value_t = 16)]
        max_awake: usize,
    },
    /// The dashboard's delta stream: N active agents with and without one
    /// SSE subscriber; throughput and slowdown.
    Stream {
        /// Agents running at once.
        #[arg(long, default_value_t = 1000)]
        agents: u32,
        /// Turns per agent (5 steps each).
        #[arg(long, default_value_t = 3)]
        turns: u32,
        /// Run in this many fresh processes (after one warm-up process) and
        /// report the median, min and max.
        #[arg(long, default_value_t = 1)]
        processes: u32,
        /// Read the raw stream (every change) instead of the dashboard's
        /// coalesced one (`?coalesce=1`).
        #[arg(long)]
        raw: bool,
    },
    /// One compaction of an agent's history of N messages (the summary from
    /// the scripted model: our own cost), then `derive_messages` after it.
    Compact {
        /// Messages in the history (user and assistant, one turn per pair).
        #[arg(long, default_value_t = 1000)]
        messages: u32,
    },
    /// Our W1/W2/W3 beside the AutoAgents harness (the Rust peer), in
    /// interleaved fresh processes: medians and ratios.
    Compare(crate::compare::CompareArgs),
    /// W2: an orchestrator fans out to K concurrent sub-agents (5-step
    /// worker turns) through the subagent seam; then its tree is torn down.
    W2 {
        /// Sub-agents K.
        #[arg(long, default_value_t = 100)]
        k: u32,
        /// Run in this many fresh processes (after one warm-up process) and
        /// report the median, min and max.
        #[arg(long, default_value_t = 1)]
        processes: u32,
        /// Also place the children on this many local `dsh node` processes
        /// (started here) and report what a remote child costs.
        #[arg(long, value_name = "N", default_value_t = 0,
              value_parser = clap::value_parser!(u32).range(0..=16))]
        local_nodes: u32,
    },
}

/// Runs the benchmark and prints its figures (the last line `RESULT {json}`).
pub async fn bench(args: BenchArgs) -> Exit {
    match args.which {
        // It prints its own figures and RESULT line.
        Bench::Kernel { rounds } => match kernel(rounds).await {
            Ok(_) => Exit::ok(),
            Err(e) => Exit::failed(e.to_string()),
        },
        Bench::Persist { events, backend } => report(persist(events, &backend).await),
        Bench::Derive => {
            derive_costs(&[1_000, 10_000, 100_000, 1_000_000]);
            Exit::ok()
        }
        Bench::W1 {
            turns,
            steps,
            processes,
            threads,
        } => {
            if steps == 0 || turns == 0 {
                return Exit::usage("--turns and --steps must be at least 1");
            }
            let (t, s) = (turns.to_string(), steps.to_string());
            let mut args = vec!["bench", "w1", "--turns", &t, "--steps", &s];
            let n = threads.map(|n| n.to_string());
            if let Some(n) = &n {
                args.extend(["--threads", n.as_str()]);
            }
            workload(&args, processes, "us_per_step", workloads::w1(turns, steps)).await
        }
        Bench::Stream {
            agents,
            turns,
            processes,
            raw,
        } => {
            if agents == 0 || turns == 0 {
                return Exit::usage("--agents and --turns must be at least 1");
            }
            let (a, t) = (agents.to_string(), turns.to_string());
            let mut args = vec!["bench", "stream", "--agents", &a, "--turns", &t];
            if raw {
                args.push("--raw");
            }
            let run = workloads::stream(agents, turns, !raw);
            workload(&args, processes, "slowdown", run).await
        }
        Bench::W3 {
            n,
            processes,
            max_awake,
        } => {
            if n == 0 {
                return Exit::usage("--n must be at least 1");
            }
            let (n_text, cap_text) = (n.to_string(), max_awake.to_string());
            let args = ["bench", "w3", "--n", &n_text, "--max-awake", &cap_text];
            let cap = (max_awake > 0).then_some(max_awake);
            workload(&args, processes, "bytes_per_agent", workloads::w3(n, cap)).await
        }
        Bench::Compact { messages } => {
            if messages < 4 {
                return Exit::usage("--messages must be at least 4");
            }
            report(workloads::compact(messages).await)
        }
        Bench::Compare(args) => crate::compare::compare(args).await,
        Bench::W2 {
            k,
            processes,
            local_nodes,
        } => {
            if k == 0 {
                return Exit::usage("--k must be at least 1");
            }
            let k_text = k.to_string();
            if local_nodes > 0 {
                let n_text = local_nodes.to_string();
                let args = ["bench", "w2", "--k", &k_text, "--local-nodes", &n_text];
                return workload(
                    &args,
                    processes,
                    "wall_s",
                    workloads::w2_nodes(k, local_nodes),
                )
                .await;
            }
            let args = ["bench", "w2", "--k", &k_text];
            workload(&args, processes, "wall_s", workloads::w2(k)).await
        }
    }
}

/// Runs a workload across `processes` fresh processes (median of `key`), or
/// once here on a worker thread, as an embedding service would run it.
async fn workload(
    args: &[&str],
    processes: u32,
    key: &str,
    run: impl std::future::Future<Output = Result<serde_json::Value, BoxError>> + Send + 'static,
) -> Exit {
    if processes > 1 {
        return report(across_processes(args, processes, key).await);
    }
    let run = tokio::spawn(run);
    report(run.await.unwrap_or_else(|e| Err(e.to_string().into())))
}

/// Prints a workload's `RESULT` line, or says why it failed.
fn report(result: Result<serde_json::Value, BoxError>) -> Exit {
    match result {
        Ok(v) => {
            crate::outln!("RESULT {v}");
            Exit::ok()
        }
        Err(e) => Exit::failed(e.to_string()),
    }
}

/// A worker that does nothing.
struct Nop;

impl Actor for Nop {
    type Msg = NoMessages;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _me: ActorRef<NoMessages>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }
}

/// One level of the benchmark tree.
struct Level {
    depth: usize,
}

impl Plugin for Level {
    type Config = ();

    fn name(&self) -> &str {
        "level"
    }

    async fn apply(&self, ctx: Context, _config: Arc<()>) -> Result<(), BoxError> {
        if self.depth == 0 {
            for i in 0..9 {
                ctx.spawn(WorkerSpec::new("worker", format!("w{i}"), Nop, ()))
                    .await?;
            }
            return Ok(());
        }
        for i in 0..10 {
            let options = PluginOptions {
                name: Some(format!("level{}/{i}", self.depth)),
                ..PluginOptions::default()
            };
            ctx.plugin_with(
                Level {
                    depth: self.depth - 1,
                },
                (),
                options,
            )
            .await?;
        }
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct TreeFigures {
    actors: usize,
    start_ms: f64,
    teardown_ms: f64,
}

async fn tree_round() -> Result<TreeFigures, BoxError> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let t0 = Instant::now();
    let top = rt.root().plugin(Level { depth: 2 }, ()).await?;
    let start = t0.elapsed();
    let actors = rt.tree().live_len() - 1;
    let t1 = Instant::now();
    top.dispose().await;
    let teardown = t1.elapsed();
    let order = top.stop_order().unwrap_or_default();
    if order.len() != actors {
        return Err(format!("teardown stopped {} of {actors} actors", order.len()).into());
    }
    rt.shutdown().await;
    Ok(TreeFigures {
        actors,
        start_ms: start.as_secs_f64() * 1e3,
        teardown_ms: teardown.as_secs_f64() * 1e3,
    })
}

struct Tick(u64);
impl Event for Tick {
    const NAME: &'static str = "bench/tick";
}
impl Emit for Tick {}
impl Parallel for Tick {}
impl Bail for Tick {
    type Output = u64;
}
impl Serial for Tick {
    type Output = u64;
}
impl Waterfall for Tick {
    type Output = u64;
}

const LISTENERS: usize = 5;

async fn dispatch_costs(iterations: u64) -> Result<Vec<(&'static str, f64)>, BoxError> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let ctx = rt.root();
    for _ in 0..LISTENERS {
        ctx.on(|t: &Tick| {
            std::hint::black_box(t.0);
        })?;
        ctx.on_bail(|t: &Tick| (t.0 == u64::MAX).then_some(0))?;
        ctx.on_parallel(|t: Arc<Tick>| async move {
            std::hint::black_box(t.0);
        })?;
        ctx.on_serial(|t: Arc<Tick>| async move { (t.0 == u64::MAX).then_some(0) })?;
        ctx.on_waterfall(|t: Tick, next| async move { next.run(Tick(t.0 + 1)).await })?;
    }
    let mut out = Vec::new();
    let per = |d: Duration| d.as_secs_f64() * 1e9 / iterations as f64;

    let t = Instant::now();
    for i in 0..iterations {
        ctx.emit(&Tick(i));
    }
    out.push(("emit", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        std::hint::black_box(ctx.bail(&Tick(i)));
    }
    out.push(("bail", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        ctx.parallel(Tick(i)).await;
    }
    out.push(("parallel", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        std::hint::black_box(ctx.serial(Tick(i)).await);
    }
    out.push(("serial", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        let out = ctx.waterfall(Tick(i), |t: Tick| async move { t.0 }).await?;
        if out != i + LISTENERS as u64 {
            return Err(format!(
                "waterfall returned {out}, expected {}",
                i + LISTENERS as u64
            )
            .into());
        }
    }
    out.push(("waterfall", per(t.elapsed())));
    rt.shutdown().await;
    Ok(out)
}

async fn spawn_costs(n: usize) -> Result<(f64, f64), BoxError> {
    // Bare ractor: spawn n unlinked actors, then stop them (not timed).
    let t = Instant::now();
    let mut bare = Vec::with_capacity(n);
    for _ in 0..n {
        let (r, h) = Actor::spawn(None, Nop, ()).await?;
        bare.push((r, h));
    }
    let bare_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    // Outside the tree on purpose (the baseline), so stopped here.
    for (bare, h) in bare {
        bare.stop(None);
        let _ = h.await;
    }

    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let host = rt.root().plugin(dsh_supervisors::Group, ()).await?;
    let ctx = host.context();
    let t = Instant::now();
    for i in 0..n {
        ctx.spawn(WorkerSpec::new("worker", format!("w{i}"), Nop, ()))
            .await?;
    }
    let supervised_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    rt.shutdown().await;
    Ok((bare_us, supervised_us))
}

/// Runs the kernel benchmark and prints its figures.
pub async fn kernel(rounds: usize) -> Result<serde_json::Value, BoxError> {
    let rounds = rounds.max(1);
    // Warm-up of every path.
    tree_round().await?;
    dispatch_costs(10_000).await?;
    spawn_costs(200).await?;

    let mut starts = Vec::new();
    let mut teardowns = Vec::new();
    let mut totals = Vec::new();
    let mut actors = 0;
    for _ in 0..rounds {
        let f = tree_round().await?;
        actors = f.actors;
        totals.push(f.start_ms + f.teardown_ms);
        starts.push(f.start_ms);
        teardowns.push(f.teardown_ms);
    }
    let (start_ms, teardown_ms, total_ms) = (median(starts), median(teardowns), median(totals));
    crate::outln!(
        "tree of {actors} actors (3 levels): start {start_ms:.2} ms, ordered teardown {teardown_ms:.2} ms, total {total_ms:.2} ms (aim < 50 ms)"
    );

    let mut per_mode: Vec<Vec<(&'static str, f64)>> = Vec::new();
    for _ in 0..rounds {
        per_mode.push(dispatch_costs(100_000).await?);
    }
    let mut dispatch = serde_json::Map::new();
    for (i, (mode, _)) in per_mode[0].iter().enumerate() {
        let ns = median(per_mode.iter().map(|r| r[i].1).collect());
        crate::outln!(
            "dispatch `{mode}` with {LISTENERS} listeners: {ns:.0} ns per dispatch, {:.0} ns per listener",
            ns / LISTENERS as f64
        );
        dispatch.insert(
            (*mode).to_owned(),
            serde_json::json!({"ns_per_dispatch": ns, "ns_per_listener": ns / LISTENERS as f64}),
        );
    }

    let mut bare = Vec::new();
    let mut supervised = Vec::new();
    for _ in 0..rounds {
        let (b, s) = spawn_costs(2_000).await?;
        bare.push(b);
        supervised.push(s);
    }
    let (bare_us, supervised_us) = (median(bare), median(supervised));
    let ratio = supervised_us / bare_us;
    crate::outln!(
        "spawn: bare ractor {bare_us:.2} us, supervised {supervised_us:.2} us, ratio {ratio:.2}x (aim <= 2x)"
    );
    let result = serde_json::json!({
        "tree_actors": actors,
        "tree_start_ms": start_ms,
        "tree_teardown_ms": teardown_ms,
        "tree_total_ms": total_ms,
        "dispatch": dispatch,
        "spawn_bare_us": bare_us,
        "spawn_supervised_us": supervised_us,
        "spawn_ratio": ratio,
        "rounds": rounds,
    });
    crate::outln!("RESULT {result}");
    Ok(result)
}

/// Runs `dsh <args>` in one warm-up process and then `processes` measured
/// fresh processes; reports every run and the median, min and max of `key`.
pub async fn across_processes(
    args: &[&str],
    processes: u32,
    key: &str,
) -> Result<serde_json::Value, BoxError> {
    let exe = std::env::current_exe()?;
    let mut runs = Vec::new();
    for i in 0..=processes {
        let out = tokio::process::Command::new(&exe)
            .args(args)
            .output()
            .await?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            return Err(format!("run {i} failed: {}", String::from_utf8_lossy(&out.stderr)).into());
        }
        let line = stdout
            .lines()
            .rev()
            .find_map(|l| l.strip_prefix("RESULT "))
            .ok_or("a run printed no RESULT line")?;
        let value: serde_json::Value = serde_json::from_str(line)?;
        if i > 0 {
            crate::outln!("run {i}: {line}");
            runs.push(value);
        }
    }
    let mut figures: Vec<f64> = runs.iter().filter_map(|r| r[key].as_f64()).collect();
    figures.sort_by(|a, b| a.total_cmp(b));
    let median = figures.get(figures.len() / 2).copied().unwrap_or(f64::NAN);
    let mut summary = runs.get(figures.len() / 2).cloned().unwrap_or_default();
    if let Some(obj) = summary.as_object_mut() {
        obj.insert(format!("{key}_median"), median.into());
        obj.insert(
            format!("{key}_min"),
            figures.first().copied().unwrap_or(f64::NAN).into(),
        );
        obj.insert(
            format!("{key}_max"),
            figures.last().copied().unwrap_or(f64::NAN).into(),
        );
        obj.insert("processes".into(), processes.into());
    }
    Ok(summary)
}

/// The W1/W2/W3 workloads (`docs/benchmarks.md` says what each does).
pub mod workloads {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use dsh_actors::agent::{Agent, AgentSpec, Agents, Hibernation};
    use dsh_actors::subagent::{StartRequest, StopReason, Subagents};
    use dsh_services::llm::scripted::chunks_for;
    use dsh_services::llm::{
        ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmRequest, LlmRuntime, TokenUsage,
        ToolSchema,
    };
    use dsh_services::session::TurnEndReason;
    use dsh_services::tools::{Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};
    use dsh_supervisors::{BoxError, Runtime, RuntimeSettings};
    use futures::FutureExt;
    use futures::StreamExt;
    use futures::future::BoxFuture;
    use tokio_util::sync::CancellationToken;

    /// The worker model: a pure function of the conversation. With `n` tool
    /// results after the last user prompt, it calls `echo(n+1)` while
    /// `n < S-1`, then answers `done`.
    pub struct WorkerModel {
        steps: u32,
        calls: AtomicU64,
    }

    impl WorkerModel {
        /// A worker model for `steps` steps per turn.
        pub fn new(steps: u32) -> WorkerModel {
            WorkerModel {
                steps,
                calls: AtomicU64::new(0),
            }
        }

        /// Model calls answered.
        pub fn calls(&self) -> u64 {
            self.calls.load(Ordering::Relaxed)
        }
    }

    /// Streams `blocks` as a fake model's answer to `request`.
    fn reply(request: &LlmRequest, blocks: &[ContentBlock], finish: FinishReason) -> ChunkStream {
        let usage = TokenUsage {
            input_tokens: request.messages.len() as u64,
            output_tokens: 1,
            ..TokenUsage::default()
        };
        Box::pin(futures::stream::iter(
            chunks_for(blocks, usage, finish).into_iter().map(Ok),
        ))
    }

    /// Tool results after the last prompt (a user message from the user).
    fn results_since_prompt(request: &LlmRequest) -> u32 {
        let mut n = 0;
        for m in request.messages.iter().rev() {
            if m.source.kind == "user" {
                break;
            }
            n += m
                .content
                .iter()
                .filter(|b| matches!(b, ContentBlock::ToolResult { .. }))
                .count() as u32;
        }
        n
    }

    impl LlmAdapter for WorkerModel {
        fn name(&self) -> &str {
            "bench-worker"
        }

        fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let n = results_since_prompt(&request);
            let (blocks, finish) = if n < self.steps.saturating_sub(1) {
                let call = ContentBlock::ToolCall {
                    id: format!("call_{}", n + 1),
                    name: "echo".into(),
                    arguments: format!("{{\"i\":{}}}", n + 1),
                };
                (vec![call], FinishReason::ToolCalls)
            } else {
                (vec![ContentBlock::text("done")], FinishReason::Stop)
            };
            reply(&request, &blocks, finish)
        }
    }

    /// `echo(i: integer) -> "<i>"`.
    pub struct Echo {
        calls: AtomicU64,
    }

    impl Tool for Echo {
        fn schema(&self) -> ToolSchema {
            ToolSchema {
                name: "echo".into(),
                description: "Returns its argument.".into(),
                parameters: dsh_services::tools::parameters::<EchoArgs>(),
            }
        }

        fn is_concurrency_safe(&self) -> bool {
            true
        }

        fn execute(
            self: Arc<Self>,
            cx: ToolContext,
        ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            async move {
                let args: EchoArgs = cx.parse()?;
                Ok(ToolOutput::text(args.i.to_string()))
            }
            .boxed()
        }
    }

    // `echo`'s arguments (undescribed, as the workloads define them).
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    #[serde(deny_unknown_fields)]
    struct EchoArgs {
        i: i64,
    }

    // `delegate`'s arguments.
    #[derive(serde::Deserialize, schemars::JsonSchema)]
    #[serde(deny_unknown_fields)]
    struct DelegateArgs {
        input: String,
    }

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
    pub async fn node_services(rt: &Runtime) -> Result<(), BoxError> {
        provide(rt, 5, None).await.map(|_| ())
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

    /// W1: one agent, `turns` sequential turns of `steps` steps each.
    pub async fn w1(turns: u32, steps: u32) -> Result<serde_json::Value, BoxError> {
        let w = world(steps, None).await?;
        let agent = Agent::create(&w.rt.root(), spec("bench-worker")).await?;
        for t in 0..5 {
            turn(&agent, &format!("warmup-{t}"), steps).await?;
        }
        let (calls0, echo0) = (w.worker.calls(), w.echo.calls.load(Ordering::Relaxed));
        let start = Instant::now();
        for t in 0..turns {
            turn(&agent, &format!("turn-{t}"), steps).await?;
        }
        let wall = start.elapsed().as_secs_f64();
        let model_calls = w.worker.calls() - calls0;
        let echo_calls = w.echo.calls.load(Ordering::Relaxed) - echo0;
        let (want_calls, want_echo) = (u64::from(turns * steps), u64::from(turns * (steps - 1)));
        if model_calls != want_calls || echo_calls != want_echo {
            return Err(format!(
                "semantic mismatch: {model_calls} model calls (want {want_calls}), {echo_calls} echo calls (want {want_echo})"
            )
            .into());
        }
        let events = agent.session().next_seq();
        w.rt.shutdown().await;
        let us_per_step = wall * 1e6 / f64::from(turns * steps);
        Ok(serde_json::json!({
            "workload": "w1",
            "wall_s": wall,
            "us_per_step": us_per_step,
            "peak_rss_kb": rss_kb("VmHWM:"),
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

    /// The orchestrator model: with no tool result after the prompt, `K`
    /// `delegate` calls (`call_d<j>`, input `task-<j>`); then `done`.
    pub struct OrchestratorModel {
        k: std::sync::atomic::AtomicU32,
        calls: AtomicU64,
    }

    impl LlmAdapter for OrchestratorModel {
        fn name(&self) -> &str {
            "bench-orchestrator"
        }

        fn stream(&self, request: LlmRequest, _cancel: CancellationToken) -> ChunkStream {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let (blocks, finish) = if results_since_prompt(&request) == 0 {
                let calls = (0..self.k.load(Ordering::Relaxed))
                    .map(|j| ContentBlock::ToolCall {
                        id: format!("call_d{j}"),
                        name: "delegate".into(),
                        arguments: format!("{{\"input\":\"task-{j}\"}}"),
                    })
                    .collect();
                (calls, FinishReason::ToolCalls)
            } else {
                (vec![ContentBlock::text("done")], FinishReason::Stop)
            };
            reply(&request, &blocks, finish)
        }
    }

    /// `delegate(input)`: a fresh child agent through the subagent seam (a
    /// child actor of the orchestrator) runs one worker turn on `input`;
    /// its final text is the result. The child stays in the orchestrator's
    /// tree until the orchestrator is torn down.
    pub struct Delegate {
        subagents: Arc<Subagents>,
        calls: AtomicU64,
        finals: AtomicU64,
        /// Children go to other nodes (the `remote` provider).
        remote: std::sync::atomic::AtomicBool,
    }

    impl Tool for Delegate {
        fn schema(&self) -> ToolSchema {
            ToolSchema {
                name: "delegate".into(),
                description: "Runs a task on a fresh sub-agent.".into(),
                parameters: dsh_services::tools::parameters::<DelegateArgs>(),
            }
        }

        fn is_concurrency_safe(&self) -> bool {
            true
        }

        fn execute(
            self: Arc<Self>,
            cx: ToolContext,
        ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
            async move {
                self.calls.fetch_add(1, Ordering::Relaxed);
                let parent = Agent::calling(&cx.ctx)
                    .ok_or_else(|| ToolError::failed("delegate runs inside an agent"))?;
                let DelegateArgs { input } = cx.parse()?;
                let mut request = StartRequest::new(&parent, input, cx.cancel.clone());
                request.route = Some(("bench-worker".into(), "bench".into()));
                request.persona = Some("You are a benchmark agent.".into());
                let provider = if self.remote.load(Ordering::Relaxed) {
                    "remote"
                } else {
                    "spawn"
                };
                let run = self
                    .subagents
                    .start(provider, request)
                    .await
                    .map_err(|e| ToolError::new(e.code(), e.to_string()))?;
                let result = run.result().await;
                if result.stop_reason != StopReason::Completed {
                    return Err(ToolError::failed(format!(
                        "sub-agent ended {}",
                        result.stop_reason.as_str()
                    )));
                }
                if result.output == "done" {
                    self.finals.fetch_add(1, Ordering::Relaxed);
                }
                Ok(ToolOutput::text(result.output))
            }
            .boxed()
        }
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

    /// A `dsh node --bench-worker` process of this binary on loopback.
    struct LocalNode {
        child: tokio::process::Child,
        peer: dsh_actors::cluster::Peer,
        // Held open so the node's stderr never sees a closed pipe.
        _stderr: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>,
    }

    const NODE_COOKIE_VAR: &str = "DSH_BENCH_COOKIE";

    async fn local_node(name: &str, cookie: &str) -> Result<LocalNode, BoxError> {
        use tokio::io::AsyncBufReadExt;
        let exe = std::env::current_exe()?;
        let mut child = tokio::process::Command::new(exe)
            .args(["node", "--name", name, "--listen", "127.0.0.1:0"])
            .args(["--cookie-env", NODE_COOKIE_VAR, "--bench-worker"])
            .args(["--max-agents", "100000"])
            .env(NODE_COOKIE_VAR, cookie)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()?;
        let stderr = child.stderr.take().ok_or("the node has no stderr")?;
        let mut lines = tokio::io::BufReader::new(stderr).lines();
        let addr = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await? {
                if let Some(addr) = line.split(" listening on ").nth(1) {
                    return Ok::<_, std::io::Error>(Some(addr.trim().to_owned()));
                }
            }
            Ok(None)
        })
        .await
        .map_err(|_| format!("node {name} did not listen within 30 s"))??
        .ok_or_else(|| format!("node {name} ended before it listened"))?;
        Ok(LocalNode {
            child,
            peer: dsh_actors::cluster::Peer {
                name: name.to_owned(),
                addr,
            },
            _stderr: lines,
        })
    }

    fn peak_rss_of(pid: Option<u32>) -> u64 {
        pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("VmHWM:"))
                    .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
            })
            .unwrap_or(0)
    }

    /// W2 across `nodes` local node processes: the same fan-out once with
    /// local children, then with every child placed round-robin on the
    /// nodes (one process each, started here), and what a remote child costs.
    pub async fn w2_nodes(k: u32, nodes: u32) -> Result<serde_json::Value, BoxError> {
        use dsh_actors::cluster::remote::RemoteProvider;
        use dsh_actors::cluster::{Cluster, ClusterSettings, Placement};
        let cookie = dsh_services::llm::Message::new_id();
        let mut started = Vec::new();
        for i in 0..nodes {
            started.push(local_node(&format!("n{i}"), &cookie).await?);
        }
        let w = world(5, None).await?;
        let root = w.rt.root();
        let subagents = Arc::new(Subagents::with_builtin());
        root.provide(Subagents::SERVICE, subagents.clone())?;
        let delegate = Arc::new(Delegate {
            subagents: subagents.clone(),
            calls: AtomicU64::new(0),
            finals: AtomicU64::new(0),
            remote: std::sync::atomic::AtomicBool::new(false),
        });
        root.get::<ToolRegistry>(ToolRegistry::SERVICE)
            .ok_or("no tool registry")?
            .register(&root, delegate.clone())?;
        let orchestrator = Arc::new(OrchestratorModel {
            k: std::sync::atomic::AtomicU32::new(10),
            calls: AtomicU64::new(0),
        });
        root.get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or("no llm service")?
            .register(&root, &["bench-orchestrator"], orchestrator.clone())?;
        // Local children first, as the reference.
        fan_out(&w, &delegate, &orchestrator, 10).await?;
        orchestrator.k.store(k, Ordering::Relaxed);
        let (local_wall, local_teardown, _) = fan_out(&w, &delegate, &orchestrator, k).await?;
        // Then the same fan-out on the nodes.
        let options = dsh_supervisors::PluginOptions {
            name: Some("cluster".into()),
            ..Default::default()
        };
        let ctx = root
            .plugin_with(dsh_supervisors::Group, (), options)
            .await?
            .context();
        let settings = ClusterSettings {
            name: "bench".into(),
            cookie,
            listen: None,
            tls: None,
        };
        let cluster = Cluster::start(&ctx, settings).await?;
        for n in &started {
            cluster.connect(&n.peer, Duration::from_secs(30)).await?;
        }
        subagents.register(
            &ctx,
            Arc::new(RemoteProvider::new(cluster, Placement::RoundRobin)),
        )?;
        delegate.remote.store(true, Ordering::Relaxed);
        orchestrator.k.store(10, Ordering::Relaxed);
        fan_out(&w, &delegate, &orchestrator, 10).await?;
        orchestrator.k.store(k, Ordering::Relaxed);
        let (wall, teardown, baseline) = fan_out(&w, &delegate, &orchestrator, k).await?;
        let peak = rss_kb("VmHWM:");
        let node_peaks: Vec<u64> = started.iter().map(|n| peak_rss_of(n.child.id())).collect();
        w.rt.shutdown().await;
        for mut n in started {
            let _ = n.child.start_kill();
            let _ = tokio::time::timeout(Duration::from_secs(10), n.child.wait()).await;
        }
        let per_child = |wall: f64| wall / f64::from(k) * 1e6;
        Ok(serde_json::json!({
            "workload": "w2-nodes",
            "k": k,
            "nodes": nodes,
            "local_wall_s": local_wall,
            "wall_s": wall,
            "local_us_per_child": per_child(local_wall),
            "remote_us_per_child": per_child(wall),
            "extra_us_per_remote_child": per_child(wall) - per_child(local_wall),
            "local_teardown_ms": local_teardown * 1e3,
            "teardown_ms": teardown * 1e3,
            "parent_baseline_rss_kb": baseline,
            "parent_peak_rss_kb": peak,
            "node_peak_rss_kb": node_peaks,
            "threads": threads(),
            "delegate_calls": k,
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

    /// The dashboard's delta stream under load: `agents` active agents with
    /// and without one HTTP subscriber on `/api/tree/stream`, in alternating
    /// rounds with the server up throughout (so both sides of the ratio run
    /// in the same conditions); the stream's throughput and the slowdown it
    /// causes (median watched round over median unwatched round).
    pub async fn stream(
        agents: u32,
        turns: u32,
        coalesced: bool,
    ) -> Result<serde_json::Value, BoxError> {
        const ROUNDS: usize = 9;
        let steps = 5;
        let w = world(steps, None).await?;
        let root = w.rt.root();
        let config = crate::web::WebConfig {
            bind: "127.0.0.1:0".into(),
            token_env: None,
            mutations: false,
        };
        root.plugin(crate::web::Web, config).await?;
        let addr = root
            .get::<crate::web::WebServer>(crate::web::WebServer::SERVICE)
            .ok_or("no web server")?
            .local_addr();
        let _ = rustls::crypto::ring::default_provider().install_default();
        let url = format!(
            "http://{addr}/api/tree/stream?coalesce={}",
            u8::from(coalesced)
        );
        // Warm-up, then alternating rounds. The reader's thread and HTTP
        // client are made once, so both kinds of round start right after
        // the previous one (a pause before the watched rounds alone, to
        // make them, let the last round's leftovers settle for them only).
        active(&w, 10, 1, steps).await?;
        let reader = Outside::start()?;
        let (mut alone, mut watched) = (Vec::new(), Vec::new());
        let mut counts = StreamCounts::default();
        for _ in 0..ROUNDS {
            alone.push(active(&w, agents, turns, steps).await?);
            let stop = CancellationToken::new();
            let read = reader.watch(url.clone(), stop.clone()).await?;
            let wall = active(&w, agents, turns, steps).await;
            stop.cancel();
            let read = tokio::time::timeout(OUTSIDE_BUDGET, read)
                .await
                .map_err(|_| "the subscriber did not stop in time")?
                .map_err(|_| "the subscriber thread ended without its counts")?;
            watched.push(wall?);
            counts.add(&read);
        }
        reader.finish().await?;
        w.rt.shutdown().await;
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let (alone, watched_median) = (median(&mut alone), median(&mut watched));
        let watched_total: f64 = watched.iter().sum();
        Ok(serde_json::json!({
            "workload": "stream",
            "agents": agents,
            "turns": turns,
            "steps": steps,
            "rounds": ROUNDS,
            "wall_alone_s": alone,
            "wall_watched_s": watched_median,
            "slowdown": watched_median / alone,
            "stream": if coalesced { "coalesced (the dashboard's)" } else { "raw" },
            "changes": counts.changes,
            "sse_events": counts.events,
            "bytes": counts.bytes,
            "changes_per_s": counts.changes as f64 / watched_total,
            "folded": counts.folded,
            "dropped_events": counts.dropped,
            "threads": threads(),
        }))
    }

    /// What a stream subscriber read.
    #[derive(Default)]
    struct StreamCounts {
        bytes: u64,
        events: u64,
        changes: u64,
        dropped: u64,
        folded: u64,
    }

    impl StreamCounts {
        fn add(&mut self, other: &StreamCounts) {
            self.bytes += other.bytes;
            self.events += other.events;
            self.changes += other.changes;
            self.dropped += other.dropped;
            self.folded += other.folded;
        }
    }

    /// The subscriber as the dashboard is one: outside the agents' runtime
    /// (a browser is its own process), here an HTTP client on its own thread
    /// and runtime, so its work competes with the agents for the cores as an
    /// outside reader would, not inside their worker threads. It lives
    /// across rounds and connects for each watched one.
    struct Outside {
        watches: tokio::sync::mpsc::UnboundedSender<Watch>,
        thread: std::thread::JoinHandle<()>,
    }

    /// One watched round: the stream to read until `stop`; `connected` is
    /// answered once the server has subscribed, `counts` when done.
    struct Watch {
        url: String,
        stop: CancellationToken,
        connected: tokio::sync::oneshot::Sender<Result<(), String>>,
        counts: tokio::sync::oneshot::Sender<StreamCounts>,
    }

    /// How long connecting or finishing the outside reader may take.
    const OUTSIDE_BUDGET: Duration = Duration::from_secs(30);

    impl Outside {
        /// Starts the reader's thread, runtime and HTTP client.
        fn start() -> Result<Outside, BoxError> {
            let (watches, mut queue) = tokio::sync::mpsc::unbounded_channel::<Watch>();
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let thread = std::thread::Builder::new()
                .name("bench-subscriber".into())
                .spawn(move || {
                    rt.block_on(async move {
                        // Made in this runtime, whose tasks serve its
                        // connections.
                        let client = reqwest::Client::builder().build();
                        // Until the bench drops its sender.
                        while let Some(watch) = queue.recv().await {
                            let sent = match &client {
                                Ok(client) => client
                                    .get(&watch.url)
                                    .send()
                                    .await
                                    .map_err(|e| e.to_string()),
                                Err(e) => Err(e.to_string()),
                            };
                            let response = match sent {
                                Ok(r) => r,
                                Err(e) => {
                                    let _ = watch.connected.send(Err(e));
                                    continue;
                                }
                            };
                            let _ = watch.connected.send(Ok(()));
                            let _ = watch.counts.send(read_stream(response, watch.stop).await);
                        }
                    });
                })?;
            Ok(Outside { watches, thread })
        }

        /// Connects to `url` (the server has subscribed when this returns);
        /// the counts come once `stop` is cancelled.
        async fn watch(
            &self,
            url: String,
            stop: CancellationToken,
        ) -> Result<tokio::sync::oneshot::Receiver<StreamCounts>, BoxError> {
            let (connected_tx, connected) = tokio::sync::oneshot::channel();
            let (counts_tx, counts) = tokio::sync::oneshot::channel();
            self.watches
                .send(Watch {
                    url,
                    stop,
                    connected: connected_tx,
                    counts: counts_tx,
                })
                .map_err(|_| "the subscriber thread ended")?;
            tokio::time::timeout(OUTSIDE_BUDGET, connected)
                .await
                .map_err(|_| "the subscriber did not connect in time")?
                .map_err(|_| "the subscriber thread ended")??;
            Ok(counts)
        }

        /// Ends the reader's thread and joins it.
        async fn finish(self) -> Result<(), BoxError> {
            let Outside { watches, thread } = self;
            drop(watches);
            tokio::time::timeout(
                OUTSIDE_BUDGET,
                tokio::task::spawn_blocking(move || thread.join()),
            )
            .await
            .map_err(|_| "the subscriber thread did not end in time")??
            .map_err(|_| "the subscriber thread panicked")?;
            Ok(())
        }
    }

    /// Reads and splits events, counting changes, until `stop`.
    async fn read_stream(response: reqwest::Response, stop: CancellationToken) -> StreamCounts {
        let mut body = response.bytes_stream();
        let mut counts = StreamCounts::default();
        // Bytes of an event not complete yet. Scanned as bytes, and only the
        // new part: the reader is a client on the same two cores, so it
        // must cost what a browser's native event-stream parser would.
        let mut pending: Vec<u8> = Vec::new();
        let change = memchr::memmem::Finder::new(b"\"type\":\"");
        let folded = memchr::memmem::Finder::new(b"\"folded\":");
        loop {
            let chunk = tokio::select! {
                c = body.next() => c,
                () = stop.cancelled() => None,
            };
            let Some(Ok(chunk)) = chunk else { break };
            counts.bytes += chunk.len() as u64;
            let mut at = pending.len().saturating_sub(1);
            pending.extend_from_slice(&chunk);
            let mut start = 0;
            while let Some(end) = memchr::memmem::find(&pending[at..], b"\n\n").map(|i| at + i) {
                let block = &pending[start..end];
                counts.events += 1;
                counts.changes += change.find_iter(block).count() as u64;
                if let Some(i) = folded.find(block) {
                    let digits = &block[i + 9..];
                    let n = digits.iter().take_while(|b| b.is_ascii_digit()).count();
                    counts.folded += std::str::from_utf8(&digits[..n])
                        .ok()
                        .and_then(|d| d.parse::<u64>().ok())
                        .unwrap_or(0);
                }
                if block.starts_with(b"event: dropped") {
                    counts.dropped += 1;
                }
                start = end + 2;
                at = start;
            }
            pending.drain(..start);
        }
        counts
    }

    /// Worker threads of the runtime running the workload.
    pub fn threads() -> usize {
        tokio::runtime::Handle::try_current()
            .map(|h| h.metrics().num_workers())
            .unwrap_or(1)
    }
}

/// `derive_messages` cost as history grows: the time to append one message
/// and derive the history again, at several history sizes. Incremental
/// derivation keeps it flat per new node.
pub fn derive_costs(sizes: &[usize]) -> serde_json::Value {
    use dsh_services::llm::Message;
    use dsh_services::session::{EventData, SessionHeader, SessionLog, SurfaceIntent};
    let mut log = SessionLog::new(SessionHeader::new("bench-derive", None));
    let prompt = Arc::new(Message::user_text("x"));
    let mut out = serde_json::Map::new();
    let mut at = 0usize;
    for &size in sizes {
        while at < size {
            let _ = log.append(
                EventData::UserMessage(prompt.clone()),
                Some(SurfaceIntent::append()),
                0,
            );
            at += 1;
        }
        let _ = log.derive_messages();
        // Measure: one append + one derive, repeated.
        let rounds = 2_000usize;
        let t = Instant::now();
        for _ in 0..rounds {
            let _ = log.append(
                EventData::UserMessage(prompt.clone()),
                Some(SurfaceIntent::append()),
                0,
            );
            std::hint::black_box(log.derive_messages());
        }
        at += rounds;
        let ns = t.elapsed().as_secs_f64() * 1e9 / rounds as f64;
        crate::outln!(
            "history of {size:>7} messages: append + derive_messages {ns:.0} ns per new message"
        );
        out.insert(size.to_string(), ns.into());
    }
    let result = serde_json::json!({"workload": "derive", "ns_per_new_message_at_size": out});
    crate::outln!("RESULT {result}");
    result
}

/// `dsh bench persist`: append throughput to a JSONL session (batched by the
/// session actor, timed until flushed) and load + derive time of the result.
pub async fn persist(events: u64, backend: &str) -> Result<serde_json::Value, BoxError> {
    use dsh_actors::session::SessionHandle;
    use dsh_services::llm::{Message, StreamChunk};
    use dsh_services::persistence::{Compression, JsonlStore, SessionPersistence, SqliteStore};
    use dsh_services::session::{EventData, SessionHeader, SessionLog, SurfaceIntent};

    let root = dsh_supervisors::scratch::fresh_dir("dsh-bench-persist")?;
    let store: Arc<dyn SessionPersistence> = match backend {
        "jsonl" => Arc::new(JsonlStore::new(&root)),
        "jsonl-zstd" => Arc::new(JsonlStore::new(&root).with_compression(Compression::Zstd)),
        "sqlite" => Arc::new(SqliteStore::open(root.join("sessions.db"))?),
        other => {
            return Err(format!("unknown backend `{other}` (jsonl, jsonl-zstd or sqlite)").into());
        }
    };
    let id = Message::new_id();
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let session = SessionHandle::new(SessionLog::new(SessionHeader::new(id.clone(), None)));
    session.attach(&rt.root(), Some(store.clone())).await?;
    let prompt = Arc::new(Message::user_text(
        "a prompt of a realistic length, about one line of text",
    ));
    let t = Instant::now();
    for i in 0..events {
        if i % 5 == 0 {
            session.append(
                EventData::UserMessage(prompt.clone()),
                Some(SurfaceIntent::append()),
            )?;
        } else {
            let chunk = StreamChunk::TextDelta {
                index: 0,
                text: "token ".into(),
            };
            session.append(
                EventData::AssistantChunk {
                    turn: 1,
                    step: 1,
                    chunk: Box::new(chunk),
                },
                None,
            )?;
        }
    }
    session.flush().await?;
    let append_s = t.elapsed().as_secs_f64();
    rt.shutdown().await;
    let bytes = disk_usage(&root)?;
    // Five loads; the median is reported (the first one also pays for
    // reading the file into the page cache).
    let mut load_ms = Vec::new();
    let (mut count, mut messages) = (0, 0);
    for _ in 0..5 {
        let t = Instant::now();
        let loaded = store.load(&id)?;
        count = loaded.events.len();
        let mut log = SessionLog::from_seed(loaded.header, loaded.events, 0)?;
        messages = log.derive_messages().len();
        load_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    load_ms.sort_by(f64::total_cmp);
    let (load_min, load_ms) = (load_ms[0], load_ms[2]);
    let _ = std::fs::remove_dir_all(&root);
    if count as u64 != events || messages as u64 != events.div_ceil(5) {
        return Err(format!(
            "loaded {count} events and {messages} messages from {events} appended"
        )
        .into());
    }
    let per_s = events as f64 / append_s;
    crate::outln!(
        "{backend} append: {events} events in {:.1} ms = {per_s:.0} events/s flushed ({bytes} bytes; aim >= 200000/s)",
        append_s * 1e3
    );
    crate::outln!(
        "{backend} load + derive of {events} events: median {load_ms:.1} ms, min {load_min:.1} ms of 5 (aim < 300 ms)"
    );
    Ok(serde_json::json!({
        "workload": "persist",
        "backend": backend,
        "events": events,
        "append_events_per_s": per_s,
        "bytes": bytes,
        "load_derive_ms": load_ms,
        "load_derive_min_ms": load_min,
    }))
}

/// Bytes of every file under `dir`.
fn disk_usage(dir: &std::path::Path) -> std::io::Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            disk_usage(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}
