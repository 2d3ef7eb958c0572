//! Writing to stdout and stderr without panicking: `print!` panics when the
//! reader has gone (`dsh sessions show … | head -1`, `dsh check | true`).
//! Here a closed stream is noted and the rest of the output is dropped; the
//! command goes on (a running turn still ends and its session is still
//! written) and exits as it would have.

use std::fmt::Arguments;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_GONE: AtomicBool = AtomicBool::new(false);
static STDERR_GONE: AtomicBool = AtomicBool::new(false);

/// Writes `args` to stdout; false once stdout is gone.
pub fn stdout(args: Arguments<'_>, newline: bool) -> bool {
    write(&STDOUT_GONE, &mut std::io::stdout().lock(), args, newline)
}

/// Writes `args` to stderr; false once stderr is gone.
pub fn stderr(args: Arguments<'_>, newline: bool) -> bool {
    write(&STDERR_GONE, &mut std::io::stderr().lock(), args, newline)
}

/// Whether stdout's reader has gone.
pub fn stdout_gone() -> bool {
    STDOUT_GONE.load(Ordering::Relaxed)
}

/// Flushes stdout (a closed stdout is noted, not an error).
pub fn flush() {
    if !stdout_gone() && std::io::stdout().flush().is_err() {
        STDOUT_GONE.store(true, Ordering::Relaxed);
    }
}

fn write(gone: &AtomicBool, to: &mut impl Write, args: Arguments<'_>, newline: bool) -> bool {
    if gone.load(Ordering::Relaxed) {
        return false;
    }
    let written = to
        .write_fmt(args)
        .and_then(|()| if newline { to.write_all(b"\n") } else { Ok(()) });
    if written.is_err() {
        gone.store(true, Ordering::Relaxed);
        return false;
    }
    true
}

/// `print!` that never panics.
#[macro_export]
macro_rules! out {
    ($($t:tt)*) => {{ let _ = $crate::out::stdout(format_args!($($t)*), false); }};
}

/// `println!` that never panics.
#[macro_export]
macro_rules! outln {
    () => {{ let _ = $crate::out::stdout(format_args!(""), true); }};
    ($($t:tt)*) => {{ let _ = $crate::out::stdout(format_args!($($t)*), true); }};
}

/// `eprint!` that never panics.
#[macro_export]
macro_rules! err {
    ($($t:tt)*) => {{ let _ = $crate::out::stderr(format_args!($($t)*), false); }};
}

/// `eprintln!` that never panics.
#[macro_export]
macro_rules! errln {
    () => {{ let _ = $crate::out::stderr(format_args!(""), true); }};
    ($($t:tt)*) => {{ let _ = $crate::out::stderr(format_args!($($t)*), true); }};
}
