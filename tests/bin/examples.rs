//! The examples (`examples/*.rs`) as one binary, `dsh-examples NAME`, so the
//! suite runs each as a real process, as written (one link, not one per
//! example).

#[path = "../../examples/custom_tool.rs"]
mod custom_tool;
#[path = "../../examples/embed.rs"]
mod embed;
#[path = "../../examples/workflow.rs"]
mod workflow;

fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    match std::env::args().nth(1).as_deref() {
        Some("embed") => embed::main(),
        Some("custom_tool") => custom_tool::main(),
        Some("workflow") => workflow::main(),
        other => {
            Err(format!("usage: dsh-examples embed|custom_tool|workflow (not {other:?})").into())
        }
    }
}
