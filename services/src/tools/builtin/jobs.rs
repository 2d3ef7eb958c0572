//! `job_list`, `job_output`, `job_kill`: the model's controls over its
//! background jobs (see [`crate::jobs`]). Each sees only the calling
//! agent's jobs.

use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;

use crate::jobs::{Job, Jobs};
use crate::llm::{ContentBlock, ToolSchema};
use crate::session::{SESSION_SERVICE, SessionWriter};
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};

/// The jobs service and the caller's session id.
fn access(cx: &ToolContext) -> Result<(Arc<Jobs>, Option<Arc<str>>), ToolError> {
    let jobs = cx
        .ctx
        .get::<Jobs>(Jobs::SERVICE)
        .ok_or_else(|| ToolError::new("NO_JOBS", "background jobs are not available here"))?;
    let caller = cx
        .ctx
        .get::<dyn SessionWriter>(SESSION_SERVICE)
        .map(|s| s.session_id());
    Ok((jobs, caller))
}

fn job(cx: &ToolContext, id: &str) -> Result<(Arc<Jobs>, Arc<Job>), ToolError> {
    let (jobs, caller) = access(cx)?;
    let job = jobs
        .get(id, caller.as_deref())
        .map_err(|e| ToolError::new(e.code(), chain(&e).to_string()))?;
    Ok((jobs, job))
}

fn with_job(text: String, job: &Job) -> ToolOutput {
    ToolOutput {
        content: vec![ContentBlock::text(text)],
        meta: serde_json::to_value(job.snapshot())
            .ok()
            .map(|j| serde_json::json!({ "job": j })),
    }
}

/// `job_list`.
pub struct JobList;

/// `job_list` takes nothing.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct NoArgs {}

impl Tool for JobList {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "job_list".into(),
            description: "List your background jobs, running and ended, one per line as `<id> [<kind>] <status> — <what it runs>`.".into(),
            parameters: parameters::<NoArgs>(),
        }
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let (jobs, caller) = access(&cx)?;
            let list = jobs.list(caller.as_deref());
            let text = if list.is_empty() {
                "(no background jobs)".to_owned()
            } else {
                list.iter()
                    .map(|j| {
                        let status = match &j.detail {
                            Some(d) => format!("{} ({d})", j.status.as_str()),
                            None => j.status.as_str().to_owned(),
                        };
                        format!("{} [{}] {status} — {}", j.id, j.kind, j.label)
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            Ok(ToolOutput {
                content: vec![ContentBlock::text(text)],
                meta: serde_json::to_value(&list)
                    .ok()
                    .map(|l| serde_json::json!({ "jobs": l })),
            })
        }
        .boxed()
    }
}

/// `job_output`.
pub struct JobOutput;

/// What a `job_output` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct OutputArgs {
    /// The job id the starting tool returned (e.g. `bash-1`).
    job_id: String,
    /// Wait until the job ends or the timeout passes. A wait that times out
    /// returns `[status: running]` and leaves the job running.
    #[serde(default)]
    wait: Option<bool>,
    /// The longest wait in milliseconds (with `wait: true`; default 30000,
    /// at most 600000).
    #[serde(default)]
    timeout_ms: Option<f64>,
}

impl Tool for JobOutput {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "job_output".into(),
            description: "Read a background job: the output it produced since your last read (its tail when there is much; the whole output is then in a file the read names), then `[status: …]`. Returns at once unless `wait` is true, which waits for the job to end up to `timeout_ms`.".into(),
            parameters: parameters::<OutputArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Background jobs (`bash` with `run_in_background`, for servers, watchers and long builds): keep track of the ids you start. You are told when one finishes, so do not poll or sleep waiting for it; go on with other work. Before your final answer, read each job that still matters with `job_output` (`wait: true` only when you cannot go on without it) and `job_kill` those that no longer do.",
        )
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: OutputArgs = cx.parse()?;
            let (jobs, job) = job(&cx, &args.job_id)?;
            if args.wait == Some(true) {
                let limits = jobs.limits();
                let timeout = args
                    .timeout_ms
                    .filter(|t| *t > 0.0)
                    .map_or(limits.wait_default, |t| Duration::from_millis(t as u64))
                    .min(limits.wait_max);
                job.wait(timeout, &cx.cancel).await;
            }
            Ok(with_job(job.read(), &job))
        }
        .boxed()
    }
}

/// `job_kill`.
pub struct JobKill;

/// What a `job_kill` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct KillArgs {
    /// The job id the starting tool returned (e.g. `bash-1`).
    job_id: String,
    /// Why, in a few words (kept with the job's status).
    #[serde(default)]
    reason: Option<String>,
}

impl Tool for JobKill {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "job_kill".into(),
            description: "Stop a background job by its id: everything it started is killed. Returns at once; the job then ends as killed. A job that already ended is left as it is and its status returned.".into(),
            parameters: parameters::<KillArgs>(),
        }
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: KillArgs = cx.parse()?;
            let (_, job) = job(&cx, &args.job_id)?;
            let before = job.snapshot();
            let after = job.kill(args.reason.as_deref().unwrap_or(""));
            let text = if before.status.is_terminal() {
                format!("job {} had already ended {}", job.id, after.status_line())
            } else {
                format!(
                    "requested the end of job {} {}",
                    job.id,
                    after.status_line()
                )
            };
            Ok(with_job(text, &job))
        }
        .boxed()
    }
}
