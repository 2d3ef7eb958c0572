//! The multi-agent tools' parameter schemas, generated from their argument
//! structs, keep the properties, types and required fields the model was
//! always sent.

use std::sync::Arc;

use dsh_actors::ralph::tool::RalphTool;
use dsh_actors::subagent::Subagents;
use dsh_actors::subagent::tools::{
    InterruptAgent, ListAgents, SendMessage, SubagentTool, SubagentToolConfig,
};
use dsh_actors::workflow::tool::WorkflowTool;
use dsh_actors::workflow::{WorkflowEngine, WorkflowLimits};
use dsh_services::tools::Tool;
use serde_json::{Value, json};

fn parameters(tool: &dyn Tool) -> Value {
    tool.schema().parameters
}

fn same(got: Value, want: Value) {
    assert_eq!(
        got,
        want,
        "\n{}",
        serde_json::to_string_pretty(&got).unwrap()
    );
}

#[test]
fn the_multi_agent_tools_send_the_schemas_they_always_did() {
    let subagents = Arc::new(Subagents::with_builtin());
    let background = SubagentToolConfig::new("spawn", "subagent");
    let mut foreground = SubagentToolConfig::new("fork", "subagent_fork");
    foreground.background = false;
    let spawn = SubagentTool::new(subagents.clone(), background).unwrap();
    let fork = SubagentTool::new(subagents.clone(), foreground).unwrap();
    let task = json!({
        "description": {
            "type": "string",
            "description": "A short (3-5 word) description of the delegated task, for display."
        },
        "prompt": {"type": "string", "description": "The complete task for the subagent."},
        "agent": {
            "type": "string",
            "description": "A named agent to run the task (one of the \"Named agents\" your \
                            instructions list, when they list any): its instructions, model and \
                            tools."
        }
    });
    let mut with_background = task.clone();
    with_background["run_in_background"] = json!({
        "type": "boolean",
        "description": "Start a continuable subagent and return its id at once; you are told \
                        when it finishes and can send it more work with send_message. \
                        Defaults to false (wait for the result)."
    });
    same(
        parameters(&spawn),
        json!({"type": "object", "properties": with_background, "required": ["description", "prompt"]}),
    );
    same(
        parameters(&fork),
        json!({"type": "object", "properties": task, "required": ["description", "prompt"]}),
    );
    same(
        parameters(&SendMessage(subagents.clone())),
        json!({
            "type": "object",
            "properties": {
                "subagent_id": {"type": "string", "description": "The subagent id."},
                "message": {"type": "string", "description": "The message to deliver."}
            },
            "required": ["subagent_id", "message"]
        }),
    );
    same(
        parameters(&InterruptAgent(subagents.clone())),
        json!({
            "type": "object",
            "properties": {
                "agent_id": {"type": "string", "description": "The agent id to interrupt."}
            },
            "required": ["agent_id"]
        }),
    );
    same(
        parameters(&ListAgents(subagents.clone())),
        json!({"type": "object", "properties": {"scope": {
            "type": "string",
            "enum": ["children", "descendants"],
            "description": "`children` (the default) lists your direct children; `descendants` walks the whole tree below you."
        }}}),
    );
    let engine = WorkflowEngine::new(subagents.clone(), "spawn", WorkflowLimits::default());
    same(
        parameters(&WorkflowTool(Arc::new(engine))),
        json!({
            "type": "object",
            "properties": {
                "script": {"type": "string", "description": "The script body."},
                "meta": {
                    "type": "object",
                    "description": "{name: kebab-case, description, whenToUse?, phases?: [{title, detail?}]}",
                    "properties": {
                        "name": {"type": "string"},
                        "description": {"type": "string"}
                    },
                    "required": ["name", "description"]
                },
                "args": {"description": "Input exposed to the script as `args`."}
            },
            "required": ["script", "meta"]
        }),
    );
    same(
        parameters(&RalphTool::new(subagents)),
        json!({
            "type": "object",
            "properties": {
                "objective": {"type": "string", "minLength": 1},
                "maxRounds": {"type": "integer", "minimum": 1, "maximum": 256}
            },
            "required": ["objective"]
        }),
    );
}
