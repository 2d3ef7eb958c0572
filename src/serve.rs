//! `dsh serve`: the HTTP/SSE API and dashboard over the live actor tree,
//! until Ctrl-C or SIGTERM; then the runtime shuts down in order.

use dsh_supervisors::error::chain;
use dsh_supervisors::{Error, Runtime, RuntimeSettings};

use std::sync::Arc;

use crate::args::{AgentArgs, DashboardArgs, MODEL_PRECEDENCE};
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
    /// Environment variable holding the bearer token (required off
    /// loopback; with --mutations and none, the server makes one and prints
    /// it in its URL's fragment).
    #[arg(long, value_name = "VAR")]
    pub token_env: Option<String>,
    /// Enable the endpoints that create, steer and cancel agents and answer
    /// approvals; every request then needs the token.
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
        Err(e) => return Exit::failed(format!("cannot start the runtime: {}", chain(&e))),
    };
    let exit = Exit::from(serve_in(&rt, args).await);
    rt.shutdown().await;
    exit
}

async fn serve_in(rt: &Runtime, args: ServeArgs) -> exit::Result<()> {
    // No model configured is fine: the API serves the tree without one.
    boot(rt, &args.agents, Purpose::Serve, None).await?;
    if !args.cluster.nodes.is_empty() {
        crate::node::offer_remote(rt, &args.cluster).await?;
    }
    let config = WebConfig {
        bind: args.bind,
        token_env: args.token_env,
        mutations: args.mutations,
    };
    let web = web(rt, config).await?;
    // One line on stdout: where to connect (tests and scripts read it). A
    // token the server made is told here only, in the URL's fragment.
    let url = if web.token_generated() {
        web.page_url()
    } else {
        format!("http://{}", web.local_addr())
    };
    crate::outln!("dsh serve: listening on {url}");
    // Ctrl-C, SIGTERM or SIGHUP: the normal end of a server (exit 0).
    let _ = crate::exit::stop_signal().await;
    Ok(())
}

/// The runtime's web server: a config's own `web` entry, else one started
/// with `config`.
async fn web(rt: &Runtime, config: WebConfig) -> exit::Result<Arc<WebServer>> {
    let root = rt.root();
    if let Some(w) = root.get::<WebServer>(WebServer::SERVICE) {
        return Ok(w);
    }
    root.plugin(Web, config).await.map_err(|e| match e {
        Error::PluginFailed { reason, .. } => Exit::usage(reason),
        other => Exit::failed(other.to_string()),
    })?;
    root.get::<WebServer>(WebServer::SERVICE)
        .ok_or_else(|| Exit::failed("the web plugin provided no server"))
}

/// With `--dashboard`: serves the page of `rt` (its tree, its agents; the
/// page may cancel and steer them), and says where on stderr.
pub async fn dashboard(rt: &Runtime, args: &DashboardArgs) -> exit::Result<()> {
    if let Some(url) = dashboard_url(rt, args).await? {
        crate::errln!("dsh: dashboard at {url}");
    }
    Ok(())
}

/// With `--dashboard`: serves the page of `rt` and returns its address
/// (the token, when there is one, in the fragment, which is never sent).
pub async fn dashboard_url(rt: &Runtime, args: &DashboardArgs) -> exit::Result<Option<String>> {
    let Some(bind) = &args.dashboard else {
        return Ok(None);
    };
    let config = WebConfig {
        bind: bind.clone(),
        token_env: args.dashboard_token_env.clone(),
        mutations: true,
    };
    let web = web(rt, config).await?;
    Ok(Some(web.page_url()))
}

/// Runs a command's `drive` in a runtime of its own with the workspace
/// resolved: then keeps the dashboard up with `--hold`, and shuts the
/// runtime down in order (at most 60 s). Returns how the process exits.
pub async fn in_runtime<F, Fut>(
    workspace: &crate::args::WorkspaceArgs,
    dashboard: &DashboardArgs,
    drive: F,
) -> Exit
where
    F: FnOnce(Runtime, std::path::PathBuf) -> Fut,
    Fut: std::future::Future<Output = exit::Result<()>>,
{
    let cwd = match workspace.resolve() {
        Ok(c) => c,
        Err(e) => return e,
    };
    let rt = match Runtime::start(dsh_supervisors::RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => {
            return Exit::failed(format!(
                "cannot start the runtime: {}",
                dsh_supervisors::error::chain(&e)
            ));
        }
    };
    let exit = Exit::from(drive(rt.clone(), cwd).await);
    hold(dashboard).await;
    if tokio::time::timeout(std::time::Duration::from_secs(60), rt.shutdown())
        .await
        .is_err()
    {
        return Exit::failed("shutdown did not finish within 60 s");
    }
    exit
}

/// With `--hold`: keeps the process, and the page, up until Ctrl-C,
/// SIGTERM or SIGHUP.
pub async fn hold(args: &DashboardArgs) {
    if args.hold {
        crate::errln!("dsh: the run ended; the dashboard stays up until Ctrl-C");
        let _ = crate::exit::stop_signal().await;
    }
}
