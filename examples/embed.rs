//! Embedding dsh in your own axum service.
//!
//! `POST /ask {"prompt": "..."}` creates an agent for the request and streams
//! its session events as SSE until its turn ends; the agent stays resident
//! (a conversation you could continue). On SIGTERM or Ctrl-C the server stops
//! taking requests, then `Runtime::shutdown` drains every agent in order
//! (each cancelled turn ends, its session is flushed, its actors stop) before
//! the process exits.
//!
//! Run: `cargo run --release --bin dsh-embed-example` (keyless: the built-in demo
//! model), or with `DSH_BASE_URL`/`DSH_MODEL`/`DSH_API_KEY` for a real
//! OpenAI-compatible endpoint. `PORT` picks the port (default: any free one).

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::routing::post;
use axum::{Json, Router};
use dsh::actors::agent::{Agent, AgentDisposed, AgentSpec};
use dsh::catalogue::{AgentServices, OpenAi, OpenAiPluginConfig};
use dsh::kernel::{Runtime, RuntimeSettings};
use dsh::services::llm::{LlmRuntime, Message};
use dsh::services::session::{EventData, SessionEvent};
use futures::Stream;

#[derive(Clone)]
struct App {
    rt: Runtime,
    provider: String,
    model: String,
}

#[derive(serde::Deserialize)]
struct Ask {
    prompt: String,
}

/// One agent per request; its events stream back until its turn ends.
async fn ask(
    State(app): State<App>,
    Json(ask): Json<Ask>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, String> {
    let spec = AgentSpec::new(&app.provider, &app.model, std::env::temp_dir());
    let agent = Agent::create(&app.rt.root(), spec)
        .await
        .map_err(|e| e.to_string())?;
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Arc<SessionEvent>>();
    let observer = agent
        .session()
        .observe(Arc::new(move |e: &Arc<SessionEvent>| {
            let _ = tx.send(e.clone());
        }));
    agent
        .followup(Message::user_text(ask.prompt))
        .map_err(|e| e.to_string())?;
    let events = futures::stream::unfold(
        (rx, Some((agent, observer))),
        |(mut rx, watching)| async move {
            let (agent, observer) = watching?;
            let e = rx.recv().await?;
            let done = matches!(e.data, EventData::TurnEnd { .. });
            let event = Event::default()
                .event("event")
                .data(e.to_json().to_string());
            if done {
                agent.session().unobserve(observer);
                return Some((Ok(event), (rx, None)));
            }
            Some((Ok(event), (rx, Some((agent, observer)))))
        },
    );
    Ok(Sse::new(events))
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

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let root = rt.root();
    root.plugin(AgentServices, Default::default()).await?;
    let (provider, model) = match (std::env::var("DSH_BASE_URL"), std::env::var("DSH_MODEL")) {
        (Ok(base_url), Ok(model)) => {
            let config = OpenAiPluginConfig {
                provider: "openai".into(),
                base_url,
                api_key_env: Some("DSH_API_KEY".into()),
                idle_timeout_s: None,
                request_timeout_s: None,
                total_timeout_s: None,
                images: false,
                context_window: None,
                models: Default::default(),
                price: None,
            };
            root.plugin(OpenAi, config).await?;
            ("openai".to_owned(), model)
        }
        _ => {
            let llm = root
                .get::<LlmRuntime>(LlmRuntime::SERVICE)
                .ok_or("no llm service")?;
            llm.register(&root, &["demo"], Arc::new(dsh::demo::DemoModel))?;
            ("demo".to_owned(), "demo".to_owned())
        }
    };
    // Count the agents the shutdown disposes, to report it.
    let disposed = Arc::new(AtomicUsize::new(0));
    let count = disposed.clone();
    root.on(move |_: &AgentDisposed| {
        count.fetch_add(1, Ordering::Relaxed);
    })?;
    let app = Router::new().route("/ask", post(ask)).with_state(App {
        rt: rt.clone(),
        provider,
        model,
    });
    let port = std::env::var("PORT").unwrap_or_else(|_| "0".into());
    let listener = tokio::net::TcpListener::bind(format!("127.0.0.1:{port}")).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(terminated())
        .await?;
    // Every agent, drained in reverse start order before the process exits.
    rt.shutdown().await;
    println!(
        "shut down: {} agents disposed",
        disposed.load(Ordering::Relaxed)
    );
    Ok(())
}
