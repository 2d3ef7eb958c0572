//! Skills found on disk (the project's, the user's; shadowing, frontmatter,
//! names, hostile files), their catalog, and the `skill` tool loading them.

use std::path::Path;
use std::sync::Arc;

use dsh_services::sandbox::Policy;
use dsh_services::skills::{catalog, discover, valid_name};
use dsh_services::tools::builtin::SkillTool;
use dsh_services::tools::{Tool, ToolContext};
use dsh_supervisors::scratch::fresh_dir;
use dsh_supervisors::{Runtime, RuntimeSettings};
use serde_json::json;
use tokio_util::sync::CancellationToken;

fn write(path: &Path, text: &str) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, text).unwrap();
}

/// A project (with `.git`) and a home, holding skills of every kind.
fn layout() -> (std::path::PathBuf, std::path::PathBuf) {
    let base = fresh_dir("dsh-skills").unwrap().canonicalize().unwrap();
    let (repo, home) = (base.join("repo"), base.join("home"));
    std::fs::create_dir_all(repo.join(".git")).unwrap();
    write(
        &repo.join(".dsh/skills/deploy/SKILL.md"),
        "---\ndescription: Ship a release <safely> & quickly\n---\n# Deploy\n\nRun `scripts/ship.sh`, see `notes.md`.\n",
    );
    write(&repo.join(".dsh/skills/deploy/notes.md"), "resource");
    write(
        &repo.join(".agents/skills/review.md"),
        "# Review code\n\nRead the diff first.\n",
    );
    write(
        &repo.join(".agents/skills/secret-ritual.md"),
        "---\ndisable-model-invocation: true\ndescription: only for the user\n---\nbody\n",
    );
    write(&repo.join(".dsh/skills/Bad_Name.md"), "never listed");
    write(
        &home.join("skills/deploy/SKILL.md"),
        "---\ndescription: the user's older deploy\n---\nold\n",
    );
    write(
        &home.join("skills/greet.md"),
        "---\ndescription: say hello\n---\nSay hello.\n",
    );
    write(&base.join("private-key"), "PRIVATE KEY");
    std::os::unix::fs::symlink(
        base.join("private-key"),
        repo.join(".agents/skills/leak.md"),
    )
    .unwrap();
    (repo, home)
}

#[test]
fn skills_are_found_shadowed_and_listed() {
    let (repo, home) = layout();
    let found = discover(&repo, Some(&home));
    let names: Vec<(&str, &str)> = found.iter().map(|s| (s.name.as_str(), s.source)).collect();
    assert_eq!(
        names,
        [
            ("deploy", "project-dsh"),
            ("greet", "user-dsh"),
            ("review", "project-agents"),
            ("secret-ritual", "project-agents"),
        ]
    );
    assert_eq!(found[2].description, "Review code");
    let listed = catalog(&found).unwrap();
    assert!(
        listed.contains("- `deploy`: Ship a release &lt;safely&gt; &amp; quickly"),
        "{listed}"
    );
    assert!(
        listed.contains("- `greet`: say hello") && listed.contains("- `review`"),
        "{listed}"
    );
    assert!(
        !listed.contains("secret-ritual") && !listed.contains("older"),
        "{listed}"
    );
    assert!(
        !listed.contains("PRIVATE") && !listed.contains("leak"),
        "{listed}"
    );
    assert!(catalog(&[]).is_none());
    for (name, ok) in [
        ("deploy", true),
        ("a-1-b", true),
        ("Bad_Name", false),
        ("-x", false),
        ("a--b", false),
        ("", false),
    ] {
        assert_eq!(valid_name(name), ok, "{name}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_skill_tool_loads_instructions_and_refuses_the_rest() {
    let (repo, home) = layout();
    let rt = Runtime::start(RuntimeSettings::default()).await.unwrap();
    let tool = Arc::new(SkillTool::new(Some(home)));
    let call = |name: &str| {
        let cx = ToolContext {
            call_id: "s".into(),
            args: json!({ "name": name }),
            cancel: CancellationToken::new(),
            ctx: rt.root(),
            cwd: Arc::new(repo.clone()),
            policy: Policy::default(),
        };
        tool.clone().execute(cx)
    };
    let out = call("deploy").await.unwrap();
    let text = match &out.content[0] {
        dsh_services::llm::ContentBlock::Text { text } => text.clone(),
        other => panic!("{other:?}"),
    };
    assert!(
        text.starts_with("<skill_content name=\"deploy\">"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "relative to {}",
            repo.join(".dsh/skills/deploy").display()
        )),
        "{text}"
    );
    assert!(
        text.contains("<skill_instructions>\n# Deploy\n\nRun `scripts/ship.sh`"),
        "{text}"
    );
    for (name, code) in [
        ("secret-ritual", "NOT_MODEL_INVOCABLE"),
        ("nope", "UNKNOWN_SKILL"),
        ("leak", "UNKNOWN_SKILL"),
        ("../etc", "INVALID_ARGS"),
    ] {
        let e = call(name).await.unwrap_err();
        assert_eq!(e.code, code, "{name}: {e}");
    }
    rt.shutdown().await;
}
