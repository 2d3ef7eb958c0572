//! The tree's change feed: one bounded queue per subscriber.
//!
//! The changing side pushes each change onto every subscriber's own queue
//! (a short lock per queue); the reader takes the whole queue in one swap and
//! reads it without locking; a change is dropped once read. A broadcast ring
//! instead kept its last changes (and the nodes they hold) alive whether
//! anyone had read them or not, and allocated all its slots up front.
//!
//! A subscriber whose queue is full misses every change until it has read
//! what is queued; it then gets [`RecvError::Lagged`] with the number it
//! missed, and must take a fresh snapshot. A subscriber holds at most twice
//! the capacity: the batch it is reading and a full queue behind it.
//!
//! A follower ([`super::Follower`]) subscribes to events only
//! (supervision, teardown): a change of a node merely wakes it, once, when
//! it asked to be woken, and it reads the tree itself. A tree followed by
//! viewers alone builds and queues nothing per node change.
//!
//! Subscribing and changing race like Dekker's flags: a change is made, then
//! [`Feed::watched`] is read; a subscriber is counted, then the tree is
//! read. A sequentially consistent fence on both sides between the write and
//! the read makes sure one of them sees the other, so a first subscriber's
//! snapshot and its feed together miss nothing.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use arc_swap::ArcSwap;
use tokio::sync::Notify;
pub use tokio::sync::broadcast::error::{RecvError, TryRecvError};

use super::TreeChange;

/// The subscribers' queues.
pub(super) struct Feed {
    queues: ArcSwap<Vec<Arc<Queue>>>,
    /// Number of queues, read on every change of the tree (cheaper than
    /// loading the list when nobody watches).
    count: AtomicUsize,
    /// Number of events-only queues (followers).
    followers: AtomicUsize,
    capacity: usize,
}

/// What a subscriber's queue receives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Reads {
    /// Every change.
    Everything,
    /// Supervision and teardown events; a node change only wakes the
    /// reader, when it is armed (see [`Queue::armed`]).
    Events,
}

/// One subscriber's queue.
pub(super) struct Queue {
    pending: Mutex<Pending>,
    /// Woken when the queue stops being empty (or closes), when it is half
    /// full, and for an armed events-only queue, at the next node change.
    pub(super) ready: Notify,
    reads: Reads,
    /// Set by an events-only reader when it has read the tree and wants a
    /// wake-up at the next node change; cleared by that change.
    pub(super) armed: AtomicBool,
}

#[derive(Default)]
struct Pending {
    changes: VecDeque<TreeChange>,
    /// Changes left out since the queue filled up.
    missed: u64,
    closed: bool,
}

impl Queue {
    fn new(reads: Reads) -> Queue {
        Queue {
            pending: Mutex::default(),
            ready: Notify::new(),
            reads,
            armed: AtomicBool::new(false),
        }
    }

    /// A node changed: wakes an armed events-only reader, once.
    fn poke(&self) {
        if self.armed.load(Ordering::Relaxed) && self.armed.swap(false, Ordering::AcqRel) {
            self.ready.notify_one();
        }
    }

    fn lock(&self) -> MutexGuard<'_, Pending> {
        // A panic while holding this lock leaves a queue of whole changes.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, change: TreeChange, capacity: usize) {
        let (woke, refused) = {
            let mut pending = self.lock();
            if pending.missed > 0 || pending.changes.len() >= capacity {
                pending.missed += 1;
                (false, Some(change))
            } else {
                pending.changes.push_back(change);
                // Woken when the queue stops being empty, and again at half
                // full (a reader waiting for more to batch must not wait
                // for it to overflow).
                let len = pending.changes.len();
                (len == 1 || len == capacity / 2, None)
            }
        };
        // A refused change (and the node it may be the last to hold) is
        // dropped outside the lock.
        drop(refused);
        if woke {
            self.ready.notify_one();
        }
    }
}

impl Feed {
    pub(super) fn new(capacity: usize) -> Feed {
        Feed {
            queues: ArcSwap::from_pointee(Vec::new()),
            count: AtomicUsize::new(0),
            followers: AtomicUsize::new(0),
            capacity: capacity.max(16),
        }
    }

    /// Whether anyone subscribes. Called after the change it is asked for
    /// was made (see the module docs for the fence).
    pub(super) fn watched(&self) -> bool {
        std::sync::atomic::fence(Ordering::SeqCst);
        self.count.load(Ordering::Relaxed) > 0
    }

    /// Whether a follower subscribes. Read under the lock of the stops,
    /// which a new follower takes after it was counted.
    pub(super) fn followed(&self) -> bool {
        self.followers.load(Ordering::Relaxed) > 0
    }

    pub(super) fn subscribe(self: &Arc<Self>, reads: Reads) -> Subscription {
        let queue = Arc::new(Queue::new(reads));
        self.queues.rcu(|queues| {
            let mut queues = Vec::clone(queues);
            queues.push(queue.clone());
            queues
        });
        if reads == Reads::Events {
            self.followers.fetch_add(1, Ordering::SeqCst);
        }
        self.count.fetch_add(1, Ordering::SeqCst);
        // Before the subscriber reads the tree (see the module docs).
        std::sync::atomic::fence(Ordering::SeqCst);
        Subscription {
            queue,
            feed: self.clone(),
            taken: VecDeque::new(),
        }
    }

    /// Queues an event (supervision, teardown) for every subscriber.
    pub(super) fn send(&self, change: TreeChange) {
        let queues = self.queues.load();
        if let Some((last, others)) = queues.split_last() {
            for queue in others {
                queue.push(change.clone(), self.capacity);
            }
            last.push(change, self.capacity);
        }
    }

    /// Queues the node change `make` builds for the subscribers that read
    /// every change (it is built only if there is one), and wakes the armed
    /// followers.
    pub(super) fn send_node(&self, make: impl FnOnce() -> TreeChange) {
        let mut make = Some(make);
        let mut built: Option<TreeChange> = None;
        for queue in self.queues.load().iter() {
            if queue.reads == Reads::Events {
                queue.poke();
                continue;
            }
            if built.is_none() {
                built = make.take().map(|make| make());
            }
            if let Some(change) = &built {
                queue.push(change.clone(), self.capacity);
            }
        }
    }

    /// Closes every queue: readers get what is queued, then
    /// [`RecvError::Closed`].
    pub(super) fn close(&self) {
        for queue in self.queues.load().iter() {
            queue.lock().closed = true;
            queue.ready.notify_one();
        }
    }
}

/// A subscription to the tree's change feed (see the module docs). Dropping
/// it unsubscribes.
pub struct Subscription {
    pub(super) queue: Arc<Queue>,
    feed: Arc<Feed>,
    /// Changes taken from the queue in one swap, read without a lock.
    taken: VecDeque<TreeChange>,
}

impl Subscription {
    /// The next change, waiting for one. Cancel-safe: a change is only taken
    /// by the call that returns it.
    pub async fn recv(&mut self) -> Result<TreeChange, RecvError> {
        loop {
            match self.try_recv() {
                Ok(change) => return Ok(change),
                Err(TryRecvError::Lagged(n)) => return Err(RecvError::Lagged(n)),
                Err(TryRecvError::Closed) => return Err(RecvError::Closed),
                Err(TryRecvError::Empty) => self.queue.ready.notified().await,
            }
        }
    }

    /// The next change if one is queued. After a full queue: the changes
    /// queued before it, then `Lagged` with the number missed, then the
    /// changes since.
    pub fn try_recv(&mut self) -> Result<TreeChange, TryRecvError> {
        if let Some(change) = self.taken.pop_front() {
            return Ok(change);
        }
        let mut pending = self.queue.lock();
        if !pending.changes.is_empty() {
            // The two buffers change places, so both keep their capacity.
            std::mem::swap(&mut pending.changes, &mut self.taken);
            drop(pending);
            return self.taken.pop_front().ok_or(TryRecvError::Empty);
        }
        if pending.missed > 0 {
            return Err(TryRecvError::Lagged(std::mem::take(&mut pending.missed)));
        }
        if pending.closed {
            return Err(TryRecvError::Closed);
        }
        Err(TryRecvError::Empty)
    }

    /// Whether the feed closed (its tree is gone) and everything queued
    /// was read.
    pub(super) fn is_closed(&self) -> bool {
        self.taken.is_empty() && {
            let pending = self.queue.lock();
            pending.closed && pending.changes.is_empty() && pending.missed == 0
        }
    }

    /// Waits until half the queue's capacity is taken (or it lagged, or
    /// closed): a reader batching changes for a while stops waiting before
    /// the queue overflows. Cancel-safe.
    pub async fn half_full(&self) {
        loop {
            {
                let pending = self.queue.lock();
                if pending.changes.len() >= self.feed.capacity / 2
                    || pending.missed > 0
                    || pending.closed
                {
                    return;
                }
            }
            self.queue.ready.notified().await;
        }
    }

    /// Whether nothing is there to read right now.
    pub fn is_empty(&self) -> bool {
        if !self.taken.is_empty() {
            return false;
        }
        let pending = self.queue.lock();
        pending.changes.is_empty() && pending.missed == 0 && !pending.closed
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let gone = &self.queue;
        self.feed.queues.rcu(|queues| {
            queues
                .iter()
                .filter(|q| !Arc::ptr_eq(q, gone))
                .cloned()
                .collect::<Vec<_>>()
        });
        self.feed.count.fetch_sub(1, Ordering::AcqRel);
        if self.queue.reads == Reads::Events {
            self.feed.followers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tree::Status;

    fn change(id: u64) -> TreeChange {
        TreeChange::Status {
            id,
            status: Status::Active,
        }
    }

    fn id_of(change: TreeChange) -> u64 {
        match change {
            TreeChange::Status { id, .. } => id,
            other => panic!("unexpected change {other:?}"),
        }
    }

    #[test]
    fn a_reader_waiting_for_a_batch_is_woken_at_half_capacity() {
        use std::sync::atomic::AtomicUsize;
        use std::task::{Context, Poll};
        struct Wakes(AtomicUsize);
        impl futures::task::ArcWake for Wakes {
            fn wake_by_ref(this: &Arc<Self>) {
                this.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
        let waker = futures::task::waker(wakes.clone());
        let mut cx = Context::from_waker(&waker);
        let woken = || wakes.0.load(Ordering::SeqCst);

        let feed = Arc::new(Feed::new(64));
        let rx = feed.subscribe(Reads::Everything);
        let mut waiting = std::pin::pin!(rx.half_full());
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        feed.send(change(0));
        assert_eq!(woken(), 1, "the queue stopped being empty");
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
        for id in 1..31 {
            feed.send(change(id));
        }
        assert_eq!(woken(), 1, "31 of 64 queued: no wake-up");
        feed.send(change(31));
        assert_eq!(woken(), 2, "woken at 32 of 64");
        assert_eq!(waiting.as_mut().poll(&mut cx), Poll::Ready(()));
    }

    #[test]
    fn every_subscriber_reads_every_change_in_order_until_it_unsubscribes() {
        let feed = Arc::new(Feed::new(64));
        assert!(!feed.watched());
        let mut a = feed.subscribe(Reads::Everything);
        let mut b = feed.subscribe(Reads::Everything);
        assert!(feed.watched() && a.is_empty());
        for id in 0..5 {
            feed.send(change(id));
        }
        assert!(!a.is_empty());
        fn read(s: &mut Subscription) -> Vec<u64> {
            std::iter::from_fn(|| s.try_recv().ok().map(id_of)).collect()
        }
        assert_eq!(read(&mut a), [0, 1, 2, 3, 4]);
        assert!(matches!(a.try_recv(), Err(TryRecvError::Empty)));
        drop(a);
        feed.send(change(5));
        assert_eq!(read(&mut b), [0, 1, 2, 3, 4, 5]);
        assert_eq!(feed.queues.load().len(), 1);
        drop(b);
        assert!(!feed.watched() && feed.queues.load().is_empty());
    }

    #[test]
    fn a_full_queue_misses_changes_and_says_how_many_after_what_it_kept() {
        let feed = Arc::new(Feed::new(16));
        let mut s = feed.subscribe(Reads::Everything);
        for id in 0..20 {
            feed.send(change(id));
        }
        for id in 0..16 {
            assert_eq!(id_of(s.try_recv().unwrap()), id);
        }
        // Missing started at the first refused change and goes on until the
        // reader has seen the lag.
        feed.send(change(20));
        assert!(matches!(s.try_recv(), Err(TryRecvError::Lagged(5))));
        feed.send(change(21));
        assert_eq!(id_of(s.try_recv().unwrap()), 21);
    }

    #[test]
    fn a_follower_gets_events_and_one_wake_up_per_arming_but_no_node_change() {
        use futures::FutureExt;
        let feed = Arc::new(Feed::new(16));
        let mut every = feed.subscribe(Reads::Everything);
        let follower = feed.subscribe(Reads::Events);
        let built = std::cell::Cell::new(0);
        let built = &built;
        let node_change = |id| {
            move || {
                built.set(built.get() + 1);
                change(id)
            }
        };
        feed.send_node(node_change(1));
        // Not armed: no wake-up for the follower.
        assert!(follower.is_empty());
        assert!(follower.queue.ready.notified().now_or_never().is_none());
        follower.queue.armed.store(true, Ordering::SeqCst);
        feed.send_node(node_change(2));
        feed.send_node(node_change(3));
        assert!(!follower.queue.armed.load(Ordering::SeqCst));
        // One wake-up for the two changes, and no change queued.
        assert!(follower.queue.ready.notified().now_or_never().is_some());
        assert!(follower.queue.ready.notified().now_or_never().is_none());
        assert!(follower.is_empty());
        // Built once per change, for the subscriber that reads every one.
        assert_eq!(built.get(), 3);
        let ids: Vec<u64> = std::iter::from_fn(|| every.try_recv().ok().map(id_of)).collect();
        assert_eq!(ids, [1, 2, 3]);
        drop(every);
        feed.send_node(node_change(4));
        assert_eq!(built.get(), 3, "nothing built for followers alone");
        // Events reach both kinds.
        feed.send(TreeChange::Teardown {
            root: 9,
            order: vec![9],
        });
        let mut follower = follower;
        assert!(matches!(
            follower.try_recv(),
            Ok(TreeChange::Teardown { root: 9, .. })
        ));
    }

    #[tokio::test]
    async fn a_waiting_reader_wakes_for_a_change_and_learns_the_feed_closed() {
        let feed = Arc::new(Feed::new(16));
        let mut s = feed.subscribe(Reads::Everything);
        let reader = tokio::spawn(async move {
            let first = s.recv().await.map(id_of);
            let second = s.recv().await.map(id_of);
            (first, second, s)
        });
        tokio::task::yield_now().await;
        feed.send(change(7));
        feed.close();
        let (first, second, _s) = tokio::time::timeout(std::time::Duration::from_secs(20), reader)
            .await
            .expect("the reader never woke")
            .unwrap();
        assert_eq!(first, Ok(7));
        assert_eq!(second, Err(RecvError::Closed));
    }
}
