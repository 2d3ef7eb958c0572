//! Project instructions: the `AGENTS.md` (or `CLAUDE.md`) files a project
//! keeps for agents, from the user's own under `~/.dsh` and the project
//! root down to the agent's working directory, rendered as one system
//! prompt section that says where each came from.
//!
//! Files are the workspace's, so hostile: a symlink is not followed (a
//! repository's `AGENTS.md -> ~/.ssh/id_ed25519` would send the key to the
//! model), only regular UTF-8 files load, one over [`MAX_FILE_BYTES`] is
//! skipped, and the whole section stays under [`MAX_TOTAL_BYTES`].

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The section's name and order (after the tools' guidance and the sandbox).
pub const SECTION: &str = "project-instructions";
/// Its order.
pub const ORDER: i32 = 300;

/// Names looked for in each directory, in this order; a second file with
/// the same text as the first is left out.
pub const CANDIDATES: [&str; 2] = ["AGENTS.md", "CLAUDE.md"];

/// A file larger than this is skipped.
pub const MAX_FILE_BYTES: u64 = 64 * 1024;

/// The section's text stays under this; files past it are named, not loaded.
pub const MAX_TOTAL_BYTES: usize = 32 * 1024;

/// One loaded file: where it is and what it says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Source {
    /// Its path.
    pub path: PathBuf,
    /// Its text, trimmed.
    pub text: String,
}

/// The instruction files for an agent working in `cwd`: `home`'s own
/// `AGENTS.md` first (the user's, for every project), then each directory
/// from the project root (the nearest ancestor of `cwd` holding `.git`, else
/// `cwd` itself) down to `cwd`, so the nearest comes last.
pub fn sources(cwd: &Path, home: Option<&Path>) -> Vec<Source> {
    let mut out = Vec::new();
    if let Some(home) = home
        && let Some(text) = read_plain(&home.join("AGENTS.md"))
    {
        out.push(Source {
            path: home.join("AGENTS.md"),
            text,
        });
    }
    let Ok(cwd) = cwd.canonicalize() else {
        return out;
    };
    let root = project_root(&cwd);
    let mut dirs: Vec<&Path> = cwd.ancestors().take_while(|d| *d != root).collect();
    dirs.push(&root);
    dirs.reverse();
    for dir in dirs {
        let mut here: Vec<Source> = Vec::new();
        for name in CANDIDATES {
            let path = dir.join(name);
            if let Some(text) = read_plain(&path)
                && !here.iter().any(|s| s.text == text)
            {
                here.push(Source { path, text });
            }
        }
        out.extend(here);
    }
    out
}

/// The section text for `sources`, or `None` when there are none.
pub fn render(sources: &[Source]) -> Option<String> {
    if sources.is_empty() {
        return None;
    }
    let mut text = String::from(
        "# Project instructions\nThe files below are instructions this project and its user keep for agents, the nearest directory's last: where they disagree, the nearer one wins, and the user's word in this conversation wins over all of them.",
    );
    let mut skipped = Vec::new();
    for s in sources {
        let part = format!("\n\n## From {}\n{}", s.path.display(), s.text);
        if text.len() + part.len() > MAX_TOTAL_BYTES {
            skipped.push(s.path.display().to_string());
            continue;
        }
        text.push_str(&part);
    }
    if !skipped.is_empty() {
        text.push_str(&format!(
            "\n\n(Not loaded, over the {} KiB budget: {}. Read them if the task needs them.)",
            MAX_TOTAL_BYTES / 1024,
            skipped.join(", ")
        ));
    }
    Some(text)
}

/// The project root of a (canonical) `cwd`: its nearest ancestor holding
/// `.git`, else `cwd` itself.
pub fn project_root(cwd: &Path) -> PathBuf {
    cwd.ancestors()
        .find(|d| d.join(".git").symlink_metadata().is_ok())
        .unwrap_or(cwd)
        .to_path_buf()
}

/// [`render`] of [`sources`]. Reads files: call it off the async workers.
pub fn load(cwd: &Path, home: Option<&Path>) -> Option<String> {
    render(&sources(cwd, home))
}

/// The trimmed text of `path` if it is a regular, non-empty UTF-8 file of
/// at most [`MAX_FILE_BYTES`] reached without following a symlink at its
/// last component.
pub(crate) fn read_plain(path: &Path) -> Option<String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let meta = file.metadata().ok()?;
    if !meta.is_file() {
        return None;
    }
    if meta.len() > MAX_FILE_BYTES {
        tracing::warn!(path = %path.display(), "instruction file over 64 KiB, skipped");
        return None;
    }
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1).read_to_end(&mut bytes).ok()?;
    let text = String::from_utf8(bytes).ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}
