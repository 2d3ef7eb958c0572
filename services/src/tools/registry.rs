//! The scoped tool registry: registration through a (scoped) context,
//! shadowing by the nearest scope, and allow/deny restrictions that
//! intersect along the scope chain. A filtered tool is absent from the
//! prompt and refuses execution alike.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dsh_supervisors::error::chain;
use dsh_supervisors::registry::{RegisterError, SharedLayers, register_scoped};
use dsh_supervisors::scope::{NamedEntries, ScopeKey, ScopeLayer, ScopedLayers};
use dsh_supervisors::{Context, Disposer};

use super::Tool;
use crate::llm::ToolSchema;

/// A registered tool with its compiled argument validator.
pub struct RegisteredTool {
    /// The definition.
    pub tool: Arc<dyn Tool>,
    /// Its schema, computed once.
    pub schema: ToolSchema,
    validator: jsonschema::Validator,
}

/// Arguments that do not match a tool's parameter schema: every violation,
/// each with its path. The model may retry with corrected arguments.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}", .violations.join("; "))]
pub struct InvalidArguments {
    /// One line per violation (`/path: what is wrong`).
    pub violations: Vec<String>,
}

impl RegisteredTool {
    /// Validates arguments; the error lists every violation with its path.
    pub fn validate(&self, args: &serde_json::Value) -> Result<(), InvalidArguments> {
        let violations: Vec<String> = self
            .validator
            .iter_errors(args)
            .map(|e| {
                let path = e.instance_path().to_string();
                if path.is_empty() {
                    chain(&e).to_string()
                } else {
                    format!("{path}: {}", chain(&e))
                }
            })
            .collect();
        if violations.is_empty() {
            Ok(())
        } else {
            Err(InvalidArguments { violations })
        }
    }
}

/// Which tools a scope may see: `allow` (when set) keeps only those names,
/// `deny` removes names. Restrictions on a scope and its ancestors intersect.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Restriction {
    /// Names allowed (all when `None`).
    pub allow: Option<Vec<String>>,
    /// Names denied.
    pub deny: Vec<String>,
}

impl Restriction {
    fn admits(&self, name: &str) -> bool {
        self.allow
            .as_ref()
            .is_none_or(|a| a.iter().any(|n| n == name))
            && !self.deny.iter().any(|n| n == name)
    }
}

#[derive(Default)]
struct ToolLayer {
    tools: NamedEntries<Arc<RegisteredTool>>,
    restrictions: Vec<(u64, Restriction)>,
}

impl ScopeLayer for ToolLayer {
    fn is_empty(&self) -> bool {
        self.tools.is_empty() && self.restrictions.is_empty()
    }
}

/// How a name resolved for one scope.
pub enum Resolution {
    /// Visible and callable.
    Found(Arc<RegisteredTool>),
    /// No such tool.
    Unknown,
    /// Registered but filtered out for this scope.
    Filtered,
}

/// The `tools` service.
#[derive(Default)]
pub struct ToolRegistry {
    layers: SharedLayers<ToolLayer>,
    next: AtomicU64,
    generation: AtomicU64,
}

impl ToolRegistry {
    /// The capability name.
    pub const SERVICE: &'static str = "tools";

    /// An empty registry.
    pub fn new() -> ToolRegistry {
        ToolRegistry::default()
    }

    /// Changes with every registration, removal and restriction change, so
    /// a consumer may cache what it derived from the registry.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn bump(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// Registers `tool` in `ctx`'s scope layer (global for an untagged
    /// context); removed when `ctx`'s fiber unloads. Refuses a name already
    /// registered in that same layer and a schema that does not compile.
    pub fn register(
        self: &Arc<Self>,
        ctx: &Context,
        tool: Arc<dyn Tool>,
    ) -> Result<Disposer, RegisterError> {
        let schema = tool.schema();
        let validator =
            jsonschema::validator_for(&schema.parameters).map_err(|e| RegisterError::Invalid {
                what: "tool",
                name: schema.name.clone(),
                reason: format!("its parameter schema does not compile: {}", chain(&e)),
            })?;
        let name = schema.name.clone();
        let entry = Arc::new(RegisteredTool {
            tool,
            schema,
            validator,
        });
        let me = self.clone();
        let removed = name.clone();
        let (_, disposer) = register_scoped(
            &self.layers,
            ctx,
            &format!("tool {name}"),
            |layer| {
                layer
                    .tools
                    .insert(&name, entry)
                    .map_err(|_| RegisterError::Taken {
                        what: "tool",
                        name: name.clone(),
                    })
            },
            move |layer| {
                layer.tools.remove(&removed);
                me.bump();
            },
        )?;
        self.bump();
        Ok(disposer)
    }

    /// Adds a restriction to `ctx`'s scope layer; lifted when `ctx`'s fiber unloads.
    pub fn restrict(
        self: &Arc<Self>,
        ctx: &Context,
        restriction: Restriction,
    ) -> Result<Disposer, RegisterError> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let me = self.clone();
        let (_, disposer) = register_scoped(
            &self.layers,
            ctx,
            "tool restriction",
            |layer| {
                layer.restrictions.push((id, restriction));
                Ok(())
            },
            move |layer| {
                layer.restrictions.retain(|(i, _)| *i != id);
                me.bump();
            },
        )?;
        self.bump();
        Ok(disposer)
    }

    fn admitted(layers: &ScopedLayers<ToolLayer>, scope: Option<&ScopeKey>, name: &str) -> bool {
        layers
            .visible(scope)
            .iter()
            .flat_map(|l| l.restrictions.iter())
            .all(|(_, r)| r.admits(name))
    }

    /// Tools visible from `scope`, nearest registration winning, restricted,
    /// sorted by name.
    pub fn visible(&self, scope: Option<&ScopeKey>) -> Vec<Arc<RegisteredTool>> {
        let Ok(layers) = self.layers.read() else {
            return Vec::new();
        };
        let mut by_name: BTreeMap<&str, &Arc<RegisteredTool>> = BTreeMap::new();
        // Farthest first, so nearer layers overwrite.
        for layer in layers.visible(scope).into_iter().rev() {
            for (name, tool) in layer.tools.iter() {
                by_name.insert(name, tool);
            }
        }
        by_name
            .into_iter()
            .filter(|(name, _)| Self::admitted(&layers, scope, name))
            .map(|(_, t)| t.clone())
            .collect()
    }

    /// The model-facing schemas visible from `scope`.
    pub fn schemas(&self, scope: Option<&ScopeKey>) -> Vec<ToolSchema> {
        self.visible(scope)
            .iter()
            .map(|t| t.schema.clone())
            .collect()
    }

    /// Resolves `name` for `scope`.
    pub fn resolve(&self, scope: Option<&ScopeKey>, name: &str) -> Resolution {
        let Ok(layers) = self.layers.read() else {
            return Resolution::Unknown;
        };
        let found = layers
            .visible(scope)
            .into_iter()
            .find_map(|l| l.tools.get(name).cloned());
        match found {
            None => Resolution::Unknown,
            Some(_) if !Self::admitted(&layers, scope, name) => Resolution::Filtered,
            Some(t) => Resolution::Found(t),
        }
    }
}
