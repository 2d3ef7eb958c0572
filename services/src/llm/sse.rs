//! Server-sent events framing, linear in the bytes received.
//!
//! Every byte is scanned for a line end once: a line that spans many
//! chunks is neither re-scanned nor moved per chunk (the buffer is
//! compacted only when its consumed part is at least half of it). Lines end
//! with `\n`, `\r\n` or `\r` (also split across chunks); `:` lines are
//! comments; `data:` lines are joined with `\n`; an empty line ends an
//! event. Other fields (`event`, `id`, `retry`) are read and ignored: the
//! OpenAI-compatible stream carries everything in `data`.
//!
//! An event (or a line) larger than the cap fails the stream with
//! [`SseError::TooLarge`] instead of growing without bound.

use bytes::Bytes;
use futures::{Stream, StreamExt};

/// The largest event accepted by default: 16 MiB.
pub const MAX_EVENT: usize = 16 * 1024 * 1024;

/// Why a stream of events ended early.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    /// One event grew past the cap. Fatal for the call: the endpoint sends
    /// something no model answer needs.
    #[error("an event of the stream is larger than {cap} bytes")]
    TooLarge {
        /// The cap.
        cap: usize,
    },
    /// The connection failed.
    #[error("{0}")]
    Transport(String),
}

/// Splits bytes into events' `data`.
#[derive(Debug)]
pub struct Framer {
    buf: Vec<u8>,
    /// Where the unconsumed part of `buf` starts.
    start: usize,
    /// Up to where `buf` has been scanned for a line end.
    scanned: usize,
    /// The current event's data so far.
    data: Vec<u8>,
    has_data: bool,
    /// A `\r` ended the last line: a `\n` right after it belongs to it.
    after_cr: bool,
    cap: usize,
    /// Bytes looked at for a line end, in all (what the framing costs).
    work: u64,
}

impl Framer {
    /// A framer refusing events larger than `cap` bytes.
    pub fn new(cap: usize) -> Framer {
        Framer {
            buf: Vec::new(),
            start: 0,
            scanned: 0,
            data: Vec::new(),
            has_data: false,
            after_cr: false,
            cap,
            work: 0,
        }
    }

    /// Bytes scanned so far (each received byte once).
    pub fn work(&self) -> u64 {
        self.work
    }

    /// Takes `chunk`; the data of every event it completes, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Result<Vec<String>, SseError> {
        let mut out = Vec::new();
        if self.start > 0 && self.start * 2 >= self.buf.len() {
            self.buf.drain(..self.start);
            self.scanned -= self.start;
            self.start = 0;
        }
        self.buf.extend_from_slice(chunk);
        loop {
            if self.after_cr && self.start < self.buf.len() {
                if self.buf[self.start] == b'\n' {
                    self.start += 1;
                    self.scanned = self.scanned.max(self.start);
                }
                self.after_cr = false;
            }
            let from = self.scanned.max(self.start);
            let end = memchr::memchr2(b'\n', b'\r', &self.buf[from..]).map(|i| from + i);
            self.work += (end.map_or(self.buf.len(), |e| e + 1) - from) as u64;
            let Some(end) = end else {
                self.scanned = self.buf.len();
                if self.buf.len() - self.start + self.data.len() > self.cap {
                    return Err(SseError::TooLarge { cap: self.cap });
                }
                return Ok(out);
            };
            let line_start = self.start;
            self.after_cr = self.buf[end] == b'\r';
            self.start = end + 1;
            self.scanned = self.start;
            if let Some(data) = self.line(line_start, end)? {
                out.push(data);
            }
        }
    }

    /// Handles the line `buf[from..to]`; an event's data when it ends one.
    fn line(&mut self, from: usize, to: usize) -> Result<Option<String>, SseError> {
        let line = &self.buf[from..to];
        if line.is_empty() {
            if !self.has_data {
                return Ok(None);
            }
            self.has_data = false;
            let data = std::mem::take(&mut self.data);
            return Ok(Some(String::from_utf8_lossy(&data).into_owned()));
        }
        if line[0] == b':' {
            return Ok(None);
        }
        let (field, value) = match memchr::memchr(b':', line) {
            Some(i) => {
                let v = &line[i + 1..];
                (&line[..i], v.strip_prefix(b" ").unwrap_or(v))
            }
            None => (line, &[][..]),
        };
        if field == b"data" {
            if self.data.len() + value.len() + 1 > self.cap {
                return Err(SseError::TooLarge { cap: self.cap });
            }
            if self.has_data {
                self.data.push(b'\n');
            }
            self.data.extend_from_slice(value);
            self.has_data = true;
        }
        Ok(None)
    }
}

/// The events' data of a byte stream (a connection error ends it).
pub fn events<S, E>(bytes: S, cap: usize) -> impl Stream<Item = Result<String, SseError>> + Send
where
    S: Stream<Item = Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display,
{
    let state = (
        Box::pin(bytes),
        Framer::new(cap),
        std::collections::VecDeque::new(),
        false,
    );
    futures::stream::unfold(
        state,
        |(mut bytes, mut framer, mut ready, mut done)| async move {
            loop {
                if let Some(data) = ready.pop_front() {
                    return Some((Ok(data), (bytes, framer, ready, done)));
                }
                if done {
                    return None;
                }
                match bytes.next().await {
                    None => return None,
                    Some(Err(e)) => {
                        done = true;
                        return Some((
                            Err(SseError::Transport(e.to_string())),
                            (bytes, framer, ready, done),
                        ));
                    }
                    Some(Ok(chunk)) => match framer.push(&chunk) {
                        Ok(events) => ready.extend(events),
                        Err(e) => {
                            done = true;
                            return Some((Err(e), (bytes, framer, ready, done)));
                        }
                    },
                }
            }
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(chunks: &[&[u8]]) -> Vec<String> {
        let mut f = Framer::new(MAX_EVENT);
        chunks.iter().flat_map(|c| f.push(c).unwrap()).collect()
    }

    #[test]
    fn events_split_anywhere_come_out_whole() {
        let stream =
            b": hello\r\ndata: one\r\n\r\nevent: x\ndata:two\ndata: lines\n\ndata: three\r\r";
        let want = ["one", "two\nlines", "three"];
        assert_eq!(all(&[stream]), want);
        // Cut at every byte, including between `\r` and `\n`.
        for cut in 0..stream.len() {
            assert_eq!(all(&[&stream[..cut], &stream[cut..]]), want, "cut at {cut}");
        }
        let bytewise: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(all(&bytewise), want);
    }

    #[test]
    fn one_large_event_costs_its_size_once() {
        let payload = "x".repeat(8 * 1024 * 1024);
        let event = format!("data: {payload}\n\n");
        let mut f = Framer::new(MAX_EVENT);
        let mut got = Vec::new();
        for chunk in event.as_bytes().chunks(16 * 1024) {
            got.extend(f.push(chunk).unwrap());
        }
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].len(), payload.len());
        // Linear: each byte scanned about once (a quadratic framer scans
        // the pending line again per chunk: ~256 times the size here).
        assert!(
            f.work() <= event.len() as u64 * 2,
            "{} for {}",
            f.work(),
            event.len()
        );
    }

    #[test]
    fn an_event_past_the_cap_fails_the_stream() {
        let mut f = Framer::new(1024);
        let big = format!("data: {}", "y".repeat(2000));
        assert_eq!(
            f.push(big.as_bytes()),
            Err(SseError::TooLarge { cap: 1024 })
        );
        let mut f = Framer::new(1024);
        let many: String = (0..100).map(|_| "data: 0123456789abcdef\n").collect();
        assert_eq!(
            f.push(many.as_bytes()),
            Err(SseError::TooLarge { cap: 1024 })
        );
    }
}
