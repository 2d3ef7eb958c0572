//! Input: `followup` (a new turn), `steer` (into the running turn),
//! `inject` (context for the next step), `cancel`; each queued prompt is
//! logged as an `agent/inbox/spliced` at its position in the queue, and
//! input to a hibernated agent asks the keeper to wake it.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use dsh_services::llm::Message;
use dsh_services::session::EventData;
use dsh_supervisors::tree::now_ms;

use super::log_append;
use super::{Agent, AgentError, Cancelled, Inbox, Life, lock};

impl Agent {
    pub(super) fn inbox(&self) -> MutexGuard<'_, Inbox> {
        lock(&self.inner.inbox)
    }

    /// Tells the driver there is work (waking the agent first if it sleeps).
    /// `idle` was already cleared under the inbox lock by the caller, so a
    /// driver finishing concurrently cannot report idle over queued work.
    pub(super) fn kick(&self) {
        self.touch();
        match &*self.life() {
            Life::Awake(me) if !me.sleeping.load(Ordering::Acquire) => {
                me.wake.notify_one();
                return;
            }
            Life::Gone { .. } => return,
            _ => {}
        }
        // Asleep, or going to sleep: the keeper wakes it (after the
        // hibernation finishes) and then tells the new driver.
        let asked = self
            .inner
            .agents
            .as_ref()
            .is_some_and(|a| a.ask_wake(self.clone()));
        if !asked {
            self.abandon("no keeper runs to wake it");
        }
    }

    /// A wake failed: queued input is dropped and the agent takes no more.
    pub(super) fn abandon(&self, why: &str) {
        tracing::error!(agent = %self.inner.id, "cannot wake the agent: {why}");
        lock(&self.inner.ending)
            .rare
            .get_or_insert_with(Box::default)
            .abandoned = Some(Arc::from(why));
        let mut inbox = self.inbox();
        inbox.accepting = false;
        inbox.followups.clear();
        inbox.steer.clear();
        inbox.inject.clear();
        self.inner.idle.set(true);
    }

    pub(super) fn accepting(&self) -> Result<(), AgentError> {
        let accepting = self.inbox().accepting;
        if accepting {
            Ok(())
        } else {
            Err(self.closed())
        }
    }

    /// Why the agent takes no input: closed, or abandoned with the reason
    /// its wake gave. Takes the ending lock: call it holding no other.
    pub(super) fn closed(&self) -> AgentError {
        let id = self.inner.id.to_string();
        let why = lock(&self.inner.ending)
            .rare
            .as_ref()
            .and_then(|r| r.abandoned.clone());
        match why {
            Some(why) => AgentError::Abandoned { id, why },
            None => AgentError::Closed(id),
        }
    }

    /// Marks a use (for the awake cap's least-recently-used order and the
    /// idle timeout).
    pub(super) fn touch(&self) {
        if let Some(agents) = &self.inner.agents {
            self.inner.used.store(agents.tick(), Ordering::Relaxed);
        }
        self.inner.used_ms.store(now_ms(), Ordering::Relaxed);
    }
}

impl Agent {
    /// Queues a prompt as a new turn (after the running one); wakes a
    /// hibernated agent.
    pub fn followup(&self, message: Message) -> Result<(), AgentError> {
        {
            let mut inbox = self.inbox();
            if !inbox.accepting {
                return Err(AgentError::Closed(self.inner.id.to_string()));
            }
            inbox.fresh = false;
            self.enqueue(&mut inbox, Arc::new(message));
            self.inner.idle.set(false);
        }
        self.kick();
        Ok(())
    }

    /// Queues `message` as the last pending prompt, logging the splice at
    /// its position (`inbox` is the caller's held lock).
    pub(super) fn enqueue(&self, inbox: &mut Inbox, message: Arc<Message>) {
        let start = inbox.followups.len();
        self.splice(start, 0, std::slice::from_ref(&message));
        inbox.followups.push_back(message);
    }

    /// Records one mutation of the pending prompts (`agent/inbox/spliced`),
    /// under the inbox lock so positions match the queue.
    pub(super) fn splice(&self, start: usize, removed: usize, inserted: &[Arc<Message>]) {
        let splice = dsh_services::session::InboxSplice {
            target: "next-turn".into(),
            start: start as u64,
            removed_count: (removed > 0).then_some(removed as u64),
            inserted: inserted.to_vec(),
            outcome: None,
        };
        log_append(self, EventData::InboxSpliced(Box::new(splice)), None);
    }

    /// Adds a message to the running turn at its next step (a new turn when
    /// idle); wakes a hibernated agent.
    pub fn steer(&self, message: Message) -> Result<(), AgentError> {
        self.accepting()?;
        {
            let mut inbox = self.inbox();
            if inbox.running {
                inbox.steer.push(Arc::new(message));
                return Ok(());
            }
            inbox.fresh = false;
            self.enqueue(&mut inbox, Arc::new(message));
            self.inner.idle.set(false);
        }
        self.kick();
        Ok(())
    }

    /// Adds injected context (a non-user source) to the next step; wakes a
    /// hibernated agent (which then waits, awake, for that step).
    pub fn inject(&self, message: Message) -> Result<(), AgentError> {
        self.accepting()?;
        self.inbox().inject.push(Arc::new(message));
        let awake =
            matches!(&*self.life(), Life::Awake(me) if !me.sleeping.load(Ordering::Acquire));
        if !awake {
            self.kick();
        }
        Ok(())
    }

    /// Cancels the running turn (it ends `aborted`); queued prompts stay.
    /// A hibernated agent runs nothing: the cancel is a no-op, and says so.
    pub fn cancel(&self) -> Cancelled {
        let asleep = self.is_hibernated();
        let mut inbox = self.inbox();
        match &inbox.cancel {
            Some(token) => {
                token.cancel();
                Cancelled::Running
            }
            // A prompt queued but not yet claimed: its turn starts cancelled
            // (and ends `aborted` at once), so a cancel is never lost in the
            // moment between `followup` and the driver picking it up.
            None if !inbox.followups.is_empty() => {
                inbox.cancel_next = true;
                Cancelled::Queued
            }
            None if asleep => Cancelled::Hibernated,
            None => Cancelled::Idle,
        }
    }
}
