//! What the tree shows for an agent (turn, step, tokens, hibernated, what
//! pins it awake), computed when read, and when the tree is told it changed.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use dsh_supervisors::tree::now_ms;

use super::{Agent, Awake};

impl Agent {
    /// What the tree shows for the agent, computed when read (not kept as
    /// JSON per agent): turn, step (0 between turns), tokens spent, whether
    /// it hibernates, and between turns what keeps it from hibernating
    /// (`pinned`: registrations made in its scope after it was built).
    /// Once the agent is gone (its node stopped, kept in the tree's
    /// record), what stays: its id, tokens, label and group.
    pub(super) fn summary_fn(&self) -> Arc<dsh_supervisors::tree::SummaryFn> {
        let weak = self.downgrade();
        let id = self.inner.id.clone();
        let (tokens, spec) = (self.inner.tokens.clone(), self.inner.spec.clone());
        Arc::new(move || match weak.upgrade() {
            Some(agent) => agent.summary(),
            None => {
                let mut summary = serde_json::json!({
                    "agent": id,
                    "tokens": tokens.load(Ordering::Relaxed),
                });
                named(&mut summary, &spec);
                summary
            }
        })
    }

    pub(super) fn summary(&self) -> serde_json::Value {
        let progress = self.progress();
        let mut summary = serde_json::json!({
            "agent": self.inner.id,
            "turn": progress.turn,
            "step": progress.step,
            "tokens": progress.tokens,
        });
        if progress.hibernated {
            summary["hibernated"] = true.into();
        }
        named(&mut summary, &self.inner.spec);
        if let Some(me) = self.awake().filter(|_| !progress.running) {
            let fiber = me.scope.fiber();
            let settled = me.settled.get().map_or(0, |s| s.0);
            if fiber.effect_count() > settled {
                let mut labels = fiber.effects();
                let ad_hoc = labels.split_off(settled.min(labels.len()));
                summary["pinned"] = format!("ad hoc registrations: {}", ad_hoc.join(", ")).into();
            }
        }
        summary
    }
}

/// What people call the agent, in its summary: its label and group.
fn named(summary: &mut serde_json::Value, spec: &super::AgentSpec) {
    if let Some(label) = &spec.label {
        summary["label"] = label.as_str().into();
    }
    if let Some(group) = &spec.group {
        summary["group"] = group.as_str().into();
    }
    if let Some(definition) = &spec.definition {
        summary["definition"] = definition.as_str().into();
    }
}

/// Tells the tree the agent's summary changed (sent to the feed only while
/// someone watches it; the summary itself is computed when read).
pub(super) fn publish_progress(me: &Awake) {
    me.published_ms.store(now_ms(), Ordering::Relaxed);
    me.ctx
        .runtime()
        .tree()
        .summary_changed(me.scope.fiber().id());
}

/// The least time between two per-step summaries of one agent on the tree
/// feed (turn ends always go out; snapshots are always current): a viewer
/// cannot follow faster.
const STEP_SUMMARY_EVERY_MS: u64 = 100;

/// [`publish_progress`] at a step, at most every [`STEP_SUMMARY_EVERY_MS`].
pub(super) fn publish_step(me: &Awake) {
    if !me.ctx.runtime().tree().watched() {
        return;
    }
    let now = now_ms();
    if now.saturating_sub(me.published_ms.load(Ordering::Relaxed)) >= STEP_SUMMARY_EVERY_MS {
        publish_progress(me);
    }
}
