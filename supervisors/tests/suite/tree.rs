//! The tree registry: records, summaries, mailbox depth, the feed, bounded memory.

use std::sync::Arc;

use dsh_supervisors::tree::{RecvError, TreeLimits, render};
use futures::FutureExt;
use std::time::Duration;

use dsh_supervisors::{
    Context, Fiber, Runtime, RuntimeSettings, Shutdown, Status, TreeChange, WorkerRef, WorkerSpec,
    plugin_fn,
};
use tokio::sync::Notify;

use super::common::{Log, Msg, Recorder, bounded, runtime, wait_change};

/// A plugin `host` whose fiber starts one `tool` worker named `name`.
async fn host_with_worker(rt: &Runtime, name: &'static str) -> (Fiber, WorkerRef<Msg>) {
    let log = Log::default();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("host", &[], move |ctx: Context| {
                let (l, tx) = (log.clone(), tx.clone());
                async move {
                    let w = ctx
                        .spawn(
                            WorkerSpec::new("tool", name, Recorder::new("w", &l), ())
                                .shutdown(Shutdown::Timeout(Duration::from_millis(50))),
                        )
                        .await?;
                    tx.send(w).map_err(|_| "send")?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    (fiber, rx.recv().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_are_recorded_with_parent_status_summary_and_mailbox_depth() {
    let rt = runtime().await;
    let mut feed = rt.tree().subscribe();
    let (fiber, worker) = host_with_worker(&rt, "tool/bash#call_7").await;
    let node = rt.tree().get(worker.id()).unwrap();
    assert_eq!(node.kind, "tool");
    assert_eq!(node.name, "tool/bash#call_7");
    assert_eq!(node.parent, Some(fiber.id()));
    assert_eq!(node.status, Status::Active);
    assert!(node.started_ms > 0 && node.last_activity_ms >= node.started_ms);
    let host = rt.tree().get(fiber.id()).unwrap();
    assert_eq!(
        (host.kind.as_str(), host.name.as_str()),
        ("plugin", "plugin/host")
    );
    assert_eq!(host.parent, Some(rt.root_fiber_handle().id()));

    let spawned = wait_change(
        &mut feed,
        |c| matches!(c, TreeChange::Spawned { node } if node.info.id == worker.id()),
    )
    .await;

    rt.tree()
        .set_summary(worker.id(), serde_json::json!({"turn": 2, "step": 5}));
    assert_eq!(rt.tree().get(worker.id()).unwrap().summary["step"], 5);
    let summary = wait_change(
        &mut feed,
        |c| matches!(c, TreeChange::Summary { id, .. } if *id == worker.id()),
    )
    .await;
    // Changes carry the node, read when serialized: a viewer gets the node
    // and its summary as they are by then, in the wire shape.
    rt.tree()
        .set_summary(worker.id(), serde_json::json!({"turn": 3, "step": 1}));
    let wire = serde_json::to_value(&summary).unwrap();
    assert_eq!(
        wire,
        serde_json::json!({"type": "summary", "id": worker.id(), "summary": {"turn": 3, "step": 1}})
    );
    // With the status it had when it was spawned (later ones follow).
    let TreeChange::Spawned { node: at_spawn } = &spawned else {
        unreachable!()
    };
    assert_eq!(at_spawn.status(), Status::Loading);
    let wire = serde_json::to_value(&spawned).unwrap();
    assert_eq!(wire["type"], "spawned");
    assert_eq!(wire["node"]["status"], "loading");
    assert_eq!(wire["node"]["name"], "tool/bash#call_7");
    assert_eq!(wire["node"]["parent"], fiber.id());
    assert_eq!(wire["node"]["summary"]["turn"], 3);

    // Block the worker in a handler, then queue three messages behind it.
    let started = Arc::new(Notify::new());
    worker.send(Msg::Hang(started.clone())).unwrap();
    started.notified().await;
    for _ in 0..3 {
        let (tx, _rx) = ractor::concurrency::oneshot();
        worker
            .send(Msg::Ping((tx, std::time::Duration::from_secs(1)).into()))
            .unwrap();
    }
    assert_eq!(rt.tree().get(worker.id()).unwrap().mailbox_depth, 3);
    let text = render(&rt.tree().snapshot());
    assert!(text.contains("root [root] active"), "{text}");
    assert!(text.contains("\n  plugin/host [plugin] active"), "{text}");
    assert!(
        text.contains("\n    tool/bash#call_7 [tool] active"),
        "{text}"
    );
    assert!(text.contains("mailbox=3"), "{text}");
    bounded("shutdown", rt.shutdown()).await;
}

/// A plugin `many` whose fiber starts `n` workers `w0`, `w1`, ….
async fn many_workers(rt: &Runtime, n: usize, log: &Log) -> Fiber {
    let log = log.clone();
    rt.root()
        .plugin(
            plugin_fn("many", &[], move |ctx: Context| {
                let l = log.clone();
                async move {
                    for i in 0..n {
                        let name = format!("w{i}");
                        ctx.spawn(WorkerSpec::new(
                            "worker",
                            name.clone(),
                            Recorder::new(name, &l),
                            (),
                        ))
                        .await?;
                    }
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_entries_are_bounded_and_status_changes_are_published() {
    let settings = RuntimeSettings {
        tree: TreeLimits {
            stopped_capacity: 8,
            feed_capacity: 1024,
            ..TreeLimits::default()
        },
        ..RuntimeSettings::default()
    };
    let rt = Runtime::start(settings).await.unwrap();
    let log = Log::default();
    let mut feed = rt.tree().subscribe();
    let fiber = many_workers(&rt, 20, &log).await;
    wait_change(
        &mut feed,
        |c| matches!(c, TreeChange::Status { id, status: Status::Active } if *id == fiber.id()),
    )
    .await;
    fiber.dispose().await;
    let stopped = rt.tree().stopped_nodes();
    assert_eq!(stopped.len(), 8);
    assert_eq!(stopped.last().unwrap().id, fiber.id());
    let names: Vec<&str> = stopped.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(
        names,
        ["w6", "w5", "w4", "w3", "w2", "w1", "w0", "plugin/many"]
    );
    assert_eq!(
        log.lines().iter().filter(|l| l.starts_with("stop")).count(),
        20
    );
    assert!(rt.tree().get_stopped(fiber.id()).is_some());
    assert_eq!(rt.tree().live_len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_node_is_remembered_as_it_was_when_it_stopped() {
    let rt = runtime().await;
    let (fiber, worker) = host_with_worker(&rt, "late").await;
    bounded("dispose", fiber.dispose()).await;
    let at_stop = rt.tree().get_stopped(worker.id()).unwrap();
    // Once the millisecond clock has moved on, a late send to the stopped
    // worker touches its live counters; the remembered node keeps its own.
    bounded("the clock moving on", async {
        while dsh_supervisors::tree::now_ms() <= at_stop.last_activity_ms {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let (reply, _) = ractor::concurrency::oneshot();
    assert!(
        worker
            .send(Msg::Ping((reply, Duration::from_secs(1)).into()))
            .is_err()
    );
    assert_eq!(rt.tree().get_stopped(worker.id()).unwrap(), at_stop);
    bounded("shutdown", rt.shutdown()).await;
}

/// The ids of the node changes in `out` of one kind (`stopped`, …), in order.
fn ids_of(out: &[TreeChange], kind: &str) -> Vec<u64> {
    out.iter()
        .filter_map(|c| match (c, kind) {
            (TreeChange::Spawned { node }, "spawned") => Some(node.info.id),
            (TreeChange::Status { id, .. }, "status")
            | (TreeChange::Summary { id, .. }, "summary")
            | (TreeChange::Stopped { id, .. }, "stopped") => Some(*id),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_reads_the_latest_state_and_leaves_out_short_lived_nodes() {
    let rt = runtime().await;
    let tree = rt.tree().clone();
    let (snapshot, mut f) = tree.follow();
    assert!(snapshot.iter().any(|n| n.kind == "root"), "{snapshot:?}");
    let mut out = Vec::new();
    // A quiet tree: nothing to read, and nothing wakes the follower.
    assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
    assert!(out.is_empty(), "{out:?}");
    assert!(f.changed().now_or_never().is_none());

    let (fiber, worker) = host_with_worker(&rt, "followed").await;
    bounded("the wake-up", f.changed()).await.unwrap();
    for step in 0..3 {
        tree.set_summary(worker.id(), serde_json::json!({ "step": step }));
    }
    tree.catch_up(&mut f, &mut out).unwrap();
    // New nodes once each, parents first, read as they are now.
    assert_eq!(ids_of(&out, "spawned"), [fiber.id(), worker.id()]);
    let wire = serde_json::to_value(&out).unwrap();
    assert_eq!(wire[1]["node"]["summary"]["step"], 2, "{wire}");

    // Three summaries between two looks: the last one, once.
    out.clear();
    for step in 3..6 {
        tree.set_summary(worker.id(), serde_json::json!({ "step": step }));
    }
    tree.catch_up(&mut f, &mut out).unwrap();
    assert_eq!(ids_of(&out, "summary"), [worker.id()]);
    let wire = serde_json::to_value(&out).unwrap();
    let summary = wire
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "summary")
        .unwrap();
    assert_eq!(summary["summary"]["step"], 5, "{wire}");

    // A scope that started and stopped between two looks is left out.
    out.clear();
    let brief = rt
        .root()
        .scope(dsh_supervisors::ScopeKey::new("brief"))
        .await
        .unwrap();
    let brief_id = brief.fiber().id();
    bounded("dispose", brief.dispose()).await;
    assert_eq!(tree.catch_up(&mut f, &mut out), Ok(1));
    for kind in ["spawned", "status", "summary", "stopped"] {
        assert!(!ids_of(&out, kind).contains(&brief_id), "{out:?}");
    }

    // Stops in stop order (children first), then the teardown event.
    out.clear();
    bounded("dispose", fiber.dispose()).await;
    tree.catch_up(&mut f, &mut out).unwrap();
    assert_eq!(ids_of(&out, "stopped"), [worker.id(), fiber.id()]);
    let seqs: Vec<u64> = out
        .iter()
        .filter_map(|c| match c {
            TreeChange::Stopped { stop_seq, .. } => Some(*stop_seq),
            _ => None,
        })
        .collect();
    assert!(seqs[0] < seqs[1], "{seqs:?}");
    assert!(
        matches!(out.last(), Some(TreeChange::Teardown { root, order }) if *root == fiber.id() && order[..] == [worker.id(), fiber.id()]),
        "{out:?}"
    );
    bounded("shutdown", rt.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_missed_stops_is_told_to_start_over() {
    let settings = RuntimeSettings {
        tree: TreeLimits {
            follow_stops: 4,
            ..TreeLimits::default()
        },
        ..RuntimeSettings::default()
    };
    let rt = Runtime::start(settings).await.unwrap();
    let tree = rt.tree().clone();
    let (_, mut f) = tree.follow();
    let fiber = many_workers(&rt, 10, &Log::default()).await;
    bounded("dispose", fiber.dispose()).await;
    // Eleven stops (ten workers, then the plugin), four remembered.
    let mut out = Vec::new();
    assert_eq!(tree.catch_up(&mut f, &mut out), Err(RecvError::Lagged(7)));
    // Started over: the snapshot, and what follows it.
    let (snapshot, mut f) = tree.follow();
    assert!(snapshot.iter().all(|n| n.id != fiber.id()));
    assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
    bounded("shutdown", rt.shutdown()).await;
}
