//! The default plugin catalogue: every plugin a `cordis.yml` may name.

use std::sync::Arc;

use dsh_supervisors::{BoxError, Catalogue, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

/// Config of the `value` plugin.
#[derive(Debug, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ValueConfig {
    /// The capability name to provide (e.g. `settings`).
    pub service: String,
    /// The JSON value consumers get.
    #[serde(default)]
    pub value: serde_json::Value,
}

/// Provides a constant JSON value as a service: shared settings that other
/// plugins inject by name.
pub struct Value;

impl Plugin for Value {
    type Config = ValueConfig;

    fn name(&self) -> &str {
        "value"
    }

    async fn apply(&self, ctx: Context, config: Arc<ValueConfig>) -> Result<(), BoxError> {
        if config.service.trim().is_empty() {
            return Err("`service` must name a capability".into());
        }
        ctx.provide(&config.service, Arc::new(config.value.clone()))?;
        Ok(())
    }
}

/// The catalogue `dsh` boots `cordis.yml` against.
pub fn default_catalogue() -> Catalogue {
    let mut c = Catalogue::new();
    c.register("value", || Value);
    c
}
