//! The difference between two plans, entry by entry (what a reload applies).

use std::collections::{BTreeMap, HashSet};

use super::Plan;

/// Entries that differ between two plans, by id.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Diff {
    /// Ids present only in the new plan.
    pub added: Vec<String>,
    /// Ids present only in the old plan.
    pub removed: Vec<String>,
    /// Ids whose own settings changed.
    pub changed: Vec<String>,
}

/// Compares two plans entry by entry.
pub fn diff(old: &Plan, new: &Plan) -> Diff {
    let index = |p: &Plan| -> BTreeMap<String, (String, Option<String>)> {
        p.flatten()
            .into_iter()
            .map(|(e, parent)| (e.id.clone(), (e.fingerprint(), parent.map(str::to_owned))))
            .collect()
    };
    let (a, b) = (index(old), index(new));
    let mut d = Diff::default();
    let old_ids: HashSet<&String> = a.keys().collect();
    for (id, fp) in &b {
        match a.get(id) {
            None => d.added.push(id.clone()),
            Some(old_fp) if old_fp != fp => d.changed.push(id.clone()),
            Some(_) => {}
        }
    }
    for id in old_ids {
        if !b.contains_key(id) {
            d.removed.push(id.clone());
        }
    }
    d.removed.sort();
    d
}
