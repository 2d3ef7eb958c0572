//! Fibers: one loaded plugin (or scope) instance, run by a ractor actor.
//!
//! A fiber owns its effects and its children, both kept in start order. It
//! is the supervisor of its children: their failures reach its actor as
//! ractor supervision events and are answered with the fiber's strategy.
//! Teardown is ordered: children in reverse start order (each drained and
//! awaited up to its shutdown budget, then killed), then the fiber's own
//! effects in reverse registration order.

use std::any::Any;
use std::collections::{BTreeMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::{Duration, Instant};

use futures::FutureExt;
use futures::future::BoxFuture;
use ractor::{Actor, ActorCell, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::watch;

use crate::context::Context;
use crate::error::{Error, Result};
use crate::events::panic_text;
use crate::plugin::ErasedPlugin;
use crate::runtime::Runtime;
use crate::scope::ScopeKey;
use crate::tree::{Node, NodeInfo, Status, now_ms};

tokio::task_local! {
    /// Fibers whose teardown the current task is running (outermost first).
    static TEARDOWN_CHAIN: Arc<[u64]>;
}

fn current_chain() -> Arc<[u64]> {
    TEARDOWN_CHAIN
        .try_with(|c| c.clone())
        .unwrap_or_else(|_| Arc::from(Vec::new()))
}

fn extend_chain(chain: &[u64], id: u64) -> Arc<[u64]> {
    let mut v = chain.to_vec();
    v.push(id);
    Arc::from(v)
}

/// What happens to a child when it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Restart {
    /// Always restarted.
    Permanent,
    /// Restarted only when it failed.
    Transient,
    /// Never restarted; its failure is reported.
    Temporary,
}

/// How long a child may take to stop gracefully before it is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// Killed at once, no drain.
    BrutalKill,
    /// Drained, awaited this long, then killed.
    Timeout(Duration),
    /// Awaited without a limit (the OTP default for supervisors; bound it
    /// through the budgets of the leaves).
    Infinity,
}

/// Supervisor strategy of a fiber over its children.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Restart only the failed child.
    OneForOne,
    /// Stop every other child (reverse order) and restart all (start order).
    OneForAll,
    /// Stop the children started after the failed one, restart it and them.
    RestForOne,
}

/// A fiber's strategy and restart intensity.
#[derive(Clone, Copy, Debug)]
pub struct SupervisorSpec {
    /// Strategy.
    pub strategy: Strategy,
    /// Restarts allowed within `period`; one more and the fiber fails upward.
    pub intensity: u32,
    /// The sliding window for `intensity`.
    pub period: Duration,
}

impl Default for SupervisorSpec {
    fn default() -> Self {
        SupervisorSpec {
            strategy: Strategy::OneForOne,
            intensity: 3,
            period: Duration::from_secs(5),
        }
    }
}

/// Restart policy and shutdown budget of one child.
#[derive(Clone, Copy, Debug)]
pub struct ChildPolicy {
    /// Restart policy.
    pub restart: Restart,
    /// Shutdown budget.
    pub shutdown: Shutdown,
}

impl ChildPolicy {
    /// The default for workers: temporary, 5 s to drain.
    pub const WORKER: ChildPolicy = ChildPolicy {
        restart: Restart::Temporary,
        shutdown: Shutdown::Timeout(Duration::from_secs(5)),
    };
    /// The default for plugins: permanent, 60 s for the whole subtree.
    pub const PLUGIN: ChildPolicy = ChildPolicy {
        restart: Restart::Permanent,
        shutdown: Shutdown::Timeout(Duration::from_secs(60)),
    };
    /// The default for scopes: temporary, 60 s for the whole subtree.
    pub const SCOPE: ChildPolicy = ChildPolicy {
        restart: Restart::Temporary,
        shutdown: Shutdown::Timeout(Duration::from_secs(60)),
    };
}

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

pub(crate) enum ChildKind {
    Fiber(Arc<FiberShared>),
    Worker {
        cell: ActorCell,
        start: Option<WorkerStart>,
    },
}

pub(crate) struct ChildEntry {
    pub node: Arc<Node>,
    /// The ractor pid, to match supervision events.
    pub pid: u64,
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
    effects: BTreeMap<u64, EffectEntry>,
    /// Run first on unload, before the children stop (stop accepting input,
    /// cancel running work).
    preludes: Vec<EffectEntry>,
    children: BTreeMap<u64, ChildEntry>,
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
    actor: OnceLock<ActorRef<FiberMsg>>,
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

    pub fn cell(&self) -> Option<ActorCell> {
        self.actor.get().map(|a| a.get_cell())
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
            other => Err(Error::InactiveFiber {
                fiber: format!("{}#{}", self.name(), self.id),
                state: other.as_str(),
            }),
        }
    }

    /// Registers a disposer; refused once the fiber is unloading.
    pub fn add_effect(&self, label: Arc<str>, run: DisposeFn) -> Result<u64> {
        let mut inner = self.lock();
        self.accepting()?;
        inner.next_seq += 1;
        let seq = inner.next_seq;
        inner.effects.insert(seq, EffectEntry { label, run });
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
        self.lock().effects.remove(&seq)
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
        inner.children.insert(seq, entry);
        Ok(seq)
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
            .find(|(_, c)| c.pid == pid)
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

    pub fn children_ids(&self) -> Vec<u64> {
        self.lock()
            .children
            .values()
            .map(|c| c.node.info.id)
            .collect()
    }

    /// Asks the fiber to tear down and stop; idempotent.
    fn request_dispose(&self, chain: Arc<[u64]>, from_parent: bool) {
        if self.dispose_requested.swap(true, Ordering::AcqRel) {
            return;
        }
        let sent = self
            .actor
            .get()
            .map(|a| {
                a.send_message(FiberMsg::Dispose { chain, from_parent })
                    .is_ok()
            })
            .unwrap_or(false);
        if sent {
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

/// Disposes `fiber` (memoized) and waits for it, bounded by `budget`; kills
/// it when the budget runs out. Re-entrant calls from inside the fiber's own
/// teardown (or a descendant's) only make the request and return.
pub(crate) async fn shutdown_fiber(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    budget: Shutdown,
    from_parent: bool,
) {
    let chain = current_chain();
    if chain.contains(&fiber.id) {
        fiber.request_dispose(chain, from_parent);
        return;
    }
    if budget == Shutdown::BrutalKill {
        kill_fiber(rt, fiber, "brutal kill").await;
        return;
    }
    fiber.request_dispose(chain, from_parent);
    match budget {
        Shutdown::Timeout(t) => {
            if tokio::time::timeout(t, fiber.wait_stopped()).await.is_err() {
                tracing::warn!(
                    fiber = fiber.id,
                    name = fiber.name(),
                    ?t,
                    "fiber missed its shutdown budget; killing"
                );
                kill_fiber(rt, fiber, "killed after its shutdown budget").await;
            }
        }
        _ => fiber.wait_stopped().await,
    }
}

async fn kill_fiber(rt: &Runtime, fiber: &Arc<FiberShared>, reason: &str) {
    if let Some(actor) = fiber.actor() {
        // ractor kills every linked descendant with it; an Err means it had
        // already exited.
        let _ = actor.kill_and_wait(Some(Duration::from_secs(5))).await;
    }
    mark_killed(rt, fiber, reason);
}

/// Records a killed fiber and every node still under it as failed.
fn mark_killed(rt: &Runtime, fiber: &Arc<FiberShared>, reason: &str) {
    let children: Vec<ChildEntry> = std::mem::take(&mut fiber.lock().children)
        .into_values()
        .collect();
    for child in children {
        match &child.kind {
            ChildKind::Fiber(f) => mark_killed(rt, f, "killed with its parent"),
            ChildKind::Worker { .. } => {
                rt.tree()
                    .stopped(child.node.info.id, Status::Failed, "killed with its parent");
            }
        }
    }
    fiber.lock().effects.clear();
    fiber.lock().preludes.clear();
    fiber.node.stats.set_status(Status::Failed);
    rt.tree().stopped(fiber.id, Status::Failed, reason);
    fiber.phase.send_modify(|p| {
        p.status = Status::Failed;
        p.stopped = true;
    });
}

/// Stops one child the graceful way; returns the ids in the order they stopped.
async fn stop_child(rt: &Runtime, child: &ChildEntry) -> Vec<u64> {
    match &child.kind {
        ChildKind::Fiber(f) => {
            shutdown_fiber(rt, f, child.policy.shutdown, true).await;
            f.stop_order()
                .map(|o| o.to_vec())
                .unwrap_or_else(|| vec![f.id])
        }
        ChildKind::Worker { cell, .. } => {
            let id = child.node.info.id;
            rt.tree().set_status(&child.node, Status::Unloading);
            let graceful = match child.policy.shutdown {
                Shutdown::BrutalKill => false,
                Shutdown::Timeout(t) => cell.drain_and_wait(Some(t)).await.is_ok(),
                Shutdown::Infinity => cell.drain_and_wait(None).await.is_ok(),
            };
            if graceful {
                rt.tree().stopped(id, Status::Disposed, "drained");
            } else {
                if child.policy.shutdown != Shutdown::BrutalKill {
                    tracing::warn!(actor = id, name = %child.node.info.name, "worker missed its shutdown budget; killing");
                }
                let _ = cell.kill_and_wait(Some(Duration::from_secs(5))).await;
                let why = if child.policy.shutdown == Shutdown::BrutalKill {
                    "brutal kill"
                } else {
                    "killed after its shutdown budget"
                };
                rt.tree().stopped(id, Status::Failed, why);
            }
            vec![id]
        }
    }
}

/// Stops the children selected by `which` (reverse start order), keeping
/// each in the map until it has stopped so a kill can still find it.
async fn stop_children(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    which: impl Fn(u64) -> bool,
) -> Vec<(u64, ChildEntry, Vec<u64>)> {
    let seqs: Vec<u64> = fiber
        .lock()
        .children
        .keys()
        .copied()
        .filter(|s| which(*s))
        .collect();
    let mut out = Vec::new();
    for seq in seqs.into_iter().rev() {
        let Some((node, pid, policy, kind)) = ({
            let inner = fiber.lock();
            inner.children.get(&seq).map(|c| {
                (
                    c.node.clone(),
                    c.pid,
                    c.policy,
                    match &c.kind {
                        ChildKind::Fiber(f) => ChildKind::Fiber(f.clone()),
                        ChildKind::Worker { cell, start } => ChildKind::Worker {
                            cell: cell.clone(),
                            start: start.clone(),
                        },
                    },
                )
            })
        }) else {
            continue;
        };
        let entry = ChildEntry {
            node,
            pid,
            policy,
            kind,
        };
        let order = stop_child(rt, &entry).await;
        fiber.lock().children.remove(&seq);
        out.push((seq, entry, order));
    }
    out
}

/// The fiber that owns tree node `id` among `from`'s descendants, and the
/// child's key there.
fn owner_of(from: &Arc<FiberShared>, id: u64) -> Option<(Arc<FiberShared>, u64)> {
    let subs: Vec<Arc<FiberShared>> = {
        let inner = from.lock();
        if let Some(seq) = inner
            .children
            .iter()
            .find_map(|(seq, c)| (c.node.info.id == id).then_some(*seq))
        {
            return Some((from.clone(), seq));
        }
        inner
            .children
            .values()
            .filter_map(|c| match &c.kind {
                ChildKind::Fiber(f) => Some(f.clone()),
                ChildKind::Worker { .. } => None,
            })
            .collect()
    };
    subs.iter().find_map(|f| owner_of(f, id))
}

/// Stops the actor of tree node `id` wherever it is under `root`: its owner
/// forgets it first (so it is not restarted), then it stops the normal way
/// (drained, killed past its budget; a fiber tears its subtree down in
/// order). Returns the stop order, or `None` when no live child has that id.
pub(crate) async fn stop_node(rt: &Runtime, root: &Arc<FiberShared>, id: u64) -> Option<Vec<u64>> {
    let (owner, seq) = owner_of(root, id)?;
    let entry = owner.lock().children.remove(&seq)?;
    Some(stop_child(rt, &entry).await)
}

/// Runs effects in reverse registration order, each isolated from the others.
async fn run_effects(rt: &Runtime, fiber: &Arc<FiberShared>) {
    loop {
        let last = {
            let mut inner = fiber.lock();
            inner.effects.pop_last()
        };
        let Some((_, effect)) = last else { break };
        run_effect(rt, fiber.id, effect).await;
    }
}

async fn run_effect(rt: &Runtime, fiber_id: u64, effect: EffectEntry) {
    let outcome = match effect.run {
        DisposeFn::Sync(f) => std::panic::catch_unwind(AssertUnwindSafe(f)),
        DisposeFn::Async(f) => match std::panic::catch_unwind(AssertUnwindSafe(f)) {
            Ok(fut) => AssertUnwindSafe(fut).catch_unwind().await,
            Err(p) => Err(p),
        },
    };
    if let Err(panic) = outcome {
        let message = panic_text(&panic);
        tracing::error!(fiber = fiber_id, effect = %effect.label, message, "effect disposer panicked");
        rt.tree().supervision(
            fiber_id,
            fiber_id,
            &format!("disposer `{}` panicked: {message}", effect.label),
            "isolated",
        );
    }
}

/// Runs one early-disposed effect (a `Disposer` was called).
pub(crate) async fn dispose_effect(rt: &Runtime, fiber: &Arc<FiberShared>, seq: u64) {
    if let Some(effect) = fiber.take_effect(seq) {
        run_effect(rt, fiber.id, effect).await;
    }
}

/// Children (reverse), then effects (reverse). Returns the stop order of the children.
async fn unload(rt: &Runtime, fiber: &Arc<FiberShared>, chain: Arc<[u64]>) -> Vec<u64> {
    fiber.set_status(rt, Status::Unloading);
    let chain = extend_chain(&chain, fiber.id);
    TEARDOWN_CHAIN
        .scope(chain, async {
            let preludes = std::mem::take(&mut fiber.lock().preludes);
            for prelude in preludes.into_iter().rev() {
                run_effect(rt, fiber.id, prelude).await;
            }
            let stopped = stop_children(rt, fiber, |_| true).await;
            run_effects(rt, fiber).await;
            stopped
                .into_iter()
                .flat_map(|(_, _, order)| order)
                .collect()
        })
        .await
}

/// The actor behind every fiber.
pub(crate) struct FiberActor;

pub(crate) struct FiberState {
    pub rt: Runtime,
    pub fiber: Arc<FiberShared>,
}

impl Actor for FiberActor {
    type Msg = FiberMsg;
    type State = FiberState;
    type Arguments = FiberState;

    async fn pre_start(
        &self,
        _myself: ActorRef<FiberMsg>,
        args: FiberState,
    ) -> std::result::Result<FiberState, ActorProcessingErr> {
        Ok(args)
    }

    async fn handle(
        &self,
        myself: ActorRef<FiberMsg>,
        msg: FiberMsg,
        state: &mut FiberState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let FiberState { rt, fiber } = state;
        fiber.node.stats.handled();
        match msg {
            // Boxed (here and below): a fiber waiting for messages does not carry
            // the state of a teardown or a load in its task.
            FiberMsg::Reevaluate => Box::pin(reevaluate(rt, fiber)).await,
            FiberMsg::Restart => {
                if fiber.status() == Status::Active || fiber.status() == Status::Failed {
                    Box::pin(unload(rt, fiber, Arc::from(Vec::new()))).await;
                    fiber.lock().loaded_with = None;
                    fiber.lock().error = None;
                    fiber.set_status(rt, Status::Pending);
                    Box::pin(reevaluate(rt, fiber)).await;
                }
            }
            FiberMsg::Dispose { chain, from_parent } => {
                let final_status = if fiber.status() == Status::Failed {
                    Status::Failed
                } else {
                    Status::Disposed
                };
                let mut order = Box::pin(unload(rt, fiber, chain)).await;
                order.push(fiber.id);
                let order: Arc<[u64]> = Arc::from(order);
                fiber.lock().stop_order = Some(order.clone());
                fiber.node.stats.set_status(final_status);
                rt.tree().stopped(fiber.id, final_status, "disposed");
                if !from_parent {
                    rt.tree().teardown(fiber.id, order.to_vec());
                    // Out of its parent's children now, not when the parent
                    // gets to its exit: whoever awaited the dispose sees the
                    // parent without it (a deliberate dispose is removed,
                    // never restarted, so the parent has nothing to decide).
                    if let Some(parent) = fiber.parent.as_ref().and_then(Weak::upgrade) {
                        parent.forget_child(fiber.id);
                    }
                }
                myself.stop(Some("disposed".to_owned()));
                fiber.phase.send_modify(|p| {
                    p.status = final_status;
                    p.stopped = true;
                });
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        myself: ActorRef<FiberMsg>,
        evt: SupervisionEvent,
        state: &mut FiberState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let FiberState { rt, fiber } = state;
        let (cell, failure) = match evt {
            SupervisionEvent::ActorFailed(cell, err) => (cell, Some(err.to_string())),
            SupervisionEvent::ActorTerminated(cell, _, reason) => {
                let killed = reason.as_deref() == Some("killed");
                (cell, killed.then(|| "killed".to_owned()))
            }
            _ => return Ok(()),
        };
        if fiber.status() != Status::Active && fiber.status() != Status::Loading {
            return Ok(());
        }
        let pid = cell.get_id().pid();
        let Some(seq) = fiber.child_by_actor(pid) else {
            return Ok(());
        };
        let escalate = Box::pin(on_child_exit(rt, fiber, seq, failure)).await;
        if let Some(reason) = escalate {
            // Fail upward: tear everything down in order, then let ractor
            // report this actor's failure to our own supervisor.
            fiber.lock().error = Some(reason.clone());
            let mut order = Box::pin(unload(rt, fiber, Arc::from(Vec::new()))).await;
            order.push(fiber.id);
            fiber.lock().stop_order = Some(Arc::from(order));
            fiber.node.stats.set_status(Status::Failed);
            rt.tree().stopped(fiber.id, Status::Failed, &reason);
            fiber.phase.send_modify(|p| {
                p.status = Status::Failed;
                p.stopped = true;
            });
            if fiber.parent.is_none() {
                rt.root_failed(reason.clone());
                myself.stop(Some(reason));
                return Ok(());
            }
            return Err(reason.into());
        }
        Ok(())
    }
}

/// Applies the restart policy and strategy to a child that stopped on its
/// own. Returns `Some(reason)` when the fiber must fail upward.
async fn on_child_exit(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    seq: u64,
    failure: Option<String>,
) -> Option<String> {
    // The child is gone already: take its entry out first.
    let failed_entry = fiber.lock().children.remove(&seq)?;
    let (node, policy, child_fiber) = {
        let c = &failed_entry;
        let child_fiber = match &c.kind {
            ChildKind::Fiber(f) => Some(f.clone()),
            ChildKind::Worker { .. } => None,
        };
        (c.node.clone(), c.policy, child_fiber)
    };
    let child_id = node.info.id;
    // A fiber disposed on purpose is simply removed, whatever its policy.
    let deliberate = child_fiber
        .as_ref()
        .is_some_and(|f| f.dispose_requested.load(Ordering::Acquire) && failure.is_none());
    let failed = failure.is_some();
    let restart = !deliberate
        && match policy.restart {
            Restart::Permanent => true,
            Restart::Transient => failed,
            Restart::Temporary => false,
        };
    let message = failure.clone().unwrap_or_else(|| "exited".to_owned());
    if child_fiber.is_none() {
        let status = if failed {
            Status::Failed
        } else {
            Status::Disposed
        };
        rt.tree().stopped(child_id, status, &message);
    }
    if !restart {
        if failed {
            tracing::warn!(
                supervisor = fiber.id,
                child = child_id,
                message,
                "child failed; not restarted"
            );
            rt.tree()
                .supervision(fiber.id, child_id, &message, "removed");
        }
        return None;
    }
    // Intensity: more than `intensity` restarts within `period` escalates.
    let spec = {
        let mut inner = fiber.lock();
        let spec = inner.supervisor;
        let now = Instant::now();
        while inner
            .restarts
            .front()
            .is_some_and(|t| now.duration_since(*t) > spec.period)
        {
            inner.restarts.pop_front();
        }
        inner.restarts.push_back(now);
        if inner.restarts.len() as u32 > spec.intensity {
            drop(inner);
            rt.tree()
                .supervision(fiber.id, child_id, &message, "escalated");
            return Some(format!(
                "restart intensity exceeded ({} restarts in {:?}); last failure of {}: {message}",
                spec.intensity, spec.period, node.info.name
            ));
        }
        spec
    };
    tracing::info!(supervisor = fiber.id, child = child_id, strategy = ?spec.strategy, message, "restarting");
    // Stop the siblings the strategy names (reverse order), then start them
    // and the failed child again, in start order.
    let mut to_start: Vec<(u64, ChildEntry)> = Vec::new();
    match spec.strategy {
        Strategy::OneForOne => {}
        Strategy::OneForAll => {
            for (s, e, _) in stop_children(rt, fiber, |_| true).await {
                to_start.push((s, e));
            }
        }
        Strategy::RestForOne => {
            for (s, e, _) in stop_children(rt, fiber, |s| s > seq).await {
                to_start.push((s, e));
            }
        }
    }
    to_start.push((seq, failed_entry));
    to_start.sort_by_key(|(s, _)| *s);
    for (seq, entry) in to_start {
        if entry.policy.restart == Restart::Temporary {
            continue;
        }
        if let Err(e) = restart_child(rt, fiber, seq, entry).await {
            return Some(format!("could not restart a child: {e}"));
        }
    }
    rt.tree()
        .supervision(fiber.id, child_id, &message, "restarted");
    None
}

/// Starts a child again in its old place in the start order.
async fn restart_child(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    seq: u64,
    entry: ChildEntry,
) -> Result<()> {
    let ctx = Context::new(rt.clone(), fiber.clone(), fiber.scope.clone());
    match entry.kind {
        ChildKind::Fiber(old) => {
            let Some(load) = old.load.clone() else {
                return Ok(());
            };
            let name = old.node.info.name.clone();
            let fresh = crate::context::spawn_plugin_fiber(
                &ctx,
                load,
                entry.policy,
                Some(name.to_string()),
            )
            .await?;
            fiber.move_child(fresh.id, seq);
        }
        ChildKind::Worker {
            start: Some(start), ..
        } => {
            let (cell, node) = start(ctx).await?;
            let child = ChildEntry {
                node,
                pid: cell.get_id().pid(),
                policy: entry.policy,
                kind: ChildKind::Worker {
                    cell: cell.clone(),
                    start: Some(start),
                },
            };
            match fiber.add_child(child) {
                Ok(new_seq) => fiber.move_child_seq(new_seq, seq),
                Err(_) => cell.kill(),
            }
        }
        ChildKind::Worker { start: None, .. } => {}
    }
    Ok(())
}

/// Loads, unloads or reloads a plugin fiber after its injections changed.
async fn reevaluate(rt: &Runtime, fiber: &Arc<FiberShared>) {
    let Some(load) = fiber.load.clone() else {
        return;
    };
    if fiber.dispose_requested.load(Ordering::Acquire) {
        return;
    }
    let resolved: Option<Vec<u64>> = load
        .plugin
        .inject()
        .iter()
        .map(|name| {
            rt.services()
                .resolve(fiber.scope.as_ref(), name)
                .map(|(id, _)| id)
        })
        .collect();
    let loaded_with = fiber.lock().loaded_with.clone();
    match (fiber.status(), resolved) {
        (Status::Pending | Status::Loading, Some(ids)) => apply(rt, fiber, &load, ids).await,
        (Status::Loading, None) => fiber.set_status(rt, Status::Pending),
        (Status::Active, None) => {
            unload(rt, fiber, Arc::from(Vec::new())).await;
            fiber.lock().loaded_with = None;
            fiber.set_status(rt, Status::Pending);
        }
        (Status::Active, Some(ids)) if loaded_with.as_ref() != Some(&ids) => {
            tracing::info!(
                fiber = fiber.id,
                plugin = load.plugin.name(),
                "an injected service was replaced; restarting"
            );
            unload(rt, fiber, Arc::from(Vec::new())).await;
            fiber.set_status(rt, Status::Pending);
            apply(rt, fiber, &load, ids).await;
        }
        _ => {}
    }
}

async fn apply(rt: &Runtime, fiber: &Arc<FiberShared>, load: &LoadSpec, ids: Vec<u64>) {
    fiber.set_status(rt, Status::Loading);
    fiber.lock().loaded_with = Some(ids);
    let ctx = Context::new(rt.clone(), fiber.clone(), fiber.scope.clone());
    let chain: Arc<[u64]> = Arc::from(vec![fiber.id]);
    let body = TEARDOWN_CHAIN.scope(chain, async {
        match std::panic::catch_unwind(AssertUnwindSafe(|| {
            load.plugin.apply(ctx, load.config.clone())
        })) {
            Ok(fut) => AssertUnwindSafe(fut)
                .catch_unwind()
                .await
                .map_err(|p| format!("panicked: {}", panic_text(&p)))
                .and_then(|r| r.map_err(|e| e.to_string())),
            Err(p) => Err(format!("panicked: {}", panic_text(&p))),
        }
    });
    match body.await {
        Ok(()) => {
            fiber.set_status(rt, Status::Active);
            rt.announce_active(fiber);
        }
        Err(reason) => {
            tracing::error!(
                fiber = fiber.id,
                plugin = load.plugin.name(),
                reason,
                "plugin failed to start"
            );
            unload(rt, fiber, Arc::from(Vec::new())).await;
            fiber.lock().error = Some(reason.clone());
            fiber.set_status(rt, Status::Failed);
            rt.tree()
                .supervision(fiber.id, fiber.id, &reason, "apply failed");
        }
    }
}

/// Spawns the actor of a new fiber under `parent` and records it as the
/// parent's newest child.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn spawn_fiber(
    rt: &Runtime,
    parent: Option<&Arc<FiberShared>>,
    kind: &str,
    name: String,
    scope: Option<ScopeKey>,
    load: Option<LoadSpec>,
    policy: ChildPolicy,
    status: Status,
) -> Result<Arc<FiberShared>> {
    if let Some(p) = parent {
        p.accepting()?;
    }
    let id = rt.next_id();
    let node = rt.tree().insert(
        NodeInfo {
            id,
            kind: Arc::from(kind),
            name: Arc::from(name),
            parent: parent.map(|p| p.id),
            started_ms: now_ms(),
        },
        status,
    );
    let (phase, _) = watch::channel(Phase {
        status,
        stopped: false,
    });
    let fiber = Arc::new(FiberShared {
        id,
        node,
        parent: parent.map(Arc::downgrade),
        scope,
        load,
        policy,
        actor: OnceLock::new(),
        inner: Mutex::new(FiberInner {
            supervisor: rt.default_supervisor(),
            ..FiberInner::default()
        }),
        phase,
        dispose_requested: AtomicBool::new(false),
    });
    let args = FiberState {
        rt: rt.clone(),
        fiber: fiber.clone(),
    };
    let spawned = match parent.and_then(|p| p.cell()) {
        Some(cell) => Actor::spawn_linked(None, FiberActor, args, cell).await,
        None => Actor::spawn(None, FiberActor, args).await,
    };
    let (actor, _task) = match spawned {
        Ok(ok) => ok,
        Err(e) => {
            rt.tree().stopped(id, Status::Failed, "spawn failed");
            return Err(Error::Spawn(e.to_string()));
        }
    };
    let pid = actor.get_id().pid();
    let _ = fiber.actor.set(actor.clone());
    if let Some(p) = parent {
        let entry = ChildEntry {
            node: fiber.node.clone(),
            pid,
            policy,
            kind: ChildKind::Fiber(fiber.clone()),
        };
        if p.add_child(entry).is_err() {
            actor.stop(Some("parent is shutting down".to_owned()));
            rt.tree()
                .stopped(id, Status::Disposed, "parent is shutting down");
            fiber.phase.send_modify(|ph| ph.stopped = true);
            return Err(Error::InactiveFiber {
                fiber: format!("{}#{}", p.name(), p.id),
                state: p.status().as_str(),
            });
        }
    }
    Ok(fiber)
}
