//! One hook as a child process: `sh -c COMMAND` under the calling agent's
//! sandbox and policy, in its working directory, with the JSON payload on
//! stdin and the secret-free environment plus the dialect's variables.
//! Its output is read up to a bound while it runs; it is killed (its whole
//! process group) at its timeout or when the turn or call it serves is
//! cancelled. Each run is a supervised task child (kind `hook`) under the
//! agent's scope, as a tool call is: it shows in the tree, and
//! the agent's teardown stops it (and its process) in order.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use std::sync::Arc;

use dsh_services::sandbox::{Launch, Policy, Sandbox};
use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, TaskEnd, TaskSpec};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use super::{Command, Ran};

/// The most of each stream a hook's answer is read from.
const MAX_OUTPUT: u64 = 1 << 20;

/// Where and how one hook runs.
pub(super) struct Invocation {
    pub command: Command,
    pub payload: String,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    pub policy: Policy,
    pub timeout: Duration,
    pub cancel: CancellationToken,
}

/// Runs the hook as a supervised task child of `ctx`'s fiber (`hook/POINT`
/// in the tree) and waits for what it did; never fails (a hook that could
/// not run says why in [`Ran::failure`]).
pub(super) async fn supervised(
    ctx: &Context,
    point: &str,
    sandbox: Arc<Sandbox>,
    inv: Invocation,
) -> Ran {
    let spec = TaskSpec::new("hook", format!("hook/{point}")).cancelled_by(&inv.cancel);
    let started = ctx.spawn_task(spec, move |cancel| async move {
        // The task's signal: cancelled with the turn or call, and by the
        // agent's teardown, which then awaits the kill.
        let inv = Invocation { cancel, ..inv };
        self::run(&sandbox, inv).await
    });
    let ended = match started {
        Ok(task) => task.join().await,
        Err(e) => {
            return Ran {
                failure: Some(format!("the hook could not be supervised: {}", chain(&e))),
                ..Ran::default()
            };
        }
    };
    ended.unwrap_or_else(|end| Ran {
        failure: Some(match end {
            TaskEnd::Panicked(m) => format!("running the hook panicked: {m}"),
            TaskEnd::Stopped => "the hook was stopped before it finished".into(),
        }),
        ..Ran::default()
    })
}

/// Runs the hook to its end, its timeout or the cancel.
async fn run(sandbox: &Sandbox, inv: Invocation) -> Ran {
    let started = Instant::now();
    let mut env = sandbox.child_env();
    for (k, v) in &inv.env {
        env.retain(|(name, _)| name != k.as_str());
        env.push((k.into(), v.into()));
    }
    let launch = Launch {
        argv: vec![
            OsString::from("sh"),
            OsString::from("-c"),
            OsString::from(&inv.command.command),
        ],
        cwd: inv.cwd.clone(),
        workspace: inv.cwd.clone(),
        env,
        stdin: true,
    };
    let mut spawned = match sandbox.spawn(launch, inv.policy).await {
        Ok(s) => s,
        Err(e) => {
            return Ran {
                failure: Some(format!("the hook could not start: {}", chain(&e))),
                duration: started.elapsed(),
                ..Ran::default()
            };
        }
    };
    let stdin = spawned.child.stdin.take();
    let stdout = spawned.child.stdout.take();
    let stderr = spawned.child.stderr.take();
    let payload = inv.payload;
    let write = async move {
        if let Some(mut stdin) = stdin {
            // A hook that does not read its input is not an error.
            let _ = stdin.write_all(payload.as_bytes()).await;
            let _ = stdin.shutdown().await;
        }
    };
    let all = async {
        let ((), out, err, status) =
            tokio::join!(write, read(stdout), read(stderr), spawned.child.wait());
        (out, err, status)
    };
    let ended = tokio::select! {
        done = all => Ok(done),
        () = tokio::time::sleep(inv.timeout) => Err(format!(
            "the hook timed out after {} s", inv.timeout.as_secs_f64()
        )),
        () = inv.cancel.cancelled() => Err("the hook was cancelled".to_owned()),
    };
    // Dropping `spawned` kills whatever of the hook is left.
    match ended {
        Ok((stdout, stderr, status)) => Ran {
            exit: status.ok().and_then(|s| s.code()),
            stdout,
            stderr,
            failure: None,
            duration: started.elapsed(),
        },
        Err(why) => Ran {
            failure: Some(why),
            duration: started.elapsed(),
            ..Ran::default()
        },
    }
}

/// A stream's text, up to [`MAX_OUTPUT`] bytes (the rest is drained so
/// the hook does not block on a full pipe).
async fn read(stream: Option<impl AsyncRead + Unpin>) -> String {
    let Some(mut stream) = stream else {
        return String::new();
    };
    let mut kept = Vec::new();
    let _ = (&mut stream).take(MAX_OUTPUT).read_to_end(&mut kept).await;
    let _ = tokio::io::copy(&mut stream, &mut tokio::io::sink()).await;
    String::from_utf8_lossy(&kept).into_owned()
}
