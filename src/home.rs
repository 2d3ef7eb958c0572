//! `~/.dsh`: where dsh keeps what outlives a run on this machine (the
//! sessions store by default, the anonymous installation id).

use std::io::Write;
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
    if let Err(e) = write_atomically(home, &path, &id) {
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

/// Writes `text` to `path` through a temporary file and a rename, so a
/// reader sees the old file or the whole new one.
fn write_atomically(home: &Path, path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::create_dir_all(home)?;
    let tmp = home.join(format!(".{USER_ID_FILE}.{}", std::process::id()));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.write_all(b"\n")?;
    f.sync_all()?;
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}
