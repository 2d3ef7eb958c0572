//! # dsh-services — seams and their shared vocabulary
//!
//! ## Code map
//! Modules in layers: each imports only modules above it in this list.
//! - [`attachments`]: images kept by content address (PNG, JPEG, GIF,
//!   WebP, sniffed from their bytes), read back for the wire.
//! - [`llm`]: messages, content blocks, the raw stream protocol
//!   (`StreamChunk`), token usage, finish reasons, failures and their codes
//!   ([`llm::code`]), the `BlockAssembler`, the `llm` service (provider
//!   routes, the `llm/stream` waterfall), the OpenAI-compatible adapter and
//!   the keyless scripted model.
//! - [`prompt`]: system prompt sections and variables (scoped, shadowing),
//!   the `system-prompt/assemble` waterfall and rendering.
//! - [`instructions`]: a project's `AGENTS.md` files, found and rendered as
//!   one prompt section (symlinks not followed, sizes capped).
//! - [`session`]: the session event log — typed events in dsh's JSON
//!   shapes, surface ops, incremental `derive_messages`, the request-header
//!   fold, forks at turn boundaries, the `session.jsonl` reader/writer,
//!   compaction, structural comparison; a step's stream chunks are held
//!   packed in memory once its answer is committed.
//! - [`providers`]: the model providers, in one place — `openai` (any
//!   OpenAI-compatible endpoint, DeepSeek's dialect included), `scripted`
//!   (a script of steps), `replay` (a recorded session's model output),
//!   `demo` (the keyless demo model).
//! - [`approval`]: the approval seam (never / ask / always; fails closed).
//! - [`sandbox`]: permission modes and policies, the process sandbox (bwrap,
//!   else Landlock; fails closed with `SANDBOX_UNAVAILABLE`), and the
//!   secret-free environment child processes see.
//! - [`persistence`]: sessions on disk (JSONL, zstd frames, SQLite), crash
//!   repair on load (torn tails reported, interrupted turns closed), listing.
//! - [`skills`]: skills found under the project's and the user's skill
//!   directories, their catalog and their loaded form.
//! - [`definitions`]: named agent definitions (ours and Claude Code's
//!   files), found nearest first and read as hostile files.
//! - [`jobs`]: background jobs — ids, owners, statuses, streamed output
//!   with a spill file, each job a supervised worker under its owner.
//! - [`tools`]: tool definitions (arguments as one typed struct, its schema
//!   generated), the scoped registry with restrictions, the guarded pipeline
//!   (pre-execute → guards → execute → post-execute → finalize →
//!   `tools/result`), and the built-in tools.
//! - [`mcp`]: the MCP client — each configured server a supervised actor
//!   whose tools are registered as `mcp__<server>__<tool>` while it is up.
//!
//! Dependency direction: `supervisors <- services <- actors <- dsh`.
//!
//! ## Invariants
//! - Wire shapes (serde) live beside the types that own them; the JSON a
//!   session log holds is exactly what the upstream harness writes.
//! - A committed event is immutable (`Arc`), and derived history shares it.
//! - A tool's parameter schema and the struct its body parses are one type.

pub use dsh_supervisors as kernel;

pub mod approval;
pub mod attachments;
pub mod definitions;
pub mod instructions;
pub mod jobs;
pub mod llm;
pub mod mcp;
pub mod persistence;
pub mod prompt;
pub mod providers;
pub mod sandbox;
pub mod session;
pub mod skills;
pub mod tools;
