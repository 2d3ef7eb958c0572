//! Background jobs: long-running work a tool starts and returns from at
//! once (`bash` with `run_in_background`), read later with `job_output`,
//! listed with `job_list`, stopped with `job_kill`.
//!
//! The [`Jobs`] service (`jobs`) holds every job's identity, owner, status
//! and output. Each job runs as a supervised task child under its owner agent's
//! scope ([`run_job`]), so the owner cannot hibernate while it runs, and
//! the owner's teardown cancels it ([`Jobs::cancel_owner`]) before its
//! children drain. Access is fenced by the owner's session id: ids such as
//! `bash-1` are guessable, the owner check is the boundary.
//!
//! Output is kept as a stream with one read cursor: each read returns what
//! came since the last one, at most [`READ_CAP`] bytes (its tail). Past
//! [`READ_CAP`] bytes in all, the whole output also goes to a spill file,
//! whose path a read names when it had to leave bytes out.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, Emit, Event, Shutdown, TaskSpec};
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::sandbox::Spawned;

/// Bytes one read returns at most (the tail of what is new).
pub const READ_CAP: usize = 30_000;

/// Where a job is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum JobStatus {
    /// Working.
    Running,
    /// Asked to stop; not yet stopped.
    Stopping,
    /// Ended by itself, successfully (exit code 0).
    Completed,
    /// Stopped by `job_kill` or its owner's end.
    Killed,
    /// Ended by itself, unsuccessfully (a non-zero exit, a failed start).
    Failed,
}

impl JobStatus {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            JobStatus::Running => "running",
            JobStatus::Stopping => "stopping",
            JobStatus::Completed => "completed",
            JobStatus::Killed => "killed",
            JobStatus::Failed => "failed",
        }
    }

    /// Whether the job has ended.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            JobStatus::Completed | JobStatus::Killed | JobStatus::Failed
        )
    }
}

/// What a caller may see of a job.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobSnapshot {
    /// `bash-1`, …
    pub id: String,
    /// The producer (`bash`).
    pub kind: &'static str,
    /// One line saying what it runs.
    pub label: String,
    /// Its status.
    pub status: JobStatus,
    /// What the status does not say (`exit code: 3`, a kill's reason).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// Start, in milliseconds since the epoch.
    pub started_ms: u64,
    /// End, when it ended.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub finished_ms: Option<u64>,
}

impl JobSnapshot {
    /// `[status: completed]`, `[status: failed (exit code: 3)]`.
    pub fn status_line(&self) -> String {
        match &self.detail {
            Some(d) => format!("[status: {} ({d})]", self.status.as_str()),
            None => format!("[status: {}]", self.status.as_str()),
        }
    }
}

/// Why a job operation was refused. Each names what to do instead.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum JobError {
    /// No job has that id (or it belongs to another agent: the same answer,
    /// so ids cannot be probed).
    #[error("no background job `{0}` of yours (job_list shows them)")]
    Unknown(String),
    /// The owner runs as many jobs as it may.
    #[error(
        "{running} background jobs are running, the most one agent may run at once; collect or job_kill one first"
    )]
    TooMany {
        /// Jobs running now.
        running: usize,
    },
}

impl JobError {
    /// The stable code.
    pub fn code(&self) -> &'static str {
        match self {
            JobError::Unknown(_) => "UNKNOWN_JOB",
            JobError::TooMany { .. } => "TOO_MANY_JOBS",
        }
    }
}

/// Limits of a [`Jobs`] service.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobLimits {
    /// Jobs one owner may have running at once.
    pub max_running: usize,
    /// A `wait: true` read that names no timeout waits this long.
    pub wait_default: Duration,
    /// No read waits longer.
    pub wait_max: Duration,
}

impl Default for JobLimits {
    fn default() -> JobLimits {
        JobLimits {
            max_running: 8,
            wait_default: Duration::from_secs(30),
            wait_max: Duration::from_secs(600),
        }
    }
}

/// `jobs/done`: a job ended. Emitted once per job, with its owner, so the
/// owner can be told (unless a kill or a terminal read already did).
#[derive(Clone, Debug)]
pub struct JobDone {
    /// The job.
    pub job: Arc<Job>,
}

impl Event for JobDone {
    const NAME: &'static str = "jobs/done";
}

impl Emit for JobDone {}

/// The `jobs` service.
pub struct Jobs {
    limits: JobLimits,
    next: AtomicU64,
    jobs: Mutex<BTreeMap<u64, Arc<Job>>>,
    spill_dir: PathBuf,
}

impl Jobs {
    /// The capability name.
    pub const SERVICE: &'static str = "jobs";

    /// A registry with `limits`; spill files go under a fresh private
    /// directory in the system temp directory.
    pub fn new(limits: JobLimits) -> Jobs {
        let spill_dir = std::env::temp_dir().join(format!(
            "dsh-jobs-{}-{:08x}",
            std::process::id(),
            rand_u32()
        ));
        Jobs {
            limits,
            next: AtomicU64::new(1),
            jobs: Mutex::default(),
            spill_dir,
        }
    }

    /// Its limits.
    pub fn limits(&self) -> JobLimits {
        self.limits
    }

    /// Registers a running job of `kind` for `owner` (a session id), or
    /// refuses when the owner runs [`JobLimits::max_running`] already.
    pub fn admit(
        &self,
        kind: &'static str,
        label: &str,
        owner: Option<Arc<str>>,
    ) -> Result<Arc<Job>, JobError> {
        let mut jobs = lock(&self.jobs);
        let running = jobs
            .values()
            .filter(|j| j.owner == owner && !j.snapshot().status.is_terminal())
            .count();
        if running >= self.limits.max_running {
            return Err(JobError::TooMany { running });
        }
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let (settled, _) = tokio::sync::watch::channel(false);
        let job = Arc::new(Job {
            id: format!("{kind}-{n}"),
            kind,
            label: one_line(label),
            owner,
            started_ms: now_ms(),
            cancel: CancellationToken::new(),
            settled,
            spill: self.spill_dir.join(format!("{kind}-{n}.log")),
            group: std::sync::atomic::AtomicI32::new(0),
            state: Mutex::new(JobState {
                status: JobStatus::Running,
                detail: None,
                finished_ms: None,
                pending: Vec::new(),
                skipped: 0,
                total: 0,
                reported: false,
            }),
        });
        jobs.insert(n, job.clone());
        Ok(job)
    }

    /// The job `id` if `caller` may see it.
    pub fn get(&self, id: &str, caller: Option<&str>) -> Result<Arc<Job>, JobError> {
        lock(&self.jobs)
            .values()
            .find(|j| j.id == id && j.visible_to(caller))
            .cloned()
            .ok_or_else(|| JobError::Unknown(id.to_owned()))
    }

    /// The jobs `caller` may see, oldest first.
    pub fn list(&self, caller: Option<&str>) -> Vec<JobSnapshot> {
        lock(&self.jobs)
            .values()
            .filter(|j| j.visible_to(caller))
            .map(|j| j.snapshot())
            .collect()
    }

    /// Cancels every running job of `owner` (its agent is going away) and
    /// forgets its ended ones; nothing is reported for them.
    pub fn cancel_owner(&self, owner: &str) {
        let mut jobs = lock(&self.jobs);
        for job in jobs.values() {
            if job.owner.as_deref() == Some(owner) {
                job.kill("its agent ended");
            }
        }
        // Their tasks hold them until they end; nobody can ask anymore.
        jobs.retain(|_, j| j.owner.as_deref() != Some(owner));
    }

    /// Where the spill files are.
    pub fn spill_dir(&self) -> &std::path::Path {
        &self.spill_dir
    }
}

impl Drop for Jobs {
    fn drop(&mut self) {
        for job in lock(&self.jobs).values() {
            job.cancel.cancel();
        }
        let _ = std::fs::remove_dir_all(&self.spill_dir);
    }
}

/// One job.
#[derive(Debug)]
pub struct Job {
    /// `bash-1`, …
    pub id: String,
    /// The producer.
    pub kind: &'static str,
    /// What it runs, on one line.
    pub label: String,
    /// The owning session (`None`: anyone may see it).
    pub owner: Option<Arc<str>>,
    started_ms: u64,
    /// Fires when the job is asked to stop.
    pub cancel: CancellationToken,
    settled: tokio::sync::watch::Sender<bool>,
    spill: PathBuf,
    state: Mutex<JobState>,
    /// The command's process group, once started (0: none yet).
    group: std::sync::atomic::AtomicI32,
}

#[derive(Debug)]
struct JobState {
    status: JobStatus,
    detail: Option<String>,
    finished_ms: Option<u64>,
    /// Output since the last read (its tail, at most READ_CAP bytes).
    pending: Vec<u8>,
    /// Bytes dropped from the front of `pending` since the last read.
    skipped: u64,
    /// Bytes produced in all.
    total: u64,
    /// The owner was told it ended (or read or killed it): no notice.
    reported: bool,
}

impl Job {
    fn visible_to(&self, caller: Option<&str>) -> bool {
        self.owner.is_none() || self.owner.as_deref() == caller
    }

    /// Its state now.
    pub fn snapshot(&self) -> JobSnapshot {
        let s = lock(&self.state);
        JobSnapshot {
            id: self.id.clone(),
            kind: self.kind,
            label: self.label.clone(),
            status: s.status,
            detail: s.detail.clone(),
            started_ms: self.started_ms,
            finished_ms: s.finished_ms,
        }
    }

    /// Where the whole output is once it passed [`READ_CAP`] bytes.
    pub fn spill_path(&self) -> &std::path::Path {
        &self.spill
    }

    /// Whether the whole output is in the spill file.
    pub fn spilled(&self) -> bool {
        lock(&self.state).total > READ_CAP as u64
    }

    /// Appends produced output.
    pub fn push(&self, bytes: &[u8]) {
        let mut s = lock(&self.state);
        s.total += bytes.len() as u64;
        s.pending.extend_from_slice(bytes);
        if s.pending.len() > READ_CAP {
            let cut = s.pending.len() - READ_CAP;
            s.pending.drain(..cut);
            s.skipped += cut as u64;
        }
    }

    /// What came since the last read (`(no new output)` when nothing did)
    /// and the status line; a read of an ended job marks it reported.
    pub fn read(&self) -> String {
        let snapshot = self.snapshot();
        let mut s = lock(&self.state);
        let pending = std::mem::take(&mut s.pending);
        let skipped = std::mem::take(&mut s.skipped);
        if snapshot.status.is_terminal() {
            s.reported = true;
        }
        let spilled = s.total > READ_CAP as u64;
        drop(s);
        let mut out = String::new();
        if skipped > 0 {
            out.push_str(&format!("({skipped} earlier bytes not shown"));
            if spilled {
                out.push_str(&format!(
                    "; the whole output is in {}",
                    self.spill.display()
                ));
            }
            out.push_str(")\n");
        }
        if pending.is_empty() && skipped == 0 {
            out.push_str("(no new output)\n");
        } else {
            out.push_str(&String::from_utf8_lossy(&pending));
            if !out.ends_with('\n') {
                out.push('\n');
            }
        }
        out.push_str(&snapshot.status_line());
        out
    }

    /// Asks the job to stop (`stopping` until it has); an ended job is left
    /// as it is. Either way the owner needs no notice: it asked.
    pub fn kill(&self, reason: &str) -> JobSnapshot {
        {
            let mut s = lock(&self.state);
            s.reported = true;
            if s.status == JobStatus::Running {
                s.status = JobStatus::Stopping;
                if !reason.trim().is_empty() {
                    s.detail = Some(one_line(reason));
                }
                // Killed now, not when its task next runs: a loaded
                // runtime, or a task stopped first, must not let it live.
                // (The task clears `group` once it reaps the leader.)
                let group = self.group.load(Ordering::Acquire);
                if group > 0 {
                    crate::sandbox::kill_command(group, false);
                }
            }
        }
        self.cancel.cancel();
        self.snapshot()
    }

    /// Records the end (first one wins); whether it was this call's.
    pub fn settle(&self, status: JobStatus, detail: Option<String>) -> bool {
        {
            let mut s = lock(&self.state);
            if s.status.is_terminal() {
                return false;
            }
            let stopping = s.status == JobStatus::Stopping;
            s.status = if stopping { JobStatus::Killed } else { status };
            if !stopping || s.detail.is_none() {
                s.detail = detail;
            }
            s.finished_ms = Some(now_ms());
        }
        self.settled.send_replace(true);
        true
    }

    /// Waits until the job ends or `timeout` passes (or `cancel` fires).
    pub async fn wait(&self, timeout: Duration, cancel: &CancellationToken) {
        let mut rx = self.settled.subscribe();
        let ended = async {
            tokio::select! {
                _ = rx.wait_for(|done| *done) => {}
                () = cancel.cancelled() => {}
            }
        };
        // Past the timeout the job runs on; the read says so.
        let _ = tokio::time::timeout(timeout, ended).await;
    }

    /// Whether the owner was told of the end (or needs not be); marks it
    /// told from now on.
    pub fn take_unreported(&self) -> bool {
        let mut s = lock(&self.state);
        !std::mem::replace(&mut s.reported, true)
    }
}

/// Runs `spawned` as job `job`: a supervised task child under `ctx` (the
/// owner agent's scope, kind `job`) that collects the command's stdout and
/// stderr into the job (and its spill file past [`READ_CAP`] bytes), kills
/// the command's process group when the job or the task is cancelled,
/// settles the job from the exit status, emits [`JobDone`] and ends.
pub async fn run_job(
    ctx: &Context,
    jobs: &Arc<Jobs>,
    job: Arc<Job>,
    spawned: Spawned,
    marker: Option<String>,
) -> Result<(), dsh_supervisors::Error> {
    let name = format!("job/{}", job.id);
    if let Some(pid) = spawned.child.id() {
        job.group.store(pid as i32, Ordering::Release);
    }
    let (owner, jobs, task_job) = (ctx.clone(), jobs.clone(), job.clone());
    // The pump's own kill and drain get their time before an abort.
    let spec =
        TaskSpec::new("job", name).shutdown(Shutdown::Timeout(DRAIN + Duration::from_secs(2)));
    let started = ctx.spawn_task(spec, move |cancel| {
        // Made only once the task is accepted: a refused start is settled
        // by the caller below, not as a killed job.
        let settler = Settler {
            ctx: owner,
            job: task_job,
        };
        async move {
            let pumped = pump(&jobs, &settler.job, spawned, marker);
            tokio::pin!(pumped);
            let (status, detail) = tokio::select! {
                ended = &mut pumped => ended,
                // The task is stopped (its owner's teardown, a stop by id):
                // the job is cancelled, and the pump kills what it started.
                () = cancel.cancelled() => {
                    settler.job.cancel.cancel();
                    pumped.await
                }
            };
            settler.settle(status, detail);
        }
    });
    match started {
        Ok(_) => Ok(()),
        Err(e) => {
            job.settle(
                JobStatus::Failed,
                Some(format!("could not start: {}", chain(&e))),
            );
            Err(e)
        }
    }
}

/// Settles a job once and tells the owner; a task aborted before the
/// command ended (past its shutdown budget) settles it `killed` on drop.
struct Settler {
    ctx: Context,
    job: Arc<Job>,
}

impl Settler {
    fn settle(&self, status: JobStatus, detail: Option<String>) {
        if self.job.settle(status, detail) {
            self.ctx.emit(&JobDone {
                job: self.job.clone(),
            });
        }
    }
}

impl Drop for Settler {
    fn drop(&mut self) {
        // Dropped unsettled: the task was aborted mid-pump. The leader died
        // with the dropped child (kill on drop); the rest of its process
        // group is killed here.
        if self
            .job
            .settle(JobStatus::Killed, Some("its task was stopped".into()))
        {
            let group = self.job.group.load(Ordering::Acquire);
            if group > 0 {
                crate::sandbox::kill_command(group, false);
            }
            self.job.cancel.cancel();
            self.ctx.emit(&JobDone {
                job: self.job.clone(),
            });
        }
    }
}

/// Collects the output until the command ends or the job is cancelled.
/// Once the leader exits or the job is cancelled, everything the command
/// started is killed (its group, and by `marker` what left the group), and
/// the pipes get [`DRAIN`] to close: a process out of reach of both (it
/// cleared its environment and left the group, on a host without bwrap)
/// cannot hold the task.
async fn pump(
    jobs: &Jobs,
    job: &Arc<Job>,
    mut spawned: Spawned,
    marker: Option<String>,
) -> (JobStatus, Option<String>) {
    let mut stdout = spawned.child.stdout.take();
    let mut stderr = spawned.child.stderr.take();
    let mut spill: Option<tokio::fs::File> = None;
    let mut head: Vec<u8> = Vec::new();
    let (mut out_buf, mut err_buf) = ([0u8; 8192], [0u8; 8192]);
    let mut exit = None;
    let mut cancelled = false;
    let mut drain: Option<tokio::time::Instant> = None;
    let pid = spawned.child.id().map(|p| p as i32);
    loop {
        let open = stdout.is_some() || stderr.is_some();
        if !open && exit.is_some() {
            break;
        }
        let mut ending = false;
        let chunk = tokio::select! {
            n = read_some(&mut stdout, &mut out_buf), if stdout.is_some() => match n {
                Some(n) => Some(out_buf[..n].to_vec()),
                None => { stdout = None; None }
            },
            n = read_some(&mut stderr, &mut err_buf), if stderr.is_some() => match n {
                Some(n) => Some(err_buf[..n].to_vec()),
                None => { stderr = None; None }
            },
            status = spawned.child.wait(), if exit.is_none() => {
                exit = Some(status);
                // Reaped: a kill must not reach a pid reused since.
                job.group.store(0, Ordering::Release);
                if let Some(pid) = pid {
                    crate::sandbox::kill_command(pid, true);
                }
                ending = true;
                None
            }
            () = job.cancel.cancelled(), if !cancelled => {
                cancelled = true;
                if let (Some(pid), None) = (pid, &exit) {
                    crate::sandbox::kill_command(pid, false);
                }
                ending = true;
                None
            }
            () = sleep_until(drain), if drain.is_some() => break,
        };
        if ending {
            if let Some(marker) = marker.clone() {
                crate::sandbox::kill_marked(marker).await;
            }
            drain.get_or_insert_with(|| tokio::time::Instant::now() + DRAIN);
        }
        if let Some(bytes) = chunk {
            job.push(&bytes);
            spill_write(jobs, job, &mut spill, &mut head, &bytes).await;
        }
    }
    if let Some(f) = spill.as_mut() {
        let _ = f.flush().await;
    }
    match exit {
        _ if cancelled => (JobStatus::Killed, None),
        Some(Ok(status)) if status.success() => (JobStatus::Completed, None),
        Some(Ok(status)) => {
            use std::os::unix::process::ExitStatusExt;
            let detail = match (status.code(), status.signal()) {
                (Some(code), _) => format!("exit code: {code}"),
                (None, Some(sig)) => format!("killed by signal {sig}"),
                (None, None) => "ended abnormally".to_owned(),
            };
            (JobStatus::Failed, Some(detail))
        }
        Some(Err(e)) => (
            JobStatus::Failed,
            Some(format!("cannot wait for it: {}", chain(&e))),
        ),
        None => (JobStatus::Failed, Some("it ended unobserved".to_owned())),
    }
}

/// How long the pipes may take to close once everything is killed.
const DRAIN: Duration = Duration::from_secs(5);

async fn sleep_until(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn read_some<R: tokio::io::AsyncRead + Unpin>(
    r: &mut Option<R>,
    buf: &mut [u8],
) -> Option<usize> {
    match r.as_mut()?.read(buf).await {
        Ok(0) | Err(_) => None,
        Ok(n) => Some(n),
    }
}

/// Keeps the first [`READ_CAP`] bytes in memory; past them, writes those
/// and everything after to the job's spill file (0600 in a 0700 directory).
async fn spill_write(
    jobs: &Jobs,
    job: &Job,
    spill: &mut Option<tokio::fs::File>,
    head: &mut Vec<u8>,
    bytes: &[u8],
) {
    if let Some(f) = spill.as_mut() {
        let _ = f.write_all(bytes).await;
        return;
    }
    head.extend_from_slice(bytes);
    if head.len() <= READ_CAP {
        return;
    }
    let dir = jobs.spill_dir().to_path_buf();
    let opened = async {
        let mut builder = tokio::fs::DirBuilder::new();
        builder.recursive(true).mode(0o700);
        builder.create(&dir).await?;
        tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(job.spill_path())
            .await
    };
    match opened.await {
        Ok(mut f) => {
            let _ = f.write_all(head).await;
            *spill = Some(f);
        }
        Err(e) => tracing::warn!(job = %job.id, error = %e, "cannot spill the job's output"),
    }
    *head = Vec::new();
}

fn one_line(s: &str) -> String {
    let line: String = s.split_whitespace().collect::<Vec<_>>().join(" ");
    if line.chars().count() > 120 {
        format!("{}…", line.chars().take(119).collect::<String>())
    } else {
        line
    }
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn rand_u32() -> u32 {
    uuid::Uuid::new_v4().as_u128() as u32
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
