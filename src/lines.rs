//! How a run's lines read: one formatter for what `run`, `workflow`,
//! `ralph` and `demo` print about their agents — where a child runs, how it
//! ended, how long it took and what it spent — and the one place where text
//! from outside (a model, a tool, a node, a peer) is made inert before it
//! reaches a terminal.

use std::time::Duration;

/// `text` with every terminal control removed: escape sequences (CSI such
/// as colours and cursor moves, OSC such as titles, hyperlinks and the
/// clipboard, DCS, APC, PM, SOS), C0 and C1 control characters, and the
/// bidirectional overrides that reorder what is shown. Newlines and tabs
/// stay; a carriage return becomes a newline (it would let a later part
/// overwrite an earlier one).
pub fn inert(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\n' | '\t' => out.push(c),
            '\r' => {
                if chars.peek() != Some(&'\n') {
                    out.push('\n');
                }
            }
            '\u{1b}' => match chars.next() {
                // CSI: parameters and intermediates, then one final byte.
                Some('[') => skip_csi(&mut chars),
                // OSC, DCS, SOS, PM, APC: up to BEL or ST (ESC \).
                Some(']' | 'P' | 'X' | '^' | '_') => skip_string(&mut chars),
                // A two-character sequence (ESC c, ESC 7, …): both go.
                _ => {}
            },
            '\u{9b}' => skip_csi(&mut chars),
            '\u{9d}' | '\u{90}' | '\u{98}' | '\u{9e}' | '\u{9f}' => skip_string(&mut chars),
            c if c.is_control() || bidi_control(c) => {}
            c => out.push(c),
        }
    }
    out
}

/// [`inert`] on one line: newlines and tabs become spaces.
pub fn inert_line(text: &str) -> String {
    inert(text)
        .chars()
        .map(|c| if c == '\n' || c == '\t' { ' ' } else { c })
        .collect()
}

fn skip_csi(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    for c in chars.by_ref() {
        if ('\u{40}'..='\u{7e}').contains(&c) {
            return;
        }
        if !('\u{20}'..='\u{3f}').contains(&c) {
            // Not a CSI byte: the sequence is broken; stop here.
            return;
        }
    }
}

fn skip_string(chars: &mut std::iter::Peekable<std::str::Chars<'_>>) {
    while let Some(c) = chars.next() {
        match c {
            '\u{7}' | '\u{9c}' => return,
            '\u{1b}' => {
                if chars.peek() == Some(&'\\') {
                    chars.next();
                }
                return;
            }
            _ => {}
        }
    }
}

/// Characters that reorder text on screen (embeddings, overrides, isolates).
fn bidi_control(c: char) -> bool {
    matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{200e}' | '\u{200f}' | '\u{61c}')
}

/// A duration for people: `850 ms`, `4.2 s`, `2 min 5 s`, `1 h 3 min`.
pub fn duration(d: Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", d.as_secs_f64()),
        60_000..3_600_000 => format!("{} min {} s", ms / 60_000, ms / 1_000 % 60),
        _ => format!("{} h {} min", ms / 3_600_000, ms / 60_000 % 60),
    }
}

/// A token count for people: `950`, `1.2k`, `3.4M`.
pub fn tokens(n: u64) -> String {
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}k", n as f64 / 1e3),
        _ => format!("{:.1}M", n as f64 / 1e6),
    }
}

/// A cost in millionths of the price's currency, for people: `0.0123`,
/// `1.25`, `0.000004`.
pub fn cost(micro: u64) -> String {
    let units = micro as f64 / 1e6;
    if micro == 0 {
        "0".to_owned()
    } else if units >= 1.0 {
        format!("{units:.2}")
    } else if units >= 0.0001 {
        format!("{units:.4}")
    } else {
        format!("{units:.6}")
    }
}

/// How one agent ended, as its line says it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Ending {
    /// `completed`, `error`, `aborted`, `max-tokens`.
    pub outcome: String,
    /// The failure's `CODE: message`, as the session log and the API have it.
    pub diagnostic: Option<String>,
    /// From its start to its end.
    pub elapsed: Option<Duration>,
    /// Steps its turn took.
    pub steps: Option<u64>,
    /// Tokens it spent (input and output).
    pub tokens: Option<u64>,
    /// What they cost, in millionths of the route's currency, when its
    /// config gives a price.
    pub cost: Option<u64>,
}

impl Ending {
    /// Read from a `workflow/agent-end` update's data.
    pub fn from_update(data: &serde_json::Value) -> Ending {
        Ending {
            outcome: data["outcome"].as_str().unwrap_or("ended").to_owned(),
            diagnostic: data["diagnostic"].as_str().map(str::to_owned),
            elapsed: data["ms"].as_u64().map(Duration::from_millis),
            steps: data["steps"].as_u64(),
            tokens: data["tokens"].as_u64(),
            cost: data["cost"].as_u64(),
        }
    }

    /// Whether it completed.
    pub fn completed(&self) -> bool {
        self.outcome == "completed"
    }
}

impl std::fmt::Display for Ending {
    /// `completed in 4.2 s · 3 steps · 1.2k tokens`, or `failed: CODE:
    /// message` (the message's first line, made inert), or `aborted after
    /// 2.0 s`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let figures = |f: &mut std::fmt::Formatter<'_>| -> std::fmt::Result {
            if let Some(steps) = self.steps.filter(|s| *s > 0) {
                write!(f, " · {steps} step{}", if steps == 1 { "" } else { "s" })?;
            }
            if let Some(t) = self.tokens.filter(|t| *t > 0) {
                write!(f, " · {} tokens", tokens(t))?;
            }
            if let Some(c) = self.cost {
                write!(f, " · cost {}", cost(c))?;
            }
            Ok(())
        };
        match self.outcome.as_str() {
            "completed" => {
                f.write_str("completed")?;
                if let Some(d) = self.elapsed {
                    write!(f, " in {}", duration(d))?;
                }
                figures(f)
            }
            outcome => {
                let verb = match outcome {
                    "error" => "failed",
                    "max-tokens" => "stopped at its token limit",
                    other => other,
                };
                f.write_str(verb)?;
                if let Some(d) = self.elapsed {
                    write!(f, " after {}", duration(d))?;
                }
                if let Some(why) = &self.diagnostic {
                    let first = why.lines().next().unwrap_or_default();
                    write!(f, ": {}", inert_line(first))?;
                }
                Ok(())
            }
        }
    }
}

/// An `llm/retry` record as a line: `retrying in 2.0 s (HTTP 429
/// RATE_LIMITED: slow down; attempt 1 of 5)`.
pub fn retrying(data: &serde_json::Value) -> String {
    let wait = Duration::from_millis(data["waitMs"].as_u64().unwrap_or(0));
    let status = data["status"]
        .as_u64()
        .map(|s| format!("HTTP {s} "))
        .unwrap_or_default();
    let message = data["message"].as_str().unwrap_or_default();
    let message = inert_line(message.lines().next().unwrap_or_default());
    let said: String = message.chars().take(120).collect();
    format!(
        "retrying in {} ({status}{}{}; attempt {} of {})",
        duration(wait),
        inert_line(data["code"].as_str().unwrap_or("FAILED")),
        if said.is_empty() {
            String::new()
        } else {
            format!(": {said}")
        },
        data["attempt"].as_u64().unwrap_or(0),
        data["maxRetries"].as_u64().unwrap_or(0),
    )
}

/// ` on b` for a child on node `b`, nothing for one here.
pub fn place(node: Option<&str>) -> String {
    node.map(|n| format!(" on {}", inert_line(n)))
        .unwrap_or_default()
}

/// ` on b` for a child on node `b`, else ` via acp-x` for one a provider
/// other than the usual ones runs, else nothing.
pub fn place_via(node: Option<&str>, provider: Option<&str>) -> String {
    match (node, provider) {
        (Some(_), _) => place(node),
        (None, Some(p)) => format!(" via {}", inert_line(p)),
        (None, None) => String::new(),
    }
}

/// What a tool result says: its text blocks, joined.
pub fn result_text(message: &dsh_services::llm::Message) -> String {
    use dsh_services::llm::ContentBlock;
    message
        .content
        .iter()
        .flat_map(|b| match b {
            ContentBlock::ToolResult { content, .. } => content.clone(),
            _ => Vec::new(),
        })
        .filter_map(|b| match b {
            ContentBlock::Text { text } => Some(text),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_sequences_and_controls_are_removed_and_the_text_kept() {
        let attacks = [
            // A title, a hyperlink to elsewhere, the clipboard, colours, a
            // cursor move that hides what came before, a reset.
            ("\u{1b}]0;pwned\u{7}title", "title"),
            (
                "\u{1b}]8;;http://evil.example/\u{1b}\\click\u{1b}]8;;\u{1b}\\",
                "click",
            ),
            ("\u{1b}]52;c;cm0gLXJmIH4=\u{7}copy", "copy"),
            ("\u{1b}[31mred\u{1b}[0m", "red"),
            ("ok\u{1b}[2K\u{1b}[1Ahidden", "okhidden"),
            ("\u{1b}cfull reset", "full reset"),
            ("\u{9b}31mC1 CSI", "C1 CSI"),
            ("\u{9d}0;c1 osc\u{9c}after", "after"),
            ("a\u{7}b\u{8}c\u{0}d\u{7f}e", "abcde"),
            ("over\rwritten", "over\nwritten"),
            ("bidi \u{202e}txt.exe\u{202c}", "bidi txt.exe"),
            ("\u{1b}P1;2|secret\u{1b}\\dcs", "dcs"),
            // An unfinished sequence at the end takes nothing after it.
            ("tail\u{1b}]0;never closed", "tail"),
            ("tail\u{1b}", "tail"),
        ];
        for (attack, shown) in attacks {
            let out = inert(attack);
            assert_eq!(out, shown, "{attack:?}");
            assert!(
                !out.chars()
                    .any(|c| c.is_control() && c != '\n' && c != '\t'),
                "{attack:?} left {out:?}"
            );
        }
        assert_eq!(inert("line one\nline\ttwo\n"), "line one\nline\ttwo\n");
        assert_eq!(inert_line("a\nb\tc\r\nd"), "a b c d");
        assert_eq!(inert("ünïcödé ✓ 漢字"), "ünïcödé ✓ 漢字");
    }

    #[test]
    fn an_ending_says_how_long_what_it_spent_and_why_it_failed() {
        let done = Ending {
            outcome: "completed".into(),
            elapsed: Some(Duration::from_millis(4_210)),
            steps: Some(3),
            tokens: Some(1_234),
            ..Ending::default()
        };
        assert_eq!(
            done.to_string(),
            "completed in 4.2 s · 3 steps · 1.2k tokens"
        );
        let lost = Ending {
            outcome: "error".into(),
            diagnostic: Some("NODE_DOWN: node `b` was lost\u{1b}]0;x\u{7}\nmore".into()),
            elapsed: Some(Duration::from_millis(850)),
            ..Ending::default()
        };
        assert_eq!(
            lost.to_string(),
            "failed after 850 ms: NODE_DOWN: node `b` was lost"
        );
        assert_eq!(duration(Duration::from_secs(125)), "2 min 5 s");
        assert_eq!(duration(Duration::from_secs(3_780)), "1 h 3 min");
        assert_eq!(tokens(950), "950");
        assert_eq!(cost(12_345), "0.0123");
        assert_eq!(cost(1_250_000), "1.25");
        assert_eq!(cost(4), "0.000004");
        assert_eq!(tokens(3_400_000), "3.4M");
        assert_eq!(place(Some("b\u{1b}[2J")), " on b");
        assert_eq!(place(None), "");
        assert_eq!(place_via(None, Some("acp-claude")), " via acp-claude");
        assert_eq!(place_via(Some("b"), Some("remote")), " on b");
        let priced = Ending {
            cost: Some(6_000),
            ..done.clone()
        };
        assert_eq!(
            priced.to_string(),
            "completed in 4.2 s · 3 steps · 1.2k tokens · cost 0.0060"
        );
        let retry = serde_json::json!({"attempt": 1, "maxRetries": 5, "code": "RATE_LIMITED", "status": 429, "message": "slow\u{1b}[2J down\nmore", "waitMs": 2000});
        assert_eq!(
            retrying(&retry),
            "retrying in 2.0 s (HTTP 429 RATE_LIMITED: slow down; attempt 1 of 5)"
        );
    }
}
