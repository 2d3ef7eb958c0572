//! The model-facing `ralph` tool: one Ralph loop, awaited to its end.

use std::sync::Arc;

use dsh_services::llm::{ContentBlock, ToolSchema};
use dsh_services::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};
use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use super::{DEFAULT_ROUNDS, MAX_ROUNDS, RalphOutcome, RalphRequest};
use crate::agent::Agent;
use crate::subagent::Subagents;

/// The `ralph` tool.
pub struct RalphTool {
    /// The subagent service rounds start through.
    pub subagents: Arc<Subagents>,
    /// Provider of the workers (must start fresh children).
    pub provider: String,
    /// Default round cap and ceiling of a call's `maxRounds`.
    pub max_rounds: u32,
}

// What a `ralph` call takes. (Plain comments: the model has always been
// sent these fields undescribed; a doc comment would become a description.)
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct RalphArgs {
    // The fixed objective every round works on.
    #[schemars(length(min = 1))]
    objective: String,
    // Round cap; defaults to, and may not exceed, this deployment's cap.
    #[serde(rename = "maxRounds", default)]
    #[schemars(range(min = 1, max = MAX_ROUNDS))]
    max_rounds: Option<u32>,
}

impl RalphTool {
    /// A tool over `spawn` with the default cap.
    pub fn new(subagents: Arc<Subagents>) -> RalphTool {
        RalphTool {
            subagents,
            provider: "spawn".into(),
            max_rounds: DEFAULT_ROUNDS,
        }
    }
}

impl Tool for RalphTool {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "ralph".into(),
            description: "Run a Ralph loop: a fresh agent per round works on one fixed objective, \
                          with the shared workspace as memory and a structured handoff between \
                          rounds. Use it only when explicitly asked for a Ralph loop. Completion \
                          and blockers are the workers' claims, not verification: check the \
                          result yourself before you report it done."
                .into(),
            parameters: parameters::<RalphArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "`ralph` runs a Ralph loop (fresh workers, one objective, rounds until done or blocked); start one only when the user asks for a Ralph loop, and verify its claimed result.",
        )
    }

    /// A cancelled call stops its run, waits for its children, and records the end.
    fn cancel_grace(&self) -> Option<std::time::Duration> {
        Some(std::time::Duration::from_secs(90))
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let parent = Agent::calling(&cx.ctx)
                .ok_or_else(|| ToolError::new("NO_AGENT", "ralph runs inside an agent"))?;
            let args: RalphArgs = cx.parse()?;
            let objective = args.objective.as_str();
            let rounds = args.max_rounds.unwrap_or(self.max_rounds);
            if rounds > self.max_rounds.max(1) {
                return Err(ToolError::new(
                    "INVALID_ARGS",
                    format!(
                        "maxRounds {rounds} is above this deployment's cap of {}",
                        self.max_rounds
                    ),
                ));
            }
            let mut request = RalphRequest::new(&parent, objective);
            request.max_rounds = Some(rounds);
            request.cancel = cx.cancel.clone();
            request.provider = self.provider.clone();
            let result = super::run(&self.subagents, request, None)
                .await
                .map_err(|e| ToolError::new("RALPH_START", chain(&e).to_string()))?;
            let report = json!({
                "runId": result.run_id,
                "rounds": result.rounds,
                "result": result.outcome.name(),
                "lastHandoff": result.last,
            });
            match &result.outcome {
                RalphOutcome::Failed { .. } | RalphOutcome::Cancelled { .. } => {
                    Err(ToolError::new(
                        "RALPH_FAILED",
                        format!("{}\n{}", result.outcome.describe(), report),
                    ))
                }
                outcome => Ok(ToolOutput {
                    content: vec![ContentBlock::text(format!(
                        "Ralph loop {}: {} after {} rounds.\n{}",
                        result.run_id,
                        outcome.describe(),
                        result.rounds,
                        serde_json::to_string_pretty(&report).unwrap_or_default()
                    ))],
                    meta: Some(report),
                }),
            }
        }
        .boxed()
    }
}
