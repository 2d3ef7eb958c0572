//! Built-in tools run for real: workspace confinement, read-before-edit,
//! bash timeouts and cancellation killing the whole process group.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use dsh_services::llm::{ContentBlock, LlmRuntime};
use dsh_services::providers::scripted::ScriptedModel;
use dsh_services::sandbox::{PermissionMode, Policy};
use dsh_services::tools::builtin::{Bash, Glob, Grep, file_tools};
use dsh_services::tools::{Resolution, Tool, ToolContext, ToolError, ToolOutput, ToolRegistry};
use dsh_supervisors::registry::RegisterError;
use dsh_supervisors::scratch::fresh_dir;
use dsh_supervisors::{Error as KernelError, Runtime, RuntimeSettings, ScopeKey};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

fn workspace() -> PathBuf {
    let dir = fresh_dir("dsh-tools").unwrap();
    dir.canonicalize().unwrap()
}

async fn call(
    tool: Arc<dyn Tool>,
    rt: &Runtime,
    cwd: &Path,
    args: Value,
) -> Result<ToolOutput, ToolError> {
    call_with(tool, rt, cwd, args, CancellationToken::new()).await
}

async fn call_with(
    tool: Arc<dyn Tool>,
    rt: &Runtime,
    cwd: &Path,
    args: Value,
    cancel: CancellationToken,
) -> Result<ToolOutput, ToolError> {
    let cx = ToolContext {
        call_id: "c1".into(),
        args,
        cancel,
        ctx: rt.root(),
        cwd: Arc::new(cwd.to_path_buf()),
        policy: Policy::default(),
    };
    tool.execute(cx).await
}

fn text(out: &ToolOutput) -> String {
    out.content
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

async fn rt() -> Runtime {
    Runtime::start(RuntimeSettings::default()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_tools_stay_inside_the_workspace() {
    let rt = rt().await;
    let ws = workspace();
    let outside = workspace();
    std::fs::write(outside.join("secret.txt"), "top secret").unwrap();
    std::os::unix::fs::symlink(outside.join("secret.txt"), ws.join("link.txt")).unwrap();
    let (read, write, _edit) = file_tools();
    let read: Arc<dyn Tool> = Arc::new(read);
    let write: Arc<dyn Tool> = Arc::new(write);
    for escape in [
        "../../etc/passwd",
        "/etc/passwd",
        "link.txt",
        "sub/../../x.txt",
    ] {
        let err = call(read.clone(), &rt, &ws, json!({"file_path": escape}))
            .await
            .unwrap_err();
        assert_eq!(err.code, "OUTSIDE_WORKSPACE", "{escape}: {err}");
    }
    let err = call(
        write.clone(),
        &rt,
        &ws,
        json!({"file_path": "../evil.txt", "content": "x"}),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, "OUTSIDE_WORKSPACE");
    assert!(!ws.parent().unwrap().join("evil.txt").exists());
    // Inside is fine, including new subdirectories.
    let out = call(
        write.clone(),
        &rt,
        &ws,
        json!({"file_path": "notes/a.txt", "content": "one\ntwo\n"}),
    )
    .await
    .unwrap();
    assert!(text(&out).contains("Created file"));
    let out = call(read.clone(), &rt, &ws, json!({"file_path": "notes/a.txt"}))
        .await
        .unwrap();
    assert!(text(&out).contains("1: one\n2: two\n"), "{}", text(&out));
    assert!(text(&out).contains("(End of file - total 2 lines)"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edit_requires_a_read_of_the_current_content() {
    let rt = rt().await;
    let ws = workspace();
    std::fs::write(ws.join("f.txt"), "alpha beta").unwrap();
    let (read, write, edit) = file_tools();
    let (read, write, edit): (Arc<dyn Tool>, Arc<dyn Tool>, Arc<dyn Tool>) =
        (Arc::new(read), Arc::new(write), Arc::new(edit));
    let args = json!({"file_path": "f.txt", "old_string": "beta", "new_string": "gamma"});
    assert_eq!(
        call(edit.clone(), &rt, &ws, args.clone())
            .await
            .unwrap_err()
            .code,
        "NOT_READ"
    );
    assert_eq!(
        call(
            write.clone(),
            &rt,
            &ws,
            json!({"file_path": "f.txt", "content": "x"})
        )
        .await
        .unwrap_err()
        .code,
        "NOT_READ"
    );
    call(read.clone(), &rt, &ws, json!({"file_path": "f.txt"}))
        .await
        .unwrap();
    std::fs::write(ws.join("f.txt"), "alpha beta delta").unwrap();
    assert_eq!(
        call(edit.clone(), &rt, &ws, args.clone())
            .await
            .unwrap_err()
            .code,
        "STALE_READ"
    );
    call(read.clone(), &rt, &ws, json!({"file_path": "f.txt"}))
        .await
        .unwrap();
    call(edit.clone(), &rt, &ws, args.clone()).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(ws.join("f.txt")).unwrap(),
        "alpha gamma delta"
    );
    // Its own edit counts as seen: a second edit needs no new read.
    let again =
        json!({"file_path": "f.txt", "old_string": "a", "new_string": "A", "replace_all": false});
    assert_eq!(
        call(edit.clone(), &rt, &ws, again).await.unwrap_err().code,
        "AMBIGUOUS"
    );
    let all =
        json!({"file_path": "f.txt", "old_string": "a", "new_string": "A", "replace_all": true});
    call(edit, &rt, &ws, all).await.unwrap();
    assert_eq!(
        std::fs::read_to_string(ws.join("f.txt")).unwrap(),
        "AlphA gAmmA deltA"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn glob_and_grep_search_the_workspace() {
    let rt = rt().await;
    let ws = workspace();
    std::fs::create_dir_all(ws.join("src/deep")).unwrap();
    std::fs::create_dir_all(ws.join(".git")).unwrap();
    std::fs::write(ws.join("src/deep/x.rs"), "fn main() {}\n// TODO: more\n").unwrap();
    std::fs::write(ws.join("src/y.txt"), "TODO later\n").unwrap();
    std::fs::write(ws.join(".git/config.rs"), "// TODO hidden vcs\n").unwrap();
    let out = call(Arc::new(Glob), &rt, &ws, json!({"pattern": "*.rs"}))
        .await
        .unwrap();
    assert_eq!(text(&out), "src/deep/x.rs\n");
    let out = call(Arc::new(Glob), &rt, &ws, json!({"pattern": "src/*.txt"}))
        .await
        .unwrap();
    assert_eq!(text(&out), "src/y.txt\n");
    let out = call(
        Arc::new(Grep),
        &rt,
        &ws,
        json!({"pattern": "TODO", "include": "*.rs"}),
    )
    .await
    .unwrap();
    assert_eq!(text(&out), "src/deep/x.rs:\n  2: // TODO: more\n");
    let err = call(Arc::new(Grep), &rt, &ws, json!({"pattern": "("}))
        .await
        .unwrap_err();
    assert_eq!(err.code, "INVALID_ARGS");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_reports_exit_codes_and_caps_output() {
    let rt = rt().await;
    let ws = workspace();
    let out = call(
        Arc::new(Bash),
        &rt,
        &ws,
        json!({"command": "echo hi; echo oops >&2; exit 3", "description": "t"}),
    )
    .await
    .unwrap();
    assert_eq!(text(&out), "hi\n[stderr]\noops\n\n[exit code: 3]");
    let out = call(
        Arc::new(Bash),
        &rt,
        &ws,
        json!({"command": "head -c 100000 /dev/zero | tr '\\0' a", "description": "t"}),
    )
    .await
    .unwrap();
    assert!(text(&out).starts_with("[output truncated: showing the last 30000 of 100000 bytes]"));
    let out = call(
        Arc::new(Bash),
        &rt,
        &ws,
        json!({"command": "pwd", "description": "t", "workdir": "."}),
    )
    .await
    .unwrap();
    assert_eq!(text(&out).trim(), ws.display().to_string());
    let err = call(
        Arc::new(Bash),
        &rt,
        &ws,
        json!({"command": "pwd", "description": "t", "workdir": "/"}),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, "OUTSIDE_WORKSPACE");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bash_timeout_kills_the_whole_process_group() {
    let rt = rt().await;
    let ws = workspace();
    // Found by its command line: under bwrap `$!` is a PID of the
    // sandbox's own namespace, not the host's.
    let command = "sleep 30.0917 & wait";
    let err = call(
        Arc::new(Bash),
        &rt,
        &ws,
        json!({"command": command, "description": "t", "timeoutMs": 300}),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, "TIMEOUT");
    assert!(
        all_gone("30.0917").await,
        "the background child survived the timeout"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_bash_mid_run_kills_it() {
    let rt = rt().await;
    let ws = workspace();
    let fifo = ws.join("started");
    assert!(
        std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let cancel = CancellationToken::new();
    let running = tokio::spawn({
        let (rt, ws, cancel) = (rt.clone(), ws.clone(), cancel.clone());
        async move {
            call_with(
                Arc::new(Bash),
                &rt,
                &ws,
                json!({"command": "echo go > started; sleep 30.0918", "description": "t"}),
                cancel,
            )
            .await
        }
    });
    // Opening the FIFO blocks until the command writes: a real start signal.
    tokio::task::spawn_blocking(move || std::fs::read_to_string(fifo).unwrap())
        .await
        .unwrap();
    cancel.cancel();
    let err = running.await.unwrap().unwrap_err();
    assert_eq!(err.code, "ABORTED");
    // Found by its command line (`$$` would be the sandbox's own PID).
    assert!(all_gone("30.0918").await, "the command survived the cancel");
}

/// A registration through an owner that is already unloading is refused,
/// and what it put in its table is taken back at once: no tool or model
/// route is left behind with no owner to remove it.
#[tokio::test]
async fn a_registration_refused_by_its_owner_leaves_nothing_behind() {
    let rt = rt().await;
    let key = ScopeKey::new("gone");
    let scope = rt.root().scope(key.clone()).await.unwrap();
    let ctx = scope.ctx().clone();
    scope.dispose().await;

    let tools = Arc::new(ToolRegistry::new());
    let err = tools.register(&ctx, Arc::new(Glob)).unwrap_err();
    assert!(
        matches!(
            err,
            RegisterError::Kernel(KernelError::InactiveFiber { .. })
        ),
        "{err}"
    );
    assert!(tools.visible(Some(&key)).is_empty());
    assert!(matches!(
        tools.resolve(Some(&key), "glob"),
        Resolution::Unknown
    ));

    let llm = Arc::new(LlmRuntime::new());
    let model = Arc::new(ScriptedModel::new(Vec::new()));
    let err = llm.register(&ctx, &["gone"], model).unwrap_err();
    assert!(matches!(err, RegisterError::Kernel(_)), "{err}");
    assert!(llm.providers().is_empty());
    assert!(llm.adapter("gone").is_none());
    rt.shutdown().await;
}

fn call_under(
    tool: Arc<dyn Tool>,
    rt: &Runtime,
    cwd: &Path,
    args: Value,
    policy: Policy,
) -> impl std::future::Future<Output = Result<ToolOutput, ToolError>> {
    let cx = ToolContext {
        call_id: "c1".into(),
        args,
        cancel: CancellationToken::new(),
        ctx: rt.root(),
        cwd: Arc::new(cwd.to_path_buf()),
        policy,
    };
    tool.execute(cx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_symlink_carries_a_write_out_of_the_workspace() {
    let rt = rt().await;
    let ws = workspace();
    let outside = workspace();
    // A dangling link to a file outside (the escape `exists()` let through),
    // a relative one, and a link to a directory outside.
    std::os::unix::fs::symlink(outside.join("target.txt"), ws.join("dangle")).unwrap();
    let relative = format!(
        "../{}/relative.txt",
        outside.file_name().unwrap().to_string_lossy()
    );
    std::os::unix::fs::symlink(&relative, ws.join("dangle-rel")).unwrap();
    std::os::unix::fs::symlink(&outside, ws.join("dir")).unwrap();
    let (_read, write, _edit) = file_tools();
    let write: Arc<dyn Tool> = Arc::new(write);
    for path in ["dangle", "dangle-rel", "dir/new.txt", "dir/sub/new.txt"] {
        let err = call(
            write.clone(),
            &rt,
            &ws,
            json!({"file_path": path, "content": "pwned"}),
        )
        .await
        .unwrap_err();
        assert_eq!(err.code, "OUTSIDE_WORKSPACE", "{path}: {err}");
        assert!(err.message.contains("`sandbox_permissions`"), "{err}");
    }
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    // A link that stays inside is followed.
    std::fs::create_dir(ws.join("real")).unwrap();
    std::os::unix::fs::symlink("real", ws.join("alias")).unwrap();
    call(
        write.clone(),
        &rt,
        &ws,
        json!({"file_path": "alias/in.txt", "content": "fine"}),
    )
    .await
    .unwrap();
    assert_eq!(
        std::fs::read_to_string(ws.join("real/in.txt")).unwrap(),
        "fine"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_mode_decides_what_the_file_tools_may_change() {
    let rt = rt().await;
    let ws = workspace();
    let outside = workspace();
    let (_read, write, edit) = file_tools();
    let (write, edit): (Arc<dyn Tool>, Arc<dyn Tool>) = (Arc::new(write), Arc::new(edit));
    let read_only = Policy {
        mode: PermissionMode::ReadOnly,
        network: true,
    };
    let err = call_under(
        write.clone(),
        &rt,
        &ws,
        json!({"file_path": "new.txt", "content": "x"}),
        read_only,
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, "DENIED");
    assert!(err.message.contains("read-only"), "{err}");
    assert!(!ws.join("new.txt").exists());
    std::fs::write(ws.join("f.txt"), "a").unwrap();
    let err = call_under(
        edit.clone(),
        &rt,
        &ws,
        json!({"file_path": "f.txt", "old_string": "a", "new_string": "b"}),
        read_only,
    )
    .await
    .unwrap_err();
    assert_eq!(err.code, "DENIED");
    // Unconfined (a standing danger-full-access, or one approved call),
    // absolute paths elsewhere are reachable.
    let target = outside.join("granted.txt");
    call_under(
        write,
        &rt,
        &ws,
        json!({"file_path": target.display().to_string(), "content": "ok"}),
        Policy::escalated(),
    )
    .await
    .unwrap();
    assert_eq!(std::fs::read_to_string(&target).unwrap(), "ok");
}

mod link_layouts {
    use super::*;
    use proptest::prelude::*;

    /// What one name in the workspace is.
    #[derive(Clone, Debug)]
    enum Entry {
        Missing,
        File,
        Dir,
        Link(usize),
    }

    /// Where links point: inside, outside, dangling, absolute, looping.
    fn targets(ws: &Path, outside: &Path) -> Vec<String> {
        let out = outside.file_name().unwrap().to_string_lossy().into_owned();
        vec![
            format!("../{out}/t"),
            format!("../{out}"),
            outside.join("t").display().to_string(),
            outside.display().to_string(),
            "a".into(),
            "b/c".into(),
            "..".into(),
            ".".into(),
            ws.join("a").display().to_string(),
            "loop".into(),
            "b/../../x".into(),
        ]
    }

    /// Every path under `dir`, what it is and holds (links not followed).
    fn snapshot(dir: &Path) -> Vec<(PathBuf, String)> {
        let mut seen = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                let p = e.path();
                let m = std::fs::symlink_metadata(&p).unwrap();
                let what = if m.file_type().is_symlink() {
                    format!("link {}", std::fs::read_link(&p).unwrap().display())
                } else if m.is_dir() {
                    stack.push(p.clone());
                    "dir".into()
                } else {
                    std::fs::read_to_string(&p).unwrap_or_default()
                };
                seen.push((p, what));
            }
        }
        seen.sort();
        seen
    }

    fn entry() -> impl Strategy<Value = Entry> {
        prop_oneof![
            Just(Entry::Missing),
            Just(Entry::File),
            Just(Entry::Dir),
            (0usize..11).prop_map(Entry::Link),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Whatever links the workspace holds and whatever path is asked
        /// for, a write either lands inside the workspace or is refused;
        /// the directory beside it is never touched.
        #[test]
        fn a_write_never_lands_outside(
            layout in proptest::collection::vec(entry(), 4),
            inner in proptest::collection::vec(entry(), 2),
            path in proptest::collection::vec(prop_oneof![
                Just("a"), Just("b"), Just("c"), Just("loop"), Just(".."), Just("."), Just("t"), Just("new")
            ], 1..4),
        ) {
            let ws = workspace();
            let outside = workspace();
            std::fs::write(outside.join("t"), "outside").unwrap();
            let targets = targets(&ws, &outside);
            let make = |dir: &Path, name: &str, e: &Entry| match e {
                Entry::Missing => {}
                Entry::File => std::fs::write(dir.join(name), "inside").unwrap(),
                Entry::Dir => std::fs::create_dir_all(dir.join(name)).unwrap(),
                Entry::Link(i) => {
                    let target = if targets[*i] == "loop" { name.to_owned() } else { targets[*i].clone() };
                    std::os::unix::fs::symlink(target, dir.join(name)).unwrap();
                }
            };
            for (name, e) in ["a", "b", "c", "loop"].iter().zip(&layout) {
                make(&ws, name, e);
            }
            if ws.join("b").is_dir() && !std::fs::symlink_metadata(ws.join("b")).unwrap().file_type().is_symlink() {
                for (name, e) in ["c", "d"].iter().zip(&inner) {
                    make(&ws.join("b"), name, e);
                }
            }
            let before = snapshot(&outside);
            let given = path.join("/");
            let outcome = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(async {
                    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
                    let (_r, write, _e) = file_tools();
                    let out = call(Arc::new(write), &rt, &ws, json!({"file_path": given, "content": "written"})).await;
                    rt.shutdown().await;
                    out
                });
            prop_assert_eq!(snapshot(&outside), before, "`{}` reached outside", given);
            if let Ok(out) = outcome {
                let shown = text(&out);
                let path = shown.split("<path>").nth(1).and_then(|s| s.split("</path>").next()).unwrap();
                let real = std::fs::canonicalize(path).unwrap();
                prop_assert!(real.starts_with(&ws), "`{}` wrote {}", given, real.display());
            }
        }
    }
}

/// Whether a live (not zombie) process's command line contains `token`.
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

/// Whether no process runs `token` before the deadline (a killed process
/// takes a moment to become a zombie).
async fn all_gone(token: &str) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while running(token) {
        if std::time::Instant::now() > deadline {
            // What survived, for the failure's reader: state, parent, group.
            for p in std::fs::read_dir("/proc").unwrap().flatten() {
                let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
                if String::from_utf8_lossy(&cmdline).contains(token) {
                    let stat = std::fs::read_to_string(p.path().join("stat")).unwrap_or_default();
                    eprintln!("survivor: {stat}");
                }
            }
            return false;
        }
        // No event marks another parent's process dying: look again.
        tokio::task::yield_now().await;
    }
    true
}

/// Whatever a command starts dies with its call — what `setsid` or a
/// double fork took out of its process group too — under bwrap, under
/// Landlock and unconfined; a background process holding the output pipe
/// does not keep the call waiting; a timeout keeps what was printed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nothing_a_command_starts_outlives_its_call() {
    use dsh_services::sandbox::{BackendChoice, Sandbox, Settings};
    for (n, (backend, policy)) in [
        (BackendChoice::Bwrap, Policy::default()),
        (BackendChoice::Landlock, Policy::default()),
        (BackendChoice::Auto, Policy::escalated()),
    ]
    .into_iter()
    .enumerate()
    {
        let rt = rt().await;
        rt.root()
            .provide(
                Sandbox::SERVICE,
                Arc::new(Sandbox::new(Settings {
                    backend,
                    ..Settings::default()
                })),
            )
            .unwrap();
        let ws = workspace();
        let token = |k: u32| format!("{}.{n}{k}7", 80 + k);
        let bash = |command: String, timeout: u32| {
            call_under(
                Arc::new(Bash),
                &rt,
                &ws,
                json!({"command": command, "description": "t", "timeoutMs": timeout}),
                policy,
            )
        };
        let detached = format!(
            "setsid sleep {} >/dev/null 2>&1 </dev/null & (sleep {} >/dev/null 2>&1 </dev/null &); echo done",
            token(1),
            token(2)
        );
        let out = bash(detached, 20_000).await.unwrap();
        assert!(text(&out).contains("done"), "{backend:?}: {}", text(&out));
        assert!(
            all_gone(&token(1)).await,
            "{backend:?}: a setsid child survived"
        );
        assert!(
            all_gone(&token(2)).await,
            "{backend:?}: a double-forked child survived"
        );
        // Holding stdout open does not hold the call until its timeout.
        let held = format!("setsid sleep {} & echo held", token(3));
        let out = bash(held, 20_000).await;
        assert!(
            out.as_ref().is_ok_and(|o| text(o).contains("held")),
            "{backend:?}: {:?}",
            out.map(|o| text(&o))
        );
        assert!(all_gone(&token(3)).await, "{backend:?}");
        // A timeout keeps the output printed before the kill.
        let slow = format!("echo before-the-kill; sleep {}", token(4));
        let err = bash(slow, 300).await.unwrap_err();
        assert_eq!(err.code, "TIMEOUT", "{backend:?}: {err}");
        assert!(
            err.message.contains("before-the-kill"),
            "{backend:?}: {err}"
        );
        assert!(all_gone(&token(4)).await, "{backend:?}");
        rt.shutdown().await;
    }
}

/// The `tool-guidance` prompt section lists what each tool the assembling
/// agent can see says about itself, in name order, and follows a
/// restriction or a registration (the registry's generation) at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_guidance_follows_the_tools_an_agent_sees() {
    use dsh_services::prompt::SystemPrompt;
    use dsh_services::tools::Restriction;
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let root = rt.root();
    let tools = Arc::new(ToolRegistry::new());
    let prompt = Arc::new(SystemPrompt::new());
    prompt
        .section(&root, dsh_services::tools::guidance::section(tools.clone()))
        .unwrap();
    assert_eq!(
        prompt.assemble(&root).await.unwrap(),
        "",
        "no tools, no section"
    );
    tools.register(&root, Arc::new(Grep)).unwrap();
    tools.register(&root, Arc::new(Bash)).unwrap();
    let all = prompt.assemble(&root).await.unwrap();
    assert!(all.starts_with("# Tools\n- `bash` is for"), "{all}");
    let (bash, grep) = (
        all.find("`bash` is").unwrap(),
        all.find("Use `grep`").unwrap(),
    );
    assert!(bash < grep, "name order: {all}");
    // An agent whose tools are restricted reads only about its own.
    let scope = root.scope(ScopeKey::new("child")).await.unwrap();
    tools
        .restrict(
            scope.ctx(),
            Restriction {
                allow: Some(vec!["grep".into()]),
                deny: Vec::new(),
            },
        )
        .unwrap();
    let child = prompt.assemble(scope.ctx()).await.unwrap();
    assert!(
        child.contains("Use `grep`") && !child.contains("`bash`"),
        "{child}"
    );
    // The root's text is not the child's (one cache entry each).
    assert_eq!(prompt.assemble(&root).await.unwrap(), all);
    rt.shutdown().await;
}

/// `long {n}` → n bytes of numbered lines.
struct Long;
impl Tool for Long {
    fn schema(&self) -> dsh_services::llm::ToolSchema {
        dsh_services::llm::ToolSchema {
            name: "long".into(),
            description: "a long result".into(),
            parameters: json!({"type": "object", "properties": {"n": {"type": "integer"}}}),
        }
    }
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> futures::future::BoxFuture<'static, Result<ToolOutput, ToolError>> {
        let n = cx.args["n"].as_u64().unwrap_or(0) as usize;
        let mut text = String::new();
        let mut i = 0;
        while text.len() < n {
            i += 1;
            text.push_str(&format!("line {i}\n"));
        }
        text.truncate(n);
        Box::pin(async move { Ok(ToolOutput::text(text)) })
    }
}

async fn through_pipeline(rt: &Runtime, registry: &ToolRegistry, ws: &Path, n: usize) -> String {
    let outcome = dsh_services::tools::run_pipeline(
        &rt.root(),
        registry,
        None,
        dsh_services::tools::ToolCall {
            id: "c1".into(),
            name: "long".into(),
            arguments: json!({ "n": n }).to_string(),
        },
        CancellationToken::new(),
        dsh_services::tools::Bounds::workspace(ws),
    )
    .await;
    assert!(outcome.error.is_none(), "{outcome:?}");
    outcome
        .content
        .iter()
        .filter_map(|b| match b {
            ContentBlock::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// A long plain-text result is kept whole in a private file and the model
/// reads its head, its tail and the path, which `read` then reads
/// (beneath the spill root, under read-only too); a short one passes as it
/// is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_result_is_spilled_and_read_back_by_its_path() {
    use dsh_services::tools::SpillStore;
    use std::os::unix::fs::PermissionsExt;
    let rt = rt().await;
    let ws = workspace();
    let root = workspace().join("spill");
    rt.root()
        .provide(
            SpillStore::SERVICE,
            Arc::new(SpillStore::new(root.clone(), 4096)),
        )
        .unwrap();
    let registry = Arc::new(ToolRegistry::new());
    registry.register(&rt.root(), Arc::new(Long)).unwrap();
    assert_eq!(through_pipeline(&rt, &registry, &ws, 100).await.len(), 100);
    let shown = through_pipeline(&rt, &registry, &ws, 50_000).await;
    assert!(shown.len() <= 4096, "{}", shown.len());
    assert!(shown.starts_with("line 1\nline 2\n"), "{shown}");
    assert!(shown.contains("bytes omitted"));
    let path = shown
        .split("the whole of it is in ")
        .nth(1)
        .and_then(|s| s.split(". Read it with the read tool").next())
        .unwrap()
        .to_owned();
    let whole = std::fs::read_to_string(&path).unwrap();
    assert_eq!(whole.len(), 50_000);
    assert!(whole.ends_with(
        &shown[shown.find("\n\n[This").unwrap() - 20..shown.find("\n\n[This").unwrap()]
    ));
    // Private: the root, the session directory, the file.
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&root), 0o700);
    assert_eq!(mode(Path::new(&path).parent().unwrap()), 0o700);
    assert_eq!(mode(Path::new(&path)), 0o600);
    // `read` reads it by that path, even read-only and outside the
    // workspace.
    let (read, _, _) = file_tools();
    let read: Arc<dyn Tool> = Arc::new(read);
    let read_only = Policy {
        mode: PermissionMode::ReadOnly,
        network: false,
    };
    let out = call_under(
        read.clone(),
        &rt,
        &ws,
        json!({"file_path": path, "offset": 5000, "limit": 2}),
        read_only,
    )
    .await
    .unwrap();
    assert!(text(&out).contains("5000: line 5000"), "{}", text(&out));
    // A link planted in the spill root leads nowhere outside it.
    let secret = workspace().join("secret.txt");
    std::fs::write(&secret, "secret").unwrap();
    let link = Path::new(&path).parent().unwrap().join("planted.txt");
    std::os::unix::fs::symlink(&secret, &link).unwrap();
    let err = call_under(read, &rt, &ws, json!({"file_path": link}), read_only)
        .await
        .unwrap_err();
    assert_eq!(err.code, "OUTSIDE_WORKSPACE", "{err}");
    rt.shutdown().await;
}

/// A spill root someone else prepared — a symlink to elsewhere, or a
/// directory open to others — is never written: the result stays inline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_spill_root_is_refused_and_the_result_stays_inline() {
    use dsh_services::tools::SpillStore;
    use std::os::unix::fs::PermissionsExt;
    let elsewhere = workspace();
    let linked = workspace().join("linked");
    std::os::unix::fs::symlink(&elsewhere, &linked).unwrap();
    let open = workspace().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    for root in [linked, open.clone()] {
        let store = SpillStore::new(root.clone(), 2048);
        let out = store
            .apply("s", "long", ToolOutput::text("x".repeat(10_000)))
            .await;
        assert_eq!(text(&out).len(), 10_000, "{}", root.display());
    }
    assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
    // Not text only (an image beside it): passed as it is.
    let store = SpillStore::new(workspace().join("fine"), 2048);
    let mixed = ToolOutput {
        content: vec![
            ContentBlock::text("y".repeat(10_000)),
            ContentBlock::Image {
                fields: serde_json::Map::new(),
            },
        ],
        meta: None,
    };
    assert_eq!(
        store.apply("s", "long", mixed.clone()).await.content,
        mixed.content
    );
}
