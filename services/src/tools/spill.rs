//! Spill: a tool's plain-text result too large for the model's context is
//! kept whole in a private file, and the model reads a preview (its head
//! and tail) with the file's path instead.
//!
//! One optional capability ([`SpillStore::SERVICE`]): without it results
//! pass as they are. With it, every successful call whose content is text
//! only and longer than [`SpillStore::max_inline_bytes`] is saved under
//! `<root>/session-<hash of the session id>/<random>-<tool>.txt` and
//! replaced. The root and each session directory are private (0700, ours,
//! not a symlink — a directory that is not is refused, never used), and the
//! file is created new (0600, no symlink followed), so nothing planted
//! beforehand can redirect or read it. A save that fails keeps the result
//! inline: spilling never turns a successful call into a failure.
//!
//! `read` reads a spilled file by the absolute path the preview names,
//! beneath the spill root as it reads beneath the workspace.

use std::io::Write as _;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::llm::ContentBlock;
use crate::tools::ToolOutput;

/// Where spilled results go and past what size.
#[derive(Debug)]
pub struct SpillStore {
    root: PathBuf,
    max_inline_bytes: usize,
}

impl SpillStore {
    /// The capability name.
    pub const SERVICE: &'static str = "spill-store";

    /// The default cap of a result kept inline: 40,000 bytes (about 10,000
    /// tokens).
    pub const DEFAULT_MAX_INLINE: usize = 40_000;

    /// A store under `root` (created private when missing) spilling past
    /// `max_inline_bytes` (at least 1,024).
    pub fn new(root: PathBuf, max_inline_bytes: usize) -> SpillStore {
        SpillStore {
            root,
            max_inline_bytes: max_inline_bytes.max(1024),
        }
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Results longer than this many bytes are spilled.
    pub fn max_inline_bytes(&self) -> usize {
        self.max_inline_bytes
    }

    /// `output` as the model should read it: as it is, or (text only and
    /// too long) a preview naming the file that holds it whole.
    pub async fn apply(&self, session: &str, tool: &str, output: ToolOutput) -> ToolOutput {
        let Some(text) = text_only(&output.content) else {
            return output;
        };
        if text.len() <= self.max_inline_bytes {
            return output;
        }
        let (root, session, tool) = (self.root.clone(), session.to_owned(), tool.to_owned());
        // The text goes to the blocking pool and comes back for the preview.
        let saved = tokio::task::spawn_blocking(move || {
            let path = save(&root, &session, &tool, text.as_bytes());
            (path, text)
        })
        .await;
        match saved {
            Ok((Ok(path), text)) => ToolOutput {
                content: vec![ContentBlock::text(preview(
                    &text,
                    &path,
                    self.max_inline_bytes,
                ))],
                meta: output.meta,
            },
            Ok((Err(e), text)) => {
                tracing::warn!("a {} byte result stays inline: {e}", text.len());
                output
            }
            Err(_) => output,
        }
    }
}

/// The text of `content` when it holds text blocks only.
fn text_only(content: &[ContentBlock]) -> Option<String> {
    let mut text = String::new();
    for block in content {
        match block {
            ContentBlock::Text { text: t } => text.push_str(t),
            _ => return None,
        }
    }
    Some(text)
}

/// `text`'s head and tail within `budget` bytes with the file's pointer.
fn preview(text: &str, path: &Path, budget: usize) -> String {
    let note = format!(
        "\n\n[This result was {} bytes; the whole of it is in {}. Read it with the read tool (offset and limit for a range) rather than running the call again.]",
        text.len(),
        path.display()
    );
    let room = budget.saturating_sub(note.len() + 64);
    let head = floor_boundary(text, room * 3 / 4);
    let tail = ceil_boundary(text, text.len() - (room - head.len()).min(text.len()));
    let omitted = text.len() - head.len() - (text.len() - tail);
    format!(
        "{head}\n\n[... {omitted} bytes omitted ...]\n\n{}{note}",
        &text[tail..]
    )
}

/// The longest prefix of `text` of at most `n` bytes ending on a character.
fn floor_boundary(text: &str, n: usize) -> &str {
    let mut n = n.min(text.len());
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    &text[..n]
}

/// The first character boundary at or after `n`.
fn ceil_boundary(text: &str, n: usize) -> usize {
    let mut n = n.min(text.len());
    while !text.is_char_boundary(n) {
        n += 1;
    }
    n
}

/// Saves `bytes` as a new private file for `session`; its path.
fn save(root: &Path, session: &str, tool: &str, bytes: &[u8]) -> std::io::Result<PathBuf> {
    private_dir(root)?;
    let digest = ring::digest::digest(&ring::digest::SHA256, session.as_bytes());
    let hash: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = root.join(format!("session-{hash}"));
    private_dir(&dir)?;
    let safe: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '_'
            }
        })
        .take(48)
        .collect();
    let path = dir.join(format!("{}-{safe}.txt", uuid::Uuid::new_v4().simple()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&path)?;
    file.write_all(bytes)?;
    file.flush()?;
    Ok(path)
}

/// Creates `dir` private, or checks that it is: a real directory, ours,
/// closed to others.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => return Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)?;
            return Ok(());
        }
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    let refuse = |why: &str| {
        Err(std::io::Error::other(format!(
            "{} {why}; it is not used for spill files",
            dir.display()
        )))
    };
    if !meta.file_type().is_dir() {
        return refuse("is not a directory (a symlink?)");
    }
    if meta.uid() != nix::unistd::geteuid().as_raw() {
        return refuse("belongs to another user");
    }
    if meta.permissions().mode() & 0o077 != 0 {
        return refuse("is open to other users");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_preview_keeps_head_and_tail_within_the_budget_on_char_boundaries() {
        let text = format!("{}{}", "é".repeat(30_000), "z".repeat(30_000));
        let shown = preview(&text, Path::new("/spill/x.txt"), 4096);
        assert!(shown.len() <= 4096, "{}", shown.len());
        assert!(shown.starts_with('é') && shown.contains("zzz\n\n[This result was 90000 bytes"));
        assert!(shown.contains("bytes omitted"));
        assert!(shown.contains("/spill/x.txt"));
    }
}
