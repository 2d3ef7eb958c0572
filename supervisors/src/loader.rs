//! Booting a [`Plan`] into fibers, reloading it entry by entry, and watching
//! its files.
//!
//! Every entry runs as a child fiber of one host fiber (`config/<file>`);
//! a group is a fiber whose children are its entries. A reload starts from a
//! fully validated new plan (an invalid file changes nothing), then disposes
//! removed entries, replaces changed ones and starts added ones. A changed
//! entry whose new config fails to start is rolled back to the previous
//! config and the report says why.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};

use crate::config::{ConfigError, Plan, PlannedEntry, Source, diff};
use crate::error::Error;
use crate::error::Result;
use crate::error::chain;
use crate::runtime::Runtime;
use crate::runtime::context::{Context, Fiber, PluginOptions, WorkerSpec};
use crate::runtime::plugin::{Catalogue, Group};

/// Why a config could not be booted.
#[derive(Debug, thiserror::Error)]
pub enum BootError {
    /// The files are invalid (every problem listed); nothing was started.
    /// Fatal until the files change.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The kernel refused to start the host fiber (the runtime is shutting
    /// down). Fatal for this runtime.
    #[error(transparent)]
    Kernel(#[from] Error),
}

/// What a reload did.
#[derive(Debug, Default)]
pub struct ReloadReport {
    /// The new files were invalid; nothing changed.
    pub rejected: Option<ConfigError>,
    /// Entries stopped, started or replaced.
    pub applied: Vec<String>,
    /// Entries whose new config failed to start, with the reason; they run
    /// their previous config again.
    pub rolled_back: Vec<(String, String)>,
    /// Entries that failed to start and had nothing to roll back to.
    pub failed: Vec<(String, String)>,
}

/// A booted config: its plan and the fibers running it.
#[derive(Clone)]
pub struct Loader {
    inner: Arc<Inner>,
}

struct Inner {
    rt: Runtime,
    catalogue: Catalogue,
    source: Source,
    host: Fiber,
    state: tokio::sync::Mutex<State>,
}

struct State {
    plan: Plan,
    running: HashMap<String, Fiber>,
}

impl Loader {
    /// Validates the source and starts every enabled entry under a host
    /// fiber. Returns the loader and the entries that failed to start.
    pub async fn boot(
        rt: &Runtime,
        catalogue: Catalogue,
        source: Source,
    ) -> std::result::Result<(Loader, Vec<(String, String)>), BootError> {
        let plan = source.plan(&catalogue)?;
        let file = source
            .base
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_else(|| "cordis.yml".into());
        let host = rt
            .root()
            .plugin_with(
                Group,
                (),
                PluginOptions {
                    name: Some(format!("config/{file}")),
                    ..PluginOptions::default()
                },
            )
            .await?;
        let loader = Loader {
            inner: Arc::new(Inner {
                rt: rt.clone(),
                catalogue,
                source,
                host,
                state: tokio::sync::Mutex::new(State {
                    plan: plan.clone(),
                    running: HashMap::new(),
                }),
            }),
        };
        let mut failures = Vec::new();
        {
            let mut state = loader.inner.state.lock().await;
            let host_ctx = loader.inner.host.context();
            for entry in &plan.entries {
                start_tree(&host_ctx, entry, &mut state.running, &mut failures).await;
            }
        }
        Ok((loader, failures))
    }

    /// The host fiber every entry runs under.
    pub fn host(&self) -> &Fiber {
        &self.inner.host
    }

    /// The plan currently applied.
    pub async fn plan(&self) -> Plan {
        self.inner.state.lock().await.plan.clone()
    }

    /// The fiber running entry `id`, if it runs.
    pub async fn fiber(&self, id: &str) -> Option<Fiber> {
        self.inner.state.lock().await.running.get(id).cloned()
    }

    /// Re-reads the files and applies what changed.
    pub async fn reload(&self) -> ReloadReport {
        let mut report = ReloadReport::default();
        let new_plan = match self.inner.source.plan(&self.inner.catalogue) {
            Ok(p) => p,
            Err(e) => {
                tracing::error!(
                    "config reload rejected, keeping the running config:\n{}",
                    chain(&e)
                );
                report.rejected = Some(e);
                return report;
            }
        };
        let mut state = self.inner.state.lock().await;
        let d = diff(&state.plan, &new_plan);
        let mut effective = new_plan.clone();
        for id in &d.removed {
            if let Some(f) = state.running.remove(id) {
                f.dispose().await;
                report.applied.push(id.clone());
            }
        }
        for id in &d.changed {
            let (Some(old), Some(new)) = (
                find(&state.plan.entries, id).cloned(),
                find(&new_plan.entries, id).cloned(),
            ) else {
                continue;
            };
            stop_entry(&mut state.running, &old).await;
            let Some(parent) = self.parent_ctx(&state, &new_plan, id) else {
                continue;
            };
            let mut failures = Vec::new();
            start_tree(&parent, &new, &mut state.running, &mut failures).await;
            if failures.is_empty() {
                report.applied.push(id.clone());
                continue;
            }
            // Roll back: stop what the new config started, start the old one.
            stop_entry(&mut state.running, &new).await;
            let mut again = Vec::new();
            start_tree(&parent, &old, &mut state.running, &mut again).await;
            let reason = failures
                .iter()
                .map(|(i, r)| format!("{i}: {r}"))
                .collect::<Vec<_>>()
                .join("; ");
            tracing::error!(entry = %id, reason, "new config failed to start; rolled back");
            replace(&mut effective.entries, id, old);
            report.rolled_back.push((id.clone(), reason));
            report.failed.extend(again);
        }
        for id in &d.added {
            let Some(new) = find(&new_plan.entries, id).cloned() else {
                continue;
            };
            if state.running.contains_key(id) {
                continue; // started with its group
            }
            let Some(parent) = self.parent_ctx(&state, &new_plan, id) else {
                continue;
            };
            let mut failures = Vec::new();
            start_tree(&parent, &new, &mut state.running, &mut failures).await;
            if failures.is_empty() {
                report.applied.push(id.clone());
            } else {
                report.failed.extend(failures);
            }
        }
        state.plan = effective;
        report
    }

    fn parent_ctx(&self, state: &State, plan: &Plan, id: &str) -> Option<Context> {
        let parent = plan.flatten().into_iter().find(|(e, _)| e.id == id)?.1;
        match parent {
            None => Some(self.inner.host.context()),
            Some(group) => state.running.get(group).map(Fiber::context),
        }
    }

    /// Starts a watcher (a worker under the host fiber) that reloads when one
    /// of the source files changes.
    pub async fn watch(&self) -> Result<()> {
        let dirs: Vec<PathBuf> = self
            .inner
            .source
            .files()
            .iter()
            .map(|f| match f.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            })
            .collect();
        let files: Vec<PathBuf> = self
            .inner
            .source
            .files()
            .iter()
            .map(|f| std::fs::canonicalize(f).unwrap_or_else(|_| f.to_path_buf()))
            .collect();
        let spec = WorkerSpec::new(
            "watcher",
            "config/watch",
            Watcher {
                loader: self.clone(),
            },
            (dirs, files),
        );
        self.inner.host.context().spawn(spec).await?;
        Ok(())
    }

    /// The runtime this loader belongs to.
    pub fn runtime(&self) -> &Runtime {
        &self.inner.rt
    }
}

fn find<'a>(entries: &'a [PlannedEntry], id: &str) -> Option<&'a PlannedEntry> {
    for e in entries {
        if e.id == id {
            return Some(e);
        }
        if let Some(found) = find(&e.group, id) {
            return Some(found);
        }
    }
    None
}

fn replace(entries: &mut [PlannedEntry], id: &str, with: PlannedEntry) -> bool {
    for e in entries.iter_mut() {
        if e.id == id {
            *e = with;
            return true;
        }
        if replace(&mut e.group, id, with.clone()) {
            return true;
        }
    }
    false
}

/// Disposes the fiber of `entry` (a group's children go with it) and
/// forgets all of them.
async fn stop_entry(running: &mut HashMap<String, Fiber>, entry: &PlannedEntry) {
    if let Some(f) = running.remove(&entry.id) {
        f.dispose().await;
    }
    forget_children(running, entry);
}

fn forget_children(running: &mut HashMap<String, Fiber>, entry: &PlannedEntry) {
    for child in &entry.group {
        running.remove(&child.id);
        forget_children(running, child);
    }
}

/// Starts `entry` (and a group's children) under `parent`.
fn start_tree<'a>(
    parent: &'a Context,
    entry: &'a PlannedEntry,
    running: &'a mut HashMap<String, Fiber>,
    failures: &'a mut Vec<(String, String)>,
) -> futures::future::BoxFuture<'a, ()> {
    Box::pin(async move {
        if entry.disabled {
            return;
        }
        let options = PluginOptions {
            name: Some(if entry.is_group() {
                format!("group/{}", entry.id)
            } else if entry.id == entry.plugin {
                format!("plugin/{}", entry.plugin)
            } else {
                format!("plugin/{}#{}", entry.plugin, entry.id)
            }),
            ..PluginOptions::default()
        };
        let started = match (&entry.entry, &entry.valid) {
            (Some(cat), Some(valid)) => {
                parent
                    .load_validated(cat.instantiate(), valid.clone(), options)
                    .await
            }
            _ => parent.plugin_with(Group, (), options).await,
        };
        match started {
            Ok(fiber) if fiber.status() == crate::tree::Status::Failed => {
                let reason = fiber.error().unwrap_or_else(|| "failed".to_owned());
                // Leave nothing half-started behind.
                fiber.dispose().await;
                failures.push((entry.id.clone(), reason));
            }
            Ok(fiber) => {
                let ctx = fiber.context();
                running.insert(entry.id.clone(), fiber);
                for child in &entry.group {
                    start_tree(&ctx, child, running, failures).await;
                }
            }
            Err(e) => failures.push((entry.id.clone(), chain(&e).to_string())),
        }
    })
}

/// Reloads on file changes. Holds the OS watcher; stopping the actor stops it.
struct Watcher {
    loader: Loader,
}

enum WatchMsg {
    Changed,
}

// Local only: never sent to another node.
impl ractor::Message for WatchMsg {}

impl Actor for Watcher {
    type Msg = WatchMsg;
    type State = notify::RecommendedWatcher;
    type Arguments = (Vec<PathBuf>, Vec<PathBuf>);

    async fn pre_start(
        &self,
        myself: ActorRef<WatchMsg>,
        (dirs, files): (Vec<PathBuf>, Vec<PathBuf>),
    ) -> std::result::Result<notify::RecommendedWatcher, ActorProcessingErr> {
        use notify::Watcher as _;
        let mut watcher =
            notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
                let Ok(event) = event else { return };
                if !(event.kind.is_modify() || event.kind.is_create()) {
                    return;
                }
                let relevant = event.paths.iter().any(|p| {
                    let p = std::fs::canonicalize(p).unwrap_or_else(|_| p.clone());
                    files.contains(&p)
                });
                if relevant {
                    // Fails only once the watcher actor is gone.
                    let _ = myself.send_message(WatchMsg::Changed);
                }
            })?;
        for dir in dirs {
            watcher.watch(&dir, notify::RecursiveMode::NonRecursive)?;
        }
        Ok(watcher)
    }

    async fn handle(
        &self,
        _myself: ActorRef<WatchMsg>,
        WatchMsg::Changed: WatchMsg,
        _state: &mut notify::RecommendedWatcher,
    ) -> std::result::Result<(), ActorProcessingErr> {
        let report = self.loader.reload().await;
        if !report.applied.is_empty() || !report.rolled_back.is_empty() {
            tracing::info!(applied = ?report.applied, rolled_back = ?report.rolled_back, "config reloaded");
        }
        Ok(())
    }
}
