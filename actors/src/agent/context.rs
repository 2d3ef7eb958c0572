//! The runtime-context snapshot: one sourced user message stating what the
//! agent may do right now — its file policy (mode, workspace, network) and
//! its approval policy — appended before a request whenever that changed
//! since the last snapshot in the log (so a resumed session does not repeat
//! it). It rides the history rather than the system prompt, so the prompt's
//! cached prefix survives a policy change. Like upstream's, it is a
//! contribution of the composition: agents built where a `sandbox` service
//! is provided (the `agent-services` plugin provides one) send it; a bare
//! runtime without one does not.
//!
//! Also here: a new session's fallback title (`session/title`, log-only):
//! the first words of its first human message, as upstream's harness
//! records before any title provider answers.

use std::sync::Arc;

use dsh_services::approval::ApprovalPolicy;
use dsh_services::llm::{ContentBlock, Message, MessageSource, Role};
use dsh_services::sandbox::Policy;
use dsh_services::session::{EventData, SurfaceIntent};
use serde_json::json;

use super::driver::log_append;
use super::{Agent, Awake, lock};

/// The plugin name a snapshot's source carries.
pub const SOURCE: &str = "dsh/runtime-context";

/// What a snapshot states.
pub(super) type Facts = (Policy, Option<ApprovalPolicy>);

/// Appends a snapshot when the facts changed since the last one (only
/// where a `sandbox` service defines them).
pub(super) fn refresh(agent: &Agent, me: &Awake) {
    if !me.snapshots {
        return;
    }
    let approval = me.approval.as_ref().map(|a| a.policy());
    let facts = (me.bounds.policy, approval);
    let mut last = lock(&me.context);
    if *last == Some(facts) {
        return;
    }
    let sections = sections(me, facts);
    let text = render(&sections);
    // First look since this agent woke: the log may hold the same one.
    let logged = last.is_none()
        && agent.inner.session.with_log(|log| {
            log.events().iter().rev().find_map(|e| match &e.data {
                EventData::UserMessage(m) if m.source.plugin.as_deref() == Some(SOURCE) => {
                    Some(m.text() == text)
                }
                _ => None,
            })
        }) == Some(true);
    *last = Some(facts);
    if logged {
        return;
    }
    let mut source = MessageSource::of("plugin");
    source.plugin = Some(SOURCE.into());
    source.extra.insert("form".into(), json!("snapshot"));
    source.extra.insert(
        "sections".into(),
        json!(
            sections
                .iter()
                .map(|(name, text)| json!({"name": name, "text": text}))
                .collect::<Vec<_>>()
        ),
    );
    let message = Message {
        id: Message::new_id(),
        role: Role::User,
        content: vec![ContentBlock::text(text)],
        source,
    };
    log_append(
        agent,
        EventData::UserMessage(Arc::new(message)),
        Some(SurfaceIntent::append()),
    );
}

fn sections(me: &Awake, (policy, approval): Facts) -> Vec<(&'static str, String)> {
    let mut out = vec![("sandbox:policy", policy.describe(&me.bounds.cwd))];
    if let Some(a) = approval {
        out.push(("approval:policy", a.describe().to_owned()));
    }
    out
}

fn render(sections: &[(&str, String)]) -> String {
    let mut text = String::from("Runtime context (this replaces any earlier runtime context).");
    for (_, s) in sections {
        text.push_str("\n\n");
        text.push_str(s);
    }
    text
}

/// Words a fallback title keeps.
const TITLE_WORDS: usize = 5;

/// Records a fallback title when the session has none yet (once per awake
/// spell it looks; a session with a title is left alone).
pub(super) fn title(agent: &Agent, me: &Awake) {
    if me.titled.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return;
    }
    let first = agent.inner.session.with_log(|log| {
        let events = log.events();
        if events.iter().any(|e| e.kind() == "session/title") {
            return None;
        }
        events.iter().find_map(|e| match &e.data {
            EventData::UserMessage(m) if m.source.kind == "user" => Some((e.seq, m.text())),
            _ => None,
        })
    });
    let Some((seq, text)) = first else {
        return;
    };
    let title: String = text
        .split_whitespace()
        .take(TITLE_WORDS)
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .take(80)
        .collect();
    if title.is_empty() {
        return;
    }
    log_append(
        agent,
        EventData::Other {
            kind: Arc::from("session/title"),
            data: json!({"title": title, "messageSeqs": [seq], "source": {"kind": "fallback"}}),
        },
        None,
    );
}
