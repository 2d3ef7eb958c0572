//! `dsh agents list|show`: the named agent definitions found for the
//! workspace — the project's `.dsh/agents` and `.claude/agents` (nearest
//! directory first), then `~/.dsh/agents` — where each came from, and each
//! file refused with why.

use std::path::PathBuf;

use dsh_services::definitions::{Definition, Definitions, discover};

use crate::exit::{self, Exit};
use crate::lines::inert_line;

/// `dsh agents`: the options.
#[derive(clap::Args, Debug)]
pub struct AgentsArgs {
    #[command(subcommand)]
    what: AgentsCommand,
    /// The workspace whose definitions are read (default: the current directory)
    #[arg(long, global = true)]
    cwd: Option<PathBuf>,
}

#[derive(clap::Subcommand, Debug)]
enum AgentsCommand {
    /// Every definition found: name, description, file; then what was
    /// refused and what an earlier one hid.
    List,
    /// One definition in full: its settings, file and system prompt.
    Show {
        /// Its name.
        name: String,
    },
}

/// Runs a `dsh agents` subcommand.
pub fn agents(args: AgentsArgs) -> Exit {
    Exit::from(agents_in(args))
}

fn agents_in(args: AgentsArgs) -> exit::Result<()> {
    let cwd = match args.cwd {
        Some(c) => c,
        None => std::env::current_dir()
            .map_err(|e| Exit::failed(format!("cannot read the current directory: {e}")))?,
    };
    let found = discover(&cwd, Some(&crate::home::dir()));
    match args.what {
        AgentsCommand::List => {
            list(&found);
            Ok(())
        }
        AgentsCommand::Show { name } => {
            let d = found
                .require(&name)
                .map_err(|e| Exit::usage(inert_line(&e.to_string())))?;
            show(d);
            Ok(())
        }
    }
}

fn list(found: &Definitions) {
    if found.found.is_empty() {
        crate::outln!(
            "no agent definitions (put Markdown files with a `name` and `description` front matter in .dsh/agents/ or ~/.dsh/agents/)"
        );
    }
    for d in found.found.values() {
        crate::outln!(
            "{}  {}\n    {} ({})",
            d.name,
            inert_line(&d.description),
            inert_line(&d.path.display().to_string()),
            d.dialect.as_str()
        );
        for w in &d.warnings {
            crate::outln!("    note: {}", inert_line(w));
        }
    }
    for e in &found.errors {
        crate::outln!("refused: {}", inert_line(&e.to_string()));
    }
    for p in &found.hidden {
        crate::outln!(
            "hidden by an earlier definition: {}",
            inert_line(&p.display().to_string())
        );
    }
}

fn show(d: &Definition) {
    let or = |v: Option<String>, default: &str| v.unwrap_or_else(|| default.to_owned());
    crate::outln!("name: {}", d.name);
    crate::outln!("description: {}", inert_line(&d.description));
    crate::outln!(
        "file: {} ({})",
        inert_line(&d.path.display().to_string()),
        d.dialect.as_str()
    );
    crate::outln!("model: {}", or(d.model.clone(), "the parent's"));
    crate::outln!(
        "reasoning effort: {}",
        or(d.reasoning_effort.clone(), "the route's")
    );
    crate::outln!(
        "tools: {}",
        or(
            d.tools.as_ref().map(|t| t.join(", ")),
            "all of the parent's"
        )
    );
    crate::outln!(
        "permission mode: {}",
        or(
            d.permission_mode.map(|m| m.as_str().to_owned()),
            "the parent's"
        )
    );
    crate::outln!(
        "max steps: {}",
        or(d.max_steps.map(|n| n.to_string()), "the parent's")
    );
    for (what, value) in [
        ("max turns", d.max_turns.map(|n| n.to_string())),
        (
            "timeout",
            d.timeout.map(|t| format!("{} s", t.as_secs_f64())),
        ),
        ("max tokens", d.max_tokens.map(|n| n.to_string())),
    ] {
        if let Some(v) = value {
            crate::outln!("{what}: {v}");
        }
    }
    for w in &d.warnings {
        crate::outln!("note: {}", inert_line(w));
    }
    crate::outln!("\n{}", crate::lines::inert(&d.prompt));
}
