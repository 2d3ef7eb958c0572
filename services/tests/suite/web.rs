//! `web_fetch` against a real HTTP server on loopback, and attacked: the
//! model's URL aims at this machine, a private network, cloud metadata,
//! through a redirect, with credentials, at a body too large or a server
//! that never answers.

use std::sync::Arc;
use std::time::Duration;

use dsh_services::sandbox::Policy;
use dsh_services::tools::builtin::{WebFetch, WebFetchSettings, public};
use dsh_services::tools::{Tool, ToolContext, ToolError};
use dsh_supervisors::{Runtime, RuntimeSettings};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// A server answering by path: a page, a redirect to it, a redirect to
/// cloud metadata, a body too large, a binary, JSON, and silence.
async fn serve() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = sock.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_string();
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                let reply = |kind: &str, body: &str| {
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    )
                };
                let out = match path.as_str() {
                    "/page" => reply(
                        "text/html; charset=utf-8",
                        "<html><head><title>T</title><script>evil()</script></head><body><h1>Install</h1><p>Run <code>make</code>, then read <a href=\"/docs\">the docs</a>.</p></body></html>",
                    ),
                    "/hop" => "HTTP/1.1 302 Found\r\nlocation: /page\r\ncontent-length: 0\r\n\r\n".to_owned(),
                    "/metadata" => "HTTP/1.1 302 Found\r\nlocation: http://169.254.169.254/latest/meta-data/\r\ncontent-length: 0\r\n\r\n".to_owned(),
                    "/loop" => "HTTP/1.1 302 Found\r\nlocation: /loop\r\ncontent-length: 0\r\n\r\n".to_owned(),
                    "/big" => "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 999999999\r\n\r\nxxxx".to_owned(),
                    "/bin" => reply("application/octet-stream", "\u{0}\u{1}"),
                    "/json" => reply("application/json", "{\"ok\": true}"),
                    "/long" => reply("text/plain", &"word ".repeat(400)),
                    "/silent" => {
                        // Holds the connection and never answers.
                        let _ = sock.read(&mut buf).await;
                        return;
                    }
                    _ => "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n".to_owned(),
                };
                let _ = sock.write_all(out.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    base
}

async fn fetch(tool: &Arc<WebFetch>, url: &str, policy: Policy) -> Result<String, ToolError> {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let cx = ToolContext {
        call_id: "w".into(),
        args: json!({ "url": url }),
        cancel: CancellationToken::new(),
        ctx: rt.root(),
        cwd: Arc::new(std::env::temp_dir()),
        policy,
    };
    let out = tool.clone().execute(cx).await;
    rt.shutdown().await;
    out.map(|o| {
        o.content
            .iter()
            .filter_map(|b| match b {
                dsh_services::llm::ContentBlock::Text { text } => Some(text.clone()),
                _ => None,
            })
            .collect()
    })
}

fn allowing_loopback() -> Arc<WebFetch> {
    Arc::new(WebFetch::new(WebFetchSettings {
        allow_private_hosts: vec!["127.0.0.1".into()],
        timeout: Duration::from_secs(2),
        max_bytes: 1024 * 1024,
        max_chars: 1000,
        ..WebFetchSettings::default()
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_is_fetched_as_markdown_and_redirects_are_followed() {
    let base = serve().await;
    let tool = allowing_loopback();
    let page = fetch(&tool, &format!("{base}/hop"), Policy::default())
        .await
        .unwrap();
    assert!(
        page.starts_with(&format!("{base}/page (text/html)")),
        "{page}"
    );
    assert!(page.contains("# Install"), "{page}");
    assert!(
        page.contains("`make`") && page.contains("[the docs](/docs)"),
        "{page}"
    );
    assert!(!page.contains("evil()"), "scripts are not text: {page}");
    let json = fetch(&tool, &format!("{base}/json"), Policy::default())
        .await
        .unwrap();
    assert!(json.ends_with("{\"ok\": true}"), "{json}");
    let long = fetch(&tool, &format!("{base}/long"), Policy::default())
        .await
        .unwrap();
    assert!(
        long.ends_with("[cut: 1000 of 2000 characters shown]"),
        "{long}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_targets_bad_urls_and_oversized_or_silent_servers_are_refused() {
    let base = serve().await;
    let strict = Arc::new(WebFetch::new(WebFetchSettings {
        timeout: Duration::from_secs(2),
        ..WebFetchSettings::default()
    }));
    let port = base.rsplit(':').next().unwrap().to_owned();
    // This machine and private networks, by address or by name.
    for url in [
        format!("{base}/page"),
        format!("http://localhost:{port}/page"),
        format!("http://[::1]:{port}/page"),
        format!("http://[::ffff:127.0.0.1]:{port}/page"),
        "http://169.254.169.254/latest/meta-data/".to_owned(),
        "http://10.0.0.1/".to_owned(),
        "http://192.168.1.1/".to_owned(),
        "http://100.64.0.1/".to_owned(),
        "http://0.0.0.0/".to_owned(),
        "http://[fd00::1]/".to_owned(),
    ] {
        let e = fetch(&strict, &url, Policy::default()).await.unwrap_err();
        assert_eq!(e.code, "WEB_BLOCKED_URL", "{url}: {e}");
    }
    let tool = allowing_loopback();
    // Allowed itself, it cannot redirect to metadata.
    let e = fetch(&tool, &format!("{base}/metadata"), Policy::default())
        .await
        .unwrap_err();
    assert_eq!(e.code, "WEB_BLOCKED_URL", "{e}");
    let e = fetch(&tool, &format!("{base}/loop"), Policy::default())
        .await
        .unwrap_err();
    assert_eq!(e.code, "WEB_REDIRECT_BLOCKED", "{e}");
    for (url, code) in [
        ("file:///etc/passwd".to_owned(), "WEB_INVALID_URL"),
        ("ftp://example.com/x".to_owned(), "WEB_INVALID_URL"),
        (
            format!("http://user:pw@127.0.0.1:{port}/page"),
            "WEB_INVALID_URL",
        ),
        ("not a url".to_owned(), "WEB_INVALID_URL"),
        (format!("{base}/big"), "WEB_FETCH_TOO_LARGE"),
        (format!("{base}/bin"), "WEB_UNSUPPORTED_CONTENT_TYPE"),
        (format!("{base}/nothing"), "WEB_HTTP_STATUS"),
        (format!("{base}/silent"), "WEB_FETCH_TIMEOUT"),
    ] {
        let e = fetch(&tool, &url, Policy::default()).await.unwrap_err();
        assert_eq!(e.code, code, "{url}: {e}");
    }
    // A cut network fetches nothing, whatever the URL.
    let offline = Policy {
        network: false,
        ..Policy::default()
    };
    let e = fetch(&tool, &format!("{base}/page"), offline)
        .await
        .unwrap_err();
    assert_eq!(e.code, "NETWORK_OFF", "{e}");
}

#[test]
fn only_internet_addresses_are_public() {
    for ip in ["8.8.8.8", "1.1.1.1", "2606:4700::1111", "93.184.216.34"] {
        assert!(public(ip.parse().unwrap()), "{ip}");
    }
    for ip in [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.0.1",
        "169.254.169.254",
        "100.100.0.1",
        "0.0.0.0",
        "255.255.255.255",
        "224.0.0.1",
        "::1",
        "::",
        "fe80::1",
        "fc00::1",
        "::ffff:10.0.0.1",
        "2001:db8::1",
        "198.18.0.1",
        "240.0.0.1",
    ] {
        assert!(!public(ip.parse().unwrap()), "{ip}");
    }
}
