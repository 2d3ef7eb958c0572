//! The sandbox, attacked for real: bash under bwrap and under Landlock
//! (bwrap not chosen), each trying to leave the workspace — writing the
//! workspace's parent, the host's `/tmp`, through a symlink out, after
//! `setsid`, remounting `/` read-write — under `workspace-write` and
//! `read-only`; the network cut; secrets withheld from the environment.

use std::path::{Path, PathBuf};

use dsh_services::sandbox::{
    Backend, BackendChoice, Launch, PermissionMode, Policy, Sandbox, SandboxError, Settings,
};
use dsh_supervisors::scratch::fresh_dir;
use tokio::io::AsyncReadExt;

const WORKSPACE_WRITE: Policy = Policy {
    mode: PermissionMode::WorkspaceWrite,
    network: true,
};
const READ_ONLY: Policy = Policy {
    mode: PermissionMode::ReadOnly,
    network: true,
};

fn sandbox(backend: BackendChoice) -> Sandbox {
    Sandbox::new(Settings {
        backend,
        ..Settings::default()
    })
}

/// A workspace inside a fresh directory, and a sibling outside it.
fn layout() -> (PathBuf, PathBuf) {
    let base = fresh_dir("dsh-sandbox-test")
        .unwrap()
        .canonicalize()
        .unwrap();
    let ws = base.join("ws");
    let outside = base.join("outside");
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    (ws, outside)
}

/// Runs `script` with bash under `policy`; (exit code, stdout+stderr).
async fn run(
    sandbox: &Sandbox,
    ws: &Path,
    policy: Policy,
    script: &str,
) -> Result<(Option<i32>, String), SandboxError> {
    let launch = Launch {
        argv: vec!["bash".into(), "-c".into(), script.into()],
        cwd: ws.to_path_buf(),
        workspace: ws.to_path_buf(),
        env: sandbox.child_env(),
        stdin: false,
    };
    let mut spawned = sandbox.spawn(launch, policy).await?;
    let mut out = String::new();
    let mut err = String::new();
    let mut stdout = spawned.child.stdout.take().unwrap();
    let mut stderr = spawned.child.stderr.take().unwrap();
    let wait = async {
        let (a, b) = tokio::join!(
            stdout.read_to_string(&mut out),
            stderr.read_to_string(&mut err)
        );
        a.unwrap();
        b.unwrap();
        spawned.child.wait().await.unwrap()
    };
    let status = tokio::time::timeout(std::time::Duration::from_secs(60), wait)
        .await
        .expect("the command ends");
    Ok((status.code(), format!("{out}{err}")))
}

/// Every escape a command might try, each leaving a marker file if it works.
fn attacks(outside: &Path, host_tmp: &Path) -> Vec<(&'static str, String, PathBuf)> {
    vec![
        (
            "write outside",
            format!("echo pwned > {}/direct", outside.display()),
            outside.join("direct"),
        ),
        (
            "write the host /tmp",
            format!("echo pwned > {}", host_tmp.display()),
            host_tmp.to_path_buf(),
        ),
        (
            "symlink out",
            format!(
                "ln -s {0}/via-link link && echo pwned > link",
                outside.display()
            ),
            outside.join("via-link"),
        ),
        (
            "setsid",
            format!(
                "setsid bash -c 'echo pwned > {}/detached'; sleep 0.2",
                outside.display()
            ),
            outside.join("detached"),
        ),
        (
            "remount",
            format!(
                "mount -o remount,rw / && echo pwned > {}/remounted",
                outside.display()
            ),
            outside.join("remounted"),
        ),
    ]
}

async fn no_escape(choice: BackendChoice) {
    let sandbox = sandbox(choice);
    let backend = sandbox.backend().await.expect("the backend works here");
    match choice {
        BackendChoice::Bwrap => assert!(matches!(backend, Backend::Bwrap(_))),
        _ => assert!(matches!(backend, Backend::Landlock { .. })),
    }
    let (ws, outside) = layout();
    let host_tmp = std::env::temp_dir().join(format!(
        "dsh-sandbox-host-tmp-{}-{}",
        std::process::id(),
        backend.name()
    ));
    for policy in [WORKSPACE_WRITE, READ_ONLY] {
        for (name, script, marker) in attacks(&outside, &host_tmp) {
            let (code, output) = run(&sandbox, &ws, policy, &script).await.unwrap();
            assert!(
                !marker.exists(),
                "{} under {:?}: `{name}` escaped ({code:?}: {output})",
                backend.name(),
                policy.mode
            );
        }
    }
    // What the mode allows still works: the workspace and the private
    // temp directory under workspace-write, nothing under read-only.
    let (code, output) = run(
        &sandbox,
        &ws,
        WORKSPACE_WRITE,
        "echo ok > inside && echo tmp > \"$TMPDIR/scratch\" && cat \"$TMPDIR/scratch\"",
    )
    .await
    .unwrap();
    assert_eq!(code, Some(0), "{output}");
    assert_eq!(output.trim(), "tmp");
    assert!(ws.join("inside").exists());
    let (code, output) = run(&sandbox, &ws, READ_ONLY, "echo no > inside-ro")
        .await
        .unwrap();
    assert_ne!(code, Some(0), "{output}");
    assert!(!ws.join("inside-ro").exists());
    let denied = backend
        .denial_signatures()
        .iter()
        .any(|s| output.to_lowercase().contains(s));
    assert!(denied, "the denial is in the backend's words: {output}");
    // Unconfined is unconfined.
    let marker = outside.join("unconfined");
    let script = format!("echo yes > {}", marker.display());
    let unconfined = Policy {
        mode: PermissionMode::DangerFullAccess,
        network: true,
    };
    let (code, _) = run(&sandbox, &ws, unconfined, &script).await.unwrap();
    assert_eq!(code, Some(0));
    assert!(marker.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaves_the_bwrap_sandbox() {
    no_escape(BackendChoice::Bwrap).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_leaves_the_landlock_sandbox() {
    no_escape(BackendChoice::Landlock).await;
}

/// A listener on loopback and a script that connects to it.
async fn connect_script() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let script = format!("exec 3<>/dev/tcp/127.0.0.1/{port} && echo connected");
    (listener, script)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_network_is_cut_by_bwrap_and_landlock_refuses_to_pretend() {
    let (ws, _) = layout();
    let (_listener, script) = connect_script().await;
    let bwrap = sandbox(BackendChoice::Bwrap);
    let (code, output) = run(&bwrap, &ws, WORKSPACE_WRITE, &script).await.unwrap();
    assert_eq!((code, output.trim()), (Some(0), "connected"));
    let cut = Policy {
        network: false,
        ..WORKSPACE_WRITE
    };
    let (code, output) = run(&bwrap, &ws, cut, &script).await.unwrap();
    assert_ne!(code, Some(0), "{output}");
    assert!(!output.contains("connected"));
    // Unconfined files with the network cut: writes anywhere, no connect.
    let (_, outside) = layout();
    let marker = outside.join("offline-but-free");
    let free = Policy {
        mode: PermissionMode::DangerFullAccess,
        network: false,
    };
    let both = format!("echo x > {}; {script}", marker.display());
    let (code, output) = run(&bwrap, &ws, free, &both).await.unwrap();
    assert!(marker.exists(), "{output}");
    assert_ne!(code, Some(0), "{output}");
    assert!(!output.contains("connected"));
    // Landlock filters TCP only: a cut network cannot be promised.
    let landlock = sandbox(BackendChoice::Landlock);
    let err = run(&landlock, &ws, cut, &script).await.unwrap_err();
    assert!(matches!(err, SandboxError::Unavailable { .. }), "{err}");
    assert_eq!(err.code(), "SANDBOX_UNAVAILABLE");
    assert!(
        err.to_string()
            .contains("refusing to run the command unconfined")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_usable_backend_nothing_runs() {
    // Only bwrap allowed, and no bwrap where it is looked for: unavailable,
    // and the command never ran.
    let (ws, outside) = layout();
    let sandbox = Sandbox::new(Settings {
        backend: BackendChoice::Bwrap,
        bwrap: Some(ws.join("no-such-bwrap")),
        ..Settings::default()
    });
    let marker = outside.join("ran");
    let script = format!("echo ran > {}", marker.display());
    let err = run(&sandbox, &ws, WORKSPACE_WRITE, &script)
        .await
        .unwrap_err();
    assert_eq!(err.code(), "SANDBOX_UNAVAILABLE");
    assert!(err.to_string().contains("no-such-bwrap"), "{err}");
    assert!(!marker.exists());
    // A bwrap that cannot set up the profile is as good as none.
    let fake = ws.join("bwrap");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let sandbox = Sandbox::new(Settings {
        backend: BackendChoice::Bwrap,
        bwrap: Some(fake),
        ..Settings::default()
    });
    let err = run(&sandbox, &ws, READ_ONLY, &script).await.unwrap_err();
    assert!(err.to_string().contains("uid map"), "{err}");
    assert!(!marker.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_out_of_child_processes_unless_passed() {
    let (ws, _) = layout();
    // This process's own environment holds no test secret; the scrub is
    // checked on the list children get.
    let env = vec![
        ("PATH".into(), std::env::var_os("PATH").unwrap_or_default()),
        ("OPENAI_API_KEY".into(), "sk-1".into()),
        ("DSH_TOKEN".into(), "t".into()),
        ("HARMLESS".into(), "h".into()),
    ];
    let kept = dsh_services::sandbox::env::scrub(env.clone(), &[]);
    let names: Vec<_> = kept
        .iter()
        .map(|(k, _)| k.to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["PATH", "HARMLESS"]);
    let passed = dsh_services::sandbox::env::scrub(env, &["DSH_TOKEN".into()]);
    assert!(passed.iter().any(|(k, _)| k == "DSH_TOKEN"));
    // And the shell really gets only that.
    let sandbox = sandbox(BackendChoice::Auto);
    let launch = Launch {
        argv: vec![
            "bash".into(),
            "-c".into(),
            "echo \"[$OPENAI_API_KEY][$HARMLESS]\"".into(),
        ],
        cwd: ws.clone(),
        workspace: ws.clone(),
        env: kept,
        stdin: false,
    };
    let mut spawned = sandbox.spawn(launch, WORKSPACE_WRITE).await.unwrap();
    let mut out = String::new();
    spawned
        .child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .await
        .unwrap();
    assert_eq!(out.trim(), "[][h]");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_bwrap_auto_falls_back_to_landlock() {
    let (ws, outside) = layout();
    let sandbox = Sandbox::new(Settings {
        bwrap: Some(ws.join("no-such-bwrap")),
        ..Settings::default()
    });
    let backend = sandbox.backend().await.expect("Landlock works here");
    assert!(
        matches!(backend, Backend::Landlock { full: true }),
        "{backend:?}"
    );
    let marker = outside.join("fallback");
    let (_, output) = run(
        &sandbox,
        &ws,
        WORKSPACE_WRITE,
        &format!("echo x > {}", marker.display()),
    )
    .await
    .unwrap();
    assert!(!marker.exists(), "{output}");
}

/// A started command abandoned before anyone reaped it (its call dropped at
/// any await) takes its whole process group with it, under each backend
/// and unconfined: a background grandchild included.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abandoned_command_is_killed_with_its_group() {
    let (ws, _) = layout();
    let alive = |token: &str| {
        std::fs::read_dir("/proc").unwrap().flatten().any(|p| {
            std::fs::read(p.path().join("cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(token))
                .unwrap_or(false)
        })
    };
    let cases = [
        (BackendChoice::Bwrap, WORKSPACE_WRITE, "71.4321"),
        (BackendChoice::Landlock, WORKSPACE_WRITE, "72.4321"),
        (BackendChoice::Auto, Policy::escalated(), "73.4321"),
    ];
    for (choice, policy, token) in cases {
        let sandbox = sandbox(choice);
        let launch = Launch {
            argv: vec![
                "bash".into(),
                "-c".into(),
                format!("sleep {token} & echo started; wait").into(),
            ],
            cwd: ws.clone(),
            workspace: ws.clone(),
            env: sandbox.child_env(),
            stdin: false,
        };
        let mut spawned = sandbox.spawn(launch, policy).await.unwrap();
        // Started: its line is out, so the grandchild exists.
        let mut stdout = spawned.child.stdout.take().unwrap();
        let mut first = [0u8; 8];
        stdout.read_exact(&mut first).await.unwrap();
        assert_eq!(&first, b"started\n");
        assert!(alive(token), "{choice:?}: the sleep runs");
        drop(spawned);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while alive(token) {
            assert!(
                std::time::Instant::now() < deadline,
                "{choice:?}: the abandoned command's group lives on"
            );
            tokio::task::yield_now().await;
        }
    }
}

/// A command killed at any instant of bwrap's set-up leaves nothing behind:
/// the kill lands anywhere from before bwrap's fork to after the command
/// detached itself with `setsid`, and no process of it survives (bwrap's
/// own parent-death watch alone loses this race).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_killed_while_bwrap_sets_up_leaves_nothing() {
    let (ws, _) = layout();
    let sandbox = sandbox(BackendChoice::Bwrap);
    let token = "74.4321";
    for step in 0..60u64 {
        let launch = Launch {
            argv: vec![
                "bash".into(),
                "-c".into(),
                format!("setsid sleep {token} & sleep {token}").into(),
            ],
            cwd: ws.clone(),
            workspace: ws.clone(),
            env: sandbox.child_env(),
            stdin: false,
        };
        let spawned = sandbox.spawn(launch, WORKSPACE_WRITE).await.unwrap();
        // From at once to a few milliseconds in: bwrap's fork, its
        // namespace set-up, the exec, the command's own setsid.
        let started = std::time::Instant::now();
        while started.elapsed() < std::time::Duration::from_micros(step * step * 2) {
            tokio::task::yield_now().await;
        }
        drop(spawned);
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while super::tools::running(token) {
        assert!(
            std::time::Instant::now() < deadline,
            "a killed command lives on"
        );
        tokio::task::yield_now().await;
    }
}
