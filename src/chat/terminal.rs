//! The chat's seat on a terminal: a line editor with history
//! (`~/.dsh/history`), the answer rendered as Markdown as it streams,
//! reasoning folded to one dimmed line, and a status line after each turn.
//!
//! Three threads besides the runtime's: the editor's (rustyline's
//! `readline` blocks), the printer's (rustyline prints above the prompt
//! through a pipe and may block), and the loop here, which owns the chat.
//! Keys: Enter sends (queued while a turn runs), Alt-Enter or Ctrl-J a new
//! line, `!` steers, Ctrl-C cancels the running turn and a second one
//! within 2 s leaves, Ctrl-D on an empty line leaves. Every line shown is a
//! display item ([`Item`]) of model and tool text made inert; the styles
//! are added here.

use std::io::Write as _;
use std::sync::mpsc as std_mpsc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use super::Chat;
use super::engine::{Finished, Item};
use super::markdown::Markdown;
use crate::exit::{self, Exit, Stop};

/// How long after a Ctrl-C a second one leaves.
const TWICE: Duration = Duration::from_secs(2);

/// What the editor thread hands the loop.
enum Key {
    /// Enter: the line typed (several lines after Alt-Enter).
    Line(String),
    /// Ctrl-C.
    Interrupt,
    /// Ctrl-D on an empty line.
    Eof,
    /// The terminal could not be read.
    Failed(String),
}

/// Whether this chat can sit at a terminal: stdin and stdout are both one.
pub fn usable() -> bool {
    use std::io::IsTerminal;
    std::io::stdin().is_terminal() && std::io::stdout().is_terminal()
}

/// Converses at the terminal until Ctrl-D, a second Ctrl-C, `/exit` (once
/// the running turn ends) or a signal.
pub async fn converse(
    chat: &mut Chat<'_>,
    mut shown: mpsc::UnboundedReceiver<Item>,
) -> exit::Result<()> {
    // Watched before the editor's first read: rustyline puts back, after
    // each read, the SIGINT handler it found (tokio's, from here on).
    let mut signals = crate::exit::Signals::watch();
    let _restore = Restore::save();
    let Seat {
        mut keys,
        out,
        resume,
        stopping,
        printed,
    } = editor().map_err(|e| Exit::failed(format!("cannot use the terminal: {e}")))?;
    let mut screen = Screen::new(out);
    let mut leaving = false;
    let mut armed: Option<Instant> = None;
    // Whether the editor waits to be resumed (it handed over a key).
    let mut gated = false;
    let result = loop {
        let idle = chat.turns_done(leaving);
        let key = tokio::select! {
            biased;
            Some(item) = shown.recv() => {
                // What was typed here is on the screen already.
                if let Item::Prompt(p) = &item
                    && chat.typed_here(p)
                {
                    continue;
                }
                let ended = matches!(item, Item::TurnEnd { .. });
                screen.show(&item);
                if ended {
                    screen.status(&chat.status().await);
                }
                continue;
            }
            key = keys.recv() => {
                gated = true;
                key.unwrap_or(Key::Eof)
            }
            () = idle => break Ok(()),
            stop = signals.next() => match stop {
                // Between two reads the terminal is not raw: Ctrl-C comes
                // as a signal.
                Stop::Interrupt => Key::Interrupt,
                other => break Err(other.exit("the chat was stopped")),
            },
        };
        // The editor waits after each key until resumed: at once (so what
        // is typed ahead, and what is printed meanwhile, reaches a reading
        // editor), but not after `/exit` or a second Ctrl-C: then no read
        // is left holding the terminal.
        let resume_now = |waiting: &mut bool| {
            if std::mem::take(waiting) {
                let _ = resume.send(());
            }
        };
        match key {
            Key::Line(line) => {
                armed = None;
                if !leaving && !leaves(&line) {
                    resume_now(&mut gated);
                }
                if !leaving && !chat.act(&line).await {
                    leaving = true;
                    if chat.running() {
                        screen.note("leaving when this turn ends (Ctrl-C cancels it)");
                    }
                }
            }
            Key::Interrupt => {
                let again = armed.is_some_and(|at| at.elapsed() <= TWICE);
                if again {
                    break Ok(());
                }
                armed = Some(Instant::now());
                if !leaving {
                    resume_now(&mut gated);
                }
                match chat.agent() {
                    Some(a) if chat.running() => {
                        a.cancel();
                        screen.note("cancelling the turn (Ctrl-C again within 2 s leaves)");
                    }
                    _ => screen.note("Ctrl-C again within 2 s (or Ctrl-D) leaves"),
                }
            }
            Key::Eof => break Ok(()),
            Key::Failed(e) => break Err(Exit::failed(format!("cannot read the terminal: {e}"))),
        }
        if !leaving {
            resume_now(&mut gated);
        }
    };
    // The editor stops before its next read (one already under way when a
    // signal ended the chat ends with the process; the terminal is
    // restored all the same).
    stopping.store(true, std::sync::atomic::Ordering::SeqCst);
    drop(resume);
    if let Some(a) = chat.agent()
        && chat.running()
    {
        a.cancel();
        let _ = a.when_idle(Duration::from_secs(30)).await;
    }
    while let Ok(item) = shown.try_recv() {
        screen.show(&item);
    }
    drop(screen);
    // Everything shown before the chat's last words.
    let _ = tokio::time::timeout(Duration::from_secs(5), printed).await;
    result
}

/// Whether `line` is `/exit` (the editor then reads no more).
fn leaves(line: &str) -> bool {
    matches!(super::input::parse_line(line), Ok(super::input::Input::Command(c, _)) if c.name == "exit")
}

/// The editor's and the printer's threads, as the loop holds them.
struct Seat {
    /// What the user types.
    keys: mpsc::UnboundedReceiver<Key>,
    /// What to print above the prompt.
    out: std_mpsc::Sender<String>,
    /// Lets the editor read the next line (dropped: it stops).
    resume: std_mpsc::Sender<()>,
    /// Set when the chat ends: the editor reads no more.
    stopping: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Fires when the printer has printed everything (after `out` is
    /// dropped).
    printed: tokio::sync::oneshot::Receiver<()>,
}

/// Starts the editor's thread and the printer's. The editor reads a line,
/// hands it over, and reads the next only when resumed: when the chat
/// ends, no read is left holding the terminal. Each line goes to the
/// history file as it is read.
fn editor() -> Result<Seat, String> {
    use rustyline::error::ReadlineError;
    use rustyline::{Cmd, Config, Editor, EventHandler, KeyCode, KeyEvent, Modifiers};
    let history = crate::home::dir().join("history");
    if let Some(dir) = history.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let config = Config::builder()
        .auto_add_history(true)
        .max_history_size(5000)
        .map_err(|e| e.to_string())?
        .build();
    let mut ed: Editor<(), rustyline::history::FileHistory> =
        Editor::with_config(config).map_err(|e| e.to_string())?;
    ed.bind_sequence(
        KeyEvent(KeyCode::Enter, Modifiers::ALT),
        EventHandler::Simple(Cmd::Newline),
    );
    ed.bind_sequence(KeyEvent::ctrl('J'), EventHandler::Simple(Cmd::Newline));
    // No history yet is not an error.
    let _ = ed.load_history(&history);
    let mut printer = ed.create_external_printer().map_err(|e| e.to_string())?;
    let (out, lines) = std_mpsc::channel::<String>();
    let (done, printed) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("dsh-printer".into())
        .spawn(move || {
            use rustyline::ExternalPrinter as _;
            // Ends when the loop drops its sender.
            while let Ok(text) = lines.recv() {
                if printer.print(text).is_err() {
                    break;
                }
            }
            let _ = done.send(());
        })
        .map_err(|e| e.to_string())?;
    let (tx, keys) = mpsc::unbounded_channel();
    let (resume, resumed) = std_mpsc::channel::<()>();
    let stopping = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stop = stopping.clone();
    std::thread::Builder::new()
        .name("dsh-editor".into())
        .spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let key = match ed.readline("› ") {
                    Ok(line) => {
                        // Kept at once: a signal may end the chat mid-read.
                        let _ = ed.append_history(&history);
                        Key::Line(line)
                    }
                    Err(ReadlineError::Interrupted) => Key::Interrupt,
                    Err(ReadlineError::Eof) => Key::Eof,
                    Err(e) => Key::Failed(e.to_string()),
                };
                let last = matches!(key, Key::Eof | Key::Failed(_));
                if tx.send(key).is_err() || last || resumed.recv().is_err() {
                    break;
                }
            }
        })
        .map_err(|e| e.to_string())?;
    Ok(Seat {
        keys,
        out,
        resume,
        stopping,
        printed,
    })
}

/// Puts the terminal back as it was (a chat ended while the editor was
/// reading leaves it raw). Meanwhile, between two reads, Enter stays a
/// carriage return (no CR-to-NL translation: typed ahead, it would reach the
/// editor as Ctrl-J, a new line) and nothing typed is echoed twice.
struct Restore(Option<nix::sys::termios::Termios>);

impl Restore {
    fn save() -> Restore {
        use nix::sys::termios::{InputFlags, LocalFlags, SetArg, tcgetattr, tcsetattr};
        let saved = tcgetattr(std::io::stdin()).ok();
        if let Some(mode) = &saved {
            let mut chat = mode.clone();
            chat.input_flags.remove(InputFlags::ICRNL);
            chat.local_flags.remove(LocalFlags::ECHO);
            let _ = tcsetattr(std::io::stdin(), SetArg::TCSANOW, &chat);
        }
        Restore(saved)
    }
}

impl Drop for Restore {
    fn drop(&mut self) {
        if let Some(mode) = &self.0 {
            let _ = nix::sys::termios::tcsetattr(
                std::io::stdin(),
                nix::sys::termios::SetArg::TCSANOW,
                mode,
            );
        }
        // Bracketed paste, which the editor turns on, off again.
        crate::out!("\x1b[?2004l");
    }
}

const DIM: &str = "\x1b[2m";
const BOLD: &str = "\x1b[1m";
const RED: &str = "\x1b[31m";
const GREEN: &str = "\x1b[32m";
const YELLOW: &str = "\x1b[33m";
const RESET: &str = "\x1b[0m";

/// What the terminal shows: items styled, the answer rendered a line at a
/// time, reasoning folded.
struct Screen {
    out: std_mpsc::Sender<String>,
    markdown: Markdown,
    /// The answer's unfinished line.
    text: String,
    /// The reasoning so far, shown folded when it ends.
    reasoning: String,
}

impl Screen {
    fn new(out: std_mpsc::Sender<String>) -> Screen {
        Screen {
            out,
            markdown: Markdown::default(),
            text: String::new(),
            reasoning: String::new(),
        }
    }

    /// One line above the prompt (its newline added: printed directly
    /// between two reads, nothing else would end it).
    fn print(&self, mut line: String) {
        line.push('\n');
        let _ = self.out.send(line);
    }

    fn note(&self, line: &str) {
        self.print(format!("{DIM}{line}{RESET}"));
    }

    fn status(&self, line: &str) {
        self.print(format!("{DIM}── {line} ──{RESET}"));
    }

    fn show(&mut self, item: &Item) {
        match item {
            Item::Text(t) => {
                self.fold();
                self.text.push_str(t);
                while let Some(at) = self.text.find('\n') {
                    let line: String = self.text.drain(..=at).collect();
                    let rendered = self.markdown.line(line.trim_end_matches('\n'));
                    self.print(rendered);
                }
                return;
            }
            Item::Reasoning(t) => {
                self.reasoning.push_str(t);
                return;
            }
            _ => {}
        }
        self.end();
        if let Item::TurnEnd { .. } = item {
            // A block the turn left open ends with it.
            self.markdown = Markdown::default();
        }
        let line = match item {
            // A prompt from elsewhere (the dashboard).
            Item::Prompt(_) => format!("{DIM}{item}{RESET}"),
            Item::ToolStarted { .. } => format!("{BOLD}{item}{RESET}"),
            Item::ToolFinished {
                outcome: Finished::Done { .. },
                ..
            } => format!("{GREEN}{item}{RESET}"),
            Item::ToolFinished { .. } | Item::Error(_) => format!("{RED}{item}{RESET}"),
            Item::Approval { .. } => format!("{YELLOW}{BOLD}{item}{RESET}"),
            Item::TurnEnd { .. } | Item::Note(_) | Item::Retry(_) | Item::Withdrawn { .. } => {
                format!("{DIM}{item}{RESET}")
            }
            Item::Text(_) | Item::Reasoning(_) => unreachable!("handled above"),
        };
        self.print(line);
    }

    /// Shows the reasoning so far as one dimmed line.
    fn fold(&mut self) {
        let reasoning = std::mem::take(&mut self.reasoning);
        let words = reasoning.split_whitespace().count();
        if words == 0 {
            return;
        }
        let flat = reasoning.split_whitespace().collect::<Vec<_>>().join(" ");
        self.print(format!(
            "{DIM}· thought: {} ({words} words){RESET}",
            super::engine::cut(&flat, 100)
        ));
    }

    /// Ends the answer's last line and folds the reasoning.
    fn end(&mut self) {
        self.fold();
        let rest = std::mem::take(&mut self.text);
        if !rest.is_empty() {
            let rendered = self.markdown.line(&rest);
            self.print(rendered);
        }
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        self.end();
        let _ = std::io::stdout().flush();
    }
}
