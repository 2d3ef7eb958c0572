//! The `dsh` command.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use dsh::catalogue::default_catalogue;
use dsh::kernel::tree::render;
use dsh::kernel::{BootError, Error, Loader, Runtime, RuntimeSettings, Source};

/// mimalloc: agent work allocates many small short-lived objects (events,
/// messages, actor mailboxes); glibc's allocator spent a third of the W1
/// instructions in malloc/free.
/// (`--features system-allocator` keeps the system allocator, for heap
/// profilers such as heaptrack that intercept malloc.)
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for a config that does not validate (or bad arguments).
const EXIT_CONFIG: u8 = 2;
/// Exit code for a runtime failure (a plugin that failed to start, …).
const EXIT_FAILURE: u8 = 1;

#[derive(Parser)]
#[command(
    name = "dsh",
    version,
    about = "dsh: a supervised actor runtime for multi-agent LLM work"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

// Parsed once per process; boxing the large `Run` variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Validate a cordis.yml (and its patches) without starting anything.
    Check {
        /// The config file.
        #[arg(default_value = "cordis.yml")]
        file: PathBuf,
        /// Patch layers applied by entry id, in order.
        #[arg(long = "patch")]
        patches: Vec<PathBuf>,
        /// Print the JSON schema of a plugin's config instead.
        #[arg(long, value_name = "PLUGIN")]
        schema: Option<String>,
    },
    /// Boot a cordis.yml, print the live supervision tree, shut down in order.
    Tree {
        /// The config file.
        #[arg(default_value = "cordis.yml")]
        file: PathBuf,
        /// Patch layers applied by entry id, in order.
        #[arg(long = "patch")]
        patches: Vec<PathBuf>,
        /// Print the tree as JSON (one array of nodes).
        #[arg(long)]
        json: bool,
    },
    /// Run one prompt through an agent; the answer streams to stdout, tool
    /// calls to stderr.
    Run {
        /// The prompt.
        prompt: String,
        /// Play a script with the keyless scripted model.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["base_url", "model"])]
        script: Option<PathBuf>,
        /// OpenAI-compatible endpoint, e.g. https://api.deepseek.com/v1 (or $DSH_BASE_URL).
        #[arg(long)]
        base_url: Option<String>,
        /// Model id (or $DSH_MODEL).
        #[arg(long)]
        model: Option<String>,
        /// Environment variable holding the API key.
        #[arg(long, default_value = "DSH_API_KEY")]
        api_key_env: String,
        /// Approval policy for actions that ask: never, ask, always (default ask).
        #[arg(long)]
        approval: Option<dsh_services::approval::ApprovalPolicy>,
        /// Boot this cordis.yml for the services and the model provider.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["script", "base_url"])]
        config: Option<PathBuf>,
        /// Patch layers of --config, applied by entry id.
        #[arg(long = "patch", requires = "config")]
        patches: Vec<PathBuf>,
        /// Provider route to use (default: the only one registered).
        #[arg(long)]
        provider: Option<String>,
        /// Print the session events as JSON lines on stdout.
        #[arg(long)]
        json: bool,
        /// Print the actor tree on stderr at the end.
        #[arg(long)]
        tree: bool,
        /// Workspace root (default: the current directory).
        #[arg(long, default_value = ".")]
        cwd: PathBuf,
        /// Write the session log (JSONL) here.
        #[arg(long, value_name = "FILE")]
        session: Option<PathBuf>,
        /// System prompt.
        #[arg(long)]
        system: Option<String>,
        /// Steps allowed in the turn.
        #[arg(long, default_value_t = 64)]
        max_steps: u32,
        /// Continue a stored session (its id, as `dsh sessions list` shows).
        #[arg(long, value_name = "ID", conflicts_with = "session")]
        resume: Option<String>,
        #[command(flatten)]
        store: dsh::sessions::StoreChoice,
    },
    /// Stored sessions: list, show, fork, export.
    Sessions {
        #[command(subcommand)]
        what: SessionsCommand,
        #[command(flatten)]
        store: dsh::sessions::StoreChoice,
    },
    /// Re-run a recorded session (ours or the upstream harness's): its prompts
    /// turn by turn, its model output step by step, the tools for real; then
    /// compare turns, steps, tool calls, final texts and end reasons.
    Replay {
        /// The recorded `session.jsonl`.
        log: PathBuf,
        /// Workspace the tools run in.
        #[arg(long, default_value = ".")]
        cwd: PathBuf,
        /// Write the new session log here.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
        /// Print the verdict as JSON.
        #[arg(long)]
        json: bool,
    },
    /// The keyless demo: a workflow fanning out to three subagents and a
    /// three-round Ralph loop, with the live actor tree and the log paths.
    Demo {
        /// Workspace root (default: the current directory).
        #[arg(long, default_value = ".")]
        cwd: PathBuf,
        #[command(flatten)]
        store: dsh::sessions::StoreChoice,
    },
    /// Run a workflow script (JavaScript; `agent()`, `phase()`, `log()`,
    /// `args`) whose subagents are children of a coordinator agent.
    Workflow {
        /// The script file.
        script: PathBuf,
        /// The `args` global, as JSON.
        #[arg(long)]
        args: Option<String>,
        /// The meta block, as JSON (default: named after the file).
        #[arg(long)]
        meta: Option<String>,
        /// Print the live actor tree once the first child is in flight.
        #[arg(long)]
        tree: bool,
        #[command(flatten)]
        model: ModelFlags,
        /// Workspace root (default: the current directory).
        #[arg(long, default_value = ".")]
        cwd: PathBuf,
        #[command(flatten)]
        store: dsh::sessions::StoreChoice,
    },
    /// Run a Ralph loop: a fresh worker per round on one objective, with a
    /// structured handoff between rounds.
    Ralph {
        /// The objective (omit with --resume).
        #[arg(required_unless_present = "resume")]
        objective: Option<String>,
        /// Round cap (1..=256).
        #[arg(long, default_value_t = 20)]
        max_rounds: u32,
        /// Continue the loop recorded in this coordinator session.
        #[arg(long, value_name = "ID", conflicts_with = "objective")]
        resume: Option<String>,
        #[command(flatten)]
        model: ModelFlags,
        /// Workspace root (default: the current directory).
        #[arg(long, default_value = ".")]
        cwd: PathBuf,
        #[command(flatten)]
        store: dsh::sessions::StoreChoice,
    },
    /// Serve the HTTP/SSE API over the live actor tree until Ctrl-C/SIGTERM.
    Serve {
        /// Boot this cordis.yml first (its `web` entry, if any, is used).
        #[arg(long, value_name = "FILE")]
        config: Option<PathBuf>,
        /// Address to listen on (loopback by default).
        #[arg(long, default_value = "127.0.0.1:7878")]
        bind: String,
        /// Environment variable holding the bearer token (required off loopback).
        #[arg(long)]
        token_env: Option<String>,
        /// Enable the endpoints that create and steer agents.
        #[arg(long)]
        mutations: bool,
    },
    /// Run a benchmark and print its figures (last line: `RESULT {json}`).
    Bench {
        #[command(subcommand)]
        which: Bench,
    },
}

/// The model of `dsh workflow` / `dsh ralph`.
#[derive(clap::Args, Clone, Debug)]
struct ModelFlags {
    /// Use the built-in keyless demo model.
    #[arg(long, conflicts_with_all = ["base_url", "model"])]
    demo_model: bool,
    /// OpenAI-compatible endpoint (or $DSH_BASE_URL).
    #[arg(long)]
    base_url: Option<String>,
    /// Model id (or $DSH_MODEL).
    #[arg(long)]
    model: Option<String>,
    /// Environment variable holding the API key.
    #[arg(long, default_value = "DSH_API_KEY")]
    api_key_env: String,
}

impl ModelFlags {
    fn pick(self) -> Result<dsh::multi::ModelChoice, dsh::run::RunExit> {
        dsh::multi::ModelChoice::pick(self.demo_model, self.base_url, self.model, self.api_key_env)
    }
}

fn exit_with(command: &str, exit: dsh::run::RunExit) -> ExitCode {
    if let Some(m) = exit.message {
        eprintln!("dsh {command}: {m}");
    }
    ExitCode::from(exit.code)
}

#[derive(Subcommand)]
enum SessionsCommand {
    /// Every stored session, newest first.
    List {
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
    /// A session's header, repairs and turns.
    Show {
        /// Session id.
        id: String,
    },
    /// A new session seeded with the events through `--at` (a turn boundary).
    Fork {
        /// Session id.
        id: String,
        /// Last seq to include (default: the whole log).
        #[arg(long)]
        at: Option<u64>,
    },
    /// The session log (repaired) as JSONL on stdout.
    Export {
        /// Session id.
        id: String,
    },
}

#[derive(Subcommand)]
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
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DSH_LOG").unwrap_or_else(|_| "off".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Command::Bench {
        which: Bench::W1 {
            threads: Some(n), ..
        },
    } = &cli.command
    {
        builder.worker_threads((*n).max(1));
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dsh: cannot start the async runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    rt.block_on(run(cli.command))
}

async fn run(command: Command) -> ExitCode {
    match command {
        Command::Check {
            file,
            patches,
            schema,
        } => check(file, patches, schema),
        Command::Tree {
            file,
            patches,
            json,
        } => tree(file, patches, json).await,
        Command::Sessions { what, store } => {
            let exit = match dsh::sessions::open_store(&store) {
                Err(exit) => exit,
                Ok(store) => match what {
                    SessionsCommand::List { json } => dsh::sessions::list(&*store, json),
                    SessionsCommand::Show { id } => dsh::sessions::show(&*store, &id),
                    SessionsCommand::Fork { id, at } => dsh::sessions::fork(&*store, &id, at),
                    SessionsCommand::Export { id } => dsh::sessions::export(&*store, &id),
                },
            };
            if let Some(m) = exit.message {
                eprintln!("dsh sessions: {m}");
            }
            ExitCode::from(exit.code)
        }
        Command::Replay {
            log,
            cwd,
            out,
            json,
        } => {
            let exit = dsh::replay::replay(dsh::replay::ReplayOptions {
                log,
                cwd,
                out,
                json,
            })
            .await;
            if let Some(m) = exit.message {
                eprintln!("dsh replay: {m}");
            }
            ExitCode::from(exit.code)
        }
        Command::Demo { cwd, store } => exit_with("demo", dsh::multi::demo(store, cwd).await),
        Command::Serve {
            config,
            bind,
            token_env,
            mutations,
        } => serve(config, bind, token_env, mutations).await,
        Command::Workflow {
            script,
            args,
            meta,
            tree,
            model,
            cwd,
            store,
        } => {
            let model = match model.pick() {
                Ok(m) => m,
                Err(e) => return exit_with("workflow", e),
            };
            let opts = dsh::multi::WorkflowOptions {
                script,
                args,
                meta,
                tree,
                model,
                cwd,
                store,
            };
            exit_with("workflow", dsh::multi::workflow(opts).await)
        }
        Command::Ralph {
            objective,
            max_rounds,
            resume,
            model,
            cwd,
            store,
        } => {
            let model = match model.pick() {
                Ok(m) => m,
                Err(e) => return exit_with("ralph", e),
            };
            let opts = dsh::multi::RalphOptions {
                objective,
                max_rounds,
                resume,
                model,
                cwd,
                store,
            };
            exit_with("ralph", dsh::multi::ralph(opts).await)
        }
        Command::Run {
            prompt,
            script,
            base_url,
            model,
            api_key_env,
            approval,
            config,
            patches,
            provider,
            json,
            tree,
            cwd,
            session,
            system,
            max_steps,
            resume,
            store,
        } => {
            let opts = dsh::run::RunOptions {
                prompt,
                script,
                base_url,
                model,
                api_key_env,
                approval,
                config,
                patches,
                provider,
                json,
                tree,
                cwd,
                session_out: session,
                system,
                max_steps,
                resume,
                store,
            };
            let exit = dsh::run::run(opts).await;
            if let Some(m) = exit.message {
                eprintln!("dsh run: {m}");
            }
            ExitCode::from(exit.code)
        }
        Command::Bench {
            which: Bench::Kernel { rounds },
        } => match dsh::bench::kernel(rounds).await {
            Ok(_) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("dsh bench kernel: {e}");
                ExitCode::from(EXIT_FAILURE)
            }
        },
        Command::Bench {
            which: Bench::Persist { events, backend },
        } => report(dsh::bench::persist(events, &backend).await),
        Command::Bench {
            which: Bench::Derive,
        } => {
            dsh::bench::derive_costs(&[1_000, 10_000, 100_000, 1_000_000]);
            ExitCode::SUCCESS
        }
        Command::Bench {
            which:
                Bench::W1 {
                    turns,
                    steps,
                    processes,
                    threads,
                },
        } => {
            if steps == 0 || turns == 0 {
                eprintln!("dsh bench w1: --turns and --steps must be at least 1");
                return ExitCode::from(EXIT_CONFIG);
            }
            let (t, s) = (turns.to_string(), steps.to_string());
            let mut args = vec!["bench", "w1", "--turns", &t, "--steps", &s];
            let n = threads.map(|n| n.to_string());
            if let Some(n) = &n {
                args.extend(["--threads", n.as_str()]);
            }
            let run = dsh::bench::workloads::w1(turns, steps);
            workload(&args, processes, "us_per_step", run).await
        }
        Command::Bench {
            which:
                Bench::Stream {
                    agents,
                    turns,
                    processes,
                    raw,
                },
        } => {
            if agents == 0 || turns == 0 {
                eprintln!("dsh bench stream: --agents and --turns must be at least 1");
                return ExitCode::from(EXIT_CONFIG);
            }
            let (a, t) = (agents.to_string(), turns.to_string());
            let mut args = vec!["bench", "stream", "--agents", &a, "--turns", &t];
            if raw {
                args.push("--raw");
            }
            let run = dsh::bench::workloads::stream(agents, turns, !raw);
            workload(&args, processes, "slowdown", run).await
        }
        Command::Bench {
            which:
                Bench::W3 {
                    n,
                    processes,
                    max_awake,
                },
        } => {
            if n == 0 {
                eprintln!("dsh bench w3: --n must be at least 1");
                return ExitCode::from(EXIT_CONFIG);
            }
            let (n_text, cap_text) = (n.to_string(), max_awake.to_string());
            let args = ["bench", "w3", "--n", &n_text, "--max-awake", &cap_text];
            let cap = (max_awake > 0).then_some(max_awake);
            workload(
                &args,
                processes,
                "bytes_per_agent",
                dsh::bench::workloads::w3(n, cap),
            )
            .await
        }
        Command::Bench {
            which: Bench::W2 { k, processes },
        } => {
            if k == 0 {
                eprintln!("dsh bench w2: --k must be at least 1");
                return ExitCode::from(EXIT_CONFIG);
            }
            let k_text = k.to_string();
            let args = ["bench", "w2", "--k", &k_text];
            workload(&args, processes, "wall_s", dsh::bench::workloads::w2(k)).await
        }
    }
}

async fn serve(
    config: Option<PathBuf>,
    bind: String,
    token_env: Option<String>,
    mutations: bool,
) -> ExitCode {
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dsh serve: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let root = rt.root();
    let booted = match &config {
        Some(file) => {
            let source = Source {
                base: file.clone(),
                patches: Vec::new(),
            };
            match Loader::boot(&rt, default_catalogue(), source).await {
                Err(BootError::Config(e)) => {
                    eprintln!("dsh serve: {e}");
                    rt.shutdown().await;
                    return ExitCode::from(EXIT_CONFIG);
                }
                Err(e) => Err(e.to_string()),
                Ok((_, failures)) if !failures.is_empty() => Err(failures
                    .iter()
                    .map(|(id, why)| format!("entry `{id}`: {why}"))
                    .collect::<Vec<_>>()
                    .join("\n")),
                Ok(_) => Ok(()),
            }
        }
        None => root
            .plugin(dsh::catalogue::AgentServices, Default::default())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string()),
    };
    let web = match booted {
        Err(e) => Err(e),
        Ok(()) => match root.get::<dsh::web::WebServer>(dsh::web::WebServer::SERVICE) {
            Some(w) => Ok(w),
            None => {
                let config = dsh::web::WebConfig {
                    bind,
                    token_env,
                    mutations,
                };
                match root.plugin(dsh::web::Web, config).await {
                    Err(Error::PluginFailed { reason, .. }) => Err(reason),
                    Err(e) => Err(e.to_string()),
                    Ok(_) => root
                        .get::<dsh::web::WebServer>(dsh::web::WebServer::SERVICE)
                        .ok_or_else(|| "the web plugin provided no server".to_owned()),
                }
            }
        },
    };
    let web = match web {
        Ok(w) => w,
        Err(e) => {
            eprintln!("dsh serve: {e}");
            rt.shutdown().await;
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    // One line on stdout: where to connect (tests and scripts read it).
    println!("dsh serve: listening on http://{}", web.local_addr());
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("dsh serve: cannot watch SIGTERM: {e}");
            rt.shutdown().await;
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    rt.shutdown().await;
    ExitCode::SUCCESS
}

/// Runs a workload across `processes` fresh processes (median of `key`), or
/// once here on a worker thread, as an embedding service would run it.
async fn workload(
    args: &[&str],
    processes: u32,
    key: &str,
    run: impl std::future::Future<Output = Result<serde_json::Value, dsh::kernel::BoxError>>
    + Send
    + 'static,
) -> ExitCode {
    if processes > 1 {
        return report(dsh::bench::across_processes(args, processes, key).await);
    }
    let run = tokio::spawn(run);
    report(run.await.unwrap_or_else(|e| Err(e.to_string().into())))
}

/// Prints a workload's `RESULT` line, or its error.
fn report(result: Result<serde_json::Value, dsh::kernel::BoxError>) -> ExitCode {
    match result {
        Ok(v) => {
            println!("RESULT {v}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dsh bench: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn check(file: PathBuf, patches: Vec<PathBuf>, schema: Option<String>) -> ExitCode {
    let catalogue = default_catalogue();
    if let Some(name) = schema {
        return match catalogue.schema(&name) {
            Some(s) => {
                println!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
                ExitCode::SUCCESS
            }
            None => {
                eprintln!(
                    "dsh check: unknown plugin `{name}` (known: {})",
                    catalogue.names().join(", ")
                );
                ExitCode::from(EXIT_CONFIG)
            }
        };
    }
    let source = Source {
        base: file,
        patches,
    };
    match source.plan(&catalogue) {
        Ok(plan) => {
            let all = plan.flatten();
            let enabled = all.iter().filter(|(e, _)| !e.disabled).count();
            println!(
                "{}: ok ({} entries, {} enabled)",
                source.base.display(),
                all.len(),
                enabled
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

async fn tree(file: PathBuf, patches: Vec<PathBuf>, json: bool) -> ExitCode {
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dsh tree: cannot start the runtime: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let source = Source {
        base: file,
        patches,
    };
    let booted = Loader::boot(&rt, default_catalogue(), source).await;
    let code = match booted {
        Err(BootError::Config(e)) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_CONFIG)
        }
        Err(e) => {
            eprintln!("dsh tree: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
        Ok((_loader, failures)) => {
            let nodes = rt.tree().snapshot();
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&nodes).unwrap_or_default()
                );
            } else {
                print!("{}", render(&nodes));
            }
            for (id, reason) in &failures {
                eprintln!("entry `{id}` failed to start: {reason}");
            }
            if failures.is_empty() {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), rt.shutdown())
        .await
        .is_err()
    {
        eprintln!("dsh tree: shutdown did not finish within 60 s");
        return ExitCode::from(EXIT_FAILURE);
    }
    code
}
