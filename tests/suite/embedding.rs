//! The embedding example (`docs/embedding.md`), run as written.

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
    let _sweep = crate::suite::sweep();
    embed().await.unwrap();
}

/// The embedding example as a real process: a request streams an agent's
/// events, SIGTERM drains every agent in order, and the process exits cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_embedding_example_streams_an_agent_and_drains_on_sigterm() {
    let _sweep = crate::suite::sweep();
    use futures::StreamExt;
    use tokio::io::AsyncBufReadExt;
    let wait = std::time::Duration::from_secs(60);
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dsh-embed-example"))
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let first = tokio::time::timeout(wait, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let base = first.strip_prefix("listening on ").unwrap().to_owned();
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder().timeout(wait).build().unwrap();
    for topic in ["actors", "teardown"] {
        let r = client
            .post(format!("{base}/ask"))
            .json(&serde_json::json!({"prompt": format!("Write one line about {topic}.")}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let mut body = r.bytes_stream();
        let mut text = String::new();
        while let Some(chunk) = tokio::time::timeout(wait, body.next()).await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk.unwrap()));
        }
        assert!(text.contains("\"turn/end\""), "{text}");
        assert!(text.contains(&format!("{topic}:")), "{text}");
    }
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let last = tokio::time::timeout(wait, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(last, "shut down: 2 agents disposed");
    let status = tokio::time::timeout(wait, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}
