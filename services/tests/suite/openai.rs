//! The OpenAI-compatible adapter against a real HTTP server on loopback
//! that plays scripted responses (and faults).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_services::llm::{
    BlockAssembler, ContentBlock, FinishReason, History, LlmFailure, LlmRequest, LlmRuntime,
    Message, ToolSchema,
};
use dsh_services::providers::openai::{OpenAiCompatible, OpenAiConfig, RetryListener};
use dsh_supervisors::{Runtime, RuntimeSettings};
use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

enum Reply {
    /// 200 with these SSE `data:` payloads; `cut` drops the connection before `[DONE]`.
    Sse { events: Vec<String>, cut: bool },
    /// An error status with a JSON body.
    Status {
        code: u16,
        body: String,
        retry_after: Option<u32>,
    },
}

struct Server {
    url: String,
    requests: Arc<Mutex<Vec<String>>>,
}

async fn serve(replies: Vec<Reply>) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let requests: Arc<Mutex<Vec<String>>> = Arc::default();
    let seen = requests.clone();
    let queue = Arc::new(Mutex::new(VecDeque::from(replies)));
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            let reply = queue.lock().unwrap().pop_front();
            let seen = seen.clone();
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 8192];
                // Headers, then the body by content-length.
                loop {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let text = String::from_utf8_lossy(&buf).to_string();
                    if let Some(end) = text.find("\r\n\r\n") {
                        let len = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if buf.len() >= end + 4 + len {
                            break;
                        }
                    }
                }
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&buf).to_string());
                let out = match reply {
                    None => {
                        "HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n\r\n".to_owned()
                    }
                    Some(Reply::Status {
                        code,
                        body,
                        retry_after,
                    }) => {
                        let extra = retry_after
                            .map(|s| format!("retry-after: {s}\r\n"))
                            .unwrap_or_default();
                        format!(
                            "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\n{extra}content-length: {}\r\n\r\n{body}",
                            body.len()
                        )
                    }
                    Some(Reply::Sse { events, cut }) => {
                        let mut s = String::from(
                            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n",
                        );
                        for e in events {
                            s.push_str(&format!("data: {e}\n\n"));
                        }
                        if !cut {
                            s.push_str("data: [DONE]\n\n");
                        }
                        s
                    }
                };
                let _ = sock.write_all(out.as_bytes()).await;
                let _ = sock.shutdown().await;
            });
        }
    });
    Server { url, requests }
}

fn request() -> LlmRequest {
    LlmRequest {
        provider: "openai".into(),
        model: "test-model".into(),
        system: Some(Arc::from("be brief")),
        messages: history(vec![Message::user_text("hi")]),
        tools: Arc::from(vec![ToolSchema {
            name: "read".into(),
            description: "reads".into(),
            parameters: serde_json::json!({"type": "object"}),
        }]),
        temperature: Some(0.0),
        max_tokens: None,
        options: Default::default(),
        session: None,
        purpose: None,
        notify: None,
    }
}

fn history(messages: Vec<Message>) -> History {
    let mut log = dsh_services::session::SessionLog::new(
        dsh_services::session::SessionHeader::new("s", None),
    );
    for m in messages {
        log.append(
            dsh_services::session::EventData::UserMessage(Arc::new(m)),
            Some(dsh_services::session::SurfaceIntent::append()),
            0,
        )
        .unwrap();
    }
    log.derive_messages()
}

async fn setup(server: &Server, retry: bool) -> (Runtime, Arc<LlmRuntime>) {
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let llm = Arc::new(LlmRuntime::new());
    let adapter = OpenAiCompatible::new(OpenAiConfig {
        base_url: server.url.clone(),
        api_key: Some("sk-test-secret".into()),
        idle_timeout: Duration::from_secs(30),
        first_byte_timeout: Duration::from_secs(30),
        total_timeout: Duration::from_secs(600),
        dialect: Default::default(),
        user_id: None,
        images: false,
        attachments: None,
        context_window: None,
        models: Vec::new(),
        price: None,
    })
    .unwrap();
    llm.register(&rt.root(), &["openai"], Arc::new(adapter))
        .unwrap();
    if retry {
        RetryListener {
            max_retries: 2,
            initial: Duration::from_millis(5),
            max: Duration::from_millis(20),
        }
        .install(&rt.root())
        .unwrap();
    }
    (rt, llm)
}

/// Runs one call to completion: the assembler, or the failure that ended it.
async fn call(
    rt: &Runtime,
    llm: &Arc<LlmRuntime>,
) -> Result<BlockAssembler, (BlockAssembler, LlmFailure)> {
    let mut a = BlockAssembler::new();
    let mut stream = match llm
        .stream(&rt.root(), request(), CancellationToken::new())
        .await
    {
        Ok(s) => s,
        Err(f) => return Err((a, f)),
    };
    while let Some(item) = stream.next().await {
        match item {
            Ok(c) => a.push(&c),
            Err(f) => return Err((a, f)),
        }
    }
    Ok(a)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_text_reasoning_and_split_tool_calls_with_usage() {
    let server = serve(vec![Reply::Sse {
        events: vec![
            r#"{"choices":[{"delta":{"role":"assistant","reasoning_content":"think"}}]}"#.into(),
            r#"{"choices":[{"delta":{"content":"Look"}}]}"#.into(),
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"call_x1","type":"function","function":{"name":"read","arguments":""}}]}}]}"#.into(),
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"file_"}}]}}]}"#.into(),
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"path\":\"a.txt\"}"}}]}}]}"#.into(),
            r#"{"choices":[{"delta":{},"finish_reason":"tool_calls"}]}"#.into(),
            r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":7,"completion_tokens_details":{"reasoning_tokens":2}}}"#.into(),
        ],
        cut: false,
    }])
    .await;
    let (rt, llm) = setup(&server, false).await;
    let a = call(&rt, &llm).await.map_err(|(_, f)| f).unwrap();
    assert_eq!(
        a.blocks().unwrap(),
        vec![
            ContentBlock::Reasoning {
                text: "think".into()
            },
            ContentBlock::text("Look"),
            ContentBlock::ToolCall {
                id: "call_x1".into(),
                name: "read".into(),
                arguments: "{\"file_path\":\"a.txt\"}".into()
            },
        ]
    );
    assert_eq!(a.finish(), FinishReason::ToolCalls);
    assert_eq!(a.usage().unwrap().reasoning_tokens, Some(2));
    let sent = server.requests.lock().unwrap()[0].clone();
    assert!(sent.starts_with("POST /v1/chat/completions"), "{sent}");
    assert!(
        sent.to_lowercase()
            .contains("authorization: bearer sk-test-secret")
    );
    let body: serde_json::Value =
        serde_json::from_str(&sent[sent.find("\r\n\r\n").unwrap() + 4..]).unwrap();
    assert_eq!(body["stream_options"]["include_usage"], true);
    assert_eq!(
        body["messages"][0],
        serde_json::json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(body["tools"][0]["function"]["name"], "read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_event_inside_a_200_stream_is_a_failure() {
    let server = serve(vec![Reply::Sse {
        events: vec![
            r#"{"choices":[{"delta":{"content":"par"}}]}"#.into(),
            r#"{"error":{"message":"upstream overloaded","type":"overloaded"}}"#.into(),
        ],
        cut: false,
    }])
    .await;
    let (rt, llm) = setup(&server, false).await;
    let (a, f) = call(&rt, &llm).await.err().unwrap();
    assert_eq!(
        (f.code.as_str(), f.message.as_str()),
        ("OVERLOADED", "upstream overloaded")
    );
    assert_eq!(a.interrupted_blocks(), vec![ContentBlock::text("par")]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_errors_are_classified_and_auth_is_not_retried() {
    let server = serve(vec![Reply::Status {
        code: 401,
        body: r#"{"error":{"message":"bad key"}}"#.into(),
        retry_after: None,
    }])
    .await;
    let (rt, llm) = setup(&server, true).await;
    let (_, f) = call(&rt, &llm).await.err().unwrap();
    assert_eq!((f.code.as_str(), f.status), ("AUTH", Some(401)));
    assert!(f.message.contains("bad key"));
    assert!(
        !f.message.contains("sk-test-secret"),
        "the key never appears in errors"
    );
    assert_eq!(server.requests.lock().unwrap().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_are_retried_with_backoff_until_success() {
    let server = serve(vec![
        Reply::Status {
            code: 429,
            body: r#"{"error":{"message":"slow down"}}"#.into(),
            retry_after: None,
        },
        Reply::Status {
            code: 503,
            body: "{}".into(),
            retry_after: None,
        },
        Reply::Sse {
            events: vec![
                r#"{"choices":[{"delta":{"content":"ok"},"finish_reason":"stop"}]}"#.into(),
            ],
            cut: false,
        },
    ])
    .await;
    let (rt, llm) = setup(&server, true).await;
    let a = call(&rt, &llm).await.map_err(|(_, f)| f).unwrap();
    assert_eq!(a.blocks().unwrap(), vec![ContentBlock::text("ok")]);
    assert_eq!(server.requests.lock().unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_connection_and_a_malformed_chunk_end_the_call() {
    let server = serve(vec![
        Reply::Sse {
            events: vec![r#"{"choices":[{"delta":{"content":"half"}}]}"#.into()],
            cut: true,
        },
        Reply::Sse {
            events: vec!["{not json".into()],
            cut: false,
        },
    ])
    .await;
    let (rt, llm) = setup(&server, false).await;
    let (a, f) = call(&rt, &llm).await.err().unwrap();
    assert_eq!(f.code, "CONNECTION_LOST");
    assert_eq!(a.interrupted_blocks(), vec![ContentBlock::text("half")]);
    let (_, f) = call(&rt, &llm).await.err().unwrap();
    assert_eq!(f.code, "MALFORMED_CHUNK");
}

/// How a silent endpoint behaves after reading the request.
#[derive(Clone, Copy)]
enum Silence {
    /// Accepts and never answers.
    NoHeaders,
    /// Sends 200 and the event-stream headers, then nothing.
    NoBody,
    /// Sends one event and a comment, then nothing (a comment is not an
    /// event: it never puts a deadline off).
    OneEvent,
}

async fn silent(how: Silence) -> (String, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let Ok((mut sock, _)) = listener.accept().await else {
            return;
        };
        let mut buf = [0u8; 8192];
        let _ = sock.read(&mut buf).await;
        let headers = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n";
        match how {
            Silence::NoHeaders => {}
            Silence::NoBody => {
                let _ = sock.write_all(headers.as_bytes()).await;
            }
            Silence::OneEvent => {
                let first = r#"data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}"#;
                let _ = sock
                    .write_all(format!("{headers}{first}\n\n: still here\n\n").as_bytes())
                    .await;
            }
        }
        // Hold the connection open until the client gives up.
        let _ = sock.read(&mut buf).await;
    });
    (url, task)
}

/// An endpoint that accepts and never answers, answers headers and no
/// body, or sends one event and then only a comment: each call ends with a retryable
/// `TIMEOUT` saying which wait ran out (it hung forever before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_wait_for_an_endpoint_has_an_end() {
    for (how, said) in [
        (Silence::NoHeaders, "first byte"),
        (Silence::NoBody, "first byte"),
        (Silence::OneEvent, "total ceiling"),
    ] {
        let (url, server) = silent(how).await;
        let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
        let llm = Arc::new(LlmRuntime::new());
        let adapter = OpenAiCompatible::new(OpenAiConfig {
            base_url: url,
            api_key: None,
            idle_timeout: Duration::from_secs(300),
            first_byte_timeout: Duration::from_millis(300),
            total_timeout: Duration::from_millis(900),
            dialect: Default::default(),
            user_id: None,
            images: false,
            attachments: None,
            context_window: None,
            models: Vec::new(),
            price: None,
        })
        .unwrap();
        llm.register(&rt.root(), &["openai"], Arc::new(adapter))
            .unwrap();
        let outcome = tokio::time::timeout(Duration::from_secs(30), call(&rt, &llm))
            .await
            .expect("the call ends by itself");
        let Err((_, failure)) = outcome else {
            panic!("the call should fail")
        };
        assert_eq!(failure.code, "TIMEOUT", "{}", failure.message);
        assert!(failure.retryable());
        assert!(failure.message.contains(said), "{}", failure.message);
        server.abort();
        rt.shutdown().await;
    }
}

/// DeepSeek's dialect, request by request: thinking on or off per effort
/// (the default, or a per-request `reasoning_effort` option), an unknown
/// effort refused before anything is sent, `max_tokens` by default, and a
/// tool-call turn's reasoning passed back with `content: ""`.
#[test]
fn the_deepseek_dialect_switches_thinking_and_passes_reasoning_back() {
    use dsh_services::llm::{MessageSource, Role};
    use dsh_services::providers::openai::{Dialect, ReasoningEffort, request_body};
    let assistant = Message {
        id: Message::new_id(),
        role: Role::Assistant,
        content: vec![
            ContentBlock::Reasoning {
                text: "the file first".into(),
            },
            ContentBlock::ToolCall {
                id: "c1".into(),
                name: "read".into(),
                arguments: "{}".into(),
            },
        ],
        source: MessageSource::model("deepseek", "deepseek-v4-flash"),
    };
    let mut request = request();
    request.messages = history(vec![Message::user_text("hi"), assistant]);
    let deepseek = |effort| Dialect::DeepSeek {
        effort,
        max_tokens: 256_000,
    };
    let body = request_body(&request, deepseek(ReasoningEffort::High)).unwrap();
    assert_eq!(body["thinking"], serde_json::json!({"type": "enabled"}));
    assert_eq!(body["reasoning_effort"], "high");
    assert_eq!(body["max_tokens"], 256_000);
    let turn = &body["messages"][2];
    assert_eq!(turn["role"], "assistant");
    assert_eq!(turn["content"], "");
    assert_eq!(turn["reasoning_content"], "the file first");
    assert_eq!(turn["tool_calls"][0]["id"], "c1");
    // Off: thinking disabled, no effort on the wire.
    let body = request_body(&request, deepseek(ReasoningEffort::Off)).unwrap();
    assert_eq!(body["thinking"], serde_json::json!({"type": "disabled"}));
    assert!(body.get("reasoning_effort").is_none());
    // One request's own effort wins (an `agent/request` listener's).
    request
        .options
        .insert("reasoning_effort".into(), serde_json::json!("max"));
    let body = request_body(&request, deepseek(ReasoningEffort::Off)).unwrap();
    assert_eq!(body["reasoning_effort"], "max");
    assert_eq!(body["thinking"]["type"], "enabled");
    request
        .options
        .insert("reasoning_effort".into(), serde_json::json!("extreme"));
    let err = request_body(&request, deepseek(ReasoningEffort::High)).unwrap_err();
    assert_eq!(err.code, "UNSUPPORTED_REASONING_EFFORT");
    // A title request thinks not at all, whatever the step asked.
    request
        .options
        .insert("reasoning_effort".into(), serde_json::json!("max"));
    request.purpose = Some("session-title");
    let body = request_body(&request, deepseek(ReasoningEffort::High)).unwrap();
    assert_eq!(body["thinking"]["type"], "disabled");
    assert!(body.get("reasoning_effort").is_none());
    request.purpose = None;
    // What the route tells the agent it fills in (logged in its header).
    use dsh_services::llm::{LlmAdapter, ModelDefaults};
    let mut config = OpenAiConfig::new("http://127.0.0.1:9", None);
    config.dialect = deepseek(ReasoningEffort::Low);
    let adapter = OpenAiCompatible::new(config.clone()).unwrap();
    assert_eq!(
        adapter.defaults("deepseek-v4-pro"),
        ModelDefaults {
            reasoning_effort: Some("low"),
            max_tokens: Some(256_000),
            context_window: Some(1_000_000),
            price: None,
        }
    );
    // A catalogue entry wins for its model, the route's window for others.
    // So does its price; the route's price serves the others.
    let cheap = dsh_services::llm::Price {
        input: 100_000,
        cached_input: 10_000,
        output: 400_000,
    };
    let dear = dsh_services::llm::Price {
        input: 3_000_000,
        ..cheap
    };
    config.context_window = Some(500_000);
    config.price = Some(dear);
    config.models = vec![dsh_services::providers::openai::ModelEntry {
        context_window: Some(64_000),
        max_tokens: Some(8_000),
        images: Some(true),
        price: Some(cheap),
        ..dsh_services::providers::openai::ModelEntry::new("small")
    }];
    let listed = OpenAiCompatible::new(config.clone()).unwrap();
    assert_eq!(
        listed.defaults("small"),
        ModelDefaults {
            reasoning_effort: Some("low"),
            max_tokens: Some(8_000),
            context_window: Some(64_000),
            price: Some(cheap),
        }
    );
    assert_eq!(listed.defaults("other").price, Some(dear));
    // 2M input, 1M cached, 0.5M output at the cheap price: 0.2 + 0.01 + 0.2.
    assert_eq!(cheap.cost(2_000_000, 1_000_000, 500_000), 410_000);
    assert_eq!(listed.defaults("other").context_window, Some(500_000));
    assert_eq!(listed.defaults("other").max_tokens, Some(256_000));
    assert!(listed.accepts_images("small") && !listed.accepts_images("other"));
    config.dialect = Dialect::OpenAi;
    assert_eq!(
        OpenAiCompatible::new(config.clone())
            .unwrap()
            .defaults("small"),
        ModelDefaults {
            reasoning_effort: None,
            max_tokens: Some(8_000),
            context_window: Some(64_000),
            price: Some(cheap),
        }
    );
    config.context_window = None;
    config.models.clear();
    config.price = None;
    let plain = OpenAiCompatible::new(config).unwrap();
    assert_eq!(plain.defaults("m"), ModelDefaults::default());
    // Plain OpenAI: nothing of that, and `content: null` beside tool calls.
    request.options.clear();
    let body = request_body(&request, Dialect::OpenAi).unwrap();
    assert!(body.get("thinking").is_none() && body.get("max_tokens").is_none());
    assert!(body["messages"][2]["content"].is_null());
    assert!(body["messages"][2].get("reasoning_content").is_none());
}

/// What a provider says decides the code: exhausted quota is `QUOTA` (on a
/// 402, or a 429 that says so; never retried), a 400 about the context
/// length is `CONTEXT_WINDOW_EXCEEDED`, a plain 429 stays `RATE_LIMITED`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_and_context_overflow_are_told_apart_from_rate_limits() {
    for (status, body, want, retryable) in [
        (
            402,
            r#"{"error":{"message":"Insufficient Balance"}}"#,
            "QUOTA",
            false,
        ),
        (
            429,
            r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota"}}"#,
            "QUOTA",
            false,
        ),
        (
            400,
            r#"{"error":{"message":"This model's maximum context length is 131072 tokens"}}"#,
            "CONTEXT_WINDOW_EXCEEDED",
            false,
        ),
        (
            400,
            r#"{"error":{"message":"bad field"}}"#,
            "BAD_REQUEST",
            false,
        ),
        (
            429,
            r#"{"error":{"message":"slow down"}}"#,
            "RATE_LIMITED",
            true,
        ),
    ] {
        let server = serve(vec![Reply::Status {
            code: status,
            body: body.into(),
            retry_after: None,
        }])
        .await;
        let (rt, llm) = setup(&server, false).await;
        let Err((_, f)) = call(&rt, &llm).await else {
            panic!("{status} should fail")
        };
        assert_eq!(f.code, want, "{status} {body}");
        assert_eq!(f.retryable(), retryable, "{status} {body}");
        rt.shutdown().await;
    }
}

/// A request that is not the conversation says what it is for in
/// `x-dsh-purpose`; the conversation's requests carry no such header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auxiliary_request_names_its_purpose_in_a_header() {
    let done = || Reply::Sse {
        events: vec![r#"{"choices":[{"delta":{"content":"t"},"finish_reason":"stop"}]}"#.into()],
        cut: false,
    };
    let server = serve(vec![done(), done()]).await;
    let (rt, llm) = setup(&server, false).await;
    for purpose in [Some("session-title"), None] {
        let mut r = request();
        r.purpose = purpose;
        let mut stream = llm
            .stream(&rt.root(), r, CancellationToken::new())
            .await
            .unwrap();
        while let Some(item) = stream.next().await {
            item.unwrap();
        }
    }
    let sent = server.requests.lock().unwrap().clone();
    assert!(
        sent[0]
            .to_lowercase()
            .contains("x-dsh-purpose: session-title"),
        "{}",
        sent[0]
    );
    assert!(
        !sent[1].to_lowercase().contains("x-dsh-purpose"),
        "{}",
        sent[1]
    );
    rt.shutdown().await;
}

/// `Retry-After` in both of its forms: delay seconds, or an HTTP date
/// measured from now; zero, a past date and garbage leave the wait to the
/// listener's backoff.
#[test]
fn retry_after_reads_seconds_and_http_dates() {
    use dsh_services::providers::openai::retry_after_ms;
    let now = std::time::UNIX_EPOCH + Duration::from_secs(1_780_000_000);
    assert_eq!(retry_after_ms("7", now), Some(7_000));
    assert_eq!(retry_after_ms(" 2 ", now), Some(2_000));
    let later = httpdate_of(now + Duration::from_secs(90));
    assert_eq!(retry_after_ms(&later, now), Some(90_000), "{later}");
    let earlier = httpdate_of(now - Duration::from_secs(5));
    assert_eq!(retry_after_ms(&earlier, now), None);
    for bad in ["0", "-3", "soon", "", "Wed, 99 Foo 2026 00:00:00 GMT"] {
        assert_eq!(retry_after_ms(bad, now), None, "{bad:?}");
    }
}

/// An IMF-fixdate, written by hand so the test does not share the parser.
fn httpdate_of(t: std::time::SystemTime) -> String {
    let secs = t.duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let weekday = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"][(days % 7) as usize];
    let month = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ][(month - 1) as usize];
    format!(
        "{weekday}, {day:02} {month} {year} {:02}:{:02}:{:02} GMT",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// An endpoint configured for images is sent the bytes of an image a tool
/// returned (read back from the attachment store, as a `data:` URL); the
/// same request to an endpoint without images describes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_result_reaches_an_endpoint_that_takes_images() {
    use base64::Engine;
    let dir = dsh_supervisors::scratch::fresh_dir("dsh-openai-images").unwrap();
    let store = Arc::new(dsh_services::attachments::Attachments::new(&dir));
    let png = super::attachments::png(3, 2);
    let fields = store.put(&png, Some("shot.png")).unwrap();
    let done = || Reply::Sse {
        events: vec![r#"{"choices":[{"delta":{"content":"seen"},"finish_reason":"stop"}]}"#.into()],
        cut: false,
    };
    for images in [true, false] {
        let server = serve(vec![done()]).await;
        let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
        let llm = Arc::new(LlmRuntime::new());
        let mut config = OpenAiConfig::new(server.url.clone(), None);
        config.images = images;
        config.attachments = Some(store.clone());
        llm.register(
            &rt.root(),
            &["openai"],
            Arc::new(OpenAiCompatible::new(config).unwrap()),
        )
        .unwrap();
        let mut r = request();
        r.messages = history(vec![Message {
            id: Message::new_id(),
            role: dsh_services::llm::Role::User,
            content: vec![
                ContentBlock::text("what is in it?"),
                ContentBlock::Image {
                    fields: fields.clone(),
                },
            ],
            source: dsh_services::llm::MessageSource::user(),
        }]);
        let mut stream = llm
            .stream(&rt.root(), r, CancellationToken::new())
            .await
            .unwrap();
        while let Some(item) = stream.next().await {
            item.unwrap();
        }
        let sent = server.requests.lock().unwrap()[0].clone();
        let body: serde_json::Value =
            serde_json::from_str(&sent[sent.find("\r\n\r\n").unwrap() + 4..]).unwrap();
        let part = &body["messages"][1]["content"][1];
        if images {
            let url = format!(
                "data:image/png;base64,{}",
                base64::engine::general_purpose::STANDARD.encode(&png)
            );
            assert_eq!(part["image_url"]["url"], url, "{body}");
        } else {
            assert!(
                part["text"]
                    .as_str()
                    .unwrap()
                    .contains("does not take images"),
                "{part}"
            );
        }
        rt.shutdown().await;
    }
}
