//! Typed events in the five Cordis dispatch modes.
//!
//! An event is a Rust type; the mode it is dispatched in is part of its
//! contract and is chosen by the trait it implements ([`Emit`], [`Bail`],
//! [`Parallel`], [`Serial`], [`Waterfall`]). Dispatch runs in the caller's
//! task over a lock-free snapshot of the listener list (an `ArcSwap`), so a
//! listener added or removed during a dispatch affects the next one only.
//!
//! What the dispatcher sees when a listener panics (the panic is caught,
//! logged, and reported on the tree feed as a supervision event of the
//! registering fiber; the listener stays registered):
//! - `emit`: nothing; the remaining listeners still run.
//! - `bail`: the panicking listener counts as "no answer"; the next one runs.
//! - `parallel`: the other listeners finish; the dispatch resolves normally.
//! - `serial`: like `bail`, the next listener runs.
//! - `waterfall`: the chain above the panicking listener is unwound and the
//!   dispatch returns [`Error::ListenerPanicked`] naming that listener's
//!   fiber; the next dispatch runs the full chain again.

use std::any::{Any, TypeId};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use futures::FutureExt;
use futures::future::BoxFuture;

use crate::error::{Error, Result};
use crate::scope::ScopeKey;
use crate::tree::Tree;

/// A typed event. The type is the payload.
pub trait Event: Send + Sync + 'static {
    /// The event's public name, e.g. `llm/stream`.
    const NAME: &'static str;
}

/// Synchronous notification; listener results are ignored.
pub trait Emit: Event {}

/// Synchronous: listeners in order until one returns `Some`.
pub trait Bail: Event {
    /// The answer a listener may give.
    type Output: Send + 'static;
}

/// Asynchronous: every listener concurrently; awaited together.
pub trait Parallel: Event {}

/// Asynchronous: listeners one after another until one returns `Some`.
pub trait Serial: Event {
    /// The answer a listener may give.
    type Output: Send + 'static;
}

/// Middleware: each listener wraps the rest of the chain and the final
/// built-in behaviour, and may call [`Next::run`] zero, one or more times.
pub trait Waterfall: Event + Sized {
    /// What the chain produces.
    type Output: Send + 'static;
}

/// Listener of an [`Emit`] event.
pub type EmitFn<E> = dyn Fn(&E) + Send + Sync;
/// Listener of a [`Bail`] event.
pub type BailFn<E> = dyn Fn(&E) -> Option<<E as Bail>::Output> + Send + Sync;
/// Listener of a [`Parallel`] event.
pub type ParallelFn<E> = dyn Fn(Arc<E>) -> BoxFuture<'static, ()> + Send + Sync;
/// Listener of a [`Serial`] event.
pub type SerialFn<E> =
    dyn Fn(Arc<E>) -> BoxFuture<'static, Option<<E as Serial>::Output>> + Send + Sync;
/// Listener of a [`Waterfall`] event.
pub type WaterfallFn<E> =
    dyn Fn(E, Next<E>) -> BoxFuture<'static, <E as Waterfall>::Output> + Send + Sync;
type TerminalFn<E> = dyn Fn(E) -> BoxFuture<'static, <E as Waterfall>::Output> + Send + Sync;

/// Which listeners a dispatch reaches.
#[derive(Clone, Debug, Default)]
pub enum Target {
    /// Every listener (an ordinary, unfiltered event).
    #[default]
    All,
    /// A scope-filtered dispatch: untagged listeners, `global` listeners, and
    /// listeners tagged with this key or one of its ancestors. `None` reaches
    /// untagged and `global` listeners only.
    Scope(Option<ScopeKey>),
}

/// Options of a registration.
#[derive(Clone, Copy, Debug, Default)]
pub struct ListenOptions {
    /// Run before listeners already registered.
    pub prepend: bool,
    /// Receive scope-filtered dispatches whatever their key.
    pub global: bool,
}

struct Entry<F: ?Sized> {
    id: u64,
    fiber: u64,
    scope: Option<ScopeKey>,
    global: bool,
    f: Box<F>,
}

impl<F: ?Sized> Entry<F> {
    fn admitted(&self, target: &Target) -> bool {
        match (target, &self.scope) {
            (Target::All, _) | (_, None) => true,
            _ if self.global => true,
            (Target::Scope(None), Some(_)) => false,
            (Target::Scope(Some(key)), Some(tag)) => tag.admits(key),
        }
    }
}

struct Table<F: ?Sized> {
    list: ArcSwap<Vec<Arc<Entry<F>>>>,
    // Serializes writers; readers never take it.
    write: Mutex<()>,
}

impl<F: ?Sized + 'static> Table<F> {
    fn new() -> Self {
        Table {
            list: ArcSwap::from_pointee(Vec::new()),
            write: Mutex::new(()),
        }
    }

    fn insert(&self, entry: Entry<F>, prepend: bool) {
        let _guard = self.write.lock();
        let mut next: Vec<Arc<Entry<F>>> = self.list.load().as_ref().clone();
        if prepend {
            next.insert(0, Arc::new(entry));
        } else {
            next.push(Arc::new(entry));
        }
        self.list.store(Arc::new(next));
    }

    fn remove(&self, id: u64) -> bool {
        let _guard = self.write.lock();
        let current = self.list.load();
        if !current.iter().any(|e| e.id == id) {
            return false;
        }
        let next: Vec<_> = current.iter().filter(|e| e.id != id).cloned().collect();
        self.list.store(Arc::new(next));
        true
    }
}

/// Removes one listener; returned by registration and held by the fiber's effect.
pub(crate) struct Unlisten(Box<dyn Fn() -> bool + Send + Sync>);

impl Unlisten {
    pub(crate) fn run(&self) -> bool {
        (self.0)()
    }
}

/// The event bus of one runtime.
pub struct Events {
    tables: DashMap<TypeId, Arc<dyn Any + Send + Sync>>,
    next_id: AtomicU64,
    tree: Arc<Tree>,
}

/// Who registers a listener: the owning fiber and its scope tag.
#[derive(Clone, Debug)]
pub(crate) struct Owner {
    pub fiber: u64,
    pub scope: Option<ScopeKey>,
}

impl Events {
    pub(crate) fn new(tree: Arc<Tree>) -> Events {
        Events {
            tables: DashMap::new(),
            next_id: AtomicU64::new(1),
            tree,
        }
    }

    fn table<F: ?Sized + Send + Sync + 'static>(&self) -> Arc<Table<F>> {
        let key = TypeId::of::<F>();
        if let Some(t) = self.tables.get(&key)
            && let Ok(t) = t.value().clone().downcast::<Table<F>>()
        {
            return t;
        }
        let fresh: Arc<dyn Any + Send + Sync> = Arc::new(Table::<F>::new());
        let stored = self.tables.entry(key).or_insert(fresh).value().clone();
        match stored.downcast::<Table<F>>() {
            Ok(t) => t,
            // The key is the type's own id, so the stored table has that type.
            Err(_) => Arc::new(Table::new()),
        }
    }

    fn peek<F: ?Sized + Send + Sync + 'static>(&self) -> Option<Arc<Vec<Arc<Entry<F>>>>> {
        let t = self.tables.get(&TypeId::of::<F>())?;
        let table = t.value().downcast_ref::<Table<F>>()?;
        Some(table.list.load_full())
    }

    pub(crate) fn register<F: ?Sized + Send + Sync + 'static>(
        &self,
        owner: &Owner,
        f: Box<F>,
        options: ListenOptions,
    ) -> Unlisten {
        let table = self.table::<F>();
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        table.insert(
            Entry {
                id,
                fiber: owner.fiber,
                scope: owner.scope.clone(),
                global: options.global,
                f,
            },
            options.prepend,
        );
        Unlisten(Box::new(move || table.remove(id)))
    }

    fn report(&self, event: &'static str, fiber: u64, message: &str) {
        tracing::error!(event, fiber, message, "event listener panicked");
        self.tree.supervision(
            fiber,
            fiber,
            &format!("listener of `{event}` panicked: {message}"),
            "isolated",
        );
    }

    /// Number of listeners registered for a listener type (for tests/diagnostics).
    pub fn listener_count<F: ?Sized + Send + Sync + 'static>(&self) -> usize {
        self.peek::<F>().map(|l| l.len()).unwrap_or(0)
    }

    /// Dispatches an [`Emit`] event.
    pub fn emit<E: Emit>(&self, target: &Target, event: &E) {
        let Some(list) = self.peek::<EmitFn<E>>() else {
            return;
        };
        for entry in list.iter().filter(|e| e.admitted(target)) {
            if let Err(panic) = std::panic::catch_unwind(AssertUnwindSafe(|| (entry.f)(event))) {
                self.report(E::NAME, entry.fiber, &panic_text(&panic));
            }
        }
    }

    /// Dispatches a [`Bail`] event; the first `Some` wins.
    pub fn bail<E: Bail>(&self, target: &Target, event: &E) -> Option<E::Output> {
        let list = self.peek::<BailFn<E>>()?;
        for entry in list.iter().filter(|e| e.admitted(target)) {
            match std::panic::catch_unwind(AssertUnwindSafe(|| (entry.f)(event))) {
                Ok(Some(out)) => return Some(out),
                Ok(None) => {}
                Err(panic) => self.report(E::NAME, entry.fiber, &panic_text(&panic)),
            }
        }
        None
    }

    /// Dispatches a [`Parallel`] event and waits for every listener.
    pub async fn parallel<E: Parallel>(&self, target: &Target, event: E) {
        let Some(list) = self.peek::<ParallelFn<E>>().filter(|l| !l.is_empty()) else {
            return;
        };
        let event = Arc::new(event);
        let runs = list.iter().filter(|e| e.admitted(target)).map(|entry| {
            let fut = std::panic::catch_unwind(AssertUnwindSafe(|| (entry.f)(event.clone())));
            let fiber = entry.fiber;
            async move {
                let outcome = match fut {
                    Ok(fut) => AssertUnwindSafe(fut).catch_unwind().await,
                    Err(panic) => Err(panic),
                };
                if let Err(panic) = outcome {
                    self.report(E::NAME, fiber, &panic_text(&panic));
                }
            }
        });
        futures::future::join_all(runs).await;
    }

    /// Dispatches a [`Serial`] event; the first `Some` wins.
    pub async fn serial<E: Serial>(&self, target: &Target, event: E) -> Option<E::Output> {
        let list = self.peek::<SerialFn<E>>().filter(|l| !l.is_empty())?;
        let event = Arc::new(event);
        for entry in list.iter().filter(|e| e.admitted(target)) {
            let outcome =
                match std::panic::catch_unwind(AssertUnwindSafe(|| (entry.f)(event.clone()))) {
                    Ok(fut) => AssertUnwindSafe(fut).catch_unwind().await,
                    Err(panic) => Err(panic),
                };
            match outcome {
                Ok(Some(out)) => return Some(out),
                Ok(None) => {}
                Err(panic) => self.report(E::NAME, entry.fiber, &panic_text(&panic)),
            }
        }
        None
    }

    /// Dispatches a [`Waterfall`] event around `terminal`, the built-in behaviour.
    pub async fn waterfall<E, T, Fut>(
        &self,
        target: &Target,
        event: E,
        terminal: T,
    ) -> Result<E::Output>
    where
        E: Waterfall,
        T: Fn(E) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = E::Output> + Send + 'static,
    {
        let list = match self.peek::<WaterfallFn<E>>() {
            Some(list) if list.iter().any(|e| e.admitted(target)) => list,
            // Nobody wraps this dispatch: the built-in behaviour, directly.
            _ => return Ok(terminal(event).await),
        };
        let terminal: Arc<TerminalFn<E>> = Arc::new(move |e| terminal(e).boxed());
        let fault = Arc::new(Mutex::new(None));
        let next = Next {
            list,
            index: 0,
            target: target.clone(),
            terminal,
            fault: fault.clone(),
        };
        match AssertUnwindSafe(next.run(event)).catch_unwind().await {
            Ok(out) => Ok(out),
            Err(panic) => {
                let (fiber, message) = fault
                    .lock()
                    .ok()
                    .and_then(|mut f| f.take())
                    .unwrap_or((0, panic_text(&panic)));
                self.report(E::NAME, fiber, &message);
                Err(Error::ListenerPanicked {
                    event: E::NAME,
                    fiber,
                    message,
                })
            }
        }
    }
}

/// The rest of a waterfall chain, handed to each listener.
pub struct Next<E: Waterfall> {
    list: Arc<Vec<Arc<Entry<WaterfallFn<E>>>>>,
    index: usize,
    target: Target,
    terminal: Arc<TerminalFn<E>>,
    fault: Arc<Mutex<Option<(u64, String)>>>,
}

impl<E: Waterfall> Clone for Next<E> {
    fn clone(&self) -> Self {
        Next {
            list: self.list.clone(),
            index: self.index,
            target: self.target.clone(),
            terminal: self.terminal.clone(),
            fault: self.fault.clone(),
        }
    }
}

impl<E: Waterfall> Next<E> {
    /// Runs the rest of the chain (finally the built-in behaviour) on `event`.
    pub fn run(&self, event: E) -> BoxFuture<'static, E::Output> {
        let mut index = self.index;
        while let Some(entry) = self.list.get(index) {
            if entry.admitted(&self.target) {
                let entry = entry.clone();
                let next = Next {
                    index: index + 1,
                    ..self.clone()
                };
                let fault = self.fault.clone();
                return async move {
                    let fiber = entry.fiber;
                    let run = std::panic::catch_unwind(AssertUnwindSafe(|| (entry.f)(event, next)));
                    let outcome = match run {
                        Ok(fut) => AssertUnwindSafe(fut).catch_unwind().await,
                        Err(panic) => Err(panic),
                    };
                    match outcome {
                        Ok(out) => out,
                        Err(panic) => {
                            if let Ok(mut slot) = fault.lock()
                                && slot.is_none()
                            {
                                *slot = Some((fiber, panic_text(&panic)));
                            }
                            std::panic::resume_unwind(panic)
                        }
                    }
                }
                .boxed();
            }
            index += 1;
        }
        (self.terminal)(event)
    }
}

/// The text of a caught panic payload.
pub fn panic_text(panic: &Box<dyn Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".to_owned()
    }
}
