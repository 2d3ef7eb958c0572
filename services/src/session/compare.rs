//! A structural view of a session for comparing two runs: per turn, its
//! steps, its tool calls (names and parsed arguments), its final assistant
//! text and how it ended.

use serde_json::Value;

use super::event::{EventData, SessionEvent, TurnEndReason};

/// One turn, structurally.
#[derive(Clone, Debug, PartialEq)]
pub struct TurnShape {
    /// Turn number.
    pub turn: u32,
    /// Steps entered.
    pub steps: u32,
    /// Tool calls: name and arguments (parsed JSON; raw text when unparsable).
    pub calls: Vec<(String, Value)>,
    /// Text of the turn's last assistant message.
    pub final_text: String,
    /// The end reason's kind (`completed`, `aborted`, …), `open` when missing.
    pub end: String,
}

/// The turns of a log.
pub fn shape(events: &[impl AsRef<SessionEvent>]) -> Vec<TurnShape> {
    let mut out: Vec<TurnShape> = Vec::new();
    for e in events {
        match &e.as_ref().data {
            EventData::TurnStart { turn } => out.push(TurnShape {
                turn: *turn,
                steps: 0,
                calls: Vec::new(),
                final_text: String::new(),
                end: "open".into(),
            }),
            EventData::StepStart { .. } => {
                if let Some(t) = out.last_mut() {
                    t.steps += 1;
                }
            }
            EventData::ToolCall { call, .. } => {
                let (name, arguments) = (&call.name, &call.arguments);
                if let Some(t) = out.last_mut() {
                    let args = serde_json::from_str(arguments)
                        .unwrap_or_else(|_| Value::String(arguments.to_string()));
                    t.calls.push((name.to_string(), args));
                }
            }
            EventData::AssistantMessage { message, .. } => {
                if let Some(t) = out.last_mut() {
                    t.final_text = message.text();
                }
            }
            EventData::TurnEnd { reason, .. } => {
                if let Some(t) = out.last_mut() {
                    t.end = end_kind(reason).into();
                }
            }
            _ => {}
        }
    }
    out
}

/// A turn end's kind as the log writes it (`completed`, `aborted`, …).
pub fn end_kind(r: &TurnEndReason) -> &'static str {
    match r {
        TurnEndReason::Completed => "completed",
        TurnEndReason::Aborted { .. } => "aborted",
        TurnEndReason::Blocked => "blocked",
        TurnEndReason::Error { .. } => "error",
        TurnEndReason::MaxTokens => "max-tokens",
        TurnEndReason::Interrupted => "interrupted",
    }
}

/// Where a replay first differs from its recording.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{what}")]
pub struct Divergence {
    /// The turn it differs in (`None`: the replay ran more turns).
    pub turn: Option<u32>,
    /// How, in words (`turn 2: recorded 3 steps, replayed 4`).
    pub what: String,
}

fn diverged(turn: u32, what: String) -> Divergence {
    Divergence {
        turn: Some(turn),
        what: format!("turn {turn}: {what}"),
    }
}

/// `Ok(turns)` when the two agree, else the first divergence, described.
pub fn compare(recorded: &[TurnShape], replayed: &[TurnShape]) -> Result<usize, Divergence> {
    for (i, r) in recorded.iter().enumerate() {
        let Some(p) = replayed.get(i) else {
            return Err(diverged(
                r.turn,
                format!("recorded, but the replay ran only {} turns", replayed.len()),
            ));
        };
        if r.steps != p.steps {
            return Err(diverged(
                r.turn,
                format!("recorded {} steps, replayed {}", r.steps, p.steps),
            ));
        }
        for (k, (rc, pc)) in r.calls.iter().zip(&p.calls).enumerate() {
            if rc != pc {
                return Err(diverged(
                    r.turn,
                    format!(
                        "tool call {}: recorded {} {}, replayed {} {}",
                        k + 1,
                        rc.0,
                        rc.1,
                        pc.0,
                        pc.1
                    ),
                ));
            }
        }
        if r.calls.len() != p.calls.len() {
            return Err(diverged(
                r.turn,
                format!(
                    "recorded {} tool calls, replayed {}",
                    r.calls.len(),
                    p.calls.len()
                ),
            ));
        }
        if r.final_text != p.final_text {
            return Err(diverged(
                r.turn,
                format!(
                    "recorded final text {:?}, replayed {:?}",
                    r.final_text, p.final_text
                ),
            ));
        }
        if r.end != p.end {
            return Err(diverged(
                r.turn,
                format!("recorded end `{}`, replayed `{}`", r.end, p.end),
            ));
        }
    }
    if replayed.len() > recorded.len() {
        return Err(Divergence {
            turn: None,
            what: format!(
                "the replay ran {} turns; the recording has {}",
                replayed.len(),
                recorded.len()
            ),
        });
    }
    Ok(recorded.len())
}

/// The user prompts that opened each turn (user-sourced `user/message`s).
pub fn prompts(events: &[impl AsRef<SessionEvent>]) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_turn_first = false;
    for e in events {
        match &e.as_ref().data {
            EventData::TurnStart { .. } => in_turn_first = true,
            EventData::UserMessage(m) if in_turn_first && m.source.kind == "user" => {
                out.push(m.text());
                in_turn_first = false;
            }
            _ => {}
        }
    }
    out
}
