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
use dsh_services::tools::ToolCall;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::driver::log_append;
use super::envelope::envelope;
use super::events::AgentRequest;
use super::tool_exec::{execute, release_step_children};
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

pub(super) async fn run_step(
    agent: &Agent,
    me: &Awake,
    turn: u32,
    step: u32,
    token: &CancellationToken,
) -> StepEnd {
    let inner = &agent.inner;
    let scope = me.ctx.scope_key();
    let system: Option<Arc<str>> = match me.ctx.get::<SystemPrompt>(SystemPrompt::SERVICE) {
        Some(prompt) => match prompt.assemble(&me.ctx).await {
            Ok(text) if text.is_empty() => None,
            Ok(text) => Some(Arc::from(text)),
            Err(e) => {
                return StepEnd::Failed(LlmFailure::new(code::SYSTEM_PROMPT, e.to_string()));
            }
        },
        None => inner.spec.system.as_deref().map(Arc::from),
    };
    let envelope = envelope(inner, me, system.as_deref());
    // The request envelope is logged state: a full snapshot at the first
    // request of this agent instance, then whenever it changes.
    let (first, changed) = inner.session.with_log(|log| {
        let logged = log.request_header();
        let first_here = logged.is_none()
            || !log
                .events()
                .iter()
                .skip(log.first_live_seq() as usize)
                .any(|e| matches!(e.data, EventData::RequestHeader { .. }));
        let same = logged.is_some_and(|h| {
            Arc::ptr_eq(h, &envelope.header) || h.as_ref() == envelope.header.as_ref()
        });
        (first_here, !same)
    });
    if first || changed {
        let reason = if !first {
            "change"
        } else if inner.resumed {
            "resume"
        } else {
            "initial"
        };
        log_append(
            agent,
            EventData::RequestHeader {
                header: envelope.header.clone(),
                reason: reason.into(),
            },
            None,
        );
        let route = RequestContext {
            provider: inner.spec.provider.clone(),
            model: inner.spec.model.clone(),
            context_window: None,
        };
        let differs = inner
            .session
            .with_log(|log| log.request_context() != Some(&route));
        if differs {
            log_append(agent, EventData::RequestContext(route), None);
        }
    }
    let schemas = envelope.schemas.clone();
    let request = LlmRequest {
        provider: inner.spec.provider.clone(),
        model: inner.spec.model.clone(),
        system,
        messages: inner.session.derive_messages(),
        tools: schemas,
        temperature: inner.spec.temperature,
        max_tokens: inner.spec.max_tokens,
        options: Default::default(),
    };
    let target = dsh_supervisors::Target::Scope(scope.cloned());
    let wrapped = AgentRequest {
        agent: inner.id.to_string(),
        request,
    };
    let request = match me
        .ctx
        .events()
        .waterfall(&target, wrapped, |r: AgentRequest| async move { r.request })
        .await
    {
        Ok(r) => r,
        Err(e) => return StepEnd::Failed(LlmFailure::new(code::LISTENER_PANICKED, e.to_string())),
    };
    let call_token = token.child_token();
    let stream = tokio::select! {
        s = me.llm.stream(&me.ctx, request, call_token.clone()) => s,
        () = token.cancelled() => return StepEnd::Aborted,
    };
    let mut stream = match stream {
        Ok(s) => s,
        Err(f) => return StepEnd::Failed(f),
    };
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
                keep_interrupted(agent, turn, step, &assembler, chunk_seqs);
                return StepEnd::Aborted;
            }
            Some(Some(Err(_))) if token.is_cancelled() => {
                keep_interrupted(agent, turn, step, &assembler, chunk_seqs);
                return StepEnd::Aborted;
            }
            Some(None) => break,
            Some(Some(Err(f))) => return StepEnd::Failed(f),
            Some(Some(Ok(chunk))) => {
                assembler.push(&chunk);
                let done = matches!(chunk, StreamChunk::Finish { .. });
                if let Some(e) =
                    log_append(agent, EventData::AssistantChunk { turn, step, chunk }, None)
                {
                    chunk_seqs.push(e.seq);
                }
                if done {
                    break;
                }
            }
        }
    }
    let finish = assembler.finish();
    if let FinishReason::Error { failure } | FinishReason::Aborted { failure } = finish {
        return StepEnd::Failed(*failure);
    }
    let max_tokens = finish == FinishReason::MaxTokens;
    if let Some(u) = assembler.usage() {
        inner
            .tokens
            .fetch_add(u.input_tokens + u.output_tokens, Ordering::Relaxed);
    }
    let message = match assembler.message(MessageSource::model(
        &inner.spec.provider,
        &inner.spec.model,
    )) {
        Ok(m) => Arc::new(m),
        Err(e) => return StepEnd::Failed(LlmFailure::new(code::MALFORMED_STREAM, e.to_string())),
    };
    log_append(
        agent,
        EventData::AssistantMessage {
            turn,
            step,
            message: message.clone(),
            usage: assembler.usage(),
            interrupted: false,
        },
        Some(SurfaceIntent::append_citing(chunk_seqs)),
    );
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
    let mut call_seqs = Vec::with_capacity(calls.len());
    for c in &calls {
        let seq = log_append(
            agent,
            EventData::ToolCall {
                turn,
                step,
                call_id: c.id.clone(),
                name: c.name.clone(),
                arguments: c.arguments.clone(),
            },
            None,
        )
        .map(|e| e.seq);
        call_seqs.push(seq);
    }
    // Runs of concurrency-safe calls go in parallel; any other call alone.
    let mut i = 0;
    while i < calls.len() {
        let safe = |c: &ToolCall| match me.tools.resolve(scope, &c.name) {
            dsh_services::tools::Resolution::Found(t) => t.tool.is_concurrency_safe(),
            _ => true,
        };
        let mut j = i + 1;
        if safe(&calls[i]) {
            while j < calls.len() && safe(&calls[j]) {
                j += 1;
            }
        }
        // A lone call is awaited in place (no batch of large futures to move).
        let outcomes = if j == i + 1 {
            vec![execute(me, calls[i].clone(), token).await]
        } else {
            // At most `max_parallel_tools` at once; results keep call order.
            let batch: Vec<_> = calls[i..j]
                .iter()
                .cloned()
                .map(|c| execute(me, c, token))
                .collect();
            futures::stream::iter(batch)
                .buffered(inner.spec.max_parallel_tools.max(1))
                .collect::<Vec<_>>()
                .await
        };
        for (k, outcome) in outcomes.into_iter().enumerate() {
            let call = &calls[i + k];
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
            let cited = call_seqs[i + k].map(|s| vec![s]);
            log_append(
                agent,
                EventData::ToolResult {
                    turn,
                    step,
                    message: Arc::new(message),
                    error: outcome.error.map(|e| dsh_services::session::ToolErrorId {
                        name: "ToolError".into(),
                        code: e.code,
                    }),
                    meta: outcome.meta,
                },
                Some(SurfaceIntent {
                    surface_op: dsh_services::session::SurfaceOp::Append,
                    source_event_seqs: cited,
                }),
            );
        }
        i = j;
    }
    release_step_children(me).await;
    if token.is_cancelled() {
        return StepEnd::Aborted;
    }
    if me.conclude.swap(false, Ordering::AcqRel) {
        return StepEnd::Concluded { max_tokens };
    }
    StepEnd::ToolsDone { max_tokens }
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
            usage: assembler.usage(),
            interrupted: true,
        },
        Some(SurfaceIntent::append_citing(chunk_seqs)),
    );
}
