//! The five dispatch modes, prepend, removal with the fiber, scope filtering, panics.

use std::sync::Arc;

use dsh_supervisors::events::{EmitFn, WaterfallFn};
use dsh_supervisors::{
    Bail, Context, Emit, Error, Event, ListenOptions, Parallel, ScopeKey, Serial, Target,
    Waterfall, plugin_fn,
};
use tokio::sync::Barrier;

use super::common::{Log, bounded, runtime};

struct Ping(&'static str);
impl Event for Ping {
    const NAME: &'static str = "test/ping";
}
impl Emit for Ping {}

struct Ask(u32);
impl Event for Ask {
    const NAME: &'static str = "test/ask";
}
impl Bail for Ask {
    type Output = String;
}
impl Serial for Ask {
    type Output = String;
}

struct Fan;
impl Event for Fan {
    const NAME: &'static str = "test/fan";
}
impl Parallel for Fan {}

/// A request the middleware may annotate.
struct Req(Vec<String>);
impl Event for Req {
    const NAME: &'static str = "test/request";
}
impl Waterfall for Req {
    type Output = Vec<String>;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emit_runs_in_registration_order_with_prepend_first() {
    let rt = runtime().await;
    let ctx = rt.root();
    let log = Log::default();
    for tag in ["a", "b"] {
        let l = log.clone();
        ctx.on(move |p: &Ping| l.push(format!("{tag}:{}", p.0)))
            .unwrap();
    }
    let l = log.clone();
    ctx.listen::<EmitFn<Ping>>(
        Box::new(move |p: &Ping| l.push(format!("first:{}", p.0))),
        ListenOptions {
            prepend: true,
            ..ListenOptions::default()
        },
    )
    .unwrap();
    ctx.emit(&Ping("x"));
    assert_eq!(log.lines(), ["first:x", "a:x", "b:x"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bail_and_serial_stop_at_the_first_answer() {
    let rt = runtime().await;
    let ctx = rt.root();
    let log = Log::default();
    let l = log.clone();
    ctx.on_bail(move |a: &Ask| {
        l.push("bail-1");
        (a.0 > 10).then(|| "big".to_owned())
    })
    .unwrap();
    let l = log.clone();
    ctx.on_bail(move |_: &Ask| {
        l.push("bail-2");
        Some("fallback".to_owned())
    })
    .unwrap();
    let l = log.clone();
    ctx.on_bail(move |_: &Ask| {
        l.push("bail-3");
        Some("never".to_owned())
    })
    .unwrap();
    assert_eq!(ctx.bail(&Ask(50)).as_deref(), Some("big"));
    assert_eq!(ctx.bail(&Ask(1)).as_deref(), Some("fallback"));
    assert_eq!(log.lines(), ["bail-1", "bail-1", "bail-2"]);

    let l = log.clone();
    ctx.on_serial(move |a: Arc<Ask>| {
        let l = l.clone();
        async move {
            tokio::task::yield_now().await;
            l.push("serial-1");
            (a.0 == 7).then(|| "seven".to_owned())
        }
    })
    .unwrap();
    let l = log.clone();
    ctx.on_serial(move |_a: Arc<Ask>| {
        let l = l.clone();
        async move {
            l.push("serial-2");
            None
        }
    })
    .unwrap();
    assert_eq!(ctx.serial(Ask(7)).await.as_deref(), Some("seven"));
    assert_eq!(ctx.serial(Ask(8)).await, None);
    assert_eq!(log.lines()[3..], ["serial-1", "serial-1", "serial-2"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_runs_listeners_concurrently_and_awaits_them_all() {
    let rt = runtime().await;
    let ctx = rt.root();
    // Each listener waits for the other: this only completes if both run at once.
    let barrier = Arc::new(Barrier::new(2));
    let log = Log::default();
    for tag in ["x", "y"] {
        let (b, l) = (barrier.clone(), log.clone());
        ctx.on_parallel(move |_: Arc<Fan>| {
            let (b, l) = (b.clone(), l.clone());
            async move {
                b.wait().await;
                l.push(tag);
            }
        })
        .unwrap();
    }
    bounded("parallel dispatch", ctx.parallel(Fan)).await;
    let mut got = log.lines();
    got.sort();
    assert_eq!(got, ["x", "y"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waterfall_wraps_the_terminal_and_may_short_circuit_or_retry() {
    let rt = runtime().await;
    let ctx = rt.root();
    ctx.on_waterfall(|mut req: Req, next| async move {
        req.0.push("outer-in".into());
        let mut out = next.run(req).await;
        out.push("outer-out".into());
        out
    })
    .unwrap();
    let inner = ctx
        .on_waterfall(|mut req: Req, next| async move {
            if req.0.first().map(String::as_str) == Some("veto") {
                return vec!["vetoed".to_owned()];
            }
            if req.0.first().map(String::as_str) == Some("retry") {
                let first = next.run(Req(vec!["attempt-1".into()])).await;
                let mut second = next.run(Req(vec!["attempt-2".into()])).await;
                second.extend(first);
                return second;
            }
            req.0.push("inner".into());
            next.run(req).await
        })
        .unwrap();
    let terminal = |req: Req| async move {
        let mut v = req.0;
        v.push("terminal".into());
        v
    };
    let out = ctx.waterfall(Req(vec![]), terminal).await.unwrap();
    assert_eq!(out, ["outer-in", "inner", "terminal", "outer-out"]);
    let out = ctx
        .waterfall(Req(vec!["veto".into()]), terminal)
        .await
        .unwrap();
    assert_eq!(out, ["vetoed", "outer-out"]);
    let out = ctx
        .waterfall(Req(vec!["retry".into()]), terminal)
        .await
        .unwrap();
    assert_eq!(
        out,
        [
            "attempt-2",
            "terminal",
            "attempt-1",
            "terminal",
            "outer-out"
        ]
    );
    inner.dispose().await;
    let out = ctx.waterfall(Req(vec![]), terminal).await.unwrap();
    assert_eq!(out, ["outer-in", "terminal", "outer-out"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_go_away_with_their_fiber() {
    let rt = runtime().await;
    let log = Log::default();
    let l = log.clone();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("listener", &[], move |ctx: Context| {
                let l = l.clone();
                async move {
                    ctx.on(move |p: &Ping| l.push(p.0))?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    rt.root().emit(&Ping("before"));
    assert_eq!(rt.events().listener_count::<EmitFn<Ping>>(), 1);
    fiber.dispose().await;
    rt.root().emit(&Ping("after"));
    assert_eq!(log.lines(), ["before"]);
    assert_eq!(rt.events().listener_count::<EmitFn<Ping>>(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scope_filtered_dispatch_reaches_the_key_and_its_ancestors() {
    let rt = runtime().await;
    let root = rt.root();
    let parent = ScopeKey::new("preset");
    let agent = ScopeKey::new("agent-a");
    let other = ScopeKey::new("agent-b");
    agent.bind_parent(&parent).unwrap();
    let log = Log::default();
    let listen = |ctx: &Context, tag: &'static str, global: bool| {
        let l = log.clone();
        ctx.listen::<EmitFn<Ping>>(
            Box::new(move |p: &Ping| l.push(format!("{tag}<{}", p.0))),
            ListenOptions {
                global,
                ..ListenOptions::default()
            },
        )
        .unwrap();
    };
    listen(&root, "untagged", false);
    let parent_scope = root.scope(parent.clone()).await.unwrap();
    let agent_scope = root.scope(agent.clone()).await.unwrap();
    let other_scope = root.scope(other.clone()).await.unwrap();
    listen(parent_scope.ctx(), "preset", false);
    listen(agent_scope.ctx(), "agent-a", false);
    listen(other_scope.ctx(), "agent-b", false);
    listen(other_scope.ctx(), "global-b", true);

    rt.events()
        .emit(&Target::Scope(Some(agent.clone())), &Ping("a"));
    assert_eq!(
        log.lines(),
        ["untagged<a", "preset<a", "agent-a<a", "global-b<a"]
    );
    let mut seen = log.lines().len();
    rt.events()
        .emit(&Target::Scope(Some(parent.clone())), &Ping("p"));
    assert_eq!(
        log.lines()[seen..],
        ["untagged<p", "preset<p", "global-b<p"]
    );
    seen = log.lines().len();
    rt.events().emit(&Target::Scope(None), &Ping("none"));
    assert_eq!(log.lines()[seen..], ["untagged<none", "global-b<none"]);
    seen = log.lines().len();
    rt.events().emit(&Target::All, &Ping("all"));
    assert_eq!(log.lines().len() - seen, 5);

    // Disposing a scope revokes what was registered through it.
    agent_scope.dispose().await;
    seen = log.lines().len();
    rt.events()
        .emit(&Target::Scope(Some(agent.clone())), &Ping("gone"));
    assert_eq!(
        log.lines()[seen..],
        ["untagged<gone", "preset<gone", "global-b<gone"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_listener_never_poisons_the_dispatcher() {
    let rt = runtime().await;
    let log = Log::default();
    let l = log.clone();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("faulty", &[], move |ctx: Context| {
                let l = l.clone();
                async move {
                    ctx.on(|_: &Ping| panic!("emit listener down"))?;
                    let l2 = l.clone();
                    ctx.on(move |p: &Ping| l2.push(format!("after:{}", p.0)))?;
                    ctx.on_bail(|_: &Ask| -> Option<String> { panic!("bail listener down") })?;
                    ctx.on_bail(|_: &Ask| Some("second".to_owned()))?;
                    ctx.on_parallel(|_: Arc<Fan>| async { panic!("parallel listener down") })?;
                    let l3 = l.clone();
                    ctx.on_parallel(move |_: Arc<Fan>| {
                        let l3 = l3.clone();
                        async move { l3.push("parallel ok") }
                    })?;
                    ctx.on_waterfall(|req: Req, next| async move {
                        if req.0.is_empty() {
                            panic!("waterfall listener down");
                        }
                        next.run(req).await
                    })?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    let ctx = rt.root();
    ctx.emit(&Ping("1"));
    ctx.emit(&Ping("2"));
    assert_eq!(ctx.bail(&Ask(0)).as_deref(), Some("second"));
    ctx.parallel(Fan).await;
    assert_eq!(log.lines(), ["after:1", "after:2", "parallel ok"]);

    let terminal = |req: Req| async move { req.0 };
    let err = ctx.waterfall(Req(vec![]), terminal).await.unwrap_err();
    match err {
        Error::ListenerPanicked {
            event,
            fiber: who,
            message,
        } => {
            assert_eq!(event, "test/request");
            assert_eq!(who, fiber.id());
            assert_eq!(message, "waterfall listener down");
        }
        other => panic!("unexpected {other}"),
    }
    // The same chain still works for the next dispatch.
    let out = ctx
        .waterfall(Req(vec!["ok".into()]), terminal)
        .await
        .unwrap();
    assert_eq!(out, ["ok"]);
    assert_eq!(rt.events().listener_count::<WaterfallFn<Req>>(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_cannot_outlive_an_unloading_owner() {
    let rt = runtime().await;
    let outcome: Arc<std::sync::Mutex<Option<bool>>> = Arc::default();
    let o = outcome.clone();
    let fiber = rt
        .root()
        .plugin(
            plugin_fn("late", &[], move |ctx: Context| {
                let o = o.clone();
                async move {
                    let late = ctx.clone();
                    ctx.effect("listen while unloading", move || {
                        *o.lock().unwrap() = Some(late.on(|_: &Ping| {}).is_ok());
                    })?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    fiber.dispose().await;
    assert_eq!(
        *outcome.lock().unwrap(),
        Some(false),
        "registration refused"
    );
    assert_eq!(
        rt.events().listener_count::<EmitFn<Ping>>(),
        0,
        "and nothing left behind"
    );
}
