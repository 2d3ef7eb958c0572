//! Services: pending until injected services exist, restart on replacement,
//! change events, scope shadowing and revocation.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_supervisors::{Context, ScopeKey, ServiceChange, ServiceChanged, Status, plugin_fn};
use tokio::sync::mpsc;

use super::common::{bounded, runtime};

async fn next(rx: &mut mpsc::UnboundedReceiver<String>) -> String {
    bounded("consumer event", rx.recv()).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_waits_for_its_services_and_restarts_when_one_is_replaced() {
    let rt = runtime().await;
    let changes: Arc<Mutex<Vec<(String, ServiceChange)>>> = Arc::default();
    let c = changes.clone();
    rt.root()
        .on(move |e: &ServiceChanged| c.lock().unwrap().push((e.name.clone(), e.change)))
        .unwrap();

    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let consumer = rt
        .root()
        .plugin(
            plugin_fn("consumer", &["db"], move |ctx: Context| {
                let tx = tx.clone();
                async move {
                    let db: Arc<String> = ctx.get("db").ok_or("db missing during apply")?;
                    tx.send(format!("apply with {db}"))?;
                    let tx2 = tx.clone();
                    ctx.effect("unload", move || {
                        let _ = tx2.send("unload".to_owned());
                    })?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    assert_eq!(consumer.status(), Status::Pending, "waits for `db`");

    let slot: Arc<Mutex<Option<Context>>> = Arc::default();
    let s = slot.clone();
    let provider = rt
        .root()
        .plugin(
            plugin_fn("provider", &[], move |ctx: Context| {
                let s = s.clone();
                async move {
                    ctx.provide("db", Arc::new("v1".to_owned()))?;
                    *s.lock().unwrap() = Some(ctx);
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    assert_eq!(next(&mut rx).await, "apply with v1");
    consumer
        .wait_for(Status::Active, Duration::from_secs(20))
        .await
        .unwrap();

    // Replacing the service restarts the consumer: unload, then apply again.
    let provider_ctx = slot.lock().unwrap().clone().unwrap();
    provider_ctx.set("db", Arc::new("v2".to_owned())).unwrap();
    assert_eq!(next(&mut rx).await, "unload");
    assert_eq!(next(&mut rx).await, "apply with v2");

    // The provider going away sends the consumer back to pending.
    provider.dispose().await;
    assert_eq!(next(&mut rx).await, "unload");
    consumer
        .wait_for(Status::Pending, Duration::from_secs(20))
        .await
        .unwrap();

    let seen: Vec<(String, ServiceChange)> = changes.lock().unwrap().clone();
    assert_eq!(
        seen,
        [
            ("db".to_owned(), ServiceChange::Provided),
            ("db".to_owned(), ServiceChange::Replaced),
            ("db".to_owned(), ServiceChange::Removed),
        ]
    );
    // Providing it again under another fiber activates the consumer again.
    rt.root().provide("db", Arc::new("v3".to_owned())).unwrap();
    assert_eq!(next(&mut rx).await, "apply with v3");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_nearest_scope_shadows_and_disposal_revokes() {
    let rt = runtime().await;
    let root = rt.root();
    root.provide("model", Arc::new("global".to_owned()))
        .unwrap();
    let preset = ScopeKey::new("preset");
    let agent = ScopeKey::new("agent");
    agent.bind_parent(&preset).unwrap();
    let preset_scope = root.scope(preset.clone()).await.unwrap();
    let agent_scope = root.scope(agent.clone()).await.unwrap();
    let get = |ctx: &Context| ctx.get::<String>("model").map(|s| s.as_str().to_owned());

    assert_eq!(get(agent_scope.ctx()).as_deref(), Some("global"));
    preset_scope
        .ctx()
        .provide("model", Arc::new("preset".to_owned()))
        .unwrap();
    assert_eq!(
        get(agent_scope.ctx()).as_deref(),
        Some("preset"),
        "inherits down the chain"
    );
    agent_scope
        .ctx()
        .provide("model", Arc::new("agent".to_owned()))
        .unwrap();
    assert_eq!(
        get(agent_scope.ctx()).as_deref(),
        Some("agent"),
        "nearest wins"
    );
    assert_eq!(
        get(preset_scope.ctx()).as_deref(),
        Some("preset"),
        "never the reverse"
    );
    assert_eq!(get(&root).as_deref(), Some("global"));
    let taken = agent_scope
        .ctx()
        .provide("model", Arc::new("again".to_owned()));
    assert!(taken.unwrap_err().to_string().contains("already provided"));

    // A plugin loaded in the scope resolves its injection through the scope.
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    agent_scope
        .ctx()
        .plugin(
            plugin_fn("scoped-consumer", &["model"], move |ctx: Context| {
                let tx = tx.clone();
                async move {
                    tx.send(ctx.get::<String>("model").unwrap().to_string())?;
                    Ok(())
                }
            }),
            (),
        )
        .await
        .unwrap();
    assert_eq!(rx.recv().await.unwrap(), "agent");

    agent_scope.dispose().await;
    assert_eq!(get(&agent_scope.ctx().clone()).as_deref(), Some("preset"));
    preset_scope.dispose().await;
    assert_eq!(get(&root).as_deref(), Some("global"));
    assert_eq!(get(preset_scope.ctx()).as_deref(), Some("global"));
}
