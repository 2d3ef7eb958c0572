//! The answer's Markdown, rendered a line at a time for a terminal as it
//! streams: headings bold, lists with bullets, quotes with a bar, code
//! blocks dimmed without their fences' markup, and inline `code`,
//! **strong** and *emphasis*. The text comes in inert (no escape sequence
//! of the model's); only the styles added here reach the terminal.

const BOLD: &str = "\x1b[1m";
const DIM: &str = "\x1b[2m";
const ITALIC: &str = "\x1b[3m";
const CYAN: &str = "\x1b[36m";
const RESET: &str = "\x1b[0m";

/// What the renderer remembers between lines: whether a code block is open.
#[derive(Default)]
pub struct Markdown {
    code: bool,
}

impl Markdown {
    /// `line` (without its newline) as the terminal shows it.
    pub fn line(&mut self, line: &str) -> String {
        let trimmed = line.trim_start();
        if let Some(info) = trimmed
            .strip_prefix("```")
            .filter(|info| !info.contains('`'))
        {
            self.code = !self.code;
            return if self.code && !info.trim().is_empty() {
                format!("{DIM}── {} ──{RESET}", info.trim())
            } else {
                format!("{DIM}──{RESET}")
            };
        }
        if self.code {
            return format!("{CYAN}  {line}{RESET}");
        }
        let indent = &line[..line.len() - trimmed.len()];
        if let Some(rest) = heading(trimmed) {
            return format!("{BOLD}{}{RESET}", inline(rest, BOLD));
        }
        if let Some(rest) = trimmed.strip_prefix("> ") {
            return format!("{DIM}│{RESET} {}", inline(rest, ""));
        }
        if let Some(rest) = ["- ", "* ", "+ "]
            .iter()
            .find_map(|b| trimmed.strip_prefix(b))
        {
            return format!("{indent}• {}", inline(rest, ""));
        }
        if ["---", "***", "___"].contains(&trimmed.trim_end()) {
            return format!("{DIM}────────{RESET}");
        }
        format!("{indent}{}", inline(trimmed, ""))
    }
}

/// A heading's text (`# `, `## `, … up to six).
fn heading(line: &str) -> Option<&str> {
    let hashes = line.chars().take_while(|c| *c == '#').count();
    (1..=6)
        .contains(&hashes)
        .then(|| line[hashes..].strip_prefix(' '))
        .flatten()
}

/// Inline styles: `code`, **strong** (or __strong__), *emphasis* (or
/// _emphasis_ between non-word characters). An unclosed marker stays as
/// typed. `base` is the style to return to after a span.
fn inline(text: &str, base: &str) -> String {
    let mut out = String::with_capacity(text.len() + 16);
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    let closes = |from: usize, marker: &[char]| -> Option<usize> {
        (from..chars.len().saturating_sub(marker.len() - 1))
            .find(|&j| chars[j..j + marker.len()] == *marker)
            .filter(|&j| j > from)
    };
    let span = |out: &mut String, style: &str, inner: &[char]| {
        out.push_str(style);
        out.extend(inner);
        out.push_str(RESET);
        out.push_str(base);
    };
    while i < chars.len() {
        let c = chars[i];
        let at_word_start = i == 0 || !chars[i - 1].is_alphanumeric();
        if c == '`'
            && let Some(end) = closes(i + 1, &['`'])
        {
            span(&mut out, CYAN, &chars[i + 1..end]);
            i = end + 1;
            continue;
        }
        if (c == '*' || c == '_') && chars.get(i + 1) == Some(&c) {
            if let Some(end) = closes(i + 2, &[c, c]) {
                span(&mut out, BOLD, &chars[i + 2..end]);
                i = end + 2;
                continue;
            }
        } else if (c == '*' || (c == '_' && at_word_start))
            && chars.get(i + 1).is_some_and(|n| !n.is_whitespace())
            && let Some(end) = closes(i + 1, &[c])
        {
            span(&mut out, ITALIC, &chars[i + 1..end]);
            i = end + 1;
            continue;
        }
        out.push(c);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text without the styles (what a screen shows).
    fn plain(s: &str) -> String {
        crate::lines::inert(s)
    }

    #[test]
    fn blocks_and_spans_render_and_unclosed_markers_stay() {
        let mut md = Markdown::default();
        assert_eq!(plain(&md.line("# Title")), "Title");
        assert!(md.line("# Title").starts_with(BOLD));
        assert_eq!(plain(&md.line("- one **two** `three`")), "• one two three");
        assert_eq!(plain(&md.line("  * nested")), "  • nested");
        assert_eq!(plain(&md.line("> quoted")), "│ quoted");
        assert_eq!(
            plain(&md.line("a *b* and snake_case_name")),
            "a b and snake_case_name"
        );
        assert_eq!(
            plain(&md.line("2 * 3 = 6 and `open")),
            "2 * 3 = 6 and `open"
        );
        assert_eq!(plain(&md.line("```rust")), "── rust ──");
        // Inside a block nothing is styled but the block.
        assert_eq!(plain(&md.line("let x = **y**;")), "  let x = **y**;");
        assert_eq!(plain(&md.line("```")), "──");
        assert_eq!(plain(&md.line("**done**")), "done");
        // Inline code that starts a line opens no block.
        assert_eq!(plain(&md.line("```x``` is inline")), "``x`` is inline");
        assert_eq!(plain(&md.line("after")), "after");
        assert_eq!(plain(&md.line("** alone and ``")), "** alone and ``");
        assert_eq!(plain(&md.line("# ünïcödé **ß**")), "ünïcödé ß");
    }
}
