//! `dsh bench …`: the benchmarks, private to the binary. They drive the
//! library through its public API as an embedder would, and print
//! per-operation figures (the last line: `RESULT {json}`); none of them is
//! part of the library people embed.
//!
//! - [`kernel`]: the kernel's own costs (tree start + ordered teardown,
//!   event dispatch, supervised spawn);
//! - [`workloads`]: W1/W2/W3, the dashboard stream, compaction, and the
//!   scripted worker model and `echo` tool they run on;
//! - [`session`]: `derive_messages` and session persistence;
//! - [`compare`]: our W1/W2/W3 beside the AutoAgents harness.

use dsh_supervisors::BoxError;
use dsh_supervisors::error::chain;

use kernel::kernel;
use session::{derive_costs, persist};

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
    /// W1: one agent, R sequential turns of S steps (scripted worker model,
    /// `echo` tool), in rounds until enough was measured.
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
        /// Repeat the R turns on a fresh agent until at least this many
        /// seconds of turns were measured (three rounds at least); the
        /// figure is the median round's, with the rounds' spread.
        #[arg(long, default_value_t = 0.5, value_name = "SECS")]
        min_seconds: f64,
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
    Compare(crate::bench::compare::CompareArgs),
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
            Err(e) => Exit::failed(chain(&*e).to_string()),
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
            min_seconds,
        } => {
            if steps == 0 || turns == 0 {
                return Exit::usage("--turns and --steps must be at least 1");
            }
            if !(0.0..=600.0).contains(&min_seconds) {
                return Exit::usage("--min-seconds must be between 0 and 600");
            }
            let (t, s, m) = (
                turns.to_string(),
                steps.to_string(),
                min_seconds.to_string(),
            );
            let mut args = vec![
                "bench",
                "w1",
                "--turns",
                &t,
                "--steps",
                &s,
                "--min-seconds",
                &m,
            ];
            let n = threads.map(|n| n.to_string());
            if let Some(n) = &n {
                args.extend(["--threads", n.as_str()]);
            }
            workload(
                &args,
                processes,
                "us_per_step",
                workloads::w1(turns, steps, min_seconds),
            )
            .await
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
        Bench::Compare(args) => crate::bench::compare::compare(args).await,
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
    report(
        run.await
            .unwrap_or_else(|e| Err(chain(&e).to_string().into())),
    )
}

/// Prints a workload's `RESULT` line, or says why it failed.
fn report(result: Result<serde_json::Value, BoxError>) -> Exit {
    match result {
        Ok(v) => {
            dsh::outln!("RESULT {v}");
            Exit::ok()
        }
        Err(e) => Exit::failed(chain(&*e).to_string()),
    }
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
            dsh::outln!("run {i}: {line}");
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

mod compare;
pub mod kernel;
mod session;
pub mod workloads;
