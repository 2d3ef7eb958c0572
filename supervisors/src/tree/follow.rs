//! Following the tree as a viewer: what changed since the last look, read
//! from the tree itself instead of from a queue of every change.
//!
//! A viewer (the dashboard) wants the tree as it is now, not each step it
//! took: an actor that started and stopped between two looks is of no use
//! to it, and a node's third summary in a row replaces the first two. A
//! [`Follower`] remembers what it has shown (status and summary count per
//! node); [`Tree::catch_up`] compares that with the live map and the log of
//! stops and gives the difference. Per change, the changing side only
//! checks a flag the follower sets at each look and wakes it on the first
//! change after (see [`super::feed`]), so a followed tree costs its actors
//! almost what an unfollowed one does, however fast they change.
//!
//! What a look gives, in this order:
//! - `stopped` for every shown node that stopped since the last look, in
//!   stop order (from a log of stops kept while anyone follows; a node never
//!   shown, because it started and stopped between two looks, is left out
//!   and counted);
//! - `status` and `summary` for shown nodes that changed;
//! - `spawned` for new nodes, parents before children (a node whose live
//!   parent was not in this look waits for the next one, which the parent's
//!   arrival brings), each with the status this look read;
//! - supervision and teardown events, each as it happened.
//!
//! When the log dropped stops the follower had not read, or its
//! events queue overflowed, the look fails with `Lagged`: the follower must
//! start over from a new snapshot.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, atomic};

use super::feed::{self, RecvError, Subscription, TryRecvError};
use super::{Node, NodeAt, NodeSnapshot, Status, StopRecord, Tree, TreeChange, snapshot_of};

/// A viewer's position in the tree: what it has been shown so far.
pub struct Follower {
    /// Events (supervision, teardown), and the wake-up at a node change.
    events: Subscription,
    /// Every shown node that has not stopped: status and summary count as
    /// last shown.
    shown: HashMap<u64, Shown, BuildHasherDefault<IdHasher>>,
    /// The number of the last stop read (shared with the tree, which frees
    /// the stops every follower has read).
    last_stop: Arc<AtomicU64>,
    /// Reused between looks: the new nodes (with the counts read), and the
    /// stops read.
    fresh: Vec<(Arc<Node>, Status, u32)>,
    stops: Vec<StopRecord>,
}

#[derive(Clone, Copy)]
struct Shown {
    status: Status,
    summary: u32,
}

/// Node ids are spread by one multiplication (they are mostly consecutive,
/// and nobody outside chooses them).
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, id: u64) {
        self.0 = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Follower {
    /// Waits until the tree may have changed since the last look (a node
    /// changed, or an event is queued). Returns `Closed` once the tree is
    /// gone. Cancel-safe.
    pub async fn changed(&mut self) -> Result<(), RecvError> {
        let queue = self.events.queue.clone();
        loop {
            if self.events.is_closed() {
                return Err(RecvError::Closed);
            }
            // Disarmed by a node change; an event or a lag shows as a
            // non-empty queue.
            if !queue.armed.load(Ordering::Acquire) || !self.events.is_empty() {
                return Ok(());
            }
            queue.ready.notified().await;
        }
    }
}

impl Tree {
    /// Starts following the tree: the snapshot to show first, and the
    /// follower to pass to [`Tree::catch_up`] for what changes after it.
    pub fn follow(&self) -> (Vec<NodeSnapshot>, Follower) {
        let events = self.feed.subscribe(feed::Reads::Events);
        let mut follower = Follower {
            events,
            shown: HashMap::default(),
            last_stop: Arc::default(),
            fresh: Vec::new(),
            stops: Vec::new(),
        };
        follower.arm();
        // Stops numbered from here on concern nodes the snapshot below may
        // hold: it reads the live map after (a node leaves the map before
        // its stop is numbered).
        {
            let mut stops = self.stops();
            follower.last_stop.store(stops.seq, Ordering::Relaxed);
            stops.cursors.push(Arc::downgrade(&follower.last_stop));
        }
        let nodes: Vec<Arc<Node>> = self.live.iter().map(|n| n.clone()).collect();
        let mut snapshot = Vec::with_capacity(nodes.len());
        for node in &nodes {
            // The counts before the node itself: a change after them shows
            // again at the next look.
            let shown = Shown {
                status: node.stats.status(),
                summary: node.stats.summary_version(),
            };
            follower.shown.insert(node.info.id, shown);
            // The status as recorded, so a later change shows as one.
            let mut node = snapshot_of(node, None, None);
            node.status = shown.status;
            snapshot.push(node);
        }
        snapshot.sort_by_key(|n| n.id);
        (snapshot, follower)
    }

    /// Appends to `out` what changed since the follower's last look (see
    /// the module docs), and returns how many nodes started and stopped in
    /// between (left out). `Lagged` means changes were lost: start over
    /// with [`Tree::follow`]. `Closed` means the tree is gone.
    pub fn catch_up(&self, f: &mut Follower, out: &mut Vec<TreeChange>) -> Result<u64, RecvError> {
        // Armed before reading: a change from here on wakes the follower
        // for the next look, and this one may already see it.
        f.arm();
        let mut events = Vec::new();
        loop {
            match f.events.try_recv() {
                Ok(event) => events.push(event),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Lagged(n)) => return Err(RecvError::Lagged(n)),
                Err(TryRecvError::Closed) if events.is_empty() => return Err(RecvError::Closed),
                Err(TryRecvError::Closed) => break,
            }
        }
        let left_out = self.read_stops(f, out)?;
        // One pass over the live map, under each shard's lock in turn: per
        // node two counters and a look-up in the follower's own map; a node
        // is cloned only when it goes out (new, or its summary changed).
        f.fresh.clear();
        for entry in self.live.iter() {
            let (id, node) = (*entry.key(), entry.value());
            // The counts before the node's summary is read (when the change
            // is serialized): a change after them shows again next look.
            let (status, summary) = (node.stats.status(), node.stats.summary_version());
            let Some(shown) = f.shown.get_mut(&id) else {
                f.fresh.push((node.clone(), status, summary));
                continue;
            };
            if shown.status != status {
                shown.status = status;
                out.push(TreeChange::Status { id, status });
            }
            if shown.summary != summary {
                shown.summary = summary;
                let node = node.clone();
                out.push(TreeChange::Summary { id, node });
            }
        }
        // Ids grow with start time and a parent starts before its child,
        // so one pass in id order shows most; more passes show what came
        // before its parent in that order.
        f.fresh.sort_by_key(|(node, ..)| node.info.id);
        loop {
            let before = f.fresh.len();
            let shown = &mut f.shown;
            f.fresh.retain(|(node, status, summary)| {
                let waits = node
                    .info
                    .parent
                    .is_some_and(|p| !shown.contains_key(&p) && self.live.contains_key(&p));
                if !waits {
                    let (status, summary) = (*status, *summary);
                    shown.insert(node.info.id, Shown { status, summary });
                    let node = NodeAt::new(node.clone(), status);
                    out.push(TreeChange::Spawned { node });
                }
                waits
            });
            if f.fresh.is_empty() || f.fresh.len() == before {
                break;
            }
        }
        // The rest have a parent that arrived after this look read the live
        // map: its arrival wakes the follower for the next look.
        f.fresh.clear();
        out.extend(events);
        Ok(left_out)
    }

    /// The stops since the follower's last look: `stopped` for the shown
    /// nodes, a count of the others.
    fn read_stops(&self, f: &mut Follower, out: &mut Vec<TreeChange>) -> Result<u64, RecvError> {
        // Copied under the lock (stopping actors wait on it), read after.
        f.stops.clear();
        {
            let mut stops = self.stops();
            let last = f.last_stop.load(Ordering::Relaxed);
            // The log is in stop order, without gaps since the follower
            // subscribed (it was counted before it read `seq`, under this
            // lock).
            let from = stops.log.partition_point(|s| s.seq <= last);
            let unread = stops.seq - last;
            let kept = (stops.log.len() - from) as u64;
            if unread > kept {
                return Err(RecvError::Lagged(unread - kept));
            }
            f.stops.extend(stops.log.range(from..).cloned());
            f.last_stop.store(stops.seq, Ordering::Relaxed);
            // What every follower has read goes.
            let mut oldest = stops.seq;
            stops.cursors.retain(|c| match c.upgrade() {
                Some(c) => {
                    oldest = oldest.min(c.load(Ordering::Relaxed));
                    true
                }
                None => false,
            });
            let read = stops.log.partition_point(|s| s.seq <= oldest);
            stops.log.drain(..read);
        }
        let mut left_out = 0;
        for stop in f.stops.drain(..) {
            if f.shown.remove(&stop.id).is_some() {
                out.push(TreeChange::Stopped {
                    id: stop.id,
                    status: stop.status,
                    reason: stop.reason,
                    stop_seq: stop.seq,
                    stopped_ms: stop.stopped_ms,
                });
            } else {
                left_out += 1;
            }
        }
        Ok(left_out)
    }
}

impl Follower {
    fn arm(&self) {
        self.events.queue.armed.store(true, Ordering::Relaxed);
        // Between arming and reading the tree (the changing side fences
        // between its change and the armed check).
        atomic::fence(Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{NodeInfo, TreeLimits};
    use super::*;

    fn info(id: u64, parent: Option<u64>) -> NodeInfo {
        NodeInfo {
            form: crate::tree::Form::Actor,
            id,
            kind: Arc::from("worker"),
            name: Arc::from(format!("n{id}")),
            parent,
            started_ms: 0,
            node: None,
        }
    }

    fn spawned(out: &[TreeChange]) -> Vec<u64> {
        out.iter()
            .filter_map(|c| match c {
                TreeChange::Spawned { node } => Some(node.info.id),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_new_node_is_shown_after_its_live_parent_in_the_same_look() {
        let tree = Tree::new(TreeLimits::default());
        let (snapshot, mut f) = tree.follow();
        assert!(snapshot.is_empty());
        // A child whose live parent sorts after it (as if the parent's
        // shard had been read before the parent arrived), and an orphan.
        tree.insert(info(5, Some(9)), Status::Active);
        tree.insert(info(9, None), Status::Active);
        tree.insert(info(12, Some(77)), Status::Active);
        let mut out = Vec::new();
        assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
        assert_eq!(spawned(&out), [9, 12, 5]);
        out.clear();
        assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
        assert!(out.is_empty());
    }

    #[test]
    fn a_new_node_shows_the_status_its_look_read_and_later_ones_follow() {
        let tree = Tree::new(TreeLimits::default());
        let (_, mut f) = tree.follow();
        let node = tree.insert(info(4, None), Status::Active);
        let mut out = Vec::new();
        assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
        // Changed after the look, before the viewer serializes the change.
        tree.set_status(&node, Status::Unloading);
        let wire = serde_json::to_value(&out).unwrap();
        assert_eq!(wire[0]["node"]["status"], "active", "{wire}");
        out.clear();
        assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
        assert!(matches!(
            out[..],
            [TreeChange::Status {
                id: 4,
                status: Status::Unloading
            }]
        ));
    }

    #[test]
    fn the_stops_are_kept_until_every_follower_has_read_them() {
        let tree = Tree::new(TreeLimits::default());
        let stop = |id| {
            tree.insert(info(id, None), Status::Active);
            tree.stopped(id, Status::Disposed, "done");
        };
        let kept = || tree.stops().log.len();
        let (_, mut a) = tree.follow();
        let (_, mut b) = tree.follow();
        (1..=3).for_each(stop);
        let mut out = Vec::new();
        assert_eq!(tree.catch_up(&mut a, &mut out), Ok(3));
        assert_eq!(kept(), 3, "b has not read them");
        assert_eq!(tree.catch_up(&mut b, &mut out), Ok(3));
        assert_eq!(kept(), 0);
        drop(b);
        (4..=5).for_each(stop);
        assert_eq!(tree.catch_up(&mut a, &mut out), Ok(2));
        assert_eq!(kept(), 0, "a follower that left holds nothing back");
        drop(a);
        stop(6);
        assert_eq!(tree.stops().log.capacity(), 0, "freed once nobody follows");
    }

    #[test]
    fn a_follower_learns_that_the_tree_is_gone() {
        use futures::FutureExt;
        let tree = Tree::new(TreeLimits::default());
        let (_, mut f) = tree.follow();
        assert!(f.changed().now_or_never().is_none());
        tree.insert(info(1, None), Status::Active);
        assert_eq!(f.changed().now_or_never(), Some(Ok(())));
        drop(tree);
        assert_eq!(f.changed().now_or_never(), Some(Err(RecvError::Closed)));
    }

    #[test]
    fn a_status_that_changed_and_changed_back_between_looks_is_not_shown() {
        let tree = Tree::new(TreeLimits::default());
        let node = tree.insert(info(3, None), Status::Active);
        let (_, mut f) = tree.follow();
        tree.set_status(&node, Status::Unloading);
        tree.set_status(&node, Status::Active);
        let mut out = Vec::new();
        assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
        assert!(out.is_empty());
        tree.set_status(&node, Status::Unloading);
        assert_eq!(tree.catch_up(&mut f, &mut out), Ok(0));
        assert!(matches!(
            out[..],
            [TreeChange::Status {
                id: 3,
                status: Status::Unloading
            }]
        ));
    }
}
