//! One step: the request (system prompt, envelope, history) through the
//! `agent/request` waterfall, the model stream logged chunk by chunk, the
//! assistant message, then its tool calls (runs of concurrency-safe calls in
//! parallel, others alone) and their results in call order.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use dsh_services::llm::{
    BlockAssembler, ContentBlock, FinishReason, LlmFailure, LlmRequest, Message, MessageSource,
    Role, StreamChunk, code,
};
use dsh_services::prompt::SystemPrompt;
use dsh_services::session::{EventData, RequestContext, SurfaceIntent};
use dsh_services::tools::{PipelineOutcome, ToolCall};
use dsh_supervisors::error::chain;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::envelope::envelope;
use super::events::AgentRequest;
use super::header::CallConfig;
use super::log_append;
use super::tool_exec::{Placement, execute, release_step_children};
use super::{Agent, Awake};

pub(super) enum StepEnd {
    Answer {
        text: String,
        max_tokens: bool,
    },
    /// A capture tool concluded the turn: no continuation.
    Concluded {
        max_tokens: bool,
    },
    ToolsDone {
        max_tokens: bool,
    },
    Aborted,
    Failed(LlmFailure),
}

/// Where a step runs: its agent, the agent's awake part, turn and step.
#[derive(Clone, Copy)]
struct At<'a> {
    agent: &'a Agent,
    me: &'a Awake,
    turn: u32,
    step: u32,
}

impl At<'_> {
    fn log(&self, data: EventData, intent: Option<SurfaceIntent>) -> Option<u64> {
        log_append(self.agent, data, intent).map(|e| e.seq)
    }
}

/// Runs one step of the running turn; its `step/start` and entering
/// messages are logged by the caller.
pub(super) async fn run_step(
    agent: &Agent,
    me: &Awake,
    turn: u32,
    step: u32,
    token: &CancellationToken,
) -> StepEnd {
    let at = At {
        agent,
        me,
        turn,
        step,
    };
    let request = match request(at, token).await {
        Ok(r) => r,
        Err(f) => return StepEnd::Failed(f),
    };
    let (message, max_tokens) = match stream(at, request, token).await {
        Ok(answer) => answer,
        Err(end) => return end,
    };
    let calls: Vec<ToolCall> = message
        .tool_calls()
        .map(|(id, name, arguments)| ToolCall {
            id: id.to_owned(),
            name: name.to_owned(),
            arguments: arguments.to_owned(),
        })
        .collect();
    if calls.is_empty() {
        return StepEnd::Answer {
            text: message.text(),
            max_tokens,
        };
    }
    run_calls(at, &calls, token).await;
    release_step_children(me).await;
    if token.is_cancelled() {
        return StepEnd::Aborted;
    }
    if me.conclude.swap(false, Ordering::AcqRel) {
        return StepEnd::Concluded { max_tokens };
    }
    StepEnd::ToolsDone { max_tokens }
}

/// The step's request: system prompt, envelope (logged when it changed) and
/// history, after the `agent/request` waterfall.
async fn request(at: At<'_>, token: &CancellationToken) -> Result<LlmRequest, LlmFailure> {
    let (inner, me) = (&at.agent.inner, at.me);
    let system: Option<Arc<str>> = match me.ctx.get::<SystemPrompt>(SystemPrompt::SERVICE) {
        Some(prompt) => match prompt.assemble(&me.ctx).await {
            Ok(text) if text.is_empty() => None,
            Ok(text) => Some(Arc::from(text)),
            Err(e) => return Err(LlmFailure::new(code::SYSTEM_PROMPT, chain(&e).to_string())),
        },
        None => inner.spec.system.as_deref().map(Arc::from),
    };
    super::context::refresh(at.agent, me);
    if let Some((seq, prompt)) = super::context::title(at.agent, me) {
        super::context::ask_for_title(at.agent, me, seq, prompt);
    }
    // The route's defaults as they stand; the waterfall may name its own.
    let defaults = me.llm.defaults(&inner.spec.provider, &inner.spec.model);
    // Near the model's context window, the turns before this one become a
    // summary first.
    super::compaction::maybe_compact(at.agent, me, at.turn, defaults.context_window, token).await;
    let mut proposed = LlmRequest {
        provider: inner.spec.provider.clone(),
        model: inner.spec.model.clone(),
        system: system.clone(),
        messages: inner.session.derive_messages(),
        tools: Arc::from([]),
        temperature: inner.spec.temperature,
        max_tokens: inner.spec.max_tokens,
        options: effort(inner.spec.reasoning_effort.as_deref()),
        session: Some(inner.id.clone()),
        purpose: None,
        notify: Some(retry_record(at.agent)),
    };
    let planned = CallConfig::of(&proposed, defaults);
    let envelope = envelope(inner, me, system.as_deref(), &planned);
    proposed.tools = envelope.schemas.clone();
    let target = dsh_supervisors::Target::Scope(me.ctx.scope_key().cloned());
    let wrapped = AgentRequest {
        agent: inner.id.to_string(),
        request: proposed,
    };
    let mut request = me
        .ctx
        .events()
        .waterfall(&target, wrapped, |r: AgentRequest| async move { r.request })
        .await
        .map_err(|e| LlmFailure::new(code::LISTENER_PANICKED, chain(&e).to_string()))?;
    // What is sent is what is logged: the defaults go into the request, and
    // a step that named its own effort or cap logs those.
    let call = CallConfig::of(&request, defaults);
    call.fill(&mut request);
    let header = if call == planned {
        envelope.header
    } else {
        self::envelope(inner, me, system.as_deref(), &call).header
    };
    log_envelope(at, &header, defaults.context_window);
    Ok(request)
}

/// The request envelope is logged state: a full `request/header` snapshot
/// at the first request of this agent instance, then whenever it changes
/// (with the route, when that changed too).
fn log_envelope(at: At<'_>, header: &Arc<serde_json::Value>, context_window: Option<u64>) {
    let inner = &at.agent.inner;
    let (first, changed) = inner.session.with_log(|log| {
        let logged = log.request_header();
        let first_here = logged.is_none()
            || !log
                .without_chunks()
                .skip_while(|e| e.seq < log.first_live_seq())
                .any(|e| matches!(e.data, EventData::RequestHeader { .. }));
        let same = logged.is_some_and(|h| Arc::ptr_eq(h, header) || h.as_ref() == header.as_ref());
        (first_here, !same)
    });
    if !first && !changed {
        return;
    }
    let reason = if !first {
        "change"
    } else if inner.resumed {
        "resume"
    } else {
        "initial"
    };
    at.log(
        EventData::RequestHeader {
            header: header.clone(),
            reason: reason.into(),
        },
        None,
    );
    let route = RequestContext {
        provider: inner.spec.provider.clone(),
        model: inner.spec.model.clone(),
        context_window,
    };
    let differs = inner
        .session
        .with_log(|log| log.request_context() != Some(&route));
    if differs {
        at.log(EventData::RequestContext(Box::new(route)), None);
    }
}

/// Streams the model's answer, logging each chunk, and commits the
/// assembled `assistant/message`; returns it and whether the output-token
/// ceiling cut it. A cancel mid-stream keeps the delivered prefix.
async fn stream(
    at: At<'_>,
    request: LlmRequest,
    token: &CancellationToken,
) -> Result<(Arc<Message>, bool), StepEnd> {
    let inner = &at.agent.inner;
    let call_token = token.child_token();
    let stream = tokio::select! {
        s = at.me.llm.stream(&at.me.ctx, request, call_token.clone()) => s,
        () = token.cancelled() => return Err(StepEnd::Aborted),
    };
    let mut stream = stream.map_err(StepEnd::Failed)?;
    let mut assembler = BlockAssembler::new();
    let mut chunk_seqs = Vec::new();
    loop {
        // Cancellation first: a stream ended by the cancel itself is a cancel.
        let next = tokio::select! {
            biased;
            () = token.cancelled() => None,
            c = stream.next() => Some(c),
        };
        match next {
            None => {
                call_token.cancel();
                keep_interrupted(at.agent, at.turn, at.step, &assembler, chunk_seqs);
                return Err(StepEnd::Aborted);
            }
            Some(Some(Err(_))) if token.is_cancelled() => {
                keep_interrupted(at.agent, at.turn, at.step, &assembler, chunk_seqs);
                return Err(StepEnd::Aborted);
            }
            Some(None) => break,
            Some(Some(Err(f))) => return Err(StepEnd::Failed(f)),
            Some(Some(Ok(chunk))) => {
                assembler.push(&chunk);
                let done = matches!(chunk, StreamChunk::Finish { .. });
                let (turn, step) = (at.turn, at.step);
                if let Some(seq) = at.log(
                    EventData::AssistantChunk {
                        turn,
                        step,
                        chunk: Box::new(chunk),
                    },
                    None,
                ) {
                    chunk_seqs.push(seq);
                }
                if done {
                    break;
                }
            }
        }
    }
    let finish = assembler.finish();
    if let FinishReason::Error { failure } | FinishReason::Aborted { failure } = finish {
        return Err(StepEnd::Failed(*failure));
    }
    if let Some(u) = assembler.usage() {
        let spent = u.input_tokens + u.output_tokens;
        inner.tokens.fetch_add(spent, Ordering::Relaxed);
        if let Some(limits) = &inner.spec.limits {
            limits.charge(spent);
        }
    }
    let source = MessageSource::model(&inner.spec.provider, &inner.spec.model);
    let message = match assembler.message(source) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            let failure = LlmFailure::new(code::MALFORMED_STREAM, chain(&e).to_string());
            return Err(StepEnd::Failed(failure));
        }
    };
    at.log(
        EventData::AssistantMessage {
            turn: at.turn,
            step: at.step,
            message: message.clone(),
            usage: assembler.usage().map(Box::new),
            interrupted: false,
        },
        Some(SurfaceIntent::append_citing(chunk_seqs)),
    );
    Ok((message, finish == FinishReason::MaxTokens))
}

/// Logs the calls, runs them (runs of concurrency-safe calls in parallel,
/// at most `max_parallel_tools` at once; any other call alone), and logs
/// their results in call order, each citing its call.
async fn run_calls(at: At<'_>, calls: &[ToolCall], token: &CancellationToken) {
    let me = at.me;
    let call_seqs: Vec<Option<u64>> = calls
        .iter()
        .map(|c| {
            at.log(
                EventData::tool_call(at.turn, at.step, &c.id, &c.name, &c.arguments),
                None,
            )
        })
        .collect();
    let scope = me.ctx.scope_key();
    let safe = |c: &ToolCall| match me.tools.resolve(scope, &c.name) {
        dsh_services::tools::Resolution::Found(t) => t.tool.is_concurrency_safe(),
        _ => true,
    };
    let mut i = 0;
    while i < calls.len() {
        let mut j = i + 1;
        if safe(&calls[i]) {
            while j < calls.len() && safe(&calls[j]) {
                j += 1;
            }
        }
        // A lone call runs in this task (no batch of large futures to move).
        let outcomes = if j == i + 1 {
            vec![execute(me, calls[i].clone(), token, Placement::Alone).await]
        } else {
            let batch: Vec<_> = calls[i..j]
                .iter()
                .cloned()
                .map(|c| execute(me, c, token, Placement::InRun))
                .collect();
            futures::stream::iter(batch)
                .buffered(at.agent.inner.spec.max_parallel_tools.max(1))
                .collect::<Vec<_>>()
                .await
        };
        for (k, outcome) in outcomes.into_iter().enumerate() {
            log_result(at, &calls[i + k], outcome, call_seqs[i + k]);
        }
        i = j;
    }
}

/// Commits one call's `tool/result`, citing its `tool/call`.
fn log_result(at: At<'_>, call: &ToolCall, outcome: PipelineOutcome, cited: Option<u64>) {
    let message = Message {
        id: Message::new_id(),
        role: Role::User,
        content: vec![ContentBlock::ToolResult {
            tool_call_id: call.id.clone(),
            content: outcome.content,
            is_error: Some(outcome.error.is_some()),
        }],
        source: MessageSource::tool(&call.id),
    };
    at.log(
        EventData::ToolResult {
            turn: at.turn,
            step: at.step,
            message: Arc::new(message),
            error: outcome.error.map(|e| {
                Box::new(dsh_services::session::ToolErrorId {
                    name: "ToolError".into(),
                    code: e.code,
                })
            }),
            meta: outcome.meta.map(Box::new),
        },
        Some(SurfaceIntent {
            surface_op: dsh_services::session::SurfaceOp::Append,
            source_event_seqs: cited.map(|s| vec![s]),
        }),
    );
}

/// Commits the visible prefix of a cancelled stream as an interrupted
/// assistant message (nothing when no text or reasoning arrived).
fn keep_interrupted(
    agent: &Agent,
    turn: u32,
    step: u32,
    assembler: &BlockAssembler,
    chunk_seqs: Vec<u64>,
) {
    let kept = assembler.interrupted_blocks();
    if kept.is_empty() {
        return;
    }
    let spec = &agent.inner.spec;
    let message = Message {
        id: Message::new_id(),
        role: Role::Assistant,
        content: kept,
        source: MessageSource::model(&spec.provider, &spec.model),
    };
    log_append(
        agent,
        EventData::AssistantMessage {
            turn,
            step,
            message: Arc::new(message),
            usage: assembler.usage().map(Box::new),
            interrupted: true,
        },
        Some(SurfaceIntent::append_citing(chunk_seqs)),
    );
}

/// Records each retry of the step's call in the agent's log (`llm/retry`),
/// where its observers see it as it happens.
fn retry_record(agent: &Agent) -> dsh_services::llm::Notify {
    let agent = agent.downgrade();
    dsh_services::llm::Notify::new(move |r| {
        if let Some(agent) = agent.upgrade() {
            agent.record(
                "llm/retry",
                serde_json::json!({
                    "attempt": r.attempt,
                    "maxRetries": r.max_retries,
                    "code": r.code,
                    "status": r.status,
                    "message": r.message,
                    "waitMs": r.wait.as_millis() as u64,
                }),
            );
        }
    })
}

/// A request's options asking for `effort` (none: the route's default).
fn effort(effort: Option<&str>) -> serde_json::Map<String, serde_json::Value> {
    let mut options = serde_json::Map::new();
    if let Some(e) = effort {
        options.insert("reasoning_effort".into(), e.into());
    }
    options
}
