//! Tools: definitions, the scoped registry, and the guarded pipeline.
//!
//! A call goes, in this exact order: resolve (`UNKNOWN_TOOL` when absent or
//! filtered) → parse and validate arguments against the tool's JSON Schema
//! (`INVALID_ARGS`) → `tools/pre-execute` waterfall (allow / deny / ask;
//! ask goes to the approval seam, which fails closed) → guards (`tools/guard`,
//! bail: the first denial wins) → `tools/execute` waterfall around the body
//! (timeout, cancellation, a panic becoming an error) → `tools/post-execute`
//! waterfall → the definition's `finalize_content` → `tools/result` (emit).
//! Every failure along the way is an `is_error` result; the turn goes on.

pub mod builtin;
pub mod guidance;
mod pipeline;
mod registry;
pub mod spill;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_supervisors::Context;
use dsh_supervisors::error::chain;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::llm::{ContentBlock, ToolSchema};
use crate::sandbox::Policy;

pub use pipeline::{
    Decision, PipelineOutcome, PostExecute, PreExecute, ToolExecute, ToolGuard, ToolResultEvent,
    run_pipeline,
};
pub use registry::{RegisteredTool, Resolution, Restriction, ToolRegistry};
pub use spill::SpillStore;

/// One requested invocation, as the model produced it.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// Call id.
    pub id: String,
    /// Tool name.
    pub name: String,
    /// Raw JSON arguments.
    pub arguments: String,
}

/// What a call with raw `arguments` does, for a person: its telling
/// argument (the command, path, pattern, URL, query, prompt or task) when
/// the arguments are an object that has one, else the arguments as they
/// are. Raw text: whoever shows it makes it inert and cuts it.
pub fn telling_argument(arguments: &str) -> std::borrow::Cow<'_, str> {
    const TELLING: [&str; 8] = [
        "command",
        "file_path",
        "path",
        "pattern",
        "url",
        "query",
        "prompt",
        "task",
    ];
    let parsed: Option<serde_json::Value> = serde_json::from_str(arguments).ok();
    match parsed
        .as_ref()
        .and_then(|v| TELLING.iter().find_map(|k| v.get(*k)?.as_str()))
    {
        Some(text) => std::borrow::Cow::Owned(text.to_owned()),
        None => std::borrow::Cow::Borrowed(arguments),
    }
}

/// The parameter schema of a tool whose arguments are the struct `T`
/// (`#[derive(Deserialize, JsonSchema)]`): an object schema with its
/// `properties` (each described by its field's doc comment) and `required`
/// (the fields that are not `Option` and have no default), inlined, with no
/// `$schema`, title or struct description. An `Option` field is optional,
/// not nullable: a `null` is refused as it would be for a missing type.
/// The one source of a tool's parameters: the schema the model sees, the
/// validation the pipeline runs and the struct the body parses agree.
pub fn parameters<T: schemars::JsonSchema>() -> Value {
    let mut settings = schemars::generate::SchemaSettings::draft2020_12();
    settings.inline_subschemas = true;
    settings.meta_schema = None;
    let schema = settings.into_generator().into_root_schema_for::<T>();
    let mut value = Value::from(schema);
    if let Some(root) = value.as_object_mut() {
        root.remove("title");
        root.remove("description");
        // A tool without arguments still names its (empty) properties:
        // some providers refuse an object schema without them.
        root.entry("properties")
            .or_insert_with(|| Value::Object(Default::default()));
    }
    model_facing(&mut value);
    value
}

/// Drops what generated schemas carry and models are not served: `null` as
/// an alternative type (an optional field is omitted, not null), numeric
/// `format`s, and `default: null`; a description taken from a doc comment
/// has its lines joined as rustdoc joins them (paragraphs stay apart).
fn model_facing(v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(text)) = map.get_mut("description") {
                *text = text
                    .split("\n\n")
                    .map(|p| p.split('\n').map(str::trim).collect::<Vec<_>>().join(" "))
                    .collect::<Vec<_>>()
                    .join("\n\n");
            }
            if let Some(Value::Array(types)) = map.get("type") {
                let kept: Vec<Value> = types.iter().filter(|t| *t != "null").cloned().collect();
                if kept.len() == 1 {
                    map.insert("type".into(), kept[0].clone());
                } else {
                    map.insert("type".into(), Value::Array(kept));
                }
            }
            if let Some(Value::Array(branches)) = map.get("anyOf") {
                let kept: Vec<Value> = branches
                    .iter()
                    .filter(|b| b.get("type").is_none_or(|t| t != "null"))
                    .cloned()
                    .collect();
                if let [only] = kept.as_slice()
                    && let Value::Object(inner) = only.clone()
                {
                    map.remove("anyOf");
                    for (k, val) in inner {
                        map.entry(k).or_insert(val);
                    }
                }
            }
            // A unit-variant enum (`oneOf` of `const`s): one `enum`, as
            // models are served it; the field's description says what each
            // value means.
            let consts: Option<Vec<Value>> = map
                .get("oneOf")
                .and_then(Value::as_array)
                .and_then(|bs| bs.iter().map(|b| b.get("const").cloned()).collect());
            if let Some(values) = consts.filter(|v| v.iter().all(Value::is_string)) {
                map.remove("oneOf");
                map.insert("type".into(), "string".into());
                map.insert("enum".into(), Value::Array(values));
            }
            let numeric = map.get("format").and_then(Value::as_str).is_some_and(|f| {
                f.starts_with("int") || f.starts_with("uint") || f == "double" || f == "float"
            });
            if numeric {
                map.remove("format");
            }
            if map.get("default").is_some_and(Value::is_null) {
                map.remove("default");
            }
            for child in map.values_mut() {
                model_facing(child);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(model_facing),
        _ => {}
    }
}

/// What a tool body receives.
#[derive(Clone)]
pub struct ToolContext {
    /// The call id.
    pub call_id: String,
    /// Validated arguments.
    pub args: Value,
    /// Fires when the call is cancelled (turn cancelled, agent disposed, timeout).
    pub cancel: CancellationToken,
    /// The calling agent's scoped context.
    pub ctx: Context,
    /// The workspace root the tool works in.
    pub cwd: Arc<PathBuf>,
    /// How far this call may reach: the calling agent's policy, or the
    /// unconfined one when the user approved this call's escalation.
    pub policy: Policy,
}

/// Where a call works and how far it may reach: the workspace and the
/// calling agent's standing policy.
#[derive(Clone, Debug)]
pub struct Bounds {
    /// The workspace root.
    pub cwd: Arc<PathBuf>,
    /// The agent's policy.
    pub policy: Policy,
}

impl Bounds {
    /// `cwd` under the default policy (`workspace-write`, network on).
    pub fn workspace(cwd: impl Into<PathBuf>) -> Bounds {
        Bounds {
            cwd: Arc::new(cwd.into()),
            policy: Policy::default(),
        }
    }
}

/// The two parameters a tool that may run beyond the sandbox takes
/// (`#[serde(flatten)]` into its argument struct). The pipeline reads them
/// before the body runs: a mode wider than the agent's asks the approval
/// seam, and only an approval runs the call under it.
#[derive(Debug, Default, serde::Deserialize, schemars::JsonSchema)]
pub struct Escalation {
    /// Run this one call under a wider permission mode than yours, once
    /// the user approves (give a `justification`): `workspace-write` to
    /// change the workspace from read-only, `danger-full-access` for
    /// anything outside it. Leave it out to run under your own mode.
    #[serde(default)]
    pub sandbox_permissions: Option<SandboxPermissions>,
    /// Why this call needs the wider mode, shown to the user who approves
    /// it (required with `sandbox_permissions`).
    #[serde(default)]
    pub justification: Option<String>,
}

/// The wider mode one call asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxPermissions {
    /// Writes in the workspace.
    WorkspaceWrite,
    /// No confinement.
    DangerFullAccess,
}

impl ToolContext {
    /// The arguments as the tool's argument struct (the pipeline has
    /// validated them against [`parameters`] of the same struct).
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, ToolError> {
        T::deserialize(&self.args)
            .map_err(|e| ToolError::new("INVALID_ARGS", chain(&e).to_string()))
    }
}

/// A tool body's result.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolOutput {
    /// Model-facing content.
    pub content: Vec<ContentBlock>,
    /// Tool-private presentation data (JSON).
    pub meta: Option<Value>,
}

impl ToolOutput {
    /// A single text block.
    pub fn text(text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            content: vec![ContentBlock::text(text)],
            meta: None,
        }
    }
}

/// A failed call: a stable code and a message for the model. It becomes an
/// error result the model reads; whether a retry helps is the model's to
/// judge from the code (`INVALID_ARGS`: fix the arguments; `TIMEOUT`,
/// `FAILED`: maybe; `DENIED`, `UNKNOWN_TOOL`: not as it is).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct ToolError {
    /// `UNKNOWN_TOOL`, `INVALID_ARGS`, `DENIED`, `TIMEOUT`, `ABORTED`,
    /// `PANICKED`, `FAILED`, or a tool-specific code.
    pub code: String,
    /// What happened, for the model.
    pub message: String,
}

impl ToolError {
    /// A failure with `code`.
    pub fn new(code: &str, message: impl Into<String>) -> ToolError {
        ToolError {
            code: code.to_owned(),
            message: message.into(),
        }
    }

    /// A generic execution failure.
    pub fn failed(message: impl Into<String>) -> ToolError {
        ToolError::new("FAILED", message)
    }
}

/// A tool definition.
pub trait Tool: Send + Sync + 'static {
    /// The model-facing schema (name, description, JSON Schema of arguments).
    fn schema(&self) -> ToolSchema;

    /// What the system prompt says about using this tool well: one short
    /// paragraph, or nothing. The [`guidance`] section lists it for every
    /// agent that can see the tool.
    fn guidance(&self) -> Option<&'static str> {
        None
    }

    /// Whether a call may ask to run beyond the sandbox (its arguments
    /// flatten [`Escalation`] in).
    fn escalates(&self) -> bool {
        false
    }

    /// Whether calls may run in parallel with other calls of the same step.
    /// Only an exact `true` allows it.
    fn is_concurrency_safe(&self) -> bool {
        false
    }

    /// Longest a call may run before it is cancelled with `TIMEOUT`.
    fn timeout(&self) -> Option<Duration> {
        None
    }

    /// How long a cancelled call may take to clean up. `None` (the default):
    /// the body is dropped the moment the call is cancelled. `Some(grace)`:
    /// the body sees `cx.cancel`, stops what it started (children, runs,
    /// records) and returns; it is dropped only if it takes longer than
    /// `grace`. The call's result is `ABORTED` either way.
    fn cancel_grace(&self) -> Option<Duration> {
        None
    }

    /// Whether this call may run under the calling agent's `policy`,
    /// decided before the body runs (after the `tools/pre-execute`
    /// listeners): [`Decision::Deny`] refuses it, [`Decision::Ask`] puts it
    /// to the approval seam and only an `allowed-once` answer runs it. The
    /// built-in tools allow here and confine themselves (they read
    /// `cx.policy`, or run under the sandbox); a tool written by an
    /// embedder decides from the effects it declares.
    fn decide(&self, _policy: &Policy, _args: &Value) -> Decision {
        Decision::Allow
    }

    /// The body.
    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>>;

    /// Last content-only transform of a successful result.
    fn finalize_content(&self, output: ToolOutput) -> ToolOutput {
        output
    }
}
