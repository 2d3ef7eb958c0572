//! Plugins: the unit a fiber runs, and the compiled-in catalogue `cordis.yml` names.

use std::any::Any;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use schemars::JsonSchema;
use serde::de::DeserializeOwned;

use crate::error::BoxError;
use crate::error::Error;
use crate::runtime::context::{Context, Fiber, PluginOptions, spawn_plugin_fiber};
use crate::runtime::fiber::LoadSpec;
use crate::tree::Status;

/// A plugin: configuration type, injected services and an `apply` body.
///
/// `apply` registers everything through `ctx` (effects, services, listeners,
/// child actors); all of it is undone, in reverse, when the fiber unloads.
/// The config is validated before `apply` runs, so a plugin never starts
/// half-configured.
pub trait Plugin: Send + Sync + 'static {
    /// The plugin's configuration (`config:` in `cordis.yml`).
    type Config: DeserializeOwned + JsonSchema + Send + Sync + 'static;

    /// Display name, used in the tree (`plugin/<name>`) and in errors.
    fn name(&self) -> &str;

    /// Services the plugin needs; it stays `pending` until all exist and is
    /// restarted when one of them is replaced.
    fn inject(&self) -> &[&'static str] {
        &[]
    }

    /// Starts the plugin. An `Err` (or a panic) leaves the fiber `failed`
    /// after undoing what it registered.
    fn apply(
        &self,
        ctx: Context,
        config: Arc<Self::Config>,
    ) -> impl Future<Output = Result<(), BoxError>> + Send;
}

/// A plugin with its type erased, as a fiber holds it.
pub(crate) trait ErasedPlugin: Send + Sync {
    fn name(&self) -> &str;
    fn inject(&self) -> &[&'static str];
    fn apply(
        &self,
        ctx: Context,
        config: Arc<dyn Any + Send + Sync>,
    ) -> BoxFuture<'_, Result<(), BoxError>>;
}

impl<P: Plugin> ErasedPlugin for P {
    fn name(&self) -> &str {
        Plugin::name(self)
    }
    fn inject(&self) -> &[&'static str] {
        Plugin::inject(self)
    }
    fn apply(
        &self,
        ctx: Context,
        config: Arc<dyn Any + Send + Sync>,
    ) -> BoxFuture<'_, Result<(), BoxError>> {
        match config.downcast::<P::Config>() {
            Ok(config) => Plugin::apply(self, ctx, config).boxed(),
            Err(_) => {
                let name = self.name().to_owned();
                async move { Err(format!("plugin `{name}` was given a config of another type").into()) }
                    .boxed()
            }
        }
    }
}

/// A plugin written as a closure, with no config (Cordis's `ctx.inject`).
pub struct FnPlugin<F> {
    name: String,
    inject: &'static [&'static str],
    body: F,
}

/// Makes a config-less plugin from a closure.
pub fn plugin_fn<F, Fut>(
    name: impl Into<String>,
    inject: &'static [&'static str],
    body: F,
) -> FnPlugin<F>
where
    F: Fn(Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    FnPlugin {
        name: name.into(),
        inject,
        body,
    }
}

impl<F, Fut> Plugin for FnPlugin<F>
where
    F: Fn(Context) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), BoxError>> + Send + 'static,
{
    type Config = ();

    fn name(&self) -> &str {
        &self.name
    }

    fn inject(&self) -> &[&'static str] {
        self.inject
    }

    fn apply(
        &self,
        ctx: Context,
        _config: Arc<()>,
    ) -> impl Future<Output = Result<(), BoxError>> + Send {
        (self.body)(ctx)
    }
}

/// A plugin that registers nothing: a fiber that only owns children
/// (config hosts and `group` entries).
pub struct Group;

impl Plugin for Group {
    type Config = ();

    fn name(&self) -> &str {
        "group"
    }

    async fn apply(&self, _ctx: Context, _config: Arc<()>) -> Result<(), BoxError> {
        Ok(())
    }
}

/// A config that passed validation, ready for `apply`.
#[derive(Clone)]
pub struct ValidConfig(pub(crate) Arc<dyn Any + Send + Sync>);

/// Why one config value did not validate.
#[derive(Debug, Clone, PartialEq)]
pub struct FieldError {
    /// Dotted path inside the entry's `config`, e.g. `retry.max_attempts`; empty for the whole value.
    pub path: String,
    /// What was wrong.
    pub reason: String,
}

/// One catalogue entry: how to validate a config and make the plugin.
pub(crate) trait CatalogueEntry: Send + Sync {
    fn validate(&self, config: serde_json::Value) -> Result<ValidConfig, FieldError>;
    fn instantiate(&self) -> Arc<dyn ErasedPlugin>;
    fn schema(&self) -> serde_json::Value;
}

struct Entry<P, F> {
    make: F,
    _plugin: std::marker::PhantomData<fn() -> P>,
}

impl<P: Plugin, F: Fn() -> P + Send + Sync> CatalogueEntry for Entry<P, F> {
    fn validate(&self, config: serde_json::Value) -> Result<ValidConfig, FieldError> {
        let parsed: P::Config =
            serde_path_to_error::deserialize(config).map_err(|e| FieldError {
                path: e.path().to_string().trim_start_matches('.').to_owned(),
                reason: e.inner().to_string(),
            })?;
        Ok(ValidConfig(Arc::new(parsed)))
    }

    fn instantiate(&self) -> Arc<dyn ErasedPlugin> {
        Arc::new((self.make)())
    }

    fn schema(&self) -> serde_json::Value {
        serde_json::to_value(schemars::schema_for!(P::Config)).unwrap_or_default()
    }
}

/// The plugins a `cordis.yml` may name, compiled into the binary.
#[derive(Clone, Default)]
pub struct Catalogue {
    entries: BTreeMap<String, Arc<dyn CatalogueEntry>>,
}

impl Catalogue {
    /// An empty catalogue.
    pub fn new() -> Catalogue {
        Catalogue::default()
    }

    /// Adds a plugin under `name`; `make` builds a fresh instance per load.
    pub fn register<P: Plugin>(
        &mut self,
        name: &str,
        make: impl Fn() -> P + Send + Sync + 'static,
    ) {
        self.entries.insert(
            name.to_owned(),
            Arc::new(Entry {
                make,
                _plugin: std::marker::PhantomData,
            }),
        );
    }

    /// Names known to the catalogue, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.entries.keys().map(String::as_str).collect()
    }

    /// The JSON schema of a plugin's config.
    pub fn schema(&self, name: &str) -> Option<serde_json::Value> {
        self.entries.get(name).map(|e| e.schema())
    }

    pub(crate) fn get(&self, name: &str) -> Option<&Arc<dyn CatalogueEntry>> {
        self.entries.get(name)
    }
}

/// Loading plugins (here, beside the trait, so that the context does not
/// need to know what a plugin is).
impl Context {
    /// Loads a plugin as a child fiber and waits until it settles (`active`,
    /// `pending` on missing services, or an error when `apply` failed).
    pub async fn plugin<P: Plugin>(
        &self,
        plugin: P,
        config: P::Config,
    ) -> crate::error::Result<Fiber> {
        self.plugin_with(plugin, config, PluginOptions::default())
            .await
    }

    /// [`Context::plugin`] with a name and a child policy.
    pub async fn plugin_with<P: Plugin>(
        &self,
        plugin: P,
        config: P::Config,
        options: PluginOptions,
    ) -> crate::error::Result<Fiber> {
        let load = LoadSpec {
            plugin: Arc::new(plugin),
            config: Arc::new(config),
        };
        self.load_erased(load, options).await
    }

    /// Loads a validated catalogue plugin; a failed `apply` still returns
    /// the (failed) fiber so the caller can dispose or inspect it.
    pub(crate) async fn load_validated(
        &self,
        plugin: Arc<dyn ErasedPlugin>,
        config: ValidConfig,
        options: PluginOptions,
    ) -> crate::error::Result<Fiber> {
        let load = LoadSpec {
            plugin,
            config: config.0,
        };
        let shared = spawn_plugin_fiber(self, load, options.policy, options.name).await?;
        let fiber = Fiber {
            shared,
            rt: self.runtime().clone(),
        };
        fiber.ready().await;
        Ok(fiber)
    }

    async fn load_erased(
        &self,
        load: LoadSpec,
        options: PluginOptions,
    ) -> crate::error::Result<Fiber> {
        let plugin = load.plugin.name().to_owned();
        let shared = spawn_plugin_fiber(self, load, options.policy, options.name).await?;
        let fiber = Fiber {
            shared,
            rt: self.runtime().clone(),
        };
        match fiber.ready().await {
            Status::Failed => Err(Error::PluginFailed {
                plugin,
                fiber: fiber.id(),
                reason: fiber.error().unwrap_or_else(|| "failed".to_owned()),
            }),
            _ => Ok(fiber),
        }
    }
}
