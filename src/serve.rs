//! `dsh serve`: the HTTP/SSE API and dashboard over the live actor tree,
//! until Ctrl-C or SIGTERM; then the runtime shuts down in order.

use dsh_supervisors::{Error, Runtime, RuntimeSettings};

use crate::args::{AgentArgs, MODEL_PRECEDENCE};
use crate::exit::{self, Exit};
use crate::stage::{Purpose, boot};
use crate::web::{Web, WebConfig, WebServer};

/// `dsh serve`: the options.
#[derive(clap::Args, Debug)]
#[command(after_help = MODEL_PRECEDENCE)]
pub struct ServeArgs {
    /// Address to listen on (loopback by default).
    #[arg(long, default_value = "127.0.0.1:7878")]
    pub bind: String,
    /// Environment variable holding the bearer token (required off loopback).
    #[arg(long, value_name = "VAR")]
    pub token_env: Option<String>,
    /// Enable the endpoints that create and steer agents.
    #[arg(long)]
    pub mutations: bool,
    /// The model, policy and plugin tree.
    #[command(flatten)]
    pub agents: AgentArgs,
    /// Nodes the served agents may delegate to (their `subagent_remote`
    /// tool).
    #[command(flatten)]
    pub cluster: crate::args::ClusterArgs,
}

/// Serves until Ctrl-C or SIGTERM.
pub async fn serve(args: ServeArgs) -> Exit {
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => return Exit::failed(format!("cannot start the runtime: {e}")),
    };
    let exit = Exit::from(serve_in(&rt, args).await);
    rt.shutdown().await;
    exit
}

async fn serve_in(rt: &Runtime, args: ServeArgs) -> exit::Result<()> {
    // No model configured is fine: the API serves the tree without one.
    boot(rt, &args.agents, Purpose::Serve).await?;
    if !args.cluster.nodes.is_empty() {
        crate::node::offer_remote(rt, &args.cluster).await?;
    }
    let root = rt.root();
    // A config's own `web` entry serves; else one from the flags.
    let web = match root.get::<WebServer>(WebServer::SERVICE) {
        Some(w) => w,
        None => {
            let config = WebConfig {
                bind: args.bind,
                token_env: args.token_env,
                mutations: args.mutations,
            };
            root.plugin(Web, config).await.map_err(|e| match e {
                Error::PluginFailed { reason, .. } => Exit::usage(reason),
                other => Exit::failed(other.to_string()),
            })?;
            root.get::<WebServer>(WebServer::SERVICE)
                .ok_or_else(|| Exit::failed("the web plugin provided no server"))?
        }
    };
    // One line on stdout: where to connect (tests and scripts read it).
    crate::outln!("dsh serve: listening on http://{}", web.local_addr());
    // Ctrl-C, SIGTERM or SIGHUP: the normal end of a server (exit 0).
    let _ = crate::exit::stop_signal().await;
    Ok(())
}
