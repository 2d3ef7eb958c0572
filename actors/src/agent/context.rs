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
use dsh_supervisors::error::chain;
use serde_json::json;

use super::log_append;
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
            log.without_chunks().rev().find_map(|e| match &e.data {
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
    source.set_extra("form", json!("snapshot"));
    source.set_extra(
        "sections",
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
/// spell it looks; a session with a title is left alone); the prompt it
/// was made from (its seq and text), for a provider to title it better.
pub(super) fn title(agent: &Agent, me: &Awake) -> Option<(u64, String)> {
    if me.titled.swap(true, std::sync::atomic::Ordering::AcqRel) {
        return None;
    }
    let first = agent.inner.session.with_log(|log| {
        if log.without_chunks().any(|e| e.kind() == "session/title") {
            return None;
        }
        log.without_chunks().find_map(|e| match &e.data {
            EventData::UserMessage(m) if m.source.kind == "user" => Some((e.seq, m.text())),
            _ => None,
        })
    });
    let (seq, text) = first?;
    let title: String = text
        .split_whitespace()
        .take(TITLE_WORDS)
        .collect::<Vec<_>>()
        .join(" ")
        .chars()
        .take(80)
        .collect();
    if title.is_empty() {
        return None;
    }
    log_append(
        agent,
        EventData::Other {
            kind: Arc::from("session/title"),
            data: Arc::new(
                json!({"title": title, "messageSeqs": [seq], "source": {"kind": "fallback"}}),
            ),
        },
        None,
    );
    Some((seq, text))
}

/// Asks the route for a title of the session's first prompt, in a
/// supervised task child of the agent's scope (cancelled with it); the answer is
/// a `session/title` from the provider, after the fallback.
pub(super) fn ask_for_title(agent: &Agent, me: &Awake, seq: u64, prompt: String) {
    let spec = &agent.inner.spec;
    let asks = me.llm.adapter(&spec.provider).is_some_and(|a| a.titles());
    if !asks {
        return;
    }
    let job = TitleJob {
        ctx: me.ctx.clone(),
        llm: me.llm.clone(),
        provider: spec.provider.clone(),
        model: spec.model.clone(),
        prompt,
    };
    let weak = agent.downgrade();
    let spec = dsh_supervisors::TaskSpec::new("title", "title");
    let started = me.ctx.spawn_task(spec, move |cancel| async move {
        let asked = tokio::time::timeout(TITLE_WAIT, generate(&job, cancel)).await;
        if let (Ok(Some(title)), Some(agent)) = (asked, weak.upgrade()) {
            agent.record(
                "session/title",
                json!({
                    "title": title,
                    "messageSeqs": [seq],
                    "source": {"kind": "provider", "provider": "dsh/title",
                               "model": {"provider": job.provider, "model": job.model}},
                }),
            );
        }
    });
    // Nobody waits for the title: the agent's teardown cancels and awaits it.
    if let Err(e) = started {
        tracing::debug!(agent = %agent.inner.id, "no title request: {}", chain(&e));
    }
}

/// What a title request says to the model.
const TITLE_SYSTEM: &str = "Name the conversation that starts with the user's message below: answer with a title of at most six words, in the message's language, with no quotes and no final punctuation.";

/// How long a title may take.
const TITLE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// What a title request needs.
struct TitleJob {
    ctx: dsh_supervisors::Context,
    llm: Arc<dsh_services::llm::LlmRuntime>,
    provider: String,
    model: String,
    prompt: String,
}

/// The model's title, normalized (one line, no quotes, at most 80 chars).
async fn generate(job: &TitleJob, cancel: tokio_util::sync::CancellationToken) -> Option<String> {
    use futures::StreamExt;
    let request = dsh_services::llm::LlmRequest {
        provider: job.provider.clone(),
        model: job.model.clone(),
        system: Some(Arc::from(TITLE_SYSTEM)),
        messages: dsh_services::llm::History::of(vec![Arc::new(Message::user_text(
            job.prompt.clone(),
        ))]),
        tools: Arc::from(Vec::new()),
        temperature: None,
        max_tokens: Some(64),
        options: Default::default(),
        session: None,
        purpose: Some("session-title"),
        notify: None,
    };
    let mut stream = job.llm.stream(&job.ctx, request, cancel).await.ok()?;
    let mut text = String::new();
    while let Some(chunk) = stream.next().await {
        if let dsh_services::llm::StreamChunk::TextDelta { text: t, .. } = chunk.ok()? {
            text.push_str(&t);
        }
    }
    let line = text.lines().map(str::trim).find(|l| !l.is_empty())?;
    let title: String = line
        .trim_matches(|c: char| c == '"' || c == '\'' || c == '“' || c == '”')
        .trim_end_matches(['.', '。'])
        .chars()
        .take(80)
        .collect();
    (!title.is_empty()).then_some(title)
}
