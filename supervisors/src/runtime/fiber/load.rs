//! Loading: a new fiber's actor is spawned under its parent (a scope's only
//! once it needs one); a plugin fiber applies its plugin once every injected
//! service exists, and unloads or reloads when one goes away or is replaced.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use futures::FutureExt;
use futures::future::BoxFuture;
use ractor::{Actor, ActorCell, ActorRef};
use tokio::sync::watch;

use super::actor::{FiberActor, FiberState};
use super::teardown::{TEARDOWN_CHAIN, unload};
use super::{ChildEntry, ChildKind, FiberInner, FiberMsg, FiberShared, LoadSpec, Phase};
use crate::error::chain;
use crate::error::{Error, Result};
use crate::events::panic_text;
use crate::policy::ChildPolicy;
use crate::runtime::Runtime;
use crate::runtime::context::Context;
use crate::scope::ScopeKey;
use crate::tree::{Form, NodeInfo, Status, now_ms};

/// Loads, unloads or reloads a plugin fiber after its injections changed.
pub(super) async fn reevaluate(rt: &Runtime, fiber: &Arc<FiberShared>) {
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

/// Makes a new fiber under `parent` and records it as the parent's newest
/// child. A plugin fiber (and the root) gets its actor at once; a scope (a
/// fiber with no plugin to load) starts without one, and gets it from
/// [`ensure_actor`] when something under it needs a supervisor actor (a
/// worker, a plugin fiber): an agent's scope of task children and parts
/// never allocates a mailbox. Its teardown then runs in a task of its own.
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
    let lazy = load.is_none() && parent.is_some();
    let id = rt.next_id();
    let node = rt.tree().insert(
        NodeInfo {
            id,
            form: Form::Fiber,
            kind: Arc::from(kind),
            name: Arc::from(name),
            parent: parent.map(|p| p.id),
            started_ms: now_ms(),
            node: None,
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
        teardown: OnceLock::new(),
        inner: Mutex::new(FiberInner {
            supervisor: rt.default_supervisor(),
            ..FiberInner::default()
        }),
        phase,
        dispose_requested: AtomicBool::new(false),
    });
    let actor = if lazy {
        None
    } else {
        let parent_cell = match parent {
            Some(p) => Some(ensure_actor(rt, p).await?),
            None => None,
        };
        match start_actor(rt, &fiber, parent_cell).await {
            Ok(actor) => {
                let _ = fiber.actor.set(actor.clone());
                Some(actor)
            }
            Err(e) => {
                rt.tree().stopped(id, Status::Failed, "spawn failed");
                return Err(e);
            }
        }
    };
    if let Some(p) = parent {
        let entry = ChildEntry {
            node: fiber.node.clone(),
            pid: actor.as_ref().map(|a| a.get_id().pid()),
            policy,
            kind: ChildKind::Fiber(fiber.clone()),
        };
        if p.add_child(entry).is_err() {
            if let Some(actor) = &actor {
                actor.stop(Some("parent is shutting down".to_owned()));
            }
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

/// Spawns `fiber`'s actor, linked to `parent` when there is one.
async fn start_actor(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    parent: Option<ActorCell>,
) -> Result<ActorRef<FiberMsg>> {
    let args = FiberState {
        rt: rt.clone(),
        fiber: fiber.clone(),
    };
    let spawned = match parent {
        Some(cell) => Actor::spawn_linked(None, FiberActor, args, cell).await,
        None => Actor::spawn(None, FiberActor, args).await,
    };
    spawned
        .map(|(actor, _task)| actor)
        .map_err(|e| Error::Spawn(chain(&e).to_string()))
}

/// `fiber`'s actor, started now if it has none yet (a scope's, the first
/// time something under it needs a supervisor), linked to its parent's
/// (started too if needed). Refused once the fiber is being disposed, or
/// when its parent is gone.
pub(crate) fn ensure_actor<'a>(
    rt: &'a Runtime,
    fiber: &'a Arc<FiberShared>,
) -> BoxFuture<'a, Result<ActorCell>> {
    async move {
        if let Some(actor) = fiber.actor.get() {
            return Ok(actor.get_cell());
        }
        let parent_cell = match &fiber.parent {
            None => None,
            // A parent that is gone has no actor to link to: an actor
            // started unlinked would have no owner.
            Some(parent) => {
                let parent = parent.upgrade().ok_or(Error::ShuttingDown)?;
                Some((ensure_actor(rt, &parent).await?, parent))
            }
        };
        if fiber.dispose_requested.load(Ordering::Acquire) {
            return Err(fiber.inactive());
        }
        fiber.accepting()?;
        let started = start_actor(rt, fiber, parent_cell.as_ref().map(|(c, _)| c.clone())).await?;
        // Installed under the fiber's lock, where `request_dispose` decides
        // between the actor and a teardown task of its own: a dispose that
        // came meanwhile gets the new actor stopped, and a concurrent start
        // that won keeps its own.
        let installed = {
            let _inner = fiber.lock();
            if fiber.dispose_requested.load(Ordering::Acquire) {
                None
            } else {
                let _ = fiber.actor.set(started.clone());
                fiber.actor.get().cloned()
            }
        };
        match installed {
            Some(actor) if actor.get_id() == started.get_id() => {
                if let Some((_, parent)) = &parent_cell {
                    parent.set_child_pid(fiber.id, actor.get_id().pid());
                }
                Ok(actor.get_cell())
            }
            Some(actor) => {
                started.stop(Some("another start won".to_owned()));
                Ok(actor.get_cell())
            }
            None => {
                started.stop(Some("disposed".to_owned()));
                Err(fiber.inactive())
            }
        }
    }
    .boxed()
}
