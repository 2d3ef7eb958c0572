//! `dsh bench compare`: our W1/W2/W3 beside the AutoAgents harness (the
//! Rust peer, `bench/autoagents` of the shared workspace beside the
//! repository), in one run.
//!
//! Each cell runs one warm-up process of each side, then `runs` fresh
//! processes of each, interleaved (ours, theirs, ours, …) so both see the
//! same machine; the table gives each side's median and the ratio
//! ours / theirs (below 1: we are ahead). A developer tool, not a test:
//! it builds the harness when its binary is missing, and says so when the
//! harness is not there at all.

use std::path::{Path, PathBuf};

use dsh_supervisors::BoxError;
use dsh_supervisors::error::chain;
use serde_json::{Value, json};

use crate::exit::Exit;

/// `dsh bench compare`: the options.
#[derive(clap::Args, Debug, Clone)]
pub struct CompareArgs {
    /// The AutoAgents harness directory (default: `$DSH_AUTOAGENTS_DIR`)
    #[arg(long, value_name = "DIR")]
    pub peer: Option<PathBuf>,
    /// Measured processes per side and cell
    #[arg(long, default_value_t = 5)]
    pub runs: u32,
    /// Cells, comma-separated: w1 (2 threads), w1t1 (1 thread), w2k100,
    /// w2k1000, w3
    #[arg(long, default_value = "w1,w1t1,w2k100,w2k1000,w3")]
    pub cells: String,
    /// Smoke sizes (W1 R=20, W2 K=10/50, W3 N=200)
    #[arg(long)]
    pub quick: bool,
}

/// One cell: the arguments of each side and the figures compared.
struct Cell {
    name: &'static str,
    ours: Vec<String>,
    theirs: Vec<String>,
    metrics: &'static [&'static str],
}

fn cells(quick: bool) -> Vec<Cell> {
    // W1: ours repeats 200-turn rounds on fresh agents for at least 0.5 s;
    // the harness runs one agent whose memory is cleared each turn, so the
    // same 0.5 s and more is one longer run of it.
    let (r, min_secs, r_peer, k1, k2, n) = if quick {
        (20, 0.0, 20, 10, 50, 200)
    } else {
        (200, 0.5, 12_500, 100, 1000, 10_000)
    };
    let words = |s: String| s.split(' ').map(str::to_owned).collect::<Vec<_>>();
    let w1 = ["us_per_step", "peak_rss_kb"].as_slice();
    let w2 = ["wall_s", "peak_minus_baseline_kb"].as_slice();
    vec![
        Cell {
            name: "w1",
            ours: words(format!(
                "bench w1 --turns {r} --steps 5 --threads 2 --min-seconds {min_secs}"
            )),
            theirs: words(format!("w1 --r {r_peer} --s 5 --variant actor --threads 2")),
            metrics: w1,
        },
        Cell {
            name: "w1t1",
            ours: words(format!(
                "bench w1 --turns {r} --steps 5 --threads 1 --min-seconds {min_secs}"
            )),
            theirs: words(format!("w1 --r {r_peer} --s 5 --variant actor --threads 1")),
            metrics: w1,
        },
        Cell {
            name: "w2k100",
            ours: words(format!("bench w2 --k {k1}")),
            theirs: words(format!("w2 --k {k1} --s 5 --variant actor --threads 2")),
            metrics: w2,
        },
        Cell {
            name: "w2k1000",
            ours: words(format!("bench w2 --k {k2}")),
            theirs: words(format!("w2 --k {k2} --s 5 --variant actor --threads 2")),
            metrics: w2,
        },
        Cell {
            name: "w3",
            ours: words(format!("bench w3 --n {n}")),
            theirs: words(format!("w3 --n {n} --threads 2")),
            metrics: &["bytes_per_agent", "us_per_agent"],
        },
    ]
}

/// Where the harness is, and its binary (built when missing).
async fn harness(args: &CompareArgs) -> Result<Option<PathBuf>, BoxError> {
    let Some(dir) = args
        .peer
        .clone()
        .or_else(|| std::env::var_os("DSH_AUTOAGENTS_DIR").map(PathBuf::from))
    else {
        dsh::errln!(
            "dsh bench compare: no AutoAgents harness named (pass --peer DIR, the shared workspace's bench/autoagents, or set DSH_AUTOAGENTS_DIR); our figures alone follow"
        );
        return Ok(None);
    };
    if !dir.join("Cargo.toml").is_file() {
        dsh::errln!(
            "dsh bench compare: no AutoAgents harness at {} (no Cargo.toml there); our figures alone follow",
            dir.display()
        );
        return Ok(None);
    }
    let target = std::env::var_os("DSH_AUTOAGENTS_TARGET")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/tmp/aa-target"));
    let bin = target.join("release/aa-bench");
    if !bin.is_file() {
        dsh::errln!(
            "dsh bench compare: building the AutoAgents harness in {} (once; a few minutes)",
            target.display()
        );
        let status = tokio::process::Command::new("cargo")
            .args(["build", "--release", "--quiet"])
            .current_dir(&dir)
            .env("CARGO_TARGET_DIR", &target)
            .status()
            .await?;
        if !status.success() {
            return Err(format!("building the harness in {} failed", dir.display()).into());
        }
    }
    Ok(Some(bin))
}

/// Runs `program args` and returns its `RESULT` record.
async fn result_of(program: &Path, args: &[String]) -> Result<Value, BoxError> {
    let out = tokio::process::Command::new(program)
        .args(args)
        .output()
        .await?;
    if !out.status.success() {
        return Err(format!(
            "{} {} failed: {}",
            program.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        )
        .into());
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("RESULT "))
        .ok_or_else(|| format!("{} {} printed no RESULT", program.display(), args.join(" ")))?;
    Ok(serde_json::from_str(line)?)
}

/// The median of `v`, with its least and greatest.
fn spread(mut v: Vec<f64>) -> Option<(f64, f64, f64)> {
    v.sort_by(f64::total_cmp);
    Some((*v.get(v.len() / 2)?, *v.first()?, *v.last()?))
}

/// A figure with four significant digits (kB and seconds alike).
fn figure_text(v: f64) -> String {
    if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.4}")
    }
}

/// Runs the cells and prints the table, then `RESULT {json}`.
pub async fn compare(args: CompareArgs) -> Exit {
    match run(args).await {
        Ok(()) => Exit::ok(),
        Err(e) => Exit::failed(chain(&*e).to_string()),
    }
}

async fn run(args: CompareArgs) -> Result<(), BoxError> {
    if args.runs == 0 {
        return Err("--runs must be at least 1".into());
    }
    let ours = std::env::current_exe()?;
    let theirs = harness(&args).await?;
    let wanted: Vec<&str> = args.cells.split(',').map(str::trim).collect();
    let all = cells(args.quick);
    if let Some(bad) = wanted.iter().find(|w| !all.iter().any(|c| c.name == **w)) {
        return Err(format!("unknown cell `{bad}` (known: w1, w1t1, w2k100, w2k1000, w3)").into());
    }
    dsh::outln!(
        "| cell | metric | dsh median (min–max) | AutoAgents median (min–max) | dsh / AutoAgents |"
    );
    dsh::outln!("|---|---|---:|---:|---:|");
    let mut records = Vec::new();
    for cell in all.iter().filter(|c| wanted.contains(&c.name)) {
        let mut mine = Vec::new();
        let mut peer = Vec::new();
        for i in 0..=args.runs {
            let a = result_of(&ours, &cell.ours).await?;
            let b = match &theirs {
                Some(bin) => Some(result_of(bin, &cell.theirs).await?),
                None => None,
            };
            // Run 0 is the warm-up of each side.
            if i > 0 {
                mine.push(a);
                peer.extend(b);
            }
        }
        for metric in cell.metrics {
            let figure =
                |runs: &[Value]| spread(runs.iter().filter_map(|r| r[*metric].as_f64()).collect());
            let (a, b) = (figure(&mine), figure(&peer));
            let show = |v: Option<(f64, f64, f64)>| {
                v.map_or("—".to_owned(), |(m, lo, hi)| {
                    format!(
                        "{} ({}–{})",
                        figure_text(m),
                        figure_text(lo),
                        figure_text(hi)
                    )
                })
            };
            let ratio = match (a, b) {
                (Some((a, ..)), Some((b, ..))) if b > 0.0 => Some(a / b),
                _ => None,
            };
            let (a_min, a_max) = (a.map(|v| v.1), a.map(|v| v.2));
            let (b_min, b_max) = (b.map(|v| v.1), b.map(|v| v.2));
            let (a, b) = (a.map(|v| v.0), b.map(|v| v.0));
            dsh::outln!(
                "| {} | {metric} | {} | {} | {} |",
                cell.name,
                show(figure(&mine)),
                show(figure(&peer)),
                ratio.map_or("—".to_owned(), |r| format!("{r:.2}"))
            );
            records.push(json!({"cell": cell.name, "metric": metric,
                "dsh": a, "dsh_min": a_min, "dsh_max": a_max,
                "autoagents": b, "autoagents_min": b_min, "autoagents_max": b_max,
                "ratio": ratio}));
        }
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    dsh::outln!(
        "RESULT {}",
        json!({"workload": "compare", "runs": args.runs, "quick": args.quick,
               "peer": theirs.is_some(), "loadavg_after": load.split(' ').next(), "cells": records})
    );
    Ok(())
}
