//! Image attachments: the bytes of an image a tool or a user hands the
//! model, kept once under a content address (`sha256:<hex>`) so the session
//! log carries only a reference — id, media type, size, dimensions — and
//! the adapter reads the bytes back when it builds a request.
//!
//! The media type and dimensions come from the bytes (PNG, JPEG, GIF,
//! WebP headers), never from a file name; an image over [`MAX_BYTES`] or
//! [`MAX_SIDE`] pixels a side is refused, not shrunk.

use std::io::Write;
use std::path::PathBuf;

use serde_json::{Map, Value, json};

/// The largest image kept, in bytes.
pub const MAX_BYTES: usize = 20 * 1024 * 1024;

/// The longest side an image may have, in pixels.
pub const MAX_SIDE: u32 = 8192;

/// Why an image was not kept or cannot be read back.
#[derive(Debug, thiserror::Error)]
pub enum AttachmentError {
    /// Not a PNG, JPEG, GIF or WebP image (by its bytes).
    #[error("not a PNG, JPEG, GIF or WebP image")]
    NotAnImage,
    /// Over a limit.
    #[error("the image is {0}, over the limit of 20 MiB and 8192 pixels a side")]
    TooLarge(String),
    /// An id that is no attachment id.
    #[error("`{0}` is not an attachment id")]
    BadId(String),
    /// The store could not be written or read.
    #[error("the attachment store at {}", .path.display())]
    Store {
        /// Where.
        path: PathBuf,
        /// What happened.
        #[source]
        error: std::io::Error,
    },
}

/// What the bytes of an image say about it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ImageInfo {
    /// `image/png`, `image/jpeg`, `image/gif` or `image/webp`.
    pub media_type: &'static str,
    /// Width in pixels.
    pub width: u32,
    /// Height in pixels.
    pub height: u32,
}

/// The media type and dimensions of an image, read from its header.
pub fn sniff(b: &[u8]) -> Option<ImageInfo> {
    let be32 = |i: usize| Some(u32::from_be_bytes(b.get(i..i + 4)?.try_into().ok()?));
    let le16 = |i: usize| Some(u16::from_le_bytes(b.get(i..i + 2)?.try_into().ok()?) as u32);
    let be16 = |i: usize| Some(u16::from_be_bytes(b.get(i..i + 2)?.try_into().ok()?) as u32);
    let info = |media_type, width, height| {
        Some(ImageInfo {
            media_type,
            width,
            height,
        })
    };
    if b.starts_with(b"\x89PNG\r\n\x1a\n") && b.get(12..16) == Some(b"IHDR") {
        return info("image/png", be32(16)?, be32(20)?);
    }
    if b.starts_with(b"GIF87a") || b.starts_with(b"GIF89a") {
        return info("image/gif", le16(6)?, le16(8)?);
    }
    if b.starts_with(b"RIFF") && b.get(8..12) == Some(b"WEBP") {
        return match b.get(12..16)? {
            b"VP8 " => info("image/webp", le16(26)? & 0x3fff, le16(28)? & 0x3fff),
            b"VP8L" => {
                let bits = u32::from_le_bytes(b.get(21..25)?.try_into().ok()?);
                info(
                    "image/webp",
                    (bits & 0x3fff) + 1,
                    ((bits >> 14) & 0x3fff) + 1,
                )
            }
            b"VP8X" => {
                let le24 = |i: usize| Some(le16(i)? | (u32::from(*b.get(i + 2)?) << 16));
                info("image/webp", le24(24)? + 1, le24(27)? + 1)
            }
            _ => None,
        };
    }
    if b.starts_with(&[0xff, 0xd8]) {
        // Walk the segments to a start-of-frame marker.
        let mut i = 2;
        while i + 9 < b.len() {
            if b[i] != 0xff {
                return None;
            }
            let marker = b[i + 1];
            let len = be16(i + 2)? as usize;
            if matches!(marker, 0xc0..=0xcf) && !matches!(marker, 0xc4 | 0xc8 | 0xcc) {
                return info("image/jpeg", be16(i + 7)?, be16(i + 5)?);
            }
            i += 2 + len;
        }
    }
    None
}

/// The `attachments` service: images by content address under `root`.
#[derive(Debug)]
pub struct Attachments {
    root: PathBuf,
}

impl Attachments {
    /// The capability name.
    pub const SERVICE: &'static str = "attachments";

    /// A store under `root` (created on first use).
    pub fn new(root: impl Into<PathBuf>) -> Attachments {
        Attachments { root: root.into() }
    }

    fn path_of(&self, id: &str) -> Result<PathBuf, AttachmentError> {
        let hex = id
            .strip_prefix("sha256:")
            .filter(|h| {
                h.len() == 64
                    && h.bytes()
                        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase())
            })
            .ok_or_else(|| AttachmentError::BadId(id.to_owned()))?;
        Ok(self.root.join("v1").join(&hex[..2]).join(hex))
    }

    /// Keeps `bytes` (an image) and returns the fields of its image block
    /// for a message: the reference and what the bytes say, with `name` for
    /// display. Writes a file: call it off the async workers.
    pub fn put(
        &self,
        bytes: &[u8],
        name: Option<&str>,
    ) -> Result<Map<String, Value>, AttachmentError> {
        let info = sniff(bytes).ok_or(AttachmentError::NotAnImage)?;
        if bytes.len() > MAX_BYTES || info.width > MAX_SIDE || info.height > MAX_SIDE {
            return Err(AttachmentError::TooLarge(format!(
                "{} bytes, {}x{}",
                bytes.len(),
                info.width,
                info.height
            )));
        }
        let id = address(bytes);
        let hex = &id["sha256:".len()..];
        let path = self.path_of(&id)?;
        if !path.exists() {
            let store = |e| AttachmentError::Store {
                path: path.clone(),
                error: e,
            };
            let dir = path.parent().unwrap_or(&self.root);
            std::fs::create_dir_all(dir).map_err(store)?;
            let tmp = dir.join(format!(".{hex}.{}", std::process::id()));
            let mut f = std::fs::File::create(&tmp).map_err(store)?;
            f.write_all(bytes)
                .and_then(|()| f.sync_all())
                .map_err(store)?;
            std::fs::rename(&tmp, &path).map_err(store)?;
        }
        let mut fields = Map::new();
        fields.insert("attachmentId".into(), json!(id));
        fields.insert("mediaType".into(), json!(info.media_type));
        fields.insert("bytes".into(), json!(bytes.len()));
        fields.insert("width".into(), json!(info.width));
        fields.insert("height".into(), json!(info.height));
        if let Some(n) = name {
            fields.insert("name".into(), json!(n));
        }
        Ok(fields)
    }

    /// The bytes of attachment `id`, checked against its address. Reads a
    /// file: call it off the async workers.
    pub fn get(&self, id: &str) -> Result<Vec<u8>, AttachmentError> {
        let path = self.path_of(id)?;
        let bytes = std::fs::read(&path).map_err(|e| AttachmentError::Store {
            path: path.clone(),
            error: e,
        })?;
        if id != address(&bytes) {
            return Err(AttachmentError::Store {
                path,
                error: std::io::Error::other("its bytes do not match its address"),
            });
        }
        Ok(bytes)
    }
}

/// The content address of `bytes`: `sha256:<hex>`.
fn address(bytes: &[u8]) -> String {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256:{hex}")
}

/// A one-line description of an image block, for a model that takes no
/// images (or an image that cannot be read back).
pub fn placeholder(fields: &Map<String, Value>, why: &str) -> String {
    let name = fields
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("image");
    let kind = fields
        .get("mediaType")
        .and_then(Value::as_str)
        .unwrap_or("image");
    let (w, h) = (
        fields.get("width").and_then(Value::as_u64).unwrap_or(0),
        fields.get("height").and_then(Value::as_u64).unwrap_or(0),
    );
    format!("[image {name}: {kind}, {w}x{h}; {why}]")
}
