//! Bounds on the processes a test starts: nothing a test waits on may hang
//! it, and nothing it started outlives it.
//!
//! - [`Bounded::bounded_output`] is `Command::output` with a deadline: a
//!   process still running at [`DEADLINE`] is killed with everything it
//!   started, and the test fails naming the command and showing what it had
//!   printed so far.
//! - [`sweep`] makes the test process the reaper of everything it starts
//!   (`PR_SET_CHILD_SUBREAPER`), so processes that leave its process group
//!   (bwrap calls `setsid`; Chromium makes its own) stay its descendants; the
//!   guard kills them all when the test ends, passed or failed.
//!
//! nextest kills a test at 120 s (`.config/nextest.toml`); the deadline here
//! is shorter, so a hang fails with its output rather than a bare TIMEOUT.

use std::collections::HashMap;
use std::io::Read;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How long one process a test waits on may run.
pub(crate) const DEADLINE: Duration = Duration::from_secs(90);

/// How long a test holding a [`Sweep`] may run before its watchdog kills
/// everything it started (so a test blocked on one of them fails with what
/// it had read); 5 s later the watchdog ends the test process itself, still
/// before nextest's termination at 120 s.
pub(crate) const TEST_DEADLINE: Duration = Duration::from_secs(105);

/// Kills every descendant of this process when dropped; see the module docs.
#[must_use = "the guard sweeps when dropped: bind it to a variable"]
pub(crate) struct Sweep {
    /// Dropped with the guard, which stops the watchdog.
    _running: mpsc::Sender<()>,
}

/// Starts the guard for one test: from now on every process this test
/// starts, and everything those start, is swept when the guard drops, or by
/// the watchdog at [`TEST_DEADLINE`].
pub(crate) fn sweep() -> Sweep {
    nix::sys::prctl::set_child_subreaper(true).expect("PR_SET_CHILD_SUBREAPER");
    let (running, ended) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        // The guard dropping disconnects the channel: the test ended.
        if !matches!(
            ended.recv_timeout(TEST_DEADLINE),
            Err(mpsc::RecvTimeoutError::Timeout)
        ) {
            return;
        }
        eprintln!("the test ran past {TEST_DEADLINE:?}: killing every process it started");
        kill_descendants(std::process::id());
        if let Err(mpsc::RecvTimeoutError::Timeout) = ended.recv_timeout(Duration::from_secs(5)) {
            eprintln!("the test still runs 5 s after its processes were killed: ending it");
            std::process::exit(101);
        }
    });
    Sweep { _running: running }
}

/// This test's live descendants, one per line: pid, state and command
/// line (what a failed wait on them shows).
pub(crate) fn survivors() -> String {
    descendants(std::process::id())
        .into_iter()
        .map(|pid| {
            let dir = std::path::PathBuf::from(format!("/proc/{pid}"));
            let state = std::fs::read_to_string(dir.join("stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(") ")
                        .map(|(_, r)| r.chars().next().unwrap_or('?'))
                })
                .unwrap_or('?');
            let cmdline = std::fs::read(dir.join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            format!("{pid} {state} {cmdline}")
        })
        .collect::<Vec<_>>()
        .join("\n")
}

impl Drop for Sweep {
    fn drop(&mut self) {
        kill_descendants(std::process::id());
    }
}

/// The live descendants of `root` (not `root` itself), read from /proc.
fn descendants(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid ...`; comm may hold spaces and parentheses.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let mut fields = rest.split(' ');
        let state = fields.next().unwrap_or("Z");
        let Some(ppid) = fields.next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if state != "Z" {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let mut found = Vec::new();
    let mut stack = vec![root];
    while let Some(pid) = stack.pop() {
        for &child in children.get(&pid).into_iter().flatten() {
            found.push(child);
            stack.push(child);
        }
    }
    found
}

/// SIGKILLs `root`'s descendants, repeating while any remain (a dying
/// parent's children are re-parented to us as the reaper, not lost).
fn kill_descendants(root: u32) {
    for _ in 0..10 {
        let found = descendants(root);
        if found.is_empty() {
            return;
        }
        for pid in found {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Kills `pid` and everything under it.
fn kill_tree(pid: u32) {
    kill_descendants(pid);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    );
}

/// `Command::output` and `Child::wait`, bounded.
pub(crate) trait Bounded {
    /// The command's output, failing the test if it runs past `limit`; an
    /// error only when it cannot be started.
    fn output_within(&mut self, limit: Duration) -> std::io::Result<Output>;

    /// [`Bounded::output_within`] the standard [`DEADLINE`]: a drop-in for
    /// `Command::output`.
    fn bounded_output(&mut self) -> std::io::Result<Output> {
        self.output_within(DEADLINE)
    }
}

impl Bounded for Command {
    fn output_within(&mut self, limit: Duration) -> std::io::Result<Output> {
        let what = format!("{self:?}");
        // As `output()` does: no stdin, both outputs captured.
        let child = self
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        Ok(output_bounded(child, limit, &what))
    }
}

/// `Child::wait_with_output` bounded by `limit`: past it, the child and its
/// descendants are killed and the test fails naming `what` and showing what
/// the child had printed so far.
pub(crate) fn output_bounded(mut child: Child, limit: Duration, what: &str) -> Output {
    let stdout = child.stdout.take().map(drain);
    let stderr = child.stderr.take().map(drain);
    let status = wait_until(&mut child, Instant::now() + limit);
    let deadline = Instant::now() + Duration::from_secs(10);
    let (out, out_done) = stdout.map_or((Vec::new(), true), |d| d.collect(deadline));
    let (err, err_done) = stderr.map_or((Vec::new(), true), |d| d.collect(deadline));
    let shown = || {
        format!(
            "--- stdout so far ---\n{}\n--- stderr so far ---\n{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        )
    };
    match status {
        Some(status) if out_done && err_done => Output {
            status,
            stdout: out,
            stderr: err,
        },
        Some(_) => panic!(
            "{what} exited, but something it started still holds its output open\n{}",
            shown()
        ),
        None => panic!("{what} still running after {limit:?}: killed\n{}", shown()),
    }
}

/// Waits for `child` until `deadline`; past it, kills the child with its
/// descendants and returns `None`.
fn wait_until(child: &mut Child, deadline: Instant) -> Option<ExitStatus> {
    let pid = child.id();
    let (tx, rx) = mpsc::channel::<()>();
    // A watchdog that kills the tree at the deadline unless told it exited.
    let watchdog = std::thread::spawn(move || {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Err(mpsc::RecvTimeoutError::Timeout) => {
                kill_tree(pid);
                true
            }
            _ => false,
        }
    });
    let status = child.wait().expect("wait for a child");
    let _ = tx.send(());
    let killed = watchdog.join().unwrap_or(true);
    (!killed).then_some(status)
}

/// [`Child::wait`] bounded by [`DEADLINE`]: past it, the child and its
/// descendants are killed and the test fails naming `what`.
pub(crate) fn wait_bounded(child: &mut Child, what: &str) -> ExitStatus {
    wait_until(child, Instant::now() + DEADLINE)
        .unwrap_or_else(|| panic!("{what} still running after {DEADLINE:?}: killed"))
}

/// An output pipe read on its own thread, so a full pipe never stalls the child.
struct Drain {
    bytes: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    done: mpsc::Receiver<()>,
}

fn drain(mut pipe: impl Read + Send + 'static) -> Drain {
    let bytes = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (tx, done) = mpsc::channel();
    let sink = bytes.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        while let Ok(n) = pipe.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock()
                .expect("output buffer")
                .extend_from_slice(&buf[..n]);
        }
        let _ = tx.send(());
    });
    Drain { bytes, done }
}

impl Drain {
    /// What was read, and whether the pipe reached its end by `deadline`.
    fn collect(self, deadline: Instant) -> (Vec<u8>, bool) {
        let left = deadline.saturating_duration_since(Instant::now());
        let done = self.done.recv_timeout(left).is_ok();
        let bytes = std::mem::take(&mut *self.bytes.lock().expect("output buffer"));
        (bytes, done)
    }
}

/// A process past its deadline is killed with what it started (a `setsid`
/// one too), and the failure shows what it had printed.
#[test]
fn a_hung_process_fails_with_its_output_and_leaves_nothing_behind() {
    let _sweep = sweep();
    let hung = std::panic::catch_unwind(|| {
        Command::new("sh")
            .args([
                "-c",
                "echo started-4411; setsid sleep 1041.17 & sleep 1042.17",
            ])
            .output_within(Duration::from_secs(1))
    });
    let message = hung
        .expect_err("the deadline fails the test")
        .downcast::<String>()
        .expect("a formatted panic message");
    assert!(
        message.contains("still running after 1s: killed"),
        "{message}"
    );
    assert!(message.contains("started-4411"), "{message}");
    super::until_blocking("the hung process is gone", || !super::running("1042.17"));
    super::until_blocking("its setsid child is gone", || !super::running("1041.17"));
}

/// The guard kills what a test started when it ends, even a process that
/// left the process group and whose parent already exited.
#[test]
fn the_guard_kills_an_orphaned_setsid_process_when_the_test_ends() {
    let guard = sweep();
    let out = Command::new("sh")
        .args(["-c", "setsid sleep 1043.17 >/dev/null 2>&1 &"])
        .bounded_output()
        .expect("sh runs");
    assert!(out.status.success());
    super::until_blocking("the orphan starts", || super::running("1043.17"));
    drop(guard);
    super::until_blocking("the guard killed it", || !super::running("1043.17"));
}
