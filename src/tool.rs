//! Tools written in Rust: a typed argument struct (its JSON schema derived
//! with `schemars`), an async body, and the effects it has.
//!
//! ```
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use dsh::{CustomTool, Effect};
//!
//! /// What `lookup_order` takes.
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Lookup {
//!     /// The order's id.
//!     order: String,
//! }
//!
//! let lookup = CustomTool::builder("lookup_order", "Looks an order up by its id.")
//!     .effects([Effect::Reads])
//!     .run(|args: Lookup, _call| async move { Ok(format!("order {} shipped", args.order)) });
//! let dsh = dsh::Dsh::builder().model(dsh::Model::demo()).tool(lookup).start().await?;
//! # dsh.shutdown().await?; Ok(()) }
//! ```
//!
//! A tool registered on the builder is every agent's; one given to
//! [`AgentBuilder::tool`](crate::AgentBuilder::tool) is that agent's only.
//! Either runs through the same pipeline as the built-in tools: argument
//! validation against the schema, hooks, approvals, cancellation (the body
//! is dropped when the call is cancelled), large results spilled.
//!
//! The effects decide, before the body runs, whether the call may run
//! under the calling agent's policy: [`Effect::Reads`] always;
//! [`Effect::WritesWorkspace`] not under `read-only`; [`Effect::Network`]
//! not when the network is off; [`Effect::RunsProcesses`] (processes the
//! tool starts itself, outside dsh's sandbox) never under `read-only`,
//! without asking under `danger-full-access`, else the user is asked. Every
//! refusal is looked for before any question, so the order effects are
//! listed in never matters. A tool that declares no effects is asked about
//! on every call: with no one to ask (the builder's default approval
//! policy), it never runs — declare what it does.

use std::future::Future;
use std::marker::PhantomData;
use std::path::PathBuf;
use std::sync::Arc;

use dsh_services::llm::ToolSchema;
use dsh_services::sandbox::{PermissionMode, Policy};
use dsh_services::tools::{Decision, Tool, ToolContext, ToolError, ToolOutput, parameters};
use dsh_supervisors::BoxError;
use futures::FutureExt;
use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

/// What a tool does beyond computing its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Effect {
    /// Reads (files, a database, the service's own state): always allowed.
    Reads,
    /// Changes files in the workspace: refused under `read-only`.
    WritesWorkspace,
    /// Starts processes of its own, which dsh's sandbox does not confine:
    /// refused under `read-only`, runs under `danger-full-access`, else
    /// only with the user's approval.
    RunsProcesses,
    /// Reaches the network: refused when the agent's network is off.
    Network,
}

/// What the body of a call gets besides its arguments.
#[derive(Clone, Debug)]
pub struct Call {
    /// The call's id (as the model gave it).
    pub id: String,
    /// The calling agent's workspace.
    pub workspace: PathBuf,
    /// Fires when the call is cancelled (its turn cancelled, its agent
    /// disposed); the body is dropped then.
    pub cancel: CancellationToken,
    /// The calling agent's policy for this call.
    pub policy: Policy,
}

/// A tool's name and description, waiting for its effects and its body.
#[derive(Clone, Debug)]
pub struct CustomToolBuilder {
    name: String,
    description: String,
    effects: Vec<Effect>,
}

impl CustomToolBuilder {
    /// What the tool does (each one declared; none: every call is asked
    /// about).
    pub fn effects(mut self, effects: impl IntoIterator<Item = Effect>) -> Self {
        self.effects = effects.into_iter().collect();
        self
    }

    /// The body: parsed arguments and the [`Call`] in, the text the model
    /// reads (or an error it reads) out.
    pub fn run<A, F, Fut>(self, body: F) -> CustomTool
    where
        A: DeserializeOwned + schemars::JsonSchema + Send + 'static,
        F: Fn(A, Call) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<String, BoxError>> + Send + 'static,
    {
        CustomTool {
            name: Arc::from(self.name.as_str()),
            tool: Arc::new(Typed {
                name: self.name,
                description: self.description,
                effects: self.effects,
                body,
                args: PhantomData,
            }),
        }
    }
}

/// A tool written in Rust, ready to register on a
/// [`DshBuilder`](crate::DshBuilder) or an [`AgentBuilder`](crate::AgentBuilder).
#[derive(Clone)]
pub struct CustomTool {
    name: Arc<str>,
    tool: Arc<dyn Tool>,
}

impl CustomTool {
    /// A tool named `name` (letters, digits, `_` and `-`; what the model
    /// calls it) that does what `description` says (what the model reads).
    pub fn builder(name: impl Into<String>, description: impl Into<String>) -> CustomToolBuilder {
        CustomToolBuilder {
            name: name.into(),
            description: description.into(),
            effects: Vec::new(),
        }
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn tool(&self) -> Arc<dyn Tool> {
        self.tool.clone()
    }
}

impl std::fmt::Debug for CustomTool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CustomTool({})", self.name)
    }
}

/// Whether `name` is one a model may call: 1 to 64 ASCII letters, digits,
/// `_` or `-`.
pub(crate) fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

struct Typed<A, F> {
    name: String,
    description: String,
    effects: Vec<Effect>,
    body: F,
    args: PhantomData<fn() -> A>,
}

impl<A, F, Fut> Tool for Typed<A, F>
where
    A: DeserializeOwned + schemars::JsonSchema + Send + 'static,
    F: Fn(A, Call) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<String, BoxError>> + Send + 'static,
{
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: self.name.clone(),
            description: self.description.clone(),
            parameters: parameters::<A>(),
        }
    }

    fn decide(&self, policy: &Policy, _args: &Value) -> Decision {
        let name = &self.name;
        if self.effects.is_empty() {
            return Decision::Ask(format!(
                "the tool `{name}` does not say what it does (it declares no effects)"
            ));
        }
        // Every refusal first, then every question: the order the effects
        // were listed in never decides.
        let refused = self.effects.iter().find_map(|effect| match effect {
            Effect::WritesWorkspace if policy.mode == PermissionMode::ReadOnly => Some(format!(
                "the tool `{name}` changes the workspace, and the permission mode is read-only"
            )),
            // Its processes could change anything: never under read-only.
            Effect::RunsProcesses if policy.mode == PermissionMode::ReadOnly => Some(format!(
                "the tool `{name}` starts processes the sandbox does not confine, and the permission mode is read-only"
            )),
            Effect::Network if !policy.network => Some(format!(
                "the tool `{name}` reaches the network, and this agent's network is off"
            )),
            _ => None,
        });
        if let Some(why) = refused {
            return Decision::Deny(why);
        }
        if self.effects.contains(&Effect::RunsProcesses)
            && policy.mode != PermissionMode::DangerFullAccess
        {
            return Decision::Ask(format!(
                "the tool `{name}` starts processes the sandbox does not confine"
            ));
        }
        Decision::Allow
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        let args = serde_json::from_value::<A>(cx.args.clone());
        let call = Call {
            id: cx.call_id.clone(),
            workspace: cx.cwd.as_ref().clone(),
            cancel: cx.cancel.clone(),
            policy: cx.policy,
        };
        async move {
            let args = args.map_err(|e| {
                ToolError::new(
                    "INVALID_ARGS",
                    format!(
                        "the arguments do not parse: {}",
                        dsh_supervisors::error::chain(&e)
                    ),
                )
            })?;
            match (self.body)(args, call).await {
                Ok(text) => Ok(ToolOutput::text(text)),
                Err(e) => Err(ToolError::new(
                    "FAILED",
                    dsh_supervisors::error::chain(&*e).to_string(),
                )),
            }
        }
        .boxed()
    }
}
