//! Automatic compaction: before a step's request would outgrow the model's
//! context window, the turns before the running one are summarised by one
//! auxiliary request (`x-dsh-purpose: compaction`) and replaced on the
//! surface by that summary.
//!
//! Logged as upstream's harness logs it: `compaction/start {turn}` takes
//! the lock, `compaction/summary` records the summary, the shadowed range
//! and seqs, their estimated tokens and the call's route, a `user/message`
//! (source `compaction`) replaces the range on the surface, and
//! `compaction/end {turn}` releases the lock — with `error` when the
//! summary could not be made, in which case nothing is replaced.

use std::sync::Arc;

use dsh_services::llm::{
    BlockAssembler, ContentBlock, History, LlmRequest, Message, MessageSource, Role,
};
use dsh_services::session::{EventData, SessionLog, SurfaceIntent, SurfaceOp};
use dsh_supervisors::error::chain;
use futures::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::budget::{chars_of, price};
use super::log_append;
use super::{Agent, Awake};

/// Compaction starts when the estimate passes this share of the window.
pub const THRESHOLD: f64 = 0.8;

/// The source of the summary message.
pub const SOURCE: &str = "compaction";

/// The summary request's output cap.
const SUMMARY_MAX_TOKENS: u64 = 8192;

const INSTRUCTION: &str = "Summarise the conversation above for yourself: you will continue the work from this summary alone, without the messages it replaces. Keep what the work needs — the user's requests and constraints in their own words where they matter, decisions made and why, files read or changed (with paths), commands run and what they showed, errors met and how they were resolved, what is done and what remains. Leave out pleasantries and anything superseded. Write plain prose and lists, no preamble.";

/// The tokens the next request would carry: the last answer's reported
/// input and output, less what replacements since took out of what it
/// counted, plus a quarter token per character of what came after it (all
/// of it, when nothing reported usage).
pub(super) fn estimate(agent: &Agent) -> u64 {
    agent.inner.session.with_log(|log| {
        let mut chars = 0usize;
        // From the newest surface node back to the last answer that
        // reported usage: a few lookups, however long the session.
        for seq in log.surface().nodes.iter().rev() {
            let Some(e) = log.get(*seq) else {
                continue;
            };
            if let EventData::AssistantMessage { usage: Some(u), .. } = &e.data {
                let base = u.input_tokens + u.cache_read_tokens.unwrap_or(0) + u.output_tokens;
                let base = base.saturating_sub(saved_since(log, e.seq));
                return base + (chars as u64).div_ceil(4);
            }
            if let Some(m) = dsh_services::session::derive_event_message(&e) {
                chars += chars_of(&m);
            }
        }
        (chars as u64).div_ceil(4)
    })
}

/// What the replacements logged after the answer at `answer` saved of the
/// nodes before it: for each prune or summary (the metering event right
/// before its replacement), the shadowed price less the replacement's.
fn saved_since(log: &SessionLog, answer: u64) -> u64 {
    let mut saved = 0;
    for e in log.without_chunks().rev().take_while(|e| e.seq > answer) {
        let EventData::Other { kind, data } = &e.data else {
            continue;
        };
        if !matches!(&**kind, "compaction/prune" | "compaction/summary") {
            continue;
        }
        let before = data["shadowedSeqs"]
            .as_array()
            .is_some_and(|s| s.iter().all(|v| v.as_u64().is_some_and(|v| v < answer)));
        let shadowed = data["shadowedTokenCount"].as_u64().unwrap_or(0);
        let replacement = log
            .get(e.seq + 1)
            .and_then(|r| dsh_services::session::derive_event_message(&r))
            .map_or(0, |m| price(&m));
        if before {
            saved += shadowed.saturating_sub(replacement);
        }
    }
    saved
}

/// The event with `seq` (events are in seq order).
/// Compacts when the estimate passes [`THRESHOLD`] of `window`; whether
/// the surface changed.
pub(super) async fn maybe_compact(
    agent: &Agent,
    me: &Awake,
    turn: u32,
    window: Option<u64>,
    token: &CancellationToken,
) -> bool {
    let Some(window) = window.filter(|w| *w > 0) else {
        return false;
    };
    let pressing = |estimated: u64| estimated as f64 >= window as f64 * THRESHOLD;
    if !pressing(estimate(agent)) {
        return false;
    }
    // Over-long tool results are cut first; a summary only if that is
    // not enough.
    let pruned = super::prune::prune_surface(agent) > 0;
    if pruned && !pressing(estimate(agent)) {
        return true;
    }
    compact(agent, me, Some(turn), token).await == Ok(true) || pruned
}

/// Summarises the surface before `turn` (all of it for a manual compaction,
/// `None`) into one replacing message; whether anything was replaced, or
/// why the summary failed. Fewer than two messages are left as they are.
pub(super) async fn compact(
    agent: &Agent,
    me: &Awake,
    turn: Option<u32>,
    token: &CancellationToken,
) -> Result<bool, String> {
    let (shadowed, messages) = before_turn(agent, turn);
    if shadowed.len() < 2 {
        return Ok(false);
    }
    log_append(
        agent,
        EventData::Other {
            kind: "compaction/start".into(),
            data: Arc::new(json!({"turn": turn})),
        },
        None,
    );
    let priced: u64 = messages.iter().map(|m| price(m)).sum();
    let summary = summarise(me, summary_request(agent, messages), token).await;
    let (end, outcome) = match summary {
        Ok((text, usage)) => {
            replace(agent, &shadowed, priced, &text, usage);
            (json!({"turn": turn}), Ok(true))
        }
        Err(error) => (json!({"turn": turn, "error": error}), Err(error)),
    };
    log_append(
        agent,
        EventData::Other {
            kind: "compaction/end".into(),
            data: Arc::new(end),
        },
        None,
    );
    outcome
}

/// The surface before the running turn: its seqs and their messages.
fn before_turn(agent: &Agent, turn: Option<u32>) -> (Vec<u64>, Vec<Arc<Message>>) {
    agent.inner.session.with_log(|log| {
        let start = turn
            .and_then(|turn| {
                log.without_chunks()
                    .rev()
                    .find(|e| matches!(e.data, EventData::TurnStart { turn: t } if t == turn))
            })
            .map_or(u64::MAX, |e| e.seq);
        let seqs: Vec<u64> = log
            .surface()
            .nodes
            .iter()
            .copied()
            .filter(|s| *s < start)
            .collect();
        let messages: Vec<Arc<Message>> = seqs
            .iter()
            .filter_map(|s| log.get(*s))
            .filter_map(|e| dsh_services::session::derive_event_message(&e))
            .collect();
        (seqs, messages)
    })
}

/// The one auxiliary request that summarises `messages`.
fn summary_request(agent: &Agent, mut messages: Vec<Arc<Message>>) -> LlmRequest {
    let spec = &agent.inner.spec;
    messages.push(Arc::new(Message::user_text(INSTRUCTION)));
    LlmRequest {
        provider: spec.provider.clone(),
        model: spec.model.clone(),
        system: Some(Arc::from(
            "You write the working summary that replaces the earlier part of a coding agent's conversation.",
        )),
        messages: History::of(messages),
        tools: Arc::from([]),
        temperature: None,
        max_tokens: Some(SUMMARY_MAX_TOKENS),
        options: Default::default(),
        session: Some(agent.inner.id.clone()),
        purpose: Some("compaction"),
        notify: None,
    }
}

/// Records `text` as the summary of `shadowed` and replaces them with it
/// on the surface.
fn replace(
    agent: &Agent,
    shadowed: &[u64],
    priced: u64,
    text: &str,
    usage: Option<dsh_services::llm::TokenUsage>,
) {
    let spec = &agent.inner.spec;
    let (first, last) = (shadowed[0], shadowed[shadowed.len() - 1]);
    log_append(
        agent,
        EventData::Other {
            kind: "compaction/summary".into(),
            data: Arc::new(json!({
                "summary": text,
                "shadowedRange": {"start": first, "end": last},
                "shadowedSeqs": shadowed,
                "shadowedTokenCount": priced,
                "provider": spec.provider,
                "model": spec.model,
                "maxTokens": SUMMARY_MAX_TOKENS,
                "usage": usage,
                // A local model call, its whole output: a replay serves it
                // as that call's stream.
                "llmStreamCall": true,
                "rawOutput": text,
            })),
        },
        None,
    );
    let mut message = Message::user_text(format!(
        "Summary of the conversation before this turn (it replaces the earlier messages):\n\n{text}"
    ));
    message.source = MessageSource::of(SOURCE);
    message.role = Role::User;
    log_append(
        agent,
        EventData::UserMessage(Arc::new(message)),
        Some(SurfaceIntent {
            surface_op: SurfaceOp::Replace {
                start: first,
                end: last,
            },
            source_event_seqs: Some(shadowed.to_vec()),
        }),
    );
}

/// The summary text and usage of one call, or why there is none.
async fn summarise(
    me: &Awake,
    request: LlmRequest,
    token: &CancellationToken,
) -> Result<(String, Option<dsh_services::llm::TokenUsage>), String> {
    let call = token.child_token();
    let mut stream = me
        .llm
        .stream(&me.ctx, request, call.clone())
        .await
        .map_err(|f| format!("{}: {}", f.code, f.message))?;
    let mut assembler = BlockAssembler::new();
    loop {
        let next = tokio::select! {
            biased;
            () = token.cancelled() => {
                call.cancel();
                return Err("cancelled".into());
            }
            n = stream.next() => n,
        };
        match next {
            None => break,
            Some(Ok(chunk)) => assembler.push(&chunk),
            Some(Err(f)) => return Err(format!("{}: {}", f.code, f.message)),
        }
    }
    let text = assembler
        .blocks()
        .map_err(|e| chain(&e).to_string())?
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join("");
    let text = text.trim().to_owned();
    if text.is_empty() {
        return Err("the summary came back empty".into());
    }
    Ok((text, assembler.usage()))
}

impl Agent {
    /// The token meter: what the next request would carry (the last
    /// answer's reported tokens plus an estimate of what came since), the
    /// figure automatic compaction compares with the context window.
    /// `None` while hibernated (its history is packed away).
    pub fn context_tokens(&self) -> Option<u64> {
        (!self.is_hibernated()).then(|| estimate(self))
    }

    /// Summarises the whole conversation so far into one message that
    /// replaces it on the surface (what automatic compaction does near the
    /// context window), logged the same way with `turn: null`; `Ok(false)`
    /// when there is too little to summarise. Only between turns; a
    /// hibernated agent is woken for it.
    pub async fn compact(&self) -> Result<bool, crate::agent::AgentError> {
        use crate::agent::AgentError;
        if !self.is_idle() {
            return Err(AgentError::Busy(self.id().to_owned()));
        }
        if self.is_hibernated() {
            self.wake().await?;
        }
        let me = match &*self.life() {
            super::Life::Awake(me) => me.clone(),
            _ => return Err(AgentError::Closed(self.id().to_owned())),
        };
        compact(self, &me, None, &CancellationToken::new())
            .await
            .map_err(AgentError::Compaction)
    }
}
