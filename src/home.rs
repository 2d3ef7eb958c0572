//! `~/.dsh`: where dsh keeps what outlives a run on this machine (the
//! sessions store by default, the anonymous installation id).

use std::path::{Path, PathBuf};

/// `$HOME/.dsh`, or `.dsh` in the current directory when `$HOME` is unset.
pub fn dir() -> PathBuf {
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map_or_else(|| PathBuf::from(".dsh"), |h| PathBuf::from(h).join(".dsh"))
}

/// The workspace's system prompt sections for an agent in `cwd` (project
/// instructions, skills catalog), with this home; read off the async
/// workers.
pub async fn workspace_sections(cwd: &Path) -> Vec<dsh_services::prompt::RenderedSection> {
    let (cwd, home) = (cwd.to_path_buf(), dir());
    tokio::task::spawn_blocking(move || dsh_services::skills::workspace_sections(&cwd, Some(&home)))
        .await
        .unwrap_or_default()
}

/// The file holding the anonymous installation id.
pub const USER_ID_FILE: &str = "user-id";

/// This installation's anonymous id: a random UUID made on first use and
/// kept in `~/.dsh/user-id`, so every DeepSeek request of every run carries
/// the same one. It names no person and no machine.
///
/// A file that does not hold a UUID is replaced (it holds nothing anyone
/// committed); a home that cannot be written gives an id for this process
/// only, with a warning, and never stops a run.
pub fn user_id() -> String {
    user_id_in(&dir())
}

/// [`user_id`] kept under `home`.
pub fn user_id_in(home: &Path) -> String {
    let path = home.join(USER_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => match uuid::Uuid::parse_str(text.trim()) {
            Ok(id) => return id.to_string(),
            Err(_) => tracing::warn!(
                path = %path.display(),
                "the anonymous id file holds no UUID; writing a new one"
            ),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the anonymous id")
        }
    }
    let id = uuid::Uuid::new_v4().to_string();
    let written = std::fs::create_dir_all(home)
        .and_then(|()| write_whole(&path, format!("{id}\n").as_bytes()));
    if let Err(e) = written {
        tracing::warn!(path = %path.display(), error = %e, "cannot keep the anonymous id; using one for this run");
        return id;
    }
    // Two first runs at once: both renamed, the last one's file won; read
    // it back so this process sends what later runs will.
    std::fs::read_to_string(&path)
        .ok()
        .and_then(|t| uuid::Uuid::parse_str(t.trim()).ok())
        .map_or(id, |u| u.to_string())
}

/// Writes `bytes` to `path` through a temporary file renamed over it: the
/// file is whole or untouched. The temporary file is created new (never
/// through a link someone placed at its name) under a name no one can
/// guess; a link at `path` itself is replaced, not followed.
pub fn write_whole(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write as _;
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."));
    let name = path
        .file_name()
        .ok_or_else(|| std::io::Error::other("the path names no file"))?;
    let mut tmp = None;
    for _ in 0..16 {
        let candidate = dir.join(format!(
            ".{}.{}.tmp",
            name.to_string_lossy(),
            dsh_services::llm::Message::new_id()
        ));
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&candidate)
        {
            Ok(f) => {
                tmp = Some((candidate, f));
                break;
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    let (tmp, mut f) = tmp.ok_or_else(|| std::io::Error::other("no free temporary name"))?;
    let written = f
        .write_all(bytes)
        .and_then(|()| f.sync_all())
        .and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}
