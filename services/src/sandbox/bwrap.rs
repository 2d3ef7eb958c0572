//! The bubblewrap profile.
//!
//! dsh may run as root, and bwrap run by root keeps its capabilities inside
//! unless told otherwise (a `mount -o remount,rw /` would succeed), so the
//! profile always takes a user namespace and drops every capability. The
//! host is visible read-only; `/dev` and `/proc` are fresh (the command sees
//! only its own processes, and host `/proc/<pid>` magic links cannot reach
//! around the mounts); `/tmp` is a private tmpfs. Under `workspace-write` the
//! workspace is bound writable after `/tmp`, so a workspace under `/tmp`
//! still works. The command runs in a new session and dies with its parent;
//! being PID 1's child in its own PID namespace, every process it starts
//! dies with the namespace.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Stdio;

use super::{Launch, PROBE_TIMEOUT, PermissionMode, Policy, on_path};

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
        "--new-session",
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
    let run = tokio::process::Command::new(&path)
        .args(arguments(&launch, policy))
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
