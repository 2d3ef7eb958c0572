//! `todo_write`: the agent's whole task list, recorded as `todo/write`.

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::json;

use crate::llm::ToolSchema;
use crate::session::{EventData, SESSION_SERVICE, SessionWriter, TodoItem, TodoStatus};
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput};

/// The `todo_write` tool.
pub struct TodoWrite;

impl Tool for TodoWrite {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "todo_write".into(),
            description: "Record and update a structured task list. Send the ENTIRE list every call; it replaces the previous one. Mark work being done now `in_progress` (several when work runs in parallel) and finished work `completed` as soon as it is done.".into(),
            parameters: json!({
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
        }
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let todos: Vec<TodoItem> = serde_json::from_value(cx.args["todos"].clone())
                .map_err(|e| ToolError::new("INVALID_ARGS", e.to_string()))?;
            let session = cx
                .ctx
                .get::<dyn SessionWriter>(SESSION_SERVICE)
                .ok_or_else(|| ToolError::failed("todo_write needs an agent session"))?;
            session
                .append_log_only(EventData::TodoWrite {
                    todos: todos.clone(),
                })
                .map_err(|e| ToolError::failed(e.to_string()))?;
            let mut text = String::from("Todo list updated:\n");
            for t in &todos {
                let mark = match t.status {
                    TodoStatus::Pending => "[ ]",
                    TodoStatus::InProgress => "[~]",
                    TodoStatus::Completed => "[x]",
                };
                text.push_str(&format!("{mark} {}\n", t.content));
            }
            Ok(ToolOutput::text(text))
        }
        .boxed()
    }
}
