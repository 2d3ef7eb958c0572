//! Tool calls: each runs the guarded pipeline as a supervised task child
//! of the agent's scope (a tree node with a cancel signal, no mailbox);
//! children a step's calls started are disposed, last started first, once
//! the step's results are in.

use dsh_services::llm::ContentBlock;
use dsh_services::tools::{PipelineOutcome, ToolCall, ToolError, run_pipeline};
use dsh_supervisors::{TaskEnd, TaskSpec};
use tokio_util::sync::CancellationToken;

use super::{Awake, lock};

/// Runs one call as a supervised task child of the agent's scope; its
/// signal is a child of the step's `token`.
pub(super) async fn execute(
    me: &Awake,
    call: ToolCall,
    token: &CancellationToken,
) -> PipelineOutcome {
    let name = format!("tool/{}#{}", call.name, call.id);
    let ctx = me.ctx.clone();
    let tools = me.tools.clone();
    let approval = me.approval.clone();
    let bounds = me.bounds.clone();
    let spec = TaskSpec::new("tool", name).cancelled_by(token);
    let started = me.ctx.spawn_task(spec, move |cancel| async move {
        Box::pin(run_pipeline(
            &ctx,
            &tools,
            approval.as_deref(),
            call,
            cancel,
            bounds,
        ))
        .await
    });
    let ended = match started {
        Ok(task) => task.join().await,
        Err(e) => return aborted(format!("the call could not start: {e}")),
    };
    match ended {
        Ok(outcome) => outcome,
        Err(TaskEnd::Panicked(message)) => aborted(format!("the tool panicked: {message}")),
        Err(TaskEnd::Stopped) => aborted("the call was stopped before it finished".into()),
    }
}

/// The result of a call that gave none of its own.
fn aborted(message: String) -> PipelineOutcome {
    PipelineOutcome {
        content: vec![ContentBlock::text(format!("Error: {message}"))],
        error: Some(ToolError::new("ABORTED", message)),
        meta: None,
    }
}

/// Disposes the children the step's calls handed over, in reverse start
/// order (their position among the agent's own children).
pub(super) async fn release_step_children(me: &Awake) {
    let mut children = std::mem::take(&mut *lock(&me.step_children));
    if children.is_empty() {
        return;
    }
    let order = me.scope.fiber().children();
    children.sort_by_key(|c| order.iter().position(|n| *n == c.node_id()));
    for child in children.into_iter().rev() {
        child.dispose().await;
    }
}
