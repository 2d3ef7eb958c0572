//! A run's children as they go: one row per child (its label, node,
//! status, time, steps, tokens, session), the progress line a terminal
//! shows while they run, and the summary table printed when the run ends.
//!
//! Every line a run prints about its children goes through the board
//! ([`Board::say`]), so the progress line is cleared before the line and
//! drawn again after it; without a terminal there is no progress line and
//! the lines are plain.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::lines::{self, Ending, inert_line};

/// One child of the run.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// Its number in the run (`agent #3`).
    pub seq: u64,
    /// Its label (`-` when it has none), made inert.
    pub label: String,
    /// The node it runs on, when another.
    pub node: Option<String>,
    /// The provider that runs it, when not the usual one.
    pub provider: Option<String>,
    /// Its session id.
    pub session: String,
    /// How it ended; `None` while it runs.
    pub ending: Option<Ending>,
    /// When it started: the time of an ending that does not say its own.
    pub since: Option<Instant>,
}

/// The children of one run, and the terminal line that shows them.
pub struct Board {
    /// The run's name, in front of every line (`[fan]`).
    name: String,
    /// Whether stderr is a terminal (a progress line is drawn).
    live: bool,
    began: Instant,
    rows: Mutex<Vec<Row>>,
    /// A Ralph loop's round cap: its rows are rounds (`round 2 of 5`).
    rounds: Option<u32>,
}

impl Board {
    /// A board for the run `name`; the progress line only when stderr is a
    /// terminal.
    pub fn new(name: &str) -> Board {
        Board::with(name, std::io::IsTerminal::is_terminal(&std::io::stderr()))
    }

    /// A board that draws its progress line when `live`.
    pub fn with(name: &str, live: bool) -> Board {
        Board {
            name: inert_line(name),
            live,
            began: Instant::now(),
            rows: Mutex::new(Vec::new()),
            rounds: None,
        }
    }

    /// The same board for a loop of at most `max` rounds: one row per round.
    pub fn rounds(mut self, max: u32) -> Board {
        self.rounds = Some(max);
        self
    }

    fn rows(&self) -> std::sync::MutexGuard<'_, Vec<Row>> {
        self.rows.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prints `line` on stderr, under the progress line's redraw.
    pub fn say(&self, line: &str) {
        let rows = self.rows();
        if self.live {
            crate::err!("\r\x1b[2K");
        }
        crate::errln!("{line}");
        self.draw(&rows);
    }

    /// A child started; how many have.
    pub fn started(&self, row: Row) -> usize {
        let place = lines::place_via(row.node.as_deref(), row.provider.as_deref());
        let line = match self.rounds {
            None => format!(
                "[{}] agent #{} started: {}{place} (session {})",
                self.name, row.seq, row.label, row.session
            ),
            Some(max) => format!(
                "[{}] round {} of {max} started{place} (session {})",
                self.name, row.seq, row.session
            ),
        };
        let started = {
            let mut rows = self.rows();
            rows.push(row);
            rows.len()
        };
        self.say(&line);
        started
    }

    /// Child `seq` ended (one the board never saw start is left out).
    pub fn ended(&self, seq: u64, mut ending: Ending) {
        let row = {
            let mut rows = self.rows();
            let Some(row) = rows.iter_mut().find(|r| r.seq == seq) else {
                return;
            };
            if ending.elapsed.is_none() {
                ending.elapsed = row.since.map(|s| s.elapsed());
            }
            row.ending = Some(ending.clone());
            row.clone()
        };
        let place = lines::place_via(row.node.as_deref(), row.provider.as_deref());
        self.say(&match self.rounds {
            None => format!("[{}] agent #{seq} {}{place} {ending}", self.name, row.label),
            Some(_) => format!("[{}] round {seq}{place} {ending}", self.name),
        });
    }

    /// One line per child that ended without completing, in start order:
    /// `agent #2 topic b on b (session …) failed after 850 ms: CODE: …`.
    pub fn failures(&self) -> Vec<String> {
        self.rows()
            .iter()
            .filter_map(|r| {
                let ending = r.ending.as_ref().filter(|e| !e.completed())?;
                let place = lines::place_via(r.node.as_deref(), r.provider.as_deref());
                Some(format!(
                    "agent #{} {}{place} (session {}) {ending}",
                    r.seq, r.label, r.session
                ))
            })
            .collect()
    }

    /// Draws the progress line again (its clock moves); a no-op without a
    /// terminal.
    pub fn tick(&self) {
        let rows = self.rows();
        self.draw(&rows);
    }

    fn draw(&self, rows: &[Row]) {
        if self.live {
            crate::err!("\r\x1b[2K{}", self.progress(rows));
        }
    }

    /// `[fan] 2 running · 3 done · 1 failed · 4.2 s · 1.2k tokens`.
    fn progress(&self, rows: &[Row]) -> String {
        let count = Count::of(rows);
        let round = match self.rounds {
            Some(max) => format!("round {} of {max} · ", rows.len()),
            None => String::new(),
        };
        let mut line = format!(
            "[{}] {round}{} running · {} done · {} failed · {}",
            self.name,
            count.running,
            count.completed,
            count.failed,
            lines::duration(self.began.elapsed())
        );
        if count.tokens > 0 {
            line.push_str(&format!(" · {} tokens", lines::tokens(count.tokens)));
        }
        line
    }

    /// Clears the progress line and prints the summary table (nothing when
    /// no child started).
    pub fn finish(&self) {
        let rows = self.rows();
        if self.live {
            crate::err!("\r\x1b[2K");
        }
        if !rows.is_empty() {
            let what = if self.rounds.is_some() {
                "rounds"
            } else {
                "children"
            };
            crate::err!("{}", table(&rows, self.began.elapsed(), what));
        }
    }
}

/// What the rows add up to.
#[derive(Default)]
struct Count {
    running: usize,
    completed: usize,
    failed: usize,
    tokens: u64,
}

impl Count {
    fn of(rows: &[Row]) -> Count {
        let mut c = Count::default();
        for r in rows {
            match &r.ending {
                None => c.running += 1,
                Some(e) if e.completed() => c.completed += 1,
                Some(_) => c.failed += 1,
            }
            c.tokens += r.ending.as_ref().and_then(|e| e.tokens).unwrap_or(0);
        }
        c
    }
}

/// The summary: a line of totals, then one row per child.
///
/// ```text
/// children: 4 started · 3 completed · 1 failed · 4.5 s · 3.2k tokens
///   #  label    node  status     time    steps  tokens  session
///   1  topic a  -     completed  4.2 s   3      1.2k    3e17803d-…
/// ```
pub fn table(rows: &[Row], elapsed: Duration, what: &str) -> String {
    let count = Count::of(rows);
    let mut out = format!(
        "{what}: {} started · {} completed · {} failed",
        rows.len(),
        count.completed,
        count.failed
    );
    if count.running > 0 {
        out.push_str(&format!(" · {} still running", count.running));
    }
    out.push_str(&format!(" · {}", lines::duration(elapsed)));
    if count.tokens > 0 {
        out.push_str(&format!(" · {} tokens", lines::tokens(count.tokens)));
    }
    out.push('\n');
    let dash = || "-".to_owned();
    let priced = rows
        .iter()
        .any(|r| r.ending.as_ref().is_some_and(|e| e.cost.is_some()));
    let mut cells = vec![
        [
            "#", "label", "node", "status", "time", "steps", "tokens", "session",
        ]
        .map(str::to_owned),
    ];
    if priced {
        cells[0][6] = "tokens (cost)".to_owned();
    }
    for r in rows {
        let e = r.ending.as_ref();
        let status = match e {
            None => "running".to_owned(),
            Some(e) if e.completed() => "completed".to_owned(),
            Some(e) => match e.diagnostic.as_deref().and_then(code_of) {
                Some(code) => format!("failed ({code})"),
                None if e.outcome == "error" => "failed".to_owned(),
                None => e.outcome.clone(),
            },
        };
        cells.push([
            r.seq.to_string(),
            r.label.clone(),
            r.node.as_deref().map_or_else(dash, inert_line),
            status,
            e.and_then(|e| e.elapsed).map_or_else(dash, lines::duration),
            e.and_then(|e| e.steps)
                .filter(|s| *s > 0)
                .map_or_else(dash, |s| s.to_string()),
            match (
                e.and_then(|e| e.tokens).filter(|t| *t > 0),
                e.and_then(|e| e.cost),
            ) {
                (Some(t), Some(c)) => format!("{} ({})", lines::tokens(t), lines::cost(c)),
                (Some(t), None) => lines::tokens(t),
                (None, _) => dash(),
            },
            r.session.clone(),
        ]);
    }
    let widths: Vec<usize> = (0..8)
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for row in &cells {
        out.push_str("  ");
        for (i, cell) in row.iter().enumerate() {
            if i == row.len() - 1 {
                out.push_str(cell);
            } else {
                let pad = widths[i] - cell.chars().count();
                out.push_str(cell);
                out.push_str(&" ".repeat(pad + 2));
            }
        }
        out.push('\n');
    }
    out
}

/// The `CODE` of a `CODE: message` diagnostic.
fn code_of(diagnostic: &str) -> Option<String> {
    let (code, _) = diagnostic.split_once(':')?;
    let code = code.trim();
    (!code.is_empty()
        && code
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
    .then(|| code.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(seq: u64, label: &str, node: Option<&str>, ending: Option<Ending>) -> Row {
        Row {
            seq,
            label: label.into(),
            node: node.map(str::to_owned),
            provider: None,
            session: format!("session-{seq}"),
            ending,
            since: None,
        }
    }

    #[test]
    fn the_table_lists_every_child_with_its_status_time_and_spend() {
        let done = Ending {
            outcome: "completed".into(),
            elapsed: Some(Duration::from_millis(4_200)),
            steps: Some(3),
            tokens: Some(1_200),
            ..Ending::default()
        };
        let lost = Ending {
            outcome: "error".into(),
            diagnostic: Some("NODE_DOWN: node `b` is down".into()),
            elapsed: Some(Duration::from_millis(850)),
            ..Ending::default()
        };
        let rows = [
            row(1, "topic a", None, Some(done)),
            row(2, "topic b", Some("b"), Some(lost)),
            row(3, "-", None, None),
        ];
        let t = table(&rows, Duration::from_millis(4_500), "children");
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "children: 3 started · 1 completed · 1 failed · 1 still running · 4.5 s · 1.2k tokens"
        );
        let words = |l: &str| l.split_whitespace().map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(
            words(lines[1]),
            [
                "#", "label", "node", "status", "time", "steps", "tokens", "session"
            ]
        );
        assert_eq!(
            words(lines[2]),
            [
                "1",
                "topic",
                "a",
                "-",
                "completed",
                "4.2",
                "s",
                "3",
                "1.2k",
                "session-1"
            ]
        );
        assert_eq!(
            words(lines[3]),
            [
                "2",
                "topic",
                "b",
                "b",
                "failed",
                "(NODE_DOWN)",
                "850",
                "ms",
                "-",
                "-",
                "session-2"
            ]
        );
        assert_eq!(
            words(lines[4]),
            ["3", "-", "-", "running", "-", "-", "-", "session-3"]
        );
        assert_eq!(lines.len(), 5);
        // The columns line up.
        let at = |l: &str, w: &str| l.find(w).unwrap();
        assert_eq!(at(lines[1], "status"), at(lines[2], "completed"));
        assert_eq!(at(lines[1], "status"), at(lines[3], "failed"));
        assert_eq!(at(lines[1], "session"), at(lines[4], "session-3"));
    }

    #[test]
    fn a_board_without_a_terminal_prints_plain_lines() {
        let board = Board::with("fan", false);
        assert!(
            board
                .progress(&[])
                .starts_with("[fan] 0 running · 0 done · 0 failed · ")
        );
        assert_eq!(board.started(row(1, "a", Some("b"), None)), 1);
        assert_eq!(board.started(row(2, "c", None, None)), 2);
        board.ended(
            1,
            Ending {
                outcome: "completed".into(),
                ..Ending::default()
            },
        );
        board.ended(
            2,
            Ending {
                outcome: "error".into(),
                diagnostic: Some("X: broke".into()),
                ..Ending::default()
            },
        );
        // One the board never saw start changes nothing.
        board.ended(9, Ending::default());
        assert_eq!(
            board.failures(),
            ["agent #2 c (session session-2) failed: X: broke"]
        );
    }
}
