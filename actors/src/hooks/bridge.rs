//! The points hooks run at, each dialect's payload there, and the records.
//!
//! | hook | point | what a hook can do |
//! |---|---|---|
//! | `UserPromptSubmit` | `agent/pre-step` (a step a user's message enters) | block the prompt (the turn ends `blocked`, no request sent); add context (a message after the prompt, sourced to the dialect) |
//! | `PreToolUse` | `tools/pre-execute` | deny the call; ask (Claude Code) — the approval seam decides (a later listener's denial stands) |
//! | `PostToolUse` | `tools/post-execute` | feedback for the model (block); add context — both appended to the result |
//! | `Stop` | `agent/turn-stopping` | keep the turn going with its reason (`stop_hook_active` tells a hook it already did; at most [`MAX_STOP_BLOCKS`] times a turn) |
//!
//! Hooks of every file run serially in file order, Claude Code's files
//! first; their answers fold most-restrictively. Claude Code hooks see
//! (and match) Claude Code's names for our tools (`Bash`, `Edit`, …). Each run is recorded in
//! the agent's session as `hook/invoked` then `hook/result`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dsh_services::llm::{ContentBlock, Message, MessageSource};
use dsh_services::sandbox::{Policy, Sandbox};
use dsh_services::session::{EventData, SESSION_SERVICE, SessionWriter};
use dsh_services::tools::{Decision, PostExecute, PreExecute};
use dsh_supervisors::Context;
use dsh_supervisors::error::chain;
use serde_json::{Map, Value, json};
use tokio_util::sync::CancellationToken;

use super::run::{Invocation, supervised};
use super::{Dialect, HookSet, Outcome, Permission, Point, decode};
use crate::agent::{Agent, AgentPreStep, AgentTurnStopping, PreStepDecision};

/// How many times in one turn a `Stop` hook may keep the turn going.
pub const MAX_STOP_BLOCKS: u32 = 8;

/// The settings of the hooks plugin.
#[derive(Clone, Debug)]
pub struct HooksSettings {
    /// A hook's timeout when it names none.
    pub default_timeout: Duration,
    /// The most of a hook's stderr `hook/result` keeps, in characters.
    pub stderr_summary_max_chars: usize,
}

impl Default for HooksSettings {
    fn default() -> Self {
        HooksSettings {
            default_timeout: Duration::from_secs(600),
            stderr_summary_max_chars: 500,
        }
    }
}

/// The loaded hooks and what they need between runs.
pub struct Hooks {
    sets: Vec<HookSet>,
    settings: HooksSettings,
    /// Per agent: the turn a `Stop` hook last kept going, and how often.
    stops: Mutex<HashMap<String, (u32, u32)>>,
}

impl Hooks {
    /// Hooks from `sets` (run in this order).
    pub fn new(sets: Vec<HookSet>, settings: HooksSettings) -> Hooks {
        Hooks {
            sets,
            settings,
            stops: Mutex::default(),
        }
    }

    /// The loaded files.
    pub fn sets(&self) -> &[HookSet] {
        &self.sets
    }

    fn has(&self, point: Point) -> bool {
        self.sets.iter().any(|s| s.points.contains_key(&point))
    }
}

/// Where a point fires: the calling agent's scope and what confines it.
struct Site {
    ctx: Context,
    agent: Option<Agent>,
    cwd: PathBuf,
    policy: Policy,
    cancel: CancellationToken,
}

impl Site {
    fn of_agent(ctx: Context, cancel: CancellationToken) -> Site {
        let agent = Agent::calling(&ctx);
        let (cwd, policy) = match &agent {
            Some(a) => (a.spec().cwd.clone(), a.policy()),
            None => (std::env::temp_dir(), Policy::default()),
        };
        Site {
            ctx,
            agent,
            cwd,
            policy,
            cancel,
        }
    }

    fn turn(&self) -> u32 {
        self.agent.as_ref().map_or(0, |a| a.progress().turn)
    }

    /// The fields every payload of `dialect` carries.
    fn common(&self, dialect: Dialect, point: Point) -> Map<String, Value> {
        let session = self
            .ctx
            .get::<dyn SessionWriter>(SESSION_SERVICE)
            .map(|s| s.session_id().to_string())
            .unwrap_or_default();
        let transcript = self
            .agent
            .as_ref()
            .and_then(|a| a.spec().store.as_ref().map(|s| s.locate(&session)));
        let mut m = Map::new();
        m.insert("session_id".into(), json!(session));
        m.insert(
            "transcript_path".into(),
            match (dialect, transcript) {
                (_, Some(t)) => json!(t),
                (Dialect::Claude, None) => json!(""),
                (Dialect::Codex, None) => Value::Null,
            },
        );
        m.insert("cwd".into(), json!(self.cwd));
        m.insert("hook_event_name".into(), json!(point.as_str()));
        if dialect == Dialect::Codex {
            m.insert("turn_id".into(), json!(self.turn().to_string()));
            let model = self.agent.as_ref().map(|a| a.spec().model.clone());
            m.insert("model".into(), json!(model));
        }
        m
    }

    fn record(&self, kind: &str, data: Value) {
        if let Some(s) = self.ctx.get::<dyn SessionWriter>(SESSION_SERVICE)
            && let Err(e) = s.append_log_only(EventData::Other {
                kind: Arc::from(kind),
                data: Arc::new(data),
            })
        {
            tracing::warn!("a {kind} record was refused: {}", chain(&e));
        }
    }
}

impl Hooks {
    /// Runs every hook of `point` whose matcher admits `subject`, serially,
    /// each recorded; their answers folded.
    async fn fire(
        &self,
        point: Point,
        subject: Option<&str>,
        site: &Site,
        extra: impl Fn(Dialect, &mut Map<String, Value>),
    ) -> Outcome {
        let sandbox = site
            .ctx
            .get::<Sandbox>(Sandbox::SERVICE)
            .unwrap_or_else(Sandbox::host);
        let turn = site.turn();
        let mut all = Outcome::default();
        for set in &self.sets {
            let Some(groups) = set.points.get(&point) else {
                continue;
            };
            for group in groups {
                if subject.is_some_and(|s| !group.matcher.admits_tool(set.dialect, s)) {
                    continue;
                }
                for command in &group.commands {
                    if site.cancel.is_cancelled() {
                        return all;
                    }
                    let mut invoked = json!({"turn": turn, "point": point.as_str(),
                        "dialect": set.dialect.as_str(), "handlerId": command.id});
                    if let Some(p) = &group.pattern {
                        invoked["matcher"] = json!(p);
                    }
                    site.record("hook/invoked", invoked);
                    let mut payload = site.common(set.dialect, point);
                    extra(set.dialect, &mut payload);
                    let mut text = Value::Object(payload).to_string();
                    let mut env = Vec::new();
                    if set.dialect == Dialect::Claude {
                        // Claude Code ends the payload with a newline; Codex does not.
                        text.push('\n');
                        let project = set.project.as_ref().unwrap_or(&site.cwd);
                        env.push((
                            "CLAUDE_PROJECT_DIR".to_owned(),
                            project.display().to_string(),
                        ));
                    }
                    let invocation = Invocation {
                        command: command.clone(),
                        payload: text,
                        env,
                        cwd: site.cwd.clone(),
                        policy: site.policy,
                        timeout: command.timeout.unwrap_or(self.settings.default_timeout),
                        cancel: site.cancel.clone(),
                    };
                    let ran =
                        supervised(&site.ctx, point.as_str(), sandbox.clone(), invocation).await;
                    if let Some(why) = &ran.failure {
                        tracing::warn!("hook {}: {why}", command.id);
                    }
                    let outcome = decode(point, set.dialect, &ran);
                    let mut result = json!({"turn": turn, "point": point.as_str(),
                        "handlerId": command.id, "decision": outcome.decision(),
                        "durationMs": ran.duration.as_millis() as u64});
                    if let Some(code) = ran.exit {
                        result["exitCode"] = json!(code);
                    }
                    let said = ran
                        .failure
                        .clone()
                        .unwrap_or_else(|| ran.stderr.trim().to_owned());
                    if !said.is_empty() {
                        let cap = self.settings.stderr_summary_max_chars;
                        result["stderrSummary"] = json!(said.chars().take(cap).collect::<String>());
                    }
                    site.record("hook/result", result);
                    all.merge(outcome);
                }
            }
        }
        all
    }
}

/// Registers the hook points on `ctx` (global listeners: every agent's
/// calls and turns pass them).
pub fn install(ctx: &Context, hooks: Arc<Hooks>) -> Result<(), dsh_supervisors::Error> {
    if hooks.has(Point::UserPromptSubmit) {
        let h = hooks.clone();
        ctx.on_waterfall(move |e: AgentPreStep, next| {
            let h = h.clone();
            async move { h.prompt(e, next).await }
        })?;
    }
    if hooks.has(Point::PreToolUse) {
        let h = hooks.clone();
        ctx.on_waterfall(move |p: PreExecute, next| {
            let h = h.clone();
            async move { h.pre_tool(p, next).await }
        })?;
    }
    if hooks.has(Point::PostToolUse) {
        let h = hooks.clone();
        ctx.on_waterfall(move |p: PostExecute, next| {
            let h = h.clone();
            async move { h.post_tool(p, next).await }
        })?;
    }
    if hooks.has(Point::Stop) {
        let h = hooks;
        ctx.on_serial(move |e: Arc<AgentTurnStopping>| {
            let h = h.clone();
            async move { h.at_stop(&e).await }
        })?;
    }
    Ok(())
}

/// The text of a tool outcome, as `tool_response` carries it.
fn response_text(
    outcome: &Result<dsh_services::tools::ToolOutput, dsh_services::tools::ToolError>,
) -> String {
    match outcome {
        Ok(o) => dsh_services::llm::joined_text(&o.content, "\n"),
        Err(e) => format!("Error: {}", e.message),
    }
}

/// A tool's input as the dialect shows it: all of it (Claude Code), or
/// `{command}` (Codex).
fn tool_input(dialect: Dialect, args: &Value) -> Value {
    match dialect {
        Dialect::Claude => args.clone(),
        Dialect::Codex => {
            json!({"command": args.get("command").and_then(Value::as_str).unwrap_or("")})
        }
    }
}

impl Hooks {
    async fn prompt(
        &self,
        e: AgentPreStep,
        next: dsh_supervisors::Next<AgentPreStep>,
    ) -> PreStepDecision {
        let prompt: Vec<String> = e
            .entering
            .iter()
            .filter(|m| m.source.kind == "user")
            .map(|m| m.text())
            .collect();
        if prompt.is_empty() {
            return next.run(e).await;
        }
        let prompt = prompt.join("\n");
        let site = Site::of_agent(e.ctx.clone(), e.cancel.clone());
        let out = self
            .fire(Point::UserPromptSubmit, None, &site, |_, m| {
                m.insert("prompt".into(), json!(prompt));
            })
            .await;
        if let Some(why) = out.refusal(Point::UserPromptSubmit) {
            return PreStepDecision::Reject(why);
        }
        match next.run(e).await {
            PreStepDecision::Enter(mut batch) => {
                for (dialect, text) in out.context {
                    let mut m = Message::user_text(text);
                    m.source = MessageSource::plugin(dialect.plugin());
                    batch.push(Arc::new(m));
                }
                PreStepDecision::Enter(batch)
            }
            rejected => rejected,
        }
    }

    async fn pre_tool(
        &self,
        p: PreExecute,
        next: dsh_supervisors::Next<PreExecute>,
    ) -> (Decision, Value) {
        let mut site = Site::of_agent(p.ctx.clone(), p.cancel.clone());
        site.cwd = p.bounds.cwd.to_path_buf();
        site.policy = p.bounds.policy;
        let (name, id, args) = (p.call.name.clone(), p.call.id.clone(), p.args.clone());
        let out = self
            .fire(Point::PreToolUse, Some(&name), &site, |d, m| {
                m.insert(
                    "tool_name".into(),
                    json!(d.tool_name(&name).unwrap_or(&name)),
                );
                m.insert("tool_input".into(), tool_input(d, &args));
                m.insert("tool_use_id".into(), json!(id));
            })
            .await;
        if let Some(why) = out.refusal(Point::PreToolUse) {
            return (Decision::Deny(why), p.args);
        }
        let (decision, args) = next.run(p).await;
        // An ask does not skip what later listeners decide: a denial
        // stands, anything else becomes the question.
        match (&out.permission, decision) {
            (Some(Permission::Ask(why)), Decision::Allow | Decision::Ask(_)) => {
                let why = if why.trim().is_empty() {
                    "a PreToolUse hook asks before this call".to_owned()
                } else {
                    why.clone()
                };
                (Decision::Ask(why), args)
            }
            (_, decision) => (decision, args),
        }
    }

    async fn post_tool(
        &self,
        p: PostExecute,
        next: dsh_supervisors::Next<PostExecute>,
    ) -> Result<dsh_services::tools::ToolOutput, dsh_services::tools::ToolError> {
        let mut site = Site::of_agent(p.ctx.clone(), p.cancel.clone());
        site.cwd = p.bounds.cwd.to_path_buf();
        site.policy = p.bounds.policy;
        let (name, id, args) = (p.call.name.clone(), p.call.id.clone(), p.args.clone());
        let outcome = next.run(p).await;
        let response = response_text(&outcome);
        let out = self
            .fire(Point::PostToolUse, Some(&name), &site, |d, m| {
                m.insert(
                    "tool_name".into(),
                    json!(d.tool_name(&name).unwrap_or(&name)),
                );
                m.insert("tool_input".into(), tool_input(d, &args));
                m.insert("tool_response".into(), json!(response));
                m.insert("tool_use_id".into(), json!(id));
            })
            .await;
        let mut notes: Vec<String> = out.refusal(Point::PostToolUse).into_iter().collect();
        notes.extend(out.context.into_iter().map(|(_, c)| c));
        if notes.is_empty() {
            return outcome;
        }
        let note = notes.join("\n\n");
        match outcome {
            Ok(mut o) => {
                o.content.push(ContentBlock::text(note));
                Ok(o)
            }
            Err(mut e) => {
                e.message = format!("{}\n\n{note}", e.message);
                Err(e)
            }
        }
    }

    async fn at_stop(&self, e: &AgentTurnStopping) -> Option<String> {
        let site = Site::of_agent(e.ctx.clone(), e.cancel.clone());
        let active = {
            let stops = self.stops.lock().unwrap_or_else(|p| p.into_inner());
            stops
                .get(&e.agent)
                .filter(|(t, _)| *t == e.turn)
                .map_or(0, |(_, n)| *n)
        };
        if active >= MAX_STOP_BLOCKS {
            tracing::warn!(
                "agent {}: Stop hooks kept turn {} going {active} times; letting it end",
                e.agent,
                e.turn
            );
            return None;
        }
        let out = self
            .fire(Point::Stop, None, &site, |_, m| {
                m.insert("stop_hook_active".into(), json!(active > 0));
                m.insert("last_assistant_message".into(), json!(e.text));
            })
            .await;
        // `continue: false` lets the turn end; a block keeps it going.
        let why = out.refusal(Point::Stop).filter(|_| out.halt.is_none());
        let mut stops = self.stops.lock().unwrap_or_else(|p| p.into_inner());
        match &why {
            Some(_) => stops.insert(e.agent.clone(), (e.turn, active + 1)),
            None => stops.remove(&e.agent),
        };
        why
    }
}
