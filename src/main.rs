//! The `dsh` command: parses the arguments and hands each subcommand to its
//! module, which returns an [`Exit`](exit::Exit).
//!
//! ## Code map
//! The command's own modules, in layers: each imports only modules above
//! it (and the library, `dsh`, whose modules it shares as `crate::…`).
//! - [`exit`]: how a command ends (exit codes, library errors turned into them).
//! - [`args`]: the options every agent-creating command shares (model,
//!   policy, plugin tree, workspace, sessions store).
//! - [`board`]: a run's children as they go: the progress line on a
//!   terminal, the summary table at the end.
//! - [`sessions`]: `dsh sessions` — list, show, fork, export stored sessions.
//! - [`stage`]: booting the agent services and the model those options name.
//! - [`agents`]: `dsh agents list|show` — the named agent definitions found.
//! - [`config`]: `dsh check`, `dsh tree`, `dsh mcp list`.
//! - [`replay`]: `dsh replay` — re-run a recorded session, compare structurally.
//! - [`acp`]: `dsh acp` — the Agent Client Protocol over stdio, one agent
//!   per session (on a model, or on a recording).
//! - [`node`]: `dsh node` — join a cluster and serve children to other
//!   nodes; the `--nodes` options that place a command's children there.
//! - [`serve`]: `dsh serve` — the API and dashboard until Ctrl-C.
//! - [`run`]: `dsh run` — one agent, one turn, streamed to the terminal.
//! - [`multi`]: `dsh workflow`, `dsh ralph`, `dsh demo` — multi-agent runs.
//! - [`chat`]: `dsh chat` — an interactive session on one resident agent:
//!   what a typed line means, the agent's events as display items, the
//!   commands, and the transcript seat (stdin not a terminal).
//! - [`bench`]: `dsh bench` — the benchmarks, driving the library through
//!   its public API as an embedder would.
//!
//! Each command module owns its `…Args` (clap); `main` parses the command
//! line and dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
// The library's modules the command shares, reachable as `crate::…`.
use dsh::{catalogue, err, errln, home, lines, out, outln, record, web};
use dsh_supervisors::error::chain;

mod acp;
mod agents;
mod args;
mod bench;
mod board;
mod chat;
mod config;
mod exit;
mod multi;
mod node;
mod replay;
mod run;
mod serve;
mod sessions;
mod stage;

/// mimalloc: agent work allocates many small short-lived objects (events,
/// messages, actor mailboxes); glibc's allocator spent a third of the W1
/// instructions in malloc/free. Built with `no_thp`: its arenas are not
/// advised for transparent huge pages, so a process grows in 4 KiB pages,
/// not 2 MiB ones (W1's peak 44 -> 35 MiB, a W2 of 100 children 6.1 -> 3.1
/// MiB, at about 5 % of W1's time on two threads; docs/benchmarks.md).
/// (`--features system-allocator` keeps the system allocator, for heap
/// profilers such as heaptrack that intercept malloc.)
#[cfg(not(feature = "system-allocator"))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "dsh",
    version,
    about = "dsh: a supervised actor runtime for multi-agent LLM work",
    after_help = "Exit codes: 0 done; 1 the work failed (the cause is printed; also a \
                  session log not fully written, or a session another process writes: \
                  SESSION_BUSY); 2 bad arguments, a bad file or config, or no model \
                  configured; 3 a Ralph loop ended blocked or without progress; 4 a \
                  workflow ended with failed children (listed; --allow-failures: 0); \
                  130 cancelled."
)]
struct Cli {
    /// None: `dsh chat` on a terminal, the help elsewhere.
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Validate a cordis.yml (and its patches) without starting anything.
    Check(config::CheckArgs),
    /// Boot a cordis.yml, print the live supervision tree, shut down in order;
    /// with `--nodes`, print the tree of each node of a running cluster.
    Tree(Box<config::TreeCommand>),
    /// Run one prompt through an agent; the answer streams to stdout, tool
    /// calls to stderr.
    Run(Box<run::RunArgs>),
    /// Talk with one agent, turn after turn: type a message, `!` to steer
    /// the running turn, `/help` for the commands; each turn is stored.
    Chat(Box<chat::ChatArgs>),
    /// Stored sessions: list, show, fork, export.
    Sessions(sessions::SessionsArgs),
    /// Named agent definitions (.dsh/agents, .claude/agents, ~/.dsh/agents):
    /// list what was found, show one.
    Agents(agents::AgentsArgs),
    /// Re-run a recorded session (ours or the upstream harness's): its prompts
    /// turn by turn, its model output step by step, the tools for real; then
    /// compare turns, steps, tool calls, final texts and end reasons.
    Replay(replay::ReplayArgs),
    /// The keyless demo: a workflow fanning out to three subagents and a
    /// three-round Ralph loop, with the live actor tree and the log paths.
    Demo(multi::DemoArgs),
    /// Run a workflow script (JavaScript; `agent()`, `phase()`, `log()`,
    /// `args`) whose subagents are children of a coordinator agent.
    Workflow(Box<multi::WorkflowArgs>),
    /// Run a Ralph loop: a fresh worker per round on one objective, with a
    /// structured handoff between rounds.
    Ralph(Box<multi::RalphArgs>),
    /// Serve the HTTP/SSE API and dashboard over the live actor tree until
    /// Ctrl-C/SIGTERM.
    Serve(Box<serve::ServeArgs>),
    /// Run a benchmark and print its figures (last line: `RESULT {json}`).
    Bench(bench::BenchArgs),
    /// Serve the Agent Client Protocol on stdin/stdout (for editors and
    /// parent agents); exits 0 when stdin closes.
    Acp(Box<acp::AcpArgs>),
    /// Join a cluster as a node that runs child agents for parents on other
    /// nodes (`--nodes` of workflow and ralph); until Ctrl-C/SIGTERM.
    Node(Box<node::NodeArgs>),
    /// MCP servers of a cordis.yml: `dsh mcp list` connects them and shows
    /// each one's state and tools.
    Mcp(config::McpArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `dsh` alone: a chat at a terminal; elsewhere the help (exit 2), as
    // any missing subcommand.
    let command = match cli.command {
        Some(c) => c,
        None if chat::terminal::usable() => match Cli::parse_from(["dsh", "chat"]).command {
            Some(chat) => chat,
            None => return ExitCode::from(exit::USAGE),
        },
        None => {
            let _ = <Cli as clap::CommandFactory>::command().print_help();
            return ExitCode::from(exit::USAGE);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DSH_LOG").unwrap_or_else(|_| "off".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    raise_open_file_limit();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Command::Bench(b) = &command
        && let Some(n) = b.threads()
    {
        builder.worker_threads(n);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            errln!("dsh: cannot start the async runtime: {}", chain(&e));
            return ExitCode::from(exit::FAILED);
        }
    };
    let code = rt.block_on(dispatch(command));
    // Whatever a tool started and nothing reaped dies with us, reaped
    // (before the runtime's drop, which waits for blocking tasks that may
    // wait on it).
    rt.block_on(dsh::services::sandbox::end_commands());
    drop(rt);
    code
}

async fn dispatch(command: Command) -> ExitCode {
    let (name, exit) = match command {
        Command::Check(args) => ("check", config::check(args)),
        Command::Tree(args) if !args.cluster.nodes.is_empty() => {
            ("tree", node::trees(args.cluster, args.tree.json).await)
        }
        Command::Tree(args) => ("tree", config::tree(args.tree).await),
        Command::Run(args) => ("run", run::run(*args).await),
        Command::Chat(args) => ("chat", chat::chat(*args).await),
        Command::Sessions(args) => ("sessions", sessions::sessions(args)),
        Command::Agents(args) => ("agents", agents::agents(args)),
        Command::Replay(args) => ("replay", replay::replay(args).await),
        Command::Demo(args) => ("demo", multi::demo(args).await),
        Command::Workflow(args) => ("workflow", multi::workflow(*args).await),
        Command::Ralph(args) => ("ralph", multi::ralph(*args).await),
        Command::Serve(args) => ("serve", serve::serve(*args).await),
        Command::Bench(args) => ("bench", bench::bench(args).await),
        Command::Acp(args) => ("acp", acp::acp(*args).await),
        Command::Mcp(args) => ("mcp", config::mcp(args).await),
        Command::Node(args) => (
            "node",
            node::node(*args, bench::workloads::node_services).await,
        ),
    };
    exit.report(name)
}

/// Most open files this process asks for (a soft limit above it is kept).
const OPEN_FILES: u64 = 65_536;

/// Raises the soft limit on open files toward the hard one: every live
/// agent holds its session's lock file open, so a thousand children need
/// more than the usual soft 1,024.
fn raise_open_file_limit() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        let wanted = hard.min(OPEN_FILES);
        if soft < wanted {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, wanted, hard);
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every subcommand's arguments are well formed (unique names, real
    /// conflicts); clap checks this only when a subcommand is parsed.
    #[test]
    fn the_command_line_is_well_formed() {
        use clap::CommandFactory;
        super::Cli::command().debug_assert();
    }
}
