//! # dsh-services — seams and non-agent providers
//!
//! The capability seams the agent system is written against (LLM streaming,
//! tools, session persistence, approval, subagents) and the providers that
//! are not agents themselves. It builds on the kernel in `dsh-supervisors`
//! and is filled in by the agent-core issue; today it only re-exports the
//! kernel so the dependency direction `supervisors <- services <- actors <- dsh`
//! is fixed from the start.

pub use dsh_supervisors as kernel;
