//! `dsh replay <session.jsonl>`: re-run a recorded session and compare.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use dsh_actors::agent::{Agent, AgentSpec, Agents};
use dsh_services::approval::{Approval, ApprovalPolicy};
use dsh_services::llm::LlmRuntime;
use dsh_services::llm::replay::ReplayModel;
use dsh_services::session::compare::{compare, prompts, shape};
use dsh_services::session::jsonl;
use dsh_services::tools::ToolRegistry;
use dsh_services::tools::builtin::register_builtin;
use dsh_supervisors::{Runtime, RuntimeSettings};

use crate::run::RunExit;

/// Options of `dsh replay`.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// The recorded log.
    pub log: PathBuf,
    /// Workspace the tools run in.
    pub cwd: PathBuf,
    /// Where to write the new session log.
    pub out: Option<PathBuf>,
    /// Print the comparison as JSON.
    pub json: bool,
}

/// Replays `opts.log`; exit 0 when the runs agree, 1 with the first divergence.
pub async fn replay(opts: ReplayOptions) -> RunExit {
    let text = match std::fs::read_to_string(&opts.log) {
        Ok(t) => t,
        Err(e) => return fail(2, format!("cannot read {}: {e}", opts.log.display())),
    };
    let (_header, events) = match jsonl::parse(&text) {
        Ok(v) => v,
        Err(e) => return fail(2, format!("{}: {e}", opts.log.display())),
    };
    let recorded = shape(&events);
    let inputs = prompts(&events);
    if inputs.is_empty() {
        return fail(
            2,
            format!(
                "{}: the recording has no user prompt to replay",
                opts.log.display()
            ),
        );
    }
    let model = Arc::new(ReplayModel::from_events(&events));
    let cwd = match opts.cwd.canonicalize() {
        Ok(c) => c,
        Err(e) => {
            return fail(
                2,
                format!(
                    "the workspace {} is not accessible: {e}",
                    opts.cwd.display()
                ),
            );
        }
    };
    let rt = match Runtime::start(RuntimeSettings::default()).await {
        Ok(rt) => rt,
        Err(e) => return fail(1, format!("cannot start the runtime: {e}")),
    };
    let outcome = drive(&rt, model, cwd, opts.out.clone(), &inputs).await;
    let _ = tokio::time::timeout(Duration::from_secs(60), rt.shutdown()).await;
    let replayed = match outcome {
        Ok(events) => events,
        Err(e) => return fail(1, e),
    };
    let verdict = compare(&recorded, &shape(&replayed));
    if opts.json {
        let v = match &verdict {
            Ok(turns) => serde_json::json!({"agree": true, "turns": turns}),
            Err(d) => serde_json::json!({"agree": false, "divergence": d}),
        };
        println!("{v}");
    }
    match verdict {
        Ok(turns) => {
            if !opts.json {
                println!(
                    "replay agrees with the recording: {turns} turns, {} model steps",
                    model_steps(&recorded)
                );
            }
            RunExit {
                code: 0,
                message: None,
            }
        }
        Err(d) => fail(1, format!("first divergence: {d}")),
    }
}

fn model_steps(shapes: &[dsh_services::session::compare::TurnShape]) -> u32 {
    shapes.iter().map(|t| t.steps).sum()
}

fn fail(code: u8, message: String) -> RunExit {
    RunExit {
        code,
        message: Some(message),
    }
}

async fn drive(
    rt: &Runtime,
    model: Arc<ReplayModel>,
    cwd: PathBuf,
    out: Option<PathBuf>,
    inputs: &[String],
) -> Result<Vec<Arc<dsh_services::session::SessionEvent>>, String> {
    let root = rt.root();
    let llm = Arc::new(LlmRuntime::new());
    let tools = Arc::new(ToolRegistry::new());
    root.provide(LlmRuntime::SERVICE, llm.clone())
        .map_err(|e| e.to_string())?;
    root.provide(ToolRegistry::SERVICE, tools.clone())
        .map_err(|e| e.to_string())?;
    root.provide(
        Approval::SERVICE,
        Arc::new(Approval::new(ApprovalPolicy::Never)),
    )
    .map_err(|e| e.to_string())?;
    root.provide(Agents::SERVICE, Arc::new(Agents::default()))
        .map_err(|e| e.to_string())?;
    register_builtin(&root, &tools)?;
    llm.register(&root, &["replay"], model)?;
    let mut spec = AgentSpec::new("replay", "recorded", cwd);
    spec.store = out.map(|p| {
        Arc::new(dsh_services::persistence::JsonlStore::file(p))
            as Arc<dyn dsh_services::persistence::SessionPersistence>
    });
    let agent = Agent::create(&root, spec)
        .await
        .map_err(|e| e.to_string())?;
    for prompt in inputs {
        agent
            .run(prompt, Duration::from_secs(600))
            .await
            .map_err(|e| e.to_string())?;
    }
    agent.session().flush().await?;
    Ok(agent.session().events())
}
