//! A server's tool as one of ours.
//!
//! A call acts with the server's powers, not the calling agent's, so it is
//! admitted against the agent's policy first: an agent without network may
//! not call a server that has it (every HTTP server has); an agent with
//! a narrower mode than the server's, or a workspace that does not hold
//! the (writing, stdio) server's, may call only the tools the server marks
//! read-only (`readOnlyHint`). The call is sent under the raw name;
//! dropping it (the turn cancelled, the timeout) sends
//! `notifications/cancelled`. Result blocks keep their order: text runs
//! join with newlines, images go to the attachment store, resource links
//! and other blocks become text saying what they were.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use base64::Engine;
use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;
use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::ServiceError;
use serde_json::{Value, json};

use super::Transport;
use crate::attachments::Attachments;
use crate::llm::{ContentBlock, ToolSchema};
use crate::sandbox::{PermissionMode, Policy};
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput};

/// The longest tool description kept, in characters.
const MAX_DESCRIPTION: usize = 4096;

/// The largest input schema a tool may have, in bytes of JSON.
const MAX_SCHEMA_BYTES: usize = 64 * 1024;

/// What a tool needs of its server, which hands it this narrow handle: the
/// entry, the live connection, and where calls are counted and told.
pub(crate) trait Server: Send + Sync + 'static {
    /// The server's entry.
    fn spec(&self) -> &super::ServerSpec;
    /// The live connection and its number, or why there is none.
    fn peer(&self) -> Result<(rmcp::Peer<rmcp::RoleClient>, u32), String>;
    /// Connection `number` was lost during a call.
    fn call_lost(&self, number: u32, why: String);
    /// Calls sent and not yet answered.
    fn in_flight(&self) -> &std::sync::atomic::AtomicU32;
    /// The size of the last message over the transport's cap, changed
    /// each time one arrives.
    fn too_large(&self) -> tokio::sync::watch::Receiver<u64>;
}

/// One tool of one server.
pub(crate) struct McpTool {
    server: Arc<dyn Server>,
    raw: String,
    public: String,
    description: String,
    parameters: Value,
    read_only: bool,
}

impl McpTool {
    /// The tool `t` of `server`; refused when its schema is larger than
    /// [`MAX_SCHEMA_BYTES`] (it would ride every request). A description
    /// past [`MAX_DESCRIPTION`] characters is cut.
    pub(crate) fn new(server: Arc<dyn Server>, t: &rmcp::model::Tool) -> Result<McpTool, String> {
        let raw = t.name.to_string();
        let public = super::public_name(&server.spec().name, &raw);
        let mut description = t
            .description
            .as_deref()
            .map(str::to_owned)
            .or_else(|| t.title.clone())
            .unwrap_or_else(|| format!("Tool {raw} of MCP server {}.", server.spec().name));
        if let Some((cut, _)) = description.char_indices().nth(MAX_DESCRIPTION) {
            description.truncate(cut);
            description.push('…');
        }
        let size = serde_json::to_string(&*t.input_schema).map_or(0, |s| s.len());
        if size > MAX_SCHEMA_BYTES {
            return Err(format!(
                "the input schema of its tool {raw:?} is {size} bytes, more than {MAX_SCHEMA_BYTES}"
            ));
        }
        let mut parameters = Value::Object((*t.input_schema).clone());
        if let Some(map) = parameters.as_object_mut() {
            map.entry("type").or_insert_with(|| json!("object"));
            map.entry("properties").or_insert_with(|| json!({}));
        }
        if let Err(e) = jsonschema::validator_for(&parameters) {
            tracing::warn!(
                "MCP server {}: the input schema of {raw} does not compile ({e}); its arguments go unchecked",
                server.spec().name
            );
            parameters = json!({"type": "object", "properties": {}});
        }
        let read_only = t
            .annotations
            .as_ref()
            .and_then(|a| a.read_only_hint)
            .unwrap_or(false);
        Ok(McpTool {
            server,
            raw,
            public,
            description,
            parameters,
            read_only,
        })
    }

    pub(crate) fn public_name(&self) -> &str {
        &self.public
    }

    pub(crate) fn raw(&self) -> &str {
        &self.raw
    }

    /// Whether `other` is the same definition (name, text, schema, hints).
    pub(crate) fn same_as(&self, other: &McpTool) -> bool {
        self.raw == other.raw
            && self.description == other.description
            && self.parameters == other.parameters
            && self.read_only == other.read_only
    }

    /// Refuses a call the agent's `policy` (in `workspace`) does not cover.
    fn admit(&self, policy: Policy, workspace: &std::path::Path) -> Result<(), ToolError> {
        let spec = self.server.spec();
        let networked = matches!(spec.transport, Transport::Http { .. }) || spec.policy.network;
        if networked && !policy.network {
            return Err(ToolError::new(
                "DENIED",
                format!(
                    "MCP server {} reaches the network and this agent may not",
                    spec.name
                ),
            ));
        }
        // A writing server must write inside the caller's workspace: one
        // rooted above it (or elsewhere) would let the agent write where
        // it may not.
        if let Transport::Stdio { cwd, .. } = &spec.transport
            && spec.policy.mode == PermissionMode::WorkspaceWrite
            && policy.mode == PermissionMode::WorkspaceWrite
            && !self.read_only
            && !cwd.starts_with(workspace)
        {
            return Err(ToolError::new(
                "DENIED",
                format!(
                    "MCP server {} writes under {}, outside this agent's workspace {}; only the tools it marks read-only are open here",
                    spec.name,
                    cwd.display(),
                    workspace.display()
                ),
            ));
        }
        if policy.mode < spec.policy.mode && !self.read_only {
            return Err(ToolError::new(
                "DENIED",
                format!(
                    "MCP server {} acts with {}, more than this agent's {}; only the tools it marks read-only are open here",
                    spec.name,
                    spec.policy.mode.as_str(),
                    policy.mode.as_str()
                ),
            ));
        }
        Ok(())
    }

    fn failure(&self, e: ServiceError, number: u32) -> ToolError {
        let name = &self.server.spec().name;
        match e {
            ServiceError::McpError(e) => ToolError::new(
                "MCP_ERROR",
                format!("MCP server {name}: {} (code {})", e.message, e.code.0),
            ),
            ServiceError::TransportClosed | ServiceError::TransportSend(_) => {
                let why = format!("the connection to MCP server {name} was lost during the call");
                self.server.call_lost(number, chain(&e).to_string());
                ToolError::new("UNAVAILABLE", why)
            }
            ServiceError::Timeout { timeout } => ToolError::new(
                "TIMEOUT",
                format!("MCP server {name} did not answer within {timeout:?}"),
            ),
            other => ToolError::failed(format!("MCP server {name}: {other}")),
        }
    }

    /// The call's result as our blocks.
    async fn output(
        &self,
        result: CallToolResult,
        cx: &ToolContext,
    ) -> Result<ToolOutput, ToolError> {
        let blocks: Vec<Value> = serde_json::to_value(&result.content)
            .ok()
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default();
        let store = cx.ctx.get::<Attachments>(Attachments::SERVICE);
        let mut content: Vec<ContentBlock> = Vec::new();
        for b in &blocks {
            let block = match b["type"].as_str().unwrap_or("") {
                "text" => ContentBlock::text(b["text"].as_str().unwrap_or("")),
                "image" => image(b, store.clone()).await,
                "resource_link" => ContentBlock::text(format!(
                    "[resource link] {}: {}",
                    b["name"].as_str().unwrap_or("(unnamed)"),
                    b["uri"].as_str().unwrap_or("")
                )),
                "resource" => resource(&b["resource"]),
                "audio" => ContentBlock::text(format!(
                    "[audio ({}): not shown]",
                    b["mimeType"].as_str().unwrap_or("unknown type")
                )),
                other => ContentBlock::text(format!("[{other} block: not shown]")),
            };
            push(&mut content, block);
        }
        if content.is_empty()
            && let Some(structured) = &result.structured_content
        {
            content.push(ContentBlock::text(structured.to_string()));
        }
        if result.is_error == Some(true) {
            let text = crate::llm::joined_text(&content, "\n");
            let text = if text.is_empty() {
                "the tool reported an error".to_owned()
            } else {
                text
            };
            return Err(ToolError::new("TOOL_ERROR", text));
        }
        if content.is_empty() {
            content.push(ContentBlock::text(""));
        }
        let mut mcp = json!({"server": self.server.spec().name, "tool": self.raw});
        if let Some(s) = result.structured_content {
            mcp["structuredContent"] = s;
        }
        Ok(ToolOutput {
            content,
            meta: Some(json!({ "mcp": mcp })),
        })
    }
}

/// One call counted in flight until it is answered or dropped.
struct InFlight<'a>(&'a dyn Server);

impl<'a> InFlight<'a> {
    fn enter(server: &'a dyn Server) -> InFlight<'a> {
        server.in_flight().fetch_add(1, Ordering::AcqRel);
        InFlight(server)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight().fetch_sub(1, Ordering::AcqRel);
    }
}

/// Appends `block`, joining a text run with a newline.
fn push(content: &mut Vec<ContentBlock>, block: ContentBlock) {
    if let ContentBlock::Text { text: next } = &block
        && let Some(ContentBlock::Text { text }) = content.last_mut()
    {
        text.push('\n');
        text.push_str(next);
        return;
    }
    content.push(block);
}

/// An image block, kept in the attachment store; text saying why not when
/// it cannot be.
async fn image(b: &Value, store: Option<Arc<Attachments>>) -> ContentBlock {
    let mime = b["mimeType"].as_str().unwrap_or("unknown type").to_owned();
    let not_shown = |why: String| ContentBlock::text(format!("[image ({mime}): not shown: {why}]"));
    let Some(store) = store else {
        return not_shown("no attachment store here".into());
    };
    let bytes =
        match base64::engine::general_purpose::STANDARD.decode(b["data"].as_str().unwrap_or("")) {
            Ok(bytes) => bytes,
            Err(e) => return not_shown(format!("its data is not base64 ({})", chain(&e))),
        };
    match tokio::task::spawn_blocking(move || store.put(&bytes, None)).await {
        Ok(Ok(fields)) => ContentBlock::Image { fields },
        Ok(Err(e)) => not_shown(chain(&e).to_string()),
        Err(e) => not_shown(format!("it could not be kept ({})", chain(&e))),
    }
}

/// An embedded resource: its text when it has text, else what it was.
fn resource(r: &Value) -> ContentBlock {
    let uri = r["uri"].as_str().unwrap_or("");
    match r["text"].as_str() {
        Some(text) => ContentBlock::text(format!("[resource {uri}]\n{text}")),
        None => ContentBlock::text(format!(
            "[resource {uri} ({}): binary, not shown]",
            r["mimeType"].as_str().unwrap_or("unknown type")
        )),
    }
}

impl Tool for McpTool {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: self.public.clone(),
            description: self.description.clone(),
            parameters: self.parameters.clone(),
        }
    }

    fn timeout(&self) -> Option<Duration> {
        Some(self.server.spec().call_timeout)
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            self.admit(cx.policy, &cx.cwd)?;
            let (peer, number) = self
                .server
                .peer()
                .map_err(|e| ToolError::new("UNAVAILABLE", e))?;
            let mut params = CallToolRequestParams::new(self.raw.clone());
            match &cx.args {
                Value::Object(map) => params = params.with_arguments(map.clone()),
                Value::Null => {}
                other => {
                    return Err(ToolError::new(
                        "INVALID_ARGS",
                        format!("arguments must be an object, not {other}"),
                    ));
                }
            }
            let _counted = InFlight::enter(&*self.server);
            // A message over the cap is dropped by the transport, unread:
            // which call it answered is unknown, so every call then in
            // flight on this server fails, saying why, instead of waiting
            // out its timeout.
            let mut too_large = self.server.too_large();
            too_large.mark_unchanged();
            let result = tokio::select! {
                r = peer.call_tool(params) => r.map_err(|e| self.failure(e, number))?,
                Ok(()) = too_large.changed() => {
                    let bytes = *too_large.borrow();
                    return Err(ToolError::new(
                        "TOO_LARGE",
                        format!(
                            "MCP server {} sent a message of {bytes} bytes, over the {} bytes a message may have; it was dropped",
                            self.server.spec().name,
                            super::link::MAX_MESSAGE
                        ),
                    ));
                }
            };
            self.output(result, &cx).await
        }
        .boxed()
    }
}
