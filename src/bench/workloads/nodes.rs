//! W2 across local `dsh node` processes: the nodes, and their memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dsh_actors::subagent::Subagents;
use dsh_services::llm::LlmRuntime;
use dsh_services::tools::ToolRegistry;
use dsh_supervisors::BoxError;

use super::models::{Delegate, OrchestratorModel};
use super::{fan_out, rss_kb, threads, world};

/// A `dsh node --bench-worker` process of this binary on loopback.
struct LocalNode {
    child: tokio::process::Child,
    peer: dsh_actors::cluster::Peer,
    // Held open so the node's stderr never sees a closed pipe.
    _stderr: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStderr>>,
}

const NODE_COOKIE_VAR: &str = "DSH_BENCH_COOKIE";

async fn local_node(name: &str, cookie: &str) -> Result<LocalNode, BoxError> {
    use tokio::io::AsyncBufReadExt;
    let exe = std::env::current_exe()?;
    let mut child = tokio::process::Command::new(exe)
        .args(["node", "--name", name, "--listen", "127.0.0.1:0"])
        .args(["--cookie-env", NODE_COOKIE_VAR, "--bench-worker"])
        .args(["--max-agents", "100000"])
        .env(NODE_COOKIE_VAR, cookie)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let stderr = child.stderr.take().ok_or("the node has no stderr")?;
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    let addr = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if let Some(addr) = line.split(" listening on ").nth(1) {
                return Ok::<_, std::io::Error>(Some(addr.trim().to_owned()));
            }
        }
        Ok(None)
    })
    .await
    .map_err(|_| format!("node {name} did not listen within 30 s"))??
    .ok_or_else(|| format!("node {name} ended before it listened"))?;
    Ok(LocalNode {
        child,
        peer: dsh_actors::cluster::Peer {
            name: name.to_owned(),
            addr,
        },
        _stderr: lines,
    })
}

fn peak_rss_of(pid: Option<u32>) -> u64 {
    pid.and_then(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        })
        .unwrap_or(0)
}

/// W2 across `nodes` local node processes: the same fan-out once with
/// local children, then with every child placed round-robin on the
/// nodes (one process each, started here), and what a remote child costs.
pub async fn w2_nodes(k: u32, nodes: u32) -> Result<serde_json::Value, BoxError> {
    use dsh_actors::cluster::remote::RemoteProvider;
    use dsh_actors::cluster::{Cluster, ClusterSettings, Placement};
    let cookie = dsh_services::llm::Message::new_id();
    let mut started = Vec::new();
    for i in 0..nodes {
        started.push(local_node(&format!("n{i}"), &cookie).await?);
    }
    let w = world(5, None).await?;
    let root = w.rt.root();
    let subagents = Arc::new(Subagents::with_builtin());
    root.provide(Subagents::SERVICE, subagents.clone())?;
    let delegate = Arc::new(Delegate {
        subagents: subagents.clone(),
        calls: AtomicU64::new(0),
        finals: AtomicU64::new(0),
        remote: std::sync::atomic::AtomicBool::new(false),
    });
    root.get::<ToolRegistry>(ToolRegistry::SERVICE)
        .ok_or("no tool registry")?
        .register(&root, delegate.clone())?;
    let orchestrator = Arc::new(OrchestratorModel {
        k: std::sync::atomic::AtomicU32::new(10),
        calls: AtomicU64::new(0),
    });
    root.get::<LlmRuntime>(LlmRuntime::SERVICE)
        .ok_or("no llm service")?
        .register(&root, &["bench-orchestrator"], orchestrator.clone())?;
    // Local children first, as the reference.
    fan_out(&w, &delegate, &orchestrator, 10).await?;
    orchestrator.k.store(k, Ordering::Relaxed);
    let (local_wall, local_teardown, _) = fan_out(&w, &delegate, &orchestrator, k).await?;
    // Then the same fan-out on the nodes.
    let options = dsh_supervisors::PluginOptions {
        name: Some("cluster".into()),
        ..Default::default()
    };
    let ctx = root
        .plugin_with(dsh_supervisors::Group, (), options)
        .await?
        .context();
    let settings = ClusterSettings {
        name: "bench".into(),
        cookie,
        listen: None,
        tls: None,
    };
    let cluster = Cluster::start(&ctx, settings).await?;
    for n in &started {
        cluster.connect(&n.peer, Duration::from_secs(30)).await?;
    }
    subagents.register(
        &ctx,
        Arc::new(RemoteProvider::new(cluster, Placement::RoundRobin)),
    )?;
    delegate.remote.store(true, Ordering::Relaxed);
    orchestrator.k.store(10, Ordering::Relaxed);
    fan_out(&w, &delegate, &orchestrator, 10).await?;
    orchestrator.k.store(k, Ordering::Relaxed);
    let (wall, teardown, baseline) = fan_out(&w, &delegate, &orchestrator, k).await?;
    let peak = rss_kb("VmHWM:");
    let node_peaks: Vec<u64> = started.iter().map(|n| peak_rss_of(n.child.id())).collect();
    w.rt.shutdown().await;
    for mut n in started {
        let _ = n.child.start_kill();
        let _ = tokio::time::timeout(Duration::from_secs(10), n.child.wait()).await;
    }
    let per_child = |wall: f64| wall / f64::from(k) * 1e6;
    Ok(serde_json::json!({
        "workload": "w2-nodes",
        "k": k,
        "nodes": nodes,
        "local_wall_s": local_wall,
        "wall_s": wall,
        "local_us_per_child": per_child(local_wall),
        "remote_us_per_child": per_child(wall),
        "extra_us_per_remote_child": per_child(wall) - per_child(local_wall),
        "local_teardown_ms": local_teardown * 1e3,
        "teardown_ms": teardown * 1e3,
        "parent_baseline_rss_kb": baseline,
        "parent_peak_rss_kb": peak,
        "node_peak_rss_kb": node_peaks,
        "threads": threads(),
        "delegate_calls": k,
    }))
}
