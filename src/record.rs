//! A run's own record: the nodes of its tree, live and stopped, each with
//! its kind, name, node, status, start, time and tokens, bounded ("N more"
//! beyond the bound), and its rendering as an indented tree — what `--tree`
//! prints when the run ends.

use std::collections::{BTreeMap, HashMap, HashSet};

use dsh_supervisors::Runtime;
use dsh_supervisors::tree::{NodeSnapshot, now_ms};

use crate::lines::{self, inert_line};

/// How many nodes a record keeps; the rest are counted.
pub const BOUND: usize = 200;

/// One node of the record.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Entry {
    /// Kernel id.
    pub id: u64,
    /// Its parent's id, when the record holds the parent.
    pub parent: Option<u64>,
    /// `agent`, `session`, `workflow`, `scope`, ….
    pub kind: String,
    /// Its name (`driver/3e17803d`), made inert.
    pub name: String,
    /// The cluster node it runs on, when another.
    pub node: Option<String>,
    /// `active`, `stopped`, `failed`, ….
    pub status: String,
    /// Why it stopped, when it did.
    pub reason: Option<String>,
    /// Start, ms since epoch.
    pub started_ms: u64,
    /// From its start to its stop (or to now, while it runs).
    pub ms: u64,
    /// Tokens it spent, when its summary says.
    pub tokens: Option<u64>,
    /// What people call it (a child's label), made inert.
    pub label: Option<String>,
    /// The named agent definition it was made from.
    pub definition: Option<String>,
}

/// The record of a runtime's tree: every live node and every stopped one
/// the tree still remembers, parents before children, at most `bound`
/// (and how many more there were).
pub fn of(rt: &Runtime, bound: usize) -> (Vec<Entry>, usize) {
    let tree = rt.tree();
    let mut nodes: BTreeMap<u64, NodeSnapshot> = BTreeMap::new();
    for n in tree.stopped_nodes().into_iter().chain(tree.snapshot()) {
        nodes.insert(n.id, n);
    }
    let now = now_ms();
    let total = nodes.len();
    let entries = nodes
        .into_values()
        .take(bound)
        .map(|n| Entry {
            id: n.id,
            parent: n.parent,
            kind: inert_line(&n.kind),
            name: inert_line(&n.name),
            node: n.node.as_deref().map(inert_line),
            status: n.status.as_str().to_owned(),
            reason: n.stop_reason.as_deref().map(inert_line),
            started_ms: n.started_ms,
            ms: n.stopped_ms.unwrap_or(now).saturating_sub(n.started_ms),
            tokens: n.summary["tokens"].as_u64().filter(|t| *t > 0),
            label: n.summary["label"].as_str().map(inert_line),
            definition: n.summary["definition"].as_str().map(inert_line),
        })
        .collect();
    (entries, total.saturating_sub(bound))
}

/// The record as an indented tree, one node per line:
/// `driver/3e17803d [agent] stopped 4.2 s · 1.2k tokens (disposed)`.
pub fn render(entries: &[Entry], more: usize) -> String {
    let ids: HashSet<u64> = entries.iter().map(|e| e.id).collect();
    let mut children: HashMap<Option<u64>, Vec<&Entry>> = HashMap::new();
    for e in entries {
        children
            .entry(e.parent.filter(|p| ids.contains(p)))
            .or_default()
            .push(e);
    }
    let mut out = String::new();
    let mut stack: Vec<(&Entry, usize)> = children
        .get(&None)
        .map(|roots| roots.iter().rev().map(|e| (*e, 0)).collect())
        .unwrap_or_default();
    while let Some((e, depth)) = stack.pop() {
        out.push_str(&"  ".repeat(depth));
        out.push_str(&format!("{} [{}]", e.name, e.kind));
        if let Some(label) = &e.label {
            out.push_str(&format!(" «{label}»"));
        }
        if let Some(definition) = &e.definition {
            out.push_str(&format!(" as {definition}"));
        }
        out.push_str(&lines::place(e.node.as_deref()));
        out.push_str(&format!(
            " {} {}",
            e.status,
            lines::duration(std::time::Duration::from_millis(e.ms))
        ));
        if let Some(t) = e.tokens {
            out.push_str(&format!(" · {} tokens", lines::tokens(t)));
        }
        if let Some(why) = &e.reason {
            out.push_str(&format!(" ({why})"));
        }
        out.push('\n');
        if let Some(kids) = children.get(&Some(e.id)) {
            stack.extend(kids.iter().rev().map(|k| (*k, depth + 1)));
        }
    }
    if more > 0 {
        out.push_str(&format!("… {more} more\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: u64, parent: Option<u64>, name: &str, status: &str, ms: u64) -> Entry {
        Entry {
            id,
            parent,
            kind: "agent".into(),
            name: name.into(),
            node: None,
            status: status.into(),
            reason: None,
            started_ms: 0,
            ms,
            tokens: None,
            label: None,
            definition: None,
        }
    }

    #[test]
    fn the_record_renders_each_node_under_its_parent_with_status_and_time() {
        let mut child = entry(3, Some(2), "driver/b", "stopped", 4_200);
        child.tokens = Some(1_200);
        child.reason = Some("disposed".into());
        child.node = Some("b".into());
        let entries = [
            entry(1, None, "root", "active", 9_000),
            entry(2, Some(1), "scope/run", "stopped", 5_000),
            child,
            entry(4, Some(1), "driver/a", "failed", 850),
            // Its parent is not in the record: shown at the top.
            entry(9, Some(7), "orphan", "stopped", 10),
        ];
        assert_eq!(
            render(&entries, 3),
            "root [agent] active 9.0 s\n  scope/run [agent] stopped 5.0 s\n    driver/b [agent] on b stopped 4.2 s · 1.2k tokens (disposed)\n  driver/a [agent] failed 850 ms\norphan [agent] stopped 10 ms\n… 3 more\n"
        );
    }
}
