//! # dsh-actors — sessions, agents, tool executions, workflow engines
//!
//! The actors of the agent system, each a supervised child in the kernel's
//! tree. Filled in by the agent-core issue; today it only fixes the
//! dependency direction `supervisors <- services <- actors <- dsh`.

pub use dsh_services as services;
