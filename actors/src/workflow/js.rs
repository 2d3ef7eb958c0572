//! The QuickJS side of a run: one OS thread owning the JS runtime.
//!
//! The thread evaluates the wrapped script, then loops: run pending jobs,
//! check the script's promise, and block on the next answer from the host
//! (bounded by the run's deadline). An interrupt handler stops a script
//! spinning on the CPU once the run is stopped or out of time.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::{Duration, Instant};

use dsh_supervisors::error::chain;
use rquickjs::context::EvalOptions;
use rquickjs::function::Opt;
use rquickjs::promise::PromiseState;
use rquickjs::{CatchResultExt, CaughtError, Ctx, Function, Object, Persistent, Promise};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

use super::AgentOptions;

/// What the script asks of the host.
pub(super) enum ToHost {
    Phase(String),
    Log(String),
    Agent {
        seq: u64,
        prompt: String,
        options: AgentOptions,
    },
    /// The first terminal outcome of the script.
    Done(Result<Value, String>),
}

/// The host's answer to one `agent()` call.
pub(super) enum Answer {
    /// Resolve the promise with this value.
    Value(Value),
    /// A fatal hook failure: the script dies with it.
    Fatal(String),
}

enum ToJs {
    Answer(u64, Answer),
    Stop,
}

pub(super) struct Setup {
    pub script: String,
    pub args: Value,
    pub max_agents: u32,
    pub memory: usize,
    pub time: Duration,
    pub to_host: mpsc::UnboundedSender<ToHost>,
}

/// The host's handle on the JS thread.
pub(super) struct Js {
    tx: Sender<ToJs>,
    stop: Arc<AtomicBool>,
    done: Option<oneshot::Receiver<()>>,
}

impl Js {
    pub fn answer(&self, seq: u64, answer: Answer) {
        let _ = self.tx.send(ToJs::Answer(seq, answer));
    }

    /// Stops the script: wakes a waiting thread, interrupts a running one.
    pub fn stop(&self) {
        self.stop.store(true, Ordering::Release);
        let _ = self.tx.send(ToJs::Stop);
    }

    /// Waits for the thread to finish (it does promptly once stopped).
    pub async fn join(mut self) {
        if let Some(done) = self.done.take()
            && tokio::time::timeout(Duration::from_secs(10), done)
                .await
                .is_err()
        {
            tracing::error!("a workflow script thread did not stop within 10 s");
        }
    }
}

/// Starts the JS thread.
pub(super) fn spawn(setup: Setup) -> std::io::Result<Js> {
    let (tx, rx) = channel();
    let stop = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = oneshot::channel();
    let flag = stop.clone();
    std::thread::Builder::new()
        .name("workflow-js".into())
        .spawn(move || {
            let to_host = setup.to_host.clone();
            let outcome = run(setup, rx, flag);
            let _ = to_host.send(ToHost::Done(outcome));
            let _ = done_tx.send(());
        })?;
    Ok(Js {
        tx,
        stop,
        done: Some(done_rx),
    })
}

/// Characters put before the script's first line.
const PREFIX: &str = "(async () => {";
const FILE: &str = "workflow.js";

type Resolvers = (Persistent<Function<'static>>, Persistent<Function<'static>>);

struct State {
    /// The resolve and reject functions of each unanswered `agent()` call.
    pending: RefCell<HashMap<u64, Resolvers>>,
    fatal: RefCell<Option<String>>,
    next: Cell<u64>,
    /// `log()` and `phase()` calls so far (bounded: they cross to the host).
    notes: Cell<u64>,
    max_agents: u32,
    to_host: mpsc::UnboundedSender<ToHost>,
}

fn run(setup: Setup, rx: Receiver<ToJs>, stop: Arc<AtomicBool>) -> Result<Value, String> {
    let rt =
        rquickjs::Runtime::new().map_err(|e| format!("cannot start QuickJS: {}", chain(&e)))?;
    rt.set_memory_limit(setup.memory);
    rt.set_max_stack_size(1 << 20);
    let deadline = Instant::now() + setup.time;
    let flag = stop.clone();
    rt.set_interrupt_handler(Some(Box::new(move || {
        flag.load(Ordering::Acquire) || Instant::now() >= deadline
    })));
    let context =
        rquickjs::Context::full(&rt).map_err(|e| format!("cannot start QuickJS: {}", chain(&e)))?;
    let state = Rc::new(State {
        pending: RefCell::default(),
        fatal: RefCell::default(),
        next: Cell::new(0),
        notes: Cell::new(0),
        max_agents: setup.max_agents,
        to_host: setup.to_host.clone(),
    });
    let outcome = event_loop(&rt, &context, &state, setup, &rx, &stop, deadline);
    // The resolvers of unanswered calls are JS values held from Rust (and
    // the globals' closures hold the state): drop them before the runtime
    // goes, or QuickJS finds live objects at teardown.
    state.pending.borrow_mut().clear();
    outcome
}

fn event_loop(
    rt: &rquickjs::Runtime,
    context: &rquickjs::Context,
    state: &Rc<State>,
    setup: Setup,
    rx: &Receiver<ToJs>,
    stop: &AtomicBool,
    deadline: Instant,
) -> Result<Value, String> {
    let time = setup.time;
    let limit = move || format!("TIME_LIMIT: the workflow ran past its {time:?} limit");
    let main = context.with(|ctx| -> Result<Persistent<Promise<'static>>, String> {
        install(&ctx, state, &setup.args)
            .map_err(|e| format!("cannot set up the script: {}", chain(&e)))?;
        let wrapped = format!("{PREFIX}{}\n}})()", setup.script);
        let mut options = EvalOptions::default();
        options.global = true;
        options.strict = false;
        options.filename = Some(FILE.into());
        let promise: Promise = ctx
            .eval_with_options(wrapped, options)
            .catch(&ctx)
            .map_err(|e| describe(e, "SCRIPT_PARSE"))?;
        Ok(Persistent::save(&ctx, promise))
    });
    let main = match main {
        Ok(m) => m,
        Err(_) if Instant::now() >= deadline => return Err(limit()),
        Err(e) => return Err(e),
    };
    loop {
        loop {
            match rt.execute_pending_job() {
                Ok(true) => {}
                Ok(false) => break,
                Err(_) if Instant::now() >= deadline => return Err(limit()),
                Err(_) => {
                    return Err(
                        "SCRIPT_ERROR: a promise callback failed (out of memory or interrupted)"
                            .into(),
                    );
                }
            }
        }
        if let Some(fatal) = state.fatal.borrow_mut().take() {
            return Err(fatal);
        }
        if stop.load(Ordering::Acquire) {
            return Err("STOPPED: the workflow was stopped".into());
        }
        let settled = context.with(|ctx| -> Option<Result<Value, String>> {
            let promise = match main.clone().restore(&ctx) {
                Ok(p) => p,
                Err(e) => return Some(Err(format!("lost the script's promise: {}", chain(&e)))),
            };
            match promise.state() {
                PromiseState::Pending => None,
                PromiseState::Resolved => Some(returned(&ctx, &promise)),
                PromiseState::Rejected => {
                    let error = promise
                        .result::<rquickjs::Value>()
                        .map(|r| r.catch(&ctx))
                        .and_then(|r| r.err())
                        .map(|e| describe(e, "SCRIPT_ERROR"))
                        .unwrap_or_else(|| "SCRIPT_ERROR: the script failed".into());
                    Some(Err(error))
                }
            }
        });
        match settled {
            Some(Err(_)) if Instant::now() >= deadline => return Err(limit()),
            Some(r) => return r,
            None => {}
        }
        // Only `agent()` answers can settle anything here (no timers, no
        // I/O): with none outstanding, the script waits forever.
        if state.pending.borrow().is_empty() {
            return Err(
                "SCRIPT_STUCK: the script awaits a promise that nothing will settle".into(),
            );
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(ToJs::Answer(seq, answer)) => {
                let entry = state.pending.borrow_mut().remove(&seq);
                let Some((resolve, reject)) = entry else {
                    continue;
                };
                let delivered = context.with(|ctx| -> rquickjs::Result<()> {
                    match answer {
                        Answer::Value(v) => {
                            let value = ctx.json_parse(v.to_string())?;
                            resolve.restore(&ctx)?.call::<_, ()>((value,))
                        }
                        Answer::Fatal(message) => {
                            *state.fatal.borrow_mut() = Some(message.clone());
                            let error = rquickjs::Exception::from_message(ctx.clone(), &message)?;
                            reject.restore(&ctx)?.call::<_, ()>((error,))
                        }
                    }
                });
                if let Err(e) = delivered {
                    return Err(format!("cannot deliver an agent() result: {}", chain(&e)));
                }
            }
            Ok(ToJs::Stop) | Err(RecvTimeoutError::Disconnected) => {
                return Err("STOPPED: the workflow was stopped".into());
            }
            Err(RecvTimeoutError::Timeout) => return Err(limit()),
        }
    }
}

/// The script's return value as JSON (`null` for `undefined`).
fn returned<'js>(ctx: &Ctx<'js>, promise: &Promise<'js>) -> Result<Value, String> {
    let value: rquickjs::Value = match promise.result() {
        Some(Ok(v)) => v,
        _ => return Ok(Value::Null),
    };
    if value.is_undefined() {
        return Ok(Value::Null);
    }
    let text = ctx
        .json_stringify(value)
        .catch(ctx)
        .map_err(|e| describe(e, "RESULT_UNSERIALIZABLE"))?;
    match text {
        None => Err("RESULT_UNSERIALIZABLE: the return value is not JSON data".into()),
        Some(s) => {
            let s = s.to_string().map_err(|e| chain(&e).to_string())?;
            serde_json::from_str(&s).map_err(|e| format!("RESULT_UNSERIALIZABLE: {}", chain(&e)))
        }
    }
}

/// Codes of the errors hooks throw (their messages are already complete).
const FATAL_CODES: &[&str] = &[
    "AGENT_CAP",
    "AGENT_START",
    "INVALID_ARGUMENT",
    "UNSUPPORTED_OPTION",
    "LOG_CAP",
];

/// A thrown value as `CODE: Name: message (workflow.js line L, column C)`.
fn describe(error: CaughtError<'_>, code: &str) -> String {
    match error {
        CaughtError::Exception(e) => {
            let message = e.message().unwrap_or_default();
            let name: String = e.as_object().get("name").unwrap_or_else(|_| "Error".into());
            // A fatal hook error already says what it is.
            if FATAL_CODES.iter().any(|c| message.starts_with(c)) {
                return message;
            }
            let place = e.stack().and_then(|s| position(&s)).or_else(|| {
                let line: Option<u32> = e.as_object().get("lineNumber").ok();
                let col: Option<u32> = e.as_object().get("columnNumber").ok();
                line.map(|l| (l, col.unwrap_or(0)))
            });
            match place {
                Some((line, column)) => {
                    format!("{code}: {name}: {message} ({FILE} line {line}, column {column})")
                }
                None => format!("{code}: {name}: {message}"),
            }
        }
        CaughtError::Value(v) => {
            let shown = v
                .as_string()
                .and_then(|s| s.to_string().ok())
                .unwrap_or_else(|| format!("{v:?}"));
            format!("{code}: uncaught {shown}")
        }
        CaughtError::Error(e) => format!("{code}: {}", chain(&e)),
    }
}

/// The first `workflow.js:L:C` of a stack, in the script's own coordinates.
fn position(stack: &str) -> Option<(u32, u32)> {
    let at = stack.find(&format!("{FILE}:"))?;
    let rest = &stack[at + FILE.len() + 1..];
    let mut parts = rest.split(|c: char| !c.is_ascii_digit());
    let line: u32 = parts.next()?.parse().ok()?;
    let column: u32 = parts.next().and_then(|c| c.parse().ok()).unwrap_or(0);
    let column = if line == 1 {
        column.saturating_sub(PREFIX.len() as u32)
    } else {
        column
    };
    Some((line, column))
}

/// The globals: `args`, `agent`, `phase`, `log`.
fn install<'js>(ctx: &Ctx<'js>, state: &Rc<State>, args: &Value) -> rquickjs::Result<()> {
    let globals = ctx.globals();
    globals.set("args", ctx.json_parse(args.to_string())?)?;
    let s = state.clone();
    globals.set(
        "phase",
        Function::new(
            ctx.clone(),
            move |ctx: Ctx<'js>, title: rquickjs::Coerced<String>| {
                note(&ctx, &s, ToHost::Phase(title.0))
            },
        )?,
    )?;
    let s = state.clone();
    globals.set(
        "log",
        Function::new(
            ctx.clone(),
            move |ctx: Ctx<'js>, message: rquickjs::Coerced<String>| {
                note(&ctx, &s, ToHost::Log(message.0))
            },
        )?,
    )?;
    let s = state.clone();
    globals.set(
        "agent",
        Function::new(
            ctx.clone(),
            move |ctx: Ctx<'js>, prompt: rquickjs::Value<'js>, opts: Opt<rquickjs::Value<'js>>| {
                agent_call(&ctx, &s, prompt, opts.0)
            },
        )?,
    )?;
    Ok(())
}

/// Most `log()` + `phase()` calls a run may make.
const MAX_NOTES: u64 = 10_000;

/// Sends a narration line to the host, within [`MAX_NOTES`].
fn note<'js>(ctx: &Ctx<'js>, state: &State, message: ToHost) -> rquickjs::Result<()> {
    let n = state.notes.get() + 1;
    if n > MAX_NOTES {
        return Err(fatal(
            ctx,
            state,
            format!("LOG_CAP: a workflow may call log() and phase() at most {MAX_NOTES} times"),
        ));
    }
    state.notes.set(n);
    let _ = state.to_host.send(message);
    Ok(())
}

/// A fatal misuse: recorded so the script dies even if it catches it.
fn fatal<'js>(ctx: &Ctx<'js>, state: &State, message: String) -> rquickjs::Error {
    *state.fatal.borrow_mut() = Some(message.clone());
    rquickjs::Exception::throw_type(ctx, &message)
}

fn agent_call<'js>(
    ctx: &Ctx<'js>,
    state: &Rc<State>,
    prompt: rquickjs::Value<'js>,
    opts: Option<rquickjs::Value<'js>>,
) -> rquickjs::Result<Promise<'js>> {
    let Some(prompt) = prompt.as_string().and_then(|s| s.to_string().ok()) else {
        return Err(fatal(
            ctx,
            state,
            "INVALID_ARGUMENT: agent(prompt, opts) needs a string prompt".into(),
        ));
    };
    if prompt.trim().is_empty() {
        return Err(fatal(
            ctx,
            state,
            "INVALID_ARGUMENT: agent() was given an empty prompt".into(),
        ));
    }
    let options = match opts.filter(|o| !o.is_undefined() && !o.is_null()) {
        None => AgentOptions::default(),
        Some(o) => {
            let Some(object) = o.as_object().cloned() else {
                return Err(fatal(
                    ctx,
                    state,
                    "INVALID_ARGUMENT: agent() options must be an object".into(),
                ));
            };
            let text = ctx
                .json_stringify(Object::into_value(object))?
                .map(|s| s.to_string())
                .transpose()?
                .unwrap_or_else(|| "{}".into());
            match serde_json::from_str::<AgentOptions>(&text) {
                Ok(o) => o,
                Err(e) => {
                    return Err(fatal(
                        ctx,
                        state,
                        format!("UNSUPPORTED_OPTION: agent() options: {}", chain(&e)),
                    ));
                }
            }
        }
    };
    let seq = state.next.get() + 1;
    if seq > u64::from(state.max_agents) {
        return Err(fatal(
            ctx,
            state,
            format!(
                "AGENT_CAP: the workflow may start at most {} agents (`dsh workflow --max-agents N` sets it, up to 256)",
                state.max_agents
            ),
        ));
    }
    state.next.set(seq);
    let (promise, resolve, reject) = ctx.promise()?;
    state.pending.borrow_mut().insert(
        seq,
        (
            Persistent::save(ctx, resolve),
            Persistent::save(ctx, reject),
        ),
    );
    let _ = state.to_host.send(ToHost::Agent {
        seq,
        prompt,
        options,
    });
    Ok(promise)
}
