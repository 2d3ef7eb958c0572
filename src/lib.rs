//! # dsh — the facade crate and the `dsh` command
//!
//! ## Code map
//! Modules in layers: each imports only modules above it in this list.
//! - [`out`]: stdout and stderr that a closed reader does not crash
//!   (`out!`, `outln!`, `err!`, `errln!`).
//! - [`lines`]: how a run's lines read (where a child runs, how it ended,
//!   its time and tokens) and text from outside made inert for a terminal.
//! - [`board`]: a run's children as they go: the progress line on a
//!   terminal, the summary table at the end.
//! - [`record`]: a run's own record — its tree's nodes, live and stopped,
//!   with status, time and tokens, bounded — and its rendering.
//! - [`exit`]: how a command ends (exit codes, library errors turned into them).
//! - [`home`]: `~/.dsh` (the default sessions store, the anonymous id).
//! - [`args`]: the options every agent-creating command shares (model,
//!   policy, plugin tree, workspace, sessions store).
//! - [`web`]: the `web` plugin — the HTTP/SSE API and the dashboard page.
//! - [`catalogue`]: the compiled-in plugins a `cordis.yml` may name.
//! - [`sessions`]: `dsh sessions` — list, show, fork, export stored sessions.
//! - [`stage`]: booting the agent services and the model those options name.
//! - [`embed`]: the front door for services — [`Dsh::builder`] boots a
//!   runtime with one model; agents, workflows and Ralph loops run under
//!   it; one error type per operation.
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
//!
//! Each command module owns its `…Args` (clap); `main.rs` parses the command
//! line and dispatches. The benchmarks (`dsh bench`) are modules of the
//! binary, not of this library: they drive it through its public API, as an
//! embedder would.
//!
//! The kernel, seams and actors are re-exported as [`kernel`], [`services`]
//! and [`actors`] so an embedder depends on this one crate.

pub use dsh_actors as actors;
pub use dsh_services as services;
/// The keyless demo model (its home is with the other providers).
pub use dsh_services::providers::demo;
pub use dsh_supervisors as kernel;
pub use embed::{
    AgentBuilder, AgentHandle, Answer, Dsh, DshBuilder, Events, FlowError, Model, RalphBuilder,
    RunError, ShutdownError, StartError, WorkflowBuilder, WorkflowOutput,
};

pub mod acp;
pub mod agents;
pub mod args;
pub mod board;
pub mod catalogue;
pub mod chat;
pub mod config;
pub mod embed;
pub mod exit;
pub mod home;
pub mod lines;
pub mod multi;
pub mod node;
pub mod out;
pub mod record;
pub mod replay;
pub mod run;
pub mod serve;
pub mod sessions;
pub mod stage;
pub mod web;
