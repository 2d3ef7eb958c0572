mod acp;
mod architecture;
mod chat;
mod cli;
mod cluster;
mod conformance;
mod dashboard;
mod embedding;
mod hardening;
mod hooks;
mod mcp;
mod multi;
mod peers;
mod persistence;
mod process;
mod run;
mod trust;
mod web;

pub(crate) use process::{Bounded, DEADLINE, output_bounded, survivors, sweep, wait_bounded};

/// Whether a live (not zombie) process's command line holds `token`.
pub(crate) fn running(token: &str) -> bool {
    std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
        let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(") ")
            .is_some_and(|(_, rest)| rest.starts_with('Z'));
        !zombie
            && std::fs::read(p.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(token))
                .unwrap_or(false)
    })
}

/// This process's children that are zombies (exited, not reaped): their
/// names.
pub(crate) fn zombie_children() -> Vec<String> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
        let Some((head, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let mut fields = rest.split(' ');
        let (state, ppid) = (fields.next(), fields.next());
        if state == Some("Z") && ppid == Some(me.as_str()) {
            found.push(head.to_owned());
        }
    }
    found
}

/// Waits (at most a minute) until `done` holds, looking again every 2 ms;
/// `what` names what never happened.
pub(crate) async fn until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        // A pause, not a spin: a spinning test takes a core from the work
        // it waits for (and from the other tests) on a two-core machine.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// Waits until `fd` is readable (a listener's next connection), at most
/// until `deadline`; whether it is.
pub(crate) fn readable(fd: &impl std::os::fd::AsFd, deadline: std::time::Instant) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let left = deadline.saturating_duration_since(std::time::Instant::now());
    let Ok(left) = Timespec::try_from(left) else {
        return false;
    };
    let mut fds = [PollFd::new(fd, PollFlags::IN)];
    matches!(poll(&mut fds, Some(&left)), Ok(n) if n > 0)
}

/// Waits until process `pid` (any process, not only a child) has ended,
/// at most until `deadline`: on its pidfd, which is readable once it has.
/// Whether it ended.
pub(crate) fn ends(pid: i32, deadline: std::time::Instant) -> bool {
    let Some(pid) = rustix::process::Pid::from_raw(pid) else {
        return true;
    };
    match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()) {
        Ok(fd) => readable(&fd, deadline),
        // Gone already.
        Err(e) if e == rustix::io::Errno::SRCH => true,
        Err(e) => panic!("pidfd_open({}): {e}", pid.as_raw_nonzero()),
    }
}

/// [`until`] for a test without a runtime: it looks again every 5 ms (a
/// check that reads all of /proc, spun without a pause, takes a core from
/// the processes it waits for on a two-core machine).
pub(crate) fn until_blocking(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !done() {
        assert!(std::time::Instant::now() < deadline, "{what}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A test's directories: a workspace, a directory outside it, a sessions
/// directory, all under `base` (fresh, canonical).
pub(crate) struct Place {
    pub(crate) ws: std::path::PathBuf,
    pub(crate) outside: std::path::PathBuf,
    pub(crate) sessions: std::path::PathBuf,
    pub(crate) base: std::path::PathBuf,
}

/// A fresh [`Place`] named after `prefix`; the workspace and the outside
/// directory exist.
pub(crate) fn place(prefix: &str) -> Place {
    let base = dsh::kernel::scratch::fresh_dir(prefix)
        .unwrap()
        .canonicalize()
        .unwrap();
    let p = Place {
        ws: base.join("ws"),
        outside: base.join("outside"),
        sessions: base.join("sessions"),
        base,
    };
    for d in [&p.ws, &p.outside] {
        std::fs::create_dir_all(d).unwrap();
    }
    p
}

/// A `bash` call that touches `path` and asks to run unconfined for it.
pub(crate) fn escalated_touch(path: &std::path::Path) -> serde_json::Value {
    serde_json::json!({"name": "bash", "arguments": {
        "command": format!("touch {}", path.display()), "description": "touch",
        "sandbox_permissions": "danger-full-access", "justification": "the test asks for it"
    }})
}
