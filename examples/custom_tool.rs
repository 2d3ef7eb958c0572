//! A tool written in Rust, offered to an agent.
//!
//! `lookup_order` takes a typed argument struct (its JSON schema is derived
//! from the struct and its doc comments), declares that it only reads, and
//! answers from the service's own data. The agent calls it like any
//! built-in tool: its arguments are validated, hooks and approvals apply,
//! and a cancelled call is dropped.
//!
//! Run: `cargo run --example custom_tool` (keyless: a scripted model that
//! calls the tool), or with `DSH_BASE_URL`/`DSH_MODEL`/`DSH_API_KEY` for a
//! real OpenAI-compatible endpoint, which decides for itself.

use std::collections::HashMap;
use std::sync::Arc;

use dsh::{CustomTool, Dsh, Effect, Model};

/// What `lookup_order` takes.
#[derive(serde::Deserialize, schemars::JsonSchema)]
struct Lookup {
    /// The order's id, as `A-17`.
    order: String,
}

/// Asks an agent where order A-17 is; prints its tool calls and answer.
#[tokio::main]
pub async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // The service's own data.
    let orders: Arc<HashMap<&str, &str>> = Arc::new(HashMap::from([
        ("A-17", "shipped on 2 December"),
        ("B-2", "packed"),
    ]));
    let lookup = CustomTool::builder("lookup_order", "Looks an order up by its id.")
        .effects([Effect::Reads])
        .run(move |args: Lookup, _call| {
            let orders = orders.clone();
            async move {
                match orders.get(args.order.as_str()) {
                    Some(state) => Ok(format!("order {}: {state}", args.order)),
                    None => Err(format!("no order {}", args.order).into()),
                }
            }
        });
    let model = match (std::env::var("DSH_BASE_URL"), std::env::var("DSH_MODEL")) {
        (Ok(url), Ok(id)) => Model::openai_compatible(url, id),
        _ => Model::scripted(
            r#"{"steps": [
                {"tool_calls": [{"name": "lookup_order", "arguments": {"order": "A-17"}}]},
                {"text": "Order A-17 shipped on 2 December."}
            ]}"#,
        )?,
    };
    let dsh = Dsh::builder().model(model).start().await?;
    let agent = dsh
        .agent()
        .system("You answer questions about orders with the lookup_order tool.")
        .tools(["lookup_order"])
        .tool(lookup)
        .spawn()
        .await?;
    let answer = agent.run("Where is order A-17?").await?;
    for event in agent.agent().session().events() {
        if let dsh::services::session::EventData::ToolCall { call, .. } = &event.data {
            println!("tool call: {} {}", call.name, call.arguments);
        }
    }
    println!("answer: {}", answer.text);
    agent.dispose().await;
    dsh.shutdown().await?;
    Ok(())
}
