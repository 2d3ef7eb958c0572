//! Nodes: dsh processes joined with `ractor_cluster` (node sessions
//! authenticated by a shared cookie, process groups synchronised between
//! them), so a parent on one node can run child agents on another.
//!
//! - [`Cluster`] (service `cluster`): this process's node. It supervises a
//!   `NodeServer` (listening or client-only), watches the peers' sessions
//!   and the `dsh.hosts` process group, and pings every known host; a host
//!   that stops answering, or whose session closes, is *lost*: its
//!   in-flight calls fail at once with [`NODE_DOWN`].
//! - [`host`]: a node that serves children runs one host actor, the only
//!   actor whose messages cross the wire ([`wire::HostMsg`], JSON
//!   payloads parsed once, at the host). Children live under a scope per
//!   (parent node, parent session), in the host's subtree.
//! - [`remote`]: the `remote` subagent provider. The child runs on the
//!   placed node; the parent's tree holds a proxy agent whose model route
//!   relays each turn to it, so result, cancel, dispose and continuable
//!   `send` work as for a local child.
//!
//! Invariant: nothing here trusts a peer's bytes (see [`wire`]); a peer is
//! trusted only after the cookie challenge, and even then a child never
//! gets more than its parent's policy nor more than the serving node's.

pub mod host;
mod mirror;
pub mod remote;
pub mod tls;
pub mod wire;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, TaskSpec, WorkerRef, WorkerSpec};
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use ractor_cluster::node::NodeServerSessionInformation;
use ractor_cluster::{NodeEventSubscription, NodeServer, NodeServerMessage};
use ractor_cluster::{client_connect, client_connect_enc};
use tokio_util::sync::CancellationToken;

use self::wire::{Hello, HostMsg, Request, WireError};

/// The process group every serving host joins.
pub const HOSTS_GROUP: &str = "dsh.hosts";

/// The process group a host is in while it has room for another child (it
/// leaves it when full and joins again when a child goes): its free slots,
/// as every node sees them without asking.
pub const ROOM_GROUP: &str = "dsh.hosts.room";

/// The failure code of a child whose node died or cannot be reached.
pub const NODE_DOWN: &str = "NODE_DOWN";

/// How often each known host is pinged, and how long a ping may take.
const PING_EVERY: Duration = Duration::from_secs(1);
const PING_TIMEOUT: Duration = Duration::from_secs(3);
/// Missed pings in a row after which a host is lost. A ping that times out
/// while other answers from that host arrived is no miss: a busy node (a
/// thousand children on two cores) answers late, and is not lost.
const PING_MISSES: u32 = 3;

/// Milliseconds since the first call of this process (for "heard since").
fn now_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A peer named on the command line: `NAME@HOST:PORT`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// The node's name.
    pub name: String,
    /// Where it listens.
    pub addr: String,
}

impl FromStr for Peer {
    type Err = String;

    fn from_str(s: &str) -> Result<Peer, String> {
        let (name, addr) = s
            .split_once('@')
            .ok_or_else(|| format!("`{s}` is not NAME@HOST:PORT (no `@`)"))?;
        valid_name(name).map_err(|e| format!("`{s}`: {}", chain(&e)))?;
        let port = addr
            .rsplit_once(':')
            .map(|(_, p)| p)
            .ok_or_else(|| format!("`{s}`: `{addr}` has no port (HOST:PORT)"))?;
        port.parse::<u16>()
            .map_err(|_| format!("`{s}`: `{port}` is not a port number"))?;
        Ok(Peer {
            name: name.into(),
            addr: addr.into(),
        })
    }
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name, self.addr)
    }
}

/// A name that is not a node name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a node name (1 to 64 letters, digits, `_`, `.` or `-`)")]
pub struct BadName(pub String);

/// A node name: 1 to 64 of `[A-Za-z0-9_.-]`.
pub fn valid_name(name: &str) -> Result<(), BadName> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if ok {
        Ok(())
    } else {
        Err(BadName(name.to_owned()))
    }
}

/// Why the cluster could not start or reach a peer.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The node server could not start (the address is taken, ...).
    #[error("node `{name}` cannot listen on {addr}: {why}")]
    Listen {
        /// This node.
        name: String,
        /// The address.
        addr: String,
        /// What failed.
        why: String,
    },
    /// A peer could not be reached, or refused us.
    #[error("cannot join {peer}: {why}")]
    Connect {
        /// The peer.
        peer: String,
        /// What failed.
        why: String,
    },
    /// The cluster's parts could not be supervised.
    #[error("the cluster cannot start: {0}")]
    Supervise(String),
}

/// How this node joins the cluster.
#[derive(Clone, Debug)]
pub struct ClusterSettings {
    /// This node's name.
    pub name: String,
    /// The shared secret (read from the environment by the caller).
    pub cookie: String,
    /// Where to accept peers (`None`: a client-only node, on a loopback
    /// port nobody is told of).
    pub listen: Option<SocketAddr>,
    /// TLS: with a certificate, peers are accepted over TLS only; with a
    /// trust anchor, peers are dialled over TLS (`None`: plain TCP).
    pub tls: Option<tls::Tls>,
}

/// A host on another node, as this node knows it.
pub struct RemoteHost {
    node: String,
    actor: ActorRef<HostMsg>,
    max_agents: u32,
    agents: AtomicU32,
    misses: AtomicU32,
    /// When an answer from it last arrived ([`now_ms`]).
    heard: std::sync::atomic::AtomicU64,
    lost: CancellationToken,
    /// Its children's subtrees, as this node's tree shows them.
    mirror: mirror::Mirror,
}

impl RemoteHost {
    fn new(node: String, actor: ActorRef<HostMsg>, max_agents: u32, agents: u32) -> RemoteHost {
        RemoteHost {
            actor,
            max_agents,
            agents: AtomicU32::new(agents),
            misses: AtomicU32::new(0),
            heard: std::sync::atomic::AtomicU64::new(now_ms()),
            lost: CancellationToken::new(),
            mirror: mirror::Mirror::new(&node),
            node,
        }
    }

    /// The node's name.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Children it holds, as of the last ping.
    pub fn load(&self) -> u32 {
        self.agents.load(Ordering::Relaxed)
    }

    /// Room left, as of the last ping.
    pub fn free(&self) -> u32 {
        self.max_agents.saturating_sub(self.load())
    }

    /// Whether it advertises room for a child ([`ROOM_GROUP`]).
    pub fn has_room(&self) -> bool {
        let id = self.actor.get_id();
        ractor::pg::get_members(&ROOM_GROUP.to_owned())
            .iter()
            .any(|c| c.get_id() == id)
    }

    /// Counts a child opened there (until the next ping says how many).
    pub fn opened(&self) {
        self.agents.fetch_add(1, Ordering::Relaxed);
    }

    /// Fires when the host is lost (its session closed or it stopped
    /// answering pings).
    pub fn lost(&self) -> &CancellationToken {
        &self.lost
    }

    /// Sends `request` and reads the answer, within `timeout`; a lost
    /// host, a closed session or no answer in time is [`NODE_DOWN`].
    pub async fn call<T: serde::de::DeserializeOwned>(
        &self,
        request: &Request,
        timeout: Duration,
    ) -> Result<T, WireError> {
        let down = |why: &str| WireError::new(NODE_DOWN, format!("node `{}` {why}", self.node));
        if self.lost.is_cancelled() {
            return Err(down("is down"));
        }
        let request = request.encode();
        if request.len() > wire::MAX_REQUEST {
            // Sent, it would be refused there, or drop the whole session
            // past the transport's frame limit.
            return Err(WireError::new(
                "BAD_REQUEST",
                format!(
                    "the request to node `{}` is {} bytes; at most {} are sent",
                    self.node,
                    request.len(),
                    wire::MAX_REQUEST
                ),
            ));
        }
        let (tx, rx) = ractor::concurrency::oneshot();
        let msg = HostMsg::Call {
            request,
            reply: (tx, timeout).into(),
        };
        if self.actor.send_message(msg).is_err() {
            return Err(down("is unreachable (its session is closed)"));
        }
        let bytes = tokio::select! {
            r = tokio::time::timeout(timeout, rx) => match r {
                Ok(Ok(bytes)) => {
                    self.heard.store(now_ms(), Ordering::Relaxed);
                    bytes
                }
                Ok(Err(_)) => return Err(down("closed the connection mid-call")),
                Err(_) => return Err(down(&format!("did not answer within {timeout:?}"))),
            },
            () = self.lost.cancelled() => return Err(down("is down")),
        };
        wire::read_answer(&bytes)
    }

    /// Sends a notice (best effort).
    pub fn notify(&self, notice: &wire::Notice) {
        let _ = self.actor.send_message(HostMsg::Cast {
            notice: notice.encode(),
        });
    }
}

/// Told the name of a peer node that left.
type OnLeft = Box<dyn Fn(&str) + Send + Sync>;

/// A node session, as its events said.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Session {
    /// Authenticated and done with its state exchange: the peer's name
    /// (as it said it in the challenge it passed) and its node id here.
    Ready { name: String, node_id: u64 },
    /// Closed; a close before ready is a refusal.
    Closed,
}

/// The most closed sessions remembered (their entries only tell a waiting
/// `connect` that it was refused).
const CLOSED_KEPT: usize = 256;

/// What the cluster's parts share.
struct Shared {
    name: String,
    hosts: Mutex<BTreeMap<String, Arc<RemoteHost>>>,
    /// Node sessions by peer address.
    sessions: Mutex<BTreeMap<String, Session>>,
    /// Host cells seen in the group before their session was ready.
    pending: Mutex<Vec<ActorCell>>,
    /// Hosts lost to pings while their session stays up: pinged again,
    /// and known again once they answer.
    suspects: Mutex<Vec<Arc<RemoteHost>>>,
    /// Bumped on every change of the hosts or the sessions.
    changed: tokio::sync::watch::Sender<u64>,
    /// Told when a peer node leaves (the host disposes its children).
    left: Mutex<Vec<OnLeft>>,
    /// Told when a peer node's session is ready (it may place again).
    joined: Mutex<Vec<OnLeft>>,
}

impl Shared {
    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// The node's session closed: its host is lost and, as a parent, its
    /// children elsewhere go.
    fn lose(&self, node: &str, why: &str) {
        let gone = lock(&self.hosts).remove(node);
        if let Some(h) = gone {
            tracing::warn!("cluster: node `{node}` is lost: {why}");
            h.lost.cancel();
        }
        lock(&self.suspects).retain(|h| h.node != node);
        for f in lock(&self.left).iter() {
            f(node);
        }
        self.bump();
    }

    /// The host stopped answering while its session is up: in-flight calls
    /// fail now, and it is pinged on as a suspect.
    fn suspect(&self, host: &Arc<RemoteHost>, why: &str) {
        let gone = {
            let mut hosts = lock(&self.hosts);
            match hosts.get(&host.node) {
                Some(h) if Arc::ptr_eq(h, host) => hosts.remove(&host.node),
                _ => None,
            }
        };
        if let Some(h) = gone {
            tracing::warn!("cluster: node `{}` is lost: {why}", h.node);
            h.lost.cancel();
            lock(&self.suspects).push(h);
            self.bump();
        }
    }

    /// Whether a peer named `node` has a ready session with this node.
    fn is_connected(&self, node: &str) -> bool {
        lock(&self.sessions)
            .values()
            .any(|s| matches!(s, Session::Ready { name, .. } if name == node))
    }

    /// The name of the ready session of `node_id`, if any.
    fn ready_name(&self, node_id: u64) -> Option<String> {
        lock(&self.sessions).values().find_map(|s| match s {
            Session::Ready { name, node_id: id } if *id == node_id => Some(name.clone()),
            _ => None,
        })
    }
}

/// This process's node (service [`Cluster::SERVICE`]).
pub struct Cluster {
    shared: Arc<Shared>,
    server: WorkerRef<NodeServerMessage>,
    listen: Option<SocketAddr>,
    tls: Option<tls::Tls>,
    ctx: Context,
    next: AtomicU32,
}

impl Cluster {
    /// The capability name.
    pub const SERVICE: &'static str = "cluster";

    /// Starts the node under `ctx`'s fiber: the node server, the watcher
    /// of peers and hosts, and the heartbeat. Listening, it is accepting
    /// peers when this returns.
    pub async fn start(
        ctx: &Context,
        settings: ClusterSettings,
    ) -> Result<Arc<Cluster>, ClusterError> {
        valid_name(&settings.name).map_err(|e| ClusterError::Supervise(chain(&e).to_string()))?;
        let cannot = |addr: String, why: String| ClusterError::Listen {
            name: settings.name.clone(),
            addr,
            why,
        };
        let tls = settings.tls.clone();
        // A TLS node accepts on its own listener (see `tls`).
        let front = match (&tls, settings.listen) {
            (Some(t), Some(a)) if t.accepts() => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .map_err(|e| cannot(a.to_string(), chain(&e).to_string()))?,
            ),
            _ => None,
        };
        let listen = match (&front, settings.listen) {
            (Some(l), _) => Some(
                l.local_addr()
                    .map_err(|e| cannot("?".into(), chain(&e).to_string()))?,
            ),
            (None, Some(a)) if a.port() == 0 => {
                Some(free_port(a).map_err(|why| cannot(a.to_string(), why))?)
            }
            (None, other) => other,
        };
        // A client-only node, and the node server behind a TLS listener,
        // still run a listener (ractor_cluster has no other mode): a free
        // loopback port never announced.
        let bind = match (listen, &front) {
            (Some(a), None) => a,
            _ => free_port(SocketAddr::from(([127, 0, 0, 1], 0)))
                .map_err(|why| cannot("127.0.0.1:0".into(), why))?,
        };
        // Over TLS, peers are only the ones dialled: a peer's peers are
        // known by that hidden port, and would be dialled in plain TCP.
        let mode = tls
            .as_ref()
            .map(|_| ractor_cluster::node::NodeConnectionMode::Isolated);
        let server = NodeServer::new(
            bind.port(),
            settings.cookie.clone(),
            settings.name.clone(),
            bind.ip().to_string(),
            None,
            mode,
        )
        .with_listen_addr(bind.ip());
        let server = ctx
            .spawn(WorkerSpec::new(
                "node-server",
                format!("node/{}", settings.name),
                server,
                (),
            ))
            .await
            .map_err(|e| ClusterError::Listen {
                name: settings.name.clone(),
                addr: bind.to_string(),
                why: chain(&e).to_string(),
            })?;
        let shared = Arc::new(Shared {
            name: settings.name.clone(),
            hosts: Mutex::default(),
            sessions: Mutex::default(),
            pending: Mutex::default(),
            suspects: Mutex::default(),
            changed: tokio::sync::watch::Sender::new(0),
            left: Mutex::default(),
            joined: Mutex::default(),
        });
        let watch = ctx
            .spawn(WorkerSpec::new(
                "cluster-watch",
                "watch/peers",
                Watch,
                shared.clone(),
            ))
            .await
            .map_err(|e| ClusterError::Supervise(chain(&e).to_string()))?;
        let subscription = Subscription {
            watch: watch.actor().clone(),
        };
        server
            .send(NodeServerMessage::SubscribeToEvents {
                id: "dsh-cluster".into(),
                subscription: Box::new(subscription),
            })
            .map_err(|_| ClusterError::Supervise("the node server stopped".into()))?;
        let beat = shared.clone();
        ctx.spawn_task(TaskSpec::new("heartbeat", "heartbeat"), move |stop| {
            heartbeat(beat, stop)
        })
        .map_err(|e| ClusterError::Supervise(chain(&e).to_string()))?;
        if let (Some(front), Some(t), Some(addr)) = (front, tls.clone(), listen) {
            let (actor, owner) = (server.actor().clone(), ctx.clone());
            ctx.spawn_task(
                TaskSpec::new("tls-listener", format!("tls/{addr}")),
                move |stop| tls::accept(front, t, actor, owner, stop),
            )
            .map_err(|e| ClusterError::Supervise(chain(&e).to_string()))?;
        }
        Ok(Arc::new(Cluster {
            shared,
            server,
            listen,
            tls,
            ctx: ctx.clone(),
            next: AtomicU32::new(0),
        }))
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Where it accepts peers (`None`: client only).
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.listen
    }

    /// The context the cluster's parts live under.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    /// Joins `peer` and waits, up to `timeout`, until its host is known;
    /// a wrong cookie, a name that is not the peer's, or no host there is
    /// an error saying which.
    pub async fn connect(
        &self,
        peer: &Peer,
        timeout: Duration,
    ) -> Result<Arc<RemoteHost>, ClusterError> {
        let failed = |why: String| ClusterError::Connect {
            peer: peer.to_string(),
            why,
        };
        let waited = tokio::time::timeout(timeout, async {
            let addr = tokio::net::lookup_host(&peer.addr)
                .await
                .map_err(|e| failed(format!("`{}` does not resolve: {e}", peer.addr)))?
                .next()
                .ok_or_else(|| failed(format!("`{}` resolves to no address", peer.addr)))?;
            let key = addr.to_string();
            let mut changes = self.shared.changed.subscribe();
            lock(&self.shared.sessions).remove(&key);
            match &self.tls {
                None => client_connect(self.server.actor(), addr).await,
                Some(t) => {
                    let name = tls::server_name(&peer.addr).map_err(&failed)?;
                    client_connect_enc(self.server.actor(), addr, t.connector().clone(), name).await
                }
            }
            .map_err(|e| {
                failed(match e {
                    ractor_cluster::ClientConnectErr::Encryption(e) => {
                        format!("the TLS handshake failed: {}", chain(&e))
                    }
                    other => other.to_string(),
                })
            })?;
            loop {
                if let Some(h) = self.host(&peer.name) {
                    return Ok(h);
                }
                match lock(&self.shared.sessions).get(&key) {
                    Some(Session::Closed) => {
                        return Err(failed(
                            "the peer closed the session before it was ready (a wrong cookie? \
                             a node that takes TLS only, dialled without --tls-ca?)"
                                .into(),
                        ));
                    }
                    Some(Session::Ready { name, .. }) if name != &peer.name => {
                        return Err(failed(format!("the node there is named `{name}`")));
                    }
                    _ => {}
                }
                if changes.changed().await.is_err() {
                    return Err(failed("the cluster stopped".into()));
                }
            }
        })
        .await;
        waited.unwrap_or_else(|_| {
            Err(failed(format!(
                "no host of `{}` answered within {timeout:?}",
                peer.name
            )))
        })
    }

    /// The known host of `node`.
    pub fn host(&self, node: &str) -> Option<Arc<RemoteHost>> {
        lock(&self.shared.hosts).get(node).cloned()
    }

    /// Every known host, by node name.
    pub fn hosts(&self) -> Vec<Arc<RemoteHost>> {
        lock(&self.shared.hosts).values().cloned().collect()
    }

    /// Picks a host by `placement`; `None` when no host fits.
    pub fn place(&self, placement: &Placement) -> Option<Arc<RemoteHost>> {
        let hosts = self.hosts();
        match placement {
            // A named node is asked even when full: it says so.
            Placement::Node(name) => hosts.into_iter().find(|h| &h.node == name),
            Placement::LeastLoaded => hosts
                .into_iter()
                .filter(|h| h.free() > 0 && h.has_room())
                .min_by_key(|h| (h.load(), h.node.clone())),
            Placement::RoundRobin => {
                let roomy: Vec<_> = hosts.into_iter().filter(|h| h.has_room()).collect();
                if roomy.is_empty() {
                    return None;
                }
                let n = self.next.fetch_add(1, Ordering::Relaxed) as usize;
                roomy.get(n % roomy.len()).cloned()
            }
        }
    }

    /// Shows the subtrees of this node's children on `host` in this
    /// process's tree, from now until the host is lost (they are then
    /// marked `lost`) or the cluster stops: a `mirror/<node>` task, started
    /// once per host.
    pub(crate) fn follow(&self, host: &Arc<RemoteHost>) {
        if !host.mirror.start(self.ctx.runtime().tree()) {
            return;
        }
        let (watched, me) = (host.clone(), self.name().to_owned());
        let spec = TaskSpec::new("mirror", format!("mirror/{}", host.node()));
        if let Err(e) = self
            .ctx
            .spawn_task(spec, move |stop| mirror::follow(watched, me, stop))
        {
            tracing::warn!("cluster: cannot mirror node `{}`: {e}", host.node());
        }
    }

    /// Waits, up to `timeout`, until every child placed on another node
    /// shows its own node in this process's tree (or its node is lost);
    /// whether all do.
    pub async fn mirrored(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        for host in self.hosts() {
            if !host.mirror.rooted_by(deadline).await {
                return false;
            }
        }
        true
    }

    /// Runs `f` with the name of each peer node that leaves.
    fn on_left(&self, f: impl Fn(&str) + Send + Sync + 'static) {
        lock(&self.shared.left).push(Box::new(f));
    }

    /// Runs `f` with the name of each peer node whose session is ready.
    fn on_joined(&self, f: impl Fn(&str) + Send + Sync + 'static) {
        lock(&self.shared.joined).push(Box::new(f));
    }
}

/// Where the `remote` provider starts a child.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placement {
    /// The next known host in turn.
    RoundRobin,
    /// The host holding the fewest children (with room left).
    LeastLoaded,
    /// The host of this node.
    Node(String),
}

impl FromStr for Placement {
    type Err = String;

    fn from_str(s: &str) -> Result<Placement, String> {
        match s {
            "round-robin" => Ok(Placement::RoundRobin),
            "least-loaded" => Ok(Placement::LeastLoaded),
            name => valid_name(name)
                .map(|()| Placement::Node(name.into()))
                .map_err(|_| {
                    format!("`{s}` is not a placement (round-robin, least-loaded or a node name)")
                }),
        }
    }
}

/// A free port on `addr`'s interface (bound, read and released: the node
/// server binds it again at once).
fn free_port(addr: SocketAddr) -> Result<SocketAddr, String> {
    std::net::TcpListener::bind(addr)
        .and_then(|l| l.local_addr())
        .map_err(|e| chain(&e).to_string())
}

/// Node session events, forwarded to the watcher.
struct Subscription {
    watch: ActorRef<WatchMsg>,
}

impl NodeEventSubscription for Subscription {
    fn node_session_opened(&self, _ses: NodeServerSessionInformation) {}

    fn node_session_disconnected(&self, ses: NodeServerSessionInformation) {
        // Not the name it claimed: a session that failed the challenge
        // claimed it too. What it was is what it was when ready.
        let _ = self.watch.send_message(WatchMsg::Closed {
            addr: ses.peer_addr,
        });
    }

    fn node_session_authenticated(&self, _ses: NodeServerSessionInformation) {}

    fn node_session_ready(&self, ses: NodeServerSessionInformation) {
        let _ = self.watch.send_message(WatchMsg::Ready {
            addr: ses.peer_addr,
            name: ses.peer_name.map(|n| node_of(&n.name)).unwrap_or_default(),
            node_id: ses.node_id,
        });
    }
}

/// `name@host` (ractor_cluster's form) to `name`.
fn node_of(full: &str) -> String {
    full.split_once('@').map_or(full, |(n, _)| n).to_owned()
}

enum WatchMsg {
    Ready {
        addr: String,
        name: String,
        node_id: u64,
    },
    Closed {
        addr: String,
    },
}

// Local only: the watcher is never reached from another node.
impl ractor::Message for WatchMsg {}

/// Watches node sessions and the hosts group; identifies each remote host
/// that joins (a `hello`) and loses those that leave.
struct Watch;

impl Actor for Watch {
    type Msg = WatchMsg;
    type State = Arc<Shared>;
    type Arguments = Arc<Shared>;

    async fn pre_start(
        &self,
        me: ActorRef<WatchMsg>,
        shared: Arc<Shared>,
    ) -> Result<Arc<Shared>, ActorProcessingErr> {
        ractor::pg::monitor(HOSTS_GROUP.into(), me.get_cell());
        Ok(shared)
    }

    async fn post_start(
        &self,
        _me: ActorRef<WatchMsg>,
        shared: &mut Arc<Shared>,
    ) -> Result<(), ActorProcessingErr> {
        // Hosts that joined before the monitor.
        let members = ractor::pg::get_members(&HOSTS_GROUP.to_owned());
        identify(shared, members).await;
        Ok(())
    }

    async fn handle(
        &self,
        _me: ActorRef<WatchMsg>,
        msg: WatchMsg,
        shared: &mut Arc<Shared>,
    ) -> Result<(), ActorProcessingErr> {
        match msg {
            WatchMsg::Ready {
                addr,
                name,
                node_id,
            } => {
                lock(&shared.sessions).insert(
                    addr,
                    Session::Ready {
                        name: name.clone(),
                        node_id,
                    },
                );
                for f in lock(&shared.joined).iter() {
                    f(&name);
                }
                // Hosts of this node seen before its session was ready.
                let waiting: Vec<ActorCell> = {
                    let mut p = lock(&shared.pending);
                    let (mine, rest) = std::mem::take(&mut *p)
                        .into_iter()
                        .partition(|c| remote_node_id(c) == Some(node_id));
                    *p = rest;
                    mine
                };
                identify(shared, waiting).await;
                shared.bump();
            }
            WatchMsg::Closed { addr } => {
                let was = {
                    let mut sessions = lock(&shared.sessions);
                    let was = sessions.insert(addr, Session::Closed);
                    if sessions.len() > CLOSED_KEPT {
                        sessions.retain(|_, s| s != &Session::Closed);
                    }
                    was
                };
                // Only a session that was ready stood for a node, and the
                // node is gone only if no other ready session stands for it.
                match was {
                    Some(Session::Ready { name, node_id }) => {
                        lock(&shared.pending).retain(|c| remote_node_id(c) != Some(node_id));
                        let still = lock(&shared.sessions)
                            .values()
                            .any(|s| matches!(s, Session::Ready { name: n, .. } if n == &name));
                        if still {
                            shared.bump();
                        } else {
                            shared.lose(&name, "its session closed");
                        }
                    }
                    _ => shared.bump(),
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _me: ActorRef<WatchMsg>,
        event: SupervisionEvent,
        shared: &mut Arc<Shared>,
    ) -> Result<(), ActorProcessingErr> {
        if let SupervisionEvent::ProcessGroupChanged(change) = event {
            match change {
                ractor::pg::GroupChangeMessage::Join(_, _, cells) => identify(shared, cells).await,
                ractor::pg::GroupChangeMessage::Leave(_, _, cells) => {
                    let gone: Vec<String> = lock(&shared.hosts)
                        .values()
                        .filter(|h| cells.iter().any(|c| c.get_id() == h.actor.get_id()))
                        .map(|h| h.node.clone())
                        .collect();
                    for node in gone {
                        shared.lose(&node, "its host left");
                    }
                }
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        me: ActorRef<WatchMsg>,
        shared: &mut Arc<Shared>,
    ) -> Result<(), ActorProcessingErr> {
        ractor::pg::demonitor(HOSTS_GROUP.into(), me.get_id());
        for h in std::mem::take(&mut *lock(&shared.hosts)).into_values() {
            h.lost.cancel();
        }
        shared.bump();
        Ok(())
    }
}

/// The node id (here) of a remote actor's session.
fn remote_node_id(cell: &ActorCell) -> Option<u64> {
    match cell.get_id() {
        ractor::ActorId::Remote { node_id, .. } => Some(node_id),
        ractor::ActorId::Local(_) => None,
    }
}

/// Asks each remote member who it is, and records it under the name its
/// session proved (a host that names another node is ignored); a member
/// whose session is not ready yet waits for it.
async fn identify(shared: &Shared, cells: Vec<ActorCell>) {
    for cell in cells.into_iter().filter(|c| !c.get_id().is_local()) {
        let known = lock(&shared.hosts)
            .values()
            .any(|h| h.actor.get_id() == cell.get_id());
        if known {
            continue;
        }
        let Some(session) = remote_node_id(&cell).and_then(|id| shared.ready_name(id)) else {
            lock(&shared.pending).push(cell);
            continue;
        };
        let probe = RemoteHost::new(cell.get_id().to_string(), ActorRef::from(cell), 0, 0);
        let hello: Hello = match probe.call(&Request::Hello {}, PING_TIMEOUT).await {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!("cluster: a host did not say who it is: {}", chain(&e));
                continue;
            }
        };
        if hello.node != session || hello.node == shared.name {
            tracing::warn!(
                "cluster: ignoring a host that calls itself `{}` on the session of `{session}`",
                hello.node
            );
            continue;
        }
        let host = Arc::new(RemoteHost::new(
            hello.node.clone(),
            probe.actor,
            hello.max_agents,
            hello.agents,
        ));
        tracing::info!("cluster: node `{}` serves children", hello.node);
        let replaced = lock(&shared.hosts).insert(hello.node, host);
        if let Some(old) = replaced {
            old.lost.cancel();
        }
        shared.bump();
    }
}

/// Pings every known host each second; one that misses three in a row is
/// lost. The pings refresh each host's load.
async fn heartbeat(shared: Arc<Shared>, stop: CancellationToken) {
    loop {
        tokio::select! {
            () = tokio::time::sleep(PING_EVERY) => {}
            () = stop.cancelled() => return,
        }
        let hosts: Vec<Arc<RemoteHost>> = lock(&shared.hosts).values().cloned().collect();
        let sent = now_ms();
        let pings = hosts.iter().map(|h| async move {
            let r: Result<Hello, _> = h.call(&Request::Hello {}, PING_TIMEOUT).await;
            (h, r)
        });
        // Suspects are asked too (their own `lost` has fired: a fresh probe).
        let suspects: Vec<Arc<RemoteHost>> = lock(&shared.suspects).clone();
        let probes = suspects.iter().map(|h| async move {
            let probe = RemoteHost::new(h.node.clone(), h.actor.clone(), h.max_agents, 0);
            let r: Result<Hello, _> = probe.call(&Request::Hello {}, PING_TIMEOUT).await;
            (h, probe, r)
        });
        let both = futures::future::join(
            futures::future::join_all(pings),
            futures::future::join_all(probes),
        );
        let (answered, back) = tokio::select! {
            a = both => a,
            () = stop.cancelled() => return,
        };
        for (old, probe, r) in back {
            if let Ok(hello) = r
                && hello.node == old.node
            {
                lock(&shared.suspects).retain(|h| !Arc::ptr_eq(h, old));
                probe.agents.store(hello.agents, Ordering::Relaxed);
                let mut hosts = lock(&shared.hosts);
                if !hosts.contains_key(&old.node) {
                    tracing::info!("cluster: node `{}` answers again", old.node);
                    hosts.insert(old.node.clone(), Arc::new(probe));
                }
                drop(hosts);
                shared.bump();
            }
        }
        for (h, r) in answered {
            match r {
                Ok(hello) => {
                    h.agents.store(hello.agents, Ordering::Relaxed);
                    h.misses.store(0, Ordering::Relaxed);
                }
                Err(_) if h.heard.load(Ordering::Relaxed) >= sent => {
                    // Late, but it answered something else meanwhile.
                }
                Err(e) => {
                    let missed = h.misses.fetch_add(1, Ordering::Relaxed) + 1;
                    if missed >= PING_MISSES {
                        shared.suspect(h, &format!("{missed} pings unanswered ({})", chain(&e)));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_and_placements_parse_and_bad_ones_say_what_is_wrong() {
        assert_eq!(
            "b@127.0.0.1:4001".parse::<Peer>(),
            Ok(Peer {
                name: "b".into(),
                addr: "127.0.0.1:4001".into()
            })
        );
        for (bad, says) in [
            ("127.0.0.1:4001", "no `@`"),
            ("b@127.0.0.1", "no port"),
            ("b@host:http", "not a port number"),
            ("b c@host:1", "not a node name"),
            ("@host:1", "not a node name"),
        ] {
            let e = bad.parse::<Peer>().err().unwrap_or_default();
            assert!(e.contains(says), "{bad}: {e}");
        }
        assert_eq!("least-loaded".parse(), Ok(Placement::LeastLoaded));
        assert_eq!("round-robin".parse(), Ok(Placement::RoundRobin));
        assert_eq!("b".parse(), Ok(Placement::Node("b".into())));
        assert!("b/c".parse::<Placement>().is_err());
        assert_eq!(node_of("b@127.0.0.1"), "b");
    }
}
