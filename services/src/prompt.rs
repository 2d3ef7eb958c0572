//! System prompt assembly: ordered sections and `{{variables}}`, registered
//! globally or in a scope (the nearest same-named registration shadows), run
//! through the `system-prompt/assemble` waterfall, then rendered.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dsh_supervisors::registry::{RegisterError, SharedLayers, register_scoped};
use dsh_supervisors::scope::{NamedEntries, ScopeKey, ScopeLayer};
use dsh_supervisors::{Context, Disposer, Event, Target, Waterfall};

/// Text evaluated at each assembly.
pub type TextFn = Arc<dyn Fn(Option<&ScopeKey>) -> String + Send + Sync>;

/// Static or computed text.
#[derive(Clone)]
pub enum Text {
    /// Fixed text.
    Static(String),
    /// Computed for each assembly (for the assembling scope).
    Dynamic(TextFn),
}

impl Text {
    fn eval(&self, scope: Option<&ScopeKey>) -> String {
        match self {
            Text::Static(s) => s.clone(),
            Text::Dynamic(f) => f(scope),
        }
    }
}

/// One contributed section.
#[derive(Clone)]
pub struct PromptSection {
    /// Unique within a layer; a scoped section shadows the global one of the same name.
    pub name: String,
    /// Ascending order (convention: -100 identity, 0 persona, 100–199 tool guidance).
    pub order: i32,
    /// The text; may reference `{{variable}}`s.
    pub text: Text,
    /// This section is the whole prompt (at most one may be in effect).
    pub complete: bool,
}

/// One evaluated section: name, order, text.
pub type RenderedSection = (String, i32, String);

/// The assembled parts, before rendering.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PromptAssembly {
    /// `(name, order, text)` in render order.
    pub sections: Vec<RenderedSection>,
    /// Variable values.
    pub variables: BTreeMap<String, String>,
}

/// `system-prompt/assemble` (waterfall): listeners may rewrite the assembly.
pub struct SystemPromptAssemble {
    /// The assembly so far.
    pub assembly: PromptAssembly,
}

impl Event for SystemPromptAssemble {
    const NAME: &'static str = "system-prompt/assemble";
}
impl Waterfall for SystemPromptAssemble {
    type Output = PromptAssembly;
}

#[derive(Default)]
struct Layer {
    sections: NamedEntries<PromptSection>,
    variables: NamedEntries<Text>,
}

impl ScopeLayer for Layer {
    fn is_empty(&self) -> bool {
        self.sections.is_empty() && self.variables.is_empty()
    }
}

/// The `systemPrompt` service.
#[derive(Default)]
pub struct SystemPrompt {
    layers: SharedLayers<Layer>,
    generation: AtomicU64,
}

impl SystemPrompt {
    /// The capability name.
    pub const SERVICE: &'static str = "systemPrompt";

    /// An empty registry.
    pub fn new() -> SystemPrompt {
        SystemPrompt::default()
    }

    /// Changes with every registration and removal.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Registers a section in `ctx`'s scope layer (removed with its fiber).
    pub fn section(
        self: &Arc<Self>,
        ctx: &Context,
        section: PromptSection,
    ) -> Result<Disposer, RegisterError> {
        let name = section.name.clone();
        let me = self.clone();
        let removed = name.clone();
        let (_, disposer) = register_scoped(
            &self.layers,
            ctx,
            &format!("prompt section {name}"),
            |layer| {
                layer
                    .sections
                    .insert(&name, section)
                    .map_err(|_| RegisterError::Taken {
                        what: "prompt section",
                        name: name.clone(),
                    })
            },
            move |layer| {
                layer.sections.remove(&removed);
                me.generation.fetch_add(1, Ordering::AcqRel);
            },
        )?;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(disposer)
    }

    /// Registers a `{{name}}` variable in `ctx`'s scope layer.
    pub fn variable(
        self: &Arc<Self>,
        ctx: &Context,
        name: &str,
        value: Text,
    ) -> Result<Disposer, RegisterError> {
        let valid = name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !valid {
            return Err(RegisterError::Invalid {
                what: "prompt variable",
                name: name.to_owned(),
                reason: "expected [a-z][a-z0-9_]*".into(),
            });
        }
        let me = self.clone();
        let removed = name.to_owned();
        let (_, disposer) = register_scoped(
            &self.layers,
            ctx,
            &format!("prompt variable {name}"),
            |layer| {
                layer
                    .variables
                    .insert(name, value)
                    .map_err(|_| RegisterError::Taken {
                        what: "prompt variable",
                        name: name.to_owned(),
                    })
            },
            move |layer| {
                layer.variables.remove(&removed);
                me.generation.fetch_add(1, Ordering::AcqRel);
            },
        )?;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(disposer)
    }

    /// Collects the sections and variables visible from `scope` (nearest
    /// shadowing), evaluated now.
    fn collect(
        &self,
        scope: Option<&ScopeKey>,
    ) -> Result<(PromptAssembly, Option<RenderedSection>), PromptError> {
        // A poisoned lock only means a registration panicked; the table is whole.
        let layers = self.layers.read().unwrap_or_else(|p| p.into_inner());
        let mut sections: BTreeMap<String, PromptSection> = BTreeMap::new();
        let mut variables: BTreeMap<String, Text> = BTreeMap::new();
        for layer in layers.visible(scope).into_iter().rev() {
            for (name, s) in layer.sections.iter() {
                sections.insert(name.to_owned(), s.clone());
            }
            for (name, v) in layer.variables.iter() {
                variables.insert(name.to_owned(), v.clone());
            }
        }
        drop(layers);
        let complete: Vec<&PromptSection> = sections.values().filter(|s| s.complete).collect();
        if complete.len() > 1 {
            let names = complete.iter().map(|s| s.name.clone()).collect();
            return Err(PromptError::SeveralComplete { names });
        }
        let complete = complete
            .first()
            .map(|s| (s.name.clone(), s.order, s.text.eval(scope)));
        let mut list: Vec<RenderedSection> = sections
            .into_values()
            .map(|s| (s.name.clone(), s.order, s.text.eval(scope)))
            .collect();
        list.sort_by(|a, b| a.1.cmp(&b.1).then_with(|| a.0.cmp(&b.0)));
        let variables = variables
            .into_iter()
            .map(|(k, v)| (k, v.eval(scope)))
            .collect();
        Ok((
            PromptAssembly {
                sections: list,
                variables,
            },
            complete,
        ))
    }

    /// Assembles and renders the system prompt for `ctx`'s scope.
    pub async fn assemble(&self, ctx: &Context) -> Result<String, PromptError> {
        let scope = ctx.scope_key();
        let (assembly, complete) = self.collect(scope)?;
        let target = Target::Scope(scope.cloned());
        let mut assembly = ctx
            .events()
            .waterfall(
                &target,
                SystemPromptAssemble { assembly },
                |a: SystemPromptAssemble| async move { a.assembly },
            )
            .await?;
        if let Some(c) = complete {
            assembly.sections = vec![c];
        }
        render(&assembly)
    }
}

/// Why the system prompt could not be assembled. Fatal for the step that
/// asked (its turn ends with `SYSTEM_PROMPT`); the registrations must change.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    /// Two sections each claim to be the whole prompt.
    #[error("more than one complete prompt section is in effect: {}", .names.join(", "))]
    SeveralComplete {
        /// Their names.
        names: Vec<String>,
    },
    /// A section names a `{{variable}}` nobody provides.
    #[error("prompt section `{section}` references {{{{{variable}}}}}, which no variable provides")]
    UnknownVariable {
        /// The section.
        section: String,
        /// The variable it names.
        variable: String,
    },
    /// A listener of `system-prompt/assemble` panicked.
    #[error(transparent)]
    Listener(#[from] dsh_supervisors::Error),
}

/// Joins the sections (blank line between) and interpolates `{{name}}`.
pub fn render(assembly: &PromptAssembly) -> Result<String, PromptError> {
    let mut out = String::new();
    for (name, _, text) in &assembly.sections {
        if text.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push_str("\n\n");
        }
        let mut rest = text.as_str();
        while let Some(start) = rest.find("{{") {
            out.push_str(&rest[..start]);
            let after = &rest[start + 2..];
            let Some(end) = after.find("}}") else {
                out.push_str(&rest[start..]);
                rest = "";
                break;
            };
            let var = after[..end].trim();
            match assembly.variables.get(var) {
                Some(v) => out.push_str(v),
                None => {
                    return Err(PromptError::UnknownVariable {
                        section: name.clone(),
                        variable: var.to_owned(),
                    });
                }
            }
            rest = &after[end + 2..];
        }
        out.push_str(rest);
    }
    Ok(out)
}
