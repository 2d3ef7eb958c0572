//! The tree registry: records, summaries, mailbox depth, the feed, bounded memory.

use std::sync::Arc;

use dsh_supervisors::tree::{TreeLimits, render};
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
    let wire = serde_json::to_value(&spawned).unwrap();
    assert_eq!(wire["type"], "spawned");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_entries_are_bounded_and_status_changes_are_published() {
    let settings = RuntimeSettings {
        tree: TreeLimits {
            stopped_capacity: 8,
            feed_capacity: 1024,
        },
        ..RuntimeSettings::default()
    };
    let rt = Runtime::start(settings).await.unwrap();
    let log = Log::default();
    let l = log.clone();
    let mut feed = rt.tree().subscribe();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("many", &[], move |ctx: Context| {
                let l = l.clone();
                async move {
                    for i in 0..20 {
                        ctx.spawn(WorkerSpec::new(
                            "worker",
                            format!("w{i}"),
                            Recorder::new(format!("w{i}"), &l),
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
        .unwrap();
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
