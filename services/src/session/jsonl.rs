//! dsh's `session.jsonl` text format: a header line, then one event per line.
//!
//! The reader also accepts what the upstream harness writes: packed chunk
//! rows (`text-chunks`, `reasoning-chunks`, `tool-call-chunks`: a run of
//! delta chunks on one line, expanded back into one `assistant/chunk` event
//! each) and lines without `seq`/`time` (recorded fixtures), whose seq is
//! their position. Every refusal names the line.

use dsh_supervisors::error::chain;
use serde::Deserialize;
use serde_json::Value;

use super::event::{CARRIED_TYPES, EventData, EventError, EventMeta, SessionEvent, SurfaceOp};
use super::log::{SESSION_FORMAT_VERSION, SessionHeader};
use crate::llm::StreamChunk;

/// Why a log could not be loaded. None is retryable as it is: the file
/// must change (a torn tail is repaired by `persistence`'s load, which keeps
/// every good line).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoadError {
    /// The text holds no header line.
    #[error("the log is empty (no session header)")]
    Empty,
    /// The first line is not a session header.
    #[error("line 1: not a session header: {0}")]
    Header(String),
    /// The format version is not the one this build reads.
    #[error(
        "line 1: format version {found} was written by {direction} dsh; this build reads version {expected}"
    )]
    Version {
        /// Version in the file.
        found: u32,
        /// Version this build reads.
        expected: u32,
        /// `a newer` or `an older`.
        direction: &'static str,
    },
    /// The last line is cut off (a crash mid-write); every line before it is good.
    #[error(
        "line {line}: the last line is incomplete (torn write); {good} events before it are intact"
    )]
    TornTail {
        /// The torn line.
        line: usize,
        /// Events read before it.
        good: usize,
    },
    /// A line repeats a seq the log already holds: two writers appended at
    /// once (dsh before its one-writer lock). Every line before it is good.
    #[error(
        "line {line}: seq {seq} repeats one already in the log (two writers at once); {good} events before it are intact"
    )]
    Repeated {
        /// The first repeating line.
        line: usize,
        /// Its seq.
        seq: u64,
        /// Events read before it.
        good: usize,
    },
    /// A compressed frame is damaged (not a torn last frame).
    #[error("the compressed frame at byte {offset} is damaged: {reason}")]
    Frame {
        /// Byte offset of the frame in the file.
        offset: u64,
        /// What the decoder said.
        reason: String,
    },
    /// A line is not valid.
    #[error("line {line}: {reason}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

/// Why one event line (or database row) is not a valid event. Fatal for
/// that line: a log holding it is refused there ([`LoadError::Line`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// Not a JSON object with a `type`.
    #[error("not a JSON event: {0}")]
    NotJson(String),
    /// A packed chunk row where a single event was expected.
    #[error("a packed `{0}` row where one event was expected")]
    Packed(String),
    /// The line's `seq` is not the next one.
    #[error("seq {found} where {expected} was expected (the log must be contiguous)")]
    Seq {
        /// The seq on the line.
        found: u64,
        /// The seq it must have.
        expected: u64,
    },
    /// The payload is not valid for its type.
    #[error("`{kind}` event")]
    Event {
        /// The event type.
        kind: String,
        /// What is wrong with it.
        #[source]
        error: EventError,
    },
    /// A type this build does not know, not marked `ignorable`.
    #[error(
        "unknown event type `{0}` is not marked ignorable; refusing to load a log this build cannot interpret"
    )]
    Unknown(String),
}

#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    seq: Option<u64>,
    #[serde(default)]
    time: Option<u64>,
    #[serde(borrow, default)]
    data: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    ignorable: Option<bool>,
    #[serde(default, rename = "surfaceOp")]
    surface_op: Option<SurfaceOp>,
    #[serde(default, rename = "sourceEventSeqs")]
    source_event_seqs: Option<Vec<u64>>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Packed {
    turn: u32,
    step: u32,
    index: u32,
    /// Milliseconds between chunks; recorded logs hold negative ones (a
    /// clock that stepped back), so signed, and never a reason to refuse
    /// a log.
    #[serde(default)]
    dt: Vec<i64>,
    #[serde(default)]
    texts: Vec<String>,
    #[serde(default)]
    args: Vec<String>,
    #[serde(default)]
    id: Option<String>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    seq0: Option<u64>,
    #[serde(default)]
    time0: Option<u64>,
}

/// Parses a whole `session.jsonl` text.
pub fn parse(text: &str) -> Result<(SessionHeader, Vec<SessionEvent>), LoadError> {
    let torn_tail = !text.is_empty() && !text.ends_with('\n');
    let lines: Vec<&str> = text.lines().collect();
    let mut numbered = lines
        .iter()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty());
    let Some((at, first)) = numbered.next() else {
        return Err(LoadError::Empty);
    };
    let last_line = lines.len();
    if torn_tail && at + 1 == last_line {
        return Err(LoadError::TornTail { line: 1, good: 0 });
    }
    let header = parse_header(first)?;
    let mut events: Vec<SessionEvent> = Vec::new();
    for (i, line) in numbered {
        let n = i + 1;
        // A last line without its newline was never acknowledged, even if
        // it happens to be whole JSON: appending after it would glue the
        // next event onto it.
        if torn_tail && n == last_line {
            return Err(LoadError::TornTail {
                line: n,
                good: events.len(),
            });
        }
        let envelope: Envelope = match serde_json::from_str(line) {
            Ok(e) => e,
            Err(e) => {
                return Err(LoadError::Line {
                    line: n,
                    reason: format!("not a JSON event: {}", chain(&e)),
                });
            }
        };
        let fail = |reason: String| LoadError::Line { line: n, reason };
        let prev_time = events.last().map(|e| e.time).unwrap_or(0);
        match envelope.kind.as_str() {
            "text-chunks" | "reasoning-chunks" | "tool-call-chunks" => {
                let packed: Packed =
                    serde_json::from_str(envelope.data.map_or("null", |r| r.get()))
                        .map_err(|e| fail(format!("bad `{}` row: {e}", envelope.kind)))?;
                if let Some(seq) = packed.seq0.filter(|s| *s < events.len() as u64) {
                    return Err(LoadError::Repeated {
                        line: n,
                        seq,
                        good: events.len(),
                    });
                }
                expand(&envelope.kind, packed, &mut events, prev_time).map_err(fail)?;
            }
            _ if envelope.seq.is_some_and(|s| s < events.len() as u64) => {
                return Err(LoadError::Repeated {
                    line: n,
                    seq: envelope.seq.unwrap_or_default(),
                    good: events.len(),
                });
            }
            _ => events.push(
                event(envelope, events.len() as u64, prev_time)
                    .map_err(|e| fail(chain(&e).to_string()))?,
            ),
        }
    }
    Ok((header, events))
}

/// Parses one event line that must carry seq `expected` (a line without a
/// seq gets it; one without a time gets `prev_time`). Packed chunk rows are
/// refused here: they only occur in whole logs ([`parse`]).
pub fn parse_event(line: &str, expected: u64, prev_time: u64) -> Result<SessionEvent, LineError> {
    let envelope: Envelope =
        serde_json::from_str(line).map_err(|e| LineError::NotJson(chain(&e).to_string()))?;
    if matches!(
        envelope.kind.as_str(),
        "text-chunks" | "reasoning-chunks" | "tool-call-chunks"
    ) {
        return Err(LineError::Packed(envelope.kind));
    }
    event(envelope, expected, prev_time)
}

fn event(envelope: Envelope, expected: u64, prev_time: u64) -> Result<SessionEvent, LineError> {
    if let Some(found) = envelope.seq
        && found != expected
    {
        return Err(LineError::Seq { found, expected });
    }
    let kind = envelope.kind;
    let ignorable = envelope.ignorable.unwrap_or(false);
    let data = match envelope.data {
        Some(raw) => EventData::from_raw(&kind, raw),
        None => EventData::from_parts(&kind, Value::Null),
    }
    .map_err(|error| LineError::Event {
        kind: kind.clone(),
        error,
    })?;
    if let EventData::Other { kind, .. } = &data
        && !ignorable
        && !CARRIED_TYPES.contains(&kind.as_ref())
    {
        return Err(LineError::Unknown(kind.to_string()));
    }
    let time = envelope.time.unwrap_or(prev_time);
    Ok(
        SessionEvent::new(expected, time, data).with_meta(EventMeta {
            ignorable,
            surface_op: envelope.surface_op,
            source_event_seqs: envelope.source_event_seqs.map(Vec::into_boxed_slice),
        }),
    )
}

/// The header as its JSON line (without the newline).
pub fn render_header(header: &SessionHeader) -> String {
    // The header's own object, with `type` put first.
    let body = serde_json::to_string(header).unwrap_or_default();
    match body.strip_prefix('{') {
        Some("}") | None => r#"{"type":"session"}"#.to_owned(),
        Some(fields) => format!(r#"{{"type":"session",{fields}"#),
    }
}

fn parse_header(line: &str) -> Result<SessionHeader, LoadError> {
    let value: Value =
        serde_json::from_str(line).map_err(|e| LoadError::Header(chain(&e).to_string()))?;
    if value.get("type").and_then(Value::as_str) != Some("session") {
        return Err(LoadError::Header(
            "the first line must have `\"type\": \"session\"`".into(),
        ));
    }
    if let Some(found) = value.get("version").and_then(Value::as_u64) {
        let found = found as u32;
        if found != SESSION_FORMAT_VERSION {
            return Err(LoadError::Version {
                found,
                expected: SESSION_FORMAT_VERSION,
                direction: if found > SESSION_FORMAT_VERSION {
                    "a newer"
                } else {
                    "an older"
                },
            });
        }
    }
    let mut obj = value;
    if let Some(map) = obj.as_object_mut() {
        map.remove("type");
    }
    serde_json::from_value(obj).map_err(|e| LoadError::Header(chain(&e).to_string()))
}

fn expand(
    kind: &str,
    p: Packed,
    events: &mut Vec<SessionEvent>,
    prev_time: u64,
) -> Result<(), String> {
    let pieces = if kind == "tool-call-chunks" {
        &p.args
    } else {
        &p.texts
    };
    if pieces.is_empty() {
        return Err(format!("`{kind}` row holds no chunks"));
    }
    if !p.dt.is_empty() && p.dt.len() + 1 != pieces.len() && p.dt.len() != pieces.len() {
        return Err(format!(
            "`{kind}` row has {} time deltas for {} chunks",
            p.dt.len(),
            pieces.len()
        ));
    }
    let first_seq = events.len() as u64;
    if let Some(seq0) = p.seq0
        && seq0 != first_seq
    {
        return Err(format!(
            "`{kind}` row starts at seq {seq0} where {first_seq} was expected"
        ));
    }
    let call_id = match (kind, &p.id) {
        ("tool-call-chunks", None) => return Err("`tool-call-chunks` row has no call `id`".into()),
        (_, id) => id.clone().unwrap_or_default(),
    };
    // With one delta fewer than chunks, dt[i] separates chunk i and i+1.
    let offset = usize::from(p.dt.len() == pieces.len());
    let mut time = p.time0.unwrap_or(prev_time);
    for (i, piece) in pieces.iter().enumerate() {
        if i > 0 {
            time = time.saturating_add_signed(p.dt.get(i - 1 + offset).copied().unwrap_or(0));
        } else if offset == 1 {
            time = time.saturating_add_signed(p.dt.first().copied().unwrap_or(0));
        }
        let chunk = match kind {
            "text-chunks" => StreamChunk::TextDelta {
                index: p.index,
                text: piece.clone(),
            },
            "reasoning-chunks" => StreamChunk::ReasoningDelta {
                index: p.index,
                text: piece.clone(),
            },
            _ => StreamChunk::ToolCallDelta {
                index: p.index,
                id: call_id.clone(),
                name: if i == 0 { p.name.clone() } else { None },
                arguments_delta: piece.clone(),
            },
        };
        let data = EventData::AssistantChunk {
            turn: p.turn,
            step: p.step,
            chunk: Box::new(chunk),
        };
        events.push(SessionEvent::new(events.len() as u64, time, data));
    }
    Ok(())
}

/// Renders a header and events as `session.jsonl` text (one event per line).
pub fn render(header: &SessionHeader, events: &[impl AsRef<SessionEvent>]) -> String {
    let mut out = render_header(header).into_bytes();
    out.push(b'\n');
    write_lines(events, &mut out);
    // Every piece is serde_json's output: UTF-8.
    String::from_utf8(out).unwrap_or_default()
}

/// Appends each event's `session.jsonl` line, newline-terminated, to `out`.
pub fn write_lines(events: &[impl AsRef<SessionEvent>], out: &mut Vec<u8>) {
    for e in events {
        e.as_ref().write_line(out);
        out.push(b'\n');
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A packed row's time deltas may be negative (a recorded clock that
    /// stepped back): the log loads, its chunks keep their order, and the
    /// times follow the deltas without wrapping.
    #[test]
    fn a_packed_row_with_negative_time_deltas_loads() {
        let log = concat!(
            r#"{"type":"session","version":0,"id":"s1","createdAt":1000,"cwd":"/w","delegationDepth":0}"#,
            "\n",
            r#"{"type":"turn/start","time":5000,"data":{"turn":1}}"#,
            "\n",
            r#"{"type":"reasoning-chunks","data":{"turn":1,"step":1,"index":0,"dt":[3,-2],"texts":["a","b","c"]}}"#,
            "\n",
        );
        let (_, events) = parse(log).unwrap();
        let times: Vec<u64> = events.iter().map(|e| e.time).collect();
        assert_eq!(times, [5000, 5000, 5003, 5001]);
        let texts: Vec<String> = events[1..]
            .iter()
            .map(|e| match &e.data {
                EventData::AssistantChunk { chunk, .. } => match &**chunk {
                    StreamChunk::ReasoningDelta { text, .. } => text.to_string(),
                    other => panic!("{other:?}"),
                },
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(texts, ["a", "b", "c"]);
    }
}
