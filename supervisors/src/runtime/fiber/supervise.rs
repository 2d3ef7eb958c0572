//! Supervision: a child that stopped on its own is restarted or removed as
//! its restart policy says, with the fiber's strategy (one for one, one for
//! all, rest for one) and within its restart intensity; past it the fiber
//! fails upward.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use super::teardown::{abort_tasks, stop_children};
use super::{ChildEntry, ChildKind, FiberShared};
use crate::error::Result;
use crate::error::chain;
use crate::policy::{Restart, Strategy};
use crate::runtime::Runtime;
use crate::runtime::context::Context;
use crate::tree::Status;

/// Applies the restart policy and strategy to a child that stopped on its
/// own. Returns `Some(reason)` when the fiber must fail upward.
pub(super) async fn on_child_exit(
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
            ChildKind::Worker { .. } | ChildKind::Task(_) | ChildKind::Part => None,
        };
        (c.node.clone(), c.policy, child_fiber)
    };
    let child_id = node.info.id;
    // A fiber whose actor failed had no teardown: ractor stopped the actors
    // under it, its task children are aborted here.
    if let Some(f) = &child_fiber
        && failure.is_some()
    {
        abort_tasks(f, "its owner failed");
    }
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
    to_start.push((seq, *failed_entry));
    to_start.sort_by_key(|(s, _)| *s);
    for (seq, entry) in to_start {
        if entry.policy.restart == Restart::Temporary {
            continue;
        }
        if let Err(e) = restart_child(rt, fiber, seq, entry).await {
            return Some(format!("could not restart a child: {}", chain(&e)));
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
            let fresh = crate::runtime::context::spawn_plugin_fiber(
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
                pid: Some(cell.get_id().pid()),
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
        // One-shot work is never started again.
        ChildKind::Worker { start: None, .. } | ChildKind::Task(_) | ChildKind::Part => {}
    }
    Ok(())
}
