//! Reaching files under a call's policy without holes.
//!
//! Confined (`read-only`, `workspace-write`), a path is opened relative to
//! a handle on the workspace root with `openat2(RESOLVE_BENEATH |
//! RESOLVE_NO_MAGICLINKS)`: the kernel resolves every component, symlinks
//! included, and refuses any step out of the root, in the same system call
//! that opens the file. A dangling link to a file outside, a link swapped in
//! between a check and the write, `..` or an absolute link: none leaves the
//! workspace. (Absolute symlinks are refused even when they point back
//! inside.) Missing parent directories are created one at a time, each
//! relative to a handle on its already-resolved parent.
//!
//! [`confine`] answers the same question for paths that are not opened
//! here (a command's working directory, a search root): it resolves
//! without following anything blindly — each component by
//! `symlink_metadata`, each link's target resolved in turn — so a dangling
//! link is judged by where it points.
//!
//! Under `danger-full-access` (standing, or one approved call) paths are
//! taken as given, relative ones against the workspace.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::OwnedFd;
use std::path::{Component, Path, PathBuf};

use dsh_supervisors::error::chain;
use nix::errno::Errno;
use nix::fcntl::{OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::Mode;

use crate::sandbox::PermissionMode;
use crate::tools::{ToolContext, ToolError};

/// Symlinks followed in one resolution before it is refused (as Linux does).
const MAX_LINKS: usize = 40;

/// The hint every confined refusal carries.
pub(super) const ESCALATE: &str = "If the task really needs it, retry the call with `sandbox_permissions` set to the mode it needs (`workspace-write`, or `danger-full-access` outside the workspace) and a `justification`; the user is asked to approve that one call.";

/// Where a file tool's path leads.
#[derive(Clone, Debug)]
pub(super) enum Place {
    /// `rel` beneath the workspace `root`, resolved by the kernel.
    Beneath {
        /// The workspace, canonical.
        root: PathBuf,
        /// A relative path with no `.` or `..`.
        rel: PathBuf,
    },
    /// Unconfined.
    Anywhere(PathBuf),
}

impl Place {
    /// Where the call's `given` path leads under its policy.
    pub(super) fn of(cx: &ToolContext, given: &str) -> Result<Place, ToolError> {
        if given.is_empty() {
            return Err(ToolError::new("INVALID_ARGS", "the path is empty"));
        }
        if cx.policy.mode == PermissionMode::DangerFullAccess {
            return Ok(Place::Anywhere(lexical(&cx.cwd.join(given))));
        }
        let root = canonical_root(&cx.cwd)?;
        let full = lexical(&root.join(given));
        match full.strip_prefix(&root) {
            Ok(rel) => Ok(Place::Beneath {
                rel: rel.to_path_buf(),
                root,
            }),
            Err(_) => Err(outside(given, &root)),
        }
    }

    /// A file dsh spilled for the model (a long result, a job's output),
    /// named by its absolute path: read beneath its spill root as a
    /// workspace file is read beneath the workspace, whatever the mode.
    pub(super) fn spilled(cx: &ToolContext, given: &str) -> Option<Place> {
        let given = Path::new(given);
        if !given.is_absolute() {
            return None;
        }
        let roots = [
            cx.ctx
                .get::<crate::tools::SpillStore>(crate::tools::SpillStore::SERVICE)
                .map(|s| s.root().to_path_buf()),
            cx.ctx
                .get::<crate::jobs::Jobs>(crate::jobs::Jobs::SERVICE)
                .map(|j| j.spill_dir().to_path_buf()),
        ];
        let full = lexical(given);
        roots.into_iter().flatten().find_map(|root| {
            let root = root.canonicalize().ok()?;
            let rel = full.strip_prefix(&root).ok()?;
            (!rel.as_os_str().is_empty()).then(|| Place::Beneath {
                rel: rel.to_path_buf(),
                root,
            })
        })
    }

    /// The path to show and to key what was read by.
    pub(super) fn shown(&self) -> PathBuf {
        match self {
            Place::Beneath { root, rel } => root.join(rel),
            Place::Anywhere(p) => p.clone(),
        }
    }

    /// The whole file's bytes, refused past `max`; `Ok(None)` when it does
    /// not exist.
    pub(super) async fn read_bytes(
        &self,
        given: &str,
        max: u64,
    ) -> Result<Option<Vec<u8>>, ToolError> {
        let place = self.clone();
        let given = given.to_owned();
        blocking(move || -> Result<Option<Vec<u8>>, ToolError> {
            let file = match place.open(OFlag::O_RDONLY, &given) {
                Ok(f) => f,
                Err(Opened::Missing) => return Ok(None),
                Err(Opened::Refused(e)) => return Err(e),
            };
            let mut bytes = Vec::new();
            file.take(max + 1).read_to_end(&mut bytes).map_err(|e| {
                ToolError::failed(format!("cannot read {}: {e}", place.shown().display()))
            })?;
            if bytes.len() as u64 > max {
                return Err(ToolError::new(
                    "TOO_LARGE",
                    format!("{} is larger than {max} bytes", place.shown().display()),
                ));
            }
            Ok(Some(bytes))
        })
        .await
    }

    /// The whole file as UTF-8; `Ok(None)` when it does not exist.
    pub(super) async fn read(&self, given: &str) -> Result<Option<String>, ToolError> {
        let bytes = self.read_bytes(given, u64::MAX - 1).await?;
        match bytes {
            None => Ok(None),
            Some(b) => String::from_utf8(b).map(Some).map_err(|_| {
                ToolError::failed(format!("{} is not UTF-8 text", self.shown().display()))
            }),
        }
    }

    /// Creates or replaces the file with `content`, creating missing parent
    /// directories.
    pub(super) async fn write(&self, given: &str, content: Vec<u8>) -> Result<(), ToolError> {
        let place = self.clone();
        let given = given.to_owned();
        blocking(move || {
            place.make_parents(&given)?;
            let flags = OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC;
            let mut file = place.open(flags, &given).map_err(|e| match e {
                Opened::Missing => ToolError::failed(format!(
                    "cannot create {}: its directory is missing",
                    place.shown().display()
                )),
                Opened::Refused(e) => e,
            })?;
            file.write_all(&content).map_err(|e| {
                ToolError::failed(format!("cannot write {}: {e}", place.shown().display()))
            })
        })
        .await
    }

    fn open(&self, flags: OFlag, given: &str) -> Result<File, Opened> {
        let flags = flags | OFlag::O_CLOEXEC;
        match self {
            Place::Anywhere(path) => {
                let mut options = std::fs::OpenOptions::new();
                options
                    .read(!flags.intersects(OFlag::O_WRONLY))
                    .write(flags.contains(OFlag::O_WRONLY))
                    .create(flags.contains(OFlag::O_CREAT))
                    .truncate(flags.contains(OFlag::O_TRUNC));
                options.open(path).map_err(|e| match e.kind() {
                    std::io::ErrorKind::NotFound => Opened::Missing,
                    _ => Opened::Refused(ToolError::failed(format!(
                        "cannot open {}: {e}",
                        path.display()
                    ))),
                })
            }
            Place::Beneath { root, rel } => {
                let dir = open_root(root).map_err(Opened::Refused)?;
                beneath(&dir, rel, flags)
                    .map(File::from)
                    .map_err(|e| refusal(e, given, root, &self.shown()))
            }
        }
    }

    /// Creates the missing directories above the file, each relative to a
    /// handle on its (kernel-resolved) parent.
    fn make_parents(&self, given: &str) -> Result<(), ToolError> {
        let (root, rel) = match self {
            Place::Anywhere(path) => {
                return match path.parent() {
                    Some(dir) => std::fs::create_dir_all(dir).map_err(|e| {
                        ToolError::failed(format!("cannot create {}: {e}", dir.display()))
                    }),
                    None => Ok(()),
                };
            }
            Place::Beneath { root, rel } => (root, rel),
        };
        let Some(parent) = rel.parent() else {
            return Ok(());
        };
        let dir = open_root(root)?;
        let mut done = PathBuf::new();
        for part in parent.components() {
            let above = done.clone();
            done.push(part);
            let directory = OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
            match beneath(&dir, &done, directory) {
                Ok(_) => continue,
                Err(Errno::ENOENT) => {}
                Err(e) => return Err(refusal_of(e, given, root, &root.join(&done))),
            }
            let parent_fd = if above.as_os_str().is_empty() {
                dir.try_clone().map_err(|e| {
                    ToolError::failed(format!("cannot reopen the workspace: {}", chain(&e)))
                })?
            } else {
                beneath(&dir, &above, directory)
                    .map_err(|e| refusal_of(e, given, root, &root.join(&above)))?
            };
            match nix::sys::stat::mkdirat(
                &parent_fd,
                part.as_os_str(),
                Mode::from_bits_truncate(0o777),
            ) {
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(e) => return Err(refusal_of(e, given, root, &root.join(&done))),
            }
        }
        Ok(())
    }
}

/// Why an open did not give a file.
enum Opened {
    /// Nothing there.
    Missing,
    /// Refused (outside, unreadable, …).
    Refused(ToolError),
}

fn refusal(e: Errno, given: &str, root: &Path, shown: &Path) -> Opened {
    match e {
        Errno::ENOENT => Opened::Missing,
        e => Opened::Refused(refusal_of(e, given, root, shown)),
    }
}

fn refusal_of(e: Errno, given: &str, root: &Path, shown: &Path) -> ToolError {
    match e {
        Errno::EXDEV | Errno::ELOOP => outside(given, root),
        e => ToolError::failed(format!("cannot open {}: {}", shown.display(), e.desc())),
    }
}

fn outside(given: &str, root: &Path) -> ToolError {
    ToolError::new(
        "OUTSIDE_WORKSPACE",
        format!(
            "{given} resolves outside the workspace {} (through `..`, an absolute path or a symlink; absolute symlinks are not followed). {ESCALATE}",
            root.display()
        ),
    )
}

fn open_root(root: &Path) -> Result<OwnedFd, ToolError> {
    File::open(root).map(OwnedFd::from).map_err(|e| {
        ToolError::failed(format!(
            "the workspace {} is not accessible: {e}",
            root.display()
        ))
    })
}

/// Opens `rel` beneath `dir`; the kernel refuses any escape (`EXDEV`).
fn beneath(dir: &OwnedFd, rel: &Path, flags: OFlag) -> Result<OwnedFd, Errno> {
    let rel: &Path = if rel.as_os_str().is_empty() {
        Path::new(".")
    } else {
        rel
    };
    let mut how = OpenHow::new()
        .flags(flags)
        .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    // openat2 refuses a mode without O_CREAT.
    if flags.contains(OFlag::O_CREAT) {
        how = how.mode(Mode::from_bits_truncate(0o666));
    }
    loop {
        match openat2(dir, rel, how) {
            Err(Errno::EINTR) | Err(Errno::EAGAIN) => continue,
            other => return other,
        }
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ToolError> + Send + 'static,
) -> Result<T, ToolError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        ToolError::failed(format!("the file operation did not finish: {}", chain(&e)))
    })?
}

fn canonical_root(cwd: &Path) -> Result<PathBuf, ToolError> {
    cwd.canonicalize().map_err(|e| {
        ToolError::failed(format!(
            "the workspace {} is not accessible: {e}",
            cwd.display()
        ))
    })
}

/// `path` with `.` dropped and `..` applied to what precedes it.
fn lexical(path: &Path) -> PathBuf {
    let mut normal = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                normal.pop();
            }
            Component::CurDir => {}
            other => normal.push(other),
        }
    }
    normal
}

/// Resolves `given` against the workspace `root` and refuses anything that
/// ends up outside it: `..`, absolute paths elsewhere, and symlinks —
/// existing or dangling — whose targets lead out. Components are resolved
/// one at a time without following links blindly; what does not exist is
/// taken as named.
pub fn confine(root: &Path, given: &str) -> Result<PathBuf, ToolError> {
    if given.is_empty() {
        return Err(ToolError::new("INVALID_ARGS", "the path is empty"));
    }
    let root = canonical_root(root)?;
    let start = root.join(given);
    let resolved = resolve(&start).map_err(|why| match why {
        Resolve::Loop => outside(given, &root),
        Resolve::Io(e) => ToolError::failed(format!("cannot resolve {given}: {}", chain(&e))),
    })?;
    if !resolved.starts_with(&root) {
        return Err(outside(given, &root));
    }
    Ok(resolved)
}

enum Resolve {
    Loop,
    Io(std::io::Error),
}

/// `path` (absolute) with every symlink replaced by its target, judged by
/// `symlink_metadata` (a dangling link still counts as a link).
fn resolve(path: &Path) -> Result<PathBuf, Resolve> {
    let mut pending: Vec<OsString> = parts(path);
    pending.reverse();
    let mut done = PathBuf::from("/");
    let mut links = 0;
    while let Some(part) = pending.pop() {
        match part.to_str() {
            Some(".") => continue,
            Some("..") => {
                done.pop();
                continue;
            }
            _ => {}
        }
        let next = done.join(&part);
        match std::fs::symlink_metadata(&next) {
            Ok(m) if m.file_type().is_symlink() => {
                links += 1;
                if links > MAX_LINKS {
                    return Err(Resolve::Loop);
                }
                let target = std::fs::read_link(&next).map_err(Resolve::Io)?;
                if target.is_absolute() {
                    done = PathBuf::from("/");
                }
                let mut more = parts(&target);
                more.reverse();
                pending.extend(more);
            }
            Ok(_) => done = next,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => done = next,
            Err(e) if e.kind() == std::io::ErrorKind::NotADirectory => done = next,
            Err(e) => return Err(Resolve::Io(e)),
        }
    }
    Ok(done)
}

/// The names in `path`, `.` and `..` kept as such, the root dropped.
fn parts(path: &Path) -> Vec<OsString> {
    path.components()
        .filter_map(|c| match c {
            Component::Normal(n) => Some(n.to_os_string()),
            Component::ParentDir => Some("..".into()),
            Component::CurDir => Some(".".into()),
            Component::RootDir | Component::Prefix(_) => None,
        })
        .collect()
}
