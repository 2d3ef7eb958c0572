//! # dsh-actors — sessions, agents and tool executions as supervised actors
//!
//! ## Code map
//! - [`session`]: `SessionHandle` (appends, observers, derived history) and
//!   the session actor that owns durability (buffered JSONL, drained on stop).
//! - [`agent`]: `Agent` — creation as one transaction, the inbox
//!   (`followup`, `steer`, `inject`), `cancel`, `when_idle`, the driver actor
//!   running turns and steps, one actor per tool call, ordered teardown; the
//!   `agents` registry service.
//!
//! ## Invariants
//! - Only the driver appends turn, step, assistant and tool events of its agent.
//! - Every actor an agent owns is a child of the agent's scope fiber.

pub use dsh_services as services;

pub mod agent;
pub mod multi_agent;
pub mod ralph;
pub mod session;
pub mod subagent;
pub mod workflow;
