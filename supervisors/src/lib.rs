//! # dsh-supervisors — the kernel
//!
//! Cordis plugin semantics on supervised `ractor` actors, with ordered teardown.
//!
//! ## Code map
//! - [`runtime`]: [`Runtime`] — one root fiber, the tree, the event bus and the
//!   service store of a process; [`Runtime::shutdown`] drains it all in order.
//! - [`context`]: [`Context`] — the registration handle (effects, services,
//!   listeners, plugins, scopes, workers); [`Fiber`], [`Scope`], [`Disposer`],
//!   [`WorkerSpec`]/[`WorkerRef`].
//! - [`fiber`]: the fiber actor — lifecycle states, effects, children in start
//!   order, ordered teardown, restart policies, strategies and intensity.
//! - [`events`]: typed events in the five Cordis modes and scope-filtered dispatch.
//! - [`services`]: capabilities by name, resolved through scope layers.
//! - [`scope`]: scope keys, their parent chain, scoped registry layers.
//! - [`tree`]: the registry of every supervised node and its change feed.
//! - [`plugin`]: the [`Plugin`] trait and the compiled-in [`Catalogue`].
//! - [`config`]: `cordis.yml` — parsing with line numbers, `${ENV}`
//!   interpolation, patch layers, validation against plugin schemas.
//! - [`scratch`]: fresh, never-used temporary directories.
//! - [`loader`]: boots a validated plan into fibers; reloads changed entries
//!   with rollback; watches the files.
//!
//! ## Invariants
//! - Only `fiber` calls ractor's stop/kill/drain on supervised actors.
//! - Whatever a context creates is a child of that context's fiber; nothing
//!   owned lives outside the tree.
//! - A fiber tears down children in reverse start order, each awaited up to
//!   its shutdown budget and then killed, and only then its own effects, in
//!   reverse registration order; each disposer runs at most once.
//! - User code (apply, disposers, listeners, worker handlers) runs behind a
//!   panic boundary; a panic becomes a supervision event, never a crash.

pub mod config;
pub mod error;
pub mod events;
pub mod loader;
pub mod policy;
pub mod registry;
pub mod runtime;
pub mod scope;
pub mod scratch;
pub mod services;
pub mod tree;

pub use config::{ConfigError, Plan, Problem, Source};
pub use error::{BoxError, Error, Result};
pub use events::{Bail, Emit, Event, ListenOptions, Next, Parallel, Serial, Target, Waterfall};
pub use loader::{BootError, Loader, ReloadReport};
pub use policy::{ChildPolicy, Restart, Shutdown, Strategy, SupervisorSpec};
pub use runtime::context::{
    Context, Disposer, Fiber, PluginOptions, Scope, SendError, WorkerRef, WorkerSpec,
};
pub use runtime::plugin::{Catalogue, Group, Plugin, plugin_fn};
pub use runtime::{Runtime, RuntimeSettings};
pub use scope::ScopeKey;
pub use services::{ServiceChange, ServiceChanged};
pub use tree::{NodeSnapshot, Status, Tree, TreeChange};
