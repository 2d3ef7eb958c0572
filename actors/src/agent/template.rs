//! What agents made from one template share: one kept spec, and one schema
//! list and request header per tool set. Held by the [`super::Agents`]
//! registry (so it lives and goes with the tree that provides it).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, Weak};

use dsh_services::llm::ToolSchema;
use dsh_services::tools::RegisteredTool;

use super::header::{CallConfig, header_value};
use super::spec::same_template;
use super::{AgentSpec, lock};

/// Specs remembered for sharing (most recently made first).
const SHARED_SPEC_SLOTS: usize = 32;

/// Specs and envelopes in use, shared between agents of one registry: agents
/// made from one template (same route, prompt, tools, limits and hooks) hold
/// one spec, and agents with the same tools, route and system text one
/// schema list and one header value, instead of a copy each (a thousand
/// subagents would otherwise carry a thousand).
#[derive(Default)]
pub(super) struct Templates {
    specs: Mutex<VecDeque<Weak<AgentSpec>>>,
    envelopes: Mutex<VecDeque<SharedEnvelope>>,
}

impl Templates {
    /// The kept spec for `spec`: one made from the same template before,
    /// else `spec` itself, remembered.
    pub(super) fn spec(&self, spec: AgentSpec) -> Arc<AgentSpec> {
        let mut shared = lock(&self.specs);
        shared.retain(|w| w.strong_count() > 0);
        let found = shared
            .iter()
            .position(|w| w.upgrade().is_some_and(|s| same_template(&s, &spec)));
        if let Some(at) = found
            && let Some(known) = shared.remove(at).and_then(|w| w.upgrade())
        {
            shared.push_front(Arc::downgrade(&known));
            return known;
        }
        let made = Arc::new(spec);
        shared.push_front(Arc::downgrade(&made));
        shared.truncate(SHARED_SPEC_SLOTS);
        made
    }

    /// The schema list and header for `spec`, `system` and `tools`: one built
    /// from the same inputs before, else one equal to what they build, else a
    /// new one.
    pub(super) fn envelope(
        &self,
        spec: &Arc<AgentSpec>,
        system: Option<&str>,
        tools: &[Arc<RegisteredTool>],
        call: &CallConfig,
    ) -> (Arc<[ToolSchema]>, Arc<serde_json::Value>) {
        let mut shared = lock(&self.envelopes);
        if let Some(at) = shared
            .iter()
            .position(|e| e.built_from(spec, system, tools, call))
            && let Some(hit) = shared.remove(at)
        {
            let found = (hit.schemas.clone(), hit.header.clone());
            shared.push_front(hit);
            return found;
        }
        let (schemas, header) = built(spec, system, tools, call);
        let (schemas, header) = match shared.iter().find(|e| *e.header == header) {
            Some(equal) => (equal.schemas.clone(), equal.header.clone()),
            None => (schemas.into(), Arc::new(header)),
        };
        shared.push_front(SharedEnvelope {
            spec: Arc::downgrade(spec),
            system: system.map(str::to_owned),
            tools: tools.iter().map(Arc::downgrade).collect(),
            call: call.clone(),
            schemas: schemas.clone(),
            header: header.clone(),
        });
        shared.truncate(SHARED_ENVELOPE_SLOTS);
        (schemas, header)
    }
}

/// One shared envelope: what it was built from (weak references: they keep
/// no spec or tool alive, and their addresses cannot be reused while held)
/// and the schema list and header built.
struct SharedEnvelope {
    spec: Weak<AgentSpec>,
    system: Option<String>,
    tools: Box<[Weak<RegisteredTool>]>,
    call: CallConfig,
    schemas: Arc<[ToolSchema]>,
    header: Arc<serde_json::Value>,
}

impl SharedEnvelope {
    /// Built from this very spec, system text and tool list.
    fn built_from(
        &self,
        spec: &Arc<AgentSpec>,
        system: Option<&str>,
        tools: &[Arc<RegisteredTool>],
        call: &CallConfig,
    ) -> bool {
        std::ptr::eq(self.spec.as_ptr(), Arc::as_ptr(spec))
            && self.system.as_deref() == system
            && self.call == *call
            && self.tools.len() == tools.len()
            && self
                .tools
                .iter()
                .zip(tools)
                .all(|(w, t)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(t)))
    }
}

/// Envelopes remembered for sharing (most recently built first).
const SHARED_ENVELOPE_SLOTS: usize = 32;

/// The schema list and header `spec`, `system` and `tools` build.
fn built(
    spec: &AgentSpec,
    system: Option<&str>,
    tools: &[Arc<RegisteredTool>],
    call: &CallConfig,
) -> (Vec<ToolSchema>, serde_json::Value) {
    let schemas: Vec<ToolSchema> = tools.iter().map(|t| t.schema.clone()).collect();
    let header = header_value(spec, system, &schemas, call);
    (schemas, header)
}

/// [`Templates::envelope`] for an agent outside any registry: built, not shared.
pub(super) fn unshared_envelope(
    spec: &AgentSpec,
    system: Option<&str>,
    tools: &[Arc<RegisteredTool>],
    call: &CallConfig,
) -> (Arc<[ToolSchema]>, Arc<serde_json::Value>) {
    let (schemas, header) = built(spec, system, tools, call);
    (schemas.into(), Arc::new(header))
}
