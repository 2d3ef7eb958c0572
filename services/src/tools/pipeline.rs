//! The guarded pipeline one tool call goes through.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use dsh_supervisors::error::chain;
use dsh_supervisors::events::{BailFn, WaterfallFn, panic_text};
use dsh_supervisors::{Bail, Context, Emit, Event, Target, Waterfall};
use futures::FutureExt;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use super::registry::{Resolution, ToolRegistry};
use super::{Bounds, ToolCall, ToolContext, ToolError, ToolOutput};
use crate::approval::{Approval, ApprovalOutcome, ApprovalRequest};
use crate::llm::ContentBlock;
use crate::sandbox::{PermissionMode, Policy};

/// What `tools/pre-execute` decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Go ahead.
    Allow,
    /// Refuse, with the reason the model sees.
    Deny(String),
    /// Ask the approval seam first.
    Ask(String),
}

/// `tools/pre-execute` (waterfall): policy before anything runs. Listeners
/// may rewrite `args`; the terminal allows with the arguments it is given.
pub struct PreExecute {
    /// The call.
    pub call: Arc<ToolCall>,
    /// Validated arguments (rewritable).
    pub args: Value,
    /// Where the call runs (the calling agent's scope).
    pub ctx: Context,
    /// The call's cancel signal.
    pub cancel: CancellationToken,
    /// The call's directory and policy.
    pub bounds: Bounds,
}

impl Event for PreExecute {
    const NAME: &'static str = "tools/pre-execute";
}
impl Waterfall for PreExecute {
    type Output = (Decision, Value);
}

/// `tools/guard` (bail): monotonic guards; the first `Some(reason)` denies.
pub struct ToolGuard {
    /// The call.
    pub call: Arc<ToolCall>,
    /// Arguments after pre-execute.
    pub args: Value,
}

impl Event for ToolGuard {
    const NAME: &'static str = "tools/guard";
}
impl Bail for ToolGuard {
    type Output = String;
}

/// `tools/execute` (waterfall): around the body (timeouts, retries, metrics).
pub struct ToolExecute {
    /// The call.
    pub call: Arc<ToolCall>,
    /// What the body will receive.
    pub cx: ToolContext,
}

impl Event for ToolExecute {
    const NAME: &'static str = "tools/execute";
}
impl Waterfall for ToolExecute {
    type Output = Result<ToolOutput, ToolError>;
}

/// `tools/post-execute` (waterfall): may accept, block or replace the outcome.
pub struct PostExecute {
    /// The call.
    pub call: Arc<ToolCall>,
    /// Its validated arguments (`Null` when it failed before validation, or
    /// when no listener of this event was registered as its body started).
    pub args: Value,
    /// The outcome so far.
    pub outcome: Result<ToolOutput, ToolError>,
    /// Where the call ran (the calling agent's scope).
    pub ctx: Context,
    /// The call's cancel signal.
    pub cancel: CancellationToken,
    /// The call's directory and policy.
    pub bounds: Bounds,
}

impl Event for PostExecute {
    const NAME: &'static str = "tools/post-execute";
}
impl Waterfall for PostExecute {
    type Output = Result<ToolOutput, ToolError>;
}

/// `tools/result` (emit): the final, immutable outcome of one call.
#[derive(Clone, Debug)]
pub struct ToolResultEvent {
    /// The call.
    pub call: Arc<ToolCall>,
    /// Model-facing content.
    pub content: Vec<ContentBlock>,
    /// Failure identity, when it failed.
    pub error: Option<ToolError>,
}

impl Event for ToolResultEvent {
    const NAME: &'static str = "tools/result";
}
impl Emit for ToolResultEvent {}

/// The settled outcome of one call.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineOutcome {
    /// Model-facing content (an error becomes one text block).
    pub content: Vec<ContentBlock>,
    /// Failure identity.
    pub error: Option<ToolError>,
    /// Tool-private presentation data.
    pub meta: Option<Value>,
}

fn listener_failure(e: dsh_supervisors::Error) -> ToolError {
    ToolError::new("PANICKED", chain(&e).to_string())
}

/// Runs one call through the whole pipeline, in the order the module docs
/// give. Never fails: every failure is an `is_error` outcome.
pub async fn run_pipeline(
    ctx: &Context,
    registry: &ToolRegistry,
    approval: Option<&Approval>,
    call: ToolCall,
    cancel: CancellationToken,
    bounds: Bounds,
) -> PipelineOutcome {
    let call = Arc::new(call);
    let target = Target::Scope(ctx.scope_key().cloned());
    let events = ctx.events();
    let (post_cancel, post_bounds) = (cancel.clone(), bounds.clone());
    let mut post_args = Value::Null;
    let (outcome, finalize) =
        match prepare(ctx, registry, approval, &call, &target, cancel, bounds).await {
            Err(e) => (Err(e), None),
            Ok((tool, cx)) => {
                // Only a `tool/post-execute` listener reads the arguments
                // after the body, which takes them: copied for one only.
                if events.listener_count::<WaterfallFn<PostExecute>>() > 0 {
                    post_args = cx.args.clone();
                }
                let body_tool = tool.clone();
                let terminal = move |ex: ToolExecute| run_body(body_tool.clone(), ex.cx);
                let executed = events
                    .waterfall(
                        &target,
                        ToolExecute {
                            call: call.clone(),
                            cx,
                        },
                        terminal,
                    )
                    .await
                    .unwrap_or_else(|e| Err(listener_failure(e)));
                (executed, Some(tool))
            }
        };
    let post = events
        .waterfall(
            &target,
            PostExecute {
                call: call.clone(),
                args: post_args,
                outcome,
                ctx: ctx.clone(),
                cancel: post_cancel,
                bounds: post_bounds,
            },
            |p: PostExecute| async move { p.outcome },
        )
        .await
        .unwrap_or_else(|e| Err(listener_failure(e)));
    let post = match post {
        Ok(output) => Ok(spill(ctx, &call, output).await),
        failed => failed,
    };
    let settled = match post {
        Ok(output) => {
            let output = match &finalize {
                Some(t) => t.tool.finalize_content(output),
                None => output,
            };
            PipelineOutcome {
                content: output.content,
                error: None,
                meta: output.meta,
            }
        }
        Err(e) => PipelineOutcome {
            // As upstream's harness: `Error: <what happened>`; the code
            // rides the result's error (logged with `tool/result`).
            content: vec![ContentBlock::text(format!("Error: {}", e.message))],
            error: Some(e),
            meta: None,
        },
    };
    // Nobody listening: skip building the event (it copies the content).
    if events.listener_count::<dsh_supervisors::events::EmitFn<ToolResultEvent>>() > 0 {
        events.emit(
            &target,
            &ToolResultEvent {
                call,
                content: settled.content.clone(),
                error: settled.error.clone(),
            },
        );
    }
    settled
}

/// `output`, spilled when a spill store is provided and it is too long.
async fn spill(ctx: &Context, call: &ToolCall, output: ToolOutput) -> ToolOutput {
    let Some(store) = ctx.get::<super::SpillStore>(super::SpillStore::SERVICE) else {
        return output;
    };
    let session = ctx
        .get::<dyn crate::session::SessionWriter>(crate::session::SESSION_SERVICE)
        .map_or_else(|| "no-session".into(), |s| s.session_id());
    store.apply(&session, &call.name, output).await
}

/// Resolve, validate, pre-execute, approval, escalation, guards.
async fn prepare(
    ctx: &Context,
    registry: &ToolRegistry,
    approval: Option<&Approval>,
    call: &Arc<ToolCall>,
    target: &Target,
    cancel: CancellationToken,
    bounds: Bounds,
) -> Result<(Arc<super::RegisteredTool>, ToolContext), ToolError> {
    let tool = match registry.resolve(ctx.scope_key(), &call.name) {
        Resolution::Found(t) => t,
        Resolution::Unknown => {
            return Err(ToolError::new(
                "UNKNOWN_TOOL",
                format!("there is no tool named `{}`", call.name),
            ));
        }
        Resolution::Filtered => {
            return Err(ToolError::new(
                "UNKNOWN_TOOL",
                format!("the tool `{}` is not available to this agent", call.name),
            ));
        }
    };
    let raw = if call.arguments.trim().is_empty() {
        "{}"
    } else {
        call.arguments.as_str()
    };
    let args: Value = serde_json::from_str(raw).map_err(|e| {
        ToolError::new(
            "INVALID_ARGS",
            format!("the arguments are not valid JSON: {}", chain(&e)),
        )
    })?;
    tool.validate(&args).map_err(|e| {
        ToolError::new(
            "INVALID_ARGS",
            format!("the arguments do not match the schema: {}", chain(&e)),
        )
    })?;
    let events = ctx.events();
    let (decision, args) = events
        .waterfall(
            target,
            PreExecute {
                call: call.clone(),
                args,
                ctx: ctx.clone(),
                cancel: cancel.clone(),
                bounds: bounds.clone(),
            },
            |p: PreExecute| async move { (Decision::Allow, p.args) },
        )
        .await
        .map_err(listener_failure)?;
    // The listeners' decision and the tool's own under the agent's policy:
    // a refusal from either, before anyone is asked; then one question
    // for both (a hook that asks about a call the tool asks about too puts
    // one question to the person, with both reasons).
    let mut questions = Vec::new();
    for decision in [decision, tool.tool.decide(&bounds.policy, &args)] {
        match decision {
            Decision::Allow => {}
            Decision::Deny(reason) => return Err(ToolError::new("DENIED", reason)),
            Decision::Ask(reason) => questions.push(reason),
        }
    }
    if !questions.is_empty() {
        let reason = questions.join("; ");
        let outcome = ask(ctx, approval, call, &reason, &args, &cancel).await;
        if outcome != ApprovalOutcome::AllowedOnce {
            return Err(ToolError::new(
                "DENIED",
                format!(
                    "approval was required ({reason}) and the answer was {}",
                    outcome.as_str()
                ),
            ));
        }
    }
    let policy = escalation(ctx, approval, &tool, call, &args, &cancel, bounds.policy).await?;
    let guarded = events.listener_count::<BailFn<ToolGuard>>() > 0;
    if let Some(reason) = guarded
        .then(|| {
            let guard = ToolGuard {
                call: call.clone(),
                args: args.clone(),
            };
            events.bail(target, &guard)
        })
        .flatten()
    {
        return Err(ToolError::new("DENIED", reason));
    }
    let cx = ToolContext {
        call_id: call.id.clone(),
        args,
        cancel,
        ctx: ctx.clone(),
        cwd: bounds.cwd,
        policy,
    };
    Ok((tool, cx))
}

/// One question to the approval seam (`unavailable` without one).
async fn ask(
    ctx: &Context,
    approval: Option<&Approval>,
    call: &ToolCall,
    reason: &str,
    args: &Value,
    cancel: &CancellationToken,
) -> ApprovalOutcome {
    let Some(approval) = approval else {
        return ApprovalOutcome::Unavailable;
    };
    let request = ApprovalRequest {
        tool: call.name.clone(),
        call_id: Some(call.id.clone()),
        reason: reason.to_owned(),
        arguments: args.clone(),
    };
    approval.request(ctx, request, cancel).await
}

/// The policy the call runs under: the agent's, or — when the call names
/// a wider mode in `sandbox_permissions` and the user approves this one
/// call — the agent's widened to it. A refused escalation fails the call;
/// a mode no wider than the agent's asks nothing.
async fn escalation(
    ctx: &Context,
    approval: Option<&Approval>,
    tool: &super::RegisteredTool,
    call: &ToolCall,
    args: &Value,
    cancel: &CancellationToken,
    standing: Policy,
) -> Result<Policy, ToolError> {
    let asked = args
        .get("sandbox_permissions")
        .and_then(Value::as_str)
        .and_then(|m| m.parse::<PermissionMode>().ok());
    let Some(asked) = asked.filter(|m| *m > standing.mode) else {
        return Ok(standing);
    };
    if !tool.tool.escalates() {
        return Ok(standing);
    }
    let justification = args
        .get("justification")
        .and_then(Value::as_str)
        .map(str::trim)
        .filter(|j| !j.is_empty())
        .ok_or_else(|| {
            ToolError::new(
                "INVALID_ARGS",
                format!(
                    "`sandbox_permissions: \"{asked}\"` needs a `justification` saying why this call needs more than the {} mode",
                    standing.mode
                ),
            )
        })?;
    let reason = format!(
        "run under {asked} (the agent's mode is {}): {justification}",
        standing.mode
    );
    match ask(ctx, approval, call, &reason, args, cancel).await {
        ApprovalOutcome::AllowedOnce => Ok(standing.widened(asked)),
        outcome => Err(ToolError::new(
            "DENIED",
            format!(
                "running this call under {asked} needs the user's approval, and the answer was {}. Do the task within the {} mode, or report that it needs wider access.",
                outcome.as_str(),
                standing.mode
            ),
        )),
    }
}

/// The body with its timeout, cancellation and panic boundary.
async fn run_body(
    tool: Arc<super::RegisteredTool>,
    cx: ToolContext,
) -> Result<ToolOutput, ToolError> {
    let cancel = cx.cancel.clone();
    let timeout = tool.tool.timeout();
    let body = match std::panic::catch_unwind(AssertUnwindSafe(|| tool.tool.clone().execute(cx))) {
        Ok(fut) => AssertUnwindSafe(fut).catch_unwind(),
        Err(p) => {
            return Err(ToolError::new(
                "PANICKED",
                format!("the tool panicked: {}", panic_text(&p)),
            ));
        }
    };
    let grace = tool.tool.cancel_grace();
    let settled = |out: std::thread::Result<Result<ToolOutput, ToolError>>| {
        out.unwrap_or_else(|p| {
            Err(ToolError::new(
                "PANICKED",
                format!("the tool panicked: {}", panic_text(&p)),
            ))
        })
    };
    let guarded = async {
        let mut body = body;
        let aborted = || ToolError::new("ABORTED", "the call was cancelled");
        tokio::select! {
            out = &mut body => settled(out),
            () = cancel.cancelled() => match grace {
                None => Err(aborted()),
                // The body cleans up and returns; its error (or ABORTED) stands.
                Some(grace) => match tokio::time::timeout(grace, &mut body).await {
                    Ok(out) => Err(settled(out).err().unwrap_or_else(aborted)),
                    Err(_) => Err(ToolError::new(
                        "ABORTED",
                        format!(
                            "the call was cancelled and did not finish cleaning up within {} ms",
                            grace.as_millis()
                        ),
                    )),
                },
            },
        }
    };
    match timeout {
        Some(t) => match tokio::time::timeout(t, guarded).await {
            Ok(out) => out,
            Err(_) => {
                cancel.cancel();
                Err(ToolError::new(
                    "TIMEOUT",
                    format!("the call did not finish within {} ms", t.as_millis()),
                ))
            }
        },
        None => guarded.await,
    }
}
