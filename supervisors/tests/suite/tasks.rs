//! Task children: one-shot work in the tree without a mailbox. Result,
//! panic as a supervision event, cancel and await in reverse start order on
//! teardown, abort past the budget, refusal once the owner unloads; the
//! same for tasks their caller runs (`run_task`).

use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::tree::Form;
use dsh_supervisors::{
    Context, Fiber, Shutdown, Status, TaskEnd, TaskSpec, TreeChange, WorkerSpec, plugin_fn,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::common::{Log, Recorder, bounded, runtime, wait_change};

/// A plugin fiber with nothing in it, to own the tasks a test starts.
async fn owner(rt: &dsh_supervisors::Runtime, name: &str) -> Fiber {
    rt.root()
        .plugin(
            plugin_fn(name.to_owned(), &[], |_ctx: Context| async { Ok(()) }),
            (),
        )
        .await
        .unwrap()
}

/// Asserts how node `id` ended.
fn assert_stopped(rt: &dsh_supervisors::Runtime, id: u64, status: Status, reason: &str) {
    let node = rt
        .tree()
        .get_stopped(id)
        .expect("the node is recorded stopped");
    assert_eq!(node.status, status, "{}", node.name);
    assert_eq!(node.stop_reason.as_deref(), Some(reason), "{}", node.name);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_a_tree_node_that_returns_its_result_and_leaves() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let ctx = fiber.context();
    let release = Arc::new(Notify::new());
    let gate = release.clone();
    let task = ctx
        .spawn_task(
            TaskSpec::new("tool", "tool/echo#1"),
            move |_cancel| async move {
                gate.notified().await;
                42
            },
        )
        .unwrap();
    let node = rt.tree().get(task.id()).expect("a live node while it runs");
    assert_eq!(node.kind, "tool");
    assert_eq!(node.form, Form::Task);
    assert_eq!(node.name, "tool/echo#1");
    assert_eq!(node.parent, Some(fiber.id()));
    assert_eq!(fiber.children(), vec![task.id()]);

    let id = task.id();
    release.notify_one();
    assert_eq!(bounded("join", task.join()).await, Ok(42));
    assert!(rt.tree().get(id).is_none(), "the node stopped");
    let stopped = rt.tree().get_stopped(id).unwrap();
    assert_eq!(stopped.status, Status::Disposed);
    assert!(fiber.children().is_empty(), "the owner forgot it");
    assert_eq!(fiber.status(), Status::Active);
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_task_is_a_supervision_event_and_its_owner_goes_on() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let mut feed = rt.tree().subscribe();
    let task = fiber
        .context()
        .spawn_task(TaskSpec::new("tool", "bomb"), |_cancel| async {
            tokio::task::yield_now().await;
            if true {
                panic!("the tool exploded");
            }
        })
        .unwrap();
    let id = task.id();
    let end = bounded("join", task.join()).await;
    assert_eq!(end, Err(TaskEnd::Panicked("the tool exploded".into())));
    let change = wait_change(&mut feed, |c| matches!(c, TreeChange::Supervision { .. })).await;
    let TreeChange::Supervision {
        supervisor,
        child,
        message,
        action,
    } = change
    else {
        unreachable!()
    };
    assert_eq!((supervisor, child), (fiber.id(), id));
    assert!(message.contains("the tool exploded"), "{message}");
    assert_eq!(action, "removed");
    assert_eq!(rt.tree().get_stopped(id).unwrap().status, Status::Failed);
    assert_eq!(fiber.status(), Status::Active, "the owner is unharmed");

    // It still takes work.
    let again = fiber
        .context()
        .spawn_task(TaskSpec::new("tool", "ok"), |_c| async { "fine" })
        .unwrap();
    assert_eq!(bounded("join", again.join()).await, Ok("fine"));
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn teardown_cancels_and_awaits_tasks_in_reverse_start_order_among_workers() {
    let rt = runtime().await;
    let log = Log::default();
    let l = log.clone();
    let started = Arc::new(tokio::sync::Semaphore::new(0));
    let s = started.clone();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("owner", &[], move |ctx: Context| {
                let log = l.clone();
                let started = s.clone();
                async move {
                    ctx.spawn(WorkerSpec::new("worker", "a", Recorder::new("a", &log), ()))
                        .await?;
                    for name in ["t1", "t2"] {
                        let log = log.clone();
                        let started = started.clone();
                        // The handles are dropped: the owner still awaits them.
                        ctx.spawn_task(TaskSpec::new("tool", name), move |cancel| async move {
                            started.add_permits(1);
                            cancel.cancelled().await;
                            // Work after the cancel, finished before the next sibling stops.
                            tokio::task::yield_now().await;
                            log.push(format!("stop {name}"));
                        })?;
                    }
                    ctx.spawn(WorkerSpec::new("worker", "c", Recorder::new("c", &log), ()))
                        .await?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    bounded("tasks started", started.acquire_many(2))
        .await
        .unwrap()
        .forget();
    assert_eq!(fiber.children().len(), 4);
    let mut feed = rt.tree().subscribe();
    bounded("dispose", fiber.dispose()).await;
    let stops: Vec<String> = log
        .lines()
        .into_iter()
        .filter(|l| l.starts_with("stop"))
        .collect();
    assert_eq!(stops, ["stop c", "stop t2", "stop t1", "stop a"]);
    let TreeChange::Teardown { order, .. } =
        wait_change(&mut feed, |c| matches!(c, TreeChange::Teardown { .. })).await
    else {
        unreachable!()
    };
    let names: Vec<String> = order
        .iter()
        .filter_map(|id| rt.tree().get_stopped(*id))
        .map(|n| n.name)
        .collect();
    assert_eq!(names, ["c", "t2", "t1", "a", "plugin/owner"]);
    for id in &order[1..3] {
        let node = rt.tree().get_stopped(*id).unwrap();
        assert_eq!(node.status, Status::Disposed, "{} ended in time", node.name);
    }
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_that_ignores_its_cancel_is_aborted_past_its_budget() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let dropped = CancellationToken::new();
    let on_drop = dropped.clone().drop_guard();
    let started = Arc::new(Notify::new());
    let s = started.clone();
    let task = fiber
        .context()
        .spawn_task(
            TaskSpec::new("tool", "stuck").shutdown(Shutdown::Timeout(Duration::from_millis(50))),
            move |_cancel| async move {
                let _guard = on_drop;
                s.notify_one();
                futures::future::pending::<()>().await;
            },
        )
        .unwrap();
    let id = task.id();
    bounded("started", started.notified()).await;
    bounded("dispose", fiber.dispose()).await;
    assert!(dropped.is_cancelled(), "the aborted body was dropped");
    assert_eq!(bounded("join", task.join()).await, Err(TaskEnd::Stopped));
    assert_stopped(&rt, id, Status::Failed, "aborted after its shutdown budget");
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_is_cancelled_with_its_parent_signal_or_by_id_and_refused_once_its_owner_unloads() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let ctx = fiber.context();
    let turn = CancellationToken::new();
    let task = ctx
        .spawn_task(
            TaskSpec::new("tool", "waits").cancelled_by(&turn),
            |cancel| async move {
                cancel.cancelled().await;
                "saw the cancel"
            },
        )
        .unwrap();
    turn.cancel();
    assert_eq!(bounded("join", task.join()).await, Ok("saw the cancel"));

    // Stopped by id from outside (the dashboard's stop): cancelled, awaited.
    let task = ctx
        .spawn_task(TaskSpec::new("tool", "stoppable"), |cancel| async move {
            cancel.cancelled().await;
            "stopped by id"
        })
        .unwrap();
    let id = task.id();
    let order = bounded("stop", rt.stop_node(id)).await;
    assert_eq!(order, Some(vec![id]));
    assert_eq!(bounded("join", task.join()).await, Ok("stopped by id"));
    assert!(fiber.children().is_empty());

    bounded("dispose", fiber.dispose()).await;
    let refused = ctx.spawn_task(TaskSpec::new("tool", "late"), |_c| async {});
    assert!(refused.is_err(), "a disposed owner takes no tasks");
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_passive_part_stops_in_its_place_and_only_parts_can_be_dropped() {
    let rt = runtime().await;
    let log = Log::default();
    let fiber = owner(&rt, "owner").await;
    let ctx = fiber.context();
    let a = ctx
        .spawn(WorkerSpec::new("worker", "a", Recorder::new("a", &log), ()))
        .await
        .unwrap();
    let part = ctx.part("session", "session/x").unwrap();
    let c = ctx
        .spawn(WorkerSpec::new("worker", "c", Recorder::new("c", &log), ()))
        .await
        .unwrap();
    assert_eq!(fiber.children(), vec![a.id(), part, c.id()]);
    assert_eq!(rt.tree().get(part).unwrap().kind, "session");
    assert_eq!(rt.tree().get(part).unwrap().form, Form::Part);
    assert_eq!(rt.tree().get(a.id()).unwrap().form, Form::Actor);
    let text = dsh_supervisors::tree::render(&rt.tree().snapshot());
    assert!(text.contains("session/x [session] active"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("session/x") && l.ends_with(" part")),
        "a part shows no mailbox: {text}"
    );

    // Not a part: left alone.
    ctx.drop_part(c.id());
    assert_eq!(fiber.children().len(), 3);

    let mut feed = rt.tree().subscribe();
    bounded("dispose", fiber.dispose()).await;
    let TreeChange::Teardown { order, .. } =
        wait_change(&mut feed, |c| matches!(c, TreeChange::Teardown { .. })).await
    else {
        unreachable!()
    };
    assert_eq!(order, vec![c.id(), part, a.id(), fiber.id()]);
    assert_eq!(
        rt.tree().get_stopped(part).unwrap().status,
        Status::Disposed
    );

    // Dropped early: gone from the children and the tree at once.
    let fiber = owner(&rt, "second").await;
    let part = fiber.context().part("session", "session/y").unwrap();
    fiber.context().drop_part(part);
    assert!(fiber.children().is_empty());
    assert!(rt.tree().get(part).is_none());
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_dropped_midway_leaves_the_task_where_its_owner_still_aborts_it() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let started = Arc::new(Notify::new());
    let s = started.clone();
    let task = fiber
        .context()
        .spawn_task(
            TaskSpec::new("tool", "deaf").shutdown(Shutdown::Timeout(Duration::from_millis(50))),
            move |_cancel| async move {
                s.notify_one();
                futures::future::pending::<()>().await;
            },
        )
        .unwrap();
    let id = task.id();
    bounded("started", started.notified()).await;
    // A stop by id whose caller goes away (a client that hung up) after one
    // poll: the task ignores its cancel, so the stop was still waiting.
    {
        let stop = rt.stop_node(id);
        tokio::pin!(stop);
        assert!(futures::poll!(stop.as_mut()).is_pending());
    }
    assert_eq!(fiber.children(), vec![id], "still its owner's child");
    bounded("dispose", fiber.dispose()).await;
    assert_eq!(bounded("join", task.join()).await, Err(TaskEnd::Stopped));
    assert_stopped(&rt, id, Status::Failed, "aborted after its shutdown budget");
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brutally_killed_task_is_recorded_even_if_it_never_ran() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let mut ids = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..16 {
        let task = fiber
            .context()
            .spawn_task(
                TaskSpec::new("tool", format!("t{i}")).shutdown(Shutdown::BrutalKill),
                |_cancel| futures::future::pending::<()>(),
            )
            .unwrap();
        ids.push(task.id());
        tasks.push(task);
    }
    bounded("dispose", fiber.dispose()).await;
    for task in tasks {
        assert_eq!(bounded("join", task.join()).await, Err(TaskEnd::Stopped));
    }
    for id in ids {
        assert_stopped(&rt, id, Status::Failed, "brutal kill");
    }
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_its_caller_runs_borrows_returns_and_is_recorded_however_it_ends() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let ctx = fiber.context();
    let borrowed = String::from("borrowed, not moved");
    let release = Notify::new();
    let task = ctx
        .run_task(TaskSpec::new("tool", "tool/inline#1"), |_cancel| async {
            release.notified().await;
            borrowed.len()
        })
        .unwrap();
    let watch = async {
        // Registered before it is first polled: its place is taken at once.
        let id = fiber.children()[0];
        let node = rt.tree().get(id).expect("a live node while it runs");
        assert_eq!((node.form, node.kind.as_str()), (Form::Task, "tool"));
        release.notify_one();
        id
    };
    let (ended, id) = bounded("run", async { tokio::join!(task, watch) }).await;
    assert_eq!(ended, Ok(borrowed.len()));
    assert_stopped(&rt, id, Status::Disposed, "finished");
    assert!(fiber.children().is_empty(), "the owner forgot it");

    // A panic is the caller's `Err`, and the owner's supervision event.
    let mut feed = rt.tree().subscribe();
    let task = ctx
        .run_task(TaskSpec::new("tool", "bomb"), |_c| async {
            tokio::task::yield_now().await;
            if true {
                panic!("the inline tool exploded");
            }
        })
        .unwrap();
    assert_eq!(
        bounded("run", task).await,
        Err(TaskEnd::Panicked("the inline tool exploded".into()))
    );
    let change = wait_change(&mut feed, |c| matches!(c, TreeChange::Supervision { .. })).await;
    assert!(
        matches!(&change, TreeChange::Supervision { supervisor, action, .. } if *supervisor == fiber.id() && action == "removed"),
        "{change:?}"
    );

    // Dropped by its caller before it finished: recorded, and gone.
    let task = ctx
        .run_task(TaskSpec::new("tool", "abandoned"), |_c| {
            futures::future::pending::<()>()
        })
        .unwrap();
    let id = fiber.children()[0];
    drop(task);
    assert_stopped(&rt, id, Status::Failed, "dropped");
    assert!(fiber.children().is_empty());
    assert_eq!(fiber.status(), Status::Active, "the owner is unharmed");
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_its_caller_runs_is_stopped_by_its_owner_and_aborted_past_its_budget() {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let ctx = fiber.context();
    let budget = Shutdown::Timeout(Duration::from_millis(50));
    // One obeys its cancel, one ignores it; the owner's teardown ends both
    // while their caller (another task) polls them.
    let polite = ctx
        .run_task(TaskSpec::new("tool", "polite"), |cancel| async move {
            cancel.cancelled().await;
            "saw the cancel"
        })
        .unwrap();
    let stuck = ctx
        .run_task(TaskSpec::new("tool", "stuck").shutdown(budget), |_c| {
            futures::future::pending::<&str>()
        })
        .unwrap();
    let ids = fiber.children();
    let caller = tokio::spawn(async move { tokio::join!(polite, stuck) });
    bounded("dispose", fiber.dispose()).await;
    let (polite, stuck) = bounded("caller", caller).await.unwrap();
    assert_eq!(polite, Ok("saw the cancel"));
    assert_eq!(stuck, Err(TaskEnd::Stopped));
    assert_stopped(&rt, ids[0], Status::Disposed, "cancelled by its owner");
    assert_stopped(
        &rt,
        ids[1],
        Status::Failed,
        "aborted after its shutdown budget",
    );
    let refused = ctx.run_task(TaskSpec::new("tool", "late"), |_c| async {});
    assert!(refused.is_err(), "a disposed owner takes no tasks");
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_its_caller_runs_is_stopped_by_id_and_a_body_that_panics_as_it_is_made_leaves_no_node()
 {
    let rt = runtime().await;
    let fiber = owner(&rt, "owner").await;
    let ctx = fiber.context();
    let task = ctx
        .run_task(TaskSpec::new("tool", "stoppable"), |cancel| async move {
            cancel.cancelled().await;
            "stopped by id"
        })
        .unwrap();
    let id = fiber.children()[0];
    let caller = tokio::spawn(task);
    assert_eq!(bounded("stop", rt.stop_node(id)).await, Some(vec![id]));
    assert_eq!(
        bounded("caller", caller).await.unwrap(),
        Ok("stopped by id")
    );
    assert_stopped(&rt, id, Status::Disposed, "cancelled by its owner");

    // The closure that makes the body panics: the panic goes on to the
    // caller, and the registered node is recorded, not left behind.
    let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = ctx.spawn_task(
            TaskSpec::new("tool", "unmade"),
            |_c| -> std::future::Ready<()> { panic!("could not make the body") },
        );
    }));
    assert!(made.is_err(), "the panic reaches the caller");
    let unmade = rt
        .tree()
        .stopped_nodes()
        .into_iter()
        .find(|n| n.name == "unmade")
        .expect("the node is recorded stopped");
    assert_eq!(unmade.status, Status::Failed);
    assert!(fiber.children().is_empty(), "no child left behind");
    bounded("dispose", fiber.dispose()).await;
    bounded("shutdown", rt.shutdown()).await;
}
