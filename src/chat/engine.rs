//! The chat's engine: one resident agent, what the user does to it (a
//! message, a steer, a cancel, an approval answer) and what it does, as
//! display items. Both seats — the transcript (stdin not a terminal) and the
//! terminal — print these items; neither touches the agent's events.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use dsh_actors::agent::Agent;
use dsh_services::approval::{ApprovalAsk, ApprovalOutcome};
use dsh_services::llm::{ContentBlock, Message, Price, StreamChunk};
use dsh_services::session::{EventData, TurnEndReason};
use dsh_supervisors::error::chain;
use tokio::sync::{mpsc, oneshot};

use crate::lines::{self, Ending, inert, inert_line};

/// One thing the chat shows.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// A message of the user's went to the model (typed here, or sent from
    /// the page): its first line, made inert.
    Prompt(String),
    /// Part of the answer, as it streams (made inert).
    Text(String),
    /// Part of the model's reasoning, as it streams (made inert).
    Reasoning(String),
    /// A tool call began: its name and what it was asked, in short.
    ToolStarted {
        /// The tool.
        name: String,
        /// Its telling argument (a command, a path), on one line.
        arguments: String,
    },
    /// A tool call ended.
    ToolFinished {
        /// The tool.
        name: String,
        /// How it ended.
        outcome: Finished,
        /// From its start to its result.
        took: Duration,
    },
    /// A call waits for the user's answer (`y`, `a` or no).
    Approval {
        /// The number the answer refers to.
        id: u64,
        /// The tool, what it was asked and why it needs an answer.
        what: String,
    },
    /// A question withdrawn before it was answered (its call was cancelled).
    Withdrawn {
        /// The question's number.
        id: u64,
    },
    /// The model call failed and is tried again.
    Retry(String),
    /// A turn ended: how, with its figures.
    TurnEnd {
        /// The turn's number.
        turn: u32,
        /// How it ended, its time, steps, tokens and cost.
        ending: Ending,
    },
    /// Something the chat says (a command's answer).
    Note(String),
    /// Something that went wrong, with its causes.
    Error(String),
}

/// How a tool call ended, as its line says it.
#[derive(Clone, Debug, PartialEq)]
pub enum Finished {
    /// It succeeded: how much it returned.
    Done {
        /// Its result's lines (and KiB when large).
        size: String,
    },
    /// A command ran and exited non-zero.
    Exit {
        /// The exit code.
        code: i64,
        /// Its output's lines.
        size: String,
    },
    /// It failed: its error code and the first line of what it said.
    Failed {
        /// The error code (`DENIED`, `TIMEOUT`, …).
        code: String,
        /// The first line of what it said.
        first: String,
    },
}

impl std::fmt::Display for Item {
    /// One line per item, except the streamed text (as it came).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Item::Prompt(t) => write!(f, "> {t}"),
            Item::Text(t) | Item::Reasoning(t) => f.write_str(t),
            Item::ToolStarted { name, arguments } => write!(f, "▸ {name} {arguments}"),
            Item::ToolFinished {
                name,
                outcome,
                took,
            } => {
                let took = lines::duration(*took);
                match outcome {
                    Finished::Done { size } => write!(f, "  ✓ {name} · {size} · {took}"),
                    Finished::Exit { code, size } => {
                        write!(f, "  ✗ {name} · exit {code} · {size} · {took}")
                    }
                    Finished::Failed { code, first } => {
                        write!(f, "  ✗ {name} · {code}: {first} · {took}")
                    }
                }
            }
            Item::Approval { id, what } => write!(f, "approval {id}: {what}"),
            Item::Withdrawn { id } => write!(f, "approval {id} withdrawn: its call was cancelled"),
            Item::Retry(line) => f.write_str(line),
            Item::TurnEnd { turn, ending } => write!(f, "── turn {turn} {ending} ──"),
            Item::Note(line) => f.write_str(line),
            Item::Error(line) => write!(f, "error: {line}"),
        }
    }
}

/// Where items go: the seat's channel.
pub type Items = mpsc::UnboundedSender<Item>;

/// How the user answers an approval question.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `y`: this call only.
    Once,
    /// `a`: this call and every later call of the same tool in this chat.
    Always,
    /// Anything else.
    No,
}

impl Answer {
    /// What a typed line answers.
    pub fn of(line: &str) -> Answer {
        match line.trim().to_lowercase().as_str() {
            "y" | "yes" => Answer::Once,
            "a" | "always" => Answer::Always,
            _ => Answer::No,
        }
    }
}

/// One question waiting for the user.
struct Pending {
    id: u64,
    tool: String,
    answer: oneshot::Sender<ApprovalOutcome>,
}

/// The approval questions of a chat, asked in order, and the tools the user
/// allowed for the rest of it.
#[derive(Default)]
pub struct Approvals {
    /// The questions waiting, in the order their numbers were shown, and
    /// whether the input has ended (then every question is refused). One
    /// lock: a question is numbered, queued and shown under it, so the
    /// queue's order is the order the user saw, and none slips in after
    /// the end.
    state: Mutex<Questions>,
    always: Mutex<BTreeSet<String>>,
    /// The dashboard answers too: a question is put to both, the first
    /// answer wins and the other side's question is withdrawn.
    shared: std::sync::atomic::AtomicBool,
    /// How long a question waits for its answer before it is refused
    /// (`None`: as long as its call does).
    expiry: Option<Duration>,
}

#[derive(Default)]
struct Questions {
    next: u64,
    waiting: VecDeque<Pending>,
    closed: bool,
}

/// Takes a question out of the queue when its asker stops waiting, however
/// that happens (answered, withdrawn, its future dropped by the seam), and
/// says so unless it was answered here.
struct Asked<'a> {
    approvals: &'a Approvals,
    items: &'a Items,
    id: u64,
    settled: bool,
}

impl Drop for Asked<'_> {
    fn drop(&mut self) {
        let mut state = lock(&self.approvals.state);
        let before = state.waiting.len();
        state.waiting.retain(|p| p.id != self.id);
        if !self.settled && state.waiting.len() < before {
            let _ = self.items.send(Item::Withdrawn { id: self.id });
        }
    }
}

impl Approvals {
    /// Questions refused when unanswered after `expiry`.
    pub fn expiring(expiry: Option<Duration>) -> Approvals {
        Approvals {
            expiry,
            ..Approvals::default()
        }
    }

    /// From now on the dashboard's answerer (further down the approval
    /// chain) gets each question too.
    pub fn share(&self) {
        self.shared.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Forgets the tools answered `a` (another session was opened).
    pub fn forget_always(&self) {
        lock(&self.always).clear();
    }

    /// Whether a question waits for its answer.
    pub fn waiting(&self) -> bool {
        let mut state = lock(&self.state);
        // A question whose asker is gone is no question.
        state.waiting.retain(|p| !p.answer.is_closed());
        !state.waiting.is_empty()
    }

    /// Answers the first question still asked; `None` when none waits.
    pub fn answer(&self, answer: Answer) -> Option<u64> {
        let outcome = match answer {
            Answer::Once | Answer::Always => ApprovalOutcome::AllowedOnce,
            Answer::No => ApprovalOutcome::Rejected,
        };
        let mut state = lock(&self.state);
        while let Some(pending) = state.waiting.pop_front() {
            if pending.answer.send(outcome).is_err() {
                continue;
            }
            if answer == Answer::Always {
                lock(&self.always).insert(pending.tool);
            }
            return Some(pending.id);
        }
        None
    }

    /// Nobody will answer any more (the input ended): refuses the questions
    /// waiting and every later one (fail closed); returns how many waited.
    pub fn close(&self) -> usize {
        let mut state = lock(&self.state);
        state.closed = true;
        state
            .waiting
            .drain(..)
            .map(|p| p.answer.send(ApprovalOutcome::Rejected).is_ok())
            .filter(|sent| *sent)
            .count()
    }

    /// Puts `ask` to the user through `items` and waits for the answer, or
    /// answers at once for a tool allowed always. `elsewhere` is the
    /// dashboard's answer: when it comes first, this question is withdrawn
    /// (an `unavailable` from it leaves the question to the user).
    async fn ask(
        &self,
        ask: &ApprovalAsk,
        items: &Items,
        elsewhere: impl Future<Output = ApprovalOutcome>,
    ) -> ApprovalOutcome {
        let tool = inert_line(&ask.request.tool);
        let (id, mut answered) = {
            let mut state = lock(&self.state);
            if state.closed {
                let _ = items.send(Item::Note(format!(
                    "refused {tool}: the input has ended, nobody is left to answer"
                )));
                return ApprovalOutcome::Rejected;
            }
            if lock(&self.always).contains(&ask.request.tool) {
                let _ = items.send(Item::Note(format!(
                    "allowed {tool} (always, as answered before)"
                )));
                return ApprovalOutcome::AllowedOnce;
            }
            state.next += 1;
            let id = state.next;
            let (answer, answered) = oneshot::channel();
            state.waiting.push_back(Pending {
                id,
                tool: ask.request.tool.clone(),
                answer,
            });
            let _ = items.send(Item::Approval {
                id,
                what: question(ask),
            });
            (id, answered)
        };
        let mut asked = Asked {
            approvals: self,
            items,
            id,
            settled: false,
        };
        let mut elsewhere = std::pin::pin!(elsewhere);
        let mut asking_elsewhere = true;
        let expired = async {
            match self.expiry {
                Some(after) => tokio::time::sleep(after).await,
                None => std::future::pending().await,
            }
        };
        let mut expired = std::pin::pin!(expired);
        loop {
            tokio::select! {
                // An answer that came wins over the expiry that fired with it.
                biased;
                outcome = &mut answered => {
                    asked.settled = true;
                    return outcome.unwrap_or(ApprovalOutcome::Unavailable);
                }
                () = &mut expired => {
                    asked.settled = true;
                    let after = self.expiry.map(lines::duration).unwrap_or_default();
                    let _ = items.send(Item::Note(format!(
                        "approval {id} unanswered after {after}: refused"
                    )));
                    return ApprovalOutcome::Rejected;
                }
                () = ask.cancel.cancelled() => return ApprovalOutcome::Cancelled,
                outcome = &mut elsewhere, if asking_elsewhere => {
                    if outcome == ApprovalOutcome::Unavailable {
                        asking_elsewhere = false;
                        continue;
                    }
                    asked.settled = true;
                    let _ = items.send(Item::Note(format!(
                        "approval {id} answered on the dashboard: {}",
                        outcome.as_str()
                    )));
                    return outcome;
                }
            }
        }
    }
}

/// A question on one line: the tool, what it was asked (short), and why it
/// needs an answer; `[y once / a always / n]`.
fn question(ask: &ApprovalAsk) -> String {
    let arguments = short_arguments(&ask.request.arguments.to_string(), 160);
    format!(
        "{} {arguments} — {} [y once / a always / n]",
        inert_line(&ask.request.tool),
        inert_line(&ask.request.reason)
    )
}

/// Routes `agent`'s approval asks (its own and its children's) to the user,
/// ahead of every other answerer; once [`Approvals::share`] was called, the
/// rest of the chain (the dashboard) is asked at the same time.
pub fn answer_approvals(
    agent: &Agent,
    approvals: Arc<Approvals>,
    items: Items,
) -> Result<(), String> {
    let ctx = agent.context().map_err(|e| chain(&e).to_string())?;
    let first = dsh_supervisors::ListenOptions {
        prepend: true,
        ..Default::default()
    };
    ctx.on_waterfall_with(first, move |ask: ApprovalAsk, next| {
        let (approvals, items) = (approvals.clone(), items.clone());
        async move {
            if !approvals.shared.load(std::sync::atomic::Ordering::SeqCst) {
                return approvals.ask(&ask, &items, std::future::pending()).await;
            }
            let copy = ApprovalAsk {
                id: ask.id.clone(),
                request: ask.request.clone(),
                cancel: ask.cancel.clone(),
            };
            approvals.ask(&ask, &items, next.run(copy)).await
        }
    })
    .map(|_| ())
    .map_err(|e| chain(&e).to_string())
}

/// What the observer keeps between events: the running calls and the
/// figures of the running turn.
#[derive(Default)]
struct Watch {
    calls: HashMap<Box<str>, (Box<str>, Instant)>,
    began: Option<Instant>,
    steps: u64,
    input: u64,
    cached: u64,
    output: u64,
}

/// The tokens a chat has spent, over all its turns and agents.
#[derive(Debug, Default)]
pub struct Totals {
    /// Input tokens (cached ones included).
    pub input: std::sync::atomic::AtomicU64,
    /// Output tokens.
    pub output: std::sync::atomic::AtomicU64,
}

/// Shows `agent`'s events as items, and counts its tokens into `totals`;
/// `price` prices a turn's tokens. `reasoning`: whether the model's
/// reasoning is shown.
pub fn observe(
    agent: &Agent,
    items: Items,
    totals: Arc<Totals>,
    price: Option<Price>,
    reasoning: bool,
) {
    let watch = Mutex::new(Watch::default());
    agent.session().observe(Arc::new(move |e| {
        let mut w = lock(&watch);
        let item = match &e.data {
            EventData::TurnStart { .. } => {
                *w = Watch {
                    began: Some(Instant::now()),
                    ..Watch::default()
                };
                None
            }
            EventData::StepStart { .. } => {
                w.steps += 1;
                None
            }
            EventData::UserMessage(m) if m.source.kind == "user" => {
                Some(Item::Prompt(prompt_line(&m.text())))
            }
            EventData::AssistantChunk { chunk, .. } => match &**chunk {
                StreamChunk::TextDelta { text, .. } => Some(Item::Text(inert(text))),
                StreamChunk::ReasoningDelta { text, .. } if reasoning => {
                    Some(Item::Reasoning(inert(text)))
                }
                _ => None,
            },
            EventData::AssistantMessage { usage, .. } => {
                if let Some(u) = usage {
                    use std::sync::atomic::Ordering::Relaxed;
                    totals
                        .input
                        .fetch_add(u.input_tokens + u.cache_read_tokens.unwrap_or(0), Relaxed);
                    totals.output.fetch_add(u.output_tokens, Relaxed);
                    w.input += u.input_tokens;
                    w.cached += u.cache_read_tokens.unwrap_or(0);
                    w.output += u.output_tokens;
                }
                None
            }
            EventData::ToolCall { call, .. } => {
                let (call_id, name, arguments) = (&call.call_id, &call.name, &call.arguments);
                w.calls
                    .insert(call_id.clone(), (name.clone(), Instant::now()));
                Some(Item::ToolStarted {
                    name: inert_line(name),
                    arguments: short_arguments(arguments, 120),
                })
            }
            EventData::ToolResult { message, error, .. } => {
                let call = message.content.iter().find_map(|b| match b {
                    ContentBlock::ToolResult { tool_call_id, .. } => Some(tool_call_id.as_str()),
                    _ => None,
                });
                let (name, took) = call
                    .and_then(|id| w.calls.remove(id))
                    .map(|(name, at)| (inert_line(&name), at.elapsed()))
                    .unwrap_or_else(|| ("tool".into(), Duration::ZERO));
                let text = lines::result_text(message);
                let outcome = match (error, exit_code(&text)) {
                    (Some(err), _) => Finished::Failed {
                        code: inert_line(&err.code),
                        first: cut(&inert_line(text.lines().next().unwrap_or("")), 120),
                    },
                    (None, Some((code, printed))) => Finished::Exit {
                        code,
                        size: size(printed),
                    },
                    (None, None) => Finished::Done { size: size(&text) },
                };
                Some(Item::ToolFinished {
                    name,
                    outcome,
                    took,
                })
            }
            EventData::Other { kind, data } if &**kind == "llm/retry" => {
                Some(Item::Retry(lines::retrying(data)))
            }
            EventData::TurnEnd { turn, reason } => {
                let (outcome, diagnostic) = match &**reason {
                    TurnEndReason::Completed => ("completed", None),
                    TurnEndReason::MaxTokens => ("max-tokens", None),
                    TurnEndReason::Aborted { .. } | TurnEndReason::Interrupted => ("aborted", None),
                    TurnEndReason::Blocked => (
                        "blocked",
                        Some("a hook blocked the turn before its step".to_owned()),
                    ),
                    TurnEndReason::Error { error } => {
                        ("error", Some(format!("{}: {}", error.code, error.message)))
                    }
                };
                let ending = Ending {
                    outcome: outcome.to_owned(),
                    diagnostic,
                    elapsed: w.began.map(|b| b.elapsed()),
                    steps: Some(w.steps),
                    tokens: Some(w.input + w.cached + w.output),
                    cost: price.map(|p| p.cost(w.input, w.cached, w.output)),
                };
                Some(Item::TurnEnd {
                    turn: *turn,
                    ending,
                })
            }
            _ => None,
        };
        drop(w);
        if let Some(item) = item {
            let _ = items.send(item);
        }
    }));
}

/// How a prompt item shows a message: its first line, inert, cut.
pub fn prompt_line(text: &str) -> String {
    cut(&inert_line(text.trim().lines().next().unwrap_or("")), 120)
}

/// Sends `text` as the user's next message: a new turn when the agent is
/// idle, else queued behind the running one. Returns whether it was queued.
pub fn send(agent: &Agent, text: &str) -> Result<bool, String> {
    // A turn that has ended but not yet settled queues nothing visible.
    let progress = agent.progress();
    let queued = progress.running || progress.queued > 0;
    agent
        .followup(Message::user_text(text))
        .map_err(|e| chain(&e).to_string())?;
    Ok(queued)
}

/// Tells the running turn `text` at its next step; `false` when no turn
/// runs (then nothing was sent).
pub fn steer(agent: &Agent, text: &str) -> Result<bool, String> {
    if agent.is_idle() {
        return Ok(false);
    }
    agent
        .steer(Message::user_text(text))
        .map_err(|e| chain(&e).to_string())?;
    Ok(true)
}

/// The arguments of a call in a line: the one argument that says what the
/// call does (a command, a path, a pattern), else the JSON; inert, on one
/// line, cut to `width` characters.
pub fn short_arguments(arguments: &str, width: usize) -> String {
    let text = dsh_services::tools::telling_argument(arguments);
    let flat: String = inert(&text)
        .chars()
        .map(|c| if c.is_whitespace() { ' ' } else { c })
        .collect();
    cut(flat.trim(), width.max(10))
}

/// `text` cut to `n` characters, ending in `…` when cut.
pub fn cut(text: &str, n: usize) -> String {
    if text.chars().count() <= n {
        return text.to_owned();
    }
    let mut s: String = text.chars().take(n.saturating_sub(1)).collect();
    s.push('…');
    s
}

/// The exit code a shell result reports, when it is not 0, and what the
/// command printed before the marker (a note on a denial may follow it).
fn exit_code(text: &str) -> Option<(i64, &str)> {
    let at = text.rfind("[exit code: ")?;
    let (printed, marker) = text.split_at(at);
    let code = marker
        .lines()
        .next()?
        .strip_prefix("[exit code: ")?
        .strip_suffix(']')?;
    Some((code.parse().ok()?, printed.trim_end_matches('\n')))
}

/// How big a result is: lines, and KiB when large.
fn size(text: &str) -> String {
    let lines = text.lines().count();
    let unit = if lines == 1 { "line" } else { "lines" };
    if text.len() >= 10 * 1024 {
        format!("{lines} {unit}, {} KiB", text.len() / 1024)
    } else {
        format!("{lines} {unit}")
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_shows_what_it_does_and_a_shell_result_its_exit_code() {
        assert_eq!(
            short_arguments(r#"{"command":"ls -la\nwc"}"#, 40),
            "ls -la wc"
        );
        assert_eq!(short_arguments(r#"{"a":1}"#, 40), r#"{"a":1}"#);
        let long = short_arguments(&format!(r#"{{"path":"{}"}}"#, "x".repeat(50)), 12);
        assert_eq!(long.chars().count(), 12);
        assert!(long.ends_with('…'));
        // Escape sequences in arguments never reach the terminal.
        assert_eq!(
            short_arguments("{\"command\":\"echo \\u001b[2Jhi\"}", 40),
            "echo hi"
        );
        assert_eq!(exit_code("out\n[exit code: 2]\n"), Some((2, "out")));
        let denied = "touch: Read-only file system\n[exit code: 1]\n\n[the sandbox refused]";
        assert_eq!(exit_code(denied), Some((1, "touch: Read-only file system")));
        assert_eq!(exit_code("all good"), None);
        assert_eq!(size("a\nb"), "2 lines");
        assert_eq!(size("a"), "1 line");
    }

    #[test]
    fn items_read_as_one_line_each() {
        let done = Item::ToolFinished {
            name: "bash".into(),
            outcome: Finished::Exit {
                code: 2,
                size: "3 lines".into(),
            },
            took: Duration::from_millis(1200),
        };
        assert_eq!(done.to_string(), "  ✗ bash · exit 2 · 3 lines · 1.2 s");
        let end = Item::TurnEnd {
            turn: 2,
            ending: Ending {
                outcome: "completed".into(),
                elapsed: Some(Duration::from_millis(300)),
                steps: Some(2),
                tokens: Some(1500),
                ..Ending::default()
            },
        };
        assert_eq!(
            end.to_string(),
            "── turn 2 completed in 300 ms · 2 steps · 1.5k tokens ──"
        );
        assert_eq!(Answer::of(" Y "), Answer::Once);
        assert_eq!(Answer::of("a"), Answer::Always);
        assert_eq!(Answer::of("sure"), Answer::No);
        assert_eq!(Answer::of(""), Answer::No);
    }
}
