//! `dsh chat`: an interactive session on one resident agent, turn after
//! turn, each persisted as `dsh run` persists its one.
//!
//! - [`input`]: what a typed line means (a message, a `!` steer, a command).
//! - [`engine`]: the agent's events as display items, approval questions
//!   and their answers.
//! - [`transcript`]: the seat when stdin is not a terminal — lines read as
//!   they arrive, items printed one per line.
//!
//! [`Chat`] here holds the session: the agent, and what each command does
//! to it. `/resume`, `/fork`, `/model` and `/permission` replace the agent
//! with one on the other session (or model, or mode): the old one is
//! flushed and disposed first, and when the new one cannot start the old
//! session is reopened.

pub mod engine;
pub mod input;
pub mod markdown;
pub mod terminal;
pub mod transcript;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec};
use dsh_services::llm::{LlmRuntime, Message};
use dsh_services::persistence::{SessionPersistence, resolve};
use dsh_services::sandbox::{PermissionMode, Policy};
use dsh_services::session::EventData;
use dsh_supervisors::Runtime;
use dsh_supervisors::error::chain;

use crate::args::{
    AgentArgs, DashboardArgs, HOW_TO_CONFIGURE, MODEL_PRECEDENCE, StoreArgs, WorkspaceArgs,
};
use crate::exit::{self, Exit};
use crate::lines::inert_line;
use crate::stage::{Purpose, Route};
use engine::{Approvals, Item, Items, cut};

/// `dsh chat`: the options.
#[derive(clap::Args, Debug)]
#[command(after_help = MODEL_PRECEDENCE)]
pub struct ChatArgs {
    /// Continue a stored session (its id, or the start of it).
    #[arg(long, value_name = "ID")]
    pub resume: Option<String>,
    /// System prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Steps allowed per turn.
    #[arg(long, default_value_t = 64)]
    pub max_steps: u32,
    /// Do not show the model's reasoning.
    #[arg(long, short)]
    pub quiet: bool,
    /// Seconds an approval question waits for its answer before it is
    /// refused (0: as long as its call does).
    #[arg(long, value_name = "SECS", default_value_t = 600)]
    pub approval_timeout: u64,
    /// The model, policy and plugin tree.
    #[command(flatten)]
    pub agents: AgentArgs,
    /// The workspace tools work in.
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
    /// Where sessions are stored.
    #[command(flatten)]
    pub store: StoreArgs,
    /// The live dashboard beside the chat.
    #[command(flatten)]
    pub dashboard: DashboardArgs,
}

/// Chats until the input ends or the user leaves; returns how the process
/// should exit.
pub async fn chat(args: ChatArgs) -> Exit {
    let args = &args;
    crate::serve::in_runtime(&args.workspace, &args.dashboard, |rt, cwd| async move {
        open(&rt, args, cwd).await
    })
    .await
}

/// Boots the model, opens the session and hands it to the seat.
async fn open(rt: &Runtime, args: &ChatArgs, cwd: PathBuf) -> exit::Result<()> {
    let route = crate::stage::boot(rt, &args.agents, Purpose::Chat, Some(&cwd))
        .await?
        .ok_or_else(|| Exit::usage(HOW_TO_CONFIGURE))?;
    let store = crate::stage::store(rt, &args.store)?;
    let dashboard = crate::serve::dashboard_url(rt, &args.dashboard).await?;
    let mut sections = crate::home::workspace_sections(&cwd).await;
    let definitions = crate::stage::definitions(rt, &cwd).await;
    sections.extend(dsh_services::definitions::section(&definitions));
    let (items, shown) = tokio::sync::mpsc::unbounded_channel();
    let mut chat = Chat {
        rt,
        model: route.model.clone(),
        route,
        system: args.system.clone(),
        max_steps: args.max_steps,
        reasoning: !args.quiet,
        cwd,
        sections,
        store,
        agent: None,
        permission: None,
        approvals: Arc::new(Approvals::expiring(
            (args.approval_timeout > 0).then(|| Duration::from_secs(args.approval_timeout)),
        )),
        items,
        totals: Arc::default(),
        dashboard,
        sent: Default::default(),
    };
    match &args.resume {
        Some(given) => {
            let id = resolve(&*chat.store, given)?;
            chat.start(Some(&id), true).await.map_err(Exit::usage)?;
        }
        None => chat.start(None, false).await.map_err(Exit::failed)?,
    }
    if let Some(agent) = chat.agent() {
        chat.note(format!(
            "chat on session {} · {}/{} · {} · /help lists the commands",
            agent.id(),
            chat.route.provider,
            chat.model,
            agent.policy().mode
        ));
    }
    if let Some(url) = &chat.dashboard {
        chat.approvals.share();
        chat.note(format!("dashboard at {url}"));
    }
    let result = if terminal::usable() {
        terminal::converse(&mut chat, shown).await
    } else {
        transcript::converse(&mut chat, shown).await
    };
    chat.finish().await;
    result
}

/// One chat: the resident agent and what the commands change.
pub struct Chat<'a> {
    rt: &'a Runtime,
    route: Route,
    /// The model the agent uses now (`/model` changes it).
    model: String,
    system: Option<String>,
    max_steps: u32,
    reasoning: bool,
    cwd: PathBuf,
    sections: Vec<dsh_services::prompt::RenderedSection>,
    store: Arc<dyn SessionPersistence>,
    /// The agent (`None` only while it is being replaced).
    agent: Option<Agent>,
    /// The policy `/permission` chose (`None`: the flags').
    permission: Option<Policy>,
    approvals: Arc<Approvals>,
    items: Items,
    /// The tokens spent so far.
    totals: Arc<engine::Totals>,
    /// The dashboard's address, once serving.
    dashboard: Option<String>,
    /// The first lines of the messages sent from here, as their prompt
    /// items show them, until those come (a seat that shows what was typed
    /// skips them).
    sent: std::sync::Mutex<std::collections::VecDeque<String>>,
}

impl Chat<'_> {
    /// The agent, when one is up.
    pub fn agent(&self) -> Option<&Agent> {
        self.agent.as_ref()
    }

    /// The approval questions and their answers.
    pub fn approvals(&self) -> &Approvals {
        &self.approvals
    }

    /// Whether a turn runs (or waits in the queue).
    pub fn running(&self) -> bool {
        self.agent().is_some_and(|a| !a.is_idle())
    }

    fn note(&self, line: impl Into<String>) {
        let _ = self.items.send(Item::Note(line.into()));
    }

    fn error(&self, line: impl Into<String>) {
        let _ = self.items.send(Item::Error(line.into()));
    }

    /// Starts the agent on stored session `id` (a new one when `None`),
    /// with the chat's model and policy; with `show`, the session's earlier
    /// turns are shown, one line each for the prompt and the answer.
    async fn start(&mut self, id: Option<&str>, show: bool) -> Result<(), String> {
        let mut spec = AgentSpec::new(&self.route.provider, &self.model, self.cwd.clone());
        spec.system = Some(
            self.system
                .clone()
                .unwrap_or_else(|| crate::stage::system_prompt(&self.cwd, &self.model)),
        );
        spec.sections = self.sections.clone();
        spec.max_steps = self.max_steps;
        spec.permission = self.permission;
        match id {
            Some(id) => {
                let notes = crate::run::resume(self.store.clone(), id, &mut spec)
                    .map_err(|e| e.message.unwrap_or_default())?;
                for note in notes {
                    self.note(note);
                }
                if let Some(seed) = spec.seed.as_ref().filter(|_| show) {
                    self.show_earlier(id, &seed.1);
                }
            }
            None => {
                spec.store = Some(self.store.clone());
                spec.id = Some(Message::new_id());
            }
        }
        let agent = Agent::create(&self.rt.root(), spec)
            .await
            .map_err(|e| format!("cannot start the agent: {}", chain(&e)))?;
        if let Err(e) = engine::answer_approvals(&agent, self.approvals.clone(), self.items.clone())
        {
            agent.dispose().await;
            return Err(format!("cannot route the agent's approval questions: {e}"));
        }
        let price = self
            .rt
            .root()
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .and_then(|llm| llm.defaults(&self.route.provider, &self.model).price);
        engine::observe(
            &agent,
            self.items.clone(),
            self.totals.clone(),
            price,
            self.reasoning,
        );
        self.agent = Some(agent);
        Ok(())
    }

    /// A resumed session's turns so far: `> prompt` and `< answer`, each
    /// its first line, cut.
    fn show_earlier(&self, id: &str, events: &[dsh_services::session::SessionEvent]) {
        let mut turns = 0;
        let mut answer: Option<String> = None;
        let flush_answer = |answer: &mut Option<String>| {
            if let Some(a) = answer.take().filter(|a| !a.trim().is_empty()) {
                self.note(format!("< {}", engine::prompt_line(&a)));
            }
        };
        for e in events {
            match &e.data {
                EventData::TurnStart { .. } => {
                    turns += 1;
                    flush_answer(&mut answer);
                }
                EventData::UserMessage(m) => {
                    self.note(format!("> {}", engine::prompt_line(&m.text())));
                }
                EventData::AssistantMessage { message, .. } => {
                    let text = message.text();
                    if !text.trim().is_empty() {
                        answer = Some(text);
                    }
                }
                _ => {}
            }
        }
        flush_answer(&mut answer);
        let short: String = id.chars().take(8).collect();
        self.note(format!(
            "resumed session {short} ({id}): {turns} earlier turn{}",
            if turns == 1 { "" } else { "s" }
        ));
    }

    /// Flushes and disposes the agent, and starts one on `id`; when that
    /// fails, reopens the session it left (with what it had).
    async fn reopen(
        &mut self,
        id: &str,
        model: &str,
        permission: Option<Policy>,
    ) -> Result<(), String> {
        let Some(old) = self.agent.take() else {
            return Err("no agent to replace".into());
        };
        let left = old.id().to_owned();
        let before = (self.model.clone(), self.permission);
        self.flush(&old).await;
        if tokio::time::timeout(DISPOSE, old.dispose()).await.is_err() {
            self.error(format!(
                "the agent on {left} did not stop within {} s",
                DISPOSE.as_secs()
            ));
        }
        if id != left {
            self.approvals.forget_always();
        }
        self.model = model.to_owned();
        self.permission = permission;
        match self.start(Some(id), id != left).await {
            Ok(()) => Ok(()),
            Err(e) => {
                (self.model, self.permission) = before;
                self.start(Some(&left), false)
                    .await
                    .map_err(|again| format!("{e}; reopening {left} failed too: {again}"))?;
                Err(e)
            }
        }
    }

    /// Writes what `agent`'s log holds, at most [`FLUSH`]; says what failed.
    async fn flush(&self, agent: &Agent) -> bool {
        match tokio::time::timeout(FLUSH, agent.session().flush()).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                self.error(format!(
                    "the session log was not fully written: {}",
                    chain(&e)
                ));
                false
            }
            Err(_) => {
                self.error(format!(
                    "the session log was not written within {} s",
                    FLUSH.as_secs()
                ));
                false
            }
        }
    }

    /// Whether nothing runs; says so when something does.
    fn idle_for(&self, what: &str) -> bool {
        if self.running() {
            self.error(format!(
                "a turn is running: {what} waits until it ends (/cancel ends it now)"
            ));
            return false;
        }
        true
    }

    /// The status line: route and model, tokens in and out, the context
    /// used of the model's window, the permission mode and sandbox, the
    /// session.
    pub async fn status(&self) -> String {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(agent) = self.agent() else {
            return "no session open".to_owned();
        };
        let window = self
            .rt
            .root()
            .get::<LlmRuntime>(LlmRuntime::SERVICE)
            .and_then(|llm| {
                llm.defaults(&self.route.provider, &self.model)
                    .context_window
            });
        let context = match (agent.context_tokens(), window) {
            (Some(used), Some(w)) if w > 0 => format!(
                "context {} of {} ({}%)",
                crate::lines::tokens(used),
                crate::lines::tokens(w),
                used * 100 / w
            ),
            (Some(used), _) => format!("context {}", crate::lines::tokens(used)),
            (None, _) => "context not measured yet".to_owned(),
        };
        let policy = agent.policy();
        let sandbox = if !policy.confines() {
            "unconfined".to_owned()
        } else {
            match self
                .rt
                .root()
                .get::<dsh_services::sandbox::Sandbox>(dsh_services::sandbox::Sandbox::SERVICE)
            {
                Some(s) => match s.backend().await {
                    Ok(b) => b.name().to_owned(),
                    Err(_) => "no sandbox".to_owned(),
                },
                None => "no sandbox".to_owned(),
            }
        };
        let short: String = agent.id().chars().take(8).collect();
        format!(
            "{}/{} · {} in / {} out · {context} · {} ({sandbox}) · session {short}",
            self.route.provider,
            inert_line(&self.model),
            crate::lines::tokens(self.totals.input.load(Relaxed)),
            crate::lines::tokens(self.totals.output.load(Relaxed)),
            policy.mode,
        )
    }

    /// Does what a typed `line` says; `false` when it asks to leave
    /// (`/exit`). A command is a command even while an approval question
    /// waits (`/cancel` withdraws it); any other line answers the question.
    pub async fn act(&mut self, line: &str) -> bool {
        let parsed = input::parse_line(line);
        let command = matches!(parsed, Ok(input::Input::Command(..)) | Err(_));
        if !command && self.approvals.waiting() {
            let answer = engine::Answer::of(line);
            if let Some(id) = self.approvals.answer(answer) {
                let said = match answer {
                    engine::Answer::Once => "allowed once",
                    engine::Answer::Always => "allowed, and from now on without asking",
                    engine::Answer::No => "refused",
                };
                self.note(format!("approval {id}: {said}"));
            }
            return true;
        }
        match parsed {
            Ok(input::Input::Message(text)) => self.send(&text),
            Ok(input::Input::Steer(text)) => self.steer(&text),
            Ok(input::Input::Command(command, rest)) => return self.command(command, &rest).await,
            Ok(input::Input::Nothing) => {}
            Err(e) => self.error(e.to_string()),
        }
        true
    }

    /// Sends a message: a new turn, or a followup queued behind the
    /// running one.
    pub fn send(&self, text: &str) {
        let Some(agent) = self.agent() else {
            return self.error("not sent: no session is open (/resume one)");
        };
        match engine::send(agent, text) {
            Ok(queued) => {
                self.remember(text);
                if queued {
                    self.note("queued: it runs when this turn ends");
                }
            }
            Err(e) => self.error(format!("not sent: {e}")),
        }
    }

    /// Remembers a message sent from here (see [`Chat::typed_here`]).
    fn remember(&self, text: &str) {
        let mut sent = self
            .sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        sent.push_back(engine::prompt_line(text));
        if sent.len() > 64 {
            sent.pop_front();
        }
    }

    /// Whether the prompt item `shown` is of a message sent from here (then
    /// it and any older one are forgotten).
    pub fn typed_here(&self, shown: &str) -> bool {
        let mut sent = self
            .sent
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match sent.iter().position(|s| s == shown) {
            Some(at) => {
                sent.drain(..=at);
                true
            }
            None => false,
        }
    }

    /// Steers the running turn; a steer with no turn running starts one.
    pub fn steer(&self, text: &str) {
        let Some(agent) = self.agent() else {
            return self.error("not sent: no session is open (/resume one)");
        };
        match engine::steer(agent, text) {
            Ok(true) => {
                self.remember(text);
                self.note("steered: the model reads it at its next step");
            }
            Ok(false) => self.send(text),
            Err(e) => self.error(format!("not sent: {e}")),
        }
    }

    /// Runs a command; `false` when the chat should end (`/exit`).
    pub async fn command(&mut self, command: &input::Command, rest: &str) -> bool {
        let rest = rest.trim();
        match command.name {
            "help" => {
                for line in input::help().lines() {
                    self.note(line);
                }
            }
            "exit" => return false,
            "cancel" => match self.agent() {
                Some(a) if self.running() => {
                    a.cancel();
                    self.note("cancelling the turn");
                }
                _ => self.note("no turn is running"),
            },
            "tree" => {
                let (entries, more) = crate::record::of(self.rt, crate::record::BOUND);
                for line in crate::record::render(&entries, more).lines() {
                    self.note(line);
                }
            }
            "sessions" => self.sessions().await,
            "resume" if rest.is_empty() => {
                self.error("/resume ID: which session (/sessions lists them)")
            }
            "resume" if self.idle_for("/resume") => match resolve(&*self.store, rest) {
                Ok(id) => {
                    let (model, permission) = (self.model.clone(), self.permission);
                    match self.reopen(&id, &model, permission).await {
                        Ok(()) => {}
                        Err(e) => self.error(format!("cannot resume {}: {e}", inert_line(rest))),
                    }
                }
                Err(e) => self.error(chain(&e).to_string()),
            },
            "fork" if self.idle_for("/fork") => self.fork(rest).await,
            "compact" if self.idle_for("/compact") => self.compact().await,
            "model" if rest.is_empty() => {
                self.note(format!("model {}/{}", self.route.provider, self.model))
            }
            "model" if self.idle_for("/model") => {
                let Some(id) = self.agent().map(|a| a.id().to_owned()) else {
                    return true;
                };
                let permission = self.permission;
                match self.reopen(&id, rest, permission).await {
                    Ok(()) => self.note(format!(
                        "model {}/{} from the next turn",
                        self.route.provider,
                        inert_line(rest)
                    )),
                    Err(e) => self.error(format!("cannot switch to {}: {e}", inert_line(rest))),
                }
            }
            "permission" => self.permission(rest).await,
            "dashboard" => self.dashboard().await,
            "export" => self.export(rest).await,
            "skill" => self.skill(rest),
            // A command refused while a turn runs (said by `idle_for`).
            _ => {}
        }
        true
    }

    async fn sessions(&self) {
        const SHOWN: usize = 20;
        // This session's last turn is listed too.
        if let Some(agent) = self.agent() {
            self.flush(agent).await;
        }
        let list = match self.store.list() {
            Ok(l) => l,
            Err(e) => return self.error(format!("cannot list the sessions: {}", chain(&e))),
        };
        let current = self.agent().map(|a| a.id().to_owned()).unwrap_or_default();
        let listed: Vec<_> = list.iter().flatten().collect();
        for s in listed.iter().take(SHOWN) {
            let mark = if s.id == current { "*" } else { " " };
            let short: String = s.id.chars().take(8).collect();
            self.note(format!(
                "{mark} {short}  {} turn{}  {}",
                s.turns,
                if s.turns == 1 { "" } else { "s" },
                cut(&inert_line(&s.title), 60)
            ));
        }
        if listed.len() > SHOWN {
            self.note(format!(
                "… and {} more (dsh sessions list)",
                listed.len() - SHOWN
            ));
        }
    }

    async fn fork(&mut self, at: &str) {
        let at = match at {
            "" => None,
            n => match n.parse::<u64>() {
                Ok(n) => Some(n),
                Err(_) => {
                    return self.error(format!(
                        "/fork [AT]: AT is an event's seq, not `{}`",
                        inert_line(n)
                    ));
                }
            },
        };
        let Some(agent) = self.agent() else { return };
        let id = agent.id().to_owned();
        if !self.flush(agent).await {
            return self.error("cannot fork: the log is not all written");
        }
        let fork = match crate::sessions::fork_session(&*self.store, &id, at) {
            Ok(f) => f,
            Err(e) => {
                return self.error(format!(
                    "cannot fork {id}: {}",
                    e.message.unwrap_or_default()
                ));
            }
        };
        let (model, permission) = (self.model.clone(), self.permission);
        match self.reopen(&fork, &model, permission).await {
            Ok(()) => self.note(format!("forked {id} as {fork}; you are on the fork")),
            Err(e) => self.error(format!("forked {id} as {fork}, but cannot open it: {e}")),
        }
    }

    async fn compact(&self) {
        let Some(agent) = self.agent() else { return };
        let before = agent.context_tokens().unwrap_or(0);
        match tokio::time::timeout(Duration::from_secs(300), agent.compact()).await {
            Ok(Ok(true)) => self.note(format!(
                "compacted: context {} → {} tokens",
                crate::lines::tokens(before),
                crate::lines::tokens(agent.context_tokens().unwrap_or(0))
            )),
            Ok(Ok(false)) => self.note("too little to compact yet"),
            Ok(Err(e)) => self.error(format!(
                "cannot compact: {}",
                inert_line(&chain(&e).to_string())
            )),
            Err(_) => self.error("cannot compact: no summary within 300 s"),
        }
    }

    /// `/permission MODE`: the next turns' mode, at most the flags' (the
    /// policy the chat's agent started with).
    async fn permission(&mut self, rest: &str) {
        let Some(agent) = self.agent() else { return };
        let now = agent.policy();
        if rest.is_empty() {
            return self.note(format!("permission mode {}", now.mode));
        }
        let mode: PermissionMode = match rest.parse() {
            Ok(m) => m,
            Err(e) => return self.error(format!("/permission MODE: {e}")),
        };
        let ceiling = self.ceiling();
        if mode > ceiling.mode {
            return self.error(format!(
                "/permission {mode}: the flags allow at most {} (restart with --permission-mode to allow more)",
                ceiling.mode
            ));
        }
        if !self.idle_for("/permission") {
            return;
        }
        let id = agent.id().to_owned();
        let model = self.model.clone();
        let chosen = Policy {
            mode,
            network: ceiling.network,
        };
        match self.reopen(&id, &model, Some(chosen)).await {
            Ok(()) => self.note(format!("permission mode {mode} from the next turn")),
            Err(e) => self.error(format!("cannot change the permission mode: {e}")),
        }
    }

    /// The most the flags allow: the `sandbox` service's default policy.
    fn ceiling(&self) -> Policy {
        self.rt
            .root()
            .get::<dsh_services::sandbox::Sandbox>(dsh_services::sandbox::Sandbox::SERVICE)
            .map(|s| s.defaults())
            .unwrap_or_default()
    }

    async fn dashboard(&mut self) {
        if self.dashboard.is_none() {
            let args = DashboardArgs {
                dashboard: Some("127.0.0.1:0".into()),
                ..DashboardArgs::default()
            };
            match crate::serve::dashboard_url(self.rt, &args).await {
                Ok(url) => {
                    self.approvals.share();
                    self.dashboard = url;
                }
                Err(e) => {
                    return self.error(format!(
                        "cannot start the dashboard: {}",
                        e.message.unwrap_or_default()
                    ));
                }
            }
        }
        if let Some(url) = &self.dashboard {
            self.note(format!("dashboard at {url}"));
        }
    }

    /// `/export FILE`: the conversation as Markdown (relative to the
    /// workspace), written whole or not at all.
    async fn export(&self, file: &str) {
        if file.is_empty() {
            return self.error("/export FILE: where to write the Markdown");
        }
        let Some(agent) = self.agent() else { return };
        if !self.flush(agent).await {
            return self.error("cannot export: the log is not all written");
        }
        let loaded = match self.store.load(agent.id()) {
            Ok(l) => l,
            Err(e) => return self.error(format!("cannot export: {}", chain(&e))),
        };
        let text = markdown(agent.id(), &loaded.events);
        let path = self.cwd.join(file);
        let written = tokio::task::spawn_blocking({
            let path = path.clone();
            move || crate::home::write_whole(&path, text.as_bytes())
        })
        .await;
        match written {
            Ok(Ok(())) => self.note(format!("exported to {}", path.display())),
            Ok(Err(e)) => self.error(format!("cannot write {}: {}", path.display(), chain(&e))),
            Err(e) => self.error(format!("cannot write {}: {}", path.display(), chain(&e))),
        }
    }

    /// `/skill NAME [ARGS]`: the skill's instructions (and the arguments)
    /// as the next message — skills the model may not load included.
    fn skill(&self, rest: &str) {
        let (name, args) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
        if name.is_empty() {
            return self.error("/skill NAME [ARGS]: which skill");
        }
        let home = crate::home::dir();
        let Some(skill) = dsh_services::skills::find(&self.cwd, Some(&home), name) else {
            let known: Vec<String> = dsh_services::skills::discover(&self.cwd, Some(&home))
                .into_iter()
                .map(|s| inert_line(&s.name))
                .collect();
            return self.error(format!(
                "no skill `{}` (known: {})",
                inert_line(name),
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ));
        };
        let mut text = dsh_services::skills::render(&skill);
        if !args.trim().is_empty() {
            text.push_str("\n\n");
            text.push_str(args.trim());
        }
        self.note(format!("skill {}", inert_line(&skill.name)));
        self.send(&text);
    }

    /// Once `leaving` (the input ended, or `/exit`): ready when the running
    /// and queued turns are done (at once with no agent left, after a
    /// session that could not be reopened). Until then: never.
    pub fn turns_done(&self, leaving: bool) -> impl std::future::Future<Output = ()> + use<> {
        let agent = self.agent().cloned();
        async move {
            match agent {
                Some(a) if leaving => {
                    let _ = a.when_idle(LAST_TURN).await;
                }
                None if leaving => {}
                _ => std::future::pending().await,
            }
        }
    }

    /// Cancels what runs, flushes the log and says how to continue.
    async fn finish(&mut self) {
        let Some(agent) = self.agent.take() else {
            return;
        };
        if !agent.is_idle() {
            agent.cancel();
            let _ = agent.when_idle(Duration::from_secs(30)).await;
        }
        match tokio::time::timeout(FLUSH, agent.session().flush()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => crate::errln!(
                "dsh chat: the session log was not fully written: {}",
                chain(&e)
            ),
            Err(_) => crate::errln!(
                "dsh chat: the session log was not written within {} s",
                FLUSH.as_secs()
            ),
        }
        let id = agent.id();
        let short: String = id.chars().take(8).collect();
        crate::errln!("session {short} ({id}) · continue with: dsh chat --resume {short}");
        if tokio::time::timeout(DISPOSE, agent.dispose())
            .await
            .is_err()
        {
            crate::errln!(
                "dsh chat: the agent did not stop within {} s",
                DISPOSE.as_secs()
            );
        }
    }
}

/// How long the end of a chat waits for its last turn.
const LAST_TURN: Duration = Duration::from_secs(6 * 3600);
/// How long writing a session's log may take.
const FLUSH: Duration = Duration::from_secs(30);
/// How long an agent may take to stop.
const DISPOSE: Duration = Duration::from_secs(30);

/// A session's conversation as Markdown: each user message, each answer,
/// each tool call with its result's first lines.
fn markdown(id: &str, events: &[dsh_services::session::SessionEvent]) -> String {
    use std::fmt::Write as _;
    let mut out = format!("# Session {id}\n");
    for e in events {
        match &e.data {
            EventData::UserMessage(m) => {
                let _ = write!(out, "\n## User\n\n{}\n", m.text().trim());
            }
            EventData::AssistantMessage { message, .. } => {
                let text = message.text();
                if !text.trim().is_empty() {
                    let _ = write!(out, "\n## Assistant\n\n{}\n", text.trim());
                }
            }
            EventData::ToolCall { call, .. } => {
                let (name, arguments) = (&call.name, &call.arguments);
                let _ = write!(
                    out,
                    "\n**Tool call** `{name}`\n\n```json\n{}\n```\n",
                    arguments.replace("```", "` ` `")
                );
            }
            EventData::ToolResult { message, error, .. } => {
                let text = crate::lines::result_text(message);
                let shown: Vec<&str> = text.lines().take(20).collect();
                let more = text.lines().count().saturating_sub(shown.len());
                let status = error
                    .as_ref()
                    .map(|e| format!(" ({})", e.code))
                    .unwrap_or_default();
                let _ = write!(
                    out,
                    "\n**Result**{status}\n\n```\n{}\n```\n",
                    shown.join("\n").replace("```", "` ` `")
                );
                if more > 0 {
                    let _ = writeln!(out, "\n… {more} more lines");
                }
            }
            _ => {}
        }
    }
    out
}
