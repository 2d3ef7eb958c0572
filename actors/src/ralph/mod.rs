//! Ralph loops: one objective, a fresh child agent per round.
//!
//! Each round starts a child through the subagent seam with no inherited
//! conversation: it sees the objective, its round and the cap, the rule that
//! the shared workspace is the long-term memory, and the previous round's
//! handoff. It must end by reporting a handoff (`status` continue | complete
//! | blocked, `summary`, `evidence`, `next_steps`, `blocker`) through the
//! structured-output capture tool. The loop stops on `complete` (which wins
//! on the last round too), on `blocked`, at the round cap, when the circuit
//! breaker sees three identical `continue` handoffs in a row, on a failed
//! round, or on cancel. Completion and blockers are the worker's claim.
//!
//! The rounds run inside a `ralph/<id>` scope under the parent agent; every
//! round is recorded in the parent's log (`ralph/start`, `ralph/round`,
//! `ralph/end`), so a killed loop resumes after its last completed round.

use dsh_services::session::{EventData, SessionEvent};
use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, ScopeKey};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

use crate::agent::{Agent, AgentError};
use crate::subagent::{StartRequest, StopReason, Subagents};

pub mod tool;

/// The default round cap.
pub const DEFAULT_ROUNDS: u32 = 20;
/// The highest round cap a run may ask for.
pub const MAX_ROUNDS: u32 = 256;
/// Identical `continue` handoffs in a row that open the circuit breaker.
pub const BREAKER: usize = 3;

/// What a worker reports at the end of its round.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Handoff {
    /// `continue`, `complete` or `blocked`.
    pub status: HandoffStatus,
    /// What the round did (non-empty).
    pub summary: String,
    /// What supports the claim.
    #[serde(default)]
    pub evidence: Vec<String>,
    /// What the next round should do.
    #[serde(default)]
    pub next_steps: Vec<String>,
    /// Why the work cannot go on (required when blocked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blocker: Option<String>,
}

/// A handoff's status.
#[derive(Clone, Copy, Debug, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum HandoffStatus {
    /// More rounds are needed.
    Continue,
    /// The worker claims the objective is met.
    Complete,
    /// The worker cannot go on.
    Blocked,
}

/// The JSON Schema of a handoff (the capture tool's parameters).
pub fn handoff_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "status": {"type": "string", "enum": ["continue", "complete", "blocked"]},
            "summary": {"type": "string", "minLength": 1},
            "evidence": {"type": "array", "items": {"type": "string"}},
            "next_steps": {"type": "array", "items": {"type": "string"}},
            "blocker": {"type": "string"}
        },
        "required": ["status", "summary"],
        "additionalProperties": false
    })
}

/// Why a reported handoff is refused. The round fails with it; the loop
/// keeps the last good handoff.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum BadHandoff {
    /// Larger than the loop allows.
    #[error("the handoff is {size} characters; at most {max} are allowed")]
    TooLarge {
        /// Its serialized size.
        size: usize,
        /// The cap.
        max: usize,
    },
    /// Not of the handoff's shape (serde's message names the field).
    #[error("the handoff is malformed: {0}")]
    Malformed(String),
    /// The summary is blank.
    #[error("the handoff's summary is empty")]
    EmptySummary,
    /// `blocked` without saying what blocks it.
    #[error("a blocked handoff must say what blocks it in `blocker`")]
    NoBlocker,
}

impl Handoff {
    /// Checks a reported value: shape, status rules, serialized size.
    pub fn validate(value: &Value, max_chars: usize) -> Result<Handoff, BadHandoff> {
        let size = value.to_string().chars().count();
        if size > max_chars {
            return Err(BadHandoff::TooLarge {
                size,
                max: max_chars,
            });
        }
        let h: Handoff = serde_json::from_value(value.clone())
            .map_err(|e| BadHandoff::Malformed(chain(&e).to_string()))?;
        if h.summary.trim().is_empty() {
            return Err(BadHandoff::EmptySummary);
        }
        match (h.status, h.blocker.as_deref().map(str::trim)) {
            (HandoffStatus::Blocked, None | Some("")) => Err(BadHandoff::NoBlocker),
            _ => Ok(h),
        }
    }
}

/// Why a loop could not run at all (a loop that ran and failed a round ends
/// [`RalphOutcome::Failed`] instead). Fatal: the request must change.
#[derive(Debug, thiserror::Error)]
pub enum RalphError {
    /// No subagent provider has that name.
    #[error("no subagent provider named `{0}`")]
    UnknownProvider(String),
    /// The provider seeds children with the parent's conversation.
    #[error(
        "provider `{0}` seeds children with the parent's conversation; Ralph needs fresh children"
    )]
    InheritsContext(String),
    /// The loop being resumed already ended.
    #[error("Ralph loop {run_id} already ended ({how})")]
    Ended {
        /// The loop.
        run_id: String,
        /// How it ended.
        how: String,
    },
    /// The round cap is out of range.
    #[error("maxRounds must be between 1 and {max}; {given} was given")]
    Rounds {
        /// The cap given.
        given: u32,
        /// The ceiling.
        max: u32,
    },
    /// The coordinator could not host the loop's scope.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The kernel refused the loop's scope.
    #[error(transparent)]
    Kernel(#[from] dsh_supervisors::Error),
}

/// How a loop ended.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum RalphOutcome {
    /// A worker reported the objective complete (its claim).
    Complete,
    /// A worker reported a blocker (its claim).
    Blocked,
    /// The round cap was reached without completion.
    BudgetLimited,
    /// Three identical `continue` handoffs in a row.
    CircuitOpen,
    /// A round failed (the child did not complete, or its handoff was bad).
    Failed {
        /// The round.
        round: u32,
        /// What went wrong.
        error: String,
    },
    /// The loop was cancelled.
    Cancelled {
        /// The round in flight.
        round: u32,
    },
}

impl RalphOutcome {
    /// The outcome's wire name.
    pub fn name(&self) -> &'static str {
        match self {
            RalphOutcome::Complete => "complete",
            RalphOutcome::Blocked => "blocked",
            RalphOutcome::BudgetLimited => "budget-limited",
            RalphOutcome::CircuitOpen => "circuit-open",
            RalphOutcome::Failed { .. } => "failed",
            RalphOutcome::Cancelled { .. } => "cancelled",
        }
    }

    /// One line for people, saying whose claim an outcome is.
    pub fn describe(&self) -> String {
        match self {
            RalphOutcome::Complete => "complete (the worker's claim, not a verification)".into(),
            RalphOutcome::Blocked => "blocked (the worker's claim)".into(),
            RalphOutcome::BudgetLimited => "round cap reached without a completion claim".into(),
            RalphOutcome::CircuitOpen => {
                format!("stopped: {BREAKER} identical continue handoffs in a row (no progress)")
            }
            RalphOutcome::Failed { round, error } => format!("round {round} failed: {error}"),
            RalphOutcome::Cancelled { round } => format!("cancelled during round {round}"),
        }
    }
}

/// One completed round.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Round {
    /// 1-based round number.
    pub round: u32,
    /// The child's session id.
    pub child: String,
    /// What it handed off.
    pub handoff: Handoff,
}

/// The result of a loop.
#[derive(Clone, Debug, PartialEq)]
pub struct RalphResult {
    /// Loop id (recorded in the parent's log).
    pub run_id: String,
    /// How it ended.
    pub outcome: RalphOutcome,
    /// Rounds started, over the loop's whole life (resumes included).
    pub rounds: u32,
    /// The last successful handoff.
    pub last: Option<Handoff>,
    /// The rounds completed by this call.
    pub completed: Vec<Round>,
}

/// What a caller asks for.
#[derive(Clone)]
pub struct RalphRequest {
    /// The immutable objective.
    pub objective: String,
    /// Round cap (default 20, at most 256).
    pub max_rounds: Option<u32>,
    /// The parent of every round's child.
    pub parent: Agent,
    /// Cancels the loop.
    pub cancel: CancellationToken,
    /// Subagent provider (default `spawn`); must start fresh children.
    pub provider: String,
    /// Model route and id of the workers (the parent's when `None`).
    pub route: Option<(String, String)>,
    /// Largest serialized handoff, characters.
    pub max_handoff_chars: usize,
    /// The named agent definition every round's worker is made from.
    pub agent: Option<String>,
}

impl RalphRequest {
    /// A request with defaults.
    pub fn new(parent: &Agent, objective: impl Into<String>) -> RalphRequest {
        RalphRequest {
            objective: objective.into(),
            max_rounds: None,
            parent: parent.clone(),
            cancel: CancellationToken::new(),
            provider: "spawn".into(),
            route: None,
            max_handoff_chars: 16_384,
            agent: None,
        }
    }
}

/// Where a loop picks up: its id, and the rounds already done.
#[derive(Clone, Debug, Default)]
pub struct Resume {
    /// The loop's id.
    pub run_id: String,
    /// The objective it was started with.
    pub objective: String,
    /// Its round cap.
    pub max_rounds: u32,
    /// Rounds already completed, in order.
    pub rounds: Vec<(u32, Handoff)>,
    /// Whether it already ended (`ralph/end` logged).
    pub ended: Option<String>,
}

/// The last Ralph loop recorded in a parent's log.
pub fn last_loop(events: &[SessionEvent]) -> Option<Resume> {
    let mut found: Option<Resume> = None;
    for e in events {
        let EventData::Other { kind, data } = &e.data else {
            continue;
        };
        match &**kind {
            "ralph/start" => {
                found = Some(Resume {
                    run_id: data["runId"].as_str().unwrap_or_default().to_owned(),
                    objective: data["objective"].as_str().unwrap_or_default().to_owned(),
                    max_rounds: data["maxRounds"].as_u64().unwrap_or(DEFAULT_ROUNDS.into()) as u32,
                    rounds: Vec::new(),
                    ended: None,
                })
            }
            "ralph/round" => {
                if let Some(r) = found
                    .as_mut()
                    .filter(|r| data["runId"] == r.run_id.as_str())
                    && let Ok(h) = serde_json::from_value::<Handoff>(data["handoff"].clone())
                {
                    r.rounds
                        .push((data["round"].as_u64().unwrap_or(0) as u32, h));
                }
            }
            "ralph/end" => {
                if let Some(r) = found
                    .as_mut()
                    .filter(|r| data["runId"] == r.run_id.as_str())
                {
                    r.ended = data["outcome"]["kind"].as_str().map(str::to_owned);
                }
            }
            _ => {}
        }
    }
    found
}

fn round_prompt(objective: &str, round: u32, cap: u32, previous: Option<&Handoff>) -> String {
    let handoff = match previous {
        None => "None: this is the first round.".to_owned(),
        Some(h) => serde_json::to_string_pretty(h).unwrap_or_default(),
    };
    format!(
        "Ralph round {round} of {cap}.\n\nObjective (fixed for every round):\n{objective}\n\n\
         You are a fresh agent: you do not see earlier rounds' conversations. The shared \
         workspace is the long-term memory and the authority on what has been done; inspect it \
         before acting. Make real progress on the objective, then end by reporting a handoff \
         for the next round: status `complete` only when the objective is met, `blocked` with a \
         `blocker` when you cannot go on, otherwise `continue` with `next_steps`.\n\n\
         Previous round's handoff:\n{handoff}"
    )
}

/// Runs (or, with `resume`, continues) a loop to its end.
pub async fn run(
    subagents: &Subagents,
    request: RalphRequest,
    resume: Option<Resume>,
) -> Result<RalphResult, RalphError> {
    let provider = subagents
        .provider(&request.provider)
        .ok_or_else(|| RalphError::UnknownProvider(request.provider.clone()))?;
    if provider.inherits_parent_context() {
        return Err(RalphError::InheritsContext(request.provider.clone()));
    }
    let (run_id, objective, cap, mut history) = match resume {
        Some(r) => {
            if let Some(how) = &r.ended {
                return Err(RalphError::Ended {
                    run_id: r.run_id,
                    how: how.clone(),
                });
            }
            (r.run_id, r.objective, r.max_rounds, r.rounds)
        }
        None => {
            let cap = request.max_rounds.unwrap_or(DEFAULT_ROUNDS);
            if cap == 0 || cap > MAX_ROUNDS {
                return Err(RalphError::Rounds {
                    given: cap,
                    max: MAX_ROUNDS,
                });
            }
            let run_id = dsh_services::llm::Message::new_id();
            request.parent.record(
                "ralph/start",
                json!({"runId": run_id, "objective": request.objective, "maxRounds": cap}),
            );
            (run_id, request.objective.clone(), cap, Vec::new())
        }
    };
    let scope = request
        .parent
        .awake_context()
        .await?
        .scope(ScopeKey::new(format!(
            "ralph/{}",
            crate::session::short(&run_id)
        )))
        .await?;
    let mut completed = Vec::new();
    let mut round = history.last().map_or(0, |(n, _)| *n);
    let outcome = loop {
        if let Some(o) = verdict(&history, round, cap) {
            break o;
        }
        round += 1;
        if request.cancel.is_cancelled() {
            break RalphOutcome::Cancelled { round };
        }
        let previous = history.last().map(|(_, h)| h);
        let at = Place {
            run_id: &run_id,
            objective: &objective,
            cap,
            round,
        };
        match run_round(subagents, &request, scope.ctx(), at, previous).await {
            Ok(done) => {
                history.push((round, done.handoff.clone()));
                completed.push(done);
            }
            Err(end) => break end,
        }
    };
    scope.dispose().await;
    let rounds = match &outcome {
        RalphOutcome::Failed { round, .. } | RalphOutcome::Cancelled { round } => *round,
        _ => round,
    };
    request.parent.record(
        "ralph/end",
        json!({"runId": run_id, "outcome": outcome, "rounds": rounds}),
    );
    if let Err(e) = request.parent.session().flush().await {
        tracing::warn!("the Ralph records were not fully written: {}", chain(&e));
    }
    Ok(RalphResult {
        run_id,
        outcome,
        rounds,
        last: history.last().map(|(_, h)| h.clone()),
        completed,
    })
}

/// Which round of which loop.
#[derive(Clone, Copy)]
struct Place<'a> {
    run_id: &'a str,
    objective: &'a str,
    cap: u32,
    round: u32,
}

/// One round: a fresh worker under the loop's scope, its handoff validated
/// and recorded (`ralph/round`, flushed before the next round starts, so a
/// crash from here on resumes after it). `Err` is how the loop ends instead.
async fn run_round(
    subagents: &Subagents,
    request: &RalphRequest,
    scope: &Context,
    at: Place<'_>,
    previous: Option<&Handoff>,
) -> Result<Round, RalphOutcome> {
    let round = at.round;
    let mut start = StartRequest::new(
        &request.parent,
        round_prompt(at.objective, round, at.cap, previous),
        request.cancel.child_token(),
    );
    start.owner = Some(scope.clone());
    start.label = Some(format!("ralph round {round}"));
    start.output_schema = Some(handoff_schema());
    start.route = request.route.clone();
    if let Some(name) = &request.agent
        && let Err(e) = subagents.define(&mut start, name)
    {
        return Err(RalphOutcome::Failed {
            round,
            error: chain(&e).to_string(),
        });
    }
    let run = match subagents.start(&request.provider, start).await {
        Ok(run) => run,
        Err(_) if request.cancel.is_cancelled() => return Err(RalphOutcome::Cancelled { round }),
        Err(e) => {
            return Err(RalphOutcome::Failed {
                round,
                error: chain(&e).to_string(),
            });
        }
    };
    let result = run.result().await;
    let child = run.id().to_owned();
    run.dispose().await;
    if result.stop_reason == StopReason::Aborted && request.cancel.is_cancelled() {
        return Err(RalphOutcome::Cancelled { round });
    }
    let handoff = match (result.stop_reason, result.structured) {
        (StopReason::Completed, Some(v)) => {
            Handoff::validate(&v, request.max_handoff_chars).map_err(|e| chain(&e).to_string())
        }
        (reason, _) => Err(format!(
            "the worker ended {}{}",
            reason.as_str(),
            result
                .diagnostic
                .map(|d| format!(": {d}"))
                .unwrap_or_default()
        )),
    };
    let handoff = handoff.map_err(|error| RalphOutcome::Failed { round, error })?;
    request.parent.record(
        "ralph/round",
        json!({"runId": at.run_id, "round": round, "child": child, "handoff": handoff}),
    );
    if let Err(e) = request.parent.session().flush().await {
        tracing::warn!(round, "the round's record was not written: {}", chain(&e));
    }
    Ok(Round {
        round,
        child,
        handoff,
    })
}

/// Whether the loop is over after `round` rounds with `history`.
fn verdict(history: &[(u32, Handoff)], round: u32, cap: u32) -> Option<RalphOutcome> {
    if let Some((_, last)) = history.last() {
        match last.status {
            HandoffStatus::Complete => return Some(RalphOutcome::Complete),
            HandoffStatus::Blocked => return Some(RalphOutcome::Blocked),
            HandoffStatus::Continue => {}
        }
        if history.len() >= BREAKER {
            let tail = &history[history.len() - BREAKER..];
            if tail.iter().all(|(_, h)| h == &tail[0].1) {
                return Some(RalphOutcome::CircuitOpen);
            }
        }
    }
    (round >= cap).then_some(RalphOutcome::BudgetLimited)
}
