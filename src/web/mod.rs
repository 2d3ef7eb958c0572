//! The `web` plugin: an HTTP/SSE API over the live actor tree (axum).
//!
//! - `GET /api/tree`: every live node.
//! - `GET /api/tree/stream`: SSE — a `snapshot` event with the whole tree,
//!   then `delta` events, each a batch of the changes available at once
//!   (spawned / status / summary / stopped); when the subscriber fell behind,
//!   a `dropped` event with the number of lost changes tells it to take a
//!   new snapshot (the stream then restarts with one). `?coalesce=1` is a
//!   viewer's stream (the dashboard's): each delta is the difference between
//!   two looks at the tree, at most one per window — new nodes (parents
//!   first), a node's latest status and summary, stops in stop order; a node
//!   that started and stopped between two looks is left out (counted in
//!   `folded`). Per change, the agents only check whether to wake it.
//! - `GET /api/actors/{id}`: one node (live, or recently stopped), the ids
//!   of its live children and, for an agent's scope, the agent: its
//!   progress (turn, step, queued prompts) and its last session events.
//! - `GET /api/sessions`: live agents' sessions, then stored ones.
//! - `GET /api/sessions/{id}/events?from_seq=N&limit=M`: a page of events;
//!   `&stream=1` streams them as SSE, then every new one (a live session).
//! - `POST /api/agents` `{prompt, provider?, model?, system?,
//!   permissionMode?}`, and `POST /api/agents/{id}/followup|steer`
//!   `{text}`, `.../cancel`, `.../compact`: only when `mutations: true`.
//! - `GET /api/approvals`, `POST /api/approvals/{id}` `{outcome}`: the
//!   approval asks waiting for an answer (`approvals`; answered only when
//!   `mutations: true`).
//!
//! Errors are JSON `{"error": {"code", "message"}}` with a stable code.
//!
//! Safety — the API is reachable from any page the user's browser opens,
//! so every request is checked (`guard`):
//! - the server binds 127.0.0.1 unless told otherwise; any other address
//!   requires a bearer token (read from an environment variable);
//! - with mutations on, a token is required on loopback too: without a
//!   configured one, the server makes a random one, kept in memory only and
//!   shown only in the page's URL ([`WebServer::page_url`]). Any local
//!   process — an agent's own background job included — could otherwise
//!   answer the agent's approvals, steer it or cancel it;
//! - without a token, the `Host` must be the bound address or a loopback
//!   name with its port (a DNS-rebinding page names its own host);
//! - with a token, every request but the page itself (`GET /`, which
//!   holds no data) carries it as `Authorization: Bearer`; `?token=` is
//!   accepted for `GET` only (the page's `EventSource` cannot set headers);
//! - a request that is not `GET`/`HEAD` needs `Content-Type:
//!   application/json` (which a cross-site form or a no-CORS `fetch` cannot
//!   send) and an `Origin` that is absent or this server's own;
//! - request bodies are bounded; no CORS headers are ever sent.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use dsh_supervisors::error::chain;
use dsh_supervisors::tree::{NodeSnapshot, RecvError, Tree, TreeChange, TryRecvError};
use dsh_supervisors::{BoxError, Context, NoMessages, Plugin, Runtime, WorkerSpec};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use schemars::JsonSchema;
use serde::Deserialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

mod agents;
mod approvals;
mod sse;
mod timeline;

/// Config of the `web` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WebConfig {
    /// Address to listen on (default `127.0.0.1:7878`; port 0 picks one).
    #[serde(default = "default_bind")]
    pub bind: String,
    /// Environment variable holding the bearer token. Required when `bind`
    /// is not a loopback address; when set, every request must carry it.
    /// With `mutations` and no variable, the server makes a token of its
    /// own.
    #[serde(default)]
    pub token_env: Option<String>,
    /// Allow the endpoints that change things (create, followup, steer,
    /// cancel agents, answer approvals). Off by default; on, every request
    /// needs the token.
    #[serde(default)]
    pub mutations: bool,
}

fn default_bind() -> String {
    "127.0.0.1:7878".into()
}

/// The running server, provided as the `web` service.
pub struct WebServer {
    addr: SocketAddr,
    token: Option<Arc<str>>,
    /// Whether the server made its token (nobody else knows it yet).
    generated: bool,
}

impl std::fmt::Debug for WebServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebServer")
            .field("addr", &self.addr)
            .field("token", &self.token.as_ref().map(|_| "<withheld>"))
            .finish()
    }
}

impl WebServer {
    /// The capability name.
    pub const SERVICE: &'static str = "web";

    /// Where the server listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The token every request carries, if the server has one.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Whether the server made its token itself (then only its URL tells
    /// it: print [`page_url`](Self::page_url) to the person who started it).
    pub fn token_generated(&self) -> bool {
        self.generated
    }

    /// The dashboard's URL; with a token, in the fragment (`#token=`), which
    /// a browser never sends.
    pub fn page_url(&self) -> String {
        match &self.token {
            Some(token) => format!("http://{}/#token={token}", self.addr),
            None => format!("http://{}/", self.addr),
        }
    }
}

/// Largest request body accepted.
const MAX_BODY: usize = 64 * 1024;

/// Changes sent in one `delta` event at most.
const BATCH: usize = 4096;

/// How long the first change of a quiet spell waits for others to join its
/// batch. Longer windows fold more short-lived nodes away (fewer bytes, less
/// work for the agents' cores); 50 ms is under what a viewer notices. The
/// every-change stream stops waiting once half its queue is taken (at
/// 400 k changes a second, 50 ms would overflow a queue of 16,384).
const WINDOW: Duration = Duration::from_millis(50);

/// One `delta` event of the tree stream.
#[derive(serde::Serialize)]
struct Delta<'a> {
    changes: &'a [TreeChange],
    /// `?coalesce=1`: nodes that started and stopped since the last delta
    /// (never shown).
    #[serde(skip_serializing_if = "is_zero")]
    folded: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

#[derive(Clone)]
pub(crate) struct Api {
    pub(crate) rt: Runtime,
    token: Option<Arc<str>>,
    /// Fired when the server stops: open streams end, so the graceful
    /// shutdown does not wait on them.
    pub(crate) stop: CancellationToken,
    /// Whether mutating endpoints are enabled.
    pub(crate) mutations: bool,
    /// The `Host`s it answers to.
    hosts: Hosts,
    /// Approval asks waiting for a client.
    approvals: Arc<approvals::Pending>,
    /// Where agents created through the API work (`None`: the process's
    /// current directory).
    pub(crate) workspace: Option<std::path::PathBuf>,
    /// A mounted router's: when the last copy of the router goes, its
    /// streams end and its approval answerer steps aside.
    _alive: Option<Arc<tokio_util::sync::DropGuard>>,
}

pub(crate) fn error(status: StatusCode, code: &str, message: impl Into<String>) -> Response {
    let body = json!({"error": {"code": code, "message": message.into()}});
    (status, Json(body)).into_response()
}

async fn tree(State(api): State<Api>) -> Response {
    Json(api.rt.tree().snapshot()).into_response()
}

async fn actor(State(api): State<Api>, Path(id): Path<String>) -> Response {
    let Ok(id) = id.parse::<u64>() else {
        return error(
            StatusCode::BAD_REQUEST,
            "BAD_ID",
            format!("`{id}` is not an actor id (a number)"),
        );
    };
    let tree = api.rt.tree();
    let node = tree.get(id).or_else(|| tree.get_stopped(id));
    let Some(node) = node else {
        return error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("no actor {id} is live or recently stopped"),
        );
    };
    let children: Vec<u64> = tree
        .snapshot()
        .iter()
        .filter(|n| n.parent == Some(id))
        .map(|n| n.id)
        .collect();
    let agent = agents::by_node(&api.rt, id).map(|a| agents::describe(&a, 20));
    Json(json!({"node": node, "children": children, "agent": agent})).into_response()
}

/// Query of the tree stream.
#[derive(serde::Deserialize)]
struct StreamQuery {
    #[serde(default)]
    coalesce: Option<u8>,
}

/// The first event of a tree stream: every live node.
fn snapshot_event(events: &mut sse::Events, nodes: &[NodeSnapshot]) -> Bytes {
    #[derive(serde::Serialize)]
    struct Snapshot<'a> {
        nodes: &'a [NodeSnapshot],
    }
    events.json("snapshot", &Snapshot { nodes })
}

/// Straight into the stream's buffer (no intermediate JSON value per
/// change, no intermediate string).
fn delta_event(events: &mut sse::Events, changes: &[TreeChange], folded: u64) -> Bytes {
    events.json("delta", &Delta { changes, folded })
}

fn dropped_event(events: &mut sse::Events, dropped: u64) -> Bytes {
    #[derive(serde::Serialize)]
    struct Dropped {
        dropped: u64,
    }
    events.json("dropped", &Dropped { dropped })
}

async fn stream(
    State(api): State<Api>,
    query: Result<Query<StreamQuery>, axum::extract::rejection::QueryRejection>,
) -> Response {
    let Ok(Query(query)) = query else {
        return error(
            StatusCode::BAD_REQUEST,
            "BAD_QUERY",
            "query parameters: coalesce=1 (or 0)",
        );
    };
    let tree = api.rt.tree().clone();
    if query.coalesce.unwrap_or(0) != 0 {
        sse::response(view_stream(tree, api.stop.clone(), sse::KEEP_ALIVE))
    } else {
        sse::response(every_change(tree, api.stop.clone(), sse::KEEP_ALIVE))
    }
}

/// `?coalesce=1`: the tree as a viewer follows it. At most one look per
/// window, each the difference since the last (see
/// [`dsh_supervisors::tree::Follower`]): per change, the agents only check
/// whether to wake it. A comment goes out after `keep_alive` without an
/// event.
fn view_stream(
    tree: Arc<Tree>,
    stop: CancellationToken,
    keep_alive: Duration,
) -> impl futures::Stream<Item = Bytes> {
    let viewing = Viewing {
        tree,
        follower: None,
        look: Vec::new(),
        sent: 0,
        events: sse::Events::default(),
    };
    futures::stream::unfold(viewing, move |mut v| {
        let stop = stop.clone();
        async move {
            if v.sent < v.look.len() {
                let end = v.look.len().min(v.sent + BATCH);
                let event = delta_event(&mut v.events, &v.look[v.sent..end], 0);
                v.sent = end;
                return Some((event, v));
            }
            v.look.clear();
            v.sent = 0;
            let Some(follower) = v.follower.as_mut() else {
                let (nodes, follower) = v.tree.follow();
                v.follower = Some(follower);
                let event = snapshot_event(&mut v.events, &nodes);
                return Some((event, v));
            };
            // From the last event: a look that finds nothing to send does
            // not put the keep-alive off.
            let quiet = tokio::time::Instant::now() + keep_alive;
            loop {
                tokio::select! {
                    r = follower.changed() => r.ok()?,
                    () = tokio::time::sleep_until(quiet) => {
                        return Some((sse::Events::comment(), v));
                    }
                    () = stop.cancelled() => return None,
                }
                // The first change of a quiet spell waits for the ones
                // right behind it.
                tokio::select! {
                    () = tokio::time::sleep(WINDOW) => {}
                    () = stop.cancelled() => return None,
                }
                match v.tree.catch_up(follower, &mut v.look) {
                    Ok(0) if v.look.is_empty() => continue,
                    Ok(folded) => {
                        v.sent = v.look.len().min(BATCH);
                        let event = delta_event(&mut v.events, &v.look[..v.sent], folded);
                        return Some((event, v));
                    }
                    Err(RecvError::Lagged(n)) => {
                        v.look.clear();
                        v.follower = None;
                        return Some((dropped_event(&mut v.events, n), v));
                    }
                    Err(RecvError::Closed) => return None,
                }
            }
        }
    })
}

/// A viewer's stream between two events.
struct Viewing {
    tree: Arc<Tree>,
    /// `None` until the snapshot is sent (again after a lag).
    follower: Option<dsh_supervisors::tree::Follower>,
    /// The last look's changes (kept between looks, with its capacity), sent
    /// [`BATCH`] per event.
    look: Vec<TreeChange>,
    sent: usize,
    events: sse::Events,
}

/// Every change, in order, batched per window (a comment after
/// `keep_alive` without an event).
fn every_change(
    tree: Arc<Tree>,
    stop: CancellationToken,
    keep_alive: Duration,
) -> impl futures::Stream<Item = Bytes> {
    // The batch lives as long as the stream, with its capacity.
    let following = Following {
        tree,
        rx: None,
        batch: Vec::new(),
        events: sse::Events::default(),
    };
    futures::stream::unfold(following, move |mut f| {
        let stop = stop.clone();
        async move {
            let Some(rx) = f.rx.as_mut() else {
                // Subscribe first, then snapshot: no change falls between.
                f.rx = Some(f.tree.subscribe());
                let event = snapshot_event(&mut f.events, &f.tree.snapshot());
                return Some((event, f));
            };
            let next = tokio::select! {
                r = rx.recv() => r,
                () = tokio::time::sleep(keep_alive) => {
                    return Some((sse::Events::comment(), f));
                }
                () = stop.cancelled() => return None,
            };
            // One wake-up per window, not per change: the first change of
            // a quiet spell waits for the ones right behind it (a wake-up
            // per change would cost the agents more than the changes
            // themselves).
            // At most until half the queue is taken: the changes keep
            // coming during the window, and a full queue loses them.
            if rx.is_empty() {
                tokio::select! {
                    () = tokio::time::sleep(WINDOW) => {}
                    () = rx.half_full() => {}
                    () = stop.cancelled() => return None,
                }
            }
            // Fell behind (here or while draining): say how much was lost;
            // the next item is a fresh snapshot.
            let mut lagged = match next {
                Ok(change) => {
                    f.batch.push(change);
                    None
                }
                Err(RecvError::Lagged(n)) => Some(n),
                Err(RecvError::Closed) => return None,
            };
            while lagged.is_none() && f.batch.len() < BATCH {
                match rx.try_recv() {
                    Ok(change) => f.batch.push(change),
                    Err(TryRecvError::Lagged(n)) => lagged = Some(n),
                    Err(_) => break,
                }
            }
            let event = match lagged {
                Some(n) => {
                    f.rx = None;
                    dropped_event(&mut f.events, n)
                }
                None => delta_event(&mut f.events, &f.batch, 0),
            };
            f.batch.clear();
            Some((event, f))
        }
    })
}

/// An every-change stream between two events.
struct Following {
    tree: Arc<Tree>,
    /// `None` until the snapshot is sent (again after a lag).
    rx: Option<dsh_supervisors::tree::Subscription>,
    batch: Vec<TreeChange>,
    events: sse::Events,
}

/// Every request's checks, in order: the `Host` (without a token), the
/// token (with one; the page itself needs none), then, for anything but `GET`/`HEAD`, a JSON body and
/// no foreign `Origin`.
async fn guard(State(api): State<Api>, mut request: Request, next: Next) -> Response {
    let reading = matches!(
        *request.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    );
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .or_else(|| request.uri().authority().map(|a| a.as_str()))
        .unwrap_or("");
    match &api.hosts {
        Hosts::Bound(bound) if api.token.is_none() && !loopback_host(host, *bound) => {
            return error(
                StatusCode::FORBIDDEN,
                "FORBIDDEN_HOST",
                format!(
                    "this server answers to its own address only (Host: {bound} or localhost:{}), not `{host}`",
                    bound.port()
                ),
            );
        }
        Hosts::Listed(listed)
            if !listed.is_empty() && !listed.iter().any(|h| h.eq_ignore_ascii_case(host)) =>
        {
            return error(
                StatusCode::FORBIDDEN,
                "FORBIDDEN_HOST",
                format!(
                    "this dashboard answers to {} only, not `{host}`",
                    listed.join(", ")
                ),
            );
        }
        _ => {}
    }
    let page = reading && request.uri().path() == "/";
    let mut token_in_query = false;
    if let Some(token) = api.token.as_ref().filter(|_| !page) {
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        // The page's EventSource cannot set headers: `?token=` works for
        // reads only.
        let in_query = reading
            && request.uri().query().is_some_and(|q| {
                q.split('&')
                    .any(|kv| kv.strip_prefix("token=") == Some(token.as_ref()))
            });
        if given != Some(token.as_ref()) && !in_query {
            return error(
                StatusCode::UNAUTHORIZED,
                "UNAUTHORIZED",
                "this server requires `Authorization: Bearer <token>` (`?token=` is accepted on GET requests only)",
            );
        }
        token_in_query = in_query;
    }
    if !reading {
        let json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|m| m.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "JSON_REQUIRED",
                "requests that change things need `Content-Type: application/json`",
            );
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or("");
            let own = [format!("http://{host}"), format!("https://{host}")];
            if !own.iter().any(|o| o.eq_ignore_ascii_case(origin)) {
                return error(
                    StatusCode::FORBIDDEN,
                    "CROSS_ORIGIN",
                    format!("requests from `{origin}` may not change this server"),
                );
            }
        }
    }
    if token_in_query {
        // Checked: the handlers (and their strict query parsers) never see
        // it.
        *request.uri_mut() = without_token(request.uri());
    }
    next.run(request).await
}

/// `uri` without its `token=` query parameters.
fn without_token(uri: &axum::http::Uri) -> axum::http::Uri {
    let kept: Vec<&str> = uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|kv| !kv.is_empty() && !kv.starts_with("token="))
        .collect();
    let path_and_query = if kept.is_empty() {
        uri.path().to_owned()
    } else {
        format!("{}?{}", uri.path(), kept.join("&"))
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = path_and_query.parse().ok();
    axum::http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

/// Whether `host` (a `Host` header) names `bound`: its own `ip:port`, or a
/// loopback name with its port.
fn loopback_host(host: &str, bound: SocketAddr) -> bool {
    if host == bound.to_string() {
        return true;
    }
    let Some((name, port)) = host.rsplit_once(':') else {
        return false;
    };
    port.parse::<u16>() == Ok(bound.port())
        && bound.ip().is_loopback()
        && matches!(
            name.to_ascii_lowercase().as_str(),
            "localhost" | "127.0.0.1" | "[::1]"
        )
}

/// The dashboard: one page, its script and styles inside (no network).
async fn page() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CONTENT_SECURITY_POLICY, policy()),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        PAGE,
    )
        .into_response()
}

/// The dashboard: one page, its script and style inline.
const PAGE: &str = include_str!("dashboard.html");

/// The page's Content-Security-Policy: nothing but its own inline script
/// and style (named by their SHA-256), requests to this server only,
/// images from here or `data:` only, never framed. Model and tool text the
/// page shows can neither run nor fetch anything.
fn policy() -> &'static str {
    static POLICY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    POLICY.get_or_init(|| {
        let hash = |open: &str, close: &str| {
            let body = PAGE
                .split_once(open)
                .and_then(|(_, rest)| rest.split_once(close))
                .map_or("", |(body, _)| body);
            let digest = ring::digest::digest(&ring::digest::SHA256, body.as_bytes());
            use base64::Engine as _;
            format!(
                "'sha256-{}'",
                base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
            )
        };
        format!(
            "default-src 'none'; script-src {}; style-src {}; connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
            hash("<script>", "</script>"),
            hash("<style>", "</style>"),
        )
    })
}

/// Recently stopped nodes, in stop order (the teardown view replays them).
async fn stopped(State(api): State<Api>) -> Response {
    let mut nodes = api.rt.tree().stopped_nodes();
    nodes.sort_by_key(|n| n.stop_seq);
    Json(nodes).into_response()
}

/// The run's record: every node, live and stopped, with its end and time
/// (at most [`crate::record::BOUND`]; `more` counts the rest).
async fn record(State(api): State<Api>) -> Response {
    let (entries, more) = crate::record::of(&api.rt, crate::record::BOUND);
    Json(serde_json::json!({ "entries": entries, "more": more })).into_response()
}

async fn not_found() -> Response {
    error(StatusCode::NOT_FOUND, "NOT_FOUND", "no such endpoint")
}

async fn method_not_allowed(request: Request) -> Response {
    error(
        StatusCode::METHOD_NOT_ALLOWED,
        "METHOD_NOT_ALLOWED",
        format!(
            "{} does not take {}",
            request.uri().path(),
            request.method()
        ),
    )
}

/// The `Host`s a router answers to.
#[derive(Clone, Debug)]
enum Hosts {
    /// The server's own address (or a loopback name with its port); checked
    /// without a token.
    Bound(SocketAddr),
    /// The names a service mounting the router gave; checked always (none
    /// given: any, which only a token allows).
    Listed(Arc<[String]>),
}

/// The API's routes over `rt`, answering to `hosts`; `stop` ends the open
/// streams.
fn router(
    rt: Runtime,
    token: Option<Arc<str>>,
    stop: CancellationToken,
    mutations: bool,
    hosts: Hosts,
    approvals: Arc<approvals::Pending>,
    workspace: Option<std::path::PathBuf>,
) -> Router {
    let alive = matches!(hosts, Hosts::Listed(_)).then(|| Arc::new(stop.clone().drop_guard()));
    let api = Api {
        rt,
        token,
        stop,
        mutations,
        hosts,
        approvals,
        workspace,
        _alive: alive,
    };
    Router::new()
        .route("/api/tree", get(tree))
        .route("/api/tree/stream", get(stream))
        .route("/api/actors/{id}", get(actor))
        .route("/api/actors/{id}/stop", axum::routing::post(agents::stop))
        .route("/api/tree/stopped", get(stopped))
        .route("/api/record", get(record))
        .route("/", get(page))
        .route("/api/sessions", get(agents::sessions))
        .route("/api/sessions/{id}/events", get(agents::events))
        .route("/api/agents", axum::routing::post(agents::create))
        .route("/api/routes", get(agents::routes))
        .route("/api/timeline/{id}", get(timeline::timeline))
        .route(
            "/api/agents/{id}/{action}",
            axum::routing::post(agents::act),
        )
        .route("/api/approvals", get(approvals::list))
        .route(
            "/api/approvals/{id}",
            axum::routing::post(approvals::answer),
        )
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(api.clone(), guard))
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY))
        .with_state(api)
}

/// `bind` as an address: `ip:port`, or a host name with its port
/// (`localhost:7878`), resolved, loopback preferred.
async fn bind_address(bind: &str) -> Result<SocketAddr, BoxError> {
    if let Ok(addr) = bind.parse() {
        return Ok(addr);
    }
    let resolved: Vec<SocketAddr> =
        tokio::time::timeout(Duration::from_secs(10), tokio::net::lookup_host(bind))
            .await
            .map_err(|_| format!("`bind: {bind}`: the name did not resolve in time"))?
            .map_err(|e| {
                format!(
                    "`bind: {bind}` is not an address (ip:port or host:port): {}",
                    chain(&e)
                )
            })?
            .collect();
    resolved
        .iter()
        .find(|a| a.ip().is_loopback() && a.is_ipv4())
        .or_else(|| resolved.iter().find(|a| a.ip().is_loopback()))
        .or(resolved.first())
        .copied()
        .ok_or_else(|| format!("`bind: {bind}` resolves to no address").into())
}

/// What the dashboard's router checks when a service mounts it in its own
/// server ([`mount`]), and where the agents it creates work.
///
/// ```
/// let options = dsh::web::MountOptions::new()
///     .token("a long random secret")
///     .mutations(true)
///     .workspace("/srv/agents");
/// ```
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct MountOptions {
    hosts: Vec<String>,
    token: Option<String>,
    mutations: bool,
    workspace: Option<std::path::PathBuf>,
    stop: Option<CancellationToken>,
}

impl MountOptions {
    /// Nothing set: [`mount`] then needs a token or hosts.
    pub fn new() -> MountOptions {
        MountOptions::default()
    }

    /// The `Host` values requests may carry (`ops.example.com`,
    /// `localhost:8080`), compared without case. Required without a
    /// token: a page on a rebinding domain names its own host.
    pub fn hosts<S: Into<String>>(mut self, hosts: impl IntoIterator<Item = S>) -> Self {
        self.hosts = hosts.into_iter().map(Into::into).collect();
        self
    }

    /// The bearer token every request but the page itself carries
    /// (`Authorization: Bearer`, or `?token=` on reads). Required with
    /// mutations.
    pub fn token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    /// Allow the endpoints that change things (create, steer, cancel
    /// agents; answer the approval asks of every agent of the runtime).
    pub fn mutations(mut self, on: bool) -> Self {
        self.mutations = on;
        self
    }

    /// Where agents created through the API work (default: the process's
    /// current directory); give the runtime's (`dsh.workspace()`).
    pub fn workspace(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.workspace = Some(dir.into());
        self
    }

    /// Ends the open streams (the tree, session tails) when cancelled, as
    /// the runtime's shutdown does: cancel it when the server starts its
    /// graceful shutdown, which otherwise waits for an open page.
    pub fn stop(mut self, stop: CancellationToken) -> Self {
        self.stop = Some(stop);
        self
    }
}

impl std::fmt::Debug for MountOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MountOptions")
            .field("hosts", &self.hosts)
            .field("token", &self.token.as_ref().map(|_| "<withheld>"))
            .field("mutations", &self.mutations)
            .field("workspace", &self.workspace)
            .finish()
    }
}

/// Why [`mount`] refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountError(String);

impl std::fmt::Display for MountError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for MountError {}

/// The HTTP API and the dashboard page over `rt`'s tree as a router a
/// service mounts under a path of its own:
///
/// ```no_run
/// # async fn serve(dsh: dsh::Dsh) -> Result<(), Box<dyn std::error::Error>> {
/// let options = dsh::web::MountOptions::new()
///     .token(std::env::var("DASHBOARD_TOKEN")?)
///     .workspace(dsh.workspace());
/// let dashboard = dsh::web::mount(dsh.runtime(), options)?;
/// let app: axum::Router = axum::Router::new().nest_service("/ops/dsh", dashboard);
/// # let _ = app; Ok(()) }
/// ```
///
/// Every check of the standalone server stays: the `Host` (the listed
/// names), the token (on every request but the page), a JSON body and no
/// foreign `Origin` for anything that changes things, the body cap,
/// mutations off unless enabled (and then never without a token), agents
/// created within the sandbox's standing permission. A service's own auth
/// layer goes on top (`.layer(…)` on the router it mounts this in): both
/// must pass. The open streams end when the runtime shuts down, or when
/// [`MountOptions::stop`] is cancelled, or the router is dropped. With
/// mutations, the router answers the approval asks of every agent of the
/// runtime (its page shows them) while it is up; stopped or dropped, it
/// steps aside for the next answerer (none: the ask fails closed).
pub fn mount(rt: &Runtime, options: MountOptions) -> Result<Router, MountError> {
    let token = options
        .token
        .filter(|t| !t.is_empty())
        .map(Arc::<str>::from);
    if options.mutations && token.is_none() {
        return Err(MountError(
            "mutations need a token: anyone who reaches the router could steer agents and answer their approvals".into(),
        ));
    }
    if token.is_none() && options.hosts.is_empty() {
        return Err(MountError(
            "without a token, name the hosts the dashboard answers to (`hosts`)".into(),
        ));
    }
    let root = rt.root();
    // The service's own stop ends the streams too.
    let stop = options
        .stop
        .as_ref()
        .map_or_else(CancellationToken::new, CancellationToken::child_token);
    let ending = stop.clone();
    root.on_teardown("stop the mounted dashboard", move || async move {
        ending.cancel()
    })
    .map_err(|e| MountError(format!("the runtime refused the dashboard: {}", chain(&e))))?;
    let pending = Arc::new(approvals::Pending::default());
    if options.mutations {
        pending
            .answer_through(&root, stop.clone())
            .map_err(|e| MountError(format!("cannot answer approvals: {}", chain(&e))))?;
    }
    Ok(router(
        rt.clone(),
        token,
        stop,
        options.mutations,
        Hosts::Listed(options.hosts.into()),
        pending,
        options.workspace,
    ))
}

/// The `web` plugin.
pub struct Web;

impl Plugin for Web {
    type Config = WebConfig;

    fn name(&self) -> &str {
        "web"
    }

    async fn apply(&self, ctx: Context, config: Arc<WebConfig>) -> Result<(), BoxError> {
        let addr = bind_address(&config.bind).await?;
        let mut token: Option<Arc<str>> = match &config.token_env {
            None => None,
            Some(var) => match std::env::var(var) {
                Ok(t) if !t.is_empty() => Some(Arc::from(t)),
                _ => return Err(format!("`token_env: {var}`: ${var} is not set").into()),
            },
        };
        // Mutations answer approvals: never without a token, even on
        // loopback, where every local process (the agents' tools too) could
        // reach them. A made one lives in this process's memory only.
        let generated = config.mutations && token.is_none();
        if generated {
            token = Some(Arc::from(uuid::Uuid::new_v4().simple().to_string()));
        }
        if !addr.ip().is_loopback() && token.is_none() {
            return Err(format!(
                "binding {addr} (not loopback) requires a token: set `token_env` to a variable holding it"
            )
            .into());
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {}", chain(&e)))?;
        let bound = listener.local_addr()?;
        let stop = CancellationToken::new();
        if let Some(var) = &config.token_env {
            // No child process sees the token: not tools, not agent
            // processes.
            dsh_services::sandbox::env::register_server_token(var);
        }
        let pending = Arc::new(approvals::Pending::default());
        if config.mutations {
            pending.answer_through(&ctx, stop.clone())?;
        }
        let serving = Serving {
            listener: Some(listener),
            router: Some(router(
                ctx.runtime().clone(),
                token.clone(),
                stop.clone(),
                config.mutations,
                Hosts::Bound(bound),
                pending,
                None,
            )),
            stop: stop.clone(),
        };
        ctx.spawn(WorkerSpec::new(
            "web",
            format!("web/{bound}"),
            Server,
            serving,
        ))
        .await?;
        // Before the server actor is drained: stop accepting, finish requests.
        ctx.on_teardown("stop the web server", move || async move { stop.cancel() })?;
        let server = WebServer {
            addr: bound,
            token,
            generated,
        };
        ctx.provide(WebServer::SERVICE, Arc::new(server))?;
        tracing::info!("dsh web API on http://{bound}");
        Ok(())
    }
}

struct Serving {
    listener: Option<tokio::net::TcpListener>,
    router: Option<Router>,
    stop: CancellationToken,
}

/// The actor that owns the listening socket and serves until stopped.
struct Server;

impl Actor for Server {
    type Msg = NoMessages;
    type State = Serving;
    type Arguments = Serving;

    async fn pre_start(
        &self,
        _me: ActorRef<NoMessages>,
        args: Serving,
    ) -> Result<Serving, ActorProcessingErr> {
        Ok(args)
    }

    async fn post_start(
        &self,
        me: ActorRef<NoMessages>,
        s: &mut Serving,
    ) -> Result<(), ActorProcessingErr> {
        if let (Some(listener), Some(router)) = (s.listener.take(), s.router.take()) {
            let stop = s.stop.clone();
            let served = axum::serve(listener, router)
                .with_graceful_shutdown(async move { stop.cancelled().await })
                .await;
            if let Err(e) = served {
                tracing::error!("the web server failed: {}", chain(&e));
            }
        }
        me.stop(None);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<NoMessages>,
        s: &mut Serving,
    ) -> Result<(), ActorProcessingErr> {
        s.stop.cancel();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use dsh_supervisors::tree::TreeLimits;
    use futures::StreamExt;

    use super::*;

    #[tokio::test]
    async fn a_quiet_tree_stream_sends_keep_alive_comments_and_ends_when_stopped() {
        let tree = Arc::new(Tree::new(TreeLimits::default()));
        let bound = Duration::from_secs(10);
        let keep_alive = Duration::from_millis(5);
        for viewer in [true, false] {
            let stop = CancellationToken::new();
            let mut events = if viewer {
                view_stream(tree.clone(), stop.clone(), keep_alive).boxed()
            } else {
                every_change(tree.clone(), stop.clone(), keep_alive).boxed()
            };
            let snapshot = tokio::time::timeout(bound, events.next())
                .await
                .expect("a snapshot")
                .unwrap();
            assert_eq!(&snapshot[..], b"event: snapshot\ndata: {\"nodes\":[]}\n\n");
            let quiet = tokio::time::timeout(bound, events.next())
                .await
                .expect("a keep-alive")
                .unwrap();
            assert_eq!(&quiet[..], b":\n\n", "viewer stream: {viewer}");
            stop.cancel();
            assert!(
                tokio::time::timeout(bound, events.next())
                    .await
                    .expect("the end")
                    .is_none()
            );
        }
    }
}
