//! Whole-system tests: the `dsh` binary run as a real child process.
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod suite;
