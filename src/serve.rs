//! `dsh serve`: the HTTP/SSE API and dashboard over the live actor tree,
//! until Ctrl-C or SIGTERM; then the runtime shuts down in order.

use dsh_supervisors::{Error, Runtime, RuntimeSettings};

use crate::args::{ConfigArgs, MODEL_PRECEDENCE, ModelArgs, PolicyArgs};
use crate::exit::{self, Exit};
use crate::stage::{Needs, boot};
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
    /// The model agents use.
    #[command(flatten)]
    pub model: ModelArgs,
    /// What agents may do without asking.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// A plugin tree for the services and providers.
    #[command(flatten)]
    pub config: ConfigArgs,
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
    let needs = Needs {
        model: &args.model,
        policy: &args.policy,
        config: &args.config,
        model_required: false,
        terminal: false,
    };
    boot(rt, needs).await?;
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
    println!("dsh serve: listening on http://{}", web.local_addr());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| Exit::failed(format!("cannot watch SIGTERM: {e}")))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}
