//! # dsh — the facade crate and the `dsh` command
//!
//! ## Code map
//! - [`catalogue`]: the compiled-in plugins a `cordis.yml` may name.
//! - [`run`]: `dsh run` — one agent, one turn, streamed to the terminal.
//! - [`replay`]: `dsh replay` — re-run a recorded session, compare structurally.
//! - [`sessions`]: `dsh sessions` — list, show, fork, export stored sessions.
//! - [`multi`]: `dsh workflow`, `dsh ralph`, `dsh demo` — multi-agent runs.
//! - [`demo`]: the keyless demo model (a pure function of the conversation).
//! - [`bench`]: `dsh bench …` workloads, printing per-operation costs and ratios.
//! - `main.rs`: the CLI (`dsh check`, `dsh tree`, `dsh bench`).
//!
//! The kernel, seams and actors are re-exported as [`kernel`], [`services`]
//! and [`actors`] so an embedder depends on this one crate.

pub use dsh_actors as actors;
pub use dsh_services as services;
pub use dsh_supervisors as kernel;

pub mod bench;
pub mod catalogue;
pub mod demo;
pub mod multi;
pub mod replay;
pub mod run;
pub mod sessions;
pub mod web;
