//! The events an agent emits and the waterfalls it runs, for plugins to
//! listen to: creation and disposal, each step, the request of a step, and
//! the moment a turn is about to end.

use dsh_services::llm::LlmRequest;
use dsh_supervisors::{Emit, Event};

/// Emitted when an agent is created (mode: emit).
#[derive(Clone, Debug)]
pub struct AgentCreated {
    /// Agent id.
    pub id: String,
}

impl Event for AgentCreated {
    const NAME: &'static str = "agent/created";
}

impl Emit for AgentCreated {}

/// Emitted when an agent is disposed (mode: emit).
#[derive(Clone, Debug)]
pub struct AgentDisposed {
    /// Agent id.
    pub id: String,
}

impl Event for AgentDisposed {
    const NAME: &'static str = "agent/disposed";
}

impl Emit for AgentDisposed {}

/// Before each step (mode: emit).
#[derive(Clone, Debug)]
pub struct AgentPreStep {
    /// Agent id.
    pub agent: String,
    /// Turn number.
    pub turn: u32,
    /// Step number.
    pub step: u32,
}

impl Event for AgentPreStep {
    const NAME: &'static str = "agent/pre-step";
}

impl Emit for AgentPreStep {}

/// The request of a step, before `llm/stream` (mode: waterfall); listeners
/// may rewrite it.
pub struct AgentRequest {
    /// Agent id.
    pub agent: String,
    /// The request.
    pub request: LlmRequest,
}

impl Event for AgentRequest {
    const NAME: &'static str = "agent/request";
}

impl dsh_supervisors::Waterfall for AgentRequest {
    type Output = LlmRequest;
}

/// The model answered without tool calls and the turn is about to end
/// (mode: serial). A listener returning `Some(text)` continues the turn with
/// that text as a new user-role message (a goal or loop continuation).
pub struct AgentTurnStopping {
    /// Agent id.
    pub agent: String,
    /// Turn number.
    pub turn: u32,
    /// The answer that would end the turn.
    pub text: String,
}

impl Event for AgentTurnStopping {
    const NAME: &'static str = "agent/turn-stopping";
}

impl dsh_supervisors::Serial for AgentTurnStopping {
    type Output = String;
}
