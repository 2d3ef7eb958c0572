//! `bash`: one `bash -c` per call, confined by the sandbox under the
//! call's policy, in its own process group, killed as a group on timeout or
//! cancellation; output capped to its tail. The command sees this process's
//! environment without its secrets. A failed command whose output shows a
//! sandbox denial gets a note saying so and how to ask for escalation.

use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::io::AsyncReadExt;

use super::workspace::{ESCALATE, confine};
use crate::jobs::{JobStatus, Jobs, run_job};
use crate::llm::ToolSchema;
use crate::sandbox::{Backend, Launch, PermissionMode, Sandbox};
use crate::session::{SESSION_SERVICE, SessionWriter};
use crate::tools::{Escalation, Tool, ToolContext, ToolError, ToolOutput, parameters};

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
    /// Run in the background and return a job id at once (read its output
    /// with job_output, stop it with job_kill; no timeout applies).
    #[serde(default)]
    run_in_background: Option<bool>,
    // Read by the pipeline, before the body runs.
    #[allow(dead_code)]
    #[serde(flatten)]
    escalation: Escalation,
}

/// Starts `launch` as a background job of the calling agent: admitted
/// first (the per-agent cap), then spawned under the same sandbox, then
/// run by a supervised worker under the agent's scope.
async fn background(
    cx: &ToolContext,
    sandbox: Arc<Sandbox>,
    launch: Launch,
    command: &str,
    marker: String,
) -> Result<ToolOutput, ToolError> {
    let jobs = cx.ctx.get::<Jobs>(Jobs::SERVICE).ok_or_else(|| {
        ToolError::new(
            "NO_JOBS",
            "background jobs are not available here; run the command without run_in_background",
        )
    })?;
    let owner = cx
        .ctx
        .get::<dyn SessionWriter>(SESSION_SERVICE)
        .map(|s| s.session_id());
    let job = jobs
        .admit("bash", command, owner)
        .map_err(|e| ToolError::new(e.code(), chain(&e).to_string()))?;
    let spawned = match sandbox.spawn(launch, cx.policy).await {
        Ok(s) => s,
        Err(e) => {
            job.settle(JobStatus::Failed, Some(chain(&e).to_string()));
            return Err(ToolError::new(e.code(), chain(&e).to_string()));
        }
    };
    run_job(&cx.ctx, &jobs, job.clone(), spawned, Some(marker))
        .await
        .map_err(|e| ToolError::failed(format!("the job could not start: {}", chain(&e))))?;
    let text = format!(
        "started background job {id}: {label}\nYou are told when it finishes; read its output with job_output (job_id: \"{id}\") and stop it with job_kill.",
        id = job.id,
        label = job.label
    );
    Ok(ToolOutput {
        content: vec![crate::llm::ContentBlock::text(text)],
        meta: serde_json::to_value(job.snapshot())
            .ok()
            .map(|j| serde_json::json!({ "job": j })),
    })
}

/// How the command's wait ended.
enum Ended {
    Exited(std::io::Result<std::process::ExitStatus>),
    TimedOut,
    Cancelled,
}

/// How long the pipes may take to close once everything is killed.
const DRAIN: Duration = Duration::from_secs(5);

/// stdout, then stderr after a `[stderr]` line of its own.
fn joined(out: &[u8], err: &[u8]) -> Vec<u8> {
    let mut combined = out.to_vec();
    if !err.is_empty() {
        if !combined.is_empty() && !combined.ends_with(b"\n") {
            combined.push(b'\n');
        }
        combined.extend_from_slice(b"[stderr]\n");
        combined.extend_from_slice(err);
    }
    combined
}

/// The variable every process of one call carries (`DSH_CALL=<id>`):
/// descendants that leave the process group still inherit it.
fn marker() -> String {
    format!("DSH_CALL={}", uuid::Uuid::new_v4().simple())
}

/// Writes the whole output of a call whose result shows only its tail to
/// a file beside the background jobs' (private, removed when dsh exits);
/// where, when it could.
async fn spill(cx: &ToolContext, bytes: &[u8]) -> Option<std::path::PathBuf> {
    use tokio::io::AsyncWriteExt;
    let jobs = cx.ctx.get::<Jobs>(Jobs::SERVICE)?;
    let dir = jobs.spill_dir().to_path_buf();
    let safe: String = cx
        .call_id
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    let path = dir.join(format!("call-{safe}-{}.log", uuid::Uuid::new_v4().simple()));
    let mut builder = tokio::fs::DirBuilder::new();
    builder.recursive(true).mode(0o700);
    builder.create(&dir).await.ok()?;
    let mut f = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .await
        .ok()?;
    f.write_all(bytes).await.ok()?;
    f.flush().await.ok()?;
    Some(path)
}

/// Bytes of each stream kept in memory at most (its end): a command that
/// prints without end cannot grow this process without end.
const KEPT: usize = 4 * 1024 * 1024;

/// Reads `r` to its end into `buf`, keeping its last [`KEPT`] bytes; how
/// many earlier bytes were let go.
async fn read_tail<R: tokio::io::AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>) -> u64 {
    let mut dropped = 0u64;
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        match r.read(&mut chunk).await {
            Ok(0) | Err(_) => return dropped,
            Ok(n) => {
                buf.extend_from_slice(&chunk[..n]);
                // Trimmed in halves, so each byte moves O(1) times.
                if buf.len() > 2 * KEPT {
                    let cut = buf.len() - KEPT;
                    buf.drain(..cut);
                    dropped += cut as u64;
                }
            }
        }
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

/// The note a failed command gets when its output shows the sandbox denied
/// something.
fn denial_note(backend: Option<&Backend>, mode: PermissionMode, output: &[u8]) -> Option<String> {
    let backend = backend?;
    let text = String::from_utf8_lossy(output).to_lowercase();
    if !backend.denial_signatures().iter().any(|s| text.contains(s)) {
        return None;
    }
    let allowed = match mode {
        PermissionMode::ReadOnly => "nothing may be written",
        _ => "only the workspace and the private temp directory may be written",
    };
    Some(format!(
        "\n[sandbox: the command ran under {mode} ({}), where {allowed}; the failure above may be a denial. {ESCALATE}]",
        backend.name()
    ))
}

impl Tool for Bash {
    fn escalates(&self) -> bool {
        true
    }

    /// Cancelled, the body kills what the command started before it ends.
    fn cancel_grace(&self) -> Option<Duration> {
        Some(DRAIN * 2)
    }

    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "bash".into(),
            description: "Run a bash command (`bash -c`) and return what it printed. Each call starts a fresh shell in the workspace: no directory, variable or function survives between calls, so pass `workdir` (relative to the workspace) instead of `cd`. stdout comes first; what the command wrote to stderr follows a `[stderr]` line; a non-zero exit ends the result with `[exit code: N]`, and a command that outlives `timeoutMs` (default 120000, at most 600000) is killed with everything it started and reported as timed out, its output so far kept. Output past 30000 bytes keeps its tail. Commands run in a sandbox: under workspace-write they may change the workspace and $TMPDIR only, under read-only nothing, and the network may be cut; a denied operation shows up as the command's own error (\"Read-only file system\", \"Permission denied\", a failed connection). When the task truly needs more, retry that one call with `sandbox_permissions` naming the mode it needs and a `justification`; the user decides. Interactive commands (editors, pagers, prompts) have no terminal and will hang until the timeout: pass flags that make them non-interactive.".into(),
            parameters: parameters::<BashArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "`bash` is for what the other tools cannot do: builds, tests, version control, running programs. Give a short `description`, pass `workdir` rather than `cd`, and check the result: stderr follows a `[stderr]` line and a failure ends with `[exit code: N]`. Narrow a command whose output would be long (`| tail`, `--quiet`, a path filter) rather than reading pages of it.",
        )
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: BashArgs = cx.parse()?;
            let command = args.command;
            let workspace = confine(&cx.cwd, ".")?;
            let dir = match args.workdir.as_deref() {
                Some("") | None => workspace.clone(),
                Some(w) if cx.policy.mode == PermissionMode::DangerFullAccess => workspace.join(w),
                Some(w) => confine(&cx.cwd, w)?,
            };
            let timeout = args
                .timeout_ms
                .filter(|t| *t > 0.0)
                .map(|t| Duration::from_millis(t as u64).min(MAX_TIMEOUT))
                .unwrap_or(DEFAULT_TIMEOUT);
            let sandbox = cx
                .ctx
                .get::<Sandbox>(Sandbox::SERVICE)
                .unwrap_or_else(Sandbox::host);
            let mut env = sandbox.child_env();
            env.push(("DSH_WORKSPACE".into(), cx.cwd.as_os_str().to_owned()));
            let marker = marker();
            if let Some((k, v)) = marker.split_once('=') {
                env.push((k.into(), v.into()));
            }
            let launch = Launch {
                argv: vec!["bash".into(), "-c".into(), command.clone().into()],
                cwd: dir,
                workspace,
                env,
                stdin: false,
            };
            if args.run_in_background == Some(true) {
                return background(&cx, sandbox, launch, &command, marker).await;
            }
            let spawned = sandbox
                .spawn(launch, cx.policy)
                .await
                .map_err(|e| ToolError::new(e.code(), chain(&e).to_string()))?;
            let backend = spawned.backend.clone();
            let mut guard = spawned;
            let child = &mut guard.child;
            let pid = child.id();
            let mut stdout = child.stdout.take();
            let mut stderr = child.stderr.take();
            let mut out = Vec::new();
            let mut err = Vec::new();
            let (mut out_dropped, mut err_dropped) = (0u64, 0u64);
            let mut reading = Box::pin(async {
                let read_out = async {
                    if let Some(s) = stdout.as_mut() {
                        out_dropped = read_tail(s, &mut out).await;
                    }
                };
                let read_err = async {
                    if let Some(s) = stderr.as_mut() {
                        err_dropped = read_tail(s, &mut err).await;
                    }
                };
                tokio::join!(read_out, read_err);
            });
            let deadline = tokio::time::Instant::now() + timeout;
            let mut read_all = false;
            let ended = loop {
                tokio::select! {
                    () = &mut reading, if !read_all => read_all = true,
                    status = child.wait() => break Ended::Exited(status),
                    () = tokio::time::sleep_until(deadline) => break Ended::TimedOut,
                    () = cx.cancel.cancelled() => break Ended::Cancelled,
                }
            };
            // Whatever the command started dies with the call: its group
            // (under bwrap, the whole PID namespace), and what left the
            // group on the host (setsid, double fork) by its marker.
            if let Some(pid) = pid {
                let reaped = matches!(ended, Ended::Exited(_));
                crate::sandbox::kill_command(pid as i32, reaped);
            }
            crate::sandbox::kill_marked(marker).await;
            if !read_all {
                // Descendants holding the pipes are gone: the rest is EOF.
                let _ = tokio::time::timeout(DRAIN, &mut reading).await;
            }
            drop(reading);
            let status = match ended {
                Ended::Exited(status) => status,
                Ended::Cancelled => {
                    return Err(ToolError::new(
                        "ABORTED",
                        "the command was cancelled; everything it started was killed",
                    ));
                }
                Ended::TimedOut => {
                    let printed = tail(&joined(&out, &err));
                    return Err(ToolError::new(
                        "TIMEOUT",
                        format!(
                            "the command ran longer than {} ms; everything it started was killed. Output before the kill:\n{printed}",
                            timeout.as_millis()
                        ),
                    ));
                }
            };
            let combined = joined(&out, &err);
            let mut text = tail(&combined);
            if combined.len() > OUTPUT_CAP
                && let Some(path) = spill(&cx, &combined).await
            {
                let dropped = out_dropped + err_dropped;
                if dropped == 0 {
                    text.push_str(&format!("\n[the whole output is in {}]", path.display()));
                } else {
                    text.push_str(&format!(
                        "\n[the last {} MiB of each stream are in {}; {dropped} earlier bytes were not kept]",
                        KEPT / (1024 * 1024),
                        path.display()
                    ));
                }
            }
            let code = status.map_err(|e| ToolError::failed(format!("bash did not exit cleanly: {}", chain(&e))))?.code();
            match code {
                Some(0) => {}
                Some(c) => text.push_str(&format!("\n[exit code: {c}]")),
                None => text.push_str("\n[killed by a signal]"),
            }
            if code != Some(0)
                && let Some(note) = denial_note(backend.as_ref(), cx.policy.mode, &combined)
            {
                text.push_str(&note);
            }
            Ok(ToolOutput::text(text))
        }
        .boxed()
    }
}
