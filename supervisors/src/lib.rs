//! # dsh-supervisors — the kernel
//!
//! Cordis plugin semantics on supervised `ractor` actors, with ordered teardown.
//!
//! ## Code map
//! Modules in layers: each imports only modules above it in this list
//! (`runtime` is the core whose parts refer to each other).
//! - [`error`]: the kernel's [`Error`] (each variant says whether a retry
//!   can help).
//! - [`tree`]: the registry of every supervised node, its change feed and
//!   followers (`tree/feed`, `tree/follow`).
//! - [`scratch`]: fresh, never-used temporary directories.
//! - [`policy`]: restart policies, shutdown budgets, strategies, intensity.
//! - [`scope`]: scope keys, their parent chain, scoped layers.
//! - [`events`]: typed events in the five Cordis modes and scope-filtered dispatch.
//! - [`services`]: capabilities by name, resolved through scope layers.
//! - [`runtime`]: [`Runtime`] (root fiber, tree, bus, services; ordered
//!   shutdown) and the core it holds: `runtime::context` ([`Context`], the
//!   registration handle, and [`Fiber`], [`Scope`], [`Disposer`],
//!   [`WorkerSpec`]/[`WorkerRef`], [`TaskSpec`]), `runtime::plugin`
//!   ([`Plugin`], [`Catalogue`]), `runtime::fiber` (the fiber actor: load,
//!   teardown, supervision; task children, [`TaskRef`]).
//! - [`registry`]: scoped registrations (tools, prompt sections, routes)
//!   removed with their owner; [`registry::RegisterError`].
//! - [`config`]: `cordis.yml` — the YAML layer with line numbers, `${ENV}`
//!   interpolation, patch layers, validation against plugin schemas, diffs.
//! - [`loader`]: boots a validated plan into fibers; reloads changed entries
//!   with rollback; watches the files.
//!
//! ## Invariants
//! - Only `runtime::fiber` stops, kills or drains another actor; any other
//!   actor may only end itself.
//! - Whatever a context creates is a child of that context's fiber; nothing
//!   owned lives outside the tree.
//! - A fiber tears down children in reverse start order, each awaited up to
//!   its shutdown budget and then killed, and only then its own effects, in
//!   reverse registration order; each disposer runs at most once.
//! - A registration an unloading owner refuses leaves nothing behind.
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
    Context, Disposer, Fiber, NoMessages, PluginOptions, Scope, SendError, TaskSpec, WorkerRef,
    WorkerSpec,
};
pub use runtime::fiber::{TaskEnd, TaskRef};
pub use runtime::plugin::{Catalogue, Group, Plugin, plugin_fn};
pub use runtime::{Runtime, RuntimeSettings};
pub use scope::ScopeKey;
pub use services::{ServiceChange, ServiceChanged};
pub use tree::{NodeSnapshot, Status, Tree, TreeChange};
