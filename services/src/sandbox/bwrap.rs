//! The bubblewrap profile.
//!
//! dsh may run as root, and bwrap run by root keeps its capabilities inside
//! unless told otherwise (a `mount -o remount,rw /` would succeed), so the
//! profile always takes a user namespace and drops every capability. The
//! host is visible read-only; `/dev` and `/proc` are fresh (the command sees
//! only its own processes, and host `/proc/<pid>` magic links cannot reach
//! around the mounts); `/tmp` is a private tmpfs. Under `workspace-write` the
//! workspace is bound writable after `/tmp`, so a workspace under `/tmp`
//! still works.
//!
//! bwrap runs under `setsid`: it leads a new session (no controlling
//! terminal, so nothing inside can push keystrokes into the user's) and a
//! process group that holds the namespace's init. bwrap's own
//! `--new-session` would move that init out of the group, leaving it to
//! `--die-with-parent`, which a kill during bwrap's set-up outruns; this
//! way one `killpg` reaches the init, and every process inside, however it
//! detached, dies with the PID namespace.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::OnceLock;

use super::{Launch, PROBE_TIMEOUT, PermissionMode, Policy, command as base, on_path};

/// `setsid` on `$PATH` (util-linux), looked up once.
fn setsid() -> Result<&'static Path, String> {
    static SETSID: OnceLock<Option<PathBuf>> = OnceLock::new();
    SETSID
        .get_or_init(|| on_path("setsid"))
        .as_deref()
        .ok_or_else(|| {
            "setsid (util-linux) is not on $PATH; bwrap needs it to lead a session".into()
        })
}

/// The command running `launch` under `policy` through bwrap at `path`.
pub(super) fn command(
    path: &Path,
    launch: &Launch,
    policy: Policy,
) -> Result<tokio::process::Command, String> {
    let mut args = vec![path.as_os_str().to_owned()];
    args.extend(arguments(launch, policy));
    // Not a group leader (no `process_group`), so `setsid` calls setsid(2)
    // and execs bwrap in place: the child's pid is the session's and the
    // group's.
    Ok(base(setsid()?.as_os_str(), &args, launch))
}

/// The arguments to `bwrap` running `launch` under `policy`.
pub(super) fn arguments(launch: &Launch, policy: Policy) -> Vec<OsString> {
    // `danger-full-access` reaches bwrap only to cut the network: then the
    // host stays writable.
    let root = match policy.mode {
        PermissionMode::DangerFullAccess => "--bind",
        _ => "--ro-bind",
    };
    let mut args: Vec<OsString> = [
        "--unshare-user",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--die-with-parent",
        "--cap-drop",
        "ALL",
        root,
        "/",
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
    ]
    .iter()
    .map(OsString::from)
    .collect();
    if policy.mode == PermissionMode::WorkspaceWrite {
        args.extend(["--tmpfs", "/tmp", "--setenv", "TMPDIR", "/tmp"].map(OsString::from));
        args.push("--bind".into());
        args.push(launch.workspace.clone().into_os_string());
        args.push(launch.workspace.clone().into_os_string());
    }
    if !policy.network {
        args.push("--unshare-net".into());
    }
    args.push("--chdir".into());
    args.push(launch.cwd.clone().into_os_string());
    args.push("--".into());
    args.extend(launch.argv.iter().cloned());
    args
}

/// `bwrap` at `path` (else on `$PATH`), if it can set up the profile here
/// (user namespaces may be disabled, as in many containers).
pub(super) async fn probe(path: Option<PathBuf>) -> Result<PathBuf, String> {
    let path = match path {
        Some(p) if super::is_executable(&p) => p,
        Some(p) => return Err(format!("{} is not an executable file", p.display())),
        None => on_path("bwrap").ok_or("not found on $PATH")?,
    };
    let launch = Launch {
        argv: vec!["true".into()],
        cwd: "/".into(),
        workspace: "/".into(),
        env: Vec::new(),
        stdin: false,
    };
    let policy = Policy {
        mode: PermissionMode::ReadOnly,
        network: false,
    };
    let run = command(&path, &launch, policy)?
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .output();
    match tokio::time::timeout(PROBE_TIMEOUT, run).await {
        Err(_) => Err(format!(
            "{} did not answer within {} s",
            path.display(),
            PROBE_TIMEOUT.as_secs()
        )),
        Ok(Err(e)) => Err(format!("{}: {e}", path.display())),
        Ok(Ok(out)) if out.status.success() => Ok(path),
        Ok(Ok(out)) => Err(format!(
            "{} cannot set up a sandbox here: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}
