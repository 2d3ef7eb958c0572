//! Approvals over HTTP: while mutations are on, the server answers the
//! approval seam's asks by waiting for a client.
//!
//! - `GET /api/approvals`: the pending asks, oldest first.
//! - `POST /api/approvals/{id}` `{"outcome": "allowed-once" | "rejected"}`:
//!   answers one.
//!
//! An ask waits until a client answers or the question is withdrawn (the
//! call or turn cancelled, the agent disposed, the server stopped); then its
//! entry is gone. Answering an ask twice, or one that is gone, is
//! `NOT_FOUND`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use axum::Json;
use axum::extract::{Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dsh_services::approval::{ApprovalAsk, ApprovalOutcome};
use dsh_supervisors::Context;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::{Api, error};

/// The asks waiting for an HTTP client.
#[derive(Default)]
pub(crate) struct Pending {
    asks: Mutex<BTreeMap<u64, Waiting>>,
    next: std::sync::atomic::AtomicU64,
}

struct Waiting {
    id: String,
    shown: Value,
    answer: oneshot::Sender<ApprovalOutcome>,
}

/// Removes an ask from the pending list when its waiter ends, answered or
/// not.
struct Entry<'a> {
    pending: &'a Pending,
    key: u64,
}

impl Drop for Entry<'_> {
    fn drop(&mut self) {
        if let Ok(mut asks) = self.pending.asks.lock() {
            asks.remove(&self.key);
        }
    }
}

impl Pending {
    /// Registers the answerer through `ctx` (removed with its fiber). Once
    /// `stop` fires (the server stopped, a mounted router dropped), asks go
    /// on to the next answerer as if it were not there.
    pub(crate) fn answer_through(
        self: &Arc<Self>,
        ctx: &Context,
        stop: tokio_util::sync::CancellationToken,
    ) -> Result<(), dsh_supervisors::Error> {
        let pending = self.clone();
        ctx.on_waterfall(move |ask: ApprovalAsk, next| {
            let pending = pending.clone();
            let stop = stop.clone();
            async move {
                if stop.is_cancelled() {
                    return next.run(ask).await;
                }
                let (tx, rx) = oneshot::channel();
                let key = pending
                    .next
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let shown = json!({
                    "id": ask.id,
                    "tool": ask.request.tool,
                    "callId": ask.request.call_id,
                    "reason": ask.request.reason,
                    "arguments": ask.request.arguments,
                });
                if let Ok(mut asks) = pending.asks.lock() {
                    asks.insert(
                        key,
                        Waiting {
                            id: ask.id.clone(),
                            shown,
                            answer: tx,
                        },
                    );
                }
                let _entry = Entry {
                    pending: &pending,
                    key,
                };
                tokio::select! {
                    answer = rx => answer.unwrap_or(ApprovalOutcome::Unavailable),
                    () = ask.cancel.cancelled() => ApprovalOutcome::Cancelled,
                    () = stop.cancelled() => ApprovalOutcome::Unavailable,
                }
            }
        })
        .map(|_| ())
    }

    fn list(&self) -> Vec<Value> {
        self.asks
            .lock()
            .map(|asks| asks.values().map(|w| w.shown.clone()).collect())
            .unwrap_or_default()
    }

    /// Hands `outcome` to the ask `id`; false when no such ask waits.
    fn answer(&self, id: &str, outcome: ApprovalOutcome) -> bool {
        let Ok(mut asks) = self.asks.lock() else {
            return false;
        };
        let Some(key) = asks.iter().find(|(_, w)| w.id == id).map(|(k, _)| *k) else {
            return false;
        };
        asks.remove(&key)
            .is_some_and(|w| w.answer.send(outcome).is_ok())
    }
}

/// `GET /api/approvals`.
pub(super) async fn list(State(api): State<Api>) -> Response {
    Json(json!({"approvals": api.approvals.list(), "answering": api.mutations})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Answer {
    outcome: ApprovalOutcome,
}

/// `POST /api/approvals/{id}`.
pub(super) async fn answer(
    State(api): State<Api>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    if let Some(r) = super::agents::read_only(&api) {
        return r;
    }
    let answer: Answer = match super::agents::body(request).await {
        Ok(b) => b,
        Err(r) => return *r,
    };
    if !matches!(
        answer.outcome,
        ApprovalOutcome::AllowedOnce | ApprovalOutcome::Rejected
    ) {
        return error(
            StatusCode::BAD_REQUEST,
            "BAD_OUTCOME",
            "a client answers `allowed-once` or `rejected`",
        );
    }
    if api.approvals.answer(&id, answer.outcome) {
        Json(json!({"id": id, "outcome": answer.outcome.as_str()})).into_response()
    } else {
        error(
            StatusCode::NOT_FOUND,
            "NOT_FOUND",
            format!("no approval `{id}` is waiting (answered, withdrawn or unknown)"),
        )
    }
}
