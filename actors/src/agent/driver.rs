//! The driver actor: claims queued prompts one at a time and runs each as a
//! turn (`turn/start` … steps … `turn/end`), then reports idle.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use dsh_services::llm::{LlmFailure, Message, MessageSource, code};
use dsh_services::session::{EventData, SessionEvent, SurfaceIntent, TurnEndReason};
use ractor::{Actor, ActorProcessingErr, ActorRef};
use tokio_util::sync::CancellationToken;

use super::events::{AgentPreStep, AgentTurnStopping};
use super::step::{StepEnd, run_step};
use super::summary::{publish_progress, publish_step};
use super::{Agent, Awake, TurnSummary};

pub(super) enum DriverMsg {
    Wake,
}

/// The driver's state: the agent and its awake part.
pub(super) struct Driving {
    pub(super) agent: Agent,
    pub(super) me: Arc<Awake>,
}

/// The driver actor: runs queued turns one at a time.
pub(super) struct Driver;

impl Actor for Driver {
    type Msg = DriverMsg;
    type State = Driving;
    type Arguments = Driving;

    async fn pre_start(
        &self,
        _me: ActorRef<DriverMsg>,
        driving: Driving,
    ) -> Result<Driving, ActorProcessingErr> {
        Ok(driving)
    }

    async fn handle(
        &self,
        _me: ActorRef<DriverMsg>,
        DriverMsg::Wake: DriverMsg,
        state: &mut Driving,
    ) -> Result<(), ActorProcessingErr> {
        let Driving { agent, me } = &*state;
        loop {
            let next = {
                let mut inbox = agent.inbox();
                if !inbox.accepting {
                    None
                } else if let Some(prompt) = inbox.followups.pop_front() {
                    inbox.running = true;
                    inbox.turn += 1;
                    // Under the inbox lock: the claim is logged at the
                    // position the queue had, right after the turn opens.
                    log_append(agent, EventData::TurnStart { turn: inbox.turn }, None);
                    agent.splice(0, 1, &[]);
                    if !std::mem::replace(&mut inbox.opened, true) {
                        for data in agent.inner.spec.opening.iter().cloned() {
                            log_append(agent, data, None);
                        }
                    }
                    let token = CancellationToken::new();
                    if std::mem::take(&mut inbox.cancel_next) {
                        token.cancel();
                    }
                    inbox.cancel = Some(token.clone());
                    Some((prompt, inbox.turn, token))
                } else {
                    None
                }
            };
            let Some((prompt, turn, token)) = next else {
                break;
            };
            // Boxed: an idle driver's task does not carry a turn's state.
            let summary = Box::pin(run_turn(agent, me, prompt, turn, token)).await;
            {
                let mut inbox = agent.inbox();
                inbox.running = false;
                inbox.cancel = None;
                inbox.last = Some(Box::new(summary.clone()));
                // Steered in after the turn's last step: the next turn's prompt.
                let leftover: Vec<Arc<Message>> = inbox.steer.drain(..).collect();
                for message in leftover {
                    let start = inbox.followups.len();
                    agent.splice(start, 0, std::slice::from_ref(&message));
                    inbox.followups.push_back(message);
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
        Ok(())
    }

    async fn post_stop(
        &self,
        _me: ActorRef<DriverMsg>,
        state: &mut Driving,
    ) -> Result<(), ActorProcessingErr> {
        // However the driver ended (drained, killed, failed), no turn runs
        // any more: waiters on idle must not wait forever. Going to sleep,
        // the agent still takes input (which wakes it).
        let mut inbox = state.agent.inbox();
        inbox.running = false;
        if !state.me.sleeping.load(Ordering::Acquire) {
            inbox.accepting = false;
        }
        if inbox.followups.is_empty() || !inbox.accepting {
            state.agent.inner.idle.set(true);
        }
        Ok(())
    }
}

/// Appends, logging (not propagating) refusals: the driver's own events are
/// well-formed by construction, so a refusal is a bug worth a loud log.
pub(super) fn log_append(
    agent: &Agent,
    data: EventData,
    intent: Option<SurfaceIntent>,
) -> Option<Arc<SessionEvent>> {
    match agent.inner.session.append(data, intent) {
        Ok(e) => Some(e),
        Err(e) => {
            tracing::error!(agent = %agent.inner.id, "session refused an append: {e}");
            None
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
    let mut entering = vec![prompt];
    let mut steps = 0u32;
    let mut max_tokens_hit = false;
    let mut text = String::new();
    let reason = loop {
        if token.is_cancelled() {
            break aborted();
        }
        if steps >= agent.inner.spec.max_steps {
            break TurnEndReason::Error {
                error: Box::new(LlmFailure::new(
                    code::STEP_LIMIT,
                    format!(
                        "the turn used all {} steps it may take",
                        agent.inner.spec.max_steps
                    ),
                )),
            };
        }
        steps += 1;
        let step = steps;
        me.step.store(step, Ordering::Relaxed);
        publish_step(me);
        log_append(agent, EventData::StepStart { turn, step }, None);
        let target = dsh_supervisors::Target::Scope(me.ctx.scope_key().cloned());
        me.ctx.events().emit(
            &target,
            &AgentPreStep {
                agent: agent.inner.id.to_string(),
                turn,
                step,
            },
        );
        {
            let mut inbox = agent.inbox();
            entering.append(&mut inbox.steer);
            entering.append(&mut inbox.inject);
        }
        for m in entering.drain(..) {
            log_append(
                agent,
                EventData::UserMessage(m),
                Some(SurfaceIntent::append()),
            );
        }
        match run_step(agent, me, turn, step, &token).await {
            StepEnd::Answer {
                text: t,
                max_tokens,
            } => {
                text = t;
                max_tokens_hit |= max_tokens;
                log_append(agent, EventData::StepEnd { turn, step }, None);
                let steered = !agent.inbox().steer.is_empty();
                if steered && !token.is_cancelled() {
                    continue;
                }
                let stopping = AgentTurnStopping {
                    agent: agent.inner.id.to_string(),
                    turn,
                    text: text.clone(),
                };
                let target = dsh_supervisors::Target::Scope(me.ctx.scope_key().cloned());
                if !token.is_cancelled()
                    && let Some(more) = me.ctx.events().serial(&target, stopping).await
                {
                    let mut continuation = Message::user_text(more);
                    continuation.source = MessageSource::plugin("agent/turn-stopping");
                    entering.push(Arc::new(continuation));
                    continue;
                }
                break if max_tokens_hit {
                    TurnEndReason::MaxTokens
                } else {
                    TurnEndReason::Completed
                };
            }
            StepEnd::ToolsDone { max_tokens } => {
                max_tokens_hit |= max_tokens;
                log_append(agent, EventData::StepEnd { turn, step }, None);
            }
            StepEnd::Concluded { max_tokens } => {
                log_append(agent, EventData::StepEnd { turn, step }, None);
                break if max_tokens_hit || max_tokens {
                    TurnEndReason::MaxTokens
                } else {
                    TurnEndReason::Completed
                };
            }
            StepEnd::Aborted => {
                log_append(agent, EventData::StepEnd { turn, step }, None);
                break aborted();
            }
            StepEnd::Failed(f) => {
                log_append(agent, EventData::StepEnd { turn, step }, None);
                break TurnEndReason::Error { error: Box::new(f) };
            }
        }
    };
    log_append(
        agent,
        EventData::TurnEnd {
            turn,
            reason: reason.clone(),
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

pub(super) fn aborted() -> TurnEndReason {
    TurnEndReason::Aborted {
        reason: serde_json::json!({"kind": "user"}),
    }
}
