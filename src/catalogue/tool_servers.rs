//! The `mcp` plugin: one MCP tool server per entry.

use std::sync::Arc;

use dsh_services::sandbox::{Policy, Sandbox};
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::error::chain;
use dsh_supervisors::{BoxError, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

/// Config of the `mcp` plugin: one MCP server, checked where it is read
/// (a field of the wrong transport, a bad name, URL or header is refused
/// with the entry and line named).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(try_from = "dsh_services::mcp::ServerConfig")]
#[schemars(with = "dsh_services::mcp::ServerConfig")]
pub struct McpConfig(pub dsh_services::mcp::ServerConfig);

impl TryFrom<dsh_services::mcp::ServerConfig> for McpConfig {
    type Error = String;

    fn try_from(c: dsh_services::mcp::ServerConfig) -> Result<McpConfig, String> {
        c.spec(Policy::default())
            .map_err(|e| chain(&e).to_string())?;
        Ok(McpConfig(c))
    }
}

/// One MCP server: a supervised actor whose tools are registered, for every
/// agent, as `mcp__<server>__<tool>` while it is up.
pub struct Mcp;

impl Plugin for Mcp {
    type Config = McpConfig;

    fn name(&self) -> &str {
        "mcp"
    }

    fn inject(&self) -> &[&'static str] {
        &[ToolRegistry::SERVICE]
    }

    async fn apply(&self, ctx: Context, config: Arc<McpConfig>) -> Result<(), BoxError> {
        let defaults = ctx
            .get::<Sandbox>(Sandbox::SERVICE)
            .unwrap_or_else(Sandbox::host)
            .defaults();
        let spec = config.0.spec(defaults)?;
        let server = dsh_services::mcp::start(&ctx, spec).await?;
        let status = server.status();
        if status.connections == 0 {
            crate::errln!(
                "dsh: MCP server {} did not connect ({}); it keeps trying",
                status.name,
                status.error.as_deref().unwrap_or("no answer yet")
            );
        }
        // Its status leaves `dsh mcp list` with the entry.
        ctx.effect("mcp server status", move || drop(server))?;
        Ok(())
    }
}
