//! One writer per session: an exclusive `flock` on
//! `<store>/locks/<session id>.lock`, held while the session's writer lives.
//!
//! `flock` locks belong to the open file description, so the lock is held
//! exactly as long as the [`WriterLock`] (its file) is, and a crashed
//! process's locks go with it. `fcntl`/`lockf` locks are never used: they
//! belong to the process and vanish when any descriptor on the file closes.
//! Lock files are never deleted: unlinking a locked file would let a third
//! process lock a new file at the same path while a second one waits on the
//! old one.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, Write};
use std::path::{Path, PathBuf};

use super::StoreError;

/// The exclusive right to write one session; released when dropped.
#[derive(Debug)]
pub struct WriterLock {
    _file: File,
    path: PathBuf,
}

impl WriterLock {
    /// Takes the lock at `path` for session `id` without waiting: another
    /// holder gives [`StoreError::Busy`] with its pid. The file then holds
    /// this process's pid.
    pub fn take(path: PathBuf, id: &str) -> Result<WriterLock, StoreError> {
        let io = |error: std::io::Error| StoreError::Io {
            path: path.display().to_string(),
            error,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                return Err(StoreError::Busy {
                    id: id.to_owned(),
                    pid: holder.trim().parse().ok(),
                    path: path.display().to_string(),
                });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        Ok(WriterLock { _file: file, path })
    }

    /// Where the lock lives.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `dir/<id>.lock`, the id made a file name the way the store makes it a
/// directory name.
pub(super) fn lock_path(dir: &Path, id: &str) -> Result<PathBuf, StoreError> {
    Ok(dir.join(format!("{}.lock", super::encode(id)?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_writer_is_refused_with_the_holders_pid_until_the_first_lets_go() {
        let dir = dsh_supervisors::scratch::fresh_dir("dsh-lock").unwrap();
        let path = lock_path(&dir, "s/1").unwrap();
        assert!(path.ends_with("s%2F1.lock"), "{path:?}");
        let first = WriterLock::take(path.clone(), "s/1").unwrap();
        match WriterLock::take(path.clone(), "s/1") {
            Err(StoreError::Busy { id, pid, .. }) => {
                assert_eq!(id, "s/1");
                assert_eq!(pid, Some(std::process::id()));
            }
            other => panic!("a second writer got {other:?}"),
        }
        drop(first);
        let again = WriterLock::take(path.clone(), "s/1").unwrap();
        assert_eq!(again.path(), path);
        assert!(lock_path(&dir, "..").is_err());
    }
}
