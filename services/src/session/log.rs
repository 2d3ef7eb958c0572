//! The in-memory session log: append with surface validation, the ordered
//! surface, incremental `derive_messages`, the request-header fold and forks.

use std::collections::HashSet;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::event::{EventData, EventMeta, RequestContext, SessionEvent, SurfaceOp};
use super::packed::{Answer, ChunkRun};
use crate::llm::{History, Message};

/// The on-disk format version this build reads and writes.
pub const SESSION_FORMAT_VERSION: u32 = 0;

/// Creation metadata of a session (the first line of a `session.jsonl`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SessionHeader {
    /// Format version.
    pub version: u32,
    /// Session id.
    pub id: String,
    /// Creation time, epoch ms.
    pub created_at: u64,
    /// Working directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    /// The session this one was forked from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent_session: Option<String>,
    /// Number of events inherited from the parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed_length: Option<u64>,
    /// Free-form origin (which tool or workflow created it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<Value>,
    /// 0 for a top-level session, +1 per delegation.
    pub delegation_depth: u32,
    /// Preset the session was composed from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_preset: Option<String>,
}

impl SessionHeader {
    /// A header for a fresh top-level session.
    pub fn new(id: impl Into<String>, cwd: Option<String>) -> SessionHeader {
        SessionHeader {
            version: SESSION_FORMAT_VERSION,
            id: id.into(),
            created_at: dsh_supervisors::tree::now_ms(),
            cwd,
            parent_session: None,
            seed_length: None,
            origin: None,
            delegation_depth: 0,
            agent_preset: None,
        }
    }
}

/// Why an append (or a seed) was refused. Nothing was written.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SessionError {
    /// The surface metadata is missing, misplaced or inconsistent. Fatal: a
    /// bug in the appender, the event was not appended.
    #[error("event {seq} (`{kind}`): {reason}")]
    Surface {
        /// The seq the event would have had.
        seq: u64,
        /// Its type.
        kind: String,
        /// What is wrong.
        reason: String,
    },
    /// A seed event does not sit at its position. Fatal: the seed is corrupt.
    #[error("seed event at position {position} has seq {seq}; seqs must be contiguous from 0")]
    Discontiguous {
        /// Position in the seed.
        position: u64,
        /// The seq it carries.
        seq: u64,
    },
    /// A fork boundary falls inside an open turn or outside the log. Fatal
    /// for this boundary; a turn boundary works.
    #[error("cannot fork at seq {boundary}: {reason}")]
    Fork {
        /// Requested boundary.
        boundary: u64,
        /// Why.
        reason: String,
    },
}

/// The live surface: surface event seqs in model-visible order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Surface {
    /// Node seqs, in order.
    pub nodes: Vec<u64>,
    /// Count of committed replacements.
    pub replace_generation: u64,
}

/// One seq of the log: its event, or its place in a packed run of chunks.
#[derive(Clone, Debug)]
enum Slot {
    Event(Arc<SessionEvent>),
    Packed { run: u32, item: u32 },
}

impl Slot {
    /// The event held as it is (`None` for a packed chunk).
    fn stored(&self) -> Option<&Arc<SessionEvent>> {
        match self {
            Slot::Event(e) => Some(e),
            Slot::Packed { .. } => None,
        }
    }
}

/// An append-only session log and its projections.
///
/// Events are held by seq. Once a step's `assistant/message` is committed,
/// the `assistant/chunk` events it was streamed in are packed into one run
/// (a few bytes a chunk); reads expand them back into the same events.
#[derive(Clone, Debug)]
pub struct SessionLog {
    header: SessionHeader,
    slots: Vec<Slot>,
    runs: Vec<ChunkRun>,
    surface: Surface,
    first_live_seq: u64,
    derived: History,
    derived_nodes: usize,
    derived_generation: u64,
    request_header: Option<Arc<Value>>,
    request_context: Option<RequestContext>,
}

impl SessionLog {
    /// An empty session.
    pub fn new(header: SessionHeader) -> SessionLog {
        SessionLog {
            header,
            slots: Vec::new(),
            runs: Vec::new(),
            surface: Surface::default(),
            first_live_seq: 0,
            derived: History::default(),
            derived_nodes: 0,
            derived_generation: 0,
            request_header: None,
            request_context: None,
        }
    }

    /// A session continuing `seed` (resume, fork or replay). Every seed event
    /// is validated as if appended; a `session/end-seed` marker is appended
    /// unless the seed already ends with one.
    pub fn from_seed(
        header: SessionHeader,
        seed: Vec<SessionEvent>,
        now_ms: u64,
    ) -> Result<SessionLog, SessionError> {
        let mut log = SessionLog::admitted(header, seed)?;
        log.first_live_seq = log.next_seq();
        let ends_marked = log
            .slots
            .last()
            .and_then(Slot::stored)
            .is_some_and(|e| matches!(e.data, EventData::EndSeed));
        if !ends_marked {
            log.append(EventData::EndSeed, None, now_ms)?;
        }
        Ok(log)
    }

    /// A log as it was: `events` re-admitted in order (no seed marker
    /// added), with `first_live_seq` as the boundary of the current
    /// lifecycle. Used to restore a compacted log.
    pub fn restore(
        header: SessionHeader,
        events: Vec<SessionEvent>,
        first_live_seq: u64,
    ) -> Result<SessionLog, SessionError> {
        let mut log = SessionLog::admitted(header, events)?;
        log.first_live_seq = first_live_seq.min(log.next_seq());
        Ok(log)
    }

    /// A log of `events`, each validated and admitted in order (their seqs
    /// must be 0, 1, 2, …).
    fn admitted(
        header: SessionHeader,
        events: Vec<SessionEvent>,
    ) -> Result<SessionLog, SessionError> {
        let mut log = SessionLog::new(header);
        log.slots.reserve_exact(events.len());
        for (position, event) in events.into_iter().enumerate() {
            if event.seq != position as u64 {
                return Err(SessionError::Discontiguous {
                    position: position as u64,
                    seq: event.seq,
                });
            }
            log.admit(event)?;
        }
        Ok(log)
    }

    /// The header.
    pub fn header(&self) -> &SessionHeader {
        &self.header
    }

    /// The event at `seq`.
    pub fn get(&self, seq: u64) -> Option<Arc<SessionEvent>> {
        self.expand(self.slots.get(usize::try_from(seq).ok()?)?)
    }

    /// A slot's event; a packed chunk is expanded.
    fn expand(&self, slot: &Slot) -> Option<Arc<SessionEvent>> {
        match slot {
            Slot::Event(e) => Some(e.clone()),
            Slot::Packed { run, item } => {
                let run = self.runs.get(*run as usize)?;
                // A run's answer is the event right after it.
                let answer = self.slots.get(run.first() as usize + run.len())?.stored()?;
                run.expand(*item as usize, &Answer::of(answer)?)
                    .map(Arc::new)
            }
        }
    }

    /// Every event, in seq order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = Arc<SessionEvent>> + '_ {
        self.slots.iter().filter_map(|s| self.expand(s))
    }

    /// The events from `seq` on, in seq order.
    pub fn iter_from(&self, seq: u64) -> impl DoubleEndedIterator<Item = Arc<SessionEvent>> + '_ {
        let from = usize::try_from(seq).map_or(self.slots.len(), |s| s.min(self.slots.len()));
        self.slots[from..].iter().filter_map(|s| self.expand(s))
    }

    /// Every event but the `assistant/chunk`s, in seq order: what most
    /// readers look for (turns, messages, headers), read in place.
    pub fn without_chunks(&self) -> impl DoubleEndedIterator<Item = &Arc<SessionEvent>> + '_ {
        self.slots
            .iter()
            .filter_map(Slot::stored)
            .filter(|e| !matches!(e.data, EventData::AssistantChunk { .. }))
    }

    /// How many `assistant/chunk` events are held packed.
    pub fn packed_chunks(&self) -> usize {
        self.runs.iter().map(ChunkRun::len).sum()
    }

    /// The next seq (= the log length).
    pub fn next_seq(&self) -> u64 {
        self.slots.len() as u64
    }

    /// The first seq written by this lifecycle (the seed length).
    pub fn first_live_seq(&self) -> u64 {
        self.first_live_seq
    }

    /// The live surface.
    pub fn surface(&self) -> &Surface {
        &self.surface
    }

    /// Appends one event at `seq = len`, after validating its surface
    /// metadata. Returns the committed event.
    pub fn append(
        &mut self,
        data: EventData,
        intent: Option<SurfaceIntent>,
        time: u64,
    ) -> Result<Arc<SessionEvent>, SessionError> {
        let mut event = SessionEvent::new(self.next_seq(), time, data);
        if let Some(i) = intent {
            event = event.with_meta(EventMeta {
                ignorable: false,
                surface_op: Some(i.surface_op),
                source_event_seqs: i.source_event_seqs.map(Vec::into_boxed_slice),
            });
        }
        self.admit(event)
    }

    /// Validates and commits a fully formed event whose seq is the next one.
    fn admit(&mut self, event: SessionEvent) -> Result<Arc<SessionEvent>, SessionError> {
        let seq = event.seq;
        let fail = |reason: String| SessionError::Surface {
            seq,
            kind: event.kind().to_owned(),
            reason,
        };
        let surface_type = event.data.is_surface();
        match (event.surface_op(), surface_type) {
            (None, true) => {
                return Err(fail(
                    "a message-producing event must declare its surfaceOp".into(),
                ));
            }
            (Some(_), false) => {
                return Err(fail(
                    "only user/message, assistant/message and tool/result may carry a surfaceOp"
                        .into(),
                ));
            }
            _ => {}
        }
        if !surface_type && event.source_event_seqs().is_some() {
            return Err(fail(
                "only message-producing events may cite sourceEventSeqs".into(),
            ));
        }
        if let Some(seqs) = event.source_event_seqs() {
            if seqs.is_empty() && !matches!(event.data, EventData::AssistantMessage { .. }) {
                return Err(fail(
                    "sourceEventSeqs may be empty only on assistant/message".into(),
                ));
            }
            let mut seen = HashSet::with_capacity(seqs.len());
            for s in seqs {
                if *s >= seq {
                    return Err(fail(format!(
                        "sourceEventSeqs cites {s}, which is not an earlier event"
                    )));
                }
                if !seen.insert(*s) {
                    return Err(fail(format!("sourceEventSeqs cites {s} twice")));
                }
            }
        }
        // Surface transition, validated before anything changes.
        let mut replaced = None;
        if let Some(SurfaceOp::Replace { start, end }) = event.surface_op() {
            let pos = |n: u64| self.surface.nodes.iter().position(|x| *x == n);
            let (Some(a), Some(b)) = (pos(start), pos(end)) else {
                return Err(fail(format!(
                    "replace range {start}..={end} names a seq that is not on the surface"
                )));
            };
            if a > b {
                return Err(fail(format!(
                    "replace range {start}..={end} runs backwards on the surface"
                )));
            }
            let shadowed = &self.surface.nodes[a..=b];
            let cited: HashSet<u64> = event
                .source_event_seqs()
                .iter()
                .copied()
                .flatten()
                .copied()
                .collect();
            if let Some(missing) = shadowed.iter().find(|n| !cited.contains(n)) {
                return Err(fail(format!(
                    "replace shadows node {missing} but sourceEventSeqs does not cite it"
                )));
            }
            replaced = Some((a, b));
        }
        match replaced {
            Some((a, b)) => {
                self.surface.nodes.splice(a..=b, [seq]);
                self.surface.replace_generation += 1;
            }
            None if surface_type => self.surface.nodes.push(seq),
            None => {}
        }
        match &event.data {
            EventData::RequestHeader { header, .. } => self.request_header = Some(header.clone()),
            EventData::RequestContext(c) => self.request_context = Some((**c).clone()),
            _ => {}
        }
        let event = Arc::new(event);
        self.slots.push(Slot::Event(event.clone()));
        if let Some(answer) = Answer::of(&event) {
            self.pack_chunks(&answer);
        }
        Ok(event)
    }

    /// Packs the chunks of the answer's step right before it (the answer
    /// is the last slot) into one run.
    fn pack_chunks(&mut self, answer: &Answer<'_>) {
        let (turn, step) = (answer.turn, answer.step);
        let end = self.slots.len() - 1;
        let is_chunk = |slot: &Slot| {
            slot.stored().is_some_and(|e| {
                matches!(e.data, EventData::AssistantChunk { turn: t, step: s, .. } if (t, s) == (turn, step))
            })
        };
        let start = end
            - self.slots[..end]
                .iter()
                .rev()
                .take_while(|s| is_chunk(s))
                .count();
        let Ok(run) = u32::try_from(self.runs.len()) else {
            return;
        };
        if start == end {
            return;
        }
        let chunks = self.slots[start..end].iter().filter_map(Slot::stored);
        let Some(packed) = ChunkRun::pack(chunks, answer) else {
            return;
        };
        debug_assert_eq!(packed.len(), end - start);
        for (item, slot) in self.slots[start..end].iter_mut().enumerate() {
            *slot = Slot::Packed {
                run,
                item: item as u32,
            };
        }
        self.runs.push(packed);
    }

    /// The model-visible history: one message per surface node, in order,
    /// shared (never copied). Each node is projected once; only a surface
    /// replacement rebuilds. Empty assistant messages are skipped.
    ///
    /// The returned snapshot never grows. While no caller still holds an
    /// earlier snapshot, extending the history costs only the new nodes;
    /// a held snapshot makes the next extension copy the list once.
    pub fn derive_messages(&mut self) -> History {
        if self.derived_generation != self.surface.replace_generation {
            self.derived = History::default();
            self.derived_nodes = 0;
            self.derived_generation = self.surface.replace_generation;
        }
        if self.derived_nodes < self.surface.nodes.len() {
            let list = Arc::make_mut(&mut self.derived.0);
            for &seq in &self.surface.nodes[self.derived_nodes..] {
                if let Some(m) = self
                    .slots
                    .get(seq as usize)
                    .and_then(Slot::stored)
                    .and_then(|e| derive_event_message(e))
                {
                    list.push(m);
                }
            }
            self.derived_nodes = self.surface.nodes.len();
        }
        self.derived.clone()
    }

    /// The request header in force (the latest `request/header` snapshot).
    pub fn request_header(&self) -> Option<&Arc<Value>> {
        self.request_header.as_ref()
    }

    /// The latest route metadata.
    pub fn request_context(&self) -> Option<&RequestContext> {
        self.request_context.as_ref()
    }

    /// The events through `boundary` (inclusive; default: the last event),
    /// for seeding a fork. Refused when the prefix ends inside an open turn.
    pub fn fork_prefix(&self, boundary: Option<u64>) -> Result<Vec<SessionEvent>, SessionError> {
        let Some(last) = self.slots.len().checked_sub(1) else {
            return Ok(Vec::new());
        };
        let boundary = boundary.unwrap_or(last as u64);
        if boundary as usize > last {
            return Err(SessionError::Fork {
                boundary,
                reason: format!("the log ends at seq {last}"),
            });
        }
        if let Some(turn) = open_turn(self.without_chunks().take_while(|e| e.seq <= boundary)) {
            return Err(SessionError::Fork {
                boundary,
                reason: format!("turn {turn} is still open there; fork at a turn boundary"),
            });
        }
        Ok(self
            .iter()
            .take(boundary as usize + 1)
            .map(|e| e.as_ref().clone())
            .collect())
    }

    /// The turn still open at the end of the log, if any.
    pub fn open_turn(&self) -> Option<u32> {
        open_turn(self.without_chunks())
    }
}

/// The turn a prefix leaves open.
fn open_turn<'a>(events: impl Iterator<Item = &'a Arc<SessionEvent>>) -> Option<u32> {
    let mut open = None;
    for e in events {
        match e.data {
            EventData::TurnStart { turn } => open = Some(turn),
            EventData::TurnEnd { turn, .. } if open == Some(turn) => open = None,
            _ => {}
        }
    }
    open
}

/// The message one surface event projects (`None` for others and for an
/// empty assistant message).
pub fn derive_event_message(event: &SessionEvent) -> Option<Arc<Message>> {
    let m = event.data.message()?;
    if matches!(event.data, EventData::AssistantMessage { .. }) && m.content.is_empty() {
        return None;
    }
    Some(m.clone())
}

/// Surface placement of a message-producing append.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SurfaceIntent {
    /// How it joins the surface.
    pub surface_op: SurfaceOp,
    /// The earlier events it cites.
    pub source_event_seqs: Option<Vec<u64>>,
}

impl SurfaceIntent {
    /// Tail append citing nothing.
    pub fn append() -> SurfaceIntent {
        SurfaceIntent {
            surface_op: SurfaceOp::Append,
            source_event_seqs: None,
        }
    }

    /// Tail append citing `seqs`.
    pub fn append_citing(seqs: Vec<u64>) -> SurfaceIntent {
        SurfaceIntent {
            surface_op: SurfaceOp::Append,
            source_event_seqs: Some(seqs),
        }
    }
}
