//! `dsh bench kernel`: the kernel's own costs, measured through its public API.
//!
//! - start + ordered teardown of a 1,010-actor tree (10 fibers × 10 fibers ×
//!   9 workers; 3 levels under the root),
//! - per-dispatch and per-listener cost of each event mode (5 listeners),
//! - supervised spawn (`Context::spawn`: registry node, child record, linked
//!   actor) against a bare `ractor` spawn measured in the same run.
//!
//! Every figure is the median of several rounds; the last line is
//! `RESULT {json}`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dsh_supervisors::{
    Bail, BoxError, Context, Emit, Event, NoMessages, Parallel, Plugin, PluginOptions, Runtime,
    RuntimeSettings, Serial, Waterfall, WorkerSpec,
};
use ractor::{Actor, ActorProcessingErr, ActorRef};

/// A worker that does nothing.
struct Nop;

impl Actor for Nop {
    type Msg = NoMessages;
    type State = ();
    type Arguments = ();

    async fn pre_start(
        &self,
        _me: ActorRef<NoMessages>,
        _args: (),
    ) -> Result<(), ActorProcessingErr> {
        Ok(())
    }
}

/// One level of the benchmark tree.
struct Level {
    depth: usize,
}

impl Plugin for Level {
    type Config = ();

    fn name(&self) -> &str {
        "level"
    }

    async fn apply(&self, ctx: Context, _config: Arc<()>) -> Result<(), BoxError> {
        if self.depth == 0 {
            for i in 0..9 {
                ctx.spawn(WorkerSpec::new("worker", format!("w{i}"), Nop, ()))
                    .await?;
            }
            return Ok(());
        }
        for i in 0..10 {
            let options = PluginOptions {
                name: Some(format!("level{}/{i}", self.depth)),
                ..PluginOptions::default()
            };
            ctx.plugin_with(
                Level {
                    depth: self.depth - 1,
                },
                (),
                options,
            )
            .await?;
        }
        Ok(())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

struct TreeFigures {
    actors: usize,
    start_ms: f64,
    teardown_ms: f64,
}

async fn tree_round() -> Result<TreeFigures, BoxError> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let t0 = Instant::now();
    let top = rt.root().plugin(Level { depth: 2 }, ()).await?;
    let start = t0.elapsed();
    let actors = rt.tree().live_len() - 1;
    let t1 = Instant::now();
    top.dispose().await;
    let teardown = t1.elapsed();
    let order = top.stop_order().unwrap_or_default();
    if order.len() != actors {
        return Err(format!("teardown stopped {} of {actors} actors", order.len()).into());
    }
    rt.shutdown().await;
    Ok(TreeFigures {
        actors,
        start_ms: start.as_secs_f64() * 1e3,
        teardown_ms: teardown.as_secs_f64() * 1e3,
    })
}

struct Tick(u64);
impl Event for Tick {
    const NAME: &'static str = "bench/tick";
}
impl Emit for Tick {}
impl Parallel for Tick {}
impl Bail for Tick {
    type Output = u64;
}
impl Serial for Tick {
    type Output = u64;
}
impl Waterfall for Tick {
    type Output = u64;
}

const LISTENERS: usize = 5;

async fn dispatch_costs(iterations: u64) -> Result<Vec<(&'static str, f64)>, BoxError> {
    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let ctx = rt.root();
    for _ in 0..LISTENERS {
        ctx.on(|t: &Tick| {
            std::hint::black_box(t.0);
        })?;
        ctx.on_bail(|t: &Tick| (t.0 == u64::MAX).then_some(0))?;
        ctx.on_parallel(|t: Arc<Tick>| async move {
            std::hint::black_box(t.0);
        })?;
        ctx.on_serial(|t: Arc<Tick>| async move { (t.0 == u64::MAX).then_some(0) })?;
        ctx.on_waterfall(|t: Tick, next| async move { next.run(Tick(t.0 + 1)).await })?;
    }
    let mut out = Vec::new();
    let per = |d: Duration| d.as_secs_f64() * 1e9 / iterations as f64;

    let t = Instant::now();
    for i in 0..iterations {
        ctx.emit(&Tick(i));
    }
    out.push(("emit", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        std::hint::black_box(ctx.bail(&Tick(i)));
    }
    out.push(("bail", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        ctx.parallel(Tick(i)).await;
    }
    out.push(("parallel", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        std::hint::black_box(ctx.serial(Tick(i)).await);
    }
    out.push(("serial", per(t.elapsed())));

    let t = Instant::now();
    for i in 0..iterations {
        let out = ctx.waterfall(Tick(i), |t: Tick| async move { t.0 }).await?;
        if out != i + LISTENERS as u64 {
            return Err(format!(
                "waterfall returned {out}, expected {}",
                i + LISTENERS as u64
            )
            .into());
        }
    }
    out.push(("waterfall", per(t.elapsed())));
    rt.shutdown().await;
    Ok(out)
}

async fn spawn_costs(n: usize) -> Result<(f64, f64), BoxError> {
    // Bare ractor: spawn n unlinked actors, then stop them (not timed).
    let t = Instant::now();
    let mut bare = Vec::with_capacity(n);
    for _ in 0..n {
        let (r, h) = Actor::spawn(None, Nop, ()).await?;
        bare.push((r, h));
    }
    let bare_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    // Outside the tree on purpose (the baseline), so stopped here.
    for (bare, h) in bare {
        bare.stop(None);
        let _ = h.await;
    }

    let rt = Runtime::start(RuntimeSettings::default()).await?;
    let host = rt.root().plugin(dsh_supervisors::Group, ()).await?;
    let ctx = host.context();
    let t = Instant::now();
    for i in 0..n {
        ctx.spawn(WorkerSpec::new("worker", format!("w{i}"), Nop, ()))
            .await?;
    }
    let supervised_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
    rt.shutdown().await;
    Ok((bare_us, supervised_us))
}

/// Runs the kernel benchmark and prints its figures.
pub async fn kernel(rounds: usize) -> Result<serde_json::Value, BoxError> {
    let rounds = rounds.max(1);
    // Warm-up of every path.
    tree_round().await?;
    dispatch_costs(10_000).await?;
    spawn_costs(200).await?;

    let mut starts = Vec::new();
    let mut teardowns = Vec::new();
    let mut totals = Vec::new();
    let mut actors = 0;
    for _ in 0..rounds {
        let f = tree_round().await?;
        actors = f.actors;
        totals.push(f.start_ms + f.teardown_ms);
        starts.push(f.start_ms);
        teardowns.push(f.teardown_ms);
    }
    let (start_ms, teardown_ms, total_ms) = (median(starts), median(teardowns), median(totals));
    dsh::outln!(
        "tree of {actors} actors (3 levels): start {start_ms:.2} ms, ordered teardown {teardown_ms:.2} ms, total {total_ms:.2} ms (aim < 50 ms)"
    );

    let mut per_mode: Vec<Vec<(&'static str, f64)>> = Vec::new();
    for _ in 0..rounds {
        per_mode.push(dispatch_costs(100_000).await?);
    }
    let mut dispatch = serde_json::Map::new();
    for (i, (mode, _)) in per_mode[0].iter().enumerate() {
        let ns = median(per_mode.iter().map(|r| r[i].1).collect());
        dsh::outln!(
            "dispatch `{mode}` with {LISTENERS} listeners: {ns:.0} ns per dispatch, {:.0} ns per listener",
            ns / LISTENERS as f64
        );
        dispatch.insert(
            (*mode).to_owned(),
            serde_json::json!({"ns_per_dispatch": ns, "ns_per_listener": ns / LISTENERS as f64}),
        );
    }

    let mut bare = Vec::new();
    let mut supervised = Vec::new();
    for _ in 0..rounds {
        let (b, s) = spawn_costs(2_000).await?;
        bare.push(b);
        supervised.push(s);
    }
    let (bare_us, supervised_us) = (median(bare), median(supervised));
    let ratio = supervised_us / bare_us;
    dsh::outln!(
        "spawn: bare ractor {bare_us:.2} us, supervised {supervised_us:.2} us, ratio {ratio:.2}x (aim <= 2x)"
    );
    let result = serde_json::json!({
        "tree_actors": actors,
        "tree_start_ms": start_ms,
        "tree_teardown_ms": teardown_ms,
        "tree_total_ms": total_ms,
        "dispatch": dispatch,
        "spawn_bare_us": bare_us,
        "spawn_supervised_us": supervised_us,
        "spawn_ratio": ratio,
        "rounds": rounds,
    });
    dsh::outln!("RESULT {result}");
    Ok(result)
}
