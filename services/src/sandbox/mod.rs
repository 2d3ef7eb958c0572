//! The sandbox seam: how far an agent's processes and file tools may reach.
//!
//! A [`PermissionMode`] governs file effects: `read-only` (nothing may be
//! written but `/dev/null`), `workspace-write` (the workspace and a private
//! temp directory), `danger-full-access` (no confinement). With the network
//! flag of a [`Policy`] it is what an agent may do without asking; the
//! policy rides every call, so two agents confine differently at the same
//! instant and an approved escalation is one call with a wider policy.
//!
//! [`Sandbox`] runs a command under a policy with the host's backend:
//! `bwrap` when it works here, else Landlock (applied to a throwaway thread
//! that then spawns the command, so the child inherits the restriction and
//! no `unsafe` `pre_exec` is needed). A confined policy with no usable
//! backend is [`SandboxError::Unavailable`] (`SANDBOX_UNAVAILABLE`): a
//! command never runs unconfined because confinement failed.
//!
//! Child processes never see the variables dsh reads secrets from
//! ([`env`]).

mod bwrap;
pub mod env;
mod landlock;

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock, RwLock};
use std::time::Duration;

use dsh_supervisors::error::chain;
use serde::{Deserialize, Serialize};

/// What the system prompt tells the model about the sandbox and
/// escalation (the same under every mode, so a mode change does not
/// rewrite the prompt).
pub const PROMPT_GUIDANCE: &str = "Commands and file changes run in a sandbox governed by a permission mode (read-only, workspace-write or danger-full-access). When the sandbox denies a call the task truly needs, retry that one call with `sandbox_permissions` naming the mode it needs (`workspace-write` or `danger-full-access`) and a short `justification`; the user decides, and a refusal is final. Never escalate to get around a denial you can avoid.";

/// What an agent's tools may change.
#[derive(
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum PermissionMode {
    /// Nothing may be written (but `/dev/null`).
    ReadOnly,
    /// The workspace and a private temp directory may be written.
    #[default]
    WorkspaceWrite,
    /// No confinement.
    DangerFullAccess,
}

impl PermissionMode {
    /// Every mode, narrowest first.
    pub const ALL: [PermissionMode; 3] = [
        PermissionMode::ReadOnly,
        PermissionMode::WorkspaceWrite,
        PermissionMode::DangerFullAccess,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            PermissionMode::ReadOnly => "read-only",
            PermissionMode::WorkspaceWrite => "workspace-write",
            PermissionMode::DangerFullAccess => "danger-full-access",
        }
    }
}

impl std::fmt::Display for PermissionMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A mode name that is none of the three. Fatal: the name must change.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown permission mode `{0}` (expected read-only, workspace-write or danger-full-access)"
)]
pub struct UnknownMode(pub String);

impl std::str::FromStr for PermissionMode {
    type Err = UnknownMode;
    fn from_str(s: &str) -> Result<Self, UnknownMode> {
        PermissionMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s)
            .ok_or_else(|| UnknownMode(s.to_owned()))
    }
}

/// What an agent may do without asking: its mode and whether its
/// processes reach the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Policy {
    /// File effects.
    pub mode: PermissionMode,
    /// Whether processes may use the network.
    pub network: bool,
}

impl Default for Policy {
    fn default() -> Policy {
        Policy {
            mode: PermissionMode::WorkspaceWrite,
            network: true,
        }
    }
}

impl Policy {
    /// The policy of a child of an agent holding `self` that asks for
    /// `asked`: never more than `self` in either respect.
    pub fn narrowed(self, asked: Option<Policy>) -> Policy {
        match asked {
            None => self,
            Some(a) => Policy {
                mode: self.mode.min(a.mode),
                network: self.network && a.network,
            },
        }
    }

    /// The policy of one call the user allowed to run beyond the sandbox.
    pub fn escalated() -> Policy {
        Policy {
            mode: PermissionMode::DangerFullAccess,
            network: true,
        }
    }

    /// This policy widened to `mode` for one approved call: full access
    /// brings the network back; a wider file mode alone leaves it as it was.
    pub fn widened(self, mode: PermissionMode) -> Policy {
        if mode == PermissionMode::DangerFullAccess {
            return Policy::escalated();
        }
        Policy {
            mode: self.mode.max(mode),
            network: self.network,
        }
    }

    /// What this policy means, for the model (one paragraph of the
    /// runtime-context snapshot): the mode and, under `workspace-write`,
    /// the workspace; a cut network.
    pub fn describe(self, workspace: &Path) -> String {
        let files = match self.mode {
            PermissionMode::ReadOnly => "File policy: read-only. The tools dsh confines cannot change files in this mode. Do not give up on a change the task needs for that reason alone: make the call, and if it is denied, follow what the denial says about escalation.".to_owned(),
            PermissionMode::WorkspaceWrite => format!(
                "File policy: workspace-write. The tools dsh confines may change files under the workspace \"{}\" and in a private temporary directory, and nowhere else.",
                workspace.display()
            ),
            PermissionMode::DangerFullAccess => {
                "File policy: danger-full-access. dsh does not confine what tools change.".to_owned()
            }
        };
        if self.network {
            files
        } else {
            format!("{files} Commands run without network access.")
        }
    }

    /// Whether processes under this policy need a backend at all.
    pub fn confines(self) -> bool {
        self.mode != PermissionMode::DangerFullAccess || !self.network
    }
}

/// Which confinement mechanism runs commands.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// `bwrap` when it works on this host, else Landlock.
    #[default]
    Auto,
    /// Only `bwrap`.
    Bwrap,
    /// Only Landlock.
    Landlock,
}

/// A backend name that is none of `auto`, `bwrap`, `landlock`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown sandbox backend `{0}` (expected auto, bwrap or landlock)")]
pub struct UnknownBackend(pub String);

impl std::str::FromStr for BackendChoice {
    type Err = UnknownBackend;
    fn from_str(s: &str) -> Result<Self, UnknownBackend> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "bwrap" => Ok(BackendChoice::Bwrap),
            "landlock" => Ok(BackendChoice::Landlock),
            other => Err(UnknownBackend(other.to_owned())),
        }
    }
}

/// No backend works on this host: what each candidate said.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct NoBackend(pub String);

/// The mechanism selected on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Bubblewrap, at this path.
    Bwrap(PathBuf),
    /// Landlock, with the kernel enforcing every requested right (`full`)
    /// or only some (`partial`, older ABIs).
    Landlock {
        /// Whether every requested access right is enforced.
        full: bool,
    },
}

impl Backend {
    /// A short name for results and logs.
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Bwrap(_) => "bwrap",
            Backend::Landlock { .. } => "landlock",
        }
    }

    /// The stderr text a denied write produces under this backend.
    pub fn denial_signatures(&self) -> &'static [&'static str] {
        match self {
            Backend::Bwrap(_) => &["read-only file system"],
            Backend::Landlock { .. } => &["permission denied", "operation not permitted"],
        }
    }
}

/// Why a command could not run confined.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SandboxError {
    /// No backend can enforce the policy on this host. Fatal until the host
    /// changes (install bubblewrap, enable Landlock) or the mode does.
    #[error(
        "permission mode `{mode}`{net} is requested but no sandbox backend can enforce it here ({why}); refusing to run the command unconfined. Install bubblewrap (Debian: `apt-get install bubblewrap`) or run on a kernel with Landlock, or choose --permission-mode danger-full-access"
    )]
    Unavailable {
        /// The mode asked for.
        mode: PermissionMode,
        /// `" without network"` when the network was cut too.
        net: &'static str,
        /// What each backend said.
        why: String,
    },
    /// The backend was selected but could not start this command.
    #[error("the sandbox could not start the command: {0}")]
    Spawn(String),
}

impl SandboxError {
    /// The stable code a tool result carries.
    pub fn code(&self) -> &'static str {
        match self {
            SandboxError::Unavailable { .. } => "SANDBOX_UNAVAILABLE",
            SandboxError::Spawn(_) => "SANDBOX_FAILED",
        }
    }
}

/// One command to run: the argv, where, and with which environment.
#[derive(Clone, Debug)]
pub struct Launch {
    /// Program and arguments.
    pub argv: Vec<OsString>,
    /// Working directory (inside the workspace for confined modes).
    pub cwd: PathBuf,
    /// The workspace root `workspace-write` may write under.
    pub workspace: PathBuf,
    /// The whole environment the command sees.
    pub env: Vec<(OsString, OsString)>,
    /// Whether the command gets a stdin pipe (else `/dev/null`).
    pub stdin: bool,
}

/// A started command: the child (leading its own process group, stdout
/// and stderr piped, killed when dropped) and what confines it.
pub struct Spawned {
    /// The process.
    pub child: tokio::process::Child,
    /// The backend confining it (`None`: unconfined).
    pub backend: Option<Backend>,
    /// A private temp directory removed with this value (Landlock).
    _tmp: Option<PrivateTmp>,
    /// The thread that forked it, kept until this value goes.
    _spawner: Spawner,
}

impl Spawned {
    fn new(
        (child, tmp): (tokio::process::Child, Option<PrivateTmp>),
        backend: Option<Backend>,
        spawner: Spawner,
    ) -> Spawned {
        if let Some(pid) = child.id() {
            lock(&RUNNING).insert(pid as i32);
        }
        Spawned {
            child,
            backend,
            _tmp: tmp,
            _spawner: spawner,
        }
    }
}

/// Keeps alive the thread that forked a command. A parent-death signal
/// (bwrap's `--die-with-parent`, the guard's `setpriv --pdeathsig`) fires
/// when the *thread* that forked the process ends, not the process: so each
/// command is forked by a thread of its own that waits, parked, until the
/// command is dropped, and ends with dsh however dsh ends (`kill -9`
/// included), taking the command with it.
struct Spawner(#[allow(dead_code)] std::sync::mpsc::Sender<()>);

/// How long starting a command may take.
const SPAWN_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `start` (which forks the command) on a thread of its own that then
/// stays parked until the returned [`Spawner`] is dropped.
async fn on_own_thread(
    start: impl FnOnce() -> Result<(tokio::process::Child, Option<PrivateTmp>), SandboxError>
    + Send
    + 'static,
) -> Result<((tokio::process::Child, Option<PrivateTmp>), Spawner), SandboxError> {
    let rt = tokio::runtime::Handle::current();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let (keep, parked) = std::sync::mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("dsh-spawner".into())
        .stack_size(256 * 1024)
        .spawn(move || {
            let _entered = rt.enter();
            let started = start();
            let ok = started.is_ok();
            if tx.send(started).is_ok() && ok {
                // Until the command's value is dropped (the sender with it).
                let _ = parked.recv();
            }
        })
        .map_err(|e| {
            SandboxError::Spawn(format!("cannot start a spawner thread: {}", chain(&e)))
        })?;
    match tokio::time::timeout(SPAWN_TIMEOUT, rx).await {
        Ok(Ok(started)) => started.map(|s| (s, Spawner(keep))),
        Ok(Err(_)) => Err(SandboxError::Spawn(
            "the spawner thread ended without an answer".into(),
        )),
        Err(_) => Err(SandboxError::Spawn(format!(
            "the command did not start within {} s",
            SPAWN_TIMEOUT.as_secs()
        ))),
    }
}

/// The guard put in front of a command that no PID namespace holds
/// (Landlock, unconfined): `setpriv --pdeathsig TERM -- sh -c '[ "$PPID" =
/// "$0" ] && exec "$@"' <our pid> timeout --kill-after=1 0`. When dsh's
/// spawner thread ends (dsh exits, even by `kill -9`), `timeout` gets
/// SIGTERM and passes it to the command's whole process group, then SIGKILL
/// a second later; otherwise it only runs the command (duration 0: no time
/// limit) and exits as it does. The shell closes the race `setpriv` leaves
/// open: a dsh that died before the death signal was set is no longer the
/// parent, and the command does not start. `None` where util-linux's
/// `setpriv`, coreutils' `timeout` or `sh` is missing.
fn guard() -> Option<&'static [OsString]> {
    static GUARD: OnceLock<Option<Vec<OsString>>> = OnceLock::new();
    GUARD
        .get_or_init(|| {
            let (setpriv, sh, timeout) = (on_path("setpriv")?, on_path("sh")?, on_path("timeout")?);
            let mut argv: Vec<OsString> = vec![setpriv.into()];
            argv.extend(["--pdeathsig", "TERM", "--"].map(OsString::from));
            argv.push(sh.into());
            argv.extend(["-c", r#"[ "$PPID" = "$0" ] && exec "$@""#].map(OsString::from));
            argv.push(std::process::id().to_string().into());
            argv.push(timeout.into());
            argv.extend(["--kill-after=1", "0"].map(OsString::from));
            Some(argv)
        })
        .as_deref()
}

/// Where `program` runs from: a path with a slash (relative to `cwd`), else
/// the first executable file of that name on `path`.
fn found_in(program: &str, path: Option<&std::ffi::OsStr>, cwd: &Path) -> Option<PathBuf> {
    if program.contains('/') {
        let p = cwd.join(program);
        return is_executable(&p).then_some(p);
    }
    std::env::split_paths(path?)
        .map(|dir| dir.join(program))
        .find(|p| is_executable(p))
}

/// `launch`'s argv behind the [`guard`], when there is one and the program
/// can be found (else as it is: its spawn then fails as it would have).
fn guarded(launch: &Launch) -> Vec<OsString> {
    let program = launch.argv[0].to_string_lossy();
    let path = launch
        .env
        .iter()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.clone())
        .or_else(|| std::env::var_os("PATH"));
    match guard() {
        Some(guard) if found_in(&program, path.as_deref(), &launch.cwd).is_some() => {
            guard.iter().chain(&launch.argv).cloned().collect()
        }
        _ => launch.argv.clone(),
    }
}

/// Dropped before it was reaped (a call abandoned at any point), the
/// command's whole process group is killed, not just its leader.
impl Drop for Spawned {
    fn drop(&mut self) {
        let Some(pid) = self.child.id() else {
            return;
        };
        lock(&RUNNING).remove(&(pid as i32));
        let reaped = !matches!(self.child.try_wait(), Ok(None));
        if !reaped {
            // What it started comes to us (the subreaper) when it dies:
            // remember to reap it. The leader is tokio's to reap; an exit
            // waits for it too.
            lock(&ORPHANS).extend(descendants(pid as i32));
            lock(&KILLED).insert(pid as i32);
        }
        kill_command(pid as i32, reaped);
    }
}

/// The processes under `pid` (its children, theirs, …), as `/proc` lists
/// them now; at most a few thousand.
fn descendants(pid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let mut next = vec![pid];
    while let Some(p) = next.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{p}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let Ok(children) = std::fs::read_to_string(task.path().join("children")) else {
                continue;
            };
            for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                if found.len() < 4096 {
                    found.push(child);
                    next.push(child);
                }
            }
        }
    }
    found
}

/// Processes left by killed commands, ours to reap once they end (this
/// process is their subreaper).
static ORPHANS: Mutex<std::collections::BTreeSet<i32>> =
    Mutex::new(std::collections::BTreeSet::new());

/// Leaders of commands killed when dropped unreaped: tokio reaps them; an
/// exit waits for those it has not reaped yet ([`end_commands`]).
static KILLED: Mutex<std::collections::BTreeSet<i32>> =
    Mutex::new(std::collections::BTreeSet::new());

/// Whether `pid` is a child of this process not reaped yet (running or a
/// zombie), as `/proc` says.
fn unreaped_child(pid: i32) -> bool {
    state_and_parent(pid).is_some_and(|(_, ppid)| ppid == std::process::id() as i32)
}

/// A process's state letter and parent, as `/proc/PID/stat` says.
fn state_and_parent(pid: i32) -> Option<(String, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
    let mut fields = stat.rsplit_once(") ")?.1.split(' ');
    let state = fields.next()?.to_owned();
    Some((state, fields.next()?.parse().ok()?))
}

/// Makes this process the reaper of its orphaned descendants, once: a
/// killed command's processes (bwrap's inner one, a job's children) come
/// to us instead of to a PID 1 that may never reap them.
fn adopt_orphans() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
            tracing::warn!("cannot become the subreaper of our commands: {}", chain(&e));
        }
    });
}

/// Reaps the recorded orphans that have ended (never waits).
fn reap_orphans() {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    lock(&ORPHANS).retain(|pid| {
        matches!(
            waitpid(nix::unistd::Pid::from_raw(*pid), Some(WaitPidFlag::WNOHANG)),
            Ok(WaitStatus::StillAlive)
        )
    });
}

/// Kills the command `pid` started as and everything in its process group:
/// the leader first (unless `reaped`: its pid may be another's by now), so
/// it cannot fork again, then the group, which holds all it forked (under
/// bwrap the namespace's init, whose death ends every process inside). A
/// leader still between `exec` and `setsid` has no group yet and forked
/// nothing: the first kill suffices.
pub fn kill_command(pid: i32, reaped: bool) {
    use nix::sys::signal::{Signal, kill, killpg};
    let pid = nix::unistd::Pid::from_raw(pid);
    if !reaped {
        let _ = kill(pid, Signal::SIGKILL);
    }
    let _ = killpg(pid, Signal::SIGKILL);
}

/// The process groups of started commands not yet dropped.
static RUNNING: Mutex<std::collections::BTreeSet<i32>> =
    Mutex::new(std::collections::BTreeSet::new());

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Kills every process whose environment carries `marker` (a scan of
/// `/proc`, off the async workers; repeated while it finds any, so a fork
/// racing one scan is caught by the next). A process of ours whose
/// environment reads empty is looked at again: one in the middle of `exec`
/// (a `setsid sleep` between its `setsid()` and its new program) shows no
/// environment for a moment. A process that cleared its environment is out
/// of reach here; under bwrap the PID namespace ends it anyway.
pub async fn kill_marked(marker: String) {
    let scan = move || {
        let me = std::process::id() as i32;
        let mut rounds = 0;
        let mut unsure = Vec::new();
        loop {
            rounds += 1;
            let Ok(entries) = std::fs::read_dir("/proc") else {
                return;
            };
            let pids = entries
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok());
            let mut found = 0;
            unsure.clear();
            for pid in pids.filter(|&p| p != me) {
                match environment_of(pid, marker.as_bytes()) {
                    Environment::Marked => {
                        let _ = nix::sys::signal::kill(
                            nix::unistd::Pid::from_raw(pid),
                            nix::sys::signal::Signal::SIGKILL,
                        );
                        found += 1;
                    }
                    Environment::Empty if descends_from(pid, me) => unsure.push(pid),
                    Environment::Empty | Environment::Other => {}
                }
            }
            if found > 0 && rounds < MARKED_ROUNDS {
                continue;
            }
            // Only an exec in flight is left to wait for: a few
            // milliseconds, then whatever still reads empty cleared its
            // environment itself.
            if unsure.is_empty() || rounds >= MARKED_ROUNDS + UNSURE_ROUNDS {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let _ = tokio::task::spawn_blocking(scan).await;
}

/// Scans of `/proc` while processes carrying the marker keep turning up.
const MARKED_ROUNDS: u32 = 4;
/// Further scans, 2 ms apart, while a process of ours reads no environment.
const UNSURE_ROUNDS: u32 = 25;

/// What `/proc/PID/environ` shows of a process.
enum Environment {
    /// It carries the marker.
    Marked,
    /// Nothing: a zombie, a kernel thread, a process between two programs
    /// (`exec`), or one that cleared its environment.
    Empty,
    /// Another environment, or none this process may read.
    Other,
}

fn environment_of(pid: i32, marker: &[u8]) -> Environment {
    match std::fs::read(format!("/proc/{pid}/environ")) {
        Ok(env) if env.is_empty() => Environment::Empty,
        Ok(env) if env.split(|b| *b == 0).any(|v| v == marker) => Environment::Marked,
        _ => Environment::Other,
    }
}

/// Whether `pid` is a live (not zombie) process under `ancestor` (its
/// child, grandchild, …; at most 64 generations up).
fn descends_from(pid: i32, ancestor: i32) -> bool {
    let mut at = pid;
    for _ in 0..64 {
        let Some((state, ppid)) = state_and_parent(at) else {
            return false;
        };
        if at == pid && state == "Z" {
            return false;
        }
        match ppid {
            p if p == ancestor => return true,
            p if p > 1 => at = p,
            _ => return false,
        }
    }
    false
}

/// Kills the process group of every command still running, and reaps them
/// and what they leave: the last thing a process that started commands
/// does, whatever path ended it (a signal, a drain budget that ran out), so
/// no command outlives it even where the sandbox's own parent-death watch
/// does not hold, and none is left a zombie for a PID 1 that may never reap
/// it. Waits for the killed ones on `SIGCHLD`, at most [`REAP_BUDGET`].
pub async fn end_commands() {
    use tokio::signal::unix::{SignalKind, signal};
    // Listening before the kill: no exit goes unnoticed.
    let mut exits = signal(SignalKind::child()).ok();
    let groups = std::mem::take(&mut *lock(&RUNNING));
    // Killed leaders tokio has not reaped yet are reaped here: nothing of
    // ours outlives the process.
    let killed = std::mem::take(&mut *lock(&KILLED));
    lock(&ORPHANS).extend(killed.into_iter().filter(|&pid| unreaped_child(pid)));
    for &pgid in &groups {
        lock(&ORPHANS).extend(descendants(pgid));
        kill_command(pgid, false);
    }
    lock(&ORPHANS).extend(groups);
    let deadline = tokio::time::Instant::now() + REAP_BUDGET;
    loop {
        reap_orphans();
        reap_ended();
        if lock(&ORPHANS).is_empty() {
            return;
        }
        let Some(exits) = exits.as_mut() else {
            return;
        };
        if tokio::time::timeout_at(deadline, exits.recv())
            .await
            .is_err()
        {
            return;
        }
    }
}

/// How long an exiting process waits for killed commands to end.
const REAP_BUDGET: Duration = Duration::from_millis(500);

/// Reaps every child of this process that has ended (never waits).
fn reap_ended() {
    use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
    while let Ok(WaitStatus::Exited(..) | WaitStatus::Signaled(..)) =
        waitpid(None, Some(WaitPidFlag::WNOHANG))
    {}
}

/// A temp directory only one command may write, removed when dropped.
struct PrivateTmp(PathBuf);

impl PrivateTmp {
    fn create() -> std::io::Result<PrivateTmp> {
        use std::os::unix::fs::DirBuilderExt;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let base = std::env::temp_dir();
        for _ in 0..64 {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let dir = base.join(format!(
                "dsh-sandbox-{}-{n}-{:08x}",
                std::process::id(),
                uuid::Uuid::new_v4().as_u128() as u32
            ));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => return Ok(PrivateTmp(dir)),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::other("no free private temp directory name"))
    }
}

impl Drop for PrivateTmp {
    fn drop(&mut self) {
        let dir = std::mem::take(&mut self.0);
        // Removing may take a while (whatever the command left there): off
        // the async workers when there are any.
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || std::fs::remove_dir_all(dir))),
            Err(_) => drop(std::fs::remove_dir_all(dir)),
        }
    }
}

/// What a deployment sets: the policy agents get by default, the backend,
/// and the secret variables children may see anyway.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Settings {
    /// The policy agents get unless their spec (or parent) says otherwise.
    pub defaults: Policy,
    /// Which mechanism confines commands.
    pub backend: BackendChoice,
    /// Variables passed to children even if they hold secrets.
    pub pass_env: Vec<String>,
    /// Where bwrap is (default: found on `$PATH`).
    pub bwrap: Option<PathBuf>,
}

/// The `sandbox` service: the deployment's [`Settings`] and the host's
/// backend (probed on first use, again only if the choice changes).
#[derive(Debug, Default)]
pub struct Sandbox {
    settings: RwLock<Settings>,
    selected: Mutex<Option<(Choice, Result<Backend, NoBackend>)>>,
}

/// How long a backend probe may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(10);

impl Sandbox {
    /// The capability name.
    pub const SERVICE: &'static str = "sandbox";

    /// A sandbox with `settings`.
    pub fn new(settings: Settings) -> Sandbox {
        Sandbox {
            settings: RwLock::new(settings),
            selected: Mutex::new(None),
        }
    }

    /// The one used where no `sandbox` service is provided: the default
    /// policy, any backend, no secrets passed through.
    pub fn host() -> Arc<Sandbox> {
        static HOST: OnceLock<Arc<Sandbox>> = OnceLock::new();
        HOST.get_or_init(|| Arc::new(Sandbox::default())).clone()
    }

    /// The settings in force.
    pub fn settings(&self) -> Settings {
        self.settings.read().map(|s| s.clone()).unwrap_or_default()
    }

    /// Replaces the settings (agents created before keep their policy).
    pub fn set(&self, settings: Settings) {
        if let Ok(mut s) = self.settings.write() {
            *s = settings;
        }
    }

    /// The policy agents get unless their spec (or parent) says otherwise.
    pub fn defaults(&self) -> Policy {
        self.settings().defaults
    }

    /// The environment a child process sees: this process's, without the
    /// variables secrets are read from (unless passed through).
    pub fn child_env(&self) -> Vec<(OsString, OsString)> {
        env::scrubbed(&self.settings().pass_env)
    }

    /// The backend this host confines commands with (probed on first use).
    pub async fn backend(&self) -> Result<Backend, NoBackend> {
        let settings = self.settings();
        let choice = (settings.backend, settings.bwrap);
        let cached = self.selected.lock().ok().and_then(|s| s.clone());
        if let Some((c, verdict)) = cached
            && c == choice
        {
            return verdict;
        }
        let verdict = select(&choice).await.map_err(NoBackend);
        if let Ok(mut slot) = self.selected.lock() {
            *slot = Some((choice, verdict.clone()));
        }
        verdict
    }

    /// Starts `launch` under `policy`: unconfined for `danger-full-access`
    /// with the network on, else through the host's backend, or not at all.
    pub async fn spawn(&self, launch: Launch, policy: Policy) -> Result<Spawned, SandboxError> {
        adopt_orphans();
        reap_orphans();
        lock(&KILLED).retain(|&pid| unreaped_child(pid));
        if !policy.confines() {
            let (child, spawner) = on_own_thread(move || {
                let argv = guarded(&launch);
                let child = command(&argv[0], &argv[1..], &launch)
                    .process_group(0)
                    .spawn()
                    .map_err(|e| SandboxError::Spawn(chain(&e).to_string()))?;
                Ok((child, None))
            })
            .await?;
            return Ok(Spawned::new(child, None, spawner));
        }
        let unavailable = |why: String| SandboxError::Unavailable {
            mode: policy.mode,
            net: if policy.network {
                ""
            } else {
                " without network"
            },
            why,
        };
        let backend = self.backend().await.map_err(|e| unavailable(e.0))?;
        match &backend {
            Backend::Bwrap(path) => {
                let path = path.clone();
                let (child, spawner) = on_own_thread(move || {
                    let child = bwrap::command(&path, &launch, policy)
                        .and_then(|mut cmd| cmd.spawn().map_err(|e| chain(&e).to_string()))
                        .map_err(|e| SandboxError::Spawn(format!("bwrap: {e}")))?;
                    Ok((child, None))
                })
                .await?;
                Ok(Spawned::new(child, Some(backend), spawner))
            }
            Backend::Landlock { .. } => {
                if !policy.network {
                    return Err(unavailable(
                        "Landlock filters TCP only, so it cannot cut the network; bwrap can".into(),
                    ));
                }
                let (started, spawner) =
                    on_own_thread(move || landlock::start(launch, policy)).await?;
                Ok(Spawned::new(started, Some(backend), spawner))
            }
        }
    }
}

/// The command for `program args…` with `launch`'s directory, environment
/// and stdio, killed when dropped. The caller puts it in a group of its own
/// (`process_group(0)`, or `setsid` for bwrap).
fn command(
    program: &std::ffi::OsStr,
    args: &[OsString],
    launch: &Launch,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .current_dir(&launch.cwd)
        .env_clear()
        .envs(launch.env.iter().map(|(k, v)| (k, v)))
        .stdin(if launch.stdin {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// What a backend selection depends on: the choice and where bwrap is.
type Choice = (BackendChoice, Option<PathBuf>);

/// Picks the backend for `choice`, probing each candidate for real.
async fn select((choice, bwrap): &Choice) -> Result<Backend, String> {
    let choice = *choice;
    let mut why = Vec::new();
    if choice != BackendChoice::Landlock {
        match bwrap::probe(bwrap.clone()).await {
            Ok(path) => return Ok(Backend::Bwrap(path)),
            Err(e) => why.push(format!("bwrap: {e}")),
        }
    }
    if choice != BackendChoice::Bwrap {
        match landlock::probe().await {
            Ok(full) => return Ok(Backend::Landlock { full }),
            Err(e) => why.push(format!("Landlock: {e}")),
        }
    }
    Err(why.join("; "))
}

/// `program` found on `$PATH`.
fn on_path(program: &str) -> Option<PathBuf> {
    found_in(program, std::env::var_os("PATH").as_deref(), Path::new("/"))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_never_gets_more_than_its_parent() {
        let parent = Policy {
            mode: PermissionMode::WorkspaceWrite,
            network: false,
        };
        let asked = Policy {
            mode: PermissionMode::DangerFullAccess,
            network: true,
        };
        assert_eq!(parent.narrowed(Some(asked)), parent);
        let narrower = Policy {
            mode: PermissionMode::ReadOnly,
            network: true,
        };
        assert_eq!(
            parent.narrowed(Some(narrower)),
            Policy {
                mode: PermissionMode::ReadOnly,
                network: false
            }
        );
        assert_eq!(parent.narrowed(None), parent);
    }

    #[test]
    fn modes_parse_by_their_wire_names() {
        for mode in PermissionMode::ALL {
            assert_eq!(mode.as_str().parse::<PermissionMode>(), Ok(mode));
        }
        let err = "full".parse::<PermissionMode>().unwrap_err();
        assert!(chain(&err).to_string().contains("`full`"));
    }
}
