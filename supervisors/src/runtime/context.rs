//! `Context`: the handle every registration goes through.
//!
//! A context is the runtime, the fiber that owns what is registered through
//! it, and an optional scope tag. It is cheap to clone. Everything made
//! through it (effects, services, listeners, plugins, scopes, workers) is
//! owned by that fiber and undone, in reverse order, when it unloads.

use std::any::Any;
use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use futures::FutureExt;
use ractor::{Actor, ActorProcessingErr, ActorRef, Message, RpcReplyPort, SupervisionEvent};
use tokio_util::sync::CancellationToken;

use crate::error::chain;
use crate::error::{Error, Result};
use crate::events::{
    Bail, BailFn, Emit, EmitFn, Events, ListenOptions, Next, Owner, Parallel, ParallelFn, Serial,
    SerialFn, Target, Waterfall, WaterfallFn,
};
use crate::policy::{ChildPolicy, Restart, Shutdown, SupervisorSpec};
use crate::runtime::Runtime;
use crate::runtime::fiber::{
    self, ChildEntry, ChildKind, DisposeFn, FiberShared, LoadSpec, TaskEnd, TaskRef, WorkerStart,
};
use crate::scope::ScopeKey;
use crate::services::{Provider, ServiceChange};
use crate::tree::{Form, Node, NodeStats, Status};

/// The registration handle: runtime + owning fiber + optional scope tag.
#[derive(Clone)]
pub struct Context {
    rt: Runtime,
    fiber: Arc<FiberShared>,
    scope: Option<ScopeKey>,
}

impl Context {
    pub(crate) fn new(rt: Runtime, fiber: Arc<FiberShared>, scope: Option<ScopeKey>) -> Context {
        Context { rt, fiber, scope }
    }

    /// The runtime this context belongs to.
    pub fn runtime(&self) -> &Runtime {
        &self.rt
    }

    /// The fiber that owns registrations made through this context.
    pub fn fiber(&self) -> Fiber {
        Fiber {
            shared: self.fiber.clone(),
            rt: self.rt.clone(),
        }
    }

    /// The scope tag, `None` for a global context.
    pub fn scope_key(&self) -> Option<&ScopeKey> {
        self.scope.as_ref()
    }

    /// The event bus (for scope-targeted dispatch, see [`Events`]).
    pub fn events(&self) -> &Events {
        self.rt.events()
    }

    fn owner(&self) -> Owner {
        Owner {
            fiber: self.fiber.id,
            scope: self.scope.clone(),
        }
    }

    fn disposer(&self, seq: u64) -> Disposer {
        Disposer {
            rt: self.rt.clone(),
            fiber: Arc::downgrade(&self.fiber),
            seq,
        }
    }

    /// Registers a synchronous disposer on the owning fiber. It runs once:
    /// when the returned [`Disposer`] is called or when the fiber unloads,
    /// whichever comes first. Refused once the fiber is unloading.
    pub fn effect(&self, label: &str, dispose: impl FnOnce() + Send + 'static) -> Result<Disposer> {
        let seq = self
            .fiber
            .add_effect(intern(label), DisposeFn::Sync(Box::new(dispose)))
            .map_err(|(e, _)| e)?;
        Ok(self.disposer(seq))
    }

    /// Like [`Context::effect`] for a registration already made elsewhere
    /// (an entry put in a table): when the fiber refuses the effect (it is
    /// unloading), `undo` runs at once before the error returns, so nothing
    /// is left registered with no owner to remove it.
    pub fn effect_or_undo(
        &self,
        label: &str,
        undo: impl FnOnce() + Send + 'static,
    ) -> Result<Disposer> {
        match self
            .fiber
            .add_effect(intern(label), DisposeFn::Sync(Box::new(undo)))
        {
            Ok(seq) => Ok(self.disposer(seq)),
            Err((e, DisposeFn::Sync(undo))) => {
                undo();
                Err(e)
            }
            Err((e, DisposeFn::Async(_))) => Err(e),
        }
    }

    /// Like [`Context::effect`] with an asynchronous disposer; unloading awaits it.
    pub fn effect_async<F, Fut>(&self, label: &str, dispose: F) -> Result<Disposer>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let run = DisposeFn::Async(Box::new(move || dispose().boxed()));
        let seq = self
            .fiber
            .add_effect(intern(label), run)
            .map_err(|(e, _)| e)?;
        Ok(self.disposer(seq))
    }

    /// Registers a teardown prelude: it runs when the owning fiber starts
    /// unloading, *before* its children are stopped (e.g. stop accepting
    /// input and cancel running work, so children drain quickly). Preludes
    /// run once, in reverse registration order; panics are isolated.
    pub fn on_teardown<F, Fut>(&self, label: &str, prelude: F) -> Result<()>
    where
        F: FnOnce() -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let run = DisposeFn::Async(Box::new(move || prelude().boxed()));
        self.fiber.add_prelude(intern(label), run)
    }

    /// Sets the owning fiber's supervisor strategy and restart intensity.
    pub fn supervise(&self, spec: SupervisorSpec) {
        self.fiber.set_supervisor(spec);
    }

    /// Mints a scope under this context's fiber: a child fiber whose context
    /// is tagged with `key`. Registrations through [`Scope::ctx`] are visible
    /// in that scope and revoked when the scope is disposed.
    pub async fn scope(&self, key: ScopeKey) -> Result<Scope> {
        let shared = fiber::spawn_fiber(
            &self.rt,
            Some(&self.fiber),
            "scope",
            format!("scope/{}", key.label()),
            Some(key.clone()),
            None,
            ChildPolicy::SCOPE,
            Status::Active,
        )
        .await?;
        Ok(Scope {
            ctx: Context::new(self.rt.clone(), shared.clone(), Some(key)),
            fiber: Fiber {
                shared,
                rt: self.rt.clone(),
            },
        })
    }

    /// Provides a service under `name` in this context's scope layer. It is
    /// visible while the owning fiber is active and removed with it.
    pub fn provide<T: ?Sized + Send + Sync + 'static>(
        &self,
        name: &str,
        value: Arc<T>,
    ) -> Result<Disposer> {
        let id = self.rt.services().next_id();
        let erased: Arc<dyn Any + Send + Sync> = Arc::new(value);
        self.rt.services().provide(
            self.scope.as_ref(),
            name,
            Provider {
                id,
                version: id,
                fiber: Arc::downgrade(&self.fiber.node),
                fiber_id: self.fiber.id,
                fiber_name: Arc::from(self.fiber.name()),
                value: erased,
            },
        )?;
        let rt = self.rt.clone();
        let scope = self.scope.clone();
        let owned = name.to_owned();
        let undo = move || {
            if rt.services().remove(scope.as_ref(), &owned, id) {
                rt.service_changed(&owned, scope.as_ref(), ServiceChange::Removed);
            }
        };
        match self.effect(&format!("provide(\"{name}\")"), undo) {
            Ok(d) => {
                if self.fiber.status() == Status::Active {
                    self.rt
                        .service_changed(name, self.scope.as_ref(), ServiceChange::Provided);
                } else {
                    self.fiber.note_provided(self.scope.clone(), name);
                }
                Ok(d)
            }
            Err(e) => {
                self.rt.services().remove(self.scope.as_ref(), name, id);
                Err(e)
            }
        }
    }

    /// Replaces the value of a service this fiber provides; plugins that
    /// inject it are restarted.
    pub fn set<T: ?Sized + Send + Sync + 'static>(&self, name: &str, value: Arc<T>) -> Result<()> {
        let erased: Arc<dyn Any + Send + Sync> = Arc::new(value);
        self.rt
            .services()
            .replace(self.scope.as_ref(), name, self.fiber.id, erased)?;
        self.rt
            .service_changed(name, self.scope.as_ref(), ServiceChange::Replaced);
        Ok(())
    }

    /// The service visible from this context under `name` (nearest scope
    /// first), if one is provided by an active fiber.
    pub fn get<T: ?Sized + Send + Sync + 'static>(&self, name: &str) -> Option<Arc<T>> {
        let (_, value) = self.rt.services().resolve(self.scope.as_ref(), name)?;
        match value.downcast_ref::<Arc<T>>() {
            Some(v) => Some(v.clone()),
            None => {
                tracing::warn!(
                    "{}",
                    Error::ServiceType {
                        name: name.to_owned(),
                        expected: std::any::type_name::<T>(),
                    }
                );
                None
            }
        }
    }

    /// Registers a listener of any mode, with options. The listener is an
    /// effect of the owning fiber and tagged with this context's scope.
    pub fn listen<F: ?Sized + Send + Sync + 'static>(
        &self,
        f: Box<F>,
        options: ListenOptions,
    ) -> Result<Disposer> {
        let unlisten = Arc::new(self.rt.events().register::<F>(&self.owner(), f, options));
        let undo = unlisten.clone();
        let registered = self.effect("listener", move || {
            undo.run();
        });
        if registered.is_err() {
            // The owner is going away: never leave an unowned listener behind.
            unlisten.run();
        }
        registered
    }

    /// Listens to an [`Emit`] event.
    pub fn on<E: Emit>(&self, f: impl Fn(&E) + Send + Sync + 'static) -> Result<Disposer> {
        self.listen::<EmitFn<E>>(Box::new(f), ListenOptions::default())
    }

    /// Listens to a [`Bail`] event.
    pub fn on_bail<E: Bail>(
        &self,
        f: impl Fn(&E) -> Option<E::Output> + Send + Sync + 'static,
    ) -> Result<Disposer> {
        self.listen::<BailFn<E>>(Box::new(f), ListenOptions::default())
    }

    /// Listens to a [`Parallel`] event.
    pub fn on_parallel<E: Parallel, F, Fut>(&self, f: F) -> Result<Disposer>
    where
        F: Fn(Arc<E>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        let f: Box<ParallelFn<E>> = Box::new(move |e| f(e).boxed());
        self.listen::<ParallelFn<E>>(f, ListenOptions::default())
    }

    /// Listens to a [`Serial`] event.
    pub fn on_serial<E: Serial, F, Fut>(&self, f: F) -> Result<Disposer>
    where
        F: Fn(Arc<E>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Option<E::Output>> + Send + 'static,
    {
        let f: Box<SerialFn<E>> = Box::new(move |e| f(e).boxed());
        self.listen::<SerialFn<E>>(f, ListenOptions::default())
    }

    /// Wraps a [`Waterfall`] event (middleware around `next`).
    pub fn on_waterfall<E: Waterfall, F, Fut>(&self, f: F) -> Result<Disposer>
    where
        F: Fn(E, Next<E>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = E::Output> + Send + 'static,
    {
        self.on_waterfall_with(ListenOptions::default(), f)
    }

    /// [`Context::on_waterfall`] with options (`prepend`, `global`).
    pub fn on_waterfall_with<E: Waterfall, F, Fut>(
        &self,
        options: ListenOptions,
        f: F,
    ) -> Result<Disposer>
    where
        F: Fn(E, Next<E>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = E::Output> + Send + 'static,
    {
        let f: Box<WaterfallFn<E>> = Box::new(move |e, next| f(e, next).boxed());
        self.listen::<WaterfallFn<E>>(f, options)
    }

    /// Dispatches an [`Emit`] event to every listener.
    pub fn emit<E: Emit>(&self, event: &E) {
        self.rt.events().emit(&Target::All, event)
    }

    /// Dispatches a [`Bail`] event to every listener.
    pub fn bail<E: Bail>(&self, event: &E) -> Option<E::Output> {
        self.rt.events().bail(&Target::All, event)
    }

    /// Dispatches a [`Parallel`] event to every listener.
    pub async fn parallel<E: Parallel>(&self, event: E) {
        self.rt.events().parallel(&Target::All, event).await
    }

    /// Dispatches a [`Serial`] event to every listener.
    pub async fn serial<E: Serial>(&self, event: E) -> Option<E::Output> {
        self.rt.events().serial(&Target::All, event).await
    }

    /// Dispatches a [`Waterfall`] event around `terminal`.
    pub async fn waterfall<E, T, Fut>(&self, event: E, terminal: T) -> Result<E::Output>
    where
        E: Waterfall,
        T: Fn(E) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = E::Output> + Send + 'static,
    {
        self.rt
            .events()
            .waterfall(&Target::All, event, terminal)
            .await
    }

    /// Starts a worker actor as a supervised child of the owning fiber.
    pub async fn spawn<A: Actor>(&self, spec: WorkerSpec<A>) -> Result<WorkerRef<A::Msg>>
    where
        A::Arguments: Send,
    {
        let WorkerSpec {
            kind,
            name,
            policy,
            make,
        } = spec;
        let (actor, args, start) = match make {
            WorkerMake::Once(actor, args) => (actor, args, None),
            WorkerMake::Factory(factory) => {
                let (actor, args) = factory();
                let kind2 = kind.clone();
                let name2 = name.clone();
                let start: WorkerStart = Arc::new(move |ctx: Context| {
                    let (actor, args) = factory();
                    let kind = kind2.clone();
                    let name = name2.clone();
                    async move {
                        let (r, node) = spawn_counted(&ctx, &kind, &name, actor, args).await?;
                        Ok((r.get_cell(), node))
                    }
                    .boxed()
                });
                (actor, args, Some(start))
            }
        };
        let (actor_ref, node) = spawn_counted(self, &kind, &name, actor, args).await?;
        let entry = ChildEntry {
            node: node.clone(),
            pid: Some(actor_ref.get_id().pid()),
            policy,
            kind: ChildKind::Worker {
                cell: actor_ref.get_cell(),
                start,
            },
        };
        self.fiber.adopt(&self.rt, entry)?;
        Ok(WorkerRef {
            id: node.info.id,
            actor: actor_ref,
            stats: node.stats.clone(),
        })
    }

    /// Starts one-shot work as a supervised task child of the owning fiber:
    /// a node in the tree and a cancel signal, without a mailbox (see
    /// [`TaskSpec`]). `body` gets the signal; its result comes back through
    /// [`TaskRef::join`]. Refused once the fiber is unloading.
    pub fn spawn_task<T, F, Fut>(&self, spec: TaskSpec<'_>, body: F) -> Result<TaskRef<T>>
    where
        T: Send + 'static,
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = T> + Send + 'static,
    {
        fiber::spawn_task(&self.rt, &self.fiber, spec, body)
    }

    /// Registers one-shot work as a supervised task child of the owning
    /// fiber, as [`Context::spawn_task`] does, but run by its caller: the
    /// returned future is the task (no tokio task of its own, and its body
    /// may borrow). Await it where it is made: a stop of the task (a
    /// teardown, `stop_node`) cancels its signal, waits up to its budget and
    /// then aborts it, which ends it at its caller's next poll; dropped
    /// unfinished, it is recorded as dropped. Refused once the fiber is
    /// unloading.
    pub fn run_task<'b, T: 'b, F, Fut>(
        &self,
        spec: TaskSpec<'_>,
        body: F,
    ) -> Result<impl Future<Output = std::result::Result<T, TaskEnd>> + use<'b, T, F, Fut>>
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = T> + 'b,
    {
        fiber::inline_task(&self.rt, &self.fiber, spec, body)
    }

    /// Registers a passive part of the owning fiber: a node of `kind` in
    /// the tree, among the fiber's children in start order, with nothing
    /// running (say, a session that has no store to write). The teardown
    /// records it stopped in its place; [`Context::drop_part`] removes it
    /// earlier. Returns the node id. Refused once the fiber is unloading.
    pub fn part(&self, kind: &str, name: impl Into<String>) -> Result<u64> {
        let node = self.fiber.child_node(
            &self.rt,
            Form::Part,
            kind,
            &name.into(),
            Status::Active,
            serde_json::Value::Null,
        );
        let id = node.info.id;
        let entry = ChildEntry {
            node,
            pid: None,
            policy: ChildPolicy::WORKER,
            kind: ChildKind::Part,
        };
        self.fiber.adopt(&self.rt, entry)?;
        Ok(id)
    }

    /// Removes a part registered with [`Context::part`] (its node stops
    /// `disposed`); does nothing when it is gone already or `id` is not a
    /// part of this fiber.
    pub fn drop_part(&self, id: u64) {
        if self.fiber.forget_part(id) {
            self.rt
                .tree()
                .stopped(id, Status::Disposed, "removed by its owner");
        }
    }

    /// Disposes the owning fiber (see [`Fiber::dispose`]).
    pub async fn dispose(&self) {
        self.fiber().dispose().await
    }
}

/// How to start a task child: one-shot work (a tool call, a hook run) that
/// needs supervision (a tree node, a cancel signal, ordered teardown, panic
/// isolation) but receives no messages, so it has no mailbox.
///
/// Its owner's teardown cancels it, awaits it up to its shutdown budget (5 s
/// unless changed) and aborts it past that. A panic is caught and reported
/// as a supervision event; a task is never restarted.
pub struct TaskSpec<'a> {
    pub(crate) kind: &'a str,
    pub(crate) name: String,
    pub(crate) shutdown: Shutdown,
    pub(crate) cancel: Option<&'a CancellationToken>,
    pub(crate) summary: serde_json::Value,
}

impl<'a> TaskSpec<'a> {
    /// A task of `kind` (what it is: `tool`, `hook`) named `name`.
    pub fn new(kind: &'a str, name: impl Into<String>) -> Self {
        TaskSpec {
            kind,
            name: name.into(),
            shutdown: ChildPolicy::WORKER.shutdown,
            cancel: None,
            summary: serde_json::Value::Null,
        }
    }

    /// What the task's node says of it from its start (a tool call: its
    /// tool and what it does), as the tree's summaries do.
    pub fn summary(mut self, summary: serde_json::Value) -> Self {
        self.summary = summary;
        self
    }

    /// Sets the shutdown budget.
    pub fn shutdown(mut self, shutdown: Shutdown) -> Self {
        self.shutdown = shutdown;
        self
    }

    /// Makes the task's signal a child of `parent`: cancelling `parent`
    /// cancels the task too.
    pub fn cancelled_by(mut self, parent: &'a CancellationToken) -> Self {
        self.cancel = Some(parent);
        self
    }
}

async fn spawn_counted<A: Actor>(
    ctx: &Context,
    kind: &str,
    name: &str,
    actor: A,
    args: A::Arguments,
) -> Result<(ActorRef<A::Msg>, Arc<Node>)> {
    if ctx.fiber.status().is_terminal() || ctx.fiber.status() == Status::Unloading {
        return Err(ctx.fiber.inactive());
    }
    let cell = fiber::ensure_actor(&ctx.rt, &ctx.fiber).await?;
    let node = ctx.fiber.child_node(
        &ctx.rt,
        Form::Actor,
        kind,
        name,
        Status::Loading,
        serde_json::Value::Null,
    );
    let id = node.info.id;
    let counted = Counted {
        inner: actor,
        stats: node.stats.clone(),
    };
    match Actor::spawn_linked(None, counted, args, cell).await {
        Ok((r, _task)) => {
            ctx.rt.tree().set_status(&node, Status::Active);
            Ok((r, node))
        }
        Err(e) => {
            ctx.rt.tree().stopped(
                id,
                Status::Failed,
                &format!("failed to start: {}", chain(&e)),
            );
            Err(Error::Spawn(chain(&e).to_string()))
        }
    }
}

/// Spawns a plugin fiber under `ctx`'s fiber and asks it to load.
pub(crate) async fn spawn_plugin_fiber(
    ctx: &Context,
    load: LoadSpec,
    policy: ChildPolicy,
    name: Option<String>,
) -> Result<Arc<FiberShared>> {
    let name = name.unwrap_or_else(|| format!("plugin/{}", load.plugin.name()));
    let has_inject = !load.plugin.inject().is_empty();
    let shared = fiber::spawn_fiber(
        &ctx.rt,
        Some(&ctx.fiber),
        "plugin",
        name,
        ctx.scope.clone(),
        Some(load),
        policy,
        Status::Loading,
    )
    .await?;
    if has_inject {
        ctx.rt.register_dependent(&shared);
    }
    ctx.rt.reevaluate(&shared);
    Ok(shared)
}

/// Options for loading a plugin.
#[derive(Clone, Debug)]
pub struct PluginOptions {
    /// Name in the tree (default `plugin/<name>`).
    pub name: Option<String>,
    /// Restart policy and shutdown budget.
    pub policy: ChildPolicy,
}

impl Default for PluginOptions {
    fn default() -> Self {
        PluginOptions {
            name: None,
            policy: ChildPolicy::PLUGIN,
        }
    }
}

/// Undoes one effect early. Dropping it does nothing: the effect stays owned
/// by its fiber.
#[derive(Clone)]
pub struct Disposer {
    rt: Runtime,
    fiber: Weak<FiberShared>,
    seq: u64,
}

impl std::fmt::Debug for Disposer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Disposer(effect {})", self.seq)
    }
}

impl Disposer {
    /// Runs the effect's disposer now, unless it already ran.
    pub async fn dispose(&self) {
        if let Some(f) = self.fiber.upgrade() {
            fiber::dispose_effect(&self.rt, &f, self.seq).await;
        }
    }

    /// Drops the effect without running it: what it would undo is already
    /// undone another way.
    pub fn cancel(&self) {
        if let Some(f) = self.fiber.upgrade() {
            f.forget_effect(self.seq);
        }
    }
}

/// Labels of effects and preludes, shared: most are the same few strings,
/// registered again by every agent, scope and session.
fn intern(label: &str) -> Arc<str> {
    /// Distinct labels kept; past it, labels are no longer shared.
    const KEPT: usize = 1024;
    static LABELS: std::sync::Mutex<std::collections::BTreeSet<Arc<str>>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let Ok(mut labels) = LABELS.lock() else {
        return Arc::from(label);
    };
    if let Some(known) = labels.get(label) {
        return known.clone();
    }
    let made: Arc<str> = Arc::from(label);
    if labels.len() < KEPT {
        labels.insert(made.clone());
    }
    made
}

/// A handle to a fiber (a loaded plugin or a scope).
#[derive(Clone)]
pub struct Fiber {
    pub(crate) shared: Arc<FiberShared>,
    pub(crate) rt: Runtime,
}

impl Fiber {
    /// Kernel id (also its node id in the tree).
    pub fn id(&self) -> u64 {
        self.shared.id
    }

    /// Readable name.
    pub fn name(&self) -> &str {
        self.shared.name()
    }

    /// Current status.
    pub fn status(&self) -> Status {
        self.shared.status()
    }

    /// Why the fiber failed, if it did.
    pub fn error(&self) -> Option<String> {
        self.shared.error()
    }

    /// A context owned by this fiber (global, or tagged when it is a scope).
    pub fn context(&self) -> Context {
        Context::new(
            self.rt.clone(),
            self.shared.clone(),
            self.shared.scope.clone(),
        )
    }

    /// Waits until the fiber has settled (`active`, `pending`, `failed` or
    /// stopped); returns that status.
    pub async fn ready(&self) -> Status {
        let mut rx = self.shared.subscribe();
        let settled = |p: &fiber::Phase| {
            p.stopped
                || matches!(
                    p.status,
                    Status::Active | Status::Pending | Status::Failed | Status::Disposed
                )
        };
        match rx.wait_for(settled).await {
            Ok(p) => p.status,
            Err(_) => self.status(),
        }
    }

    /// Waits for the fiber to be in `status`, up to `timeout`.
    pub async fn wait_for(&self, status: Status, timeout: Duration) -> Result<()> {
        let mut rx = self.shared.subscribe();
        tokio::time::timeout(timeout, rx.wait_for(|p| p.status == status))
            .await
            .map_err(|_| Error::Timeout {
                what: format!("fiber {} reaching {}", self.name(), status.as_str()),
                after: timeout,
            })?
            .map(|_| ())
            .map_err(|_| Error::ShuttingDown)
    }

    /// Ordered teardown: children in reverse start order, then effects in
    /// reverse. Concurrent callers await the same teardown; a call from
    /// inside this fiber's own teardown (or apply) only requests it and
    /// returns at once instead of waiting on itself. Bounded by the fiber's
    /// shutdown budget, after which it is killed.
    pub async fn dispose(&self) {
        fiber::shutdown_fiber(&self.rt, &self.shared, self.shared.policy.shutdown, false).await
    }

    /// Whether an actor runs this fiber. A plugin fiber has one from its
    /// start; a scope only once something under it needed a supervisor
    /// actor (a worker or a plugin fiber), and tears down in a task of its
    /// own otherwise.
    pub fn has_actor(&self) -> bool {
        self.shared.actor().is_some()
    }

    /// Unloads and loads the plugin again with its current config.
    pub fn restart(&self) {
        if let Some(a) = self.shared.actor() {
            self.shared.node.stats.enqueue();
            let _ = a.send_message(fiber::FiberMsg::Restart);
        }
    }

    /// Ids of the subtree in the order it stopped (the fiber itself last),
    /// once disposed.
    pub fn stop_order(&self) -> Option<Vec<u64>> {
        self.shared.stop_order().map(|o| o.to_vec())
    }

    /// Ids of the live children, in start order.
    pub fn children(&self) -> Vec<u64> {
        self.shared.children_ids()
    }

    /// How many effects are live.
    pub fn effect_count(&self) -> usize {
        self.shared.effect_count()
    }

    /// How many children run.
    pub fn child_count(&self) -> usize {
        self.shared.child_count()
    }

    /// Labels of the live effects, in registration order.
    pub fn effects(&self) -> Vec<String> {
        self.shared.effect_labels()
    }
}

/// A scope: a tagged context plus its disposal boundary.
pub struct Scope {
    ctx: Context,
    fiber: Fiber,
}

impl Scope {
    /// The tagged context; registrations through it are scope-visible and
    /// scope-lifetime.
    pub fn ctx(&self) -> &Context {
        &self.ctx
    }

    /// The scope's key.
    pub fn key(&self) -> Option<&ScopeKey> {
        self.ctx.scope.as_ref()
    }

    /// The fiber backing the scope.
    pub fn fiber(&self) -> &Fiber {
        &self.fiber
    }

    /// Revokes every registration made through the scope; racing callers
    /// await the same teardown.
    pub async fn dispose(&self) {
        self.fiber.dispose().await
    }
}

enum WorkerMake<A: Actor> {
    Once(A, A::Arguments),
    Factory(Arc<dyn Fn() -> (A, A::Arguments) + Send + Sync>),
}

/// How to start a worker actor under a fiber.
pub struct WorkerSpec<A: Actor> {
    kind: String,
    name: String,
    policy: ChildPolicy,
    make: WorkerMake<A>,
}

impl<A: Actor> WorkerSpec<A> {
    /// A one-shot worker (temporary: never restarted).
    pub fn new(kind: &str, name: impl Into<String>, actor: A, args: A::Arguments) -> Self {
        WorkerSpec {
            kind: kind.to_owned(),
            name: name.into(),
            policy: ChildPolicy::WORKER,
            make: WorkerMake::Once(actor, args),
        }
    }

    /// A worker that can be started again; `factory` makes a fresh actor and
    /// its arguments each time. Permanent unless changed.
    pub fn restartable(
        kind: &str,
        name: impl Into<String>,
        factory: impl Fn() -> (A, A::Arguments) + Send + Sync + 'static,
    ) -> Self {
        WorkerSpec {
            kind: kind.to_owned(),
            name: name.into(),
            policy: ChildPolicy {
                restart: Restart::Permanent,
                ..ChildPolicy::WORKER
            },
            make: WorkerMake::Factory(Arc::new(factory)),
        }
    }

    /// Sets the restart policy (a one-shot worker can only be temporary).
    pub fn restart(mut self, restart: Restart) -> Self {
        self.policy.restart = match self.make {
            WorkerMake::Once(..) => Restart::Temporary,
            WorkerMake::Factory(_) => restart,
        };
        self
    }

    /// Sets the shutdown budget.
    pub fn shutdown(mut self, shutdown: Shutdown) -> Self {
        self.policy.shutdown = shutdown;
        self
    }
}

/// The message type of a worker that takes no messages (it does its work in
/// its start hook). Unlike `()`, which `ractor` can serialise, it is never
/// advertised to the other nodes of a cluster.
#[derive(Debug)]
pub enum NoMessages {}

impl Message for NoMessages {}

/// A handle to a supervised worker; sends through it are counted in the
/// node's mailbox depth.
pub struct WorkerRef<M: Message> {
    id: u64,
    actor: ActorRef<M>,
    stats: Arc<NodeStats>,
}

impl<M: Message> Clone for WorkerRef<M> {
    fn clone(&self) -> Self {
        WorkerRef {
            id: self.id,
            actor: self.actor.clone(),
            stats: self.stats.clone(),
        }
    }
}

/// A failed send: the actor has stopped. Carries the message back when
/// ractor returned it.
pub struct SendError<M>(pub Option<M>);

impl<M> std::fmt::Debug for SendError<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SendError(actor stopped)")
    }
}

impl<M> std::fmt::Display for SendError<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the actor no longer accepts messages")
    }
}

impl<M> std::error::Error for SendError<M> {}

impl<M: Message> WorkerRef<M> {
    /// Node id in the tree.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The underlying ractor handle (sends through it are not counted).
    pub fn actor(&self) -> &ActorRef<M> {
        &self.actor
    }

    /// Sends a message; gives it back when the actor no longer accepts any.
    pub fn send(&self, msg: M) -> std::result::Result<(), SendError<M>> {
        self.stats.enqueue();
        self.actor.send_message(msg).map_err(|e| {
            self.stats.handled();
            match e {
                ractor::MessagingErr::SendErr(m) => SendError(Some(m)),
                _ => SendError(None),
            }
        })
    }

    /// Sends a request and waits for the reply, up to `timeout`.
    pub async fn call<R: Send + 'static>(
        &self,
        make: impl FnOnce(RpcReplyPort<R>) -> M,
        timeout: Duration,
    ) -> Result<R> {
        let (tx, rx) = ractor::concurrency::oneshot();
        let port: RpcReplyPort<R> = (tx, timeout).into();
        self.send(make(port)).map_err(|_| Error::ShuttingDown)?;
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(_)) => Err(Error::ShuttingDown),
            Err(_) => Err(Error::Timeout {
                what: format!("call to actor #{}", self.id),
                after: timeout,
            }),
        }
    }
}

/// Wraps a worker to count handled messages for the tree.
struct Counted<A> {
    inner: A,
    stats: Arc<NodeStats>,
}

impl<A: Actor> Actor for Counted<A> {
    type Msg = A::Msg;
    type State = A::State;
    type Arguments = A::Arguments;

    fn pre_start(
        &self,
        myself: ActorRef<Self::Msg>,
        args: Self::Arguments,
    ) -> impl Future<Output = std::result::Result<Self::State, ActorProcessingErr>> + Send {
        self.inner.pre_start(myself, args)
    }

    fn post_start(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> impl Future<Output = std::result::Result<(), ActorProcessingErr>> + Send {
        self.inner.post_start(myself, state)
    }

    fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> impl Future<Output = std::result::Result<(), ActorProcessingErr>> + Send {
        self.stats.handled();
        self.inner.handle(myself, message, state)
    }

    fn handle_supervisor_evt(
        &self,
        myself: ActorRef<Self::Msg>,
        message: SupervisionEvent,
        state: &mut Self::State,
    ) -> impl Future<Output = std::result::Result<(), ActorProcessingErr>> + Send {
        self.inner.handle_supervisor_evt(myself, message, state)
    }

    fn post_stop(
        &self,
        myself: ActorRef<Self::Msg>,
        state: &mut Self::State,
    ) -> impl Future<Output = std::result::Result<(), ActorProcessingErr>> + Send {
        self.inner.post_stop(myself, state)
    }
}
