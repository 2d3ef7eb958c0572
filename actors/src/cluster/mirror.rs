//! One tree across nodes: a parent's tree shows its remote children's
//! subtrees under the parts that stand for them, fed by the serving node's
//! change feed.
//!
//! - On the host, a [`Watcher`] per parent node follows the host's tree
//!   feed and keeps what changed in that node's subtrees: the children of
//!   its scopes (`parent/<node>/…`) that are agents, and everything under
//!   them. A `watch` request takes what changed since the last answer it
//!   applied, or waits for a change (at most [`WATCH_HOLD`]); a parent that
//!   names an older answer, or a feed that lagged, gets everything afresh.
//! - On the parent's node, one `mirror/<node>` task per host asks in a loop
//!   and applies the answers to this process's tree ([`Mirror`]): each node
//!   there becomes a mirrored node here ([`Tree::mirror`], its node name
//!   on it), a child's own node under the part of its proxy. When the host
//!   is lost, its mirrored nodes and the parts stay, marked `lost`, until
//!   their proxies are disposed.
//!
//! Nothing read from a host is trusted beyond what it shows: names and
//! kinds are cut to a bound and cleaned of control characters, summaries
//! are bounded, a node whose parent is unknown waits (indexed by what it
//! waits for) until its parent arrives or it stops, and one host's shown
//! and waiting nodes are at most [`MAX_SHOWN`].

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dsh_supervisors::Status;
use dsh_supervisors::tree::{
    Mirrored, NodeSnapshot, RecvError, Subscription, Tree, TreeChange, TryRecvError,
};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::wire::{Changes, MirrorNode, MirrorStop, Request, WATCH_HOLD};
use super::{NODE_DOWN, RemoteHost, lock};

/// The most nodes and stops in one answer (the rest follow at once).
const MAX_NODES: usize = 2000;
const MAX_STOPS: usize = 10_000;
/// The longest name, kind or stop reason shown for a mirrored node.
const MAX_TEXT: usize = 200;
/// The largest summary shown for a mirrored node, as JSON.
const MAX_SUMMARY: usize = 16 << 10;
/// The most nodes of one host shown (or waiting to be) here.
const MAX_SHOWN: usize = 100_000;
/// How long a watch may take beyond the host's hold.
const WATCH_SLACK: Duration = Duration::from_secs(20);
/// The longest pause after a watch failed (it doubles from one second).
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What a host sends one parent node of its children's subtrees.
pub(super) struct Watcher {
    /// Its scopes' name prefix, `parent/<node>/`.
    prefix: String,
    feed: Subscription,
    scopes: HashSet<u64>,
    members: HashSet<u64>,
    /// Members that appeared or changed since the last answer (ids grow
    /// with spawn order: parents come first).
    dirty: BTreeSet<u64>,
    stops: VecDeque<MirrorStop>,
    /// The number of the last answer sent.
    cursor: u64,
    /// The next answer starts afresh.
    reset: bool,
}

impl Watcher {
    /// A watcher of `node`'s subtrees in `tree`; its first answer sends
    /// them whole.
    pub(super) fn new(tree: &Tree, node: &str) -> Watcher {
        Watcher {
            prefix: format!("parent/{node}/"),
            feed: tree.subscribe(),
            scopes: HashSet::new(),
            members: HashSet::new(),
            dirty: BTreeSet::new(),
            stops: VecDeque::new(),
            cursor: 0,
            reset: true,
        }
    }

    /// Reads the subtrees afresh from `tree` (the feed goes on from here).
    fn rebase(&mut self, tree: &Tree) {
        let nodes = tree.snapshot();
        self.scopes = nodes
            .iter()
            .filter(|n| n.name.starts_with(&self.prefix))
            .map(|n| n.id)
            .collect();
        let mut children: HashMap<u64, Vec<&NodeSnapshot>> = HashMap::new();
        for n in &nodes {
            if let Some(p) = n.parent {
                children.entry(p).or_default().push(n);
            }
        }
        let mut members = HashSet::new();
        let mut next: Vec<u64> = Vec::new();
        for scope in &self.scopes {
            for n in children.get(scope).into_iter().flatten() {
                if is_child_node(&n.kind) {
                    next.push(n.id);
                }
            }
        }
        while let Some(id) = next.pop() {
            if members.insert(id) {
                next.extend(children.get(&id).into_iter().flatten().map(|n| n.id));
            }
        }
        self.dirty = members.iter().copied().collect();
        self.members = members;
        self.stops.clear();
        self.reset = true;
    }

    /// Takes one change of the host's tree into account.
    fn absorb(&mut self, change: TreeChange) {
        match change {
            TreeChange::Spawned { node } => {
                let id = node.info.id;
                let parent = node.info.parent;
                if node.info.name.starts_with(&self.prefix) {
                    self.scopes.insert(id);
                } else if parent.is_some_and(|p| {
                    self.members.contains(&p)
                        || (self.scopes.contains(&p) && is_child_node(&node.info.kind))
                }) {
                    self.members.insert(id);
                    self.dirty.insert(id);
                }
            }
            TreeChange::Status { id, .. } | TreeChange::Summary { id, .. } => {
                if self.members.contains(&id) {
                    self.dirty.insert(id);
                }
            }
            TreeChange::Stopped {
                id, status, reason, ..
            } => {
                self.scopes.remove(&id);
                if self.members.remove(&id) {
                    self.dirty.remove(&id);
                    self.stops.push_back(MirrorStop {
                        id,
                        status,
                        reason: reason.to_string(),
                    });
                }
            }
            TreeChange::Supervision { .. } | TreeChange::Teardown { .. } => {}
        }
    }

    fn pending(&self) -> bool {
        self.reset || !self.dirty.is_empty() || !self.stops.is_empty()
    }

    /// Takes every change queued now; a lagged feed starts afresh.
    fn take_queued(&mut self, tree: &Tree) {
        loop {
            match self.feed.try_recv() {
                Ok(change) => self.absorb(change),
                Err(TryRecvError::Lagged(_)) => self.rebase(tree),
                Err(TryRecvError::Empty | TryRecvError::Closed) => return,
            }
        }
    }

    /// The answer to a watch that applied answer `cursor`: what changed
    /// since, once anything has (or nothing, after [`WATCH_HOLD`] or a stop).
    pub(super) async fn next(
        &mut self,
        tree: &Tree,
        cursor: Option<u64>,
        stop: &CancellationToken,
    ) -> Changes {
        if self.reset || cursor != Some(self.cursor) {
            self.rebase(tree);
        }
        self.take_queued(tree);
        let hold = tokio::time::sleep(WATCH_HOLD);
        tokio::pin!(hold);
        while !self.pending() {
            tokio::select! {
                r = self.feed.recv() => match r {
                    Ok(change) => self.absorb(change),
                    Err(RecvError::Lagged(_)) => self.rebase(tree),
                    // The tree is going (the node stops): hold on, so the
                    // parent does not ask again at once.
                    Err(RecvError::Closed) => tokio::select! {
                        () = &mut hold => break,
                        () = stop.cancelled() => break,
                    },
                },
                () = &mut hold => break,
                () = stop.cancelled() => break,
            }
        }
        // What came with the first change comes in the same answer.
        self.take_queued(tree);
        self.answer(tree)
    }

    fn answer(&mut self, tree: &Tree) -> Changes {
        let mut nodes = Vec::new();
        while nodes.len() < MAX_NODES {
            let Some(id) = self.dirty.pop_first() else {
                break;
            };
            // Gone since: its stop is on its way.
            let Some(n) = tree.get(id) else { continue };
            let root = n.parent.is_none_or(|p| self.scopes.contains(&p));
            let child = root
                .then(|| n.summary.get("agent").and_then(Value::as_str))
                .flatten()
                .map(str::to_owned);
            nodes.push(MirrorNode {
                id,
                parent: n.parent.filter(|_| !root),
                child,
                form: n.form,
                kind: n.kind,
                name: n.name,
                status: n.status,
                started_ms: n.started_ms,
                summary: n.summary,
            });
        }
        let take = self.stops.len().min(MAX_STOPS);
        let stopped = self.stops.drain(..take).collect();
        self.cursor += 1;
        let reset = std::mem::take(&mut self.reset);
        Changes {
            cursor: self.cursor,
            reset,
            more: !self.dirty.is_empty() || !self.stops.is_empty(),
            nodes,
            stopped,
        }
    }
}

/// Whether a node in a parent's scope is a child's own: an agent's scope,
/// or its parked node (not a turn task).
fn is_child_node(kind: &str) -> bool {
    matches!(kind, "scope" | "agent")
}

/// A node of the host shown here.
struct Shown {
    local: u64,
    child: Arc<str>,
    root: bool,
}

/// What a waiting node waits for.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Wait {
    /// Its parent, by id on the host.
    Parent(u64),
    /// The part of its child.
    Part(String),
    /// Its child's name (a child's own node that has not said whose).
    Name,
}

impl Wait {
    fn of(n: &MirrorNode) -> Wait {
        match (&n.parent, &n.child) {
            (Some(p), _) => Wait::Parent(*p),
            (None, Some(c)) => Wait::Part(c.clone()),
            (None, None) => Wait::Name,
        }
    }
}

/// This node's view of one host's subtrees (see the module docs).
#[derive(Default)]
struct View {
    /// Children placed there: child id → the part that stands for it here.
    parts: HashMap<String, u64>,
    /// Host node id → the node shown here.
    shown: HashMap<u64, Shown>,
    /// Nodes whose parent (or child's part) is not known yet.
    waiting: HashMap<u64, MirrorNode>,
    /// The waiting nodes by what they wait for.
    blocked: HashMap<Wait, Vec<u64>>,
    /// Whether the bound on nodes shown was reached (said once).
    full: bool,
    /// While a fresh start is read: the host nodes it sent.
    fresh: Option<HashSet<u64>>,
    lost: bool,
}

/// The mirror of one host's subtrees in this process's tree.
pub(super) struct Mirror {
    /// The host's node name, on every node shown.
    node: Arc<str>,
    view: Mutex<View>,
    tree: OnceLock<Arc<Tree>>,
    following: AtomicBool,
    /// Bumped after each answer applied.
    applied: tokio::sync::watch::Sender<u64>,
}

impl Mirror {
    /// The mirror of node `node`'s host, following nothing yet.
    pub(super) fn new(node: &str) -> Mirror {
        Mirror {
            node: Arc::from(node),
            view: Mutex::default(),
            tree: OnceLock::new(),
            following: AtomicBool::new(false),
            applied: tokio::sync::watch::Sender::new(0),
        }
    }

    /// Whether the caller is the one to start following (the first call).
    pub(super) fn start(&self, tree: &Arc<Tree>) -> bool {
        let _ = self.tree.set(tree.clone());
        !self.following.swap(true, Ordering::AcqRel)
    }

    /// The child `child` is shown here by part `part`.
    pub(super) fn placed(&self, child: &str, part: u64) {
        let Some(tree) = self.tree.get() else { return };
        let mut view = lock(&self.view);
        view.parts.insert(child.to_owned(), part);
        if view.lost {
            tree.lose(part);
        }
        view.release(tree, &self.node, Wait::Part(child.to_owned()));
        drop(view);
        self.applied.send_modify(|n| *n += 1);
    }

    /// The child `child` was closed: what is shown of it goes.
    pub(super) fn forget(&self, child: &str) {
        let Some(tree) = self.tree.get() else { return };
        let mut view = lock(&self.view);
        view.parts.remove(child);
        view.remove(tree, "closed with its proxy", |_, s| &*s.child == child);
        drop(view);
        self.applied.send_modify(|n| *n += 1);
    }

    /// The host is lost: everything shown of it, and the parts, are marked.
    pub(super) fn lose(&self) {
        let Some(tree) = self.tree.get() else { return };
        let mut view = lock(&self.view);
        view.lost = true;
        for s in view.shown.values() {
            tree.lose(s.local);
        }
        for part in view.parts.values() {
            tree.lose(*part);
        }
        drop(view);
        self.applied.send_modify(|n| *n += 1);
    }

    /// Applies one answer of the host.
    fn apply(&self, changes: Changes) {
        let Some(tree) = self.tree.get() else { return };
        let node = &self.node;
        let mut view = lock(&self.view);
        if changes.reset {
            view.fresh = Some(HashSet::new());
            view.waiting.clear();
            view.blocked.clear();
        }
        for n in changes.nodes {
            let id = n.id;
            if let Some(fresh) = &mut view.fresh {
                fresh.insert(id);
            }
            if view.upsert(tree, node, n) {
                view.release(tree, node, Wait::Parent(id));
            }
        }
        for s in changes.stopped {
            view.unwait(s.id);
            if let Some(shown) = view.shown.remove(&s.id) {
                tree.unmirror(shown.local, s.status, &clean(&s.reason));
            }
        }
        if !changes.more
            && let Some(fresh) = view.fresh.take()
        {
            view.remove(tree, "gone from its node's tree", |id, _| {
                !fresh.contains(id)
            });
        }
        drop(view);
        self.applied.send_modify(|n| *n += 1);
    }

    /// Whether every child placed there shows its own node here (or the
    /// host is lost).
    fn rooted(&self) -> bool {
        let view = lock(&self.view);
        if view.lost {
            return true;
        }
        let rooted: HashSet<&str> = view
            .shown
            .values()
            .filter(|s| s.root)
            .map(|s| &*s.child)
            .collect();
        view.parts.keys().all(|c| rooted.contains(c.as_str()))
    }

    /// Waits until [`Mirror::rooted`], up to `deadline`; whether it is.
    pub(super) async fn rooted_by(&self, deadline: tokio::time::Instant) -> bool {
        let mut applied = self.applied.subscribe();
        loop {
            if self.rooted() {
                return true;
            }
            match tokio::time::timeout_at(deadline, applied.changed()).await {
                Ok(Ok(())) => {}
                _ => return self.rooted(),
            }
        }
    }
}

impl View {
    /// Stops showing the nodes `which` picks, children before their
    /// parents (they were shown after them).
    fn remove(&mut self, tree: &Tree, reason: &str, which: impl Fn(&u64, &Shown) -> bool) {
        let mut gone: Vec<(u64, u64)> = self
            .shown
            .iter()
            .filter(|(id, s)| which(id, s))
            .map(|(id, s)| (s.local, *id))
            .collect();
        gone.sort_unstable_by(|a, b| b.cmp(a));
        for (local, id) in gone {
            self.shown.remove(&id);
            tree.unmirror(local, Status::Disposed, reason);
        }
    }

    /// Shows `n` (or updates it); waits when its parent is not known.
    /// Shown and waiting nodes of one host are at most [`MAX_SHOWN`].
    /// Whether it is newly shown (what waits for it may follow: see
    /// [`View::release`]).
    fn upsert(&mut self, tree: &Tree, node: &Arc<str>, mut n: MirrorNode) -> bool {
        n.summary = bounded(n.summary);
        if let Some(s) = self.shown.get(&n.id) {
            tree.update_mirror(s.local, n.status, n.summary);
            return false;
        }
        self.unwait(n.id);
        let at = match Wait::of(&n) {
            Wait::Part(child) => self
                .parts
                .get(&child)
                .map(|part| (*part, Arc::<str>::from(child.as_str()), true)),
            Wait::Parent(p) => self
                .shown
                .get(&p)
                .map(|s| (s.local, s.child.clone(), false)),
            Wait::Name => None,
        };
        if self.shown.len() + self.waiting.len() >= MAX_SHOWN {
            if !std::mem::replace(&mut self.full, true) {
                tracing::warn!(
                    "mirror: node `{node}` sent more than {MAX_SHOWN} nodes; no more are shown"
                );
            }
            return false;
        }
        let Some((parent, child, root)) = at else {
            self.blocked.entry(Wait::of(&n)).or_default().push(n.id);
            self.waiting.insert(n.id, n);
            return false;
        };
        let id = n.id;
        let local = tree.mirror(
            parent,
            Mirrored {
                node: node.clone(),
                form: n.form,
                kind: clean(&n.kind),
                name: clean(&n.name),
                status: n.status,
                started_ms: n.started_ms,
                summary: n.summary,
            },
        );
        if self.lost {
            tree.lose(local);
        }
        self.shown.insert(id, Shown { local, child, root });
        true
    }

    /// Ends the wait of node `id`, if it waits.
    fn unwait(&mut self, id: u64) {
        let Some(n) = self.waiting.remove(&id) else {
            return;
        };
        let key = Wait::of(&n);
        if let Some(ids) = self.blocked.get_mut(&key) {
            ids.retain(|w| *w != id);
            if ids.is_empty() {
                self.blocked.remove(&key);
            }
        }
    }

    /// Shows the nodes that waited for `what`, and in turn the ones that
    /// waited for those (a loop, not a recursion: a chain may be long).
    fn release(&mut self, tree: &Tree, node: &Arc<str>, what: Wait) {
        let mut next = vec![what];
        while let Some(what) = next.pop() {
            for id in self.blocked.remove(&what).unwrap_or_default() {
                if let Some(n) = self.waiting.remove(&id)
                    && self.upsert(tree, node, n)
                {
                    next.push(Wait::Parent(id));
                }
            }
        }
    }
}

/// At most [`MAX_TEXT`] bytes of `s`, cut at a character boundary, with
/// control characters (newlines, terminal escapes) replaced: a host's
/// names are shown in this node's terminal and page.
fn clean(s: &str) -> String {
    let mut end = s.len().min(MAX_TEXT);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end]
        .chars()
        .map(|c| if c.is_control() { '\u{fffd}' } else { c })
        .collect()
}

/// A summary of at most [`MAX_SUMMARY`] bytes as JSON; a larger one is
/// replaced by a note of its size.
fn bounded(summary: Value) -> Value {
    let len = serde_json::to_vec(&summary).map_or(0, |v| v.len());
    if len <= MAX_SUMMARY {
        summary
    } else {
        serde_json::json!({ "omitted": format!("a summary of {len} bytes") })
    }
}

/// The `mirror/<host>` task: asks `host` for what changed in the subtrees
/// of this node's (`me`) children there, and applies it, until the host is
/// lost (its nodes are then marked) or `stop`.
pub(super) async fn follow(host: Arc<RemoteHost>, me: String, stop: CancellationToken) {
    let mut cursor = None;
    let mut backoff = Duration::from_secs(1);
    loop {
        let ask = Request::Watch {
            node: me.clone(),
            cursor,
        };
        let answer = tokio::select! {
            r = host.call::<Changes>(&ask, WATCH_HOLD + WATCH_SLACK) => r,
            () = stop.cancelled() => return,
        };
        match answer {
            Ok(changes) => {
                cursor = Some(changes.cursor);
                backoff = Duration::from_secs(1);
                host.mirror.apply(changes);
            }
            // Lost, as the cluster says (a watch that timed out alone is
            // not: it is asked again).
            Err(e) if e.code == NODE_DOWN && host.lost().is_cancelled() => {
                host.mirror.lose();
                return;
            }
            Err(e) => {
                tracing::warn!("mirror: watching node `{}`: {e}", host.node());
                cursor = None;
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    () = stop.cancelled() => return,
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsh_supervisors::tree::TreeLimits;

    fn summary(v: Value) -> Arc<dsh_supervisors::tree::SummaryFn> {
        Arc::new(move || v.clone())
    }

    /// A host's tree: a scope of parent node `a` holding child `c1` (an
    /// agent with a tool call in it), and a scope of another node.
    fn host_tree() -> (Tree, u64, u64) {
        let tree = Tree::new(TreeLimits::default());
        let scope = tree.park("scope", "parent/a/p1".into(), None, summary(Value::Null));
        let child = tree.park(
            "agent",
            "subagent/c1".into(),
            Some(scope),
            summary(serde_json::json!({"agent": "c1", "turn": 1})),
        );
        tree.park("tool", "bash/1".into(), Some(child), summary(Value::Null));
        let other = tree.park("scope", "parent/z/p9".into(), None, summary(Value::Null));
        tree.park(
            "agent",
            "subagent/c9".into(),
            Some(other),
            summary(serde_json::json!({"agent": "c9"})),
        );
        (tree, scope, child)
    }

    /// The mirrored nodes of `tree`, as (name, parent, status, node).
    fn shown(tree: &Tree) -> Vec<(String, Option<u64>, Status, Option<String>)> {
        tree.snapshot()
            .into_iter()
            .filter(|n| n.node.is_some())
            .map(|n| (n.name, n.parent, n.status, n.node))
            .collect()
    }

    #[tokio::test]
    async fn a_parents_tree_shows_its_childrens_subtrees_as_the_host_changes_them() {
        let (host, scope, child) = host_tree();
        let mut watcher = Watcher::new(&host, "a");
        let stop = CancellationToken::new();
        let first = watcher.next(&host, None, &stop).await;
        // Only `a`'s child and what is under it; the scope is not sent.
        assert!(first.reset && !first.more);
        let names: Vec<&str> = first.nodes.iter().map(|n| n.name.as_str()).collect();
        assert_eq!(names, ["subagent/c1", "bash/1"]);
        assert_eq!(first.nodes[0].child.as_deref(), Some("c1"));
        assert_eq!(first.nodes[0].parent, None);
        assert_eq!(first.nodes[1].parent, Some(child));

        let parent = Arc::new(Tree::new(TreeLimits::default()));
        let part = parent.park(
            "remote-child",
            "b/subagent/c1".into(),
            None,
            summary(Value::Null),
        );
        let mirror = Mirror::new("b");
        assert!(mirror.start(&parent));
        assert!(!mirror.start(&parent), "followed once");
        // The answer comes before the part is placed: the nodes wait.
        mirror.apply(first);
        assert!(shown(&parent).is_empty());
        assert!(!mirror.rooted() || lock(&mirror.view).parts.is_empty());
        mirror.placed("c1", part);
        assert!(mirror.rooted());
        let now = shown(&parent);
        assert_eq!(now.len(), 2, "{now:?}");
        assert_eq!(now[0].0, "subagent/c1");
        assert_eq!(now[0].1, Some(part));
        assert_eq!(now[0].3.as_deref(), Some("b"));
        let agent_here = parent
            .snapshot()
            .into_iter()
            .find(|n| n.name == "subagent/c1");
        let agent_here = agent_here.map(|n| n.id).unwrap_or_default();
        assert_eq!(now[1].1, Some(agent_here));
        let text = dsh_supervisors::tree::render(&parent.snapshot());
        assert!(text.contains("subagent/c1 [agent] hibernated"), "{text}");
        assert!(text.contains("part on b"), "{text}");

        // A new node, and a stop (with its parent in this answer).
        let hook = host.park("hook", "hook/1".into(), Some(child), summary(Value::Null));
        let tool = host
            .snapshot()
            .into_iter()
            .find(|n| n.name == "bash/1")
            .map(|n| n.id);
        host.unpark(tool.unwrap_or_default(), Status::Disposed, "done");
        let cursor = Some(1);
        let second = watcher.next(&host, cursor, &stop).await;
        assert!(!second.reset);
        assert_eq!(second.nodes.len(), 1);
        assert_eq!(second.nodes[0].id, hook);
        assert_eq!(second.stopped.len(), 1);
        assert_eq!(second.stopped[0].reason, "done");
        mirror.apply(second);
        let names: Vec<String> = shown(&parent).into_iter().map(|n| n.0).collect();
        assert_eq!(names, ["subagent/c1", "hook/1"]);
        let stopped = parent.stopped_nodes();
        assert!(
            stopped
                .iter()
                .any(|n| n.name == "bash/1" && n.stop_reason.as_deref() == Some("done")),
            "{stopped:?}"
        );

        // A parent that missed an answer (it names an older one) gets
        // everything afresh; what it shows stays, with the same ids.
        let before: Vec<u64> = parent.snapshot().iter().map(|n| n.id).collect();
        let again = watcher.next(&host, Some(1), &stop).await;
        assert!(again.reset);
        assert_eq!(again.nodes.len(), 2);
        mirror.apply(again);
        let after: Vec<u64> = parent.snapshot().iter().map(|n| n.id).collect();
        assert_eq!(before, after);

        // Nothing changed: a stopped watch answers empty (no hold).
        let stopped_now = CancellationToken::new();
        stopped_now.cancel();
        let idle = watcher.next(&host, Some(3), &stopped_now).await;
        assert!(!idle.reset && idle.nodes.is_empty() && idle.stopped.is_empty());

        // The host is lost: the subtree and the part are marked.
        mirror.lose();
        let statuses: Vec<Status> = shown(&parent).into_iter().map(|n| n.2).collect();
        assert_eq!(statuses, [Status::Lost, Status::Lost]);
        assert_eq!(parent.get(part).map(|n| n.status), Some(Status::Lost));
        // Closed with its proxy: what is shown of it goes.
        mirror.forget("c1");
        assert!(shown(&parent).is_empty());
        let _ = scope;
    }

    #[tokio::test]
    async fn hostile_answers_show_no_more_than_they_may() {
        let parent = Arc::new(Tree::new(TreeLimits::default()));
        let part = parent.park(
            "remote-child",
            "b/subagent/c1".into(),
            None,
            summary(Value::Null),
        );
        let local = parent.park("agent", "mine".into(), None, summary(Value::Null));
        let mirror = Mirror::new("b");
        mirror.start(&parent);
        mirror.placed("c1", part);
        let node = |id: u64, parent: Option<u64>, child: Option<&str>, name: String| MirrorNode {
            id,
            parent,
            child: child.map(str::to_owned),
            form: dsh_supervisors::tree::Form::Actor,
            kind: "x".repeat(1000),
            name,
            status: Status::Active,
            started_ms: 0,
            summary: Value::Null,
        };
        mirror.apply(Changes {
            cursor: 1,
            nodes: vec![
                // Its name is cut to the bound, at a character boundary.
                node(1, None, Some("c1"), "é".repeat(500)),
                // Claims a child that is not placed here, and a parent
                // that was never sent: both wait, shown nowhere.
                node(2, None, Some("someone-else"), "stray".into()),
                node(3, Some(77), None, "orphan".into()),
            ],
            ..Changes::default()
        });
        let now = parent.snapshot();
        let mirrored: Vec<_> = now.iter().filter(|n| n.node.is_some()).collect();
        assert_eq!(mirrored.len(), 1, "{now:?}");
        assert!(mirrored[0].name.len() <= MAX_TEXT && mirrored[0].kind.len() <= MAX_TEXT);
        assert_eq!(lock(&mirror.view).waiting.len(), 2);
        // A stop of a waiting node ends its wait.
        mirror.apply(Changes {
            cursor: 2,
            stopped: vec![MirrorStop {
                id: 3,
                status: Status::Disposed,
                reason: "r".into(),
            }],
            ..Changes::default()
        });
        assert_eq!(lock(&mirror.view).waiting.len(), 1);
        // A node of this process is no mirror: an answer cannot change it.
        parent.update_mirror(local, Status::Failed, Value::Null);
        assert_eq!(
            parent.get(local).map(|n| n.status),
            Some(Status::Hibernated)
        );
        assert_eq!(parent.unmirror(local, Status::Failed, "no"), None);
    }

    #[tokio::test]
    async fn a_long_chain_sent_leaves_first_is_shown_without_recursion_and_text_is_cleaned() {
        let parent = Arc::new(Tree::new(TreeLimits::default()));
        let part = parent.park(
            "remote-child",
            "b/subagent/c1".into(),
            None,
            summary(Value::Null),
        );
        let mirror = Mirror::new("b");
        mirror.start(&parent);
        mirror.placed("c1", part);
        let depth = 20_000u64;
        let node = |id: u64, parent: Option<u64>| MirrorNode {
            id,
            parent,
            child: parent.is_none().then(|| "c1".to_owned()),
            form: dsh_supervisors::tree::Form::Task,
            kind: "k".into(),
            name: format!("n{id}\n\u{1b}[2Jforged"),
            status: Status::Active,
            started_ms: 0,
            // One summary too large to show (the root's).
            summary: match parent {
                None => serde_json::json!({"blob": "x".repeat(MAX_SUMMARY)}),
                Some(_) => Value::Null,
            },
        };
        // Deepest first: each waits for its parent, until the root comes.
        let mut nodes: Vec<MirrorNode> =
            (1..depth).rev().map(|id| node(id + 1, Some(id))).collect();
        nodes.push(node(1, None));
        mirror.apply(Changes {
            cursor: 1,
            nodes,
            ..Changes::default()
        });
        let shown: Vec<NodeSnapshot> = parent
            .snapshot()
            .into_iter()
            .filter(|n| n.node.is_some())
            .collect();
        assert_eq!(shown.len() as u64, depth);
        assert!(lock(&mirror.view).waiting.is_empty());
        assert!(lock(&mirror.view).blocked.is_empty());
        let root = shown.iter().find(|n| n.parent == Some(part)).unwrap();
        assert!(!root.name.chars().any(char::is_control), "{:?}", root.name);
        assert!(
            root.name.starts_with("n1\u{fffd}\u{fffd}[2Jforged"),
            "{:?}",
            root.name
        );
        let omitted = root.summary["omitted"].as_str();
        assert!(
            omitted.is_some_and(|s| s.contains("bytes")),
            "{:?}",
            root.summary
        );
    }
}
