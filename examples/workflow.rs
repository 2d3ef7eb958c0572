//! A workflow and a Ralph loop, run from Rust.
//!
//! The workflow is a JavaScript script whose `agent()` calls are children
//! of a coordinator agent, run in parallel; the Ralph loop gives a fresh
//! worker each round and passes a structured handoff between rounds. Both
//! end with their children disposed.
//!
//! Run: `cargo run --example workflow` (keyless: the built-in demo model).

use dsh::{Dsh, Model};

/// The script: one child per topic, their lines returned.
const FAN_OUT: &str = r#"
phase('Fan out');
const lines = await Promise.all(
  args.topics.map(t => agent('Write one line about ' + t + '.', {label: t, phase: 'Fan out'})));
return {lines};
"#;

/// Runs the workflow, then the loop; prints what each returned.
#[tokio::main]
pub async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let dsh = Dsh::builder().model(Model::demo()).start().await?;
    let out = dsh
        .workflow(FAN_OUT)
        .meta(serde_json::json!({
            "name": "fan-out",
            "description": "one line per topic, in parallel",
            "phases": [{"title": "Fan out"}],
        }))
        .args(serde_json::json!({"topics": ["actors", "supervision", "teardown"]}))
        .max_parallel(3)
        .run()
        .await?;
    println!("workflow: {} children", out.agents_started);
    for line in out.value["lines"].as_array().into_iter().flatten() {
        println!("  {}", line.as_str().unwrap_or_default());
    }
    let looped = dsh
        .ralph("Ship the release notes")
        .max_rounds(5)
        .run()
        .await?;
    println!(
        "ralph: {} after {} rounds",
        looped.outcome.describe(),
        looped.rounds
    );
    dsh.shutdown().await?;
    Ok(())
}
