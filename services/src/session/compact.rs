//! The compact form of a session log: what a hibernated agent keeps.
//!
//! The events are rendered as `session.jsonl` lines and compressed with
//! Zstandard; request headers (the tool schemas and system text, often the
//! biggest part of a short log and shared between agents) stay out of the
//! bytes as shared values. Restoring parses the lines back and re-admits
//! every event, so the surface, the derived history and the seed boundary
//! are exactly what they were.

use std::cell::RefCell;
use std::sync::Arc;

use dsh_supervisors::error::chain;
use serde_json::Value;

use super::jsonl;
use super::log::{SessionError, SessionLog};
use super::{EventData, SessionEvent};

/// Zstandard level: small logs, compressed on the hot path of hibernation.
const LEVEL: i32 = 1;

/// A session log at rest: compressed lines plus the shared request headers.
pub struct CompactLog {
    bytes: Box<[u8]>,
    /// Uncompressed length of `bytes`.
    text_len: usize,
    headers: Box<[Arc<Value>]>,
    first_live_seq: u64,
    next_seq: u64,
}

impl std::fmt::Debug for CompactLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompactLog")
            .field("bytes", &self.bytes.len())
            .field("events", &self.next_seq)
            .finish()
    }
}

/// Why a compact log could not be made or restored.
#[derive(Debug, thiserror::Error)]
pub enum CompactError {
    /// Compression or decompression failed. Fatal for this log: it stays
    /// (or is restored) uncompressed where it can.
    #[error("zstd: {0}")]
    Zstd(String),
    /// The restored lines did not parse (a bug: they were rendered here). Fatal.
    #[error("the compact log does not parse: {0}")]
    Parse(String),
    /// The restored events were refused by the log. Fatal.
    #[error(transparent)]
    Session(#[from] SessionError),
}

/// A rendering buffer bigger than this is not kept for the next log.
const TEXT_KEPT: usize = 64 * 1024;

thread_local! {
    /// The lines of the log being compacted (reused: most logs are alike in size).
    static TEXT: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    static COMPRESSOR: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

/// The shared dictionary: the first log compacted in this process, as raw
/// content. Logs of one process repeat each other's structure (event types,
/// keys, routes, system text), so each compact log keeps mostly what is its
/// own. It lives as long as the process; compact logs never leave it.
struct Dictionary {
    encoder: zstd::dict::EncoderDictionary<'static>,
    decoder: zstd::dict::DecoderDictionary<'static>,
}

static DICTIONARY: std::sync::OnceLock<Dictionary> = std::sync::OnceLock::new();

/// The longest prefix of the first log taken as the dictionary.
const DICTIONARY_BYTES: usize = 32 * 1024;

fn dictionary(first: &[u8]) -> &'static Dictionary {
    DICTIONARY.get_or_init(|| {
        let sample = &first[..first.len().min(DICTIONARY_BYTES)];
        Dictionary {
            encoder: zstd::dict::EncoderDictionary::copy(sample, LEVEL),
            decoder: zstd::dict::DecoderDictionary::copy(sample),
        }
    })
}

/// Runs `use_it` on this thread's (de)compressor, made by `make` on first use.
fn with_cached<T: 'static, R>(
    slot: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    make: impl FnOnce() -> std::io::Result<T>,
    use_it: impl FnOnce(&mut T) -> std::io::Result<R>,
) -> Result<R, CompactError> {
    let zstd = |e: std::io::Error| CompactError::Zstd(chain(&e).to_string());
    slot.with(|slot| {
        let mut slot = slot.borrow_mut();
        let made = match slot.as_mut() {
            Some(made) => made,
            None => slot.insert(make().map_err(zstd)?),
        };
        use_it(made).map_err(zstd)
    })
}

/// Stands in for a request header inside the bytes (the real one is kept aside).
fn placeholder() -> Arc<Value> {
    static NULL: std::sync::OnceLock<Arc<Value>> = std::sync::OnceLock::new();
    NULL.get_or_init(|| Arc::new(serde_json::json!({"config": {}})))
        .clone()
}

impl CompactLog {
    /// Compacts `log`.
    pub fn of(log: &SessionLog) -> Result<CompactLog, CompactError> {
        TEXT.with(|text| {
            let mut text = text.borrow_mut();
            text.clear();
            let made = Self::compress(log, &mut text);
            if text.capacity() > TEXT_KEPT {
                *text = Vec::new();
            }
            made
        })
    }

    /// Renders `log` into `text` (the lines) and compresses it.
    fn compress(log: &SessionLog, text: &mut Vec<u8>) -> Result<CompactLog, CompactError> {
        let mut headers = Vec::new();
        text.extend_from_slice(jsonl::render_header(log.header()).as_bytes());
        text.push(b'\n');
        for e in log.iter() {
            match &e.data {
                EventData::RequestHeader { header, reason } => {
                    headers.push(header.clone());
                    let mut stand_in = SessionEvent::clone(&e);
                    stand_in.data = EventData::RequestHeader {
                        header: placeholder(),
                        reason: reason.clone(),
                    };
                    stand_in.write_line(text);
                }
                _ => e.write_line(text),
            }
            text.push(b'\n');
        }
        let dict = dictionary(text);
        let bytes = with_cached(
            &COMPRESSOR,
            || zstd::bulk::Compressor::with_prepared_dictionary(&dict.encoder),
            |c| c.compress(text),
        )?;
        Ok(CompactLog {
            bytes: bytes.into_boxed_slice(),
            text_len: text.len(),
            headers: headers.into_boxed_slice(),
            first_live_seq: log.first_live_seq(),
            next_seq: log.next_seq(),
        })
    }

    /// The log as it was compacted.
    pub fn restore(&self) -> Result<SessionLog, CompactError> {
        // Set by the first compaction, which every compact log follows.
        let dict = DICTIONARY.get().ok_or_else(|| {
            CompactError::Zstd("no dictionary before the first compaction".into())
        })?;
        let text = with_cached(
            &DECOMPRESSOR,
            || zstd::bulk::Decompressor::with_prepared_dictionary(&dict.decoder),
            |d| d.decompress(&self.bytes, self.text_len),
        )?;
        let text =
            String::from_utf8(text).map_err(|e| CompactError::Parse(chain(&e).to_string()))?;
        let (header, mut events) =
            jsonl::parse(&text).map_err(|e| CompactError::Parse(chain(&e).to_string()))?;
        let mut kept = self.headers.iter();
        for e in &mut events {
            if let EventData::RequestHeader { header, .. } = &mut e.data {
                *header = kept
                    .next()
                    .cloned()
                    .ok_or_else(|| CompactError::Parse("more request headers than kept".into()))?;
            }
        }
        Ok(SessionLog::restore(header, events, self.first_live_seq)?)
    }

    /// Events in the log.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Compressed size in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether nothing is kept (never: the header is always there).
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::Message;
    use crate::session::SessionHeader;
    use crate::session::SurfaceIntent;

    #[test]
    fn a_compacted_log_restores_to_the_same_events_history_and_seed_boundary() {
        let header = SessionHeader::new("s-1", Some("/w".into()));
        let seed = vec![SessionEvent::new(0, 5, EventData::TurnStart { turn: 1 })];
        let mut log = SessionLog::from_seed(header, seed, 6).unwrap();
        let shared = Arc::new(serde_json::json!({"config": {"model": "m"}, "tools": [1, 2]}));
        log.append(
            EventData::RequestHeader {
                header: shared.clone(),
                reason: "initial".into(),
            },
            None,
            7,
        )
        .unwrap();
        log.append(
            EventData::UserMessage(Arc::new(Message::user_text("hello"))),
            Some(SurfaceIntent::append()),
            8,
        )
        .unwrap();
        let compact = CompactLog::of(&log).unwrap();
        let mut back = compact.restore().unwrap();
        assert_eq!(back.first_live_seq(), log.first_live_seq());
        assert_eq!(back.next_seq(), log.next_seq());
        assert_eq!(back.header(), log.header());
        let json = |l: &SessionLog| l.iter().map(|e| e.to_json()).collect::<Vec<_>>();
        assert_eq!(json(&back), json(&log));
        assert_eq!(back.derive_messages(), log.derive_messages());
        // The request header is the very same shared value, not a copy.
        assert!(Arc::ptr_eq(back.request_header().unwrap(), &shared));
    }
}
