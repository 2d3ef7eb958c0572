//! `web_fetch`: one HTTP(S) GET, its body decoded to text (HTML as
//! Markdown). The URL comes from the model, so it is hostile: only http and
//! https, no credentials, and no target on this machine or a private
//! network (loopback, RFC 1918, link-local — cloud metadata lives there —,
//! CGNAT, unique-local, …) unless the deployment names the host. The check
//! is made on the addresses the name resolves to, and the connection is
//! pinned to them (a DNS answer that changes between check and connect
//! cannot redirect it); every redirect hop is checked the same way. Bytes,
//! characters, hops and time are capped. A cut network refuses the call.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::StreamExt;
use futures::future::BoxFuture;
use reqwest::Url;

use crate::llm::ToolSchema;
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};

/// What a deployment decides about fetching.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebFetchSettings {
    /// Hosts (names or addresses, as written in URLs) that may be fetched
    /// although they are on this machine or a private network.
    pub allow_private_hosts: Vec<String>,
    /// The longest a fetch may take, redirects included.
    pub timeout: Duration,
    /// The most bytes a body may have.
    pub max_bytes: usize,
    /// The most characters of text returned (the rest is cut, and said so).
    pub max_chars: usize,
    /// Redirects followed at most.
    pub max_redirects: usize,
}

impl Default for WebFetchSettings {
    fn default() -> WebFetchSettings {
        WebFetchSettings {
            allow_private_hosts: Vec::new(),
            timeout: Duration::from_secs(30),
            max_bytes: 5 * 1024 * 1024,
            max_chars: 100_000,
            max_redirects: 5,
        }
    }
}

/// The `web_fetch` tool.
pub struct WebFetch {
    settings: WebFetchSettings,
}

impl WebFetch {
    /// A fetcher under `settings`.
    pub fn new(settings: WebFetchSettings) -> WebFetch {
        WebFetch { settings }
    }
}

/// What a `web_fetch` call takes.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
struct FetchArgs {
    /// The http(s) URL to fetch.
    url: String,
}

fn err(code: &str, message: impl Into<String>) -> ToolError {
    ToolError::new(code, message)
}

impl Tool for WebFetch {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "web_fetch".into(),
            description: "Fetch one http(s) URL and return its content as text: an HTML page converted to Markdown (links kept), plain text, JSON or XML as it is. Other content types are refused. The page is fetched as it is now, without cookies or a login; redirects are followed a few times. Long pages are cut, and the result says so. Addresses on this machine or a private network are refused unless the deployment allows them, and nothing is fetched when the network is cut.".into(),
            parameters: parameters::<FetchArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Use `web_fetch` to read a page the task or the user names (documentation, an issue, a changelog), not to browse: fetch the specific URL, and quote what you rely on.",
        )
    }

    fn is_concurrency_safe(&self) -> bool {
        true
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: FetchArgs = cx.parse()?;
            if !cx.policy.network {
                return Err(err(
                    "NETWORK_OFF",
                    "the network is cut for this agent; nothing can be fetched",
                ));
            }
            let settings = &self.settings;
            let work = fetch(settings, &args.url);
            let fetched = tokio::select! {
                r = tokio::time::timeout(settings.timeout, work) => r.unwrap_or_else(|_| Err(err(
                    "WEB_FETCH_TIMEOUT",
                    format!("{} did not answer within {} s", args.url, settings.timeout.as_secs()),
                ))),
                () = cx.cancel.cancelled() => Err(err("ABORTED", "the fetch was cancelled")),
            }?;
            Ok(ToolOutput::text(fetched))
        }
        .boxed()
    }
}

/// Fetches `url` under `settings`, following checked redirects; the text.
async fn fetch(settings: &WebFetchSettings, url: &str) -> Result<String, ToolError> {
    let mut url = parse(url)?;
    for hop in 0..=settings.max_redirects {
        let (addrs, host) = resolve(settings, &url).await?;
        // One client per hop, its name pinned to the addresses just checked.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut builder = reqwest::Client::builder()
            .user_agent(concat!("dsh/", env!("CARGO_PKG_VERSION"), " (web_fetch)"))
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .connect_timeout(settings.timeout);
        if url
            .host_str()
            .and_then(|h| h.parse::<IpAddr>().ok())
            .is_none()
        {
            builder = builder.resolve_to_addrs(&host, &addrs);
        }
        let client = builder.build().map_err(|e| {
            err(
                "WEB_PROVIDER_ERROR",
                format!("no HTTP client: {}", chain(&e)),
            )
        })?;
        let response = client
            .get(url.clone())
            .header(
                "accept",
                "text/html, text/plain, application/json, application/xml;q=0.9, */*;q=0.1",
            )
            .send()
            .await
            .map_err(|e| {
                err(
                    "WEB_PROVIDER_ERROR",
                    format!("cannot fetch {url}: {}", chain(&e)),
                )
            })?;
        let status = response.status();
        if status.is_redirection() {
            let next = response
                .headers()
                .get("location")
                .and_then(|l| l.to_str().ok())
                .and_then(|l| url.join(l).ok())
                .ok_or_else(|| {
                    err(
                        "WEB_PROVIDER_ERROR",
                        format!("{url} redirects nowhere ({status})"),
                    )
                })?;
            if hop == settings.max_redirects {
                return Err(err(
                    "WEB_REDIRECT_BLOCKED",
                    format!("{url} redirects more than {} times", settings.max_redirects),
                ));
            }
            url = parse(next.as_str()).map_err(|e| {
                err(
                    "WEB_REDIRECT_BLOCKED",
                    format!("{url} redirects to {next}: {}", e.message),
                )
            })?;
            continue;
        }
        if !status.is_success() {
            return Err(err("WEB_HTTP_STATUS", format!("{url} answered {status}")));
        }
        let kind = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("text/plain")
            .to_ascii_lowercase();
        let body = read_capped(response, settings.max_bytes, &url).await?;
        return render(&url, &kind, &body, settings.max_chars);
    }
    Err(err("WEB_REDIRECT_BLOCKED", "too many redirects"))
}

/// An http(s) URL without credentials.
fn parse(raw: &str) -> Result<Url, ToolError> {
    let url = Url::parse(raw.trim()).map_err(|e| {
        err(
            "WEB_INVALID_URL",
            format!("`{raw}` is not a URL: {}", chain(&e)),
        )
    })?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(err(
            "WEB_INVALID_URL",
            format!(
                "only http and https URLs can be fetched, not {}:",
                url.scheme()
            ),
        ));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(err(
            "WEB_INVALID_URL",
            "a URL with credentials in it is refused",
        ));
    }
    if url.host_str().is_none() {
        return Err(err("WEB_INVALID_URL", format!("`{raw}` names no host")));
    }
    Ok(url)
}

/// The addresses `url`'s host resolves to, every one of them public (or
/// the host allowed), and the host as written.
async fn resolve(
    settings: &WebFetchSettings,
    url: &Url,
) -> Result<(Vec<SocketAddr>, String), ToolError> {
    let host = url.host_str().unwrap_or_default().to_owned();
    let bare = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let port = url.port_or_known_default().unwrap_or(80);
    let addrs: Vec<SocketAddr> = match bare.parse::<IpAddr>() {
        Ok(ip) => vec![SocketAddr::new(ip, port)],
        Err(_) => tokio::net::lookup_host((bare.as_str(), port))
            .await
            .map_err(|e| {
                err(
                    "WEB_PROVIDER_ERROR",
                    format!("cannot resolve {host}: {}", chain(&e)),
                )
            })?
            .collect(),
    };
    if addrs.is_empty() {
        return Err(err(
            "WEB_PROVIDER_ERROR",
            format!("{host} resolves to nothing"),
        ));
    }
    let allowed = settings
        .allow_private_hosts
        .iter()
        .any(|h| h.eq_ignore_ascii_case(&bare) || h.eq_ignore_ascii_case(&host));
    if !allowed && let Some(private) = addrs.iter().find(|a| !public(a.ip())) {
        return Err(err(
            "WEB_BLOCKED_URL",
            format!(
                "{host} is {} — on this machine or a private network, which web_fetch does not reach unless the deployment allows that host",
                private.ip()
            ),
        ));
    }
    Ok((addrs, bare))
}

/// Whether `ip` is an address on the public internet.
pub fn public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            !(v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || v4.is_unspecified()
                || v4.is_broadcast()
                || v4.is_multicast()
                || v4.is_documentation()
                || a == 0
                || (a == 100 && (64..128).contains(&b)) // CGNAT
                || (a == 192 && b == 0 && v4.octets()[2] == 0) // IETF protocol
                || (a == 198 && (18..20).contains(&b)) // benchmarking
                || a >= 240)
        }
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return public(IpAddr::V4(v4));
            }
            !(v6.is_loopback()
                || v6.is_unspecified()
                || v6.is_multicast()
                || v6.is_unique_local()
                || v6.is_unicast_link_local()
                || v6.segments()[0] == 0x2001 && v6.segments()[1] == 0x0db8)
        }
    }
}

/// The body, refused past `max` bytes (without reading further).
async fn read_capped(
    response: reqwest::Response,
    max: usize,
    url: &Url,
) -> Result<Vec<u8>, ToolError> {
    if let Some(len) = response.content_length()
        && len > max as u64
    {
        return Err(too_large(url, max));
    }
    let mut body = Vec::new();
    let mut stream = response.bytes_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            err(
                "WEB_PROVIDER_ERROR",
                format!("{url}: the body broke off: {}", chain(&e)),
            )
        })?;
        if body.len() + chunk.len() > max {
            return Err(too_large(url, max));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

fn too_large(url: &Url, max: usize) -> ToolError {
    err(
        "WEB_FETCH_TOO_LARGE",
        format!("{url} is larger than {} MiB", max / (1024 * 1024)),
    )
}

/// The HTML converter: what a reader does not see (scripts, styles, the
/// head, embedded media) is left out.
fn markdown() -> &'static htmd::HtmlToMarkdown {
    static CONVERTER: std::sync::OnceLock<htmd::HtmlToMarkdown> = std::sync::OnceLock::new();
    CONVERTER.get_or_init(|| {
        htmd::HtmlToMarkdown::builder()
            .skip_tags(vec![
                "head", "script", "style", "noscript", "template", "svg", "iframe", "object",
                "canvas",
            ])
            .build()
    })
}

/// The text for the model: a header line, then the content (HTML as
/// Markdown), cut at `max_chars`.
fn render(url: &Url, kind: &str, body: &[u8], max_chars: usize) -> Result<String, ToolError> {
    let mime = kind.split(';').next().unwrap_or("").trim();
    let text = String::from_utf8_lossy(body);
    let content = match mime {
        "text/html" | "application/xhtml+xml" => markdown().convert(&text).map_err(|e| {
            err(
                "WEB_PROVIDER_ERROR",
                format!("{url}: the page could not be read: {}", chain(&e)),
            )
        })?,
        m if m.starts_with("text/")
            || m == "application/json"
            || m.ends_with("+json")
            || m == "application/xml"
            || m.ends_with("+xml") =>
        {
            text.into_owned()
        }
        other => {
            return Err(err(
                "WEB_UNSUPPORTED_CONTENT_TYPE",
                format!("{url} is {other}, not text; web_fetch reads text, HTML, JSON and XML"),
            ));
        }
    };
    let total = content.chars().count();
    let mut out = format!("{url} ({mime})\n\n");
    if total > max_chars {
        out.extend(content.chars().take(max_chars));
        out.push_str(&format!(
            "\n\n[cut: {max_chars} of {total} characters shown]"
        ));
    } else {
        out.push_str(&content);
    }
    Ok(out)
}
