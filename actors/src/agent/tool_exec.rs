//! Tool calls: each runs the guarded pipeline in a short-lived supervised
//! actor under the agent's scope; children a step's calls started are
//! disposed, last started first, once the step's results are in.

use std::sync::Arc;

use dsh_services::approval::Approval;
use dsh_services::llm::ContentBlock;
use dsh_services::tools::{Bounds, PipelineOutcome, ToolCall, ToolRegistry, run_pipeline};
use dsh_supervisors::{Context, WorkerSpec};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use super::{Awake, lock};

/// Runs one call as a supervised child actor of the agent's scope.
pub(super) async fn execute(
    me: &Awake,
    call: ToolCall,
    token: &CancellationToken,
) -> PipelineOutcome {
    let (tx, rx) = oneshot::channel();
    let args = ToolRun {
        ctx: me.ctx.clone(),
        tools: me.tools.clone(),
        approval: me.approval.clone(),
        call: call.clone(),
        cancel: token.child_token(),
        bounds: me.bounds.clone(),
        reply: Some(tx),
    };
    let name = format!("tool/{}#{}", call.name, call.id);
    let spawned = Box::pin(me.ctx.spawn(WorkerSpec::new("tool", name, ToolExec, args))).await;
    if let Err(e) = spawned {
        return PipelineOutcome {
            content: vec![ContentBlock::text(format!(
                "Error: the call could not start: {e}"
            ))],
            error: Some(dsh_services::tools::ToolError::new(
                "ABORTED",
                e.to_string(),
            )),
            meta: None,
        };
    }
    rx.await.unwrap_or_else(|_| PipelineOutcome {
        content: vec![ContentBlock::text(
            "Error: the call was stopped before it finished",
        )],
        error: Some(dsh_services::tools::ToolError::new(
            "ABORTED",
            "the call was stopped before it finished",
        )),
        meta: None,
    })
}

/// One tool call's actor: runs the pipeline once, replies, stops.
struct ToolExec;

struct ToolRun {
    ctx: Context,
    tools: Arc<ToolRegistry>,
    approval: Option<Arc<Approval>>,
    call: ToolCall,
    cancel: CancellationToken,
    bounds: Bounds,
    reply: Option<oneshot::Sender<PipelineOutcome>>,
}

impl Actor for ToolExec {
    type Msg = ();
    type State = ToolRun;
    type Arguments = ToolRun;

    async fn pre_start(
        &self,
        _me: ActorRef<()>,
        args: ToolRun,
    ) -> Result<ToolRun, ActorProcessingErr> {
        Ok(args)
    }

    async fn post_start(
        &self,
        me: ActorRef<()>,
        run: &mut ToolRun,
    ) -> Result<(), ActorProcessingErr> {
        let outcome = Box::pin(run_pipeline(
            &run.ctx,
            &run.tools,
            run.approval.as_deref(),
            run.call.clone(),
            run.cancel.clone(),
            run.bounds.clone(),
        ))
        .await;
        if let Some(reply) = run.reply.take() {
            let _ = reply.send(outcome);
        }
        me.stop(None);
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<()>,
        run: &mut ToolRun,
    ) -> Result<(), ActorProcessingErr> {
        // Stopped before finishing (drained by a teardown): cancel the body.
        run.cancel.cancel();
        Ok(())
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
