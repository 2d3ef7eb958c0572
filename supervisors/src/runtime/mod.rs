//! The runtime: root fiber, tree, events and services of one process, and
//! the kernel's core that refers to itself: a [`Context`] is a runtime plus a
//! fiber, a fiber runs plugins with a context, a runtime owns the root fiber.
//!
//! - this file: [`Runtime`], [`RuntimeSettings`];
//! - [`context`]: [`Context`], the registration handle, and the handles it
//!   gives out ([`Fiber`], [`context::Scope`], [`context::Disposer`],
//!   [`context::WorkerSpec`] / [`context::WorkerRef`]);
//! - [`plugin`]: the [`plugin::Plugin`] trait and the compiled-in [`plugin::Catalogue`];
//! - `fiber`: the fiber actor — lifecycle, children in start order,
//!   ordered teardown, supervision.

pub mod context;
pub(crate) mod fiber;
pub mod plugin;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::events::{Events, Target};
use crate::policy::{ChildPolicy, Shutdown, SupervisorSpec};
use crate::scope::ScopeKey;
use crate::services::{ServiceChange, ServiceChanged, Services};
use crate::tree::{Status, Tree, TreeLimits};
use context::{Context, Fiber};
use fiber::{FiberMsg, FiberShared};

/// Settings of a runtime.
#[derive(Clone, Debug)]
pub struct RuntimeSettings {
    /// Strategy and intensity every new fiber starts with.
    pub supervisor: SupervisorSpec,
    /// Budget of [`Runtime::shutdown`] for the whole tree.
    pub shutdown_budget: Duration,
    /// Tree registry limits.
    pub tree: TreeLimits,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        RuntimeSettings {
            supervisor: SupervisorSpec::default(),
            shutdown_budget: Duration::from_secs(120),
            tree: TreeLimits::default(),
        }
    }
}

/// One actor runtime: a root fiber and everything under it.
#[derive(Clone)]
pub struct Runtime(Arc<Inner>);

struct Inner {
    tree: Arc<Tree>,
    events: Events,
    services: Services,
    next_id: AtomicU64,
    root: OnceLock<Arc<FiberShared>>,
    dependents: Mutex<Vec<Weak<FiberShared>>>,
    settings: RuntimeSettings,
    failure: watch::Sender<Option<String>>,
}

impl Runtime {
    /// Starts a runtime with a root fiber, inside the current tokio runtime.
    pub async fn start(settings: RuntimeSettings) -> Result<Runtime> {
        let tree = Arc::new(Tree::new(settings.tree));
        let (failure, _) = watch::channel(None);
        let rt = Runtime(Arc::new(Inner {
            events: Events::new(tree.clone()),
            tree,
            services: Services::default(),
            next_id: AtomicU64::new(0),
            root: OnceLock::new(),
            dependents: Mutex::new(Vec::new()),
            settings,
            failure,
        }));
        let policy = ChildPolicy {
            shutdown: Shutdown::Timeout(rt.0.settings.shutdown_budget),
            ..ChildPolicy::SCOPE
        };
        let root = fiber::spawn_fiber(
            &rt,
            None,
            "root",
            "root".to_owned(),
            None,
            None,
            policy,
            Status::Active,
        )
        .await?;
        let _ = rt.0.root.set(root);
        Ok(rt)
    }

    fn root_fiber(&self) -> Result<&Arc<FiberShared>> {
        self.0.root.get().ok_or(Error::ShuttingDown)
    }

    /// The root context (global, owned by the root fiber).
    pub fn root(&self) -> Context {
        match self.0.root.get() {
            Some(root) => Context::new(self.clone(), root.clone(), None),
            // `start` sets the root before returning the runtime.
            None => unreachable_root(),
        }
    }

    /// Stops one actor by its tree id, in the normal way (a fiber with its
    /// whole subtree, in order); it is not restarted. Returns the stop
    /// order, or `None` when no live child has that id (the root cannot be
    /// stopped this way; use [`Runtime::shutdown`]).
    pub async fn stop_node(&self, id: u64) -> Option<Vec<u64>> {
        let root = self.root_fiber().ok()?.clone();
        fiber::stop_node(self, &root, id).await
    }

    /// The root fiber handle.
    pub fn root_fiber_handle(&self) -> Fiber {
        self.root().fiber()
    }

    /// The tree registry.
    pub fn tree(&self) -> &Arc<Tree> {
        &self.0.tree
    }

    /// The event bus.
    pub fn events(&self) -> &Events {
        &self.0.events
    }

    pub(crate) fn services(&self) -> &Services {
        &self.0.services
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.0.next_id.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(crate) fn default_supervisor(&self) -> SupervisorSpec {
        self.0.settings.supervisor
    }

    /// Disposes the whole tree in order (children of the root in reverse
    /// start order, recursively), bounded by the shutdown budget.
    pub async fn shutdown(&self) {
        if let Ok(root) = self.root_fiber() {
            let budget = Shutdown::Timeout(self.0.settings.shutdown_budget);
            fiber::shutdown_fiber(self, root, budget, false).await;
        }
    }

    /// Why the root fiber failed (its restart intensity was exceeded), if it did.
    pub fn failure(&self) -> Option<String> {
        self.0.failure.borrow().clone()
    }

    pub(crate) fn root_failed(&self, reason: String) {
        tracing::error!(reason, "the root supervisor failed");
        self.0.failure.send_replace(Some(reason));
    }

    pub(crate) fn register_dependent(&self, fiber: &Arc<FiberShared>) {
        if let Ok(mut deps) = self.0.dependents.lock() {
            deps.retain(|w| w.strong_count() > 0);
            deps.push(Arc::downgrade(fiber));
        }
    }

    pub(crate) fn reevaluate(&self, fiber: &FiberShared) {
        if let Some(a) = fiber.actor()
            && a.send_message(FiberMsg::Reevaluate).is_ok()
        {
            fiber.node.stats.enqueue();
        }
    }

    /// Emits `internal/service` and wakes every plugin that injects `name`.
    pub(crate) fn service_changed(
        &self,
        name: &str,
        scope: Option<&ScopeKey>,
        change: ServiceChange,
    ) {
        self.0.events.emit(
            &Target::All,
            &ServiceChanged {
                name: name.to_owned(),
                scope: scope.cloned(),
                change,
            },
        );
        let deps: Vec<Arc<FiberShared>> = match self.0.dependents.lock() {
            Ok(deps) => deps.iter().filter_map(Weak::upgrade).collect(),
            Err(_) => return,
        };
        for dep in deps {
            if dep.inject().contains(&name) {
                self.reevaluate(&dep);
            }
        }
    }

    /// A fiber became active: the services it provided while loading appear.
    pub(crate) fn announce_active(&self, fiber: &Arc<FiberShared>) {
        for (scope, name) in fiber.take_unannounced() {
            self.service_changed(&name, scope.as_ref(), ServiceChange::Provided);
        }
    }
}

#[allow(clippy::panic)]
fn unreachable_root() -> Context {
    panic!("Runtime::start sets the root fiber before returning")
}
