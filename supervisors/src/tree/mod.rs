//! The tree registry: every actor the kernel supervises, and a change feed.
//!
//! Live nodes sit in a concurrent map; stopped nodes move to a bounded ring
//! so memory stays flat however many short-lived actors come and go. The
//! feed (`feed`) gives each subscriber a bounded queue: one that falls
//! behind is told how many changes it missed (and must take a fresh
//! snapshot).

mod feed;
mod follow;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use dashmap::DashMap;
use serde::{Deserialize, Serialize};

pub use feed::{RecvError, Subscription, TryRecvError};
pub use follow::Follower;

/// Lifecycle status of a node, shared by fibers and workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum Status {
    /// Waiting for injected services.
    Pending = 0,
    /// Running its setup (`apply`, `pre_start`).
    Loading = 1,
    /// Up and serving.
    Active = 2,
    /// Tearing down (draining children, running effects).
    Unloading = 3,
    /// Stopped cleanly.
    Disposed = 4,
    /// Stopped by an error, a panic, or a kill after its shutdown budget.
    Failed = 5,
    /// A parked node: its actors stopped, and it comes back under the same
    /// name when needed (a hibernated agent).
    Hibernated = 6,
    /// A node on another machine that can no longer be reached (its
    /// machine died or stopped answering), or the part that stood for it.
    Lost = 7,
}

impl Status {
    pub(crate) fn from_u8(v: u8) -> Status {
        match v {
            0 => Status::Pending,
            1 => Status::Loading,
            2 => Status::Active,
            3 => Status::Unloading,
            4 => Status::Disposed,
            6 => Status::Hibernated,
            7 => Status::Lost,
            _ => Status::Failed,
        }
    }

    /// Whether the node will never run again.
    pub fn is_terminal(self) -> bool {
        matches!(self, Status::Disposed | Status::Failed)
    }

    /// Lower-case name, as shown in the tree and in errors.
    pub fn as_str(self) -> &'static str {
        match self {
            Status::Pending => "pending",
            Status::Loading => "loading",
            Status::Active => "active",
            Status::Unloading => "unloading",
            Status::Disposed => "disposed",
            Status::Failed => "failed",
            Status::Hibernated => "hibernated",
            Status::Lost => "lost",
        }
    }
}

/// The first id of a parked node (see [`Tree::park`]) or a mirrored one
/// ([`Tree::mirror`]): 2^50, far above any actor id and below 2^53 so
/// browsers read it exactly.
pub const PARKED_IDS: u64 = 1 << 50;

/// A fresh id for a node that holds no actor of this process.
fn outside_id() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(PARKED_IDS);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// A node that runs on another machine, as this tree shows it
/// ([`Tree::mirror`]): what that machine's tree said of it.
#[derive(Clone, Debug)]
pub struct Mirrored {
    /// The cluster node it runs on.
    pub node: Arc<str>,
    /// What runs behind it there.
    pub form: Form,
    /// Its kind there.
    pub kind: String,
    /// Its name there.
    pub name: String,
    /// Its status there.
    pub status: Status,
    /// When it started there, ms since epoch.
    pub started_ms: u64,
    /// Its summary there.
    pub summary: serde_json::Value,
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Live counters of one node, updated without locks on the hot path.
#[derive(Debug, Default)]
pub struct NodeStats {
    status: AtomicU8,
    enqueued: AtomicU64,
    handled: AtomicU64,
    last_activity_ms: AtomicU64,
    /// Counts the node's summary changes (a follower compares it with the
    /// count it last read, instead of computing the summary).
    summary_version: AtomicU32,
}

impl NodeStats {
    /// Counts one message put into the node's mailbox.
    pub fn enqueue(&self) {
        self.enqueued.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts one message taken out of the mailbox and marks activity.
    pub fn handled(&self) {
        self.handled.fetch_add(1, Ordering::Relaxed);
        self.touch();
    }

    /// Marks activity now.
    pub fn touch(&self) {
        self.last_activity_ms.store(now_ms(), Ordering::Relaxed);
    }

    /// Messages waiting (sent through counted handles and not yet handled).
    pub fn mailbox_depth(&self) -> u64 {
        let e = self.enqueued.load(Ordering::Relaxed);
        let h = self.handled.load(Ordering::Relaxed);
        e.saturating_sub(h)
    }

    /// Current status.
    pub fn status(&self) -> Status {
        Status::from_u8(self.status.load(Ordering::Acquire))
    }

    pub(crate) fn set_status(&self, s: Status) {
        self.status.store(s as u8, Ordering::Release);
    }

    /// How many times the summary changed. Read before the summary: a
    /// reader that saw this count reads a summary at least that recent.
    fn summary_version(&self) -> u32 {
        self.summary_version.load(Ordering::Acquire)
    }

    /// Counts a summary change, once the new summary is readable.
    fn summary_changed(&self) {
        self.summary_version.fetch_add(1, Ordering::Release);
    }
}

/// Static facts about a node, fixed at spawn.
#[derive(Debug)]
pub struct NodeInfo {
    /// Kernel-wide id (the ractor pid).
    pub id: u64,
    /// What runs behind the node: a fiber, an actor, a task or nothing.
    pub form: Form,
    /// Kind: `fiber`, `scope`, `worker`, or a kind chosen by the spawner (`agent`, `tool`, …).
    pub kind: Arc<str>,
    /// Readable name, e.g. `agent/3f2a` or `llm/openai`.
    pub name: Arc<str>,
    /// Parent node, `None` for the root.
    pub parent: Option<u64>,
    /// Start time, ms since epoch.
    pub started_ms: u64,
    /// The cluster node it runs on, when that is another machine (a
    /// mirrored node, see [`Tree::mirror`]); `None` for this process's.
    pub node: Option<Arc<str>>,
}

/// What runs behind a node (ARCHITECTURE.md, "What is an actor, what is a
/// task child").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Form {
    /// A fiber: a plugin instance or a scope, run by an actor.
    Fiber,
    /// A worker actor, with a mailbox.
    Actor,
    /// A task child: one-shot work, no mailbox.
    Task,
    /// A passive node: nothing runs (a store-less session, a parked agent).
    Part,
}

impl Form {
    /// The form as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Form::Fiber => "fiber",
            Form::Actor => "actor",
            Form::Task => "task",
            Form::Part => "part",
        }
    }

    /// Whether the node has a mailbox (fibers and actors do).
    pub fn has_mailbox(self) -> bool {
        matches!(self, Form::Fiber | Form::Actor)
    }
}

/// One node in the live map.
#[derive(Debug)]
pub struct Node {
    /// Static facts.
    pub info: NodeInfo,
    /// Live counters.
    pub stats: Arc<NodeStats>,
    summary: Mutex<Summary>,
}

impl Node {
    /// The node as it is now.
    pub fn snapshot(&self) -> NodeSnapshot {
        snapshot_of(self, None, None)
    }

    /// Serializes the node as a live [`NodeSnapshot`] with this status,
    /// straight from the node (no copy of its names).
    fn serialize_as<S: serde::Serializer>(
        &self,
        status: Status,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut node = serializer.serialize_struct("NodeSnapshot", 11)?;
        node.serialize_field("id", &self.info.id)?;
        node.serialize_field("form", &self.info.form)?;
        node.serialize_field("kind", &*self.info.kind)?;
        node.serialize_field("name", &*self.info.name)?;
        if let Some(on) = &self.info.node {
            node.serialize_field("node", &**on)?;
        }
        node.serialize_field("parent", &self.info.parent)?;
        node.serialize_field("status", &status)?;
        node.serialize_field("started_ms", &self.info.started_ms)?;
        node.serialize_field("mailbox_depth", &self.stats.mailbox_depth())?;
        let activity = self.stats.last_activity_ms.load(Ordering::Relaxed);
        node.serialize_field("last_activity_ms", &activity)?;
        node.serialize_field("summary", &summary_of(self))?;
        node.end()
    }
}

impl Serialize for Node {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.serialize_as(self.stats.status(), serializer)
    }
}

/// A node as a `spawned` change shows it: read when serialized, except for
/// its status, which is the one it had when the change was made (later
/// status changes follow as changes of their own, so a viewer that applies
/// them in order ends with the node's status whenever it was serialized).
#[derive(Clone, Debug)]
pub struct NodeAt {
    node: Arc<Node>,
    status: Status,
}

impl NodeAt {
    pub(crate) fn new(node: Arc<Node>, status: Status) -> NodeAt {
        NodeAt { node, status }
    }

    /// Its status when the change was made.
    pub fn status(&self) -> Status {
        self.status
    }
}

impl std::ops::Deref for NodeAt {
    type Target = Node;

    fn deref(&self) -> &Node {
        &self.node
    }
}

impl Serialize for NodeAt {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.node.serialize_as(self.status, serializer)
    }
}

/// A node's kind-specific summary: a value, or a function that computes it
/// when asked (a parked node's, so thousands of them cost no JSON each).
enum Summary {
    Value(serde_json::Value),
    Computed(Arc<SummaryFn>),
    /// A stopped node's object summary as JSON text: one allocation where
    /// the value's map took several (up to 4,096 stopped nodes are kept).
    Text(Box<str>),
}

impl Summary {
    /// The same summary, kept as text when it is an object.
    fn compacted(&self) -> Option<Summary> {
        match self {
            Summary::Value(v @ serde_json::Value::Object(_)) => serde_json::to_string(v)
                .ok()
                .map(|text| Summary::Text(text.into_boxed_str())),
            _ => None,
        }
    }
}

/// Computes a parked node's summary on demand.
pub type SummaryFn = dyn Fn() -> serde_json::Value + Send + Sync;

impl std::fmt::Debug for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Summary::Value(v) => v.fmt(f),
            Summary::Computed(_) => f.write_str("<computed>"),
            Summary::Text(t) => f.write_str(t),
        }
    }
}

/// A point-in-time copy of a node, as the API and the CLI show it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct NodeSnapshot {
    /// Kernel-wide id.
    pub id: u64,
    /// What runs behind it.
    pub form: Form,
    /// Kind.
    pub kind: String,
    /// Readable name.
    pub name: String,
    /// The cluster node it runs on, for a mirrored node.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// Parent id.
    pub parent: Option<u64>,
    /// Status.
    pub status: Status,
    /// Start time, ms since epoch.
    pub started_ms: u64,
    /// Messages waiting.
    pub mailbox_depth: u64,
    /// Last activity, ms since epoch.
    pub last_activity_ms: u64,
    /// Kind-specific summary (agent turn/step, tokens, …).
    pub summary: serde_json::Value,
    /// Why it stopped, once stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    /// When it stopped, ms since epoch, once stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped_ms: Option<u64>,
    /// Global stop sequence number, once stopped.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_seq: Option<u64>,
}

/// One change in the tree.
#[derive(Clone, Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TreeChange {
    /// A node was added.
    Spawned {
        /// The new node itself, not a copy: the change costs the spawner no
        /// snapshot, and a viewer that serializes it reads the node as it is
        /// by then (its status as at the change; see [`NodeAt`]).
        node: NodeAt,
    },
    /// A node changed status.
    Status {
        /// Node id.
        id: u64,
        /// New status.
        status: Status,
    },
    /// A node's summary changed.
    Summary {
        /// Node id.
        id: u64,
        /// The node, serialized as its `summary` when the change is (so the
        /// changing side computes no summary, and a viewer folding several
        /// changes of one node computes one).
        #[serde(rename = "summary", serialize_with = "summary_now")]
        node: Arc<Node>,
    },
    /// A node stopped for good.
    Stopped {
        /// Node id.
        id: u64,
        /// Final status (`disposed` or `failed`).
        status: Status,
        /// Why (shared with the stopped ring).
        reason: Arc<str>,
        /// Position in the global stop order.
        stop_seq: u64,
        /// When it stopped, ms since epoch.
        stopped_ms: u64,
    },
    /// A supervised child failed (a panic or an error) and the supervisor reacted.
    Supervision {
        /// The supervisor.
        supervisor: u64,
        /// The failed node.
        child: u64,
        /// The panic or error text.
        message: String,
        /// What the supervisor did (`restarted`, `removed`, `escalated`, …).
        action: String,
    },
    /// A disposal finished; `order` lists the subtree in the order it stopped.
    Teardown {
        /// Root of the disposed subtree.
        root: u64,
        /// Ids in stop order (the root last).
        order: Vec<u64>,
    },
}

/// Settings of the registry.
#[derive(Clone, Copy, Debug)]
pub struct TreeLimits {
    /// Stopped nodes remembered (oldest dropped first).
    pub stopped_capacity: usize,
    /// Changes queued per feed subscriber before it lags (it may hold twice
    /// as many: the batch it is reading and a full queue behind it).
    pub feed_capacity: usize,
    /// Stops remembered for followers between two of their looks (a
    /// follower that misses some lags); kept only while anyone follows.
    pub follow_stops: usize,
}

impl Default for TreeLimits {
    fn default() -> Self {
        TreeLimits {
            stopped_capacity: 4096,
            feed_capacity: 16384,
            follow_stops: 65536,
        }
    }
}

/// The registry of every supervised node.
pub struct Tree {
    live: DashMap<u64, Arc<Node>>,
    stopped: Mutex<Stops>,
    limits: TreeLimits,
    feed: Arc<feed::Feed>,
}

/// Stopped nodes as they were left (a node no longer changes once it
/// stopped): snapshots are made when the ring is read, not at every stop,
/// and a computed summary stays a function. Numbered under the ring's lock,
/// so the ring is in stop order and a follower reads the stops after the
/// last one it saw.
#[derive(Default)]
struct Stops {
    ring: VecDeque<StoppedNode>,
    /// The last stop sequence number given.
    seq: u64,
    /// While anyone follows the tree: the stops not yet read by every
    /// follower, without the nodes (bounded by [`TreeLimits::follow_stops`];
    /// freed at the first stop after the last follower left).
    log: VecDeque<StopRecord>,
    /// Each follower's last stop read (a follower that is gone is dropped
    /// from the list): the log keeps only what one of them has not read.
    cursors: Vec<std::sync::Weak<AtomicU64>>,
}

/// A stop as a follower reads it.
#[derive(Clone)]
struct StopRecord {
    id: u64,
    seq: u64,
    stopped_ms: u64,
    status: Status,
    reason: Arc<str>,
}

impl Drop for Tree {
    fn drop(&mut self) {
        self.feed.close();
    }
}

impl Tree {
    /// An empty registry.
    pub fn new(limits: TreeLimits) -> Tree {
        Tree {
            live: DashMap::new(),
            stopped: Mutex::default(),
            limits,
            feed: Arc::new(feed::Feed::new(limits.feed_capacity)),
        }
    }

    /// Subscribes to changes from now on. Take a [`Tree::snapshot`] after
    /// subscribing to have a base the changes apply to.
    pub fn subscribe(&self) -> Subscription {
        self.feed.subscribe(feed::Reads::Everything)
    }

    /// Whether anyone follows the change feed right now.
    pub fn watched(&self) -> bool {
        self.feed.watched()
    }

    /// Sends the node change `make` builds to the subscribers that read
    /// every change (it is built only for them), and wakes the followers.
    fn publish(&self, make: impl FnOnce() -> TreeChange) {
        if self.watched() {
            self.feed.send_node(make);
        }
    }

    /// Sends an event (supervision, teardown) to every subscriber and
    /// follower.
    fn publish_event(&self, make: impl FnOnce() -> TreeChange) {
        if self.watched() {
            self.feed.send(make());
        }
    }

    pub(crate) fn insert(&self, info: NodeInfo, status: Status) -> Arc<Node> {
        self.insert_with(info, status, Summary::Value(serde_json::Value::Null))
    }

    /// [`Tree::insert`] with the node's summary from its start.
    pub(crate) fn insert_summarized(
        &self,
        info: NodeInfo,
        status: Status,
        summary: serde_json::Value,
    ) -> Arc<Node> {
        self.insert_with(info, status, Summary::Value(summary))
    }

    fn insert_with(&self, info: NodeInfo, status: Status, summary: Summary) -> Arc<Node> {
        let stats = Arc::new(NodeStats::default());
        stats.set_status(status);
        stats
            .last_activity_ms
            .store(info.started_ms, Ordering::Relaxed);
        let node = Arc::new(Node {
            info,
            stats,
            summary: Mutex::new(summary),
        });
        self.live.insert(node.info.id, node.clone());
        self.publish(|| TreeChange::Spawned {
            node: NodeAt::new(node.clone(), status),
        });
        node
    }

    pub(crate) fn set_status(&self, node: &Node, status: Status) {
        if node.stats.status() == status {
            return;
        }
        node.stats.set_status(status);
        node.stats.touch();
        self.publish(|| TreeChange::Status {
            id: node.info.id,
            status,
        });
    }

    /// Replaces a node's kind-specific summary.
    pub fn set_summary(&self, id: u64, summary: serde_json::Value) {
        let Some(node) = self.live.get(&id).map(|n| n.clone()) else {
            return;
        };
        if let Ok(mut s) = node.summary.lock() {
            *s = Summary::Value(summary);
        }
        node.stats.summary_changed();
        self.publish(|| TreeChange::Summary { id, node });
    }

    /// Moves a node to the stopped ring; returns its stop sequence number, or
    /// `None` when it had already stopped.
    pub(crate) fn stopped(&self, id: u64, status: Status, reason: &str) -> Option<u64> {
        let (_, node) = self.live.remove(&id)?;
        node.stats.set_status(status);
        // A stopped node's summary no longer changes: kept compact.
        if let Ok(mut summary) = node.summary.lock()
            && let Some(compact) = summary.compacted()
        {
            *summary = compact;
        }
        let reason: Arc<str> = reason.into();
        let stopped_ms = now_ms();
        let mut entry = StoppedNode {
            status,
            mailbox_depth: node.stats.mailbox_depth(),
            last_activity_ms: node.stats.last_activity_ms.load(Ordering::Relaxed),
            stopped_ms,
            node,
            reason: reason.clone(),
            seq: 0,
        };
        // The entry pushed out is dropped outside the lock.
        let (seq, _oldest, _log) = {
            let mut stops = self.stops();
            stops.seq += 1;
            let seq = stops.seq;
            entry.seq = seq;
            let oldest = (stops.ring.len() >= self.limits.stopped_capacity)
                .then(|| stops.ring.pop_front())
                .flatten();
            stops.ring.push_back(entry);
            // Once nobody follows, the log goes (dropped outside the lock).
            let mut gone = None;
            if self.feed.followed() {
                if stops.log.len() >= self.limits.follow_stops {
                    stops.log.pop_front();
                }
                stops.log.push_back(StopRecord {
                    id,
                    seq,
                    stopped_ms,
                    status,
                    reason: reason.clone(),
                });
            } else {
                if stops.log.capacity() > 0 {
                    gone = Some(std::mem::take(&mut stops.log));
                }
                stops.cursors.clear();
            }
            (seq, oldest, gone)
        };
        self.publish(|| TreeChange::Stopped {
            id,
            status,
            reason,
            stop_seq: seq,
            stopped_ms,
        });
        Some(seq)
    }

    pub(crate) fn supervision(&self, supervisor: u64, child: u64, message: &str, action: &str) {
        self.publish_event(|| TreeChange::Supervision {
            supervisor,
            child,
            message: message.to_owned(),
            action: action.to_owned(),
        });
    }

    pub(crate) fn teardown(&self, root: u64, order: Vec<u64>) {
        self.publish_event(|| TreeChange::Teardown { root, order });
    }

    /// Adds a parked node (status `hibernated`): something that holds no
    /// actor now but is still part of the tree under `parent`, such as a
    /// hibernated agent. Returns its id, from a range actor ids never reach
    /// (and small enough for a JavaScript number).
    pub fn park(
        &self,
        kind: &str,
        name: Arc<str>,
        parent: Option<u64>,
        summary: Arc<SummaryFn>,
    ) -> u64 {
        let id = outside_id();
        self.insert_with(
            NodeInfo {
                id,
                form: Form::Part,
                kind: Arc::from(kind),
                name,
                parent,
                started_ms: now_ms(),
                node: None,
            },
            Status::Hibernated,
            Summary::Computed(summary),
        );
        id
    }

    /// Removes a parked node: it woke (`status` is its last status, e.g.
    /// `hibernated`) or it was disposed (`disposed`). Like any stop, it is
    /// remembered with `reason` and published.
    pub fn unpark(&self, id: u64, status: Status, reason: &str) -> Option<u64> {
        if id < PARKED_IDS {
            return None;
        }
        self.stopped(id, status, reason)
    }

    /// Adds a mirror of a node that runs on another machine (see
    /// [`Mirrored`]) under `parent`, a node of this tree. Returns its id
    /// here, from the range of parked nodes (actor ids never reach it).
    pub fn mirror(&self, parent: u64, node: Mirrored) -> u64 {
        let id = outside_id();
        self.insert_with(
            NodeInfo {
                id,
                form: node.form,
                kind: node.kind.into(),
                name: node.name.into(),
                parent: Some(parent),
                started_ms: node.started_ms,
                node: Some(node.node),
            },
            node.status,
            Summary::Value(node.summary),
        );
        id
    }

    /// Updates a mirrored node's status and summary, publishing what
    /// changed; does nothing for a node that is not a mirror.
    pub fn update_mirror(&self, id: u64, status: Status, summary: serde_json::Value) {
        let Some(node) = self.mirrored(id) else {
            return;
        };
        self.set_status(&node, status);
        let same = match node.summary.lock().as_deref() {
            Ok(Summary::Value(v)) => *v == summary,
            _ => false,
        };
        if !same {
            self.set_summary(id, summary);
        }
    }

    /// Removes a mirrored node (it stopped over there, or its machine's
    /// view here ended) as any stop is; `None` for a node that is not a
    /// mirror or stopped already.
    pub fn unmirror(&self, id: u64, status: Status, reason: &str) -> Option<u64> {
        self.mirrored(id)?;
        self.stopped(id, status, reason)
    }

    /// Marks a node [`Status::Lost`]: a mirrored node, or a passive part
    /// (the local stand-in of a child on another machine). The status of a
    /// node that runs here is the kernel's, so any other node is left as
    /// it is; returns whether the node was marked.
    pub fn lose(&self, id: u64) -> bool {
        let Some(node) = self.live.get(&id).map(|n| n.clone()) else {
            return false;
        };
        if node.info.node.is_none() && node.info.form != Form::Part {
            return false;
        }
        self.set_status(&node, Status::Lost);
        true
    }

    fn mirrored(&self, id: u64) -> Option<Arc<Node>> {
        self.live
            .get(&id)
            .map(|n| n.clone())
            .filter(|n| n.info.node.is_some())
    }

    /// The live node with this id.
    pub fn get(&self, id: u64) -> Option<NodeSnapshot> {
        let node = self.live.get(&id).map(|n| n.clone())?;
        Some(snapshot_of(&node, None, None))
    }

    /// The stopped node with this id, if still remembered.
    pub fn get_stopped(&self, id: u64) -> Option<NodeSnapshot> {
        let found = {
            let stops = self.stops();
            stops
                .ring
                .iter()
                .rev()
                .find(|s| s.node.info.id == id)
                .cloned()
        };
        found.map(|s| s.snapshot())
    }

    /// Every live node, parents before children (by id, which grows with spawn time).
    pub fn snapshot(&self) -> Vec<NodeSnapshot> {
        // Nodes first, snapshots after: a computed summary may take other
        // locks, never while a shard of the map is held.
        let nodes: Vec<Arc<Node>> = self.live.iter().map(|n| n.clone()).collect();
        let mut out: Vec<NodeSnapshot> = nodes.iter().map(|n| snapshot_of(n, None, None)).collect();
        out.sort_by_key(|n| n.id);
        out
    }

    /// The remembered stopped nodes, oldest first.
    pub fn stopped_nodes(&self) -> Vec<NodeSnapshot> {
        let ring: Vec<_> = self.stops().ring.iter().cloned().collect();
        ring.into_iter().map(|s| s.snapshot()).collect()
    }

    /// Makes a node's summary a function, computed whenever the node is
    /// read (snapshots, the stopped ring, feed changes as they are
    /// serialized); nothing is published.
    pub fn set_summary_fn(&self, id: u64, summary: Arc<SummaryFn>) {
        if let Some(node) = self.live.get(&id)
            && let Ok(mut s) = node.summary.lock()
        {
            *s = Summary::Computed(summary);
        }
    }

    /// Says a node's computed summary changed, when anyone follows the
    /// tree: it is counted (followers compare the count) and sent to the
    /// feed's subscribers (the summary is computed when the change is
    /// serialized).
    pub fn summary_changed(&self, id: u64) {
        if !self.watched() {
            return;
        }
        let Some(node) = self.live.get(&id).map(|n| n.clone()) else {
            return;
        };
        node.stats.summary_changed();
        // Through `publish`: a fence between the count above and the check
        // for followers, as for every other change.
        self.publish(|| TreeChange::Summary { id, node });
    }

    /// The stopped ring (a panic while holding it leaves whole entries).
    fn stops(&self) -> std::sync::MutexGuard<'_, Stops> {
        self.stopped.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of live nodes.
    pub fn live_len(&self) -> usize {
        self.live.len()
    }
}

/// Serializes a node's summary as it is now.
fn summary_now<S: serde::Serializer>(node: &Arc<Node>, serializer: S) -> Result<S::Ok, S::Error> {
    summary_of(node).serialize(serializer)
}

/// A node's summary (a computed one is computed outside the node's lock).
fn summary_of(node: &Node) -> serde_json::Value {
    let compute = match node.summary.lock().as_deref() {
        Ok(Summary::Value(v)) => return v.clone(),
        Ok(Summary::Text(t)) => return serde_json::from_str(t).unwrap_or_default(),
        Ok(Summary::Computed(f)) => f.clone(),
        Err(_) => return serde_json::Value::Null,
    };
    compute()
}

/// A node in the stopped ring.
#[derive(Clone)]
struct StoppedNode {
    node: Arc<Node>,
    reason: Arc<str>,
    seq: u64,
    /// Status and counters as they were at the stop (a late send to a
    /// stopped actor still touches the live ones).
    status: Status,
    mailbox_depth: u64,
    last_activity_ms: u64,
    stopped_ms: u64,
}

impl StoppedNode {
    fn snapshot(&self) -> NodeSnapshot {
        let mut snap = snapshot_of(&self.node, Some(self.reason.to_string()), Some(self.seq));
        snap.status = self.status;
        snap.mailbox_depth = self.mailbox_depth;
        snap.last_activity_ms = self.last_activity_ms;
        snap.stopped_ms = Some(self.stopped_ms);
        snap
    }
}

fn snapshot_of(node: &Node, stop_reason: Option<String>, stop_seq: Option<u64>) -> NodeSnapshot {
    NodeSnapshot {
        id: node.info.id,
        form: node.info.form,
        kind: node.info.kind.to_string(),
        name: node.info.name.to_string(),
        node: node.info.node.as_deref().map(str::to_owned),
        parent: node.info.parent,
        status: node.stats.status(),
        started_ms: node.info.started_ms,
        mailbox_depth: node.stats.mailbox_depth(),
        last_activity_ms: node.stats.last_activity_ms.load(Ordering::Relaxed),
        summary: summary_of(node),
        stop_reason,
        stopped_ms: None,
        stop_seq,
    }
}

/// Renders a snapshot as an indented tree, one node per line.
pub fn render(nodes: &[NodeSnapshot]) -> String {
    use std::collections::HashMap;
    let mut children: HashMap<Option<u64>, Vec<&NodeSnapshot>> = HashMap::new();
    let ids: std::collections::HashSet<u64> = nodes.iter().map(|n| n.id).collect();
    for n in nodes {
        let parent = n.parent.filter(|p| ids.contains(p));
        children.entry(parent).or_default().push(n);
    }
    let mut out = String::new();
    fn walk(
        out: &mut String,
        children: &HashMap<Option<u64>, Vec<&NodeSnapshot>>,
        parent: Option<u64>,
        depth: usize,
    ) {
        let Some(list) = children.get(&parent) else {
            return;
        };
        for n in list {
            out.push_str(&"  ".repeat(depth));
            // A mirrored node's mailbox is not counted here.
            let runs = match &n.node {
                Some(on) => format!("{} on {on}", n.form.as_str()),
                None if n.form.has_mailbox() => format!("mailbox={}", n.mailbox_depth),
                None => n.form.as_str().to_owned(),
            };
            out.push_str(&format!(
                "{} [{}] {} #{} {runs}\n",
                n.name,
                n.kind,
                n.status.as_str(),
                n.id,
            ));
            walk(out, children, Some(n.id), depth + 1);
        }
    }
    walk(&mut out, &children, None, 0);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_serializes_as_its_snapshot_with_the_status_of_its_change() {
        let tree = Tree::new(TreeLimits::default());
        let info = NodeInfo {
            id: 7,
            form: Form::Actor,
            kind: Arc::from("agent"),
            name: Arc::from("agent/\"quoted\""),
            parent: Some(3),
            started_ms: 12,
            node: None,
        };
        let node = tree.insert(info, Status::Loading);
        tree.set_summary(7, serde_json::json!({ "turn": 2 }));
        node.stats.enqueue();
        let at = NodeAt::new(node.clone(), Status::Loading);
        tree.set_status(&node, Status::Active);
        // As text: the same fields, in the same order.
        let mut snapshot = node.snapshot();
        let live = serde_json::to_string(&*node).unwrap();
        assert_eq!(live, serde_json::to_string(&snapshot).unwrap());
        snapshot.status = Status::Loading;
        let spawned = serde_json::to_string(&at).unwrap();
        assert_eq!(spawned, serde_json::to_string(&snapshot).unwrap());
        assert!(spawned.contains(r#""summary":{"turn":2}"#), "{spawned}");
        assert!(spawned.contains(r#""mailbox_depth":1"#), "{spawned}");
    }

    #[test]
    fn a_stopped_nodes_summary_is_kept_as_text_and_reads_back_the_same() {
        let tree = Tree::new(TreeLimits::default());
        let summary = serde_json::json!({ "tool": "bash", "call": "ls -la ✓", "n": [1, 2] });
        let info = NodeInfo {
            id: 9,
            form: Form::Task,
            kind: Arc::from("tool"),
            name: Arc::from("tool/bash#1"),
            parent: Some(3),
            started_ms: 12,
            node: None,
        };
        let node = tree.insert_summarized(info, Status::Active, summary.clone());
        tree.stopped(9, Status::Disposed, "finished");
        assert!(matches!(*node.summary.lock().unwrap(), Summary::Text(_)));
        assert_eq!(tree.get_stopped(9).unwrap().summary, summary);
        assert_eq!(summary_of(&node), summary);
    }

    #[test]
    fn a_mirrored_node_names_its_machine_and_only_mirrors_take_its_updates() {
        let tree = Tree::new(TreeLimits::default());
        let part = tree.park(
            "remote-child",
            Arc::from("b/x"),
            None,
            Arc::new(|| serde_json::Value::Null),
        );
        let id = tree.mirror(
            part,
            Mirrored {
                node: Arc::from("b"),
                form: Form::Task,
                kind: "tool".into(),
                name: "bash/1".into(),
                status: Status::Active,
                started_ms: 5,
                summary: serde_json::json!({"n": 1}),
            },
        );
        let node = tree.live.get(&id).map(|n| n.clone()).unwrap();
        let live = serde_json::to_string(&*node).unwrap();
        assert_eq!(live, serde_json::to_string(&node.snapshot()).unwrap());
        assert!(
            live.contains(r#""name":"bash/1","node":"b","parent""#),
            "{live}"
        );
        let mut feed = tree.subscribe();
        tree.update_mirror(id, Status::Active, serde_json::json!({"n": 1}));
        assert!(feed.is_empty(), "nothing changed, nothing is sent");
        tree.update_mirror(id, Status::Unloading, serde_json::json!({"n": 2}));
        assert!(matches!(
            feed.try_recv(),
            Ok(TreeChange::Status {
                status: Status::Unloading,
                ..
            })
        ));
        assert!(matches!(feed.try_recv(), Ok(TreeChange::Summary { .. })));
        assert_eq!(
            tree.get(id).map(|n| n.summary),
            Some(serde_json::json!({"n": 2}))
        );
        assert!(tree.lose(id));
        assert_eq!(tree.get(id).map(|n| n.status), Some(Status::Lost));
        let text = render(&tree.snapshot());
        assert!(text.contains("bash/1 [tool] lost #"), "{text}");
        assert!(text.contains("task on b"), "{text}");
        // The part is no mirror: unmirror leaves it.
        assert_eq!(tree.unmirror(part, Status::Disposed, "x"), None);
        assert!(tree.unmirror(id, Status::Disposed, "closed").is_some());
        assert!(tree.get(id).is_none());
    }
}
