//! Embedding dsh in your own axum service, through the front door
//! (`dsh::Dsh`).
//!
//! `POST /ask {"prompt": "..."}` spawns an agent for the request, streams
//! its session events as SSE until its turn ends, and disposes it (a client
//! that hangs up early drops the stream, and with it the agent). On SIGTERM
//! or Ctrl-C the server stops taking requests, then `Dsh::shutdown` drains
//! whatever still runs, in order, before the process exits.
//!
//! Run: `cargo run --release --example embed` (keyless: the built-in
//! demo model), or with `DSH_BASE_URL`/`DSH_MODEL`/`DSH_API_KEY` for a real
//! OpenAI-compatible endpoint. `PORT` picks the port (default: any free one).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::sse::{Event, Sse};
use axum::routing::post;
use axum::{Json, Router};
use dsh::actors::agent::AgentDisposed;
use dsh::services::session::EventData;
use dsh::{Dsh, Model, RunError};
use futures::Stream;

#[derive(serde::Deserialize)]
struct Ask {
    prompt: String,
}

/// What a refused request answers: the error's code and message.
fn refused(e: RunError) -> (StatusCode, String) {
    let status = if e.is_retryable() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    (status, e.to_string())
}

/// One agent per request: its events stream back until its turn ends.
async fn ask(
    State(dsh): State<Dsh>,
    Json(ask): Json<Ask>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, (StatusCode, String)> {
    let agent = dsh.agent().label("ask").spawn().await.map_err(refused)?;
    let events = agent.events();
    agent.send(&ask.prompt).map_err(refused)?;
    // The handle rides in the stream: when the turn ends it is disposed;
    // if the client goes first, dropping the stream disposes it.
    let stream = futures::stream::unfold(Some((agent, events)), |state| async move {
        let (agent, mut events) = state?;
        let e = events.next().await?;
        let event = Ok(Event::default()
            .event("event")
            .data(e.to_json().to_string()));
        if matches!(e.data, EventData::TurnEnd { .. }) {
            agent.dispose().await;
            return Some((event, None));
        }
        Some((event, Some((agent, events))))
    });
    Ok(Sse::new(stream))
}

/// The service's routes: `POST /ask`.
pub fn app(dsh: Dsh) -> Router {
    Router::new().route("/ask", post(ask)).with_state(dsh)
}

async fn terminated() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(t) => t,
        Err(_) => return std::future::pending().await,
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Serves until SIGTERM or Ctrl-C, then shuts the runtime down in order.
#[tokio::main]
pub async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let model = match (std::env::var("DSH_BASE_URL"), std::env::var("DSH_MODEL")) {
        (Ok(url), Ok(id)) => Model::openai_compatible(url, id),
        _ => Model::demo(),
    };
    let dsh = Dsh::builder().model(model).start().await?;
    // Count the agents disposed, to report it.
    let disposed = Arc::new(AtomicUsize::new(0));
    let count = disposed.clone();
    dsh.runtime().root().on(move |_: &AgentDisposed| {
        count.fetch_add(1, Ordering::Relaxed);
    })?;
    let app = app(dsh.clone());
    let port = std::env::var("PORT").unwrap_or_else(|_| "0".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(terminated())
        .await?;
    // Whatever still runs, drained in reverse start order.
    dsh.shutdown().await?;
    println!(
        "shut down: {} agents disposed",
        disposed.load(Ordering::Relaxed)
    );
    Ok(())
}
