//! One connection to a server: the transport (a sandboxed child process or
//! the streamable HTTP client), watched so that its loss is reported, and
//! the client handler that reports tool-list changes.
//!
//! The watch lives in the transport: the MCP service loop polls `receive`
//! for as long as the connection lasts, so the same poll drains a child's
//! stderr into a bounded tail and notices the end. No task of ours runs
//! beside the loop, and the child process goes with the transport.

use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::OsString;
use std::sync::{Arc, Mutex};

use dsh_supervisors::error::chain;
use rmcp::model::{ClientCapabilities, ClientConfig, Implementation};
use rmcp::service::{
    NotificationContext, RoleClient, RunningService, RxJsonRpcMessage, TxJsonRpcMessage,
};
use rmcp::transport::Transport;
use rmcp::{ClientHandler, ServiceExt};
use tokio::io::AsyncReadExt;

use super::{ServerSpec, Transport as Via};
use crate::sandbox::{Launch, Sandbox, Spawned};

/// What a connection tells its server actor.
pub(super) trait Watcher: Send + Sync + 'static {
    /// The connection ended (`why`: what the process last said, if anything).
    fn lost(&self, why: String);
    /// The server says its tool list changed.
    fn tools_changed(&self);
    /// The server sent a message of `bytes` bytes, over [`MAX_MESSAGE`]:
    /// the transport dropped it.
    fn too_large(&self, bytes: u64);
}

/// The largest message read from a stdio server (the transport's line cap).
pub(crate) const MAX_MESSAGE: usize = rmcp::transport::async_rw::DEFAULT_MAX_LINE_LENGTH;

/// A server's stdout, measured line by line: a line over [`MAX_MESSAGE`]
/// (which the transport drops without a word) is told to the watcher with
/// its length, so the call waiting for it fails at once, saying why.
struct Measured<R> {
    inner: R,
    watcher: Arc<dyn Watcher>,
    /// Bytes of the current line so far.
    line: u64,
}

impl<R: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Measured<R> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if polled.is_ready() {
            let this = &mut *self;
            let mut read = &buf.filled()[before..];
            while let Some(i) = memchr::memchr(b'\n', read) {
                let length = this.line + i as u64;
                if length > MAX_MESSAGE as u64 {
                    this.watcher.too_large(length);
                }
                this.line = 0;
                read = &read[i + 1..];
            }
            this.line += read.len() as u64;
        }
        polled
    }
}

/// The client side of the protocol: says who we are, passes list changes on.
pub(super) struct Handler {
    watcher: Arc<dyn Watcher>,
}

impl ClientHandler for Handler {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.watcher.tools_changed();
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            ClientCapabilities::default(),
            Implementation::new("dsh", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// A live connection.
pub(super) type Connection = RunningService<RoleClient, Handler>;

/// The last bytes a child wrote to stderr.
#[derive(Default)]
pub(super) struct Tail {
    bytes: Vec<u8>,
}

impl Tail {
    const KEEP: usize = 4096;

    fn push(&mut self, chunk: &[u8]) {
        self.bytes.extend_from_slice(chunk);
        if self.bytes.len() > Self::KEEP {
            let cut = self.bytes.len() - Self::KEEP;
            self.bytes.drain(..cut);
        }
    }

    /// The last non-empty line, lossily decoded.
    pub(super) fn last_line(&self) -> Option<String> {
        String::from_utf8_lossy(&self.bytes)
            .lines()
            .rev()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .map(str::to_owned)
    }
}

/// A transport whose end is reported once, and which may own the child
/// process and its stderr.
struct Watched<T> {
    inner: T,
    watcher: Option<Arc<dyn Watcher>>,
    stderr: Option<tokio::process::ChildStderr>,
    tail: Arc<Mutex<Tail>>,
    _child: Option<Spawned>,
}

impl<T> Watched<T> {
    fn report(&mut self) {
        if let Some(w) = self.watcher.take() {
            let why = lock(&self.tail)
                .last_line()
                .unwrap_or_else(|| "the connection closed".to_owned());
            w.lost(why);
        }
    }
}

impl<T: Transport<RoleClient>> Transport<RoleClient> for Watched<T> {
    type Error = T::Error;

    fn name() -> Cow<'static, str> {
        T::name()
    }

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    async fn receive(&mut self) -> Option<RxJsonRpcMessage<RoleClient>> {
        let mut buf = [0u8; 1024];
        loop {
            let Some(stderr) = self.stderr.as_mut() else {
                let got = self.inner.receive().await;
                if got.is_none() {
                    self.report();
                }
                return got;
            };
            tokio::select! {
                got = self.inner.receive() => {
                    if got.is_none() {
                        self.report();
                    }
                    return got;
                }
                n = stderr.read(&mut buf) => match n {
                    Ok(0) | Err(_) => self.stderr = None,
                    Ok(n) => lock(&self.tail).push(&buf[..n]),
                },
            }
        }
    }

    async fn close(&mut self) -> Result<(), Self::Error> {
        // Closed by us: not a loss to report.
        self.watcher = None;
        self.inner.close().await
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Connects to `spec`'s server and completes the handshake; the caller
/// bounds the time. A stdio server starts under `sandbox` with the spec's
/// policy, its environment the secret-free one plus the spec's variables.
pub(super) async fn connect(
    spec: &ServerSpec,
    sandbox: &Sandbox,
    watcher: Arc<dyn Watcher>,
    tail: Arc<Mutex<Tail>>,
) -> Result<Connection, String> {
    let handler = Handler {
        watcher: watcher.clone(),
    };
    match &spec.transport {
        Via::Stdio {
            command,
            args,
            env,
            cwd,
        } => {
            let mut argv: Vec<OsString> = vec![command.into()];
            argv.extend(args.iter().map(OsString::from));
            let mut vars = sandbox.child_env();
            for (k, v) in env {
                vars.retain(|(name, _)| name != k.as_str());
                vars.push((k.into(), v.into()));
            }
            let launch = Launch {
                argv,
                cwd: cwd.clone(),
                workspace: cwd.clone(),
                env: vars,
                stdin: true,
            };
            let mut spawned = sandbox
                .spawn(launch, spec.policy)
                .await
                .map_err(|e| format!("cannot start {command}: {}", chain(&e)))?;
            let stdin = spawned
                .child
                .stdin
                .take()
                .ok_or("the server has no stdin")?;
            let stdout = spawned
                .child
                .stdout
                .take()
                .ok_or("the server has no stdout")?;
            let stderr = spawned.child.stderr.take();
            let stdout = Measured {
                inner: stdout,
                watcher: watcher.clone(),
                line: 0,
            };
            let transport = Watched {
                inner: rmcp::transport::async_rw::AsyncRwTransport::new_client(stdout, stdin),
                watcher: Some(watcher),
                stderr,
                tail: tail.clone(),
                _child: Some(spawned),
            };
            handler.serve(transport).await.map_err(|e| {
                let said = lock(&tail).last_line();
                match said {
                    Some(line) => format!("the handshake failed: {} (stderr: {line})", chain(&e)),
                    None => format!("the handshake failed: {}", chain(&e)),
                }
            })
        }
        Via::Http { url, headers } => {
            use rmcp::transport::streamable_http_client::{
                StreamableHttpClientTransport, StreamableHttpClientTransportConfig,
            };
            let _ = rustls::crypto::ring::default_provider().install_default();
            // No redirects: a server (or anything on the way) could send
            // the entry's headers, tokens included, to another host.
            let client = reqwest::Client::builder()
                .user_agent(concat!("dsh/", env!("CARGO_PKG_VERSION")))
                .connect_timeout(spec.connect_timeout)
                .redirect(reqwest::redirect::Policy::none())
                .pool_max_idle_per_host(0)
                .build()
                .map_err(|e| format!("no HTTP client: {}", chain(&e)))?;
            let mut map = HashMap::new();
            for (k, v) in headers {
                let name = reqwest::header::HeaderName::from_bytes(k.as_bytes())
                    .map_err(|e| format!("header {k:?}: {}", chain(&e)))?;
                let value = reqwest::header::HeaderValue::from_str(v)
                    .map_err(|e| format!("header {k:?}: {}", chain(&e)))?;
                map.insert(name, value);
            }
            let config = StreamableHttpClientTransportConfig::with_uri(url.as_str())
                .custom_headers(map)
                .reinit_on_expired_session(true);
            let transport = Watched {
                inner: StreamableHttpClientTransport::with_client(client, config),
                watcher: Some(watcher),
                stderr: None,
                tail,
                _child: None,
            };
            handler
                .serve(transport)
                .await
                .map_err(|e| format!("the handshake with {url} failed: {}", chain(&e)))
        }
    }
}
