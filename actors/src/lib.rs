//! # dsh-actors — sessions, agents and tool executions as supervised actors
//!
//! ## Code map
//! Modules in layers: each imports only modules above it in this list.
//! - [`session`]: `SessionHandle` (appends, observers, derived history) and
//!   the session actor that owns durability (batched writes, drained on stop).
//! - [`agent`]: `Agent` — creation as one transaction, the inbox, the
//!   driver actor running turns and steps, one actor per tool call, ordered
//!   teardown, hibernation; the `agents` registry and its keeper (a folder
//!   of concerns; its module doc says which lock guards which field).
//! - [`subagent`]: the subagent seam (`spawn`, `fork` providers, continuable
//!   children) and its tools.
//! - [`workflow`]: one actor per workflow run, its QuickJS script host, and
//!   the `workflow` tool.
//! - [`ralph`]: Ralph loops (a fresh child per round, structured handoffs)
//!   and the `ralph` tool.
//! - [`cluster`]: nodes on `ractor_cluster` — the node server and its
//!   watch of peers, the host that serves children to other nodes, and the
//!   `remote` subagent provider (a proxy agent here relaying to the child).
//! - [`multi_agent`]: installs the multi-agent services and tools.
//! - [`hooks`]: Claude Code's and Codex's hook settings, run as sandboxed
//!   child processes at prompt submit, around tool calls and at stop.
//!
//! ## Invariants
//! - Only the driver appends turn, step, assistant and tool events of its agent.
//! - A session event is visible to the model only after it is appended.
//! - Every actor an agent owns is a child of the agent's scope fiber.

pub use dsh_services as services;

pub mod agent;
pub mod cluster;
pub mod hooks;
pub mod multi_agent;
pub mod ralph;
pub mod session;
pub mod subagent;
pub mod workflow;
