//! Tool calls: each runs the guarded pipeline as a supervised task child
//! of the agent's scope (a tree node with a cancel signal, no mailbox):
//! a lone call in the step's own task, each call of a concurrent run on a
//! tokio task of its own;
//! children a step's calls started are disposed, last started first, once
//! the step's results are in.

use std::future::Future;

use dsh_services::llm::ContentBlock;
use dsh_services::tools::{PipelineOutcome, ToolCall, ToolError, run_pipeline};
use dsh_supervisors::error::chain;
use dsh_supervisors::{TaskEnd, TaskSpec};
use futures::FutureExt;
use futures::future::Either;
use tokio_util::sync::CancellationToken;

use super::{Awake, lock};

/// How a call runs: alone, in the step's own task; in a run of concurrent
/// calls, on a tokio task of its own, so the run uses every worker.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Placement {
    Alone,
    InRun,
}

/// Runs one call as a supervised task child of the agent's scope (placed
/// as `placement` says); its signal is a child of the step's `token`.
pub(super) async fn execute(
    me: &Awake,
    call: ToolCall,
    token: &CancellationToken,
    placement: Placement,
) -> PipelineOutcome {
    let name = format!("tool/{}#{}", call.name, call.id);
    let summary = serde_json::json!({ "tool": call.name, "call": gist(&call.arguments) });
    let spec = TaskSpec::new("tool", name)
        .summary(summary)
        .cancelled_by(token);
    let ended = match placement {
        // Boxed: a run's futures, each waiting on its task, stay small.
        Placement::Alone => Box::pin(alone(me, spec, call)).await,
        Placement::InRun => in_run(me, spec, call).await,
    };
    match ended {
        Ok(outcome) => outcome,
        Err(Ended::Refused(e)) => aborted(format!("the call could not start: {}", chain(&e))),
        Err(Ended::Task(TaskEnd::Panicked(message))) => {
            aborted(format!("the tool panicked: {message}"))
        }
        Err(Ended::Task(TaskEnd::Stopped)) => {
            aborted("the call was stopped before it finished".into())
        }
    }
}

/// What a call does, for its tree node: its telling argument on one line,
/// with no control characters, at most [`GIST`] characters.
fn gist(arguments: &str) -> String {
    let text = dsh_services::tools::telling_argument(arguments);
    let mut words = text
        .split(|c: char| c.is_whitespace() || c.is_control() || reorders(c))
        .filter(|w| !w.is_empty());
    let mut out = String::new();
    for word in words.by_ref() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
        if out.chars().count() > GIST {
            break;
        }
    }
    if out.chars().count() > GIST {
        out = out.chars().take(GIST - 1).collect();
        out.push('…');
    }
    out
}

/// A bidirectional control: it would reorder what follows it on the page.
fn reorders(c: char) -> bool {
    matches!(c, '\u{200E}' | '\u{200F}' | '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}')
}

/// The longest gist a tool node shows.
const GIST: usize = 120;

/// Why a call gave no outcome of its own.
enum Ended {
    Refused(dsh_supervisors::Error),
    Task(TaskEnd),
}

/// A lone call, run in the step's task. (Not an `async fn`: the task's
/// future is held once, not also in the `Result` that made it.)
fn alone<'a>(
    me: &'a Awake,
    spec: TaskSpec<'_>,
    call: ToolCall,
) -> impl Future<Output = Result<PipelineOutcome, Ended>> + 'a {
    let (ctx, tools, approval) = (&me.ctx, &me.tools, me.approval.as_deref());
    let task = me.ctx.run_task(spec, move |cancel| {
        run_pipeline(ctx, tools, approval, call, cancel, me.bounds.clone())
    });
    match task {
        Ok(task) => Either::Left(task.map(|ended| ended.map_err(Ended::Task))),
        Err(e) => Either::Right(std::future::ready(Err(Ended::Refused(e)))),
    }
}

/// A call of a concurrent run, on a tokio task of its own.
async fn in_run(me: &Awake, spec: TaskSpec<'_>, call: ToolCall) -> Result<PipelineOutcome, Ended> {
    let (ctx, tools) = (me.ctx.clone(), me.tools.clone());
    let (approval, bounds) = (me.approval.clone(), me.bounds.clone());
    let task = me
        .ctx
        .spawn_task(spec, move |cancel| async move {
            let approval = approval.as_deref();
            Box::pin(run_pipeline(&ctx, &tools, approval, call, cancel, bounds)).await
        })
        .map_err(Ended::Refused)?;
    task.join().await.map_err(Ended::Task)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tool_node_reads_what_its_call_does_on_one_inert_line() {
        assert_eq!(
            gist(r#"{"command":"cargo  test\n--all"}"#),
            "cargo test --all"
        );
        assert_eq!(gist(r#"{"path":"src/lib.rs","limit":3}"#), "src/lib.rs");
        assert_eq!(gist(r#"{"a":1}"#), r#"{"a":1}"#);
        // Control characters and bidirectional overrides go.
        assert_eq!(
            gist("{\"command\":\"rm \\u001b[2J\\u202egnp.exe\"}"),
            "rm [2J gnp.exe"
        );
        let long = gist(&format!(r#"{{"command":"{}"}}"#, "x ".repeat(200)));
        assert_eq!(long.chars().count(), GIST);
        assert!(long.ends_with('…'));
    }
}
