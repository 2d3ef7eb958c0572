//! Integration tests of sessions, agents and tool executions.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod suite;
