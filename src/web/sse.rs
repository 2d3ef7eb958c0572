//! Server-sent events written into one buffer per stream.
//!
//! axum's `Event` gives each event a buffer of its own. A tree delta can be
//! hundreds of kilobytes, and a fresh buffer that size per event is pages
//! the allocator takes from the system and hands back again: faulting them
//! in cost the agents more than writing the events did. A stream here keeps
//! one buffer. An event is written into it and handed to the connection as
//! a shared view, and the space is reused once the connection has sent it.

use std::convert::Infallible;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::{BufMut, BytesMut};
use dsh_supervisors::error::chain;
use futures::{Stream, StreamExt};
use serde::Serialize;

/// How long a stream stays silent before it sends a comment, so proxies
/// and clients see the connection is alive.
pub(crate) const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// The largest buffer a stream keeps between events. A larger event (the
/// first snapshot of a big tree) gets a buffer of its own, freed once sent,
/// so an open connection does not hold its size.
const KEPT: usize = 1 << 20;

/// The writer of one stream's events.
#[derive(Default)]
pub(crate) struct Events {
    buf: BytesMut,
    /// The largest kept event so far: room for one more of its size is made
    /// before writing, in one step (in the old buffer when the connection
    /// has let go of it, else in a new one).
    largest: usize,
}

impl Events {
    /// The event `name` carrying `value` as JSON. serde_json writes no raw
    /// line break (strings escape theirs; only a `RawValue` could hold one,
    /// and the tree's types have none), so the data is one `data:` line. A
    /// value that fails to serialize sends `{"error": ...}` instead.
    pub(crate) fn json(&mut self, name: &str, value: &impl Serialize) -> Bytes {
        self.buf.reserve(self.largest);
        self.head(name);
        let data = self.buf.len();
        if let Err(e) = serde_json::to_writer((&mut self.buf).writer(), value) {
            self.buf.clear();
            self.head(name);
            let error = serde_json::json!({ "error": chain(&e).to_string() });
            // A `Value` with string keys always serializes.
            let _ = serde_json::to_writer((&mut self.buf).writer(), &error);
        }
        debug_assert!(
            !self.buf[data..].contains(&b'\n'),
            "an event's data is one line"
        );
        self.buf.put_slice(b"\n\n");
        let event = self.buf.split().freeze();
        if event.len() <= KEPT {
            self.largest = self.largest.max(event.len());
        } else {
            self.buf = BytesMut::new();
        }
        event
    }

    fn head(&mut self, name: &str) {
        self.buf.put_slice(b"event: ");
        self.buf.put_slice(name.as_bytes());
        self.buf.put_slice(b"\ndata: ");
    }

    /// A comment line, which clients ignore: the keep-alive.
    pub(crate) fn comment() -> Bytes {
        Bytes::from_static(b":\n\n")
    }
}

/// A `text/event-stream` response sending `events` as they come.
pub(crate) fn response(events: impl Stream<Item = Bytes> + Send + 'static) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(events.map(Ok::<_, Infallible>)),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_one_data_line_and_its_space_is_reused_once_dropped() {
        let mut events = Events::default();
        let value = serde_json::json!({ "text": "two\nlines", "n": 1 });
        let first = events.json("delta", &value);
        assert_eq!(
            &first[..],
            b"event: delta\ndata: {\"text\":\"two\\nlines\",\"n\":1}\n\n"
        );
        let at = first.as_ptr();
        drop(first);
        let second = events.json("delta", &value);
        assert_eq!(second.as_ptr(), at, "the sent event's space is reused");
        // While the connection still holds an event, the next one goes
        // elsewhere and the held one is unchanged.
        let third = events.json("other", &serde_json::json!(3));
        assert_ne!(third.as_ptr(), second.as_ptr());
        assert_eq!(&third[..], b"event: other\ndata: 3\n\n");
        assert!(second.starts_with(b"event: delta\n"));
    }

    #[test]
    fn an_event_too_large_to_keep_leaves_no_buffer_behind() {
        let mut events = Events::default();
        let big = "x".repeat(KEPT);
        let sent = events.json("snapshot", &big);
        assert!(sent.len() > KEPT);
        assert_eq!(
            events.buf.capacity(),
            0,
            "the connection holds its space alone"
        );
        assert_eq!(events.largest, 0);
        let small = events.json("delta", &1);
        assert_eq!(&small[..], b"event: delta\ndata: 1\n\n");
    }

    #[test]
    fn a_value_that_fails_to_serialize_even_halfway_sends_only_an_error() {
        /// Writes part of a map, then fails.
        struct Fails;
        impl Serialize for Fails {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                use serde::ser::SerializeMap;
                let mut map = s.serialize_map(None)?;
                map.serialize_entry("written", &1)?;
                Err(serde::ser::Error::custom("no way"))
            }
        }
        let mut events = Events::default();
        let sent = events.json("delta", &Fails);
        assert_eq!(&sent[..], b"event: delta\ndata: {\"error\":\"no way\"}\n\n");
    }
}
