//! The dashboard stream benchmark: N active agents with and without an
//! SSE subscriber.

use std::time::Duration;

use dsh_supervisors::BoxError;
use dsh_supervisors::error::chain;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::{active, threads, world};

/// The dashboard's delta stream under load: `agents` active agents with
/// and without one HTTP subscriber on `/api/tree/stream`, in alternating
/// rounds with the server up throughout (so both sides of the ratio run
/// in the same conditions); the stream's throughput and the slowdown it
/// causes (median watched round over median unwatched round).
pub async fn stream(
    agents: u32,
    turns: u32,
    coalesced: bool,
) -> Result<serde_json::Value, BoxError> {
    const ROUNDS: usize = 9;
    let steps = 5;
    let w = world(steps, None).await?;
    let root = w.rt.root();
    let config = dsh::web::WebConfig {
        bind: "127.0.0.1:0".into(),
        token_env: None,
        mutations: false,
    };
    root.plugin(dsh::web::Web, config).await?;
    let addr = root
        .get::<dsh::web::WebServer>(dsh::web::WebServer::SERVICE)
        .ok_or("no web server")?
        .local_addr();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let url = format!(
        "http://{addr}/api/tree/stream?coalesce={}",
        u8::from(coalesced)
    );
    // Warm-up, then alternating rounds. The reader's thread and HTTP
    // client are made once, so both kinds of round start right after
    // the previous one (a pause before the watched rounds alone, to
    // make them, let the last round's leftovers settle for them only).
    active(&w, 10, 1, steps).await?;
    let reader = Outside::start()?;
    let (mut alone, mut watched) = (Vec::new(), Vec::new());
    let mut counts = StreamCounts::default();
    for _ in 0..ROUNDS {
        alone.push(active(&w, agents, turns, steps).await?);
        let stop = CancellationToken::new();
        let read = reader.watch(url.clone(), stop.clone()).await?;
        let wall = active(&w, agents, turns, steps).await;
        stop.cancel();
        let read = tokio::time::timeout(OUTSIDE_BUDGET, read)
            .await
            .map_err(|_| "the subscriber did not stop in time")?
            .map_err(|_| "the subscriber thread ended without its counts")?;
        watched.push(wall?);
        counts.add(&read);
    }
    reader.finish().await?;
    w.rt.shutdown().await;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (alone, watched_median) = (median(&mut alone), median(&mut watched));
    let watched_total: f64 = watched.iter().sum();
    Ok(serde_json::json!({
        "workload": "stream",
        "agents": agents,
        "turns": turns,
        "steps": steps,
        "rounds": ROUNDS,
        "wall_alone_s": alone,
        "wall_watched_s": watched_median,
        "slowdown": watched_median / alone,
        "stream": if coalesced { "coalesced (the dashboard's)" } else { "raw" },
        "changes": counts.changes,
        "sse_events": counts.events,
        "bytes": counts.bytes,
        "changes_per_s": counts.changes as f64 / watched_total,
        "folded": counts.folded,
        "dropped_events": counts.dropped,
        "threads": threads(),
    }))
}

/// What a stream subscriber read.
#[derive(Default)]
struct StreamCounts {
    bytes: u64,
    events: u64,
    changes: u64,
    dropped: u64,
    folded: u64,
}

impl StreamCounts {
    fn add(&mut self, other: &StreamCounts) {
        self.bytes += other.bytes;
        self.events += other.events;
        self.changes += other.changes;
        self.dropped += other.dropped;
        self.folded += other.folded;
    }
}

/// The subscriber as the dashboard is one: outside the agents' runtime
/// (a browser is its own process), here an HTTP client on its own thread
/// and runtime, so its work competes with the agents for the cores as an
/// outside reader would, not inside their worker threads. It lives
/// across rounds and connects for each watched one.
struct Outside {
    watches: tokio::sync::mpsc::UnboundedSender<Watch>,
    thread: std::thread::JoinHandle<()>,
}

/// One watched round: the stream to read until `stop`; `connected` is
/// answered once the server has subscribed, `counts` when done.
struct Watch {
    url: String,
    stop: CancellationToken,
    connected: tokio::sync::oneshot::Sender<Result<(), String>>,
    counts: tokio::sync::oneshot::Sender<StreamCounts>,
}

/// How long connecting or finishing the outside reader may take.
const OUTSIDE_BUDGET: Duration = Duration::from_secs(30);

impl Outside {
    /// Starts the reader's thread, runtime and HTTP client.
    fn start() -> Result<Outside, BoxError> {
        let (watches, mut queue) = tokio::sync::mpsc::unbounded_channel::<Watch>();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let thread = std::thread::Builder::new()
            .name("bench-subscriber".into())
            .spawn(move || {
                rt.block_on(async move {
                    // Made in this runtime, whose tasks serve its
                    // connections.
                    let client = reqwest::Client::builder().build();
                    // Until the bench drops its sender.
                    while let Some(watch) = queue.recv().await {
                        let sent = match &client {
                            Ok(client) => client
                                .get(&watch.url)
                                .send()
                                .await
                                .map_err(|e| chain(&e).to_string()),
                            Err(e) => Err(chain(&e).to_string()),
                        };
                        let response = match sent {
                            Ok(r) => r,
                            Err(e) => {
                                let _ = watch.connected.send(Err(e));
                                continue;
                            }
                        };
                        let _ = watch.connected.send(Ok(()));
                        let _ = watch.counts.send(read_stream(response, watch.stop).await);
                    }
                });
            })?;
        Ok(Outside { watches, thread })
    }

    /// Connects to `url` (the server has subscribed when this returns);
    /// the counts come once `stop` is cancelled.
    async fn watch(
        &self,
        url: String,
        stop: CancellationToken,
    ) -> Result<tokio::sync::oneshot::Receiver<StreamCounts>, BoxError> {
        let (connected_tx, connected) = tokio::sync::oneshot::channel();
        let (counts_tx, counts) = tokio::sync::oneshot::channel();
        self.watches
            .send(Watch {
                url,
                stop,
                connected: connected_tx,
                counts: counts_tx,
            })
            .map_err(|_| "the subscriber thread ended")?;
        tokio::time::timeout(OUTSIDE_BUDGET, connected)
            .await
            .map_err(|_| "the subscriber did not connect in time")?
            .map_err(|_| "the subscriber thread ended")??;
        Ok(counts)
    }

    /// Ends the reader's thread and joins it.
    async fn finish(self) -> Result<(), BoxError> {
        let Outside { watches, thread } = self;
        drop(watches);
        tokio::time::timeout(
            OUTSIDE_BUDGET,
            tokio::task::spawn_blocking(move || thread.join()),
        )
        .await
        .map_err(|_| "the subscriber thread did not end in time")??
        .map_err(|_| "the subscriber thread panicked")?;
        Ok(())
    }
}

/// Reads and splits events, counting changes, until `stop`.
async fn read_stream(response: reqwest::Response, stop: CancellationToken) -> StreamCounts {
    let mut body = response.bytes_stream();
    let mut counts = StreamCounts::default();
    // Bytes of an event not complete yet. Scanned as bytes, and only the
    // new part: the reader is a client on the same two cores, so it
    // must cost what a browser's native event-stream parser would.
    let mut pending: Vec<u8> = Vec::new();
    let change = memchr::memmem::Finder::new(b"\"type\":\"");
    let folded = memchr::memmem::Finder::new(b"\"folded\":");
    loop {
        let chunk = tokio::select! {
            c = body.next() => c,
            () = stop.cancelled() => None,
        };
        let Some(Ok(chunk)) = chunk else { break };
        counts.bytes += chunk.len() as u64;
        let mut at = pending.len().saturating_sub(1);
        pending.extend_from_slice(&chunk);
        let mut start = 0;
        while let Some(end) = memchr::memmem::find(&pending[at..], b"\n\n").map(|i| at + i) {
            let block = &pending[start..end];
            counts.events += 1;
            counts.changes += change.find_iter(block).count() as u64;
            if let Some(i) = folded.find(block) {
                let digits = &block[i + 9..];
                let n = digits.iter().take_while(|b| b.is_ascii_digit()).count();
                counts.folded += std::str::from_utf8(&digits[..n])
                    .ok()
                    .and_then(|d| d.parse::<u64>().ok())
                    .unwrap_or(0);
            }
            if block.starts_with(b"event: dropped") {
                counts.dropped += 1;
            }
            start = end + 2;
            at = start;
        }
        pending.drain(..start);
    }
    counts
}
