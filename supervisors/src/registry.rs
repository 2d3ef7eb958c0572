//! Scoped registries: tables (tools, prompt sections, model routes) whose
//! entries are registered through a context, visible from its scope, and
//! removed when its fiber unloads or the returned disposer is called.

use std::sync::{Arc, RwLock};

use crate::error::Error;
use crate::runtime::context::{Context, Disposer};
use crate::scope::{ScopeLayer, ScopedLayers};

/// Scoped layers shared by a registry and the effects that undo its entries.
pub type SharedLayers<L> = Arc<RwLock<ScopedLayers<L>>>;

/// Why a registration was refused. None is retryable as it is: the name, the
/// entry or the owner must change.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// The name is taken in the same scope layer (a nearer scope may shadow
    /// it; the same one may not hold it twice).
    #[error("{what} `{name}` is already registered in this scope")]
    Taken {
        /// What kind of entry (`tool`, `prompt section`, …).
        what: &'static str,
        /// Its name.
        name: String,
    },
    /// The entry itself is unusable (a schema that does not compile, a
    /// malformed name).
    #[error("{what} `{name}` is invalid: {reason}")]
    Invalid {
        /// What kind of entry.
        what: &'static str,
        /// Its name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The owning fiber takes no more registrations (it is unloading).
    #[error(transparent)]
    Kernel(#[from] Error),
}

/// Registers into the layer of `ctx`'s scope: `add` runs now (its error
/// refuses the registration); `remove` runs once when `ctx`'s fiber unloads
/// or the returned disposer is called, after which an emptied scoped layer
/// is reclaimed. Visibility and ownership come from the same context. When
/// the owner refuses the registration, what `add` did is undone at once.
pub fn register_scoped<L, T>(
    layers: &SharedLayers<L>,
    ctx: &Context,
    label: &str,
    add: impl FnOnce(&mut L) -> Result<T, RegisterError>,
    remove: impl FnOnce(&mut L) + Send + 'static,
) -> Result<(T, Disposer), RegisterError>
where
    L: ScopeLayer + Send + Sync + 'static,
{
    let scope = ctx.scope_key().cloned();
    let added = {
        let mut guard = layers.write().unwrap_or_else(|p| p.into_inner());
        add(guard.layer_mut(scope.as_ref()))?
    };
    let shared = layers.clone();
    let undo = move || {
        let mut guard = shared.write().unwrap_or_else(|p| p.into_inner());
        remove(guard.layer_mut(scope.as_ref()));
        if let Some(k) = &scope {
            guard.reclaim(k);
        }
    };
    let disposer = ctx.effect_or_undo(label, undo)?;
    Ok((added, disposer))
}
