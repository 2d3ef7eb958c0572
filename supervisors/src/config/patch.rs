//! Patch layers: a patch file's entries applied to the base by `id` (fields
//! replace, `config` merges key by key, `null` deletes a key, unknown ids
//! are appended).

use super::yaml::{Node, RawEntry, Yaml};

/// Merges a patch entry into a base entry.
fn patch_entry(base: &mut RawEntry, patch: RawEntry) {
    if patch.name.is_some() {
        base.name = patch.name;
    }
    if patch.disabled.is_some() {
        base.disabled = patch.disabled;
    }
    if let Some(p) = patch.config {
        base.config = Some(match base.config.take() {
            Some(b) => merge(b, p),
            None => p,
        });
    }
    if let Some((children, origin)) = patch.group {
        let base_children = match base.group.take() {
            Some((c, _)) => c,
            None => Vec::new(),
        };
        base.group = Some((apply_patch(base_children, children), origin));
    }
}

fn merge(base: Node, patch: Node) -> Node {
    match (base.value, patch.value) {
        (Yaml::Map(mut b), Yaml::Map(p)) => {
            for (k, v) in p {
                let pos = b.iter().position(|(bk, _)| bk.name == k.name);
                match (pos, &v.value) {
                    (Some(i), Yaml::Null) => {
                        b.remove(i);
                    }
                    (Some(i), _) => {
                        let (bk, bv) = b.remove(i);
                        b.insert(i, (bk, merge(bv, v)));
                    }
                    (None, Yaml::Null) => {}
                    (None, _) => b.push((k, v)),
                }
            }
            Node {
                value: Yaml::Map(b),
                origin: base.origin,
            }
        }
        (_, value) => Node {
            value,
            origin: patch.origin,
        },
    }
}

fn find_mut<'a>(entries: &'a mut [RawEntry], id: &str) -> Option<&'a mut RawEntry> {
    for e in entries.iter_mut() {
        if e.id == id {
            return Some(e);
        }
        if let Some((children, _)) = &mut e.group
            && let Some(found) = find_mut(children, id)
        {
            return Some(found);
        }
    }
    None
}

pub(super) fn apply_patch(mut base: Vec<RawEntry>, patch: Vec<RawEntry>) -> Vec<RawEntry> {
    for p in patch {
        match find_mut(&mut base, &p.id) {
            Some(target) => patch_entry(target, p),
            None => base.push(p),
        }
    }
    base
}
