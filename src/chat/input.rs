//! What a chat line means: a message, a steer of the running turn (`!`), or
//! a slash command with its arguments, checked against the one table of
//! commands (`/help` prints it; an unknown command is told the closest).

/// One chat command: its name, what it takes, what it does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Command {
    /// Its name, without the `/`.
    pub name: &'static str,
    /// Its arguments, as `/help` shows them (empty: none).
    pub args: &'static str,
    /// What it does, in one line.
    pub about: &'static str,
}

/// Every chat command, in the order `/help` lists them.
pub const COMMANDS: &[Command] = &[
    Command {
        name: "help",
        args: "",
        about: "list the commands",
    },
    Command {
        name: "tree",
        args: "",
        about: "this session's tree: every node, its status and time",
    },
    Command {
        name: "sessions",
        args: "",
        about: "the stored sessions, newest first",
    },
    Command {
        name: "resume",
        args: "ID",
        about: "continue a stored session (its id or the start of it)",
    },
    Command {
        name: "fork",
        args: "[AT]",
        about: "a new session from this one's events through seq AT (default: all)",
    },
    Command {
        name: "compact",
        args: "",
        about: "summarize the conversation so far",
    },
    Command {
        name: "model",
        args: "NAME",
        about: "the model of the next turns",
    },
    Command {
        name: "permission",
        args: "MODE",
        about: "what the next turns' tools may change (at most what the flags allow)",
    },
    Command {
        name: "cancel",
        args: "",
        about: "cancel the running turn",
    },
    Command {
        name: "dashboard",
        args: "",
        about: "serve the dashboard for this session and print its URL",
    },
    Command {
        name: "export",
        args: "FILE",
        about: "write the conversation as Markdown",
    },
    Command {
        name: "skill",
        args: "NAME [ARGS]",
        about: "run a skill, including those the model may not invoke",
    },
    Command {
        name: "exit",
        args: "",
        about: "let the running turn finish, save, and leave",
    },
];

/// What one line of input asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Input {
    /// A message for the agent (a follow-up when a turn runs).
    Message(String),
    /// A message steered into the running turn (`!text`).
    Steer(String),
    /// A known command and the rest of the line, trimmed.
    Command(&'static Command, String),
    /// An empty line.
    Nothing,
}

/// Why a line is not a command.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InputError {
    /// `/name` is no command.
    Unknown {
        /// The name given.
        given: String,
        /// The closest command's name, when one is close.
        closest: Option<&'static str>,
    },
}

impl std::fmt::Display for InputError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InputError::Unknown { given, closest } => {
                write!(f, "/{given} is not a command")?;
                if let Some(c) = closest {
                    write!(f, " (did you mean /{c}?)")?;
                }
                f.write_str("; /help lists them")
            }
        }
    }
}

impl std::error::Error for InputError {}

/// What `line` asks for: `/name args` is a command, `!text` a steer,
/// `//text` a message that starts with `/`, anything else a message.
pub fn parse_line(line: &str) -> Result<Input, InputError> {
    let line = line.trim_end_matches(['\r', '\n']);
    if line.trim().is_empty() {
        return Ok(Input::Nothing);
    }
    if let Some(text) = line.strip_prefix("//") {
        return Ok(Input::Message(format!("/{text}")));
    }
    if let Some(text) = line.strip_prefix('!') {
        let text = text.trim();
        if text.is_empty() {
            return Ok(Input::Nothing);
        }
        return Ok(Input::Steer(text.to_owned()));
    }
    let Some(rest) = line.strip_prefix('/') else {
        return Ok(Input::Message(line.to_owned()));
    };
    let (name, args) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
    match COMMANDS.iter().find(|c| c.name == name) {
        Some(command) => Ok(Input::Command(command, args.trim().to_owned())),
        None => Err(InputError::Unknown {
            given: crate::lines::inert_line(name),
            closest: closest(name),
        }),
    }
}

/// The command whose name is nearest `given` (at most two edits away, or
/// the only one it starts).
pub fn closest(given: &str) -> Option<&'static str> {
    let starts: Vec<&Command> = COMMANDS
        .iter()
        .filter(|c| !given.is_empty() && c.name.starts_with(given))
        .collect();
    if let [only] = starts[..] {
        return Some(only.name);
    }
    COMMANDS
        .iter()
        .map(|c| (distance(given, c.name), c.name))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, name)| name)
}

/// Edits (insert, delete, replace) from `a` to `b`.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let here = row[j + 1];
            row[j + 1] = (prev + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(here + 1);
            prev = here;
        }
    }
    row[b.len()]
}

/// `/help`: one line per command.
pub fn help() -> String {
    let width = COMMANDS
        .iter()
        .map(|c| c.name.len() + c.args.len() + 2)
        .max()
        .unwrap_or(0);
    let mut out = String::new();
    for c in COMMANDS {
        let usage = if c.args.is_empty() {
            format!("/{}", c.name)
        } else {
            format!("/{} {}", c.name, c.args)
        };
        out.push_str(&format!("{usage:width$}  {}\n", c.about));
    }
    out.push_str(&format!(
        "{:width$}  steer the running turn (a plain line waits for its end)\n",
        "!text"
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(line: &str) -> (&'static str, String) {
        match parse_line(line) {
            Ok(Input::Command(c, args)) => (c.name, args),
            other => panic!("{line:?}: {other:?}"),
        }
    }

    #[test]
    fn a_line_is_a_message_a_steer_or_a_command_with_its_arguments() {
        assert_eq!(
            parse_line("hello there\n"),
            Ok(Input::Message("hello there".into()))
        );
        assert_eq!(
            parse_line("!  look at the tests first"),
            Ok(Input::Steer("look at the tests first".into()))
        );
        assert_eq!(
            parse_line("//etc is a path"),
            Ok(Input::Message("/etc is a path".into()))
        );
        assert_eq!(parse_line("   \r\n"), Ok(Input::Nothing));
        assert_eq!(command("/fork 12"), ("fork", "12".into()));
        assert_eq!(
            command("/resume   3e17803d  "),
            ("resume", "3e17803d".into())
        );
        assert_eq!(
            command("/skill review src/lib.rs --deep"),
            ("skill", "review src/lib.rs --deep".into())
        );
        assert_eq!(command("/help"), ("help", String::new()));
    }

    #[test]
    fn an_unknown_command_is_told_the_closest_one() {
        let said = |line: &str| parse_line(line).unwrap_err().to_string();
        assert_eq!(
            said("/hepl"),
            "/hepl is not a command (did you mean /help?); /help lists them"
        );
        assert_eq!(
            said("/perm x"),
            "/perm is not a command (did you mean /permission?); /help lists them"
        );
        assert_eq!(
            said("/zzzzzz"),
            "/zzzzzz is not a command; /help lists them"
        );
        // A hostile name is shown inert.
        assert_eq!(
            said("/\u{1b}]0;x\u{7}q"),
            "/q is not a command; /help lists them"
        );
        assert_eq!(closest("exi"), Some("exit"));
        assert_eq!(closest("modle"), Some("model"));
    }

    #[test]
    fn help_lists_every_command_once_aligned() {
        let help = help();
        for c in COMMANDS {
            assert_eq!(
                help.matches(&format!("/{} ", c.name)).count()
                    + help.matches(&format!("/{}\n", c.name)).count(),
                1,
                "{help}"
            );
        }
        let column: Vec<usize> = help
            .lines()
            .map(|l| {
                l.find("  ")
                    .map(|i| i + l[i..].len() - l[i..].trim_start().len())
                    .unwrap_or(0)
            })
            .collect();
        assert!(column.windows(2).all(|w| w[0] == w[1]), "{help}");
    }
}
