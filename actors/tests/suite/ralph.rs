//! Ralph loops: completion, blockers, the cap, completion on the last
//! round, the circuit breaker, failed rounds, and resuming a cut loop.

use std::sync::Arc;

use dsh_actors::agent::Agent;
use dsh_actors::ralph::{self, HandoffStatus, RalphError, RalphOutcome, RalphRequest};
use dsh_actors::subagent::Subagents;
use dsh_services::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmFailure, LlmRequest,
};
use dsh_services::session::EventData;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use super::harness::Harness;

/// A worker whose behaviour the objective names: `complete at N`,
/// `blocked at N`, `never` (distinct continues), `stuck` (identical
/// continues), `fail at N` (the model call fails).
struct Worker;

fn number_after(text: &str, key: &str) -> Option<u32> {
    let at = text.find(key)? + key.len();
    text[at..]
        .split(|c: char| !c.is_ascii_digit())
        .find(|s| !s.is_empty())?
        .parse()
        .ok()
}

impl LlmAdapter for Worker {
    fn name(&self) -> &str {
        "worker"
    }
    fn stream(&self, request: LlmRequest, _c: CancellationToken) -> ChunkStream {
        let prompt = request
            .messages
            .iter()
            .find(|m| m.source.kind == "user")
            .map(|m| m.text())
            .unwrap_or_default();
        let round = number_after(&prompt, "Ralph round ").unwrap_or(0);
        let at = |key: &str| number_after(&prompt, key);
        if at("fail at ") == Some(round) {
            let f = LlmFailure {
                message: "the worker's model is down".into(),
                code: "UNAVAILABLE".into(),
                status: Some(503),
                provider_retry_after_ms: None,
                request_id: None,
            };
            return Box::pin(futures::stream::iter(vec![Err(f)]));
        }
        if request
            .messages
            .last()
            .is_some_and(|m| m.source.kind == "tool")
        {
            let chunks = dsh_services::providers::scripted::chunks_for(
                &[ContentBlock::text("reported")],
                Default::default(),
                FinishReason::Stop,
            );
            return Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)));
        }
        let handoff = if at("complete at ") == Some(round) {
            json!({"status": "complete", "summary": format!("finished in round {round}"), "evidence": ["tests pass"]})
        } else if at("blocked at ") == Some(round) {
            json!({"status": "blocked", "summary": "cannot go on", "blocker": "no credentials"})
        } else if prompt.contains("stuck") {
            json!({"status": "continue", "summary": "tried again", "next_steps": ["try again"]})
        } else {
            json!({"status": "continue", "summary": format!("round {round} done"), "next_steps": [format!("round {}", round + 1)]})
        };
        let call = ContentBlock::ToolCall {
            id: "call_report".into(),
            name: "report".into(),
            arguments: handoff.to_string(),
        };
        let chunks = dsh_services::providers::scripted::chunks_for(
            &[call],
            Default::default(),
            FinishReason::ToolCalls,
        );
        Box::pin(futures::stream::iter(chunks.into_iter().map(Ok)))
    }
}

async fn setup() -> (Harness, Arc<Subagents>, Agent) {
    let h = Harness::new().await;
    let s = Arc::new(Subagents::with_builtin());
    h.rt.root().provide(Subagents::SERVICE, s.clone()).unwrap();
    h.adapter("worker", Arc::new(Worker));
    let parent = h.agent("worker").await;
    (h, s, parent)
}

async fn loop_of(objective: &str, cap: u32) -> (ralph::RalphResult, Agent, Harness) {
    let (h, s, parent) = setup().await;
    let mut request = RalphRequest::new(&parent, objective);
    request.max_rounds = Some(cap);
    let result = ralph::run(&s, request, None).await.unwrap();
    (result, parent, h)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_blocked_cap_and_completion_on_the_last_round() {
    let (r, parent, h) = loop_of("complete at 2", 5).await;
    assert_eq!(r.outcome, RalphOutcome::Complete);
    assert_eq!(r.rounds, 2);
    assert_eq!(r.last.as_ref().unwrap().status, HandoffStatus::Complete);
    // Each round was a fresh child of the parent, recorded in its log.
    let rounds: Vec<serde_json::Value> = parent
        .session()
        .events()
        .iter()
        .filter_map(|e| match &e.data {
            EventData::Other { kind, data } if &**kind == "ralph/round" => Some((**data).clone()),
            _ => None,
        })
        .collect();
    assert_eq!(rounds.len(), 2);
    assert_ne!(rounds[0]["child"], rounds[1]["child"]);
    h.rt.shutdown().await;

    let (r, _, h) = loop_of("blocked at 3", 5).await;
    assert_eq!(r.outcome, RalphOutcome::Blocked);
    assert_eq!(r.rounds, 3);
    assert_eq!(r.last.unwrap().blocker.as_deref(), Some("no credentials"));
    h.rt.shutdown().await;

    let (r, _, h) = loop_of("never", 4).await;
    assert_eq!(r.outcome, RalphOutcome::BudgetLimited);
    assert_eq!(r.rounds, 4);
    assert_eq!(r.completed.len(), 4);
    h.rt.shutdown().await;

    let (r, _, h) = loop_of("complete at 4", 4).await;
    assert_eq!(
        r.outcome,
        RalphOutcome::Complete,
        "completion wins on the last round"
    );
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_circuit_breaker_and_failed_rounds_stop_the_loop() {
    let (r, _, h) = loop_of("stuck", 10).await;
    assert_eq!(r.outcome, RalphOutcome::CircuitOpen);
    assert_eq!(r.rounds, 3);
    h.rt.shutdown().await;

    let (r, _, h) = loop_of("fail at 2", 10).await;
    match &r.outcome {
        RalphOutcome::Failed { round: 2, error } => {
            assert!(error.contains("UNAVAILABLE"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        r.last.unwrap().summary,
        "round 1 done",
        "the last good handoff is kept"
    );
    h.rt.shutdown().await;

    let (h, s, parent) = setup().await;
    let mut request = RalphRequest::new(&parent, "never");
    request.max_rounds = Some(0);
    assert!(matches!(
        ralph::run(&s, request.clone(), None).await,
        Err(RalphError::Rounds { given: 0, .. })
    ));
    request.max_rounds = Some(257);
    assert!(matches!(
        ralph::run(&s, request.clone(), None).await,
        Err(RalphError::Rounds {
            given: 257,
            max: 256
        })
    ));
    request.max_rounds = Some(3);
    request.provider = "fork".into();
    let e = ralph::run(&s, request, None).await.unwrap_err();
    assert!(
        matches!(&e, RalphError::InheritsContext(p) if p == "fork"),
        "{e}"
    );
    assert!(e.to_string().contains("fresh"), "{e}");
    h.rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_loop_resumes_after_its_last_completed_round() {
    let (h, s, parent) = setup().await;
    // A loop whose process died after round 2: start and two rounds logged.
    let mut first = RalphRequest::new(&parent, "complete at 4");
    first.max_rounds = Some(2);
    let r = ralph::run(&s, first, None).await.unwrap();
    assert_eq!(r.outcome, RalphOutcome::BudgetLimited);
    let mut events: Vec<_> = parent
        .session()
        .events()
        .iter()
        .map(|e| e.as_ref().clone())
        .collect();
    // Cut the log where the kill happened: no `ralph/end`, cap raised to 5.
    events.retain(|e| e.kind() != "ralph/end");
    for e in &mut events {
        if let EventData::Other { kind, data } = &mut e.data
            && &**kind == "ralph/start"
        {
            std::sync::Arc::make_mut(data)["maxRounds"] = json!(5);
        }
    }
    let resume = ralph::last_loop(&events).unwrap();
    assert_eq!(resume.rounds.len(), 2);
    let id = resume.run_id.clone();
    let r = ralph::run(&s, RalphRequest::new(&parent, "ignored"), Some(resume))
        .await
        .unwrap();
    assert_eq!(r.run_id, id);
    assert_eq!(r.outcome, RalphOutcome::Complete);
    assert_eq!(r.rounds, 4);
    assert_eq!(
        r.completed.iter().map(|c| c.round).collect::<Vec<_>>(),
        vec![3, 4],
        "only rounds after the last completed one ran"
    );
    // An ended loop is not resumed.
    let ended = ralph::last_loop(
        &parent
            .session()
            .events()
            .iter()
            .map(|e| e.as_ref().clone())
            .collect::<Vec<_>>(),
    )
    .unwrap();
    assert!(
        ralph::run(&s, RalphRequest::new(&parent, "x"), Some(ended))
            .await
            .is_err()
    );
    h.rt.shutdown().await;
}
