//! The `session-store` plugin: where sessions are kept (JSONL, zstd,
//! SQLite).

use std::path::PathBuf;
use std::sync::Arc;

use dsh_supervisors::{BoxError, Context, Plugin};
use schemars::JsonSchema;
use serde::Deserialize;

/// Config of the `session-store` plugin.
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SessionStoreConfig {
    /// `jsonl` (one directory per session) or `sqlite` (one database).
    pub backend: BackendName,
    /// The sessions directory (jsonl) or the database file (sqlite).
    /// Required: a default would follow the process's working directory.
    pub path: PathBuf,
    /// JSONL only: `none` (default) or `zstd`.
    #[serde(default)]
    pub compression: Option<CompressionName>,
}

/// A session store backend.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum BackendName {
    /// JSONL files.
    Jsonl,
    /// One SQLite database.
    Sqlite,
}

/// Encoding of JSONL transcripts.
#[derive(Debug, Clone, Copy, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CompressionName {
    /// Plain newline-delimited text.
    None,
    /// Zstandard frames.
    Zstd,
}

/// Provides the session store (`persistence`): agents created in its scope
/// without a store of their own write their sessions there.
pub struct SessionStore;

impl Plugin for SessionStore {
    type Config = SessionStoreConfig;

    fn name(&self) -> &str {
        "session-store"
    }

    async fn apply(&self, ctx: Context, config: Arc<SessionStoreConfig>) -> Result<(), BoxError> {
        use dsh_services::persistence::{
            Compression, JsonlStore, PERSISTENCE_SERVICE, SessionPersistence, SqliteStore,
        };
        let store: Arc<dyn SessionPersistence> = match (config.backend, config.compression) {
            (BackendName::Jsonl, compression) => Arc::new(
                JsonlStore::new(&config.path).with_compression(match compression {
                    Some(CompressionName::Zstd) => Compression::Zstd,
                    _ => Compression::None,
                }),
            ),
            (BackendName::Sqlite, Some(CompressionName::Zstd)) => {
                return Err("`compression: zstd` applies to the jsonl backend only".into());
            }
            (BackendName::Sqlite, _) => {
                let path = config.path.clone();
                // Opening creates the schema: file I/O, off the workers.
                Arc::new(tokio::task::spawn_blocking(move || SqliteStore::open(path)).await??)
            }
        };
        ctx.provide(PERSISTENCE_SERVICE, store)?;
        Ok(())
    }
}
