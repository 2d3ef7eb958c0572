//! Agents and sessions over HTTP: detail, session pages and tails, and the
//! mutating endpoints (create, followup, steer, cancel).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::{Path, Query, Request, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use dsh_actors::agent::{Agent, AgentSpec, Agents, Cancelled};
use dsh_services::llm::{LlmRuntime, Message};
use dsh_services::persistence::{PERSISTENCE_SERVICE, SessionPersistence};
use dsh_services::sandbox::{PermissionMode, Policy, Sandbox};
use dsh_services::session::SessionEvent;
use dsh_supervisors::Runtime;
use dsh_supervisors::error::chain;
use serde::Deserialize;
use serde_json::{Value, json};

use super::{Api, MAX_BODY, error};

/// The live agent whose scope is kernel node `node`.
pub(super) fn by_node(rt: &Runtime, node: u64) -> Option<Agent> {
    let agents = rt.root().get::<Agents>(Agents::SERVICE)?;
    agents
        .ids()
        .into_iter()
        .filter_map(|id| agents.get(&id))
        .find(|a| a.node_id() == node)
}

/// The live agent `id`, if it is.
pub(super) fn by_id(rt: &Runtime, id: &str) -> Option<Agent> {
    rt.root().get::<Agents>(Agents::SERVICE)?.get(id)
}

/// An agent as the API shows it, with its last `recent` events.
pub(super) fn describe(agent: &Agent, recent: usize) -> Value {
    let next = agent.session().next_seq();
    let events: Vec<Value> = agent
        .session()
        .events_from(next.saturating_sub(recent as u64))
        .iter()
        .map(|e| e.to_json())
        .collect();
    json!({
        "id": agent.id(),
        "node": agent.node_id(),
        "status": agent.status(),
        "progress": agent.progress(),
        "contextTokens": agent.context_tokens(),
        "last_turn": agent.last_turn().map(|t| json!({
            "turn": t.turn, "steps": t.steps, "reason": t.reason, "text": t.text,
        })),
        "recent_events": events,
    })
}

fn store(rt: &Runtime) -> Option<Arc<dyn SessionPersistence>> {
    rt.root().get::<dyn SessionPersistence>(PERSISTENCE_SERVICE)
}

/// `GET /api/sessions`: live sessions first, then stored ones.
pub(super) async fn sessions(State(api): State<Api>) -> Response {
    let live: Vec<Value> = api
        .rt
        .root()
        .get::<Agents>(Agents::SERVICE)
        .map(|agents| {
            agents
                .ids()
                .into_iter()
                .filter_map(|id| agents.get(&id))
                .map(|a| {
                    let h = a.session().header();
                    let p = a.progress();
                    json!({
                        "id": a.id(), "live": true, "node": a.node_id(),
                        "parentSession": h.parent_session, "createdAt": h.created_at,
                        "events": a.session().next_seq(),
                        "turns": p.turn, "tokens": p.tokens,
                        "status": if p.running { "running" } else if p.hibernated { "hibernated" } else { "idle" },
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    let mut out = live.clone();
    if let Some(store) = store(&api.rt) {
        let listed = tokio::task::spawn_blocking(move || store.list()).await;
        if let Ok(Ok(list)) = listed {
            for s in list.into_iter().flatten() {
                if live.iter().any(|l| l["id"] == s.id.as_str()) {
                    continue;
                }
                out.push(json!({
                    "id": s.id, "live": false,
                    "parentSession": s.parent_session, "createdAt": s.created_at,
                    "updatedAt": s.updated_at,
                    "durationMs": s.updated_at.saturating_sub(s.created_at),
                    "title": s.title, "turns": s.turns, "tokens": s.tokens,
                    "status": s.status, "events": s.events,
                }));
            }
        }
    }
    Json(out).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EventsQuery {
    #[serde(default)]
    from_seq: u64,
    #[serde(default = "default_limit")]
    limit: usize,
    #[serde(default)]
    stream: Option<u8>,
}

fn default_limit() -> usize {
    200
}

/// Most events one page returns.
const MAX_PAGE: usize = 5_000;

/// `GET /api/sessions/{id}/events`.
pub(super) async fn events(
    State(api): State<Api>,
    Path(id): Path<String>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return error(
            StatusCode::BAD_REQUEST,
            "BAD_QUERY",
            "query parameters: from_seq (number), limit (number), stream=1",
        );
    };
    let limit = q.limit.clamp(1, MAX_PAGE);
    let live = by_id(&api.rt, &id);
    if q.stream == Some(1) {
        let Some(agent) = live else {
            return error(
                StatusCode::NOT_FOUND,
                "NOT_LIVE",
                format!("session {id} has no live agent to follow"),
            );
        };
        return tail(api, agent, q.from_seq).into_response();
    }
    let page: Vec<Value> = match live {
        Some(agent) => agent
            .session()
            .events_from(q.from_seq)
            .iter()
            .take(limit)
            .map(|e| e.to_json())
            .collect(),
        None => {
            let Some(store) = store(&api.rt) else {
                return error(
                    StatusCode::NOT_FOUND,
                    "NOT_FOUND",
                    format!("no live session {id}, and no session store is configured"),
                );
            };
            let (sid, from) = (id.clone(), q.from_seq);
            let read = tokio::task::spawn_blocking(move || store.read_from(&sid, from)).await;
            match read {
                Ok(Ok(events)) => events
                    .iter()
                    .take(limit)
                    .map(SessionEvent::to_json)
                    .collect(),
                Ok(Err(e)) => {
                    return error(StatusCode::NOT_FOUND, "NOT_FOUND", chain(&e).to_string());
                }
                Err(e) => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "INTERNAL",
                        chain(&e).to_string(),
                    );
                }
            }
        }
    };
    Json(json!({"session": id, "from_seq": q.from_seq, "events": page})).into_response()
}

/// Removes the observer when the stream is dropped.
struct Unobserve {
    agent: Agent,
    id: u64,
}

impl Drop for Unobserve {
    fn drop(&mut self) {
        self.agent.session().unobserve(self.id);
    }
}

/// Events buffered for one slow tail subscriber before it is cut off.
const TAIL_BUFFER: usize = 4096;

fn tail(
    api: Api,
    agent: Agent,
    from_seq: u64,
) -> Sse<impl futures::Stream<Item = Result<SseEvent, Infallible>>> {
    let (tx, rx) = tokio::sync::mpsc::channel::<Arc<SessionEvent>>(TAIL_BUFFER);
    // Observe first, then read the history: nothing falls between; what the
    // history already holds is skipped from the live side by seq.
    let observer = agent
        .session()
        .observe(Arc::new(move |e: &Arc<SessionEvent>| {
            let _ = tx.try_send(e.clone());
        }));
    let history = agent.session().events_from(from_seq);
    let next = history.last().map_or(from_seq, |e| e.seq + 1);
    let guard = Unobserve {
        agent,
        id: observer,
    };
    let stop = api.stop.clone();
    let past = futures::stream::iter(
        history
            .into_iter()
            .map(|e| Ok(SseEvent::default().event("event").data(e.to_line()))),
    );
    let live = futures::stream::unfold(
        (rx, guard, next, stop),
        |(mut rx, guard, next, stop)| async move {
            let e = tokio::select! {
                e = rx.recv() => e?,
                () = stop.cancelled() => return None,
            };
            if e.seq < next {
                let skip = SseEvent::default().comment("already sent");
                return Some((Ok(skip), (rx, guard, next, stop)));
            }
            let event = SseEvent::default().event("event").data(e.to_line());
            Some((Ok(event), (rx, guard, e.seq + 1, stop)))
        },
    );
    Sse::new(futures::StreamExt::chain(past, live))
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
}

/// Reads a JSON body of at most [`MAX_BODY`] bytes into `T`.
pub(super) async fn body<T: serde::de::DeserializeOwned>(
    request: Request,
) -> Result<T, Box<Response>> {
    let bytes = axum::body::to_bytes(request.into_body(), MAX_BODY)
        .await
        .map_err(|_| {
            Box::new(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "TOO_LARGE",
                format!("request bodies are limited to {MAX_BODY} bytes"),
            ))
        })?;
    serde_json::from_slice(&bytes).map_err(|e| {
        Box::new(error(
            StatusCode::BAD_REQUEST,
            "BAD_JSON",
            format!("the body is not the expected JSON: {}", chain(&e)),
        ))
    })
}

/// The refusal of a mutating request on a read-only server.
pub(super) fn read_only(api: &Api) -> Option<Response> {
    if api.mutations {
        None
    } else {
        Some(error(
            StatusCode::FORBIDDEN,
            "MUTATIONS_DISABLED",
            "this server is read-only; enable `mutations` in the web plugin's config (or `dsh serve --mutations`)",
        ))
    }
}

/// `GET /api/routes`: what the page's start form offers: each provider
/// route with the model ids a person may choose (the one the command line
/// chose first), the permission modes an agent may be given (at most the
/// server's), and whether agents may be started at all.
pub(super) async fn routes(State(api): State<Api>) -> Response {
    let root = api.rt.root();
    let routes: Vec<Value> = root
        .get::<LlmRuntime>(LlmRuntime::SERVICE)
        .map(|llm| {
            llm.providers()
                .into_iter()
                .map(|p| json!({"provider": p, "models": llm.model_ids(&p)}))
                .collect()
        })
        .unwrap_or_default();
    let standing = root
        .get::<Sandbox>(Sandbox::SERVICE)
        .map(|s| s.defaults())
        .unwrap_or_default();
    let modes: Vec<&str> = PermissionMode::ALL
        .into_iter()
        .filter(|m| {
            let asked = Policy {
                mode: *m,
                network: standing.network,
            };
            standing.narrowed(Some(asked)).mode == *m
        })
        .map(PermissionMode::as_str)
        .collect();
    Json(json!({
        "routes": routes,
        "permissionModes": modes,
        "standing": standing.mode.as_str(),
        "mutations": api.mutations,
    }))
    .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateAgent {
    prompt: String,
    #[serde(default)]
    provider: Option<String>,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    system: Option<String>,
    /// At most the server's standing mode.
    #[serde(default, rename = "permissionMode")]
    permission_mode: Option<PermissionMode>,
}

/// `POST /api/agents`: a new top-level agent running `prompt`.
pub(super) async fn create(State(api): State<Api>, request: Request) -> Response {
    if let Some(r) = read_only(&api) {
        return r;
    }
    let spec: CreateAgent = match body(request).await {
        Ok(b) => b,
        Err(r) => return *r,
    };
    let root = api.rt.root();
    let Some(llm) = root.get::<LlmRuntime>(LlmRuntime::SERVICE) else {
        return error(
            StatusCode::CONFLICT,
            "NO_LLM",
            "no `llm` service is provided; load agent-services and a model provider",
        );
    };
    let providers = llm.providers();
    let provider = match (spec.provider, providers.as_slice()) {
        (Some(p), _) if providers.contains(&p) => p,
        (Some(p), _) => {
            return error(
                StatusCode::BAD_REQUEST,
                "UNKNOWN_PROVIDER",
                format!("no provider `{p}` (registered: {})", providers.join(", ")),
            );
        }
        (None, [only]) => only.clone(),
        (None, _) => {
            return error(
                StatusCode::BAD_REQUEST,
                "PROVIDER_REQUIRED",
                format!("name a provider (registered: {})", providers.join(", ")),
            );
        }
    };
    let model = spec
        .model
        .or_else(|| llm.model_ids(&provider).into_iter().next())
        .unwrap_or_else(|| "default".into());
    let cwd = match &api.workspace {
        Some(dir) => dir.clone(),
        None => std::env::current_dir().unwrap_or_else(|_| std::env::temp_dir()),
    };
    let mut agent_spec = AgentSpec::new(&provider, &model, cwd);
    agent_spec.system = spec.system;
    agent_spec.sections = crate::home::workspace_sections(&agent_spec.cwd).await;
    if let Some(mode) = spec.permission_mode {
        let standing = root
            .get::<Sandbox>(Sandbox::SERVICE)
            .map(|s| s.defaults())
            .unwrap_or_default();
        let policy = standing.narrowed(Some(Policy {
            mode,
            network: standing.network,
        }));
        agent_spec.permission = Some(policy);
        // The mode it was given, in its log.
        agent_spec.opening = vec![dsh_services::session::EventData::Other {
            kind: Arc::from("sandbox/mode"),
            data: Arc::new(
                json!({"mode": policy.mode, "network": policy.network, "source": "api"}),
            ),
        }];
    }
    let agent = match Agent::create(&root, agent_spec).await {
        Ok(a) => a,
        Err(e) => return error(StatusCode::CONFLICT, "CREATE_FAILED", chain(&e).to_string()),
    };
    if let Err(e) = agent.followup(Message::user_text(spec.prompt)) {
        return error(StatusCode::CONFLICT, "CLOSED", chain(&e).to_string());
    }
    (
        StatusCode::CREATED,
        Json(json!({"id": agent.id(), "node": agent.node_id()})),
    )
        .into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Text {
    text: String,
}

/// `POST /api/agents/{id}/followup|steer|cancel|compact`.
pub(super) async fn act(
    State(api): State<Api>,
    Path((id, action)): Path<(String, String)>,
    request: Request,
) -> Response {
    if let Some(r) = read_only(&api) {
        return r;
    }
    let Some(agent) = by_id(&api.rt, &id) else {
        return error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("no live agent {id}"),
        );
    };
    let done = match action.as_str() {
        "cancel" => {
            let outcome = agent.cancel();
            let note = match outcome {
                Cancelled::Running => "the running turn was cancelled; it ends aborted",
                Cancelled::Queued => "the queued prompt's turn starts cancelled",
                Cancelled::Idle => "nothing was running; nothing was cancelled",
                Cancelled::Hibernated => {
                    "the agent is hibernated and runs nothing; nothing was cancelled and it stays asleep"
                }
            };
            return Json(json!({
                "id": id, "accepted": action, "cancelled": outcome, "note": note,
                "progress": agent.progress(),
            }))
            .into_response();
        }
        "compact" => {
            return match agent.compact().await {
                Ok(compacted) => Json(json!({
                    "id": id, "accepted": action, "compacted": compacted,
                    "progress": agent.progress(),
                }))
                .into_response(),
                Err(e @ dsh_actors::agent::AgentError::Busy(_)) => {
                    error(StatusCode::CONFLICT, "BUSY", chain(&e).to_string())
                }
                Err(e @ dsh_actors::agent::AgentError::Compaction(_)) => error(
                    StatusCode::BAD_GATEWAY,
                    "COMPACTION_FAILED",
                    chain(&e).to_string(),
                ),
                Err(e) => error(StatusCode::CONFLICT, "CLOSED", chain(&e).to_string()),
            };
        }
        "followup" | "steer" => {
            let text: Text = match body(request).await {
                Ok(b) => b,
                Err(r) => return *r,
            };
            let message = Message::user_text(text.text);
            if action == "followup" {
                agent.followup(message)
            } else {
                agent.steer(message)
            }
        }
        other => {
            return error(
                StatusCode::NOT_FOUND,
                "NOT_FOUND",
                format!("no action `{other}` (followup, steer, cancel, compact)"),
            );
        }
    };
    match done {
        Ok(()) => Json(json!({"id": id, "accepted": action, "progress": agent.progress()}))
            .into_response(),
        Err(e) => error(StatusCode::CONFLICT, "CLOSED", chain(&e).to_string()),
    }
}

/// `POST /api/actors/{id}/stop`: stops an actor the normal way — an agent
/// (or any fiber) with its whole subtree, in order — and answers when done.
pub(super) async fn stop(State(api): State<Api>, Path(id): Path<String>) -> Response {
    if let Some(r) = read_only(&api) {
        return r;
    }
    let Ok(node) = id.parse::<u64>() else {
        return error(
            StatusCode::BAD_REQUEST,
            "BAD_ID",
            format!("`{id}` is not an actor id (a number)"),
        );
    };
    if let Some(agent) = by_node(&api.rt, node) {
        agent.dispose().await;
        let seq = api.rt.tree().get_stopped(node).and_then(|n| n.stop_seq);
        return Json(json!({"id": node, "stopped": true, "stop_seq": seq})).into_response();
    }
    if api.rt.tree().get(node).is_none() {
        return error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("no live actor {node}"),
        );
    }
    match api.rt.stop_node(node).await {
        Some(order) => Json(json!({"id": node, "stopped": true, "order": order})).into_response(),
        None => error(
            StatusCode::CONFLICT,
            "NOT_STOPPABLE",
            format!("actor {node} cannot be stopped here (the root stops with the server)"),
        ),
    }
}
