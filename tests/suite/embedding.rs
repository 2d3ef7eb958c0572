//! The README's embedding example, run as written.

use std::sync::Arc;

use dsh::kernel::{BoxError, Context, Runtime, RuntimeSettings, plugin_fn};

async fn embed() -> Result<(), BoxError> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    rt.root()
        .plugin(
            plugin_fn("db", &[], |ctx: Context| async move {
                ctx.provide("db", Arc::new(String::from("sqlite://app.db")))?;
                ctx.effect("close", || println!("db closed"))?; // runs once, on unload
                Ok(())
            }),
            (),
        )
        .await?;
    // A plugin that injects `db` stays pending until it exists, and restarts if it is replaced.
    rt.root()
        .plugin(
            plugin_fn("api", &["db"], |ctx: Context| async move {
                let db: Arc<String> = ctx.get("db").ok_or("no db")?;
                println!("api up on {db}");
                Ok(())
            }),
            (),
        )
        .await?;
    rt.shutdown().await; // api, then db: reverse start order, every budget honoured
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_embedding_example_runs() {
    embed().await.unwrap();
}
