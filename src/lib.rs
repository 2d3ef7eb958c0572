//! # dsh — the facade crate and the `dsh` command
//!
//! ## Code map
//! - [`catalogue`]: the compiled-in plugins a `cordis.yml` may name.
//! - [`web`]: the `web` plugin — the HTTP/SSE API and the dashboard page.
//! - [`demo`]: the keyless demo model (a pure function of the conversation).
//! - [`exit`]: how a command ends (exit codes, library errors turned into them).
//! - [`args`]: the options every agent-creating command shares (model,
//!   policy, plugin tree, workspace, sessions store).
//! - [`stage`]: booting the agent services and the model those options name.
//! - the commands, each with its `…Args`: [`config`] (`dsh check`, `dsh
//!   tree`), [`run`], [`sessions`], [`replay`], [`multi`] (`dsh workflow`,
//!   `dsh ralph`, `dsh demo`), [`serve`], [`bench`].
//! - `main.rs`: parses the command line and dispatches.
//!
//! The kernel, seams and actors are re-exported as [`kernel`], [`services`]
//! and [`actors`] so an embedder depends on this one crate.

pub use dsh_actors as actors;
pub use dsh_services as services;
pub use dsh_supervisors as kernel;

pub mod args;
pub mod bench;
pub mod catalogue;
pub mod config;
pub mod demo;
pub mod exit;
pub mod multi;
pub mod replay;
pub mod run;
pub mod serve;
pub mod sessions;
pub mod stage;
pub mod web;
