//! The `agents` registry and its keeper: the actor that wakes hibernated
//! agents when input reaches them and puts idle ones to sleep, after an idle
//! time or when more agents are awake than the cap allows (least recently
//! used first, never one that works).

use dsh_services::jobs::JobDone;
use dsh_services::llm::{Message, MessageSource};
use dsh_services::session::EventData;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_supervisors::error::chain;
use dsh_supervisors::tree::now_ms;
use dsh_supervisors::{Context, WorkerRef, WorkerSpec};
use ractor::{Actor, ActorProcessingErr, ActorRef};

use super::template::Templates;
use super::{Agent, WeakAgent, lock};

/// When idle agents hibernate.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Hibernation {
    /// Hibernate an agent idle for this many milliseconds (never by time
    /// when absent).
    #[serde(default)]
    pub idle_ms: Option<u64>,
    /// The most agents awake at once: above it, the least recently used
    /// idle agents hibernate (working ones never do, so the cap can be
    /// exceeded while they work). No cap when absent.
    #[serde(default)]
    pub max_awake: Option<usize>,
}

/// The keeper did not answer in time (it is stopped or overloaded).
/// Retryable: it may answer a later call.
#[derive(Debug, thiserror::Error)]
#[error("the agents keeper did not answer: {0}")]
pub struct KeeperUnanswered(pub String);

/// The `agents` service: every agent by id, awake or hibernated.
#[derive(Default)]
pub struct Agents {
    live: Mutex<BTreeMap<Arc<str>, Agent>>,
    /// Awake agents by key (see `Agent::key`).
    awake: Mutex<BTreeMap<u64, WeakAgent>>,
    clock: AtomicU64,
    policy: Hibernation,
    keeper: std::sync::OnceLock<WorkerRef<KeeperMsg>>,
    /// An eviction pass is queued at the keeper.
    evicting: AtomicBool,
    /// What agents of one template share.
    pub(super) templates: Templates,
}

impl Agents {
    /// The capability name.
    pub const SERVICE: &'static str = "agents";

    /// A registry with its keeper running under `ctx` (a worker named
    /// `agents/keeper`), hibernating agents as `policy` says.
    pub async fn start(ctx: &Context, policy: Hibernation) -> dsh_supervisors::Result<Arc<Agents>> {
        let agents = Arc::new(Agents {
            policy,
            ..Agents::default()
        });
        let keeper = ctx
            .spawn(WorkerSpec::new(
                "worker",
                "agents/keeper",
                Keeper,
                Arc::downgrade(&agents),
            ))
            .await?;
        let _ = agents.keeper.set(keeper);
        // A background job of one of these agents ended: tell its owner,
        // unless a kill or a read of the end already did.
        let weak = Arc::downgrade(&agents);
        ctx.on(move |e: &JobDone| {
            let Some(owner) = e.job.owner.as_deref() else {
                return;
            };
            let Some(agent) = weak.upgrade().and_then(|a| a.get(owner)) else {
                return;
            };
            if !e.job.take_unreported() {
                return;
            }
            let snapshot = e.job.snapshot();
            let mut notice = Message::user_text(format!(
                "Background job {} ({}: {}) finished {}. Read its output with job_output.",
                snapshot.id,
                snapshot.kind,
                snapshot.label,
                snapshot.status_line()
            ));
            notice.source = MessageSource::of(JOB_SETTLED_SOURCE);
            // A woken turn may start the job whose end wakes it again:
            // past MAX_NOTICE_WAKES notices since the user last spoke, an
            // idle owner is not woken; the notice waits for its next turn.
            let delivered = if agent.is_idle() && notices_since_user(&agent) >= MAX_NOTICE_WAKES {
                agent.inject(notice)
            } else {
                agent.steer(notice)
            };
            if delivered.is_err() {
                tracing::debug!(job = %snapshot.id, "the owner no longer takes notices");
            }
        })?;
        Ok(agents)
    }

    /// The agent with `id` (awake or hibernated).
    pub fn get(&self, id: &str) -> Option<Agent> {
        lock(&self.live).get(id).cloned()
    }

    /// Ids of the agents, sorted.
    pub fn ids(&self) -> Vec<String> {
        lock(&self.live).keys().map(|k| k.to_string()).collect()
    }

    /// Every agent, awake or not, in the order they were created (by their
    /// sessions' creation time, then their tree nodes).
    pub fn in_creation_order(&self) -> Vec<Agent> {
        let mut all: Vec<Agent> = lock(&self.live).values().cloned().collect();
        all.sort_by_key(|a| (a.session().header().created_at, a.node_id()));
        all
    }

    /// How many agents are awake.
    pub fn awake_count(&self) -> usize {
        lock(&self.awake).len()
    }

    /// How many agents there are, awake or not.
    pub fn count(&self) -> usize {
        lock(&self.live).len()
    }

    /// The hibernation policy.
    pub fn policy(&self) -> &Hibernation {
        &self.policy
    }

    /// Waits until the keeper has handled everything asked of it so far
    /// (wakes, evictions), up to `timeout`; at once without a keeper.
    pub async fn settled(&self, timeout: Duration) -> Result<(), KeeperUnanswered> {
        let Some(keeper) = self.keeper.get() else {
            return Ok(());
        };
        keeper
            .call(KeeperMsg::Ping, timeout)
            .await
            .map_err(|e| KeeperUnanswered(chain(&e).to_string()))
    }

    /// Backpressure on creation: with far more agents awake than the cap
    /// (twice as many), a new agent waits until the keeper has put a batch
    /// to sleep, so memory stays bounded however fast agents are made.
    pub(super) async fn admit_one_more(&self) {
        let Some(cap) = self.policy.max_awake else {
            return;
        };
        if self.awake_count() > cap.saturating_mul(2).max(cap + 8) {
            self.over_cap(usize::MAX);
            if let Err(e) = self.settled(Duration::from_secs(30)).await {
                tracing::warn!("creating an agent over the awake cap: {}", chain(&e));
            }
        }
    }

    pub(super) fn has_keeper(&self) -> bool {
        self.keeper.get().is_some()
    }

    /// The next value of the use clock.
    pub(super) fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed) + 1
    }

    pub(super) fn admit(&self, agent: &Agent) {
        lock(&self.live).insert(agent.inner.id.clone(), agent.clone());
    }

    pub(super) fn leave(&self, agent: &Agent) {
        lock(&self.live).remove(&*agent.inner.id);
        lock(&self.awake).remove(&agent.key());
    }

    pub(super) fn woke(&self, agent: &Agent) {
        let awake = {
            let mut set = lock(&self.awake);
            set.insert(agent.key(), agent.downgrade());
            set.len()
        };
        self.over_cap(awake);
    }

    pub(super) fn slept(&self, agent: &Agent) {
        lock(&self.awake).remove(&agent.key());
    }

    /// An agent finished its work.
    pub(super) fn idled(&self) {
        let awake = lock(&self.awake).len();
        self.over_cap(awake);
    }

    fn over_cap(&self, awake: usize) {
        let Some(cap) = self.policy.max_awake else {
            return;
        };
        if awake > cap
            && !self.evicting.swap(true, Ordering::AcqRel)
            && let Some(k) = self.keeper.get()
            && k.send(KeeperMsg::Evict).is_err()
        {
            self.evicting.store(false, Ordering::Release);
        }
    }

    /// Asks the keeper to wake `agent`; false when no keeper runs.
    pub(super) fn ask_wake(&self, agent: Agent) -> bool {
        self.keeper
            .get()
            .is_some_and(|k| k.send(KeeperMsg::Wake(agent)).is_ok())
    }

    fn awake_agents(&self) -> Vec<Agent> {
        lock(&self.awake)
            .values()
            .filter_map(WeakAgent::upgrade)
            .collect()
    }

    /// Hibernates the least recently used idle agents while more than the
    /// cap are awake.
    async fn evict(&self) {
        self.evicting.store(false, Ordering::Release);
        let Some(cap) = self.policy.max_awake else {
            return;
        };
        let all = self.awake_agents();
        if all.len() <= cap {
            return;
        }
        // Down to an eighth below the cap: one pass puts a batch to sleep
        // (concurrently), instead of one agent per agent created.
        let excess = all.len() - cap.saturating_sub(cap / 8);
        // Fresh agents are still being set up by their creator.
        let mut idle: Vec<(u64, Agent)> = all
            .into_iter()
            .filter(|a| {
                let fresh = a.inbox().fresh;
                !fresh && a.awake_reason().is_none()
            })
            .map(|a| (a.inner.used.load(Ordering::Relaxed), a))
            .collect();
        if idle.len() > excess {
            idle.select_nth_unstable_by_key(excess - 1, |(used, _)| *used);
            idle.truncate(excess);
        }
        sleep_all(idle.into_iter().map(|(_, a)| a)).await;
    }

    /// Hibernates the agents idle for longer than the idle time.
    async fn expire(&self) {
        let Some(after) = self.policy.idle_ms else {
            return;
        };
        let now = now_ms();
        let expired = self.awake_agents().into_iter().filter(|agent| {
            let used = agent.inner.used_ms.load(Ordering::Relaxed);
            now.saturating_sub(used) >= after && agent.awake_reason().is_none()
        });
        sleep_all(expired).await;
    }

    /// How often the idle time is checked.
    fn period(&self) -> Option<Duration> {
        let after = self.policy.idle_ms?;
        Some(Duration::from_millis((after / 2).clamp(10, 60_000)))
    }
}

/// Hibernates `agents` concurrently (each waits mostly on its own actors
/// stopping); one that cannot sleep now stays awake.
async fn sleep_all(agents: impl Iterator<Item = Agent>) {
    let runs = agents.map(|agent| async move {
        if let Err(why) = agent.hibernate().await {
            tracing::debug!(agent = %agent.id(), "stays awake: {why}");
        }
    });
    futures::future::join_all(runs).await;
}

pub(super) enum KeeperMsg {
    /// Input reached a hibernated agent.
    Wake(Agent),
    /// More agents are awake than the cap allows.
    Evict,
    /// Time to look for agents idle too long.
    Tick,
    /// Answers once everything sent before it is handled.
    Ping(ractor::RpcReplyPort<()>),
}

// Local only: a keeper is never reached from another node.
impl ractor::Message for KeeperMsg {}

/// The source of the message telling an agent one of its background jobs
/// ended.
pub const JOB_SETTLED_SOURCE: &str = "job-settled";

/// Job notices since the user's last message past which an idle agent is
/// no longer woken for one.
pub const MAX_NOTICE_WAKES: usize = 3;

/// How many job notices the agent got since the user's last message.
fn notices_since_user(agent: &Agent) -> usize {
    agent
        .session()
        .events()
        .iter()
        .rev()
        .filter_map(|e| match &e.data {
            EventData::UserMessage(m) => Some(m.source.kind.as_ref()),
            _ => None,
        })
        .take_while(|kind| *kind != "user")
        .filter(|kind| *kind == JOB_SETTLED_SOURCE)
        .count()
}

/// The keeper actor. It holds the registry weakly: the registry (the
/// service) owns it, not the other way round.
struct Keeper;

impl Actor for Keeper {
    type Msg = KeeperMsg;
    type State = std::sync::Weak<Agents>;
    type Arguments = std::sync::Weak<Agents>;

    async fn pre_start(
        &self,
        _me: ActorRef<KeeperMsg>,
        agents: std::sync::Weak<Agents>,
    ) -> Result<std::sync::Weak<Agents>, ActorProcessingErr> {
        Ok(agents)
    }

    async fn post_start(
        &self,
        me: ActorRef<KeeperMsg>,
        agents: &mut std::sync::Weak<Agents>,
    ) -> Result<(), ActorProcessingErr> {
        if let Some(period) = agents.upgrade().and_then(|a| a.period()) {
            me.send_after(period, || KeeperMsg::Tick);
        }
        Ok(())
    }

    async fn handle(
        &self,
        me: ActorRef<KeeperMsg>,
        msg: KeeperMsg,
        agents: &mut std::sync::Weak<Agents>,
    ) -> Result<(), ActorProcessingErr> {
        let Some(agents) = agents.upgrade() else {
            return Ok(());
        };
        match msg {
            KeeperMsg::Wake(agent) => {
                if let Err(e) = agent.wake().await {
                    // It cannot run any more: its input is refused and it
                    // is disposed (writing what it holds), not left parked.
                    agent.abandon(&chain(&e).to_string());
                    agent.dispose().await;
                }
            }
            KeeperMsg::Evict => agents.evict().await,
            KeeperMsg::Ping(reply) => {
                let _ = reply.send(());
            }
            KeeperMsg::Tick => {
                agents.expire().await;
                if let Some(period) = agents.period() {
                    me.send_after(period, || KeeperMsg::Tick);
                }
            }
        }
        Ok(())
    }
}
