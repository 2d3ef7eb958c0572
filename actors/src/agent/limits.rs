//! What an agent may spend in all: turns, tokens and wall time. A child's
//! limits hang under its parent's: every token it spends is counted on its
//! own counter and on each ancestor's, so children running in parallel draw
//! on one counter for their subtree, and a parent's remaining budget bounds
//! its children's. The driver checks them before every step, and stops a
//! step that runs past the deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dsh_services::llm::{LlmFailure, code};
use tokio::time::Instant;

/// An agent's limits, shared with the limits of the agents below it.
#[derive(Clone, Debug)]
pub struct Limits(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// Whose limits these are, for the message (`agent definition
    /// `reviewer``).
    whose: String,
    turns: Option<u32>,
    tokens: Option<u64>,
    spent: AtomicU64,
    /// The turn number it first saw (0: none yet): a seeded log numbers its
    /// turns after the ones it holds.
    first_turn: std::sync::atomic::AtomicU32,
    deadline: Option<Instant>,
    timeout: Option<Duration>,
    parent: Option<Limits>,
}

/// Limits are the same when they are one counter.
impl PartialEq for Limits {
    fn eq(&self, other: &Limits) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Limits {
    /// New limits for `whose`, under `parent`'s: at most `turns` turns,
    /// `tokens` tokens (input and output) and `timeout` of wall time from
    /// now.
    pub fn new(
        whose: impl Into<String>,
        parent: Option<&Limits>,
        turns: Option<u32>,
        tokens: Option<u64>,
        timeout: Option<Duration>,
    ) -> Limits {
        Limits(Arc::new(Inner {
            whose: whose.into(),
            turns,
            tokens,
            spent: AtomicU64::new(0),
            first_turn: std::sync::atomic::AtomicU32::new(0),
            deadline: timeout.map(|t| Instant::now() + t),
            timeout,
            parent: parent.cloned(),
        }))
    }

    /// Counts `tokens` spent here and on every ancestor.
    pub fn charge(&self, tokens: u64) {
        let mut at = Some(self);
        while let Some(l) = at {
            // Saturating: a provider's huge count cannot wrap under a cap.
            let _ =
                l.0.spent
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
                        Some(s.saturating_add(tokens))
                    });
            at = l.0.parent.as_ref();
        }
    }

    /// Tokens counted here (this agent's and its descendants').
    pub fn spent(&self) -> u64 {
        self.0.spent.load(Ordering::Relaxed)
    }

    /// The earliest deadline of these limits and their ancestors'.
    pub fn deadline(&self) -> Option<Instant> {
        self.chain().filter_map(|l| l.0.deadline).min()
    }

    /// Why turn `turn` may not take another step, if it may not: a token
    /// budget spent (here or above: `BUDGET_EXHAUSTED`), a deadline passed
    /// (`TIMEOUT`), or, before its first step, a turn past the cap.
    pub fn refusal(&self, turn: u32, first_step: bool) -> Option<LlmFailure> {
        for l in self.chain() {
            if let Some(cap) = l.0.tokens
                && l.spent() >= cap
            {
                return Some(LlmFailure::new(
                    code::BUDGET_EXHAUSTED,
                    format!(
                        "the token budget of {} is spent: {} of {cap} tokens",
                        l.0.whose,
                        l.spent()
                    ),
                ));
            }
            if let (Some(at), Some(t)) = (l.0.deadline, l.0.timeout)
                && Instant::now() >= at
            {
                return Some(timed_out(&l.0.whose, t));
            }
        }
        let first =
            match self
                .0
                .first_turn
                .compare_exchange(0, turn, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => turn,
                Err(seen) => seen,
            };
        let taken = turn.saturating_sub(first) + 1;
        match self.0.turns {
            Some(cap) if first_step && taken > cap => Some(LlmFailure::new(
                code::BUDGET_EXHAUSTED,
                format!(
                    "{} may take {cap} turn{}; this is its turn {taken}",
                    self.0.whose,
                    if cap == 1 { "" } else { "s" }
                ),
            )),
            _ => None,
        }
    }

    /// Why a step stopped at the deadline: the limits that set it.
    pub fn timed_out(&self) -> LlmFailure {
        let earliest = self
            .chain()
            .filter(|l| l.0.deadline.is_some())
            .min_by_key(|l| l.0.deadline);
        match earliest {
            Some(l) => timed_out(&l.0.whose, l.0.timeout.unwrap_or_default()),
            None => timed_out(&self.0.whose, Duration::ZERO),
        }
    }

    fn chain(&self) -> impl Iterator<Item = &Limits> {
        std::iter::successors(Some(self), |l| l.0.parent.as_ref())
    }
}

fn timed_out(whose: &str, after: Duration) -> LlmFailure {
    LlmFailure::new(
        code::TIMEOUT,
        format!(
            "the wall-time budget of {whose} ran out ({} s)",
            after.as_secs_f64()
        ),
    )
}
