//! Task children: one-shot work supervised without a mailbox.
//!
//! A task child is a tokio task owned by a fiber. It is registered in the
//! tree with a kind and a name, kept among its owner's children in start
//! order, and given a cancel signal. It ends one of three ways:
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
//! Whichever of the task's own end and its owner's stop comes first records
//! the node's end; the other finds it recorded.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures::FutureExt;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{ChildEntry, ChildKind, FiberShared};
use crate::error::{Error, Result};
use crate::events::panic_text;
use crate::policy::{ChildPolicy, Restart, Shutdown};
use crate::runtime::Runtime;
use crate::tree::{Form, Node, NodeInfo, Status, now_ms};

/// How long an aborted task may take to reach its next await point.
const ABORT_GRACE: Duration = Duration::from_secs(5);

/// The kernel's record of one running task child.
pub(crate) struct TaskShared {
    node: Arc<Node>,
    cancel: CancellationToken,
    handle: Mutex<Option<JoinHandle<()>>>,
    ended: AtomicBool,
}

impl TaskShared {
    /// Records the node's end once; later calls do nothing.
    fn end(&self, rt: &Runtime, status: Status, reason: &str) {
        if !self.ended.swap(true, Ordering::AcqRel) {
            rt.tree().stopped(self.node.info.id, status, reason);
        }
    }

    fn take_handle(&self) -> Option<JoinHandle<()>> {
        self.handle.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Stops the task its owner's way: cancel, await up to the budget,
    /// abort past it. Returns once the task has ended.
    pub(super) async fn stop(&self, rt: &Runtime, shutdown: Shutdown) {
        if self.ended.load(Ordering::Acquire) {
            return;
        }
        rt.tree().set_status(&self.node, Status::Unloading);
        self.cancel.cancel();
        // No handle: the task ended already, or another stop holds it.
        let Some(mut handle) = self.take_handle() else {
            return;
        };
        let finished = match shutdown {
            Shutdown::BrutalKill => false,
            Shutdown::Timeout(t) => tokio::time::timeout(t, &mut handle).await.is_ok(),
            Shutdown::Infinity => {
                let _ = (&mut handle).await;
                true
            }
        };
        if finished {
            self.end(rt, Status::Disposed, "cancelled by its owner");
            return;
        }
        if shutdown != Shutdown::BrutalKill {
            tracing::warn!(task = self.node.info.id, name = %self.node.info.name, "task missed its shutdown budget; aborting");
        }
        handle.abort();
        let _ = tokio::time::timeout(ABORT_GRACE, handle).await;
        let why = if shutdown == Shutdown::BrutalKill {
            "brutal kill"
        } else {
            "aborted after its shutdown budget"
        };
        self.end(rt, Status::Failed, why);
    }

    /// Aborts the task without waiting (its owner was killed).
    pub(super) fn abort(&self, rt: &Runtime, reason: &str) {
        self.cancel.cancel();
        if let Some(handle) = self.take_handle() {
            handle.abort();
        }
        self.end(rt, Status::Failed, reason);
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

/// Starts `body` as a task child of `fiber`. The body gets the task's
/// cancel signal (a child of `parent_cancel` when one is given).
pub(crate) fn spawn<T, F, Fut>(
    rt: &Runtime,
    fiber: &Arc<FiberShared>,
    kind: &str,
    name: String,
    shutdown: Shutdown,
    parent_cancel: Option<&CancellationToken>,
    body: F,
) -> Result<TaskRef<T>>
where
    T: Send + 'static,
    F: FnOnce(CancellationToken) -> Fut,
    Fut: Future<Output = T> + Send + 'static,
{
    let id = rt.next_id();
    let node = rt.tree().insert(
        NodeInfo {
            id,
            form: Form::Task,
            kind: Arc::from(kind),
            name: Arc::from(name),
            parent: Some(fiber.id),
            started_ms: now_ms(),
        },
        Status::Active,
    );
    let cancel = parent_cancel.map_or_else(CancellationToken::new, |p| p.child_token());
    let shared = Arc::new(TaskShared {
        node: node.clone(),
        cancel: cancel.clone(),
        handle: Mutex::new(None),
        ended: AtomicBool::new(false),
    });
    let entry = ChildEntry {
        node,
        pid: None,
        policy: ChildPolicy {
            restart: Restart::Temporary,
            shutdown,
        },
        kind: ChildKind::Task(shared.clone()),
    };
    let seq = match fiber.add_child(entry) {
        Ok(seq) => seq,
        Err(_) => {
            rt.tree()
                .stopped(id, Status::Failed, "owner is shutting down");
            return Err(Error::InactiveFiber {
                fiber: format!("{}#{}", fiber.name(), fiber.id),
                state: fiber.status().as_str(),
            });
        }
    };
    let (tx, rx) = oneshot::channel();
    let work = body(cancel.clone());
    let owner = Arc::downgrade(fiber);
    let task = shared.clone();
    let rt2 = rt.clone();
    let handle = tokio::spawn(async move {
        let outcome = AssertUnwindSafe(work).catch_unwind().await;
        let result = settle(
            &rt2,
            &owner,
            seq,
            &task,
            outcome.map_err(|p| panic_text(&p)),
        );
        let _ = tx.send(result);
    });
    *shared.handle.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
    Ok(TaskRef {
        id,
        cancel,
        result: rx,
    })
}

/// The task's own end: records it, leaves the owner's children, and hands
/// back what goes to the [`TaskRef`].
fn settle<T>(
    rt: &Runtime,
    owner: &Weak<FiberShared>,
    seq: u64,
    task: &TaskShared,
    outcome: std::result::Result<T, String>,
) -> std::result::Result<T, TaskEnd> {
    let owner = owner.upgrade();
    let result = match outcome {
        Ok(value) => {
            task.end(rt, Status::Disposed, "finished");
            Ok(value)
        }
        Err(message) => {
            let id = task.node.info.id;
            tracing::error!(task = id, name = %task.node.info.name, message, "task child panicked");
            if let Some(owner) = &owner {
                rt.tree()
                    .supervision(owner.id, id, &format!("panicked: {message}"), "removed");
            }
            task.end(rt, Status::Failed, &format!("panicked: {message}"));
            Err(TaskEnd::Panicked(message))
        }
    };
    if let Some(owner) = owner {
        owner.forget_child_seq(seq);
    }
    result
}
