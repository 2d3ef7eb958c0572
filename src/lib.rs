//! # dsh — supervised agents for your service
//!
//! dsh runs LLM agents as supervised actors: every agent, subagent, tool
//! call, workflow run and model provider is a node of one supervision tree,
//! and tearing a parent down drains and disposes its children in order.
//! This crate is what a service depends on; the `dsh` command is built on
//! it.
//!
//! ## Five lines
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dsh = dsh::Dsh::builder().model(dsh::Model::demo()).start().await?;
//! let answer = dsh.agent().run("Write one line about supervision.").await?;
//! assert!(answer.text.starts_with("supervision:"));
//! dsh.shutdown().await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## A guide
//!
//! - **Boot** with [`Dsh::builder`]: a [`Model`] (the keyless demo, a
//!   scripted one for tests, an OpenAI-compatible endpoint, DeepSeek), a
//!   workspace, a permission mode and sandbox, where sessions are kept, the
//!   limits. Nothing asks a person by default: a call that needs approval
//!   is refused.
//! - **Agents**: [`Dsh::agent`] gives an [`AgentBuilder`] (system prompt,
//!   tools, a named definition, model, timeout); `.run(prompt)` answers
//!   once and disposes the agent, `.spawn()` keeps a resident
//!   [`AgentHandle`] — `run`, `send`, `steer`, `cancel`, and its session's
//!   [`Events`] as a stream.
//! - **Your own tools**: [`CustomTool`] — a typed argument struct whose
//!   schema is derived, an async body, the [`Effect`]s it has — on the
//!   builder (every agent's) or on one agent.
//! - **Many agents**: [`Dsh::workflow`] runs a JavaScript workflow whose
//!   `agent()` calls are children of a coordinator; [`Dsh::ralph`] runs a
//!   Ralph loop, a fresh worker per round with a structured handoff.
//! - **Errors** are one type per operation — [`StartError`], [`RunError`],
//!   [`FlowError`], [`ShutdownError`] — each with a stable `code()` and
//!   `is_retryable()`.
//! - **Shutdown**: [`Dsh::shutdown`] disposes the whole tree in order
//!   within its budget; running turns end `aborted` in their sessions.
//! - **The dashboard** in your own server: [`web`] (the HTTP/SSE API and
//!   the page over the live tree).
//! - **Underneath**: the kernel ([`kernel`]: runtime, plugins, fibers,
//!   the tree), the seams ([`services`]: model messages, sessions, tools,
//!   sandbox, stores) and the actors ([`actors`]: agents, subagents,
//!   workflows, Ralph) are re-exported, so this one crate is the
//!   dependency. [`Dsh::runtime`] reaches the kernel's runtime.
//!
//! `docs/embedding.md` in the repository walks through a whole axum service
//! (`examples/embed.rs`).
//!
//! ## Code map (for contributors)
//! The library's modules in layers: each imports only modules above it.
//! The `dsh` command's own modules are the binary's (`src/main.rs` lists
//! them); the ones it shares with the library are hidden from these docs
//! and are not part of the API.
//! - `out`: stdout and stderr that a closed reader does not crash
//!   (`out!`, `outln!`, `err!`, `errln!`).
//! - `lines`: how a run's lines read (where a child runs, how it ended,
//!   its time and tokens) and text from outside made inert for a terminal.
//! - `record`: a run's own record — its tree's nodes, live and stopped,
//!   with status, time and tokens, bounded — and its rendering.
//! - `home`: `~/.dsh` (the default sessions store, the anonymous id).
//! - [`web`]: the `web` plugin — the HTTP/SSE API and the dashboard page.
//! - [`catalogue`]: the compiled-in plugins a `cordis.yml` may name.
//! - [`tool`]: tools written in Rust — a typed argument struct, an async
//!   body, the effects it declares (checked against the calling agent's
//!   policy before it runs).
//! - [`embed`]: the front door — [`Dsh::builder`] boots a runtime with one
//!   model; agents, workflows and Ralph loops run under it; one error type
//!   per operation.

pub use dsh_actors as actors;
pub use dsh_services as services;
/// The keyless demo model (its home is with the other providers).
pub use dsh_services::providers::demo;
pub use dsh_supervisors as kernel;
pub use embed::{
    AgentBuilder, AgentHandle, Answer, Dsh, DshBuilder, Events, FlowError, Model, RalphBuilder,
    RunError, ShutdownError, StartError, WorkflowBuilder, WorkflowOutput,
};
pub use tool::{Call, CustomTool, CustomToolBuilder, Effect};

pub mod catalogue;
pub mod embed;
#[doc(hidden)]
pub mod home;
#[doc(hidden)]
pub mod lines;
#[doc(hidden)]
pub mod out;
#[doc(hidden)]
pub mod record;
pub mod tool;
pub mod web;
