//! Ordered teardown: reverse start order at every level, budgets and kills,
//! memoized and re-entrant dispose, effects.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dsh_supervisors::{
    BoxError, Context, Error, Fiber, Plugin, PluginOptions, Shutdown, Status, TreeChange,
    WorkerSpec, plugin_fn,
};
use tokio::sync::Notify;

use super::common::{Log, Msg, Recorder, bounded, runtime, wait_change};

/// A fiber that logs its own stop from an effect and starts `fanout` children:
/// fibers while `depth > 1`, workers at the last level.
struct Branch {
    name: String,
    depth: usize,
    fanout: usize,
    log: Log,
}

impl Plugin for Branch {
    type Config = ();

    fn name(&self) -> &str {
        &self.name
    }

    async fn apply(&self, ctx: Context, _config: Arc<()>) -> Result<(), BoxError> {
        let log = self.log.clone();
        let name = self.name.clone();
        ctx.effect("log stop", move || log.push(format!("stop {name}")))?;
        for i in 0..self.fanout {
            let child = format!("{}.{i}", self.name);
            if self.depth > 1 {
                let branch = Branch {
                    name: child.clone(),
                    depth: self.depth - 1,
                    fanout: self.fanout,
                    log: self.log.clone(),
                };
                let options = PluginOptions {
                    name: Some(child),
                    ..PluginOptions::default()
                };
                ctx.plugin_with(branch, (), options).await?;
            } else {
                ctx.spawn(WorkerSpec::new(
                    "worker",
                    child.clone(),
                    Recorder::new(child, &self.log),
                    (),
                ))
                .await?;
            }
        }
        Ok(())
    }
}

/// The stop lines a branch must produce: children in reverse, then itself.
fn expected_stops(name: &str, depth: usize, fanout: usize, out: &mut Vec<String>) {
    for i in (0..fanout).rev() {
        let child = format!("{name}.{i}");
        if depth > 1 {
            expected_stops(&child, depth - 1, fanout, out);
        } else {
            out.push(format!("stop {child}"));
        }
    }
    out.push(format!("stop {name}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_level_tree_stops_in_reverse_start_order_at_every_level() {
    let rt = runtime().await;
    let log = Log::default();
    let mut tops = Vec::new();
    for t in 0..3 {
        let name = format!("t{t}");
        let branch = Branch {
            name: name.clone(),
            depth: 2,
            fanout: 3,
            log: log.clone(),
        };
        let options = PluginOptions {
            name: Some(name),
            ..PluginOptions::default()
        };
        tops.push(rt.root().plugin_with(branch, (), options).await.unwrap());
    }
    // 3 tops, 9 mids, 27 workers, and the root.
    assert_eq!(rt.tree().live_len(), 1 + 3 + 9 + 27);
    let starts = log
        .lines()
        .iter()
        .filter(|l| l.starts_with("start"))
        .count();
    assert_eq!(starts, 27);

    let mut feed = rt.tree().subscribe();
    bounded("shutdown", rt.shutdown()).await;

    let mut expected = Vec::new();
    for t in (0..3).rev() {
        expected_stops(&format!("t{t}"), 2, 3, &mut expected);
    }
    let stops: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("stop"))
        .collect();
    assert_eq!(
        stops, expected,
        "every post_stop and effect ran, in reverse start order"
    );
    assert_eq!(rt.tree().live_len(), 0);
    for top in &tops {
        assert_eq!(top.status(), Status::Disposed);
    }

    // The feed carries the same order as the stop log.
    let teardown = wait_change(&mut feed, |c| matches!(c, TreeChange::Teardown { .. })).await;
    let TreeChange::Teardown { order, .. } = teardown else {
        unreachable!()
    };
    let names: Vec<String> = order
        .iter()
        .filter_map(|id| rt.tree().get_stopped(*id))
        .filter(|n| n.kind != "root")
        .map(|n| format!("stop {}", n.name))
        .collect();
    assert_eq!(names, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_that_ignores_the_drain_is_killed_after_its_budget() {
    let rt = runtime().await;
    let log = Log::default();
    let parent_log = log.clone();
    let stuck_started = Arc::new(Notify::new());
    let started = stuck_started.clone();
    let parent = rt
        .root()
        .plugin(
            plugin_fn("parent", &[], move |ctx: Context| {
                let log = parent_log.clone();
                let started = started.clone();
                async move {
                    let l = log.clone();
                    ctx.effect("parent effect", move || l.push("parent effect"))?;
                    ctx.spawn(WorkerSpec::new("worker", "a", Recorder::new("a", &log), ()))
                        .await?;
                    let stuck = ctx
                        .spawn(
                            WorkerSpec::new("worker", "stuck", Recorder::new("stuck", &log), ())
                                .shutdown(Shutdown::Timeout(Duration::from_millis(200))),
                        )
                        .await?;
                    ctx.spawn(WorkerSpec::new("worker", "c", Recorder::new("c", &log), ()))
                        .await?;
                    stuck.send(Msg::Hang(started)).map_err(|_| "send failed")?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    stuck_started.notified().await;
    bounded("dispose", parent.dispose()).await;

    let stops: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|l| !l.starts_with("start"))
        .collect();
    assert_eq!(
        stops,
        ["stop c", "stop a", "parent effect"],
        "stuck never reached post_stop"
    );
    let stuck = rt
        .tree()
        .stopped_nodes()
        .into_iter()
        .find(|n| n.name == "stuck")
        .unwrap();
    assert_eq!(stuck.status, Status::Failed);
    assert_eq!(
        stuck.stop_reason.as_deref(),
        Some("killed after its shutdown budget")
    );
    let c = rt
        .tree()
        .stopped_nodes()
        .into_iter()
        .find(|n| n.name == "c")
        .unwrap();
    assert_eq!(c.stop_reason.as_deref(), Some("drained"));
    assert!(c.stop_seq < stuck.stop_seq);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_dispose_runs_teardown_once() {
    let rt = runtime().await;
    let runs = Arc::new(AtomicUsize::new(0));
    let r = runs.clone();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("once", &[], move |ctx: Context| {
                let r = r.clone();
                async move {
                    ctx.effect_async("slow", move || async move {
                        tokio::task::yield_now().await;
                        r.fetch_add(1, Ordering::SeqCst);
                    })?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    let (a, b, c) = (fiber.clone(), fiber.clone(), fiber.clone());
    bounded("racing disposes", async {
        tokio::join!(a.dispose(), b.dispose(), c.dispose());
    })
    .await;
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    assert_eq!(fiber.status(), Status::Disposed);
    fiber.dispose().await;
    assert_eq!(runs.load(Ordering::SeqCst), 1, "a late dispose is a no-op");
}

/// A child whose cleanup disposes its own parent.
fn disposes_its_parent(parent: Fiber, log: Log) -> impl Plugin<Config = ()> {
    plugin_fn("child", &[], move |child: Context| {
        let parent = parent.clone();
        let log = log.clone();
        async move {
            child.effect_async("dispose my parent", move || async move {
                parent.dispose().await;
                log.push("child effect done");
            })?;
            Ok(())
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dispose_from_inside_a_childs_cleanup_does_not_deadlock() {
    let rt = runtime().await;
    let log = Log::default();
    let slot: Arc<std::sync::Mutex<Option<Fiber>>> = Arc::default();
    let (l, s) = (log.clone(), slot.clone());
    let parent = rt
        .root()
        .plugin(
            plugin_fn("parent", &[], move |ctx: Context| {
                let (l, s) = (l.clone(), s.clone());
                async move {
                    let me = ctx.fiber();
                    *s.lock().unwrap() = Some(me.clone());
                    let l2 = l.clone();
                    ctx.effect("parent effect", move || l2.push("parent effect"))?;
                    ctx.plugin(disposes_its_parent(me, l), ()).await?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    bounded("re-entrant dispose", parent.dispose()).await;
    assert_eq!(log.lines(), ["child effect done", "parent effect"]);
    assert_eq!(parent.status(), Status::Disposed);
    drop(slot);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_run_once_in_reverse_and_a_panicking_disposer_is_isolated() {
    let rt = runtime().await;
    let log = Log::default();
    let rejected = Arc::new(std::sync::Mutex::new(None));
    let (l, rej) = (log.clone(), rejected.clone());
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("effects", &[], move |ctx: Context| {
                let (l, rej) = (l.clone(), rej.clone());
                async move {
                    for i in 0..3 {
                        let l = l.clone();
                        ctx.effect(&format!("e{i}"), move || l.push(format!("e{i}")))?;
                    }
                    ctx.effect("bomb", || panic!("disposer exploded"))?;
                    let late = ctx.clone();
                    ctx.effect("late registration", move || {
                        *rej.lock().unwrap() = Some(late.effect("too late", || {}).err());
                    })?;
                    let l2 = l.clone();
                    let early = ctx.effect("early", move || l2.push("early"))?;
                    early.dispose().await;
                    early.dispose().await;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    assert_eq!(
        fiber.effects(),
        ["e0", "e1", "e2", "bomb", "late registration"]
    );
    let mut feed = rt.tree().subscribe();
    fiber.dispose().await;
    assert_eq!(log.lines(), ["early", "e2", "e1", "e0"]);
    let refused = rejected.lock().unwrap().take().flatten();
    assert!(
        matches!(
            refused,
            Some(Error::InactiveFiber {
                state: "unloading",
                ..
            })
        ),
        "{refused:?}"
    );
    let change = wait_change(&mut feed, |c| matches!(c, TreeChange::Supervision { .. })).await;
    let TreeChange::Supervision { message, .. } = change else {
        unreachable!()
    };
    assert!(
        message.contains("disposer `bomb` panicked: disposer exploded"),
        "{message}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_preludes_run_before_the_children_stop() {
    let rt = runtime().await;
    let log = Log::default();
    let l = log.clone();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("host", &[], move |ctx: Context| {
                let l = l.clone();
                async move {
                    let l1 = l.clone();
                    ctx.effect("effect", move || l1.push("effect"))?;
                    ctx.spawn(WorkerSpec::new("worker", "w", Recorder::new("w", &l), ()))
                        .await?;
                    let l2 = l.clone();
                    ctx.on_teardown("stop input", move || async move { l2.push("prelude") })?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    fiber.dispose().await;
    assert_eq!(log.lines(), ["start w", "prelude", "stop w", "effect"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_one_node_stops_its_subtree_in_order_and_nothing_restarts_it() {
    let rt = runtime().await;
    let log = Log::default();
    let branch = Branch {
        name: "b".into(),
        depth: 1,
        fanout: 3,
        log: log.clone(),
    };
    let options = PluginOptions {
        name: Some("b".into()),
        ..PluginOptions::default()
    };
    let top = rt.root().plugin_with(branch, (), options).await.unwrap();
    let before = rt.tree().live_len();
    // One worker of the tree, by its id: stopped and not restarted.
    let worker = rt
        .tree()
        .snapshot()
        .into_iter()
        .find(|n| n.kind != "root" && n.kind != "plugin" && n.kind != "scope")
        .unwrap();
    let order = rt.stop_node(worker.id).await.unwrap();
    assert_eq!(order, vec![worker.id]);
    assert_eq!(
        rt.tree().live_len(),
        before - 1,
        "the worker is gone, not restarted"
    );
    // The whole branch, by its id: its subtree in reverse start order.
    let order = rt.stop_node(top.id()).await.unwrap();
    assert_eq!(order.last(), Some(&top.id()));
    assert_eq!(top.status(), Status::Disposed);
    assert_eq!(rt.tree().live_len(), 1, "only the root is left");
    // Unknown ids and the root are not stopped this way.
    assert!(rt.stop_node(999_999).await.is_none());
    assert!(rt.stop_node(rt.root().fiber().id()).await.is_none());
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_disposed_on_its_own_has_left_its_parent_when_the_dispose_returns() {
    let rt = runtime().await;
    let root = rt.root();
    let before = root.fiber().child_count();
    for round in 0..20 {
        let scope = root
            .scope(dsh_supervisors::ScopeKey::new(format!("s{round}")))
            .await
            .unwrap();
        assert_eq!(root.fiber().child_count(), before + 1);
        scope.dispose().await;
        assert_eq!(
            root.fiber().child_count(),
            before,
            "round {round}: the parent still counts the disposed scope"
        );
        assert_eq!(scope.fiber().status(), Status::Disposed);
    }
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_starts_an_actor_only_when_a_worker_under_it_needs_a_supervisor() {
    let rt = runtime().await;
    let log = Log::default();
    let outer = rt
        .root()
        .scope(dsh_supervisors::ScopeKey::new("outer"))
        .await
        .unwrap();
    let inner = outer
        .ctx()
        .scope(dsh_supervisors::ScopeKey::new("inner"))
        .await
        .unwrap();
    // Parts, effects and tasks need no mailbox.
    inner.ctx().part("session", "session/x").unwrap();
    let l = log.clone();
    inner
        .ctx()
        .effect("log", move || l.push("effect inner"))
        .unwrap();
    let task = inner
        .ctx()
        .spawn_task(dsh_supervisors::TaskSpec::new("tool", "t"), |_c| async {
            7
        })
        .unwrap();
    assert_eq!(bounded("task", task.join()).await, Ok(7));
    assert!(!outer.fiber().has_actor() && !inner.fiber().has_actor());
    // A worker does: the inner scope starts its actor, linked under the
    // outer one's (started too), and supervises it.
    let spec = WorkerSpec::restartable("worker", "w", {
        let log = log.clone();
        move || (Recorder::new("w", &log), ())
    });
    inner.ctx().spawn(spec).await.unwrap();
    assert!(outer.fiber().has_actor() && inner.fiber().has_actor());
    let mut feed = rt.tree().subscribe();
    log.actor("w").send_message(Msg::Panic("boom")).unwrap();
    let change = wait_change(&mut feed, |c| matches!(c, TreeChange::Supervision { .. })).await;
    let TreeChange::Supervision { action, .. } = change else {
        unreachable!()
    };
    assert_eq!(action, "restarted", "the late actor supervises its worker");
    assert_eq!(log.count("start w"), 2);
    // Teardown in order: the worker, the part, then the scope's effect.
    bounded("dispose", outer.dispose()).await;
    let lines = log.lines();
    let tail: Vec<&str> = lines
        .iter()
        .rev()
        .take(2)
        .rev()
        .map(String::as_str)
        .collect();
    assert_eq!(tail, ["stop w", "effect inner"]);
    assert_eq!(inner.fiber().status(), Status::Disposed);
    let order = outer.fiber().stop_order().unwrap();
    assert_eq!(order.last(), Some(&outer.fiber().id()));
    assert_eq!(order[order.len() - 2], inner.fiber().id());
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scope_without_an_actor_tears_down_in_order_and_is_stopped_when_its_owner_is_killed() {
    let rt = runtime().await;
    let log = Log::default();
    let root = rt.root();
    // Disposed on its own: children in reverse start order, then effects.
    let scope = root
        .scope(dsh_supervisors::ScopeKey::new("s"))
        .await
        .unwrap();
    for name in ["a", "b"] {
        let child = scope
            .ctx()
            .scope(dsh_supervisors::ScopeKey::new(name))
            .await
            .unwrap();
        let l = log.clone();
        child
            .ctx()
            .effect("log", move || l.push(format!("stop {name}")))
            .unwrap();
    }
    let l = log.clone();
    scope.ctx().effect("log", move || l.push("stop s")).unwrap();
    bounded("dispose", scope.dispose()).await;
    assert_eq!(log.lines(), ["stop b", "stop a", "stop s"]);
    assert!(!scope.fiber().has_actor(), "it never needed one");
    assert_eq!(scope.fiber().status(), Status::Disposed);

    // A teardown stuck in an effect ends when its owner is killed past its
    // budget: the stuck future is dropped, as an actor's would be.
    let settings = dsh_supervisors::RuntimeSettings {
        shutdown_budget: Duration::from_millis(100),
        ..dsh_supervisors::RuntimeSettings::default()
    };
    let rt = dsh_supervisors::Runtime::start(settings).await.unwrap();
    let stuck = rt
        .root()
        .scope(dsh_supervisors::ScopeKey::new("stuck"))
        .await
        .unwrap();
    struct Dropped(Arc<Notify>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.notify_one();
        }
    }
    let dropped = Arc::new(Notify::new());
    let guard = Dropped(dropped.clone());
    stuck
        .ctx()
        .effect_async("hang", move || async move {
            let _guard = guard;
            futures::future::pending::<()>().await;
        })
        .unwrap();
    bounded("shutdown", rt.shutdown()).await;
    assert_eq!(stuck.fiber().status(), Status::Failed);
    assert!(!stuck.fiber().has_actor());
    // The abort lands on the teardown task's next poll.
    bounded("the stuck effect is dropped", dropped.notified()).await;
}
