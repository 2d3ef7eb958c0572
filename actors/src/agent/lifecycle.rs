//! An agent's life: creation as one transaction (prepare, set up the
//! private scope, enter the session, enter the driver, announce; any failure
//! disposes what was built), hibernation and waking under the same id, and
//! ordered disposal. Transitions take turns (one at a time per agent).

use dsh_services::jobs::Jobs;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use dsh_services::approval::Approval;
use dsh_services::llm::{LlmRuntime, Message};
use dsh_services::persistence::{SessionPersistence, StoreError, WriterLock};
use dsh_services::prompt::{PromptSection, SystemPrompt, Text};
use dsh_services::sandbox::Sandbox;
use dsh_services::session::{EventData, SessionHeader, SessionLog};
use dsh_services::tools::Bounds;
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::error::chain;
use dsh_supervisors::tree::now_ms;
use dsh_supervisors::{Context, ScopeKey, Status, TaskSpec};

use super::driver::{Driving, Stopped, drive};
use super::events::{AgentCreated, AgentDisposed};
use super::keeper::Agents;
use super::{
    AGENT_SELF, Agent, AgentError, AgentSelf, AgentSpec, Awake, Ending, Idle, Inbox, Inner, Life,
    NOT_STORED, StaysAwake, lock,
};
use crate::session::{SessionHandle, short};

/// Held while an agent goes to sleep, wakes or is disposed.
pub(super) struct Transition<'a>(&'a Inner);

impl Drop for Transition<'_> {
    fn drop(&mut self) {
        self.0.transitioning.store(false, Ordering::Release);
        // Transition waiters wait on the idle notifier (and check again).
        self.0.idle.changed.notify_waiters();
    }
}

impl Agent {
    /// Creates an agent under `ctx` as one transaction: prepare (services),
    /// set up the private scope, enter the session, enter the driver,
    /// announce; any failure disposes what was built.
    pub async fn create(ctx: &Context, mut spec: AgentSpec) -> Result<Agent, AgentError> {
        let agents = ctx.get::<Agents>(Agents::SERVICE);
        if let Some(agents) = &agents {
            agents.admit_one_more().await;
        }
        // The policy is fixed at creation: the spec's, else the deployment's.
        if spec.permission.is_none() {
            spec.permission = Some(
                ctx.get::<Sandbox>(Sandbox::SERVICE)
                    .map(|s| s.defaults())
                    .unwrap_or_default(),
            );
        }
        let (header, seed) = match spec.seed.take().map(|b| *b) {
            Some((h, events)) => (h, Some(events)),
            None => {
                let mut h = SessionHeader::new(
                    spec.id.clone().unwrap_or_else(Message::new_id),
                    Some(spec.cwd.display().to_string()),
                );
                h.delegation_depth = spec.depth;
                h.parent_session = spec.parent_session.clone();
                h.origin = spec.origin.clone().map(serde_json::Value::String);
                (h, None)
            }
        };
        let resumed = seed.is_some();
        let log = match seed {
            Some(events) => SessionLog::from_seed(header, events, now_ms())?,
            None => SessionLog::new(header),
        };
        let session = SessionHandle::new(log);
        let id = session.shared_id();
        let first_turn = turns_in(&session);
        let durable = spec.durable.take();
        spec.id = None;
        let inner = Arc::new(Inner {
            id,
            spec: match &agents {
                Some(agents) => agents.templates.spec(spec),
                None => Arc::new(spec),
            },
            owner: ctx.clone(),
            session,
            inbox: Mutex::new(Inbox {
                accepting: true,
                fresh: true,
                // A resumed session numbers its turns after the seed's.
                turn: first_turn,
                ..Inbox::default()
            }),
            idle: Idle::default(),
            resumed,
            tokens: Arc::new(AtomicU64::new(0)),
            life: Mutex::new(Life::Gone { node: 0 }),
            transitioning: AtomicBool::new(false),
            agents,
            used: AtomicU64::new(0),
            used_ms: AtomicU64::new(0),
            durable: AtomicU64::new(durable.unwrap_or(NOT_STORED)),
            store: std::sync::OnceLock::new(),
            ending: Mutex::new(Ending::default()),
        });
        let agent = Agent { inner };
        // Boxed: the build's state lives on the heap only while it runs, not in
        // every future that awaits a creation.
        let awake = Box::pin(agent.build()).await?;
        let weak = agent.downgrade();
        let hook = ctx.effect_async("dispose a hibernated agent", move || async move {
            if let Some(agent) = weak.upgrade() {
                agent.dispose().await;
            }
        });
        match hook {
            Ok(hook) => lock(&agent.inner.ending).owner_hook = Some(hook),
            Err(e) => {
                awake.scope.dispose().await;
                return Err(AgentError::Kernel(e));
            }
        }
        if let Some(agents) = &agent.inner.agents {
            agents.admit(&agent);
        }
        agent.set_awake(awake);
        ctx.emit(&AgentCreated {
            id: agent.inner.id.to_string(),
        });
        Ok(agent)
    }

    /// Builds the agent's awake part in a fresh scope under its owner,
    /// applying what its spec registers there; on any failure the scope
    /// (and whatever was started in it) is disposed before returning.
    pub(super) async fn build(&self) -> Result<Arc<Awake>, AgentError> {
        let inner = &self.inner;
        let spec = &inner.spec;
        let ctx = &inner.owner;
        let llm = ctx
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .ok_or(AgentError::MissingService(LlmRuntime::SERVICE))?;
        let tools = ctx
            .get::<ToolRegistry>(ToolRegistry::SERVICE)
            .ok_or(AgentError::MissingService(ToolRegistry::SERVICE))?;
        let approval = spec
            .approval
            .clone()
            .or_else(|| ctx.get::<Approval>(Approval::SERVICE));
        let snapshots = ctx.get::<Sandbox>(Sandbox::SERVICE).is_some();
        let key = ScopeKey::new(self.label());
        if let Some(parent) = ctx.scope_key().filter(|_| !spec.flat_scope) {
            key.bind_parent(parent)?;
        }
        let scope = ctx.scope(key).await?;
        let sctx = scope.ctx().clone();
        // A store of the spec's own, else the one provided in scope.
        let store = spec.store.clone().or_else(|| {
            sctx.get::<dyn SessionPersistence>(dsh_services::persistence::PERSISTENCE_SERVICE)
        });
        let stored = store.is_some();
        if let Err(e) = self.set_up(&sctx, &tools, store).await {
            scope.dispose().await;
            return Err(e);
        }
        let awake = Arc::new(Awake {
            ctx: sctx,
            scope,
            llm,
            tools,
            approval,
            bounds: Bounds {
                cwd: Arc::new(spec.cwd.clone()),
                policy: spec.permission.unwrap_or_default(),
            },
            wake: tokio::sync::Notify::new(),
            envelope: Mutex::new(None),
            context: Mutex::new(None),
            snapshots,
            titled: AtomicBool::new(false),
            conclude: AtomicBool::new(false),
            step_children: Mutex::new(Vec::new()),
            step: AtomicU32::new(0),
            published_ms: AtomicU64::new(0),
            settled: std::sync::OnceLock::new(),
            stored,
            sleeping: AtomicBool::new(false),
        });
        if let Err(e) = self.enter(&awake).await {
            awake.scope.dispose().await;
            return Err(e);
        }
        let fiber = awake.scope.fiber();
        let _ = awake
            .settled
            .set((fiber.effect_count(), fiber.child_count()));
        let tree = awake.ctx.runtime().tree();
        tree.set_summary_fn(fiber.id(), self.summary_fn());
        // A viewer that read the scope before it had a summary learns it.
        tree.summary_changed(fiber.id());
        Ok(awake)
    }

    /// What the spec registers in the new scope `sctx`: its tool
    /// restriction, its persona as a prompt section, the session as the
    /// scope's session writer; then the session's actor, writing to `store`.
    async fn set_up(
        &self,
        sctx: &Context,
        tools: &Arc<ToolRegistry>,
        store: Option<Arc<dyn SessionPersistence>>,
    ) -> Result<(), AgentError> {
        let (inner, spec) = (&self.inner, &self.inner.spec);
        if let Some(s) = &store {
            let _ = inner.store.set(s.clone());
        }
        let durable = Some(inner.durable.load(Ordering::Acquire)).filter(|n| *n != NOT_STORED);
        if let Some(mut r) = spec.restriction.clone() {
            // Its own tools are its own: no filter hides them.
            let own: Vec<String> = spec.tools.0.iter().map(|t| t.schema().name).collect();
            if let Some(allow) = r.allow.as_mut() {
                allow.extend(own.iter().cloned());
            }
            r.deny.retain(|d| !own.contains(d));
            tools.restrict(sctx, r)?;
        }
        for tool in &spec.tools.0 {
            tools.register(sctx, tool.clone())?;
        }
        if let (Some(text), Some(prompt)) = (
            spec.system.clone(),
            sctx.get::<SystemPrompt>(SystemPrompt::SERVICE),
        ) {
            let persona = PromptSection {
                name: "persona".into(),
                order: 0,
                text: Text::Static(text),
                complete: false,
            };
            prompt.section(sctx, persona)?;
        }
        if let Some(prompt) = sctx.get::<SystemPrompt>(SystemPrompt::SERVICE) {
            for (name, order, text) in &spec.sections {
                let section = PromptSection {
                    name: name.clone(),
                    order: *order,
                    text: Text::Static(text.clone()),
                    complete: false,
                };
                prompt.section(sctx, section)?;
            }
        }
        let session = &inner.session;
        let writer: Arc<dyn dsh_services::session::SessionWriter> = Arc::new(session.clone());
        sctx.provide(dsh_services::session::SESSION_SERVICE, writer)?;
        let writer = match &store {
            Some(store) => take_writer(store.clone(), inner.id.to_string(), durable).await?,
            None => None,
        };
        session.attach_after(sctx, store, durable, writer).await?;
        Ok(())
    }

    /// Enters the agent into its scope: `agent/self`, the driver task, the
    /// teardown prelude that stops input and cancels the turn, and the
    /// effect that takes the agent out of the registry (neither runs when
    /// the scope stops because the agent goes to sleep).
    async fn enter(&self, awake: &Arc<Awake>) -> Result<(), AgentError> {
        let sctx = &awake.ctx;
        let me = Arc::new(AgentSelf(Arc::downgrade(&self.inner)));
        sctx.provide(AGENT_SELF, me)?;
        let driving = Driving {
            agent: self.clone(),
            me: awake.clone(),
        };
        let name = format!("driver/{}", short(&self.inner.id));
        sctx.spawn_task(TaskSpec::new("agent", name), move |stop| {
            // The guard exists before the task first runs: an abort even
            // then settles the inbox.
            drive(Stopped(driving), stop)
        })?;
        let (weak, part) = (self.downgrade(), Arc::downgrade(awake));
        sctx.on_teardown("stop input and cancel the turn", move || async move {
            let sleeping = part
                .upgrade()
                .is_some_and(|p| p.sleeping.load(Ordering::Acquire));
            if let Some(agent) = weak.upgrade().filter(|_| !sleeping) {
                agent.close_and_cancel().await;
            }
        })?;
        let (weak, part) = (self.downgrade(), Arc::downgrade(awake));
        sctx.effect("leave the agents registry", move || {
            let sleeping = part
                .upgrade()
                .is_some_and(|p| p.sleeping.load(Ordering::Acquire));
            if let Some(agent) = weak.upgrade().filter(|_| !sleeping) {
                agent.finish();
            }
        })?;
        Ok(())
    }

    /// The readable name of the agent's scope (and of its parked node).
    pub(super) fn label(&self) -> String {
        self.inner
            .spec
            .name
            .clone()
            .unwrap_or_else(|| format!("agent/{}", short(&self.inner.id)))
    }

    pub(super) fn life(&self) -> MutexGuard<'_, Life> {
        lock(&self.inner.life)
    }

    /// The awake part, while the agent is awake.
    pub(super) fn awake(&self) -> Option<Arc<Awake>> {
        match &*self.life() {
            Life::Awake(a) => Some(a.clone()),
            _ => None,
        }
    }

    pub(super) fn set_awake(&self, awake: Arc<Awake>) {
        // The owner may have torn the new scope down already (its registry
        // effect then ended the agent): do not bring it back.
        let status = awake.scope.fiber().status();
        if status.is_terminal() || status == Status::Unloading {
            return;
        }
        *self.life() = Life::Awake(awake);
        self.touch();
        if let Some(agents) = &self.inner.agents {
            agents.woke(self);
        }
    }

    /// Waits until no other transition (sleep, wake, disposal) runs and
    /// starts one; it ends when the guard drops.
    pub(super) async fn transition(&self) -> Transition<'_> {
        loop {
            // Registered before the check, so the end of the running
            // transition cannot be missed.
            let notified = self.inner.idle.changed.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            if self
                .inner
                .transitioning
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Transition(&self.inner);
            }
            notified.await;
        }
    }

    /// The agent's key among the keeper's awake agents (its record's
    /// address: unique while the keeper holds a weak handle to it).
    pub(super) fn key(&self) -> u64 {
        Arc::as_ptr(&self.inner) as usize as u64
    }
}

impl Agent {
    pub(super) async fn close_and_cancel(&self) {
        {
            let mut inbox = self.inbox();
            inbox.accepting = false;
            inbox.followups.clear();
            if let Some(t) = &inbox.cancel {
                t.cancel();
            }
        }
        // Its background jobs end with it (their tasks, children of its
        // scope, then end at once).
        if let Some(jobs) = self.reach().get::<Jobs>(Jobs::SERVICE) {
            jobs.cancel_owner(&self.inner.id);
        }
        // The driver writes the turn's end; bounded so a stuck body cannot
        // hold the teardown (the kernel kills it after its budget anyway).
        let _ = tokio::time::timeout(Duration::from_secs(5), self.inner.idle.wait()).await;
    }

    /// Ordered teardown of the agent and everything it owns. A hibernated
    /// agent is disposed without waking: its parked node and compact session
    /// go, and it leaves the registry.
    pub async fn dispose(&self) {
        let _transition = self.transition().await;
        let awake = match &*self.life() {
            Life::Awake(me) => Some(me.clone()),
            Life::Asleep { .. } => None,
            Life::Gone { .. } => return,
        };
        match awake {
            // Its teardown ends with `finish` (the registry effect).
            Some(me) => me.scope.dispose().await,
            None => {
                self.inbox().accepting = false;
                self.write_tail().await;
                self.finish();
            }
        }
    }

    /// Writes what was appended while the agent slept (a record, the splice
    /// of input whose wake failed) to its store, which its next wake would
    /// have done: an agent disposed asleep loses nothing committed.
    pub(super) async fn write_tail(&self) {
        let Some(store) = self.inner.store.get().cloned() else {
            return;
        };
        let from = self.inner.durable.load(Ordering::Acquire);
        let session = &self.inner.session;
        if from == NOT_STORED || session.next_seq() <= from {
            return;
        }
        let events = session.events_from(from);
        let id = self.inner.id.to_string();
        let written = tokio::task::spawn_blocking(move || {
            let _writer = writer_of(&*store, &id, Some(from))?;
            store.append(&id, &events)
        })
        .await;
        match written {
            Ok(Ok(())) => self
                .inner
                .durable
                .store(session.next_seq(), Ordering::Release),
            Ok(Err(e)) => {
                tracing::error!(agent = %self.inner.id, "the session's last events were not written: {}", chain(&e))
            }
            Err(e) => {
                tracing::error!(agent = %self.inner.id, "the session writer failed: {}", chain(&e))
            }
        }
    }

    /// The end of the agent: it leaves the registry and the tree, its
    /// disposal callbacks run, `agent/disposed` is emitted.
    pub(super) fn finish(&self) {
        // Whatever path ended it (a teardown prelude that did not run, an
        // asleep disposal), no background job of its outlives it.
        if let Some(jobs) = self.inner.owner.get::<Jobs>(Jobs::SERVICE) {
            jobs.cancel_owner(&self.inner.id);
        }
        let was = {
            let mut life = self.life();
            let node = life.node();
            std::mem::replace(&mut *life, Life::Gone { node })
        };
        {
            let mut inbox = self.inbox();
            inbox.accepting = false;
            inbox.followups.clear();
        }
        self.inner.idle.set(true);
        if let Life::Asleep { node } = was {
            self.inner.owner.runtime().tree().unpark(
                node,
                Status::Disposed,
                "disposed while hibernated",
            );
        }
        let (hook, callbacks) = {
            let mut ending = lock(&self.inner.ending);
            let callbacks = ending
                .rare
                .as_mut()
                .map(|r| std::mem::take(&mut r.on_disposed))
                .unwrap_or_default();
            (ending.owner_hook.take(), callbacks)
        };
        if let Some(hook) = hook {
            hook.cancel();
        }
        if let Some(agents) = &self.inner.agents {
            agents.leave(self);
        }
        for f in callbacks {
            if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
                tracing::error!(
                    agent = %self.inner.id,
                    "a disposal callback panicked: {}",
                    dsh_supervisors::events::panic_text(&p)
                );
            }
        }
        self.inner.owner.emit(&AgentDisposed {
            id: self.inner.id.to_string(),
        });
    }

    /// Whether the agent may hibernate, given its inbox (locked by the caller).
    pub(super) fn may_sleep(&self, me: &Awake, inbox: &Inbox) -> Result<(), StaysAwake> {
        if !inbox.accepting {
            return Err(StaysAwake::Closed);
        }
        if inbox.running {
            return Err(StaysAwake::Running);
        }
        if !inbox.followups.is_empty() || !inbox.steer.is_empty() || !inbox.inject.is_empty() {
            return Err(StaysAwake::Queued);
        }
        if me.sleeping.load(Ordering::Acquire) {
            return Err(StaysAwake::Sleeping);
        }
        let fiber = me.scope.fiber();
        let (effects, children) = me.settled.get().copied().unwrap_or((0, 0));
        if fiber.child_count() > children || !lock(&me.step_children).is_empty() {
            return Err(StaysAwake::Children);
        }
        if fiber.effect_count() > effects {
            let mut labels = fiber.effects();
            let ad_hoc = labels.split_off(effects.min(labels.len()));
            return Err(StaysAwake::AdHoc(ad_hoc));
        }
        Ok(())
    }

    /// Puts an idle agent to sleep: its scope stops in the normal ordered
    /// way (driver, session, whose actor writes what is pending),
    /// its session is compacted, and a parked node stands for it in the
    /// tree. Refused (with the reason) while it works, has queued input,
    /// live children or ad hoc registrations, or when no keeper runs to
    /// wake it again.
    pub async fn hibernate(&self) -> Result<(), StaysAwake> {
        if !self.inner.agents.as_ref().is_some_and(|a| a.has_keeper()) {
            return Err(StaysAwake::NoKeeper);
        }
        let _transition = self.transition().await;
        let me = match &*self.life() {
            Life::Awake(me) => me.clone(),
            Life::Asleep { .. } => return Ok(()),
            Life::Gone { .. } => return Err(StaysAwake::Disposed),
        };
        {
            // Under the inbox lock: input arriving from now on sees
            // `sleeping` and asks the keeper to wake the agent.
            let mut inbox = self.inbox();
            self.may_sleep(&me, &inbox)?;
            me.sleeping.store(true, Ordering::Release);
            // Empty, but sized for the last burst: sized for idle instead.
            inbox.followups.shrink_to_fit();
            inbox.steer.shrink_to_fit();
            inbox.inject.shrink_to_fit();
        }
        // Durable first: an agent whose log cannot be written stays awake
        // (its session actor keeps retrying).
        if let Err(e) = self.inner.session.flush().await {
            me.sleeping.store(false, Ordering::Release);
            return Err(e.into());
        }
        me.scope.dispose().await;
        let session = &self.inner.session;
        session.detach();
        if me.stored {
            // What the actor wrote, not what the log holds: an event
            // appended while it drained (a splice of input arriving now) is
            // written on wake.
            self.inner
                .durable
                .store(session.written(), Ordering::Release);
        }
        if let Err(e) = session.compact() {
            tracing::warn!(agent = %self.inner.id, "the session stays uncompressed: {}", chain(&e));
        }
        let summary = self.summary_fn();
        let owner = &self.inner.owner;
        // Named by the agent's own name, else its id (shared, not copied).
        let name = match &self.inner.spec.name {
            Some(n) => Arc::from(n.as_str()),
            None => self.inner.session.shared_id(),
        };
        let parent = Some(owner.fiber().id());
        let node = owner.runtime().tree().park("agent", name, parent, summary);
        *self.life() = Life::Asleep { node };
        if let Some(agents) = &self.inner.agents {
            agents.slept(self);
        }
        Ok(())
    }

    /// Wakes a hibernated agent under the same id: a new scope with what its
    /// spec registers, the session restored, a new driver; then any queued
    /// input runs. Awake already: only the driver is told.
    pub async fn wake(&self) -> Result<(), AgentError> {
        let _transition = self.transition().await;
        let node = match &*self.life() {
            Life::Awake(me) => {
                me.wake.notify_one();
                return Ok(());
            }
            Life::Asleep { node } => *node,
            Life::Gone { .. } => return Err(AgentError::Closed(self.inner.id.to_string())),
        };
        self.inner.session.thaw().map_err(AgentError::Restore)?;
        let awake = Box::pin(self.build()).await?;
        self.inner
            .owner
            .runtime()
            .tree()
            .unpark(node, Status::Hibernated, "woke");
        let wake = awake.clone();
        self.set_awake(awake);
        wake.wake.notify_one();
        Ok(())
    }
}

/// The last turn number a session's log holds.
pub(super) fn turns_in(session: &SessionHandle) -> u32 {
    session.with_log(|log| {
        log.without_chunks()
            .filter_map(|e| match e.data {
                EventData::TurnStart { turn } => Some(turn),
                _ => None,
            })
            .max()
            .unwrap_or(0)
    })
}

/// Takes session `id`'s one-writer lock in `store` (off the async workers):
/// see [`writer_of`].
async fn take_writer(
    store: Arc<dyn SessionPersistence>,
    id: String,
    durable: Option<u64>,
) -> Result<Option<WriterLock>, AgentError> {
    let at = store.locate(&id);
    tokio::task::spawn_blocking(move || writer_of(&*store, &id, durable))
        .await
        .map_err(|e| StoreError::Io {
            path: at,
            error: std::io::Error::other(format!("the lock taker failed: {}", chain(&e))),
        })?
        .map_err(AgentError::from)
}

/// The one-writer lock of session `id`; a session already stored with
/// `durable` events must still hold exactly those (nobody wrote it since it
/// was read, nor while this agent slept).
fn writer_of(
    store: &dyn SessionPersistence,
    id: &str,
    durable: Option<u64>,
) -> Result<Option<WriterLock>, StoreError> {
    let writer = store.lock_writer(id)?;
    if let Some(read) = durable
        && store.holds_more_than(id, read)?
    {
        return Err(StoreError::Stale {
            id: id.to_owned(),
            read,
        });
    }
    Ok(writer)
}
