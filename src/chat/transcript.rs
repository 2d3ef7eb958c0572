//! The chat's seat when stdin is not a terminal: lines are read as they
//! arrive and each item is printed on its own line, nothing redrawn, so a
//! script (or a test) can drive a chat by reading what it waits for and
//! then writing the next line.
//!
//! - A line is a message, a `!` steer or a `/` command ([`super::input`]);
//!   a message while a turn runs is queued as a followup.
//! - An approval question prints `approval N: …` and takes the next line as
//!   its answer: `y` once, `a` always (that tool, for this chat), anything
//!   else no. Questions asked once the input has ended are refused.
//! - At the end of the input the running and queued turns finish, the
//!   session is written, and the chat exits 0.

use std::io::{BufRead as _, Read as _};

use tokio::sync::mpsc;

use super::Chat;
use super::engine::Item;
use crate::exit;

/// The longest line read; a longer one is refused (and skipped).
const LINE_MAX: usize = 1 << 20;

/// Converses until the input ends or `/exit` (then the running and queued
/// turns finish first), or a signal (which cancels them).
pub async fn converse(
    chat: &mut Chat<'_>,
    mut shown: mpsc::UnboundedReceiver<Item>,
) -> exit::Result<()> {
    let mut lines = read_stdin();
    let mut printer = Printer::default();
    let mut ended = false;
    let mut stop = std::pin::pin!(crate::exit::stop_signal());
    let result = loop {
        let idle = chat.turns_done(ended);
        tokio::select! {
            biased;
            Some(item) = shown.recv() => printer.show(&item),
            line = lines.recv(), if !ended => match line {
                Some(Err(e)) => printer.show(&Item::Error(e)),
                Some(Ok(line)) if chat.act(&line).await => {}
                // The end of the input, or `/exit`: no more lines are read.
                _ => {
                    ended = true;
                    let refused = chat.approvals().close();
                    if refused > 0 {
                        printer.show(&Item::Note(format!(
                            "no more input: {refused} approval question{} refused",
                            if refused == 1 { "" } else { "s" }
                        )));
                    }
                }
            },
            () = idle => break Ok(()),
            stop = &mut stop => {
                if let Some(a) = chat.agent() {
                    a.cancel();
                }
                break Err(stop.exit("the chat was stopped"));
            }
        }
    };
    // What the last turn said before it went idle.
    while let Ok(item) = shown.try_recv() {
        printer.show(&item);
    }
    printer.end();
    result
}

/// Stdin's lines, read on a thread of their own (a blocking read cannot be
/// cancelled, so it is kept off the runtime's threads; the thread ends at
/// the end of the input, or with the process). Not UTF-8 is read lossily;
/// a line over [`LINE_MAX`] is an error and skipped.
fn read_stdin() -> mpsc::UnboundedReceiver<Result<String, String>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let spawned = std::thread::Builder::new()
        .name("dsh-stdin".into())
        .spawn(move || {
            let stdin = std::io::stdin();
            let mut input = stdin.lock();
            let mut n = 0u64;
            loop {
                n += 1;
                let mut raw = Vec::new();
                let read = (&mut input)
                    .take(LINE_MAX as u64 + 1)
                    .read_until(b'\n', &mut raw);
                let line = match read {
                    Ok(0) => return,
                    Ok(_) if raw.len() > LINE_MAX && !raw.ends_with(b"\n") => {
                        skip_line(&mut input);
                        Err(format!(
                            "line {n} is longer than {} KiB: skipped",
                            LINE_MAX / 1024
                        ))
                    }
                    Ok(_) => {
                        let text = String::from_utf8_lossy(&raw);
                        Ok(text.trim_end_matches(['\n', '\r']).to_owned())
                    }
                    Err(e) => {
                        let _ = tx.send(Err(format!("cannot read stdin: {e}")));
                        return;
                    }
                };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
    if let Err(e) = spawned {
        crate::errln!("dsh chat: cannot start the input reader: {e}");
    }
    rx
}

/// Skips the rest of a line without keeping it (it may be gigabytes).
fn skip_line(input: &mut impl std::io::BufRead) {
    loop {
        let (found, used) = match input.fill_buf() {
            Ok([]) | Err(_) => return,
            Ok(buf) => match buf.iter().position(|b| *b == b'\n') {
                Some(at) => (true, at + 1),
                None => (false, buf.len()),
            },
        };
        input.consume(used);
        if found {
            return;
        }
    }
}

/// Prints items one per line on stdout: streamed text as whole lines,
/// reasoning lines marked `· `.
#[derive(Default)]
struct Printer {
    /// The unfinished line of the stream being printed, and whether it is
    /// reasoning.
    open: Option<(bool, String)>,
}

impl Printer {
    fn show(&mut self, item: &Item) {
        match item {
            Item::Text(t) => self.stream(false, t),
            Item::Reasoning(t) => self.stream(true, t),
            other => {
                self.end();
                crate::outln!("{other}");
            }
        }
    }

    fn stream(&mut self, reasoning: bool, text: &str) {
        if self.open.as_ref().is_some_and(|(r, _)| *r != reasoning) {
            self.end();
        }
        let (_, pending) = self.open.get_or_insert_with(|| (reasoning, String::new()));
        pending.push_str(text);
        while let Some(at) = pending.find('\n') {
            let line: String = pending.drain(..=at).collect();
            print_streamed(reasoning, line.trim_end_matches('\n'));
        }
    }

    /// Ends the open stream's last line.
    fn end(&mut self) {
        if let Some((reasoning, rest)) = self.open.take()
            && !rest.is_empty()
        {
            print_streamed(reasoning, &rest);
        }
    }
}

fn print_streamed(reasoning: bool, line: &str) {
    if reasoning {
        crate::outln!("· {line}");
    } else {
        crate::outln!("{line}");
    }
}
