//! # dsh-services — seams and their shared vocabulary
//!
//! ## Code map
//! - [`llm`]: messages, content blocks, the raw stream protocol
//!   (`StreamChunk`), token usage, finish reasons, and the `BlockAssembler`.
//! - [`llm`] also holds the `llm` service (provider routes, the `llm/stream`
//!   waterfall) and the keyless scripted model.
//! - [`tools`]: tool definitions, the scoped registry with restrictions, and
//!   the guarded pipeline (pre-execute → guards → execute → post-execute →
//!   finalize → `tools/result`).
//! - [`prompt`]: system prompt sections and variables (scoped, shadowing),
//!   the `system-prompt/assemble` waterfall and rendering.
//! - [`persistence`]: sessions on disk in dsh's JSONL format, crash repair
//!   on load (torn tails reported, interrupted turns closed), listing.
//! - [`approval`]: the approval seam (never / ask / always; fails closed).
//! - [`session`]: the session event log — typed events in dsh's JSON
//!   shapes, surface ops, incremental `derive_messages`, the request-header
//!   fold, forks at turn boundaries, and the `session.jsonl` reader/writer.
//!
//! Dependency direction: `supervisors <- services <- actors <- dsh`.
//!
//! ## Invariants
//! - Wire shapes (serde) live beside the types that own them; the JSON a
//!   session log holds is exactly what the upstream harness writes.
//! - A committed event is immutable (`Arc`), and derived history shares it.

pub use dsh_supervisors as kernel;

pub mod approval;
pub mod llm;
pub mod persistence;
pub mod prompt;
pub mod replay;
pub mod session;
pub mod tools;
