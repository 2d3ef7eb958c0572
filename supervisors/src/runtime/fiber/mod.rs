//! Fibers: one loaded plugin (or scope) instance, run by a ractor actor.
//!
//! A fiber owns its effects and its children, both kept in start order. It
//! is the supervisor of its children: their failures reach its actor as
//! ractor supervision events and are answered with the fiber's strategy.
//! Teardown is ordered: children in reverse start order (each drained and
//! awaited up to its shutdown budget, then killed), then the fiber's own
//! effects in reverse registration order.
//!
//! - this file: a fiber's shared record ([`FiberShared`]) and its
//!   bookkeeping (effects, preludes, children in start order, phase);
//! - [`load`]: spawning a fiber, applying its plugin, reloading on service changes;
//! - [`actor`]: the actor that runs each fiber's messages;
//! - [`teardown`]: ordered teardown and stopping one node;
//! - [`supervise`]: restart policies, strategies and intensity;
//! - [`task`]: task children, one-shot work supervised without a mailbox.
//!
//! This is the only code that stops or kills another actor (drain, kill,
//! stop); an actor elsewhere may only end itself.

mod actor;
mod load;
mod supervise;
mod task;
mod teardown;

use std::any::Any;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Instant;

use futures::future::BoxFuture;
use ractor::{ActorCell, ActorRef};
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::policy::{ChildPolicy, SupervisorSpec};
use crate::runtime::Runtime;
use crate::runtime::context::Context;
use crate::runtime::plugin::ErasedPlugin;
use crate::scope::ScopeKey;
use crate::tree::{Form, Node, NodeInfo, Status, now_ms};

pub(crate) use load::{ensure_actor, spawn_fiber};
pub use task::{TaskEnd, TaskRef};
pub(crate) use task::{inline as inline_task, spawn as spawn_task};
pub(crate) use teardown::{dispose_effect, shutdown_fiber, stop_node};

pub(crate) enum DisposeFn {
    Sync(Box<dyn FnOnce() + Send>),
    Async(Box<dyn FnOnce() -> BoxFuture<'static, ()> + Send>),
}

struct EffectEntry {
    label: Arc<str>,
    run: DisposeFn,
}

/// Starts a worker again after a failure: returns the new actor cell.
pub(crate) type WorkerStart =
    Arc<dyn Fn(Context) -> BoxFuture<'static, Result<(ActorCell, Arc<Node>)>> + Send + Sync>;

#[derive(Clone)]
pub(crate) enum ChildKind {
    Fiber(Arc<FiberShared>),
    Worker {
        cell: ActorCell,
        start: Option<WorkerStart>,
    },
    Task(Arc<task::TaskShared>),
    /// A passive part of its owner: a node in the tree with nothing running
    /// (a session with no store to write). Stopping it only records it.
    Part,
}

#[derive(Clone)]
pub(crate) struct ChildEntry {
    pub node: Arc<Node>,
    /// The ractor pid, to match supervision events (`None` for a task or a
    /// part).
    pub pid: Option<u64>,
    pub policy: ChildPolicy,
    pub kind: ChildKind,
}

/// What a plugin fiber loads (and re-loads on restart).
#[derive(Clone)]
pub(crate) struct LoadSpec {
    pub plugin: Arc<dyn ErasedPlugin>,
    pub config: Arc<dyn Any + Send + Sync>,
}

#[derive(Default)]
struct FiberInner {
    next_seq: u64,
    // Entries boxed, here and in `children`: a map's first node holds room
    // for 11 of them, and most fibers (an agent's scope) have a few.
    effects: BTreeMap<u64, Box<EffectEntry>>,
    /// Run first on unload, before the children stop (stop accepting input,
    /// cancel running work).
    preludes: Vec<EffectEntry>,
    children: BTreeMap<u64, Box<ChildEntry>>,
    loaded_with: Option<Vec<u64>>,
    restarts: VecDeque<Instant>,
    supervisor: SupervisorSpec,
    error: Option<String>,
    stop_order: Option<Arc<[u64]>>,
    unannounced: Vec<(Option<ScopeKey>, String)>,
}

/// Phase published to waiters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Phase {
    pub status: Status,
    pub stopped: bool,
}

/// The shared part of a fiber; its actor and its contexts point here.
pub(crate) struct FiberShared {
    pub id: u64,
    pub node: Arc<Node>,
    pub parent: Option<Weak<FiberShared>>,
    pub scope: Option<ScopeKey>,
    pub load: Option<LoadSpec>,
    pub policy: ChildPolicy,
    /// Set at once for a plugin fiber; for a scope, once something under
    /// it needs a supervisor actor ([`load::ensure_actor`]).
    actor: OnceLock<ActorRef<FiberMsg>>,
    /// The teardown of a scope that never needed its actor (a task of its
    /// own), to abort when it is killed.
    teardown: OnceLock<tokio::task::AbortHandle>,
    inner: Mutex<FiberInner>,
    phase: watch::Sender<Phase>,
    dispose_requested: AtomicBool,
}

pub(crate) enum FiberMsg {
    /// Injected services may have changed: load, unload or reload.
    Reevaluate,
    /// Ordered teardown, then stop. `chain` lists the fibers whose teardown
    /// is waiting on this one; `from_parent` is false for a direct dispose.
    Dispose {
        chain: Arc<[u64]>,
        from_parent: bool,
    },
    /// Unload and load again with the current config.
    Restart,
}

// Local only: a fiber is never reached from another node.
impl ractor::Message for FiberMsg {}

impl FiberShared {
    pub fn name(&self) -> &str {
        &self.node.info.name
    }

    pub fn status(&self) -> Status {
        self.node.stats.status()
    }

    fn lock(&self) -> MutexGuard<'_, FiberInner> {
        // A poisoned lock only means a panic happened while it was held;
        // the data is plain bookkeeping and stays usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn actor(&self) -> Option<&ActorRef<FiberMsg>> {
        self.actor.get()
    }

    /// Records the pid of the actor a child scope started late, so its
    /// exits are matched to it.
    fn set_child_pid(&self, id: u64, pid: u64) {
        if let Some(child) = self
            .lock()
            .children
            .values_mut()
            .find(|c| c.node.info.id == id)
        {
            child.pid = Some(pid);
        }
    }

    pub fn inject(&self) -> &[&'static str] {
        self.load.as_ref().map(|l| l.plugin.inject()).unwrap_or(&[])
    }

    pub fn error(&self) -> Option<String> {
        self.lock().error.clone()
    }

    pub fn stop_order(&self) -> Option<Arc<[u64]>> {
        self.lock().stop_order.clone()
    }

    /// Remembers a service provided while loading, announced on activation.
    pub fn note_provided(&self, scope: Option<ScopeKey>, name: &str) {
        self.lock().unannounced.push((scope, name.to_owned()));
    }

    pub fn take_unannounced(&self) -> Vec<(Option<ScopeKey>, String)> {
        std::mem::take(&mut self.lock().unannounced)
    }

    pub fn set_supervisor(&self, spec: SupervisorSpec) {
        self.lock().supervisor = spec;
    }

    pub fn subscribe(&self) -> watch::Receiver<Phase> {
        self.phase.subscribe()
    }

    fn set_status(&self, rt: &Runtime, status: Status) {
        rt.tree().set_status(&self.node, status);
        self.phase.send_modify(|p| p.status = status);
    }

    fn accepting(&self) -> std::result::Result<(), Error> {
        match self.status() {
            Status::Pending | Status::Loading | Status::Active => Ok(()),
            _ => Err(self.inactive()),
        }
    }

    /// The refusal of a fiber that takes no more children or effects.
    pub fn inactive(&self) -> Error {
        Error::InactiveFiber {
            fiber: format!("{}#{}", self.name(), self.id),
            state: self.status().as_str(),
        }
    }

    /// Puts a node for a new child of this fiber in the tree.
    pub fn child_node(
        &self,
        rt: &Runtime,
        form: Form,
        kind: &str,
        name: &str,
        status: Status,
        summary: serde_json::Value,
    ) -> Arc<Node> {
        rt.tree().insert_summarized(
            NodeInfo {
                id: rt.next_id(),
                form,
                kind: Arc::from(kind),
                name: Arc::from(name),
                parent: Some(self.id),
                started_ms: now_ms(),
                node: None,
            },
            status,
            summary,
        )
    }

    /// Registers a disposer; refused once the fiber is unloading (the
    /// disposer is handed back with the refusal, not run).
    pub fn add_effect(
        &self,
        label: Arc<str>,
        run: DisposeFn,
    ) -> std::result::Result<u64, (Error, DisposeFn)> {
        let mut inner = self.lock();
        if let Err(e) = self.accepting() {
            return Err((e, run));
        }
        inner.next_seq += 1;
        let seq = inner.next_seq;
        inner
            .effects
            .insert(seq, Box::new(EffectEntry { label, run }));
        Ok(seq)
    }

    /// Registers a teardown prelude: it runs when the fiber starts unloading,
    /// before its children are stopped (preludes run in reverse order).
    pub fn add_prelude(&self, label: Arc<str>, run: DisposeFn) -> Result<()> {
        let mut inner = self.lock();
        self.accepting()?;
        inner.preludes.push(EffectEntry { label, run });
        Ok(())
    }

    /// Takes one effect out (the disposer was called early).
    fn take_effect(&self, seq: u64) -> Option<EffectEntry> {
        self.lock().effects.remove(&seq).map(|e| *e)
    }

    pub fn effect_count(&self) -> usize {
        self.lock().effects.len()
    }

    pub fn child_count(&self) -> usize {
        self.lock().children.len()
    }

    /// Drops one effect without running it.
    pub(crate) fn forget_effect(&self, seq: u64) {
        drop(self.take_effect(seq));
    }

    pub fn effect_labels(&self) -> Vec<String> {
        self.lock()
            .effects
            .values()
            .map(|e| e.label.to_string())
            .collect()
    }

    /// Records a started child; refused once the fiber is unloading (the
    /// caller must then stop the child it just started).
    pub fn add_child(&self, entry: ChildEntry) -> std::result::Result<u64, ChildEntry> {
        let mut inner = self.lock();
        if self.accepting().is_err() {
            return Err(entry);
        }
        inner.next_seq += 1;
        let seq = inner.next_seq;
        inner.children.insert(seq, Box::new(entry));
        Ok(seq)
    }

    /// Records a child just made for this fiber (a worker, a task, a part)
    /// as its newest. A fiber that no longer takes children (it is
    /// unloading) kills a worker instead, marks the node failed and refuses.
    pub fn adopt(&self, rt: &Runtime, entry: ChildEntry) -> Result<u64> {
        match self.add_child(entry) {
            Ok(seq) => Ok(seq),
            Err(entry) => {
                if let ChildKind::Worker { cell, .. } = &entry.kind {
                    cell.kill();
                }
                rt.tree()
                    .stopped(entry.node.info.id, Status::Failed, "owner is shutting down");
                Err(self.inactive())
            }
        }
    }

    /// Moves the child recorded at `from` to start-order position `to`.
    fn move_child_seq(&self, from: u64, to: u64) {
        let mut inner = self.lock();
        if !inner.children.contains_key(&to)
            && let Some(entry) = inner.children.remove(&from)
        {
            inner.children.insert(to, entry);
        }
    }

    /// Moves the child with node id `id` to start-order position `to`.
    fn move_child(&self, id: u64, to: u64) {
        let from = self
            .lock()
            .children
            .iter()
            .find(|(_, c)| c.node.info.id == id)
            .map(|(s, _)| *s);
        if let Some(from) = from {
            self.move_child_seq(from, to);
        }
    }

    fn child_by_actor(&self, pid: u64) -> Option<u64> {
        self.lock()
            .children
            .iter()
            .find(|(_, c)| c.pid == Some(pid))
            .map(|(seq, _)| *seq)
    }

    /// Drops the child with node id `id` from the children, if there.
    fn forget_child(&self, id: u64) {
        let gone = {
            let mut inner = self.lock();
            let seq = inner
                .children
                .iter()
                .find_map(|(seq, c)| (c.node.info.id == id).then_some(*seq));
            seq.and_then(|seq| inner.children.remove(&seq))
        };
        // Dropped outside the lock.
        drop(gone);
    }

    /// Drops the passive part with node id `id`; false when no part has it
    /// (another kind of child is never dropped this way).
    pub fn forget_part(&self, id: u64) -> bool {
        let mut inner = self.lock();
        let seq = inner.children.iter().find_map(|(seq, c)| {
            (c.node.info.id == id && matches!(c.kind, ChildKind::Part)).then_some(*seq)
        });
        seq.and_then(|seq| inner.children.remove(&seq)).is_some()
    }

    /// Drops the child recorded at `seq`, if there.
    fn forget_child_seq(&self, seq: u64) {
        let gone = self.lock().children.remove(&seq);
        drop(gone);
    }

    pub fn children_ids(&self) -> Vec<u64> {
        self.lock()
            .children
            .values()
            .map(|c| c.node.info.id)
            .collect()
    }

    /// Asks the fiber to tear down and stop; idempotent. A scope that never
    /// needed its actor tears down in a task of its own.
    fn request_dispose(self: &Arc<Self>, rt: &Runtime, chain: Arc<[u64]>, from_parent: bool) {
        // Decided under the fiber's lock, where `ensure_actor` installs a
        // late actor: either the actor exists and tears down, or no actor
        // will be installed.
        let actor = {
            let _inner = self.lock();
            if self.dispose_requested.swap(true, Ordering::AcqRel) {
                return;
            }
            self.actor.get().cloned()
        };
        let Some(actor) = actor else {
            let (rt, fiber) = (rt.clone(), self.clone());
            let task = tokio::spawn(async move {
                let status = teardown::dispose(&rt, &fiber, chain, from_parent).await;
                // A kill that came meanwhile has recorded its own end.
                fiber.phase.send_if_modified(|p| {
                    let first = !p.stopped;
                    if first {
                        p.status = status;
                        p.stopped = true;
                    }
                    first
                });
            });
            let _ = self.teardown.set(task.abort_handle());
            return;
        };
        if actor
            .send_message(FiberMsg::Dispose { chain, from_parent })
            .is_ok()
        {
            self.node.stats.enqueue();
        } else {
            self.phase.send_modify(|p| p.stopped = true);
        }
    }

    async fn wait_stopped(&self) {
        let mut rx = self.phase.subscribe();
        // An Err means the sender is gone, i.e. the fiber is gone.
        let _ = rx.wait_for(|p| p.stopped).await;
    }
}
