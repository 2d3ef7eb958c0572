//! The driver: a task child of the agent's scope that claims queued prompts
//! one at a time and runs each as a turn (`turn/start` … steps …
//! `turn/end`), then reports idle and waits to be woken. Input reaches it
//! through the inbox and a wake-up ([`Awake::wake`]), never a mailbox: it
//! receives nothing else.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use dsh_services::llm::{LlmFailure, Message, MessageSource, code};
use dsh_services::session::{EventData, SurfaceIntent, TurnEndReason};
use dsh_supervisors::error::chain;
use tokio_util::sync::CancellationToken;

use super::events::{AgentPreStep, AgentTurnStopping, PreStepDecision};
use super::step::{StepEnd, run_step};
use super::summary::{publish_progress, publish_step};
use super::{Agent, Awake, TurnSummary, log_append};

/// What the driver runs for: the agent and its awake part.
pub(super) struct Driving {
    pub(super) agent: Agent,
    pub(super) me: Arc<Awake>,
}

/// The driver's body: on each wake-up, runs the queued turns, until `stop`
/// (its owner's teardown) is cancelled. A wake-up that came before a stop
/// is served first, as a drained mailbox would be.
pub(super) async fn drive(driving: Stopped, stop: CancellationToken) {
    let Driving { agent, me } = &driving.0;
    loop {
        tokio::select! {
            biased;
            () = me.wake.notified() => {}
            () = stop.cancelled() => break,
        }
        while let Some((prompt, turn, token)) = claim(agent, me, &stop) {
            // Boxed: an idle driver's task does not carry a turn's state.
            let summary = Box::pin(run_turn(agent, me, prompt, turn, token)).await;
            settle(agent, summary);
        }
        // Before idle is announced: whoever waits for it finds the keeper
        // already asked to apply the awake cap.
        agent.touch();
        if let Some(agents) = &agent.inner.agents {
            agents.idled();
        }
        let inbox = agent.inbox();
        if inbox.followups.is_empty() || !inbox.accepting {
            // Under the inbox lock: see `Agent::kick`.
            agent.inner.idle.set(true);
        }
        drop(inbox);
    }
}

/// Runs when the driver ends however it ends (stopped, aborted past its
/// budget, panicked, aborted before it first ran): no turn runs any more,
/// so waiters on idle must not wait forever. Going to sleep, the agent
/// still takes input (which wakes it).
pub(super) struct Stopped(pub(super) Driving);

impl Drop for Stopped {
    fn drop(&mut self) {
        let Driving { agent, me } = &self.0;
        let mut inbox = agent.inbox();
        inbox.running = false;
        if !me.sleeping.load(Ordering::Acquire) {
            inbox.accepting = false;
        }
        if inbox.followups.is_empty() || !inbox.accepting {
            agent.inner.idle.set(true);
        }
    }
}

/// Claims the next queued prompt: opens its turn (`turn/start`, the claim's
/// splice, the spec's opening events before the first turn) under the inbox
/// lock, so the claim is logged at the position the queue had. The turn's
/// signal is a child of the driver's: a driver stopped mid-turn cancels the
/// turn (and its tool call) rather than dropping it at its budget.
fn claim(
    agent: &Agent,
    me: &Awake,
    stop: &CancellationToken,
) -> Option<(Arc<Message>, u32, CancellationToken)> {
    let mut inbox = agent.inbox();
    // Going to sleep (set under this lock): the input stays queued for the
    // driver the wake-up starts.
    if !inbox.accepting || me.sleeping.load(Ordering::Acquire) {
        return None;
    }
    let prompt = inbox.followups.pop_front()?;
    inbox.running = true;
    inbox.turn += 1;
    log_append(agent, EventData::TurnStart { turn: inbox.turn }, None);
    agent.splice(0, 1, &[]);
    if !std::mem::replace(&mut inbox.opened, true) {
        for data in agent.inner.spec.opening.iter().cloned() {
            log_append(agent, data, None);
        }
    }
    let token = stop.child_token();
    if std::mem::take(&mut inbox.cancel_next) {
        token.cancel();
    }
    inbox.cancel = Some(token.clone());
    Some((prompt, inbox.turn, token))
}

/// After a turn: it is the last one, steering that arrived after its last
/// step becomes the next turn's prompt, and the spec's turn-end hook runs
/// (a panic in it is logged, not propagated).
fn settle(agent: &Agent, summary: TurnSummary) {
    {
        let mut inbox = agent.inbox();
        inbox.running = false;
        inbox.cancel = None;
        inbox.last = Some(Box::new(summary.clone()));
        let leftover: Vec<Arc<Message>> = inbox.steer.drain(..).collect();
        for message in leftover {
            agent.enqueue(&mut inbox, message);
        }
    }
    if let Some(hook) = &agent.inner.spec.on_turn_end {
        let run = std::panic::AssertUnwindSafe(|| (hook.0)(agent, &summary));
        if let Err(p) = std::panic::catch_unwind(run) {
            tracing::error!(
                agent = %agent.inner.id,
                "a turn-end hook panicked: {}",
                dsh_supervisors::events::panic_text(&p)
            );
        }
    }
}

/// Runs one turn; its `turn/start` was logged when the driver claimed the prompt.
pub(super) async fn run_turn(
    agent: &Agent,
    me: &Awake,
    prompt: Arc<Message>,
    turn: u32,
    token: CancellationToken,
) -> TurnSummary {
    // A capture left over from an aborted turn must not end this one.
    me.conclude.store(false, Ordering::Release);
    let max_steps = agent.inner.spec.max_steps;
    let mut entering = vec![prompt];
    let mut steps = 0u32;
    let mut max_tokens_hit = false;
    let mut text = String::new();
    let reason = loop {
        if token.is_cancelled() {
            break aborted();
        }
        if steps >= max_steps {
            let why = format!("the turn used all {max_steps} steps it may take");
            let error = Box::new(LlmFailure::new(code::STEP_LIMIT, why));
            break TurnEndReason::Error { error };
        }
        let limits = agent.inner.spec.limits.as_ref();
        if let Some(refused) = limits.and_then(|l| l.refusal(turn, steps == 0)) {
            break TurnEndReason::Error {
                error: Box::new(refused),
            };
        }
        steps += 1;
        let step = steps;
        let batch = match pre_step(agent, me, turn, step, &mut entering, &token).await {
            Ok(batch) => batch,
            Err(why) => {
                steps -= 1;
                text = why;
                break TurnEndReason::Blocked;
            }
        };
        open_step(agent, me, turn, step, batch);
        let end = match limits.and_then(super::Limits::deadline) {
            // A step still running at the deadline is stopped, and the turn
            // ends for the time, not as cancelled.
            Some(deadline) => {
                let step_token = token.child_token();
                let run = run_step(agent, me, turn, step, &step_token);
                tokio::pin!(run);
                tokio::select! {
                    end = &mut run => end,
                    () = tokio::time::sleep_until(deadline) => {
                        step_token.cancel();
                        run.await;
                        log_append(agent, EventData::StepEnd { turn, step }, None);
                        let error = limits.map(super::Limits::timed_out);
                        break TurnEndReason::Error { error: Box::new(error.unwrap_or_else(|| LlmFailure::new(code::TIMEOUT, "the wall-time budget ran out"))) };
                    }
                }
            }
            None => run_step(agent, me, turn, step, &token).await,
        };
        log_append(agent, EventData::StepEnd { turn, step }, None);
        match end {
            StepEnd::Answer {
                text: t,
                max_tokens,
            } => {
                text = t;
                max_tokens_hit |= max_tokens;
                if let Some(more) = goes_on(agent, me, turn, &text, &token).await {
                    entering.extend(more);
                    continue;
                }
                break ended(max_tokens_hit);
            }
            StepEnd::ToolsDone { max_tokens } => max_tokens_hit |= max_tokens,
            StepEnd::Concluded { max_tokens } => break ended(max_tokens_hit || max_tokens),
            StepEnd::Aborted => break aborted(),
            StepEnd::Failed(f) => break TurnEndReason::Error { error: Box::new(f) },
        }
    };
    log_append(
        agent,
        EventData::TurnEnd {
            turn,
            reason: Box::new(reason.clone()),
        },
        None,
    );
    publish_progress(me);
    TurnSummary {
        turn,
        steps,
        reason,
        text,
    }
}

/// Opens a step: `step/start`, `agent/pre-step`, then the messages entering
/// it (the turn's prompt or continuation, steered input, injected context).
fn open_step(agent: &Agent, me: &Awake, turn: u32, step: u32, batch: Vec<Arc<Message>>) {
    me.step.store(step, Ordering::Relaxed);
    publish_step(me);
    log_append(agent, EventData::StepStart { turn, step }, None);
    for m in batch {
        log_append(
            agent,
            EventData::UserMessage(m),
            Some(SurfaceIntent::append()),
        );
    }
}

/// The batch entering the next step: the turn's prompt or continuation,
/// steered input and injected context, as `agent/pre-step` decides; the
/// reason when it rejects the step (a failing listener rejects it too:
/// nothing enters a step no one vetted).
async fn pre_step(
    agent: &Agent,
    me: &Awake,
    turn: u32,
    step: u32,
    entering: &mut Vec<Arc<Message>>,
    token: &CancellationToken,
) -> Result<Vec<Arc<Message>>, String> {
    {
        let mut inbox = agent.inbox();
        entering.append(&mut inbox.steer);
        entering.append(&mut inbox.inject);
    }
    let event = AgentPreStep {
        agent: agent.inner.id.to_string(),
        turn,
        step,
        entering: std::mem::take(entering),
        ctx: me.ctx.clone(),
        cancel: token.clone(),
    };
    let target = dsh_supervisors::Target::Scope(me.ctx.scope_key().cloned());
    let terminal = |e: AgentPreStep| async move { PreStepDecision::Enter(e.entering) };
    match me.ctx.events().waterfall(&target, event, terminal).await {
        Ok(PreStepDecision::Enter(batch)) => Ok(batch),
        Ok(PreStepDecision::Reject(why)) => Err(why),
        Err(e) => Err(format!("agent/pre-step failed: {}", chain(&e))),
    }
}

/// Whether the turn goes on after an answer without tool calls, and with
/// what: steered input arrived (it enters the next step), or an
/// `agent/turn-stopping` listener continues the turn with a message.
async fn goes_on(
    agent: &Agent,
    me: &Awake,
    turn: u32,
    text: &str,
    token: &CancellationToken,
) -> Option<Vec<Arc<Message>>> {
    if token.is_cancelled() {
        return None;
    }
    if !agent.inbox().steer.is_empty() {
        return Some(Vec::new());
    }
    let stopping = AgentTurnStopping {
        agent: agent.inner.id.to_string(),
        turn,
        text: text.to_owned(),
        ctx: me.ctx.clone(),
        cancel: token.clone(),
    };
    let target = dsh_supervisors::Target::Scope(me.ctx.scope_key().cloned());
    let more = me.ctx.events().serial(&target, stopping).await?;
    let mut continuation = Message::user_text(more);
    continuation.source = MessageSource::plugin("agent/turn-stopping");
    Some(vec![Arc::new(continuation)])
}

/// How a turn that answered ends: `max-tokens` when any step was cut.
fn ended(max_tokens_hit: bool) -> TurnEndReason {
    if max_tokens_hit {
        TurnEndReason::MaxTokens
    } else {
        TurnEndReason::Completed
    }
}

pub(super) fn aborted() -> TurnEndReason {
    TurnEndReason::Aborted {
        reason: serde_json::json!({"kind": "user"}),
    }
}
