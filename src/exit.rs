//! How a command ends: an exit code and, for anything but success, a
//! message for stderr. Every command returns an [`Exit`]; library errors
//! become one here, in one place, so a kind of failure has the same code in
//! every command.
//!
//! | code | meaning |
//! |---:|---|
//! | [`OK`] 0 | done |
//! | [`FAILED`] 1 | the work failed (a model call, the runtime, a write); the cause is printed |
//! | [`USAGE`] 2 | bad arguments, a bad file or config, no model configured: nothing ran |
//! | [`BLOCKED`] 3 | a Ralph loop ended blocked or without progress (the worker's claim) |
//! | [`CHILD_FAILED`] 4 | a workflow ran to its end but some of its children failed (listed on stderr; `--allow-failures` makes it 0) |
//! | [`CANCELLED`] 130 | cancelled (Ctrl-C, SIGINT) |
//! | 143, 129 | cancelled by SIGTERM, SIGHUP (handled as Ctrl-C is: the turn ends `aborted`, children are killed, the session is written) |

use std::process::ExitCode;

use dsh_services::persistence::StoreError;
use dsh_supervisors::BootError;
use dsh_supervisors::error::chain;

/// Done.
pub const OK: u8 = 0;
/// The work failed; the cause is printed.
pub const FAILED: u8 = 1;
/// Bad arguments, file or config, or no model configured; nothing ran.
pub const USAGE: u8 = 2;
/// A Ralph loop ended blocked or without progress.
pub const BLOCKED: u8 = 3;
/// A workflow ended, but some of its children failed.
pub const CHILD_FAILED: u8 = 4;
/// Cancelled.
pub const CANCELLED: u8 = 130;

/// A signal that cancels a command the way Ctrl-C does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT (Ctrl-C).
    Interrupt,
    /// SIGTERM.
    Terminate,
    /// SIGHUP (the terminal went away).
    Hangup,
}

impl Stop {
    /// The exit code: 128 + the signal's number.
    pub fn code(self) -> u8 {
        match self {
            Stop::Interrupt => CANCELLED,
            Stop::Terminate => 143,
            Stop::Hangup => 129,
        }
    }

    /// How the signal is known.
    pub fn name(self) -> &'static str {
        match self {
            Stop::Interrupt => "SIGINT",
            Stop::Terminate => "SIGTERM",
            Stop::Hangup => "SIGHUP",
        }
    }

    /// How a command this signal cancelled ends.
    pub fn exit(self, what: &str) -> Exit {
        Exit::with(self.code(), Some(format!("{what} ({})", self.name())))
    }
}

/// The first of SIGINT, SIGTERM and SIGHUP to arrive. A signal that cannot
/// be watched is left to its default action.
pub async fn stop_signal() -> Stop {
    Signals::watch().next().await
}

/// SIGINT, SIGTERM and SIGHUP, watched from now on: each one that arrives,
/// in turn (none is missed between two waits).
pub struct Signals {
    int: Option<tokio::signal::unix::Signal>,
    term: Option<tokio::signal::unix::Signal>,
    hup: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    /// Starts watching (a signal that cannot be watched keeps its default
    /// action).
    pub fn watch() -> Signals {
        use tokio::signal::unix::{SignalKind, signal};
        let watch = |kind: SignalKind| signal(kind).ok();
        Signals {
            int: watch(SignalKind::interrupt()),
            term: watch(SignalKind::terminate()),
            hup: watch(SignalKind::hangup()),
        }
    }

    /// The next signal.
    pub async fn next(&mut self) -> Stop {
        async fn next(s: &mut Option<tokio::signal::unix::Signal>) {
            match s {
                Some(s) => {
                    s.recv().await;
                }
                None => std::future::pending().await,
            }
        }
        tokio::select! {
            () = next(&mut self.int) => Stop::Interrupt,
            () = next(&mut self.term) => Stop::Terminate,
            () = next(&mut self.hup) => Stop::Hangup,
        }
    }
}

/// How a command ended.
#[derive(Debug)]
#[must_use]
pub struct Exit {
    /// The process exit code (one of the constants above).
    pub code: u8,
    /// Printed on stderr when set.
    pub message: Option<String>,
    /// The message already says where each problem is (`file:line: …`,
    /// one per line): printed as it is, without the command's name.
    placed: bool,
}

/// A command's result: the value, or how the command ends instead.
pub type Result<T> = std::result::Result<T, Exit>;

impl Exit {
    /// Success, nothing to print.
    pub fn ok() -> Exit {
        Exit::with(OK, None::<String>)
    }

    /// Ends with `code` and `message`.
    pub fn with(code: u8, message: Option<impl Into<String>>) -> Exit {
        Exit {
            code,
            message: message.map(Into::into),
            placed: false,
        }
    }

    /// Bad arguments or input; nothing ran.
    pub fn usage(message: impl Into<String>) -> Exit {
        Exit::with(USAGE, Some(message))
    }

    /// The work failed.
    pub fn failed(message: impl Into<String>) -> Exit {
        Exit::with(FAILED, Some(message))
    }

    /// Cancelled.
    pub fn cancelled(message: impl Into<String>) -> Exit {
        Exit::with(CANCELLED, Some(message))
    }

    /// A problem list whose lines say where each problem is (a config's
    /// `file:line: …`): printed as it is.
    pub fn placed(code: u8, problems: impl Into<String>) -> Exit {
        Exit {
            placed: true,
            ..Exit::with(code, Some(problems))
        }
    }

    /// Whether the command succeeded.
    pub fn is_ok(&self) -> bool {
        self.code == OK
    }

    /// The same exit with `context: ` in front of its message.
    pub fn context(mut self, context: &str) -> Exit {
        if let Some(m) = &self.message {
            self.message = Some(format!("{context}: {m}"));
        }
        self
    }

    /// Prints the message (`dsh <command>: …`) and gives the exit code.
    pub fn report(self, command: &str) -> ExitCode {
        match &self.message {
            Some(m) if self.placed => crate::errln!("{m}"),
            Some(m) => crate::errln!("dsh {command}: {m}"),
            None => {}
        }
        ExitCode::from(self.code)
    }
}

impl From<Result<()>> for Exit {
    fn from(result: Result<()>) -> Exit {
        result.err().unwrap_or_else(Exit::ok)
    }
}

impl From<StoreError> for Exit {
    /// A store that cannot be read or written is a failure; a missing or
    /// unreadable session, or a bad id, is bad input.
    fn from(e: StoreError) -> Exit {
        let code = match e {
            StoreError::NotFound(..)
            | StoreError::BadId(_)
            | StoreError::Exists(_)
            | StoreError::Encoding { .. }
            | StoreError::Ambiguous { .. }
            | StoreError::Load { .. } => USAGE,
            StoreError::Io { .. }
            | StoreError::Database { .. }
            | StoreError::Busy { .. }
            | StoreError::Stale { .. } => FAILED,
        };
        Exit::with(code, Some(chain(&e).to_string()))
    }
}

impl From<BootError> for Exit {
    /// An invalid config is bad input (every problem listed, each with its
    /// place); a kernel that refuses to start it is a failure.
    fn from(e: BootError) -> Exit {
        match e {
            BootError::Config(problems) => Exit::placed(USAGE, problems.to_string()),
            BootError::Kernel(e) => Exit::failed(chain(&e).to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_store_error_is_bad_input_unless_the_store_itself_failed() {
        let missing = Exit::from(StoreError::BadId("../x".into()));
        assert_eq!(missing.code, USAGE);
        let io = Exit::from(StoreError::Io {
            path: "/s".into(),
            error: std::io::Error::other("disk full"),
        });
        assert_eq!(io.code, FAILED);
        assert!(io.message.unwrap_or_default().contains("disk full"));
    }

    #[test]
    fn context_goes_in_front_and_success_has_no_message() {
        let e = Exit::failed("the call failed").context("cannot create the agent");
        assert_eq!(
            e.message.as_deref(),
            Some("cannot create the agent: the call failed")
        );
        assert!(Exit::from(Ok(())).is_ok());
        assert!(Exit::ok().message.is_none());
    }
}
