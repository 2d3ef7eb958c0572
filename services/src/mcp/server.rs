//! A server as a supervised actor: connect, list and register its tools,
//! notice the loss, reconnect with a doubling delay within a budget.
//!
//! Messages: `Connect` (one attempt), `Lost` and `ToolsChanged` (from a
//! connection, tagged with its number so a stale one is ignored). The
//! actor is a child of the fiber that started it, and its tools are
//! effects of that same fiber: teardown stops the actor (its connection and
//! process go with it) before the tools are unregistered. The registrations
//! live in [`Shared`], so an actor restarted after a panic takes over the
//! tools its predecessor registered. A teardown prelude stops connecting
//! first: no attempt starts, or goes on, once the owner is going away.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dsh_supervisors::error::chain;
use ractor::{Actor, ActorProcessingErr, ActorRef};
use rmcp::service::{Peer, RoleClient};
use tokio::sync::watch;

use dsh_supervisors::{Context, Disposer, Restart, WorkerSpec};

use super::link::{self, Connection, Tail, Watcher};
use super::tool::{self, McpTool};
use super::{McpError, McpServers, ServerSpec, ServerStatus, State, ToolInfo};
use crate::sandbox::Sandbox;
use crate::tools::ToolRegistry;

/// What the actor, the tools and `dsh mcp list` share about one server.
pub(crate) struct Shared {
    pub(crate) spec: ServerSpec,
    /// The scope the tools are registered in (`None`: global).
    pub(crate) scope: Option<String>,
    status: Mutex<Status>,
    live: Mutex<Option<Live>>,
    tail: Arc<Mutex<Tail>>,
    changes: watch::Sender<u64>,
    /// Calls sent and not yet answered (or dropped).
    pub(crate) in_flight: std::sync::atomic::AtomicU32,
    /// The registered tools, each with what unregisters it.
    registered: Mutex<Vec<(Arc<McpTool>, Disposer)>>,
    /// Set when the owner goes away (or the start was refused): no more
    /// connecting.
    stopping: tokio_util::sync::CancellationToken,
    /// A relist is queued; more `list_changed` notices add nothing.
    resync_queued: std::sync::atomic::AtomicBool,
    /// The size of the last message the server sent over the transport's
    /// cap (dropped there); calls in flight watch it.
    pub(crate) too_large: watch::Sender<u64>,
}

/// The live connection: its peer, and how to report its loss.
#[derive(Clone)]
struct Live {
    peer: Peer<RoleClient>,
    me: ActorRef<Msg>,
    number: u32,
}

#[derive(Clone)]
struct Status {
    state: State,
    tools: Vec<ToolInfo>,
    connections: u32,
    attempts: u32,
    error: Option<String>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    pub(crate) fn status(&self) -> ServerStatus {
        let s = lock(&self.status).clone();
        ServerStatus {
            name: self.spec.name.clone(),
            transport: self.spec.transport.kind(),
            scope: self.scope.clone(),
            state: s.state,
            tools: s.tools,
            connections: s.connections,
            attempts: s.attempts,
            in_flight: self.in_flight.load(std::sync::atomic::Ordering::Acquire),
            error: s.error,
        }
    }

    /// The live connection's peer and number, or why there is none.
    pub(crate) fn peer(&self) -> Result<(Peer<RoleClient>, u32), String> {
        if let Some(live) = lock(&self.live).clone() {
            return Ok((live.peer, live.number));
        }
        let s = lock(&self.status).clone();
        let why = s.error.map(|e| format!(": {e}")).unwrap_or_default();
        Err(format!(
            "MCP server {} is {}{why}",
            self.spec.name,
            s.state.as_str()
        ))
    }

    fn update(&self, f: impl FnOnce(&mut Status)) {
        f(&mut lock(&self.status));
        self.changes.send_modify(|n| *n += 1);
    }

    fn set_live(&self, live: Option<Live>) {
        *lock(&self.live) = live;
    }

    /// A call on connection `number` found it gone (an HTTP server that
    /// went away says so only when asked): the actor treats it as lost —
    /// unless another connection has replaced it since.
    pub(crate) fn call_lost(&self, number: u32, why: String) {
        let mut live = lock(&self.live);
        if live.as_ref().is_some_and(|l| l.number == number)
            && let Some(l) = live.take()
        {
            let _ = l.me.cast(Msg::Lost {
                connection: l.number,
                why,
            });
        }
    }

    fn take_registered(&self) -> Vec<(Arc<McpTool>, Disposer)> {
        std::mem::take(&mut *lock(&self.registered))
    }
}

/// A started server: its status, and a way to wait for it to change.
pub struct McpServer {
    shared: Arc<Shared>,
    hub: Option<Arc<McpServers>>,
}

impl Drop for McpServer {
    fn drop(&mut self) {
        if let Some(hub) = &self.hub {
            hub.remove(&self.shared);
        }
    }
}

impl McpServer {
    /// Its status now.
    pub fn status(&self) -> ServerStatus {
        self.shared.status()
    }

    /// Waits until `done` holds for its status, up to `timeout`; the status
    /// it ended with either way.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        done: impl Fn(&ServerStatus) -> bool,
    ) -> ServerStatus {
        let mut rx = self.shared.changes.subscribe();
        let _ = tokio::time::timeout(timeout, async {
            loop {
                if done(&self.shared.status()) {
                    return;
                }
                if rx.changed().await.is_err() {
                    return;
                }
            }
        })
        .await;
        self.shared.status()
    }
}

/// Starts `spec`'s server as a supervised worker under `ctx`'s fiber, its
/// tools registered through `ctx` (so in `ctx`'s scope), and waits for the
/// first connection to settle (up to the connect timeout). Refused when a
/// live server of the same scope has its name, and when the first
/// connection fails and the spec says to fail then.
pub async fn start(ctx: &Context, spec: ServerSpec) -> Result<McpServer, McpError> {
    let refused = |why: &str| McpError::Start {
        name: spec.name.clone(),
        why: why.to_owned(),
    };
    let tools = ctx
        .get::<ToolRegistry>(ToolRegistry::SERVICE)
        .ok_or_else(|| {
            refused("no tool registry (the agent-services plugin) to register its tools in")
        })?;
    let sandbox = ctx
        .get::<Sandbox>(Sandbox::SERVICE)
        .unwrap_or_else(Sandbox::host);
    let hub = ctx.get::<McpServers>(McpServers::SERVICE);
    let shared = Arc::new(Shared {
        scope: ctx.scope_key().map(|k| format!("{}#{}", k.label(), k.id())),
        spec,
        status: Mutex::new(Status {
            state: State::Connecting,
            tools: Vec::new(),
            connections: 0,
            attempts: 0,
            error: None,
        }),
        live: Mutex::new(None),
        tail: Arc::default(),
        changes: watch::channel(0).0,
        in_flight: Default::default(),
        registered: Mutex::default(),
        stopping: Default::default(),
        resync_queued: Default::default(),
        too_large: watch::channel(0).0,
    });
    if let Some(hub) = &hub {
        hub.admit(shared.clone())?;
    }
    let server = McpServer {
        shared: shared.clone(),
        hub,
    };
    let stopping = shared.stopping.clone();
    ctx.on_teardown("stop connecting the MCP server", move || async move {
        stopping.cancel();
    })
    .map_err(|e| McpError::Start {
        name: shared.spec.name.clone(),
        why: format!("its owner is going away: {}", chain(&e)),
    })?;
    let args = Args {
        shared: shared.clone(),
        ctx: ctx.clone(),
        tools,
        sandbox,
    };
    let spec = WorkerSpec::restartable("mcp-server", shared.spec.name.clone(), move || {
        (ServerActor, args.clone())
    })
    .restart(Restart::Permanent);
    ctx.spawn(spec).await.map_err(|e| McpError::Start {
        name: shared.spec.name.clone(),
        why: format!("it cannot be supervised: {}", chain(&e)),
    })?;
    let timeout = shared.spec.connect_timeout + Duration::from_secs(1);
    let settled = server
        .wait_until(timeout, |s| s.connections > 0 || s.attempts > 0)
        .await;
    if settled.connections == 0 && shared.spec.fail_on_startup_error {
        // Refused: the worker stops trying (its owner stops it).
        shared.stopping.cancel();
        let why = settled
            .error
            .unwrap_or_else(|| "it did not connect in time".into());
        return Err(McpError::Start {
            name: shared.spec.name.clone(),
            why,
        });
    }
    if settled.connections == 0 {
        tracing::warn!(
            "MCP server {} did not connect: {}; retrying in the background",
            shared.spec.name,
            settled.error.as_deref().unwrap_or("no answer yet")
        );
    }
    Ok(server)
}

#[derive(Clone)]
struct Args {
    shared: Arc<Shared>,
    ctx: Context,
    tools: Arc<ToolRegistry>,
    sandbox: Arc<Sandbox>,
}

/// The actor.
struct ServerActor;

/// Its messages.
enum Msg {
    Connect,
    Lost { connection: u32, why: String },
    ToolsChanged { connection: u32 },
}

// Local only: an MCP link is never reached from another node.
impl ractor::Message for Msg {}

/// Its state.
struct Run {
    args: Args,
    me: ActorRef<Msg>,
    connection: Option<Connection>,
    /// Attempts made, numbering each attempt's connection.
    tag: u32,
    /// The number of the live connection (0: none).
    number: u32,
    up_since: Option<Instant>,
    timer: Option<tokio::task::JoinHandle<Result<(), ractor::MessagingErr<Msg>>>>,
}

/// Forwards a connection's news to the actor, tagged with its number.
struct Forward {
    me: ActorRef<Msg>,
    connection: u32,
    shared: Arc<Shared>,
}

impl Watcher for Forward {
    fn lost(&self, why: String) {
        let _ = self.me.cast(Msg::Lost {
            connection: self.connection,
            why,
        });
    }

    fn too_large(&self, bytes: u64) {
        self.shared.too_large.send_replace(bytes);
    }

    fn tools_changed(&self) {
        // A flood of notices queues one relist.
        if !self
            .shared
            .resync_queued
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            let _ = self.me.cast(Msg::ToolsChanged {
                connection: self.connection,
            });
        }
    }
}

impl Actor for ServerActor {
    type Msg = Msg;
    type State = Run;
    type Arguments = Args;

    async fn pre_start(&self, me: ActorRef<Msg>, args: Args) -> Result<Run, ActorProcessingErr> {
        me.cast(Msg::Connect)?;
        Ok(Run {
            args,
            me,
            connection: None,
            tag: 0,
            number: 0,
            up_since: None,
            timer: None,
        })
    }

    async fn handle(
        &self,
        _me: ActorRef<Msg>,
        msg: Msg,
        run: &mut Run,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            Msg::Connect => run.connect().await,
            Msg::Lost { connection, why } if connection == run.number => run.lost(why).await,
            Msg::ToolsChanged { connection } => {
                run.args
                    .shared
                    .resync_queued
                    .store(false, std::sync::atomic::Ordering::Release);
                if connection == run.number {
                    run.resync().await;
                }
            }
            Msg::Lost { .. } => {}
        }
        Ok(())
    }

    async fn post_stop(&self, _me: ActorRef<Msg>, run: &mut Run) -> Result<(), ActorProcessingErr> {
        if let Some(t) = run.timer.take() {
            t.abort();
        }
        run.args.shared.set_live(None);
        if let Some(mut c) = run.connection.take() {
            // Bounded: the loop ends and the child goes with its transport.
            let _ = c.close_with_timeout(Duration::from_secs(2)).await;
        }
        run.args.shared.update(|s| s.state = State::Stopped);
        Ok(())
    }
}

impl Run {
    fn spec(&self) -> &ServerSpec {
        &self.args.shared.spec
    }

    /// One attempt: connect and list within the connect timeout, then
    /// register the tools; a failure counts against the outage's budget.
    async fn connect(&mut self) {
        self.timer = None;
        let stopping = self.args.shared.stopping.clone();
        if stopping.is_cancelled() {
            return;
        }
        self.tag += 1;
        let number = self.tag;
        let watcher = Arc::new(Forward {
            me: self.me.clone(),
            connection: number,
            shared: self.args.shared.clone(),
        });
        let spec = self.spec().clone();
        let sandbox = self.args.sandbox.clone();
        let tail = self.args.shared.tail.clone();
        let attempt = async {
            let c = link::connect(&spec, &sandbox, watcher, tail).await?;
            let listed = c
                .peer()
                .list_all_tools()
                .await
                .map_err(|e| format!("tools/list failed: {}", chain(&e)))?;
            Ok::<_, String>((c, listed))
        };
        let outcome = tokio::select! {
            r = tokio::time::timeout(spec.connect_timeout, attempt) => match r {
                Ok(r) => r,
                Err(_) => Err(format!(
                    "no connection and tool list within {} ms",
                    spec.connect_timeout.as_millis()
                )),
            },
            // The owner goes away: the half-made connection is dropped.
            () = stopping.cancelled() => return,
        };
        match outcome {
            Ok((c, listed)) => {
                self.number = number;
                // A notice queued for an old connection is moot now.
                self.args
                    .shared
                    .resync_queued
                    .store(false, std::sync::atomic::Ordering::Release);
                let peer = c.peer().clone();
                self.connection = Some(c);
                self.up_since = Some(Instant::now());
                self.args.shared.set_live(Some(Live {
                    peer,
                    me: self.me.clone(),
                    number,
                }));
                let installed = self.install(listed).await;
                self.args.shared.update(|s| {
                    s.state = State::Up;
                    // A reconnect counts against the budget until the
                    // connection outlives the longest delay (see `lost`):
                    // a server that crashes right after each handshake
                    // still spends it.
                    if s.connections > 0 {
                        s.attempts += 1;
                    }
                    s.connections += 1;
                    s.error = installed.err();
                });
                tracing::info!("MCP server {} connected", self.spec().name);
            }
            Err(why) => self.failed(why).await,
        }
    }

    /// A failed attempt: try again after the doubled delay, or give up and
    /// unregister the tools once the budget is spent.
    async fn failed(&mut self, why: String) {
        let shared = self.args.shared.clone();
        let attempts = lock(&shared.status).attempts + 1;
        let reconnect = self.spec().reconnect.clone();
        if !reconnect.enabled || attempts >= reconnect.max_attempts {
            return self.give_up(attempts, why).await;
        }
        if shared.stopping.is_cancelled() {
            return;
        }
        let delay = backoff(&reconnect, attempts);
        tracing::warn!(
            "MCP server {}: {why}; reconnecting in {} ms (attempt {attempts})",
            self.spec().name,
            delay.as_millis()
        );
        shared.update(|s| {
            s.state = if s.connections == 0 {
                State::Connecting
            } else {
                State::Reconnecting
            };
            s.attempts = attempts;
            s.error = Some(why);
        });
        self.timer = Some(self.me.send_after(delay, || Msg::Connect));
    }

    /// Unregisters the tools and stops trying, after `attempts`.
    async fn give_up(&mut self, attempts: u32, why: String) {
        tracing::error!(
            "MCP server {}: {why}; giving up after {attempts} attempt(s)",
            self.spec().name
        );
        for (_, d) in self.args.shared.take_registered() {
            d.dispose().await;
        }
        self.args.shared.update(|s| {
            s.state = State::Failed;
            s.attempts = attempts;
            s.error = Some(why);
            s.tools.clear();
        });
    }

    /// The connection ended: keep the tools (failing) and reconnect, or stay
    /// down when reconnecting is off, or give up when reconnects have spent
    /// the budget.
    async fn lost(&mut self, why: String) {
        self.connection = None;
        self.number = 0;
        self.args.shared.set_live(None);
        let reconnect = self.spec().reconnect.clone();
        let lived = self.up_since.take().map(|t| t.elapsed());
        let why = format!("the connection was lost: {why}");
        if lived.is_some_and(|l| l >= Duration::from_millis(reconnect.max_delay_ms)) {
            self.args.shared.update(|s| s.attempts = 0);
        }
        if !reconnect.enabled {
            tracing::error!(
                "MCP server {}: {why}; reconnecting is off",
                self.spec().name
            );
            self.args.shared.update(|s| {
                s.state = State::Down;
                s.error = Some(why);
            });
            return;
        }
        let attempts = lock(&self.args.shared.status).attempts;
        if attempts >= reconnect.max_attempts {
            return self.give_up(attempts, why).await;
        }
        if self.args.shared.stopping.is_cancelled() {
            return;
        }
        let delay = backoff(&reconnect, attempts);
        tracing::warn!(
            "MCP server {}: {why}; reconnecting in {} ms",
            self.spec().name,
            delay.as_millis()
        );
        self.args.shared.update(|s| {
            s.state = State::Reconnecting;
            s.error = Some(why);
        });
        self.timer = Some(self.me.send_after(delay, || Msg::Connect));
    }

    /// The server's list changed: list again; a failed listing keeps the
    /// tools registered now.
    async fn resync(&mut self) {
        let Some(c) = &self.connection else { return };
        let peer = c.peer().clone();
        let listed =
            match tokio::time::timeout(self.spec().connect_timeout, peer.list_all_tools()).await {
                Ok(Ok(l)) => l,
                Ok(Err(e)) => {
                    tracing::warn!("MCP server {}: tools/list failed: {e}", self.spec().name);
                    return;
                }
                Err(_) => {
                    tracing::warn!("MCP server {}: tools/list timed out", self.spec().name);
                    return;
                }
            };
        let installed = self.install(listed).await;
        self.args.shared.update(|s| s.error = installed.err());
    }

    /// Replaces the registered tools with `listed`, all or none: a tool
    /// whose definition did not change stays registered (no window where
    /// it is missing, and the request prefix stays the same), a changed one
    /// is replaced, a gone one removed. A list naming a tool twice, or a
    /// name another registration holds, leaves no tool of this server
    /// registered.
    async fn install(&mut self, listed: Vec<rmcp::model::Tool>) -> Result<(), String> {
        let shared = self.args.shared.clone();
        if listed.len() > MAX_TOOLS {
            let why = format!("it lists {} tools, more than {MAX_TOOLS}", listed.len());
            return self.clear(why).await;
        }
        let mut seen = std::collections::HashSet::new();
        let mut wanted = Vec::new();
        for t in &listed {
            if !seen.insert(t.name.to_string()) {
                return self
                    .clear(format!("it lists the tool {:?} twice", t.name))
                    .await;
            }
            match McpTool::new(shared.clone() as Arc<dyn tool::Server>, t) {
                Ok(tool) => wanted.push(tool),
                Err(why) => return self.clear(why).await,
            }
        }
        let mut kept = Vec::new();
        for (tool, disposer) in shared.take_registered() {
            match wanted.iter().position(|w| w.same_as(&tool)) {
                Some(i) => {
                    wanted.remove(i);
                    kept.push((tool, disposer));
                }
                None => disposer.dispose().await,
            }
        }
        *lock(&shared.registered) = kept;
        for tool in wanted {
            let tool = Arc::new(tool);
            match self.args.tools.register(&self.args.ctx, tool.clone()) {
                Ok(d) => lock(&shared.registered).push((tool, d)),
                Err(e) => {
                    let why = format!("its tool {:?} cannot be registered: {e}", tool.raw());
                    return self.clear(why).await;
                }
            }
        }
        let order: Vec<&str> = listed.iter().map(|t| t.name.as_ref()).collect();
        let infos = {
            let mut registered = lock(&shared.registered);
            registered.sort_by_key(|(t, _)| order.iter().position(|n| *n == t.raw()));
            registered
                .iter()
                .map(|(t, _)| ToolInfo {
                    name: t.public_name().to_owned(),
                    raw: t.raw().to_owned(),
                })
                .collect()
        };
        shared.update(|s| s.tools = infos);
        Ok(())
    }

    /// Unregisters every tool of this server, for `why`.
    async fn clear(&mut self, why: String) -> Result<(), String> {
        tracing::error!(
            "MCP server {}: {why}; none of its tools are registered",
            self.spec().name
        );
        for (_, d) in self.args.shared.take_registered() {
            d.dispose().await;
        }
        self.args.shared.update(|s| s.tools.clear());
        Err(why)
    }
}

/// The most tools one server may list (each costs schema tokens in every
/// request).
const MAX_TOOLS: usize = 256;

/// The delay before the attempt after `failed` failed ones: the initial
/// delay doubled per failure, capped.
fn backoff(r: &super::ReconnectConfig, failed: u32) -> Duration {
    let ms = r
        .initial_delay_ms
        .saturating_mul(1u64 << failed.min(20))
        .min(r.max_delay_ms.max(r.initial_delay_ms));
    Duration::from_millis(ms)
}

impl tool::Server for Shared {
    fn spec(&self) -> &super::ServerSpec {
        &self.spec
    }

    fn peer(&self) -> Result<(Peer<RoleClient>, u32), String> {
        Shared::peer(self)
    }

    fn call_lost(&self, number: u32, why: String) {
        Shared::call_lost(self, number, why)
    }

    fn in_flight(&self) -> &std::sync::atomic::AtomicU32 {
        &self.in_flight
    }

    fn too_large(&self) -> watch::Receiver<u64> {
        self.too_large.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_doubles_up_to_its_ceiling() {
        let r = super::super::ReconnectConfig {
            enabled: true,
            initial_delay_ms: 500,
            max_delay_ms: 3000,
            max_attempts: 10,
        };
        let ms: Vec<u128> = (0..6).map(|n| backoff(&r, n).as_millis()).collect();
        assert_eq!(ms, [500, 1000, 2000, 3000, 3000, 3000]);
        assert_eq!(backoff(&r, u32::MAX).as_millis(), 3000);
    }
}
