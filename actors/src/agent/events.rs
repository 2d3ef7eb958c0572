//! The events an agent emits and the waterfalls it runs, for plugins to
//! listen to: creation and disposal, each step, the request of a step, and
//! the moment a turn is about to end.

use std::sync::Arc;

use dsh_services::llm::{LlmRequest, Message};
use dsh_supervisors::{Context, Emit, Event};
use tokio_util::sync::CancellationToken;

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

/// Before each step, with the messages about to enter it (the turn's
/// prompt or continuation, steered input, injected context), before any
/// of them is logged (mode: waterfall). The decision is authoritative:
/// `Enter` the (possibly changed) batch, or `Reject` the step, which
/// ends the turn `blocked` without it.
pub struct AgentPreStep {
    /// Agent id.
    pub agent: String,
    /// Turn number.
    pub turn: u32,
    /// Step number.
    pub step: u32,
    /// The messages entering the step.
    pub entering: Vec<Arc<Message>>,
    /// The agent's scoped context.
    pub ctx: Context,
    /// The turn's cancel signal.
    pub cancel: CancellationToken,
}

/// What `agent/pre-step` decided.
pub enum PreStepDecision {
    /// The step runs with these messages entering it.
    Enter(Vec<Arc<Message>>),
    /// The step does not run; the turn ends `blocked` for this reason.
    Reject(String),
}

impl Event for AgentPreStep {
    const NAME: &'static str = "agent/pre-step";
}

impl dsh_supervisors::Waterfall for AgentPreStep {
    type Output = PreStepDecision;
}

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
    /// The agent's scoped context.
    pub ctx: Context,
    /// The turn's cancel signal.
    pub cancel: CancellationToken,
}

impl Event for AgentTurnStopping {
    const NAME: &'static str = "agent/turn-stopping";
}

impl dsh_supervisors::Serial for AgentTurnStopping {
    type Output = String;
}
