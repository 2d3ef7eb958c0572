//! Ordered teardown: a fiber's preludes, then its children in reverse start
//! order (each drained and awaited up to its budget, then killed), then its
//! effects in reverse registration order. Memoized and re-entrant: a dispose
//! issued from inside a teardown joins it instead of waiting on itself.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::FutureExt;

use super::{ChildEntry, ChildKind, DisposeFn, EffectEntry, FiberShared};
use crate::events::panic_text;
use crate::policy::Shutdown;
use crate::runtime::Runtime;
use crate::tree::Status;

tokio::task_local! {
    /// Fibers whose teardown the current task is running (outermost first).
    pub(super) static TEARDOWN_CHAIN: Arc<[u64]>;
}

fn current_chain() -> Arc<[u64]> {
    TEARDOWN_CHAIN
        .try_with(|c| c.clone())
        .unwrap_or_else(|_| Arc::from(Vec::new()))
}

pub(super) fn extend_chain(chain: &[u64], id: u64) -> Arc<[u64]> {
    let mut v = chain.to_vec();
    v.push(id);
    Arc::from(v)
}

/// Tears `fiber` down in order and records it stopped (out of its parent's
/// children when the dispose was its own); returns its final status. The
/// caller stops its actor, if it has one, and publishes the phase.
pub(super) async fn dispose(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    chain: Arc<[u64]>,
    from_parent: bool,
) -> Status {
    let final_status = if fiber.status() == Status::Failed {
        Status::Failed
    } else {
        Status::Disposed
    };
    let mut order = unload(rt, fiber, chain).await;
    order.push(fiber.id);
    let order: Arc<[u64]> = Arc::from(order);
    fiber.lock().stop_order = Some(order.clone());
    fiber.node.stats.set_status(final_status);
    rt.tree().stopped(fiber.id, final_status, "disposed");
    if !from_parent {
        rt.tree().teardown(fiber.id, order.to_vec());
        // Out of its parent's children now, not when the parent gets to its
        // exit: whoever awaited the dispose sees the parent without it (a
        // deliberate dispose is removed, never restarted, so the parent has
        // nothing to decide).
        if let Some(parent) = fiber.parent.as_ref().and_then(Weak::upgrade) {
            parent.forget_child(fiber.id);
        }
    }
    final_status
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
        fiber.request_dispose(rt, chain, from_parent);
        return;
    }
    if budget == Shutdown::BrutalKill {
        kill_fiber(rt, fiber, "brutal kill").await;
        return;
    }
    fiber.request_dispose(rt, chain, from_parent);
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

/// Records a killed fiber and every node still under it as failed. A scope
/// that tore down without an actor has its teardown stopped, as ractor stops
/// an actor's.
fn mark_killed(rt: &Runtime, fiber: &Arc<FiberShared>, reason: &str) {
    if let Some(teardown) = fiber.teardown.get() {
        teardown.abort();
    }
    let children: Vec<ChildEntry> = std::mem::take(&mut fiber.lock().children)
        .into_values()
        .map(|c| *c)
        .collect();
    for child in children {
        match &child.kind {
            ChildKind::Fiber(f) => mark_killed(rt, f, "killed with its parent"),
            ChildKind::Worker { .. } => {
                rt.tree()
                    .stopped(child.node.info.id, Status::Failed, "killed with its parent");
            }
            ChildKind::Task(t) => t.abort("killed with its parent"),
            ChildKind::Part => {
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

/// Aborts every task child in `fiber`'s subtree: its actor failed without
/// a teardown, and ractor stops only actors (linked to it), not tasks.
pub(super) fn abort_tasks(fiber: &Arc<FiberShared>, reason: &'static str) {
    let mut fibers = Vec::new();
    for child in fiber.lock().children.values() {
        match &child.kind {
            ChildKind::Task(t) => t.abort(reason),
            ChildKind::Fiber(f) => fibers.push(f.clone()),
            _ => {}
        }
    }
    // Outside this fiber's lock.
    for f in fibers {
        abort_tasks(&f, reason);
    }
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
        ChildKind::Task(task) => {
            task.stop(rt, child.policy.shutdown).await;
            vec![child.node.info.id]
        }
        ChildKind::Part => {
            rt.tree()
                .stopped(child.node.info.id, Status::Disposed, "stopped");
            vec![child.node.info.id]
        }
    }
}

/// Stops the children selected by `which` (reverse start order), keeping
/// each in the map until it has stopped so a kill can still find it.
pub(super) async fn stop_children(
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
        let Some(entry) = fiber.lock().children.get(&seq).cloned() else {
            continue;
        };
        let order = stop_child(rt, &entry).await;
        fiber.lock().children.remove(&seq);
        out.push((seq, *entry, order));
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
                ChildKind::Worker { .. } | ChildKind::Task(_) | ChildKind::Part => None,
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
    // A task stays among its owner's children until it has ended (it
    // leaves them itself): a stop dropped midway leaves it where the
    // owner's teardown still finds it. It is never restarted anyway.
    let task = {
        let inner = owner.lock();
        let child = inner.children.get(&seq)?;
        match &child.kind {
            ChildKind::Task(t) => Some((t.clone(), child.policy.shutdown)),
            _ => None,
        }
    };
    if let Some((task, shutdown)) = task {
        task.stop(rt, shutdown).await;
        return Some(vec![id]);
    }
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
        run_effect(rt, fiber.id, *effect).await;
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
pub(super) async fn unload(rt: &Runtime, fiber: &Arc<FiberShared>, chain: Arc<[u64]>) -> Vec<u64> {
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
