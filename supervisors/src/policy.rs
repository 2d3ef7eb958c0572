//! Supervision policies: what happens to a child when it stops, how long it
//! may take to stop, and how a fiber answers a failed child (strategy and
//! restart intensity). Plain data; the fiber applies them.

use std::time::Duration;

/// What happens to a child when it stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Restart {
    /// Always restarted.
    Permanent,
    /// Restarted only when it failed.
    Transient,
    /// Never restarted; its failure is reported.
    Temporary,
}

/// How long a child may take to stop gracefully before it is killed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shutdown {
    /// Killed at once, no drain.
    BrutalKill,
    /// Drained, awaited this long, then killed.
    Timeout(Duration),
    /// Awaited without a limit (the OTP default for supervisors; bound it
    /// through the budgets of the leaves).
    Infinity,
}

/// Supervisor strategy of a fiber over its children.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Strategy {
    /// Restart only the failed child.
    OneForOne,
    /// Stop every other child (reverse order) and restart all (start order).
    OneForAll,
    /// Stop the children started after the failed one, restart it and them.
    RestForOne,
}

/// A fiber's strategy and restart intensity.
#[derive(Clone, Copy, Debug)]
pub struct SupervisorSpec {
    /// Strategy.
    pub strategy: Strategy,
    /// Restarts allowed within `period`; one more and the fiber fails upward.
    pub intensity: u32,
    /// The sliding window for `intensity`.
    pub period: Duration,
}

impl Default for SupervisorSpec {
    fn default() -> Self {
        SupervisorSpec {
            strategy: Strategy::OneForOne,
            intensity: 3,
            period: Duration::from_secs(5),
        }
    }
}

/// Restart policy and shutdown budget of one child.
#[derive(Clone, Copy, Debug)]
pub struct ChildPolicy {
    /// Restart policy.
    pub restart: Restart,
    /// Shutdown budget.
    pub shutdown: Shutdown,
}

impl ChildPolicy {
    /// The default for workers: temporary, 5 s to drain.
    pub const WORKER: ChildPolicy = ChildPolicy {
        restart: Restart::Temporary,
        shutdown: Shutdown::Timeout(Duration::from_secs(5)),
    };
    /// The default for plugins: permanent, 60 s for the whole subtree.
    pub const PLUGIN: ChildPolicy = ChildPolicy {
        restart: Restart::Permanent,
        shutdown: Shutdown::Timeout(Duration::from_secs(60)),
    };
    /// The default for scopes: temporary, 60 s for the whole subtree.
    pub const SCOPE: ChildPolicy = ChildPolicy {
        restart: Restart::Temporary,
        shutdown: Shutdown::Timeout(Duration::from_secs(60)),
    };
}
