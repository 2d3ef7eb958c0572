//! The `web` plugin's HTTP/SSE API, against a real server on a loopback port.

use std::sync::Arc;
use std::time::Duration;

use dsh::kernel::{Runtime, RuntimeSettings, ScopeKey, Status};
use dsh::web::{Web, WebConfig, WebServer};
use futures::StreamExt;

const WAIT: Duration = Duration::from_secs(30);

/// The web plugin alone (reads only: no token) on a free loopback port.
async fn serve() -> (Runtime, String) {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let config = WebConfig {
        bind: "127.0.0.1:0".into(),
        token_env: None,
        mutations: false,
    };
    rt.root().plugin(Web, config).await.unwrap();
    let web = rt.root().get::<WebServer>(WebServer::SERVICE).unwrap();
    (rt, format!("http://{}", web.local_addr()))
}

/// GETs `url` and parses the JSON body.
pub(super) async fn get_json(c: &reqwest::Client, url: String) -> serde_json::Value {
    c.get(url).send().await.unwrap().json().await.unwrap()
}

/// POSTs `body` as JSON to `url`.
async fn post(c: &reqwest::Client, url: String, body: serde_json::Value) -> reqwest::Response {
    c.post(url).json(&body).send().await.unwrap()
}

fn client() -> reqwest::Client {
    client_with(None)
}

/// A client that sends `token` (as `Authorization: Bearer`) with every
/// request.
fn client_with(token: Option<&str>) -> reqwest::Client {
    // reqwest is built without a default TLS provider (plain HTTP here).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(token) = token {
        let value = format!("Bearer {token}").parse().unwrap();
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    reqwest::Client::builder()
        .timeout(WAIT)
        .default_headers(headers)
        .build()
        .unwrap()
}

/// A printed URL (`http://ADDR` or `http://ADDR/#token=T`): the base and a
/// client that carries the token, if the URL has one.
pub(super) fn endpoint(url: &str) -> (String, reqwest::Client) {
    match url.split_once("/#token=") {
        Some((base, token)) => (base.to_owned(), client_with(Some(token))),
        None => (url.trim_end_matches('/').to_owned(), client()),
    }
}

/// The page is served with a Content-Security-Policy that lets only its
/// own inline script and style run (named by their SHA-256, as served),
/// requests go only to this server, images only from here or `data:`, and
/// no one frames it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_is_served_under_a_policy_that_runs_only_its_own_script() {
    use base64::Engine as _;
    let (rt, base) = serve().await;
    let page = client().get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let policy = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(page.headers()["x-content-type-options"], "nosniff");
    let body = page.text().await.unwrap();
    let hash = |open: &str, close: &str| {
        let inner = body
            .split_once(open)
            .unwrap()
            .1
            .split_once(close)
            .unwrap()
            .0;
        let digest = ring::digest::digest(&ring::digest::SHA256, inner.as_bytes());
        format!(
            "'sha256-{}'",
            base64::engine::general_purpose::STANDARD.encode(digest.as_ref())
        )
    };
    let directives: Vec<&str> = policy.split("; ").collect();
    for expected in [
        "default-src 'none'".to_owned(),
        format!("script-src {}", hash("<script>", "</script>")),
        format!("style-src {}", hash("<style>", "</style>")),
        "connect-src 'self'".to_owned(),
        "img-src 'self' data:".to_owned(),
        "frame-ancestors 'none'".to_owned(),
    ] {
        assert!(
            directives.contains(&expected.as_str()),
            "{expected} not in {policy}"
        );
    }
    // One script, one style: nothing inline goes unnamed.
    assert_eq!(body.matches("<script").count(), 1);
    assert_eq!(body.matches("<style").count(), 1);
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tree_and_actors_are_served_as_json_with_json_errors() {
    let _sweep = crate::suite::sweep();
    let (rt, base) = serve().await;
    let c = client();
    let tree: serde_json::Value = get_json(&c, format!("{base}/api/tree")).await;
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

/// Starts `dsh serve` with `args` and `env` (and none of the caller's model
/// or policy variables); returns it, the base URL it printed and a client
/// with the token the URL carried (a made one: `--mutations` without
/// `--token-env`).
async fn dsh_serve(
    args: &[String],
    env: &[(&str, &str)],
) -> (tokio::process::Child, String, reqwest::Client) {
    dsh_serve_in(&std::env::current_dir().unwrap(), args, env).await
}

/// [`dsh_serve`] with `cwd` as its working directory (its agents'
/// workspace).
async fn dsh_serve_in(
    cwd: &std::path::Path,
    args: &[String],
    env: &[(&str, &str)],
) -> (tokio::process::Child, String, reqwest::Client) {
    let (child, url) = dsh_serve_url(cwd, args, env).await;
    let (base, c) = endpoint(&url);
    (child, base, c)
}

/// `dsh serve ARGS…` in `cwd` (with `env` set): the process and the URL it
/// printed (`#token=…` included when it made one).
pub(super) async fn dsh_serve_url(
    cwd: &std::path::Path,
    args: &[String],
    env: &[(&str, &str)],
) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dsh"))
        .current_dir(cwd)
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .env_remove("DSH_APPROVAL")
        .envs(env.iter().copied())
        .arg("serve")
        .args(args)
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
        .unwrap_or_default();
    let url = line
        .strip_prefix("dsh serve: listening on ")
        .unwrap_or_else(|| panic!("{args:?}: unexpected first line: {line}"))
        .to_owned();
    (child, url)
}

/// SIGTERM, then the exit status (within the wait budget).
pub(super) async fn terminate(mut child: tokio::process::Child) -> std::process::ExitStatus {
    let pid = nix::unistd::Pid::from_raw(child.id().unwrap() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    tokio::time::timeout(WAIT, child.wait())
        .await
        .unwrap()
        .unwrap()
}

/// `dsh serve --config` serves whatever tree the file boots: one with no
/// agent services, or with several model routes, needs no route picked;
/// with the keyless model from the flags, the API creates an agent on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dsh_serve_takes_any_config_or_a_model_from_its_flags() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-serve").unwrap();
    let web_only = dir.join("web.yml");
    std::fs::write(
        &web_only,
        "plugins:\n  - id: web\n    name: web\n    config: { bind: \"127.0.0.1:0\" }\n",
    )
    .unwrap();
    let two_routes = dir.join("two.yml");
    let script = dir.join("s.json");
    std::fs::write(&script, r#"{"steps": [{"text": "hi"}]}"#).unwrap();
    std::fs::write(
        &two_routes,
        format!(
            "plugins:\n  - {{ id: services, name: agent-services }}\n  \
             - {{ id: a, name: scripted, config: {{ provider: a, script: {s} }} }}\n  \
             - {{ id: b, name: scripted, config: {{ provider: b, script: {s} }} }}\n",
            s = script.display()
        ),
    )
    .unwrap();
    let cases: [Vec<String>; 3] = [
        vec!["--config".into(), web_only.display().to_string()],
        vec![
            "--config".into(),
            two_routes.display().to_string(),
            "--bind".into(),
            "127.0.0.1:0".into(),
        ],
        vec![
            "--demo-model".into(),
            "--mutations".into(),
            "--bind".into(),
            "127.0.0.1:0".into(),
        ],
    ];
    let sessions = dir.join("sessions");
    for args in cases {
        let (child, base, c) =
            dsh_serve(&args, &[("DSH_SESSIONS_DIR", sessions.to_str().unwrap())]).await;
        let r = c.get(format!("{base}/api/tree")).send().await.unwrap();
        assert_eq!(r.status(), 200, "{args:?}");
        // What the page's start form offers: the routes, with the model the
        // flags chose; the modes at most the server's.
        let offered = get_json(&c, format!("{base}/api/routes")).await;
        let providers: Vec<&str> = offered["routes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["provider"].as_str().unwrap())
            .collect();
        let demo = args.contains(&"--demo-model".to_owned());
        let expected: &[&str] = if demo {
            &["demo"]
        } else if args.contains(&two_routes.display().to_string()) {
            &["a", "b"]
        } else {
            &[]
        };
        assert_eq!(providers, expected, "{args:?}: {offered}");
        assert_eq!(offered["mutations"], demo, "{offered}");
        assert_eq!(
            offered["permissionModes"],
            serde_json::json!(["read-only", "workspace-write"]),
            "{offered}"
        );
        if demo {
            assert_eq!(offered["routes"][0]["models"], serde_json::json!(["demo"]));
        }
        if demo {
            let r = c
                .post(format!("{base}/api/agents"))
                .json(&serde_json::json!({"prompt": "Write one line about teardown."}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 201, "{args:?}");
        }
        let status = terminate(child).await;
        assert!(status.success(), "{args:?}: {status:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dsh_serve_requires_its_token_and_exits_cleanly_on_sigterm() {
    let _sweep = crate::suite::sweep();
    let args = ["--bind", "127.0.0.1:0", "--token-env", "DSH_TEST_WEB_TOKEN"].map(String::from);
    let (child, base, c) = dsh_serve(&args, &[("DSH_TEST_WEB_TOKEN", "s3cret")]).await;
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
    let status = terminate(child).await;
    assert!(status.success(), "{status:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binding_off_loopback_without_a_token_is_refused() {
    let _sweep = crate::suite::sweep();
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let config = WebConfig {
        bind: "0.0.0.0:0".into(),
        token_env: None,
        mutations: false,
    };
    let err = match rt.root().plugin(Web, config).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("the plugin should refuse"),
    };
    assert!(err.contains("requires a token"), "{err}");
    assert!(rt.root().get::<WebServer>(WebServer::SERVICE).is_none());
    rt.shutdown().await;
}

/// Opens a tree stream (`query` after the path) and reads it up to its
/// first snapshot: the body, what was read past the snapshot, the snapshot.
async fn open_stream(
    base: &str,
    query: &str,
) -> (
    impl futures::Stream<Item = reqwest::Result<axum::body::Bytes>> + Unpin,
    String,
    serde_json::Value,
) {
    let r = client()
        .get(format!("{base}/api/tree/stream{query}"))
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
    (body, buf, serde_json::from_str(&snapshot).unwrap())
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
    let _sweep = crate::suite::sweep();
    let (rt, base) = serve().await;
    // Every change, and the viewer's stream (`?coalesce=1`), side by side.
    let mut streams = Vec::new();
    for query in ["", "?coalesce=1"] {
        let (body, buf, snapshot) = open_stream(&base, query).await;
        assert!(snapshot["nodes"].as_array().unwrap().len() >= 3, "{query}");
        streams.push((query, body, buf));
    }
    // A scope spawned now shows up as a delta.
    let scope = rt.root().scope(ScopeKey::new("watched")).await.unwrap();
    let id = scope.fiber().id();
    for (query, body, buf) in &mut streams {
        let (_, delta) = until(body, buf, |name, data| {
            name == "delta" && data.contains("scope/watched")
        })
        .await;
        let delta: serde_json::Value = serde_json::from_str(&delta).unwrap();
        let spawned = delta["changes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["type"] == "spawned" && c["node"]["id"] == id);
        assert!(spawned.is_some(), "{query}: {delta}");
    }
    // Disposing it is a `stopped` change.
    scope.dispose().await;
    let stopped = |data: &str| {
        serde_json::from_str::<serde_json::Value>(data)
            .ok()
            .and_then(|d| d["changes"].as_array().cloned())
            .is_some_and(|cs| cs.iter().any(|c| c["type"] == "stopped" && c["id"] == id))
    };
    for (_, body, buf) in &mut streams {
        until(body, buf, |name, data| name == "delta" && stopped(data)).await;
    }
    // Shutdown ends the open streams instead of waiting on them.
    tokio::time::timeout(WAIT, rt.shutdown())
        .await
        .expect("shutdown does not wait on an open stream");
    for (query, mut body, _) in streams {
        let rest =
            tokio::time::timeout(WAIT, async { while let Some(Ok(_)) = body.next().await {} })
                .await;
        assert!(rest.is_ok(), "the stream {query} ended");
    }
}

async fn serve_agents(mutations: bool) -> (Runtime, String, reqwest::Client) {
    serve_agents_at("127.0.0.1:0", mutations).await
}

/// The agent services with the demo model, and the web plugin on `bind`.
async fn serve_agents_at(bind: &str, mutations: bool) -> (Runtime, String, reqwest::Client) {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let root = rt.root();
    root.plugin(dsh::catalogue::AgentServices, Default::default())
        .await
        .unwrap();
    let llm = root
        .get::<dsh::services::llm::LlmRuntime>(dsh::services::llm::LlmRuntime::SERVICE)
        .unwrap();
    llm.register(&root, &["demo"], std::sync::Arc::new(dsh::demo::DemoModel))
        .unwrap();
    let config = WebConfig {
        bind: bind.into(),
        token_env: None,
        mutations,
    };
    root.plugin(Web, config).await.unwrap();
    let web = root.get::<WebServer>(WebServer::SERVICE).unwrap();
    assert_eq!(web.token().is_some(), mutations, "a token with mutations");
    let (base, c) = endpoint(&web.page_url());
    (rt, base, c)
}

/// Creates an agent through the API with `prompt` and waits until its
/// turn is over; its id and handle.
async fn created_idle(
    c: &reqwest::Client,
    base: &str,
    rt: &Runtime,
    prompt: &str,
) -> (String, dsh::actors::agent::Agent) {
    let created: serde_json::Value = post(
        c,
        format!("{base}/api/agents"),
        serde_json::json!({"prompt": prompt}),
    )
    .await
    .json()
    .await
    .unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let a = agent(rt, &id);
    a.when_idle(WAIT).await.unwrap();
    (id, a)
}

fn agent(rt: &Runtime, id: &str) -> dsh::actors::agent::Agent {
    rt.root()
        .get::<dsh::actors::agent::Agents>(dsh::actors::agent::Agents::SERVICE)
        .unwrap()
        .get(id)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agents_are_created_followed_and_their_sessions_read_and_tailed() {
    let _sweep = crate::suite::sweep();
    let (rt, base, c) = serve_agents(true).await;
    let r = post(
        &c,
        format!("{base}/api/agents"),
        serde_json::json!({"prompt": "Write one line about actors."}),
    )
    .await;
    assert_eq!(r.status(), 201);
    let created: serde_json::Value = r.json().await.unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let node = created["node"].as_u64().unwrap();

    // The tail replays the history, then follows: read to the first turn's end.
    let r = c
        .get(format!("{base}/api/sessions/{id}/events?stream=1"))
        .send()
        .await
        .unwrap();
    let mut body = r.bytes_stream();
    let mut buf = String::new();
    let (_, end) = until(&mut body, &mut buf, |name, data| {
        name == "event" && data.contains("\"turn/end\"")
    })
    .await;
    assert!(end.contains("completed"), "{end}");

    let a = agent(&rt, &id);
    a.when_idle(WAIT).await.unwrap();
    let detail: serde_json::Value = get_json(&c, format!("{base}/api/actors/{node}")).await;
    assert_eq!(detail["agent"]["id"], id.as_str());
    assert_eq!(detail["agent"]["progress"]["turn"], 1);
    assert_eq!(detail["agent"]["progress"]["running"], false);
    assert!(
        detail["agent"]["last_turn"]["text"]
            .as_str()
            .unwrap()
            .starts_with("actors:")
    );
    assert!(
        !detail["agent"]["recent_events"]
            .as_array()
            .unwrap()
            .is_empty()
    );

    // A followup becomes turn 2, and the open tail sees it.
    let r = c
        .post(format!("{base}/api/agents/{id}/followup"))
        .json(&serde_json::json!({"text": "Write one line about teardown."}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, second) = until(&mut body, &mut buf, |name, data| {
        name == "event" && data.contains("\"turn/end\"") && data.contains("\"turn\":2")
    })
    .await;
    assert!(second.contains("completed"), "{second}");

    let page: serde_json::Value = get_json(
        &c,
        format!("{base}/api/sessions/{id}/events?from_seq=1&limit=3"),
    )
    .await;
    let seqs: Vec<u64> = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, vec![1, 2, 3]);
    let sessions: serde_json::Value = get_json(&c, format!("{base}/api/sessions")).await;
    assert!(
        sessions
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["id"] == id.as_str() && s["live"] == true)
    );
    let r = c
        .post(format!("{base}/api/agents/{id}/cancel"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // Stopping the agent disposes its subtree; it is then among the stopped.
    let r = c
        .post(format!("{base}/api/actors/{node}/stop"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let stopped: serde_json::Value = get_json(&c, format!("{base}/api/tree/stopped")).await;
    let seqs: Vec<u64> = stopped
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["stop_seq"].as_u64().unwrap())
        .collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "in stop order: {seqs:?}"
    );
    assert!(stopped.as_array().unwrap().iter().any(|n| n["id"] == node));
    // The run's record holds it too, stopped, timed, under its parent.
    let record: serde_json::Value = get_json(&c, format!("{base}/api/record")).await;
    let entries = record["entries"].as_array().unwrap();
    let entry = entries.iter().find(|e| e["id"] == node).unwrap();
    assert_eq!(entry["status"], "disposed", "{entry}");
    assert!(
        entry["ms"].is_u64() && entry["reason"].is_string(),
        "{entry}"
    );
    assert!(
        entries.iter().any(|e| e["id"] == entry["parent"]),
        "{record}"
    );
    assert_eq!(record["more"], 0);
    let detail: serde_json::Value = get_json(&c, format!("{base}/api/actors/{node}")).await;
    assert_eq!(detail["node"]["status"], "disposed");
    // Any actor stops the same way: here a scope with a worker inside.
    let victim = rt.root().scope(ScopeKey::new("victim")).await.unwrap();
    let vid = victim.fiber().id();
    let r = c
        .post(format!("{base}/api/actors/{vid}/stop"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["order"], serde_json::json!([vid]));
    assert!(victim.fiber().status().is_terminal());
    // The root stops only with the server.
    let root_id = rt.root().fiber().id();
    let r = c
        .post(format!("{base}/api/actors/{root_id}/stop"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "NOT_STOPPABLE");
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_json_errors_and_mutations_can_be_off() {
    let _sweep = crate::suite::sweep();
    let (rt, base, c) = serve_agents(true).await;
    let post = |path: &str, body: &str| {
        c.post(format!("{base}{path}"))
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
    };
    for (path, body, status, code) in [
        ("/api/agents", "{not json", 400, "BAD_JSON"),
        (
            "/api/agents",
            r#"{"prompt": "x", "colour": "red"}"#,
            400,
            "BAD_JSON",
        ),
        (
            "/api/agents",
            r#"{"prompt": "x", "provider": "nope"}"#,
            400,
            "UNKNOWN_PROVIDER",
        ),
        (
            "/api/agents/no-such-agent/followup",
            r#"{"text": "x"}"#,
            404,
            "NOT_FOUND",
        ),
    ] {
        let r = post(path, body).await.unwrap();
        assert_eq!(r.status(), status, "{path} {body}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], code, "{path} {body}: {v}");
    }
    let huge = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(70 * 1024));
    let r = post("/api/agents", &huge).await.unwrap();
    assert_eq!(r.status(), 413);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "TOO_LARGE");
    let r = c
        .get(format!("{base}/api/sessions/x/events?from_seq=abc"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "BAD_QUERY");
    let r = c
        .get(format!("{base}/api/sessions/no-such/events"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    rt.shutdown().await;

    let (rt, base, _) = serve_agents(false).await;
    let r = client()
        .post(format!("{base}/api/agents"))
        .json(&serde_json::json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "MUTATIONS_DISABLED");
    let r = client()
        .post(format!("{base}/api/actors/1/stop"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hibernated_agent_is_shown_answers_a_cancel_and_wakes_on_a_followup() {
    let _sweep = crate::suite::sweep();
    let (rt, base, c) = serve_agents(true).await;
    let (id, a) = created_idle(&c, &base, &rt, "Write one line about sleep.").await;
    a.hibernate().await.unwrap();
    let node = a.node_id();

    let tree: serde_json::Value = get_json(&c, format!("{base}/api/tree")).await;
    let parked = tree
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == node)
        .unwrap_or_else(|| panic!("no node {node} in {tree}"));
    assert_eq!(parked["status"], "hibernated");
    assert_eq!(parked["kind"], "agent");
    assert_eq!(parked["summary"]["agent"], id.as_str());
    assert_eq!(parked["summary"]["turn"], 1);
    let detail: serde_json::Value = get_json(&c, format!("{base}/api/actors/{node}")).await;
    assert_eq!(detail["agent"]["status"], "hibernated");
    assert_eq!(detail["agent"]["progress"]["hibernated"], true);

    let cancel: serde_json::Value = c
        .post(format!("{base}/api/agents/{id}/cancel"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(cancel["cancelled"], "hibernated", "{cancel}");
    assert!(a.is_hibernated());

    let r = post(
        &c,
        format!("{base}/api/agents/{id}/followup"),
        serde_json::json!({"text": "And one about waking."}),
    )
    .await;
    assert_eq!(r.status(), 200);
    a.when_idle(WAIT).await.unwrap();
    assert!(!a.is_hibernated());
    assert_eq!(a.progress().turn, 2);
    assert_eq!(
        a.last_turn().unwrap().reason,
        dsh::services::session::TurnEndReason::Completed
    );
    rt.shutdown().await;
}

// One thread: the burst below runs without a yield, so the stream's reader
// cannot run until it is over, and the 16-change feed must overflow.
#[tokio::test(flavor = "current_thread")]
async fn a_subscriber_that_falls_behind_is_told_how_much_it_missed_and_gets_a_snapshot() {
    let _sweep = crate::suite::sweep();
    let settings = RuntimeSettings {
        tree: dsh::kernel::tree::TreeLimits {
            feed_capacity: 16,
            follow_stops: 16,
            ..Default::default()
        },
        ..Default::default()
    };
    let rt = Runtime::start(settings).await.unwrap();
    let config = WebConfig {
        bind: "127.0.0.1:0".into(),
        token_env: None,
        mutations: false,
    };
    rt.root().plugin(Web, config).await.unwrap();
    let web = rt.root().get::<WebServer>(WebServer::SERVICE).unwrap();
    let base = format!("http://{}", web.local_addr());
    let (mut body, mut buf, _) = open_stream(&base, "").await;
    // A burst the 16-change feed cannot hold.
    let root = rt.root().fiber().id();
    for i in 0..5000 {
        rt.tree()
            .set_summary(root, serde_json::json!({ "burst": i }));
    }
    let (_, dropped) = until(&mut body, &mut buf, |name, _| name == "dropped").await;
    let missed: serde_json::Value = serde_json::from_str(&dropped).unwrap();
    assert!(missed["dropped"].as_u64().unwrap() > 0, "{dropped}");
    // Right after: a fresh snapshot to start over from.
    let (next, data) = until(&mut body, &mut buf, |_, _| true).await;
    assert_eq!(next, "snapshot", "{data}");
    let nodes: serde_json::Value = serde_json::from_str(&data).unwrap();
    let root_node = nodes["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["id"] == root)
        .unwrap();
    // The snapshot has the state of its moment (the burst may still run);
    // what follows it brings the subscriber to the last change.
    let seen = root_node["summary"]["burst"].as_u64().unwrap();
    if seen != 4999 {
        until(&mut body, &mut buf, |_, data| {
            data.contains("\"burst\":4999")
        })
        .await;
    }
    drop(body);

    // The viewer's stream lags when more nodes stopped between two looks
    // than the tree remembers for it (16 here).
    let (mut body, mut buf, _) = open_stream(&base, "?coalesce=1").await;
    let tree = rt.tree();
    let null: Arc<dsh::kernel::tree::SummaryFn> = Arc::new(|| serde_json::Value::Null);
    for i in 0..100 {
        let id = tree.park(
            "agent",
            format!("brief/{i}").into(),
            Some(root),
            null.clone(),
        );
        tree.unpark(id, Status::Disposed, "burst");
    }
    let (_, dropped) = until(&mut body, &mut buf, |name, _| name == "dropped").await;
    let missed: serde_json::Value = serde_json::from_str(&dropped).unwrap();
    assert!(missed["dropped"].as_u64().unwrap() >= 84, "{dropped}");
    let (next, data) = until(&mut body, &mut buf, |_, _| true).await;
    assert_eq!(next, "snapshot", "{data}");
    // A look larger than one event is sent as several (4,096 changes each
    // at most), in order.
    for i in 0..5000 {
        tree.park(
            "agent",
            format!("resting/{i}").into(),
            Some(root),
            null.clone(),
        );
    }
    let mut names = Vec::new();
    while names.len() < 5000 {
        let (name, data) = until(&mut body, &mut buf, |_, _| true).await;
        assert_eq!(name, "delta", "{data}");
        let delta: serde_json::Value = serde_json::from_str(&data).unwrap();
        let changes = delta["changes"].as_array().unwrap();
        assert!(changes.len() <= 4096, "{}", changes.len());
        names.extend(
            changes
                .iter()
                .map(|c| c["node"]["name"].as_str().unwrap().to_owned()),
        );
    }
    let expected: Vec<String> = (0..5000).map(|i| format!("resting/{i}")).collect();
    assert_eq!(names, expected);
    rt.shutdown().await;
}

/// Requests a hostile page could make: a rebinding `Host` (on a server
/// without a token: with one, the page cannot know it), a form-style body,
/// a foreign `Origin` (even with the token). All refused before any handler
/// runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_requests_and_rebinding_hosts_are_refused() {
    let _sweep = crate::suite::sweep();
    let (reads, base, c) = serve_agents(false).await;
    let port = base.rsplit(':').next().unwrap().to_owned();
    let r = c
        .get(format!("{base}/api/tree"))
        .header("host", format!("evil.example:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "FORBIDDEN_HOST");
    let r = c
        .get(format!("{base}/api/tree"))
        .header("host", format!("localhost:{port}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    reads.shutdown().await;
    let (rt, base, c) = serve_agents(true).await;
    let body = r#"{"prompt": "Write one line about trust."}"#;
    let refused = [
        ("text/plain", None, 415, "JSON_REQUIRED"),
        (
            "application/x-www-form-urlencoded",
            None,
            415,
            "JSON_REQUIRED",
        ),
        (
            "application/json",
            Some("http://evil.example"),
            403,
            "CROSS_ORIGIN",
        ),
        ("application/json", Some("null"), 403, "CROSS_ORIGIN"),
        (
            "text/plain",
            Some("http://evil.example"),
            415,
            "JSON_REQUIRED",
        ),
    ];
    for (content_type, origin, status, code) in refused {
        let mut request = c
            .post(format!("{base}/api/agents"))
            .header("content-type", content_type)
            .body(body);
        if let Some(o) = origin {
            request = request.header("origin", o);
        }
        let r = request.send().await.unwrap();
        assert_eq!(r.status(), status, "{content_type} {origin:?}");
        let v: serde_json::Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], code, "{content_type} {origin:?}");
    }
    // A body-less POST (a no-CORS fetch) is refused too.
    let r = c
        .post(format!("{base}/api/actors/1/stop"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let agents = rt
        .root()
        .get::<dsh::actors::agent::Agents>(dsh::actors::agent::Agents::SERVICE)
        .unwrap();
    assert!(
        agents.ids().is_empty(),
        "a refused request created an agent"
    );
    // The page itself (same origin) is served.
    let r = c
        .post(format!("{base}/api/agents"))
        .header("content-type", "application/json")
        .header("origin", base.clone())
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_in_the_query_opens_reads_only() {
    let _sweep = crate::suite::sweep();
    let args = [
        "--bind",
        "127.0.0.1:0",
        "--token-env",
        "DSH_TEST_WEB_TOKEN",
        "--mutations",
        "--demo-model",
    ]
    .map(String::from);
    let (child, base, c) = dsh_serve(&args, &[("DSH_TEST_WEB_TOKEN", "s3cret")]).await;
    let r = c
        .get(format!("{base}/api/tree?token=s3cret"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .post(format!("{base}/api/agents?token=s3cret"))
        .json(&serde_json::json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(format!("{base}/api/agents"))
        .bearer_auth("s3cret")
        .json(&serde_json::json!({"prompt": "x"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    // The token is taken out of the query before a handler parses it: an
    // endpoint that refuses unknown parameters still answers.
    let id = r.json::<serde_json::Value>().await.unwrap()["id"]
        .as_str()
        .unwrap()
        .to_owned();
    let r = c
        .get(format!(
            "{base}/api/sessions/{id}/events?from_seq=0&token=s3cret&limit=5"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = c
        .get(format!(
            "{base}/api/sessions/{id}/events?bogus=1&token=s3cret"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        400,
        "other unknown parameters are still refused"
    );
    assert!(terminate(child).await.success());
}

/// Creates an agent through the API with the prompt `go`; its id and its
/// session's event stream (`?stream=1`).
async fn created_and_followed(
    c: &reqwest::Client,
    base: &str,
) -> (
    String,
    impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin,
) {
    let created = post(
        c,
        format!("{base}/api/agents"),
        serde_json::json!({"prompt": "go"}),
    )
    .await;
    assert_eq!(created.status(), 201);
    let created: serde_json::Value = created.json().await.unwrap();
    let id = created["id"].as_str().unwrap().to_owned();
    let events = c
        .get(format!("{base}/api/sessions/{id}/events?stream=1"))
        .send()
        .await
        .unwrap()
        .bytes_stream();
    (id, events)
}

/// Reads an SSE body until a line contains `needle` (within the wait).
async fn until_line(
    body: &mut (impl futures::Stream<Item = reqwest::Result<bytes::Bytes>> + Unpin),
    seen: &mut String,
    needle: &str,
) {
    tokio::time::timeout(WAIT, async {
        while !seen.contains(needle) {
            let chunk = body.next().await.expect("the stream goes on").unwrap();
            seen.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no `{needle}` in: {seen}"));
}

/// `dsh serve --mutations` answers the approval seam through its API: the
/// ask is listed, a client allows it, the one escalated call runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http_client_answers_approvals() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-web-approval").unwrap();
    let marker = dir.join("escalated");
    let script = dir.join("script.json");
    let call = serde_json::json!({"name": "bash", "arguments": {
        "command": format!("touch {}", marker.display()), "description": "probe",
        "sandbox_permissions": "danger-full-access", "justification": "write the marker"
    }});
    let steps = serde_json::json!({"steps": [{"tool_calls": [call]}, {"text": "done"}]});
    std::fs::write(&script, steps.to_string()).unwrap();
    let args = [
        "--bind".to_owned(),
        "127.0.0.1:0".to_owned(),
        "--mutations".to_owned(),
        "--script".to_owned(),
        script.display().to_string(),
    ];
    let (child, base, c) = dsh_serve(&args, &[]).await;
    let (_, mut events) = created_and_followed(&c, &base).await;
    let mut seen = String::new();
    until_line(&mut events, &mut seen, "approval/asked").await;
    // Logged first, then listed: wait (bounded) for the listing.
    let deadline = tokio::time::Instant::now() + WAIT;
    let pending = loop {
        let list = get_json(&c, format!("{base}/api/approvals")).await;
        if let Some(first) = list["approvals"]
            .as_array()
            .and_then(|a| a.first())
            .cloned()
        {
            break first;
        }
        assert!(tokio::time::Instant::now() < deadline, "never listed");
        tokio::task::yield_now().await;
    };
    assert_eq!(pending["tool"], "bash");
    assert!(
        pending["reason"]
            .as_str()
            .unwrap()
            .contains("write the marker")
    );
    assert!(!marker.exists());
    let approval = pending["id"].as_str().unwrap().to_owned();
    let r = post(
        &c,
        format!("{base}/api/approvals/{approval}"),
        serde_json::json!({"outcome": "unavailable"}),
    )
    .await;
    assert_eq!(r.status(), 400);
    let r = post(
        &c,
        format!("{base}/api/approvals/{approval}"),
        serde_json::json!({"outcome": "allowed-once"}),
    )
    .await;
    assert_eq!(r.status(), 200);
    until_line(&mut events, &mut seen, "turn/end").await;
    assert!(marker.exists(), "the approved call ran: {seen}");
    assert!(seen.contains(r#""outcome":"allowed-once""#), "{seen}");
    let r = post(
        &c,
        format!("{base}/api/approvals/{approval}"),
        serde_json::json!({"outcome": "rejected"}),
    )
    .await;
    assert_eq!(r.status(), 404);
    assert!(terminate(child).await.success());
}

/// An agent approving its own escalation (issue 39): its first call starts
/// a background job that polls the server's approvals and answers each one
/// `allowed-once`; its second asks for `danger-full-access` to write
/// outside its workspace. The server's token, made or configured (then
/// withheld from tools like an API key), is out of the job's reach: every
/// request it makes is refused, the ask waits for the person holding the
/// token, who rejects it, and the file is never written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agents_own_job_cannot_answer_its_approval() {
    let _sweep = crate::suite::sweep();
    const VAR: &str = "DSH_TEST_SELF_APPROVAL_TOKEN";
    for configured in [false, true] {
        let dir = dsh::kernel::scratch::fresh_dir("dsh-web-self-approval").unwrap();
        let workspace = dir.join("workspace");
        std::fs::create_dir(&workspace).unwrap();
        let marker = dir.join("escaped");
        let addr = {
            let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            probe.local_addr().unwrap()
        };
        // The attacker polls on its own clock; nothing here waits on it.
        let job = format!(
            r#"for i in $(seq 1 1000); do
  code=$(curl -s -o list.json -w '%{{http_code}}' -H "Authorization: Bearer ${VAR}" http://{addr}/api/approvals)
  echo "list $code" >> job.log
  for id in $(grep -o '"id":"[^"]*"' list.json | cut -d'"' -f4); do
    code=$(curl -s -o /dev/null -w '%{{http_code}}' -X POST -H 'Content-Type: application/json' -H "Authorization: Bearer ${VAR}" -d '{{"outcome":"allowed-once"}}' http://{addr}/api/approvals/$id)
    echo "answer $code" >> job.log
  done
  sleep 0.05
done"#
        );
        let steps = serde_json::json!({"steps": [
            {"tool_calls": [{"name": "bash", "arguments": {
                "command": job, "description": "approve everything", "run_in_background": true
            }}]},
            {"tool_calls": [{"name": "bash", "arguments": {
                "command": format!("touch {}", marker.display()), "description": "escape",
                "sandbox_permissions": "danger-full-access", "justification": "write outside"
            }}]},
            {"text": "done"}
        ]});
        let script = dir.join("script.json");
        std::fs::write(&script, steps.to_string()).unwrap();
        let mut args = vec![
            "--bind".to_owned(),
            addr.to_string(),
            "--mutations".to_owned(),
            "--script".to_owned(),
            script.display().to_string(),
        ];
        let env: &[(&str, &str)] = if configured {
            args.extend(["--token-env".to_owned(), VAR.to_owned()]);
            &[(VAR, "s3cret-self")]
        } else {
            &[]
        };
        let (child, base, made) = dsh_serve_in(&workspace, &args, env).await;
        let c = if configured {
            client_with(Some("s3cret-self"))
        } else {
            made
        };
        let (_, mut events) = created_and_followed(&c, &base).await;
        let mut seen = String::new();
        until_line(&mut events, &mut seen, "approval/asked").await;
        // The job has tried, several times, while the ask was open.
        let log = workspace.join("job.log");
        let tries = |log: &std::path::Path| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .lines()
                .filter(|l| l.starts_with("list "))
                .count()
        };
        let before = tries(&log);
        crate::suite::until("the job polls the approvals", || tries(&log) >= before + 3).await;
        let pending = get_json(&c, format!("{base}/api/approvals")).await;
        let approval = pending["approvals"][0]["id"]
            .as_str()
            .unwrap_or_else(|| panic!("the ask still waits: {pending}"))
            .to_owned();
        let r = post(
            &c,
            format!("{base}/api/approvals/{approval}"),
            serde_json::json!({"outcome": "rejected"}),
        )
        .await;
        assert_eq!(r.status(), 200);
        until_line(&mut events, &mut seen, "turn/end").await;
        assert!(
            !marker.exists(),
            "configured: {configured}: the agent escaped: {seen}"
        );
        assert!(seen.contains(r#""outcome":"rejected""#), "{seen}");
        let attempts = std::fs::read_to_string(&log).unwrap();
        assert!(
            attempts.lines().all(|l| l == "list 401"),
            "configured: {configured}: the job got through:\n{attempts}"
        );
        assert!(terminate(child).await.success());
    }
}

/// A thousand live agents, each holding its session's lock file open, in a
/// process started with a soft limit of 256 open files: dsh raises its own
/// limit, so every agent is created and written, and the server answers on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_live_agents_fit_under_a_low_open_file_limit() {
    use futures::StreamExt as _;
    use tokio::io::AsyncBufReadExt;
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-web-fds").unwrap();
    let sessions = dir.join("sessions");
    let script = dir.join("hello.json");
    std::fs::write(&script, r#"{"steps": [{"text": "hello"}]}"#).unwrap();
    let config = dir.join("cordis.yml");
    std::fs::write(
        &config,
        format!(
            "plugins:\n  - {{ id: services, name: agent-services }}\n  \
             - {{ id: model, name: scripted, config: {{ script: {} }} }}\n  \
             - {{ id: store, name: session-store, config: {{ backend: jsonl, path: {} }} }}\n",
            script.display(),
            sessions.display()
        ),
    )
    .unwrap();
    let mut child = tokio::process::Command::new("sh")
        .arg("-c")
        .arg("ulimit -Sn 256 && exec \"$0\" serve --bind 127.0.0.1:0 --mutations --config \"$1\"")
        .arg(env!("CARGO_BIN_EXE_dsh"))
        .arg(&config)
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(WAIT, lines.next_line())
        .await
        .unwrap()
        .unwrap()
        .unwrap_or_default();
    let (base, c) = endpoint(line.strip_prefix("dsh serve: listening on ").unwrap());
    let created: Vec<u16> = futures::stream::iter(0..1000)
        .map(|i| {
            let (c, base) = (c.clone(), base.clone());
            async move {
                c.post(format!("{base}/api/agents"))
                    .json(&serde_json::json!({"prompt": format!("Write one line about {i}.")}))
                    .send()
                    .await
                    .map(|r| r.status().as_u16())
                    .unwrap_or(0)
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    assert!(
        created.iter().all(|s| *s == 201),
        "{:?}",
        created
            .iter()
            .filter(|s| **s != 201)
            .take(5)
            .collect::<Vec<_>>()
    );
    let pid = child.id().unwrap();
    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    assert!(
        open > 1000,
        "{open} files open: the agents hold their locks"
    );
    let listed = get_json(&c, format!("{base}/api/sessions")).await;
    assert!(listed.to_string().matches("\"id\"").count() >= 1000);
    let locks = std::fs::read_dir(sessions.join("locks")).unwrap().count();
    assert_eq!(locks, 1000);
    assert!(terminate(child).await.success());
}

/// The minor rough edges: a wrong method gets a JSON 405, `bind` takes a
/// host name, and stopping `plugin/agent-services` takes its agents down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_method_a_named_host_and_a_stopped_services_plugin_behave() {
    let _sweep = crate::suite::sweep();
    let (rt, base, c) = serve_agents_at("localhost:0", true).await;
    let addr: std::net::SocketAddr = base.trim_start_matches("http://").parse().unwrap();
    assert!(addr.ip().is_loopback(), "{addr}");
    let r = post(&c, format!("{base}/api/tree"), serde_json::json!({})).await;
    assert_eq!(r.status(), 405);
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["error"]["code"], "METHOD_NOT_ALLOWED");
    let (_, a) = created_idle(&c, &base, &rt, "Write one line about order.").await;
    let node = a.node_id();
    let services = rt
        .tree()
        .snapshot()
        .into_iter()
        .find(|n| n.name == "plugin/agent-services")
        .unwrap();
    let r = post(
        &c,
        format!("{base}/api/actors/{}/stop", services.id),
        serde_json::json!({}),
    )
    .await;
    assert_eq!(r.status(), 200);
    let detail: serde_json::Value = get_json(&c, format!("{base}/api/actors/{node}")).await;
    assert_eq!(detail["node"]["status"], "disposed", "{detail}");
    rt.shutdown().await;
}

/// `POST /api/agents/{id}/compact` summarises an idle agent's conversation
/// into one message (logged as compaction) and says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_agent_is_compacted_through_the_api() {
    let _sweep = crate::suite::sweep();
    let (rt, base, c) = serve_agents(true).await;
    let (id, a) = created_idle(&c, &base, &rt, "Write one line about tides.").await;
    let done: serde_json::Value = post(
        &c,
        format!("{base}/api/agents/{id}/compact"),
        serde_json::json!({}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(done["compacted"], true, "{done}");
    let detail: serde_json::Value =
        get_json(&c, format!("{base}/api/actors/{}", a.node_id())).await;
    assert!(
        detail["agent"]["contextTokens"].as_u64().is_some(),
        "{detail}"
    );
    let kinds: Vec<String> = a
        .session()
        .events()
        .iter()
        .map(|e| e.kind().to_owned())
        .filter(|k| k.starts_with("compaction/"))
        .collect();
    assert_eq!(
        kinds,
        ["compaction/start", "compaction/summary", "compaction/end"]
    );
    let history = a.session().derive_messages();
    assert_eq!(history.len(), 1, "one summary replaces the turn");
    assert_eq!(history[0].source.kind, "compaction");
    // Nothing left to summarise: a second compaction replaces nothing.
    let again: serde_json::Value = post(
        &c,
        format!("{base}/api/agents/{id}/compact"),
        serde_json::json!({}),
    )
    .await
    .json()
    .await
    .unwrap();
    assert_eq!(again["compacted"], false, "{again}");
    rt.shutdown().await;
}

/// `dsh serve --nodes`: the server joins the nodes before it serves; its
/// tree shows the cluster's parts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_joins_the_nodes_it_is_given() {
    let _sweep = crate::suite::sweep();
    use super::cluster::{COOKIE, COOKIE_VAR, Node};
    let b = Node::start("b", &["--demo-model"]);
    let args: Vec<String> = [
        "--bind",
        "127.0.0.1:0",
        "--demo-model",
        "--nodes",
        &b.peer(),
        "--cookie-env",
        COOKIE_VAR,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let (child, base, c) = dsh_serve(&args, &[(COOKIE_VAR, COOKIE)]).await;
    let tree = get_json(&c, format!("{base}/api/tree")).await;
    let kinds: Vec<&str> = tree
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|n| n["kind"].as_str())
        .collect();
    assert!(kinds.contains(&"node-server"), "{tree}");
    assert!(kinds.contains(&"cluster-watch"), "{tree}");
    assert!(terminate(child).await.success());
}

/// The child of `parent` on node `b`, continued: the API's tree shows its
/// subtree there (marked with the node) while it lives, and a later
/// message is its next turn on that node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_continuable_child_on_another_node_takes_its_next_turn_there_and_shows_in_the_api_tree() {
    let _sweep = crate::suite::sweep();
    use super::cluster::{COOKIE, Node, log_of};
    use dsh::actors::cluster::remote::RemoteProvider;
    use dsh::actors::cluster::{Cluster, ClusterSettings, Placement};
    use dsh::actors::subagent::{StartRequest, Subagents};
    let b = Node::start("b", &["--demo-model"]);
    let (rt, base, c) = serve_agents(true).await;
    let root = rt.root();
    let settings = ClusterSettings {
        name: "a".into(),
        cookie: COOKIE.into(),
        listen: None,
        tls: None,
    };
    let cluster = Cluster::start(&root, settings).await.unwrap();
    let peer = b.peer().parse().unwrap();
    cluster.connect(&peer, WAIT).await.unwrap();
    let subagents = root.get::<Subagents>(Subagents::SERVICE).unwrap();
    let provider = RemoteProvider::new(cluster.clone(), Placement::RoundRobin);
    subagents.register(&root, Arc::new(provider)).unwrap();
    let (parent_id, parent) = created_idle(&c, &base, &rt, "Write one line about parents.").await;

    let request = StartRequest::new(
        &parent,
        "Write one line about actors.",
        tokio_util::sync::CancellationToken::new(),
    );
    let id = subagents
        .start_continuable("remote", "helper", request)
        .await
        .unwrap();
    let proxy = agent(&rt, &id);
    super::until("the child's first turn never ended", || {
        proxy.last_turn().is_some_and(|t| t.turn == 1)
    })
    .await;
    assert!(proxy.last_turn().unwrap().text.starts_with("actors:"));
    // The API's tree: under the proxy's part, the child's scope on b.
    let part = "b/subagent/";
    let mut tree = Vec::new();
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        tree = get_json(&c, format!("{base}/api/tree"))
            .await
            .as_array()
            .unwrap()
            .clone();
        if tree
            .iter()
            .any(|n| n["node"] == "b" && n["kind"] == "scope")
        {
            break;
        }
        tokio::task::yield_now().await;
    }
    let the_part = tree
        .iter()
        .find(|n| n["kind"] == "remote-child" && n["name"].as_str().unwrap().starts_with(part))
        .unwrap_or_else(|| panic!("{tree:#?}"));
    let scope = tree
        .iter()
        .find(|n| n["node"] == "b" && n["kind"] == "scope")
        .unwrap_or_else(|| panic!("{tree:#?}"));
    assert_eq!(scope["parent"], the_part["id"], "{tree:#?}");
    assert!(scope["id"].as_u64().unwrap() >= dsh::kernel::tree::PARKED_IDS);
    assert!(
        tree.iter()
            .any(|n| n["node"] == "b" && n["parent"] == scope["id"] && n["kind"] == "session"),
        "{tree:#?}"
    );

    // A later message is the child's next turn, on b, in the same session.
    subagents
        .send(&parent, &id, "Write one line about nodes.")
        .await
        .unwrap();
    super::until("the child's second turn never ended", || {
        proxy.last_turn().is_some_and(|t| t.turn == 2)
    })
    .await;
    assert!(proxy.last_turn().unwrap().text.starts_with("nodes:"));
    // b's store has it once b's writer flushed (a batch window later).
    let store = b.dir.join("sessions");
    let turns = || {
        b.headers()
            .first()
            .map(|h| log_of(&store, h["id"].as_str().unwrap()))
            .map_or(0, |log| log.matches(r#""type":"turn/end""#).count())
    };
    super::until("b's log never held both turns", || turns() == 2).await;
    let hs = b.headers();
    assert_eq!(hs.len(), 1, "{hs:?}");
    assert_eq!(hs[0]["parentSession"], parent_id.as_str());

    // Disposed, the child leaves b, and its nodes leave the parent's tree.
    proxy.dispose().await;
    let tree = get_json(&c, format!("{base}/api/tree")).await;
    assert!(
        !tree.as_array().unwrap().iter().any(|n| n["node"] == "b"),
        "{tree:#}"
    );
    rt.shutdown().await;
}

/// `dsh ARGS… --hold` in a fresh workspace (with `files` in it and `env`
/// set), once its run is over and the dashboard is held; the process and
/// the URL it printed.
pub(super) async fn held(
    args: &[&str],
    files: &[(&str, &str)],
    env: &[(&str, &str)],
) -> (tokio::process::Child, String) {
    use tokio::io::AsyncBufReadExt;
    let dir = dsh::kernel::scratch::fresh_dir("dsh-dashboard-run").unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_dsh"))
        .args(args)
        .arg("--hold")
        .arg("--sessions-dir")
        .arg(dir.join("sessions"))
        .envs(env.iter().copied())
        .env_remove("DSH_BASE_URL")
        .env_remove("DSH_MODEL")
        .current_dir(&dir)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let mut url = None;
    loop {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .expect("the run narrates")
            .unwrap()
            .expect("a line before the hold");
        if let Some(u) = line.strip_prefix("dsh: dashboard at ") {
            url = Some(u.to_owned());
        }
        if line.contains("the dashboard stays up") {
            return (child, url.expect("the URL was printed"));
        }
    }
}

/// `dsh workflow … --dashboard --hold`: the page of the run's own runtime,
/// kept up after the run until SIGTERM; its API saw the children.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workflow_with_dashboard_and_hold_serves_its_tree_until_stopped() {
    let _sweep = crate::suite::sweep();
    let fan = "const r = await Promise.all(['a','b','c'].map(t => agent('Write one line about ' + t + '.')));\nreturn {r};\n";
    let args = ["workflow", "fan.js", "--demo-model", "--dashboard"];
    let (child, url) = held(&args, &[("fan.js", fan)], &[]).await;
    // The dashboard may steer and answer approvals: it made a token.
    let (base, c) = endpoint(&url);
    assert!(url.contains("/#token="), "{url}");
    assert!(base.starts_with("http://127.0.0.1:"), "{base}");
    // The run is over and the page is still served (to anyone: it holds
    // no data), with what it ran (to the token's holder only).
    let page = client().get(format!("{base}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let bare = client()
        .get(format!("{base}/api/tree"))
        .send()
        .await
        .unwrap();
    assert_eq!(bare.status(), 401);
    let stopped = get_json(&c, format!("{base}/api/tree/stopped")).await;
    let children = stopped
        .as_array()
        .unwrap()
        .iter()
        .filter(|n| {
            n["name"]
                .as_str()
                .unwrap_or("")
                .starts_with("scope/subagent/")
        })
        .count();
    assert_eq!(children, 3, "{stopped:#}");
    // Nothing forgotten: the sessions the run wrote are listed with their
    // title, time, tokens and how they ended, and each child's events are
    // read back from the store its agent is gone from.
    let sessions = get_json(&c, format!("{base}/api/sessions")).await;
    let done: Vec<&serde_json::Value> = sessions
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["live"] == false
                && s["title"]
                    .as_str()
                    .unwrap_or("")
                    .starts_with("Write one line about ")
        })
        .collect();
    assert_eq!(done.len(), 3, "{sessions:#}");
    for s in &done {
        assert_eq!(s["status"], "completed", "{s}");
        assert_eq!(s["turns"], 1, "{s}");
        assert!(s["tokens"].as_u64().unwrap() > 0, "{s}");
        assert!(s["updatedAt"].as_u64() >= s["createdAt"].as_u64(), "{s}");
        let id = s["id"].as_str().unwrap();
        let events = get_json(&c, format!("{base}/api/sessions/{id}/events")).await;
        let kinds: Vec<&str> = events["events"]
            .as_array()
            .unwrap_or_else(|| panic!("{events:#}"))
            .iter()
            .filter_map(|e| e["type"].as_str())
            .collect();
        assert!(kinds.contains(&"turn/end"), "{events:#}");
    }
    // SIGTERM ends the hold; the run's own result stands.
    assert!(terminate(child).await.success());
}

/// A run's dashboard with a token: the URL printed carries it in the
/// fragment, and a request without it, or with another, is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runs_dashboard_with_a_token_refuses_requests_without_it() {
    let _sweep = crate::suite::sweep();
    let args = [
        "run",
        "Write one line about tokens.",
        "--demo-model",
        "--dashboard=127.0.0.1:0",
        "--dashboard-token-env",
        "DSH_TEST_DASH_TOKEN",
    ];
    let (child, url) = held(&args, &[], &[("DSH_TEST_DASH_TOKEN", "s3cret")]).await;
    let (base, token) = url
        .split_once("/#token=")
        .expect("the token in the fragment");
    assert_eq!(token, "s3cret");
    let c = client();
    let tree = format!("{base}/api/tree");
    let bare = c.get(&tree).send().await.unwrap();
    assert_eq!(bare.status(), 401);
    let forged = c.get(&tree).bearer_auth("guess").send().await.unwrap();
    assert_eq!(forged.status(), 401);
    let good = c.get(&tree).bearer_auth(token).send().await.unwrap();
    assert_eq!(good.status(), 200);
    assert!(terminate(child).await.success());
}

/// The service's own auth in the mounting test: a session cookie, which a
/// browser sends on a cross-site request too.
pub(super) async fn service_auth(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let signed_in = request
        .headers()
        .get(reqwest::header::COOKIE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|c| c.split("; ").any(|kv| kv == "session=signed-in"));
    if !signed_in {
        return (axum::http::StatusCode::UNAUTHORIZED, "sign in").into_response();
    }
    next.run(request).await
}

/// The dashboard mounted in a service under a prefix: it answers there,
/// behind the service's auth, and keeps every check of its own — the token,
/// a JSON body, no foreign origin even with the service's cookie, the body
/// cap, the hosts it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_mounts_in_a_service_behind_its_auth_and_keeps_its_checks() {
    use dsh::web::{MountOptions, mount};
    let dsh = dsh::Dsh::builder()
        .model(dsh::Model::demo())
        .workspace(dsh::kernel::scratch::fresh_dir("dsh-mount").unwrap())
        .start()
        .await
        .unwrap();
    // Refused before it serves: mutations without a token; no token and no
    // hosts.
    let refused = mount(dsh.runtime(), MountOptions::new().mutations(true)).unwrap_err();
    assert!(
        refused.to_string().contains("mutations need a token"),
        "{refused}"
    );
    let refused = mount(dsh.runtime(), MountOptions::default()).unwrap_err();
    assert!(refused.to_string().contains("name the hosts"), "{refused}");

    let streams = tokio_util::sync::CancellationToken::new();
    let options = MountOptions::new()
        .token("t0ken")
        .mutations(true)
        .workspace(dsh.workspace())
        .stop(streams.clone());
    let shown = format!("{options:?}");
    assert!(
        !shown.contains("t0ken") && shown.contains("<withheld>"),
        "{shown}"
    );
    let dashboard = mount(dsh.runtime(), options).unwrap();
    let app = axum::Router::new()
        .route("/health", axum::routing::get(|| async { "ok" }))
        .nest_service("/ops/dsh", dashboard)
        .layer(axum::middleware::from_fn(service_auth));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let stop = tokio_util::sync::CancellationToken::new();
    let stopped = stop.clone();
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move { stopped.cancelled().await })
            .await
    });
    let dash = format!("{base}/ops/dsh");
    let cookie = "session=signed-in";
    let anyone = client();
    let member = {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut headers = reqwest::header::HeaderMap::new();
        headers.insert(reqwest::header::COOKIE, cookie.parse().unwrap());
        // A connection per request: the server closes one after refusing
        // a body it did not read (the 413 below), and a pooled connection
        // would carry the next request into that close.
        reqwest::Client::builder()
            .timeout(WAIT)
            .default_headers(headers)
            .pool_max_idle_per_host(0)
            .build()
            .unwrap()
    };
    // The service's auth comes first.
    let r = anyone.get(format!("{dash}/api/tree")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    assert_eq!(r.text().await.unwrap(), "sign in");
    // Signed in, the page (no data) is served under the prefix; the API
    // still wants the dashboard's token.
    let page = member.get(format!("{dash}/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    assert!(page.text().await.unwrap().contains("<script>"));
    let r = member.get(format!("{dash}/api/tree")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "UNAUTHORIZED");
    let tree = member
        .get(format!("{dash}/api/tree?token=t0ken"))
        .send()
        .await
        .unwrap();
    assert_eq!(tree.status(), 200);
    let nodes: serde_json::Value = tree.json().await.unwrap();
    assert!(nodes.as_array().is_some_and(|n| !n.is_empty()), "{nodes}");
    // A cross-site POST carries the service's cookie (and, say, a leaked
    // token): the dashboard refuses it all the same.
    let create = serde_json::json!({"prompt": "Write one line about actors."});
    let r = member
        .post(format!("{dash}/api/agents"))
        .bearer_auth("t0ken")
        .header(reqwest::header::ORIGIN, "https://evil.example")
        .json(&create)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "CROSS_ORIGIN");
    // A form post, and a body past the cap.
    let r = member
        .post(format!("{dash}/api/agents"))
        .bearer_auth("t0ken")
        .header(
            reqwest::header::CONTENT_TYPE,
            "application/x-www-form-urlencoded",
        )
        .body("prompt=hi")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 415);
    let huge = serde_json::json!({"prompt": "x".repeat(200_000)});
    let r = member
        .post(format!("{dash}/api/agents"))
        .bearer_auth("t0ken")
        .json(&huge)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    // Everything right: an agent is made in the embedding runtime.
    let r = member
        .post(format!("{dash}/api/agents"))
        .bearer_auth("t0ken")
        .json(&create)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let made: serde_json::Value = r.json().await.unwrap();
    let node = made["node"].as_u64().unwrap();
    assert!(
        dsh.runtime().tree().snapshot().iter().any(|n| n.id == node),
        "{made}"
    );
    // In the embedding runtime's workspace, not the process's directory.
    let created = agent(dsh.runtime(), made["id"].as_str().unwrap());
    assert_eq!(created.spec().cwd, dsh.workspace());
    // The service's own stop ends an open stream (its graceful shutdown
    // would otherwise wait for the page).
    let open = member
        .get(format!("{dash}/api/tree/stream?token=t0ken"))
        .send()
        .await
        .unwrap();
    assert_eq!(open.status(), 200);
    let mut open = open.bytes_stream();
    assert!(open.next().await.is_some(), "the snapshot comes first");
    streams.cancel();
    let ended = tokio::time::timeout(WAIT, async {
        while let Some(chunk) = open.next().await {
            chunk.unwrap();
        }
    })
    .await;
    assert!(ended.is_ok(), "the stream outlived the service's stop");
    // Outside the prefix, the service's own routes.
    let r = member.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.text().await.unwrap(), "ok");

    // Mounted without a token, only the hosts named are answered.
    let named = mount(
        dsh.runtime(),
        MountOptions::new().hosts(["ops.example.test"]),
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let other = format!("http://{}", listener.local_addr().unwrap());
    let stopped = stop.clone();
    let second = tokio::spawn(async move {
        axum::serve(listener, axum::Router::new().nest_service("/d", named))
            .with_graceful_shutdown(async move { stopped.cancelled().await })
            .await
    });
    let r = anyone
        .get(format!("{other}/d/api/tree"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "FORBIDDEN_HOST");
    let r = anyone
        .get(format!("{other}/d/api/tree"))
        .header(reqwest::header::HOST, "ops.example.test")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    stop.cancel();
    server.await.unwrap().unwrap();
    second.await.unwrap().unwrap();
    dsh.shutdown().await.unwrap();
}

/// A mounted router that answers approvals steps aside once it is dropped:
/// an ask then goes on to the next answerer (here none: it fails closed at
/// once) instead of waiting for a page nobody can open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_mounted_router_stops_answering_approvals() {
    let _sweep = crate::suite::sweep();
    let dir = dsh::kernel::scratch::fresh_dir("dsh-mount-dropped").unwrap();
    let call = serde_json::json!({"name": "bash", "arguments": {
        "command": "true", "description": "probe",
        "sandbox_permissions": "danger-full-access", "justification": "needs the host"
    }});
    let script = serde_json::json!({"steps": [{"tool_calls": [call]}, {"text": "done"}]});
    let dsh = dsh::Dsh::builder()
        .model(dsh::Model::scripted(&script.to_string()).unwrap())
        .workspace(&dir)
        .approval(dsh::services::approval::ApprovalPolicy::Ask)
        .start()
        .await
        .unwrap();
    let router = dsh::web::mount(
        dsh.runtime(),
        dsh::web::MountOptions::new().token("t0ken").mutations(true),
    )
    .unwrap();
    drop(router);
    let agent = dsh
        .agent()
        .timeout(Duration::from_secs(60))
        .spawn()
        .await
        .unwrap();
    let answer = agent.run("probe the host").await.unwrap();
    assert_eq!(answer.text, "done");
    let result = agent
        .agent()
        .session()
        .events()
        .iter()
        .find(|e| e.data.kind() == "tool/result")
        .map(|e| e.to_json().to_string())
        .unwrap();
    assert!(result.contains("DENIED"), "{result}");
    agent.dispose().await;
    dsh.shutdown().await.unwrap();
}
