//! Images: sniffed from their bytes, kept by content address, read back
//! checked, and put on the wire as image parts or described in text.

use dsh_supervisors::error::chain;
use std::collections::HashMap;
use std::sync::Arc;

use dsh_services::attachments::{Attachments, sniff};
use dsh_services::llm::{ContentBlock, History, LlmRequest, Message, MessageSource, Role};
use dsh_services::providers::openai::{Dialect, Images, request_body_with};
use dsh_supervisors::scratch::fresh_dir;

/// A minimal PNG header of `w` x `h`.
pub fn png(w: u32, h: u32) -> Vec<u8> {
    let mut b = b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR".to_vec();
    b.extend_from_slice(&w.to_be_bytes());
    b.extend_from_slice(&h.to_be_bytes());
    b.extend_from_slice(&[8, 6, 0, 0, 0, 0, 0, 0, 0]);
    b
}

#[test]
fn images_are_known_by_their_bytes() {
    assert_eq!(
        sniff(&png(640, 480)).map(|i| (i.media_type, i.width, i.height)),
        Some(("image/png", 640, 480))
    );
    let gif = [b"GIF89a".as_slice(), &[0x20, 0x03, 0x58, 0x02]].concat();
    assert_eq!(sniff(&gif).map(|i| (i.width, i.height)), Some((800, 600)));
    // JPEG: SOI, an APP0 segment, then SOF0 with height 300, width 400.
    let mut jpeg = vec![0xff, 0xd8, 0xff, 0xe0, 0x00, 0x04, 0x00, 0x00];
    jpeg.extend_from_slice(&[
        0xff, 0xc0, 0x00, 0x11, 0x08, 0x01, 0x2c, 0x01, 0x90, 0x03, 0, 0, 0, 0, 0, 0,
    ]);
    assert_eq!(
        sniff(&jpeg).map(|i| (i.media_type, i.width, i.height)),
        Some(("image/jpeg", 400, 300))
    );
    // WebP (VP8X): canvas 1024 x 768, stored minus one in 24 bits.
    let mut webp = b"RIFF\x00\x00\x00\x00WEBPVP8X\x0a\x00\x00\x00\x00\x00\x00\x00".to_vec();
    webp.extend_from_slice(&[0xff, 0x03, 0x00, 0xff, 0x02, 0x00]);
    assert_eq!(
        sniff(&webp).map(|i| (i.media_type, i.width, i.height)),
        Some(("image/webp", 1024, 768))
    );
    for not in [
        b"hello".as_slice(),
        b"\x89PNG\r\n\x1a\n",
        b"GIF8",
        b"%PDF-1.7",
    ] {
        assert_eq!(sniff(not), None, "{not:?}");
    }
}

#[test]
fn the_store_keeps_images_by_content_and_checks_what_it_reads_back() {
    let dir = fresh_dir("dsh-attach").unwrap();
    let store = Attachments::new(&dir);
    let fields = store.put(&png(2, 3), Some("shot.png")).unwrap();
    let id = fields["attachmentId"].as_str().unwrap().to_owned();
    assert!(id.starts_with("sha256:") && id.len() == 71, "{id}");
    assert_eq!(
        (fields["width"].as_u64(), fields["height"].as_u64()),
        (Some(2), Some(3))
    );
    assert_eq!(fields["name"], "shot.png");
    let mut unnamed = fields.clone();
    unnamed.remove("name");
    assert_eq!(
        store.put(&png(2, 3), None).unwrap(),
        unnamed,
        "the same bytes, the same id"
    );
    assert_eq!(store.get(&id).unwrap(), png(2, 3));
    // Not an image, too large, a forged id, a tampered file.
    assert!(store.put(b"plain text", None).is_err());
    assert!(store.put(&png(9000, 10), None).is_err());
    for bad in [
        "sha256:../../etc/passwd",
        "md5:abc",
        &format!("{}x", &id[..70]),
    ] {
        assert!(store.get(bad).is_err(), "{bad}");
    }
    let hex = &id[7..];
    std::fs::write(dir.join("v1").join(&hex[..2]).join(hex), png(5, 5)).unwrap();
    let err = chain(&store.get(&id).unwrap_err()).to_string();
    assert!(err.contains("do not match"), "{err}");
}

fn history(messages: Vec<Message>) -> History {
    let mut log = dsh_services::session::SessionLog::new(
        dsh_services::session::SessionHeader::new("s", None),
    );
    for m in messages {
        let data = if m.role == Role::Assistant {
            dsh_services::session::EventData::AssistantMessage {
                turn: 1,
                step: 1,
                message: Arc::new(m),
                usage: None,
                interrupted: false,
            }
        } else {
            dsh_services::session::EventData::UserMessage(Arc::new(m))
        };
        log.append(
            data,
            Some(dsh_services::session::SurfaceIntent::append()),
            0,
        )
        .unwrap();
    }
    log.derive_messages()
}

#[test]
fn image_blocks_go_on_the_wire_as_parts_or_as_text() {
    let store = Attachments::new(fresh_dir("dsh-attach-wire").unwrap());
    let fields = store.put(&png(4, 4), Some("a.png")).unwrap();
    let image = ContentBlock::Image {
        fields: fields.clone(),
    };
    let id = fields["attachmentId"].as_str().unwrap().to_owned();
    let result = Message {
        id: Message::new_id(),
        role: Role::User,
        content: vec![ContentBlock::ToolResult {
            tool_call_id: "c1".into(),
            content: vec![ContentBlock::text("a.png: image/png, 4x4"), image.clone()],
            is_error: Some(false),
        }],
        source: MessageSource::tool("c1"),
    };
    let call = Message {
        id: Message::new_id(),
        role: Role::Assistant,
        content: vec![ContentBlock::ToolCall {
            id: "c1".into(),
            name: "read_image".into(),
            arguments: "{}".into(),
        }],
        source: MessageSource::model("p", "m"),
    };
    let request = LlmRequest {
        provider: "p".into(),
        model: "m".into(),
        system: None,
        messages: history(vec![Message::user_text("look"), call, result]),
        tools: Arc::from([]),
        temperature: None,
        max_tokens: None,
        options: Default::default(),
        session: None,
        purpose: None,
        notify: None,
    };
    let urls = HashMap::from([(id.clone(), "data:image/png;base64,AAAA".to_owned())]);
    let body = request_body_with(&request, Dialect::OpenAi, &Images::Sent(urls)).unwrap();
    let messages = body["messages"].as_array().unwrap();
    assert_eq!(messages[2]["role"], "tool");
    assert_eq!(messages[2]["content"], "a.png: image/png, 4x4");
    assert_eq!(messages[3]["role"], "user");
    assert_eq!(
        messages[3]["content"][1]["image_url"]["url"],
        "data:image/png;base64,AAAA"
    );
    // A model without images reads a description; so does a lost one.
    for images in [Images::Described, Images::Sent(HashMap::new())] {
        let body = request_body_with(&request, Dialect::OpenAi, &images).unwrap();
        let part = &body["messages"][3]["content"][1];
        assert_eq!(part["type"], "text");
        assert!(
            part["text"]
                .as_str()
                .unwrap()
                .starts_with("[image a.png: image/png, 4x4;"),
            "{part}"
        );
    }
}

/// `read_image` keeps a workspace image and returns it as an image block;
/// it stays in the workspace (a symlink out is refused) and refuses what
/// is not an image.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_image_hands_a_workspace_image_to_the_model() {
    use dsh_services::tools::builtin::ReadImage;
    use dsh_services::tools::{Tool, ToolContext};
    let base = fresh_dir("dsh-read-image").unwrap().canonicalize().unwrap();
    let (ws, outside) = (base.join("ws"), base.join("outside"));
    std::fs::create_dir_all(&ws).unwrap();
    std::fs::create_dir_all(&outside).unwrap();
    std::fs::write(ws.join("shot.png"), png(10, 20)).unwrap();
    std::fs::write(ws.join("notes.txt"), "not an image").unwrap();
    std::fs::write(outside.join("secret.png"), png(1, 1)).unwrap();
    std::os::unix::fs::symlink(outside.join("secret.png"), ws.join("link.png")).unwrap();
    let rt = dsh_supervisors::Runtime::start(dsh_supervisors::RuntimeSettings::default())
        .await
        .unwrap();
    let store = Arc::new(Attachments::new(base.join("store")));
    rt.root()
        .provide(Attachments::SERVICE, store.clone())
        .unwrap();
    let call = |path: &str| {
        let cx = ToolContext {
            call_id: "i".into(),
            args: serde_json::json!({ "file_path": path }),
            cancel: tokio_util::sync::CancellationToken::new(),
            ctx: rt.root(),
            cwd: Arc::new(ws.clone()),
            policy: dsh_services::sandbox::Policy::default(),
        };
        Arc::new(ReadImage).execute(cx)
    };
    let out = call("shot.png").await.unwrap();
    assert_eq!(
        out.content[0],
        ContentBlock::text(format!(
            "{}: image/png, 10x20",
            ws.join("shot.png").display()
        ))
    );
    let ContentBlock::Image { fields } = &out.content[1] else {
        panic!("{:?}", out.content)
    };
    let id = fields["attachmentId"].as_str().unwrap();
    assert_eq!(store.get(id).unwrap(), png(10, 20));
    for (path, code) in [
        ("link.png", "OUTSIDE_WORKSPACE"),
        ("../outside/secret.png", "OUTSIDE_WORKSPACE"),
        ("notes.txt", "NOT_AN_IMAGE"),
        ("missing.png", "NOT_FOUND"),
    ] {
        let e = call(path).await.unwrap_err();
        assert_eq!(e.code, code, "{path}: {e}");
    }
    rt.shutdown().await;
}
