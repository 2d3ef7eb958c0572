//! `dsh check`, `dsh tree` and `dsh mcp list`: a `cordis.yml` validated
//! without starting anything, or booted, its live supervision tree (or its
//! MCP servers) printed, and shut down in order.

use std::path::PathBuf;
use std::time::Duration;

use dsh_supervisors::error::chain;
use dsh_supervisors::tree::render;
use dsh_supervisors::{Loader, Runtime, RuntimeSettings, Source};

use dsh_services::mcp::{McpServers, ServerStatus, State};

use crate::catalogue::default_catalogue;
use crate::exit::{self, Exit};

/// `dsh check`: the options.
#[derive(clap::Args, Debug)]
pub struct CheckArgs {
    /// The config file.
    #[arg(default_value = "cordis.yml")]
    pub file: PathBuf,
    /// Patch layers applied by entry id, in order.
    #[arg(long = "patch", value_name = "FILE")]
    pub patches: Vec<PathBuf>,
    /// Print the JSON schema of a plugin's config instead.
    #[arg(long, value_name = "PLUGIN")]
    pub schema: Option<String>,
}

/// `dsh tree`: the options.
#[derive(clap::Args, Debug)]
pub struct TreeArgs {
    /// The config file.
    #[arg(default_value = "cordis.yml")]
    pub file: PathBuf,
    /// Patch layers applied by entry id, in order.
    #[arg(long = "patch", value_name = "FILE")]
    pub patches: Vec<PathBuf>,
    /// Print the tree as JSON (one array of nodes).
    #[arg(long)]
    pub json: bool,
}

/// `dsh tree`: a config's tree, or with `--nodes` a running cluster's.
#[derive(clap::Args, Debug)]
pub struct TreeCommand {
    /// The config to boot (unless `--nodes` names a running cluster).
    #[command(flatten)]
    pub tree: TreeArgs,
    /// A running cluster's nodes: print each one's tree instead.
    #[command(flatten)]
    pub cluster: crate::args::ClusterArgs,
}

/// `dsh mcp`: the subcommands.
#[derive(clap::Args, Debug)]
pub struct McpArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: McpCommand,
}

/// `dsh mcp …`.
#[derive(clap::Subcommand, Debug)]
pub enum McpCommand {
    /// Boot the config, connect its MCP servers (each up to its connect
    /// timeout), print each server's state and tools, shut down.
    List(TreeArgs),
}

/// `dsh mcp list`: every MCP server of the file with its state and tools;
/// exits 1 when one is not up.
pub async fn mcp(args: McpArgs) -> Exit {
    let McpCommand::List(args) = args.command;
    let json = args.json;
    booted(args, move |rt, mut problems| {
        let servers = rt
            .root()
            .get::<McpServers>(McpServers::SERVICE)
            .map(|m| m.list())
            .unwrap_or_default();
        if json {
            crate::outln!(
                "{}",
                serde_json::to_string_pretty(&servers).unwrap_or_default()
            );
        } else {
            crate::out!("{}", render_servers(&servers));
        }
        problems.extend(
            servers
                .iter()
                .filter(|s| s.state != State::Up)
                .map(|s| format!("MCP server {} is {}", s.name, s.state.as_str())),
        );
        problems
    })
    .await
}

/// Boots the file in a fresh runtime, lets `report` print what it shows
/// (given the entries that failed to start, as lines; it returns every
/// problem), then shuts down in order: exit 1 with the problems, if any.
async fn booted(args: TreeArgs, report: impl FnOnce(&Runtime, Vec<String>) -> Vec<String>) -> Exit {
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => return Exit::failed(format!("cannot start the runtime: {}", chain(&e))),
    };
    let source = Source {
        base: args.file,
        patches: args.patches,
    };
    let exit = match Loader::boot(&rt, default_catalogue(), source).await {
        Err(e) => Exit::from(e),
        Ok((_loader, failures)) => {
            let failed = failures
                .iter()
                .map(|(id, reason)| format!("entry `{id}` failed to start: {reason}"))
                .collect();
            let problems = report(&rt, failed);
            if problems.is_empty() {
                Exit::ok()
            } else {
                Exit::placed(exit::FAILED, problems.join("\n"))
            }
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), rt.shutdown())
        .await
        .is_err()
    {
        return Exit::failed("shutdown did not finish within 60 s");
    }
    exit
}

/// One block per server: name, transport, state, then its tools.
fn render_servers(servers: &[ServerStatus]) -> String {
    if servers.is_empty() {
        return "no MCP servers are configured (add an entry with `name: mcp`)\n".into();
    }
    let mut out = String::new();
    for s in servers {
        let transport = s.transport.as_str();
        out.push_str(&format!(
            "{}  {transport}  {}  {} tool(s)\n",
            s.name,
            s.state.as_str(),
            s.tools.len()
        ));
        if let Some(e) = &s.error {
            out.push_str(&format!("  error: {e}\n"));
        }
        for t in &s.tools {
            out.push_str(&format!("  {}\n", t.name));
        }
    }
    out
}

/// Validates the file (and its patches), or prints a plugin's schema.
pub fn check(args: CheckArgs) -> Exit {
    let catalogue = default_catalogue();
    if let Some(name) = args.schema {
        return match catalogue.schema(&name) {
            Some(s) => {
                crate::outln!("{}", serde_json::to_string_pretty(&s).unwrap_or_default());
                Exit::ok()
            }
            None => Exit::usage(format!(
                "unknown plugin `{name}` (known: {})",
                catalogue.names().join(", ")
            )),
        };
    }
    let source = Source {
        base: args.file,
        patches: args.patches,
    };
    match source.plan(&catalogue) {
        Ok(plan) => {
            let all = plan.flatten();
            let enabled = all.iter().filter(|(e, _)| !e.disabled).count();
            crate::outln!(
                "{}: ok ({} entries, {} enabled)",
                source.base.display(),
                all.len(),
                enabled
            );
            Exit::ok()
        }
        Err(problems) => Exit::placed(exit::USAGE, problems.to_string()),
    }
}

/// Boots the file, prints the live tree, and shuts it down in order.
pub async fn tree(args: TreeArgs) -> Exit {
    let json = args.json;
    booted(args, move |rt, failed| {
        let nodes = rt.tree().snapshot();
        if json {
            crate::outln!(
                "{}",
                serde_json::to_string_pretty(&nodes).unwrap_or_default()
            );
        } else {
            crate::out!("{}", render(&nodes));
        }
        failed
    })
    .await
}
