//! The Landlock backend, without `unsafe`.
//!
//! Landlock restricts the calling *thread* and everything it starts
//! afterwards. So each command gets an OS thread of its own (never a tokio
//! worker, never the blocking pool, whose threads are reused): the thread
//! restricts itself, spawns the command (the child inherits the domain
//! across `fork` and `exec`) and waits, parked, until the command is
//! dropped (see `Spawner`). The rules: read and execute
//! everywhere; write only `/dev/null`, and under `workspace-write` the
//! workspace and a private temp directory (`TMPDIR` points there). Signals
//! to processes outside the domain are refused too (ABI 6), so a command
//! cannot kill dsh. Landlock also forbids `mount` to a restricted thread.
//!
//! What Landlock cannot do that bwrap does: cut the network (it filters TCP
//! only; a policy without network is refused before this module), and
//! stop `chmod`/`chown` on files it may read (metadata is not an access
//! right it governs).

use std::ffi::OsString;
use std::path::Path;

use dsh_supervisors::error::chain;
use landlock::{
    ABI, Access, AccessFs, CompatLevel, Compatible, Ruleset, RulesetAttr, RulesetCreatedAttr,
    RulesetStatus, Scope, path_beneath_rules,
};
use tokio::sync::oneshot;

use super::{
    Launch, PROBE_TIMEOUT, PermissionMode, Policy, PrivateTmp, SandboxError, command, guarded,
};

/// The newest ABI whose rights we ask for; older kernels enforce a subset
/// (reported as partial).
const ABI_ASKED: ABI = ABI::V7;

/// Restricts the calling thread: reads everywhere, writes only under
/// `writable`. Returns whether every asked right is enforced.
fn restrict(writable: &[&Path]) -> Result<bool, String> {
    let all = AccessFs::from_all(ABI_ASKED);
    let mut created = Ruleset::default()
        .set_compatibility(CompatLevel::BestEffort)
        .handle_access(all)
        .and_then(|r| r.scope(Scope::Signal))
        .and_then(|r| r.create())
        .map_err(|e| chain(&e).to_string())?;
    created = created
        .add_rules(path_beneath_rules(["/"], AccessFs::from_read(ABI_ASKED)))
        .and_then(|r| r.add_rules(path_beneath_rules(["/dev/null"], all)))
        .and_then(|r| r.add_rules(path_beneath_rules(writable, all)))
        .map_err(|e| chain(&e).to_string())?;
    let status = created.restrict_self().map_err(|e| chain(&e).to_string())?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok(true),
        RulesetStatus::PartiallyEnforced => Ok(false),
        RulesetStatus::NotEnforced => Err("the kernel does not enforce Landlock".into()),
    }
}

/// Whether Landlock works here (restricting a throwaway thread); `true`
/// when every asked right is enforced.
pub(super) async fn probe() -> Result<bool, String> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("dsh-landlock-probe".into())
        .spawn(move || {
            let _ = tx.send(restrict(&[]));
        })
        .map_err(|e| format!("cannot start a probe thread: {}", chain(&e)))?;
    match tokio::time::timeout(PROBE_TIMEOUT, rx).await {
        Ok(Ok(verdict)) => verdict,
        Ok(Err(_)) => Err("the probe thread ended without an answer".into()),
        Err(_) => Err("the probe did not answer".into()),
    }
}

/// Starts `launch` confined under `policy` (a mode that confines), from
/// the calling thread, which it restricts: call it on a thread of its own
/// (never a tokio worker or the blocking pool, whose threads are reused).
/// The command runs behind the parent-death guard.
pub(super) fn start(
    mut launch: Launch,
    policy: Policy,
) -> Result<(tokio::process::Child, Option<PrivateTmp>), SandboxError> {
    let tmp = match policy.mode {
        PermissionMode::WorkspaceWrite => Some(PrivateTmp::create().map_err(|e| {
            SandboxError::Spawn(format!(
                "cannot create a private temp directory: {}",
                chain(&e)
            ))
        })?),
        _ => None,
    };
    let mut writable: Vec<&Path> = Vec::new();
    if let Some(t) = &tmp {
        writable.push(&t.0);
        writable.push(&launch.workspace);
        let dir: OsString = t.0.clone().into_os_string();
        launch.env.retain(|(k, _)| k != "TMPDIR");
        launch.env.push(("TMPDIR".into(), dir));
    }
    restrict(&writable).map_err(|e| SandboxError::Spawn(format!("Landlock: {e}")))?;
    let argv = guarded(&launch);
    let child = command(&argv[0], &argv[1..], &launch)
        .process_group(0)
        .spawn()
        .map_err(|e| SandboxError::Spawn(chain(&e).to_string()))?;
    Ok((child, tmp))
}
