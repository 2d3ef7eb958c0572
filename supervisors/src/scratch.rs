//! Fresh scratch directories.
//!
//! A name made of the process id and a counter is not unique over time: process
//! ids come round, and a directory left by an earlier process under the same
//! name still holds its files (a fifo, a symlink) that a new run then trips
//! over. [`fresh_dir`] creates the directory itself and retries under another
//! name when it already exists, so what it returns has never been used.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

static NEXT: AtomicU64 = AtomicU64::new(0);

/// Creates a new, empty directory under the system temp directory whose name
/// starts with `prefix`.
pub fn fresh_dir(prefix: &str) -> io::Result<PathBuf> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.subsec_nanos());
    let base = std::env::temp_dir();
    for _ in 0..1024 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = base.join(format!("{prefix}-{}-{nanos:08x}-{n}", std::process::id()));
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(err) if err.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(err) => return Err(err),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        format!(
            "no free scratch directory name for {prefix:?} in {}",
            base.display()
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_directory_is_new_and_empty() {
        let a = fresh_dir("dsh-scratch-test").unwrap();
        std::fs::write(a.join("left-behind"), "x").unwrap();
        let b = fresh_dir("dsh-scratch-test").unwrap();
        assert_ne!(a, b);
        assert_eq!(std::fs::read_dir(&b).unwrap().count(), 0);
        std::fs::remove_dir_all(a).unwrap();
        std::fs::remove_dir_all(b).unwrap();
    }
}
