//! `bash`: one `bash -c` per call, in its own process group, killed as a
//! group on timeout or cancellation; output capped to its tail.

use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::io::AsyncReadExt;

use super::fs::confine;
use crate::llm::ToolSchema;
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};

/// Default and ceiling of a call's timeout.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);
const MAX_TIMEOUT: Duration = Duration::from_secs(600);
/// Output kept (the tail), in bytes.
const OUTPUT_CAP: usize = 30_000;

/// The `bash` tool.
pub struct Bash;

/// What a `bash` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct BashArgs {
    /// The bash command to execute.
    command: String,
    /// What the command does, in 5-10 words.
    // Asked of the model so it says what it runs; the call does not need it.
    #[allow(dead_code)]
    description: String,
    /// Timeout in milliseconds (default 120000, at most 600000).
    #[serde(rename = "timeoutMs", default)]
    timeout_ms: Option<f64>,
    /// Working directory, relative to the workspace.
    #[serde(default)]
    workdir: Option<String>,
}

fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid {
        // The child leads its own group (process_group(0)); signal all of it.
        let _ = nix::sys::signal::killpg(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

fn tail(bytes: &[u8]) -> String {
    if bytes.len() <= OUTPUT_CAP {
        return String::from_utf8_lossy(bytes).into_owned();
    }
    let cut = &bytes[bytes.len() - OUTPUT_CAP..];
    format!(
        "[output truncated: showing the last {OUTPUT_CAP} of {} bytes]\n{}",
        bytes.len(),
        String::from_utf8_lossy(cut)
    )
}

impl Tool for Bash {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "bash".into(),
            description: "Execute a bash command (`bash -c`) in the workspace and return its stdout and stderr. Each call runs in a fresh shell; pass `workdir` instead of using `cd`. Non-zero exits are reported as `[exit code: N]`. Long output is truncated to its tail.".into(),
            parameters: parameters::<BashArgs>(),
        }
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: BashArgs = cx.parse()?;
            let command = args.command;
            let dir = match args.workdir.as_deref() {
                Some(w) if !w.is_empty() => confine(&cx.cwd, w)?,
                _ => confine(&cx.cwd, ".")?,
            };
            let timeout = args
                .timeout_ms
                .filter(|t| *t > 0.0)
                .map(|t| Duration::from_millis(t as u64).min(MAX_TIMEOUT))
                .unwrap_or(DEFAULT_TIMEOUT);
            let mut child = tokio::process::Command::new("bash")
                .arg("-c")
                .arg(&command)
                .current_dir(&dir)
                .env("DSH_WORKSPACE", cx.cwd.as_os_str())
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .process_group(0)
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| ToolError::failed(format!("cannot start bash: {e}")))?;
            let pid = child.id();
            let mut stdout = child.stdout.take();
            let mut stderr = child.stderr.take();
            let collect = async {
                let mut out = Vec::new();
                let mut err = Vec::new();
                let read_out = async {
                    if let Some(s) = stdout.as_mut() {
                        let _ = s.read_to_end(&mut out).await;
                    }
                };
                let read_err = async {
                    if let Some(s) = stderr.as_mut() {
                        let _ = s.read_to_end(&mut err).await;
                    }
                };
                tokio::join!(read_out, read_err);
                let status = child.wait().await;
                (out, err, status)
            };
            let outcome = tokio::select! {
                r = tokio::time::timeout(timeout, collect) => r,
                () = cx.cancel.cancelled() => {
                    kill_group(pid);
                    return Err(ToolError::new("ABORTED", "the command was cancelled and its process group killed"));
                }
            };
            let (out, err, status) = match outcome {
                Ok(v) => v,
                Err(_) => {
                    kill_group(pid);
                    return Err(ToolError::new(
                        "TIMEOUT",
                        format!("the command ran longer than {} ms; its process group was killed", timeout.as_millis()),
                    ));
                }
            };
            let mut combined = out;
            if !err.is_empty() {
                if !combined.is_empty() && !combined.ends_with(b"\n") {
                    combined.push(b'\n');
                }
                combined.extend_from_slice(&err);
            }
            let mut text = tail(&combined);
            let code = status.map_err(|e| ToolError::failed(format!("bash did not exit cleanly: {e}")))?.code();
            match code {
                Some(0) => {}
                Some(c) => text.push_str(&format!("\n[exit code: {c}]")),
                None => text.push_str("\n[killed by a signal]"),
            }
            Ok(ToolOutput::text(text))
        }
        .boxed()
    }
}
