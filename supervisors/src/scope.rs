//! Scope keys, their parent relation, and scoped registry layers.
//!
//! A [`ScopeKey`] is an opaque identity: two keys are equal only when they
//! are the same key (clones compare equal). Keys form an optional parent
//! chain. Registration views inherit *down* the chain (a scope sees its
//! ancestors' layers, the nearest shadowing the farthest) and event admission
//! extends *up* it (a listener tagged with an ancestor hears a descendant's
//! events, never the reverse).

use std::collections::HashMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use arc_swap::ArcSwapOption;

use crate::error::{Error, Result};

static NEXT_SCOPE: AtomicU64 = AtomicU64::new(1);

/// Deepest parent chain the kernel walks; a longer chain is a bug upstream.
const MAX_CHAIN: usize = 1024;

/// An opaque, identity-compared scope key.
#[derive(Clone)]
pub struct ScopeKey(Arc<KeyInner>);

struct KeyInner {
    id: u64,
    label: Arc<str>,
    parent: ArcSwapOption<KeyInner>,
}

impl ScopeKey {
    /// Mints a fresh key. `label` is only for people reading the tree.
    pub fn new(label: impl Into<Arc<str>>) -> Self {
        ScopeKey(Arc::new(KeyInner {
            id: NEXT_SCOPE.fetch_add(1, Ordering::Relaxed),
            label: label.into(),
            parent: ArcSwapOption::empty(),
        }))
    }

    /// The key's process-unique number (for display and maps, not identity tricks).
    pub fn id(&self) -> u64 {
        self.0.id
    }

    /// The human-readable label given at creation.
    pub fn label(&self) -> &str {
        &self.0.label
    }

    /// The bound parent, if any.
    pub fn parent(&self) -> Option<ScopeKey> {
        self.0.parent.load_full().map(ScopeKey)
    }

    /// Binds this key's parent once. A key that already has a parent is
    /// refused; only the returned binding may re-link it. A link that would
    /// close a cycle is refused.
    pub fn bind_parent(&self, parent: &ScopeKey) -> Result<ScopeParentBinding> {
        if self.0.parent.load().is_some() {
            return Err(Error::Scope(format!(
                "scope {self} already has a parent; re-link it through its binding"
            )));
        }
        self.link(parent)?;
        Ok(ScopeParentBinding { key: self.clone() })
    }

    fn link(&self, parent: &ScopeKey) -> Result<()> {
        if parent.chain().any(|k| k == *self) {
            return Err(Error::Scope(format!(
                "binding {self} under {parent} would close a cycle"
            )));
        }
        self.0.parent.store(Some(parent.0.clone()));
        Ok(())
    }

    /// `[self, parent, grandparent, …]`, nearest first.
    pub fn chain(&self) -> impl Iterator<Item = ScopeKey> + '_ {
        let mut next = Some(self.clone());
        let mut steps = 0;
        std::iter::from_fn(move || {
            let current = next.take()?;
            steps += 1;
            if steps < MAX_CHAIN {
                next = current.parent();
            }
            Some(current)
        })
    }

    /// True when `self` is `other` or one of `other`'s ancestors.
    pub fn admits(&self, other: &ScopeKey) -> bool {
        let mut cursor = Some(other.0.clone());
        let mut steps = 0;
        while let Some(k) = cursor {
            if Arc::ptr_eq(&k, &self.0) {
                return true;
            }
            steps += 1;
            if steps >= MAX_CHAIN {
                return false;
            }
            cursor = k.parent.load_full();
        }
        false
    }
}

impl PartialEq for ScopeKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for ScopeKey {}
impl Hash for ScopeKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.id.hash(state);
    }
}
impl fmt::Display for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{}", self.0.label, self.0.id)
    }
}
impl fmt::Debug for ScopeKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ScopeKey({self})")
    }
}

/// The one handle allowed to re-link a key whose parent was bound.
#[derive(Debug)]
pub struct ScopeParentBinding {
    key: ScopeKey,
}

impl ScopeParentBinding {
    /// Re-links the key under a new parent; a link closing a cycle is refused
    /// and leaves the old parent in place.
    pub fn rebind(&self, parent: &ScopeKey) -> Result<()> {
        self.key.link(parent)
    }
}

/// One registry's whole contribution at the global level or for one scope.
pub trait ScopeLayer: Default {
    /// Whether the layer holds nothing (an empty scoped layer is reclaimed).
    fn is_empty(&self) -> bool;
}

/// A global layer plus lazily created per-scope layers.
#[derive(Default)]
pub struct ScopedLayers<L> {
    global: L,
    scoped: HashMap<ScopeKey, L>,
}

impl<L: ScopeLayer> ScopedLayers<L> {
    /// The layer registered exactly at `key` (`None` = global). Never creates
    /// a layer and never looks at ancestors.
    pub fn peek(&self, key: Option<&ScopeKey>) -> Option<&L> {
        match key {
            None => Some(&self.global),
            Some(k) => self.scoped.get(k),
        }
    }

    /// The layer at exactly `key`, created on first use.
    pub fn layer_mut(&mut self, key: Option<&ScopeKey>) -> &mut L {
        match key {
            None => &mut self.global,
            Some(k) => self.scoped.entry(k.clone()).or_default(),
        }
    }

    /// Layers visible from `key`, nearest first: the key's own, then each
    /// ancestor's that exists, then the global layer last.
    pub fn visible(&self, key: Option<&ScopeKey>) -> Vec<&L> {
        let mut out = Vec::new();
        if let Some(k) = key {
            for k in k.chain() {
                if let Some(layer) = self.scoped.get(&k) {
                    out.push(layer);
                }
            }
        }
        out.push(&self.global);
        out
    }

    /// Drops the scoped layer at `key` if it is empty.
    pub fn reclaim(&mut self, key: &ScopeKey) {
        if self.scoped.get(key).is_some_and(L::is_empty) {
            self.scoped.remove(key);
        }
    }

    /// Number of live scoped layers (for tests and diagnostics).
    pub fn scoped_len(&self) -> usize {
        self.scoped.len()
    }
}

/// Insertion-ordered named entries with unique names.
pub struct NamedEntries<V> {
    next: u64,
    by_name: HashMap<Arc<str>, (u64, V)>,
}

impl<V> Default for NamedEntries<V> {
    fn default() -> Self {
        NamedEntries {
            next: 0,
            by_name: HashMap::new(),
        }
    }
}

impl<V> NamedEntries<V> {
    /// Inserts `value` under `name`; refuses a name already present and
    /// returns the value back with the refusal.
    pub fn insert(&mut self, name: &str, value: V) -> std::result::Result<(), V> {
        if self.by_name.contains_key(name) {
            return Err(value);
        }
        self.next += 1;
        self.by_name.insert(Arc::from(name), (self.next, value));
        Ok(())
    }

    /// The entry under `name`.
    pub fn get(&self, name: &str) -> Option<&V> {
        self.by_name.get(name).map(|(_, v)| v)
    }

    /// Mutable access to the entry under `name`.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut V> {
        self.by_name.get_mut(name).map(|(_, v)| v)
    }

    /// Removes and returns the entry under `name`.
    pub fn remove(&mut self, name: &str) -> Option<V> {
        self.by_name.remove(name).map(|(_, v)| v)
    }

    /// Entries in insertion order.
    pub fn iter(&self) -> Vec<(&str, &V)> {
        let mut all: Vec<_> = self
            .by_name
            .iter()
            .map(|(k, (seq, v))| (*seq, k.as_ref(), v))
            .collect();
        all.sort_by_key(|(seq, _, _)| *seq);
        all.into_iter().map(|(_, k, v)| (k, v)).collect()
    }
}

impl<V> ScopeLayer for NamedEntries<V> {
    fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_by_identity() {
        let a = ScopeKey::new("a");
        let b = ScopeKey::new("a");
        assert_eq!(a, a.clone());
        assert_ne!(a, b);
    }

    #[test]
    fn parent_binding_is_once_and_rejects_cycles() {
        let root = ScopeKey::new("root");
        let mid = ScopeKey::new("mid");
        let leaf = ScopeKey::new("leaf");
        mid.bind_parent(&root).unwrap();
        let leaf_binding = leaf.bind_parent(&mid).unwrap();
        assert!(
            leaf.bind_parent(&root).is_err(),
            "second bind must go through rebind"
        );
        let err = root.bind_parent(&leaf).unwrap_err().to_string();
        assert!(err.contains("cycle"), "{err}");
        assert!(root.parent().is_none());
        let self_loop = ScopeKey::new("self");
        assert!(self_loop.bind_parent(&self_loop).is_err());
        leaf_binding.rebind(&root).unwrap();
        assert_eq!(leaf.parent(), Some(root.clone()));
        let chain: Vec<_> = leaf.chain().map(|k| k.label().to_owned()).collect();
        assert_eq!(chain, ["leaf", "root"]);
        assert!(root.admits(&leaf));
        assert!(!leaf.admits(&root));
    }

    #[test]
    fn nearest_layer_shadows() {
        let parent = ScopeKey::new("p");
        let child = ScopeKey::new("c");
        child.bind_parent(&parent).unwrap();
        let mut layers: ScopedLayers<NamedEntries<&str>> = ScopedLayers::default();
        layers.layer_mut(None).insert("tool", "global").unwrap();
        layers
            .layer_mut(Some(&parent))
            .insert("tool", "parent")
            .unwrap();
        fn found(
            k: Option<&ScopeKey>,
            layers: &ScopedLayers<NamedEntries<&'static str>>,
        ) -> Option<&'static str> {
            layers
                .visible(k)
                .into_iter()
                .find_map(|l| l.get("tool").copied())
        }
        assert_eq!(found(Some(&child), &layers), Some("parent"));
        layers
            .layer_mut(Some(&child))
            .insert("tool", "child")
            .unwrap();
        assert_eq!(found(Some(&child), &layers), Some("child"));
        assert_eq!(found(None, &layers), Some("global"));
        assert!(layers.peek(Some(&ScopeKey::new("x"))).is_none());
        layers.layer_mut(Some(&child)).remove("tool");
        layers.reclaim(&child);
        assert_eq!(layers.scoped_len(), 1);
    }
}
