//! Services: capabilities provided by name, resolved through scope layers.
//!
//! A consumer names the capability (`"llm"`), never the provider. A provider
//! is visible only while its fiber is `active`; the nearest scope layer that
//! has the name wins over its ancestors and over the global layer.

use std::any::Any;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use crate::error::{Error, Result};
use crate::events::{Emit, Event};
use crate::scope::{NamedEntries, ScopeKey, ScopedLayers};
use crate::tree::{Node, Status};

pub(crate) struct Provider {
    /// Identity of the registration (stable; used to remove it).
    pub id: u64,
    /// Changes each time the value is replaced (what dependents compare).
    pub version: u64,
    /// The providing fiber's tree node (its status says whether it is active).
    pub fiber: Weak<Node>,
    pub fiber_id: u64,
    pub fiber_name: Arc<str>,
    pub value: Arc<dyn Any + Send + Sync>,
}

impl Provider {
    fn active(&self) -> bool {
        self.fiber
            .upgrade()
            .is_some_and(|node| node.stats.status() == Status::Active)
    }
}

/// How a service changed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServiceChange {
    /// A provider appeared (or its fiber became active).
    Provided,
    /// The provider's value was replaced in place.
    Replaced,
    /// The provider went away (or its fiber stopped being active).
    Removed,
}

/// Emitted on every service change (mode: `emit`).
#[derive(Clone, Debug)]
pub struct ServiceChanged {
    /// The capability name.
    pub name: String,
    /// The scope layer it changed in (`None` = global).
    pub scope: Option<ScopeKey>,
    /// What happened.
    pub change: ServiceChange,
}

impl Event for ServiceChanged {
    const NAME: &'static str = "internal/service";
}
impl Emit for ServiceChanged {}

/// The service store of one runtime.
#[derive(Default)]
pub(crate) struct Services {
    layers: RwLock<ScopedLayers<NamedEntries<Provider>>>,
    next: AtomicU64,
}

impl Services {
    pub fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub fn provide(&self, scope: Option<&ScopeKey>, name: &str, provider: Provider) -> Result<()> {
        let mut layers = self.layers.write().map_err(|_| Error::ShuttingDown)?;
        layers.layer_mut(scope).insert(name, provider).map_err(|_| {
            let owner = layers
                .peek(scope)
                .and_then(|l| l.get(name))
                .map(|p| format!("{}#{}", p.fiber_name, p.fiber_id))
                .unwrap_or_default();
            Error::ServiceTaken {
                name: name.to_owned(),
                owner,
            }
        })
    }

    /// Removes the provider `id` under `name`; false when it was already gone.
    pub fn remove(&self, scope: Option<&ScopeKey>, name: &str, id: u64) -> bool {
        let Ok(mut layers) = self.layers.write() else {
            return false;
        };
        let layer = layers.layer_mut(scope);
        if layer.get(name).is_some_and(|p| p.id == id) {
            layer.remove(name);
            if let Some(k) = scope {
                layers.reclaim(k);
            }
            return true;
        }
        false
    }

    /// Replaces the value of the provider owned by `fiber_id`; returns its new id.
    pub fn replace(
        &self,
        scope: Option<&ScopeKey>,
        name: &str,
        fiber_id: u64,
        value: Arc<dyn Any + Send + Sync>,
    ) -> Result<u64> {
        let new_id = self.next_id();
        let mut layers = self.layers.write().map_err(|_| Error::ShuttingDown)?;
        match layers.layer_mut(scope).get_mut(name) {
            Some(p) if p.fiber_id == fiber_id => {
                p.value = value;
                p.version = new_id;
                Ok(new_id)
            }
            _ => Err(Error::NotServiceOwner(name.to_owned())),
        }
    }

    /// The provider visible from `scope` (nearest layer first), active only:
    /// its version and value.
    pub fn resolve(
        &self,
        scope: Option<&ScopeKey>,
        name: &str,
    ) -> Option<(u64, Arc<dyn Any + Send + Sync>)> {
        let layers = self.layers.read().ok()?;
        layers
            .visible(scope)
            .into_iter()
            .filter_map(|l| l.get(name))
            .find(|p| p.active())
            .map(|p| (p.version, p.value.clone()))
    }
}
