//! The host: what a node that serves children runs. One actor, joined to
//! the `dsh.hosts` process group, answers [`Request`]s from parents on
//! other nodes.
//!
//! - `open` creates a child agent under a scope per (parent node, parent
//!   session), named `parent/<node>/<session>` in the host's subtree; the
//!   child's session is stored in this node's store, its header naming the
//!   parent (`parentSession`, `origin: "subagent"`, the depth). It gets at
//!   most the parent's policy and at most this node's, and this node's
//!   model route (the parent's route when this node has one of that name).
//! - `turn` runs one turn in a task child of the child's scope and answers
//!   when it ends; `cancel` cancels it.
//! - `close` disposes a child (its subtree in order) inside the host's
//!   handler, so closes sent in an order are carried out in that order;
//!   a scope left empty goes with its last child.
//! - `watch` answers what changed in the asking node's children's
//!   subtrees ([`super::mirror`]), so its tree can show them.
//! - While it holds fewer children than its maximum, the host is in the
//!   [`ROOM_GROUP`] process group too: parents place only on hosts there.
//! - When a parent node leaves, its scopes are disposed.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::{LlmRuntime, Message, TokenUsage};
use dsh_services::persistence::SessionPersistence;
use dsh_services::sandbox::Policy;
use dsh_services::session::EventData;
use dsh_services::tools::{Restriction, ToolRegistry};
use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, Fiber, Group, PluginOptions, TaskSpec, WorkerSpec};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::{Value, json};

use super::mirror::Watcher;
use super::wire::{
    self, Hello, HostMsg, Notice, OpenChild, Opened, Request, TreeView, TurnDone, WireError,
};
use super::{Cluster, ClusterError, HOSTS_GROUP, ROOM_GROUP, lock};
use crate::agent::{Agent, AgentSpec};

/// The longest label and persona a host takes.
const MAX_LABEL: usize = 200;
const MAX_PERSONA: usize = 64 << 10;

/// What this node gives the children it serves.
#[derive(Clone)]
pub struct HostSettings {
    /// How many children it holds at most.
    pub max_agents: u32,
    /// The model route and id children use by default.
    pub route: (String, String),
    /// The workspace their tools work in.
    pub cwd: PathBuf,
    /// Where their sessions are stored.
    pub store: Option<Arc<dyn SessionPersistence>>,
    /// The most this node lets a child do.
    pub policy: Policy,
    /// System text for children that bring no persona.
    pub system: Option<String>,
}

struct Child {
    agent: Agent,
    scope: (String, String),
    capture: Option<Arc<Mutex<Option<Value>>>>,
}

/// The children a host serves, and their scopes.
struct Hosted {
    name: String,
    settings: HostSettings,
    ctx: Context,
    children: Mutex<BTreeMap<String, Child>>,
    /// Ids being opened, with their scope (reserved until their child is
    /// in `children`: a scope with an open in flight is not dropped).
    opening: Mutex<BTreeMap<String, (String, String)>>,
    scopes: Mutex<BTreeMap<(String, String), Fiber>>,
    /// Parent nodes that left and did not come back: opens for them are
    /// refused, and an open that finishes after its node left is undone.
    left: Mutex<BTreeSet<String>>,
    /// What each parent node watching its children's subtrees is sent (a
    /// watch waits its turn behind the one before it).
    watchers: Mutex<HashMap<String, Arc<tokio::sync::Mutex<Watcher>>>>,
    /// The host actor, once started.
    me: std::sync::OnceLock<ractor::ActorCell>,
    /// Whether it is in [`ROOM_GROUP`] (taken before `children` and
    /// `opening`, and never inside another lock).
    roomy: Mutex<bool>,
    /// Whether a node of that name has a session with this one now.
    connected: Box<dyn Fn(&str) -> bool + Send + Sync>,
}

/// The most parent nodes watching one host at once.
const MAX_WATCHERS: usize = 256;

/// The largest answer a host sends (a child's final text, its result).
const MAX_ANSWER: usize = wire::MAX_REQUEST;

/// A reply port that answers `DROPPED` if it goes unanswered (a task that
/// could not start, or was aborted), so no caller waits out its timeout.
struct Reply(Option<RpcReplyPort<Vec<u8>>>);

impl Reply {
    fn send<T: serde::Serialize>(mut self, result: Result<T, WireError>) {
        let mut bytes = wire::answer(result);
        if bytes.len() > MAX_ANSWER {
            bytes = wire::answer::<()>(Err(WireError::new(
                "TOO_LARGE",
                format!(
                    "the answer is {} bytes; at most {MAX_ANSWER} are sent",
                    bytes.len()
                ),
            )));
        }
        if let Some(port) = self.0.take() {
            let _ = port.send(bytes);
        }
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        if let Some(port) = self.0.take() {
            let dropped = WireError::new("DROPPED", "the node dropped the request unanswered");
            let _ = port.send(wire::answer::<()>(Err(dropped)));
        }
    }
}

/// Starts this node's host under the cluster's context.
pub async fn serve(cluster: &Arc<Cluster>, settings: HostSettings) -> Result<(), ClusterError> {
    let hosted = Arc::new(Hosted {
        name: cluster.name().to_owned(),
        settings,
        ctx: cluster.context().clone(),
        children: Mutex::default(),
        opening: Mutex::default(),
        scopes: Mutex::default(),
        left: Mutex::default(),
        watchers: Mutex::default(),
        me: std::sync::OnceLock::new(),
        roomy: Mutex::new(false),
        connected: {
            // Weak: the cluster's callbacks hold this host.
            let shared = Arc::downgrade(&cluster.shared);
            Box::new(move |node| shared.upgrade().is_some_and(|s| s.is_connected(node)))
        },
    });
    let gone = hosted.clone();
    cluster.on_left(move |node| gone.node_left(node));
    let back = hosted.clone();
    cluster.on_joined(move |node| {
        lock(&back.left).remove(node);
    });
    cluster
        .context()
        .spawn(WorkerSpec::new(
            "node-host",
            format!("host/{}", cluster.name()),
            Host,
            hosted,
        ))
        .await
        .map_err(|e| ClusterError::Supervise(chain(&e).to_string()))?;
    Ok(())
}

struct Host;

impl Actor for Host {
    type Msg = HostMsg;
    type State = Arc<Hosted>;
    type Arguments = Arc<Hosted>;

    async fn pre_start(
        &self,
        me: ActorRef<HostMsg>,
        hosted: Arc<Hosted>,
    ) -> Result<Arc<Hosted>, ActorProcessingErr> {
        ractor::pg::join(HOSTS_GROUP.into(), vec![me.get_cell()]);
        let _ = hosted.me.set(me.get_cell());
        hosted.advertise();
        Ok(hosted)
    }

    async fn handle(
        &self,
        _me: ActorRef<HostMsg>,
        msg: HostMsg,
        hosted: &mut Arc<Hosted>,
    ) -> Result<(), ActorProcessingErr> {
        // The handler never waits: what takes time (creating a child, a
        // turn, a disposal) runs in a task child, so pings are answered at
        // once however busy the node is.
        match msg {
            HostMsg::Call { request, reply } => {
                let reply = Reply(Some(reply));
                match Request::parse(&request) {
                    Err(e) => reply.send(Err::<(), _>(e)),
                    Ok(Request::Hello {}) => reply.send(Ok(hosted.hello())),
                    Ok(Request::Tree {}) => reply.send(Ok(hosted.tree())),
                    Ok(Request::Open(open)) => {
                        let h = hosted.clone();
                        hosted.task("open", &open.child.clone(), async move {
                            reply.send(h.open(*open).await);
                        });
                    }
                    Ok(Request::Turn { child, prompt }) => hosted.turn(&child, prompt, reply),
                    Ok(Request::Watch { node, cursor }) => hosted.watch(node, cursor, reply),
                    Ok(Request::Close { child }) => {
                        let h = hosted.clone();
                        hosted.task("close", &child.clone(), async move {
                            reply.send(h.close(&child).await);
                        });
                    }
                }
            }
            HostMsg::Cast { notice } => match Notice::parse(&notice) {
                Err(e) => tracing::warn!("host: a notice was refused: {}", chain(&e)),
                Ok(Notice::Cancel { child }) => {
                    if let Some(agent) = hosted.agent(&child) {
                        agent.cancel();
                    }
                }
                Ok(Notice::Close { child }) => {
                    let h = hosted.clone();
                    hosted.task("close", &child.clone(), async move {
                        let _ = h.close(&child).await;
                    });
                }
            },
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        me: ActorRef<HostMsg>,
        _hosted: &mut Arc<Hosted>,
    ) -> Result<(), ActorProcessingErr> {
        ractor::pg::leave(HOSTS_GROUP.into(), vec![me.get_cell()]);
        ractor::pg::leave(ROOM_GROUP.into(), vec![me.get_cell()]);
        Ok(())
    }
}

impl Hosted {
    /// Runs `work` as a task child of the host's context (its reply, if
    /// any, answers `DROPPED` when the task cannot start).
    fn task(
        &self,
        kind: &'static str,
        child: &str,
        work: impl Future<Output = ()> + Send + 'static,
    ) {
        let spec = TaskSpec::new(kind, format!("{kind}/{}", crate::session::short(child)));
        if let Err(e) = self.ctx.spawn_task(spec, move |_stop| work) {
            tracing::warn!("host: cannot {kind} {child}: {}", chain(&e));
        }
    }

    /// Keeps the host in [`ROOM_GROUP`] exactly while it has room for a
    /// child (joined and left on the change only).
    fn advertise(&self) {
        let mut roomy = lock(&self.roomy);
        // One lock at a time (`open` holds `opening` while it takes
        // `children`).
        let children = lock(&self.children).len();
        let held = children + lock(&self.opening).len();
        let room = held < self.settings.max_agents as usize;
        if *roomy == room {
            return;
        }
        let Some(me) = self.me.get() else { return };
        if room {
            ractor::pg::join(ROOM_GROUP.into(), vec![me.clone()]);
        } else {
            ractor::pg::leave(ROOM_GROUP.into(), vec![me.clone()]);
        }
        *roomy = room;
    }

    fn hello(&self) -> Hello {
        Hello {
            node: self.name.clone(),
            max_agents: self.settings.max_agents,
            agents: lock(&self.children).len() as u32,
        }
    }

    fn tree(&self) -> TreeView {
        let tree = self.ctx.runtime().tree();
        let nodes = tree.snapshot();
        TreeView {
            node: self.name.clone(),
            text: dsh_supervisors::tree::render(&nodes),
            nodes: serde_json::to_value(&nodes).unwrap_or_default(),
            stopped: serde_json::to_value(tree.stopped_nodes()).unwrap_or_default(),
        }
    }

    /// Answers `node`'s watch of its children's subtrees in a task child
    /// (it may wait for a change).
    fn watch(&self, node: String, cursor: Option<u64>, reply: Reply) {
        if let Err(e) = super::valid_name(&node) {
            return reply.send(Err::<(), _>(WireError::new(
                "BAD_REQUEST",
                chain(&e).to_string(),
            )));
        }
        // Only a node connected now, by the name it proved (a watcher
        // follows the whole tree feed: none for names made up).
        if !(self.connected)(&node) || lock(&self.left).contains(&node) {
            return reply.send(Err::<(), _>(WireError::new(
                "NOT_CONNECTED",
                format!("node `{node}` has no session with this node"),
            )));
        }
        let tree = self.ctx.runtime().tree().clone();
        let watcher = {
            let mut watchers = lock(&self.watchers);
            if !watchers.contains_key(&node) && watchers.len() >= MAX_WATCHERS {
                return reply.send(Err::<(), _>(WireError::new(
                    "BUSY",
                    format!("{MAX_WATCHERS} nodes watch this node already"),
                )));
            }
            watchers
                .entry(node.clone())
                .or_insert_with(|| Arc::new(tokio::sync::Mutex::new(Watcher::new(&tree, &node))))
                .clone()
        };
        let spec = TaskSpec::new("watch", format!("watch/{node}"));
        let started = self.ctx.spawn_task(spec, move |stop| async move {
            // The watch before it ends within its hold.
            let wait = wire::WATCH_HOLD + Duration::from_secs(5);
            let mut watcher = tokio::select! {
                w = tokio::time::timeout(wait, watcher.lock()) => match w {
                    Ok(w) => w,
                    Err(_) => return reply.send(Err::<(), _>(WireError::new(
                        "BUSY",
                        "another watch of this node is still being answered",
                    ))),
                },
                () = stop.cancelled() => return,
            };
            let changes = watcher.next(&tree, cursor, &stop).await;
            reply.send(Ok(changes));
        });
        if let Err(e) = started {
            tracing::warn!("host: a watch could not start: {}", chain(&e));
        }
    }

    fn agent(&self, child: &str) -> Option<Agent> {
        lock(&self.children).get(child).map(|c| c.agent.clone())
    }

    async fn open(&self, open: OpenChild) -> Result<Opened, WireError> {
        let bad = |m: String| WireError::new("BAD_REQUEST", m);
        super::valid_name(&open.parent_node).map_err(|e| bad(chain(&e).to_string()))?;
        let id_ok = !open.child.is_empty()
            && open.child.len() <= 64
            && open
                .child
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !id_ok {
            return Err(bad(
                "`child` must be an id (1 to 64 letters, digits or `-`)".into(),
            ));
        }
        if lock(&self.left).contains(&open.parent_node) {
            return Err(WireError::new(
                "NODE_LEFT",
                format!("node `{}` left this node", open.parent_node),
            ));
        }
        let id = open.child.clone();
        let key = (open.parent_node.clone(), open.parent.clone());
        {
            // Scopes first, as everywhere: a scope is dropped under this
            // lock only when nothing uses or is opening in it.
            let _scopes = lock(&self.scopes);
            let mut opening = lock(&self.opening);
            if lock(&self.children).contains_key(&id) || opening.contains_key(&id) {
                return Err(bad(format!("a child `{id}` exists on this node")));
            }
            opening.insert(id.clone(), key);
        }
        self.advertise();
        let made = self.make(open).await;
        lock(&self.opening).remove(&id);
        self.advertise();
        made
    }

    async fn make(&self, open: OpenChild) -> Result<Opened, WireError> {
        let bad = |m: String| WireError::new("BAD_REQUEST", m);
        if open.parent.is_empty() || open.parent.len() > 128 {
            return Err(bad("`parent` must be a session id (1 to 128 bytes)".into()));
        }
        if open.label.as_ref().is_some_and(|l| l.len() > MAX_LABEL) {
            return Err(bad(format!("`label` is longer than {MAX_LABEL} bytes")));
        }
        if open.persona.as_ref().is_some_and(|p| p.len() > MAX_PERSONA) {
            return Err(bad(format!("`persona` is longer than {MAX_PERSONA} bytes")));
        }
        if let Some(s) = &open.output_schema
            && s.get("type").and_then(Value::as_str) != Some("object")
        {
            return Err(bad("`outputSchema` must be an object schema".into()));
        }
        // One lock at a time (two are only ever held under `scopes`).
        let children = lock(&self.children).len();
        let held = children + lock(&self.opening).len() - 1;
        if held >= self.settings.max_agents as usize {
            return Err(WireError::new(
                "NODE_FULL",
                format!(
                    "node `{}` holds its maximum of {} children",
                    self.name, self.settings.max_agents
                ),
            ));
        }
        let key = (open.parent_node.clone(), open.parent.clone());
        let scope = self.scope(&key).await?;
        let (provider, model) = self.route(open.route.as_ref());
        let mut spec = AgentSpec::new(&provider, &model, self.settings.cwd.clone());
        let id = open.child.clone();
        spec.id = Some(id.clone());
        // A child never asks this node's human: what needs approval is
        // refused, unless the parent's policy allows everything.
        let approval = match open.approval {
            ApprovalPolicy::Always => ApprovalPolicy::Always,
            _ => ApprovalPolicy::Never,
        };
        spec.approval = Some(Arc::new(Approval::new(approval)));
        spec.name = Some(format!("subagent/{}", crate::session::short(&id)));
        spec.system = open
            .persona
            .clone()
            .or_else(|| self.settings.system.clone());
        spec.store = self.settings.store.clone();
        spec.depth = open.depth;
        spec.parent_session = Some(open.parent.clone());
        spec.origin = Some("subagent".into());
        spec.flat_scope = true;
        let policy = self.settings.policy.narrowed(Some(open.policy));
        spec.permission = Some(policy);
        spec.restriction = match (&open.allow, open.deny.is_empty()) {
            (None, true) => None,
            (allow, _) => Some(Restriction {
                allow: allow.clone().map(|mut a| {
                    if open.output_schema.is_some() {
                        a.push(crate::subagent::REPORT.into());
                    }
                    a
                }),
                deny: open.deny.clone(),
            }),
        };
        spec.opening = vec![
            EventData::Other {
                kind: Arc::from("approval/policy"),
                data: Arc::new(json!({"policy": approval, "source": "delegation"})),
            },
            EventData::Other {
                kind: Arc::from("sandbox/mode"),
                data: Arc::new(
                    json!({"mode": policy.mode, "network": policy.network, "source": "delegation"}),
                ),
            },
            EventData::Other {
                kind: Arc::from("subagent/descriptor"),
                data: Arc::new(json!({
                    "version": 2,
                    "mode": "remote",
                    "provider": "remote",
                    "label": open.label,
                    "node": self.name,
                    "parentNode": open.parent_node,
                })),
            },
        ];
        let agent = Agent::create(&scope.context(), spec)
            .await
            .map_err(|e| WireError::new("START_FAILED", chain(&e).to_string()))?;
        let capture = match &open.output_schema {
            None => None,
            Some(schema) => {
                let slot = Arc::new(Mutex::new(None));
                let registered =
                    agent
                        .context()
                        .map_err(|e| chain(&e).to_string())
                        .and_then(|ctx| {
                            let tools = ctx
                                .get::<ToolRegistry>(ToolRegistry::SERVICE)
                                .ok_or("no tool registry")?;
                            tools
                                .register(
                                    &ctx,
                                    crate::subagent::report_tool(schema.clone(), slot.clone()),
                                )
                                .map_err(|e| chain(&e).to_string())
                        });
                if let Err(e) = registered {
                    agent.dispose().await;
                    self.drop_scope_if_empty(&key).await;
                    return Err(WireError::new("START_FAILED", e));
                }
                Some(slot)
            }
        };
        // Its parent's node may have left while it was made.
        if lock(&self.left).contains(&key.0) {
            agent.dispose().await;
            self.drop_scope_if_empty(&key).await;
            return Err(WireError::new(
                "NODE_LEFT",
                format!("node `{}` left", key.0),
            ));
        }
        lock(&self.children).insert(
            id.clone(),
            Child {
                agent,
                scope: key,
                capture,
            },
        );
        Ok(Opened { child: id })
    }

    /// The parent's route when this node has it, else the node's.
    fn route(&self, asked: Option<&(String, String)>) -> (String, String) {
        let has = |route: &str| {
            self.ctx
                .get::<LlmRuntime>(LlmRuntime::SERVICE)
                .is_some_and(|llm| llm.providers().iter().any(|p| p == route))
        };
        match asked {
            Some((route, model)) if has(route) => (route.clone(), model.clone()),
            _ => self.settings.route.clone(),
        }
    }

    async fn scope(&self, key: &(String, String)) -> Result<Fiber, WireError> {
        if let Some(f) = lock(&self.scopes)
            .get(key)
            .filter(|f| !f.status().is_terminal())
        {
            return Ok(f.clone());
        }
        let options = PluginOptions {
            name: Some(format!(
                "parent/{}/{}",
                key.0,
                crate::session::short(&key.1)
            )),
            ..PluginOptions::default()
        };
        let fiber = self
            .ctx
            .plugin_with(Group, (), options)
            .await
            .map_err(|e| WireError::new("START_FAILED", chain(&e).to_string()))?;
        // Two opens for one parent may race here: the first live scope stays.
        let kept = {
            let mut scopes = lock(&self.scopes);
            match scopes.get(key) {
                Some(f) if !f.status().is_terminal() => f.clone(),
                _ => {
                    scopes.insert(key.clone(), fiber.clone());
                    fiber.clone()
                }
            }
        };
        if kept.id() != fiber.id() {
            fiber.dispose().await;
        }
        Ok(kept)
    }

    fn turn(self: &Arc<Self>, child: &str, prompt: String, reply: Reply) {
        let found = lock(&self.children)
            .get(child)
            .map(|c| (c.agent.clone(), c.capture.clone(), c.scope.clone()));
        let Some((agent, capture, key)) = found else {
            return reply.send(Err::<(), _>(not_found(child)));
        };
        let Some(scope) = lock(&self.scopes).get(&key).map(Fiber::context) else {
            return reply.send(Err::<(), _>(not_found(child)));
        };
        let spec = TaskSpec::new(
            "remote-turn",
            format!("turn/{}", crate::session::short(child)),
        );
        let started = scope.spawn_task(spec, move |stop| async move {
            reply.send(run_turn(&agent, prompt, capture.as_ref(), stop).await);
        });
        if let Err(e) = started {
            tracing::warn!("host: a turn could not start: {}", chain(&e));
        }
    }

    async fn close(&self, child: &str) -> Result<(), WireError> {
        let Some(c) = lock(&self.children).remove(child) else {
            return Err(not_found(child));
        };
        self.advertise();
        c.agent.dispose().await;
        self.drop_scope_if_empty(&c.scope).await;
        Ok(())
    }

    async fn drop_scope_if_empty(&self, key: &(String, String)) {
        let fiber = {
            let mut scopes = lock(&self.scopes);
            let used = lock(&self.children).values().any(|c| &c.scope == key)
                || lock(&self.opening).values().any(|k| k == key);
            if used {
                return;
            }
            scopes.remove(key)
        };
        if let Some(f) = fiber {
            f.dispose().await;
        }
    }

    /// A parent node left: its children go, scope by scope (each in
    /// reverse start order), in a task of the host's context.
    fn node_left(self: &Arc<Self>, node: &str) {
        lock(&self.left).insert(node.to_owned());
        lock(&self.watchers).remove(node);
        let scopes: Vec<Fiber> = {
            let mut s = lock(&self.scopes);
            let keys: Vec<_> = s.keys().filter(|k| k.0 == node).cloned().collect();
            keys.iter().filter_map(|k| s.remove(k)).collect()
        };
        if scopes.is_empty() {
            return;
        }
        lock(&self.children).retain(|_, c| c.scope.0 != node);
        self.advertise();
        tracing::warn!(
            "host: node `{node}` left; disposing its {} scope(s)",
            scopes.len()
        );
        let spec = TaskSpec::new("cleanup", format!("left/{node}"));
        let started = self.ctx.spawn_task(spec, move |_stop| async move {
            for f in scopes.into_iter().rev() {
                f.dispose().await;
            }
        });
        if let Err(e) = started {
            tracing::warn!(
                "host: cannot dispose the children of `{node}`: {}",
                chain(&e)
            );
        }
    }
}

fn add(sum: &mut TokenUsage, u: &TokenUsage) {
    let opt = |a: Option<u64>, b: Option<u64>| match (a, b) {
        (None, None) => None,
        (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
    };
    sum.input_tokens += u.input_tokens;
    sum.output_tokens += u.output_tokens;
    sum.cache_read_tokens = opt(sum.cache_read_tokens, u.cache_read_tokens);
    sum.cache_write_tokens = opt(sum.cache_write_tokens, u.cache_write_tokens);
    sum.reasoning_tokens = opt(sum.reasoning_tokens, u.reasoning_tokens);
}

fn not_found(child: &str) -> WireError {
    WireError::new("NOT_FOUND", format!("no child `{child}` on this node"))
}

async fn run_turn(
    agent: &Agent,
    prompt: String,
    capture: Option<&Arc<Mutex<Option<Value>>>>,
    stop: tokio_util::sync::CancellationToken,
) -> Result<TurnDone, WireError> {
    let before = agent.last_turn().map(|t| t.turn);
    agent
        .followup(Message::user_text(prompt))
        .map_err(|e| WireError::new("TURN_REFUSED", chain(&e).to_string()))?;
    let waited = tokio::select! {
        r = agent.when_idle(Duration::MAX) => r,
        () = stop.cancelled() => {
            agent.cancel();
            agent.when_idle(Duration::from_secs(30)).await
        }
    };
    waited.map_err(|e| WireError::new("TURN_FAILED", chain(&e).to_string()))?;
    let summary = agent
        .last_turn()
        .filter(|t| Some(t.turn) != before)
        .ok_or_else(|| WireError::new("TURN_FAILED", "the child ran no turn"))?;
    let structured = capture.and_then(|slot| lock(slot).take());
    // What the turn's model calls spent, for the parent's accounting.
    let usage = agent.session().with_log(|log| {
        let mut sum = TokenUsage::default();
        for e in log.without_chunks() {
            if let EventData::AssistantMessage {
                turn,
                usage: Some(u),
                ..
            } = &e.data
                && *turn == summary.turn
            {
                add(&mut sum, u);
            }
        }
        sum
    });
    Ok(TurnDone {
        text: summary.text,
        reason: summary.reason,
        usage,
        structured,
    })
}
