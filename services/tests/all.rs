//! Integration tests of the seams (one binary; modules under `suite/`).
#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

mod suite;
