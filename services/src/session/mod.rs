//! The session log: dsh's typed, append-only event vocabulary, the ordered
//! surface and the history derived from it, and the `session.jsonl` format.
//!
//! Invariants: `seq` equals the log length before the append; committed
//! events are `Arc`-shared and never mutated; only message-producing events
//! (`user/message`, `assistant/message`, `tool/result`) carry surface
//! metadata, and the surface is the sole source of derived model history.

use std::sync::Arc;

pub mod compact;
pub mod compare;
mod event;
pub mod jsonl;
mod log;
mod packed;

pub use event::{
    CARRIED_TYPES, EventData, EventError, EventMeta, InboxSplice, RequestContext, SessionEvent,
    SurfaceOp, TodoItem, TodoStatus, ToolCallEvent, ToolErrorId, TurnEndReason, is_surface_type,
};
pub use log::{
    SESSION_FORMAT_VERSION, SessionError, SessionHeader, SessionLog, Surface, SurfaceIntent,
    derive_event_message,
};

/// Appends log-only events to the session of the agent a tool runs for.
/// Agents provide it in their scope under [`SESSION_SERVICE`].
pub trait SessionWriter: Send + Sync {
    /// Appends one log-only event; returns its seq.
    fn append_log_only(&self, data: EventData) -> Result<u64, SessionError>;
    /// The session's id.
    fn session_id(&self) -> Arc<str>;
}

/// The scoped capability name of an agent's [`SessionWriter`].
pub const SESSION_SERVICE: &str = "session";
