//! The request envelope: the tool schemas and the `request/header` value a
//! step sends, rebuilt only when the tool registry or the system text changed.

use super::header::CallConfig;
use super::template::unshared_envelope;
use super::{Awake, Envelope, Inner, lock};

/// The tool schemas and header in force, rebuilt when the registry changed.
pub(super) fn envelope(
    inner: &Inner,
    me: &Awake,
    system: Option<&str>,
    call: &CallConfig,
) -> Envelope {
    let generation = me.tools.generation();
    let mut cache = lock(&me.envelope);
    if let Some(e) = cache.as_ref()
        && e.generation == generation
        && e.system.as_deref() == system
        && e.call == *call
    {
        return e.clone();
    }
    let tools = me.tools.visible(me.ctx.scope_key());
    let (schemas, header) = match &inner.agents {
        Some(agents) => agents.templates.envelope(&inner.spec, system, &tools, call),
        None => unshared_envelope(&inner.spec, system, &tools, call),
    };
    let fresh = Envelope {
        generation,
        system: system.map(str::to_owned),
        call: call.clone(),
        schemas,
        header,
    };
    *cache = Some(fresh.clone());
    fresh
}
