//! The `web` plugin's HTTP/SSE API, against a real server on a loopback port.

use std::time::Duration;

use dsh::kernel::{Runtime, RuntimeSettings, ScopeKey};
use dsh::web::{Web, WebConfig, WebServer};
use futures::StreamExt;

const WAIT: Duration = Duration::from_secs(30);

async fn serve(token_env: Option<&str>) -> (Runtime, String) {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let config = WebConfig {
        bind: "127.0.0.1:0".into(),
        token_env: token_env.map(str::to_owned),
    };
    rt.root().plugin(Web, config).await.unwrap();
    let web = rt.root().get::<WebServer>(WebServer::SERVICE).unwrap();
    (rt, format!("http://{}", web.local_addr()))
}

fn client() -> reqwest::Client {
    // reqwest is built without a default TLS provider (plain HTTP here).
    let _ = rustls::crypto::ring::default_provider().install_default();
    reqwest::Client::builder().timeout(WAIT).build().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tree_and_actors_are_served_as_json_with_json_errors() {
    let (rt, base) = serve(None).await;
    let c = client();
    let tree: serde_json::Value = c
        .get(format!("{base}/api/tree"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let nodes = tree.as_array().unwrap();
    assert!(nodes.iter().any(|n| n["kind"] == "root"), "{tree}");
    let web = nodes.iter().find(|n| n["kind"] == "web").unwrap();
    let plugin = web["parent"].as_u64().unwrap();

    let r = c
        .get(format!("{base}/api/actors/{plugin}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let detail: serde_json::Value = r.json().await.unwrap();
    assert_eq!(detail["node"]["id"], plugin);
    assert_eq!(detail["children"], serde_json::json!([web["id"]]));

    for (path, status, code) in [
        ("/api/actors/999999", 404, "NOT_FOUND"),
        ("/api/actors/abc", 400, "BAD_ID"),
        ("/api/nothing-here", 404, "NOT_FOUND"),
    ] {
        let r = c.get(format!("{base}{path}")).send().await.unwrap();
        assert_eq!(r.status(), status, "{path}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], code, "{path}: {body}");
        assert!(body["error"]["message"].as_str().unwrap().len() > 5);
    }
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dsh_serve_requires_its_token_and_exits_cleanly_on_sigterm() {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args([
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--token-env",
            "DSH_TEST_WEB_TOKEN",
        ])
        .env("DSH_TEST_WEB_TOKEN", "s3cret")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let line = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let base = line
        .strip_prefix("dsh serve: listening on ")
        .unwrap_or_else(|| panic!("unexpected first line: {line}"))
        .to_owned();
    let c = client();
    let r = c.get(format!("{base}/api/tree")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "UNAUTHORIZED");
    let r = c
        .get(format!("{base}/api/tree"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .get(format!("{base}/api/tree"))
        .bearer_auth("s3cret")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let tree: serde_json::Value = r.json().await.unwrap();
    assert!(
        tree.as_array()
            .unwrap()
            .iter()
            .any(|n| n["name"] == "plugin/agent-services"),
        "{tree}"
    );
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = tokio::time::timeout(WAIT, child.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_off_loopback_without_a_token_is_refused() {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let config = WebConfig {
        bind: "0.0.0.0:0".into(),
        token_env: None,
    };
    let err = match rt.root().plugin(Web, config).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("the plugin should refuse"),
    };
    assert!(err.contains("requires a token"), "{err}");
    assert!(rt.root().get::<WebServer>(WebServer::SERVICE).is_none());
    rt.shutdown().await;
}

/// Reads SSE events (name, data) from a response body until `want` matches.
async fn until<S>(
    body: &mut S,
    buf: &mut String,
    want: impl Fn(&str, &str) -> bool,
) -> (String, String)
where
    S: futures::Stream<Item = reqwest::Result<axum::body::Bytes>> + Unpin,
{
    loop {
        while let Some(end) = buf.find("\n\n") {
            let block: String = buf.drain(..end + 2).collect();
            let mut name = String::new();
            let mut data = String::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    name = v.trim().to_owned();
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push_str(v.trim_start());
                }
            }
            if want(&name, &data) {
                return (name, data);
            }
        }
        let chunk = tokio::time::timeout(WAIT, body.next())
            .await
            .expect("an SSE event within the wait")
            .expect("the stream is open")
            .unwrap();
        buf.push_str(&String::from_utf8_lossy(&chunk));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_sends_a_snapshot_then_deltas_and_ends_at_shutdown() {
    let (rt, base) = serve(None).await;
    let r = client()
        .get(format!("{base}/api/tree/stream"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(
        r.headers()["content-type"].to_str().unwrap(),
        "text/event-stream"
    );
    let mut body = r.bytes_stream();
    let mut buf = String::new();
    let (_, snapshot) = until(&mut body, &mut buf, |name, _| name == "snapshot").await;
    let snapshot: serde_json::Value = serde_json::from_str(&snapshot).unwrap();
    assert!(snapshot["nodes"].as_array().unwrap().len() >= 3);
    // A scope spawned now shows up as a delta.
    let scope = rt.root().scope(ScopeKey::new("watched")).await.unwrap();
    let id = scope.fiber().id();
    let (_, delta) = until(&mut body, &mut buf, |name, data| {
        name == "delta" && data.contains("scope/watched")
    })
    .await;
    let delta: serde_json::Value = serde_json::from_str(&delta).unwrap();
    let spawned = delta["changes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "spawned" && c["node"]["id"] == id);
    assert!(spawned.is_some(), "{delta}");
    // Disposing it is a `stopped` change.
    scope.dispose().await;
    let stopped = |data: &str| {
        serde_json::from_str::<serde_json::Value>(data)
            .ok()
            .and_then(|d| d["changes"].as_array().cloned())
            .is_some_and(|cs| cs.iter().any(|c| c["type"] == "stopped" && c["id"] == id))
    };
    until(&mut body, &mut buf, |name, data| {
        name == "delta" && stopped(data)
    })
    .await;
    // Shutdown ends the open stream instead of waiting on it.
    tokio::time::timeout(WAIT, rt.shutdown())
        .await
        .expect("shutdown does not wait on an open stream");
    let rest =
        tokio::time::timeout(WAIT, async { while let Some(Ok(_)) = body.next().await {} }).await;
    assert!(rest.is_ok(), "the stream ended");
}
