//! The MCP client: tool servers speaking the Model Context Protocol,
//! mounted as tools.
//!
//! - [`ServerSpec`]: one checked server (a stdio command, or a streamable
//!   HTTP URL with headers) and its reconnect budget; [`ServerConfig`] is
//!   the `cordis.yml` shape it is read from.
//! - `server`: each server is a supervised actor under the context that
//!   started it. It connects, lists the server's tools and registers them
//!   (in that context's scope) as `mcp__<server>__<tool>`; when the
//!   connection is lost it reconnects with a doubling delay, and after
//!   `max_attempts` failed attempts in one outage it unregisters them.
//! - `link`: one connection: the child process under the sandbox (its
//!   stderr kept as a bounded tail) or the HTTP transport, watched so that
//!   its loss reaches the actor.
//! - `tool`: a server's tool as a [`crate::tools::Tool`]: the call with the
//!   turn's cancel (dropping it sends `notifications/cancelled`), the
//!   result's blocks mapped in order (text, images into the attachment
//!   store, links and other blocks as text), `isError` as a failed call.
//! - [`McpServers`]: the `mcp` service, every live server's status, for
//!   `dsh mcp list`, the API and duplicate-name checks.
//!
//! Invariants: a tool name is a pure function of (server, tool); a server's
//! tools are registered all or none; a call never runs with more than the
//! calling agent's policy allows (see [`tool`]).

mod link;
mod server;
mod tool;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_supervisors::error::chain;
use serde::{Deserialize, Serialize};

use crate::sandbox::{PermissionMode, Policy};

pub use server::{McpServer, start};

/// How a server is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum TransportKind {
    /// A child process speaking JSON-RPC over its stdin and stdout.
    Stdio,
    /// An HTTP endpoint (MCP's streamable HTTP transport).
    StreamableHttp,
}

/// Reconnect settings.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ReconnectConfig {
    /// Reconnect after a lost connection (default true). Off: the tools
    /// stay registered and fail until the entry is reloaded.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// First delay in milliseconds; doubles per failed attempt (default 500).
    #[serde(default = "default_initial_delay", alias = "initialDelayMs")]
    pub initial_delay_ms: u64,
    /// The delay's ceiling in milliseconds; a connection that lived longer
    /// resets the attempt budget (default 30000).
    #[serde(default = "default_max_delay", alias = "maxDelayMs")]
    pub max_delay_ms: u64,
    /// Failed attempts in one outage before giving up (default 10).
    #[serde(default = "default_max_attempts", alias = "maxAttempts")]
    pub max_attempts: u32,
}

impl Default for ReconnectConfig {
    fn default() -> Self {
        ReconnectConfig {
            enabled: true,
            initial_delay_ms: default_initial_delay(),
            max_delay_ms: default_max_delay(),
            max_attempts: default_max_attempts(),
        }
    }
}

fn yes() -> bool {
    true
}
fn default_initial_delay() -> u64 {
    500
}
fn default_max_delay() -> u64 {
    30_000
}
fn default_max_attempts() -> u32 {
    10
}
fn default_call_timeout() -> u64 {
    60_000
}
fn default_connect_timeout() -> u64 {
    30_000
}

/// Config of one MCP server (the `mcp` plugin's entry). Upstream's
/// camelCase names are accepted too.
#[derive(Clone, Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ServerConfig {
    /// The namespace of its tools: `[A-Za-z0-9_-]{1,32}`, unique among
    /// live servers of one scope.
    #[serde(alias = "serverName")]
    pub server_name: String,
    /// `stdio` or `streamable-http`.
    pub transport: TransportKind,
    /// stdio: the program to start.
    #[serde(default)]
    pub command: Option<String>,
    /// stdio: its arguments.
    #[serde(default)]
    pub args: Vec<String>,
    /// stdio: variables set on top of the secret-free environment.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// stdio: its working directory (default: the process's).
    #[serde(default)]
    pub cwd: Option<PathBuf>,
    /// The mode the server's tools act with (default: the deployment's); a
    /// stdio server's process is confined to it. An agent with a narrower
    /// mode may call only the tools the server marks read-only.
    #[serde(default)]
    pub permission_mode: Option<PermissionMode>,
    /// streamable-http: the endpoint.
    #[serde(default)]
    pub url: Option<String>,
    /// streamable-http: headers sent with every request.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// streamable-http: headers whose value is read from an environment
    /// variable (`Authorization: MCP_TOKEN` sends `$MCP_TOKEN`); the
    /// variable is then kept from every tool process, as API keys are.
    /// A value needing a prefix names it: `Authorization: "Bearer $MCP_TOKEN"`.
    #[serde(default, alias = "headersFromEnv")]
    pub headers_from_env: BTreeMap<String, String>,
    /// Longest one tool call may take, in milliseconds (default 60000).
    #[serde(default = "default_call_timeout", alias = "toolCallTimeoutMs")]
    pub tool_call_timeout_ms: u64,
    /// Longest a connection and its tool listing may take, in milliseconds
    /// (default 30000).
    #[serde(default = "default_connect_timeout", alias = "connectTimeoutMs")]
    pub connect_timeout_ms: u64,
    /// Fail the entry when the first connection fails (default false: the
    /// entry starts without tools and keeps trying).
    #[serde(default, alias = "failOnStartupError")]
    pub fail_on_startup_error: bool,
    /// Reconnect settings.
    #[serde(default)]
    pub reconnect: ReconnectConfig,
}

/// How a checked server is reached.
#[derive(Clone, Debug)]
pub enum Transport {
    /// A child process.
    Stdio {
        /// Program.
        command: String,
        /// Arguments.
        args: Vec<String>,
        /// Extra environment.
        env: Vec<(String, String)>,
        /// Working directory (and workspace of a confined process).
        cwd: PathBuf,
    },
    /// An HTTP endpoint.
    Http {
        /// The URL.
        url: String,
        /// Headers for every request.
        headers: Vec<(String, String)>,
    },
}

impl TransportKind {
    /// `stdio` or `streamable-http`.
    pub fn as_str(self) -> &'static str {
        match self {
            TransportKind::Stdio => "stdio",
            TransportKind::StreamableHttp => "streamable-http",
        }
    }
}

impl Transport {
    /// `stdio` or `streamable-http`.
    pub fn kind(&self) -> TransportKind {
        match self {
            Transport::Stdio { .. } => TransportKind::Stdio,
            Transport::Http { .. } => TransportKind::StreamableHttp,
        }
    }
}

/// A checked server: what to connect to, under which policy, with which
/// budgets.
#[derive(Clone, Debug)]
pub struct ServerSpec {
    /// The namespace of its tools.
    pub name: String,
    /// How it is reached.
    pub transport: Transport,
    /// What a stdio server's process may do; for an HTTP server the
    /// network it needs.
    pub policy: Policy,
    /// Longest one call may take.
    pub call_timeout: Duration,
    /// Longest a connection and its listing may take.
    pub connect_timeout: Duration,
    /// Whether a failed first connection fails the start.
    pub fail_on_startup_error: bool,
    /// Reconnect settings.
    pub reconnect: ReconnectConfig,
}

/// Why an MCP server was refused: its config, or its start.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum McpError {
    /// A field is wrong: which, and why.
    #[error("{0}")]
    Config(String),
    /// A live server of the same scope has this name.
    #[error("an MCP server named {0:?} is already running here")]
    Taken(String),
    /// It could not be started, or did not connect when it had to.
    #[error("MCP server {name}: {why}")]
    Start {
        /// The server.
        name: String,
        /// What went wrong.
        why: String,
    },
}

impl ServerSpec {
    /// A server reached by `transport` under `policy`, with the defaults an
    /// entry gets when it names none (60 s a call, 30 s to connect, the
    /// default reconnect budget, no failing at start).
    pub fn new(name: String, transport: Transport, policy: Policy) -> ServerSpec {
        ServerSpec {
            name,
            transport,
            policy,
            call_timeout: Duration::from_millis(default_call_timeout()),
            connect_timeout: Duration::from_millis(default_connect_timeout()),
            fail_on_startup_error: false,
            reconnect: ReconnectConfig::default(),
        }
    }
}

/// Checks a server name: `[A-Za-z0-9_-]{1,32}` without `__`.
pub fn check_name(name: &str) -> Result<(), McpError> {
    let ok = !name.is_empty()
        && name.len() <= 32
        && !name.contains("__")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        // `__` separates the name from the tool's: `a__b` + `c` would name
        // the same tool as `a` + `b__c`.
        Err(McpError::Config(format!(
            "server_name {name:?} must be 1 to 32 of A-Z a-z 0-9 _ -, without `__`"
        )))
    }
}

/// Checks that `url` is an absolute http(s) URL.
pub fn check_url(url: &str) -> Result<(), McpError> {
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") && u.host().is_some() => Ok(()),
        Ok(u) => Err(McpError::Config(format!(
            "url {url:?} must be http or https with a host (scheme {:?})",
            u.scheme()
        ))),
        Err(e) => Err(McpError::Config(format!(
            "url {url:?} is not a URL: {}",
            chain(&e)
        ))),
    }
}

/// Checks header names and values as HTTP defines them.
pub fn check_headers(headers: &[(String, String)]) -> Result<(), McpError> {
    for (k, v) in headers {
        reqwest::header::HeaderName::from_bytes(k.as_bytes()).map_err(|_| {
            McpError::Config(format!("header name {k:?} is not a valid HTTP header name"))
        })?;
        reqwest::header::HeaderValue::from_str(v).map_err(|_| {
            McpError::Config(format!(
                "the value of header {k:?} is not a valid HTTP header value"
            ))
        })?;
    }
    Ok(())
}

/// The value of header `name` from `spec`: `VAR`, or text with one
/// `$VAR` in it (`Bearer $VAR`). The variable must be set; it becomes a
/// secret no child process sees.
fn header_from_env(name: &str, spec: &str) -> Result<String, String> {
    let (before, var, after) = match spec.split_once('$') {
        Some((before, rest)) => {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            (before, &rest[..end], &rest[end..])
        }
        None => ("", spec, ""),
    };
    let valid = !var.is_empty() && var.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
    if !valid {
        return Err(format!(
            "headers_from_env.{name}: {spec:?} names no variable (VAR, or text with $VAR)"
        ));
    }
    let value = std::env::var(var)
        .map_err(|_| format!("headers_from_env.{name}: the variable {var} is not set"))?;
    crate::sandbox::env::register_secret(var);
    Ok(format!("{before}{value}{after}"))
}

impl ServerConfig {
    /// The checked server, confined by `defaults` unless the entry names a
    /// mode; every field that does not belong to the transport is refused.
    pub fn spec(&self, defaults: Policy) -> Result<ServerSpec, McpError> {
        self.checked(defaults).map_err(McpError::Config)
    }

    fn checked(&self, defaults: Policy) -> Result<ServerSpec, String> {
        check_name(&self.server_name).map_err(|e| chain(&e).to_string())?;
        let transport = match self.transport {
            TransportKind::Stdio => {
                if self.url.is_some()
                    || !self.headers.is_empty()
                    || !self.headers_from_env.is_empty()
                {
                    return Err(
                        "url, headers and headers_from_env belong to transport streamable-http"
                            .into(),
                    );
                }
                let command = self
                    .command
                    .clone()
                    .filter(|c| !c.is_empty())
                    .ok_or("transport stdio needs a command")?;
                // Absolute: the sandbox binds it by path, and a relative
                // one would mean different places to the kernel and to it.
                let here = std::env::current_dir()
                    .map_err(|e| format!("no working directory for the server: {}", chain(&e)))?;
                let cwd = match &self.cwd {
                    Some(c) => here.join(c),
                    None => here,
                };
                let cwd = cwd
                    .canonicalize()
                    .map_err(|e| format!("cwd {} is not a directory here: {e}", cwd.display()))?;
                Transport::Stdio {
                    command,
                    args: self.args.clone(),
                    env: self.env.clone().into_iter().collect(),
                    cwd,
                }
            }
            TransportKind::StreamableHttp => {
                if self.command.is_some()
                    || !self.args.is_empty()
                    || !self.env.is_empty()
                    || self.cwd.is_some()
                {
                    return Err("command, args, env and cwd belong to transport stdio".into());
                }
                let url = self
                    .url
                    .clone()
                    .ok_or("transport streamable-http needs a url")?;
                check_url(&url).map_err(|e| chain(&e).to_string())?;
                let mut headers: Vec<(String, String)> = self.headers.clone().into_iter().collect();
                for (name, from) in &self.headers_from_env {
                    headers.push((name.clone(), header_from_env(name, from)?));
                }
                check_headers(&headers).map_err(|e| chain(&e).to_string())?;
                Transport::Http { url, headers }
            }
        };
        if self.tool_call_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return Err("tool_call_timeout_ms and connect_timeout_ms must be positive".into());
        }
        if self.reconnect.initial_delay_ms == 0 || self.reconnect.max_attempts == 0 {
            return Err(
                "reconnect.initial_delay_ms and reconnect.max_attempts must be positive".into(),
            );
        }
        let policy = Policy {
            mode: self.permission_mode.unwrap_or(defaults.mode),
            network: defaults.network,
        };
        Ok(ServerSpec {
            name: self.server_name.clone(),
            transport,
            policy,
            call_timeout: Duration::from_millis(self.tool_call_timeout_ms),
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            fail_on_startup_error: self.fail_on_startup_error,
            reconnect: self.reconnect.clone(),
        })
    }
}

/// The model-facing name of `raw` on `server`: `mcp__<server>__<raw>`,
/// or, when that is not 1 to 64 of `[A-Za-z0-9_-]`, the name with every
/// other character replaced, cut, and a 12-hex hash of (server, raw)
/// appended, so distinct tools never share a name.
pub fn public_name(server: &str, raw: &str) -> String {
    let wanted = format!("mcp__{server}__{raw}");
    let clean: String = wanted
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if clean == wanted && wanted.len() <= 64 {
        return wanted;
    }
    let mut input = server.as_bytes().to_vec();
    input.push(0);
    input.extend_from_slice(raw.as_bytes());
    let digest = ring::digest::digest(&ring::digest::SHA256, &input);
    let hash: String = digest.as_ref()[..6]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    // `clean` is ASCII: any cut is a character boundary.
    let keep = clean.len().min(64 - 1 - hash.len());
    format!("{}_{hash}", &clean[..keep])
}

/// Where a server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum State {
    /// The first connection is being made.
    Connecting,
    /// Connected; its tools are registered.
    Up,
    /// Lost; waiting to try again (its last tools stay registered and fail).
    Reconnecting,
    /// Lost with reconnecting off: its tools stay registered and fail.
    Down,
    /// Gave up after the attempt budget: its tools are unregistered.
    Failed,
    /// Stopped with its owner.
    Stopped,
}

impl State {
    /// The kebab-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            State::Connecting => "connecting",
            State::Up => "up",
            State::Reconnecting => "reconnecting",
            State::Down => "down",
            State::Failed => "failed",
            State::Stopped => "stopped",
        }
    }
}

/// One tool a server lists.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ToolInfo {
    /// The name the model sees.
    pub name: String,
    /// The name on the wire.
    pub raw: String,
}

/// A server's status as `dsh mcp list` and the API show it.
#[derive(Clone, Debug, Serialize)]
pub struct ServerStatus {
    /// Its name.
    pub name: String,
    /// `stdio` or `streamable-http`.
    pub transport: TransportKind,
    /// The scope its tools are visible in (`None`: everywhere).
    pub scope: Option<String>,
    /// Its state.
    pub state: State,
    /// Its registered tools.
    pub tools: Vec<ToolInfo>,
    /// Connections made so far (a reconnect adds one).
    pub connections: u32,
    /// Failed attempts counted against the reconnect budget.
    pub attempts: u32,
    /// Calls sent and not yet answered.
    pub in_flight: u32,
    /// What went wrong last, if anything.
    pub error: Option<String>,
}

/// The `mcp` service: the status of every live server.
#[derive(Default)]
pub struct McpServers {
    servers: Mutex<Vec<Arc<server::Shared>>>,
}

impl McpServers {
    /// The capability name.
    pub const SERVICE: &'static str = "mcp";

    /// An empty set.
    pub fn new() -> McpServers {
        McpServers::default()
    }

    /// Every live server's status, in start order.
    pub fn list(&self) -> Vec<ServerStatus> {
        self.lock().iter().map(|s| s.status()).collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<server::Shared>>> {
        self.servers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds `shared` unless a live server of the same scope has its name.
    fn admit(&self, shared: Arc<server::Shared>) -> Result<(), McpError> {
        let mut all = self.lock();
        if all
            .iter()
            .any(|s| s.spec.name == shared.spec.name && s.scope == shared.scope)
        {
            return Err(McpError::Taken(shared.spec.name.clone()));
        }
        all.push(shared);
        Ok(())
    }

    fn remove(&self, shared: &Arc<server::Shared>) {
        self.lock().retain(|s| !Arc::ptr_eq(s, shared));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_header_from_the_environment_is_read_and_kept_from_children() {
        // HOME is set wherever tests run; registering it as a secret here
        // touches only this test's process.
        let c: ServerConfig = serde_json::from_value(serde_json::json!({
            "server_name": "e", "transport": "streamable-http", "url": "http://h/",
            "headers_from_env": {"Authorization": "Bearer $HOME"}
        }))
        .unwrap();
        let spec = c.spec(Policy::default()).unwrap();
        let Transport::Http { headers, .. } = spec.transport else {
            panic!("an HTTP server");
        };
        let home = std::env::var("HOME").unwrap();
        assert_eq!(
            headers,
            vec![("Authorization".to_owned(), format!("Bearer {home}"))]
        );
        assert!(crate::sandbox::env::is_secret("HOME"));
    }

    #[test]
    fn names_are_qualified_and_normalized_deterministically() {
        assert_eq!(public_name("fs", "read_file"), "mcp__fs__read_file");
        let odd = public_name("fs", "read file.v2");
        assert!(odd.starts_with("mcp__fs__read_file_v2_"), "{odd}");
        assert_eq!(odd, public_name("fs", "read file.v2"));
        // Two raw names that normalize alike stay apart.
        assert_ne!(public_name("fs", "a.b"), public_name("fs", "a:b"));
        let long = public_name("server", &"x".repeat(100));
        assert_eq!(long.len(), 64);
        assert!(
            long.bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        );
        assert_ne!(long, public_name("server", &"x".repeat(101)));
    }

    #[test]
    fn a_config_is_checked_for_its_transport() {
        let parse = |yaml: serde_json::Value| -> Result<ServerSpec, String> {
            let c: ServerConfig =
                serde_json::from_value(yaml).map_err(|e| chain(&e).to_string())?;
            c.spec(Policy::default()).map_err(|e| chain(&e).to_string())
        };
        let ok =
            parse(serde_json::json!({"server_name": "e", "transport": "stdio", "command": "node"}));
        assert!(ok.is_ok(), "{ok:?}");
        let camel = parse(
            serde_json::json!({"serverName": "e", "transport": "streamable-http", "url": "http://127.0.0.1:1/mcp", "toolCallTimeoutMs": 5}),
        );
        assert!(camel.is_ok(), "{camel:?}");
        for (bad, says) in [
            (
                serde_json::json!({"server_name": "a b", "transport": "stdio", "command": "x"}),
                "server_name",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "stdio"}),
                "needs a command",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "stdio", "command": "x", "url": "http://h/"}),
                "belong to transport streamable-http",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "streamable-http"}),
                "needs a url",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "streamable-http", "url": "file:///etc/passwd"}),
                "http or https",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "streamable-http", "url": "http://h/", "headers": {"Bad Name": "x"}}),
                "header name",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "streamable-http", "url": "http://h/", "headers": {"X": "a\nb"}}),
                "header value",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "streamable-http", "url": "http://h/", "command": "x"}),
                "belong to transport stdio",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "pipe", "command": "x"}),
                "unknown variant",
            ),
            (
                serde_json::json!({"server_name": "a__b", "transport": "stdio", "command": "x"}),
                "without `__`",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "stdio", "command": "x", "cwd": "/no/such/dir"}),
                "not a directory",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "streamable-http", "url": "http://h/", "headers_from_env": {"X": "DSH_TEST_SURELY_UNSET_VARIABLE"}}),
                "is not set",
            ),
            (
                serde_json::json!({"server_name": "e", "transport": "streamable-http", "url": "http://h/", "headers_from_env": {"X": "Bearer $"}}),
                "names no variable",
            ),
        ] {
            let e = parse(bad.clone()).expect_err(&bad.to_string());
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
