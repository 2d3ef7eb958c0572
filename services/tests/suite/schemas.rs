//! The built-in tools' parameter schemas, generated from their argument
//! structs, are what the model has always been sent: the same properties,
//! types, descriptions and required fields as the schemas written by hand
//! before them; bash, write and edit also take the two escalation
//! parameters.

use dsh_services::tools::Tool;
use dsh_services::tools::builtin::{Bash, Glob, Grep, TodoWrite, file_tools};
use serde_json::{Value, json};

fn parameters(tool: &dyn Tool) -> Value {
    tool.schema().parameters
}

/// The two parameters of a call that may ask to run beyond the sandbox
/// (bash, write, edit), never required.
fn escalation() -> Value {
    json!({
        "sandbox_permissions": {
            "type": "string",
            "enum": ["workspace-write", "danger-full-access"],
            "description": "Run this one call under a wider permission mode than yours, once the user approves (give a `justification`): `workspace-write` to change the workspace from read-only, `danger-full-access` for anything outside it. Leave it out to run under your own mode."
        },
        "justification": {
            "type": "string",
            "description": "Why this call needs the wider mode, shown to the user who approves it (required with `sandbox_permissions`)."
        }
    })
}

#[test]
fn the_builtin_tools_send_the_schemas_they_always_did() {
    let (read, write, edit) = file_tools();
    let expected = [
        (
            parameters(&Bash),
            json!({
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The bash command to execute."},
                    "description": {"type": "string", "description": "What the command does, in 5-10 words."},
                    "timeoutMs": {"type": "number", "description": "Timeout in milliseconds (default 120000, at most 600000)."},
                    "workdir": {"type": "string", "description": "Working directory, relative to the workspace."},
                    "run_in_background": {"type": "boolean", "description": "Run in the background and return a job id at once (read its output with job_output, stop it with job_kill; no timeout applies)."},
                    "sandbox_permissions": escalation()["sandbox_permissions"],
                    "justification": escalation()["justification"]
                },
                "required": ["command", "description"]
            }),
        ),
        (
            parameters(&read),
            json!({
                "type": "object",
                "properties": {
                    "file_path": {"type": "string", "description": "Path to read, relative to the workspace."},
                    "offset": {"type": "number", "description": "1-based first line to return. Defaults to 1."},
                    "limit": {"type": "number", "description": "Maximum number of lines to return. Defaults to 2000."}
                },
                "required": ["file_path"]
            }),
        ),
        (
            parameters(&write),
            json!({
                "type": "object",
                "properties": {
                    "file_path": {"type": "string", "description": "Path to write, relative to the workspace."},
                    "content": {"type": "string", "description": "Full UTF-8 text content to write."},
                    "sandbox_permissions": escalation()["sandbox_permissions"],
                    "justification": escalation()["justification"]
                },
                "required": ["file_path", "content"]
            }),
        ),
        (
            parameters(&edit),
            json!({
                "type": "object",
                "properties": {
                    "file_path": {"type": "string", "description": "Path to edit, relative to the workspace."},
                    "old_string": {"type": "string", "description": "Literal text to replace. Must match exactly."},
                    "new_string": {"type": "string", "description": "Replacement text."},
                    "replace_all": {"type": "boolean", "description": "Replace every match (default: exactly one match required)."},
                    "sandbox_permissions": escalation()["sandbox_permissions"],
                    "justification": escalation()["justification"]
                },
                "required": ["file_path", "old_string", "new_string"]
            }),
        ),
        (
            parameters(&Glob),
            json!({
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "description": "Glob pattern."},
                    "path": {"type": "string", "description": "Directory to search; defaults to the workspace."}
                },
                "required": ["pattern"]
            }),
        ),
        (
            parameters(&Grep),
            json!({
                "type": "object",
                "properties": {
                    "pattern": {"type": "string", "description": "Regular expression."},
                    "path": {"type": "string", "description": "File or directory to search; defaults to the workspace."},
                    "include": {"type": "string", "description": "One glob filter for file names (e.g. \"*.rs\")."}
                },
                "required": ["pattern"]
            }),
        ),
        (
            parameters(&TodoWrite),
            json!({
                "type": "object",
                "properties": {
                    "todos": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {
                                "content": {"type": "string", "minLength": 1},
                                "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}
                            },
                            "required": ["content", "status"],
                            "additionalProperties": false
                        }
                    }
                },
                "required": ["todos"],
                "additionalProperties": false
            }),
        ),
    ];
    for (got, want) in expected {
        assert_eq!(
            got,
            want,
            "\n{}",
            serde_json::to_string_pretty(&got).unwrap()
        );
    }
}
