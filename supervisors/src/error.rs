//! The kernel's error type.

use std::time::Duration;

/// A boxed error from user code (plugin `apply`, effect bodies).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything the kernel can refuse or report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A registration was attempted on a fiber that is unloading, disposed or
    /// failed. Fatal for the caller: the owner is going away.
    #[error("cannot register on inactive fiber {fiber} ({state})")]
    InactiveFiber {
        /// Readable name of the fiber.
        fiber: String,
        /// The state it was in.
        state: &'static str,
    },
    /// A service name is already provided in the same scope layer. Fatal.
    #[error("service `{name}` is already provided in this scope (by fiber {owner})")]
    ServiceTaken {
        /// The capability name.
        name: String,
        /// Fiber that holds it.
        owner: String,
    },
    /// `set` was called on a service the caller does not own. Fatal.
    #[error("service `{0}` is not provided by this fiber")]
    NotServiceOwner(String),
    /// A service was found but holds a different type than asked for. Fatal.
    #[error("service `{name}` holds a different type than `{expected}`")]
    ServiceType {
        /// The capability name.
        name: String,
        /// The type the caller asked for.
        expected: &'static str,
    },
    /// A scope operation was refused (double bind, cycle). Fatal.
    #[error("scope: {0}")]
    Scope(String),
    /// A plugin's `apply` failed or panicked; the fiber is `failed`. Fatal
    /// for that fiber; a restart policy may start a fresh one.
    #[error("plugin `{plugin}` (fiber {fiber}) failed: {reason}")]
    PluginFailed {
        /// Plugin name.
        plugin: String,
        /// Fiber id.
        fiber: u64,
        /// Error or panic text.
        reason: String,
    },
    /// ractor refused to spawn an actor. Retryable only if the cause was
    /// transient (it rarely is).
    #[error("spawn failed: {0}")]
    Spawn(String),
    /// An event listener panicked inside a waterfall; the chain's result is lost.
    #[error("listener of `{event}` registered by fiber {fiber} panicked: {message}")]
    ListenerPanicked {
        /// Event name.
        event: &'static str,
        /// Registering fiber.
        fiber: u64,
        /// Panic text.
        message: String,
    },
    /// A wait ran out of time. Retryable.
    #[error("{what} did not finish within {after:?}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The budget.
        after: Duration,
    },
    /// The runtime is shutting down. Fatal.
    #[error("the runtime is shutting down")]
    ShuttingDown,
}

/// Kernel result.
pub type Result<T> = std::result::Result<T, Error>;

/// An error and every cause under it, on one line: `outer: cause: root`.
///
/// Errors here say their own part only and hand their cause to
/// [`std::error::Error::source`]; whoever shows an error to a person (an
/// exit message, an API answer, a tool result, a log line) renders it with
/// [`chain`], so each cause appears once. A part that already ends with
/// its cause's text (a foreign error that prints its source) is not
/// repeated.
#[derive(Clone, Copy)]
pub struct Chain<'a>(&'a (dyn std::error::Error + 'a));

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut shown = self.0.to_string();
        f.write_str(&shown)?;
        let mut next = self.0.source();
        while let Some(cause) = next {
            let text = cause.to_string();
            if !text.is_empty() && !shown.ends_with(&text) {
                write!(f, ": {text}")?;
            }
            shown = text;
            next = cause.source();
        }
        Ok(())
    }
}

impl std::fmt::Debug for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// `error` and its causes, for display: see [`Chain`].
pub fn chain<'a>(error: &'a (dyn std::error::Error + 'a)) -> Chain<'a> {
    Chain(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("cannot load {path}")]
    struct Load {
        path: &'static str,
        #[source]
        cause: std::io::Error,
    }

    #[derive(Debug, thiserror::Error)]
    #[error("agent a1 could not start")]
    struct Start(#[from] Load);

    #[test]
    fn a_chain_shows_every_cause_once_outermost_first() {
        let e = Start(Load {
            path: "/s/session.jsonl",
            cause: std::io::Error::other("disk full"),
        });
        assert_eq!(
            chain(&e).to_string(),
            "agent a1 could not start: cannot load /s/session.jsonl: disk full"
        );
        // A part that already printed its cause does not print it again.
        #[derive(Debug, thiserror::Error)]
        #[error("wrapped: {0}")]
        struct Loud(#[source] std::io::Error);
        let loud = Loud(std::io::Error::other("gone"));
        assert_eq!(chain(&loud).to_string(), "wrapped: gone");
    }
}
