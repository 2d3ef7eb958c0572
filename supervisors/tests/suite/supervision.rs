//! Restart policies, strategies, intensity and escalation, panics.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_supervisors::{
    ChildPolicy, Context, Fiber, PluginOptions, Restart, Runtime, Status, Strategy, SupervisorSpec,
    TreeChange, WorkerRef, WorkerSpec, plugin_fn,
};

use super::common::{Log, Msg, Recorder, bounded, runtime, wait_change};

type Workers = Arc<Mutex<Vec<WorkerRef<Msg>>>>;

/// A supervisor fiber with three restartable workers a, b, c.
async fn supervisor(
    rt: &Runtime,
    strategy: Strategy,
    intensity: u32,
    log: &Log,
) -> (Fiber, Workers) {
    let workers: Workers = Arc::default();
    let (l, w) = (log.clone(), workers.clone());
    let fiber = rt
        .root()
        .plugin_with(
            plugin_fn("sup", &[], move |ctx: Context| {
                let (l, w) = (l.clone(), w.clone());
                async move {
                    ctx.supervise(SupervisorSpec {
                        strategy,
                        intensity,
                        period: Duration::from_secs(3600),
                    });
                    for name in ["a", "b", "c"] {
                        let l = l.clone();
                        let spec = WorkerSpec::restartable("worker", name, move || {
                            (Recorder::new(name, &l), ())
                        });
                        let worker = ctx.spawn(spec).await?;
                        w.lock().unwrap().push(worker);
                    }
                    Ok(())
                }
            }),
            (),
            PluginOptions {
                name: Some("sup".into()),
                policy: ChildPolicy {
                    restart: Restart::Temporary,
                    ..ChildPolicy::PLUGIN
                },
            },
        )
        .await
        .unwrap();
    (fiber, workers)
}

fn child_names(rt: &Runtime, fiber: &Fiber) -> Vec<String> {
    fiber
        .children()
        .into_iter()
        .map(|id| rt.tree().get(id).unwrap().name)
        .collect()
}

/// Panics the current worker `b` and waits until it was restarted.
async fn crash_b(rt: &Runtime, log: &Log, text: &'static str) -> String {
    let mut feed = rt.tree().subscribe();
    log.actor("b").send_message(Msg::Panic(text)).unwrap();
    let change = wait_change(&mut feed, |c| matches!(c, TreeChange::Supervision { .. })).await;
    let TreeChange::Supervision {
        message, action, ..
    } = change
    else {
        unreachable!()
    };
    assert_eq!(
        action, "restarted",
        "published once the restart is complete"
    );
    message
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_for_one_restarts_only_the_failed_child() {
    let rt = runtime().await;
    let log = Log::default();
    let (fiber, _workers) = supervisor(&rt, Strategy::OneForOne, 3, &log).await;
    let before = fiber.children();
    let message = crash_b(&rt, &log, "boom in b").await;
    assert!(
        message.contains("boom in b"),
        "the panic message is carried: {message}"
    );
    let after = fiber.children();
    assert_eq!(after.len(), 3);
    assert_eq!(after[0], before[0]);
    assert_eq!(after[2], before[2]);
    assert_ne!(after[1], before[1]);
    assert_eq!(child_names(&rt, &fiber), ["a", "b", "c"]);
    assert_eq!(log.lines()[3..], ["start b"]);
    // The restarted worker serves.
    let new_b = rt.tree().get(after[1]).unwrap();
    assert_eq!(new_b.status, Status::Active);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_for_all_stops_siblings_in_reverse_and_restarts_all_in_order() {
    let rt = runtime().await;
    let log = Log::default();
    let (fiber, _workers) = supervisor(&rt, Strategy::OneForAll, 3, &log).await;
    let before = fiber.children();
    crash_b(&rt, &log, "boom in b").await;
    assert_eq!(
        log.lines()[3..],
        ["stop c", "stop a", "start a", "start b", "start c"]
    );
    let after = fiber.children();
    assert!(after.iter().all(|id| !before.contains(id)));
    assert_eq!(child_names(&rt, &fiber), ["a", "b", "c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rest_for_one_restarts_the_failed_child_and_those_after_it() {
    let rt = runtime().await;
    let log = Log::default();
    let (fiber, _workers) = supervisor(&rt, Strategy::RestForOne, 3, &log).await;
    let before = fiber.children();
    crash_b(&rt, &log, "boom in b").await;
    assert_eq!(log.lines()[3..], ["stop c", "start b", "start c"]);
    let after = fiber.children();
    assert_eq!(after[0], before[0]);
    assert_eq!(child_names(&rt, &fiber), ["a", "b", "c"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exceeding_restart_intensity_fails_the_supervisor_upward() {
    let rt = runtime().await;
    let log = Log::default();
    let sibling_log = Log::default();
    let sl = sibling_log.clone();
    let sibling = rt
        .root()
        .plugin(
            plugin_fn("sibling", &[], move |ctx: Context| {
                let sl = sl.clone();
                async move {
                    ctx.spawn(WorkerSpec::new("worker", "s", Recorder::new("s", &sl), ()))
                        .await?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    let (fiber, _workers) = supervisor(&rt, Strategy::OneForOne, 1, &log).await;
    crash_b(&rt, &log, "boom in b").await;
    let mut feed = rt.tree().subscribe();
    // Crash the restarted b: the second restart exceeds intensity 1.
    log.actor("b")
        .send_message(Msg::Panic("boom again"))
        .unwrap();
    let change = wait_change(
        &mut feed,
        |c| matches!(c, TreeChange::Supervision { action, .. } if action == "escalated"),
    )
    .await;
    let TreeChange::Supervision { message, .. } = change else {
        unreachable!()
    };
    assert!(message.contains("boom again"), "{message}");
    bounded(
        "supervisor failed",
        fiber.wait_for(Status::Failed, Duration::from_secs(20)),
    )
    .await
    .unwrap();
    assert!(
        fiber
            .error()
            .unwrap()
            .contains("restart intensity exceeded")
    );
    // Its children were stopped in order before it failed, post_stop included.
    let tail: Vec<String> = log.lines().into_iter().rev().take(2).collect();
    assert_eq!(tail, ["stop a", "stop c"]);
    // The sibling subtree and the root live on.
    assert_eq!(sibling.status(), Status::Active);
    assert_eq!(rt.root_fiber_handle().status(), Status::Active);
    assert!(sibling_log.lines().iter().all(|l| !l.starts_with("stop")));
    assert!(rt.failure().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_and_temporary_children_follow_their_policy() {
    let rt = runtime().await;
    let log = Log::default();
    let handles: Workers = Arc::default();
    let (l, h) = (log.clone(), handles.clone());
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("policies", &[], move |ctx: Context| {
                let (l, h) = (l.clone(), h.clone());
                async move {
                    let l1 = l.clone();
                    let transient = WorkerSpec::restartable("worker", "transient", move || {
                        (Recorder::new("transient", &l1), ())
                    })
                    .restart(Restart::Transient);
                    let worker = ctx.spawn(transient).await?;
                    h.lock().unwrap().push(worker);
                    let temp =
                        WorkerSpec::new("worker", "temporary", Recorder::new("temporary", &l), ());
                    let worker = ctx.spawn(temp).await?;
                    h.lock().unwrap().push(worker);
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    let (transient, temporary) = {
        let h = handles.lock().unwrap();
        (h[0].clone(), h[1].clone())
    };
    let mut feed = rt.tree().subscribe();
    // A transient child that exits normally is not restarted.
    transient.send(Msg::Exit).unwrap();
    let stopped = wait_change(
        &mut feed,
        |c| matches!(c, TreeChange::Stopped { id, .. } if *id == transient.id()),
    )
    .await;
    let TreeChange::Stopped { status, .. } = stopped else {
        unreachable!()
    };
    assert_eq!(status, Status::Disposed);
    // A temporary child that fails is reported and removed.
    temporary.send(Msg::Fail).unwrap();
    let change = wait_change(&mut feed, |c| matches!(c, TreeChange::Supervision { .. })).await;
    let TreeChange::Supervision {
        message,
        action,
        child,
        ..
    } = change
    else {
        unreachable!()
    };
    assert_eq!(action, "removed");
    assert_eq!(child, temporary.id());
    assert!(message.contains("temporary gave up"), "{message}");
    bounded("children removed", async {
        while !fiber.children().is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert_eq!(log.count("start transient"), 1);
    assert_eq!(fiber.status(), Status::Active);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_apply_fails_only_its_fiber() {
    let rt = runtime().await;
    let err = rt
        .root()
        .plugin(
            plugin_fn("bad", &[], |_ctx: Context| async {
                panic!("apply blew up")
            }),
            (),
        )
        .await
        .err()
        .unwrap();
    let text = err.to_string();
    assert!(text.contains("plugin `bad`"), "{text}");
    assert!(text.contains("panicked: apply blew up"), "{text}");
    let ok = rt
        .root()
        .plugin(plugin_fn("good", &[], |_ctx: Context| async { Ok(()) }), ())
        .await
        .unwrap();
    assert_eq!(ok.status(), Status::Active);
    let err = rt
        .root()
        .plugin(
            plugin_fn("erring", &[], |_ctx: Context| async {
                Err("no database".into())
            }),
            (),
        )
        .await
        .err()
        .unwrap();
    assert!(err.to_string().ends_with("failed: no database"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_fails_upward_is_restarted_by_its_parent() {
    let rt = runtime().await;
    let log = Log::default();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let l = log.clone();
    let parent = rt
        .root()
        .plugin(
            plugin_fn("parent", &[], move |ctx: Context| {
                let (l, tx) = (l.clone(), tx.clone());
                async move {
                    ctx.plugin_with(
                        flaky(l, tx),
                        (),
                        PluginOptions {
                            name: Some("flaky".into()),
                            ..PluginOptions::default()
                        },
                    )
                    .await?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    let first = bounded("first apply", rx.recv()).await.unwrap();
    let old = parent.children()[0];
    let mut feed = rt.tree().subscribe();
    log.actor("x").send_message(Msg::Panic("x down")).unwrap();
    // flaky allows no restarts: it fails upward, and its parent restarts it.
    wait_change(&mut feed, |c| {
        matches!(c, TreeChange::Supervision { supervisor, action, .. } if *supervisor == parent.id() && action == "restarted")
    })
    .await;
    let second = bounded("second apply", rx.recv()).await.unwrap();
    assert_ne!(first, second, "a fresh fiber applied the plugin again");
    let fresh = parent.children();
    assert_eq!(fresh.len(), 1);
    assert_ne!(fresh[0], old);
    assert_eq!(rt.tree().get_stopped(old).unwrap().status, Status::Failed);
    assert_eq!(log.count("start x"), 2);
    assert_eq!(parent.status(), Status::Active);
}

/// A plugin that allows its worker no restarts; reports each apply's fiber id.
fn flaky(
    log: Log,
    applied: tokio::sync::mpsc::UnboundedSender<u64>,
) -> impl dsh_supervisors::Plugin<Config = ()> {
    plugin_fn("flaky", &[], move |ctx: Context| {
        let (log, applied) = (log.clone(), applied.clone());
        async move {
            ctx.supervise(SupervisorSpec {
                strategy: Strategy::OneForOne,
                intensity: 0,
                period: Duration::from_secs(3600),
            });
            let l = log.clone();
            ctx.spawn(WorkerSpec::restartable("worker", "x", move || {
                (Recorder::new("x", &l), ())
            }))
            .await?;
            applied.send(ctx.fiber().id())?;
            Ok(())
        }
    })
}
