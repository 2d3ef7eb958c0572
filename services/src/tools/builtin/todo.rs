//! `todo_write`: the agent's whole task list, recorded as `todo/write`.

use std::sync::Arc;

use dsh_supervisors::error::chain;
use futures::FutureExt;
use futures::future::BoxFuture;

use crate::llm::ToolSchema;
use crate::session::{EventData, SESSION_SERVICE, SessionWriter, TodoItem, TodoStatus};
use crate::tools::{Tool, ToolContext, ToolError, ToolOutput, parameters};

/// The `todo_write` tool.
pub struct TodoWrite;

// What a `todo_write` call takes: the whole list. (Plain comments, not doc
// comments: the model has always been sent these fields undescribed, and a
// doc comment would become a description in the schema.)
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct TodoArgs {
    // The entire task list; it replaces the previous one.
    todos: Vec<Todo>,
}

// One task.
#[derive(Debug, serde::Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct Todo {
    // The task, in one line.
    #[schemars(length(min = 1))]
    content: String,
    // `pending`, `in_progress` or `completed`.
    #[schemars(schema_with = "status_schema")]
    status: TodoStatus,
}

fn status_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({"type": "string", "enum": ["pending", "in_progress", "completed"]})
}

impl Tool for TodoWrite {
    fn schema(&self) -> ToolSchema {
        ToolSchema {
            name: "todo_write".into(),
            description: "Record and update your task list for this session. Send the ENTIRE list every call: it replaces the previous one. Each item has `content` (what to do, in the imperative) and a `status`: `pending`, `in_progress` (what you work on now; several only when work really runs in parallel) or `completed` (done, as soon as it is). The list is shown to the user as your plan.".into(),
            parameters: parameters::<TodoArgs>(),
        }
    }

    fn guidance(&self) -> Option<&'static str> {
        Some(
            "Keep a plan with `todo_write` for work of three or more steps: write it before you start, keep one item in progress, and mark each completed as soon as it is, not in a batch at the end. Skip it for a single quick change.",
        )
    }

    fn execute(
        self: Arc<Self>,
        cx: ToolContext,
    ) -> BoxFuture<'static, Result<ToolOutput, ToolError>> {
        async move {
            let args: TodoArgs = cx.parse()?;
            let todos: Vec<TodoItem> = args
                .todos
                .into_iter()
                .map(|t| TodoItem {
                    content: t.content,
                    status: t.status,
                })
                .collect();
            let session = cx
                .ctx
                .get::<dyn SessionWriter>(SESSION_SERVICE)
                .ok_or_else(|| ToolError::failed("todo_write needs an agent session"))?;
            session
                .append_log_only(EventData::TodoWrite {
                    todos: todos.clone(),
                })
                .map_err(|e| ToolError::failed(chain(&e).to_string()))?;
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
