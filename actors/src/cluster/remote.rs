//! `remote`: a subagent on another node.
//!
//! Starting a child places it ([`Placement`]) and asks that node's host to
//! `open` it; the child agent runs there, with that node's tools, model and
//! store. Here the parent's tree holds a proxy agent (no tools) whose model
//! route is [`RemoteChild`]: each model call sends the latest user message
//! as one remote `turn` and answers with how it ended — the final text, or
//! the `report` call that carries a structured result (the proxy's own
//! `report` tool validates it again), or a failure. So result, cancel,
//! dispose and continuable `send` behave as for a local child:
//!
//! - a cancel sends `cancel`, and the call ends once the remote turn has;
//! - disposing the proxy drops its route, which sends `close`: the host
//!   disposes the child, in the order the closes were sent;
//! - a lost node ends the call at once with [`NODE_DOWN`] (never retried),
//!   so the run settles as an error instead of waiting.

use std::sync::Arc;
use std::time::Duration;

use dsh_services::approval::ApprovalPolicy;
use dsh_services::llm::{
    ChunkStream, ContentBlock, FinishReason, LlmAdapter, LlmFailure, LlmRequest, code,
};
use dsh_services::providers::scripted::chunks_for;
use dsh_services::session::{SessionEvent, TurnEndReason};
use dsh_supervisors::error::chain;
use futures::StreamExt as _;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use super::wire::{Notice, OpenChild, Opened, Request, TurnDone, WireError};
use super::{Cluster, NODE_DOWN, Placement, RemoteHost};
use crate::agent::{Agent, AgentSpec};
use crate::subagent::{Capabilities, RemoteLink, StartRequest, SubagentError, SubagentProvider};

/// How long a host may take to create a child.
const OPEN_TIMEOUT: Duration = Duration::from_secs(60);
/// The longest one remote turn may run (a cancel or a lost node ends it
/// sooner).
const TURN_TIMEOUT: Duration = Duration::from_secs(6 * 3600);
/// How long a host may take to dispose a child.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a cancelled turn may take to end on its node.
const CANCEL_GRACE: Duration = Duration::from_secs(30);

/// The `remote` provider: children on the cluster's other nodes.
pub struct RemoteProvider {
    cluster: Arc<Cluster>,
    placement: Placement,
}

impl RemoteProvider {
    /// Children placed by `placement` among `cluster`'s hosts.
    pub fn new(cluster: Arc<Cluster>, placement: Placement) -> RemoteProvider {
        RemoteProvider { cluster, placement }
    }
}

impl SubagentProvider for RemoteProvider {
    fn name(&self) -> &str {
        "remote"
    }
    /// Every feature: the serving node enforces them on the child.
    fn capabilities(&self) -> Capabilities {
        Capabilities::ALL
    }
    fn inherits_parent_context(&self) -> bool {
        false
    }
    fn seed(&self, _parent: &Agent) -> Result<Option<Vec<SessionEvent>>, SubagentError> {
        Ok(None)
    }
    fn remote<'a>(
        &'a self,
        request: &'a StartRequest,
        spec: &'a AgentSpec,
    ) -> BoxFuture<'a, Result<Option<RemoteLink>, SubagentError>> {
        Box::pin(async move {
            let host = self.cluster.place(&self.placement).ok_or_else(|| {
                let known: Vec<String> = self
                    .cluster
                    .hosts()
                    .iter()
                    .map(|h| h.node().to_owned())
                    .collect();
                SubagentError::Start(match &self.placement {
                    Placement::Node(n) => {
                        format!("{NODE_DOWN}: node `{n}` is not connected (known: {known:?})")
                    }
                    _ if known.is_empty() => format!("{NODE_DOWN}: no node serves children"),
                    _ => format!("no node has room for a child (known: {known:?})"),
                })
            })?;
            let parent_spec = request.parent.spec();
            let child = dsh_services::llm::Message::new_id();
            let open = OpenChild {
                child: child.clone(),
                parent_node: self.cluster.name().to_owned(),
                parent: request.parent.id().to_owned(),
                depth: spec.depth,
                label: request.label.clone(),
                persona: request.persona.clone(),
                allow: spec.restriction.as_ref().and_then(|r| r.allow.clone()),
                deny: spec
                    .restriction
                    .as_ref()
                    .map(|r| r.deny.clone())
                    .unwrap_or_default(),
                policy: spec.permission.unwrap_or_default(),
                approval: spec
                    .approval
                    .as_ref()
                    .map_or(ApprovalPolicy::Never, |a| a.policy()),
                output_schema: request.output_schema.clone(),
                route: Some((parent_spec.provider.clone(), parent_spec.model.clone())),
            };
            // Until it is answered, a dropped, cancelled or timed-out open
            // leaves a close behind it (the child may exist over there).
            let pending = Unopened {
                host: &host,
                child: Some(child),
            };
            let asked = Request::Open(Box::new(open));
            let opened: Opened = tokio::select! {
                r = host.call(&asked, OPEN_TIMEOUT) => r,
                () = request.cancel.cancelled() => return Err(SubagentError::Cancelled),
            }
            .map_err(|e| SubagentError::Start(format!("on node `{}`: {e}", host.node())))?;
            if pending.child.as_deref() != Some(opened.child.as_str()) {
                return Err(SubagentError::Start(format!(
                    "node `{}` opened `{}`, not the child asked for",
                    host.node(),
                    opened.child
                )));
            }
            pending.defuse();
            host.opened();
            self.cluster.follow(&host);
            let close = {
                let (host, child) = (host.clone(), opened.child.clone());
                Box::pin(async move {
                    // Answered once the child's subtree is down over there.
                    let close = Request::Close {
                        child: child.clone(),
                    };
                    let r: Result<(), WireError> = host.call(&close, CLOSE_TIMEOUT).await;
                    if let Err(e) = &r
                        && e.code != NODE_DOWN
                    {
                        tracing::warn!("remote: closing a child on `{}`: {e}", host.node());
                    }
                    host.mirror.forget(&child);
                }) as BoxFuture<'static, ()>
            };
            let place = format!(
                "{}/subagent/{}",
                host.node(),
                crate::session::short(&opened.child)
            );
            let placed = {
                let (host, child) = (host.clone(), opened.child.clone());
                Box::new(move |part| host.mirror.placed(&child, part)) as Box<_>
            };
            Ok(Some(RemoteLink {
                node: Some(host.node().to_owned()),
                place: Some(place),
                placed: Some(placed),
                adapter: Arc::new(RemoteChild {
                    host,
                    child: opened.child,
                }),
                close: Some(close),
            }))
        })
    }
}

/// An open not yet answered: dropped before [`Unopened::defuse`], it asks
/// the host to close the child it may have made.
struct Unopened<'a> {
    host: &'a RemoteHost,
    child: Option<String>,
}

impl Unopened<'_> {
    fn defuse(mut self) {
        self.child = None;
    }
}

impl Drop for Unopened<'_> {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            self.host.notify(&Notice::Close { child });
        }
    }
}

/// A child on another node, as the model route of its proxy agent here.
pub struct RemoteChild {
    host: Arc<RemoteHost>,
    child: String,
}

impl RemoteChild {
    /// The node it runs on.
    pub fn node(&self) -> &str {
        self.host.node()
    }

    /// Its session id there.
    pub fn child(&self) -> &str {
        &self.child
    }
}

impl Drop for RemoteChild {
    fn drop(&mut self) {
        // The backstop of the awaited close: the proxy is gone, so is the
        // child (a child already closed is not found, and that is all).
        self.host.mirror.forget(&self.child);
        self.host.notify(&Notice::Close {
            child: std::mem::take(&mut self.child),
        });
    }
}

impl LlmAdapter for RemoteChild {
    fn name(&self) -> &str {
        "remote-child"
    }

    /// One remote turn on the latest user message.
    fn stream(&self, request: LlmRequest, cancel: CancellationToken) -> ChunkStream {
        let host = self.host.clone();
        let child = self.child.clone();
        let prompt = crate::subagent::relayed_prompt(&request);
        let answer = async move {
            let turn = Request::Turn {
                child: child.clone(),
                prompt,
            };
            let call = host.call::<TurnDone>(&turn, TURN_TIMEOUT);
            tokio::pin!(call);
            let done = tokio::select! {
                r = &mut call => r,
                () = cancel.cancelled() => {
                    host.notify(&Notice::Cancel { child });
                    // The remote turn ends aborted; wait for it, boundedly.
                    let _ = tokio::time::timeout(CANCEL_GRACE, &mut call).await;
                    return vec![Err(LlmFailure::new(code::ABORTED, "cancelled"))];
                }
            };
            relay(done, host.node())
        };
        Box::pin(futures::stream::once(answer).flat_map(futures::stream::iter))
    }
}

/// A remote turn's end as this proxy's model output.
fn relay(
    done: Result<TurnDone, WireError>,
    node: &str,
) -> Vec<Result<dsh_services::llm::StreamChunk, LlmFailure>> {
    let fail = |code: &str, message: String| vec![Err(LlmFailure::new(code, message))];
    let done = match done {
        Ok(d) => d,
        Err(e) if e.code == NODE_DOWN => return fail(NODE_DOWN, e.message),
        Err(e) => {
            return fail(
                "SUBAGENT_FAILED",
                format!("on node `{node}`: {}", chain(&e)),
            );
        }
    };
    let finish = match &done.reason {
        TurnEndReason::Completed => FinishReason::Stop,
        TurnEndReason::MaxTokens => FinishReason::MaxTokens,
        TurnEndReason::Aborted { .. } | TurnEndReason::Interrupted => {
            return fail(
                code::ABORTED,
                format!("the turn on node `{node}` was cancelled"),
            );
        }
        TurnEndReason::Blocked => {
            return fail(
                "SUBAGENT_FAILED",
                format!("the turn on node `{node}` was blocked by a policy"),
            );
        }
        TurnEndReason::Error { error } => {
            return fail(
                "SUBAGENT_FAILED",
                format!("on node `{node}`: {}: {}", error.code, error.message),
            );
        }
    };
    let mut blocks = Vec::new();
    if !done.text.is_empty() {
        blocks.push(ContentBlock::text(done.text));
    }
    let finish = match done.structured {
        Some(value) => {
            blocks.push(ContentBlock::ToolCall {
                id: format!("remote-report-{}", dsh_services::llm::Message::new_id()),
                name: crate::subagent::REPORT.into(),
                arguments: value.to_string(),
            });
            FinishReason::ToolCalls
        }
        None => finish,
    };
    chunks_for(&blocks, done.usage, finish)
        .into_iter()
        .map(Ok)
        .collect()
}
