//! `dsh node` (a process that joins a cluster and serves child agents to
//! parents on other nodes) and [`ClusterArgs`] (how a command that starts
//! agents places its children on such nodes).
//!
//! The cookie is read from the variable `--cookie-env` names, never from
//! the command line; a missing or empty one is refused before anything
//! starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_actors::cluster::host::{self, HostSettings};
use dsh_actors::cluster::remote::RemoteProvider;
use dsh_actors::cluster::tls::Tls;
use dsh_actors::cluster::wire::{Hello, Request, TreeView};
use dsh_actors::cluster::{Cluster, ClusterSettings, Peer, Placement};
use dsh_actors::subagent::Subagents;
use dsh_actors::subagent::tools::{SubagentTool, SubagentToolConfig};
use dsh_services::sandbox::Sandbox;
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::error::chain;
use dsh_supervisors::{Context, Group, PluginOptions, Runtime, RuntimeSettings};

use crate::args::{AgentArgs, ClusterArgs, MODEL_PRECEDENCE, StoreArgs, WorkspaceArgs};
use crate::exit::{self, Exit};
use crate::stage::{Route, route, store};

/// How long joining one peer may take (connect, cookie challenge, its host
/// answering).
const JOIN_TIMEOUT: Duration = Duration::from_secs(15);

/// `dsh node`: the options.
#[derive(clap::Args, Debug)]
#[command(after_help = MODEL_PRECEDENCE)]
pub struct NodeArgs {
    /// This node's name (letters, digits, `_`, `.`, `-`)
    #[arg(long, value_name = "NAME")]
    pub name: String,
    /// Where to accept peers (port 0: a free one; the line on stderr says
    /// which)
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Peers to join at start, NAME@HOST:PORT (repeatable or comma-separated)
    #[arg(long = "connect", value_name = "NAME@ADDR", value_delimiter = ',')]
    pub connect: Vec<Peer>,
    /// The variable holding the cluster's cookie (the cookie itself is never a flag)
    #[arg(long, value_name = "VAR")]
    pub cookie_env: String,
    /// The most child agents this node holds at once
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub max_agents: u32,
    /// Serve the benchmark's worker model and `echo` instead of a model
    /// (for `dsh bench w2 --local-nodes`).
    #[arg(long, hide = true)]
    pub bench_worker: bool,
    /// Accept peers over TLS only, with this PEM certificate chain
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Trust the peers this PEM file vouches for when dialling them
    /// (--connect) [default: the node's own --tls-cert]
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_ca: Option<PathBuf>,
    /// The model, policy and plugin tree children run with.
    #[command(flatten)]
    pub agents: AgentArgs,
    /// The workspace children's tools work in.
    #[command(flatten)]
    pub workspace: WorkspaceArgs,
    /// Where children's sessions are stored.
    #[command(flatten)]
    pub store: StoreArgs,
}

/// The cookie from `$var`: set and not empty.
fn cookie(var: &str) -> exit::Result<String> {
    match std::env::var(var) {
        Ok(c) if !c.is_empty() => Ok(c),
        Ok(_) => Err(Exit::usage(format!(
            "${var} is empty; set it to the cluster's cookie"
        ))),
        Err(_) => Err(Exit::usage(format!(
            "${var} is not set; set it to the cluster's cookie (--cookie-env names the variable)"
        ))),
    }
}

/// A fiber named `cluster` under the root for the node's parts.
async fn cluster_fiber(rt: &Runtime) -> exit::Result<Context> {
    let options = PluginOptions {
        name: Some("cluster".into()),
        ..PluginOptions::default()
    };
    let fiber = rt
        .root()
        .plugin_with(Group, (), options)
        .await
        .map_err(|e| Exit::failed(format!("cannot start the cluster: {}", chain(&e))))?;
    Ok(fiber.context())
}

async fn join_all(cluster: &Cluster, peers: &[Peer]) -> exit::Result<()> {
    for peer in peers {
        cluster
            .connect(peer, JOIN_TIMEOUT)
            .await
            .map_err(|e| Exit::failed(chain(&e).to_string()))?;
    }
    Ok(())
}

/// What `--bench-worker` serves instead of a model: provides the
/// benchmark's worker model and tool on the runtime (the `dsh` binary's
/// benchmarks pass theirs).
pub type BenchWorker =
    for<'a> fn(
        &'a Runtime,
    ) -> futures::future::BoxFuture<'a, Result<(), dsh_supervisors::BoxError>>;

/// `dsh node --name NAME --cookie-env VAR …`: joins (or starts) a cluster
/// and serves children until Ctrl-C, SIGTERM or SIGHUP; `bench_worker`
/// serves `--bench-worker`.
pub async fn node(args: NodeArgs, bench_worker: BenchWorker) -> Exit {
    let cookie = match cookie(&args.cookie_env) {
        Ok(c) => c,
        Err(e) => return e,
    };
    if let Err(e) = dsh_actors::cluster::valid_name(&args.name) {
        return Exit::usage(format!("--name: {}", chain(&e)));
    }
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => return Exit::failed(format!("cannot start the runtime: {}", chain(&e))),
    };
    let exit = Exit::from(serve_node(&rt, &args, cookie, bench_worker).await);
    if tokio::time::timeout(Duration::from_secs(60), rt.shutdown())
        .await
        .is_err()
    {
        crate::errln!(
            "dsh node {}: the shutdown did not finish within 60 s",
            args.name
        );
    }
    exit
}

async fn serve_node(
    rt: &Runtime,
    args: &NodeArgs,
    cookie: String,
    bench_worker: BenchWorker,
) -> exit::Result<()> {
    let cwd = args.workspace.resolve()?;
    let (provider, model, store) = if args.bench_worker {
        bench_worker(rt)
            .await
            .map_err(|e| Exit::failed(e.to_string()))?;
        // In memory, as the benchmark's own agents are.
        ("bench-worker".to_owned(), "bench".to_owned(), None)
    } else {
        let Route { provider, model } = route(rt, &args.agents, None).await?;
        (provider, model, Some(store(rt, &args.store)?))
    };
    let policy = rt
        .root()
        .get::<Sandbox>(Sandbox::SERVICE)
        .map(|s| s.settings().defaults)
        .unwrap_or_default();
    let ctx = cluster_fiber(rt).await?;
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(
            Tls::node(cert, key, args.tls_ca.as_deref())
                .map_err(|e| Exit::usage(chain(&e).to_string()))?,
        ),
        _ => None,
    };
    let settings = ClusterSettings {
        name: args.name.clone(),
        cookie,
        listen: Some(args.listen),
        tls,
    };
    let cluster = Cluster::start(&ctx, settings)
        .await
        .map_err(|e| Exit::failed(chain(&e).to_string()))?;
    let hosting = HostSettings {
        max_agents: args.max_agents,
        route: (provider, model.clone()),
        system: Some(if args.bench_worker {
            "You are a benchmark agent.".to_owned()
        } else {
            crate::stage::system_prompt(&cwd, &model)
        }),
        cwd,
        store,
        policy,
    };
    host::serve(&cluster, hosting)
        .await
        .map_err(|e| Exit::failed(chain(&e).to_string()))?;
    if let Some(addr) = cluster.listen_addr() {
        crate::errln!("dsh node {} listening on {addr}", args.name);
    }
    join_all(&cluster, &args.connect).await?;
    for peer in &args.connect {
        crate::errln!("dsh node {}: joined {peer}", args.name);
    }
    // Ctrl-C, SIGTERM or SIGHUP: the node drains its children and leaves.
    let _ = crate::exit::stop_signal().await;
    crate::errln!("dsh node {}: leaving; draining its children", args.name);
    Ok(())
}

impl ClusterArgs {
    /// With `--nodes`: joins them as a client-only node and registers the
    /// `remote` subagent provider; returns the cluster children go to.
    pub async fn join(
        &self,
        rt: &Runtime,
        subagents: &Arc<Subagents>,
    ) -> exit::Result<Option<Arc<Cluster>>> {
        if self.nodes.is_empty() {
            return Ok(None);
        }
        if let Some(Placement::Node(n)) = &self.placement
            && !self.nodes.iter().any(|p| &p.name == n)
        {
            return Err(Exit::usage(format!(
                "--placement {n}: no node of that name is in --nodes"
            )));
        }
        let (ctx, cluster) = self.client(rt).await?;
        join_all(&cluster, &self.nodes).await?;
        let placement = self.placement.clone().unwrap_or(Placement::RoundRobin);
        let provider = RemoteProvider::new(cluster.clone(), placement);
        subagents
            .register(&ctx, Arc::new(provider))
            .map_err(|e| Exit::failed(chain(&e).to_string()))?;
        Ok(Some(cluster))
    }

    /// A client-only node under `rt` (its cookie from `--cookie-env`),
    /// joined to nothing yet; and the context its parts live under.
    async fn client(&self, rt: &Runtime) -> exit::Result<(Context, Arc<Cluster>)> {
        let var = self.cookie_env.as_deref().ok_or_else(|| {
            Exit::usage("--nodes needs --cookie-env VAR (the variable holding the cookie)")
        })?;
        let cookie = cookie(var)?;
        let ctx = cluster_fiber(rt).await?;
        let id = dsh_services::llm::Message::new_id();
        let tls = match &self.tls_ca {
            Some(ca) => Some(Tls::client(ca).map_err(|e| Exit::usage(chain(&e).to_string()))?),
            None => None,
        };
        let settings = ClusterSettings {
            name: format!("client-{}", dsh_actors::session::short(&id)),
            cookie,
            listen: None,
            tls,
        };
        let cluster = Cluster::start(&ctx, settings)
            .await
            .map_err(|e| Exit::failed(chain(&e).to_string()))?;
        Ok((ctx, cluster))
    }
}

/// With `--nodes`: joins them and gives the agents of `rt` a
/// `subagent_remote` tool (the `subagent` tool over the `remote` provider).
pub async fn offer_remote(rt: &Runtime, args: &ClusterArgs) -> exit::Result<()> {
    let root = rt.root();
    let subagents = root.get::<Subagents>(Subagents::SERVICE).ok_or_else(|| {
        Exit::usage("--nodes needs the multi-agent services (`multi_agent: false` in the config?)")
    })?;
    let tools = root
        .get::<ToolRegistry>(ToolRegistry::SERVICE)
        .ok_or_else(|| Exit::failed("no tool registry"))?;
    args.join(rt, &subagents).await?;
    let mut config = SubagentToolConfig::new("remote", REMOTE_TOOL);
    config.remote = true;
    let tool =
        SubagentTool::new(subagents, config).map_err(|e| Exit::failed(chain(&e).to_string()))?;
    tools
        .register(&root, Arc::new(tool))
        .map_err(|e| Exit::failed(chain(&e).to_string()))?;
    Ok(())
}

/// `dsh tree --nodes …`: each node's supervision tree, as it is now.
pub async fn trees(args: ClusterArgs, json: bool) -> Exit {
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => return Exit::failed(format!("cannot start the runtime: {}", chain(&e))),
    };
    let exit = Exit::from(print_trees(&rt, &args, json).await);
    let _ = tokio::time::timeout(Duration::from_secs(60), rt.shutdown()).await;
    exit
}

async fn print_trees(rt: &Runtime, args: &ClusterArgs, json: bool) -> exit::Result<()> {
    let (_, cluster) = args.client(rt).await?;
    let mut all = serde_json::Map::new();
    for peer in &args.nodes {
        let host = cluster
            .connect(peer, JOIN_TIMEOUT)
            .await
            .map_err(|e| Exit::failed(chain(&e).to_string()))?;
        let view: TreeView = host
            .call(&Request::Tree {}, JOIN_TIMEOUT)
            .await
            .map_err(|e| Exit::failed(format!("the tree of {peer}: {}", chain(&e))))?;
        let hello: Hello = host
            .call(&Request::Hello {}, JOIN_TIMEOUT)
            .await
            .map_err(|e| Exit::failed(format!("the capacity of {peer}: {}", chain(&e))))?;
        if json {
            let both = serde_json::json!({
                "nodes": view.nodes,
                "stopped": view.stopped,
                "capacity": {"maxAgents": hello.max_agents, "agents": hello.agents},
            });
            all.insert(view.node, both);
        } else {
            crate::outln!(
                "node {peer} (holds {} of {} children):\n{}",
                hello.agents,
                hello.max_agents,
                view.text
            );
        }
    }
    if json {
        crate::outln!("{}", serde_json::Value::Object(all));
    }
    Ok(())
}

/// The delegation tool `--nodes` adds to `dsh run`.
pub const REMOTE_TOOL: &str = "subagent_remote";
