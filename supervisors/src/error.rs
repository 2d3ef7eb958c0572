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
