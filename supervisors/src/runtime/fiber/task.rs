//! Task children: one-shot work supervised without a mailbox.
//!
//! A task child is one-shot work owned by a fiber: a tokio task of its own
//! ([`spawn`]) or a future its caller polls ([`inline`]). It is registered
//! in the tree with a kind and a name, kept among its owner's children in
//! start order, and given a cancel signal. It ends one of three ways:
//!
//! - its body returns: the node stops `disposed` and the result goes to
//!   whoever holds the [`TaskRef`];
//! - its body panics: the panic is caught, reported as a supervision event
//!   of the owner (`removed`: a task is never restarted) and the node stops
//!   `failed`;
//! - its owner stops it (a teardown, a one-for-all restart, `stop_node`):
//!   the signal is cancelled, the task is awaited up to its shutdown budget
//!   and aborted past it.
//!
//! However it ends (also aborted, or dropped unpolled), a guard inside the
//! task's future records the end and takes it out of its owner's children;
//! a stop only cancels, waits for that record and aborts past its budget.
//! An inline task ends at its caller's next poll after the abort, so its
//! caller must await it where it is made.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock, Weak};
use std::time::Duration;

use futures::FutureExt;
use futures::future::{AbortHandle, Abortable};
use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

use super::{ChildEntry, ChildKind, FiberShared};
use crate::error::Result;
use crate::events::panic_text;
use crate::policy::{ChildPolicy, Restart, Shutdown};
use crate::runtime::Runtime;
use crate::runtime::context::TaskSpec;
use crate::tree::{Form, Node, Status};

/// How long an aborted task may take to reach its next await point.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// The kernel's record of one running task child. It holds the task's
/// abort handle from before the task is registered, so whoever stops it
/// (and however often, or however interrupted) can always abort it; the
/// task's own drop guard records its end, whichever way it ends.
pub(crate) struct TaskShared {
    node: Arc<Node>,
    cancel: CancellationToken,
    abort: AbortHandle,
    /// Why it was aborted, set by whoever aborts it before the abort.
    aborted_because: OnceLock<&'static str>,
    /// Its owner asked it to stop (the end says so).
    stopping: AtomicBool,
    /// Set by the drop guard once the end is recorded.
    ended: AtomicBool,
    ended_signal: Notify,
}

impl TaskShared {
    fn has_ended(&self) -> bool {
        self.ended.load(Ordering::Acquire)
    }

    /// Waits until the drop guard has recorded the end.
    async fn wait_ended(&self) {
        loop {
            let notified = self.ended_signal.notified();
            tokio::pin!(notified);
            // Registered before the check: an end between them still wakes us.
            notified.as_mut().enable();
            if self.has_ended() {
                return;
            }
            notified.await;
        }
    }

    /// Aborts the task without waiting; `why` is recorded as its end.
    pub(super) fn abort(&self, why: &'static str) {
        let _ = self.aborted_because.set(why);
        self.cancel.cancel();
        self.abort.abort();
    }

    /// Stops the task its owner's way: cancel, await up to the budget,
    /// abort past it. Returns once the task has ended (or the abort grace
    /// ran out). Safe to call more than once, and to drop midway: the task
    /// stays abortable and its end is recorded by the task itself.
    pub(super) async fn stop(&self, rt: &Runtime, shutdown: Shutdown) {
        if self.has_ended() {
            return;
        }
        rt.tree().set_status(&self.node, Status::Unloading);
        self.stopping.store(true, Ordering::Release);
        self.cancel.cancel();
        let finished = match shutdown {
            Shutdown::BrutalKill => false,
            Shutdown::Timeout(t) => tokio::time::timeout(t, self.wait_ended()).await.is_ok(),
            Shutdown::Infinity => {
                self.wait_ended().await;
                true
            }
        };
        if finished {
            return;
        }
        if shutdown == Shutdown::BrutalKill {
            self.abort("brutal kill");
        } else {
            tracing::warn!(task = self.node.info.id, name = %self.node.info.name, "task missed its shutdown budget; aborting");
            self.abort("aborted after its shutdown budget");
        }
        if tokio::time::timeout(ABORT_GRACE, self.wait_ended())
            .await
            .is_err()
        {
            // Its body blocks a worker thread and never yields; it is
            // recorded when it does.
            tracing::error!(task = self.node.info.id, name = %self.node.info.name, "aborted task has not ended");
        }
    }
}

/// Lives inside the task's future: records the task's end when the future
/// is dropped, whether it returned, panicked, was aborted or was never
/// polled (a runtime shutting down, a caller that dropped it).
struct Ending {
    rt: Runtime,
    owner: Weak<FiberShared>,
    seq: u64,
    task: Arc<TaskShared>,
    /// What the body did, once it did something.
    outcome: Option<std::result::Result<(), String>>,
}

impl Ending {
    /// Records what the body did; the end is recorded as `self` drops.
    fn record(mut self, outcome: std::result::Result<(), String>) {
        self.outcome = Some(outcome);
    }
}

impl Drop for Ending {
    fn drop(&mut self) {
        let task = &self.task;
        let id = task.node.info.id;
        let owner = self.owner.upgrade();
        let (status, reason) = match self.outcome.take() {
            Some(Ok(())) if task.stopping.load(Ordering::Acquire) => {
                (Status::Disposed, "cancelled by its owner".to_owned())
            }
            Some(Ok(())) => (Status::Disposed, "finished".to_owned()),
            Some(Err(message)) => {
                tracing::error!(task = id, name = %task.node.info.name, message, "task child panicked");
                if let Some(owner) = &owner {
                    self.rt.tree().supervision(
                        owner.id,
                        id,
                        &format!("panicked: {message}"),
                        "removed",
                    );
                }
                (Status::Failed, format!("panicked: {message}"))
            }
            None => {
                let why = task.aborted_because.get().copied();
                (Status::Failed, why.unwrap_or("dropped").to_owned())
            }
        };
        self.rt.tree().stopped(id, status, &reason);
        if let Some(owner) = owner {
            owner.forget_child_seq(self.seq);
        }
        task.ended.store(true, Ordering::Release);
        task.ended_signal.notify_waiters();
    }
}

/// How a task child ended when it gave no result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TaskEnd {
    /// The body panicked; the panic's message.
    #[error("the task panicked: {0}")]
    Panicked(String),
    /// The task was aborted (its owner's budget ran out, or its owner was
    /// killed) before it returned.
    #[error("the task was stopped before it returned")]
    Stopped,
}

/// A handle to a running task child.
pub struct TaskRef<T> {
    id: u64,
    cancel: CancellationToken,
    result: oneshot::Receiver<std::result::Result<T, TaskEnd>>,
}

impl<T> TaskRef<T> {
    /// Node id in the tree.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Cancels the task's signal (the body decides how soon it returns).
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Waits for the task's result. A cancelled body still returns its
    /// result; only a panic or an abort gives a [`TaskEnd`].
    pub async fn join(self) -> std::result::Result<T, TaskEnd> {
        self.result.await.unwrap_or(Err(TaskEnd::Stopped))
    }
}

/// A task child, registered and not yet running: what [`spawn`] hands to
/// tokio and [`inline`] hands to its caller.
struct Registered<Fut> {
    cancel: CancellationToken,
    work: Abortable<Fut>,
    ending: Ending,
}

/// Registers a task child of `fiber` (a node, its entry among the fiber's
/// children) and wraps `body`, which gets the task's cancel signal (a child
/// of the spec's parent signal when it names one) once the task is
/// registered.
fn register<F, Fut>(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    spec: TaskSpec<'_>,
    body: F,
) -> Result<Registered<Fut>>
where
    F: FnOnce(CancellationToken) -> Fut,
{
    // Not even a node for a fiber that takes no children (the check that
    // counts is `add_child`'s, under the fiber's lock).
    if fiber.accepting().is_err() {
        return Err(fiber.inactive());
    }
    let node = fiber.child_node(
        rt,
        Form::Task,
        spec.kind,
        &spec.name,
        Status::Active,
        spec.summary,
    );
    let cancel = spec
        .cancel
        .map_or_else(CancellationToken::new, |p| p.child_token());
    let (abort, registration) = AbortHandle::new_pair();
    let shared = Arc::new(TaskShared {
        node: node.clone(),
        cancel: cancel.clone(),
        abort,
        aborted_because: OnceLock::new(),
        stopping: AtomicBool::new(false),
        ended: AtomicBool::new(false),
        ended_signal: Notify::new(),
    });
    let entry = ChildEntry {
        node,
        pid: None,
        policy: ChildPolicy {
            restart: Restart::Temporary,
            shutdown: spec.shutdown,
        },
        kind: ChildKind::Task(shared.clone()),
    };
    let seq = fiber.adopt(rt, entry)?;
    // The guard exists before the body is made: a body that panics while it
    // is made still has its end recorded (as that panic), then unwinds on.
    let ending = Ending {
        rt: rt.clone(),
        owner: Arc::downgrade(fiber),
        seq,
        task: shared,
        outcome: None,
    };
    let work = match std::panic::catch_unwind(AssertUnwindSafe(|| body(cancel.clone()))) {
        Ok(work) => Abortable::new(work, registration),
        Err(panic) => {
            ending.record(Err(panic_text(&panic)));
            std::panic::resume_unwind(panic);
        }
    };
    Ok(Registered {
        cancel,
        work,
        ending,
    })
}

/// Runs a registered task's work to its end. The end is recorded (the
/// guard dropped) before the result is handed back; dropped midway, the
/// guard records the end as it is dropped. (A combinator, not an `async
/// fn`: the work is held once, not also as an argument.)
fn supervised<T, Fut>(
    work: Abortable<Fut>,
    ending: Ending,
) -> impl Future<Output = std::result::Result<T, TaskEnd>>
where
    Fut: Future<Output = T>,
{
    AssertUnwindSafe(work)
        .catch_unwind()
        .map(move |ended| match ended {
            Ok(Ok(value)) => {
                ending.record(Ok(()));
                Ok(value)
            }
            Ok(Err(_aborted)) => Err(TaskEnd::Stopped),
            Err(panic) => {
                let message = panic_text(&panic);
                ending.record(Err(message.clone()));
                Err(TaskEnd::Panicked(message))
            }
        })
}

/// Starts `body` as a task child of `fiber`, on a tokio task of its own.
pub(crate) fn spawn<T, F, Fut>(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    spec: TaskSpec<'_>,
    body: F,
) -> Result<TaskRef<T>>
where
    T: Send + 'static,
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let Registered {
        cancel,
        work,
        ending,
    } = register(rt, fiber, spec, body)?;
    let id = ending.task.node.info.id;
    let (tx, rx) = oneshot::channel();
    // Detached on purpose: the fiber holds the abort handle and the
    // ending signal, which is all a stop needs.
    drop(tokio::spawn(supervised(work, ending).map(move |ended| {
        let _ = tx.send(ended);
    })));
    Ok(TaskRef {
        id,
        cancel,
        result: rx,
    })
}

/// Registers `body` as a task child of `fiber` that its caller runs: the
/// returned future is the task, polled by whoever awaits it, with no tokio
/// task of its own. A stop cancels and aborts it as any task child; the
/// caller's next poll ends it.
pub(crate) fn inline<'b, T: 'b, F, Fut>(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    spec: TaskSpec<'_>,
    body: F,
) -> Result<impl Future<Output = std::result::Result<T, TaskEnd>> + use<'b, T, F, Fut>>
where
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = T> + 'b,
{
    let registered = register(rt, fiber, spec, body)?;
    Ok(supervised(registered.work, registered.ending))
}
