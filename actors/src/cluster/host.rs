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
//! - When a parent node leaves, its scopes are disposed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_services::llm::{LlmRuntime, Message, TokenUsage};
use dsh_services::persistence::SessionPersistence;
use dsh_services::sandbox::Policy;
use dsh_services::session::EventData;
use dsh_services::tools::{Restriction, ToolRegistry};
use dsh_supervisors::{Context, Fiber, Group, PluginOptions, TaskSpec, WorkerSpec};
use ractor::{Actor, ActorProcessingErr, ActorRef, RpcReplyPort};
use serde_json::{Value, json};

use super::wire::{self, Hello, HostMsg, Notice, OpenChild, Opened, Request, TurnDone, WireError};
use super::{Cluster, ClusterError, HOSTS_GROUP, lock};
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
    scopes: Mutex<BTreeMap<(String, String), Fiber>>,
}

/// Starts this node's host under the cluster's context.
pub async fn serve(cluster: &Arc<Cluster>, settings: HostSettings) -> Result<(), ClusterError> {
    let hosted = Arc::new(Hosted {
        name: cluster.name().to_owned(),
        settings,
        ctx: cluster.context().clone(),
        children: Mutex::default(),
        scopes: Mutex::default(),
    });
    let gone = hosted.clone();
    cluster.on_left(move |node| gone.node_left(node));
    cluster
        .context()
        .spawn(WorkerSpec::new(
            "node-host",
            format!("host/{}", cluster.name()),
            Host,
            hosted,
        ))
        .await
        .map_err(|e| ClusterError::Supervise(e.to_string()))?;
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
        Ok(hosted)
    }

    async fn handle(
        &self,
        _me: ActorRef<HostMsg>,
        msg: HostMsg,
        hosted: &mut Arc<Hosted>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            HostMsg::Call { request, reply } => match Request::parse(&request) {
                Err(e) => send(reply, Err::<(), _>(e)),
                Ok(Request::Hello {}) => send(reply, Ok(hosted.hello())),
                Ok(Request::Open(open)) => send(reply, hosted.open(*open).await),
                Ok(Request::Turn { child, prompt }) => hosted.turn(&child, prompt, reply),
                Ok(Request::Close { child }) => send(reply, hosted.close(&child).await),
            },
            HostMsg::Cast { notice } => match Notice::parse(&notice) {
                Err(e) => tracing::warn!("host: a notice was refused: {e}"),
                Ok(Notice::Cancel { child }) => {
                    if let Some(agent) = hosted.agent(&child) {
                        agent.cancel();
                    }
                }
                Ok(Notice::Close { child }) => {
                    let _ = hosted.close(&child).await;
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
        Ok(())
    }
}

fn send<T: serde::Serialize>(reply: RpcReplyPort<Vec<u8>>, result: Result<T, WireError>) {
    let _ = reply.send(wire::answer(result));
}

impl Hosted {
    fn hello(&self) -> Hello {
        Hello {
            node: self.name.clone(),
            max_agents: self.settings.max_agents,
            agents: lock(&self.children).len() as u32,
        }
    }

    fn agent(&self, child: &str) -> Option<Agent> {
        lock(&self.children).get(child).map(|c| c.agent.clone())
    }

    async fn open(&self, open: OpenChild) -> Result<Opened, WireError> {
        let bad = |m: String| WireError::new("BAD_REQUEST", m);
        super::valid_name(&open.parent_node).map_err(|e| bad(e.to_string()))?;
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
        if lock(&self.children).len() >= self.settings.max_agents as usize {
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
        let id = Message::new_id();
        spec.id = Some(id.clone());
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
            .map_err(|e| WireError::new("START_FAILED", e.to_string()))?;
        let capture = match &open.output_schema {
            None => None,
            Some(schema) => {
                let slot = Arc::new(Mutex::new(None));
                let registered = agent.context().map_err(|e| e.to_string()).and_then(|ctx| {
                    let tools = ctx
                        .get::<ToolRegistry>(ToolRegistry::SERVICE)
                        .ok_or("no tool registry")?;
                    tools
                        .register(
                            &ctx,
                            crate::subagent::report_tool(schema.clone(), slot.clone()),
                        )
                        .map_err(|e| e.to_string())
                });
                if let Err(e) = registered {
                    agent.dispose().await;
                    self.drop_scope_if_empty(&key).await;
                    return Err(WireError::new("START_FAILED", e));
                }
                Some(slot)
            }
        };
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
        if let Some(f) = lock(&self.scopes).get(key) {
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
            .map_err(|e| WireError::new("START_FAILED", e.to_string()))?;
        // Two opens for one parent may race here: the first scope stays.
        let kept = lock(&self.scopes)
            .entry(key.clone())
            .or_insert(fiber.clone())
            .clone();
        if kept.id() != fiber.id() {
            fiber.dispose().await;
        }
        Ok(kept)
    }

    fn turn(self: &Arc<Self>, child: &str, prompt: String, reply: RpcReplyPort<Vec<u8>>) {
        let found = lock(&self.children)
            .get(child)
            .map(|c| (c.agent.clone(), c.capture.clone(), c.scope.clone()));
        let Some((agent, capture, key)) = found else {
            return send(reply, Err::<(), _>(not_found(child)));
        };
        let Some(scope) = lock(&self.scopes).get(&key).map(Fiber::context) else {
            return send(reply, Err::<(), _>(not_found(child)));
        };
        let spec = TaskSpec::new(
            "remote-turn",
            format!("turn/{}", crate::session::short(child)),
        );
        let started = scope.spawn_task(spec, move |stop| async move {
            send(
                reply,
                run_turn(&agent, prompt, capture.as_ref(), stop).await,
            );
        });
        if let Err(e) = started {
            tracing::warn!("host: a turn could not start: {e}");
        }
    }

    async fn close(&self, child: &str) -> Result<(), WireError> {
        let Some(c) = lock(&self.children).remove(child) else {
            return Err(not_found(child));
        };
        c.agent.dispose().await;
        self.drop_scope_if_empty(&c.scope).await;
        Ok(())
    }

    async fn drop_scope_if_empty(&self, key: &(String, String)) {
        let used = lock(&self.children).values().any(|c| &c.scope == key);
        if used {
            return;
        }
        let fiber = lock(&self.scopes).remove(key);
        if let Some(f) = fiber {
            f.dispose().await;
        }
    }

    /// A parent node left: its children go, scope by scope (each in
    /// reverse start order), in a task of the host's context.
    fn node_left(self: &Arc<Self>, node: &str) {
        let scopes: Vec<Fiber> = {
            let mut s = lock(&self.scopes);
            let keys: Vec<_> = s.keys().filter(|k| k.0 == node).cloned().collect();
            keys.iter().filter_map(|k| s.remove(k)).collect()
        };
        if scopes.is_empty() {
            return;
        }
        lock(&self.children).retain(|_, c| c.scope.0 != node);
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
            tracing::warn!("host: cannot dispose the children of `{node}`: {e}");
        }
    }
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
        .map_err(|e| WireError::new("TURN_REFUSED", e.to_string()))?;
    let waited = tokio::select! {
        r = agent.when_idle(Duration::MAX) => r,
        () = stop.cancelled() => {
            agent.cancel();
            agent.when_idle(Duration::from_secs(30)).await
        }
    };
    waited.map_err(|e| WireError::new("TURN_FAILED", e.to_string()))?;
    let summary = agent
        .last_turn()
        .filter(|t| Some(t.turn) != before)
        .ok_or_else(|| WireError::new("TURN_FAILED", "the child ran no turn"))?;
    let structured = capture.and_then(|slot| lock(slot).take());
    Ok(TurnDone {
        text: summary.text,
        reason: summary.reason,
        usage: TokenUsage::default(),
        structured,
    })
}
