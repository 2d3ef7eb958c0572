//! The approval seam: may this specific action proceed?
//!
//! Policies: `never` rejects every ask without asking anyone, `always`
//! allows every ask, `ask` dispatches the `approval/request` waterfall to the
//! registered answerers (a terminal, a UI). With no answerer, or a failing
//! one, the answer is `unavailable` — callers fail closed on anything but
//! `allowed-once`.

use std::sync::RwLock;

use dsh_supervisors::{Context, Event, Target, Waterfall};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::session::{EventData, SESSION_SERVICE, SessionWriter};

/// What happens to an ask.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ApprovalPolicy {
    /// Reject every ask.
    Never,
    /// Ask the answerers.
    Ask,
    /// Allow every ask.
    Always,
}

impl ApprovalPolicy {
    /// What this policy means, for the model (one paragraph of the
    /// runtime-context snapshot).
    pub fn describe(self) -> &'static str {
        match self {
            ApprovalPolicy::Ask => {
                "Approval policy: ask. A call that needs a wider mode than the agent's (`sandbox_permissions` naming it, with a `justification`) is put to the user, who allows or refuses that one call."
            }
            ApprovalPolicy::Never => {
                "Approval policy: never. Nothing is put to the user here: a call that needs approval is refused, so do not ask to run outside the sandbox (leave `sandbox_permissions` out)."
            }
            ApprovalPolicy::Always => {
                "Approval policy: always. A call that asks to run outside the sandbox is allowed without asking the user; ask for it only when the task needs it."
            }
        }
    }
}

/// A policy name that is none of `never`, `ask`, `always`. Fatal: the
/// name must change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown approval policy `{0}` (expected never, ask or always)")]
pub struct UnknownPolicy(pub String);

impl std::str::FromStr for ApprovalPolicy {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        match s {
            "never" => Ok(ApprovalPolicy::Never),
            "ask" => Ok(ApprovalPolicy::Ask),
            "always" => Ok(ApprovalPolicy::Always),
            other => Err(UnknownPolicy(other.to_owned())),
        }
    }
}

/// The closed answer vocabulary.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ApprovalOutcome {
    /// This one action may proceed.
    AllowedOnce,
    /// Refused.
    Rejected,
    /// The question was withdrawn.
    Cancelled,
    /// Nobody could answer (fail closed).
    Unavailable,
}

impl ApprovalOutcome {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalOutcome::AllowedOnce => "allowed-once",
            ApprovalOutcome::Rejected => "rejected",
            ApprovalOutcome::Cancelled => "cancelled",
            ApprovalOutcome::Unavailable => "unavailable",
        }
    }
}

/// One question.
#[derive(Clone, Debug, PartialEq)]
pub struct ApprovalRequest {
    /// The tool the question is about.
    pub tool: String,
    /// The exact call, when known.
    pub call_id: Option<String>,
    /// Why approval is needed.
    pub reason: String,
    /// The call's arguments.
    pub arguments: Value,
}

/// `approval/request` (waterfall): answerers return an outcome or call `next`.
/// An answerer that waits (for a person) stops waiting when `cancel`
/// fires; the seam then answers `cancelled` and drops the answerer's future.
pub struct ApprovalAsk {
    /// This ask's id (the one its `approval/asked` record carries).
    pub id: String,
    /// The question.
    pub request: ApprovalRequest,
    /// Fires when the question is withdrawn (the call or turn was cancelled).
    pub cancel: CancellationToken,
}

impl Event for ApprovalAsk {
    const NAME: &'static str = "approval/request";
}
impl Waterfall for ApprovalAsk {
    type Output = ApprovalOutcome;
}

/// The `approval` service.
#[derive(Debug)]
pub struct Approval {
    policy: RwLock<ApprovalPolicy>,
}

impl Approval {
    /// The capability name.
    pub const SERVICE: &'static str = "approval";

    /// A service with `policy`.
    pub fn new(policy: ApprovalPolicy) -> Approval {
        Approval {
            policy: RwLock::new(policy),
        }
    }

    /// The policy in force.
    pub fn policy(&self) -> ApprovalPolicy {
        self.policy
            .read()
            .map(|p| *p)
            .unwrap_or(ApprovalPolicy::Never)
    }

    /// Switches the policy.
    pub fn set_policy(&self, policy: ApprovalPolicy) {
        if let Ok(mut p) = self.policy.write() {
            *p = policy;
        }
    }

    /// Obtains one outcome for `request`; `cancelled` as soon as `cancel`
    /// fires. When `ctx` belongs to an agent, the question and its outcome
    /// are recorded in its session as `approval/asked` and
    /// `approval/decided` (log-only audit).
    pub async fn request(
        &self,
        ctx: &Context,
        request: ApprovalRequest,
        cancel: &CancellationToken,
    ) -> ApprovalOutcome {
        let session = ctx.get::<dyn SessionWriter>(SESSION_SERVICE);
        let id = format!("approval_{}", crate::llm::Message::new_id());
        if let Some(s) = &session {
            let mut asked =
                serde_json::json!({"id": id, "toolName": request.tool, "reason": request.reason});
            if let Some(call) = &request.call_id {
                asked["callId"] = call.clone().into();
            }
            let _ = s.append_log_only(EventData::Other {
                kind: std::sync::Arc::from("approval/asked"),
                data: std::sync::Arc::new(asked),
            });
        }
        let outcome = tokio::select! {
            outcome = self.decide(ctx, id.clone(), request, cancel.clone()) => outcome,
            () = cancel.cancelled() => ApprovalOutcome::Cancelled,
        };
        if let Some(s) = &session {
            let _ = s.append_log_only(EventData::Other {
                kind: std::sync::Arc::from("approval/decided"),
                data: std::sync::Arc::new(
                    serde_json::json!({"id": id, "outcome": outcome.as_str()}),
                ),
            });
        }
        outcome
    }

    async fn decide(
        &self,
        ctx: &Context,
        id: String,
        request: ApprovalRequest,
        cancel: CancellationToken,
    ) -> ApprovalOutcome {
        match self.policy() {
            ApprovalPolicy::Never => ApprovalOutcome::Rejected,
            ApprovalPolicy::Always => ApprovalOutcome::AllowedOnce,
            ApprovalPolicy::Ask => {
                let target = Target::Scope(ctx.scope_key().cloned());
                let ask = ApprovalAsk {
                    id,
                    request,
                    cancel,
                };
                ctx.events()
                    .waterfall(&target, ask, |_| async { ApprovalOutcome::Unavailable })
                    .await
                    .unwrap_or(ApprovalOutcome::Unavailable)
            }
        }
    }
}
